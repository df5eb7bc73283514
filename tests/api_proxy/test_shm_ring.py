"""The shared-memory channel: rings, fragmentation, doorbells, and the cross-process handshake."""

from __future__ import annotations

import mmap
import os
import random
import struct
import time

import pytest

from streambox.api_proxy import wire
from streambox.api_proxy.channel import connect, make_server
from streambox.api_proxy.shm_ring import (
    Doorbell,
    Inbox,
    Outbox,
    Ring,
    create_segment,
    private_dir,
    wait_readable,
)


def _pair(capacity: int) -> tuple[Outbox, Inbox, mmap.mmap]:
    mm = mmap.mmap(-1, Ring.nbytes(capacity))
    buf = memoryview(mm)
    return Outbox(Ring(buf, 0, capacity), None), Inbox(Ring(buf, 0, capacity)), mm


@pytest.mark.parametrize("capacity", [64, 256, 4096])
def test_random_interleavings_deliver_every_message_once_in_order(capacity):
    out, inbox, _mm = _pair(capacity)
    rnd = random.Random(capacity)
    sent, got = [], []
    for _ in range(5000):
        if rnd.random() < 0.5:
            size = rnd.choice([0, 1, 7, 8, 9, rnd.randint(0, 3 * capacity)])
            message = rnd.randbytes(size)
            sent.append(message)
            out.put(message)
        else:
            out.flush()
            if (m := inbox.poll()) is not None:
                got.append(m)
    while len(got) < len(sent):
        out.flush()
        if (m := inbox.poll()) is not None:
            got.append(m)
    assert got == sent
    assert inbox.poll() is None


def test_a_full_ring_refuses_a_record_and_takes_it_once_read():
    out, inbox, _mm = _pair(64)
    assert out.put(b"a" * 40)  # 48 bytes with its header
    assert not out.put(b"b" * 40)  # queued: no room
    assert out  # pending
    assert inbox.poll() == b"a" * 40
    assert out.flush()
    assert inbox.poll() == b"b" * 40


def test_ring_rejects_misaligned_layouts():
    buf = memoryview(mmap.mmap(-1, 4096))
    with pytest.raises(ValueError, match="multiple of 8"):
        Ring(buf, 0, 100)
    with pytest.raises(ValueError, match="aligned"):
        Ring(buf, 8, 1024)


def test_cross_process_stream_with_fragmented_messages():
    """A producer process and this consumer on a small ring: every message arrives intact, in order
    (the regression: counters written with struct.pack_into showed a transient 0 to the reader)."""
    capacity, count = 4096, 3000
    mm = mmap.mmap(-1, Ring.nbytes(capacity))
    buf = memoryview(mm)
    rnd = random.Random(5)
    messages = [
        bytes([i % 251]) * rnd.choice([0, 5, 500, 3000, 9000]) + struct.pack("<I", i) for i in range(count)
    ]
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the producer
        try:
            out = Outbox(Ring(buf, 0, capacity), None)
            for m in messages:
                out.put(m)
                while not out.flush():
                    os.sched_yield()
        finally:
            os._exit(0)
    inbox = Inbox(Ring(buf, 0, capacity))
    got = 0
    deadline = time.monotonic() + 120
    try:
        while got < count:
            assert time.monotonic() < deadline, f"only {got} of {count} messages arrived"
            m = inbox.poll()
            if m is None:
                os.sched_yield()
                continue
            assert m == messages[got], f"message {got} arrived corrupted ({len(m)} bytes)"
            got += 1
    finally:
        os.waitpid(pid, 0)


def test_shared_counters_never_show_a_transient_value():
    """The writer stores the same value over and over; the reader must only ever see that value."""
    mm = mmap.mmap(-1, Ring.nbytes(64))
    buf = memoryview(mm)
    ring = Ring(buf, 0, 64)
    ring._words[ring._head_at] = 12345
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the writer
        words = buf.cast("B").cast("Q")
        for _ in range(200_000):
            words[0] = 12345
        os._exit(0)
    seen = set()
    try:
        for _ in range(200_000):
            seen.add(ring._words[ring._head_at])
    finally:
        os.waitpid(pid, 0)
    assert seen == {12345}


def test_doorbell_wakes_a_sleeping_consumer(tmp_path):
    mm = create_segment(tmp_path / "flags", 4096)
    buf = memoryview(mm)
    Doorbell.make_fifo(tmp_path / "bell")
    consumer = Doorbell(buf, 0, tmp_path / "bell")
    producer = Doorbell(buf, 0, tmp_path / "bell")
    producer.ring_if_waiting()  # nobody waits: no wake-up byte
    consumer.arm()
    producer.ring_if_waiting()
    started = time.perf_counter()
    consumer.sleep(5.0)
    assert time.perf_counter() - started < 1.0
    assert oct(os.stat(tmp_path / "bell").st_mode & 0o777) == "0o600"
    assert oct(os.stat(tmp_path / "flags").st_mode & 0o777) == "0o600"
    consumer.close()
    producer.close()


@pytest.mark.parametrize("kind", ["shm", "zmq"])
def test_channel_round_trip_between_processes_and_owner_only_files(kind):
    directory = private_dir("sbx-test-")
    assert oct(os.stat(directory).st_mode & 0o777) == "0o700"
    server = make_server(kind, directory, capacity=1 << 16)
    endpoint = server.add(7)
    for entry in directory.iterdir():
        if not entry.is_dir():
            assert entry.stat().st_mode & 0o077 == 0, f"{entry.name} is readable by others"
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the function side
        code = 1
        try:
            channel = connect(endpoint)
            for i in range(50):
                channel.send(wire.pack([wire.CALL, i, "noop", [b"x" * (i * 997)]]))
                reply = wire.unpack(channel.recv(10.0))
                assert reply == [wire.REPLY, i, True, i * 997]
            code = 0
        finally:
            os._exit(code)
    seen = 0
    deadline = time.monotonic() + 60

    def deliver(instance_id: int, data: bytes) -> None:
        nonlocal seen
        assert instance_id == 7
        _, call_id, op, (payload,) = wire.unpack(data)
        server.send(instance_id, wire.pack([wire.REPLY, call_id, True, len(payload)]))
        seen += 1

    try:
        while seen < 50 and time.monotonic() < deadline:
            if not server.poll(deliver):
                time.sleep(50e-6)
    finally:
        _, status = os.waitpid(pid, 0)
        server.close()
        directory.rmdir()
    assert seen == 50
    assert os.waitstatus_to_exitcode(status) == 0


def test_a_descriptor_past_1024_is_waited_on():
    """`select` refuses descriptors numbered 1024 or more ("filedescriptor out of range"); a proxy or
    an instance started from a process with that many open gets such numbers, so waits use poll."""
    import resource

    unlimited = resource.RLIM_INFINITY
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != unlimited and hard <= 1500:
        pytest.skip("this process may not open descriptor 1500")
    if soft != unlimited and soft <= 1500:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    read_end, write_end = os.pipe()
    high = os.dup2(read_end, 1500)
    try:
        assert not wait_readable(high, 0.01)
        os.write(write_end, b"x")
        assert wait_readable(high, 1.0)
    finally:
        for fd in (high, read_end, write_end):
            os.close(fd)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
