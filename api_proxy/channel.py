"""The forwarding channel between function processes and their workflow's proxy.

Two transports with one shape, chosen by `ProxyConfig.channel`:

- `shm` (default): per instance, a 0600 segment in the proxy's 0700 directory holding two SPSC rings
  (requests, replies) plus doorbells (`shm_ring.py`). A hot channel makes no system call.
- `zmq`: a ROUTER socket of the proxy (`ipc://` in the same 0700 directory, socket file 0600) and a
  DEALER per instance whose routing id is its instance id.

Function side: `connect(endpoint)` -> `ClientChannel` (`send`, `recv`). Proxy side: `ShmServer` or
`ZmqServer` (`add`/`remove` instances, non-blocking `poll` and `send`, `prepare_sleep` before the
dispatcher blocks in its poller). Both carry opaque bytes (msgpack messages, `wire.py`).

Torch-free: function processes import this.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

from .shm_ring import (
    Doorbell,
    Inbox,
    Outbox,
    Ring,
    create_segment,
    drain_fd,
    open_segment,
    spin_then_sleep,
)

CHANNELS = ("shm", "zmq")
DEFAULT_RING_BYTES = 1 << 20
DEFAULT_SPIN_S = 200e-6
HOT_SPIN_S = 50e-6  # spin without yielding for this long first

# Layout of an instance segment: a header page (the instance's waiting flag), then two rings.
_FLAG_OFF = 0
_RINGS_OFF = 4096
# The proxy's control segment: its waiting flag, read by every instance before ringing.
_PROXY_FLAG_OFF = 0
_PROXY_CTL_BYTES = 4096


class ClientChannel(Protocol):
    def send(self, data: bytes) -> None: ...

    def recv(self, timeout: float | None = None) -> bytes | None: ...

    def close(self) -> None: ...


def connect(endpoint: dict[str, Any]) -> ClientChannel:
    """The function side of a channel described by `endpoint` (made by the proxy's `add`)."""
    kind = endpoint.get("kind")
    if kind == "shm":
        return ShmClient(endpoint)
    if kind == "zmq":
        return ZmqClient(endpoint)
    raise ValueError(f"unknown channel kind {kind!r}; choose one of {CHANNELS}")


# -- shared memory ----------------------------------------------------------------------------------


def _rings(buf: memoryview, capacity: int) -> tuple[Ring, Ring]:
    requests = Ring(buf, _RINGS_OFF, capacity)
    replies = Ring(buf, _RINGS_OFF + Ring.nbytes(capacity), capacity)
    return requests, replies


class ShmClient:
    """A function's end: producer of the request ring, consumer of the reply ring."""

    def __init__(self, endpoint: dict[str, Any]) -> None:
        self._mm = open_segment(endpoint["segment"])
        self._buf = memoryview(self._mm)
        self._ctl_mm = open_segment(endpoint["proxy_ctl"])
        self._ctl = memoryview(self._ctl_mm)
        requests, replies = _rings(self._buf, endpoint["capacity"])
        self._proxy_bell = Doorbell(self._ctl, _PROXY_FLAG_OFF, endpoint["proxy_bell"])
        self._bell = Doorbell(self._buf, _FLAG_OFF, endpoint["bell"])
        self._out = Outbox(requests, self._proxy_bell)
        self._in = Inbox(replies)
        self._spin_s = float(endpoint.get("spin_s", DEFAULT_SPIN_S))
        self._pending: bytes | None = None

    def send(self, data: bytes) -> None:
        if self._out.put(data):
            return
        while not self._out.flush():  # the proxy drains requests on its own; wait for room
            time.sleep(20e-6)

    def _ready(self) -> bool:
        if self._pending is None:
            self._pending = self._in.poll()
        return self._pending is not None

    def recv(self, timeout: float | None = None) -> bytes | None:
        # Hot path: a tight spin on the reply ring (a function process has no other thread to
        # yield to); then the general spin-yield-sleep wait.
        poll = self._in.poll
        data = poll()
        if data is not None:
            return data
        end = time.perf_counter() + min(HOT_SPIN_S, self._spin_s)
        while time.perf_counter() < end:
            data = poll()
            if data is not None:
                return data
        if not spin_then_sleep(self._ready, self._bell, self._spin_s, timeout):
            return None
        data, self._pending = self._pending, None
        return data

    def close(self) -> None:
        self._bell.close()
        self._proxy_bell.close()
        self._out.ring.release()
        self._in.ring.release()
        self._out = self._in = None  # type: ignore[assignment]
        self._buf.release()
        self._ctl.release()
        self._mm.close()
        self._ctl_mm.close()


class _ShmPeer:
    def __init__(self, directory: Path, instance_id: int, capacity: int) -> None:
        self.segment = directory / f"i{instance_id}.ring"
        self.bell_path = directory / f"i{instance_id}.bell"
        self.mm = create_segment(self.segment, _RINGS_OFF + 2 * Ring.nbytes(capacity))
        self.buf = memoryview(self.mm)
        Doorbell.make_fifo(self.bell_path)
        self.bell = Doorbell(self.buf, _FLAG_OFF, self.bell_path)
        requests, replies = _rings(self.buf, capacity)
        self.inbox = Inbox(requests)
        self.outbox = Outbox(replies, self.bell)

    def close(self) -> None:
        """Unmap and unlink; never raises for views a poll round up the stack still holds (the
        rings let go of the mapping first, so the mmap has no exports left)."""
        self.bell.close()
        self.inbox.ring.release()
        self.outbox.ring.release()
        self.inbox = self.outbox = None  # type: ignore[assignment]
        self.buf.release()
        self.mm.close()
        for path in (self.segment, self.bell_path):
            with contextlib.suppress(FileNotFoundError):
                path.unlink()


class ShmServer:
    """The proxy's end of every instance's rings, and the proxy's doorbell."""

    kind = "shm"

    def __init__(self, directory: Path, capacity: int = DEFAULT_RING_BYTES, spin_s: float = DEFAULT_SPIN_S):
        self.directory = Path(directory)
        self.capacity = capacity
        self.spin_s = spin_s
        self._ctl_path = self.directory / "proxy.ctl"
        self._bell_path = self.directory / "proxy.bell"
        self._ctl_mm = create_segment(self._ctl_path, _PROXY_CTL_BYTES)
        self._ctl = memoryview(self._ctl_mm)
        Doorbell.make_fifo(self._bell_path)
        self.bell = Doorbell(self._ctl, _PROXY_FLAG_OFF, self._bell_path)
        self._peers: dict[int, _ShmPeer] = {}
        self._inboxes: tuple[tuple[int, Inbox], ...] = ()  # what `poll` walks, rebuilt on add/remove
        self._unsent: set[int] = set()

    def add(self, instance_id: int) -> dict[str, Any]:
        peer = _ShmPeer(self.directory, instance_id, self.capacity)
        self._peers[instance_id] = peer
        self._inboxes = tuple((i, p.inbox) for i, p in self._peers.items())
        return {
            "kind": "shm",
            "segment": str(peer.segment),
            "bell": str(peer.bell_path),
            "proxy_ctl": str(self._ctl_path),
            "proxy_bell": str(self._bell_path),
            "capacity": self.capacity,
            "spin_s": self.spin_s,
        }

    def remove(self, instance_id: int) -> None:
        peer = self._peers.pop(instance_id, None)
        self._unsent.discard(instance_id)
        self._inboxes = tuple((i, p.inbox) for i, p in self._peers.items())
        if peer is not None:
            peer.close()

    def poll(self, deliver: Callable[[int, bytes], None]) -> int:
        """Hand every complete message waiting in any request ring to `deliver`; returns how many."""
        n = 0
        peers = self._peers
        for instance_id, inbox in self._inboxes:
            if instance_id not in peers:  # removed by an earlier `deliver` of this round
                continue
            while (data := inbox.poll()) is not None:
                deliver(instance_id, data)
                n += 1
                if instance_id not in peers:
                    break
        if self._unsent:
            for instance_id in list(self._unsent):
                peer = self._peers.get(instance_id)
                if peer is None or peer.outbox.flush():
                    self._unsent.discard(instance_id)
        return n

    def send(self, instance_id: int, data: bytes) -> None:
        peer = self._peers.get(instance_id)
        if peer is None:
            return  # the instance is gone; its reply has nobody to read it
        if not peer.outbox.put(data):
            self._unsent.add(instance_id)

    def has_input(self) -> bool:
        return any(p.inbox.ring.readable() for p in self._peers.values()) or bool(self._unsent)

    def prepare_sleep(self) -> bool:
        """Raise the proxy's waiting flag; False (flag lowered) if there is work after all."""
        self.bell.arm()
        if self.has_input():
            self.bell.disarm()
            return False
        return True

    def after_sleep(self) -> None:
        self.bell.drain()
        self.bell.disarm()

    def wake(self) -> None:
        """Wake the dispatcher from another thread of the proxy."""
        self.bell.ring()

    def poll_items(self) -> list[Any]:
        return [self.bell.fd]

    def close(self) -> None:
        for instance_id in list(self._peers):
            self.remove(instance_id)
        self.bell.close()
        self._ctl.release()
        self._ctl_mm.close()
        for path in (self._ctl_path, self._bell_path):
            with contextlib.suppress(FileNotFoundError):
                path.unlink()


# -- zmq ----------------------------------------------------------------------------------------------


_EVENTS = 15  # ZMQ_EVENTS, as a plain int: pyzmq converts enum members on every call
_POLLIN = 1


class ZmqClient:
    def __init__(self, endpoint: dict[str, Any]) -> None:
        import zmq

        self._zmq = zmq
        self._ctx = zmq.Context(io_threads=1)
        self._sock = self._ctx.socket(zmq.DEALER)
        self._sock.setsockopt(zmq.ROUTING_ID, endpoint["identity"].encode())
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.SNDHWM, 0)
        self._sock.setsockopt(zmq.RCVHWM, 0)
        self._sock.connect(endpoint["address"])

    def send(self, data: bytes) -> None:
        self._sock.send(data, copy=len(data) < 65536)

    def recv(self, timeout: float | None = None) -> bytes | None:
        if timeout is not None and not self._sock.poll(max(0, int(timeout * 1000))):
            return None
        return self._sock.recv()

    def close(self) -> None:
        self._sock.close(0)
        self._ctx.term()


