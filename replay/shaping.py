"""Workload shaping: classify, choose, map, scale, and turn per-minute counts into arrival times.

Pure functions over numpy arrays: no clocks, no I/O; every random choice comes from a seed, so the
same arguments give the same workload on every machine.

Pattern rules (`classify`, thresholds in `PatternRules`), applied in order, the first that matches wins;
all statistics are over the function's per-minute counts x_1..x_n:

1. no invocation at all -> sporadic ("empty").
2. trigger is `timer` and the function ran in >= 2 minutes -> periodic ("timer").
3. >= 3 active minutes, the gaps between consecutive active minutes have a coefficient of variation
   (CV) <= 0.1, the counts of the active minutes a CV <= 0.5, and the idle stretches before the first
   and after the last active minute are no longer than the largest gap -> periodic ("regular"):
   evenly spaced invocations through the whole series, e.g. every 5 minutes, or a steady stream
   every minute (a lone run of busy minutes is not regular).
4. >= 3 active minutes and the autocorrelation of x has a peak >= 0.6 at some lag between the first
   lag where it falls to <= 0 (and >= 2) and n/3 (so that >= 3 periods fit) -> periodic
   ("autocorrelation").
5. CV of x >= 1, variance/mean (index of dispersion; 1 for Poisson arrivals) >= 2 and a peak minute
   >= 5 invocations -> bursty ("bursty"): invocations come in clumps far denser than their average.
6. idle in >= 50 % of the minutes, and less than half of the active minutes lie in runs of >= 10
   consecutive active minutes -> sporadic ("sporadic"): rare invocations, alone or in short sessions,
   with idle time between them.
7. otherwise -> periodic ("steady"): a sustained rate with low variation (smooth, diurnal, or a
   stream that runs for hours of the day and is off otherwise).
"""

from __future__ import annotations

import heapq
import zlib
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from .choices import MAPPINGS, PATTERNS, SELECTIONS, SPACINGS
from .traces import FunctionKey, FunctionSeries

MAX_ARRIVALS_PER_MINUTE = 1_000_000  # per function and trace minute, after scaling


# -- classification ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class PatternRules:
    """The thresholds of the pattern rules (see the module's docstring)."""

    min_active_minutes: int = 3
    regular_gap_cv_max: float = 0.1
    regular_count_cv_max: float = 0.5
    acf_peak_min: float = 0.6
    bursty_cv_min: float = 1.0
    bursty_dispersion_min: float = 2.0
    bursty_peak_min: int = 5
    sporadic_idle_min: float = 0.5
    long_run_minutes: int = 10
    sporadic_long_run_share_max: float = 0.5


DEFAULT_RULES = PatternRules()


@dataclass(frozen=True)
class SeriesStats:
    minutes: int
    total: int
    active_minutes: int
    idle_share: float
    cv: float  # std / mean of the per-minute counts
    dispersion: float  # variance / mean
    peak: int
    gap_cv: float  # CV of the gaps between consecutive active minutes (nan with < 2 gaps)
    long_run_share: float  # share of the active minutes in runs of >= 10 consecutive active minutes
    covers: bool  # idle stretches at either end are no longer than the largest gap
    active_cv: float  # CV of the counts of active minutes
    acf_peak: float  # autocorrelation peak after its first fall to <= 0 (0 when none)
    acf_lag: int  # its lag in minutes (0 when none)


@dataclass(frozen=True)
class Pattern:
    kind: str  # one of PATTERNS
    rule: str  # the rule that decided: empty, timer, regular, autocorrelation, bursty, sporadic, steady
    stats: SeriesStats

    def as_dict(self) -> dict:
        return {"kind": self.kind, "rule": self.rule, **asdict(self.stats)}


def _cv(values: np.ndarray) -> float:
    mean = float(values.mean()) if len(values) else 0.0
    return float(values.std() / mean) if mean > 0 else float("nan")


