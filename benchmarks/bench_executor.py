"""Host time per kernel of the plan executor against eager torch's own per-op time, per zoo model.

Every figure is wall time of the calling thread, median over turns, measured in one process by
turns (eager, then the executor), so both see the same load on the machine:

- eager torch (the baseline): `module(x)` on the CPU, one thread, divided by the compute ops it
  dispatches (aten ops below autograd, counted once with a dispatch mode; views, which launch
  nothing, are not counted, as the executor's view kernels are not). A CPU op returns when it has
  computed, so this includes its compute: on the zoo's small inputs dispatch dominates for the
  mobilenets, text_encoder and espcn (tens of us per op); for alexnet, vgg16 and the resnets compute
  does, and the ratio only bounds.
- the executor's host time: `PlanExecutor.run` of a warm instance through the runtime's memory pool
  (`DeviceMemoryPool`, as in the proxy), from the call until it returns with every kernel issued
  (lazy allocation, access counting, eager recycling, launch), per compute kernel, issued while the
  device is held by a gate on another stream: a GPU runs its kernels without the host's CPU, the
  emulated device runs them on CPU threads of this process. In timed mode kernels are phantom, so the
  gate is a modelled kernel that holds the stream only for its modelled time: the run's placements
  (the timed launch's own host work) run inline on the issuing thread and are part of the figure,
  as a real launch's driver work would be. The ops themselves (and torch's dispatch
  of them) run on the stream's worker on the emulated device; the CUDA backend dispatches them on
  the issuing thread, inside `launch`, where they would add torch's dispatch time to this figure.
- in the proxy's issue path: the same held run as the proxy issues it (`api_proxy/ops.py`): on an
  issuer thread (`Issuer.submit`), with the ticket's per-kernel hook (slice pacing, nobody else
  waiting) and the resilient scaler's `PositionBoard` written per kernel; the proxy's share of the
  host time per kernel, which the column before leaves out.
- kernel by kernel: the same held run with the run's kernels launched one by one (`run_issue.IssueOne`)
  instead of a segment at a time (`Runtime.launch_many`, the default), in the same turns, and the ratio.
- of which the executor's own: the same run with a null allocator and a null device (nothing taken,
  nothing launched): the mapping table and the hot loop without the pool's and the device's share.
- issue while the device computes, and end to end: a run issued with the emulated device free to
  run (the worker competes with the issuing thread for the CPU and the GIL), until its `done` event.

`--device-mode functional|timed` (default: both, where the emulated device accepts timed mode);
`--device-mode cuda`: the CUDA backend on GPU 0 instead (the baseline is then eager torch on that GPU:
host time until `module(x)` returns, its kernels queued behind a sleep kernel; a held run waits behind
one too, as `_hold` cannot block a GPU stream with a host-side gate).
"""

from __future__ import annotations

import contextlib
import inspect
import os
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import torch
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import parser, print_table, write_json  # noqa: E402

from streambox.api_proxy.device_tensor import DeviceTensor, upload_tensor  # noqa: E402
from streambox.api_proxy.executor import (  # noqa: E402
    DeviceModel,
    PlanExecutor,
    RunResult,
    free_model,
    upload_model,
)
from streambox.api_proxy.issuer import Issuer  # noqa: E402
from streambox.config import default_model_pool  # noqa: E402
from streambox.device import BackendUnavailable, Runtime, Stream, get_backend  # noqa: E402
from streambox.device.emulated import EmulatedBackend  # noqa: E402
from streambox.device.specs import V100_16GB  # noqa: E402
from streambox.kernel_compiler import native_out  # noqa: E402
from streambox.kernel_compiler.model_pool import ModelPool  # noqa: E402
from streambox.kernel_compiler.plan import KernelPlan  # noqa: E402
from streambox.kernel_compiler.zoo import ZOO, build_model, example_input, get_entry  # noqa: E402
from streambox.memory_pool.pool import DeviceMemoryPool  # noqa: E402
from streambox.memory_pool.scaler import PositionBoard  # noqa: E402

QUICK_MODELS = ["alexnet", "resnet18", "mobilenet_v3_small"]
WARMUP = 3  # turns before the measured ones: the pool grows and the instance binds its calls
ALIGN = 512  # the null device's allocation granularity
HOLD_LIMIT_S = 10.0  # a held stream is let go after this long whatever happens
DEVICE_MODES = ("functional", "timed")
CUDA_MODE = "cuda"  # not an emulated mode: the real GPU, only when asked for
CUDA_HOLD_CYCLES = int(0.2 * 2.0e9)  # `torch.cuda._sleep`: ~0.2 s at a 2 GHz clock, longer than any issue
GOAL_US, GOAL_RATIO = 15.0, 1.5  # docs/api_proxy.md: host time per kernel, absolute and vs eager


