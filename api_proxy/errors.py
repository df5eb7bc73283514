"""Errors of the API proxy, and how they cross the forwarding channel.

An error travels as `[type name, message, fields]` and is rebuilt from the classes registered here
(unknown names become `CallFailed`): nothing a function sends is ever unpickled, and no class is looked
up by an arbitrary name. `fields` (a JSON-able map, `exc.fields` on both sides) carries the error's
details structured -- a handler's failure has `error_type`, `message`, `traceback`, `function`,
`request_id` -- so no receiver parses the message text back. Torch-free: function processes import this.
"""

from __future__ import annotations

from typing import Any, TypeVar

E = TypeVar("E", bound=BaseException)


class ProxyError(RuntimeError):
    """Base class of every error the API proxy reports."""

    fields: dict[str, Any] = {}  # noqa: RUF012 - read-only default; `with_fields` sets an instance's own


def with_fields(exc: E, **fields: Any) -> E:
    """`exc` carrying `fields` (JSON-able details) across process boundaries."""
    exc.fields = dict(fields)  # type: ignore[attr-defined]
    return exc


class IsolationError(ProxyError, PermissionError):
    """A handle or key of another workflow reached this workflow's proxy (or a forged handle)."""


class UnknownHandle(ProxyError, LookupError):
    """A handle that names no live buffer of this proxy (freed, or never allocated here)."""


class KeyNotFound(ProxyError, LookupError, TimeoutError):
    """A GET found no value under the key before its timeout; the message names the key. A
    `TimeoutError`, as run-local's `comm.errors.GetTimeout` is: handlers catch one type everywhere."""


class KeyExists(ProxyError, LookupError):
    """A PUT under a key that already holds a value."""


class UnknownModel(ProxyError, LookupError):
    """A model the function did not declare, or that the proxy cannot load."""


class UnknownFunction(ProxyError, LookupError):
    """An invocation of a function the workflow's proxy does not serve."""


class FunctionFailed(ProxyError):
    """The handler raised: the message carries its exception type, message and traceback."""


class FunctionCrashed(ProxyError):
    """The function's process died during the invocation (os._exit, a signal, ...)."""


class FunctionTimeout(ProxyError, TimeoutError):
    """The invocation ran past its timeout; the proxy killed the instance."""


class FunctionCancelled(ProxyError):
    """The invocation's request ended without it (a sibling failed, the client went away): the proxy
    stopped it, killing its instance as a timeout would, or took it out of the queue."""


class ChannelClosed(ProxyError, ConnectionError):
    """The other end of a forwarding channel is gone."""


class CallFailed(ProxyError):
    """A forwarded call failed on the proxy with an error that has no class of its own here."""


class DeviceFailed(ProxyError):
    """The device reported an error for this request's work (a failing kernel, out of memory, a use
    after free); the message starts with the device error's type."""


class QuotaExceeded(ProxyError, MemoryError):
    """An invocation asked for device memory beyond its bound (`invocation_device_bytes`), or the
    store refused a PUT over one of its bounds: nothing was taken."""


_REGISTRY: dict[str, type[BaseException]] = {
    cls.__name__: cls
    for cls in (
        ProxyError,
        IsolationError,
        UnknownHandle,
        KeyNotFound,
        KeyExists,
        UnknownModel,
        UnknownFunction,
        FunctionFailed,
        FunctionCrashed,
        FunctionTimeout,
        FunctionCancelled,
        ChannelClosed,
        CallFailed,
        DeviceFailed,
        QuotaExceeded,
    )
}
# Errors of other components, rebuilt as the closest class here (the message keeps the original type).
_ALIASES: dict[str, type[BaseException]] = {
    "GetTimeout": KeyNotFound,
    "CommError": ProxyError,
    "KernelError": DeviceFailed,
    "DeviceError": DeviceFailed,
    "InvalidAddress": DeviceFailed,
    "OutOfDeviceMemory": DeviceFailed,
    "PoolOutOfMemory": DeviceFailed,
    "UnknownModelError": UnknownModel,
}
# Builtins a call may fail with, rebuilt as themselves.
_BUILTINS: dict[str, type[BaseException]] = {
    cls.__name__: cls for cls in (ValueError, TypeError, KeyError, TimeoutError, MemoryError)
}


def encode_error(exc: BaseException) -> list[Any]:
    """`[type name, message, fields]` for the wire. Device errors keep their name (e.g. `KernelError`)."""
    message = str(exc.args[0]) if isinstance(exc, KeyError) and exc.args else str(exc)
    notes = getattr(exc, "__notes__", None)
    if notes:
        message = "\n".join([message, *notes])
    return [type(exc).__name__, message, dict(getattr(exc, "fields", None) or {})]


def decode_error(obj: Any) -> BaseException:
    """The exception for a wire error; unknown type names become `CallFailed` naming the type."""
    try:
        name, message = str(obj[0]), str(obj[1])
    except (TypeError, IndexError, KeyError):
        return CallFailed(f"malformed error from the proxy: {obj!r:.200}")
    fields = obj[2] if len(obj) > 2 and isinstance(obj[2], dict) else {}
    cls = _REGISTRY.get(name) or _BUILTINS.get(name)
    if cls is not None:
        return with_fields(cls(message), **fields)
    alias = _ALIASES.get(name)
    if alias is not None:
        return with_fields(alias(f"{name}: {message}"), **fields)
    return with_fields(CallFailed(f"{name}: {message}"), **fields)