def autocorrelation(x: np.ndarray) -> np.ndarray:
    """Sample autocorrelation r_0..r_{n-1} (biased estimator, r_0 = 1); zeros for a constant series."""
    x = np.asarray(x, dtype=float)
    n = len(x)
    centred = x - x.mean()
    variance = float(centred @ centred)
    if n == 0 or variance == 0:
        return np.zeros(n)
    spectrum = np.fft.rfft(centred, 2 * n)
    return np.fft.irfft(spectrum * np.conj(spectrum), 2 * n)[:n] / variance


def _acf_peak(x: np.ndarray) -> tuple[float, int]:
    acf = autocorrelation(x)
    n = len(acf)
    below = np.flatnonzero(acf[1:] <= 0)
    if not len(below):
        return 0.0, 0
    first = max(int(below[0]) + 1, 2)
    last = n // 3
    if first > last:
        return 0.0, 0
    lag = first + int(np.argmax(acf[first : last + 1]))
    return float(acf[lag]), lag


def _long_run_share(active: np.ndarray, length: int) -> float:
    if not active.any():
        return 0.0
    edges = np.diff(np.r_[0, active.astype(np.int8), 0])
    runs = np.flatnonzero(edges == -1) - np.flatnonzero(edges == 1)
    return float(runs[runs >= length].sum() / runs.sum())


def series_stats(counts: np.ndarray) -> SeriesStats:
    x = np.asarray(counts, dtype=np.int64)
    n = len(x)
    active = np.flatnonzero(x > 0)
    mean = float(x.mean()) if n else 0.0
    gaps = np.diff(active)
    acf_peak, acf_lag = _acf_peak(x) if len(active) >= 2 else (0.0, 0)
    return SeriesStats(
        minutes=n,
        total=int(x.sum()),
        active_minutes=len(active),
        idle_share=1.0 - len(active) / n if n else 1.0,
        cv=_cv(x.astype(float)) if mean > 0 else float("nan"),
        dispersion=float(x.var() / mean) if mean > 0 else float("nan"),
        peak=int(x.max()) if n else 0,
        gap_cv=_cv(gaps.astype(float)) if len(gaps) >= 2 else float("nan"),
        long_run_share=_long_run_share(x > 0, DEFAULT_RULES.long_run_minutes),
        covers=bool(len(gaps)) and max(int(active[0]), n - 1 - int(active[-1])) <= int(gaps.max()),
        active_cv=_cv(x[active].astype(float)) if len(active) else float("nan"),
        acf_peak=acf_peak,
        acf_lag=acf_lag,
    )


def classify(counts: np.ndarray, trigger: str | None = None, rules: PatternRules = DEFAULT_RULES) -> Pattern:
    """Sporadic, periodic or bursty, by the rules in the module's docstring; `rule` says which fired."""
    s = series_stats(counts)
    if s.total == 0:
        return Pattern("sporadic", "empty", s)
    if trigger == "timer" and s.active_minutes >= 2:
        return Pattern("periodic", "timer", s)
    if (
        s.active_minutes >= rules.min_active_minutes
        and s.gap_cv <= rules.regular_gap_cv_max
        and s.active_cv <= rules.regular_count_cv_max
        and s.covers
    ):
        return Pattern("periodic", "regular", s)
    if s.active_minutes >= rules.min_active_minutes and s.acf_peak >= rules.acf_peak_min:
        return Pattern("periodic", "autocorrelation", s)
    if (
        s.cv >= rules.bursty_cv_min
        and s.dispersion >= rules.bursty_dispersion_min
        and s.peak >= rules.bursty_peak_min
    ):
        return Pattern("bursty", "bursty", s)
    if s.idle_share >= rules.sporadic_idle_min and s.long_run_share < rules.sporadic_long_run_share_max:
        return Pattern("sporadic", "sporadic", s)
    return Pattern("periodic", "steady", s)


# -- choosing functions --------------------------------------------------------------------------------


@dataclass(frozen=True)
class Chosen:
    """A function chosen for the workload, with its pattern (over its whole series) and its counts in
    the replay window."""

    series: FunctionSeries
    pattern: Pattern
    window_counts: np.ndarray

    @property
    def key(self) -> FunctionKey:
        return self.series.key