class _OpCounter(TorchDispatchMode):
    """Counts the aten ops eager torch dispatches (below autograd, as the plan's kernels are), and
    among them the views (an op returning an alias it does not write), which launch nothing."""

    def __init__(self) -> None:
        super().__init__()
        self.ops = 0
        self.views = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        self.ops += 1
        aliases = [r.alias_info for r in func._schema.returns if r.alias_info is not None]
        self.views += bool(aliases) and not any(a.is_write for a in aliases)
        return func(*args, **(kwargs or {}))


def _hold(rt: Runtime, holder: Stream, stream: Stream) -> threading.Event:
    """Make `stream` wait until the returned event is set (a host-side gate on another stream), so
    that a run can be issued while the emulated device does nothing, as a GPU takes no host CPU.
    On the CUDA backend a launch runs its callable on the calling thread, so the gate is a sleep
    kernel instead (the event is then only a formality)."""
    gate = threading.Event()
    if rt.properties().backend == "cuda":
        rt.launch(holder, lambda: torch.cuda._sleep(CUDA_HOLD_CYCLES), name="hold")
    else:
        rt.launch(holder, lambda: gate.wait(HOLD_LIMIT_S), name="hold")
    reached = rt.create_event(timing=False)
    reached.record(holder)
    stream.wait_event(reached)
    return gate


