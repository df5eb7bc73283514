"""Models resident on a device, and where device bytes come from.

`DeviceModel` is a plan whose weights live on one device (with tensor views over them, built once).
Weights are allocated (`allocate_weights`) and copied (`copy_weights`) in separate steps, so that the
IO daemon can replace the copies; `upload_model` does both, `free_model` gives them back.

Device bytes come from an `Allocator`: `memory_pool.DeviceMemoryPool` (the runtime's pool, which
every byte of a proxy comes from) or `StreamPoolAllocator` (the device's own stream-ordered pool);
`free_all` frees a batch through either.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Protocol

import torch

from streambox.device import MemoryPool, Runtime, Stream
from streambox.device.base import contiguous_strides
from streambox.kernel_compiler.plan import KernelPlan

from .device_tensor import DeviceTensor
from .plan_program import PlanProgram

__all__ = [
    "Allocator",
    "DeviceModel",
    "StreamPoolAllocator",
    "allocate_weights",
    "copy_weights",
    "free_all",
    "free_model",
    "upload_model",
]


class Allocator(Protocol):
    """Where the executor takes device bytes from (stream-ordered; `stream` is passed by keyword)."""

    def allocate(self, nbytes: int, stream: Stream) -> int: ...

    def free(self, address: int, stream: Stream) -> None: ...


class StreamPoolAllocator:
    """The device's stream-ordered pool (cuMemPool-like), one per runtime: the simple allocator."""

    def __init__(self, runtime: Runtime, release_threshold: int = 0) -> None:
        self.pool: MemoryPool = runtime.create_pool(release_threshold)

    def allocate(self, nbytes: int, stream: Stream) -> int:
        return self.pool.alloc_async(nbytes, stream)

    def free(self, address: int, stream: Stream) -> None:
        self.pool.free_async(address, stream)


def free_all(allocator: Allocator, addresses: Iterable[int], stream: Stream, *, fence: bool = False) -> None:
    """Free addresses stream-ordered, in one batch when the allocator takes batches (`free_many`).

    `fence=True`: no more frees follow on this stream soon, so ask the allocator (if it batches
    fences, as `DeviceMemoryPool` does) to make them free for every stream once the stream gets here.
    """
    free_many = getattr(allocator, "free_many", None)
    if free_many is not None:
        free_many(addresses, stream)
    else:
        for address in addresses:
            allocator.free(address, stream)
    fence_fn = getattr(allocator, "fence", None) if fence else None
    if fence_fn is not None:
        fence_fn(stream)


@dataclass
class DeviceModel:
    """A plan whose weights are resident on one device."""

    plan: KernelPlan
    weights: dict[str, DeviceTensor]
    # Tensor views over the resident weights, built once: a run only makes views of what it allocates.
    weight_views: dict[str, torch.Tensor] = field(default_factory=dict, repr=False)
    _program: PlanProgram | None = field(default=None, repr=False)

    @property
    def weight_bytes(self) -> int:
        return sum(t.nbytes for t in self.weights.values())

    @property
    def program(self) -> PlanProgram:
        """The plan resolved for the executor, once per model (see `plan_program`)."""
        if self._program is None:
            self._program = PlanProgram.of(self.plan)
        return self._program


def allocate_weights(runtime: Runtime, plan: KernelPlan, allocator: Allocator, stream: Stream) -> DeviceModel:
    """Device memory for every weight of `plan` (no copy yet: see `copy_weights`)."""
    weights: dict[str, DeviceTensor] = {}
    try:
        for var in plan.vars_of_kind("weight"):
            address = allocator.allocate(var.nbytes, stream)
            weights[var.name] = DeviceTensor(
                address, var.torch_dtype, tuple(var.shape), contiguous_strides(var.shape), var.nbytes
            )
    except BaseException:  # e.g. out of memory half-way: nothing half-loaded stays
        free_all(allocator, [t.address for t in weights.values()], stream, fence=True)
        raise
    views = {name: tensor.view(runtime) for name, tensor in weights.items()}
    return DeviceModel(plan, weights, views)


def copy_weights(
    runtime: Runtime, model: DeviceModel, stream: Stream, tensors: Mapping[str, torch.Tensor] | None = None
) -> None:
    """Copy the weights into their device memory on `stream` (the IO daemon replaces this direct path)."""
    tensors = model.plan.load_weights() if tensors is None else tensors
    for name, handle in model.weights.items():
        host = tensors[name].detach().contiguous()
        if host.numel() * host.element_size() != handle.nbytes:
            raise ValueError(
                f"weight {name}: {host.numel() * host.element_size()} bytes, expected {handle.nbytes}"
            )
        runtime.copy_htod_async(handle.address, host.view(-1).view(torch.uint8), handle.nbytes, stream)


def upload_model(runtime: Runtime, plan: KernelPlan, allocator: Allocator, stream: Stream) -> DeviceModel:
    """Allocate and copy every weight of `plan` (`allocate_weights` then `copy_weights`)."""
    model = allocate_weights(runtime, plan, allocator, stream)
    try:
        copy_weights(runtime, model, stream)
    except BaseException:
        free_model(model, allocator, stream)
        raise
    return model


def free_model(model: DeviceModel, allocator: Allocator, stream: Stream) -> None:
    free_all(allocator, [t.address for t in model.weights.values()], stream, fence=True)
    model.weights.clear()
    model.weight_views.clear()


def release_generation(allocator: Allocator) -> Callable[[], int] | None:
    """How often the allocator has given memory back to the device (`DeviceMemoryPool` counts its
    trims), or None for an allocator that does not say: then bound calls and tensors are kept for
    one run only, since an address may be backed anew between runs."""
    counters = getattr(allocator, "counters", None)
    if counters is None or not isinstance(getattr(counters, "trims", None), int):
        return None
    return lambda: counters.trims
