"""Issue CPU per run by pool mode: what lazy allocation and eager recycling (fm) cost the issuing
thread against `static` (every variable allocated up front, freed in one batch at the end).

One `ProxyMemory` per mode on one timed emulated V100 (kernels take their modelled GPU time, so the
device does not compete for the CPU), a warm instance per mode, the zoo's small inputs, the modes'
runs alternating turn by turn. The figure is the calling thread's CPU time (`time.thread_time`)
from `infer` until it returns with every kernel issued: on a shared machine CPU time moves far less
with the load than wall time. Baseline: `static` in the same run.
"""

from __future__ import annotations

import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import parser, print_table, write_json  # noqa: E402
from bench_executor import open_runtime  # noqa: E402

from streambox.api_proxy.device_tensor import upload_tensor  # noqa: E402
from streambox.api_proxy.proxy_memory import MemoryOptions, ProxyMemory  # noqa: E402
from streambox.config import default_model_pool  # noqa: E402
from streambox.kernel_compiler.model_pool import ModelPool  # noqa: E402
from streambox.kernel_compiler.zoo import example_input, get_entry  # noqa: E402

MODES = ("static", "fm", "fm+rs")
QUICK_MODELS = ["ssdlite320_mobilenet_v3", "resnet50", "vgg16"]
WARMUP = 5


def measure(name: str, turns: int, state: Path) -> dict[str, float]:
    """Median issue CPU seconds per run of `name`, per mode."""
    rt = open_runtime("timed", state)
    shape = get_entry(name).small_input_shape
    plan = ModelPool(default_model_pool()).get_or_lower(name, 1, shape)
    x = example_input(name, 1, shape)
    setups = []
    for mode in MODES:
        memory = ProxyMemory(rt, MemoryOptions(mode=mode, profiles=False)).start()
        stream = rt.create_stream()
        setups.append((mode, memory, stream, upload_tensor(rt, x, memory.allocator.allocate, stream), []))
    try:
        for turn in range(WARMUP + turns):
            for _, memory, stream, handle, samples in setups:
                started = time.thread_time()
                result = memory.infer("f", plan, {plan.inputs[0]: handle}, stream)
                issued = time.thread_time()
                result.done.synchronize()
                memory.allocator.free_many([t.address for t in result.outputs.values()], stream)
                if turn >= WARMUP:
                    samples.append(issued - started)
    finally:
        for _, memory, _, _, _ in setups:
            memory.close()
        rt.close()
    return {mode: statistics.median(samples) for mode, _, _, _, samples in setups}


def main() -> int:
    p = parser(__doc__.splitlines()[0])
    p.add_argument("--models", nargs="*", help=f"zoo models (default: {' '.join(QUICK_MODELS)})")
    args = p.parse_args()
    names = args.models or QUICK_MODELS
    turns = 10 if args.quick else 30
    results = []
    with tempfile.TemporaryDirectory() as state:
        for name in names:
            cpu = measure(name, turns, Path(state))
            results.append({"model": name, **{f"{m}_cpu_ms": s * 1e3 for m, s in cpu.items()}})
    rows = [
        [r["model"], *(f"{r[f'{m}_cpu_ms']:.2f}" for m in MODES),
         *(f"{r[f'{m}_cpu_ms'] / r['static_cpu_ms']:.2f}x" for m in MODES[1:])]
        for r in results
    ]
    print_table(
        f"Issue CPU ms per run by pool mode (timed emulated V100, small inputs, median of {turns} "
        "alternating turns; baseline: static)",
        ["model", *MODES, *(f"{m} / static" for m in MODES[1:])],
        rows,
    )
    write_json(args.json, "pool_mode_cpu", {"quick": args.quick, "turns": turns, "models": names}, results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
