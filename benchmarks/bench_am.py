"""Adaptive movement (AM) on a node of four GPUs, through a real proxy: AM on vs off in one run.

The paper's Fig. 16 right (AM cuts communication overhead by 72%): when the proxy's GPU comes under
pressure, AM moves intermediate data to the least-pressured neighbour GPU (NVLink) instead of host
memory (PCIe), so the GET that follows is a peer copy instead of a host-to-device copy.

Per round, on an emulated node of 4 V100s in timed mode (copies take their modelled link time:
peer 48 GB/s per GPU pair, pageable host 6 GB/s, `streambox.device.specs`): a proxy on GPU 0 runs `produce`,
which PUTs K items; another job (as the paper runs a video task to raise memory pressure) then
takes GPU 0's free memory and most of GPU 1's; the store's pressure awareness moves data off GPU 0
(AM: to a neighbour GPU by rule 2, least pressured; off: to host); `consume` GETs every item and
times each GET as the function sees it (the call to the proxy and the copy back). The job then
releases its memory. A first round warms each proxy up (first allocations on each GPU) and is not
timed; the store's counters (moves by destination, GETs by transport) include it. Two proxies (AM
on, AM off) run the same rounds in turn, in the same run.

Measured: each GET as the function saw it (mean and median; on a loaded shared machine the host's
share is noisy). Modelled: the timed rounds' transfers from the store's counters (moves off GPU 0 by
destination, GETs' copies by source) priced with the V100 link model (peer 48 GB/s; pageable host
6 GB/s; device/specs.py cites both): the link time AM saves, free of host noise.

    .venv/bin/python benchmarks/bench_am.py [--quick] [--rounds N] [--items K] [--item-mib S] [--json PATH]
"""

from __future__ import annotations

import statistics
import sys
import tempfile
import textwrap
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import parser, print_table, write_json  # noqa: E402
from other_job import OtherJob  # noqa: E402

from streambox.api_proxy.control import ProxyProcess, launch_proxy  # noqa: E402
from streambox.api_proxy.proxy_config import ProxyConfig, ProxyFunction  # noqa: E402
from streambox.device.specs import V100_16GB, LinkModel, MiB  # noqa: E402

GPUS = 4
WORKFLOW = "ambench"
HANDLERS = textwrap.dedent(
    f"""
    import time
    import torch
    import streambox

    @streambox.function()
    def produce(ctx, event):
        for i in range(event["items"]):
            x = ctx.upload(torch.zeros(event["nbytes"] // 4, dtype=torch.int32))
            ctx.put(f"{WORKFLOW}/item{{i}}", x, consumers=1)
        return {{}}

    @streambox.function()
    def consume(ctx, event):
        seconds = []
        for i in range(event["items"]):
            started = time.perf_counter()
            ctx.get(f"{WORKFLOW}/item{{i}}")
            seconds.append(time.perf_counter() - started)
        return {{"get_s": seconds}}
    """
)
#: What the other job leaves free on each GPU while it runs (GPU 0 full: the pressure; GPU 1 nearly
#: full, GPU 2 half: rule 2 picks the least-pressured neighbour). It takes them in this order: GPU 0
#: last, so that the store's first moves already see the neighbours' pressure.
LEAVE = {1: 32 * MiB, 2: 8 << 30, 0: 0}


def _settle(proxy: ProxyProcess, moved_before: int, timeout_s: float = 10.0) -> dict[str, Any]:
    """The store's stats once moves have started and then stopped for 0.2 s."""
    deadline = time.monotonic() + timeout_s
    last, since = -1, time.monotonic()
    while time.monotonic() < deadline:
        store = proxy.client.stats()["store"]
        moved = sum(row["count"] for row in store["moved_to"].values())
        if moved != last:
            last, since = moved, time.monotonic()
        elif moved > moved_before and time.monotonic() - since > 0.2:
            return store
        time.sleep(0.02)
    return proxy.client.stats()["store"]


def run_setting(root: Path, am: bool, rounds: int, items: int, nbytes: int, job: OtherJob) -> dict[str, Any]:
    config = ProxyConfig(
        workflow=WORKFLOW, functions=(ProxyFunction("produce", "am_handlers:produce"),
                                      ProxyFunction("consume", "am_handlers:consume")),
        sys_path=(str(root),), state_dir=str(root / "state"), prefork=0, gpus=GPUS, device=0,
        device_mode="timed", am=am,
    )
    proxy = launch_proxy(config)
    gets: list[float] = []
    try:
        event = {"items": items, "nbytes": nbytes}
        for round_ in range(rounds + 1):  # round 0 warms up (first allocations on each GPU): not timed
            if round_ == 1:
                warmed = proxy.client.stats()["store"]
            proxy.client.invoke("produce", event)
            before = proxy.client.stats()["store"]
            moved_before = sum(row["count"] for row in before["moved_to"].values())
            job.grow()
            try:
                _settle(proxy, moved_before)
                seconds = proxy.client.invoke("consume", event)["output"]["get_s"]
                gets += seconds if round_ else []
            finally:
                job.release()
        store = proxy.client.stats()["store"]
    finally:
        proxy.stop()
    return {"am": am, "get_s": gets, "store": store, "timed": _since(store, warmed)}


