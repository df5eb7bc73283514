"""Device-tensor handles as function processes see them, and the rules for keys.

A `Handle` names a buffer in the device memory of one workflow's proxy: the workflow, the device
address, the dtype, shape, strides (in elements) and size in bytes. It is a plain named tuple, so
msgpack packs it as an array and it travels through the forwarding channel unchanged. Function
processes never dereference it; the proxy checks every handle it receives against its own table of
live buffers. It does not leave its invocation in an output (`handle_in_json`): its memory is the
invocation's, freed when the invocation ends; the store (put/get) passes data on.

Keys: `ctx.key(name)` gives the request-scoped key `"<workflow>/<request id>/<name>"`; a bare name
without a slash is qualified to `"<workflow>/<name>"` (workflow-wide). A key is accepted by a proxy
only if it starts with that proxy's `"<workflow>/"`.

Torch-free: importing this module (function side) must not import torch.
"""

from __future__ import annotations

import math
import re
from typing import Any, NamedTuple

from .errors import IsolationError

#: dtype names a handle may carry (torch's names without the `torch.` prefix).
DTYPES: dict[str, int] = {
    "float32": 4,
    "float64": 8,
    "float16": 2,
    "bfloat16": 2,
    "int64": 8,
    "int32": 4,
    "int16": 2,
    "int8": 1,
    "uint8": 1,
    "bool": 1,
}


class Handle(NamedTuple):
    """An opaque handle to a tensor in one workflow's device memory."""

    workflow: str
    address: int
    dtype: str
    shape: tuple[int, ...]
    strides: tuple[int, ...]
    nbytes: int

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @classmethod
    def from_wire(cls, obj: Any) -> Handle:
        """A handle from its msgpack form (a 6-array); raises `TypeError` naming what is wrong."""
        if isinstance(obj, Handle):
            return obj
        if not isinstance(obj, list | tuple) or len(obj) != 6:
            raise TypeError(f"expected a device-tensor handle (6 fields), got {obj!r:.120}")
        workflow, address, dtype, shape, strides, nbytes = obj
        if not isinstance(workflow, str) or not isinstance(address, int) or not isinstance(nbytes, int):
            raise TypeError(f"malformed handle {obj!r:.120}")
        if dtype not in DTYPES:
            raise TypeError(f"handle dtype {dtype!r} is not one of {sorted(DTYPES)}")
        if not isinstance(shape, list | tuple) or not all(isinstance(d, int) and d >= 0 for d in shape):
            raise TypeError(f"malformed handle shape {shape!r}")
        if not isinstance(strides, list | tuple) or len(strides) != len(shape):
            raise TypeError(f"handle strides {strides!r} do not fit shape {shape!r}")
        return cls(workflow, address, dtype, tuple(shape), tuple(int(s) for s in strides), nbytes)


def request_key(workflow: str, request_id: str, name: str) -> str:
    """The request-scoped key of `name`: `<workflow>/<request id>/<name>`."""
    if not name:
        raise ValueError("a key name must not be empty")
    return f"{workflow}/{request_id}/{name}"


def qualify_key(workflow: str, key: str) -> str:
    """A bare name becomes workflow-wide (`<workflow>/<name>`); a key with a slash is kept as is."""
    if not isinstance(key, str) or not key:
        raise TypeError(f"a key must be a non-empty string, got {key!r}")
    return key if "/" in key else f"{workflow}/{key}"


#: The longest key a function may use (workflow and request prefix included).
MAX_KEY_CHARS = 1024


def check_key(workflow: str, key: Any, request_id: str | None = None) -> str:
    """`key` if `workflow`'s invocation of `request_id` may use it, else `IsolationError` saying whose
    it is. Keys are `<workflow>/<name>` (workflow-wide) or `<workflow>/<request id>/<name>`
    (request-scoped: only that request's invocations may use them)."""
    if not isinstance(key, str) or not key:
        raise TypeError(f"a key must be a non-empty string, got {key!r:.200}")
    if len(key) > MAX_KEY_CHARS:  # the store holds keys in host memory, beyond the quota of its bytes
        raise ValueError(f"a key has at most {MAX_KEY_CHARS} characters, got {len(key)}: {key[:80]!r}...")
    if not key.startswith(f"{workflow}/"):
        owner = key.split("/", 1)[0] if "/" in key else "?"
        raise IsolationError(
            f"key {key!r} belongs to workflow {owner!r}; the proxy of workflow {workflow!r} only "
            f"serves keys starting with {workflow + '/'!r}"
        )
    scope = key[len(workflow) + 1 :].split("/", 1)
    if not scope[-1]:
        raise ValueError(f"key {key!r} names nothing after its prefix ('{workflow}/[<request id>/]<name>')")
    if request_id is not None and len(scope) == 2 and scope[0] != request_id:
        raise IsolationError(
            f"key {key!r} is scoped to request {scope[0]!r}; an invocation of request {request_id!r} "
            f"may use its own keys ({request_prefix(workflow, request_id)!r}...) and workflow-wide ones "
            f"({workflow + '/'!r}<name> without a further '/')"
        )
    return key


def request_prefix(workflow: str, request_id: str) -> str:
    return f"{workflow}/{request_id}/"


_INTS = r"\[(?:-?\d+(?:, -?\d+)*)?\]"
#: JSON of a `Handle`: [workflow, address, dtype, shape, strides, nbytes].
_HANDLE_JSON = re.compile(
    rf'\["(?:[^"\\]|\\.)*", \d+, "(?:{"|".join(map(re.escape, DTYPES))})", {_INTS}, {_INTS}, \d+\]'
)


def _handle_path(value: Any, name: str) -> str | None:
    """Where in `value` (called `name`) a device handle sits, None if nowhere."""
    stack: list[tuple[Any, Any, Any]] = [(value, None, None)]  # (value, parent's entry, key in parent)
    while stack:
        item = stack.pop()
        current = item[0]
        if type(current) is Handle:
            keys = []
            while item[1] is not None:
                keys.append(f"[{item[2]!r}]")
                item = item[1]
            return name + "".join(reversed(keys))
        if isinstance(current, dict):
            children: Any = current.items()
        elif isinstance(current, list | tuple):
            children = enumerate(current)
        else:
            continue
        stack.extend((child, item, key) for key, child in children if isinstance(child, dict | list | tuple))
    return None


def handle_in_json(value: Any, text: str, name: str = "output") -> str | None:
    """Where a device handle sits in `value` (called `name`), whose JSON is `text`: e.g.
    ``output['boxes'][0]``, None if nowhere. JSON writes a handle (a named tuple) as a list, its
    device address included. The scan of `text` runs in C; only a match pays the walk of `value`
    (Python), which tells a real handle from a look-alike list of the caller's own values."""
    return _handle_path(value, name) if _HANDLE_JSON.search(text) else None
