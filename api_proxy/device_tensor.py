"""Handles to tensors in device memory, and the plain ways in and out of the device."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from streambox.device import Runtime, Stream


@dataclass(frozen=True)
class DeviceTensor:
    """A tensor living in device memory: a handle (address and layout), not the bytes."""

    address: int
    dtype: torch.dtype
    shape: tuple[int, ...]
    strides: tuple[int, ...]
    nbytes: int

    def view(self, runtime: Runtime) -> torch.Tensor:
        """A torch tensor over the device bytes (no copy), for kernels."""
        return runtime.view(self.address, self.dtype, self.shape, self.strides)


def upload_tensor(
    runtime: Runtime, tensor: torch.Tensor, allocate: Callable[[int, Stream], int], stream: Stream
) -> DeviceTensor:
    """Copy a CPU tensor to newly allocated device memory on `stream` (pageable: staged at issue)."""
    tensor = tensor.detach().contiguous()
    nbytes = tensor.numel() * tensor.element_size()
    address = allocate(nbytes, stream)
    runtime.copy_htod_async(address, tensor.view(-1).view(torch.uint8), nbytes, stream)
    return DeviceTensor(address, tensor.dtype, tuple(tensor.shape), tuple(tensor.stride()), nbytes)


def download_tensor(runtime: Runtime, handle: DeviceTensor, stream: Stream) -> torch.Tensor:
    """Copy a device tensor back to a new CPU tensor; waits for `stream` to reach the copy."""
    host = torch.empty(handle.nbytes, dtype=torch.uint8)
    runtime.copy_dtoh_async(host, handle.address, handle.nbytes, stream)
    stream.synchronize()
    return host.view(handle.dtype).as_strided(handle.shape, handle.strides)