def _since(store: dict[str, Any], base: dict[str, Any]) -> dict[str, Any]:
    """The store's transfer counters over the timed rounds: `store` less `base` (after the warm-up)."""
    out: dict[str, Any] = {"gets": {k: v - base["gets"].get(k, 0) for k, v in store["gets"].items()}}
    for table in ("moved_to", "copied_from"):
        rows = {}
        for where, row in store[table].items():
            was = base[table].get(where, {"count": 0, "bytes": 0})
            if row["count"] > was["count"]:
                rows[where] = {"count": row["count"] - was["count"], "bytes": row["bytes"] - was["bytes"]}
        out[table] = rows
    return out


def modelled_seconds(timed: dict[str, Any], link: LinkModel) -> float:
    """The link time of the timed rounds' transfers, priced with the link model (modelled): moves off
    the GPU (peer to a GPU; device-to-host, pageable, to host) and GETs' copies back."""
    total = 0.0
    for table in ("moved_to", "copied_from"):
        for where, row in timed[table].items():
            if where == "host":
                total += row["count"] * link.latency_s + row["bytes"] / link.pageable_bandwidth
            else:
                total += row["count"] * link.peer_latency_s + row["bytes"] / link.peer_bandwidth
    return total


def main() -> None:
    p = parser(__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--items", type=int, default=6)
    p.add_argument("--item-mib", type=int, default=16)
    args = p.parse_args()
    rounds = 2 if args.quick else args.rounds
    nbytes = args.item_mib * MiB
    with tempfile.TemporaryDirectory(prefix="bench-am-") as tmp:
        root = Path(tmp)
        (root / "am_handlers.py").write_text(HANDLERS)
        job = OtherJob(root / "state", GPUS, LEAVE)
        try:
            results = [run_setting(root, am, rounds, args.items, nbytes, job) for am in (True, False)]
        finally:
            job.close()
    on, off = results
    link = V100_16GB.link
    for r in results:
        r["modelled_s"] = modelled_seconds(r["timed"], link)
    rows = []
    for r in results:
        t = r["timed"]
        moved = ", ".join(
            f"{k}: {v['count']} ({v['bytes'] / MiB:.0f} MiB)" for k, v in sorted(t["moved_to"].items())
        )
        gets = t["gets"]
        rows.append([
            "AM on" if r["am"] else "AM off (host)",
            f"{statistics.mean(r['get_s']) * 1e3:.3f}",
            f"{statistics.median(r['get_s']) * 1e3:.3f}",
            f"{statistics.median(r['get_s']) / statistics.median(off['get_s']):.3f}x",
            f"{r['modelled_s'] / rounds * 1e3:.2f}",
            f"{r['modelled_s'] / off['modelled_s']:.3f}x",
            f"{gets['same-gpu']}/{gets['peer-copy']}/{gets['host-to-device']}",
            moved or "-",
        ])
    print_table(
        f"Under pressure on GPU 0 of {GPUS} emulated V100s, timed: {rounds} rounds x {args.items} x "
        f"{args.item_mib} MiB, AM on and off in the same run (counters: the timed rounds)",
        ["setting", "mean GET ms", "median GET ms", "median vs AM off", "modelled link ms/round",
         "modelled vs AM off", "same/peer/host GETs", "moved to"],
        rows,
    )
    median = statistics.median(on["get_s"]) / statistics.median(off["get_s"])
    modelled = on["modelled_s"] / off["modelled_s"]
    print(
        f"AM: median GET {100 * (median - 1):+.0f}% (measured, function-side); moves + GET copies "
        f"{100 * (modelled - 1):+.0f}% (modelled: these transfers priced with the V100 link model, "
        "device/specs.py); paper Fig. 16 right: -72%"
    )
    write_json(args.json, "bench_am", {"rounds": rounds, "items": args.items, "item_mib": args.item_mib,
                                       "gpus": GPUS, "leave": LEAVE}, results)


if __name__ == "__main__":
    main()
