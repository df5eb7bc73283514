"""Cross-node transport: a pyzmq server per node, a chunked fetch client, and a peer-polling global table.

Wire format: the client (DEALER) sends `[command, msgpack(body)]`; the server (ROUTER) answers
`[status, msgpack(body)]` plus one raw data frame for `read`. Status is `ok`, `missing` or `err`.

- `open {key, owner}` leases the key's bytes on the owning node (this counts as the key's read) and
  answers its layout: `{lease, nbytes, dtype, shape, strides}`.
- `read {lease, offset, size}` answers `{offset, size}` and the bytes.
- `close {lease}` releases the lease. The server also releases every lease of a client on shutdown,
  and the store's lease TTL covers a client that died mid-transfer.
- `table {}` answers the node's mapping table; `delete {key}` deletes a key there.

Bounded memory: the client keeps at most `pipeline` reads in flight and receives each chunk straight
into one chunk-sized host buffer (`recv_into`), which the sink copies to the reader's GPU before the
next chunk is taken; the server stages each chunk through one host buffer per GPU. So a transfer holds
at most `pipeline * chunk_bytes` bytes in flight plus one staging chunk per side, whatever its size.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections import deque
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import msgpack
import torch
import zmq

from streambox.device import HostBuffer

from .errors import CommError, RemoteError
from .tables import GlobalSnapshot, Location, merge_nodes

if TYPE_CHECKING:
    from .store import CommStore

log = logging.getLogger(__name__)

OK, MISSING, ERR = b"ok", b"missing", b"err"


def _pack(body: Mapping[str, Any]) -> bytes:
    return msgpack.packb(dict(body), use_bin_type=True)


def _unpack(data: bytes) -> dict[str, Any]:
    return msgpack.unpackb(data, raw=False)


class RpcServer:
    """Serves one store's keys to other nodes on a ROUTER socket, from one thread."""

    def __init__(self, store: CommStore, bind: str = "tcp://127.0.0.1:*", poll_ms: int = 50) -> None:
        self._store = store
        self._bind = bind
        self._poll_ms = poll_ms
        self._ready = threading.Event()
        self._stop = threading.Event()
        self._error: BaseException | None = None
        self.endpoint = ""
        self._thread = threading.Thread(
            target=self._serve, name=f"streambox-comm-rpc-{store.node}", daemon=True
        )
        self._thread.start()
        self._ready.wait()
        if self._error is not None:
            raise RemoteError(f"node {store.node}: cannot serve on {bind}: {self._error}") from self._error
        store.endpoint = self.endpoint

    def __repr__(self) -> str:
        return f"<RpcServer {self._store.node} at {self.endpoint}>"

    def _serve(self) -> None:
        sock = zmq.Context.instance().socket(zmq.ROUTER)
        sock.linger = 0
        try:
            sock.bind(self._bind)
            self.endpoint = sock.getsockopt_string(zmq.LAST_ENDPOINT)
        except zmq.ZMQError as exc:
            self._error = exc
            sock.close()
            self._ready.set()
            return
        self._ready.set()
        staging: dict[int, HostBuffer] = {}
        leases: dict[bytes, set[int]] = {}
        poller = zmq.Poller()
        poller.register(sock, zmq.POLLIN)
        try:
            while not self._stop.is_set():
                if not poller.poll(self._poll_ms):
                    continue
                frames = sock.recv_multipart()
                ident, command = frames[0], frames[1]
                body = _unpack(frames[2]) if len(frames) > 2 else {}
                try:
                    reply = self._answer(ident, command, body, staging, leases)
                except Exception as exc:  # one bad request must not stop the node's server
                    reply = [ERR, _pack({"message": f"{type(exc).__name__}: {exc}"})]
                sock.send_multipart([ident, *reply], copy=True)
        finally:
            for held in leases.values():
                for lease_id in held:
                    self._store.close_remote(lease_id)
            for buf in staging.values():
                buf.free()
            sock.close()

    def _answer(
        self, ident: bytes, command: bytes, body: dict[str, Any], staging: dict[int, HostBuffer],
        leases: dict[bytes, set[int]],
    ) -> list[bytes]:
        store = self._store
        if command == b"open":
            opened = store.open_remote(str(body["key"]), str(body.get("owner") or f"rpc:{ident.hex()}"))
            if opened is None:
                return [MISSING, _pack({"node": store.node})]
            lease_id, info = opened
            leases.setdefault(ident, set()).add(lease_id)
            return [OK, _pack({"lease": lease_id, **info})]
        if command == b"read":
            lease_id, offset, size = int(body["lease"]), int(body["offset"]), int(body["size"])
            if lease_id not in leases.get(ident, ()):
                raise CommError(f"lease {lease_id} is not held by this client")
            data = store.read_remote(lease_id, offset, size, staging)
            return [OK, _pack({"offset": offset, "size": size}), data]
        if command == b"close":
            lease_id = int(body["lease"])
            if lease_id in leases.get(ident, ()):
                leases[ident].discard(lease_id)
                store.close_remote(lease_id)
            return [OK, _pack({})]
        if command == b"table":
            entries = [loc.to_wire() for loc in store.table_snapshot().values()]
            return [OK, _pack({"node": store.node, "endpoint": self.endpoint, "entries": entries})]
        if command == b"delete":
            return [OK, _pack({"deleted": store.delete(str(body["key"]))})]
        raise CommError(f"unknown command {command!r}")

    def close(self) -> None:
        self._stop.set()
        self._thread.join()

    def __enter__(self) -> RpcServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


