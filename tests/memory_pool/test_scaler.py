"""Resilient scaling's shell: positions in, Algorithm 1's target out, the pool resized to it."""

from __future__ import annotations

import time
from types import SimpleNamespace

import pytest

from streambox.device.emulated import EmulatedBackend
from streambox.device.specs import V100_16GB
from streambox.memory_pool.periodic import PeriodicThread
from streambox.memory_pool.pool import DeviceMemoryPool
from streambox.memory_pool.scaler import (
    PositionBoard,
    ResilientScaler,
    ScalerTiming,
    measure_t_interval,
    model_profile_from,
)
from streambox.memory_pool.scaling import FunctionPosition, ModelProfile, ScalingConfig

MiB = 1 << 20
# kernel live bytes (MiB) and run times: 0.5 s, 0.25 s, 1 s, 0.5 s
A = ModelProfile.from_pairs("a", 1, [(1 * MiB, 0.5), (3 * MiB, 0.25), (2 * MiB, 1.0), (5 * MiB, 0.5)])
EXACT = ScalingConfig(t_interval_s=1.0, quantum_bytes=1)


class FakePool:
    def __init__(self, reserved: int = 0, demand: int = 0) -> None:
        self.reserved_bytes = reserved
        self.demand_bytes = demand
        self.resizes: list[int] = []

    def resize(self, target_bytes: int) -> int:
        self.resizes.append(target_bytes)
        delta = target_bytes - self.reserved_bytes
        self.reserved_bytes = target_bytes
        return delta


