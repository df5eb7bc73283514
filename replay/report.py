"""`report(run_dirs, out_dir)`: comparison plots (PNG) and a comparison table of replay runs.

Plots, after the paper's figures (Wu et al., ATC'24):
- `memory_over_time.png` (Fig. 12 left; with a second panel of pool size against live demand,
  Fig. 15 right, when the runs sample them),
- `mean_memory.png` (Fig. 12 right: time-averaged memory per system, peak marked),
- `throughput.png` (Fig. 13: requests per second, all completed and within the SLO),
- `latency_cdf.png` (Fig. 14 a/b: end-to-end latency CDF, SLO marked),
- `slo_violations.png` (SLO violation rate and cold-start rate per system).

The table is printed with rich and written as comparison.md and comparison.json. Where a run labelled
"streambox" sits beside "stream-only" or "infless", a second table sets our ratios beside the
paper's claims.
"""

from __future__ import annotations

import json
import math
import textwrap
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402  (after choosing the Agg backend)
import numpy as np  # noqa: E402
from matplotlib.ticker import FuncFormatter  # noqa: E402
from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402
from rich.text import Text  # noqa: E402

from .metrics import read_requests, read_samples, write_json  # noqa: E402
from .paper.numbers import PAPER  # noqa: E402

MIB = float(1 << 20)
PLOTS = ("memory_over_time", "mean_memory", "throughput", "latency_cdf", "slo_violations")

#: What the paper reports for StreamBox against each baseline (section 9.1; the numbers and their quotes
#: live in `paper.numbers`, the one place of the paper's numbers); ours is set beside it.
PAPER_CLAIMS = {
    base: {
        claim: f"{PAPER[f'{key}.{base}'].headline()} ({PAPER[f'{key}.{base}'].where})"
        for claim, key in (("mean memory", "12.mean_memory"), ("throughput", "13.throughput"),
                           ("latency", "14.latency"))
    }
    for base in ("stream-only", "infless", "astraea")
}
PAPER_CLAIMS["monolithic"] = PAPER_CLAIMS["infless"]  # the deprecated name of infless


class ReportError(ValueError):
    """A run directory that cannot be reported (the message names it and what is missing)."""


@dataclass
class Run:
    label: str
    path: Path
    summary: dict[str, Any]
    samples: dict[str, np.ndarray]
    latencies_ms: np.ndarray  # of "ok" requests
    replayed: dict[str, Any] = field(default_factory=dict)  # config.json's `config`: what was replayed

    def metric(self, *keys: str) -> float:
        value: Any = self.summary
        for key in keys:
            value = value.get(key) if isinstance(value, dict) else None
        return float(value) if value is not None else math.nan


def load_run(path: str | Path) -> Run:
    path = Path(path)
    missing = [n for n in ("summary.json", "requests.csv", "samples.csv") if not (path / n).exists()]
    if missing:
        raise ReportError(f"{path}: not a finished replay run (missing {', '.join(missing)})")
    reading = path / "summary.json"
    try:  # a damaged file names itself: the run's own files are read one by one
        summary = json.loads(reading.read_text())
        if not isinstance(summary, dict):
            raise ValueError("not a JSON object")
        reading = path / "requests.csv"
        rows = read_requests(reading)
        latencies = np.array(
            [float(r["latency_s"]) * 1e3 for r in rows if r["status"] == "ok" and r["latency_s"]]
        )
        reading = path / "samples.csv"
        samples = read_samples(reading)
    except (ValueError, KeyError, TypeError, UnicodeDecodeError) as error:
        why = f"{type(error).__name__}: {error}"
        raise ReportError(f"{reading}: cannot be read as a replay's file ({why})") from None
    label = summary.get("label") or summary.get("system") or path.name
    try:  # older runs, or one whose config.json was lost: compared by their summaries alone
        replayed = json.loads((path / "config.json").read_text()).get("config") or {}
    except (OSError, ValueError, AttributeError):
        replayed = {}
    return Run(label, path, summary, samples, latencies, replayed if isinstance(replayed, dict) else {})


