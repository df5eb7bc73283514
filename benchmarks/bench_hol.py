"""Head-of-line blocking in the proxy: a 1-kernel call's latency alone, and while two other
instances issue SSDlite's plan (~400 kernels) back to back (synchronising every fourth run), with
plans issued on the dispatcher (`issue_threads=0`, the old way) and by issuer threads sliced into
turns (`api_proxy/issuer.py`, the default). "During an issue" keeps the calls that started while a
big `infer` was in flight (its send to its reply, which comes once the plan is issued; both
processes stamp CLOCK_MONOTONIC), which is where head-of-line blocking can show.

The 1-kernel call is `ctx.launch` of espcn's first kernel followed by `ctx.synchronize()`, timed in
the function: until the launch is answered (the proxy's dispatch alone: where head-of-line blocking
shows) and until the kernel has run (that adds the device, which the big plans' kernels also occupy:
the emulator's CPU in functional mode, its modelled compute units in timed mode). One proxy per
(device mode, issue way); real processes throughout. Goal: during an issue <= 2x alone.

`--quick` takes fewer samples.
"""

from __future__ import annotations

import bisect
import concurrent.futures
import os
import shutil
import sys
import tempfile
import textwrap
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import parser, print_table, write_json  # noqa: E402

from streambox.api_proxy.control import ProxyClient, ProxyProcess, launch_proxy  # noqa: E402
from streambox.api_proxy.proxy_config import ProxyConfig, ProxyFunction  # noqa: E402

BIG, SMALL = "ssdlite320_mobilenet_v3", "espcn"
LOADERS = 2  # instances issuing the big plan at once

HANDLERS = textwrap.dedent(
    """
    import time
    import torch
    import streambox

    @streambox.function(models=["espcn"])
    def small(ctx, event):
        plan = ctx.plan("espcn")
        index, kernel = next((i, k) for i, k in enumerate(plan["kernels"]) if k["kind"] != "view")
        variables = plan["variables"]
        buffers = {
            name: ctx.alloc(shape=variables[name]["shape"], dtype=variables[name]["dtype"])
            for name in kernel["accesses"] if variables[name]["kind"] != "weight"
        }
        samples, replies, starts = [], [], []
        for i in range(event["warmup"] + event["n"]):
            t = time.perf_counter()  # CLOCK_MONOTONIC: comparable with the other process's marks
            ctx.launch("espcn", index, buffers).result()
            issued = time.perf_counter()
            ctx.synchronize()
            if i >= event["warmup"]:
                samples.append(time.perf_counter() - t)
                replies.append(issued - t)
                starts.append(t)
            time.sleep(event["gap_s"])
        return {"samples": samples, "replies": replies, "starts": starts}

    @streambox.function(models=["ssdlite320_mobilenet_v3"])
    def big(ctx, event):
        x = ctx.upload(torch.randn(1, 3, 64, 64))
        runs, t, issues = 0, time.perf_counter(), []
        while time.perf_counter() - t < event["seconds"]:
            begun = time.perf_counter()
            outputs = ctx.infer("ssdlite320_mobilenet_v3", x)  # answered once the plan is issued
            issues.append((begun, time.perf_counter()))
            for out in outputs:
                ctx.free(out)
            runs += 1
            if runs % event["sync_every"] == 0:  # the stream's queue stays short
                ctx.synchronize()
        return {"runs": runs, "seconds": time.perf_counter() - t, "issues": issues}
    """
)


def pct(samples: list[float], q: float) -> float:
    s = sorted(samples)
    return s[min(len(s) - 1, int(q * len(s)))]


