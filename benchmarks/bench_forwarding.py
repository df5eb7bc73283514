"""API forwarding against concurrency (the paper's Fig. 18(a)): N function instances of one warm proxy
each time forwarded no-op calls (function process -> proxy dispatcher -> back, the shared-memory
channel) at the same time, N from 1 up to 48 (the paper's maximum: CUDA MPS's 48 clients per GPU).

Each instance times its own calls (bench_proxy.py's `pingpong`); the table gives, per N, the median of
the instances' p50s, the largest of their p99s, and the p50's ratio to N = 1 measured in the same run.
Every instance is a process and the dispatcher is one more, so where N exceeds the host's cores the
calls also wait for a core: the machine line says how many there are.
"""

from __future__ import annotations

import concurrent.futures
import os
import shutil
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import parser, print_table, write_json  # noqa: E402
from bench_proxy import HANDLERS  # noqa: E402  (its `pingpong` times forwarded no-ops in the function)

from streambox.api_proxy.control import ProxyClient, ProxyProcess, launch_proxy  # noqa: E402
from streambox.api_proxy.proxy_config import ProxyConfig, ProxyFunction  # noqa: E402


def concurrent_noops(proxy: ProxyProcess, concurrency: int, count: int, warmup: int) -> dict[str, float]:
    """`concurrency` instances of `pingpong` at once (one client each), `count` timed calls apiece: the
    median of the instances' p50s and the largest of their p99s."""
    clients = [proxy.client] + [ProxyClient(proxy.address) for _ in range(concurrency - 1)]
    event = {"n": count, "warmup": warmup}
    try:
        with concurrent.futures.ThreadPoolExecutor(concurrency) as pool:
            replies = list(
                pool.map(lambda c: c.invoke("pingpong", event, request_id=f"c{concurrency}"), clients)
            )
    finally:
        for client in clients[1:]:
            client.close()
    outputs = [reply["output"] for reply in replies]
    return {
        "p50_s": statistics.median(o["p50"] for o in outputs),
        "p99_s": max(o["p99"] for o in outputs),
        "n": sum(o["n"] for o in outputs),
    }


def main() -> int:
    p = parser(__doc__.splitlines()[0])
    p.add_argument(
        "--levels",
        default="1,4,8,16,32,48",
        help="instances at once, comma-separated, starting at 1 (default 1,4,8,16,32,48)",
    )
    args = p.parse_args()
    levels = tuple(int(n) for n in args.levels.split(","))
    if levels[0] != 1 or min(levels) < 1:
        p.error(f"--levels {args.levels}: the first must be 1 (the baseline) and every level at least 1")
    count, warmup = (200, 100) if args.quick else (1000, 300)
    work = Path(tempfile.mkdtemp(prefix="sbx-bench-forwarding-"))
    (work / "bench_proxy_handlers.py").write_text(HANDLERS)
    config = ProxyConfig(
        workflow="bench-forwarding",
        functions=(ProxyFunction("pingpong", "bench_proxy_handlers:pingpong", max_instances=max(levels)),),
        sys_path=(str(work),),
        state_dir=str(work / "state"),
        channel="shm",
        keep_alive_s=60.0,  # instances stay warm between levels: the calls, not the starts, are timed
    )
    load = os.getloadavg()
    print(f"machine: {os.cpu_count()} cores, load average {load[0]:.2f}", flush=True)
    results: dict[str, Any] = {"cores": os.cpu_count(), "load_average": load, "levels": {}}
    proxy = launch_proxy(config)
    try:
        for level in levels:
            results["levels"][str(level)] = concurrent_noops(proxy, level, count, warmup)
            print(f"{level} at once: p50 {results['levels'][str(level)]['p50_s'] * 1e6:.1f} us", flush=True)
    finally:
        proxy.stop()
        shutil.rmtree(work, ignore_errors=True)
    base = results["levels"]["1"]["p50_s"]
    for row in results["levels"].values():
        row["p50_vs_one"] = row["p50_s"] / base
    results["max_level"] = str(max(levels))
    print_table(
        "Forwarded no-op round trip against concurrent instances (us); ratio = p50 / p50 at 1",
        ["instances at once", "p50", "p99", "n", "p50 vs 1"],
        [
            [level, f"{r['p50_s'] * 1e6:,.1f}", f"{r['p99_s'] * 1e6:,.1f}", r["n"], f"{r['p50_vs_one']:.2f}x"]
            for level, r in results["levels"].items()
        ],
    )
    print(f"machine: {os.cpu_count()} cores, load average after {os.getloadavg()[0]:.2f}")
    write_json(
        args.json, "bench_forwarding", {"quick": args.quick, "channel": "shm", "levels": levels}, results
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