def _window(counts: np.ndarray, start: int, minutes: int | None) -> np.ndarray:
    end = len(counts) if minutes is None else start + minutes
    window = counts[start:end]
    if end > len(counts):  # past the trace's end: idle minutes
        window = np.concatenate([window, np.zeros(end - len(counts), dtype=np.int64)])
    return window


def stable_seed(seed: int, text: str) -> np.random.Generator:
    """A generator seeded by (seed, text), the same on every machine and Python process."""
    return np.random.default_rng([seed, zlib.crc32(text.encode())])


def choose_functions(
    functions: Sequence[FunctionSeries],
    count: int,
    *,
    by: str = "volume",
    patterns: Sequence[str] | None = None,
    start_minute: int = 0,
    minutes: int | None = None,
    seed: int = 0,
    include: Sequence[str] = (),
    rules: PatternRules = DEFAULT_RULES,
) -> list[Chosen]:
    """Choose `count` functions that have invocations in the window [start_minute, +minutes).

    by="volume": the most invoked in the window (ties by key); "random": a seeded uniform sample;
    "stratified": an equal share of each pattern (bursty, periodic, sporadic, in that order for the
    remainder), the most invoked within each, topped up by volume where a pattern has too few.
    `patterns` keeps only functions of those patterns; `include` (keys as `app/function`, a bare
    function hash, or a key's label) puts those first. Patterns are judged on the whole series: a
    few minutes are too short to see a period. The result is in a stable order (by key)."""
    if by not in SELECTIONS:
        raise ValueError(f"unknown selection {by!r}; choose one of: {', '.join(SELECTIONS)}")
    unknown = set(patterns or ()) - set(PATTERNS)
    if unknown:
        raise ValueError(f"unknown patterns {sorted(unknown)}; choose from: {', '.join(PATTERNS)}")
    candidates = []
    for series in functions:
        window = _window(series.counts, start_minute, minutes)
        if window.sum() == 0:
            continue
        pattern = classify(series.counts, series.trigger, rules)
        if patterns and pattern.kind not in patterns:
            continue
        candidates.append(Chosen(series, pattern, window))
    by_volume = sorted(candidates, key=lambda c: (-int(c.window_counts.sum()), c.key))
    wanted = [c for c in by_volume if _matches(c.key, include)]
    missing = [name for name in include if not any(_matches(c.key, [name]) for c in wanted)]
    if missing:
        raise ValueError(f"functions not found with invocations in the window: {', '.join(missing)}")
    rest = [c for c in by_volume if c not in wanted]
    need = max(count - len(wanted), 0)
    if by == "volume":
        picked = rest[:need]
    elif by == "random":
        rng = np.random.default_rng(seed)
        order = sorted(rest, key=lambda c: c.key)
        picked = [order[i] for i in sorted(rng.choice(len(order), size=min(need, len(order)), replace=False))]
    else:
        picked = _stratified(rest, need)
    return sorted(wanted + picked, key=lambda c: c.key)


