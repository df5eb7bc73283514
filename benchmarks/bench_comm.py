"""PUT/GET between functions: the StreamBox store vs Func-IPC (real Redis) vs CUDA-IPC style, and the
elastic store's pressure awareness (PA) and adaptive movement (AM) under a competing function.

Part 1 (paper Fig. 16 left, section 9.2): GET latency for 1, 16 and 125 MB on an emulated node of two
V100s. Same GPU: the store hands over the address. Other GPU: a peer copy. Func-IPC: the producer
copies GPU -> host and SETs into a real redis-server; the consumer GETs and copies host -> GPU.
CUDA-IPC style: export + open + close of an IPC handle per transfer, *modelled* (see
`streambox.comm.baselines.CudaIpcModel`). Device copies follow the emulated link model (V100: PCIe
12 GB/s pinned, 6 GB/s pageable; NVLink 150 GB/s); Redis, the Python store and host copies are real.

Part 1b (Table 2's communication row, paper Fig. 16 left): a PUT and its GET through each system's
own code, producer and consumer on one emulated V100 in timed mode (copies and kernels take their
modelled time; Python, the stores, Redis, the handle registry are real): StreamBox's store (same
GPU: the address is handed over), Astraea's `IpcHandleStore` (the producer keeps the tensor; the
consumer, another runtime, opens the handle and copies device-to-device; export/open/close are
`CudaIpcModel`'s modelled constants), INFless's `RedisStore` (GPU -> host -> Redis -> host -> GPU,
the Lua scripts of the instances). Ratios are StreamBox's time over each baseline's, same run.

Part 2 (paper Fig. 16 right): per round, a producer PUTs K items on GPU 0; a competing function on
GPU 0 then grows layer by layer to fill the GPU and releases; the consumer GETs the items on GPU 0.
Communication overhead = PUT + GET time + the competitor's stall while the store gives memory back
(without PA that happens on its allocation path, after an OOM). PA predicts the competitor's demand
over the next 20 ms window (the same step schedule the competitor follows, as the memory pool's demand
model would from profiles) and moves data out ahead of it; AM sends it to the other GPU instead of
host memory. The Func-IPC row passes the same items through Redis.

Part 3 (Table 2's stream-only column, paper Fig. 16 left: "by 73% compared to Stream-only"): a PUT
and its GET through two real proxies that differ only in their store, StreamBox's managed store and
stream-only's CUDA-IPC style store, with the GPU free and with another process holding all but half
the item's size during the PUT (benchmarks/comm_proxy.py; `proxy_stores` in the JSON).
"""

from __future__ import annotations

import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import parser, print_table, write_json  # noqa: E402

from streambox.api_proxy.device_tensor import DeviceTensor, upload_tensor  # noqa: E402
from streambox.api_proxy.executor import StreamPoolAllocator  # noqa: E402
from streambox.comm import CommStore, StoreConfig  # noqa: E402
from streambox.comm.baselines import CudaIpcModel, FuncIpc, RedisServer, RedisUnavailable  # noqa: E402
from streambox.device import OutOfDeviceMemory  # noqa: E402
from streambox.device.emulated import EmulatedBackend  # noqa: E402
from streambox.device.specs import V100_16GB, MiB  # noqa: E402
from streambox.workflows.monolithic_instance import RedisStore  # noqa: E402
from streambox.workflows.monolithic_ipc import HandleRegistry, IpcHandleStore  # noqa: E402

MB = 1_000_000
SIZES_MB = (1, 16, 125)
EMULATED = "emulated V100 node"


def _us(seconds: float) -> str:
    return f"{seconds * 1e6:.1f}"


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.2f}"


def _ratio(r: float) -> str:
    """Two significant digits, however small (a 5 us GET against a 2 s one is 2.5e-06x)."""
    return f"{r:.2g}x"


def _median(samples: list[float]) -> float:
    return statistics.median(samples)


def _timed(fn, repeats: int, after=None) -> float:
    """Median seconds of `fn()`; `after(result)` runs untimed after each call (frees, releases)."""
    samples = []
    for _ in range(repeats + 1):  # the first call warms caches and is dropped
        started = time.perf_counter()
        result = fn()
        samples.append(time.perf_counter() - started)
        if after is not None:
            after(result)
    return _median(samples[1:])


