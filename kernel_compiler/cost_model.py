"""The kernel cost model: what each kernel of a plan costs, and how long it runs on a GPU preset.

At lowering every kernel gets a `KernelCost`: its FLOPs, counted by `torch.utils.flop_counter`
running the kernel's op on meta tensors with the plan's real shapes (no hand-written formulas; ops the
counter has no formula for, elementwise and reductions, count 0 and are bandwidth-bound anyway), the
bytes it reads (its argument variables, a view counted by the span it covers) and writes (its
outputs), and its op class. View kernels cost nothing.

The modelled duration of a kernel on a preset is a roofline plus a launch floor::

    launch_floor_s + max(flops / (peak_flops * efficiency[op_class]),
                         bytes / (mem_bandwidth * bw_efficiency))

The shape follows Vidur's execution-time predictor (per-operation-class predictions per device, with
the host-side overheads kept apart), with a roofline instead of a learned regressor, and a table
measured on the GPU overriding the model where one exists (`calibration.py`). The constants below are
the presets' public peak figures and efficiencies calibrated against published V100 latencies
(docs/device.md, "Kernel cost model").
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace
from types import MappingProxyType
from typing import TYPE_CHECKING, Any

import torch
from torch.utils.flop_counter import FlopCounterMode, flop_registry

from . import argcodec
from .argcodec import DeviceArg, VarRef

if TYPE_CHECKING:
    from .plan import Kernel, KernelPlan, VarSpec

OP_CLASSES = ("conv", "matmul", "elementwise", "reduction", "pooling", "copy", "other", "view")

# By the op packet of a kernel's functional (source) op. An op missing here (a custom op, or an op of a
# model the table was not written for) is `other`: costed by its bytes and any FLOPs the counter
# finds. The tests check that every zoo model's ops are classed here.
_OP_CLASS: Mapping[str, str] = MappingProxyType(
    {
        **dict.fromkeys(("convolution", "_convolution"), "conv"),
        **dict.fromkeys(("mm", "addmm", "bmm", "baddbmm"), "matmul"),
        **dict.fromkeys(
            (
                "add", "sub", "mul", "div", "relu", "clamp", "hardtanh", "tanh", "sigmoid", "gelu",
                "hardswish", "hardsigmoid", "silu", "neg", "exp", "sqrt", "rsqrt", "pow", "where",
                "maximum", "minimum", "erf", "log", "abs", "leaky_relu", "_softmax_backward_data",
            ),
            "elementwise",
        ),
        **dict.fromkeys(
            (
                "_native_batch_norm_legit_no_training", "native_batch_norm", "native_layer_norm",
                "native_group_norm", "_softmax", "_log_softmax", "mean", "sum", "amax", "amin", "var",
                "argmax", "max", "min", "prod",
            ),
            "reduction",
        ),
        **dict.fromkeys(
            ("max_pool2d_with_indices", "avg_pool2d", "_adaptive_avg_pool2d", "adaptive_max_pool2d",
             "_adaptive_avg_pool3d", "max_pool3d_with_indices", "avg_pool3d"),
            "pooling",
        ),
        **dict.fromkeys(
            ("clone", "_to_copy", "copy", "cat", "embedding", "constant_pad_nd", "index", "gather",
             "index_select", "full", "zeros", "ones", "empty", "scalar_tensor", "arange", "fill",
             "pixel_shuffle", "pixel_unshuffle", "repeat", "stack", "split_with_sizes_copy"),
            "copy",
        ),
    }
)


class UnknownPreset(KeyError):
    """A preset name the cost model has no constants for; the message lists the known ones."""

    def __str__(self) -> str:
        return str(self.args[0])


def op_packet(op_name: str) -> str:
    """``"aten.convolution.default"`` -> ``"convolution"``."""
    parts = op_name.split(".")
    if len(parts) != 3:
        raise ValueError(f"not an op overload name (namespace.packet.overload): {op_name!r}")
    return parts[1]


def op_class(kernel: Kernel) -> str:
    """The cost class of a kernel: ``view`` for view kernels, else by its source op."""
    if kernel.kind == "view":
        return "view"
    return _OP_CLASS.get(op_packet(kernel.source_op or kernel.op), "other")


# --- per-kernel costs ------------------------------------------------------------------------------


@dataclass(frozen=True)
class KernelCost:
    """What one kernel does: FLOPs (as counted by torch's flop counter) and bytes moved."""

    op_class: str
    flops: int
    bytes_read: int
    bytes_written: int

    @property
    def bytes(self) -> int:
        return self.bytes_read + self.bytes_written


def _span_bytes(var: VarSpec) -> int:
    """Bytes a variable covers in memory (a view: the span of its own shape and strides)."""
    if any(n == 0 for n in var.shape):
        return 0
    span = 1 + sum((n - 1) * st for n, st in zip(var.shape, var.strides, strict=True))
    return span * var.torch_dtype.itemsize


def _meta_args(value: Any, variables: Mapping[str, VarSpec]) -> Any:
    if isinstance(value, VarRef):
        v = variables[value.name]
        return torch.empty_strided(v.shape, v.strides, dtype=v.torch_dtype, device="meta")
    if isinstance(value, list):
        return [_meta_args(x, variables) for x in value]
    if isinstance(value, DeviceArg):
        return torch.device("meta")
    return value


def count_flops(kernel: Kernel, variables: Mapping[str, VarSpec]) -> int:
    """FLOPs of a compute kernel: its functional op run on meta tensors of the argument shapes
    under `FlopCounterMode`. Ops without a counter formula are 0 without running anything."""
    from .ops import resolve_op  # ops imports plan, which imports this module lazily

    op = resolve_op(kernel.source_op or kernel.op)
    if kernel.kind == "view" or op.overloadpacket not in flop_registry:
        return 0
    args = _meta_args(argcodec.decode(kernel.args), variables)
    out_args = set(kernel.out_args)
    kwargs = {
        k: _meta_args(argcodec.decode(v), variables) for k, v in kernel.kwargs.items() if k not in out_args
    }
    with FlopCounterMode(display=False) as counter:
        op(*args, **kwargs)
    return int(counter.get_total_flops())


def kernel_cost(kernel: Kernel, variables: Mapping[str, VarSpec]) -> KernelCost:
    """The cost of one kernel of a plan whose variables are `variables`."""
    cls = op_class(kernel)
    if cls == "view":
        return KernelCost("view", 0, 0, 0)
    read_names = argcodec.var_names(kernel.args) + argcodec.var_names(list(kernel.kwargs.values()))
    reads = sum(_span_bytes(variables[n]) for n in dict.fromkeys(read_names) if n not in kernel.outputs)
    writes = sum(_span_bytes(variables[n]) for n in kernel.outputs)
    return KernelCost(cls, count_flops(kernel, variables), reads, writes)


def annotate_costs(plan: KernelPlan) -> KernelPlan:
    """Fill every kernel's cost fields in place (at lowering, or for a plan saved without them)."""
    for kernel in plan.kernels:
        cost = kernel_cost(kernel, plan.variables)
        kernel.op_class = cost.op_class
        kernel.flops = cost.flops
        kernel.bytes_read = cost.bytes_read
        kernel.bytes_written = cost.bytes_written
    return plan


def cost_of(kernel: Kernel) -> KernelCost:
    return KernelCost(kernel.op_class, kernel.flops, kernel.bytes_read, kernel.bytes_written)


# --- presets ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class GpuPreset:
    """A GPU's roofline: fp32 peak FLOP/s (CUDA cores: no tensor cores in fp32 inference), memory
    bandwidth, the fraction of each reached by kernels of each op class, and a per-kernel floor
    (launch latency plus the framework's per-op dispatch in the published eager-mode latencies)."""

    name: str
    gpu: str
    peak_flops: float
    mem_bandwidth: float
    launch_floor_s: float
    efficiency: Mapping[str, float]
    bw_efficiency: float
    sources: tuple[str, ...] = field(default=())

    def __post_init__(self) -> None:
        missing = [c for c in OP_CLASSES if c != "view" and c not in self.efficiency]
        if missing:
            raise ValueError(f"preset {self.name}: no efficiency for op classes {missing}")
        bad = {c: e for c, e in self.efficiency.items() if not 0 < e <= 1}
        if bad or not 0 < self.bw_efficiency <= 1:
            got = bad or self.bw_efficiency
            raise ValueError(f"preset {self.name}: efficiencies must be in (0, 1], got {got}")

    def seconds(self, cost: KernelCost) -> float:
        """Modelled seconds of one kernel on this GPU (0 for views)."""
        if cost.op_class == "view":
            return 0.0
        compute = cost.flops / (self.peak_flops * self.efficiency[cost.op_class])
        memory = cost.bytes / (self.mem_bandwidth * self.bw_efficiency)
        return self.launch_floor_s + max(compute, memory)


# The V100 preset's efficiencies and floor: a grid search minimising the largest relative error against
# the published batch-1 fp32 PyTorch latencies in docs/device.md ("Kernel cost model"; reproduced by
# benchmarks/bench_device.py). Only the FLOP-counted classes (conv, matmul) use their efficiency; at
# batch 1 the linear layers are GEMVs bound by reading their weights, so `matmul` barely matters there.
_V100_EFFICIENCY = MappingProxyType(
    {
        "conv": 0.20,
        "matmul": 0.30,
        "elementwise": 1.0,
        "reduction": 1.0,
        "pooling": 1.0,
        "copy": 1.0,
        "other": 1.0,
    }
)

V100_PCIE_16GB = GpuPreset(
    name="v100-16gb",
    gpu="Tesla V100-PCIE-16GB",
    peak_flops=14e12,
    mem_bandwidth=900e9,
    launch_floor_s=30e-6,
    efficiency=_V100_EFFICIENCY,
    bw_efficiency=0.30,
    sources=(
        "NVIDIA Tesla V100 datasheet (PCIe: 14 TFLOP/s single precision, 900 GB/s HBM2): "
        "https://images.nvidia.com/content/technologies/volta/pdf/tesla-volta-v100-datasheet-letter-fnl-web.pdf",
    ),
)


def _with_v100_efficiencies(
    name: str, gpu: str, peak_flops: float, mem_bandwidth: float, source: str
) -> GpuPreset:
    """A preset with no published figures to calibrate against: the V100's efficiencies and floor.
    `make gpu-check` on such a GPU measures its real per-kernel times, which then override these."""
    return replace(
        V100_PCIE_16GB,
        name=name,
        gpu=gpu,
        peak_flops=peak_flops,
        mem_bandwidth=mem_bandwidth,
        sources=(source,),
    )


H100_SXM_80GB = _with_v100_efficiencies(
    "h100-80gb",
    "NVIDIA H100 80GB HBM3",
    67e12,
    3.35e12,
    "NVIDIA H100 Tensor Core GPU datasheet (SXM: 67 TFLOP/s FP32, 3.35 TB/s HBM3): "
    "https://resources.nvidia.com/en-us-tensor-core/nvidia-tensor-core-gpu-datasheet",
)
H200_SXM_141GB = _with_v100_efficiencies(
    "h200-141gb",
    "NVIDIA H200",
    67e12,
    4.8e12,
    "NVIDIA H200 Tensor Core GPU datasheet (SXM: 67 TFLOP/s FP32, 4.8 TB/s HBM3e): "
    "https://www.nvidia.com/en-us/data-center/h200/",
)

PRESETS: Mapping[str, GpuPreset] = MappingProxyType(
    {p.name: p for p in (V100_PCIE_16GB, H100_SXM_80GB, H200_SXM_141GB)}
)

# Device names (as the CUDA driver or the emulated device spec spell them) -> preset, first match wins.
_NAME_PATTERNS = (("v100", "v100-16gb"), ("h100", "h100-80gb"), ("h200", "h200-141gb"))


def get_preset(name: str) -> GpuPreset:
    try:
        return PRESETS[name.lower()]
    except KeyError:
        raise UnknownPreset(
            f"no cost-model preset {name!r}; known presets: {', '.join(sorted(PRESETS))}"
        ) from None


def preset_for_device(device_name: str) -> str | None:
    """The preset modelling a device called `device_name` (e.g. ``Tesla V100-PCIE-16GB``), or None."""
    lowered = device_name.lower()
    return next((preset for pattern, preset in _NAME_PATTERNS if pattern in lowered), None)


def modelled_seconds(costs: Iterable[KernelCost], preset: str | GpuPreset) -> list[float]:
    """Modelled seconds of each kernel on `preset`."""
    gpu = get_preset(preset) if isinstance(preset, str) else preset
    return [gpu.seconds(c) for c in costs]


def launch_durations(plan: KernelPlan, device_name: str) -> list[float] | list[None]:
    """`Runtime.launch`'s ``duration_s`` for each kernel of `plan` on a device called `device_name`:
    the plan's `kernel_seconds` for the preset modelling that device, or None for every kernel where
    no preset does (e.g. a test device)."""
    preset = preset_for_device(device_name)
    if preset is None:
        return [None] * len(plan.kernels)
    return plan.kernel_seconds(preset)
