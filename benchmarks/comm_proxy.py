"""PUT+GET through a real proxy: StreamBox's managed store vs stream-only's CUDA-IPC style store.

Two proxies of the same workflow, timed emulated V100 (phantom data, modelled copies), alike in every
setting but `comm_store` (`managed` | `ipc`; both with a static pool so that the producer's own buffer
comes from the pool's reserve in both, under pressure too). A handler allocates `n` bytes, PUTs them
and synchronizes (put); a second invocation of the same request GETs them and synchronizes (get). Each
side times its calls in the function process: the forwarding channel, the proxy's op and the device
work are all in the figure.

- free: nothing else on the GPU.
- pressure: another process's runtime holds all but half the item's size of the GPU while the PUT
  runs, and lets go before the GET (a competitor at its peak, as part 2 of bench_comm.py): the IPC
  store finds no room for its copy and spills it to host memory; the managed store adopts the
  producer's buffer, and with PA moves it out when its predicted idle memory shrinks.

The IPC store's driver calls are modelled (`comm.ipc_store.IpcCosts`: export/open/close from
`CudaIpcModel`, assumed; cudaMalloc/cudaFree 50 us, an order of magnitude from a published
measurement); the per-transfer sum is printed beside the measured times.

    .venv/bin/python benchmarks/comm_proxy.py [--quick]
"""

from __future__ import annotations

import statistics
import sys
import tempfile
import textwrap
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import parser, print_table  # noqa: E402

from streambox.api_proxy.control import ProxyProcess, launch_proxy  # noqa: E402
from streambox.api_proxy.proxy_config import ProxyConfig, ProxyFunction  # noqa: E402
from streambox.comm.ipc_store import IpcCosts  # noqa: E402
from streambox.device.emulated import EmulatedBackend  # noqa: E402
from streambox.device.specs import V100_16GB  # noqa: E402

MB = 1_000_000
SIZES_MB = (1, 16, 125)
STORES = ("managed", "ipc")

HANDLERS = textwrap.dedent(
    """
    import time
    import streambox

    @streambox.function
    def put(ctx, event):
        h = ctx.alloc(event["n"])
        ctx.synchronize()
        started = time.perf_counter()
        ctx.put(ctx.key("x"), h, consumers=1).result()
        ctx.synchronize()  # the store's copy, if it makes one, issued on this function's stream
        return time.perf_counter() - started

    @streambox.function
    def get(ctx, event):
        started = time.perf_counter()
        ctx.get(ctx.key("x"))
        ctx.synchronize()  # a copy to this GPU, if the data is elsewhere
        return time.perf_counter() - started
    """
)


@contextmanager
def _proxies(root: Path) -> Iterator[dict[str, ProxyProcess]]:
    (root / "comm_proxy_handlers.py").write_text(HANDLERS)
    functions = tuple(ProxyFunction(n, f"comm_proxy_handlers:{n}") for n in ("put", "get"))
    started: dict[str, ProxyProcess] = {}
    try:
        for kind in STORES:
            started[kind] = launch_proxy(ProxyConfig(
                workflow=f"comm-{kind}", functions=functions, sys_path=(str(root),),
                state_dir=str(root / "state"), device_mode="timed", pool_mode="static", comm_store=kind,
            ))
        yield started
    finally:
        for proxy in started.values():
            proxy.stop()


