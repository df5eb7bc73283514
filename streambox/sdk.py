"""The function SDK: `@streambox.function(models=[...])` on `def handler(ctx, event)`.

A handler receives a `ctx` (`streambox.api_proxy.client.Context`) and the event (a JSON-able value)
and returns a JSON-able value. It runs in its own process, forked from the workflow's warm
template, which never creates a device context: every GPU call (`ctx.infer`, `ctx.put`,
`ctx.get`, `ctx.upload`, `ctx.download`, and the low-level `alloc`, `free`, `memcpy`, `launch`,
`synchronize`) is forwarded to the workflow's API proxy and runs on the instance's own stream.

    import streambox

    @streambox.function(models=["resnet18"])
    def classify(ctx, event):
        image = ctx.get(event["key"])            # a device-tensor handle, zero-copy
        (logits,) = ctx.infer("resnet18", image)
        ctx.put(ctx.key("logits"), logits)        # request-scoped key for the next function
        return {"top1": int(ctx.download(logits).argmax())}

Importing this module imports neither torch nor the device layer.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

from streambox.api_proxy.client import Context, Future
from streambox.api_proxy.handles import Handle

F = TypeVar("F", bound=Callable[..., Any])

__all__ = ["Context", "Future", "FunctionMeta", "Handle", "function", "meta_of"]


@dataclass(frozen=True)
class FunctionMeta:
    """What `@streambox.function` records on a handler (`handler.__streambox__`)."""

    models: list[str] = field(default_factory=list)
    name: str | None = None  # default: the handler's __name__
    batch: int | None = None  # default: the workflow spec's
    max_instances: int | None = None
    timeout_s: float | None = None


def function(
    fn: F | None = None,
    *,
    models: Sequence[str] = (),
    name: str | None = None,
    batch: int | None = None,
    max_instances: int | None = None,
    timeout_s: float | None = None,
) -> Any:
    """Mark `fn(ctx, event)` as a StreamBox function that may run `models`.

    Usable bare (`@streambox.function`) or with options. The handler is returned unchanged apart
    from its `__streambox__` attribute, so it stays callable (and testable) as a plain function.
    """
    if isinstance(models, str):
        raise TypeError(f"models must be a list of model names, got the string {models!r}")

    def mark(handler: F) -> F:
        if not callable(handler):
            raise TypeError(f"@streambox.function needs a callable, got {type(handler).__name__}")
        handler.__streambox__ = FunctionMeta(  # type: ignore[attr-defined]
            models=list(models), name=name, batch=batch, max_instances=max_instances, timeout_s=timeout_s
        )
        return handler

    return mark(fn) if fn is not None else mark


def meta_of(handler: Callable[..., Any]) -> FunctionMeta | None:
    """The `FunctionMeta` of a decorated handler (None if it was not decorated)."""
    meta = getattr(handler, "__streambox__", None)
    return meta if isinstance(meta, FunctionMeta) else None
