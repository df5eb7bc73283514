"""Fault containment under load: well-behaved requests beside crashing, hanging, raising and flooding
ones (and, with `--fuzz`, functions that send malformed frames), through the real stack: the engine,
one API proxy process per workflow, function instances forked from its template, the emulated V100.

Two workflows of one handler `act` that does what the event says:

- `mixed`: well-behaved requests (upload 64 KiB, PUT it under a request key, GET it back, download,
  check) *and* the faulty ones, in the same proxy and the same function's instances: `crash`
  (`os._exit` mid-request), `hang` (sleeps past the function's 1 s timeout: the proxy kills it),
  `raise`, `flood` (PUTs 32 keys of 2 MiB and returns: the request's end must drop them), `fuzz`
  (a malformed frame on the channel; only with `--fuzz`).
- `clean`: well-behaved requests only, in a proxy of its own.

The load is open-loop and bounded: `--requests` arrivals at `--rate` per second, a seeded choice of
kind per arrival. On the same proxies: a fault-free warm-up (not measured: the instances scale up),
then `--rounds` alternating pairs: fault-free (the same schedule with the faulty arrivals left out,
so every well-behaved request is sent at the same moment), then with the faults. Printed:
well-behaved requests ok / total per phase (goal 100 %), their p50/p99 latency and the ratio
faulty / fault-free, the outcome of every faulty kind, and what is left behind after
the run in each proxy (pool bytes above the level after warm-up, live buffers, stored keys; goal 0).
"""

from __future__ import annotations

import asyncio
import random
import statistics
import sys
import tempfile
import textwrap
import time
from collections import Counter
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import parser, print_table, write_json  # noqa: E402

from streambox.config import Config  # noqa: E402
from streambox.workflows.engine import Engine, RequestResult  # noqa: E402
from streambox.workflows.proxy_invoker import ProxyInvoker  # noqa: E402
from streambox.workflows.validation import validate_file  # noqa: E402

HANDLERS = textwrap.dedent(
    """
    import os
    import time

    import torch


    def act(ctx, event):
        do = event.get("do", "ok")
        if do == "ok":
            data = torch.arange(16384, dtype=torch.float32) + event["n"]
            ctx.put(ctx.key("x"), ctx.upload(data), consumers=1)
            back = ctx.download(ctx.get(ctx.key("x")))
            assert torch.equal(back, data)
            return {"sum": float(back.sum())}
        ctx.alloc(1 << 20)  # the offender holds device memory when it goes wrong
        if do == "crash":
            os._exit(3)
        if do == "hang":
            time.sleep(3600)
        if do == "raise":
            raise ValueError("bad request")
        if do == "flood":
            for i in range(32):
                ctx.put(ctx.key(f"flood{i}"), ctx.alloc(2 << 20))
            return {"flooded": 32}
        if do == "fuzz":
            ctx._client.channel.send(b"\\xc1")  # not msgpack
            time.sleep(2)
            return {"fuzz": "survived"}
        raise ValueError(do)
    """
)


def workflow_yaml(name: str) -> str:
    return textwrap.dedent(
        f"""
        name: {name}
        slo_ms: 200
        timeout_ms: 5000
        functions:
          act: {{handler: bench_fault_handlers:act, max_instances: 6, timeout_ms: 1000}}
        """
    )


FAULTS = ("crash", "hang", "raise", "flood")
QUANTILES = ("p50_ms", "p99_ms")


def schedule(requests: int, fault_share: float, fuzz: bool, seed: int) -> list[tuple[str, str]]:
    """(workflow, kind) per arrival: half of the well-behaved ones to each workflow, faults to `mixed`."""
    rng = random.Random(seed)
    kinds = FAULTS + (("fuzz",) if fuzz else ())
    out = []
    for _ in range(requests):
        if rng.random() < fault_share:
            out.append(("mixed", rng.choice(kinds)))
        else:
            out.append((rng.choice(("mixed", "clean")), "ok"))
    return out


