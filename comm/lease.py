"""What a GET hands out (`Lease`: the reader's hold on device bytes until it releases them) and the
small types the stores share.

Not to be confused with `streambox.Handle` (api_proxy/handles.py), the one handle a function sees: a
plain wire reference to a buffer of its workflow's proxy. The proxy takes a `Lease` from its store on
a function's GET and hands the function a `Handle` of the lease's bytes; the lease stays in the proxy.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

import torch

from streambox.device import Event, Runtime, Stream

from .errors import CommError
from .tables import dtype_name

if TYPE_CHECKING:
    from .store_protocol import Store


class Allocator(Protocol):
    """Where the store takes device bytes from: the memory pool's stream-ordered interface.

    Two optional methods are used when present (`DeviceMemoryPool` has both): `fence(stream)` after
    each free (the store's free streams never allocate, so there is no reuse to wait for), and
    `retire_stream(stream)` before the store destroys one of its streams (the frees still tracked on
    it are given back and the allocator forgets the stream).
    """

    def allocate(self, nbytes: int, stream: Stream) -> int: ...

    def free(self, address: int, stream: Stream) -> None: ...


class DeviceTensorLike(Protocol):
    address: int
    dtype: torch.dtype
    shape: tuple[int, ...]
    strides: tuple[int, ...]
    nbytes: int


class Transport(enum.Enum):
    SAME_GPU = "same-gpu"  # the stored address itself
    PEER = "peer-copy"  # another GPU of the node
    HOST = "host-to-device"  # data the store moved to host memory
    IPC = "ipc-handle"  # the producer's exported CUDA IPC handle, opened by the reader (IpcStore)
    RPC = "rpc"  # another node


def location_name(device: int) -> str:
    """How stats name a location: `gpu<i>` or `host` (the `HOST` index, -1)."""
    return "host" if device < 0 else f"gpu{device}"


def count_into(table: dict[str, dict[str, int]], where: str, nbytes: int) -> None:
    """One more transfer of `nbytes` under `where` in a {where: {"count", "bytes"}} table."""
    row = table.setdefault(where, {"count": 0, "bytes": 0})
    row["count"] += 1
    row["bytes"] += nbytes


def span_bytes(shape: tuple[int, ...], strides: tuple[int, ...], itemsize: int) -> int:
    """Bytes from a strided tensor's first element to the end of its last one."""
    if any(d == 0 for d in shape):
        return 0
    return (1 + sum((d - 1) * s for d, s in zip(shape, strides, strict=True))) * itemsize


@dataclass
class StoreStats:
    puts: int = 0
    gets: dict[str, int] = field(default_factory=lambda: {t.value: 0 for t in Transport})
    relocations: int = 0  # rule 1 at GET time
    moves: dict[str, int] = field(default_factory=dict)  # by rule
    # Moves by path: "pressure" (PA, ahead of demand) or "reclaim" (on an allocation's critical
    # path), to "gpu" or "host": e.g. "reclaim->host". Counts and bytes, to price them by a link model.
    move_count: dict[str, int] = field(default_factory=dict)
    move_bytes: dict[str, int] = field(default_factory=dict)
    bytes_moved: int = 0
    # Moves by destination ("gpu2", "host"): {"count": n, "bytes": b}. With several GPUs, AM's
    # neighbour-first rule shows here as moves to GPUs before any to host.
    moved_to: dict[str, dict[str, int]] = field(default_factory=dict)
    # GETs served by a copy (peer-copy or host-to-device), by where the data was: {"count", "bytes"}.
    copied_from: dict[str, dict[str, int]] = field(default_factory=dict)
    move_seconds: float = 0.0
    reclaims: int = 0
    reclaim_seconds: float = 0.0
    expired_keys: int = 0
    expired_leases: int = 0
    rpc_chunks: int = 0
    rpc_max_in_flight_bytes: int = 0


@dataclass(eq=False)
class Lease:
    """What a GET returns: a device tensor on the reader's GPU, held as a lease until released.

    It has the fields of `api_proxy.device_tensor.DeviceTensor` (address, dtype, shape, strides,
    nbytes) and its `view(runtime)`, so it can be passed wherever one is expected.
    """

    _store: Store  # CommStore or IpcStore
    lease_id: int
    key: str
    device: int
    address: int
    dtype: torch.dtype
    shape: tuple[int, ...]
    strides: tuple[int, ...]
    nbytes: int
    transport: Transport
    ready: Event | None  # the producer's writes are done when it completes (None: already done)
    _released: bool = field(default=False, init=False)

    def __repr__(self) -> str:
        state = "released" if self._released else "held"
        return (
            f"<Lease {self.key!r} gpu{self.device} {self.address:#x} {dtype_name(self.dtype)}"
            f"{list(self.shape)} {self.transport.value} {state}>"
        )

    @property
    def released(self) -> bool:
        return self._released

    def view(self, runtime: Runtime | None = None) -> torch.Tensor:
        """A torch tensor over the bytes (no copy). Kernels on another stream should `wait` first."""
        if self._released:
            raise CommError(f"handle of {self.key!r} has been released")
        rt = runtime if runtime is not None else self._store.runtime(self.device)
        return rt.view(self.address, self.dtype, self.shape, self.strides)

    def wait(self, stream: Stream) -> None:
        """Make later work on `stream` wait until the producer's writes are done."""
        if self.ready is not None:
            stream.wait_event(self.ready)

    def release(self, stream: Stream | None = None) -> None:
        """Give the lease back. With `stream`, the bytes are freed only after the work issued to it so
        far (the reader's kernels over this handle). Idempotent."""
        if not self._released:
            self._released = True
            self._store._release_lease(self.lease_id, stream, self.device)

    def _expired(self) -> None:
        self._released = True

    def __enter__(self) -> Lease:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()
