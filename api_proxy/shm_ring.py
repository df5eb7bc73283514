"""A shared-memory channel: single-producer single-consumer byte rings plus a doorbell.

A ring lives in an mmap of a file in an owner-only directory (tmpfs `/dev/shm` where it exists):

    head (u64, producer) | tail (u64, consumer) | data[capacity]

`head` and `tail` count bytes ever written and consumed; each record is an 8-byte header (payload
length u32, flags u32) and the payload, padded to 8 bytes, wrapping around the end of the data area.
A message larger than a ring is cut into records flagged `MORE` and joined by the reader. The
producer writes the payload, then the header, then publishes `head`; on x86-64 (TSO) stores become
visible in that order, so a reader that sees `head` sees the bytes.

Waiting: a consumer spins briefly (yielding the CPU and the GIL between checks with
`os.sched_yield`), then sleeps on a doorbell: it raises its `waiting` flag, fences, checks the ring
once more, and blocks in `poll` on a FIFO. A producer that publishes a record fences and rings the
FIFO only if the flag is up, so a hot channel makes no system calls at all. The fence is an
uncontended lock acquire/release (a locked instruction: a full barrier on x86-64), which closes the
store->load window of the flag/head handshake; the blocking wait still has a timeout as a backstop.
Records above `ORDERED_COPY_MAX` bytes are fenced between their bytes and `head` (see there).

Torch-free: function processes import this.
"""

from __future__ import annotations

import contextlib
import errno
import mmap
import os
import select
import socket
import struct
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

HEADER = struct.Struct("II")  # payload length, flags (written before `head` publishes them)
# The shared counters and flags are read and written through memoryviews cast to "Q" / "I": an
# item assignment is one aligned store. Not `struct.pack_into`: it zero-fills the target before
# writing the value, so another process can see a transient 0 (measured here: a reader saw
# `head` = 0 and read a stale lap of the ring).
MORE = 1  # the message continues in the next record
RECORD_ALIGN = 8
CACHE_LINE = 64

_FENCE = threading.Lock()
#: Copies up to this size are made with ordinary vector moves by every glibc memcpy, which x86-64
#: orders like any store (TSO). Larger ones may use REP MOVSB ("fast strings"), whose stores the
#: vendors allow to become visible out of order; a record above this size is fenced before `head`
#: publishes it (defensive: cheap next to the copy).
ORDERED_COPY_MAX = 256


def fence() -> None:
    """A full memory barrier (x86-64: an uncontended lock is a locked read-modify-write)."""
    _FENCE.acquire()
    _FENCE.release()


def _padded(n: int) -> int:
    return (n + RECORD_ALIGN - 1) & ~(RECORD_ALIGN - 1)


def private_dir(prefix: str = "streambox-") -> Path:
    """A new directory only its owner can enter (0700), on tmpfs where possible."""
    base = Path("/dev/shm")
    if not (base.is_dir() and os.access(base, os.W_OK | os.X_OK)):
        base = Path(tempfile.gettempdir())
    path = Path(tempfile.mkdtemp(prefix=prefix, dir=base))
    os.chmod(path, 0o700)
    return path


