"""The IO daemon (paper section 7, Fig. 10 right, Fig. 17): host-to-device sharing on the emulated V100 link.

(a) A small model (ResNet-18) starts loading while a large one (VGG-16) is mid-load: the small one's
    load latency and first-inference latency, stream-only vs StreamBox (target <= 0.2x).
(b) Link utilisation against block size, 16 KB .. 8 MB (target >= 90% of the modelled bandwidth at 2 MB).
(c) The ablation of Fig. 17 (right): stream-only, no optimizations, +RZ, +PB, +BT (= StreamBox).
(d) Pipelined loading: first-inference latency of a cold model, pipelined vs load-then-run.

Emulated device. The V100 link model (12 GB/s pinned, 6 GB/s pageable, ~2.7 us per call, pinned
allocation 1 ms/MB) is time-dilated x`--dilation` (bandwidths / K, latency and pinned-allocation cost x K;
the bandwidth-latency product, hence utilisation per block size, is unchanged) so that this small host,
which really stages and copies every byte in Python threads, keeps up with the modelled link. Times are
event times on the emulated timeline divided by K, i.e. on the V100 link's scale; kernel time in them is
real CPU time / K. "Mid-load" = half of the large model's modelled standalone load time in that
configuration (link time of its copy calls plus, PB off, its pinned allocations). In stream-only the
large function's copies are issued behind a gate that opens when its load "begins", because the emulator
stages a pageable source at issue, which on this host is slower than the link.

Baselines: stream-only (one copy per tensor from pageable memory, straight to the FIFO engine: the
executor's direct upload) and, as a second baseline, stream-only from weights already in pinned memory
(pinning not counted). Beside each emulated figure, "link model" is the same policy code replayed in
virtual time on the undilated V100 link (`io_daemon/simulate.py`, 10 us of host time per call).
"""

from __future__ import annotations

import statistics
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import parser, print_table, write_json  # noqa: E402

from streambox.api_proxy.device_tensor import DeviceTensor, download_tensor  # noqa: E402
from streambox.api_proxy.executor import DeviceModel, PlanExecutor, StreamPoolAllocator  # noqa: E402
from streambox.config import default_model_pool  # noqa: E402
from streambox.device import Event, HostBuffer, Stream  # noqa: E402
from streambox.device.emulated import EmulatedBackend, EmulatedHostBuffer, EmulatedRuntime  # noqa: E402
from streambox.device.specs import V100_16GB, DeviceSpec, LinkModel, MiB  # noqa: E402
from streambox.io_daemon import (  # noqa: E402
    CopyRequest,
    DaemonConfig,
    IODaemon,
    PlanLoad,
    load_plan,
    weight_layout,
    weight_requests,
)
from streambox.io_daemon.simulate import SimFunction, simulate  # noqa: E402
from streambox.kernel_compiler.model_pool import ModelPool  # noqa: E402
from streambox.kernel_compiler.plan import KernelPlan  # noqa: E402
from streambox.kernel_compiler.zoo import build_model, example_input, get_entry  # noqa: E402

KiB = 1 << 10
SMALL, LARGE = "resnet18", "vgg16"
#: Host time per copy call assumed by the virtual-time replay (a CUDA cudaMemcpyAsync + event record).
ISSUE_S = 10e-6
BLOCK_SIZES = [16 * KiB, 64 * KiB, 256 * KiB, 1 * MiB, 2 * MiB, 4 * MiB, 8 * MiB]
SO, SO_PINNED, SB = "stream-only (SO)", "SO, weights pre-pinned", "+RZ+PB+BT (StreamBox)"
# label -> (configuration, whether the functions' weights sit in pinned host memory already)
CONFIGS = {  # Fig. 17 right, cumulative; plus stream-only from pinned memory (pinning not counted)
    SO: (DaemonConfig.stream_only(), False),
    SO_PINNED: (DaemonConfig.stream_only(), True),
    "no optimizations (WO)": (DaemonConfig.ablation(rz=False, pb=False, bt=False), False),
    "+RZ": (DaemonConfig.ablation(rz=True, pb=False, bt=False), False),
    "+RZ+PB": (DaemonConfig.ablation(rz=True, pb=True, bt=False), False),
    SB: (DaemonConfig(), False),
}


def dilated(spec: DeviceSpec, k: float) -> DeviceSpec:
    link = spec.link
    return spec.with_overrides(
        context_create_s=0.0,
        link=replace(
            link,
            pinned_bandwidth=link.pinned_bandwidth / k,
            pageable_bandwidth=link.pageable_bandwidth / k,
            latency_s=link.latency_s * k,
            pinned_alloc_s_per_byte=link.pinned_alloc_s_per_byte * k,
        ),
    )


