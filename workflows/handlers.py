"""Finding a function's handler from its `module:function` reference.

A handler module is imported by its dotted name. The folder of the workflow's YAML file is put on
`sys.path` first (and left there: function instances import the same modules later), so a workflow may
keep its handlers in a module beside its YAML file.
"""

from __future__ import annotations

import importlib
import inspect
import sys
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

from streambox.sdk import Context

Handler = Callable[[Context, dict], Any]  # every runtime's ctx satisfies `streambox.Context`


class HandlerError(ValueError):
    """A handler reference that does not resolve to a usable handler; the message says why."""


def _add_base_dir(base_dir: Path | None) -> None:
    if base_dir is not None:
        entry = str(Path(base_dir).resolve())
        if entry not in sys.path:
            sys.path.insert(0, entry)


def resolve_handler(ref: str, base_dir: Path | None = None) -> Handler:
    """Import `module:function` and return the function, checking it accepts `(ctx, event)`."""
    module_name, sep, attr = ref.partition(":")
    if not sep or not module_name or not attr:
        raise HandlerError(f"handler {ref!r} is not of the form module:function")
    module = import_handler_module(module_name, base_dir)
    if not hasattr(module, attr):
        raise missing_attribute(module_name, attr, module_functions(module))
    return check_handler(ref, getattr(module, attr))


def import_handler_module(module_name: str, base_dir: Path | None = None) -> ModuleType:
    """The module, imported with the workflow's folder on `sys.path`; `HandlerError` says why not."""
    _add_base_dir(base_dir)
    try:
        return importlib.import_module(module_name)
    except ImportError as error:
        raise HandlerError(f"cannot import module {module_name!r}: {error}") from error
    except Exception as error:  # the module itself is broken: say how
        raise HandlerError(
            f"importing module {module_name!r} raised {type(error).__name__}: {error}"
        ) from error


def module_functions(module: ModuleType) -> list[str]:
    """The public functions defined in `module` (for error messages)."""
    return sorted(
        n
        for n, v in vars(module).items()
        if inspect.isfunction(v) and v.__module__ == module.__name__ and not n.startswith("_")
    )


def missing_attribute(module_name: str, attr: str, functions: list[str]) -> HandlerError:
    return HandlerError(
        f"module {module_name!r} has no attribute {attr!r}; its functions: {', '.join(functions) or '-'}"
    )


def check_handler(ref: str, handler: Any) -> Handler:
    """`handler` if it is callable with `(ctx, event)`, else `HandlerError`."""
    if not callable(handler):
        raise HandlerError(f"{ref!r} is not a function but a value of type {type(handler).__name__}")
    if inspect.iscoroutinefunction(handler) or inspect.isasyncgenfunction(handler):
        raise HandlerError(
            f"handler {ref!r} is an async function: handlers are plain functions (def), run on their "
            "instance's thread; ctx.infer, ctx.put and ctx.get are called directly, without await"
        )
    try:
        inspect.signature(handler).bind(None, {})
    except TypeError:
        raise HandlerError(f"handler {ref!r} must accept (ctx, event)") from None
    except ValueError:
        pass  # no signature to inspect (a builtin): trust it
    return handler


def declared_models(handler: Handler) -> list[str] | None:
    """The models a handler declares with `@streambox.function(models=[...])`; None when it names
    none (not decorated, or decorated without models)."""
    meta = getattr(handler, "__streambox__", None)
    models = getattr(meta, "models", None)
    return list(models) if models else None
