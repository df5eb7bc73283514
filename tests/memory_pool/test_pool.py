"""The runtime's memory pool on the emulated device: chunks, stream-ordered frees, trims, errors."""

from __future__ import annotations

import threading
import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from streambox.device.base import InvalidAddress, OutOfDeviceMemory
from streambox.device.emulated import EmulatedBackend
from streambox.memory_pool import metrics as metrics_module
from streambox.memory_pool.metrics import PoolMetrics
from streambox.memory_pool.pool import DeviceMemoryPool, PoolConfig, PoolOutOfMemory, Reclaim, chunk_size_for

from .conftest import small_spec

MiB = 1 << 20


def gate(runtime, stream) -> threading.Event:
    """Block `stream` on a kernel until the returned event is set."""
    opened = threading.Event()
    runtime.launch(stream, lambda: opened.wait(10), name="gate")
    return opened


def test_chunk_policy() -> None:
    assert chunk_size_for(1, 2 * MiB) == 2 * MiB
    assert chunk_size_for(2 * MiB, 2 * MiB) == 2 * MiB
    assert chunk_size_for(2 * MiB + 1, 2 * MiB) == 4 * MiB
    assert chunk_size_for(5 * MiB, 2 * MiB) == 6 * MiB
    with pytest.raises(ValueError):
        chunk_size_for(1, 1000)


def test_small_requests_share_a_chunk_large_ones_get_their_own(runtime) -> None:
    pool = DeviceMemoryPool(runtime)
    s = runtime.create_stream()
    a = pool.allocate(1000, s)
    b = pool.allocate(3000, s)
    assert (a % 256, b % 256) == (0, 0)
    assert pool.reserved_bytes == 2 * MiB and pool.stats().sub.chunks == 1
    assert (pool.allocated_bytes, pool.demand_bytes) == (1024 + 3072, 4000)
    big = pool.allocate(5 * MiB, s)
    assert pool.reserved_bytes == 2 * MiB + 6 * MiB and pool.stats().sub.chunks == 2
    assert runtime.allocated_bytes() == pool.reserved_bytes  # every byte the device sees is a chunk
    pool.free_many([a, b, big], s)
    assert pool.demand_bytes == 0
    pool.drain()
    assert pool.allocated_bytes == 0
    assert pool.trim_to(0) == 8 * MiB
    assert pool.reserved_bytes == 0 and runtime.allocated_bytes() == 0
    assert runtime.memory_info()[0] == 64 * MiB


def test_a_free_is_stream_ordered_same_stream_reuses_at_once(runtime) -> None:
    pool = DeviceMemoryPool(runtime, PoolConfig(fence_frees=1))
    a, b = runtime.create_stream(), runtime.create_stream()
    opened = gate(runtime, a)
    x = pool.allocate(4096, a)
    pool.free(x, a)  # pending on `a` until `a` passes the gate
    assert pool.allocate(4096, b) != x  # another stream must not get it yet
    y = pool.allocate(4096, a)
    assert y == x and pool.counters.same_stream_reuses == 1  # stream order makes reuse safe
    pool.free(y, a)
    opened.set()
    a.synchronize()
    assert pool.collect() == 4096
    assert pool.allocate(4096, b) == x


def test_a_held_stream_gets_no_fence_until_its_kernels_are_launched(runtime) -> None:
    """`hold_fences`: a block freed before the kernel that uses it last is launched (the executor's
    segments) stays the stream's until the release; the sweep's fence waits for it."""
    pool = DeviceMemoryPool(runtime, PoolConfig(fence_frees=1))
    a, b = runtime.create_stream(), runtime.create_stream()
    x = pool.allocate(4096, a)
    pool.hold_fences(a)
    pool.free(x, a)  # its last user is not launched yet
    fences = pool.counters.fences
    pool.collect(fence=True)  # the periodic sweep
    a.synchronize()
    pool.collect()
    assert pool.counters.fences == fences  # no fence recorded on `a` under the hold...
    assert pool.allocate(4096, b) != x  # ...so no other stream can take the block
    assert pool.allocate(4096, a) == x  # while the stream itself may, at once
    pool.free(x, a)
    used_last = threading.Event()
    runtime.launch(a, used_last.set, name="the block's last user")
    pool.release_fences(a)  # launched: the fence asked for meanwhile is recorded now, after it
    assert pool.counters.fences == fences + 1
    a.synchronize()
    assert used_last.is_set() and pool.collect() == 4096
    assert pool.allocate(4096, b) == x


