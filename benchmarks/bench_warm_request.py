"""Where a warm Traffic request's time goes: per-phase timings measured in the request path
(`streambox.phases`), beside the modelled GPU time of its kernels, for several systems in one run.

Each system (`--variants`, default streambox and stream-only, each with proxy options of its own)
gets its own API proxy on the same emulated V100 (timed mode: kernels last their modelled time),
is warmed up with `--warmup` requests, then the systems take turns, one request at a time
(concurrency 1), so that a change in the machine's load reaches them alike. Requests go straight
to the engine (no HTTP).

Per system it prints the latency and the mean of each phase along the request's critical path
(they add up to the mean latency), `other` by where it went (the handler's own code and channel,
the control hop, the engine), and of `compute` the wait for the device once the kernels were issued.
"modelled GPU" is the cost model's time of the kernels on the critical path
(`KernelPlan.kernel_seconds('v100-16gb')` of detect's plan and one recognition's: the slower one,
a lower bound when the recognitions share the GPU); everything above it is host time.
Ratios are against the first system, measured in the same run.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import parser, print_table, write_json  # noqa: E402

from streambox.config import Config  # noqa: E402
from streambox.kernel_compiler.model_pool import ModelPool  # noqa: E402
from streambox.phases import DEVICE_WAIT, PHASES  # noqa: E402
from streambox.workflows.burst import Deployment, Outcome, default_events, prepare  # noqa: E402
from streambox.workflows.spec import WorkflowSpec  # noqa: E402

PRESET = "v100-16gb"
OTHER_PARTS = ("handler", "control", "engine")
SIZE_PARAM = {"detect": "image_size", "face": "face_size", "car": "car_size"}  # Traffic's input sides


def modelled_gpu_ms(spec: WorkflowSpec, pool: ModelPool) -> dict[str, float]:
    """Per Traffic function: the cost model's GPU time of its plan at the run's input size (the
    recognitions' crop sides are detect's parameters)."""
    params = spec.functions["detect"].params
    out = {}
    for function, param in SIZE_PARAM.items():
        (model,) = spec.functions[function].models
        side = int(params[param])
        plan = pool.get(model, 1, (3, side, side))
        if plan is None:
            raise RuntimeError(f"no plan of {model} for {side}x{side} in {pool.root}: did the warm-up run?")
        out[function] = sum(plan.kernel_seconds(PRESET)) * 1e3
    return out


def summarize(outcomes: list[Outcome], gpu_ms: dict[str, float]) -> dict[str, Any]:
    ok = [o for o in outcomes if o.ok]
    if not ok:
        return {"ok": 0}
    bodies = [o.body for o in ok]

    def mean(key: str, part: str) -> float:
        return statistics.fmean(b.get(key, {}).get(part, 0.0) for b in bodies)

    path_gpu = []
    for body in bodies:  # the critical path: the call that ended last, back through `after`
        calls = {c["call"]: c for c in body["calls"]}
        last = max(body["calls"], key=lambda c: c["wall_ms"] + _ready(c, calls))
        total, call = 0.0, last
        while call is not None:
            total += gpu_ms[call["function"]]
            call = calls.get(call["after"]) if call["after"] else None
        path_gpu.append(total)
    latency = [o.latency_s * 1e3 for o in ok]
    engine_latency = [b["latency_ms"] for b in bodies]
    return {
        "ok": len(ok),
        "p50_ms": statistics.median(latency),
        "mean_ms": statistics.fmean(latency),
        "engine_mean_ms": statistics.fmean(engine_latency),
        "phases_ms": {phase: mean("phases_ms", phase) for phase in PHASES},
        "other_ms": {part: mean("other_ms", part) for part in OTHER_PARTS},
        "device_wait_ms": mean("detail_ms", DEVICE_WAIT),
        "modelled_gpu_ms": statistics.fmean(path_gpu),
    }


def _ready(call: dict[str, Any], calls: dict[str, dict[str, Any]]) -> float:
    """A call's end, as the sum of the wall times on its chain (the body has no absolute times)."""
    total, before = 0.0, calls.get(call["after"]) if call["after"] else None
    while before is not None:
        total += before["wall_ms"]
        before = calls.get(before["after"]) if before["after"] else None
    return total


def parse_variants(text: str) -> dict[str, tuple[str, dict[str, str]]]:
    """`label=system[,key=value...];...` (a bare `system` is its own label) -> label: (system, options)."""
    out = {}
    for item in filter(None, (part.strip() for part in text.split(";"))):
        label, _, rest = item.partition("=") if "=" in item.split(",")[0] else (item, "", item)
        system, *pairs = rest.split(",")
        options = {}
        for pair in pairs:
            key, sep, value = pair.partition("=")
            if not sep:
                raise SystemExit(f"--variants: {pair!r} in {item!r} is not key=value")
            options[key.strip()] = value.strip()
        out[label.strip()] = (system.strip(), options)
    return out