@dataclass
class Model:
    """A plan with its host weights resident and its device memory allocated once (reloaded per run)."""

    plan: KernelPlan
    host: dict[str, torch.Tensor]
    device: DeviceModel
    arena: int  # device address of the weights' region (laid out by `weight_layout`)
    pinned: HostBuffer  # the same bytes in pinned host memory, same layout
    x: torch.Tensor
    x_dev: DeviceTensor

    @property
    def addresses(self) -> dict[str, int]:
        return {n: t.address for n, t in self.device.weights.items()}

    def requests(self, pinned: bool = False) -> list[CopyRequest]:
        requests = weight_requests(self.plan, self.addresses, self.host)
        if pinned:
            requests = [replace(r, src=self.pinned, src_offset=r.dst - self.arena) for r in requests]
        return requests

    def submit(
        self, daemon: IODaemon, function: str, *, pinned: bool = False, with_input: bool = True
    ) -> PlanLoad:
        """Load the weights (and the input) through `daemon`: `load_plan`, or the same from pinned memory."""
        inputs = [CopyRequest(self.x_dev.address, self.x, self.x_dev.nbytes, "input")] if with_input else []
        if not pinned:
            return load_plan(daemon, function, self.plan, self.addresses, self.host, inputs=inputs)
        requests = self.requests(pinned=True)
        ticket = daemon.submit(function, [*inputs, *requests])
        return PlanLoad(ticket, frozenset(r.layer for r in requests), ("input",) if with_input else ())

    def poison(self, rt: EmulatedRuntime) -> None:
        for t in self.device.weights.values():
            rt.view(t.address, torch.uint8, (t.nbytes,)).fill_(0xFF)

    def arrived(self, rt: EmulatedRuntime) -> bool:
        return all(
            torch.equal(
                rt.view(t.address, torch.uint8, (t.nbytes,)), self.host[n].reshape(-1).view(torch.uint8)
            )
            for n, t in self.device.weights.items()
        )