@pytest.mark.parametrize("who", ["the same stream", "another stream"])
def test_a_hold_with_everything_launched_defers_no_fence_a_full_pool_needs(tmp_path, who) -> None:
    """The executor launches what is pending (`release_fences(hold=True)`) before it waits, and an
    issuer may wait for its turn holding: a full device must still get the stream's frees back."""
    with EmulatedBackend(spec=small_spec(4 * MiB), state_dir=tmp_path / "state", timeline=False) as backend:
        rt = backend.open_runtime(0)
        pool = DeviceMemoryPool(rt, PoolConfig(oom_wait_s=0.5, metrics=False))
        s = rt.create_stream()
        blocks = []
        with pytest.raises(PoolOutOfMemory):
            while True:
                blocks.append(pool.allocate(256 * 1024, s))
        blocks.sort()
        pool.hold_fences(s)
        pool.free_many(blocks[:2], s)  # adjacent, under the fence thresholds
        pool.release_fences(s, hold=True)  # their kernels are launched; the hold goes on
        started = time.perf_counter()
        pool.allocate(512 * 1024, s if who == "the same stream" else rt.create_stream())
        assert time.perf_counter() - started < 0.4  # not the OOM wait (PoolOutOfMemory after it)
        pool.release_fences(s)
        rt.close()


def test_fence_holds_nest_and_a_release_without_a_hold_is_an_error(runtime) -> None:
    pool = DeviceMemoryPool(runtime, PoolConfig(fence_frees=1))
    s = runtime.create_stream()
    pool.hold_fences(s)
    pool.hold_fences(s)
    pool.free(pool.allocate(1024, s), s)
    fences = pool.counters.fences
    pool.release_fences(s, hold=True)  # the inner holder's segment: the outer hold still stands
    pool.release_fences(s)
    assert pool.counters.fences == fences
    pool.release_fences(s)
    assert pool.counters.fences == fences + 1
    with pytest.raises(ValueError, match="not held"):
        pool.release_fences(s)


def test_a_reused_block_freed_again_waits_for_its_second_free(runtime) -> None:
    pool = DeviceMemoryPool(runtime, PoolConfig(fence_frees=1))
    a, b = runtime.create_stream(), runtime.create_stream()
    first = gate(runtime, a)
    x = pool.allocate(4096, a)
    pool.free(x, a)  # fence 1, after gate 1
    passed_fence_1 = threading.Event()
    runtime.launch(a, passed_fence_1.set, name="marker")
    assert pool.allocate(4096, a) == x  # reused on `a`...
    second = gate(runtime, a)
    pool.free(x, a)  # ...and freed again: fence 2, after gate 2
    first.set()
    assert passed_fence_1.wait(5)
    pool.collect()
    assert pool.stats().pending_free_bytes == 4096  # fence 1 passed, but x is in use until fence 2
    assert pool.allocate(4096, b) != x
    second.set()
    a.synchronize()
    pool.collect()
    assert pool.stats().pending_free_bytes == 0
    assert pool.allocate(4096, b) == x


def test_fences_are_amortised_over_frees(runtime) -> None:
    pool = DeviceMemoryPool(runtime, PoolConfig(fence_frees=4, fence_bytes=1 << 40))
    s = runtime.create_stream()
    addresses = [pool.allocate(1024, s) for _ in range(8)]
    for address in addresses[:3]:
        pool.free(address, s)
    assert pool.counters.fences == 0
    pool.free_many(addresses[3:], s)
    assert pool.counters.fences == 1
    pool.fence(s)  # nothing left unfenced: no event
    assert pool.counters.fences == 1


