"""A run's numbers: the summary (pure, from records and samples) and the run directory's files.

A run directory holds:
- `config.json`: the run's full configuration (written before the first request),
- `requests.csv`: one row per request (RequestRecord's fields plus the function's pattern; the
  request's phases in ms, `PHASE_COLUMNS`, empty where the system did not measure them),
- `samples.csv`: one row per sample of the target (t_s, memory_used_bytes, pool_bytes, demand_bytes,
  memory.<component>_bytes, outstanding, ...),
- `summary.json`: the figures below, `memory_by_workflow` (mean and peak of each `workflow_memory.*`
  series: the device bytes of one workflow's runtimes), and `counters`: each `counter.*` sample
  column's last value (the proxies' pool grows and trims, their IO daemons' blocks, ...).

Definitions: throughput = requests with status "ok" / run duration (start to the last completion);
goodput counts only those within the SLO; latency percentiles are over "ok" requests; mean memory is
the time average (trapezoidal) of the samples, i.e. the memory-time integral over the sampled span
divided by that span, as the paper's "overall memory usage divided by the execution time".
"""

from __future__ import annotations

import csv
import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import asdict, fields
from pathlib import Path
from typing import Any

import numpy as np

from streambox.phases import PHASES

from .driver import DriveResult, RequestRecord
from .target import COMPONENT_PREFIX, COUNTER_PREFIX, WORKFLOW_MEMORY_PREFIX

MEMORY_KEYS = ("memory_used_bytes", "pool_bytes", "demand_bytes")
#: requests.csv's phase columns (ms), one per `streambox.phases.PHASES`, in that order
PHASE_COLUMNS = tuple(f"{phase}_ms" for phase in PHASES)


def _percentiles_ms(values: Sequence[float]) -> dict[str, float | None]:
    if not values:
        return {"p50": None, "p90": None, "p99": None, "mean": None, "max": None}
    ms = np.asarray(values, dtype=float) * 1e3
    p50, p90, p99 = (float(v) for v in np.percentile(ms, [50, 90, 99]))
    return {"p50": p50, "p90": p90, "p99": p99, "mean": float(ms.mean()), "max": float(ms.max())}


def time_average(times: Sequence[float], values: Sequence[float]) -> float:
    """Trapezoidal time average of samples (nan when there are none; the value when only one)."""
    t = np.asarray(times, dtype=float)
    v = np.asarray(values, dtype=float)
    keep = ~np.isnan(v)
    t, v = t[keep], v[keep]
    if len(v) == 0:
        return math.nan
    if len(v) == 1 or t[-1] <= t[0]:
        return float(v.mean())
    return float(np.trapezoid(v, t) / (t[-1] - t[0]))


def _series_stats(samples: Sequence[Mapping[str, float]], key: str) -> dict[str, float] | None:
    points = [(s["t_s"], s[key]) for s in samples if key in s]
    if not points:
        return None
    times, values = zip(*points, strict=True)
    return {"mean_bytes": time_average(times, values), "peak_bytes": float(max(values))}


def _last_counters(samples: Sequence[Mapping[str, float]]) -> dict[str, float]:
    """Each running count's last sampled value (its total over the run, as of the last sample)."""
    last: dict[str, float] = {}
    for sample in samples:
        last.update((k[len(COUNTER_PREFIX) :], v) for k, v in sample.items() if k.startswith(COUNTER_PREFIX))
    return last


