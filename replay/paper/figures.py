"""One function per evaluation figure (section 9 of the paper): measure through the system users run,
then write the figure's plots and its table (ours beside the paper's) into out/figNN/.

Figures 12-14 read the one replay comparison of the session (every system of Table 2 on the same
arrivals of the shipped Azure sample), figure 12 also a second one of StreamBox and stream-only
with Traffic at the paper's batch size (`traffic-b16`); 15-18 add the existing benchmarks'
measurements; 19 replays 3 and 6 tenants of Traffic (a comparison each).
"""

from __future__ import annotations

import csv
import json
import shutil
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402  (after choosing the Agg backend)

from .session import (  # noqa: E402
    BATCH16_SYSTEMS,
    QUICK_TENANT_USERS,
    TENANT_USERS,
    FigureUnavailable,
    Session,
)
from .table import Row, Source, computed, ratio_row, row_from, write_table  # noqa: E402

OURS = "streambox"
PATTERNS = ("bursty", "periodic", "sporadic")


@dataclass(frozen=True)
class FigureResult:
    figure: str
    folder: Path
    rows: list[Row]


def _summary(session: Session, system: str) -> str:
    return session.relative(session.comparison()[system] / "summary.json")


def _requests(session: Session, system: str) -> str:
    return session.relative(session.comparison()[system] / "requests.csv")


def _baselines(session: Session) -> list[str]:
    return [s for s in session.comparison() if s != OURS]


def _need_ours(session: Session) -> None:
    """Before anything is measured: the figure compares StreamBox with the baselines."""
    if OURS not in session.systems:
        raise FigureUnavailable(f"the figure compares {OURS} with the baselines; --systems lacks {OURS}")


def _groups(session: Session, system: str, column: str) -> list[str]:
    with open(session.comparison()[system] / "requests.csv", newline="") as stream:
        return sorted({row[column] for row in csv.DictReader(stream)})


def _versus(session: Session, metric: str, key: str, base: str, paper: str) -> Row:
    """StreamBox / `base` of a summary figure, beside the paper's `<paper>.<base>` number."""
    return ratio_row(
        session.out,
        f"{metric}, streambox / {base}",
        Source(_summary(session, OURS), key),
        Source(_summary(session, base), key),
        paper_key=f"{paper}.{base}",
    )


def _repeated(session: Session, metric: str, key: str, paper: str) -> list[Row]:
    """With `--repeats N` (N > 1): per baseline, the median over the N comparisons of StreamBox /
    baseline of a summary figure, each run's factor in the row's note (nothing when N = 1)."""
    runs = session.repeated_comparisons() if session.repeats > 1 else []
    rows = []
    for base in _baselines(session) if runs else ():
        pairs = [
            Source(session.relative(run[system] / "summary.json"), key)
            for run in runs
            for system in (OURS, base)
        ]
        each = [computed(session.out, pairs[i : i + 2], "ratio") for i in range(0, len(pairs), 2)]
        rows.append(
            row_from(
                session.out,
                f"{metric}, streambox / {base}, median of {len(runs)} runs",
                "x",
                pairs,
                "median_ratio",
                paper_key=f"{paper}.{base}",
                note="each run: " + ", ".join(f"{v:.2f}x" for v in each),
            )
        )
    return rows


#: The per-request phase columns of a replay's requests.csv (`<phase>_ms`), in the order of a request.
PHASE_COLUMNS = ("cold_start", "queue", "model_load", "compute", "comm", "other")

#: A run summary's headline numbers: short name -> (metric, unit, key in summary.json).
SUMMARY_METRICS = {
    "memory": ("mean device memory", "B", "memory.memory_used_bytes.mean_bytes"),
    "p50": ("p50 latency", "ms", "latency_ms.p50"),
    "p99": ("p99 latency", "ms", "latency_ms.p99"),
    "throughput": ("throughput", "req/s", "throughput_rps"),
    "slo": ("SLO (200 ms) violations", "requests", "slo_violations"),
    "cold": ("cold starts", "requests", "cold_starts"),
}


def _summary_rows(
    root: Path, summary: str, system: str, metrics: Sequence[str], prefix: str = ""
) -> list[Row]:
    """One row per SUMMARY_METRICS entry named in `metrics`, read from the run summary `summary`."""
    return [
        row_from(
            root,
            f"{prefix}{SUMMARY_METRICS[m][0]}, {system}",
            SUMMARY_METRICS[m][1],
            [Source(summary, SUMMARY_METRICS[m][2])],
        )
        for m in metrics
    ]


def _finish(session: Session, figure: str, title: str, rows: list[Row], notes: list[str]) -> FigureResult:
    folder = session.out / f"fig{figure}"
    ablated = session.runs_note(source.file for row in rows for source in row.sources)
    write_table(folder, figure, title, rows, [*notes, *ablated, session.machine_note()])
    return FigureResult(figure, folder, rows)


