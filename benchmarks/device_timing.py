"""The emulated GPU in GPU time: two processes sharing one GPU, and the host CPU timed mode costs.

Every row is a measurement beside the figure it should reach (the link model's bandwidth, the
kernels' modelled time, functional mode on the same work), with their ratio:

- link sharing: one context copying alone, then two contexts (two processes) copying at once;
- time-slicing: two processes' kernels without MPS (they must never overlap), then as MPS clients
  with 50% each (kernels that fit their share run side by side);
- host CPU per modelled GPU second in timed mode: kernels launched directly, and a zoo model run
  through the plan executor (against the same model in functional mode).

    python benchmarks/device_timing.py --quick --json out.json

`link_sharing`, `time_slicing` and `host_cpu` return the rows; bench_device.py imports them.
Each context is a separate process (`--child`, driven over stdin/stdout), as on a real machine.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import parser, print_table, write_json  # noqa: E402

from streambox.api_proxy.device_tensor import upload_tensor  # noqa: E402
from streambox.api_proxy.executor import PlanExecutor, StreamPoolAllocator, upload_model  # noqa: E402
from streambox.config import default_model_pool  # noqa: E402
from streambox.device import Runtime  # noqa: E402
from streambox.device.copy_engine import sleep_until  # noqa: E402
from streambox.device.emulated import EmulatedBackend  # noqa: E402
from streambox.device.specs import V100_16GB, DeviceSpec  # noqa: E402
from streambox.kernel_compiler.model_pool import ModelPool  # noqa: E402
from streambox.kernel_compiler.zoo import example_input, get_entry  # noqa: E402

#: The V100 preset without the context's start-up cost (it says nothing about sharing).
SPEC = V100_16GB.with_overrides(context_create_s=0.0)

Row = dict[str, Any]


def _row(measurement: str, measured: float, expected: float, unit: str, note: str = "") -> Row:
    ratio = measured / expected if expected else float("nan")
    return {"measurement": measurement, "measured": measured, "expected": expected, "ratio": ratio,
            "unit": unit, "note": note}


# -- one context per process ------------------------------------------------------------------------
def _child() -> None:
    """Runs in a child process: open a timed runtime, say ready, wait for the common start, work,
    report the timeline."""
    job = json.loads(sys.stdin.readline())
    spec = SPEC.with_overrides(**job.get("spec", {}))
    backend = EmulatedBackend(spec=spec, state_dir=job["state_dir"], mode="timed")
    rt = backend.open_runtime(0, gpu_percent=job.get("gpu_percent"))
    stream = rt.create_stream()
    if job["scenario"] == "copy":
        address, host = rt.mem_alloc(job["nbytes"]), rt.host_alloc(job["nbytes"])
    print(json.dumps({"ready": True}), flush=True)
    start_at = json.loads(sys.stdin.readline())["start_at"]
    sleep_until(start_at)
    if job["scenario"] == "copy":
        rt.copy_htod_async(address, host, job["nbytes"], stream)
    elif job.get("segment"):  # `launch_many`, `segment` kernels at a time (the executor's segments)
        launch = (lambda: None, job["blocks"], None, "kernel", job["duration_s"])
        for done in range(0, job["kernels"], job["segment"]):
            rt.launch_many(stream, [launch] * min(job["segment"], job["kernels"] - done))
    else:
        for _ in range(job["kernels"]):
            rt.launch(stream, lambda: None, blocks=job["blocks"], duration_s=job["duration_s"])
    stream.synchronize()
    records = [[r.kind, r.start, r.end, r.compute_units] for r in rt.timeline()]
    print(json.dumps({"records": records, "units": rt.units}), flush=True)
    rt.close()


def run_contexts(jobs: list[dict[str, Any]], state_dir: str | Path) -> list[dict[str, Any]]:
    """One process per job on the same emulated GPU (same state dir); all start their work at the
    same instant (CLOCK_MONOTONIC is shared by the processes). Returns each one's report."""
    children = [
        subprocess.Popen(
            [sys.executable, str(Path(__file__).resolve()), "--child"],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
        )
        for _ in jobs
    ]
    try:
        for child, job in zip(children, jobs, strict=True):
            assert child.stdin is not None
            child.stdin.write(json.dumps({**job, "state_dir": str(state_dir)}) + "\n")
            child.stdin.flush()
        for child in children:
            assert child.stdout is not None
            if not json.loads(child.stdout.readline() or "{}").get("ready"):
                raise RuntimeError(f"a device_timing child failed to start (exit {child.wait()})")
        start_at = time.perf_counter() + 0.2
        for child in children:
            assert child.stdin is not None
            child.stdin.write(json.dumps({"start_at": start_at}) + "\n")
            child.stdin.flush()
        reports = []
        for child in children:
            assert child.stdout is not None
            reports.append(json.loads(child.stdout.readline()))
        return reports
    finally:
        for child in children:
            if child.stdin is not None:
                child.stdin.close()
            child.wait(timeout=60)


