"""GPU partitioning, PTB cap against MPS share (the paper's Fig. 18(b)): one model's kernels on the timed
emulated device, once in a runtime opened with an MPS share (`Backend.open_runtime(i, gpu_percent=P)`)
and once in a runtime without a share whose launches carry the PTB compute-unit cap of the same share
(`api_proxy.partition.cu_cap_for(P, units)`, what the proxy gives a function that declares
`gpu_percent`).

1. One function alone at each share: the kernels' GPU time (sum of the timeline's kernel intervals,
   the device's own modelled clock, so host jitter does not enter) under MPS and under PTB.
2. Two functions at 50% each running at once: MPS = two runtimes (two processes' contexts), PTB = two
   streams of one runtime with the 50% cap; the span from the first kernel's start to the last end.

The emulated device models no persistent-thread-block loop cost: what this measures is whether the cap
gives a function the same compute as the share (the rounding of units included), not PTB's own overhead.
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import parser, print_table, write_json  # noqa: E402

from streambox.api_proxy.partition import cu_cap_for  # noqa: E402
from streambox.api_proxy.plan_program import PlanProgram  # noqa: E402
from streambox.config import Config  # noqa: E402
from streambox.device import Runtime, Stream  # noqa: E402
from streambox.kernel_compiler.model_pool import ModelPool  # noqa: E402
from streambox.kernel_compiler.zoo import get_entry  # noqa: E402

MODEL = "resnet50"  # the paper's Fig. 18(b) model is a ResNet
GATE_S = 1.0  # long enough for a loaded 2-core host to issue two runs' kernels behind it


def _noop() -> None:
    """Timed mode occupies the units for the kernel's modelled duration and does not call it."""


def launch_all(lanes: list[tuple[Runtime, Stream]], program: PlanProgram, cu_cap: int | None) -> None:
    """The program's compute kernels on every (runtime, stream) lane, kernel by kernel."""
    for kernel in program.kernels:
        if kernel.compute:
            for runtime, lane in lanes:
                runtime.launch(
                    lane,
                    _noop,
                    blocks=kernel.blocks,
                    cu_cap=cu_cap,
                    name=kernel.kernel.name,
                    duration_s=kernel.duration_s,
                )


def issue(runtime: Runtime, program: PlanProgram, cu_cap: int | None) -> None:
    """Launch the program's compute kernels on a stream of `runtime` and wait for them."""
    lane = runtime.create_stream()
    launch_all([(runtime, lane)], program, cu_cap)
    lane.synchronize()


def gpu_seconds(runtime: Runtime) -> float:
    """The kernels' GPU time on the device's own clock (the timeline's modelled intervals)."""
    return sum(r.end - r.start for r in runtime.timeline() if r.kind == "kernel")


def alone(config: Config, program: PlanProgram, share: int) -> dict[str, float]:
    """One function's kernels at `share` percent: MPS share against PTB cap."""
    backend = config.open_backend()
    units = backend.spec.compute_units
    result = {}
    for label, percent, cap in (("mps", share, None), ("ptb", None, cu_cap_for(share, units))):
        runtime = backend.open_runtime(0, gpu_percent=percent)
        try:
            issue(runtime, program, cap)
            result[f"{label}_gpu_s"] = gpu_seconds(runtime)
            result[f"{label}_units"] = runtime.units if cap is None else cap
        finally:
            runtime.close()
    return result


def gated_issue(lanes: list[tuple[Runtime, int]], program: PlanProgram, cu_cap: int | None) -> dict[str, Any]:
    """Every (runtime, streams) pair's kernels issued behind a one-block gate kernel of GATE_S per
    runtime, so that all of them are queued before any starts: the span is the device's placement,
    not the host's issue rate. Returns the span from the first kernel's start to the last one's end,
    and whether the host still issued after a gate opened (then the span is host-bound)."""
    streams = []
    for runtime, count in lanes:
        gate = runtime.create_stream()
        runtime.launch(gate, _noop, blocks=1, name="gate", duration_s=GATE_S)
        opened = runtime.create_event()
        opened.record(gate)
        for _ in range(count):
            lane = runtime.create_stream()
            lane.wait_event(opened)
            streams.append((runtime, lane))
    launch_all(streams, program, cu_cap)
    issued = time.perf_counter()
    for _, lane in streams:
        lane.synchronize()
    records = [r for runtime, _ in lanes for r in runtime.timeline() if r.kind == "kernel"]
    gates = [r.end for r in records if r.name == "gate"]
    work = [r for r in records if r.name != "gate"]
    return {
        "span_s": max(r.end for r in work) - min(r.start for r in work),
        "host_bound": issued > min(gates),
    }


