"""The one store protocol: what the proxy's forwarded ops need from a communication store.

`KeyStore` is the narrower protocol it extends: PUT/GET/DELETE by key, which the function-side stores
of run-local and the baselines implement too. Two stores implement `Store`: `CommStore` (StreamBox's
managed, elastic store: a PUT adopts the producer's buffer, PA and AM move data) and `IpcStore`
(stream-only's CUDA-IPC style data passing: a PUT copies into a fresh device allocation outside the
memory pool and exports a handle; a GET opens it). The proxy builds the one its `comm_store` setting
names (`streambox.config.Mechanisms`) and types against this protocol only.

Semantics both keep (docs/comm.md): a GET counts as one read when served and the key leaves after
`consumers` reads; handles are leases given back with `Lease.release(stream)` (stream-ordered) or all
at once with `release_owner(owner)`; `watch(key, callback)` is the non-blocking wait for a key's PUT.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any, Protocol, runtime_checkable

import torch

from streambox.device import Runtime, Stream

from .lease import DeviceTensorLike, Lease, StoreStats
from .tables import Location

#: The stores the `comm_store` setting chooses from.
STORE_KINDS = ("managed", "ipc")


@runtime_checkable
class KeyStore(Protocol):
    """PUT/GET/DELETE by key, the part every store shares: the proxy's (`Store`, below) and the
    function-side stores of run-local and the baselines (`workflows.local.LocalStore`, INFless's
    `workflows.monolithic_instance.RedisStore`, Astraea's `workflows.monolithic_ipc.IpcHandleStore`).

    `put` takes the value and the producer's `stream` (the bytes are ready once the work issued to it
    so far is done; None: ready now); `consumers` reads take the key away, `ttl` seconds expire it.
    `get` waits up to `timeout` seconds for the key's PUT (None: the store's default). `delete` says
    whether the key was there. What a GET returns is the store's own: a `Lease` from a `Store`, a
    `Got` from a function-side store. Stores may take further keyword arguments with defaults (the
    proxy's `device`, `owner`, `overwrite`; the function side's `owner` request and reader `stream`).
    """

    def put(
        self,
        key: str,
        value: Any,
        *,
        consumers: int | None = None,
        ttl: float | None = None,
        stream: Stream | None = None,
    ) -> Any: ...

    def get(self, key: str, *, timeout: float | None = None) -> Any: ...

    def delete(self, key: str) -> bool: ...

    def close(self) -> None: ...


@runtime_checkable
class Store(KeyStore, Protocol):
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
        writer: str | None = None,
    ) -> Location:
        """Store `value` under `key`; returns where the bytes are. A returned address equal to a device
        tensor's own means the store adopted the producer's buffer (it frees it); any other means it
        copied them and the buffer stays the producer's. `writer`: the function that PUTs it, held to
        its share of the quota (`quota.writer_share`)."""
        ...

    def get(
        self, key: str, *, device: int | None = None, timeout: float | None = None, owner: str | None = None
    ) -> Lease: ...

    def watch(self, key: str, callback: Callable[[], None]) -> Callable[[], None]: ...

    def delete(self, key: str) -> bool: ...

    def keys(self) -> list[str]: ...

    def usage(self) -> dict[int, int]: ...

    def snapshot(self) -> dict[str, Any]:
        """What `stats` shows of the store (JSON-ready): GPUs, bytes per location, counters."""
        ...

    def release_owner(self, owner: str) -> int: ...

    def _release_lease(self, lease_id: int, stream: Stream | None, device: int | None = None) -> None:
        """What `Lease.release` calls."""
        ...


def adopted(location: Location, tensor: DeviceTensorLike, device: int) -> bool:
    """Whether a PUT of `tensor` on GPU `device` left the store holding the producer's bytes themselves."""
    return location.device == device and location.address == int(tensor.address)


# -- what both stores share ----------------------------------------------------------------------
def check_put_args(key: object, consumers: object) -> None:
    """A PUT's key (a non-empty string) and consumers (a positive int, or None)."""
    if not isinstance(key, str) or not key:
        raise ValueError(f"keys are non-empty strings, got {key!r}")
    if consumers is not None and (  # True is an int, but no count
        isinstance(consumers, bool) or not isinstance(consumers, int) or consumers < 1
    ):
        raise ValueError(f"PUT {key!r}: consumers must be a positive int or None, got {consumers!r}")


Layout = tuple[int, torch.dtype, tuple[int, ...], tuple[int, ...]]


def tensor_layout(key: str, value: DeviceTensorLike) -> Layout:
    """(address, dtype, shape, strides) of a device tensor a PUT was given, or a TypeError naming it."""
    try:
        address, dtype = int(value.address), value.dtype
        shape, strides = tuple(int(d) for d in value.shape), tuple(int(s) for s in value.strides)
    except AttributeError as exc:
        raise TypeError(
            f"PUT {key!r}: expected a CPU tensor or a device tensor (address, dtype, shape, strides, "
            f"nbytes), got {type(value).__name__}"
        ) from exc
    return address, dtype, shape, strides


class PutWatchers:
    """One-shot notifications of a key's next PUT (`Store.watch`), kept under the store's lock."""

    def __init__(self, lock: threading.Condition) -> None:
        self._lock = lock
        self._by_key: dict[str, list[Callable[[], None]]] = {}

    def watch(
        self, key: str, callback: Callable[[], None], present: Callable[[], bool]
    ) -> Callable[[], None]:
        """Call `callback()` after the next PUT of `key`, or at once if `present()`; returns a cancel."""
        with self._lock:
            here = present()
            if not here:
                self._by_key.setdefault(key, []).append(callback)
        if here:
            callback()

        def cancel() -> None:
            with self._lock:
                waiting = self._by_key.get(key)
                if waiting and callback in waiting:
                    waiting.remove(callback)
                    if not waiting:
                        del self._by_key[key]

        return cancel

    def take(self, key: str) -> list[Callable[[], None]]:
        """The callbacks of `key`'s PUT (under the lock; call them outside it)."""
        return self._by_key.pop(key, [])