def test_a_lone_free_is_fenced_by_the_periodic_collect(runtime) -> None:
    pool = DeviceMemoryPool(runtime)  # fences every 1 MiB or 64 frees
    s = runtime.create_stream()
    x = pool.allocate(4096, s)
    pool.free(x, s)
    assert pool.collect(fence=False) == 0 and pool.stats().pending_free_bytes == 4096
    collected = pool.collect()  # the sweep's call: fences it (collected at once if already reached)
    s.synchronize()
    collected += pool.collect()
    assert collected == 4096 and pool.stats().pending_free_bytes == 0


def test_double_free_and_unknown_address(runtime) -> None:
    pool = DeviceMemoryPool(runtime)
    s = runtime.create_stream()
    x = pool.allocate(100, s)
    pool.free(x, s)
    with pytest.raises(InvalidAddress, match="not a live allocation"):
        pool.free(x, s)
    with pytest.raises(InvalidAddress):
        pool.free(12345, None)


def test_out_of_memory_fails_one_request_and_names_the_bytes(runtime) -> None:
    pool = DeviceMemoryPool(runtime, PoolConfig(oom_wait_s=0.05))
    a, b = runtime.create_stream(), runtime.create_stream()
    held = pool.allocate(40 * MiB, a)
    with pytest.raises(PoolOutOfMemory) as info:
        pool.allocate(30 * MiB, b)
    err = info.value
    assert isinstance(err, OutOfDeviceMemory)
    assert (err.requested, err.free, err.pool_bytes) == (30 * MiB, 0, 40 * MiB)
    assert "requested 31457280 bytes; 0 bytes free in the pool" in str(err)
    assert "of 41943040 pool bytes" in str(err) and "device: 25165824 of 67108864 bytes free" in str(err)
    assert pool.counters.out_of_memory == 1
    # the pool goes on: another request fits, and once the holder frees, the big one fits too
    small = pool.allocate(1 * MiB, b)
    pool.free(held, a)
    pool.drain()
    again = pool.allocate(30 * MiB, b)
    assert again == held  # best fit in the freed 40 MiB chunk
    pool.free_many([small, again], b)
    pool.drain()
    pool.trim_to(0)
    assert runtime.allocated_bytes() == 0


def test_scattered_free_chunks_go_back_to_the_device_for_a_large_request(runtime) -> None:
    pool = DeviceMemoryPool(runtime, PoolConfig(oom_wait_s=0.05))
    s = runtime.create_stream()
    small = [pool.allocate(2 * MiB, s) for _ in range(30)]  # 30 chunks, 60 MiB
    pool.free_many(small, s)
    pool.drain()
    assert pool.reserved_bytes == 60 * MiB and pool.allocated_bytes == 0
    big = pool.allocate(40 * MiB, s)  # no chunk fits, the device has 4 MiB: trim, then grow
    assert pool.counters.pressure_trims == 1
    assert pool.reserved_bytes == 40 * MiB
    pool.free(big, s)


def test_the_pool_asks_for_a_reclaim_and_goes_on_after_it(runtime) -> None:
    pool = DeviceMemoryPool(runtime, PoolConfig(oom_wait_s=0.05))
    s = runtime.create_stream()
    cached = pool.allocate(40 * MiB, s)
    need = pool.try_allocate(50 * MiB, s)  # grows fail: the pool says what it needs, holding nothing
    assert isinstance(need, Reclaim) and need.nbytes == 50 * MiB
    assert pool.demand_bytes == 40 * MiB and pool.counters.pressure_trims == 1
    pool.free(cached, None)  # the caller reclaims (e.g. idle weights: no device work reads them)
    x = pool.try_allocate(50 * MiB, s, resume=need)
    assert isinstance(x, int) and pool.demand_bytes == 50 * MiB
    pool.free(x, s)


