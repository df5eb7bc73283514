"""Host time per kernel of the plan executor against eager torch's own per-op time, per zoo model.

Both figures are "wall time of the calling thread per operation, median over runs, in one process":

- eager torch (the baseline): `module(x)` on the CPU, one thread, divided by the aten ops it dispatches
  (counted once with a dispatch mode). On the CPU an eager op returns when it has computed, so this
  includes its compute; the inputs are the zoo's small ones, where dispatch dominates.
- the executor's host time: `PlanExecutor.run` of a warm instance through the runtime's memory pool
  (`DeviceMemoryPool`, as in the proxy), from the call until it returns with every kernel issued
  (lazy allocation, access counting, eager recycling, launch), divided by the compute kernels. This
  is what a GPU waits on. On the emulated device the ops themselves (and torch's dispatch of them)
  run on the stream's worker thread, so they are not in this figure; the CUDA backend dispatches them
  on the issuing thread, inside `launch`.
- the executor end to end: the same run until its `done` event, i.e. issue plus the emulated device
  running every op on the CPU (functional mode) or for its modelled time (timed mode).

`--device-mode functional|timed` (default: both, where the device accepts timed mode).
"""

from __future__ import annotations

import inspect
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import parser, print_table, write_json  # noqa: E402

from streambox.api_proxy.device_tensor import upload_tensor  # noqa: E402
from streambox.api_proxy.executor import PlanExecutor, free_model, upload_model  # noqa: E402
from streambox.config import default_model_pool  # noqa: E402
from streambox.device import Runtime  # noqa: E402
from streambox.device.emulated import EmulatedBackend  # noqa: E402
from streambox.device.specs import V100_16GB  # noqa: E402
from streambox.kernel_compiler.model_pool import ModelPool  # noqa: E402
from streambox.kernel_compiler.zoo import ZOO, build_model, example_input, get_entry  # noqa: E402
from streambox.memory_pool.pool import DeviceMemoryPool  # noqa: E402

QUICK_MODELS = ["alexnet", "resnet18", "mobilenet_v3_small"]
DEVICE_MODES = ("functional", "timed")
GOAL_US, GOAL_RATIO = 15.0, 1.5  # docs/api_proxy.md: host time per kernel, absolute and vs eager


class _OpCounter(TorchDispatchMode):
    """Counts the aten ops eager torch dispatches (below autograd, as the plan's kernels are)."""

    def __init__(self) -> None:
        super().__init__()
        self.ops = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        self.ops += 1
        return func(*args, **(kwargs or {}))


def measure(rt: Runtime, pool: ModelPool, name: str, shape: tuple[int, ...] | None, repeats: int) -> dict:
    """Eager torch and a warm executor instance (one stream, the runtime's memory pool, fm: lazy +
    eager), run by turns so that both see the same load on the machine."""
    module = build_model(name).eval()
    x = example_input(name, 1, shape)
    with torch.no_grad(), _OpCounter() as counter:
        module(x)
    plan = pool.get_or_lower(name, 1, shape)
    mem = DeviceMemoryPool(rt)
    stream = rt.create_stream()
    model = upload_model(rt, plan, mem, stream)
    handle = upload_tensor(rt, x, mem.allocate, stream)
    executor = PlanExecutor(rt, mem)
    eager, issue, end_to_end = [], [], []
    for i in range(repeats + 2):  # two warm-up rounds
        started = time.perf_counter()
        with torch.no_grad():
            module(x)
        eager_s = time.perf_counter() - started
        started = time.perf_counter()
        result = executor.run(model, {plan.inputs[0]: handle}, stream, instance="f1")
        result.done.synchronize()
        end_to_end_s = time.perf_counter() - started
        mem.free_many([t.address for t in result.outputs.values()], stream)
        if i >= 2:
            eager.append(eager_s)
            issue.append(result.stats.issue_seconds)
            end_to_end.append(end_to_end_s)
    binds = executor.calls_bound("f1")
    executor.release_instance("f1")
    mem.free(handle.address, stream)
    free_model(model, mem, stream)
    mem.drain()
    stream.destroy()
    mem.close()
    kernels = sum(k.kind != "view" for k in plan.kernels)
    eager_us = statistics.median(eager) / counter.ops * 1e6
    host_us = statistics.median(issue) / kernels * 1e6
    end_to_end_us = statistics.median(end_to_end) / kernels * 1e6
    return {
        "model": name,
        "kernels": kernels,
        "eager_ops": counter.ops,
        "eager_ms": statistics.median(eager) * 1e3,
        "eager_us_per_op": eager_us,
        "host_us_per_kernel_p50": host_us,
        "host_us_per_kernel_p90": statistics.quantiles(issue, n=10)[-1] / kernels * 1e6,
        "host_vs_eager": host_us / eager_us,
        "end_to_end_ms": statistics.median(end_to_end) * 1e3,
        "end_to_end_us_per_kernel": end_to_end_us,
        "end_to_end_vs_eager": end_to_end_us / eager_us,
        "calls_bound": binds,
    }