class _NullDevice:
    """Takes memory and launches without doing either: isolates the executor's own share of its
    host time (mapping table, bookkeeping, the hot loop) from the pool's and the device's."""

    def __init__(self) -> None:
        self.next = ALIGN

    def allocate(self, nbytes: int, stream: object) -> int:
        self.next += -(-nbytes // ALIGN) * ALIGN
        return self.next

    def free(self, address: int, stream: object) -> None:
        pass

    def free_many(self, addresses: object, stream: object) -> None:
        pass

    def launch(self, stream: object, kernel: object, **options: object) -> None:
        pass

    def issuing(self, stream: object) -> contextlib.nullcontext:
        return contextlib.nullcontext()

    def create_event(self, timing: bool = True) -> _NullDevice:
        return self

    def properties(self) -> SimpleNamespace:
        return SimpleNamespace(name="null device")  # no preset models it: kernels get no duration

    def record(self, stream: object) -> None:
        pass


def measure_own(plan: KernelPlan, repeats: int) -> float:
    """Seconds per run of the executor with `_NullDevice` as its runtime and allocator."""
    null = _NullDevice()
    executor = PlanExecutor(null, null)  # type: ignore[arg-type]
    model = DeviceModel(plan, {}, {})
    inputs = {name: DeviceTensor(ALIGN, torch.float32, (1,), (1,), 4) for name in plan.inputs}
    samples = []
    for i in range(repeats + WARMUP):
        started = time.perf_counter()
        executor.run(model, inputs, null, instance="f1")  # type: ignore[arg-type]
        if i >= WARMUP:
            samples.append(time.perf_counter() - started)
    return statistics.median(samples)


def measure(rt: Runtime, pool: ModelPool, name: str, shape: tuple[int, ...] | None, repeats: int) -> dict:
    """Eager torch and a warm executor instance (one stream, the runtime's memory pool, fm: lazy +
    eager), run by turns so that both see the same load on the machine: per turn an eager forward,
    a run issued while the device computes, then one issued while it is held (host time): the
    held run follows a run of the executor, as a proxy's runs follow each other, not eager torch's
    forward (whose compute leaves the CPU's caches to the model's tensors)."""
    module = build_model(name).eval()
    x = example_input(name, 1, shape)
    with torch.no_grad(), _OpCounter() as counter:
        module(x)
    on_gpu = rt.properties().backend == "cuda"
    gpu_module, gpu_x = (module.cuda(), x.cuda()) if on_gpu else (module, x)
    plan = pool.get_or_lower(name, 1, shape)
    mem = DeviceMemoryPool(rt)
    stream, holder = rt.create_stream(), rt.create_stream()
    model = upload_model(rt, plan, mem, stream)
    handle = upload_tensor(rt, x, mem.allocate, stream)
    executor = PlanExecutor(rt, mem)
    proxied = PlanExecutor(rt, mem, positions=PositionBoard())  # as `ProxyMemory` makes it
    issuer = Issuer(lambda: None, contended=lambda: False)  # one request: nobody waits for a turn
    segments = executor._segments
    kinds = ("eager", "host", "issue", "e2e", "one_by_one", "proxy")
    samples: dict[str, list[float]] = {k: [] for k in kinds}

    def run() -> RunResult:
        return executor.run(model, {plan.inputs[0]: handle}, stream, instance="f1")

    def run_in_proxy_path() -> RunResult:
        ticket = issuer.submit(
            lambda on_kernel: proxied.run(model, {plan.inputs[0]: handle}, stream, instance="p1",
                                          on_kernel=on_kernel),
            lambda addresses, s: None, stream,
        )
        ok, value = ticket.future.result()
        if not ok:
            raise value
        return value

    def finish(result: RunResult) -> None:
        result.done.synchronize()
        mem.free_many([t.address for t in result.outputs.values()], stream)

    for i in range(repeats + WARMUP):
        if on_gpu:  # host time of eager dispatch: its kernels wait behind a sleep, as the held run's do
            torch.cuda._sleep(CUDA_HOLD_CYCLES)
        started = time.perf_counter()
        with torch.no_grad():
            gpu_module(gpu_x)
        eager = time.perf_counter() - started
        if on_gpu:
            torch.cuda.synchronize()
        started = time.perf_counter()
        running = run()
        finish(running)
        end_to_end = time.perf_counter() - started
        gate = _hold(rt, holder, stream)  # right after a run: the issue path's state is that of a
        held = run()  # proxy issuing request after request, not that left by eager torch's forward
        gate.set()
        finish(held)
        executor._segments = False  # the same, launched kernel by kernel (`run_issue.IssueOne`)
        gate = _hold(rt, holder, stream)
        one_by_one = run()
        gate.set()
        finish(one_by_one)
        executor._segments = segments
        finish(run_in_proxy_path())  # its instance warm and the caches as the proxy's would be
        gate = _hold(rt, holder, stream)
        in_proxy = run_in_proxy_path()
        gate.set()
        finish(in_proxy)
        if i >= WARMUP:
            for key, value in (("eager", eager), ("host", held.stats.issue_seconds),
                               ("issue", running.stats.issue_seconds), ("e2e", end_to_end),
                               ("one_by_one", one_by_one.stats.issue_seconds),
                               ("proxy", in_proxy.stats.issue_seconds)):
                samples[key].append(value)
    binds = executor.calls_bound("f1")
    executor.release_instance("f1")
    proxied.release_instance("p1")
    issuer.close()
    mem.free(handle.address, stream)
    free_model(model, mem, stream)
    mem.drain()
    for s in (stream, holder):
        s.destroy()
    mem.close()
    samples["own"] = [measure_own(plan, repeats)]
    return _figures(name, plan, counter, samples, binds)


def _figures(
    name: str, plan: KernelPlan, counter: _OpCounter, samples: dict[str, list[float]], binds: int
) -> dict:
    kernels = sum(k.kind != "view" for k in plan.kernels)
    eager_ops = counter.ops - counter.views
    p50 = {key: statistics.median(values) for key, values in samples.items()}
    eager_us = p50["eager"] / eager_ops * 1e6
    host_us = p50["host"] / kernels * 1e6
    return {
        "model": name,
        "kernels": kernels,
        "view_kernels": len(plan.kernels) - kernels,
        "eager_ops": eager_ops,
        "eager_view_ops": counter.views,
        "eager_ms": p50["eager"] * 1e3,
        "eager_us_per_op": eager_us,
        "host_us_per_kernel_p50": host_us,
        "host_us_per_kernel_p90": statistics.quantiles(samples["host"], n=10)[-1] / kernels * 1e6,
        "host_vs_eager": host_us / eager_us,
        "proxy_path_us_per_kernel_p50": p50["proxy"] / kernels * 1e6,
        "proxy_path_vs_host": p50["proxy"] / p50["host"],
        "host_one_by_one_us_per_kernel_p50": p50["one_by_one"] / kernels * 1e6,
        "segments_vs_one_by_one": p50["host"] / p50["one_by_one"],
        "executor_own_us_per_kernel": p50["own"] / kernels * 1e6,
        "issue_while_computing_us_per_kernel_p50": p50["issue"] / kernels * 1e6,
        "end_to_end_ms": p50["e2e"] * 1e3,
        "end_to_end_vs_eager": p50["e2e"] / p50["eager"],
        "calls_bound": binds,
    }


def open_runtime(mode: str, state: Path) -> Runtime | None:
    """An emulated device in `mode` (the `STREAMBOX_DEVICE_MODE` environment variable, and the
    backend's `device_mode`/`mode` argument where it has one), or None when the device it opened
    does not say it runs in `mode` (a build without timed mode); `cuda`: GPU 0."""
    if mode == CUDA_MODE:
        try:
            return get_backend("cuda").open_runtime(0)
        except BackendUnavailable as exc:
            print(f"cuda: {str(exc).splitlines()[0][:200]}")
            return None
    spec = V100_16GB.with_overrides(context_create_s=0.0)
    params = inspect.signature(EmulatedBackend).parameters
    kwargs = {p: mode for p in ("device_mode", "mode") if p in params}
    previous = os.environ.get("STREAMBOX_DEVICE_MODE")
    os.environ["STREAMBOX_DEVICE_MODE"] = mode
    try:
        backend = EmulatedBackend(spec=spec, state_dir=state / mode, **kwargs)
        rt = backend.open_runtime(0)
    finally:
        if previous is None:
            os.environ.pop("STREAMBOX_DEVICE_MODE", None)
        else:
            os.environ["STREAMBOX_DEVICE_MODE"] = previous
    said = [getattr(o, a, None) for o in (rt, backend) for a in ("device_mode", "mode")]
    said = [str(getattr(v, "value", v)) for v in said if v is not None]
    if said[:1] != [mode] and not (mode == "functional" and not said):
        rt.close()
        return None
    return rt


def _device_words(mode: str) -> str:
    if mode == CUDA_MODE:
        return "CUDA backend, eager torch on the same GPU"
    return f"emulated device, {mode} mode"


def print_mode(mode: str, results: list[dict], repeats: int) -> None:
    if not results:
        return
    rows = [
        [r["model"], r["kernels"], r["eager_ops"], f"{r['eager_us_per_op']:.1f}",
         f"{r['host_us_per_kernel_p50']:.1f}", f"{r['host_us_per_kernel_p90']:.1f}",
         f"{r['host_vs_eager']:.2f}x",
         f"{r['proxy_path_us_per_kernel_p50']:.1f} ({r['proxy_path_vs_host']:.2f}x)",
         f"{r['host_one_by_one_us_per_kernel_p50']:.1f}",
         f"{r['segments_vs_one_by_one']:.2f}x", f"{r['executor_own_us_per_kernel']:.1f}",
         f"{r['issue_while_computing_us_per_kernel_p50']:.1f}", f"{r['eager_ms']:.2f}",
         f"{r['end_to_end_ms']:.2f}", f"{r['end_to_end_vs_eager']:.2f}x"]
        for r in results
    ]
    print_table(
        f"Host time per kernel: plan executor vs eager torch ({_device_words(mode)}, batch 1, small "
        f"inputs, median of {repeats} turns; goal: host p50 <= {GOAL_US:.0f} us and <= {GOAL_RATIO}x eager)",
        ["model", "kernels", "eager ops", "eager us/op (baseline)", "executor host us/kernel p50", "p90",
         "host/eager", "in the proxy's issue path (/ host)", "host, kernel by kernel (same turns)",
         "segments / kernel by kernel",
         "of which the executor's own", "issue us/kernel, device computing", "eager ms",
         "executor end-to-end ms", "end-to-end/eager"],
        rows,
    )


def main() -> int:
    p = parser(__doc__.splitlines()[0])
    p.add_argument("--models", nargs="*", help="zoo models (default: all; --quick: a few)")
    p.add_argument("--repeats", type=int, default=None)
    p.add_argument("--device-mode", choices=(*DEVICE_MODES, CUDA_MODE), action="append",
                   help="emulated device mode(s) to measure (default: every one the device accepts), "
                   "or cuda: the CUDA backend on GPU 0")
    p.add_argument("--torch-out-wrappers", action="store_true",
                   help="kernels call their op's own .out overload, torch's generated functional + copy_ "
                   "where it has no out kernel (the executor before kernel_compiler/native_out.py)")
    args = p.parse_args()
    native_out.ENABLED = not args.torch_out_wrappers
    names = args.models or (QUICK_MODELS if args.quick else sorted(ZOO))
    repeats = args.repeats or (10 if args.quick else 20)
    modes = args.device_mode or list(DEVICE_MODES)
    torch.set_num_threads(1)  # the emulated device computes on one worker thread per stream; be fair
    pool = ModelPool(default_model_pool())
    results, skipped = [], []
    with tempfile.TemporaryDirectory() as state:
        for mode in modes:
            rt = open_runtime(mode, Path(state))
            if rt is None:
                skipped.append(mode)
                continue
            for n in names:
                r = measure(rt, pool, n, get_entry(n).small_input_shape, repeats)
                results.append({"device_mode": mode, **r})
            rt.close()
    for mode in modes:
        print_mode(mode, [r for r in results if r["device_mode"] == mode], repeats)
    for mode in skipped:
        print(f"{mode} mode: not measured, this machine has no such device")
    config = {"quick": args.quick, "repeats": repeats, "models": names, "device_modes": modes,
              "native_out": native_out.ENABLED}
    write_json(args.json, "executor", {**config, "skipped": skipped}, results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