# -- Figure 12: memory -------------------------------------------------------------------------------


def figure_12(session: Session) -> FigureResult:
    """Memory over time (plot) and time-averaged memory per system; StreamBox / each baseline."""
    _need_ours(session)
    root = session.out
    rows = []
    for system in session.comparison():
        for stat in ("mean", "peak"):
            rows.append(
                row_from(
                    root,
                    f"{stat} device memory, {system}",
                    "B",
                    [Source(_summary(session, system), f"memory.memory_used_bytes.{stat}_bytes")],
                )
            )
    rows += [
        _versus(session, "mean memory", "memory.memory_used_bytes.mean_bytes", b, "12.mean_memory")
        for b in _baselines(session)
    ]
    rows += _repeated(session, "mean memory", "memory.memory_used_bytes.mean_bytes", "12.mean_memory")
    rows += _workflow_memory_rows(session)
    session.copy_plots(["memory_over_time", "mean_memory"], root / "fig12")
    _plot_workflow_memory(session, root / "fig12" / "mean_memory_per_workflow.png")
    batch16, batch16_note = _batch16_rows(session)
    rows += batch16
    notes = [
        f"one replay of the workflows {', '.join(session.size.workflows)} together per system (one proxy "
        "or instance set per workflow); the device's used bytes, sampled every 0.5 s",
        "per workflow (the paper's Fig. 12 right): the time mean of the device bytes of the workflow's "
        "runtimes (its proxy, or its instances: contexts, framework runtimes and all they allocated), "
        "from each run's samples; the paper gives no per-workflow number in its text",
        batch16_note,
    ]
    return _finish(session, "12", "GPU memory (mean over the run, and over time)", rows, notes)


def _batch16_rows(session: Session) -> tuple[list[Row], str]:
    """Mean memory of StreamBox and stream-only with Traffic at batch 16 and their factor beside the
    paper's, and the table's note on them. Optional: without both systems, or when that comparison
    fails, the note says so and the rest of the figure stands."""
    plot = session.out / "fig12" / "memory_over_time_b16.png"
    plot.unlink(missing_ok=True)  # a previous call's, not this one's
    if not all(system in session.systems for system in BATCH16_SYSTEMS):
        wanted = " and ".join(BATCH16_SYSTEMS)
        return [], f"no comparison at batch 16: it replays {wanted}, and --systems lacks one of them"
    try:
        runs = session.batch16()
    except Exception as error:  # noqa: BLE001  (the main comparison's rows are measured: keep them)
        return [], f"no comparison at batch 16: it failed ({type(error).__name__}: {error})"
    key = "memory.memory_used_bytes.mean_bytes"
    summaries = {system: Source(session.relative(run / "summary.json"), key) for system, run in runs.items()}
    rows = [
        row_from(session.out, f"mean device memory at batch 16, {system}", "B", [source])
        for system, source in summaries.items()
    ]
    rows.append(
        ratio_row(
            session.out,
            "mean memory at batch 16, streambox / stream-only",
            summaries[OURS],
            summaries["stream-only"],
            paper_key="12.mean_memory.stream-only",
        )
    )
    report = session.out / "replay-b16" / "report" / "memory_over_time.png"
    if report.exists():
        plot.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(report, plot)
    size = session.batch16_size
    note = (
        f"at batch 16: a replay comparison of its own ({session.relative(session.out / 'replay-b16')}, "
        f"{', '.join(runs)}; once, whatever --repeats says) on the arrivals of the workflows "
        f"{', '.join(size.workflows)}, {size.minutes} trace minutes: Traffic's recognitions batched 16 "
        "(`traffic-b16`: the paper's section 3 runs Traffic at batch 16); its memory plot is "
        f"{plot.name}"
    )
    if session.quick:
        note += " (--quick: small inputs, two objects of each kind: batches of two)"
    return rows, note


def _workflows_measured(session: Session) -> list[str]:
    """Workflows whose memory every system's run recorded (`memory_by_workflow`; runs made before it
    existed have none), in StreamBox's order."""
    measured = []
    for run in session.comparison().values():
        with open(run / "summary.json") as stream:
            by_workflow = json.load(stream).get("memory_by_workflow") or {}
        measured.append([w for w, stats in by_workflow.items() if stats])
    return [w for w in measured[0] if all(w in other for other in measured[1:])] if measured else []