async def run_phase(
    engine: Engine, arrivals: list[tuple[str, str]], rate: float, with_faults: bool
) -> list[tuple[str, str, RequestResult]]:
    """Send the arrivals open-loop at `rate`/s (faulty ones skipped when not `with_faults`)."""
    loop = asyncio.get_running_loop()
    start = loop.time()
    tasks = []
    for i, (workflow, kind) in enumerate(arrivals):
        if kind != "ok" and not with_faults:
            continue
        await asyncio.sleep(max(0.0, start + i / rate - loop.time()))
        event = {"do": kind, "n": i}
        tasks.append((workflow, kind, asyncio.ensure_future(engine.run(workflow, event))))
    return [(w, k, await t) for w, k, t in tasks]


def summarize(results: list[tuple[str, str, RequestResult]]) -> dict[str, Any]:
    good = [r for _, kind, r in results if kind == "ok"]
    latencies = sorted(r.latency_s for r in good if r.ok)
    by_workflow = {}
    for name in ("mixed", "clean"):
        own = sorted(r.latency_s for w, kind, r in results if kind == "ok" and w == name and r.ok)
        by_workflow[name] = {"p50_ms": 1e3 * statistics.median(own), "p99_ms": 1e3 * _p99(own)} if own else {}
    faulty: dict[str, Counter[str]] = {}
    for _, kind, r in results:
        if kind != "ok":
            faulty.setdefault(kind, Counter())[r.status] += 1
    return {
        "good_ok": sum(r.ok for r in good),
        "good_total": len(good),
        "good_p50_ms": 1e3 * statistics.median(latencies) if latencies else None,
        "good_p99_ms": 1e3 * _p99(latencies) if latencies else None,
        "good_failures": [r.error for r in good if not r.ok][:5],
        "good_by_workflow": by_workflow,
        "faulty": {kind: dict(c) for kind, c in sorted(faulty.items())},
    }


def _p99(sorted_values: list[float]) -> float:
    return sorted_values[min(len(sorted_values) - 1, int(0.99 * len(sorted_values)))]


async def leftovers(invoker: ProxyInvoker, settle_s: float) -> dict[str, dict[str, int]]:
    """Per proxy: pool bytes allocated, live buffers and their bytes, stored keys (after `settle_s`)."""
    await asyncio.sleep(settle_s)
    await invoker.refresh_stats()
    out = {}
    for name, s in invoker.last_stats().items():
        out[name] = {
            "pool_allocated_bytes": s["pool"]["allocated_bytes"],
            "buffers": s["buffers"],
            "buffer_bytes": s["buffer_bytes"],
            "keys": s["keys"],
            "instances_died": s["instances_died"],
        }
    return out


async def main_async(args: Any) -> dict[str, Any]:
    root = Path(tempfile.mkdtemp(prefix="bench-faults-"))
    (root / "bench_fault_handlers.py").write_text(HANDLERS)
    specs = []
    for name in ("mixed", "clean"):
        (root / f"{name}.yaml").write_text(workflow_yaml(name))
        specs.append(validate_file(root / f"{name}.yaml"))
    invoker = ProxyInvoker(Config.from_env(), keep_alive_s=600.0, stats_period_s=0.5)
    engine = Engine(invoker)
    try:
        t0 = time.perf_counter()
        for spec in specs:
            await engine.deploy(spec)
        arrivals = schedule(args.requests, args.fault_share, args.fuzz, args.seed)
        await run_phase(engine, arrivals, args.rate, with_faults=False)  # warm-up: instances scale up
        print(f"proxies and instances warm in {time.perf_counter() - t0:.1f} s", flush=True)
        base = await leftovers(invoker, 1.0)
        clean_results: list[tuple[str, str, RequestResult]] = []
        fault_results: list[tuple[str, str, RequestResult]] = []
        for _ in range(args.rounds):  # alternating, so that drift in the machine's load hits both
            clean_results += await run_phase(engine, arrivals, args.rate, with_faults=False)
            fault_results += await run_phase(engine, arrivals, args.rate, with_faults=True)
        after = await leftovers(invoker, args.settle)
        return {
            "fault_free": summarize(clean_results),
            "with_faults": summarize(fault_results),
            "after_warmup": base,
            "after_run": after,
            "proxy_starts": invoker.proxy_starts,
        }
    finally:
        await engine.close()