def _spans(report: dict[str, Any], kind: str) -> list[tuple[float, float]]:
    return [(start, end) for k, start, end, _ in report["records"] if k == kind]


def overlap_seconds(a: list[tuple[float, float]], b: list[tuple[float, float]]) -> float:
    """Total time during which an interval of `a` and one of `b` both run."""
    return sum(max(0.0, min(e1, e2) - max(s1, s2)) for s1, e1 in a for s2, e2 in b)


# -- the measurements -------------------------------------------------------------------------------
def link_sharing(quick: bool = False, spec: DeviceSpec = SPEC) -> list[Row]:
    """Each context's bandwidth when copying alone and when two processes copy at once."""
    nbytes = (256 if quick else 1024) << 20
    bandwidth = spec.link.pinned_bandwidth
    job = {"scenario": "copy", "nbytes": nbytes}
    with tempfile.TemporaryDirectory(prefix="sbx-devtiming-") as state:
        (alone,) = run_contexts([job], Path(state) / "alone")
        pair = run_contexts([job, job], Path(state) / "pair")
    (a0, a1), = _spans(alone, "htod")
    rows = [_row("link: one context alone", nbytes / (a1 - a0) / 1e9, bandwidth / 1e9, "GB/s",
                 "the link model (latency + bytes / pinned bandwidth)")]
    spans = [_spans(report, "htod")[0] for report in pair]
    for i, (s, e) in enumerate(spans):
        rows.append(_row(f"link: two contexts at once, context {i}", nbytes / (e - s) / 1e9,
                         bandwidth / 2e9, "GB/s", "half the link each"))
    first, last = min(s for s, _ in spans), max(e for _, e in spans)
    rows.append(_row("link: two contexts at once, together", 2 * nbytes / (last - first) / 1e9,
                     bandwidth / 1e9, "GB/s", "the whole link, shared"))
    return rows


def time_slicing(quick: bool = False) -> list[Row]:
    """Two processes' kernels of half the GPU's width: time-sliced without MPS, side by side as
    MPS clients of 50% each."""
    kernels = 20 if quick else 100
    duration = 5e-3
    job = {"scenario": "kernels", "kernels": kernels, "blocks": SPEC.compute_units // 2,
           "duration_s": duration}
    work = kernels * duration
    rows = []
    with tempfile.TemporaryDirectory(prefix="sbx-devtiming-") as state:
        for label, share, expected_makespan in (("no MPS", None, 2 * work), ("MPS 50/50", 50, work)):
            reports = run_contexts([{**job, "gpu_percent": share}] * 2, Path(state) / label.replace(" ", "-"))
            a, b = (_spans(r, "kernel") for r in reports)
            both = a + b
            makespan = max(e for _, e in both) - min(s for s, _ in both)
            overlap = overlap_seconds(a, b)
            rows.append(_row(f"kernels, {label}: makespan of both", makespan, expected_makespan, "s",
                             "serial when time-sliced, concurrent within MPS shares"))
            rows.append(_row(f"kernels, {label}: overlap of the two contexts", overlap,
                             0.0 if share is None else work, "s",
                             "never overlap" if share is None else "overlap throughout"))
    return rows