def _workflow_memory_rows(session: Session) -> list[Row]:
    """Per workflow: each system's mean memory, then StreamBox / each baseline."""
    rows = []
    for workflow in _workflows_measured(session):
        key = f"memory_by_workflow.{workflow}.mean_bytes"
        rows += [
            row_from(session.out, f"mean memory, {workflow}, {system}", "B", [Source(summary, key)])
            for system, summary in ((s, _summary(session, s)) for s in session.comparison())
        ]
        rows += [
            ratio_row(
                session.out,
                f"mean memory, {workflow}, streambox / {base}",
                Source(_summary(session, OURS), key),
                Source(_summary(session, base), key),
            )
            for base in _baselines(session)
        ]
    return rows


def _plot_workflow_memory(session: Session, path: Path) -> None:
    workflows = _workflows_measured(session)
    if not workflows:
        return
    series = {
        system: [
            computed(
                session.out,
                [Source(_summary(session, system), f"memory_by_workflow.{w}.mean_bytes")],
                "value",
            )
            / 2**20
            for w in workflows
        ]
        for system in session.comparison()
    }
    _grouped_bars(path, workflows, series, "Mean GPU memory per workflow (its runtimes)", "MiB")


# -- Figure 13: throughput ---------------------------------------------------------------------------


def _grouped_bars(
    path: Path, groups: Sequence[str], series: dict[str, list[float]], title: str, ylabel: str
) -> None:
    """One bar per system (`series`: system -> a value per group) in each group, side by side."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fig, ax = plt.subplots(figsize=(2.2 * max(len(groups), 1) + 3, 4.2))
    width = 0.8 / max(len(series), 1)
    for i, (system, values) in enumerate(series.items()):
        ax.bar([g + i * width for g in range(len(groups))], values, width=width, label=system)
    ax.set_xticks([g + width * (len(series) - 1) / 2 for g in range(len(groups))], list(groups))
    ax.set(title=title, ylabel=ylabel)
    ax.grid(axis="y", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _plot_grouped(session: Session, column: str, path: Path, title: str) -> None:
    systems = list(session.comparison())
    groups = sorted({g for s in systems for g in _groups(session, s, column)})
    series = {
        system: [
            computed(
                session.out,
                [
                    Source(_requests(session, system), f"count:status=ok,{column}={group}"),
                    Source(_summary(session, system), "duration_s"),
                ],
                "ratio",
            )
            for group in groups
        ]
        for system in systems
    }
    _grouped_bars(path, groups, series, title, "completed requests per second")


def _group_rows(session: Session, column: str, base: str) -> list[Row]:
    """StreamBox / base throughput in each group of `column` (each over its own run's duration)."""
    rows = []
    for group in _groups(session, OURS, column):
        sources = [
            source
            for system in (OURS, base)
            for source in (
                Source(_requests(session, system), f"count:status=ok,{column}={group}"),
                Source(_summary(session, system), "duration_s"),
            )
        ]
        rows.append(
            row_from(
                session.out,
                f"throughput, {column} {group}, streambox / {base}",
                "x",
                sources,
                "ratio_of_ratios",
            )
        )
    return rows


def figure_13(session: Session) -> FigureResult:
    """Throughput per system, per workflow and per arrival pattern; StreamBox / each baseline."""
    _need_ours(session)
    root = session.out
    rows = [
        row_from(root, f"{name}, {s}", "req/s", [Source(_summary(session, s), key)])
        for name, key in (("throughput", "throughput_rps"), ("goodput (within the SLO)", "goodput_rps"))
        for s in session.comparison()
    ]
    for base in _baselines(session):
        rows.append(_versus(session, "throughput", "throughput_rps", base, "13.throughput"))
        rows.append(
            ratio_row(
                root,
                f"goodput (within the SLO), streambox / {base}",
                Source(_summary(session, OURS), "goodput_rps"),
                Source(_summary(session, base), "goodput_rps"),
            )
        )
        rows += _group_rows(session, "workflow", base)
        rows += _group_rows(session, "pattern", base)
    rows += _repeated(session, "throughput", "throughput_rps", "13.throughput")
    folder = root / "fig13"
    session.copy_plots(["throughput"], folder)
    _plot_grouped(session, "pattern", folder / "throughput_by_pattern.png", "Throughput per arrival pattern")
    _plot_grouped(session, "workflow", folder / "throughput_by_workflow.png", "Throughput per workflow")
    notes = [
        "throughput = completed requests / the run's duration (from the replay's start to its last "
        "completion); a group's is its completed requests over the same duration; goodput counts only "
        "the requests that met the SLO. The paper does not define its throughput; it explains its gains "
        "by requests timing out "
        "behind cold starts, which goodput counts and an unsaturated run's throughput does not",
        "patterns are the shipped Azure sample's classification (replay/shaping.py); the paper gives no "
        "per-pattern factor, only the average; n/a: one of the two completed no request of that group",
    ]
    return _finish(session, "13", "throughput", rows, notes)


# -- Figure 14: latency ------------------------------------------------------------------------------


def figure_14(session: Session) -> FigureResult:
    """Latency CDFs (plot), p50/p99, SLO violations and cold starts; warm against cold requests as the
    breakdown the runs record today."""
    _need_ours(session)
    root = session.out
    rows = []
    for system in session.comparison():
        summary, requests = _summary(session, system), _requests(session, system)
        rows += _summary_rows(root, summary, system, ("p50", "p99", "slo", "cold"))
        rows += [
            row_from(
                root,
                f"mean latency of cold-start requests, {system}",
                "s",
                [Source(requests, "mean:latency_s|status=ok,cold_start=True")],
            ),
            row_from(
                root,
                f"mean latency of warm requests, {system}",
                "s",
                [Source(requests, "mean:latency_s|status=ok,cold_start=False")],
            ),
        ]
        rows += [
            row_from(
                root,
                f"mean {phase} per request, {system}",
                "ms",
                [Source(requests, f"mean:{phase}_ms|status=ok")],
            )
            for phase in PHASE_COLUMNS
        ]
    for base in _baselines(session):
        rows.append(_versus(session, "p50 latency", "latency_ms.p50", base, "14.latency"))
        rows += [
            ratio_row(
                root,
                f"p50 latency, workflow {workflow}, streambox / {base}",
                Source(_requests(session, OURS), f"median:latency_s|status=ok,workflow={workflow}"),
                Source(_requests(session, base), f"median:latency_s|status=ok,workflow={workflow}"),
            )
            for workflow in _groups(session, OURS, "workflow")
        ]
    rows += _repeated(session, "p50 latency", "latency_ms.p50", "14.latency")
    session.copy_plots(["latency_cdf", "slo_violations"], root / "fig14")
    notes = [
        "breakdown: each request's time along its critical path, per phase (requests.csv: cold start, "
        "queueing, model load, compute, communication, other = handler CPU and control); the per-instance "
        "systems measure only the wait for an instance (queue, cold start), the rest is in `other`",
        "the paper's latency factors are its best case ('up to'); ours is the p50 over the whole run, "
        "a mix of workflows whose latencies differ 5x, and per workflow",
    ]
    return _finish(session, "14", "end-to-end latency", rows, notes)


# -- Figure 15: memory pool --------------------------------------------------------------------------


def figure_15(session: Session) -> FigureResult:
    """Pool ablation static / FM / FM+RS (benchmarks/bench_memory_pool.py: memory and inference time,
    GPU runtime excluded as in the paper), and the replayed StreamBox pool against its live demand."""
    root = session.out
    bench = session.relative(session.benchmark("bench_memory_pool"))
    configs = "results.configs"
    rows = []
    for mode in ("static", "fm", "fm+rs"):
        rows.append(
            row_from(
                root, f"mean pool memory, {mode}", "B", [Source(bench, f"{configs}.{mode}.mean_reserved")]
            )
        )
        rows.append(
            row_from(
                root,
                f"mean inference time, {mode}",
                "s",
                [Source(bench, f"{configs}.{mode}.inference_mean_s")],
            )
        )
    # fm+rs against a baseline: memory (paper: vs static and vs fm), inference time (paper: vs static),
    # and the breakdown of that time, host CPU per inference
    for key, metric, base, paper in (
        ("mean_reserved", "mean pool memory", "static", "15.memory.static"),
        ("mean_reserved", "mean pool memory", "fm", "15.memory.fm"),
        ("inference_mean_s", "mean inference time", "static", "15.time.static"),
        ("inference_cpu_mean_s", "host CPU per inference", "static", None),
    ):
        rows.append(
            ratio_row(
                root,
                f"{metric}, fm+rs / {base}",
                Source(bench, f"{configs}.fm+rs.{key}"),
                Source(bench, f"{configs}.{base}.{key}"),
                paper_key=paper,
            )
        )
    rows.append(
        row_from(
            root,
            "inference time one at a time (weights resident), fm+rs / static, geomean over models",
            "x",
            [Source(bench, f"{configs}.fm+rs.interleaved_inference_ratio")],
        )
    )
    notes = [
        f"left: {session.bench_command('bench_memory_pool')} "
        f"({session.bench_config('bench_memory_pool').get('functions', '?')} functions on one emulated V100, "
        "Poisson arrivals), its printed tables in bench/bench_memory_pool.txt"
    ]
    if OURS in session.comparison():
        rows.append(
            ratio_row(
                root,
                "replay: StreamBox pool / live demand (time means)",
                Source(_summary(session, OURS), "memory.pool_bytes.mean_bytes"),
                Source(_summary(session, OURS), "memory.demand_bytes.mean_bytes"),
            )
        )
        session.copy_plots(["memory_over_time"], root / "fig15")
        notes.append(
            "right: the replay's StreamBox pool against its live demand (memory_over_time.png, right panel)"
        )
    return _finish(session, "15", "memory pool ablation", rows, notes)


# -- Figure 16: communication ------------------------------------------------------------------------

#: bench_comm's pressure rows, in the order it runs them.
PRESSURE_ROWS = {"none": 0, "pa": 1, "am": 2, "pa+am": 3}
COMM_SIZE_INDEX = 1  # the 16 MB row of bench_comm's latency table (a Traffic crop batch's order)


def figure_16(session: Session) -> FigureResult:
    """The data paths' GET latency (same-GPU store vs Func-IPC through Redis vs CUDA-IPC style) and the
    PA/AM ablation under memory pressure (benchmarks/bench_comm.py)."""
    root = session.out
    bench = session.relative(session.benchmark("bench_comm"))
    lat = f"results.latency.{COMM_SIZE_INDEX}"
    rows = [
        row_from(
            root, "GET 16 MB, same-GPU store (StreamBox)", "s", [Source(bench, f"{lat}.same_gpu_get_s")]
        ),
        row_from(
            root, "GET 16 MB, Func-IPC through Redis (INFless)", "s", [Source(bench, f"{lat}.func_ipc_get_s")]
        ),
        row_from(
            root,
            "GET 16 MB, CUDA-IPC style (Astraea)",
            "s",
            [Source(bench, f"{lat}.cuda_ipc_get_s")],
            provenance="modelled (bench_comm's CudaIpcModel: handle open + map cost)",
        ),
        ratio_row(
            root,
            "GET 16 MB, StreamBox / Func-IPC",
            Source(bench, f"{lat}.same_gpu_get_s"),
            Source(bench, f"{lat}.func_ipc_get_s"),
            paper_key="16.comm.func-ipc",
        ),
    ]
    pressure = "results.pressure"
    link = "modelled (the run's moves and GETs priced by the V100 link model)"
    for variant, index in (("pa", PRESSURE_ROWS["pa"]), ("am", PRESSURE_ROWS["am"])):
        rows.append(
            ratio_row(
                root,
                f"overhead under pressure, {variant.upper()} alone / neither",
                Source(bench, f"{pressure}.{index}.overhead_model_s"),
                Source(bench, f"{pressure}.{PRESSURE_ROWS['none']}.overhead_model_s"),
                paper_key=f"16.comm.{variant}",
                provenance=link,
            )
        )
    rows.append(
        ratio_row(
            root,
            "overhead under pressure, PA+AM / neither",
            Source(bench, f"{pressure}.{PRESSURE_ROWS['pa+am']}.overhead_model_s"),
            Source(bench, f"{pressure}.{PRESSURE_ROWS['none']}.overhead_model_s"),
            provenance=link,
        )
    )
    rows.append(
        ratio_row(
            root,
            "overhead under pressure, PA+AM / Func-IPC (wall)",
            Source(bench, f"{pressure}.{PRESSURE_ROWS['pa+am']}.overhead_wall_s"),
            Source(bench, "results.func_ipc_pressure.overhead_wall_s"),
        )
    )
    notes = [
        f"{session.bench_command('bench_comm')}: a real store and a real Redis on the emulated V100 node; "
        "its printed tables in bench/bench_comm.txt",
    ]
    proxied = json.loads((root / bench).read_text())["results"].get("proxy_stores")
    if proxied:
        rows += _stream_only_rows(root, bench, proxied)
        notes.append(
            "stream-only rows: a PUT and its GET through two proxies alike but for their store "
            "(benchmarks/comm_proxy.py); under pressure another process holds all but half the item's "
            "size during the PUT, as the paper raises memory pressure with a co-located task"
        )
    else:
        notes.append("this bench_comm run has no proxy_stores results: the stream-only rows are missing")
    _plot_comm(session, root / session.relative(session.benchmark("bench_comm")), root / "fig16" / "comm.png")
    return _finish(session, "16", "communication", rows, notes)


#: Sizes of the stream-only rows: a Traffic crop batch's order and the paper's batch-16 hand-over (sec. 3).
PROXY_STORE_SIZES_MB = (16, 125)
IPC_COSTS = (
    "partly modelled (wall time through the proxies on the timed V100; the CUDA-IPC store's driver calls "
    "are comm.ipc_store.IpcCosts' assumed constants, its copies the link model)"
)


def _stream_only_rows(root: Path, bench: str, proxied: list[dict]) -> list[Row]:
    """StreamBox's managed store against stream-only's CUDA-IPC store, PUT+GET through real proxies."""
    def source(size: int, condition: str, store: str) -> Source:
        index = next(i for i, r in enumerate(proxied)
                     if (r["size_mb"], r["condition"], r["store"]) == (size, condition, store))
        return Source(bench, f"results.proxy_stores.{index}.put_get_s")

    rows = []
    for condition, paper_key in (("pressure", "16.comm.stream-only"), ("free", None)):
        for size in PROXY_STORE_SIZES_MB:
            if not any(r["size_mb"] == size for r in proxied):
                continue
            gpu = "under memory pressure" if condition == "pressure" else "GPU free"
            rows.append(ratio_row(
                root,
                f"PUT+GET {size} MB through the proxy, {gpu}: "
                "StreamBox's store / stream-only's CUDA-IPC store",
                source(size, condition, "managed"),
                source(size, condition, "ipc"),
                paper_key=paper_key,
                provenance=IPC_COSTS,
            ))
    return rows


def _plot_comm(session: Session, bench: Path, path: Path) -> None:
    import json

    results = json.loads(bench.read_text())["results"]
    path.parent.mkdir(parents=True, exist_ok=True)
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    sizes = [str(r["size_mb"]) + " MB" for r in results["latency"]]
    for key, label in (
        ("same_gpu_get_s", "same-GPU store"),
        ("func_ipc_get_s", "Func-IPC (Redis)"),
        ("cuda_ipc_get_s", "CUDA-IPC style (modelled)"),
    ):
        left.plot(
            sizes, [(r.get(key) or float("nan")) * 1e3 for r in results["latency"]], marker="o", label=label
        )
    left.set(yscale="log", title="GET latency", ylabel="ms (log)")
    left.legend(fontsize=8)
    labels = [r["label"] for r in results["pressure"]]
    right.bar(labels, [r["overhead_model_s"] * 1e3 for r in results["pressure"]])
    right.set(title="Overhead under pressure (link model)", ylabel="ms per round")
    for axis in (left, right):
        axis.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


# -- Figure 17: loading -------------------------------------------------------------------------------

SO, SB = "stream-only (SO)", "+RZ+PB+BT (StreamBox)"
ABLATION = ("no optimizations (WO)", "+RZ", "+RZ+PB", SB)


def figure_17(session: Session) -> FigureResult:
    """Model loading while another function loads (stream-only FIFO vs the IO daemon), the RZ/PB/BT
    ablation and pipelined loading (benchmarks/bench_io_daemon.py)."""
    root = session.out
    bench = session.relative(session.benchmark("bench_io_daemon"))
    first = "first_inference_ms"
    rows = [
        ratio_row(
            root,
            "first inference under a concurrent load, StreamBox / stream-only",
            Source(bench, f"results.a.runs.{SB}.{first}"),
            Source(bench, f"results.a.runs.{SO}.{first}"),
            paper_key="17.loading.stream-only",
        ),
        ratio_row(
            root,
            "first inference, stream-only under a concurrent load / alone",
            Source(bench, f"results.a.runs.{SO}.{first}"),
            Source(bench, f"results.a.alone.{SO}.{first}"),
            note="the paper's 3.2x is against INFless's MPS, which this benchmark does not run",
        ),
    ]
    rows += [
        ratio_row(
            root,
            f"ablation: {label} / stream-only",
            Source(bench, f"results.c.{label}.{first}"),
            Source(bench, f"results.c.{SO}.{first}"),
        )
        for label in ABLATION
    ]
    rows.append(
        row_from(
            root,
            "ablation: share of the gain (WO -> StreamBox) that RZ+PB bring",
            "share",
            [Source(bench, f"results.c.{label}.{first}") for label in (ABLATION[0], "+RZ+PB", SB)],
            "share_of_gain",
            paper_key="17.rz_pb_share_of_gain",
        )
    )
    models = sorted(session.bench_results("bench_io_daemon")["d"])
    rows += [
        ratio_row(
            root,
            f"pipelined / load-then-run first inference, {model}",
            Source(bench, f"results.d.{model}.pipelined.{first}"),
            Source(bench, f"results.d.{model}.load_then_run.{first}"),
        )
        for model in models
    ]
    _plot_ablation(session.bench_results("bench_io_daemon")["c"], root / "fig17" / "loading_ablation.png")
    notes = [
        f"{session.bench_command('bench_io_daemon')} (time dilated 16x: the emulated link model slowed so "
        "that the host keeps up; ratios are what it compares), printed tables in bench/bench_io_daemon.txt"
    ]
    return _finish(session, "17", "pipelined loading and the IO daemon's ablation", rows, notes)


def _plot_ablation(runs: dict, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fig, ax = plt.subplots(figsize=(9, 4.2))
    labels = list(runs)
    ax.bar(range(len(labels)), [runs[label]["first_inference_ms"] for label in labels])
    ax.set_xticks(range(len(labels)), [label.replace(" (", "\n(") for label in labels], fontsize=8)
    ax.set(title="First inference while another model loads (bench_io_daemon (c))", ylabel="ms")
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


# -- Figure 18: overheads -----------------------------------------------------------------------------


def figure_18(session: Session) -> FigureResult:
    """(a) API forwarding's round trip against concurrent functions (benchmarks/bench_forwarding.py),
    (b) the PTB compute-unit cap against an MPS share of the same size (benchmarks/bench_ptb_mps.py),
    (c) offline preparation: profiling and the PTB transformation (benchmarks/bench_compile.py, TVM)."""
    root = session.out
    forwarding = session.relative(session.benchmark("bench_forwarding"))
    levels = session.bench_results("bench_forwarding")
    top = levels["max_level"]
    partition = session.relative(session.benchmark("bench_ptb_mps"))
    compile_ = session.relative(session.benchmark("bench_compile"))
    rows = [
        row_from(
            root,
            "forwarded no-op round trip p50, one function (function -> proxy -> back, shm)",
            "us",
            [Source(forwarding, "results.levels.1.p50_s")],
            "value_us",
        ),
        row_from(
            root,
            f"forwarded no-op round trip p50, {top} functions at once",
            "us",
            [Source(forwarding, f"results.levels.{top}.p50_s")],
            "value_us",
            paper_key="18.forwarding_us.max",
            note=f"the paper's is at up to 48 functions on a many-core host; ours on {levels['cores']} cores",
        ),
        ratio_row(
            root,
            f"forwarded no-op p50, {top} functions at once / one",
            Source(forwarding, f"results.levels.{top}.p50_s"),
            Source(forwarding, "results.levels.1.p50_s"),
        ),
        ratio_row(
            root,
            "ResNet-50 kernels alone at a 50% share: PTB performance / MPS (MPS time / PTB time)",
            Source(partition, "results.alone.50.mps_gpu_s"),
            Source(partition, "results.alone.50.ptb_gpu_s"),
            paper_key="18.ptb.drop",
            provenance="modelled (the timed emulated V100: cost model per kernel, no PTB loop cost)",
        ),
        ratio_row(
            root,
            "two functions at 50% at once, span: PTB (one context) performance / MPS (two contexts)",
            Source(partition, "results.pair_50.mps_span_s"),
            Source(partition, "results.pair_50.ptb_span_s"),
            provenance="modelled (the timed emulated V100; kernels queued behind a gate, median of repeats)",
        ),
        row_from(
            root,
            "offline profiling per model",
            "s",
            [Source(compile_, "results.summary.mean_profiling_s")],
            paper_key="18.profiling_s",
        ),
        row_from(
            root,
            "PTB transformation per model",
            "s",
            [Source(compile_, "results.summary.mean_ptb_pass_s")],
            paper_key="18.transformation_s",
        ),
        row_from(
            root,
            "whole compile per model (frontend, PTB, codegen)",
            "s",
            [Source(compile_, "results.summary.mean_compile_s")],
        ),
    ]
    folder = root / "fig18"
    _plot_forwarding(levels, folder / "forwarding.png")
    _plot_partition(session.bench_results("bench_ptb_mps"), folder / "ptb_vs_mps.png")
    _plot_preparation(session.bench_results("bench_compile"), folder / "preparation.png")
    notes = [
        "benchmarks/bench_forwarding.py, bench_ptb_mps.py and bench_compile.py --quick; their printed "
        "tables in bench/",
        f"(a) every instance is a process: past the host's {levels['cores']} cores the calls also wait for "
        "a core, which the paper's host did not (its 3-5 us at 48)",
        "(b) the emulated device gives a capped kernel min(blocks, cap) units as MPS gives a client its "
        "share; it models no persistent-thread-block loop cost, the paper's 3% drop",
    ]
    return _finish(
        session, "18", "overheads: API forwarding, PTB against MPS, offline preparation", rows, notes
    )


def _plot_forwarding(results: dict, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    levels = list(results["levels"])
    fig, ax = plt.subplots(figsize=(6, 4.2))
    for key, label in (("p50_s", "p50"), ("p99_s", "p99")):
        ax.plot(
            [int(n) for n in levels],
            [results["levels"][n][key] * 1e6 for n in levels],
            marker="o",
            label=label,
        )
    ax.set(title="Forwarded no-op round trip", xlabel="functions at once", ylabel="us (log)", yscale="log")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _plot_partition(results: dict, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    shares = list(results["alone"])
    fig, ax = plt.subplots(figsize=(7, 4.2))
    for i, (key, label) in enumerate((("mps_gpu_s", "MPS share"), ("ptb_gpu_s", "PTB cap"))):
        ax.bar(
            [x + 0.4 * i for x in range(len(shares))],
            [results["alone"][s][key] * 1e3 for s in shares],
            width=0.4,
            label=label,
        )
    ax.set_xticks([x + 0.2 for x in range(len(shares))], [f"{s}%" for s in shares])
    ax.set(title=f"{results['model']} kernels' GPU time per share (timed emulated V100)", ylabel="ms")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _plot_preparation(results: dict, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    models = [m["model"] for m in results["models"]]
    fig, ax = plt.subplots(figsize=(2 * len(models) + 3, 4.2))
    for i, (key, label) in enumerate(
        (("profiling_s", "profiling"), ("ptb_s", "PTB pass"), ("compile_s", "whole compile"))
    ):
        ax.bar(
            [x + 0.25 * i for x in range(len(models))],
            [m[key] for m in results["models"]],
            width=0.25,
            label=label,
        )
    ax.set_xticks([x + 0.25 for x in range(len(models))], models)
    ax.set(title="Offline preparation per model", ylabel="seconds")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


# -- Figure 19: users of one workflow on one GPU -------------------------------------------------------


def figure_19(session: Session) -> FigureResult:
    """3 and 6 users (tenants) of Traffic sharing one GPU, each its own deployment (replay/tenants.py):
    mean memory, p50 latency, throughput, SLO violations and cold starts per system."""
    root = session.out
    users = QUICK_TENANT_USERS if session.quick else TENANT_USERS
    runs = {n: session.tenants(n) for n in users}
    if any(OURS not in r for r in runs.values()):
        raise FigureUnavailable(f"the figure compares {OURS} with the baselines; --systems lacks {OURS}")
    summary = {n: {s: session.relative(d / "summary.json") for s, d in r.items()} for n, r in runs.items()}
    memory, p50 = SUMMARY_METRICS["memory"][2], SUMMARY_METRICS["p50"][2]
    rows = []
    for n in users:
        for system, file in summary[n].items():
            rows += _summary_rows(
                root, file, system, ("memory", "p50", "throughput", "slo", "cold"), f"{n} users: "
            )
        for base in (s for s in summary[n] if s != OURS):
            for metric, key, paper in (
                ("mean memory", memory, "19.memory.lowest"),
                ("p50 latency", p50, "19.latency.leftmost"),
            ):
                rows.append(
                    ratio_row(
                        root,
                        f"{n} users: {metric}, streambox / {base}",
                        Source(summary[n][OURS], key),
                        Source(summary[n][base], key),
                        paper_key=paper,
                    )
                )
    few, many = users[0], users[-1]
    rows.append(
        ratio_row(
            root,
            f"streambox mean memory, {many} users / {few} users",
            Source(summary[many][OURS], memory),
            Source(summary[few][OURS], memory),
            note="the paper: 'slightly increased'",
        )
    )
    folder = root / "fig19"
    _plot_tenant_memory(runs, folder / "memory_by_users.png")
    for n in users:
        for plot in session.copy_plots(["latency_cdf"], folder, replay=f"tenants{n}"):
            plot.replace(folder / f"latency_cdf_{n}_users.png")
    per_user = "one trace function" if session.quick else "two trace functions"
    notes = [
        "each user is a tenant of its own (`--workflow 'traffic*N'`): its own API proxy (streambox, "
        f"stream-only) or its own function instances (infless, astraea); {per_user} of the shipped Azure "
        "sample per user, all on one emulated V100",
        "the paper gives no number for Fig. 19, an ordering: StreamBox's memory the lowest and its latency "
        "CDF the leftmost, held here as the bound 'below 1.00x' for StreamBox / each baseline",
        "proxies are admitted by predicted memory (docs/api_proxy.md), not by count: six Traffic proxies "
        "at small inputs take 5.7 GB and all stay warm on the V100; the paper's 'up to 3 users' is its "
        "16 GB and heavier runtimes (`--set max_proxies_per_device=3` reproduces the count cap)",
    ]
    return _finish(session, "19", "users of Traffic sharing one GPU", rows, notes)


def _plot_tenant_memory(runs: dict[int, dict[str, Path]], path: Path) -> None:
    users = list(runs)
    series = {
        system: [
            computed(runs[n][system], [Source("summary.json", SUMMARY_METRICS["memory"][2])], "value")
            / (1 << 30)
            for n in users
        ]
        for system in runs[users[0]]
    }
    _grouped_bars(
        path, [f"{n} users" for n in users], series, "Mean device memory, users of Traffic on one GPU", "GiB"
    )


FIGURES: dict[str, Callable[[Session], FigureResult]] = {
    "12": figure_12,
    "13": figure_13,
    "14": figure_14,
    "15": figure_15,
    "16": figure_16,
    "17": figure_17,
    "18": figure_18,
    "19": figure_19,
}

#: Figures without a builder, and why (printed by the command instead of a table).
MISSING: dict[str, str] = {}
