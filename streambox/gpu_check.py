"""`make gpu-check`: what a real GPU says about StreamBox's device model, in one command (< 10 min).

On the first CUDA device:

1. the `gpu`-marked tests (``pytest -m gpu``), one process per test file: a kernel fault leaves the
   process's CUDA context unusable, so in one process every later test would fail with it;
2. per zoo model (batch 1, the zoo's input shape): per-kernel times measured with CUDA events around
   each kernel (a profiled run of the executor through the CUDA backend, queued behind a gate kernel
   so that the host's issuing is not timed; median of a few runs),
   written as the calibration table beside the plan in the model pool (it then overrides the cost
   model for that GPU: `KernelPlan.kernel_seconds`) and as JSON under ``$OUT`` when set; each
   compared with the cost model's prediction for that GPU (the error per model);
3. host time per kernel of the plan executor on the CUDA backend against eager torch on the same GPU
   (``benchmarks/bench_executor.py --quick --device-mode cuda``, in a checkout);
4. a short trace replay of Traffic on the CUDA backend for streambox and stream-only.

Without a GPU it says so in one line and exits 0. `calibrate` is the measuring step on any runtime
(the tests run it on the emulated device's CPU through the same code).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import re
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from streambox.api_proxy.device_tensor import DeviceTensor
from streambox.api_proxy.executor import DeviceModel, PlanExecutor, RunResult
from streambox.api_proxy.profiling import measure_plan_on_device
from streambox.device import Backend, Runtime, Stream
from streambox.kernel_compiler import cost_model
from streambox.kernel_compiler.calibration import CalibrationTable, write_calibration
from streambox.kernel_compiler.model_pool import ModelPool
from streambox.kernel_compiler.plan import KernelPlan
from streambox.kernel_compiler.zoo import ZOO
from streambox.memory_pool.pool import DeviceMemoryPool

#: Replay of the check: a few trace minutes, compressed; enough to see both systems serve on the GPU.
REPLAY_ARGS = ("--workflow", "traffic", "--minutes", "6", "--minute-seconds", "5", "--scale", "0.25")
#: The gate holds the stream this long per kernel of the plan (the host issues one in ~0.1-0.2 ms).
GATE_S_PER_KERNEL = 0.5e-3
#: `torch.cuda._sleep` counts clock cycles; assuming a fast clock errs towards a longer gate.
GATE_CLOCK_HZ = 2.0e9


@dataclass(frozen=True)
class ModelCheck:
    """One model's measured time on the GPU against the cost model's prediction for it."""

    model: str
    kernels: int
    measured_ms: float
    modelled_ms: float | None  # None: no cost-model preset for this GPU

    @property
    def error(self) -> float | None:
        """(modelled - measured) / measured."""
        if self.modelled_ms is None or self.measured_ms <= 0:
            return None
        return (self.modelled_ms - self.measured_ms) / self.measured_ms


def table_key(device_name: str) -> str:
    """The preset a device's tables are stored under: its cost-model preset, else a slug of its name."""
    preset = cost_model.preset_for_device(device_name)
    return preset or re.sub(r"[^a-z0-9]+", "-", device_name.lower()).strip("-")


class _GatedExecutor(PlanExecutor):
    """An executor whose every run first holds its stream on the GPU for `gate_s`, long enough for the
    host to issue the whole run behind it: the events around each kernel then time the kernels back to
    back, not the host's issuing (which at batch 1 is slower than most kernels)."""

    def __init__(self, runtime: Runtime, allocator: DeviceMemoryPool, gate_s: float) -> None:
        super().__init__(runtime, allocator)
        self.gate_cycles = int(gate_s * GATE_CLOCK_HZ)

    def run(
        self, model: DeviceModel, inputs: Mapping[str, DeviceTensor], stream: Stream, **options: Any
    ) -> RunResult:
        cycles = self.gate_cycles
        self.runtime.launch(stream, lambda: torch.cuda._sleep(cycles), name="gate")
        return super().run(model, inputs, stream, **options)


def measure_kernel_seconds(runtime: Runtime, plan: KernelPlan, *, repeats: int = 5) -> list[float]:
    """Every kernel's time on `runtime` (0.0 for views): events around each kernel of the executor's
    profiled run, median of `repeats` after a warm-up; on CUDA each run waits behind a gate kernel."""
    executor: Callable[[Runtime, DeviceMemoryPool], PlanExecutor] = PlanExecutor
    if runtime.properties().backend == "cuda":
        gate_s = GATE_S_PER_KERNEL * len(plan.kernels) + 0.02
        executor = functools.partial(_GatedExecutor, gate_s=gate_s)
    # the emulated device runs each kernel on its stream's worker: nothing to gate
    return measure_plan_on_device(runtime, plan, repeats=repeats, executor=executor)


