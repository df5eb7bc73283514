"""The control guard, property-tested: no message without this proxy's key is ever accepted, and
nothing a caller sends makes the guard fail in a way the proxy does not expect (it refuses with
`ControlRefused` or reports a decoding error; the dispatcher treats both without dying)."""

from __future__ import annotations

import msgpack
from hypothesis import given, settings
from hypothesis import strategies as st

from streambox.api_proxy.control import KEY_BYTES, ControlGuard, ControlRefused

KEY = bytes(range(KEY_BYTES))
GUARD = ControlGuard(KEY)
values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**63), max_value=2**64 - 1)
    | st.floats(allow_nan=False)
    | st.text(max_size=8)
    | st.binary(max_size=40),
    lambda inner: st.lists(inner, max_size=5) | st.dictionaries(st.text(max_size=5), inner, max_size=5),
    max_leaves=20,
)


def _open(body: bytes):
    try:
        return GUARD.open(body)
    except ControlRefused as refused:
        assert refused.wire[0] == "IsolationError"
        return None
    except Exception:  # noqa: BLE001 - a decoding error: the proxy ignores the message
        return None


@settings(max_examples=400, deadline=None)
@given(st.binary(max_size=200))
def test_random_bytes_are_never_accepted(body):
    assert _open(body) is None


@settings(max_examples=400, deadline=None)
@given(st.lists(values, max_size=5))
def test_messages_without_the_key_are_never_accepted(message):
    if len(message) == 4 and message[3] == KEY:
        message[3] = b"not the key"
    assert _open(msgpack.packb(message, use_bin_type=True)) is None


@given(st.integers(min_value=0, max_value=2**31), st.sampled_from(["invoke", "stats", "shutdown"]), values)
def test_messages_with_the_key_are_accepted_as_sent(call_id, op, args):
    body = msgpack.packb([call_id, op, args, KEY], use_bin_type=True)
    assert GUARD.open(body) == (call_id, op, args)