# -- part 1: GET latency ------------------------------------------------------------------------
def latency(redis: RedisServer | None, repeats: int, ipc_repeats: int) -> list[dict]:
    spec = V100_16GB.with_overrides(context_create_s=0.0, context_memory=0)
    model = CudaIpcModel()
    results = []
    with tempfile.TemporaryDirectory() as state:
        backend = EmulatedBackend(spec=spec, count=2, state_dir=Path(state), timeline=False)
        rts = {i: backend.open_runtime(i) for i in range(2)}
        allocs = {i: StreamPoolAllocator(rt) for i, rt in rts.items()}
        # AM off: the other-GPU column measures the peer copy itself, not a relocation to the reader.
        store = CommStore(rts, allocs, idle={0: 8 << 30, 1: 8 << 30},
                          config=StoreConfig(adaptive_movement=False))
        stream = rts[0].create_stream()
        ipc = FuncIpc(redis.client()) if redis is not None else None
        for size_mb in SIZES_MB:
            n = size_mb * MB
            x = torch.randint(0, 255, (n,), dtype=torch.uint8)
            key = f"lat/{size_mb}"
            store.put(key, x, device=0)  # no declared consumers: it stays for every repetition
            row: dict = {"size_mb": size_mb}
            row["same_gpu_get_s"] = _timed(lambda k=key: store.get(k, device=0), repeats,
                                           lambda h: h.release())
            row["peer_get_s"] = _timed(lambda k=key: store.get(k, device=1), max(3, repeats // 10),
                                       lambda h: h.release())
            produced = upload_tensor(rts[0], x, allocs[0].allocate, stream)
            stream.synchronize()

            def handover(k=f"cycle/{size_mb}", t=produced) -> None:
                # The producer's output is adopted (PUT), read once on the same GPU (GET), released:
                # the store then frees it, so each repetition adopts a fresh allocation.
                address = allocs[0].allocate(t.nbytes, stream)
                store.put(k, DeviceTensor(address, t.dtype, t.shape, t.strides, t.nbytes), device=0,
                          consumers=1)
                store.get(k, device=0).release()

            row["same_gpu_put_get_s"] = _timed(handover, repeats)
            row["cuda_ipc_get_s"] = _timed(lambda t=produced: (model.get(t), model.release()), repeats)
            if ipc is not None:
                ipc.put(key, rts[0], produced, stream)
                row["func_ipc_get_s"] = _timed(
                    lambda k=key: ipc.get(k, rts[0], allocs[0], stream), ipc_repeats,
                    lambda r: (allocs[0].free(r.address, stream), stream.synchronize()),
                )
                row["func_ipc_put_s"] = _timed(lambda k=key, t=produced: ipc.put(k, rts[0], t, stream),
                                               ipc_repeats)
                ipc.delete(key)
            allocs[0].free(produced.address, stream)
            store.delete(key)
            store.synchronize()
            results.append(row)
        stream.synchronize()
        stream.destroy()
        store.close()
        backend.close()
    return results


def print_latency(rows: list[dict], redis_note: str) -> None:
    spec = V100_16GB
    have_ipc = all("func_ipc_get_s" in r for r in rows)
    base = "Func-IPC GET ms (Redis, baseline)"
    table = []
    for r in rows:
        peer_model = spec.link.peer_seconds(r["size_mb"] * MB)
        line = [f"{r['size_mb']} MB", _us(r["same_gpu_get_s"]), _us(r["peer_get_s"]), _us(peer_model),
                _us(r["cuda_ipc_get_s"])]
        if have_ipc:
            f = r["func_ipc_get_s"]
            line += [_ms(f), _ratio(r["same_gpu_get_s"] / f), _ratio(r["cuda_ipc_get_s"] / f)]
        table.append(line)
    cols = ["size", "same-GPU GET us", "other-GPU GET us (peer copy, wall)", "peer copy us (link model)",
            "CUDA-IPC style us (modelled)"]
    if have_ipc:
        cols += [base, "same-GPU / Func-IPC", "CUDA-IPC / Func-IPC"]
    print_table(f"GET latency, median ({EMULATED}; Redis and the store are real) {redis_note}", cols, table)
    flat = rows[-1]["same_gpu_get_s"] / rows[0]["same_gpu_get_s"]
    table = []
    for r in rows:
        line = [f"{r['size_mb']} MB", _us(r["same_gpu_put_get_s"])]
        if have_ipc:
            f = r["func_ipc_put_s"] + r["func_ipc_get_s"]
            line += [_ms(f), _ratio(r["same_gpu_put_get_s"] / f)]
        table.append(line)
    cols = ["size", "same-GPU PUT+GET us"]
    if have_ipc:
        cols += ["Func-IPC PUT+GET ms (baseline)", "same-GPU / Func-IPC"]
    print_table(f"Hand-over PUT + GET, median ({EMULATED})", cols, table)
    print(f"same-GPU GET, 125 MB vs 1 MB: {flat:.2f}x (size-independent when ~1)")


# -- part 1b: each system's data path through its own code ------------------------------------------
def data_paths(redis: RedisServer | None, repeats: int, ipc_repeats: int) -> list[dict]:
    spec = V100_16GB.with_overrides(context_create_s=0.0, context_memory=0)
    rows = []
    with tempfile.TemporaryDirectory() as state:
        backend = EmulatedBackend(spec=spec, count=1, state_dir=Path(state) / "state", timeline=False,
                                  mode="timed")
        # Producer and consumer: two instances' runtimes on one GPU (StreamBox: one proxy runtime).
        rts = [backend.open_runtime(0), backend.open_runtime(0)]
        allocs = [StreamPoolAllocator(rt) for rt in rts]
        streams = [rt.create_stream() for rt in rts]
        store = CommStore({0: rts[0]}, {0: allocs[0]}, idle={0: 8 << 30})
        registry = HandleRegistry.create(Path(state) / "handles")
        pairs = list(zip(rts, allocs, strict=True))
        handles = [IpcHandleStore(registry, "bench", rt, alloc) for rt, alloc in pairs]
        redis_stores = ([RedisStore(redis.client(), "bench", rt, alloc) for rt, alloc in pairs]
                        if redis is not None else None)
        counter = iter(range(1 << 30))

        def produced(nbytes: int) -> DeviceTensor:
            address = allocs[0].allocate(nbytes, streams[0])
            return DeviceTensor(address, torch.uint8, (nbytes,), (1,), nbytes)

        for size_mb in SIZES_MB:
            n = size_mb * MB
            row: dict = {"size_mb": size_mb}

            def streambox(n=n) -> None:
                tensor = produced(n)
                key = f"sb/{next(counter)}"
                store.put(key, tensor, device=0, consumers=1, stream=streams[0])
                store.get(key, device=0).release()

            def instances(pair: list, n: int = n) -> None:  # producer instance -> consumer instance
                tensor = produced(n)
                key = f"bench/r/{next(counter)}"
                pair[0].put(key, tensor, consumers=1, stream=streams[0], owner="r")  # ready: streams[0]
                got = pair[1].get(key, timeout=5.0, stream=streams[1])
                allocs[1].free(got.tensor.address, streams[1])

            row["streambox_s"] = _timed(streambox, repeats, lambda _: store.synchronize())
            row["astraea_s"] = _timed(lambda: instances(handles), repeats,
                                      lambda _: handles[0].reap())  # the producer frees off the path
            row["astraea_modelled_s"] = (CudaIpcModel().export_s + CudaIpcModel().open_s
                                         + CudaIpcModel().close_s + n / spec.link.device_bandwidth)
            if redis_stores is not None:
                row["infless_s"] = _timed(lambda: instances(redis_stores), ipc_repeats)
            rows.append(row)
        for s in (*handles, *(redis_stores or ())):
            s.close()
        store.close()
        for stream in streams:
            stream.synchronize()
            stream.destroy()
        backend.close()
    return rows


def print_data_paths(rows: list[dict]) -> None:
    have_redis = all("infless_s" in r for r in rows)
    table = []
    for r in rows:
        line = [f"{r['size_mb']} MB", _us(r["streambox_s"]), _us(r["astraea_s"]),
                _us(r["astraea_modelled_s"]), _ratio(r["streambox_s"] / r["astraea_s"])]
        if have_redis:
            line += [_ms(r["infless_s"]), _ratio(r["streambox_s"] / r["infless_s"]),
                     _ratio(r["astraea_s"] / r["infless_s"])]
        table.append(line)
    cols = ["size", "StreamBox PUT+GET us", "Astraea PUT+GET us (CUDA-IPC, measured)",
            "of which modelled us (export+open+close, D2D copy)", "StreamBox / Astraea"]
    if have_redis:
        cols += ["INFless PUT+GET ms (Redis)", "StreamBox / INFless", "Astraea / INFless"]
    print_table(f"Each system's data path through its own code, median ({EMULATED}, timed; "
                f"{CudaIpcModel().label})", cols, table)


# -- part 2: pressure ---------------------------------------------------------------------------
@dataclass(frozen=True)
class PressureSetup:
    """One round's scenario. Times are paper-scale; `dilation` stretches the competitor's schedule and
    the store's window and tick alike, because the emulator cannot copy faster than host memcpy (here
    tens of times slower than the modelled NVLink): stretched, the run makes the decisions it would
    make at the modelled speeds, and those decisions are then priced with the link model."""

    gpu_bytes: int = 512 * MiB
    items: int = 6
    item_bytes: int = 16 * MiB
    background: tuple[int, int] = (32 * MiB, 128 * MiB)  # other functions' memory on GPU 0 and 1
    step_bytes: int = 64 * MiB  # the competitor grows one layer at a time...
    step_s: float = 0.008  # ...every 8 ms...
    peak_bytes: int = 448 * MiB  # ...up to this...
    start_s: float = 0.01
    hold_s: float = 0.03  # ...holds it, then frees everything
    window_s: float = 0.02  # PA's prediction window (paper: 20 ms)
    tick_s: float = 0.01
    dilation: float = 25.0

    def schedule(self) -> list[tuple[float, int]]:
        """(offset from round start in dilated seconds, bytes the competitor holds from then on)."""
        steps, held, t = [], 0, self.start_s
        while held < self.peak_bytes:
            held = min(held + self.step_bytes, self.peak_bytes)
            steps.append((t * self.dilation, held))
            t += self.step_s
        steps.append(((t - self.step_s + self.hold_s) * self.dilation, 0))
        return steps


class DemandModel:
    """Predicted idle memory per GPU over [now, now + window] (what the memory pool's demand model
    computes from profiles; here from the competitor's known schedule)."""

    def __init__(self, setup: PressureSetup) -> None:
        self.setup = setup
        self.steps = setup.schedule()
        self.round_start: float | None = None

    def __call__(self, gpu: int, now: float, window: float) -> float:
        s = self.setup
        if gpu != 0:
            return s.gpu_bytes - s.background[gpu]
        peak = 0
        if self.round_start is not None:
            for offset, value in self.steps:
                at = self.round_start + offset
                if at <= now:
                    peak = value  # held now
            peak = max([peak] + [v for o, v in self.steps if now < self.round_start + o <= now + window])
        return s.gpu_bytes - s.background[0] - peak


class Competitor:
    """The competing function: allocates its layers from GPU 0's pool on its schedule. On an OOM the
    memory pool asks the store to give memory back (`reclaim`) and retries: that wait is the stall."""

    def __init__(self, store: CommStore, alloc: StreamPoolAllocator, stream, setup: PressureSetup) -> None:
        self.store, self.alloc, self.stream, self.setup = store, alloc, stream, setup
        self.ooms = 0
        self.stall_s = 0.0

    def allocate(self, nbytes: int) -> int:
        try:
            return self.alloc.allocate(nbytes, self.stream)
        except OutOfDeviceMemory:
            self.ooms += 1
            started = time.perf_counter()
            try:
                self.store.reclaim(0, nbytes)
                return self.alloc.allocate(nbytes, self.stream)
            finally:
                self.stall_s += time.perf_counter() - started

    def run(self, round_start: float) -> None:
        held: list[int] = []
        total = 0
        for offset, value in self.setup.schedule():
            delay = round_start + offset - time.monotonic()
            if delay > 0:
                time.sleep(delay)
            while total < value:
                step = min(self.setup.step_bytes, value - total)
                held.append(self.allocate(step))
                total += step
            if value == 0:
                for address in held:
                    self.alloc.free(address, self.stream)
                self.stream.synchronize()
                held, total = [], 0


def _price_moves(link, counts: dict[str, int], nbytes: dict[str, int], prefix: str) -> float:
    """Modelled seconds of the moves of one path ("reclaim" or "pressure") on the link model."""
    host, gpu = f"{prefix}->host", f"{prefix}->gpu"
    return (counts.get(host, 0) * link.latency_s + nbytes.get(host, 0) / link.pageable_bandwidth
            + counts.get(gpu, 0) * link.peer_latency_s + nbytes.get(gpu, 0) / link.peer_bandwidth)


def _price_get(link, transport: str, nbytes: int) -> float:
    if transport == "peer-copy":
        return link.peer_seconds(nbytes)
    if transport == "host-to-device":
        return link.copy_seconds(nbytes, pinned=False)  # the store's host tier is pageable memory
    return 0.0


def _diff(after: dict, before: dict) -> dict:
    return {k: v - before.get(k, 0) for k, v in after.items()}


def pressure(pa: bool, am: bool, rounds: int, setup: PressureSetup) -> dict:
    spec = V100_16GB.with_overrides(total_memory=setup.gpu_bytes, context_create_s=0.0, context_memory=0)
    link = spec.link
    demand = DemandModel(setup)
    per_round: list[dict] = []
    with tempfile.TemporaryDirectory() as state:
        backend = EmulatedBackend(spec=spec, count=2, state_dir=Path(state), timeline=False)
        rts = {i: backend.open_runtime(i) for i in range(2)}
        allocs = {i: StreamPoolAllocator(rt) for i, rt in rts.items()}
        background = [rts[i].mem_alloc(setup.background[i]) for i in range(2)]
        config = StoreConfig(pressure_aware=pa, adaptive_movement=am, capacity_fraction=0.5,
                             window_s=setup.window_s * setup.dilation, tick_s=setup.tick_s * setup.dilation)
        store = CommStore(rts, allocs, idle=demand, config=config).start()
        producer, competitor_stream = rts[0].create_stream(), rts[0].create_stream()
        for r in range(rounds + 1):  # round 0 warms the pools and is dropped
            competitor = Competitor(store, allocs[0], competitor_stream, setup)
            counts, nbytes = dict(store.stats.move_count), dict(store.stats.move_bytes)
            put_s = get_s = get_model_s = 0.0
            transports: dict[str, int] = {}
            demand.round_start = start = time.monotonic()
            keys = [f"r{r}/item{i}" for i in range(setup.items)]
            for key in keys:
                address = allocs[0].allocate(setup.item_bytes, producer)  # the producer's output
                t0 = time.perf_counter()
                output = DeviceTensor(address, torch.uint8, (setup.item_bytes,), (1,), setup.item_bytes)
                store.put(key, output, device=0, consumers=1, stream=producer)
                put_s += time.perf_counter() - t0
            competitor.run(start)
            demand.round_start = None
            for key in keys:  # the consumer on GPU 0, after the pressure peak
                t0 = time.perf_counter()
                handle = store.get(key, device=0, timeout=30)
                get_s += time.perf_counter() - t0
                transports[handle.transport.value] = transports.get(handle.transport.value, 0) + 1
                get_model_s += _price_get(link, handle.transport.value, handle.nbytes)
                handle.release()
            store.synchronize()
            moved_counts = _diff(store.stats.move_count, counts)
            moved_bytes = _diff(store.stats.move_bytes, nbytes)
            if r:
                per_round.append({
                    "put_s": put_s, "get_s": get_s, "stall_s": competitor.stall_s, "ooms": competitor.ooms,
                    "get_model_s": get_model_s,
                    "stall_model_s": _price_moves(link, moved_counts, moved_bytes, "reclaim"),
                    "background_model_s": _price_moves(link, moved_counts, moved_bytes, "pressure"),
                    "moves": moved_counts, "gets": transports,
                })
        for s in (producer, competitor_stream):
            s.synchronize()
            s.destroy()
        store.close()
        for i, address in enumerate(background):
            rts[i].mem_free(address)
        backend.close()

    def mean(name: str) -> float:
        return sum(x[name] for x in per_round) / len(per_round)

    def mean_count(field_: str, key: str) -> float:
        return sum(x[field_].get(key, 0) for x in per_round) / len(per_round)

    out = {"pa": pa, "am": am, "label": config.label, "rounds": len(per_round)}
    for name in ("put_s", "get_s", "stall_s", "ooms", "get_model_s", "stall_model_s", "background_model_s"):
        out[name] = mean(name)
    out["overhead_model_s"] = out["get_model_s"] + out["stall_model_s"]
    out["overhead_wall_s"] = out["put_s"] + out["get_s"] + out["stall_s"]
    for path in ("pressure->gpu", "pressure->host", "reclaim->gpu", "reclaim->host"):
        out[f"moves {path}"] = mean_count("moves", path)
    for transport in ("same-gpu", "peer-copy", "host-to-device"):
        out[f"gets {transport}"] = mean_count("gets", transport)
    out["per_round"] = per_round
    return out


def func_ipc_pressure(redis: RedisServer, rounds: int, setup: PressureSetup) -> dict:
    """The same items through Redis (the Func-IPC systems keep nothing on the GPU between functions):
    the device copies priced by the link model plus the measured Redis calls, and the wall clock."""
    spec = V100_16GB.with_overrides(total_memory=setup.gpu_bytes, context_create_s=0.0, context_memory=0)
    ipc = FuncIpc(redis.client())
    wall, model = [], []
    copy = spec.link.copy_seconds(setup.item_bytes, pinned=False)
    with tempfile.TemporaryDirectory() as state:
        backend = EmulatedBackend(spec=spec, count=1, state_dir=Path(state), timeline=False)
        rt = backend.open_runtime(0)
        alloc = StreamPoolAllocator(rt)
        stream = rt.create_stream()
        for r in range(rounds + 1):
            total = redis_s = 0.0
            for i in range(setup.items):
                address = alloc.allocate(setup.item_bytes, stream)
                t = DeviceTensor(address, torch.uint8, (setup.item_bytes,), (1,), setup.item_bytes)
                t0 = time.perf_counter()
                ipc.put(f"r{r}/{i}", rt, t, stream)
                total += time.perf_counter() - t0
                redis_s += ipc.last_redis_s
                alloc.free(address, stream)
            for i in range(setup.items):
                t0 = time.perf_counter()
                got = ipc.get(f"r{r}/{i}", rt, alloc, stream)
                total += time.perf_counter() - t0
                redis_s += ipc.last_redis_s
                alloc.free(got.address, stream)
                ipc.delete(f"r{r}/{i}")
            if r:
                wall.append(total)
                model.append(redis_s + 2 * setup.items * copy)
        stream.synchronize()
        stream.destroy()
        backend.close()
    return {"label": "Func-IPC (Redis)", "rounds": rounds, "overhead_wall_s": sum(wall) / len(wall),
            "overhead_model_s": sum(model) / len(model)}


def print_pressure(rows: list[dict], ipc_row: dict | None, setup: PressureSetup) -> None:
    base = rows[0]
    table = []
    for r in rows:
        table.append([
            r["label"], _ms(r["overhead_model_s"]), _ms(base["overhead_model_s"]),
            f"{r['overhead_model_s'] / base['overhead_model_s']:.3f}x",
            _ms(r["get_model_s"]), _ms(r["stall_model_s"]), _ms(r["background_model_s"]),
            f"{r['gets same-gpu']:.1f} / {r['gets peer-copy']:.1f} / {r['gets host-to-device']:.1f}",
            f"{r['ooms']:.1f}",
            _ms(r["overhead_wall_s"]), f"{r['overhead_wall_s'] / base['overhead_wall_s']:.3f}x",
        ])
    if ipc_row is not None:
        table.append([ipc_row["label"], _ms(ipc_row["overhead_model_s"]), _ms(base["overhead_model_s"]),
                      f"{ipc_row['overhead_model_s'] / base['overhead_model_s']:.3f}x", "", "", "", "", "",
                      _ms(ipc_row["overhead_wall_s"]),
                      f"{ipc_row['overhead_wall_s'] / base['overhead_wall_s']:.3f}x"])
    print_table(
        f"Communication overhead per round under memory pressure ({EMULATED}: {setup.items} x "
        f"{setup.item_bytes // MiB} MiB items on GPU 0, competitor to {setup.peak_bytes // MiB} of "
        f"{setup.gpu_bytes // MiB} MiB, schedule x{setup.dilation:g}; mean of rounds). 'model' = the run's "
        "decisions priced by the V100 link model; 'wall' = measured, host-memcpy-bound",
        ["configuration", "overhead ms (model)", "no PA, no AM ms (baseline)", "ratio",
         "GET ms (model)", "competitor stall ms (model)", "moves off path ms (model)",
         "GETs same / peer / host", "competitor OOMs", "overhead ms (wall)", "ratio (wall)"],
        table,
    )
    both = next(r for r in rows if r["pa"] and r["am"])
    pa = next(r for r in rows if r["pa"] and not r["am"])
    am = next(r for r in rows if r["am"] and not r["pa"])
    print(f"model: PA alone {pa['overhead_model_s'] / base['overhead_model_s'] - 1:+.0%}, AM alone "
          f"{am['overhead_model_s'] / base['overhead_model_s'] - 1:+.0%}, PA+AM "
          f"{both['overhead_model_s'] / base['overhead_model_s'] - 1:+.0%} vs no PA, no AM "
          "(paper Fig. 16 right: PA -55%, AM -72%)")
    if ipc_row is not None:
        model = both["overhead_model_s"] / ipc_row["overhead_model_s"]
        wall = both["overhead_wall_s"] / ipc_row["overhead_wall_s"]
        print(f"PA+AM vs Func-IPC under pressure: {_ratio(model)} (model), {_ratio(wall)} (wall)")


def proxy_stores(quick: bool) -> list[dict]:
    """Part 3: PUT+GET through real proxies, managed vs CUDA-IPC style store (benchmarks/comm_proxy.py)."""
    import comm_proxy

    repeats = 3 if quick else 10
    rows = comm_proxy.measure(repeats)
    comm_proxy.print_rows(rows, repeats)
    return rows


def main() -> int:
    p = parser(__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=None, help="repetitions of the fast GETs")
    p.add_argument("--rounds", type=int, default=None, help="rounds of the pressure experiment")
    p.add_argument("--dilation", type=float, default=PressureSetup.dilation,
                   help="stretch of the pressure schedule, window and tick (see PressureSetup)")
    args = p.parse_args()
    repeats = args.repeats or (30 if args.quick else 200)
    ipc_repeats = 2 if args.quick else 10
    rounds = args.rounds or (2 if args.quick else 8)
    torch.set_num_threads(1)
    redis: RedisServer | None = None
    try:
        redis = RedisServer().start()
        redis_note = f"[redis-server on port {redis.port}]"
    except RedisUnavailable as exc:
        redis_note = f"[Func-IPC skipped: {exc}]"
        print(f"Func-IPC baseline skipped: {exc}")
    try:
        lat = latency(redis, repeats, ipc_repeats)
        print_latency(lat, redis_note)
        paths = data_paths(redis, repeats, ipc_repeats)
        print_data_paths(paths)
        setup = PressureSetup(dilation=args.dilation)
        rows = [pressure(pa, am, rounds, setup) for pa, am in
                ((False, False), (True, False), (False, True), (True, True))]
        ipc_row = func_ipc_pressure(redis, rounds, setup) if redis is not None else None
        print_pressure(rows, ipc_row, setup)
        proxies = proxy_stores(args.quick)
    finally:
        if redis is not None:
            redis.stop()
    write_json(args.json, "comm",
               {"quick": args.quick, "repeats": repeats, "ipc_repeats": ipc_repeats, "rounds": rounds,
                "device": EMULATED, "cuda_ipc_model": CudaIpcModel().label,
                "pressure_setup": PressureSetup(dilation=args.dilation).__dict__},
               {"latency": lat, "data_paths": paths, "pressure": rows, "func_ipc_pressure": ipc_row,
                "proxy_stores": proxies})
    return 0


if __name__ == "__main__":
    sys.exit(main())
