"""The function SDK: `@streambox.function(models=[...])` on `def handler(ctx, event)`.

A handler receives a `ctx` and the event (a JSON-able value) and returns a JSON-able value. `ctx`
satisfies `Context` (below), one protocol with one set of semantics and timeouts wherever the handler
runs: behind the API proxy (`api_proxy.client.ProxyContext`: its own process, forked from the
workflow's warm template, every GPU call forwarded to the proxy and run on the instance's stream; it
adds the low-level `alloc`, `free`, `memcpy`, `launch`, `plan`), run-local
(`workflows.local.LocalContext`) or in a monolithic instance (`workflows.monolithic_instance`).
Handlers type against `streambox.Context`.

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
from typing import TYPE_CHECKING, Any, Protocol, TypeVar, runtime_checkable

from streambox.api_proxy.handles import Handle

if TYPE_CHECKING:
    from streambox.api_proxy.client import Future

F = TypeVar("F", bound=Callable[..., Any])

#: How long `ctx.get` waits for its key's PUT unless told otherwise, in every runtime.
GET_TIMEOUT_S = 10.0


class InvalidInput(ValueError):
    """Raise it from a handler when the event, the caller's input, is wrong (an image that does not
    decode, a field of the wrong type): the gateway answers 400 with its message, not 500 (which
    says the function failed). It fails the request as any error does; only the HTTP status and
    `RequestResult.error_type` tell it apart. A subclass counts as this class (`error_type_of`): its
    own name is in the traceback the caller gets."""


def error_type_of(error: BaseException) -> str:
    """The `error_type` a handler's failure is reported under, wherever it ran: its class's name, but
    `InvalidInput` for any subclass of it, since that name is what tells the gateway (in another
    process) that the caller's input was wrong."""
    return InvalidInput.__name__ if isinstance(error, InvalidInput) else type(error).__name__


def error_message_of(error: BaseException) -> str:
    """`str(error)`, or a note saying it failed: a handler's exception class may raise in `__str__`,
    and its failure must still be reported."""
    try:
        return str(error)
    except Exception as unprintable:  # noqa: BLE001 - whatever it raised, the failure is reported
        return f"(its str() raised {type(unprintable).__name__})"


@runtime_checkable
class Context(Protocol):
    """A handler's `ctx`, wherever it runs (the same calls, semantics and GET timeout).

    Handles are `streambox.Handle`s (device-tensor references the runtime checks) in every runtime;
    keys made with `key(name)` are scoped to the request and dropped when it ends. `put` hands the tensor over
    without a copy (the store owns it afterwards); `get` waits up to `timeout` seconds for the key's
    PUT, and later work of this invocation waits for the producer's; `synchronize` waits for this
    invocation's own work only (never the whole device). A GET that times out raises a
    `TimeoutError` in every runtime (the proxy's `KeyNotFound`, run-local's `GetTimeout`).
    """

    workflow: str
    function: str
    request_id: str

    def key(self, name: str) -> str: ...

    def upload(self, tensor: Any) -> Any: ...

    def download(self, handle: Any) -> Any: ...

    def infer(self, model: str, inputs: Any) -> list[Any]: ...

    def put(self, key: str, handle: Any, consumers: int | None = None, ttl: float | None = None) -> Any: ...

    def get(self, key: str, timeout: float = GET_TIMEOUT_S) -> Any: ...

    def delete(self, key: str) -> Any: ...

    def synchronize(self) -> None: ...


def __getattr__(name: str) -> Any:
    if name == "Future":  # the proxy client's futures (imported on use: it imports this module)
        from streambox.api_proxy.client import Future

        return Future
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

__all__ = ["GET_TIMEOUT_S", "Context", "Future", "FunctionMeta", "Handle", "function", "meta_of"]


@dataclass(frozen=True)
class FunctionMeta:
    """What `@streambox.function` records on a handler (`handler.__streambox__`)."""

    models: list[str] = field(default_factory=list)


#: Options the decorator once took and never applied: each is the workflow's to set, in its YAML.
_SET_IN_YAML = {
    "name": "the function's key under `functions:`",
    "batch": "max_batch_size",
    "max_instances": "max_instances",
    "timeout_s": "timeout_ms",
}


def function(fn: F | None = None, *, models: Sequence[str] = (), **options: object) -> Any:
    """Mark `fn(ctx, event)` as a StreamBox function that may run `models` (names of the model pool).

    Usable bare (`@streambox.function`) or with `models=[...]`. The handler is returned unchanged
    apart from its `__streambox__` attribute, so it stays callable (and testable) as a plain function.
    How a function runs (instances, timeout, batching) is the workflow's, set in its YAML.
    """
    if isinstance(models, str):
        raise TypeError(f"models must be a list of model names, got the string {models!r}")
    odd = [m for m in models if not isinstance(m, str)]
    if odd:
        raise TypeError(f"models must be a list of model names (strings), got {odd[0]!r} in {list(models)!r}")
    for option in options:
        where = _SET_IN_YAML.get(option)
        hint = f"set it in the workflow's YAML ({where})" if where else "it takes only models=[...]"
        raise TypeError(f"@streambox.function got {option}=...: {hint}")

    def mark(handler: F) -> F:
        if not callable(handler):
            raise TypeError(f"@streambox.function needs a callable, got {type(handler).__name__}")
        handler.__streambox__ = FunctionMeta(models=list(models))  # type: ignore[attr-defined]
        return handler

    return mark(fn) if fn is not None else mark


def meta_of(handler: Callable[..., Any]) -> FunctionMeta | None:
    """The `FunctionMeta` of a decorated handler (None if it was not decorated)."""
    meta = getattr(handler, "__streambox__", None)
    return meta if isinstance(meta, FunctionMeta) else None
