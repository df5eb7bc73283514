"""The emulated GPU in GPU time (issue 12): the kernel cost model against published V100 latencies,
then the device-timing figures (host CPU per modelled GPU-second, two-process link sharing and
time-slicing) from ``benchmarks/device_timing.py``.

Cost model: per zoo model at batch 1 and the zoo's full input shape, the plan's modelled V100 latency
(the sum of its kernels' roofline times on the ``v100-16gb`` preset: ``KernelPlan.kernel_seconds``,
which returns GPU-measured times instead where a calibration table exists) beside every published
batch-1 fp32 PyTorch V100 latency (``kernel_compiler/published_latency.py``; sources in
docs/device.md), with the error (modelled - published) / published. Goal: within 25% for every
published figure. Models without one are listed as such. The H100 column is modelled only.

``--quick`` changes nothing in the cost-model table (it costs no device time, only the first lowering
of each model) and is passed on to ``device_timing``. ``--fit`` reruns the grid search that chose the
V100 preset's floor and efficiencies (the points with the smallest largest error, ties included).
"""

from __future__ import annotations

import itertools
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import parser, print_table, write_json  # noqa: E402
from device_timing import tables as device_timing_tables  # noqa: E402
from device_timing import tables_json  # noqa: E402

from streambox.kernel_compiler import cost_model  # noqa: E402
from streambox.kernel_compiler.calibration import read_calibration  # noqa: E402
from streambox.kernel_compiler.model_pool import ModelPool  # noqa: E402
from streambox.kernel_compiler.published_latency import PUBLISHED, UNPUBLISHED  # noqa: E402
from streambox.kernel_compiler.zoo import ZOO  # noqa: E402

GOAL = 0.25
PRESET = "v100-16gb"


def cost_model_rows(pool: ModelPool) -> list[dict[str, Any]]:
    """One row per (zoo model, published figure); a model without a figure gets one row without."""
    rows = []
    for name in ZOO:
        plan = pool.get_or_lower(name, 1)
        v100_ms = sum(plan.kernel_seconds(PRESET)) * 1e3
        basis = "measured" if read_calibration(plan, PRESET) is not None else "modelled"
        common = {
            "model": name,
            "kernels": sum(k.kind == "compute" for k in plan.kernels),
            "gflop": plan.total_flops / 1e9,
            "v100_ms": v100_ms,
            "v100_basis": basis,
            "h100_ms": sum(plan.kernel_seconds("h100-80gb")) * 1e3,
        }
        figures = [p for p in PUBLISHED if p.model == name]
        for p in figures:
            rows.append({
                **common,
                "published_ms": p.ms,
                "error": (v100_ms - p.ms) / p.ms,
                "published_on": f"{p.gpu}, {p.framework}",
                "source": p.source,
            })
        if not figures:
            rows.append({**common, "published_ms": None, "error": None,
                         "published_on": UNPUBLISHED.get(name, "none found"), "source": ""})
    return rows


def print_cost_model(rows: list[dict[str, Any]]) -> None:
    table = []
    for r in rows:
        published = "-" if r["published_ms"] is None else f"{r['published_ms']:.2f}"
        error = "-" if r["error"] is None else f"{r['error']:+.0%}"
        table.append([
            r["model"], r["kernels"], f"{r['gflop']:.2f}", f"{r['v100_ms']:.2f} ({r['v100_basis']})",
            published, error, f"{r['h100_ms']:.2f}", r["published_on"],
        ])
    print_table(
        "Kernel cost model: V100 batch-1 latency, modelled (roofline + launch floor, v100-16gb preset) "
        "against published (fp32 PyTorch)",
        ["model", "kernels", "GFLOP", "V100 ms", "published ms", "error", "H100 ms (modelled)",
         "published on / why none"],
        table,
    )
    errors = [abs(r["error"]) for r in rows if r["error"] is not None]
    within = sum(e <= GOAL for e in errors)
    print(f"cost model: {within}/{len(errors)} published figures within {GOAL:.0%} "
          f"(largest error {max(errors):.0%}); models without a published figure: "
          f"{', '.join(sorted({r['model'] for r in rows if r['error'] is None}))}")


#: The grid of the V100 fit: launch floor (s), conv and matmul efficiency, bandwidth efficiency.
GRID = (
    (10e-6, 15e-6, 20e-6, 25e-6, 30e-6, 35e-6, 40e-6),
    (0.15, 0.18, 0.20, 0.22, 0.25, 0.30),
    (0.1, 0.2, 0.3, 0.5),
    (0.30, 0.40, 0.50, 0.60, 0.75),
)


def fit_v100(pool: ModelPool, best: int = 8) -> list[list[Any]]:
    """Grid points ordered by their largest relative error against the published figures."""
    models = {p.model for p in PUBLISHED}
    costs = {m: [cost_model.cost_of(k) for k in pool.get_or_lower(m, 1).kernels] for m in models}
    base = cost_model.V100_PCIE_16GB
    scored = []
    for floor, conv, matmul, bw in itertools.product(*GRID):
        efficiency = {**base.efficiency, "conv": conv, "matmul": matmul}
        gpu = replace(base, launch_floor_s=floor, efficiency=efficiency, bw_efficiency=bw)
        errors = [abs(sum(map(gpu.seconds, costs[p.model])) * 1e3 - p.ms) / p.ms for p in PUBLISHED]
        scored.append([f"{max(errors):.1%}", f"{floor * 1e6:.0f}", conv, matmul, bw])
    scored.sort(key=lambda row: float(row[0].rstrip("%")))
    return scored[:best]


def main() -> None:
    p = parser(__doc__.split("\n\n")[0])
    p.add_argument("--fit", action="store_true", help="rerun the grid search of the V100 calibration")
    args = p.parse_args()
    pool = ModelPool()
    rows = cost_model_rows(pool)
    print_cost_model(rows)
    if args.fit:
        print_table("V100 fit: grid points by largest error against the published figures",
                    ["largest error", "floor us", "conv", "matmul", "bw"], fit_v100(pool))

    timing = device_timing_tables(args.quick)
    for title, columns, table in timing:
        print_table(title, columns, table)
    write_json(
        args.json,
        "bench_device",
        {"quick": args.quick, "preset": PRESET, "goal": GOAL},
        {"cost_model": rows, "device_timing": tables_json(timing)},
    )


if __name__ == "__main__":
    main()
