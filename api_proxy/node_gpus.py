"""The node's other GPUs as the proxy's communication store sees them: AM's neighbours.

A node has `gpus` GPUs (`--gpus N`); a proxy runs its functions on one of them (its home, chosen by
the invoker's placement). With AM on and more than one GPU, the proxy also opens a context on every
other GPU of the node, as a CUDA process that touches a device does (that costs `context_memory`
there, and `context_create_s`, opened in parallel with the home context), so that its store can move
data to the least-pressured neighbour before host and peer-copy it back on a GET (paper section 6.2,
Fig. 8). Each neighbour's bytes come from a stream-ordered pool of that context with release
threshold 0: memory the store frees there goes back to the device at once, for the proxies placed
on that GPU. A neighbour's pressure is what its device reports free now (the node's shared ledger:
every process's allocations) plus the store's own bytes there; its demand model lives in the
proxies placed on it, which this proxy does not see. With AM off, or one GPU, nothing is opened:
data leaving the home GPU goes to host memory.
"""

from __future__ import annotations

import concurrent.futures
from dataclasses import dataclass, field

from streambox.device import Backend, Runtime

from .executor import StreamPoolAllocator


def neighbour_indices(home: int, gpus: int, adaptive: bool) -> list[int]:
    """The GPUs the store may move data to besides `home`: every other one with AM on, else none.
    A one-GPU node has none, whatever `home` (the CUDA backend may run a proxy on any device)."""
    if gpus <= 1 or not adaptive:
        return []
    if not 0 <= home < gpus:
        raise ValueError(f"home GPU {home} is not one of the node's {gpus} GPUs (0..{gpus - 1})")
    return [g for g in range(gpus) if g != home]


@dataclass
class Neighbours:
    """Contexts on the neighbour GPUs and the store's allocator on each."""

    runtimes: dict[int, Runtime] = field(default_factory=dict)
    allocators: dict[int, StreamPoolAllocator] = field(default_factory=dict)

    def close(self) -> None:
        """After the store closed (its streams synchronized and destroyed): pools, then contexts."""
        for gpu, runtime in self.runtimes.items():
            allocator = self.allocators.get(gpu)
            if allocator is not None:
                allocator.pool.destroy()
            runtime.close()
        self.runtimes.clear()
        self.allocators.clear()


def start_opening(backend: Backend, indices: list[int]) -> concurrent.futures.Future[Neighbours]:
    """`open_neighbours` on a thread of its own, so that the proxy opens its home context meanwhile."""
    opener = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="streambox-neighbours")
    try:
        return opener.submit(open_neighbours, backend, indices)
    finally:
        opener.shutdown(wait=False)  # the thread ends with its one task


def open_neighbours(backend: Backend, indices: list[int]) -> Neighbours:
    """Open a context and a pool on each of `indices`, in parallel (context creation is a wait)."""
    neighbours = Neighbours()
    if not indices:
        return neighbours
    with concurrent.futures.ThreadPoolExecutor(len(indices), thread_name_prefix="streambox-neighbour") as ex:
        futures = {g: ex.submit(backend.open_runtime, g) for g in indices}
        concurrent.futures.wait(futures.values())
    failed = None
    for g, future in futures.items():
        if future.exception() is None:
            neighbours.runtimes[g] = future.result()
        else:
            failed = failed or future.exception()
    if failed is not None:
        neighbours.close()
        raise failed
    neighbours.allocators = {g: StreamPoolAllocator(rt) for g, rt in neighbours.runtimes.items()}
    return neighbours
