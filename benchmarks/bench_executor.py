"""The plan executor against eager torch, per zoo model: the cost of running kernel by kernel.

Both run the same torch CPU ops; the executor adds lazy allocation from the device pool, access
counting, eager recycling and a hand-over of each kernel to the emulated stream's worker thread.
The figure of merit is the overhead per kernel: (executor - eager) / kernels. Emulated device.
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import median_seconds, parser, print_table, write_json  # noqa: E402

from streambox.api_proxy.device_tensor import upload_tensor  # noqa: E402
from streambox.api_proxy.executor import PlanExecutor, StreamPoolAllocator, upload_model  # noqa: E402
from streambox.config import default_model_pool  # noqa: E402
from streambox.device import Runtime  # noqa: E402
from streambox.device.emulated import EmulatedBackend  # noqa: E402
from streambox.device.specs import V100_16GB  # noqa: E402
from streambox.kernel_compiler.model_pool import ModelPool  # noqa: E402
from streambox.kernel_compiler.zoo import ZOO, build_model, example_input, get_entry  # noqa: E402

QUICK_MODELS = ["alexnet", "resnet18", "mobilenet_v3_small"]


def measure(rt: Runtime, pool: ModelPool, name: str, shape: tuple[int, ...] | None, repeats: int) -> dict:
    """Median seconds of one inference, eager torch and through the plan executor."""
    plan = pool.get_or_lower(name, 1, shape)
    module = build_model(name)
    x = example_input(name, 1, shape)
    allocator = StreamPoolAllocator(rt)
    stream = rt.create_stream()
    model = upload_model(rt, plan, allocator, stream)
    handle = upload_tensor(rt, x, allocator.allocate, stream)
    executor = PlanExecutor(rt, allocator)

    def run_plan() -> None:
        result = executor.run(model, {plan.inputs[0]: handle}, stream)
        result.done.synchronize()
        for out in result.outputs.values():
            allocator.free(out.address, stream)

    def run_eager() -> None:
        with torch.no_grad():
            module(x)

    eager = median_seconds(run_eager, repeats)
    planned = median_seconds(run_plan, repeats)
    stream.synchronize()
    stream.destroy()
    allocator.pool.destroy()
    kernels = sum(k.kind != "view" for k in plan.kernels)
    return {"model": name, "input_shape": list(x.shape), "kernels": kernels, "eager_s": eager,
            "executor_s": planned, "ratio": planned / eager,
            "overhead_per_kernel_us": (planned - eager) / kernels * 1e6}


def main() -> int:
    p = parser(__doc__.splitlines()[0])
    p.add_argument("--models", nargs="*", help="zoo models (default: all; --quick: a few, small inputs)")
    p.add_argument("--repeats", type=int, default=None)
    args = p.parse_args()
    names = args.models or (QUICK_MODELS if args.quick else sorted(ZOO))
    repeats = args.repeats or (3 if args.quick else 10)
    torch.set_num_threads(1)  # the executor's kernels run on one worker thread per stream; be fair
    spec = V100_16GB.with_overrides(context_create_s=0.0)
    pool = ModelPool(default_model_pool())
    with tempfile.TemporaryDirectory() as state:
        rt = EmulatedBackend(spec=spec, state_dir=Path(state)).open_runtime(0)
        results = [
            measure(rt, pool, name, get_entry(name).small_input_shape if args.quick else None, repeats)
            for name in names
        ]
        rt.close()
    rows = [
        [r["model"], r["kernels"], f"{r['eager_s'] * 1e3:.2f}", f"{r['executor_s'] * 1e3:.2f}",
         f"{r['ratio']:.2f}x", f"{r['overhead_per_kernel_us']:.1f}"]
        for r in results
    ]
    print_table(
        "Plan executor vs eager torch (emulated device, batch 1, median of runs)",
        ["model", "kernels", "eager torch ms (baseline)", "executor ms", "executor/eager",
         "overhead us/kernel"],
        rows,
    )
    write_json(args.json, "executor", {"quick": args.quick, "repeats": repeats, "models": names}, results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