class Clock:
    def __init__(self, now: float = 0.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def runtime(tmp_path):
    spec = V100_16GB.with_overrides(total_memory=512 * MiB, context_create_s=0.0, context_memory=0)
    with EmulatedBackend(spec=spec, state_dir=tmp_path / "state", timeline=False) as backend:
        rt = backend.open_runtime(0)
        yield rt
        rt.close()


def test_position_board() -> None:
    board = PositionBoard()
    board.update("f1", "a", 1, 2, 10.0, held_bytes=7)
    board.update("f1", "a", 1, 3, 11.0, held_bytes=9)
    board.update("f2", "b", 8, 0, 12.0)
    assert board.snapshot() == [
        (FunctionPosition("f1", "a", 1, 3, 11.0), 9),
        (FunctionPosition("f2", "b", 8, 0, 12.0), 0),
    ]
    board.remove("f1")
    board.remove("unknown")
    assert len(board) == 1


def test_step_resizes_to_algorithm_1_target_with_fixed_bytes() -> None:
    clock = Clock(10.0)
    board = PositionBoard()
    pool = FakePool(reserved=4 * MiB, demand=100 * MiB + 1 * MiB)  # 100 MiB of weights + f1's 1 MiB
    scaler = ResilientScaler(pool, board, [A], EXACT, clock=clock)
    board.update("f1", "a", 1, 0, 9.75, held_bytes=1 * MiB)
    d = scaler.step()
    # f1: kernel 0 has 0.25 s left; kernels 1 (+0.25) and 2 (+0.5) start in the window, 3 (+1.5) does not
    assert (d.current_demand, d.next_demand, d.fixed_bytes) == (1 * MiB, 3 * MiB, 100 * MiB)
    assert d.target_bytes == 103 * MiB and pool.resizes == [103 * MiB]
    board.remove("f1")
    pool.demand_bytes = 100 * MiB
    clock.now = 11.0
    assert scaler.step().target_bytes == 100 * MiB  # the function left: shrink to the fixed bytes
    assert pool.resizes == [103 * MiB, 100 * MiB]
    scaler.step()
    assert len(pool.resizes) == 2  # no change, no resize
    assert [t for t, _ in scaler.decisions] == [10.0, 11.0, 11.0]


def test_an_unprofiled_function_counts_as_fixed_bytes() -> None:
    board = PositionBoard()
    pool = FakePool(demand=5 * MiB)
    scaler = ResilientScaler(pool, board, [A], EXACT, clock=Clock(0.0))
    board.update("g", "unknown-model", 1, 0, 0.0, held_bytes=5 * MiB)
    d = scaler.step()
    assert (d.target_bytes, d.fixed_bytes, d.functions) == (5 * MiB, 5 * MiB, ())
    assert scaler.unprofiled == {("unknown-model", 1)}


def test_timing_from_t_interval() -> None:
    assert ScalerTiming.from_t_interval(0.02) == ScalerTiming(0.02, 0.01, 0.02)
    slow = ScalerTiming.from_t_interval(1e-4, min_period_s=2e-3)
    assert (slow.period_s, slow.horizon_s) == (2e-3, 4e-3)


def test_measure_t_interval_leaves_the_device_as_it_was(runtime) -> None:
    t = measure_t_interval(runtime, nbytes=64 * MiB, repeats=3)
    assert 0 < t < 1.0
    assert runtime.allocated_bytes() == 0


def test_model_profile_from_a_memory_profile() -> None:
    kernels = [SimpleNamespace(live_eager=b) for b in (10, 30, 20)]
    profile = SimpleNamespace(model="m", batch=8, kernels=kernels, runtime_s=None)
    with pytest.raises(ValueError, match="no kernel run times"):
        model_profile_from(profile)
    profile.runtime_s = [0.5, 0.0, 0.25]
    mp = model_profile_from(profile)
    assert (mp.key, [(k.live_bytes, k.runtime_s) for k in mp.kernels]) == (
        ("m", 8),
        [(10, 0.5), (30, 0.0), (20, 0.25)],
    )


def test_the_thread_tracks_demand_on_a_real_pool(runtime) -> None:
    pool = DeviceMemoryPool(runtime)
    board = PositionBoard()
    config = ScalingConfig(t_interval_s=1.0, quantum_bytes=2 * MiB)
    scaler = ResilientScaler(pool, board, [A], config, period_s=0.005).start()
    try:
        board.update("f1", "a", 1, 2, time.perf_counter(), held_bytes=0)  # kernel 2 (2 MiB) then 3 (5 MiB)
        deadline = time.time() + 20
        while pool.reserved_bytes < 6 * MiB and time.time() < deadline:
            time.sleep(0.005)
        assert pool.reserved_bytes == 6 * MiB  # grown ahead of the allocations, in 2 MiB chunks
        s = runtime.create_stream()
        x = pool.allocate(5 * MiB, s)  # a surge the prediction did not cover still succeeds
        y = pool.allocate(3 * MiB, s)
        assert pool.demand_bytes == 8 * MiB
        pool.free_many([x, y], s)
        board.remove("f1")
        while (pool.reserved_bytes or runtime.allocated_bytes()) and time.time() < deadline:
            time.sleep(0.005)  # (the device sees a trim a moment after the pool's books do)
        assert pool.reserved_bytes == 0 and runtime.allocated_bytes() == 0  # shrunk back
    finally:
        scaler.stop()
    pool.close()


def test_periodic_thread_survives_errors() -> None:
    calls = []

    def fn() -> None:
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("boom")

    t = PeriodicThread("t", 0.001, fn).start()
    deadline = time.time() + 5
    while len(calls) < 3 and time.time() < deadline:
        time.sleep(0.001)
    t.stop()
    assert len(calls) >= 3 and t.errors == 1 and str(t.last_error) == "boom" and not t.running


def test_the_scaler_is_idle_only_when_nothing_runs_and_the_pool_did_not_move() -> None:
    board = PositionBoard()
    pool = FakePool(reserved=4 * MiB, demand=4 * MiB)
    scaler = ResilientScaler(pool, board, [A], EXACT, clock=Clock(0.0), idle_period_s=1.0)
    scaler.step()
    assert not scaler.idle()  # the first look: nothing to compare with
    scaler.step()
    assert scaler.idle()  # nothing runs, nothing moved: the next step would decide the same
    pool.demand_bytes = 2 * MiB  # weights freed by their keep-alive
    scaler.step()
    assert not scaler.idle()
    board.update("f1", "a", 1, 0, 0.0, held_bytes=1 * MiB)
    scaler.step()
    assert not scaler.idle()  # a function runs


def test_an_idle_periodic_thread_waits_its_idle_period_and_wakes_at_once() -> None:
    calls = []
    t = PeriodicThread(
        "t", 0.001, lambda: calls.append(time.monotonic()), idle=lambda: True, idle_period_s=60.0
    )
    t.start()
    time.sleep(0.1)
    assert len(calls) == 1 and t.idle_iterations == 1  # one call, then the idle period
    woken = time.monotonic()
    t.wake()
    deadline = woken + 5
    while len(calls) < 2 and time.monotonic() < deadline:
        time.sleep(0.001)
    t.stop()
    assert len(calls) == 2 and calls[1] - woken < 1.0 and not t.running
    with pytest.raises(ValueError, match="idle_period_s"):
        PeriodicThread("t", 0.01, lambda: None, idle=lambda: True, idle_period_s=0.001)


def test_a_function_arriving_on_the_board_wakes_an_idle_scaler() -> None:
    board = PositionBoard()
    pool = FakePool(reserved=4 * MiB, demand=4 * MiB)
    scaler = ResilientScaler(pool, board, [A], EXACT, period_s=0.001, idle_period_s=60.0)
    board.on_arrival = scaler.wake
    scaler.start()
    deadline = time.monotonic() + 5
    while scaler.thread is not None and scaler.thread.idle_iterations == 0 and time.monotonic() < deadline:
        time.sleep(0.001)
    steps = len(scaler.decisions)
    board.update("f1", "a", 1, 0, time.perf_counter(), held_bytes=1 * MiB)  # a run's first kernel
    board.update("f1", "a", 1, 1, time.perf_counter(), held_bytes=1 * MiB)  # not an arrival
    while len(scaler.decisions) == steps and time.monotonic() < deadline:
        time.sleep(0.001)
    scaler.stop()
    assert len(scaler.decisions) > steps  # stepped within the test, not 60 s later