def measure(proxy: ProxyProcess, n: int) -> dict[str, Any]:
    """The small call's samples alone, then while `big` issues SSDlite back to back."""
    client = proxy.client
    event = {"n": n, "warmup": 20, "gap_s": 0.005}
    client.invoke("big", {"seconds": 0.5, "sync_every": 2}, request_id="warm-big")  # weights, bindings
    alone = client.invoke("small", event, request_id="alone")["output"]
    seconds = 3.0 + n * 0.01  # long enough to cover every sample of the small call
    others = [ProxyClient(proxy.address) for _ in range(LOADERS)]  # the invocations overlap
    busy = {"seconds": seconds, "sync_every": 4}
    with concurrent.futures.ThreadPoolExecutor(LOADERS) as pool:
        loads = [pool.submit(c.invoke, "big", busy, request_id=f"load{i}") for i, c in enumerate(others)]
        time.sleep(1.0)  # both big instances started and issuing
        loaded = client.invoke("small", event, request_id="loaded")["output"]
        big = [f.result()["output"] for f in loads]
    for c in others:
        c.close()
    runs = sum(b["runs"] / b["seconds"] for b in big)
    issues = sorted(tuple(i) for b in big for i in b["issues"])
    loaded["during"] = [_during(t, issues) for t in loaded["starts"]]
    return {
        "alone": alone,
        "loaded": loaded,
        "big_runs_per_s": runs,
        "big_infer_s": [b - a for a, b in issues],
        "big_infers": issues,
    }


def _during(t: float, issues: list[tuple[float, float]]) -> bool:
    """Whether a call that started at `t` started while a big plan's infer was in flight."""
    return any(a <= t < b for a, b in issues[: bisect.bisect_right(issues, (t, float("inf")))])


def main() -> int:
    args = parser(__doc__.splitlines()[0]).parse_args()
    n = 100 if args.quick else 400
    work = Path(tempfile.mkdtemp(prefix="sbx-bench-hol-"))
    (work / "bench_hol_handlers.py").write_text(HANDLERS)
    functions = (
        ProxyFunction("small", "bench_hol_handlers:small", models=(SMALL,)),
        ProxyFunction("big", "bench_hol_handlers:big", models=(BIG,), max_instances=LOADERS),
    )
    load = os.getloadavg()
    print(f"machine: {os.cpu_count()} cores, load average {load[0]:.2f}")
    results: dict[str, Any] = {"load_average": load, "runs": {}}
    try:
        for mode in ("functional", "timed"):
            for threads, way in ((0, "on the dispatcher (before)"), (2, "issuer threads, sliced (after)")):
                config = ProxyConfig(
                    workflow=f"bench-hol-{mode[0]}{threads}",
                    functions=functions,
                    sys_path=(str(work),),
                    state_dir=os.environ.get("STREAMBOX_STATE_DIR"),
                    device_mode=mode,
                    model_shapes="small",
                    issue_threads=threads,
                    prefork=2,
                )
                started = time.perf_counter()
                proxy = launch_proxy(config)
                print(f"proxy {mode}, {way}: warm in {time.perf_counter() - started:.1f} s", flush=True)
                try:
                    results["runs"][f"{mode}/{threads}"] = {"mode": mode, "way": way, **measure(proxy, n)}
                finally:
                    proxy.stop()
    finally:
        shutil.rmtree(work, ignore_errors=True)

    rows = []
    for run in results["runs"].values():
        during_mask = run["loaded"]["during"]
        for part, label in (("replies", "launch replied"), ("samples", "launch + synchronize")):
            alone = run["alone"][part]
            during = [x for x, d in zip(run["loaded"][part], during_mask, strict=True) if d] or [float("nan")]
            rows.append(
                [
                    run["mode"],
                    run["way"],
                    label,
                    f"{pct(alone, 0.5) * 1e6:,.0f}",
                    f"{pct(run['loaded'][part], 0.5) * 1e6:,.0f}",
                    f"{pct(during, 0.5) * 1e6:,.0f}",
                    f"{pct(during, 0.9) * 1e6:,.0f}",
                    sum(during_mask),
                    f"{pct(during, 0.5) / pct(alone, 0.5):.2f}x",
                    f"{pct(run['big_infer_s'], 0.5) * 1e3:,.1f}",
                    f"{run['big_runs_per_s']:.1f}",
                ]
            )
    print_table(
        f"A 1-kernel call alone, and while {LOADERS} instances issue {BIG} (us; goal: <= 2x alone)",
        [
            *("device mode", "plans issued", "call", "alone p50", "loaded p50"),
            *("during an issue p50", "p90", "n", "during/alone p50"),
            *(f"{BIG} infer ms p50", "runs/s"),
        ],
        rows,
    )
    write_json(args.json, "bench_hol", {"quick": args.quick, "samples": n}, results)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