def _executor_cpu(runtime: Runtime, pool: ModelPool, model: str, runs: int) -> float:
    """Host CPU seconds of `runs` inferences of `model` through the plan executor (after a warm-up)."""
    shape = get_entry(model).small_input_shape
    plan = pool.get_or_lower(model, 1, shape)
    allocator = StreamPoolAllocator(runtime)
    stream = runtime.create_stream()
    loaded = upload_model(runtime, plan, allocator, stream)
    x = upload_tensor(runtime, example_input(model, 1, shape), allocator.allocate, stream)
    executor = PlanExecutor(runtime, allocator)

    def infer() -> None:
        result = executor.run(loaded, {plan.inputs[0]: x}, stream)
        result.done.synchronize()
        for out in result.outputs.values():
            allocator.free(out.address, stream)

    infer()  # warm: registrations, cached blocks
    cpu = time.process_time()
    for _ in range(runs):
        infer()
    return time.process_time() - cpu


def host_cpu(quick: bool = False, model: str = "resnet18") -> list[Row]:
    """Host CPU seconds per modelled GPU second in timed mode: direct launches, then a zoo model
    through the plan executor (its kernels carry no duration yet: the fallback duration applies),
    against the same model in functional mode (CPU per inference)."""
    n, runs = (2000, 5) if quick else (20000, 20)
    pool = ModelPool(default_model_pool())
    with tempfile.TemporaryDirectory(prefix="sbx-devtiming-") as state:
        timed = EmulatedBackend(spec=SPEC, state_dir=Path(state) / "t", mode="timed", timeline=False)
        functional = EmulatedBackend(spec=SPEC, state_dir=Path(state) / "f", mode="functional")
        with timed.open_runtime(0) as rt:
            stream = rt.create_stream()
            cpu = time.process_time()
            for _ in range(n):
                rt.launch(stream, _nothing, blocks=SPEC.compute_units, duration_s=100e-6)
            stream.synchronize()
            direct_cpu, direct_gpu = time.process_time() - cpu, rt.timed_stats()["kernel_seconds"]
            timed_cpu = _executor_cpu(rt, pool, model, runs)
            # the executor's kernel seconds cover its warm-up run too
            executor_gpu = (rt.timed_stats()["kernel_seconds"] - direct_gpu) * runs / (runs + 1)
        with functional.open_runtime(0) as rt:
            functional_cpu = _executor_cpu(rt, pool, model, runs)
    fallback = f"fallback {SPEC.fallback_kernel_s * 1e6:.0f} us per kernel (no duration_s yet)"
    return [
        _row("host CPU s per GPU s: direct launches (100 us kernels)", direct_cpu / direct_gpu, 1.0, "s/s",
             f"{direct_cpu / n * 1e6:.1f} us of CPU per kernel; expected: at most 1 core per GPU"),
        _row(f"host CPU s per GPU s: {model} through the executor", timed_cpu / executor_gpu, 1.0, "s/s",
             fallback),
        _row(f"host CPU per {model} inference: timed vs functional", timed_cpu / runs,
             functional_cpu / runs, "s", "same plan, same executor; ratio = timed / functional"),
    ]


def _nothing() -> None:
    return None


COLUMNS = ["measurement", "measured", "expected", "ratio", "unit", "note"]


def _cells(r: Row) -> list[Any]:
    return [r["measurement"], f"{r['measured']:.4g}", f"{r['expected']:.4g}", f"{r['ratio']:.3f}", r["unit"],
            r["note"]]


#: (title, columns, rows) of one printed table.
Table = tuple[str, list[str], list[list[Any]]]


def tables(quick: bool) -> list[Table]:
    """(title, columns, rows) per measurement group, as bench_device.py prints them."""
    groups = [
        ("shared PCIe link, a context per process (V100; measured vs expected)", link_sharing(quick)),
        ("kernels of two contexts: time-slicing vs MPS 50/50 (measured vs expected)", time_slicing(quick)),
        ("host CPU per modelled GPU second, timed mode (measured vs ideal)", host_cpu(quick)),
    ]
    return [(title, COLUMNS, [_cells(r) for r in rows]) for title, rows in groups]


def tables_json(groups: list[Table]) -> list[dict[str, Any]]:
    """The tables as the JSON report writes them."""
    return [{"title": t, "columns": c, "rows": r} for t, c, r in groups]


def main() -> None:
    if sys.argv[1:] == ["--child"]:
        _child()
        return
    args = parser(__doc__.splitlines()[0]).parse_args()
    groups = tables(args.quick)
    for title, columns, rows in groups:
        print_table(title, columns, rows)
    write_json(args.json, "device_timing", {"quick": args.quick, "preset": "v100-16gb"}, tables_json(groups))


if __name__ == "__main__":
    main()