def open_runtime(mode: str, state: Path) -> Runtime | None:
    """An emulated device in `mode`, or None when this device build has no such mode."""
    spec = V100_16GB.with_overrides(context_create_s=0.0)
    params = inspect.signature(EmulatedBackend).parameters
    option = next((p for p in ("device_mode", "mode") if p in params), None)
    if option is None and mode != "functional":
        return None
    previous = os.environ.get("STREAMBOX_DEVICE_MODE")
    os.environ["STREAMBOX_DEVICE_MODE"] = mode
    try:
        kwargs = {option: mode} if option is not None else {}
        return EmulatedBackend(spec=spec, state_dir=state / mode, **kwargs).open_runtime(0)
    finally:
        if previous is None:
            os.environ.pop("STREAMBOX_DEVICE_MODE", None)
        else:
            os.environ["STREAMBOX_DEVICE_MODE"] = previous


def print_mode(mode: str, results: list[dict], repeats: int) -> None:
    if not results:
        return
    rows = [
        [r["model"], r["kernels"], r["eager_ops"], f"{r['eager_ms']:.2f}", f"{r['eager_us_per_op']:.1f}",
         f"{r['host_us_per_kernel_p50']:.1f}", f"{r['host_us_per_kernel_p90']:.1f}",
         f"{r['host_vs_eager']:.2f}x", f"{r['end_to_end_ms']:.2f}", f"{r['end_to_end_us_per_kernel']:.1f}",
         f"{r['end_to_end_vs_eager']:.2f}x"]
        for r in results
    ]
    print_table(
        f"Host time per kernel: plan executor vs eager torch (emulated device, {mode} mode, batch 1, small "
        f"inputs, median of {repeats} turns; goal: host p50 <= {GOAL_US:.0f} us and <= {GOAL_RATIO}x eager)",
        ["model", "kernels", "eager ops", "eager ms", "eager us/op (baseline)", "executor host us/kernel p50",
         "p90", "host/eager", "executor end-to-end ms", "us/kernel", "end-to-end/eager"],
        rows,
    )


def main() -> int:
    p = parser(__doc__.splitlines()[0])
    p.add_argument("--models", nargs="*", help="zoo models (default: all; --quick: a few)")
    p.add_argument("--repeats", type=int, default=None)
    p.add_argument("--device-mode", choices=DEVICE_MODES, action="append",
                   help="emulated device mode(s) to measure (default: every one the device accepts)")
    args = p.parse_args()
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
        print(f"{mode} mode: not measured, this emulated device has no such mode")
    config = {"quick": args.quick, "repeats": repeats, "models": names, "device_modes": modes}
    write_json(args.json, "executor", {**config, "skipped": skipped}, results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
