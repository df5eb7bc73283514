"""Workload shaping: pattern rules on hand-made series, choosing and mapping functions, rate scaling,
and arrivals (counts per minute kept exactly; seeded)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from streambox.replay import load_trace, sample_trace
from streambox.replay.shaping import (
    Chosen,
    build_arrivals,
    choose_functions,
    classify,
    map_to_workflows,
    minute_arrivals,
    scale_counts,
    stable_seed,
    thin_timestamps,
)
from streambox.replay.traces import FunctionKey, FunctionSeries

N = 120


def series(values) -> np.ndarray:
    return np.asarray(values, dtype=np.int64)


def every(period: int, count: int = 1, n: int = N, offset: int = 0) -> np.ndarray:
    x = np.zeros(n, dtype=np.int64)
    x[offset::period] = count
    return x


# -- pattern rules, one hand-made series per rule ------------------------------------------------------


def test_empty_series_is_sporadic():
    assert (classify(np.zeros(N, dtype=np.int64)).kind, classify(np.zeros(N, dtype=np.int64)).rule) == (
        "sporadic", "empty")


def test_timer_trigger_is_periodic_whatever_the_shape():
    x = np.zeros(N, dtype=np.int64)
    x[[3, 50]] = 1
    pattern = classify(x, trigger="timer")
    assert (pattern.kind, pattern.rule) == ("periodic", "timer")
    assert classify(x, trigger="http").kind == "sporadic"  # the same series without the timer


def test_evenly_spaced_invocations_are_periodic_regular():
    pattern = classify(every(5), trigger="http")
    assert (pattern.kind, pattern.rule) == ("periodic", "regular")
    assert pattern.stats.gap_cv == 0.0 and pattern.stats.active_cv == 0.0
    steady = classify(np.full(N, 6))  # a constant stream every minute is regular too
    assert (steady.kind, steady.rule) == ("periodic", "regular")


def test_a_repeating_shape_with_uneven_gaps_is_periodic_by_autocorrelation():
    # two invocations 2 minutes apart every 10 minutes: gaps 2, 8, 2, 8 ... (gap CV 0.6)
    x = every(10) + every(10, offset=2)
    pattern = classify(x)
    assert (pattern.kind, pattern.rule) == ("periodic", "autocorrelation")
    assert pattern.stats.acf_lag == 10 and pattern.stats.acf_peak > 0.9


def test_clumps_far_denser_than_the_mean_are_bursty():
    x = np.zeros(N, dtype=np.int64)
    x[[7, 8, 9]] = [20, 35, 12]  # one burst
    x[[70, 71]] = [15, 9]  # and another, at an unrelated distance
    x[[30, 100]] = 1
    pattern = classify(x)
    assert (pattern.kind, pattern.rule) == ("bursty", "bursty")
    assert pattern.stats.dispersion >= 2 and pattern.stats.cv >= 1 and pattern.stats.peak == 35


def test_rare_lone_invocations_are_sporadic():
    x = np.zeros(N, dtype=np.int64)
    x[[4, 11, 40, 41, 77, 90, 118]] = 1  # irregular, never more than 1
    pattern = classify(x)
    assert (pattern.kind, pattern.rule) == ("sporadic", "sporadic")
    assert pattern.stats.idle_share == pytest.approx(1 - 7 / N)


def test_few_small_clumps_are_not_bursty_below_the_peak_threshold():
    x = np.zeros(N, dtype=np.int64)
    x[[5, 60, 61]] = [4, 3, 4]  # dispersion and CV are high, but no minute reaches 5
    assert classify(x).kind == "sporadic"


def test_a_busy_smooth_rate_is_periodic_steady():
    rng = np.random.default_rng(1)
    x = rng.poisson(3, N)  # busy (few idle minutes), Poisson-like: dispersion ~1, no period
    pattern = classify(x)
    assert pattern.stats.idle_share < 0.5
    assert (pattern.kind, pattern.rule) == ("periodic", "steady")


def test_sample_covers_all_three_patterns():
    trace = load_trace(sample_trace())
    kinds = sorted(classify(s.counts, s.trigger).kind for s in trace.functions)
    assert kinds == ["bursty"] * 4 + ["periodic"] * 4 + ["sporadic"] * 4


# -- choosing and mapping ------------------------------------------------------------------------------


def _fs(name: str, counts, trigger=None) -> FunctionSeries:
    return FunctionSeries(FunctionKey("app", name), trigger, series(counts))


FUNCTIONS = [
    _fs("a", every(5, 1, 60)),  # periodic, 12
    _fs("b", np.r_[np.zeros(30, int), [30, 40, 20], np.zeros(27, int)]),  # bursty, 90
    _fs("c", np.r_[[1], np.zeros(59, int)]),  # sporadic, 1
    _fs("d", np.full(60, 2)),  # periodic, 120
    _fs("e", np.zeros(60, int)),  # never invoked
]


def test_choose_by_volume_in_the_window():
    picked = choose_functions(FUNCTIONS, 2, by="volume")
    assert [c.key.function for c in picked] == ["b", "d"]
    # minutes [0, 10): b is idle there, so c (1 invocation) makes the cut after d and a
    picked = choose_functions(FUNCTIONS, 3, by="volume", start_minute=0, minutes=10)
    assert [c.key.function for c in picked] == ["a", "c", "d"]


def test_choose_by_pattern_stratified_random_and_include():
    assert [c.key.function for c in choose_functions(FUNCTIONS, 5, patterns=["periodic"])] == ["a", "d"]
    assert [c.key.function for c in choose_functions(FUNCTIONS, 3, by="stratified")] == ["b", "c", "d"]
    first = choose_functions(FUNCTIONS, 2, by="random", seed=7)
    assert [c.key for c in first] == [c.key for c in choose_functions(FUNCTIONS, 2, by="random", seed=7)]
    assert [c.key.function for c in choose_functions(FUNCTIONS, 2, include=["app/c"])] == ["c", "d"]
    with pytest.raises(ValueError, match="not found"):
        choose_functions(FUNCTIONS, 2, include=["e"])  # never invoked
    with pytest.raises(ValueError, match="unknown patterns"):
        choose_functions(FUNCTIONS, 2, patterns=["spiky"])


def test_mapping_strategies():
    keys = [FunctionKey("app", name) for name in "abcde"]
    rr = map_to_workflows(keys, ["x", "y"], "round-robin")
    assert [rr[k] for k in keys] == ["x", "y", "x", "y", "x"]
    stripe = map_to_workflows(keys, ["x", "y"], "stripe")
    assert [stripe[k] for k in keys] == ["x", "x", "x", "y", "y"]
    explicit = map_to_workflows(keys[:2], ["x", "y"], "explicit", {"a": "y", "app/b": "x"})
    assert [explicit[k] for k in keys[:2]] == ["y", "x"]
    with pytest.raises(ValueError, match="no workflow for: app/b"):
        map_to_workflows(keys[:2], ["x"], "explicit", {"a": "x"})
    with pytest.raises(ValueError, match="unknown mapping"):
        map_to_workflows(keys, ["x"], "zigzag")
    # A typo in --map is refused, not replayed as errors of the system under test or ignored.
    with pytest.raises(ValueError, match=r"--map app/b=nowhere: not one of the replayed workflows \(x, y\)"):
        map_to_workflows(keys[:2], ["x", "y"], "explicit", {"a": "y", "app/b": "nowhere"})
    with pytest.raises(ValueError, match="--map zz: no replayed function is named so"):
        map_to_workflows(keys[:2], ["x", "y"], "explicit", {"a": "y", "app/b": "x", "zz": "x"})


# -- scaling -------------------------------------------------------------------------------------------


def test_scale_counts_by_cumulative_rounding():
    assert scale_counts(series([1] * 10), 0.1).tolist() == [0, 0, 0, 0, 1, 0, 0, 0, 0, 0]
    assert scale_counts(series([3, 0, 7]), 2.0).tolist() == [6, 0, 14]
    assert scale_counts(series([5, 5, 5, 5]), 0.5).tolist() == [3, 2, 3, 2]
    with pytest.raises(ValueError):
        scale_counts(series([1]), -1)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(0, 50), min_size=1, max_size=80), st.floats(0.01, 5.0))
def test_scaled_totals_track_the_original_everywhere(counts, factor):
    scaled = scale_counts(series(counts), factor)
    assert (scaled >= 0).all()
    # every running total is within 0.5 of the exact scaled running total
    assert np.all(np.abs(np.cumsum(scaled) - factor * np.cumsum(counts)) <= 0.5 + 1e-9)


def test_thinning_timestamps_matches_count_scaling():
    times = np.arange(10.0)
    assert thin_timestamps(times, 0.5).tolist() == [0.0, 2.0, 4.0, 6.0, 8.0]
    assert thin_timestamps(times[:2], 2.0).tolist() == [0.0, 0.0, 1.0, 1.0]


# -- arrivals ------------------------------------------------------------------------------------------


def test_even_spacing_exact_times_and_idle_minutes_kept():
    times = minute_arrivals(series([2, 0, 1, 4]), 60.0, "even")
    assert times.tolist() == [15.0, 45.0, 150.0, 187.5, 202.5, 217.5, 232.5]


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(0, 30), min_size=1, max_size=50), st.floats(0.05, 120.0), st.integers(0, 2**31))
def test_counts_per_minute_preserved_exactly(counts, minute_seconds, seed):
    for spacing in ("even", "poisson"):
        times = minute_arrivals(series(counts), minute_seconds, spacing, np.random.default_rng(seed))
        assert np.all(np.diff(times) >= 0)
        per_minute = np.bincount((times // minute_seconds).astype(int), minlength=len(counts))
        assert per_minute.tolist() == counts


def test_poisson_spacing_is_seeded():
    counts = series([5, 0, 9])
    a = minute_arrivals(counts, 60.0, "poisson", np.random.default_rng(3))
    b = minute_arrivals(counts, 60.0, "poisson", np.random.default_rng(3))
    c = minute_arrivals(counts, 60.0, "poisson", np.random.default_rng(4))
    assert a.tolist() == b.tolist() and a.tolist() != c.tolist()
    assert stable_seed(0, "x").random() == stable_seed(0, "x").random()


def _chosen(fs: FunctionSeries) -> Chosen:
    return Chosen(fs, classify(fs.counts), fs.counts)


def test_build_arrivals_merges_scales_and_compresses_time():
    chosen = [_chosen(FUNCTIONS[0]), _chosen(FUNCTIONS[3])]  # a (1 every 5 min), d (2 every min)
    mapping = {chosen[0].key: "x", chosen[1].key: "y"}
    arrivals = build_arrivals(chosen, mapping, minutes=10, minute_seconds=6.0, spacing="even")
    assert len(arrivals) == 2 + 20
    assert [a.time_s for a in arrivals] == sorted(a.time_s for a in arrivals)
    assert arrivals[0].time_s == 1.5 and arrivals[0].workflow == "y"  # d's first of 2 in minute 0
    assert {a.workflow for a in arrivals if a.function.function == "a"} == {"x"}
    assert all(a.time_s < 60.0 for a in arrivals)  # 10 trace minutes in 60 s
    assert [a.minute for a in arrivals if a.function.function == "a"] == [0, 5]
    half = build_arrivals(chosen, mapping, minutes=10, rate_scale=0.5, spacing="even")
    assert len(half) == 11
    again = build_arrivals(chosen, mapping, minutes=10, spacing="poisson", seed=5)
    assert again == build_arrivals(chosen, mapping, minutes=10, spacing="poisson", seed=5)
    alone = build_arrivals(chosen[1:], mapping, minutes=10, spacing="poisson", seed=5)
    assert [a.time_s for a in alone] == [a.time_s for a in again if a.function.function == "d"]


def test_trace_spacing_uses_2021_timestamps():
    fs = FunctionSeries(FunctionKey("a", "f"), None, series([2, 1]), np.array([1.0, 30.0, 90.0]))
    arrivals = build_arrivals([_chosen(fs)], {fs.key: "w"}, start_minute=0, minutes=2, minute_seconds=30.0,
                              spacing="trace")
    assert [a.time_s for a in arrivals] == [0.5, 15.0, 45.0]
    with pytest.raises(ValueError, match="needs per-invocation timestamps"):
        build_arrivals([_chosen(FUNCTIONS[0])], {FUNCTIONS[0].key: "w"}, spacing="trace")