def _unique_labels(runs: list[Run]) -> None:
    """Runs with one label are told apart by the shortest end of their paths that differs (a
    comparison's folders are named after their systems: two comparisons differ in the folder above)."""
    labels = [run.label for run in runs]
    for label in set(labels):
        same = [run for run in runs if run.label == label]
        if len(same) < 2:
            continue
        parts = max(len(run.path.parts) for run in same)
        for depth in range(1, parts + 1):
            ends = [str(Path(*run.path.parts[-depth:])) for run in same]
            if len(set(ends)) == len(ends):
                break
        for run, end in zip(same, ends, strict=True):
            run.label = f"{label} ({end})"


def _colors(runs: Sequence[Run]) -> dict[str, Any]:
    palette = plt.get_cmap("tab10")
    return {run.label: palette(i % 10) for i, run in enumerate(runs)}


def _wrapped(label: str, width: int = 22) -> str:
    """A label on several lines for ticks and legends: options go under the system's name."""
    name, _, options = label.partition("[")
    if not options:
        return label
    return name + "\n" + textwrap.fill("[" + options.replace(",", ", "), width).replace(", ", ",")


def _positive(values: np.ndarray) -> np.ndarray:
    """Zeros as gaps, for log axes."""
    return np.where(values > 0, values, np.nan)


def _mib_axis(axis) -> None:
    axis.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:,.0f}" if v >= 1 else f"{v:.2g}"))


def _bars(
    axis, runs: Sequence[Run], values: Sequence[float], colors, fmt: str,
    texts: Sequence[tuple[float, str]] = (),
) -> None:
    """Bars with their values written above them (or `texts`: (height, text) per bar)."""
    x = np.arange(len(runs))
    heights = [0.0 if math.isnan(v) else v for v in values]
    axis.bar(x, heights, color=[colors[r.label] for r in runs], width=0.6)
    if not texts:
        texts = [(h, "n/a" if math.isnan(v) else fmt.format(v)) for h, v in zip(heights, values, strict=True)]
    for i, (height, text) in enumerate(texts):
        axis.annotate(text, (i, height), ha="center", va="bottom", fontsize=9, xytext=(0, 4),
                      textcoords="offset points")
    axis.set_xticks(x, [_wrapped(r.label) for r in runs], fontsize=9)
    axis.grid(axis="y", alpha=0.3)
    axis.margins(y=0.15)