def _transfer(proxy: ProxyProcess, request: str, n: int, filler: Any | None) -> tuple[float, float]:
    """One PUT (with the GPU full but for n/2 bytes when `filler` is given) then one GET."""
    client = proxy.client
    held = None
    if filler is not None:
        held = filler.mem_alloc(max(1, filler.memory_info()[0] - n // 2))
    try:
        put_s = client.invoke("put", {"n": n}, request_id=request)["output"]
    finally:
        if held is not None:
            filler.mem_free(held)
    get_s = client.invoke("get", {}, request_id=request)["output"]
    client.end_request(request)
    return put_s, get_s


def _store_delta(before: dict[str, Any], after: dict[str, Any]) -> dict[str, Any]:
    gets = {t: after["gets"][t] - before["gets"].get(t, 0) for t in after["gets"]}
    def grew(name: str) -> int:
        return after.get(name, 0) - before.get(name, 0)

    gets = {t: c for t, c in gets.items() if c}
    return {"gets": gets, "spills": grew("spills"), "moved": grew("bytes_moved")}


def measure(repeats: int, sizes_mb: tuple[int, ...] = SIZES_MB) -> list[dict[str, Any]]:
    rows = []
    with tempfile.TemporaryDirectory(prefix="sbx-comm-proxy-") as tmp, _proxies(Path(tmp)) as proxies:
        backend = EmulatedBackend(state_dir=Path(tmp) / "state", mode="timed")
        filler = backend.open_runtime(0)
        try:
            for size in sizes_mb:
                n = size * MB
                for condition in ("free", "pressure"):
                    for kind in STORES:
                        proxy = proxies[kind]
                        tag = f"{size}-{condition}"  # an ended request's keys stay dropped: ids are new
                        _transfer(proxy, f"warm-{tag}", n, None)  # the pool's reserve covers n from now on
                        before = proxy.client.stats()["store"]
                        samples = [
                            _transfer(proxy, f"{tag}-{i}", n, filler if condition == "pressure" else None)
                            for i in range(repeats)
                        ]
                        after = proxy.client.stats()["store"]
                        put_s = statistics.median(p for p, _ in samples)
                        get_s = statistics.median(g for _, g in samples)
                        total = statistics.median(p + g for p, g in samples)
                        rows.append({"size_mb": size, "condition": condition, "store": kind, "put_s": put_s,
                                     "get_s": get_s, "put_get_s": total, **_store_delta(before, after)})
        finally:
            filler.close()
            backend.close()
    return rows


def modelled_ipc_extra(n: int, condition: str) -> float:
    """What the IPC store adds to a transfer by the models (seconds): its driver calls and copies.
    Free GPU: cudaMalloc + export + open + close + cudaFree, and a device-to-device copy. Full GPU:
    a failed cudaMalloc, export, the device-to-host and host-to-device pageable copies, the reader's
    cudaMalloc and cudaFree (no handle is opened for host data)."""
    costs, link = IpcCosts(), V100_16GB.link
    if condition == "free":
        host = costs.malloc_s + costs.ipc.export_s + costs.ipc.open_s + costs.ipc.close_s + costs.free_s
        return host + n / link.device_bandwidth
    return 2 * costs.malloc_s + costs.ipc.export_s + costs.free_s + 2 * link.copy_seconds(n, pinned=False)


def print_rows(rows: list[dict[str, Any]], repeats: int) -> None:
    def ms(s: float) -> str:
        return f"{s * 1e3:.2f}"

    table = []
    for row in rows:
        if row["store"] != "ipc":
            continue
        base = next(r for r in rows if r["store"] == "managed" and r["size_mb"] == row["size_mb"]
                    and r["condition"] == row["condition"])
        for r in (base, row):
            table.append([f"{r['size_mb']} MB", r["condition"], r["store"], ms(r["put_s"]), ms(r["get_s"]),
                          ms(r["put_get_s"]), f"{r['put_get_s'] / base['put_get_s']:.2f}x",
                          ",".join(f"{t}:{c}" for t, c in r["gets"].items()), r["spills"],
                          ms(modelled_ipc_extra(r["size_mb"] * MB, r["condition"])) if r is row else "-"])
    costs = IpcCosts()
    modelled = costs.malloc_s + costs.ipc.export_s + costs.ipc.open_s + costs.ipc.close_s + costs.free_s
    print_table(
        f"PUT+GET through the proxy, median of {repeats} (ms, measured; timed emulated V100)",
        ["size", "GPU", "store", "put", "get", "put+get", "vs managed", "GETs by transport", "spills",
         "ipc extra, modelled"],
        table,
    )
    print(f"IPC store's modelled host calls per transfer: {modelled * 1e6:.0f} us ({costs.label})")
    for size in sorted({r["size_mb"] for r in rows}):
        for condition in ("free", "pressure"):
            m, i = (next(r for r in rows if r["size_mb"] == size and r["condition"] == condition
                         and r["store"] == k) for k in STORES)
            print(f"{size} MB, {condition}: managed is {100 * (1 - m['put_get_s'] / i['put_get_s']):.0f}% "
                  f"lower than ipc (paper: StreamBox's communication 73% lower than stream-only's)")


def main() -> int:
    p = parser(__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=None)
    args = p.parse_args()
    repeats = args.repeats or (3 if args.quick else 10)
    print_rows(measure(repeats), repeats)
    return 0


if __name__ == "__main__":
    sys.exit(main())
