"""End-to-end Traffic latency at 1, 4 and 16 concurrent requests: proxy completion by event polling
vs stream sync. Emulated GPU, real API proxies, requests through the real HTTP gateway.

Two deployments of the bundled Traffic workflow run side by side, each on its own API proxy: one
with `completion=poll` (the proxy records an event after a call's last kernel and polls it), one
with `completion=sync` (a blocking stream synchronize on a worker thread). Each is warmed up by a
burst of 4 concurrent requests (Traffic fans out to 2 face + 2 car recognitions per request at the
burst's default sizes, so every function instance the workflow allows is started then), then each
concurrency level sends the same number of requests with at most that many outstanding; the two
modes alternate which goes first from level to level. Latency is the client's, HTTP included.

The models are the workflow's own (SSDlite320, ResNet-50, VGG-16) at the small input sizes
(`examples.SMALL_PARAMS`: 64 px detection, 32 px crops, at most 2 people + 2 vehicles per request);
`--full-size` uses the YAML's sizes. `--quick`: 16 requests per level (a few minutes on 2 loaded cores).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import parser, print_table, write_json  # noqa: E402

from streambox.config import Config  # noqa: E402
from streambox.workflows.burst import BurstReport, Deployment, default_events, prepare  # noqa: E402
from streambox.workflows.spec import WorkflowSpec  # noqa: E402

LEVELS = (1, 4, 16)
MODES = ("poll", "sync")
WARMUP = 4  # requests, all at once: starts every instance the workflow allows (see the docstring)


def _ratio(a: float | None, b: float | None) -> str:
    return f"{a / b:.2f}" if a and b else "-"


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:,.0f}"


async def measure(
    spec: WorkflowSpec, requests: int, config: Config, system: str
) -> tuple[dict[int, dict[str, BurstReport]], dict[str, float]]:
    events = default_events(spec, requests)
    reports: dict[int, dict[str, BurstReport]] = {level: {} for level in LEVELS}
    deploy_s: dict[str, float] = {}
    async with contextlib.AsyncExitStack() as stack:
        deployments: dict[str, Deployment] = {}
        for mode in MODES:
            options = {"completion": mode}
            deployment = Deployment(spec, system=system, config=config, proxy_options=options)
            deployments[mode] = await stack.enter_async_context(deployment)
            deploy_s[mode] = deployment.deploy_s
            warm = await deployment.burst(events[:WARMUP], concurrency=WARMUP)
            print(
                f"{mode}: proxy warm in {deployment.deploy_s:.1f} s; warm-up {warm.ok}/{WARMUP} ok, "
                f"{warm.instance_starts} instance starts",
                flush=True,
            )
        for i, level in enumerate(LEVELS):
            for mode in MODES if i % 2 == 0 else MODES[::-1]:
                report = await deployments[mode].burst(events, concurrency=level)
                reports[level][mode] = report
                lat = report.latency_ms()
                print(
                    f"  concurrency {level:>2} {mode}: {report.ok}/{len(report.outcomes)} ok, "
                    f"p50 {_ms(lat['p50'])} ms, {report.instance_starts} instance starts",
                    flush=True,
                )
    return reports, deploy_s


def main() -> int:
    p = parser(__doc__.splitlines()[0])
    p.add_argument(
        "--requests", type=int, help="requests per level and mode (default 16 quick, 48 full; at least 16)"
    )
    p.add_argument("--system", default="streambox", help="streambox (default) or stream-only")
    p.add_argument("--full-size", action="store_true", help="the YAML's input sizes (slow on a CPU)")
    args = p.parse_args()
    requests = args.requests or (16 if args.quick else 48)
    spec, _ = prepare("traffic", requests=1, inputs="full" if args.full_size else "small")
    load = os.getloadavg()
    print(f"machine: {os.cpu_count()} cores, load average {load[0]:.2f}; {requests} requests per level")
    with tempfile.TemporaryDirectory(prefix="sbx-bench-traffic-") as state:
        config = Config.from_env().with_overrides(state_dir=Path(state))  # this run's device memory only
        reports, deploy_s = asyncio.run(measure(spec, requests, config, args.system))

    rows, results = [], []
    for level in LEVELS:
        poll, sync = reports[level]["poll"], reports[level]["sync"]
        lp, ls = poll.latency_ms(), sync.latency_ms()
        rows.append(
            (
                level,
                f"{poll.ok}/{sync.ok} of {requests}",
                _ms(lp["p50"]),
                _ms(lp["p90"]),
                _ms(ls["p50"]),
                _ms(ls["p90"]),
                _ratio(lp["p50"], ls["p50"]),
                _ratio(lp["mean"], ls["mean"]),
                f"{len(poll.outcomes) / poll.wall_s:.2f} / {len(sync.outcomes) / sync.wall_s:.2f}",
                f"{poll.instance_starts} / {sync.instance_starts}",
            )
        )
        results.append({"concurrency": level, "poll": poll.to_json(), "sync": sync.to_json()})
    print_table(
        f"Traffic end to end via the gateway ({args.system}, emulated GPU): latency ms, event polling vs "
        "stream sync",
        (
            "concurrency",
            "ok poll/sync",
            "poll p50",
            "poll p90",
            "sync p50",
            "sync p90",
            "poll/sync p50",
            "poll/sync mean",
            "req/s poll / sync",
            "instance starts",
        ),
        rows,
    )
    memory = reports[LEVELS[-1]]["poll"].peak_memory
    print(
        f"per proxy: pool reserved {memory.pool_reserved_bytes / (1 << 20):,.0f} MiB (peak); "
        f"deploy {deploy_s['poll']:.1f} s (poll), {deploy_s['sync']:.1f} s (sync)"
    )
    config = {
        "requests_per_level": requests,
        "levels": LEVELS,
        "warmup": WARMUP,
        "system": args.system,
        "params": reports[LEVELS[0]]["poll"].params,
        "load_average": load,
    }
    write_json(args.json, "bench_traffic", config, results)
    failed = sum(r.failed for level in reports.values() for r in level.values())
    return 0 if failed == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