def _plot_memory_over_time(runs, colors, path: Path) -> None:
    with_pool = [r for r in runs if "pool_bytes" in r.samples]
    fig, axes = plt.subplots(1, 2 if with_pool else 1, figsize=(12 if with_pool else 7, 4.2), squeeze=False)
    ax = axes[0][0]
    for run in runs:
        if "memory_used_bytes" in run.samples:
            ax.plot(run.samples["t_s"], _positive(run.samples["memory_used_bytes"]) / MIB,
                    label=_wrapped(run.label, 40), color=colors[run.label], lw=1.6)
    ax.set(title="Device memory used over time", xlabel="time (s)", ylabel="memory (MiB, log)")
    ax.set_yscale("log")
    _mib_axis(ax)
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=8)
    if with_pool:
        ax = axes[0][1]
        for run in with_pool:
            t = run.samples["t_s"]
            if "pool_bytes" in run.samples:
                ax.plot(t, _positive(run.samples["pool_bytes"]) / MIB, color=colors[run.label], lw=1.6,
                        label=f"{_wrapped(run.label, 40)} pool")
            if "demand_bytes" in run.samples:
                ax.plot(t, _positive(run.samples["demand_bytes"]) / MIB, color=colors[run.label], lw=1.2,
                        ls=":", label=f"{_wrapped(run.label, 40)} live demand")
        ax.set(title="Pool size against live demand", xlabel="time (s)", ylabel="memory (MiB, log)")
        ax.set_yscale("log")
        _mib_axis(ax)
        ax.grid(alpha=0.3, which="both")
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _plot_mean_memory(runs, colors, path: Path) -> None:
    fig, ax = plt.subplots(figsize=(1.6 * len(runs) + 3, 4.2))
    means = [r.metric("memory", "memory_used_bytes", "mean_bytes") / MIB for r in runs]
    peaks = [r.metric("memory", "memory_used_bytes", "peak_bytes") / MIB for r in runs]
    texts = [
        (0.0 if math.isnan(p) else p, f"mean {m:,.0f}\npeak {p:,.0f}")
        for m, p in zip(means, peaks, strict=True)
    ]
    _bars(ax, runs, means, colors, "{:,.0f}", texts)
    ax.scatter(np.arange(len(runs)), [0 if math.isnan(p) else p for p in peaks], marker="_", s=600,
               color="black", label="peak", zorder=3)
    ax.set(title="Mean device memory (time-averaged)", ylabel="memory (MiB)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _plot_throughput(runs, colors, path: Path) -> None:
    fig, ax = plt.subplots(figsize=(1.8 * len(runs) + 3, 4.2))
    x = np.arange(len(runs))
    done = [r.metric("throughput_rps") for r in runs]
    good = [r.metric("goodput_rps") for r in runs]
    ax.bar(x - 0.18, done, width=0.36, color=[colors[r.label] for r in runs], label="completed (ok)")
    ax.bar(x + 0.18, good, width=0.36, color=[colors[r.label] for r in runs], alpha=0.45, hatch="//",
           label="within SLO")
    for i in range(len(runs)):
        for dx, v in ((-0.18, done[i]), (0.18, good[i])):
            ax.annotate(f"{v:.2f}", (i + dx, v), ha="center", va="bottom", fontsize=8, xytext=(0, 2),
                        textcoords="offset points")
    offered = [r.metric("offered_rps") for r in runs]
    if not all(math.isnan(o) for o in offered):
        ax.axhline(np.nanmax(offered), color="grey", ls="--", lw=1, label="offered load")
    ax.set_xticks(x, [_wrapped(r.label) for r in runs], fontsize=9)
    ax.set(title="Throughput", ylabel="requests per second")
    ax.grid(axis="y", alpha=0.3)
    ax.margins(y=0.15)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _slos(runs: list[Run]) -> list[float]:
    """The SLOs the runs were measured against (a violation is counted against its own run's)."""
    return sorted({r.metric("slo_ms") for r in runs if not math.isnan(r.metric("slo_ms"))})


def _plot_latency_cdf(runs, colors, path: Path) -> None:
    fig, ax = plt.subplots(figsize=(7, 4.2))
    for run in runs:
        if len(run.latencies_ms):
            values = np.sort(run.latencies_ms)
            ax.step(values, np.arange(1, len(values) + 1) / len(values), where="post",
                    label=_wrapped(run.label, 40), color=colors[run.label], lw=1.6)
    for slo in _slos(runs):
        ax.axvline(slo, color="red", ls="--", lw=1, label=f"SLO {slo:g} ms")
    ax.set_xscale("log")
    ax.set(title="End-to-end latency CDF (completed requests)", xlabel="latency (ms, log)", ylabel="CDF",
           ylim=(0, 1.02))
    ax.grid(alpha=0.3, which="both")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _plot_slo(runs, colors, path: Path) -> None:
    fig, axes = plt.subplots(1, 2, figsize=(2.6 * len(runs) + 4, 4.2))
    slos = ", ".join(f"{slo:g}" for slo in _slos(runs))
    _bars(axes[0], runs, [100 * r.metric("slo_violation_rate") for r in runs], colors, "{:.1f}%")
    each = "each run's own: " if len(_slos(runs)) > 1 else ""
    axes[0].set(title=f"SLO violations (SLO {each}{slos} ms)", ylabel="% of requests")
    _bars(axes[1], runs, [100 * r.metric("cold_start_rate") for r in runs], colors, "{:.1f}%")
    axes[1].set(title="Cold starts", ylabel="% of requests")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _row(run: Run) -> dict[str, Any]:
    requests = run.summary.get("requests", {})
    return {
        "system": run.label,
        "requests": requests.get("recorded"),
        "ok": requests.get("by_status", {}).get("ok", 0),
        "mean MiB": run.metric("memory", "memory_used_bytes", "mean_bytes") / MIB,
        "peak MiB": run.metric("memory", "memory_used_bytes", "peak_bytes") / MIB,
        "rps": run.metric("throughput_rps"),
        "rps in SLO": run.metric("goodput_rps"),
        "p50 ms": run.metric("latency_ms", "p50"),
        "p99 ms": run.metric("latency_ms", "p99"),
        "SLO viol.": run.summary.get("slo_violations"),
        "SLO viol. %": 100 * run.metric("slo_violation_rate"),
        "cold starts": run.summary.get("cold_starts"),
        "pool/demand": run.metric("pool_over_demand"),
        "run": str(run.path),
    }


def _fmt(value: Any) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "n/a"
    if isinstance(value, float):
        return f"{value:,.1f}" if abs(value) >= 10 else f"{value:.2f}"
    return str(value)


def _options(run: Run) -> str:
    """The options part of a run's label: "[inputs=full]" of "streambox[inputs=full]", "" when none
    (the label the run wrote, not the one `_unique_labels` may have lengthened)."""
    label = str(run.summary.get("label") or run.label)
    return label[len(str(run.summary.get("system", ""))):]


def _not_comparable(ours: Run, other: Run) -> str | None:
    """Why two runs' ratios would not mean what the paper's do: one was interrupted, or they replayed
    different workloads (trace, minutes, functions, rate, SLO, ...: config.json beyond the system)."""
    from .run import NOT_MEASURED, was_interrupted

    stopped = [r.label for r in (ours, other) if was_interrupted(r.summary)]
    if stopped:
        return f"{stopped[0]} was interrupted"
    mine = {k: v for k, v in ours.replayed.items() if k not in (*NOT_MEASURED, "system", "system_options")}
    differ = sorted(k for k, v in mine.items() if k in other.replayed and other.replayed[k] != v)
    return f"another workload ({', '.join(differ)})" if differ else None


def _ratios(runs: list[Run], notes: list[str] | None = None) -> list[dict[str, str]]:
    """StreamBox against each baseline run with the same options (an ablation of StreamBox, whose
    options the baselines lack, is not "StreamBox") that replayed the same workload, uninterrupted;
    why a baseline is left out goes to `notes`."""
    ours = next(
        (
            r for r in runs
            if r.summary.get("system") == "streambox"
            and any(o.summary.get("system") in PAPER_CLAIMS and _options(o) == _options(r) for o in runs)
        ),
        None,
    )
    if ours is None:
        return []
    rows = []
    for other in runs:
        system = other.summary.get("system")
        if other is ours or system not in PAPER_CLAIMS or _options(other) != _options(ours):
            continue
        why = _not_comparable(ours, other)
        if why is not None:
            if notes is not None:
                notes.append(f"{ours.label} is not set beside {other.label} and the paper: {why}")
            continue
        claims = PAPER_CLAIMS[system]
        mem = _ratio(ours.metric("memory", "memory_used_bytes", "mean_bytes"),
                     other.metric("memory", "memory_used_bytes", "mean_bytes"))
        thr = _ratio(ours.metric("throughput_rps"), other.metric("throughput_rps"))
        p50 = _ratio(ours.metric("latency_ms", "p50"), other.metric("latency_ms", "p50"))
        rows.append({
            "against": other.label,
            "mean memory (ours)": "n/a" if math.isnan(mem) else f"{(mem - 1) * 100:+.0f}%",
            "mean memory (paper)": claims["mean memory"],
            "throughput (ours)": "n/a" if math.isnan(thr) else f"{thr:.2f}x",
            "throughput (paper)": claims["throughput"],
            "p50 latency (ours)": "n/a" if math.isnan(p50) else f"{(p50 - 1) * 100:+.0f}%",
            "latency (paper)": claims["latency"],
        })
    return rows


def _ratio(ours: float, other: float) -> float:
    """ours / other; NaN ("n/a" in the table) where the baseline measured nothing (a run whose every
    request failed has no throughput or latency)."""
    return ours / other if other else math.nan


def _markdown(rows: list[dict[str, Any]]) -> str:
    if not rows:
        return ""
    head = list(rows[0])
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    lines += ["| " + " | ".join(_fmt(row[h]) for h in head) + " |" for row in rows]
    return "\n".join(lines) + "\n"


def _table(rows: list[dict[str, Any]], title: str) -> Table:
    table = Table(title=title)
    # all columns but the run's path and those no run has (pool/demand without a pool)
    shown = [h for h in rows[0] if h != "run" and any(_fmt(row[h]) != "n/a" for row in rows)]
    widest = min(max(len(row["system"]) for row in rows), 40)
    for header in shown:
        if header == "system":
            table.add_column(header, overflow="fold", min_width=widest)
        else:
            table.add_column(header, justify="right")
    for row in rows:
        table.add_row(*(Text(_fmt(row[h])) for h in shown))  # Text: labels like a[b=c] are not markup
    return table


def print_run(run_dir: str | Path, console: Console | None = None) -> None:
    """Print one run's line of the comparison table."""
    run = load_run(run_dir)
    console = console or Console(width=max(Console().width, 170))
    console.print(_table([_row(run)], f"Replay run {run.path}"))


def report(
    run_dirs: Sequence[str | Path], out_dir: str | Path, *, console: Console | None = None
) -> dict[str, Any]:
    """Draw the comparison plots of `run_dirs` into `out_dir` and print the comparison table.
    Returns {"plots": {name: path}, "rows": [...], "ratios": [...]}."""
    if not run_dirs:
        raise ReportError("no run directory given")
    runs = [load_run(path) for path in run_dirs]
    _unique_labels(runs)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    colors = _colors(runs)
    plots = {name: out / f"{name}.png" for name in PLOTS}
    _plot_memory_over_time(runs, colors, plots["memory_over_time"])
    _plot_mean_memory(runs, colors, plots["mean_memory"])
    _plot_throughput(runs, colors, plots["throughput"])
    _plot_latency_cdf(runs, colors, plots["latency_cdf"])
    _plot_slo(runs, colors, plots["slo_violations"])

    rows = [_row(run) for run in runs]
    notes: list[str] = []
    ratios = _ratios(runs, notes)
    console = console or Console(width=max(Console().width, 170))
    console.print(_table(rows, "Replay comparison"))
    for note in notes:
        console.print(note)
    if ratios:
        against = Table(title="StreamBox against each baseline: this run beside the paper (ATC'24, sec. 9.1)")
        for header in ratios[0]:
            against.add_column(header)
        for row in ratios:
            against.add_row(*(Text(v) for v in row.values()))
        console.print(against)
    (out / "comparison.md").write_text(
        _markdown([{k: v for k, v in row.items() if k != "run"} for row in rows])
        + ("\n" + _markdown(ratios) if ratios else "")
        + "".join(f"\n{note}\n" for note in notes)
    )
    write_json(out / "comparison.json", {"rows": rows, "ratios": ratios, "notes": notes, "plots": plots})
    console.print(f"plots written to {out}/: " + ", ".join(p.name for p in plots.values()))
    return {"plots": plots, "rows": rows, "ratios": ratios}