class Bench:
    def __init__(self, rt: EmulatedRuntime, pool: ModelPool, k: float) -> None:
        self.rt, self.k = rt, k
        self.allocator = StreamPoolAllocator(rt)
        self.executor = PlanExecutor(rt, self.allocator)
        self.models = {name: self._model(pool, name) for name in (SMALL, LARGE)}
        self.want = {}
        with torch.no_grad():
            self.want[SMALL] = build_model(SMALL)(self.models[SMALL].x)

    def _model(self, pool: ModelPool, name: str) -> Model:
        shape = get_entry(name).small_input_shape
        plan = pool.get_or_lower(name, 1, shape)
        host = {n: t.detach().contiguous().clone() for n, t in plan.load_weights().items()}  # resident
        # All weights in one region, in first-use order (as a loader or a fresh pool chunk lays them
        # out), so the daemon copies a block of fused small weights with one call.
        offsets, total = weight_layout(plan)
        arena = self.rt.mem_alloc(total)
        self.rt.view(arena, torch.uint8, (total,)).fill_(0)  # touch: no page faults while timed
        weights = {}
        for var in plan.vars_of_kind("weight"):
            weights[var.name] = DeviceTensor(
                arena + offsets[var.name], var.torch_dtype, tuple(var.shape), tuple(var.strides), var.nbytes
            )
        device = DeviceModel(plan, weights, {n: t.view(self.rt) for n, t in weights.items()})
        # Weights pinned long ago (the pinning cost is not part of any figure): built directly.
        pinned = EmulatedHostBuffer(total, pinned=True)
        for var_name, offset in offsets.items():
            data = host[var_name].reshape(-1).view(torch.uint8)
            pinned.tensor()[offset : offset + data.numel()].copy_(data)
        x = example_input(name, 1, shape).contiguous()
        nbytes = x.numel() * x.element_size()
        x_dev = DeviceTensor(self.rt.mem_alloc(nbytes), x.dtype, tuple(x.shape), tuple(x.stride()), nbytes)
        return Model(plan, host, device, arena, pinned, x, x_dev)

    # -- measuring --------------------------------------------------------------------------
    def mark(self) -> Event:
        """An event on an idle stream: it completes (and is stamped) at the moment it is recorded."""
        stream = self.rt.create_stream()
        event = self.rt.create_event()
        event.record(stream)
        stream.destroy()
        return event

    def ms(self, a: Event, b: Event) -> float:
        return a.elapsed_ms(b) / self.k

    def modelled_load_s(self, config: DaemonConfig, model: Model, pinned: bool, link: LinkModel) -> float:
        """A model's standalone load time on `link` in `config`, replayed in virtual time."""
        alone = SimFunction("f", 0.0, [r.nbytes for r in model.requests()], pinned)
        return simulate(link, [alone], config).finish["f"]

    def simulated(self, config: DaemonConfig, pinned: bool) -> dict[str, Any]:
        """(a)/(c) on the undilated V100 link model, in virtual time: the small model's load latency."""
        small, large = self.models[SMALL], self.models[LARGE]
        link = V100_16GB.link
        arrival = 0.5 * self.modelled_load_s(config, large, pinned, link)
        functions = [
            SimFunction("large", 0.0, [r.nbytes for r in large.requests()], pinned),
            SimFunction(
                "small", arrival, [small.x_dev.nbytes, *(r.nbytes for r in small.requests())], pinned
            ),
        ]
        result = simulate(link, functions, config, issue_s=ISSUE_S)
        return {"load_ms": (result.finish["small"] - arrival) * 1e3, "arrival_ms": arrival * 1e3}

    def infer(
        self, daemon: IODaemon, model: Model, stream: Stream, *, pipelined: bool = True, pinned: bool = False
    ) -> dict[str, Any]:
        """Load `model` cold through `daemon` and run its first inference on `stream`."""
        model.poison(self.rt)
        start = self.mark()
        load = model.submit(daemon, model.plan.model, pinned=pinned)
        if not pipelined:
            load.wait_all(stream)
        result = self.executor.run(
            model.device, {model.plan.inputs[0]: model.x_dev}, stream, on_kernel=load.on_kernel(stream)
        )
        result.done.synchronize()
        load.synchronize()
        out = download_tensor(self.rt, result.outputs[model.plan.outputs[0]], stream)
        for handle in result.outputs.values():
            self.allocator.free(handle.address, stream)
        correct = model.plan.model not in self.want or torch.allclose(
            out, self.want[model.plan.model], rtol=1e-4, atol=1e-5
        )
        name = model.plan.model
        if daemon.config.mode == "stream-only":
            calls = load.ticket.blocks  # one call per non-empty request
        else:
            calls = sum(b.calls for b in daemon.trace if b.function == name)
        return {
            "load_ms": self.ms(start, load.ticket.last_event()),
            "first_inference_ms": self.ms(start, result.done),
            "copy_calls": calls,
            "correct": bool(correct and model.arrived(self.rt)),
        }

    def contended(self, config: DaemonConfig, pinned: bool = False) -> dict[str, Any]:
        """(a)/(c): the small model arrives when the large one is mid-load (by the link model)."""
        small, large = self.models[SMALL], self.models[LARGE]
        delay = 0.5 * self.modelled_load_s(config, large, pinned, self.rt.spec.link)
        stream = self.rt.create_stream()
        h2d_before = self.rt.copy_engine_stats()["h2d"]["nbytes"]
        with IODaemon(self.rt, config) as daemon:
            release = None
            if config.mode == "stream-only":
                # Async copies are queued on the engine when issued; the emulator stages a pageable
                # source at issue, which on this host takes longer than the link. So the large
                # function's copies are all issued behind a gate first, and its load starts when
                # the gate opens: the same link state as a host that issues faster than the link.
                gate_stream = self.rt.create_stream()
                opened = threading.Event()
                self.rt.launch(gate_stream, lambda: opened.wait(120), name="gate")
                gate = self.rt.create_event()
                gate.record(gate_stream)
                daemon.function_stream("large").wait_event(gate)
                release = opened.set
            if release is None:
                began = time.perf_counter()
            large.submit(daemon, "large", pinned=pinned, with_input=False)
            if release is not None:
                began = time.perf_counter()
                release()
            time.sleep(max(0.0, began + delay - time.perf_counter()))
            on_link = self.rt.copy_engine_stats()["h2d"]["nbytes"] - h2d_before
            figures = self.infer(daemon, small, stream, pinned=pinned)
            daemon.cancel("large")  # the large load is not what is measured: stop it where it is
        stream.destroy()
        figures["large_on_link_at_arrival"] = on_link / large.plan.weight_bytes
        figures["arrival_ms"] = delay * 1e3 / self.k
        return figures

    def alone(
        self, config: DaemonConfig, name: str = SMALL, pipelined: bool = True, pinned: bool = False
    ) -> dict[str, Any]:
        stream = self.rt.create_stream()
        with IODaemon(self.rt, config) as daemon:
            figures = self.infer(daemon, self.models[name], stream, pipelined=pipelined, pinned=pinned)
        stream.destroy()
        return figures

    def compute_only(self, name: str) -> float:
        """A warm run (weights resident): the model's kernel time alone."""
        model = self.models[name]
        stream = self.rt.create_stream()
        start = self.mark()
        result = self.executor.run(model.device, {model.plan.inputs[0]: model.x_dev}, stream)
        result.done.synchronize()
        for handle in result.outputs.values():
            self.allocator.free(handle.address, stream)
        stream.destroy()
        return self.ms(start, result.done)

    def utilisation(self, block_size: int, payload: int) -> dict[str, Any]:
        """(b): one function moves `payload` bytes with blocks of `block_size` (PB and BT on)."""
        src = torch.randint(0, 256, (payload,), dtype=torch.uint8)
        dst = self.rt.mem_alloc(payload)
        self.rt.view(dst, torch.uint8, (payload,)).fill_(0)
        config = DaemonConfig(block_size=block_size)
        with IODaemon(self.rt, config) as daemon:
            self.rt.clear_timeline()
            ticket = daemon.submit("f", [CopyRequest(dst, src, payload)])
            ticket.synchronize()
            calls = daemon.stats.copy_calls
        copies = [r for r in self.rt.timeline() if r.lane == "h2d"]
        ok = torch.equal(self.rt.view(dst, torch.uint8, (payload,)), src)
        self.rt.mem_free(dst)
        link = self.rt.spec.link
        ideal = payload / link.pinned_bandwidth
        busy = sum(r.end - r.start for r in copies)
        span = copies[-1].end - copies[0].start
        return {
            "block_size": block_size,
            "calls": calls,
            "model": block_size / (block_size + link.latency_s * link.pinned_bandwidth),
            "link_busy": ideal / busy,
            "end_to_end": ideal / span,
            "correct": ok,
        }


