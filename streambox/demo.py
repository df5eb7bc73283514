"""The README's main job for now: every zoo model through its kernel plan on the configured device.

Per model it prints the plan's kernels, weight bytes, the peak of live intermediate bytes with eager
recycling and without, the device time of one inference, and the largest difference from eager torch.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from rich.console import Console
from rich.table import Table

from streambox.api_proxy.device_tensor import download_tensor, upload_tensor
from streambox.api_proxy.executor import PlanExecutor, StreamPoolAllocator, upload_model
from streambox.config import Config
from streambox.device import Runtime
from streambox.kernel_compiler.model_pool import ModelPool
from streambox.kernel_compiler.zoo import ZOO, build_model, example_input


@dataclass
class ModelReport:
    model: str
    kernels: int
    weight_bytes: int
    peak_eager: int
    peak_no_eager: int
    run_seconds: float
    max_abs_error: float


def run_model(runtime: Runtime, pool: ModelPool, name: str, batch: int) -> ModelReport:
    plan = pool.get_or_lower(name, batch)
    allocator = StreamPoolAllocator(runtime)
    stream = runtime.create_stream()
    model = upload_model(runtime, plan, allocator, stream)
    x = example_input(name, batch)
    device_input = upload_tensor(runtime, x, allocator.allocate, stream)
    peaks = {}
    outputs = {}
    seconds = 0.0
    for eager in (False, True):
        executor = PlanExecutor(runtime, allocator, eager_recycling=eager)
        started = time.perf_counter()
        result = executor.run(model, {plan.inputs[0]: device_input}, stream)
        result.done.synchronize()
        seconds = time.perf_counter() - started
        peaks[eager] = result.stats.peak_live_bytes
        outputs = {k: download_tensor(runtime, v, stream) for k, v in result.outputs.items()}
        for handle in result.outputs.values():
            allocator.free(handle.address, stream)
    with torch.no_grad():
        expected = build_model(name)(x)
    expected_list = list(expected) if isinstance(expected, tuple | list) else [expected]
    error = max(
        (got.double() - want.double()).abs().max().item()
        for got, want in zip(outputs.values(), expected_list, strict=True)
    )
    stream.synchronize()
    stream.destroy()
    allocator.pool.destroy()
    return ModelReport(
        name, len(plan.kernels), plan.weight_bytes, peaks[True], peaks[False], seconds, error
    )


def run_demo(config: Config, models: Sequence[str] | None = None, batch: int = 1) -> int:
    console = Console(width=max(Console().width, 120))  # keep the table readable when piped
    names = list(models) if models else list(ZOO)
    backend = config.open_backend()
    pool = ModelPool(config.model_pool)
    table = Table(title=f"Zoo models through kernel plans ({backend.name} backend, batch {batch})")
    columns = ("model", "kernels", "weights MiB", "peak live MiB, eager recycling",
               "peak live MiB, no recycling", "ratio", "run ms", "max |err| vs torch")
    for column in columns:
        table.add_column(column, justify="left" if column == "model" else "right")
    with backend.open_runtime(0) as runtime:
        for name in names:
            console.print(f"[dim]lowering (or loading) and running {name} ...[/dim]")
            report = run_model(runtime, pool, name, batch)
            table.add_row(
                report.model,
                str(report.kernels),
                f"{report.weight_bytes / 2**20:.1f}",
                f"{report.peak_eager / 2**20:.2f}",
                f"{report.peak_no_eager / 2**20:.2f}",
                f"{report.peak_eager / max(report.peak_no_eager, 1):.2f}",
                f"{report.run_seconds * 1e3:.1f}",
                f"{report.max_abs_error:.1e}",
            )
    console.print(table)
    return 0
