"""Dynamic batching end to end: a workflow's burst with `max_batch_size` B against the same burst unbatched.

Two deployments of one workflow (Traffic by default) run one after the other on each `--system`: real
API proxies (`streambox`, `stream-only`) or the per-instance baselines (`infless`, `astraea`: the
monolithic invoker, one process per instance, prewarmed with one instance per function, as the replay
runs them), the timed emulated GPU (modelled kernel and copy times, phantom data) and the same events:

- `unbatched`: the YAML as it is (`max_batch_size: 1`);
- `batched`: every function with models gets `max_batch_size` B and `max_queue_delay_ms` D.

In both, those functions may run max(max_instances, B) invocations at once, so that the only
difference is batching (a batch gathers concurrent invocations, so it can never hold more than the
function runs at once). Each deployment is warmed up by one concurrent burst (instances started,
plans at hand), then measured with `--requests` at `--concurrency`; `--rounds` rounds of both, in
ABBA order (the 2-core machine's load drifts), pooled as medians. Printed per system: throughput and
p50/p99 latency of both, as ratios batched / unbatched, the batch counts (the proxy's
`stats["batching"]`; the baselines' instances' `inference_counts()`: plan runs that served several
`infer` calls), then one line per system side by side, and the cost model's GPU time per sample at
batch 1 and B (modelled, not measured). Latency is the engine's (no HTTP). `--quick`: 16 requests,
1 round (a few minutes per system on 2 loaded cores). `--system streambox infless` runs both on the
same events.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import parser, print_table, write_json  # noqa: E402

from streambox.config import Config  # noqa: E402
from streambox.device.modes import device_mode_env  # noqa: E402
from streambox.kernel_compiler.model_pool import ModelPool  # noqa: E402
from streambox.workflows.burst import BurstReport, Deployment, Memory, Outcome, prepare  # noqa: E402
from streambox.workflows.engine import Engine  # noqa: E402
from streambox.workflows.monolithic import DATA_PATHS, MonolithicInvoker  # noqa: E402
from streambox.workflows.spec import WorkflowSpec  # noqa: E402


def with_batching(spec: WorkflowSpec, max_batch_size: int, delay_ms: float, room: int) -> WorkflowSpec:
    """`spec` with batching set on every function that has models, each allowed at least `room`
    instances (the same in both configurations: room for a batch's invocations in the proxy)."""
    functions = {
        name: fn.model_copy(
            update={
                "max_batch_size": max_batch_size,
                "max_queue_delay_ms": delay_ms if max_batch_size > 1 else 0.0,
                "max_instances": max(fn.max_instances, room),
            }
        )
        if fn.models
        else fn
        for name, fn in spec.functions.items()
    }
    return spec.model_copy(update={"functions": functions}).with_base_dir(spec.base_dir)


PROXY_SYSTEMS = ("streambox", "stream-only")
MONOLITHIC_SYSTEMS = {system: data_path for data_path, system in DATA_PATHS.items()}  # infless, astraea


async def measure(
    system: str, spec: WorkflowSpec, events: list[dict[str, Any]], warmup: int, concurrency: int
) -> dict[str, Any]:
    if system in MONOLITHIC_SYSTEMS:
        return await measure_monolithic(system, spec, events, warmup, concurrency)
    config = Config.from_env(device_mode="timed")
    options = {"model_shapes": "small"}
    async with Deployment(spec, via="engine", system=system, config=config, proxy_options=options) as dep:
        await dep.burst(events[:warmup] + events[:1], concurrency=concurrency, warmup=0)
        before = dict(dep.invoker.last_stats().get(spec.name, {}).get("batching", {}))
        report = await dep.burst(events, concurrency=concurrency)
        after = dep.invoker.last_stats().get(spec.name, {}).get("batching", {})
    counts = {k: after.get(k, 0) - before.get(k, 0) for k in ("batches", "members", "alone")}
    return _result(report, counts["batches"], counts["members"], counts["alone"])


async def measure_monolithic(
    system: str, spec: WorkflowSpec, events: list[dict[str, Any]], warmup: int, concurrency: int
) -> dict[str, Any]:
    """The same burst on the per-instance baseline, straight to its engine (as `Deployment` does with
    `via="engine"`); its batches are the instances' plan runs that served several `infer` calls."""
    config = Config.from_env(device_mode="timed")
    invoker = MonolithicInvoker(config, prewarm=1, model_shapes="small", data_path=MONOLITHIC_SYSTEMS[system])
    engine = Engine(invoker)
    try:
        await engine.deploy(spec)
        await _engine_burst(engine, spec.name, events[:warmup] + events[:1], concurrency)
        while invoker.starting_instances:  # starts the warm-up began would load the measured burst
            await asyncio.sleep(0.1)
        before = invoker.inference_counts()
        outcomes, wall_s = await _engine_burst(engine, spec.name, events, concurrency)
        after = invoker.inference_counts()
        instances = int(invoker.memory_breakdown()["instances"])
    finally:
        await engine.close()
    counts = {k: after[k] - before[k] for k in after}
    report = BurstReport(
        spec.name, system, "engine", concurrency, {}, outcomes, wall_s, 0.0, 0, Memory(), Memory()
    )
    batching = any(fn.max_batch_size > 1 for fn in spec.functions.values())
    alone = counts["plan_runs"] - counts["batched_runs"] if batching else 0  # plan runs of one call
    result = _result(report, counts["batched_runs"], counts["batched_calls"], alone)
    result["messages"] = {"batched": counts["batches_sent"], "invocations_in_them": counts["calls_batched"]}
    result["instances"] = instances  # instance processes (each a runtime) live at the end
    return result


async def _engine_burst(
    engine: Engine, workflow: str, events: list[dict[str, Any]], concurrency: int
) -> tuple[list[Outcome], float]:
    """`events` with at most `concurrency` outstanding: each request's outcome, and the wall time."""
    gate = asyncio.Semaphore(concurrency)

    async def one(event: dict[str, Any]) -> Outcome:
        async with gate:
            started = time.perf_counter()
            result = await engine.run(workflow, event)
            return Outcome(time.perf_counter() - started, result.status, result.to_json())

    started = time.perf_counter()
    outcomes = list(await asyncio.gather(*(one(e) for e in events)))
    return outcomes, time.perf_counter() - started


def _result(report: BurstReport, batches: int, members: int, alone: int) -> dict[str, Any]:
    out = report.to_json()
    return {
        "ok": out["ok"],
        "failed": out["failed"],
        "errors": out["errors"],
        "throughput_rps": out["throughput_rps"],
        "latency_ms": out["latency_ms"],
        "functions": out["functions"],
        "batches": batches,
        "calls_batched": members,
        "calls_alone": alone,  # waited for a batch that no other call joined
        "mean_batch": round(members / batches, 2) if batches else None,
    }


def modelled_gpu_ms(spec: WorkflowSpec, max_batch_size: int) -> list[list[Any]]:
    """Per model of the batched functions: the cost model's GPU time of one sample at batch 1 and at
    `max_batch_size` (modelled: kernel_compiler/cost_model.py, the deployment's preset and shapes)."""
    config = Config.from_env(device_mode="timed")
    pool = ModelPool(config.model_pool)
    rows = []
    for model in sorted({m for fn in spec.functions.values() for m in fn.models}):
        shape = tuple(pool.entry(model).small_input_shape or pool.entry(model).input_shape)
        one = sum(pool.get_or_lower(model, 1, shape).kernel_seconds(config.device_preset)) * 1e3
        many = sum(pool.get_or_lower(model, max_batch_size, shape).kernel_seconds(config.device_preset)) * 1e3
        per_sample = many / max_batch_size
        rows.append([model, f"{one:.3f}", f"{per_sample:.3f}", _ratio(per_sample, one)])
    return rows


def _ratio(a: float | None, b: float | None) -> str:
    return f"{a / b:.2f}x" if a and b else "-"


def _pooled(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """One configuration over its rounds: medians of throughput and latency, sums of counts."""
    def median_of(get: Any) -> float | None:
        values = [v for v in map(get, runs) if v is not None]
        return round(statistics.median(values), 3) if values else None

    batches, members = sum(r["batches"] for r in runs), sum(r["calls_batched"] for r in runs)
    return {
        "ok": sum(r["ok"] for r in runs),
        "failed": sum(r["failed"] for r in runs),
        "throughput_rps": median_of(lambda r: r["throughput_rps"]),
        "p50": median_of(lambda r: r["latency_ms"].get("p50")),
        "p99": median_of(lambda r: r["latency_ms"].get("p99")),
        "batches": batches,
        "calls_batched": members,
        "calls_alone": sum(r["calls_alone"] for r in runs),
        "mean_batch": round(members / batches, 2) if batches else None,
        "functions": {
            name: median_of(lambda r, n=name: r["functions"].get(n, {}).get("latency_ms", {}).get("p50"))
            for name in runs[0]["functions"]
        },
    }


def run_system(
    system: str, base: WorkflowSpec, events: list[dict[str, Any]], args: argparse.Namespace, rounds: int
) -> dict[str, list[dict[str, Any]]]:
    """Both configurations on `system`, `rounds` times in ABBA order (the machine's load drifts)."""
    sizes = {"unbatched": 1, "batched": args.max_batch_size}
    runs: dict[str, list[dict[str, Any]]] = {"unbatched": [], "batched": []}
    for r in range(rounds):
        for label in (("unbatched", "batched") if r % 2 == 0 else ("batched", "unbatched")):
            spec = with_batching(base, sizes[label], args.delay_ms, args.max_batch_size)
            runs[label].append(asyncio.run(measure(system, spec, events, args.concurrency, args.concurrency)))
    return runs


def print_system(system: str, title: str, runs: dict[str, list[dict[str, Any]]]) -> None:
    one, many = _pooled(runs["unbatched"]), _pooled(runs["batched"])
    rows = [
        ["requests ok / failed", f"{one['ok']} / {one['failed']}", f"{many['ok']} / {many['failed']}", ""],
        ["throughput (req/s)", one["throughput_rps"], many["throughput_rps"],
         _ratio(many["throughput_rps"], one["throughput_rps"])],
    ]
    for q in ("p50", "p99"):
        rows.append([f"latency {q} (ms)", one[q], many[q], _ratio(many[q], one[q])])
    for r, (a, b) in enumerate(zip(runs["unbatched"], runs["batched"], strict=True)):
        rows.append([f"round {r + 1}: throughput / p50 ratio", "", "",
                     f"{_ratio(b['throughput_rps'], a['throughput_rps'])} / "
                     f"{_ratio(b['latency_ms'].get('p50'), a['latency_ms'].get('p50'))}"])
    rows.append(["batches run / calls in them", "-", f"{many['batches']} / {many['calls_batched']}", ""])
    rows.append(["calls no other joined (ran alone)", "-", many["calls_alone"], ""])
    rows.append(["mean batch (calls)", "-", many["mean_batch"], ""])
    if "instances" in runs["unbatched"][0]:  # the baselines: processes, each its own runtime and models
        rows.append(["instance processes at the end (max over rounds)",
                     max(r["instances"] for r in runs["unbatched"]),
                     max(r["instances"] for r in runs["batched"]), ""])
    print_table(f"{system}: {title}", ["", "unbatched", "batched", "batched / unbatched"], rows)
    per_function = [[name, v, many["functions"].get(name)] for name, v in one["functions"].items()]
    print_table(f"{system}: per function p50 (ms), median over rounds", ["function", "unbatched", "batched"],
                per_function)


def print_systems(pooled: dict[str, dict[str, dict[str, Any]]]) -> None:
    """One line per system: batched against unbatched, measured in this run."""
    rows = []
    for system, p in pooled.items():
        one, many = p["unbatched"], p["batched"]
        rows.append([system, one["throughput_rps"], many["throughput_rps"],
                     _ratio(many["throughput_rps"], one["throughput_rps"]),
                     one["p50"], many["p50"], _ratio(many["p50"], one["p50"]), many["mean_batch"]])
    columns = ["system", "req/s unbatched", "req/s batched", "ratio", "p50 ms unbatched", "p50 ms batched",
               "ratio", "mean batch (calls)"]
    print_table("every system on the same events (medians over rounds)", columns, rows)


def main() -> int:
    p = parser(__doc__.splitlines()[0])
    p.add_argument("--workflow", default="traffic", help="bundled workflow name or YAML (default traffic)")
    systems = [*PROXY_SYSTEMS, *MONOLITHIC_SYSTEMS]
    p.add_argument("--system", nargs="+", default=["streambox"], choices=systems,
                   help="systems to run, one after the other (default streambox)")
    p.add_argument("--requests", "-n", type=int, default=48)
    p.add_argument("--concurrency", "-c", type=int, default=8)
    p.add_argument("--max-batch-size", type=int, default=4)
    p.add_argument("--delay-ms", type=float, default=5.0, help="max_queue_delay_ms of the batched run")
    p.add_argument("--rounds", type=int, default=2, help="rounds, each both configurations, ABBA order")
    p.add_argument("--params", nargs="*", default=[], metavar="[FUNCTION.]KEY=VALUE",
                   help="override params as `streambox burst --params` does (e.g. detect.max_people=4)")
    args = p.parse_args()
    requests = 16 if args.quick else args.requests
    rounds = 1 if args.quick else args.rounds
    base, events = prepare(args.workflow, requests=requests, warmup=0, params=args.params)
    title = (
        f"{base.name}: max_batch_size {args.max_batch_size}, max_queue_delay_ms {args.delay_ms:g} vs 1 "
        f"({requests} requests x {rounds} rounds, concurrency {args.concurrency}, medians over rounds; "
        f"timed emulated GPU: modelled device times)"
    )
    runs: dict[str, dict[str, list[dict[str, Any]]]] = {}
    with device_mode_env("timed"):
        for system in dict.fromkeys(args.system):
            runs[system] = run_system(system, base, events, args, rounds)
            print_system(system, title, runs[system])
    pooled = {s: {label: _pooled(r) for label, r in by_label.items()} for s, by_label in runs.items()}
    if len(pooled) > 1:
        print_systems(pooled)
    modelled = modelled_gpu_ms(base, args.max_batch_size)
    print_table(
        f"modelled GPU ms per sample (cost model, {Config.from_env().device_preset}, small inputs)",
        ["model", "batch 1", f"batch {args.max_batch_size}", "ratio"],
        modelled,
    )
    config = {
        "workflow": base.name,
        "systems": list(runs),
        "requests": requests,
        "rounds": rounds,
        "concurrency": args.concurrency,
        "max_batch_size": args.max_batch_size,
        "delay_ms": args.delay_ms,
        "params": args.params,
    }
    results = {
        "runs": runs,
        "pooled": pooled,
        "modelled_gpu_ms_per_sample": {r[0]: {"batch_1": r[1], "batched": r[2]} for r in modelled},
    }
    write_json(args.json, "batching", config, results)
    failed = sum(p[label]["failed"] for p in pooled.values() for label in p)
    return 0 if failed == 0 else 1


if __name__ == "__main__":
    raise SystemExit(main())
