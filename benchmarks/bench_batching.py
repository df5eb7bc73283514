"""Dynamic batching end to end: a workflow's burst with `max_batch_size` B against the same burst unbatched.

Two deployments of one workflow (Traffic by default) run one after the other on real API proxies, the
timed emulated GPU (modelled kernel and copy times, phantom data) and the same events:

- `unbatched`: the YAML as it is (`max_batch_size: 1`);
- `batched`: every function with models gets `max_batch_size` B and `max_queue_delay_ms` D.

In both, those functions may run max(max_instances, B) invocations at once, so that the only
difference is batching (a batch gathers concurrent invocations, so it can never hold more than the
function runs at once). Each deployment is warmed up by one concurrent burst (instances started,
plans at hand), then measured with `--requests` at `--concurrency`; `--rounds` rounds of both, in
ABBA order (the 2-core machine's load drifts), pooled as medians. Printed: throughput and p50/p99
latency of both, as ratios batched / unbatched, the proxy's batch counts (`stats["batching"]`), and
the cost model's GPU time per sample at batch 1 and B (modelled, not measured).
Latency is the engine's (no HTTP). `--quick`: 16 requests, 1 round (a few minutes on 2 loaded cores).
"""

from __future__ import annotations

import asyncio
import statistics
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import parser, print_table, write_json  # noqa: E402

from streambox.config import Config  # noqa: E402
from streambox.device.modes import device_mode_env  # noqa: E402
from streambox.kernel_compiler.model_pool import ModelPool  # noqa: E402
from streambox.workflows.burst import Deployment, prepare  # noqa: E402
from streambox.workflows.spec import WorkflowSpec  # noqa: E402


def with_batching(spec: WorkflowSpec, max_batch_size: int, delay_ms: float) -> WorkflowSpec:
    """`spec` with batching set on every function that has models (and room for a batch's invocations)."""
    functions = {
        name: fn.model_copy(
            update={
                "max_batch_size": max_batch_size,
                "max_queue_delay_ms": delay_ms if max_batch_size > 1 else 0.0,
                "max_instances": max(fn.max_instances, max_batch_size),
            }
        )
        if fn.models
        else fn
        for name, fn in spec.functions.items()
    }
    return spec.model_copy(update={"functions": functions}).with_base_dir(spec.base_dir)


async def measure(
    spec: WorkflowSpec, events: list[dict[str, Any]], warmup: int, concurrency: int
) -> dict[str, Any]:
    config = Config.from_env(device_mode="timed")
    async with Deployment(spec, via="engine", config=config, proxy_options={"model_shapes": "small"}) as dep:
        await dep.burst(events[:warmup] + events[:1], concurrency=concurrency, warmup=0)
        before = dict(dep.invoker.last_stats().get(spec.name, {}).get("batching", {}))
        report = await dep.burst(events, concurrency=concurrency)
        after = dep.invoker.last_stats().get(spec.name, {}).get("batching", {})
    out = report.to_json()
    batches = after.get("batches", 0) - before.get("batches", 0)
    members = after.get("members", 0) - before.get("members", 0)
    alone = after.get("alone", 0) - before.get("alone", 0)
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


def main() -> int:
    p = parser(__doc__.splitlines()[0])
    p.add_argument("--workflow", default="traffic", help="bundled workflow name or YAML (default traffic)")
    p.add_argument("--requests", "-n", type=int, default=48)
    p.add_argument("--concurrency", "-c", type=int, default=8)
    p.add_argument("--max-batch-size", type=int, default=4)
    p.add_argument("--delay-ms", type=float, default=5.0, help="max_queue_delay_ms of the batched run")
    p.add_argument("--rounds", type=int, default=2, help="rounds, each both configurations, ABBA order")
    args = p.parse_args()
    requests = 16 if args.quick else args.requests
    rounds = 1 if args.quick else args.rounds
    base, events = prepare(args.workflow, requests=requests, warmup=0)
    sizes = {"unbatched": 1, "batched": args.max_batch_size}
    runs: dict[str, list[dict[str, Any]]] = {"unbatched": [], "batched": []}
    with device_mode_env("timed"):
        for r in range(rounds):  # alternating which goes first: the machine's load drifts
            for label in (("unbatched", "batched") if r % 2 == 0 else ("batched", "unbatched")):
                spec = with_batching(base, sizes[label], args.delay_ms)
                runs[label].append(asyncio.run(measure(spec, events, args.concurrency, args.concurrency)))
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
    title = (
        f"{base.name}: max_batch_size {args.max_batch_size}, max_queue_delay_ms {args.delay_ms:g} vs 1 "
        f"({requests} requests x {rounds} rounds, concurrency {args.concurrency}, medians over rounds; "
        f"timed emulated GPU: modelled device times)"
    )
    print_table(title, ["", "unbatched", "batched", "batched / unbatched"], rows)
    per_function = [[name, v, many["functions"].get(name)] for name, v in one["functions"].items()]
    columns = ["function", "unbatched", "batched"]
    print_table("per function p50 (ms), median over rounds", columns, per_function)
    modelled = modelled_gpu_ms(base, args.max_batch_size)
    print_table(
        f"modelled GPU ms per sample (cost model, {Config.from_env().device_preset}, small inputs)",
        ["model", "batch 1", f"batch {args.max_batch_size}", "ratio"],
        modelled,
    )
    config = {
        "workflow": base.name,
        "requests": requests,
        "rounds": rounds,
        "concurrency": args.concurrency,
        "max_batch_size": args.max_batch_size,
        "delay_ms": args.delay_ms,
    }
    results = {
        "runs": runs,
        "pooled": {"unbatched": one, "batched": many},
        "modelled_gpu_ms_per_sample": {r[0]: {"batch_1": r[1], "batched": r[2]} for r in modelled},
    }
    write_json(args.json, "batching", config, results)
    return 0 if one["failed"] == 0 and many["failed"] == 0 else 1


if __name__ == "__main__":
    raise SystemExit(main())
