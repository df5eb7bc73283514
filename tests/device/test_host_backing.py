"""Released host backing of the functional emulator is reused by the next allocation of its size,
within a budget, without touching device memory accounting."""

from __future__ import annotations

import torch

from streambox.device.host_backing import SpareBacking

MiB = 1 << 20


def test_a_released_tensor_backs_the_next_reservation_of_its_size_within_the_budget():
    spare = SpareBacking(limit_bytes=3 * MiB)
    first = spare.take(2 * MiB)
    spare.give(first)
    assert spare.bytes == 2 * MiB
    assert spare.take(1 * MiB).data_ptr() != first.data_ptr()  # another size: a fresh tensor
    again = spare.take(2 * MiB)
    assert again.data_ptr() == first.data_ptr() and spare.reused == 1 and spare.bytes == 0
    spare.give(again)
    spare.give(torch.empty(2 * MiB, dtype=torch.uint8))  # over the budget: dropped
    assert spare.bytes == 2 * MiB


def test_device_memory_freed_is_free_on_the_device_while_its_host_backing_is_reused(rt):
    free_before, _ = rt.memory_info()
    address = rt.mem_alloc(4 * MiB)
    backing = rt.view(address, torch.uint8, (4 * MiB,)).data_ptr()
    rt.mem_free(address)
    assert rt.memory_info()[0] == free_before  # the device has the bytes back
    again = rt.mem_alloc(4 * MiB)
    assert again != address  # a new device address (freed ones stay dead) ...
    assert rt.view(again, torch.uint8, (4 * MiB,)).data_ptr() == backing  # ... on the same host pages
    rt.mem_free(again)