def calibrate(
    pool: ModelPool,
    runtime: Runtime,
    model: str,
    batch: int = 1,
    input_shape: tuple[int, ...] | None = None,
    *,
    preset: str,
    repeats: int = 5,
) -> CalibrationTable:
    """Measure every kernel of `model`'s plan on `runtime` (`measure_kernel_seconds`) and store the
    times as the plan's calibration table for `preset`."""
    plan = pool.get_or_lower(model, batch, input_shape)
    seconds = measure_kernel_seconds(runtime, plan, repeats=repeats)
    props = runtime.properties()
    table = CalibrationTable(
        preset=preset,
        device=props.name,
        backend=props.backend,
        model=model,
        batch=batch,
        input_shape=list(plan.input_shape),
        kernels=[k.name for k in plan.kernels],
        seconds=seconds,
        method=f"events around each kernel of a profiled executor run, median of {repeats} after a warm-up",
    )
    write_calibration(pool.path_for(model, batch, input_shape), table)
    return table


def compare(pool: ModelPool, table: CalibrationTable) -> ModelCheck:
    """The table's total against the cost model's prediction for its preset (where one exists)."""
    plan = pool.get_or_lower(table.model, table.batch, tuple(table.input_shape))
    modelled = None
    if table.preset in cost_model.PRESETS:
        costs = [cost_model.cost_of(k) for k in plan.kernels]
        modelled = sum(cost_model.modelled_seconds(costs, table.preset)) * 1e3
    compute = sum(k.kind == "compute" for k in plan.kernels)
    return ModelCheck(table.model, compute, table.total_seconds * 1e3, modelled)


def _run(command: Sequence[str], timeout_s: float, env: dict[str, str] | None = None) -> dict[str, Any]:
    started = time.monotonic()
    try:
        done = subprocess.run(
            list(command), capture_output=True, text=True, timeout=timeout_s, env=env, check=False
        )
        rc, output = done.returncode, done.stdout + done.stderr
    except subprocess.TimeoutExpired as exc:
        rc, output = 124, f"timed out after {timeout_s:.0f} s\n{exc.stdout or ''}{exc.stderr or ''}"
    tail = "\n".join(str(output).splitlines()[-15:])
    return {"command": list(command), "rc": rc, "seconds": round(time.monotonic() - started, 1), "tail": tail}


def group_by_file(node_ids: Sequence[str]) -> dict[str, list[str]]:
    """pytest node ids (``path::test[param]``) by their file, in first-seen order."""
    files: dict[str, list[str]] = {}
    for node in node_ids:
        files.setdefault(node.split("::", 1)[0], []).append(node)
    return files


def run_gpu_tests(timeout_s: float = 300, paths: Sequence[str] = ()) -> dict[str, Any]:
    """The `gpu`-marked tests (of `paths`, default the whole suite), one pytest process per file (see the
    module doc); rc 0 when all pass."""
    pytest = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "gpu"]
    listing = subprocess.run([*pytest, "--co", *paths], capture_output=True, text=True, check=False)
    nodes = [line for line in listing.stdout.splitlines() if "::" in line]
    started, files = time.monotonic(), {}
    for path in group_by_file(nodes):
        left = timeout_s - (time.monotonic() - started)
        files[path] = _run([*pytest, "-rfE", "--tb=short", path], max(left, 1.0))
        print(f"{path}: {files[path]['tail'].splitlines()[-1] if files[path]['tail'] else 'no output'}")
    failed = [path for path, run in files.items() if run["rc"] not in (0, 5)]  # 5: all deselected
    return {"rc": 1 if failed or not files else 0, "failed": failed, "files": files,
            "tail": "\n".join(f"{path}: rc {run['rc']}" for path, run in files.items())}


def _streambox_command() -> list[str]:
    script = Path(sys.executable).with_name("streambox")
    return [str(script)] if script.exists() else [sys.executable, "-m", "streambox.cli"]


def _print_rows(checks: Sequence[ModelCheck], device: str, preset: str) -> None:
    print(f"\nper-kernel GPU times on {device} (tables stored as {preset!r}) against the cost model:")
    print(f"{'model':26s} {'kernels':>7s} {'measured ms':>12s} {'modelled ms':>12s} {'error':>8s}")
    for c in checks:
        modelled = "-" if c.modelled_ms is None else f"{c.modelled_ms:12.3f}"
        error = "-" if c.error is None else f"{c.error:+8.0%}"
        print(f"{c.model:26s} {c.kernels:7d} {c.measured_ms:12.3f} {modelled:>12s} {error:>8s}")


