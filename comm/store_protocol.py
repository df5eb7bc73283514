"""The one store protocol: what the proxy's forwarded ops need from a communication store.

Two stores implement it: `CommStore` (StreamBox's managed, elastic store: a PUT adopts the producer's
buffer, PA and AM move data) and `IpcStore` (stream-only's CUDA-IPC style data passing: a PUT copies
into a fresh device allocation outside the memory pool and exports a handle; a GET opens it). The
proxy builds the one its `comm_store` setting names (`streambox.config.Mechanisms`) and types against
this protocol only.

Semantics both keep (docs/comm.md): a GET counts as one read when served and the key leaves after
`consumers` reads; handles are leases given back with `Handle.release(stream)` (stream-ordered) or all
at once with `release_owner(owner)`; `watch(key, callback)` is the non-blocking wait for a key's PUT.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol, runtime_checkable

import torch

from streambox.device import Runtime, Stream

from .handle import DeviceTensorLike, Handle, StoreStats
from .tables import Location

#: The stores the `comm_store` setting chooses from.
STORE_KINDS = ("managed", "ipc")


@runtime_checkable
class Store(Protocol):
    """A node's PUT/GET/DELETE by key (see the module doc)."""

    stats: StoreStats

    def start(self) -> Store: ...

    def close(self) -> None: ...

    def runtime(self, gpu: int) -> Runtime: ...

    def put(
        self,
        key: str,
        value: torch.Tensor | DeviceTensorLike,
        *,
        device: int | None = None,
        consumers: int | None = None,
        ttl: float | None = None,
        overwrite: bool = False,
        stream: Stream | None = None,
    ) -> Location:
        """Store `value` under `key`; returns where the bytes are. A returned address equal to a device
        tensor's own means the store adopted the producer's buffer (it frees it); any other means it
        copied them and the buffer stays the producer's."""
        ...

    def get(
        self, key: str, *, device: int | None = None, timeout: float | None = None, owner: str | None = None
    ) -> Handle: ...

    def watch(self, key: str, callback: Callable[[], None]) -> Callable[[], None]: ...

    def delete(self, key: str) -> bool: ...

    def keys(self) -> list[str]: ...

    def usage(self) -> dict[int, int]: ...

    def release_owner(self, owner: str) -> int: ...

    def _release_lease(self, lease_id: int, stream: Stream | None, device: int | None = None) -> None:
        """What `Handle.release` calls."""
        ...


def adopted(location: Location, tensor: DeviceTensorLike, device: int) -> bool:
    """Whether a PUT of `tensor` on GPU `device` left the store holding the producer's bytes themselves."""
    return location.device == device and location.address == int(tensor.address)