def test_a_reclaim_that_frees_nothing_is_asked_again_after_each_wait_then_fails(runtime) -> None:
    pool = DeviceMemoryPool(runtime, PoolConfig(oom_wait_s=0.05))
    s = runtime.create_stream()
    held = pool.allocate(40 * MiB, s)
    asked = 0
    got = pool.try_allocate(50 * MiB, s)
    with pytest.raises(PoolOutOfMemory, match="requested 52428800 bytes"):
        while isinstance(got, Reclaim):
            asked += 1
            got = pool.try_allocate(50 * MiB, s, resume=got)
    assert asked >= 2 and pool.counters.out_of_memory == 1
    pool.free(held, s)


def test_an_allocation_waits_boundedly_for_frees_in_flight(runtime) -> None:
    pool = DeviceMemoryPool(runtime, PoolConfig(oom_wait_s=5.0))
    a, b = runtime.create_stream(), runtime.create_stream()
    x = pool.allocate(40 * MiB, a)
    opened = gate(runtime, a)
    pool.free(x, a)  # reaches the pool only once `a` passes the gate
    timer = threading.Timer(0.1, opened.set)
    timer.start()
    started = time.perf_counter()
    y = pool.allocate(40 * MiB, b)
    waited = time.perf_counter() - started
    timer.join()
    # The whole 40 MiB device again, once `a` let go: the same chunk, or (when the free lands while
    # the pool gives its free chunks back) a new one of the device's; never an out-of-memory.
    assert pool.counters.out_of_memory == 0 and pool.reserved_bytes == 40 * MiB
    assert 0.05 < waited < 5.0
    pool.free(y, b)


def test_own_frees_in_flight_are_waited_for_rather_than_growing(runtime) -> None:
    pool = DeviceMemoryPool(runtime, PoolConfig(fence_frees=1))
    s = runtime.create_stream()
    x = pool.allocate(1 * MiB, s)
    opened = gate(runtime, s)
    pool.free(x, s)

    def open_once_waiting() -> None:  # the stream passes the free only once the pool waits for it
        while pool.counters.own_frees_waits == 0:
            time.sleep(0.001)
        opened.set()

    opener = threading.Thread(target=open_once_waiting)
    opener.start()
    y = pool.allocate(1 * MiB + 4096, s)  # no exact-size reuse; the freed block coalesces once reached
    opener.join()
    assert pool.counters.own_frees_waits >= 1 and pool.reserved_bytes == 2 * MiB
    assert y == x
    pool.free(y, s)


def test_grow_to_and_trim_to(runtime) -> None:
    pool = DeviceMemoryPool(runtime)
    assert pool.grow_to(9 * MiB) == 10 * MiB
    assert pool.reserved_bytes == 10 * MiB and pool.stats().sub.chunks == 5
    s = runtime.create_stream()
    x = pool.allocate(100, s)  # pins one chunk
    assert pool.trim_to(3 * MiB) == 6 * MiB  # largest first while >= keep: 4 MiB remain
    assert pool.resize(0) == -2 * MiB  # the pinned chunk stays
    assert pool.reserved_bytes == 2 * MiB
    pool.free(x, s)
    pool.drain()
    assert pool.resize(0) == -2 * MiB and runtime.allocated_bytes() == 0


def test_close_gives_every_byte_back(runtime) -> None:
    pool = DeviceMemoryPool(runtime)
    s = runtime.create_stream()
    pool.allocate(3 * MiB, s)
    pool.free(pool.allocate(100, s), s)
    pool.close()
    assert runtime.allocated_bytes() == 0


def test_metrics_time_averages_are_exact() -> None:
    m = PoolMetrics(clock=lambda: 0.0, series_interval_s=0.0)
    m.reset(0.0)
    m.update(0.0, 100, 50, 40)
    m.update(1.0, 300, 250, 200)
    m.update(3.0, 100, 0, 0)
    s = m.summary(4.0)
    # reserved: 100 for 1 s, 300 for 2 s, 100 for 1 s
    assert (s.duration_s, s.mean_reserved, s.mean_allocated, s.mean_demand) == (4.0, 200.0, 137.5, 110.0)
    assert (s.peak_reserved, s.peak_allocated, s.peak_demand) == (300, 250, 200)
    assert s.pool_over_demand == 200.0 / 110.0
    m.record_alloc(2e-6)
    m.record_free(1e-6, count=3)
    s = m.summary(4.0)
    assert (s.alloc.count, s.alloc.p50_us, s.free.count) == (1, 2.0, 3)
    assert [(p.t, p.reserved) for p in m.series()][:4] == [(0.0, 0), (0.0, 100), (1.0, 300), (3.0, 100)]


