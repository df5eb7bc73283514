"""Handles, keys, errors on the wire, messages and the buffer table (no processes)."""

from __future__ import annotations

import msgpack
import pytest

from streambox.api_proxy import wire
from streambox.api_proxy.buffers import BufferTable
from streambox.api_proxy.errors import (
    CallFailed,
    DeviceFailed,
    FunctionTimeout,
    IsolationError,
    KeyNotFound,
    decode_error,
    encode_error,
)
from streambox.api_proxy.handles import Handle, check_key, qualify_key, request_key


def test_handles_are_plain_msgpack_arrays_and_come_back_checked():
    h = Handle("traffic", 0x7F00_0000_1000, "float32", (1, 3, 4), (12, 4, 1), 48)
    packed = msgpack.packb(h)
    back = Handle.from_wire(msgpack.unpackb(packed))
    assert back == h and isinstance(back, Handle)
    assert h.numel == 12


@pytest.mark.parametrize(
    "bad",
    [
        "nope",
        [1, 2, 3],
        ["wf", 1, "complex128", [1], [1], 8],
        ["wf", 1, "float32", [1, -2], [1, 1], 8],
        ["wf", 1, "float32", [2, 2], [1], 16],
        ["wf", "0x10", "float32", [1], [1], 4],
    ],
)
def test_malformed_handles_are_refused_with_a_type_error(bad):
    with pytest.raises(TypeError):
        Handle.from_wire(bad)


def test_keys_are_scoped_to_their_workflow():
    assert request_key("traffic", "r1", "boxes") == "traffic/r1/boxes"
    assert qualify_key("traffic", "model-cache") == "traffic/model-cache"
    assert qualify_key("traffic", "traffic/r1/x") == "traffic/r1/x"
    assert check_key("traffic", "traffic/r1/x") == "traffic/r1/x"
    with pytest.raises(IsolationError, match="belongs to workflow 'social'"):
        check_key("traffic", "social/r1/x")
    with pytest.raises(IsolationError):
        check_key("traffic", "trafficX/r1/x")  # a prefix of the name is not the workflow
    for empty in ("traffic/", "traffic/r1/"):
        with pytest.raises(ValueError, match="names nothing after its prefix"):
            check_key("traffic", empty, "r1")
    with pytest.raises(ValueError, match="at most 1024 characters, got 1032"):
        check_key("traffic", "traffic/" + "k" * 1024)


def test_errors_cross_the_wire_by_name_never_by_pickle():
    assert isinstance(decode_error(encode_error(FunctionTimeout("slow"))), FunctionTimeout)
    assert isinstance(decode_error(encode_error(KeyError("k"))), KeyError)
    err = decode_error(["KernelError", "kernel 'conv' failed"])
    assert isinstance(err, DeviceFailed) and "KernelError: kernel 'conv' failed" in str(err)
    assert isinstance(decode_error(["GetTimeout", "GET 'x': no data"]), KeyNotFound)
    unknown = decode_error(["os.system", "rm -rf"])  # a name is only ever looked up in a table
    assert isinstance(unknown, CallFailed) and "os.system" in str(unknown)
    assert isinstance(decode_error("garbage"), CallFailed)


def test_messages_round_trip_and_malformed_ones_are_named():
    message = [wire.CALL, 3, "infer", ["resnet18", [{"tensor": ["float32", [1], b"\0" * 4]}]]]
    assert wire.unpack(wire.pack(message)) == message
    assert wire.message_kind(message) == wire.CALL
    with pytest.raises(ValueError, match="malformed"):
        wire.message_kind([99])


def test_buffer_table_frees_on_the_last_holder_and_keeps_store_owned_buffers():
    table = BufferTable()
    table.add(0x100, 64, "t", ("inv", 1))
    table.hold(0x100, ("inv", 2))
    assert table.release(0x100, ("inv", 1), event="e1") is None
    buf = table.release(0x100, ("inv", 2), event="e2")
    assert buf is not None and buf.events == ["e1", "e2"] and 0x100 not in table
    assert table.release(0x100, ("inv", 2)) is None  # gone: nothing to do twice

    table.add(0x200, 8, "t", ("inv", 3))
    table.disown(0x200)  # PUT: the store owns it
    buf = table.release(0x200, ("inv", 3))
    assert buf is not None and buf.external  # the shell must not free it
    table.add(0x300, 8, "t", ("inv", 4), external=True)
    table.add(0x300, 16, "u", ("inv", 5))  # a stale external record at a reused address is replaced
    assert table.get(0x300).nbytes == 16
    with pytest.raises(KeyError):
        table.add(0x300, 16, "u", ("inv", 6))
    assert table.held_by(("inv", 5)) == [0x300]
