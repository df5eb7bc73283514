"""Messages of the forwarding channel: msgpack arrays, never pickles.

Function -> proxy:
    [CALL, call_id, op, args]              a forwarded call; every call gets one REPLY
    [RESULT, invocation_id, ok, value]     the handler's JSON-able output, or [type, message]
    [HELLO, instance_id, pid]              registration of a new instance
Proxy -> function:
    [REPLY, call_id, ok, value]            value, or [type, message] (see `errors.encode_error`)
    [INVOKE, invocation_id, request_id, event]
    [STOP]                                 the instance exits (keep-alive expiry, scale to zero)

Handles travel as 6-arrays (`handles.Handle`), tensor bytes as msgpack bin.
"""

from __future__ import annotations

import threading
from typing import Any

import msgpack

CALL = 1
REPLY = 2
INVOKE = 3
RESULT = 4
HELLO = 5
STOP = 6

KINDS = {CALL: "CALL", REPLY: "REPLY", INVOKE: "INVOKE", RESULT: "RESULT", HELLO: "HELLO", STOP: "STOP"}

#: After a failed RESULT's [type, message, traceback]: the instance asks to be stopped once the
#: invocation is finished (it ran out of its host memory: a leak would fail every later request).
RETIRE = "retire"


_local = threading.local()


MAX_JSON_DEPTH = 64  # nesting of an event's (or a handler output's) objects and lists
#: Objects and lists in one event (or output) at most: each costs the parser ~50 bytes for 2 of the
#: text, so a body of empty lists would take ~25x its size (counted on the text: brackets in strings too).
MAX_JSON_CONTAINERS = 1_000_000


def json_depth(value: Any) -> int:
    """How deeply objects and lists nest in `value` (a scalar: 0), without recursion."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        item, depth = stack.pop()
        children = item.values() if isinstance(item, dict) else item if isinstance(item, list) else None
        if children is None:
            continue
        deepest = max(deepest, depth)
        stack.extend((child, depth + 1) for child in children)
    return deepest


def carries_int(value: int) -> bool:
    """Whether msgpack carries `value`: integers of 64 bits, signed or unsigned."""
    return -(2**63) <= value < 2**64


def pack(message: Any) -> bytes:
    packer = getattr(_local, "packer", None)
    if packer is None:
        packer = _local.packer = msgpack.Packer(use_bin_type=True)
    return packer.pack(message)


def unpack(data: bytes | memoryview) -> Any:
    """One message. Maps may have non-string keys; no extension types are accepted."""
    return msgpack.unpackb(data, raw=False, strict_map_key=False)


def message_kind(message: Any) -> int:
    if not isinstance(message, list) or not message or message[0] not in KINDS:
        raise ValueError(f"malformed channel message: {message!r:.120}")
    return message[0]