def report(results: dict[str, Any]) -> None:
    rows = []
    for phase in ("fault_free", "with_faults"):
        s = results[phase]
        share = 100.0 * s["good_ok"] / max(1, s["good_total"])
        rows.append(
            [
                phase.replace("_", "-"),
                f"{s['good_ok']} / {s['good_total']} ({share:.1f} %)",
                f"{s['good_p50_ms']:.1f}",
                f"{s['good_p99_ms']:.1f}",
            ]
        )
    p99_ratio = results["with_faults"]["good_p99_ms"] / results["fault_free"]["good_p99_ms"]
    p50_ratio = results["with_faults"]["good_p50_ms"] / results["fault_free"]["good_p50_ms"]
    rows.append(["ratio (faulty / fault-free)", "", f"{p50_ratio:.2f}", f"{p99_ratio:.2f}"])
    for name in ("mixed", "clean"):
        free, faulty = (results[p]["good_by_workflow"].get(name) for p in ("fault_free", "with_faults"))
        if free and faulty:
            cells = [f"{faulty[q]:.1f} / {free[q]:.1f} = {faulty[q] / free[q]:.2f}" for q in QUANTILES]
            rows.append([f"  {name} only: faulty / fault-free", "", *cells])
    print_table("well-behaved requests", ["phase", "ok / total", "p50 ms", "p99 ms"], rows)
    faulty = results["with_faults"]["faulty"]
    print_table(
        "faulty requests (outcome counts)",
        ["kind", "outcomes"],
        [[kind, ", ".join(f"{k}: {v}" for k, v in c.items())] for kind, c in faulty.items()],
    )
    left_rows = []
    for name, end in results["after_run"].items():
        base = results["after_warmup"].get(name, {})
        grown = end["pool_allocated_bytes"] - base.get("pool_allocated_bytes", 0)
        left_rows.append(
            [name, grown, end["buffers"], end["buffer_bytes"], end["keys"], end["instances_died"]]
        )
    print_table(
        "left behind after the run (goal 0)",
        ["proxy", "pool bytes above warm-up", "buffers", "buffer bytes", "keys", "instances died"],
        left_rows,
    )
    print(f"proxy starts: {results['proxy_starts']} (2 = no proxy died)")
    failures = results["with_faults"]["good_failures"]
    if failures:
        print("well-behaved failures (first 5):", *failures, sep="\n  ")


def main() -> int:
    p = parser(__doc__.splitlines()[0])
    p.add_argument("--requests", type=int, default=None, help="arrivals per phase (quick 120, full 600)")
    p.add_argument("--rate", type=float, default=None, help="arrivals per second (quick 30, full 40)")
    p.add_argument("--fault-share", type=float, default=0.25, help="share of arrivals that are faulty")
    p.add_argument("--fuzz", action="store_true", help="also send malformed frames (kills today's proxy)")
    p.add_argument("--rounds", type=int, default=None, help="fault-free/faulty pairs (quick 2, full 3)")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--settle", type=float, default=3.0, help="seconds to wait before counting leftovers")
    args = p.parse_args()
    args.requests = args.requests or (120 if args.quick else 600)
    args.rate = args.rate or (30.0 if args.quick else 40.0)
    args.rounds = args.rounds or (2 if args.quick else 3)
    results = asyncio.run(main_async(args))
    report(results)
    config = {k: v for k, v in vars(args).items() if k != "json"}
    config["json"] = str(args.json) if args.json else None
    write_json(args.json, "bench_faults", config, results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
