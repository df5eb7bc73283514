"""The function-to-proxy protocol under fuzzing: a function process sends random frames on its
forwarding channel (garbage bytes, maps, arrays of the wrong length or with fields of the wrong type,
unknown ops, wrong argument counts, and the cases `[5]`, `[4]`, `{}`, `b"c1"` that used to kill the
proxy); the proxy ends that instance alone and keeps serving another function's requests with
correct results, and its memory returns to its baseline.

A real proxy process (template, forked instances; shared-memory and zmq channels); the frames are sent from
inside a real handler, through the client's own channel. The oracle is `protocol.decode`: a frame it
refuses must fail the fuzzing request with `FunctionCrashed` ("sent a malformed message"), one it
accepts is a message the proxy may act on (a reply to an unknown call is dropped by the function; a
RESULT with the current invocation's id settles it early): it must not end the sender.
"""

from __future__ import annotations

import itertools
import textwrap
import time

import msgpack
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from streambox.api_proxy import protocol, wire
from streambox.api_proxy.control import launch_proxy
from streambox.api_proxy.errors import FunctionCrashed, ProxyError
from streambox.api_proxy.proxy_config import ProxyConfig, ProxyFunction

HANDLERS = textwrap.dedent(
    """
    import torch
    import streambox

    @streambox.function
    def fuzz(ctx, event):
        ctx._client._ids = 2**63 + 12345  # the frame's call id must not answer this handler's own call
        ctx._client.channel.send(bytes.fromhex(event["frame"]))
        ctx.noop()  # a round trip: the proxy has read the frame before the result goes
        return {"sent": len(event["frame"]) // 2}

    @streambox.function
    def good(ctx, event):
        g = torch.Generator().manual_seed(event["seed"])
        x = torch.randn(64, generator=g)
        h = ctx.upload(x)
        y = ctx.alloc(shape=[64], dtype="float32")
        ctx.memcpy(y, h)
        ctx.put(ctx.key("y"), y)
        back = ctx.download(ctx.get(ctx.key("y")))
        return {"sum": float(back.sum()), "first": float(back[0])}
    """
)

scalars = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**63), max_value=2**64 - 1)
    | st.floats(allow_nan=False)
    | st.text(max_size=12)
    | st.binary(max_size=12)
)
values = st.recursive(
    scalars,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=4), inner, max_size=3),
    max_leaves=8,
)
ops = st.sampled_from([*protocol.OP_ARITY, "nope", ""])
near_valid = st.one_of(
    st.tuples(st.just(wire.CALL), values, ops, st.lists(values, max_size=5)).map(list),
    st.tuples(st.just(wire.RESULT), values, values, values).map(list),
    st.tuples(st.just(wire.HELLO), values, values).map(list),
    st.lists(values, max_size=6),
    st.tuples(st.sampled_from([wire.CALL, wire.RESULT, wire.HELLO, wire.REPLY, 0, 7]), values).map(list),
)
packed = st.one_of(values, near_valid).map(lambda v: msgpack.packb(v, use_bin_type=True))
frames = st.one_of(
    st.sampled_from([b"\x91\x05", b"\x91\x04", b"\x80", b"c1", b"\xc1"]),  # [5], [4], {}, garbage
    st.binary(min_size=1, max_size=256),
    packed,
)


_requests = itertools.count()  # hypothesis replays examples: every request id is new (ended ones stay ended)


def _accepted(frame: bytes) -> bool:
    try:
        protocol.decode(frame)
    except protocol.ProtocolViolation:
        return False
    return True


def _expected(seed: int) -> dict[str, float]:
    import torch

    x = torch.randn(64, generator=torch.Generator().manual_seed(seed))
    return {"sum": float(x.sum()), "first": float(x[0])}


@pytest.fixture(scope="module", params=["shm", "zmq"])
def proxy(request, tmp_path_factory):
    root = tmp_path_factory.mktemp("protocol_fuzz")
    (root / "fuzz_handlers.py").write_text(HANDLERS)
    config = ProxyConfig(
        workflow="wffuzz",
        functions=(ProxyFunction("fuzz", "fuzz_handlers:fuzz"), ProxyFunction("good", "fuzz_handlers:good")),
        sys_path=(str(root),),
        state_dir=str(root / "state"),
        channel=request.param,
        completion="poll",
        prefork=2,
    )
    started = launch_proxy(config)
    yield started
    started.stop()


def test_the_known_killers_end_only_their_sender(proxy):
    client = proxy.client
    baseline = client.invoke("good", {"seed": 1}, request_id="base")["output"]
    for frame in (b"\x91\x05", b"\x91\x04", b"\x80", b"c1"):
        with pytest.raises(FunctionCrashed, match="malformed message"):
            client.invoke("fuzz", {"frame": frame.hex()}, request_id=f"k-{frame.hex()}")
        assert client.invoke("good", {"seed": 1}, request_id=f"g-{frame.hex()}")["output"] == baseline
        client.end_request(f"g-{frame.hex()}")
    client.end_request("base")
    assert baseline == pytest.approx(_expected(1))


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(frame=frames, seed=st.integers(0, 2**16))
def test_random_frames_end_only_their_sender_and_others_keep_correct_results(proxy, frame, seed):
    client = proxy.client
    request = f"fz-{next(_requests)}"
    if _accepted(frame):
        try:
            client.invoke("fuzz", {"frame": frame.hex()}, request_id=request)
        except ProxyError as exc:
            assert "malformed message" not in str(exc)
    else:
        with pytest.raises(FunctionCrashed, match="malformed message"):
            client.invoke("fuzz", {"frame": frame.hex()}, request_id=request)
    got = client.invoke("good", {"seed": seed}, request_id=f"{request}-good")["output"]
    assert got == pytest.approx(_expected(seed), rel=0, abs=0)
    client.end_request(request)
    client.end_request(f"{request}-good")


def test_memory_returns_to_its_baseline_after_the_fuzzing(proxy):
    client = proxy.client
    deadline = time.monotonic() + 10.0
    while time.monotonic() < deadline:  # frees are stream-ordered: they land a moment after the work
        stats = client.stats()
        if not stats["retiring_streams"] and not stats["pool"]["allocated_bytes"]:
            break
        time.sleep(0.05)
    assert stats["buffers"] == 0 and stats["buffer_bytes"] == 0
    assert stats["keys"] == 0
    assert stats["pool"]["allocated_bytes"] == 0
    assert stats["protocol_errors"] >= 4
    assert stats["instances_died"] == stats["protocol_errors"]
