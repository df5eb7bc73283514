"""Every message a function process sends, decoded and checked in one place before anything acts on it.

A function process is not trusted: its frame may be garbage, a map, an array of the wrong length or
with fields of the wrong type, an unknown op, or a known op with the wrong number of arguments.
`decode` turns a frame into one of three typed messages or raises `ProtocolViolation` saying what is
wrong; the proxy then ends that instance alone (its requests fail, its streams, buffers and leases are
reclaimed) and goes on serving the others. Nothing past `decode` re-checks the shape of a message:
argument *values* (a handle, a dtype, a shape) are checked by the op that uses them, and a bad value
fails that call only.

Torch-free (the fuzz tests import it without a device).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from . import wire
from .errors import ProxyError

#: The forwarded ops and how many arguments each takes (the client's `Context` sends exactly these).
OP_ARITY: dict[str, int] = {
    "noop": 0,
    "upload": 1,
    "download": 1,
    "infer": 2,
    "put": 4,
    "get": 2,
    "delete": 1,
    "alloc": 2,
    "free": 1,
    "memcpy": 3,
    "launch": 3,
    "synchronize": 0,
    "plan": 1,
}

_LENGTHS = {wire.CALL: 4, wire.RESULT: 4, wire.HELLO: 3}


class ProtocolViolation(ProxyError):
    """A message from a function process that is not one the protocol allows."""


@dataclass(frozen=True, slots=True)
class Call:
    call_id: int
    op: str
    args: list[Any]


@dataclass(frozen=True, slots=True)
class Result:
    invocation_id: int
    ok: bool
    value: Any  # the output (JSON-able), or the handler's error as [type, message, traceback]


@dataclass(frozen=True, slots=True)
class Hello:
    instance_id: int
    pid: int


Message = Call | Result | Hello


def _int(value: Any, what: str) -> int:
    if type(value) is not int or value < 0:
        raise ProtocolViolation(f"{what} must be a non-negative int, got {value!r:.80}")
    return value


def _call(message: list[Any]) -> Call:
    _, call_id, op, args = message
    if not isinstance(op, str) or op not in OP_ARITY:
        raise ProtocolViolation(f"unknown call {op!r:.80}; calls: {', '.join(sorted(OP_ARITY))}")
    if not isinstance(args, list):
        raise ProtocolViolation(f"call {op!r}: arguments must be an array, got {type(args).__name__}")
    if len(args) != OP_ARITY[op]:
        raise ProtocolViolation(f"call {op!r} takes {OP_ARITY[op]} argument(s), got {len(args)}")
    return Call(_int(call_id, "a call id"), op, args)


def _result(message: list[Any]) -> Result:
    _, inv_id, ok, value = message
    if not isinstance(ok, bool):
        raise ProtocolViolation(f"a result's ok flag must be a bool, got {ok!r:.80}")
    if not ok and not (isinstance(value, list) and all(isinstance(v, str) for v in value)):
        raise ProtocolViolation(f"a failed result carries [type, message, traceback], got {value!r:.80}")
    return Result(_int(inv_id, "an invocation id"), ok, value)


def _hello(message: list[Any]) -> Hello:
    _, iid, pid = message
    return Hello(_int(iid, "an instance id"), _int(pid, "a pid"))


_DECODERS = {wire.CALL: _call, wire.RESULT: _result, wire.HELLO: _hello}


def decode(data: bytes | memoryview) -> Message:
    """The typed message in a frame from a function process, or `ProtocolViolation`."""
    try:
        message = wire.unpack(data)
    except Exception as exc:  # noqa: BLE001 - msgpack raises several types for garbage
        raise ProtocolViolation(f"undecodable frame ({type(exc).__name__}: {exc})") from None
    if not isinstance(message, list) or not message:
        raise ProtocolViolation(f"a message is a non-empty array, got {message!r:.80}")
    kind = message[0]
    decoder = _DECODERS.get(kind) if type(kind) is int else None
    if decoder is None:
        raise ProtocolViolation(f"a function may send CALL, RESULT or HELLO, not {kind!r:.40}")
    if len(message) != _LENGTHS[kind]:
        raise ProtocolViolation(
            f"a {wire.KINDS[kind]} message has {_LENGTHS[kind]} fields, got {len(message)}"
        )
    return decoder(message)