def create_segment(path: Path, nbytes: int) -> mmap.mmap:
    """A new owner-only (0600) file of `nbytes` zero bytes, mapped shared."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.ftruncate(fd, nbytes)
        return mmap.mmap(fd, nbytes)
    finally:
        os.close(fd)


def open_segment(path: Path | str) -> mmap.mmap:
    fd = os.open(path, os.O_RDWR)
    try:
        return mmap.mmap(fd, 0)
    finally:
        os.close(fd)


class Ring:
    """One direction of a channel: `head` at `base`, `tail` one cache line later, then the data.

    Each side keeps its own counter locally and a cached copy of the other side's, re-read from
    shared memory only when the cache says "full" (producer) or "empty" (consumer)."""

    OVERHEAD = 2 * CACHE_LINE

    def __init__(self, buf: memoryview, base: int, capacity: int) -> None:
        if capacity % RECORD_ALIGN or capacity < 4 * RECORD_ALIGN:
            raise ValueError(f"ring capacity must be a multiple of {RECORD_ALIGN}, got {capacity}")
        if base % CACHE_LINE:
            raise ValueError(f"ring base {base} is not aligned to {CACHE_LINE}")
        self._buf = buf
        self._words = buf.cast("B").cast("Q")  # 8-byte words: one load/store per counter
        self._head_at = base // 8
        self._tail_at = (base + CACHE_LINE) // 8
        self._data = base + self.OVERHEAD
        self.capacity = capacity
        self.max_record = capacity - HEADER.size
        # Pieces of a message too large for one record: two fit at once, so writer and reader overlap.
        self.chunk = (capacity // 2 - HEADER.size) & ~(RECORD_ALIGN - 1)
        self._head = self._head_seen = self._words[self._head_at]
        self._tail = self._tail_seen = self._words[self._tail_at]

    @staticmethod
    def nbytes(capacity: int) -> int:
        return Ring.OVERHEAD + capacity

    def release(self) -> None:
        """Let go of the mapping (its mmap can close); any later use raises ValueError. Safe to call
        while a caller up the stack still holds this ring (a peer removed in the middle of a poll)."""
        self._words.release()
        self._buf = self._words = memoryview(b"")  # released views of nothing: reads fail, not crash
        self._words.release()

    def readable(self) -> bool:
        """(Consumer) a record is waiting."""
        if self._head_seen != self._tail:
            return True
        self._head_seen = self._words[self._head_at]
        return self._head_seen != self._tail

    def free_space(self) -> int:
        """(Producer) bytes that can be written now."""
        self._tail_seen = self._words[self._tail_at]
        return self.capacity - (self._head - self._tail_seen)

    def _copy_in(self, pos: int, data: memoryview | bytes) -> None:
        at = pos % self.capacity
        first = min(len(data), self.capacity - at)
        start = self._data + at
        self._buf[start : start + first] = data[:first]
        if first < len(data):
            rest = len(data) - first
            self._buf[self._data : self._data + rest] = data[first:]

    def _copy_out(self, pos: int, n: int) -> bytes:
        at = pos % self.capacity
        first = min(n, self.capacity - at)
        start = self._data + at
        if first == n:
            return bytes(self._buf[start : start + n])
        return bytes(self._buf[start : start + first]) + bytes(self._buf[self._data : self._data + n - first])

    # -- producer ---------------------------------------------------------------------------
    def try_write(self, payload: memoryview | bytes, flags: int = 0) -> bool:
        """Append one record if it fits now; `payload` must be at most `max_record` bytes."""
        n = len(payload)
        need = HEADER.size + ((n + RECORD_ALIGN - 1) & ~(RECORD_ALIGN - 1))
        head = self._head
        cap = self.capacity
        if cap - (head - self._tail_seen) < need:
            self._tail_seen = self._words[self._tail_at]
            if cap - (head - self._tail_seen) < need:
                return False
        at = head % cap  # 8-aligned: a header never wraps
        start = self._data + at
        if at + HEADER.size + n <= cap and n <= 4096:
            self._buf[start : start + HEADER.size + n] = HEADER.pack(n, flags) + payload
        else:
            self._copy_in(head + HEADER.size, payload)
            HEADER.pack_into(self._buf, start, n, flags)
        if n > ORDERED_COPY_MAX:
            fence()  # the bytes are visible before `head` says they are there
        self._head = head = head + need
        self._words[self._head_at] = head
        return True

    # -- consumer ---------------------------------------------------------------------------
    def read_record(self) -> tuple[bytes, int] | None:
        tail = self._tail
        if self._head_seen == tail:
            self._head_seen = self._words[self._head_at]
            if self._head_seen == tail:
                return None
        buf = self._buf
        at = tail % self.capacity
        start = self._data + at
        length, flags = HEADER.unpack_from(buf, start)
        if length > ORDERED_COPY_MAX:
            fence()  # no string load of the payload runs ahead of the load of `head`
        if at + HEADER.size + length <= self.capacity:
            payload = bytes(buf[start + HEADER.size : start + HEADER.size + length])
        else:
            payload = self._copy_out(tail + HEADER.size, length)
        self._tail = tail = tail + HEADER.size + ((length + RECORD_ALIGN - 1) & ~(RECORD_ALIGN - 1))
        self._words[self._tail_at] = tail
        return payload, flags


def wait_readable(fd: int | socket.socket, timeout_s: float) -> bool:
    """Block until `fd` is readable or `timeout_s` passed; whether it is. `poll`, not `select`: a
    process with over 1024 descriptors open (a proxy with many instances, a test run) gets numbers
    `select` refuses ("filedescriptor out of range")."""
    poller = select.poll()
    poller.register(fd, select.POLLIN)
    try:
        return bool(poller.poll(max(timeout_s, 0.0) * 1000.0))
    except InterruptedError:
        return False


def drain_fd(fd: int) -> None:
    """Read a non-blocking descriptor (a doorbell FIFO) until it is empty."""
    while True:
        try:
            if len(os.read(fd, 4096)) < 4096:
                return
        except BlockingIOError:
            return


class Doorbell:
    """A `waiting` flag in shared memory and a FIFO to wake a sleeping consumer.

    Both sides open the FIFO read-write (Linux: never blocks, never sees end-of-file)."""

    def __init__(self, flag_buf: memoryview, flag_off: int, fifo: Path | str) -> None:
        if flag_off % 4:
            raise ValueError(f"flag offset {flag_off} is not 4-byte aligned")
        self._flags = flag_buf.cast("B").cast("I")
        self._at = flag_off // 4
        self.fifo = str(fifo)
        self.fd = os.open(self.fifo, os.O_RDWR | os.O_NONBLOCK)

    @staticmethod
    def make_fifo(path: Path) -> None:
        os.mkfifo(path, 0o600)

    # -- consumer ---------------------------------------------------------------------------
    def arm(self) -> None:
        self._flags[self._at] = 1
        fence()

    def disarm(self) -> None:
        self._flags[self._at] = 0

    def drain(self) -> None:
        drain_fd(self.fd)

    def sleep(self, timeout: float) -> None:
        """Block until rung or `timeout` (call `arm` and re-check the ring first)."""
        wait_readable(self.fd, timeout)
        self.drain()
        self.disarm()

    # -- producer ---------------------------------------------------------------------------
    def ring_if_waiting(self) -> None:
        fence()
        if self._flags[self._at]:
            self.ring()

    def ring(self) -> None:
        try:
            os.write(self.fd, b"\0")
        except BlockingIOError:
            pass  # the FIFO is full of unread wake-ups: the consumer will wake anyway
        except OSError as exc:  # the consumer is gone
            if exc.errno not in (errno.EPIPE, errno.EBADF):
                raise

    def close(self) -> None:
        self._flags.release()
        with contextlib.suppress(OSError):
            os.close(self.fd)
        self.fd = -1


class Outbox:
    """Messages waiting to be written to a ring, cut into records; never blocks."""

    def __init__(self, ring: Ring, bell: Doorbell | None) -> None:
        self.ring = ring
        self.bell = bell
        self._pending: list[tuple[memoryview, int]] = []  # (message, bytes already written)

    def __bool__(self) -> bool:
        return bool(self._pending)

    def put(self, data: bytes) -> bool:
        """Queue `data` and write what fits; True when everything queued has been written."""
        if not self._pending and len(data) <= self.ring.max_record and self.ring.try_write(data):
            if self.bell is not None:
                self.bell.ring_if_waiting()
            return True
        self._pending.append((memoryview(data), 0))
        return self.flush()

    def flush(self) -> bool:
        wrote = False
        ring = self.ring
        while self._pending:
            data, done = self._pending[0]
            left = len(data) - done
            n = left if left <= ring.max_record else min(left, ring.chunk)
            more = MORE if done + n < len(data) else 0
            if not ring.try_write(data[done : done + n], more):
                break
            wrote = True
            if more:
                self._pending[0] = (data, done + n)
            else:
                self._pending.pop(0)
        if wrote and self.bell is not None:
            self.bell.ring_if_waiting()
        return not self._pending


class Inbox:
    """Whole messages from a ring (joining `MORE` records)."""

    def __init__(self, ring: Ring) -> None:
        self.ring = ring
        self._parts: list[bytes] = []

    def poll(self) -> bytes | None:
        if not self._parts:
            record = self.ring.read_record()
            if record is None:
                return None
            if not record[1] & MORE:
                return record[0]
            self._parts.append(record[0])
        while True:
            record = self.ring.read_record()
            if record is None:
                return None
            payload, flags = record
            if flags & MORE:
                self._parts.append(payload)
                continue
            if self._parts:
                self._parts.append(payload)
                payload = b"".join(self._parts)
                self._parts = []
            return payload


def spin_then_sleep(
    ready: Callable[[], bool],
    bell: Doorbell,
    spin_s: float,
    timeout: float | None,
    max_sleep: float = 0.05,
) -> bool:
    """Wait until `ready()` is true: spin `spin_s` (yielding), then sleep on `bell`. False on timeout."""
    now = time.perf_counter()
    deadline = None if timeout is None else now + timeout
    spin_end = now + spin_s
    while True:
        if ready():
            return True
        now = time.perf_counter()
        if deadline is not None and now >= deadline:
            return False
        if now < spin_end:
            os.sched_yield()
            continue
        bell.arm()
        if ready():
            bell.disarm()
            return True
        left = max_sleep if deadline is None else min(max_sleep, deadline - now)
        bell.sleep(left)
