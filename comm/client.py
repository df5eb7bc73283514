"""The function side of PUT/GET: one function instance's view of its proxy's store.

Today the client calls the proxy's `CommStore` in the same process; the forwarding channel (a later
issue) will carry exactly these calls to the proxy. The client fills in what the proxy knows about the
instance: its GPU, its stream (readers wait for producers on it, frees wait for its kernels) and its
owner id (everything it holds is released when it dies).
"""

from __future__ import annotations

import torch

from streambox.device import Stream

from .lease import DeviceTensorLike, Lease
from .store import CommStore
from .tables import Location


class FunctionClient:
    """`writer`: the function's name, under which its PUTs count against its share of the store's
    quota (`quota.writer_share`); None: the totals only."""

    def __init__(
        self,
        store: CommStore,
        device: int,
        owner: str,
        stream: Stream | None = None,
        writer: str | None = None,
    ) -> None:
        store.runtime(device)  # fails early for a GPU the node does not have
        self.store, self.device, self.owner, self.stream = store, device, owner, stream
        self.writer = writer

    def __repr__(self) -> str:
        return f"<FunctionClient {self.owner} gpu{self.device} of {self.store.node}>"

    def put(
        self,
        key: str,
        value: torch.Tensor | DeviceTensorLike,
        consumers: int | None = None,
        ttl: float | None = None,
        overwrite: bool = False,
    ) -> Location:
        return self.store.put(
            key, value, device=self.device, consumers=consumers, ttl=ttl, overwrite=overwrite,
            stream=self.stream, writer=self.writer,
        )

    def get(self, key: str, timeout: float | None = None) -> Lease:
        """The data of `key` on this function's GPU; this function's stream waits for its producer."""
        handle = self.store.get(key, device=self.device, timeout=timeout, owner=self.owner)
        if self.stream is not None:
            handle.wait(self.stream)
        return handle

    def release(self, handle: Lease) -> None:
        """Hand a GET's handle back once the work issued to this function's stream is done with it."""
        handle.release(self.stream)

    def delete(self, key: str) -> bool:
        return self.store.delete(key)

    def close(self) -> int:
        """The instance is gone: release every handle it still holds. Returns how many."""
        return self.store.release_owner(self.owner)
