"""The stream-ordered memory pool of the emulated backend (cuMemPool semantics)."""

from __future__ import annotations

import pytest
import torch

from streambox.device.base import DeviceError, InvalidAddress, OutOfDeviceMemory
from streambox.device.specs import MiB

from .conftest import hold


def test_pool_reuses_freed_blocks(rt):
    s = rt.create_stream()
    pool = rt.create_pool(release_threshold=64 * MiB)
    a = pool.alloc_async(MiB, s)
    assert (pool.reserved_bytes, pool.used_bytes, rt.allocated_bytes()) == (MiB, MiB, MiB)
    pool.free_async(a, s)
    s.synchronize()
    assert (pool.reserved_bytes, pool.used_bytes) == (MiB, 0)
    b = pool.alloc_async(MiB - 100, s)  # best fit: the cached block
    assert b == a
    assert (pool.reserved_bytes, pool.used_bytes, rt.allocated_bytes()) == (MiB, MiB, MiB)
    c = pool.alloc_async(256, s)  # the cached block would waste too much: a new one
    assert c != a and pool.reserved_bytes == MiB + 256
    pool.free_async(b, s)
    pool.free_async(c, s)
    s.synchronize()
    assert (pool.reserved_bytes, pool.used_bytes) == (MiB + 256, 0)
    pool.destroy()
    assert rt.allocated_bytes() == 0


def test_best_fit_among_cached_blocks(rt):
    s = rt.create_stream()
    pool = rt.create_pool(release_threshold=64 * MiB)
    blocks = {size: pool.alloc_async(size, s) for size in (4 * MiB, MiB, 2 * MiB)}
    for address in blocks.values():
        pool.free_async(address, s)
    s.synchronize()
    assert pool.alloc_async(MiB + 1, s) == blocks[2 * MiB]
    assert pool.alloc_async(600 * 1024, s) == blocks[MiB]
    assert pool.alloc_async(3 * MiB, s) == blocks[4 * MiB]
    assert pool.used_bytes == pool.reserved_bytes == 7 * MiB
    pool.destroy()


def test_free_is_stream_ordered(rt):
    s = rt.create_stream()
    pool = rt.create_pool(release_threshold=64 * MiB)
    a = pool.alloc_async(MiB, s)
    release = hold(rt, s)
    rt.launch(s, lambda: rt.view(a, torch.uint8, (MiB,)).fill_(1), name="uses-a")
    pool.free_async(a, s)
    assert pool.used_bytes == MiB  # the stream has not reached the free
    with pytest.raises(InvalidAddress, match=f"double free.*{a:#x}"):
        pool.free_async(a, s)
    assert pool.alloc_async(MiB, s) != a  # not reusable before the stream reaches the free
    release()
    s.synchronize()  # the kernel could still use `a` (no error)
    assert pool.used_bytes == MiB
    with pytest.raises(InvalidAddress, match="use after free"):
        rt.view(a, torch.uint8, (4,))  # cached in the pool: not usable
    with pytest.raises(InvalidAddress, match="free_async"):
        rt.mem_free(pool.alloc_async(MiB, s))
    pool.destroy()


def test_trim_and_release_threshold(rt):
    s = rt.create_stream()
    pool = rt.create_pool(release_threshold=64 * MiB)
    addresses = [pool.alloc_async(size, s) for size in (MiB, 2 * MiB, 4 * MiB)]
    keep = pool.alloc_async(MiB, s)
    for address in addresses:
        pool.free_async(address, s)
    s.synchronize()
    assert (pool.reserved_bytes, pool.used_bytes) == (8 * MiB, MiB)
    pool.trim_to(4 * MiB)  # 4 MiB block released first keeps >= 4 MiB: 4 MiB left
    assert pool.reserved_bytes == 4 * MiB
    assert rt.allocated_bytes() == 4 * MiB
    pool.trim_to(0)  # only the used block stays
    assert (pool.reserved_bytes, pool.used_bytes) == (MiB, MiB)
    # threshold: cached memory above it goes back at the next synchronize
    pool.set_release_threshold(2 * MiB)
    extra = [pool.alloc_async(MiB, s) for _ in range(3)]
    for address in extra:
        pool.free_async(address, s)
    assert pool.reserved_bytes == 4 * MiB
    s.synchronize()
    assert (pool.reserved_bytes, pool.used_bytes) == (2 * MiB, MiB)
    pool.free_async(keep, s)
    pool.set_release_threshold(0)
    s.synchronize()
    assert (pool.reserved_bytes, pool.used_bytes) == (0, 0)
    assert rt.allocated_bytes() == 0
    pool.destroy()


def test_pool_counts_in_the_device_and_yields_cache_under_pressure(rt, backend):
    s = rt.create_stream()
    pool = rt.create_pool(release_threshold=64 * MiB)
    a = pool.alloc_async(40 * MiB, s)
    assert backend.device_usage()[0].used_memory == 40 * MiB
    with pytest.raises(OutOfDeviceMemory):
        rt.mem_alloc(30 * MiB)
    pool.free_async(a, s)
    s.synchronize()
    assert pool.reserved_bytes == 40 * MiB
    direct = rt.mem_alloc(20 * MiB)  # the pool's cache still holds 40 MiB
    b = pool.alloc_async(30 * MiB, s)  # the cached 40 MiB block fits
    assert b == a
    pool.free_async(b, s)
    s.synchronize()
    d = pool.alloc_async(8 * MiB, s)  # 5x too big to reuse, but the device has only 4 MiB free
    assert d == a and pool.used_bytes == 40 * MiB
    pool.free_async(d, s)
    s.synchronize()
    c = pool.alloc_async(42 * MiB, s)  # no cached block fits: the cache is trimmed, then reserved
    assert pool.reserved_bytes == 42 * MiB and rt.allocated_bytes() == 62 * MiB
    with pytest.raises(OutOfDeviceMemory) as info:
        pool.alloc_async(4 * MiB, s)
    assert info.value.requested == 4 * MiB and info.value.free == 2 * MiB
    pool.destroy()
    with pytest.raises(InvalidAddress):
        rt.view(c, torch.uint8, (1,))
    with pytest.raises(DeviceError, match="destroyed"):
        pool.alloc_async(1, s)
    rt.mem_free(direct)
    assert backend.device_usage()[0].used_memory == 0