def side_by_side(config: Config, program: PlanProgram, repeats: int) -> dict[str, Any]:
    """Two functions at 50% at once: two MPS contexts against two capped streams of one context,
    alternating, `repeats` times each; the median spans (the emulator places a queued kernel when its
    stream's worker thread gets a core, so a loaded host stretches single runs)."""
    backend = config.open_backend()
    cap = cu_cap_for(50, backend.spec.compute_units)
    spans: dict[str, list[float]] = {"mps": [], "ptb": []}
    host_bound = False
    for _ in range(repeats):
        mps = [backend.open_runtime(0, gpu_percent=50) for _ in range(2)]
        try:
            two_contexts = gated_issue([(rt, 1) for rt in mps], program, None)
        finally:
            for rt in mps:
                rt.close()
        one = backend.open_runtime(0)
        try:
            one_context = gated_issue([(one, 2)], program, cap)
        finally:
            one.close()
        spans["mps"].append(two_contexts["span_s"])
        spans["ptb"].append(one_context["span_s"])
        host_bound = host_bound or two_contexts["host_bound"] or one_context["host_bound"]
    return {
        "mps_span_s": statistics.median(spans["mps"]),
        "ptb_span_s": statistics.median(spans["ptb"]),
        "mps_spans_s": spans["mps"],
        "ptb_spans_s": spans["ptb"],
        "host_bound": host_bound,
    }


def main() -> int:
    args = parser(__doc__.splitlines()[0]).parse_args()
    shares = (25, 50, 100) if args.quick else (10, 25, 50, 75, 100)
    config = Config.from_env(device_mode="timed")
    # the full input: at the small one the grids are narrower than any cap and every share looks alike
    plan = ModelPool(config.model_pool).get_or_lower(MODEL, 1, get_entry(MODEL).input_shape)
    program = PlanProgram.of(plan, plan.kernel_seconds(config.device_preset))
    print(
        f"{MODEL} b1 {plan.input_shape}: {program.compute_kernels} kernels on emulated {config.device_preset}"
    )
    results: dict[str, Any] = {"alone": {}, "model": MODEL, "input_shape": plan.input_shape}
    rows = []
    for share in shares:
        r = alone(config, program, share)
        r["ptb_performance_vs_mps"] = r["mps_gpu_s"] / r["ptb_gpu_s"]
        results["alone"][str(share)] = r
        rows.append(
            [
                f"{share}%",
                f"{r['mps_units']} / {r['ptb_units']}",
                f"{r['mps_gpu_s'] * 1e3:,.2f}",
                f"{r['ptb_gpu_s'] * 1e3:,.2f}",
                f"{r['ptb_performance_vs_mps']:.3f}",
            ]
        )
    print_table(
        "1. One function's kernels: GPU ms under an MPS share vs the PTB cap of the same share "
        "(performance = MPS time / PTB time; paper: 0.97)",
        ["share", "units MPS / PTB", "MPS ms", "PTB ms", "PTB performance"],
        rows,
    )
    pair = side_by_side(config, program, 3 if args.quick else 7)
    pair["ptb_performance_vs_mps"] = pair["mps_span_s"] / pair["ptb_span_s"]
    results["pair_50"] = pair
    print_table(
        "2. Two functions at 50% at once: median span of their kernels (ms)"
        + (" HOST-BOUND: the host issued after the gate opened" if pair["host_bound"] else ""),
        ["", "MPS (two contexts)", "PTB (two capped streams, one context)", "PTB performance"],
        [
            [
                "span",
                f"{pair['mps_span_s'] * 1e3:,.2f}",
                f"{pair['ptb_span_s'] * 1e3:,.2f}",
                f"{pair['ptb_performance_vs_mps']:.3f}",
            ]
        ],
    )
    write_json(args.json, "bench_ptb_mps", {"quick": args.quick, "preset": config.device_preset}, results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