def _stratified(by_volume: list[Chosen], need: int) -> list[Chosen]:
    order = ("bursty", "periodic", "sporadic")
    quota = {kind: need // 3 + (1 if i < need % 3 else 0) for i, kind in enumerate(order)}
    picked = []
    for kind in order:
        picked += [c for c in by_volume if c.pattern.kind == kind][: quota[kind]]
    picked += [c for c in by_volume if c not in picked][: need - len(picked)]
    return picked


def _matches(key: FunctionKey, names: Sequence[str]) -> bool:
    return any(name in (str(key), key.function, key.label()) for name in names)


# -- functions to workflows ----------------------------------------------------------------------------


def map_to_workflows(
    keys: Sequence[FunctionKey],
    workflows: Sequence[str],
    how: str = "round-robin",
    explicit: Mapping[str, str] | None = None,
) -> dict[FunctionKey, str]:
    """Assign each function to a workflow. round-robin: the i-th function to workflow i mod W;
    stripe: contiguous blocks (the first n/W functions to the first workflow, ...); explicit: from
    `explicit`, keyed as in `choose_functions`' `include`."""
    if not workflows:
        raise ValueError("no workflow to map functions to")
    if how == "round-robin":
        return {key: workflows[i % len(workflows)] for i, key in enumerate(keys)}
    if how == "stripe":
        return {key: workflows[i * len(workflows) // len(keys)] for i, key in enumerate(keys)}
    if how == "explicit":
        explicit = explicit or {}
        stray = [f"{name}={wf}" for name, wf in explicit.items() if wf not in workflows]
        if stray:
            raise ValueError(
                f"--map {', '.join(stray)}: not one of the replayed workflows ({', '.join(workflows)})"
            )
        unused = [name for name in explicit if not any(_matches(key, [name]) for key in keys)]
        if unused:
            raise ValueError(
                f"--map {', '.join(unused)}: no replayed function is named so (replayed: "
                f"{', '.join(str(k) for k in keys)})"
            )
        result, unmapped = {}, []
        for key in keys:
            hit = next((wf for name, wf in explicit.items() if _matches(key, [name])), None)
            if hit is None:
                unmapped.append(str(key))
            else:
                result[key] = hit
        if unmapped:
            raise ValueError(f"explicit mapping has no workflow for: {', '.join(unmapped)}")
        return result
    raise ValueError(f"unknown mapping {how!r}; choose one of: {', '.join(MAPPINGS)}")


# -- scaling and arrivals ------------------------------------------------------------------------------


def scale_counts(counts: np.ndarray, factor: float) -> np.ndarray:
    """Scale per-minute counts by `factor` with cumulative rounding: the running total after minute k
    is round(factor * original running total), so the day's total scales exactly, no minute drifts by
    one or more from its share, and no randomness is involved (factor 0.1 keeps every 10th invocation)."""
    if factor < 0:
        raise ValueError(f"rate scale must be >= 0, got {factor}")
    cumulative = np.floor(np.cumsum(np.asarray(counts, dtype=np.float64)) * factor + 0.5).astype(np.int64)
    return np.diff(cumulative, prepend=0)


def minute_arrivals(
    counts: np.ndarray, minute_seconds: float, spacing: str, rng: np.random.Generator | None = None
) -> np.ndarray:
    """Arrival times (seconds from the window's start) for per-minute counts; minute m spans
    [m * minute_seconds, (m + 1) * minute_seconds) and idle minutes stay idle.

    even: c arrivals at (k + 0.5) / c of the minute, k = 0..c-1; poisson: c uniform times inside the
    minute, which is a Poisson process conditioned on the minute's count (the count is kept exactly)."""
    counts = np.asarray(counts, dtype=np.int64)
    starts = np.repeat(np.arange(len(counts)) * minute_seconds, counts)
    if spacing == "even":
        within = np.concatenate([(np.arange(c) + 0.5) / c for c in counts if c > 0] or [np.zeros(0)])
        return starts + within * minute_seconds
    if spacing == "poisson":
        if rng is None:
            raise ValueError("poisson spacing needs a seeded generator")
        within = rng.random(len(starts)) * minute_seconds
        times = starts + within
        # sort inside each minute only (minutes are already in order)
        minute = np.repeat(np.arange(len(counts)), counts)
        return times[np.lexsort((times, minute))]
    raise ValueError(f"unknown spacing {spacing!r}; choose one of: {', '.join(SPACINGS)}")


def thin_timestamps(arrivals_s: np.ndarray, factor: float) -> np.ndarray:
    """Scale a list of arrival times by `factor` with the same cumulative rounding as `scale_counts`
    (factor > 1 repeats arrivals at the same instant)."""
    index = np.arange(len(arrivals_s) + 1, dtype=np.float64)
    repeats = np.diff(np.floor(index * factor + 0.5).astype(np.int64))
    return np.repeat(np.asarray(arrivals_s, dtype=float), repeats)


@dataclass(frozen=True)
class Arrival:
    time_s: float  # seconds from the start of the replay
    workflow: str
    function: FunctionKey
    minute: int  # the trace minute it stands for


def _function_times(
    item: Chosen,
    *,
    start_minute: int,
    minutes: int | None,
    rate_scale: float,
    minute_seconds: float,
    spacing: str,
    seed: int,
) -> Iterator[np.ndarray]:
    """One function's arrival times, a trace minute (or, for "trace", the window) at a time; the
    random draws are those of one `minute_arrivals` call over the whole window."""
    if spacing == "trace":
        if item.series.arrivals_s is None:
            raise ValueError(
                f"spacing 'trace' needs per-invocation timestamps (a 2021 log); {item.key} has none"
            )
        begin = start_minute * 60.0
        end = float("inf") if minutes is None else (start_minute + minutes) * 60.0
        raw = item.series.arrivals_s
        raw = thin_timestamps(raw[(raw >= begin) & (raw < end)], rate_scale)
        yield (raw - begin) * minute_seconds / 60.0
        return
    scaled = scale_counts(_window(item.series.counts, start_minute, minutes), rate_scale)
    busiest = int(scaled.max(initial=0))
    if busiest > MAX_ARRIVALS_PER_MINUTE:
        raise ValueError(
            f"{item.key}: scaling by {rate_scale:g} gives {busiest} arrivals in one trace minute; at most "
            f"{MAX_ARRIVALS_PER_MINUTE} are replayed per function and minute (lower --scale)"
        )
    rng = stable_seed(seed, str(item.key))
    for minute in np.flatnonzero(scaled):
        one = np.zeros(1, dtype=np.int64)
        one[0] = scaled[minute]
        yield minute * minute_seconds + minute_arrivals(one, minute_seconds, spacing, rng)


def iter_arrivals(
    chosen: Sequence[Chosen],
    mapping: Mapping[FunctionKey, str],
    *,
    start_minute: int = 0,
    minutes: int | None = None,
    rate_scale: float = 1.0,
    minute_seconds: float = 60.0,
    spacing: str = "poisson",
    seed: int = 0,
) -> Iterator[Arrival]:
    """Every function's arrivals in the window, merged in time order, generated lazily: memory holds
    one trace minute per function, whatever the trace's counts.

    A trace minute lasts `minute_seconds` of replay (60 = real time; 600/1440 puts a day into ten
    minutes, and rate_scale=1/144 then keeps the trace's per-second rate). spacing "trace" uses the 2021
    log's own timestamps. Each function draws from its own generator seeded by (seed, key), so adding
    a function does not move the others' arrivals."""
    if spacing not in SPACINGS:
        raise ValueError(f"unknown spacing {spacing!r}; choose one of: {', '.join(SPACINGS)}")
    if minute_seconds <= 0:
        raise ValueError(f"minute_seconds must be > 0, got {minute_seconds}")
    options = dict(
        start_minute=start_minute,
        minutes=minutes,
        rate_scale=rate_scale,
        minute_seconds=minute_seconds,
        spacing=spacing,
        seed=seed,
    )

    def stream(order: int, item: Chosen) -> Iterator[tuple[float, int, Arrival]]:
        workflow = mapping[item.key]
        for times in _function_times(item, **options):  # type: ignore[arg-type]
            for t in times.tolist():
                minute = start_minute + int(t // minute_seconds)
                yield t, order, Arrival(t, workflow, item.key, minute)

    streams = [stream(order, item) for order, item in enumerate(sorted(chosen, key=lambda c: c.key))]
    for _, _, arrival in heapq.merge(*streams, key=lambda entry: (entry[0], entry[1])):
        yield arrival


def build_arrivals(
    chosen: Sequence[Chosen],
    mapping: Mapping[FunctionKey, str],
    *,
    max_requests: int | None = None,
    max_duration_s: float | None = None,
    **options: Any,
) -> list[Arrival]:
    """`iter_arrivals` as a list, cut at the bounds: at most `max_requests` + 1 arrivals, none after
    the first one at or past `max_duration_s` (the one past a bound stays, so that the driver can
    say which bound stopped the run). Memory follows the bounds, not the trace."""
    out: list[Arrival] = []
    for arrival in iter_arrivals(chosen, mapping, **options):
        out.append(arrival)
        if max_requests is not None and len(out) > max_requests:
            break
        if max_duration_s is not None and arrival.time_s >= max_duration_s:
            break
    return out