def test_metrics_export(tmp_path) -> None:
    m = PoolMetrics(clock=lambda: 2.0, series_interval_s=0.0)
    m.reset(0.0)
    m.update(1.0, 2 * MiB, 1024, 1000)
    m.to_csv(tmp_path / "pool.csv")
    lines = (tmp_path / "pool.csv").read_text().splitlines()
    assert lines[0] == "t_s,reserved_bytes,allocated_bytes,demand_bytes"
    assert lines[2] == "1.000000,2097152,1024,1000"
    data = m.to_json(tmp_path / "pool.json")
    assert data["summary"]["peak_reserved"] == 2 * MiB
    assert data["series"]["reserved_bytes"][-1] == 2 * MiB


def test_metrics_peaks_stay_exact_ints_and_reads_beside_updates_lose_nothing() -> None:
    """The queued changes are integrated by a read: a read beside an update (the pool's lock held, as
    the pool holds it) must neither lose a change nor a peak's last unit."""
    m = PoolMetrics(clock=lambda: 0.0, series_interval_s=0.0)
    m.reset(0.0)
    m.update(1.0, 2**53 + 1, 3, 3)
    assert m.summary(2.0).peak_reserved == 2**53 + 1
    lock = threading.RLock()
    m = PoolMetrics(clock=lambda: 0.0, series_interval_s=1.0, lock=lock)
    m.reset(0.0)
    n, reads = 20_000, []

    def writer() -> None:
        for i in range(1, n + 1):
            with lock:  # as the pool calls it
                m.update(float(i), i, i, i)

    thread = threading.Thread(target=writer)
    thread.start()
    while thread.is_alive():
        reads.append(m.summary(float(n + 1)).peak_demand)
    thread.join()
    s = m.summary(float(n + 1))
    assert s.mean_reserved * (n + 1) == pytest.approx(n * (n + 1) / 2, rel=1e-12)  # value i over [i, i+1)
    assert s.peak_demand == n and reads == sorted(reads)


@settings(max_examples=25, deadline=None)
@given(
    st.floats(0.0, 2.0),
    st.lists(
        st.tuples(st.sampled_from([0.0, 0.1, 1.0, -0.5]), st.integers(0, 2**40), st.integers(0, 2**40)),
        min_size=1,
        max_size=300,
    ),
)
def test_metrics_queued_changes_integrate_as_one_by_one(interval, changes) -> None:
    """`update` queues; the bulk integration must give what integrating each change as it came gives
    (a clock that goes back adds no time; the series takes a change per `series_interval_s`), here
    with a short queue so that a full one is integrated too."""
    queued, metrics_module.QUEUED_CHANGES = metrics_module.QUEUED_CHANGES, 7
    try:
        _check_queued_changes(interval, changes)
    finally:
        metrics_module.QUEUED_CHANGES = queued


