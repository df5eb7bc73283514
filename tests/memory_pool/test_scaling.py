"""Algorithm 1 (resilient scaling): hand-computed decisions and a brute-force cross-check."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from streambox.memory_pool.scaling import (
    EPSILON_S,
    FunctionPosition,
    ModelProfile,
    ScalingConfig,
    decide_pool_size,
    index_profiles,
)

# Runtimes are binary fractions, so the hand sums below are exact.
A = ModelProfile.from_pairs("a", 1, [(100, 0.5), (300, 0.25), (200, 1.0), (50, 0.5)])
B = ModelProfile.from_pairs("b", 1, [(1000, 0.25), (10, 0.25), (4000, 2.0)])
C = ModelProfile.from_pairs("c", 1, [(10, 0.5), (20, 0.5), (999, 0.125)])
PROFILES = index_profiles([A, B, C])
EXACT = ScalingConfig(t_interval_s=1.0, quantum_bytes=1)


def test_two_functions_hand_computed() -> None:
    now = 10.0
    f1 = FunctionPosition("f1", "a", 1, kernel=0, kernel_started_at=9.75)
    # f1: kernel 0 has 0.25 s left; kernel 1 starts at +0.25, kernel 2 at +0.5, kernel 3 at +1.5 (out)
    f2 = FunctionPosition("f2", "b", 1, kernel=0, kernel_started_at=10.0)
    # f2: kernel 1 starts at +0.25, kernel 2 at +0.5: all three kernels are in the window
    d = decide_pool_size(now, [f1, f2], PROFILES, pool_bytes=1000, config=EXACT)
    assert [(f.current_bytes, f.next_bytes, f.last_kernel_in_window) for f in d.functions] == [
        (100, 300, 2),
        (1000, 4000, 2),
    ]
    assert (d.current_demand, d.next_demand) == (1100, 4300)
    assert (d.target_bytes, d.delta_bytes, d.grow, d.shrink) == (4300, 3300, True, False)


def test_window_boundary_is_inclusive() -> None:
    c0 = FunctionPosition("f", "c", 1, kernel=0, kernel_started_at=0.0)
    # kernel 2 starts exactly at +1.0 = T_interval: it counts
    d = decide_pool_size(0.0, [c0], PROFILES, pool_bytes=0, config=EXACT)
    assert (d.functions[0].last_kernel_in_window, d.next_demand) == (2, 999)
    # a hair shorter interval leaves it out
    shorter = ScalingConfig(t_interval_s=1.0 - 1e-6, quantum_bytes=1)
    d = decide_pool_size(0.0, [c0], PROFILES, pool_bytes=0, config=shorter)
    assert (d.functions[0].last_kernel_in_window, d.next_demand) == (1, 20)


def test_float_sums_do_not_drop_a_kernel_on_the_boundary() -> None:
    p = ModelProfile.from_pairs("tenths", 1, [(1, 0.1), (2, 0.1), (3, 0.1), (99, 0.1)])
    assert p.start_offset(3) > 0.3  # 0.1 + 0.1 + 0.1 is not 0.3 in floats...
    assert p.start_offset(3) - 0.3 < EPSILON_S
    pos = FunctionPosition("f", "tenths", 1, kernel=0, kernel_started_at=0.0)
    d = decide_pool_size(0.0, [pos], index_profiles([p]), 0, ScalingConfig(0.3, quantum_bytes=1))
    assert d.next_demand == 99  # ...but kernel 3, starting at +0.3, is in the window


def test_slow_kernel_and_long_kernel_and_plan_end() -> None:
    # kernel 0 of "a" ran 2 s (profiled 0.5): it may end any moment, so kernels 1 and 2 follow at +0
    # and +0.25; kernel 3 starts at +1.25 (out)
    slow = FunctionPosition("s", "a", 1, kernel=0, kernel_started_at=-2.0)
    # kernel 2 of "b" runs 2 s and has just started: nothing else fits in the window
    long = FunctionPosition("l", "b", 1, kernel=2, kernel_started_at=0.0)
    # last kernel of "a": the plan ends, demand is that kernel's only
    last = FunctionPosition("e", "a", 1, kernel=3, kernel_started_at=0.0)
    d = decide_pool_size(0.0, [slow, long, last], PROFILES, pool_bytes=0, config=EXACT)
    assert [(f.last_kernel_in_window, f.next_bytes) for f in d.functions] == [(2, 300), (2, 4000), (3, 50)]
    assert (d.current_demand, d.next_demand) == (100 + 4000 + 50, 300 + 4000 + 50)


def test_from_elapsed_equals_started_at() -> None:
    a = FunctionPosition.from_elapsed("f1", "a", 1, kernel=1, elapsed_s=0.125, now=5.0)
    assert a == FunctionPosition("f1", "a", 1, 1, 4.875)


def test_quantum_headroom_fixed_bytes_min_pool_and_hysteresis() -> None:
    f = FunctionPosition("f", "b", 1, kernel=0, kernel_started_at=0.0)  # next demand 4000
    cfg = ScalingConfig(t_interval_s=1.0, quantum_bytes=1024, headroom_bytes=100)
    d = decide_pool_size(0.0, [f], PROFILES, pool_bytes=8192, config=cfg, fixed_bytes=1000)
    assert d.target_bytes == 5120  # 4000 + 1000 + 100 = 5100 -> 5 x 1024
    assert (d.delta_bytes, d.shrink) == (-3072, True)
    assert d.fixed_bytes == 1000
    held = ScalingConfig(t_interval_s=1.0, quantum_bytes=1024, headroom_bytes=100, min_shrink_bytes=4096)
    d = decide_pool_size(0.0, [f], PROFILES, pool_bytes=8192, config=held, fixed_bytes=1000)
    assert (d.target_bytes, d.delta_bytes) == (8192, 0)  # shrinking 3 KiB < 4 KiB: hold
    floor = ScalingConfig(t_interval_s=1.0, quantum_bytes=1024, min_pool_bytes=65536)
    assert decide_pool_size(0.0, [f], PROFILES, 0, floor).target_bytes == 65536
    # no function running: only the fixed bytes remain
    empty = decide_pool_size(0.0, [], PROFILES, pool_bytes=8192, config=cfg, fixed_bytes=0)
    assert (empty.target_bytes, empty.delta_bytes) == (1024, -7168)
    assert decide_pool_size(0.0, [], PROFILES, 0).target_bytes == 0  # default: 2 MiB quantum


def test_errors_name_what_exists() -> None:
    with pytest.raises(KeyError, match=r"no profile for model 'zz' at batch 4.*'a@1'"):
        decide_pool_size(0.0, [FunctionPosition("f", "zz", 4, 0, 0.0)], PROFILES, 0)
    with pytest.raises(ValueError, match="kernels 0..3"):
        decide_pool_size(0.0, [FunctionPosition("f", "a", 1, 4, 0.0)], PROFILES, 0)
    with pytest.raises(ValueError, match="no kernels"):
        ModelProfile.from_pairs("x", 1, [])
    with pytest.raises(ValueError, match="finite runtime_s"):
        ModelProfile.from_pairs("x", 1, [(1, float("nan"))])
    with pytest.raises(ValueError, match="two profiles"):
        index_profiles([A, A])
    with pytest.raises(ValueError, match="quantum_bytes"):
        ScalingConfig(quantum_bytes=0)


def test_max_live_range_queries() -> None:
    p = ModelProfile.from_pairs("x", 1, [(5, 1), (1, 1), (7, 1), (3, 1), (2, 1), (9, 1), (4, 1)])
    lives = [5, 1, 7, 3, 2, 9, 4]
    for i in range(7):
        for j in range(i, 7):
            assert p.max_live(i, j) == max(lives[i : j + 1])
    assert p.peak_bytes == 9 and p.total_runtime_s == 7
    with pytest.raises(IndexError):
        p.max_live(3, 7)


# -- cross-check against a step-by-step walk --------------------------------------------------------


def reference_next(profile: ModelProfile, kernel: int, elapsed: float, horizon: float) -> int:
    """m_next by walking the plan kernel by kernel (the paper's inner loop, literally)."""
    kernels = profile.kernels
    m = kernels[kernel].live_bytes
    start = max(0.0, kernels[kernel].runtime_s - max(0.0, elapsed))
    for j in range(kernel + 1, len(kernels)):
        if start > horizon + EPSILON_S:
            break
        m = max(m, kernels[j].live_bytes)
        start += kernels[j].runtime_s
    return m


runtimes = st.sampled_from([0.0, 0.001, 0.004, 0.01, 0.0125, 0.03, 0.1])
profiles_st = st.lists(
    st.lists(st.tuples(st.integers(0, 1 << 30), runtimes), min_size=1, max_size=30), min_size=1, max_size=4
)


@settings(max_examples=300, deadline=None)
@given(
    plans=profiles_st,
    data=st.data(),
    horizon=st.sampled_from([0.0, 0.005, 0.01, 0.02, 0.05]),
    quantum=st.sampled_from([1, 256, 2 << 20]),
    pool=st.integers(0, 1 << 34),
    fixed=st.integers(0, 1 << 30),
)
def test_target_covers_current_and_next_demand(plans, data, horizon, quantum, pool, fixed) -> None:  # type: ignore[no-untyped-def]
    profiles = index_profiles(ModelProfile.from_pairs(f"m{i}", 1, p) for i, p in enumerate(plans))
    now = 100.0
    positions = []
    for n in range(data.draw(st.integers(0, 6))):
        model = data.draw(st.integers(0, len(plans) - 1))
        kernel = data.draw(st.integers(0, len(plans[model]) - 1))
        elapsed = data.draw(st.sampled_from([0.0, 0.002, 0.01, 0.05, 1.0]))
        positions.append(FunctionPosition.from_elapsed(n, f"m{model}", 1, kernel, elapsed, now))
    cfg = ScalingConfig(t_interval_s=horizon, quantum_bytes=quantum)
    d = decide_pool_size(now, positions, profiles, pool_bytes=pool, config=cfg, fixed_bytes=fixed)
    current = sum(profiles[p.key].kernels[p.kernel].live_bytes for p in positions)
    nxt = sum(
        reference_next(profiles[p.key], p.kernel, now - p.kernel_started_at, horizon) for p in positions
    )
    assert (d.current_demand, d.next_demand) == (current, nxt)
    assert d.target_bytes >= current + fixed
    assert d.target_bytes >= nxt + fixed
    assert d.target_bytes % quantum == 0
    assert d.target_bytes - quantum < max(current, nxt) + fixed  # no more than one quantum extra
    assert d.delta_bytes == d.target_bytes - pool