def summarize(result: DriveResult, *, slo_s: float, window_s: float | None = None) -> dict[str, Any]:
    """The summary of one run (see the module's docstring for the definitions)."""
    records = result.records
    by_status = {s: sum(r.status == s for r in records) for s in sorted({r.status for r in records})}
    ok = [r for r in records if r.status == "ok"]
    duration = result.duration_s if result.duration_s > 0 else math.nan
    violations = sum(r.slo_violation for r in records)
    lags = [max(r.sent_s - r.scheduled_s, 0.0) for r in records]
    memory = {key: _series_stats(result.samples, key) for key in MEMORY_KEYS}
    components = sorted({k for s in result.samples for k in s if k.startswith(COMPONENT_PREFIX)})
    workflows = sorted({k for s in result.samples for k in s if k.startswith(WORKFLOW_MEMORY_PREFIX)})
    pool, demand = memory["pool_bytes"], memory["demand_bytes"]
    return {
        "requests": {
            "planned": result.planned,
            "recorded": len(records),
            "stopped_by": result.stopped_by,
            "by_status": by_status,
        },
        "duration_s": result.duration_s,
        "offered_rps": result.planned / window_s if window_s else None,
        "throughput_rps": len(ok) / duration,
        "goodput_rps": sum(not r.slo_violation for r in records) / duration,
        "latency_ms": _percentiles_ms([r.latency_s for r in ok]),
        "slo_ms": slo_s * 1e3,
        "slo_violations": violations,
        "slo_violation_rate": violations / len(records) if records else None,
        "cold_starts": sum(r.cold_start for r in records),
        "cold_start_rate": sum(r.cold_start for r in records) / len(records) if records else None,
        "memory": memory,
        "memory_components": {c: _series_stats(result.samples, c) for c in components},
        "memory_by_workflow": {
            w[len(WORKFLOW_MEMORY_PREFIX) :]: _series_stats(result.samples, w) for w in workflows
        },
        "counters": _last_counters(result.samples),
        "pool_over_demand": (
            pool["mean_bytes"] / demand["mean_bytes"]
            if pool and demand and demand["mean_bytes"] > 0
            else None
        ),
        "driver": {
            "send_lag_ms": _percentiles_ms(lags),
            "max_outstanding": result.max_outstanding,
            "samples": len(result.samples),
            "sample_errors": result.sample_errors[:20],
        },
    }


# -- files ---------------------------------------------------------------------------------------------


def _clean(value: Any) -> Any:
    """JSON without NaN: nan and inf become null."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, Mapping):
        return {str(k): _clean(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_clean(v) for v in value]
    if isinstance(value, Path):
        return str(value)
    return value


def write_json(path: Path, data: Mapping[str, Any]) -> None:
    path.write_text(json.dumps(_clean(data), indent=2, sort_keys=False) + "\n")


def write_requests(path: Path, records: Sequence[RequestRecord], patterns: Mapping[str, str]) -> None:
    names = [f.name for f in fields(RequestRecord)]
    with open(path, "w", newline="") as stream:
        writer = csv.DictWriter(stream, fieldnames=[*names[:3], "pattern", *names[3:]])
        writer.writeheader()
        for record in records:
            row = asdict(record)
            row["pattern"] = patterns.get(record.function, "")
            for key in ("scheduled_s", "sent_s", "latency_s", "target_latency_s"):
                row[key] = "" if math.isnan(row[key]) else f"{row[key]:.6f}"
            for key in PHASE_COLUMNS:
                row[key] = "" if math.isnan(row[key]) else f"{row[key]:.3f}"
            writer.writerow(row)


def sample_columns(samples: Sequence[Mapping[str, float]]) -> list[str]:
    keys = {k for s in samples for k in s}
    first = [k for k in ("t_s", *MEMORY_KEYS) if k in keys]
    components = sorted(k for k in keys if k.startswith(COMPONENT_PREFIX))
    return first + components + sorted(keys - set(first) - set(components))


def write_samples(path: Path, samples: Sequence[Mapping[str, float]]) -> None:
    columns = sample_columns(samples) or ["t_s"]
    with open(path, "w", newline="") as stream:
        writer = csv.DictWriter(stream, fieldnames=columns, restval="")
        writer.writeheader()
        for sample in samples:
            writer.writerow({k: (f"{v:.6f}" if k == "t_s" else repr(v)) for k, v in sample.items()})


def read_requests(path: Path) -> list[dict[str, str]]:
    with open(path, newline="") as stream:
        return list(csv.DictReader(stream))


def read_samples(path: Path) -> dict[str, np.ndarray]:
    """samples.csv as columns of floats (nan where a sample lacked the key)."""
    with open(path, newline="") as stream:
        rows = list(csv.DictReader(stream))
    if not rows:
        return {}
    return {key: np.array([float(r[key]) if r[key] != "" else math.nan for r in rows]) for key in rows[0]}