def _check_queued_changes(interval: float, changes: list[tuple[float, int, int]]) -> None:
    m = PoolMetrics(clock=lambda: 0.0, series_interval_s=interval)
    m.reset(0.0)
    now, last, values, integrals, peaks = 0.0, 0.0, (0, 0, 0), [0.0, 0.0, 0.0], [0, 0, 0]
    series, sampled = [(0.0, 0, 0, 0)], 0.0
    for step, (dt, reserved, demand) in enumerate(changes):
        now += dt
        new = (reserved, reserved // 2, demand)
        m.update(now, *new)
        if step % 97 == 96:
            m.summary(now)  # a read in between integrates what is queued so far
        if now > last:
            integrals = [total + value * (now - last) for total, value in zip(integrals, values, strict=True)]
            last = now
        values, peaks = new, [max(p, v) for p, v in zip(peaks, new, strict=True)]
        if now - sampled >= interval:
            series.append((now, *new))
            sampled = now
    end = last + 1.0
    s = m.summary(end)
    expected = [(total + value) / end for total, value in zip(integrals, values, strict=True)]
    assert [s.mean_reserved, s.mean_allocated, s.mean_demand] == pytest.approx(expected, rel=1e-9)
    assert [s.peak_reserved, s.peak_allocated, s.peak_demand] == peaks
    assert [(p.t, p.reserved, p.allocated, p.demand) for p in m.series()][: len(series)] == series


@settings(max_examples=30, deadline=None)
@given(
    st.lists(
        st.tuples(st.sampled_from(["alloc", "free", "fence"]), st.integers(0, 1), st.integers(0, 3 * MiB)),
        max_size=60,
    )
)
def test_property_no_overlap_and_every_byte_back(tmp_path_factory, ops) -> None:
    state = tmp_path_factory.mktemp("prop")
    with EmulatedBackend(spec=small_spec(256 * MiB), state_dir=state, timeline=False) as backend:
        rt = backend.open_runtime(0)
        pool = DeviceMemoryPool(rt, PoolConfig(fence_frees=3))
        streams = [rt.create_stream(), rt.create_stream()]
        live: dict[int, tuple[int, int]] = {}  # address -> (nbytes, stream index)
        for op, si, n in ops:
            if op == "alloc":
                address = pool.allocate(n, streams[si])
                end = address + max(n, 1)
                for other, (m, _) in live.items():
                    assert end <= other or other + max(m, 1) <= address, "overlapping allocations"
                live[address] = (n, si)
            elif op == "free" and live:
                address = sorted(live)[n % len(live)]
                _, owner = live.pop(address)
                pool.free(address, streams[owner if n % 2 else si])
            elif op == "fence":
                pool.fence(streams[si])
            assert pool.demand_bytes == sum(m for m, _ in live.values())
            assert pool.allocated_bytes >= pool.demand_bytes
        for address, (_, si) in live.items():
            pool.free(address, streams[si])
        pool.drain()
        assert (pool.allocated_bytes, pool.demand_bytes) == (0, 0)
        pool.trim_to(0)
        assert pool.reserved_bytes == 0 and rt.allocated_bytes() == 0
        rt.close()


def test_retire_stream_gives_its_frees_back_and_forgets_it(runtime) -> None:
    pool = DeviceMemoryPool(runtime, PoolConfig(fence_bytes=1 << 40, fence_frees=1 << 20))
    s, other = runtime.create_stream(), runtime.create_stream()
    blocks = [pool.allocate(256 * 1024, s) for _ in range(4)]
    reserved = pool.reserved_bytes
    pool.free_many(blocks, s)  # pending on s, no fence yet
    assert pool.tracked_streams() == [s]
    opened = gate(runtime, s)  # s has not reached the frees: retiring waits for it, bounded
    assert pool.retire_stream(s, timeout_s=0.01) is False
    assert pool.tracked_streams() == [s]
    opened.set()
    assert pool.retire_stream(s) is True
    assert pool.tracked_streams() == []
    assert pool.stats().pending_free_bytes == 0 and pool.allocated_bytes == 0
    s.destroy()
    pool.collect()  # nothing left that could record on the destroyed stream
    again = [pool.allocate(256 * 1024, other) for _ in range(4)]  # the bytes serve another stream
    assert pool.reserved_bytes == reserved
    assert pool.retire_stream(s) is True  # unknown stream: nothing to do
    pool.free_many(again, other)
    assert pool.retire_stream(other) is True
    other.destroy()
    pool.close()


def test_a_thread_freeing_far_ahead_of_its_stream_waits_for_the_device(runtime) -> None:
    # Run-ahead bound: more than `run_ahead_bytes` of fenced frees the stream has not reached yet
    # make the freeing thread wait for the oldest fence (then the blocks are back for every stream).
    pool = DeviceMemoryPool(runtime, PoolConfig(fence_frees=1, run_ahead_bytes=1 * MiB))
    s = runtime.create_stream()
    blocks = [pool.allocate(1 * MiB, s) for _ in range(2)]
    opened = gate(runtime, s)
    pool.free(blocks[0], s)  # 1 MiB in flight: within the bound, no wait
    assert pool.counters.run_ahead_waits == 0
    threading.Timer(0.1, opened.set).start()
    started = time.perf_counter()
    pool.free(blocks[1], s)  # 2 MiB in flight: waits until the stream passes the gate
    waited = time.perf_counter() - started
    assert opened.is_set() and waited >= 0.09
    assert pool.counters.run_ahead_waits == 1 and pool.counters.run_ahead_wait_s >= 0.09
    assert pool.stats().pending_free_bytes <= 1 * MiB  # what the stream passed is collected
    assert pool.metrics is not None and pool.metrics.summary().free.max_us < 0.09e6  # not a free's cost
    s.synchronize()


def test_the_run_ahead_wait_is_bounded_and_can_be_switched_off(runtime) -> None:
    s = runtime.create_stream()
    bounded = DeviceMemoryPool(runtime, PoolConfig(fence_frees=1, run_ahead_bytes=0, oom_wait_s=0.05))
    off = DeviceMemoryPool(runtime, PoolConfig(fence_frees=1, run_ahead_bytes=None))
    x, y = bounded.allocate(4096, s), off.allocate(4096, s)
    opened = gate(runtime, s)
    started = time.perf_counter()
    bounded.free(x, s)  # a stuck stream: gives up after oom_wait_s, the free still happened
    assert 0.04 <= time.perf_counter() - started < 2
    assert bounded.demand_bytes == 0 and bounded.stats().pending_free_bytes == 4096
    started = time.perf_counter()
    off.free(y, s)
    assert time.perf_counter() - started < 0.04 and off.counters.run_ahead_waits == 0
    opened.set()
    s.synchronize()
    with pytest.raises(ValueError):
        PoolConfig(run_ahead_bytes=-1)


def test_free_and_allocate_frees_first_and_reuses_at_once_in_one_call(runtime) -> None:
    pool = DeviceMemoryPool(runtime, PoolConfig(fence_frees=1))
    s = runtime.create_stream()
    opened = gate(runtime, s)
    x = pool.allocate(4096, s)
    y, z = pool.free_and_allocate([x], [4096, 3 * MiB], s)  # the second needs a chunk of its own
    assert y == x and pool.counters.same_stream_reuses == 1
    assert pool.demand_bytes == 4096 + 3 * MiB and pool.counters.grows == 2
    assert pool.free_and_try_allocate([], [8 * MiB], s) == []  # the fast path stops where nothing fits
    opened.set()
    pool.free_many([y, z], s)
    pool.drain()
    assert pool.demand_bytes == 0


def test_free_and_allocate_hands_back_what_it_got_when_a_later_size_fails(runtime) -> None:
    pool = DeviceMemoryPool(runtime, PoolConfig(oom_wait_s=0.0))
    s = runtime.create_stream()
    total = runtime.memory_info()[1]
    with pytest.raises(PoolOutOfMemory):
        pool.free_and_allocate([], [4096, 2 * total], s)
    assert pool.demand_bytes == 0 and pool.stats().live_allocations == 0


def test_free_and_allocate_takes_the_preferred_pending_block_of_the_size(runtime):
    pool = DeviceMemoryPool(runtime)
    s = runtime.create_stream()
    a, b, c = pool.free_and_allocate([], [4096, 4096, 8192], s)
    got = pool.free_and_allocate([a, b, c], [4096, 4096], s, prefer=[a, c])
    assert got[0] == a  # preferred and pending at that size
    assert got[1] == b  # c is pending at another size: the last freed block of 4096 instead
    (d,) = pool.free_and_allocate([], [8192], s, prefer=[a])  # a is live: not pending, no preference
    assert d == c
    pool.free_many([*got, d], s)
    pool.close()