@contextlib.contextmanager
def _connect(endpoint: str) -> Iterator[zmq.Socket]:
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.linger = 0
    sock.connect(endpoint)
    try:
        yield sock
    finally:
        sock.close()


def _recv_header(
    sock: zmq.Socket, endpoint: str, timeout_s: float, what: str
) -> tuple[bytes, dict[str, Any]]:
    if not sock.poll(int(timeout_s * 1000)):
        raise RemoteError(f"{what}: no answer from {endpoint} within {timeout_s:g} s")
    status = sock.recv()
    body = _unpack(sock.recv())
    if status == ERR:
        while sock.getsockopt(zmq.RCVMORE):
            sock.recv()
        raise RemoteError(f"{what}: {endpoint} answered: {body.get('message')}")
    return status, body


def call(endpoint: str, command: str, body: Mapping[str, Any], timeout_s: float = 5.0) -> tuple[bytes, dict]:
    """One request and its answer (status, body); raises RemoteError on an error or a timeout."""
    with _connect(endpoint) as sock:
        sock.send_multipart([command.encode(), _pack(body)])
        return _recv_header(sock, endpoint, timeout_s, f"{command} at {endpoint}")


@dataclass(frozen=True)
class TransferStats:
    nbytes: int
    chunks: int
    max_in_flight_bytes: int  # requested but not yet written to the reader's GPU


Sink = Callable[[dict[str, Any]], Callable[[int, torch.Tensor], None]]


def fetch_remote(
    endpoint: str,
    key: str,
    sink: Sink,
    *,
    owner: str,
    chunk_bytes: int = 4 << 20,
    pipeline: int = 2,
    timeout_s: float = 10.0,
) -> TransferStats | None:
    """Stream the bytes of `key` from the node at `endpoint`; None when it does not hold the key.

    `sink(layout)` is called once with {nbytes, dtype, shape, strides} and returns `write(offset,
    chunk)`, which must have consumed `chunk` (a view of a reused buffer) when it returns.
    """
    what = f"GET {key!r} from {endpoint}"
    with _connect(endpoint) as sock:
        sock.send_multipart([b"open", _pack({"key": key, "owner": owner})])
        status, info = _recv_header(sock, endpoint, timeout_s, what)
        if status == MISSING:
            return None
        lease, nbytes = int(info["lease"]), int(info["nbytes"])
        try:
            write = sink(info)
            buffer = torch.empty(max(min(chunk_bytes, nbytes), 1), dtype=torch.uint8)
            view = memoryview(buffer.numpy())
            pending: deque[tuple[int, int]] = deque()
            next_offset, chunks, peak = 0, 0, 0

            def request() -> None:
                nonlocal next_offset
                size = min(chunk_bytes, nbytes - next_offset)
                sock.send_multipart([b"read", _pack({"lease": lease, "offset": next_offset, "size": size})])
                pending.append((next_offset, size))
                next_offset += size

            while next_offset < nbytes and len(pending) < pipeline:
                request()
            while pending:
                peak = max(peak, sum(size for _, size in pending))
                _, header = _recv_header(sock, endpoint, timeout_s, what)
                offset, size = pending.popleft()
                if (int(header["offset"]), int(header["size"])) != (offset, size):
                    raise RemoteError(f"{what}: chunk {header} arrived out of order (expected {offset})")
                got = sock.recv_into(view, nbytes=size)
                if got != size:
                    raise RemoteError(f"{what}: chunk at {offset} has {got} bytes, expected {size}")
                write(offset, buffer[:size])
                chunks += 1
                if next_offset < nbytes:
                    request()
        finally:
            sock.send_multipart([b"close", _pack({"lease": lease})])
            with contextlib.suppress(RemoteError):
                _recv_header(sock, endpoint, min(timeout_s, 1.0), what)
    return TransferStats(nbytes, chunks, peak)


class RpcGlobalTable:
    """A global table made of the peers' own node tables, asked over RPC at each snapshot.

    `publish` does nothing: each node serves its table from its `RpcServer`. An unreachable peer is
    skipped (its keys are invisible until it answers again).
    """

    def __init__(self, peers: Mapping[str, str], timeout_s: float = 1.0) -> None:
        self.peers = dict(peers)
        self.timeout_s = timeout_s

    def publish(self, node: str, endpoint: str | None, entries: Mapping[str, Location]) -> None:
        return None

    def snapshot(self) -> GlobalSnapshot:
        tables: dict[str, dict[str, Location]] = {}
        for node, endpoint in self.peers.items():
            try:
                _, body = call(endpoint, "table", {}, self.timeout_s)
            except RemoteError as exc:
                log.warning("global table: node %s skipped: %s", node, exc)
                continue
            tables[node] = {e["key"]: Location.from_wire(e) for e in body["entries"]}
        return merge_nodes(tables, self.peers)
