"""Offline preparation cost (paper Sec. 9.3, Fig. 18(c)): kernel compilation and profiling per model.

Paper: on average about 4 s to transform a model's kernels to PTB mode and 36 s of offline profiling.

Per zoo model this measures, in a fresh temporary model pool:

- compilation with ``compile_model``: frontend (torch.export + Relax import + legalisation + dlight
  schedules), the PTB rewrite of every kernel on its own (the paper's "transformation"), lowering and
  CUDA code generation, and nvcc (PTX + cubin) -- wall seconds, and CPU seconds including nvcc;
- profiling: for each batch size, lowering the plan with its memory profile
  (``ModelPool.get_or_lower``) and the profiled run that stores kernel run times
  (``api_proxy.profiling.profile_on_device``, one repeat, on the emulated V100).

The machine's load average is printed: on a shared machine wall seconds follow the load, CPU seconds
much less. ``--quick``: three models at small inputs and batches {1, 2}. Needs apache-tvm.
"""

from __future__ import annotations

import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import parser, print_table, write_json  # noqa: E402

from streambox.kernel_compiler.model_pool import ModelPool  # noqa: E402
from streambox.kernel_compiler.zoo import ZOO  # noqa: E402

PAPER_TRANSFORM_S = 4.0
PAPER_PROFILING_S = 36.0
QUICK = {"espcn": (3, 16, 16), "text_encoder": (16,), "mobilenet_v3_small": (3, 32, 32)}


def _profile(root: Path, model: str, batches: list[int], shape: tuple[int, ...]) -> tuple[float, str]:
    """Seconds to lower + memory-profile the plan and time its kernels once, summed over batches."""
    pool = ModelPool(root)
    try:
        from streambox.api_proxy.profiling import profile_on_device
        from streambox.device.emulated import EmulatedBackend
    except ImportError as exc:  # another subsystem's module; lowering alone still counts
        profile_on_device, why = None, f"lowering only ({exc})"
    else:
        why = "lowering + memory profile + emulated profiled run"
    started = time.perf_counter()
    if profile_on_device is None:
        for b in batches:
            pool.get_or_lower(model, b, shape)
    else:
        with EmulatedBackend(state_dir=root / "emu") as backend:
            rt = backend.open_runtime(0)
            for b in batches:
                pool.get_or_lower(model, b, shape)
                profile_on_device(pool, rt, model, b, shape, repeats=1)
            rt.close()
    return time.perf_counter() - started, why


def main() -> None:
    p = parser(__doc__.split("\n\n")[0])
    p.add_argument("--arch", default="sm_90")
    p.add_argument("--models", nargs="*", help="zoo models (default: all; --quick: three small ones)")
    p.add_argument("--batches", type=int, nargs="*", help="profiling batch sizes (default 1 4 8; quick 1 2)")
    p.add_argument("--no-nvcc", action="store_true", help="skip nvcc (source only)")
    p.add_argument("--no-profiling", action="store_true")
    args = p.parse_args()

    from streambox.kernel_compiler.tvm_compile import compile_model

    if args.quick:
        models = {m: QUICK.get(m, ZOO[m].small_input_shape) for m in (args.models or QUICK)}
        batches = args.batches or [1, 2]
    else:
        models = {m: ZOO[m].input_shape for m in (args.models or ZOO)}
        batches = args.batches or [1, 4, 8]
    print(f"load average before: {os.getloadavg()}, {os.cpu_count()} CPUs")

    rows, results = [], []
    with tempfile.TemporaryDirectory(prefix="bench-compile-") as tmp:
        for model, shape in models.items():
            root = Path(tmp) / model
            # the plan first, so that compile_model's own "plan" step is not counted as compilation
            ModelPool(root / "compile").get_or_lower(model, 1, shape)
            r = compile_model(
                model, args.arch, root / "compile", 1, shape, nvcc=False if args.no_nvcc else None
            )
            prof_s, prof_how = (
                (0.0, "skipped") if args.no_profiling else _profile(root / "prof", model, batches, shape)
            )
            cpu = r.cpu_seconds
            compile_cpu = sum(cpu.get(k, 0.0) for k in ("frontend", "ptb", "codegen", "nvcc"))
            rec = {
                "model": model,
                "input_shape": list(shape),
                "prim_funcs": r.prim_funcs,
                "kernels": r.kernels,
                "frontend_s": r.frontend_s,
                "ptb_s": r.ptb_s,
                "codegen_s": r.codegen_s,
                "nvcc_s": r.nvcc_s,
                "compile_s": r.compile_s,
                "compile_cpu_s": compile_cpu,
                "cpu_seconds": cpu,
                "timings": r.timings,
                "source_bytes": r.source_bytes,
                "image_bytes": r.image_bytes,
                "profiling_s": prof_s,
                "profiling": prof_how,
                "profiling_batches": batches,
            }
            results.append(rec)
            rows.append(
                [
                    model,
                    "x".join(map(str, shape)),
                    f"{r.prim_funcs}/{r.kernels}",
                    f"{r.frontend_s:.1f}",
                    f"{r.ptb_s:.2f}",
                    f"{r.codegen_s:.1f}",
                    f"{r.nvcc_s:.1f}" if not r.nvcc_skipped else "-",
                    f"{r.compile_s:.1f}",
                    f"{compile_cpu:.1f}",
                    f"{prof_s:.1f}",
                ]
            )
            print(r.summary(), f"; profiling {prof_s:.1f} s ({prof_how})", flush=True)

    def mean(key: str) -> float:
        return statistics.mean(rec[key] for rec in results)

    rows.append(
        [
            "mean",
            "",
            "",
            f"{mean('frontend_s'):.1f}",
            f"{mean('ptb_s'):.2f}",
            f"{mean('codegen_s'):.1f}",
            f"{mean('nvcc_s'):.1f}",
            f"{mean('compile_s'):.1f}",
            f"{mean('compile_cpu_s'):.1f}",
            f"{mean('profiling_s'):.1f}",
        ]
    )
    rows.append(
        ["paper (mean)", "", "", "", f"{PAPER_TRANSFORM_S:.0f}", "", "", "", "", f"{PAPER_PROFILING_S:.0f}"]
    )
    print_table(
        f"Offline preparation, {args.arch} (seconds; profiling over batches {batches})",
        [
            "model",
            "input",
            "PrimFuncs/kernels",
            "frontend",
            "PTB pass",
            "lower+codegen",
            "nvcc",
            "compile (wall)",
            "compile (CPU)",
            "profiling",
        ],
        rows,
    )
    print(f"load average after: {os.getloadavg()}")
    summary = {
        "mean_ptb_pass_s": mean("ptb_s"),
        "mean_compile_s": mean("compile_s"),
        "mean_compile_cpu_s": mean("compile_cpu_s"),
        "mean_profiling_s": mean("profiling_s"),
        "paper_transform_s": PAPER_TRANSFORM_S,
        "paper_profiling_s": PAPER_PROFILING_S,
    }
    write_json(
        args.json,
        "compile",
        {
            "quick": args.quick,
            "arch": args.arch,
            "models": {m: list(s) for m, s in models.items()},
            "batches": batches,
        },
        {"models": results, "summary": summary, "load_average_end": os.getloadavg()},
    )


if __name__ == "__main__":
    main()