def _open_gpu() -> tuple[Any, str | None]:
    """(CUDA backend, None), or (None, why not)."""
    try:
        from streambox.device import get_backend

        backend = get_backend("cuda")
    except Exception as exc:  # BackendUnavailable, or cuda-python missing altogether
        why = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        return None, why if len(why) <= 100 else why[:99] + "…"
    return backend, None


def calibrate_models(
    backend: Backend, pool: ModelPool, models: Sequence[str], *, repeats: int = 5
) -> dict[str, Any]:
    """Step 2 on device 0 of `backend`: every model's table written beside its plan, the comparison
    printed; returns the report's part (device, preset, per-model rows, the tables)."""
    with backend.open_runtime(0) as runtime:
        device = runtime.properties().name
        preset = table_key(device)
        checks, tables = [], []
        for model in models:
            print(f"gpu-check: measuring {model} ...", flush=True)
            table = calibrate(pool, runtime, model, preset=preset, repeats=repeats)
            tables.append(table)
            checks.append(compare(pool, table))
    _print_rows(checks, device, preset)
    return {
        "device": device,
        "preset": preset,
        "models": [{**asdict(c), "error": c.error} for c in checks],
        "calibration": {t.model: asdict(t) for t in tables},
    }


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="gpu-check", description=__doc__.split("\n\n")[0])
    p.add_argument("--models", help=f"comma-separated zoo models (default all: {', '.join(ZOO)})")
    p.add_argument("--repeats", type=int, default=5, help="profiled runs per model (median)")
    p.add_argument("--out", type=Path, help="where the JSON goes (default $OUT; none when unset)")
    p.add_argument("--skip-tests", action="store_true", help="do not run the gpu-marked tests")
    p.add_argument("--skip-replay", action="store_true", help="do not replay the short trace")
    p.add_argument("--skip-bench", action="store_true", help="do not measure host time per kernel")
    args = p.parse_args(argv)
    models = args.models.split(",") if args.models else list(ZOO)
    if unknown := [m for m in models if m not in ZOO]:
        p.error(f"unknown models {unknown}; known: {', '.join(ZOO)}")

    backend, why = _open_gpu()
    if backend is None:
        print(f"gpu-check: no GPU here ({why}); nothing to check")
        return 0

    out = args.out or (Path(os.environ["OUT"]) if os.environ.get("OUT") else None)
    report: dict[str, Any] = {}
    started = time.monotonic()
    if not args.skip_tests:
        print("gpu-check: the gpu-marked tests, one process per file ...", flush=True)
        report["tests"] = run_gpu_tests()

    report.update(calibrate_models(backend, ModelPool(), models, repeats=args.repeats))

    bench = Path(__file__).resolve().parent.parent / "benchmarks" / "bench_executor.py"
    if not args.skip_bench and bench.exists():  # a checkout: the benchmarks are not installed
        print("gpu-check: host time per kernel on the CUDA backend ...", flush=True)
        json_path = (out or Path("runs")) / "bench_executor_cuda.json"
        command = [sys.executable, str(bench), "--quick", "--device-mode", "cuda", "--json", str(json_path)]
        report["bench"] = _run(command, 240)
        print(report["bench"]["tail"])

    if not args.skip_replay:
        replay_out = (out or Path("runs")) / "gpu-check-replay"
        env = {**os.environ, "STREAMBOX_BACKEND": "cuda"}
        command = [
            *_streambox_command(), "replay", *REPLAY_ARGS, "--system", "streambox,stream-only",
            "--out", str(replay_out), "--overwrite", "--no-progress",
        ]
        print("gpu-check: replaying a short Traffic trace on the CUDA backend ...", flush=True)
        report["replay"] = _run(command, 360, env)
        print(report["replay"]["tail"])

    report["seconds"] = round(time.monotonic() - started, 1)
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
        path = out / "gpu_check.json"
        path.write_text(json.dumps(report, indent=1))
        print(f"gpu-check: wrote {path}")
    failed = [step for step in ("tests", "bench", "replay") if report.get(step, {}).get("rc", 0) != 0]
    verdict = f"; failed: {', '.join(failed)}" if failed else ""
    print(f"gpu-check: done in {report['seconds']:.0f} s{verdict}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
