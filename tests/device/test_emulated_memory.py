"""Device memory of the emulated backend: accounting, addresses, views, misuse."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from streambox.device.base import ALIGNMENT, DeviceError, InvalidAddress, OutOfDeviceMemory
from streambox.device.emulated import EmulatedBackend
from streambox.device.specs import MiB

from .conftest import SMALL_SPEC


def test_alloc_is_aligned_and_accounted(rt):
    a = rt.mem_alloc(1000)
    b = rt.mem_alloc(ALIGNMENT)
    assert a % ALIGNMENT == 0 and b % ALIGNMENT == 0
    assert rt.allocated_bytes() == 1024 + 256
    free, total = rt.memory_info()
    assert (free, total) == (64 * MiB - 1280, 64 * MiB)
    rt.mem_free(a)
    rt.mem_free(b)
    assert rt.allocated_bytes() == 0
    assert rt.memory_info() == (64 * MiB, 64 * MiB)


def test_addresses_are_never_reused(rt):
    seen = set()
    for _ in range(50):
        a = rt.mem_alloc(4096)
        assert a not in seen
        seen.add(a)
        rt.mem_free(a)


def test_out_of_memory_names_requested_and_free_bytes(rt):
    a = rt.mem_alloc(48 * MiB)
    with pytest.raises(OutOfDeviceMemory) as info:
        rt.mem_alloc(20 * MiB)
    err = info.value
    assert (err.requested, err.free, err.total) == (20 * MiB, 16 * MiB, 64 * MiB)
    assert str(20 * MiB) in str(err) and str(16 * MiB) in str(err)
    assert rt.allocated_bytes() == 48 * MiB  # the failed request left no trace
    rt.mem_free(a)
    rt.mem_free(rt.mem_alloc(64 * MiB))  # the whole device fits once freed


def test_capacity_is_shared_by_runtimes_and_devices_are_separate(backend):
    r0 = backend.open_runtime(0)
    r0b = backend.open_runtime(0)
    r1 = backend.open_runtime(1)
    r0.mem_alloc(40 * MiB)
    with pytest.raises(OutOfDeviceMemory):
        r0b.mem_alloc(30 * MiB)
    r1.mem_alloc(60 * MiB)  # another GPU: its own 64 MiB
    usage = backend.device_usage()
    assert [(u.used_memory, u.runtimes) for u in usage] == [(40 * MiB, 2), (60 * MiB, 1)]
    r0.close()
    r0b.close()
    r1.close()
    assert [u.used_memory for u in backend.device_usage()] == [0, 0]


def test_context_costs_memory(tmp_path):
    spec = SMALL_SPEC.with_overrides(context_memory=10 * MiB)
    with EmulatedBackend(spec, state_dir=tmp_path) as be:
        r = be.open_runtime()
        assert r.allocated_bytes() == 10 * MiB
        assert be.device_usage()[0].used_memory == 10 * MiB
        r2 = be.open_runtime()
        assert r2.memory_info()[0] == 44 * MiB
        with pytest.raises(OutOfDeviceMemory):
            r2.mem_alloc(45 * MiB)
        r.close()
        r2.close()
        assert be.device_usage()[0].used_memory == 0
        spec_full = SMALL_SPEC.with_overrides(context_memory=65 * MiB)
        with pytest.raises(OutOfDeviceMemory):
            EmulatedBackend(spec_full, state_dir=tmp_path / "other").open_runtime()


def test_view_inside_an_allocation(rt):
    base = rt.mem_alloc(1 * MiB)
    whole = rt.view(base, torch.uint8, (MiB,))
    whole.zero_()
    inner = rt.view(base + 4096, torch.float32, (16, 4))
    inner.fill_(2.5)
    assert rt.view(base + 4096, torch.float32, (64,)).sum().item() == 160.0
    assert whole[:4096].sum().item() == 0
    transposed = rt.view(base + 4096, torch.float32, (4, 16), strides=(1, 4))
    assert torch.equal(transposed, inner.t())
    with pytest.raises(InvalidAddress, match="runs past the end"):
        rt.view(base + MiB - 8, torch.float32, (4,))
    with pytest.raises(InvalidAddress, match="misaligned"):
        rt.view(base + 2, torch.float32, (1,))
    rt.mem_free(base)


def test_double_free_and_use_after_free(rt):
    s = rt.create_stream()
    a = rt.mem_alloc(4096)
    rt.mem_free(a)
    with pytest.raises(InvalidAddress, match=f"double free.*{a:#x}"):
        rt.mem_free(a)
    with pytest.raises(InvalidAddress, match=f"{a + 64:#x}"):
        rt.view(a + 64, torch.uint8, (8,))
    with pytest.raises(InvalidAddress, match="use after free"):
        rt.copy_htod_async(a, torch.zeros(16, dtype=torch.uint8), 16, s)
    with pytest.raises(InvalidAddress, match=f"{0x1234:#x}"):
        rt.mem_free(0x1234)
    b = rt.mem_alloc(4096)
    with pytest.raises(InvalidAddress, match="not the start"):
        rt.mem_free(b + 256)
    rt.mem_free(b)
    # a kernel that touches freed memory fails; the failure surfaces at synchronize
    rt.launch(s, lambda: rt.view(b, torch.uint8, (4,)).fill_(1), name="uaf")
    with pytest.raises(DeviceError, match="uaf") as info:
        s.synchronize()
    assert isinstance(info.value.__cause__, InvalidAddress)


def test_copy_of_memory_freed_before_the_stream_reaches_it(rt):
    s = rt.create_stream()
    blocker = rt.create_stream()
    gate = rt.create_event()
    host = rt.host_alloc(4 * MiB)
    big = rt.mem_alloc(4 * MiB)
    victim = rt.mem_alloc(4096)
    rt.copy_htod_async(big, host, 4 * MiB, blocker)  # ~4 ms on the slow link
    gate.record(blocker)
    s.wait_event(gate)
    rt.copy_htod_async(victim, torch.ones(4096, dtype=torch.uint8), 4096, s)
    rt.mem_free(victim)  # the copy has not run yet
    with pytest.raises(InvalidAddress, match="use after free"):
        s.synchronize()
    s.synchronize()  # reported once


def test_close_frees_everything(backend):
    r = backend.open_runtime(0)
    r.mem_alloc(MiB)
    pool = r.create_pool(release_threshold=64 * MiB)
    s = r.create_stream()
    pool.alloc_async(MiB, s)
    assert backend.device_usage()[0].used_memory == 2 * MiB
    assert backend.device_usage()[0].streams == 1
    r.close()
    r.close()  # idempotent
    assert backend.device_usage()[0] == backend.device_usage()[0].__class__(
        0, SMALL_SPEC.name, 0, 64 * MiB, 0, 0
    )
    with pytest.raises(DeviceError, match="closed"):
        r.mem_alloc(1)


_ops = st.lists(
    st.one_of(
        st.tuples(st.just("alloc"), st.integers(0, 3 * MiB)),
        st.tuples(st.just("pool"), st.integers(1, 2 * MiB)),
        st.tuples(st.just("free"), st.integers(0, 1000)),
    ),
    min_size=1,
    max_size=40,
)


@pytest.fixture(scope="module")
def shared_runtime(tmp_path_factory):
    be = EmulatedBackend(SMALL_SPEC, state_dir=tmp_path_factory.mktemp("hyp"))
    r = be.open_runtime()
    yield be, r
    be.close()


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ops=_ops)
def test_random_alloc_free_keeps_accounting_exact(shared_runtime, ops):
    be, r = shared_runtime
    s = r.create_stream()
    pool = r.create_pool(release_threshold=8 * MiB)
    live: dict[int, tuple[int, bool, int]] = {}  # address -> (aligned size, from pool, fill byte)
    try:
        for i, (op, arg) in enumerate(ops):
            if op == "free":
                if live:
                    address = sorted(live)[arg % len(live)]
                    _, pooled, _ = live.pop(address)
                    pool.free_async(address, s) if pooled else r.mem_free(address)
            else:
                size = max(ALIGNMENT, -(-arg // ALIGNMENT) * ALIGNMENT)
                try:
                    address = pool.alloc_async(arg, s) if op == "pool" else r.mem_alloc(arg)
                except OutOfDeviceMemory as err:
                    assert err.requested == size and err.requested > err.free
                    continue
                assert address % ALIGNMENT == 0
                live[address] = (size, op == "pool", i % 251)
                r.view(address, torch.uint8, (size,)).fill_(i % 251)
            s.synchronize()
            direct = sum(size for size, pooled, _ in live.values() if not pooled)
            assert pool.used_bytes >= sum(size for size, pooled, _ in live.values() if pooled)
            assert pool.reserved_bytes >= pool.used_bytes
            assert r.allocated_bytes() == direct + pool.reserved_bytes
            assert be.device_usage()[0].used_memory == r.allocated_bytes()
            assert r.memory_info()[0] == 64 * MiB - r.allocated_bytes()
        # the ranges are disjoint and every allocation still holds its own pattern
        spans = sorted((a, a + size) for a, (size, _, _) in live.items())
        assert all(end <= nxt for (_, end), (nxt, _) in zip(spans, spans[1:], strict=False))
        for address, (size, _, fill) in live.items():
            assert bool((r.view(address, torch.uint8, (size,)) == fill).all())
    finally:
        for address, (_, pooled, _) in live.items():
            pool.free_async(address, s) if pooled else r.mem_free(address)
        s.synchronize()
        pool.destroy()
        s.destroy()
    assert r.allocated_bytes() == 0
    assert be.device_usage()[0].used_memory == 0