def fmt_ms(x: float) -> str:
    return f"{x:.1f}"


def median_run(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Per key, the median over runs (numbers) or whether all runs agree (flags); plus the runs."""
    out: dict[str, Any] = {}
    for key, value in runs[0].items():
        values = [r[key] for r in runs]
        out[key] = all(values) if isinstance(value, bool) else statistics.median(values)
    out["runs"] = len(runs)
    return out


def main() -> int:
    p = parser(__doc__.splitlines()[0])
    p.add_argument("--dilation", type=float, default=16.0, help="time dilation K of the link model")
    p.add_argument("--repeats", type=int, default=None, help="runs per figure, median (default 5, quick 2)")
    args = p.parse_args()
    # One intra-op thread: the emulated device's memcpys and kernels run on worker threads of their
    # own, and torch's thread pool fighting them on a small host makes a 2 MB copy 10x slower.
    torch.set_num_threads(1)
    k = args.dilation
    repeats = args.repeats or (2 if args.quick else 5)
    spec = dilated(V100_16GB, k)
    payload = (32 if args.quick else 128) * MiB
    results: dict[str, Any] = {}
    started = time.perf_counter()
    with tempfile.TemporaryDirectory() as state:
        rt = EmulatedBackend(spec=spec, state_dir=Path(state)).open_runtime(0)
        bench = Bench(rt, ModelPool(default_model_pool()), k)
        small_mb = bench.models[SMALL].plan.weight_bytes / MiB
        large_mb = bench.models[LARGE].plan.weight_bytes / MiB
        header = (
            f"emulated V100 link, time-dilated x{k:g}, times in V100-link ms; "
            f"{SMALL} ({small_mb:.0f} MB) / {LARGE} ({large_mb:.0f} MB), batch 1"
        )
        # (c) includes (a): stream-only and StreamBox under the same contention. The host-bound
        # configurations (one block per call with a pinned allocation per request) run once.
        runs = {}
        for label, (config, pinned) in CONFIGS.items():
            n = 1 if config.batch_blocks == 1 and not config.pinned_buffer else repeats
            runs[label] = median_run([bench.contended(config, pinned) for _ in range(n)])
        alone = {
            label: median_run(
                [bench.alone(CONFIGS[label][0], pinned=CONFIGS[label][1]) for _ in range(repeats)]
            )
            for label in (SO, SO_PINNED, SB)
        }
        for label, (config, pinned) in CONFIGS.items():
            runs[label]["link_model"] = bench.simulated(config, pinned)
        so = runs[SO]
        results["a"] = {"runs": {label: runs[label] for label in (SO, SO_PINNED, SB)}, "alone": alone}
        rows = []
        for label in (SO, SO_PINNED, SB):
            r, lone, model = runs[label], alone[label], runs[label]["link_model"]
            rows.append(
                [
                    label,
                    fmt_ms(r["load_ms"]),
                    f"{r['load_ms'] / so['load_ms']:.3f}x",
                    fmt_ms(r["first_inference_ms"]),
                    f"{r['first_inference_ms'] / so['first_inference_ms']:.3f}x",
                    f"{lone['load_ms']:.1f} / {lone['first_inference_ms']:.1f}",
                    fmt_ms(model["load_ms"]),
                    f"{model['load_ms'] / so['link_model']['load_ms']:.3f}x",
                ]
            )
        print_table(
            f"(a) {SMALL} arriving while {LARGE} is mid-load ({header}; median of {repeats}); target <= 0.2x",
            [
                "system",
                "load ms",
                "load / SO",
                "first inference ms",
                "first inf. / SO",
                "alone: load / first inf. ms",
                "load ms, link model (virtual time)",
                "/ SO (link model)",
            ],
            rows,
        )
        correct = all(r["correct"] for r in (*runs.values(), *alone.values()))
        print(
            "    mid-load arrival after the large load began, and the large model's bytes on the link then: "
            + ", ".join(
                f"{label} {runs[label]['arrival_ms']:.1f} ms ({runs[label]['large_on_link_at_arrival']:.0%})"
                for label in (SO, SO_PINNED, SB)
            )
            + f".\n    Every output equals eager torch and every byte arrived: {correct}. "
            "Link model = the same policies replayed in virtual time on the undilated V100 link, "
            f"{ISSUE_S * 1e6:.0f} us host time per copy call, stream-only as one FIFO queue of async copies."
        )

        # (b) link utilisation against block size
        util = [bench.utilisation(size, payload) for size in BLOCK_SIZES]
        results["b"] = util
        print_table(
            f"(b) link utilisation vs block size ({payload // MiB} MB, one function, PB+BT on; "
            f"emulated V100 link, x{k:g}); target >= 90% at 2 MB",
            [
                "block",
                "copy calls",
                "link model",
                "link busy (measured)",
                "end to end incl. host/emulator gaps",
            ],
            [
                [
                    f"{u['block_size'] // KiB} KB"
                    if u["block_size"] < MiB
                    else f"{u['block_size'] // MiB} MB",
                    u["calls"],
                    f"{u['model']:.1%}",
                    f"{u['link_busy']:.1%}",
                    f"{u['end_to_end']:.1%}",
                ]
                for u in util
            ],
        )

        # (c) ablation
        results["c"] = runs
        print_table(
            f"(c) ablation, Fig. 17 right: {SMALL} arriving while {LARGE} is mid-load ({header})",
            [
                "configuration",
                "runs",
                "copy calls",
                "load ms",
                "first inference ms",
                "first inf. / SO (baseline)",
                "load ms, link model",
                "/ SO (link model)",
            ],
            [
                [
                    label,
                    r["runs"],
                    int(r["copy_calls"]),
                    fmt_ms(r["load_ms"]),
                    fmt_ms(r["first_inference_ms"]),
                    f"{r['first_inference_ms'] / so['first_inference_ms']:.3f}x",
                    fmt_ms(r["link_model"]["load_ms"]),
                    f"{r['link_model']['load_ms'] / so['link_model']['load_ms']:.3f}x",
                ]
                for label, r in runs.items()
            ],
        )

        # (d) pipelined loading of a cold model
        rows, results["d"] = [], {}
        for name in (SMALL, LARGE):
            after = median_run([bench.alone(DaemonConfig(), name, pipelined=False) for _ in range(repeats)])
            piped = median_run([bench.alone(DaemonConfig(), name, pipelined=True) for _ in range(repeats)])
            compute = statistics.median(bench.compute_only(name) for _ in range(repeats))
            results["d"][name] = {"load_then_run": after, "pipelined": piped, "compute_ms": compute}
            rows.append(
                [
                    name,
                    fmt_ms(after["load_ms"]),
                    fmt_ms(compute),
                    fmt_ms(after["first_inference_ms"]),
                    fmt_ms(piped["first_inference_ms"]),
                    f"{piped['first_inference_ms'] / after['first_inference_ms']:.3f}x",
                ]
            )
        print_table(
            f"(d) first inference of a cold model, StreamBox daemon alone ({header}; median of {repeats})",
            [
                "model",
                "load ms",
                "warm compute ms",
                "load-then-run ms (baseline)",
                "pipelined ms",
                "pipelined / baseline",
            ],
            rows,
        )
        rt.close()
    print(f"    total {time.perf_counter() - started:.0f} s")
    config = {
        "quick": args.quick,
        "dilation": k,
        "repeats": repeats,
        "payload_bytes": payload,
        "spec": spec.name,
    }
    write_json(args.json, "io_daemon", config, results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