class ZmqServer:
    """The proxy's ROUTER socket; instance `n` connects with routing id `i<n>`."""

    kind = "zmq"

    def __init__(self, directory: Path, spin_s: float = DEFAULT_SPIN_S) -> None:
        import zmq

        self._zmq = zmq
        self.directory = Path(directory)
        self._path = path = self.directory / "functions.sock"
        self.address = f"ipc://{path}"
        self._ctx = zmq.Context(io_threads=1)
        self._sock = self._ctx.socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.SNDHWM, 0)
        self._sock.setsockopt(zmq.RCVHWM, 0)
        self._sock.bind(self.address)
        os.chmod(path, 0o600)
        # A doorbell FIFO only to wake the dispatcher from the proxy's own threads.
        self._bell_path = self.directory / "proxy.bell"
        Doorbell.make_fifo(self._bell_path)
        self._bell_fd = os.open(self._bell_path, os.O_RDWR | os.O_NONBLOCK)
        self._ids: dict[bytes, int] = {}
        self._routes: dict[int, bytes] = {}

    def add(self, instance_id: int) -> dict[str, Any]:
        identity = f"i{instance_id}"
        self._ids[identity.encode()] = instance_id
        self._routes[instance_id] = identity.encode()
        return {"kind": "zmq", "address": self.address, "identity": identity}

    def remove(self, instance_id: int) -> None:
        route = self._routes.pop(instance_id, None)
        if route is not None:
            self._ids.pop(route, None)

    def poll(self, deliver: Callable[[int, bytes], None]) -> int:
        zmq = self._zmq
        n = 0
        while self._sock.get(_EVENTS) & _POLLIN:  # cheaper than a failing NOBLOCK receive
            try:
                route, data = self._sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return n
            instance_id = self._ids.get(route)
            if instance_id is not None:  # unknown peers (a stale or foreign id) are ignored
                deliver(instance_id, data)
                n += 1
        return n

    def send(self, instance_id: int, data: bytes) -> None:
        route = self._routes.get(instance_id)
        if route is not None:
            self._sock.send_multipart([route, data], copy=len(data) < 65536)

    def has_input(self) -> bool:
        return bool(self._sock.get(_EVENTS) & _POLLIN)

    def prepare_sleep(self) -> bool:
        return not self.has_input()

    def after_sleep(self) -> None:
        drain_fd(self._bell_fd)

    def wake(self) -> None:
        with contextlib.suppress(BlockingIOError):
            os.write(self._bell_fd, b"\0")

    def poll_items(self) -> list[Any]:
        return [self._sock, self._bell_fd]

    def close(self) -> None:
        self._sock.close(0)
        self._ctx.term()
        os.close(self._bell_fd)
        for path in (self._bell_path, self._path):
            with contextlib.suppress(FileNotFoundError):
                path.unlink()


def make_server(
    kind: str, directory: Path, *, capacity: int = DEFAULT_RING_BYTES, spin_s: float = DEFAULT_SPIN_S
) -> ShmServer | ZmqServer:
    if kind == "shm":
        return ShmServer(directory, capacity, spin_s)
    if kind == "zmq":
        return ZmqServer(directory, spin_s)
    raise ValueError(f"unknown channel {kind!r}; choose one of {CHANNELS}")