async def measure(
    spec: WorkflowSpec,
    variants: dict[str, tuple[str, dict[str, str]]],
    requests: int,
    warmup: int,
    config: Config,
) -> dict[str, list[Outcome]]:
    events = default_events(spec, requests + warmup)
    systems = list(variants)
    outcomes: dict[str, list[Outcome]] = {s: [] for s in systems}
    async with contextlib.AsyncExitStack() as stack:
        deployments = {}
        for system, (kind, options) in variants.items():
            deployment = Deployment(spec, system=kind, via="engine", config=config, proxy_options=options)
            deployments[system] = await stack.enter_async_context(deployment)
            for event in events[:warmup]:
                await deployments[system].send(event)
            print(
                f"{system}: proxy warm in {deployment.deploy_s:.1f} s, {warmup} warm-up requests", flush=True
            )
        for i, event in enumerate(events[warmup:]):
            order = systems if i % 2 == 0 else systems[::-1]
            for system in order:
                outcomes[system].append(await deployments[system].send(event))
    return outcomes


def main() -> int:
    p = parser(__doc__.splitlines()[0])
    p.add_argument(
        "--variants",
        default="streambox;stream-only",
        help="';'-separated systems, each `label=system,key=value,...` with proxy options "
        "(the first is the baseline), e.g. 'streambox;fast=streambox,switch_interval_us=500'",
    )
    p.add_argument("--requests", type=int, help="measured requests per system (default 10 quick, 30 full)")
    p.add_argument("--warmup", type=int, default=4, help="requests per system before measuring (default 4)")
    args = p.parse_args()
    variants = parse_variants(args.variants)
    systems = list(variants)
    requests = args.requests or (10 if args.quick else 30)
    spec, _ = prepare("traffic", requests=1, inputs="small")
    load = os.getloadavg()
    print(f"machine: {os.cpu_count()} cores, load average {load[0]:.2f}; {requests} requests per system")
    with tempfile.TemporaryDirectory(prefix="sbx-bench-warm-") as state:
        config = Config.from_env().with_overrides(state_dir=Path(state), device_mode="timed")
        outcomes = asyncio.run(measure(spec, variants, requests, args.warmup, config))
    gpu_ms = modelled_gpu_ms(spec, ModelPool(config.model_pool))
    print(
        "modelled GPU ms per function ("
        + PRESET
        + "): "
        + ", ".join(f"{f} {ms:.2f}" for f, ms in gpu_ms.items())
    )
    results = {system: summarize(rows, gpu_ms) for system, rows in outcomes.items()}
    base = results[systems[0]]
    rows = []
    for system, r in results.items():
        if not r["ok"]:
            rows.append((system, "0 ok", *["-"] * 12))
            continue
        ph, other = r["phases_ms"], r["other_ms"]
        rows.append(
            (
                system,
                f"{r['ok']}/{requests}",
                f"{r['p50_ms']:.1f}",
                f"{r['p50_ms'] / base['p50_ms']:.2f}x" if base.get("ok") else "-",
                f"{r['mean_ms']:.1f}",
                *(f"{ph[phase]:.1f}" for phase in PHASES[:4]),
                f"{r['device_wait_ms']:.1f}",
                f"{ph['comm']:.1f}",
                f"{ph['other']:.1f} ({' / '.join(f'{other[k]:.1f}' for k in OTHER_PARTS)})",
                f"{r['mean_ms'] - r['engine_mean_ms']:.1f}",
                f"{r['modelled_gpu_ms']:.1f}",
                f"{r['mean_ms'] - r['modelled_gpu_ms']:.1f}",
            )
        )
    print_table(
        "Warm Traffic request (small inputs, timed V100 emulation, concurrency 1): mean ms per phase on "
        "the critical path",
        (
            "system",
            "ok",
            "p50",
            "p50 ratio",
            "mean",
            "cold start",
            "queue",
            "model load",
            "compute",
            "of which device wait",
            "comm",
            "other (handler / control / engine)",
            "client",
            "modelled GPU",
            "host (mean - GPU)",
        ),
        rows,
    )
    config_json = {
        "variants": {k: [s, o] for k, (s, o) in variants.items()},
        "requests": requests,
        "warmup": args.warmup,
        "load_average": load,
    }
    write_json(args.json, "bench_warm_request", config_json, {"modelled_gpu_ms": gpu_ms, "systems": results})
    return 0 if all(r["ok"] == requests for r in results.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
