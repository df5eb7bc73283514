"""The kernel cost model: the roofline's arithmetic, FLOPs against torch's flop counter, bytes from
the plan's variables, costs through save/load (and from schema 1 plans), every zoo op classed."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from streambox.kernel_compiler import cost_model
from streambox.kernel_compiler.cost_model import GpuPreset, KernelCost
from streambox.kernel_compiler.lowering import lower_module
from streambox.kernel_compiler.plan import PLAN_FILE, SCHEMA_VERSION, KernelPlan, StalePlan
from streambox.kernel_compiler.published_latency import PUBLISHED, UNPUBLISHED
from streambox.kernel_compiler.zoo import ZOO, get_entry

#: Round numbers, so that every expected duration below is exact.
TOY = GpuPreset(
    name="toy",
    gpu="toy",
    peak_flops=1e12,
    mem_bandwidth=1e11,
    launch_floor_s=1e-5,
    efficiency={c: 0.5 for c in cost_model.OP_CLASSES if c != "view"},
    bw_efficiency=0.25,
)


def test_roofline_takes_the_slower_of_compute_and_memory_plus_the_floor() -> None:
    # compute: 1e9 / (1e12 * 0.5) = 2 ms; memory: 1e6 / (1e11 * 0.25) = 40 us
    assert TOY.seconds(KernelCost("conv", 10**9, 600_000, 400_000)) == pytest.approx(1e-5 + 2e-3, rel=1e-12)
    # compute: 1e6 / 5e11 = 2 us; memory: 1e8 / 2.5e10 = 4 ms
    assert TOY.seconds(KernelCost("matmul", 10**6, 10**8, 0)) == pytest.approx(1e-5 + 4e-3, rel=1e-12)
    # no FLOPs (elementwise): bytes only; no bytes either: the floor alone
    assert TOY.seconds(KernelCost("elementwise", 0, 5 * 10**5, 5 * 10**5)) == pytest.approx(1e-5 + 4e-5)
    assert TOY.seconds(KernelCost("copy", 0, 0, 0)) == 1e-5
    assert TOY.seconds(KernelCost("view", 10**9, 10**9, 10**9)) == 0.0  # views cost nothing


def test_the_op_class_efficiency_scales_the_compute_side_only() -> None:
    slow_conv = replace(TOY, efficiency={**TOY.efficiency, "conv": 0.1})
    cost = KernelCost("conv", 10**9, 10**3, 0)
    assert slow_conv.seconds(cost) == pytest.approx(1e-5 + 1e9 / 1e11)
    assert slow_conv.seconds(replace(cost, op_class="matmul")) == pytest.approx(TOY.seconds(cost))


def test_presets_are_checked_and_named() -> None:
    with pytest.raises(ValueError, match="no efficiency for op classes"):
        replace(TOY, efficiency={"conv": 0.5})
    with pytest.raises(ValueError, match=r"in \(0, 1\]"):
        replace(TOY, bw_efficiency=1.5)
    with pytest.raises(KeyError, match="known presets: h100-80gb, h200-141gb, v100-16gb"):
        cost_model.get_preset("a100")
    assert cost_model.get_preset("V100-16GB") is cost_model.V100_PCIE_16GB
    v100 = cost_model.V100_PCIE_16GB
    assert (v100.peak_flops, v100.mem_bandwidth) == (14e12, 900e9)  # the datasheet's PCIe figures
    assert cost_model.preset_for_device("Tesla V100-PCIE-16GB (emulated)") == "v100-16gb"
    assert cost_model.preset_for_device("NVIDIA H100 80GB HBM3") == "h100-80gb"
    assert cost_model.preset_for_device("test-gpu-64mib") is None


class ConvLinear(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, stride=2, padding=1)
        self.fc = nn.Linear(8 * 8 * 8, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(torch.relu(self.conv(x)).flatten(1))


def _counted(fn, *args) -> int:
    with FlopCounterMode(display=False) as counter:
        fn(*args)
    return counter.get_total_flops()


@pytest.fixture(scope="module")
def conv_linear() -> tuple[ConvLinear, torch.Tensor, KernelPlan]:
    torch.manual_seed(0)
    module, x = ConvLinear().eval(), torch.rand(2, 3, 16, 16)
    return module, x, lower_module(module, x, "conv_linear")


def test_conv_and_linear_flops_match_the_flop_counter_on_the_eager_module(conv_linear) -> None:
    module, x, plan = conv_linear
    (conv,) = [k for k in plan.kernels if k.op_class == "conv"]
    (linear,) = [k for k in plan.kernels if k.op_class == "matmul"]
    with torch.no_grad():
        assert conv.flops == _counted(module.conv, x) > 0
        hidden = torch.relu(module.conv(x)).flatten(1)
        assert linear.flops == _counted(module.fc, hidden) > 0
        assert plan.total_flops == _counted(module, x)
    assert all(k.flops == 0 for k in plan.kernels if k.op_class not in ("conv", "matmul"))


def test_bytes_are_the_arguments_read_and_the_outputs_written(conv_linear) -> None:
    _, x, plan = conv_linear
    (conv,) = [k for k in plan.kernels if k.op_class == "conv"]
    variables = plan.variables
    args = list(dict.fromkeys(a["var"] for a in conv.args if isinstance(a, dict) and "var" in a))
    assert conv.bytes_read == sum(variables[n].nbytes for n in args)
    assert conv.bytes_read == x.nbytes + (8 * 3 * 3 * 3 + 8) * 4  # input, weight and bias
    assert conv.bytes_written == sum(variables[n].nbytes for n in conv.outputs) == 2 * 8 * 8 * 8 * 4
    views = [k for k in plan.kernels if k.kind == "view"]
    assert views and all(cost_model.cost_of(k) == KernelCost("view", 0, 0, 0) for k in views)


def test_kernel_seconds_are_the_modelled_roofline_of_each_kernel(conv_linear) -> None:
    _, _, plan = conv_linear
    v100 = cost_model.V100_PCIE_16GB
    expected = [v100.seconds(cost_model.cost_of(k)) for k in plan.kernels]
    assert plan.kernel_seconds("v100-16gb") == expected
    assert all(s == 0.0 for s, k in zip(expected, plan.kernels, strict=True) if k.kind == "view")
    compute = [s for s, k in zip(expected, plan.kernels, strict=True) if k.kind != "view"]
    assert all(s >= v100.launch_floor_s for s in compute)
    # H100: the same kernels, a faster GPU
    assert sum(plan.kernel_seconds("h100-80gb")) < sum(expected)
    with pytest.raises(KeyError, match="known presets"):
        plan.kernel_seconds("tpu")


def test_costs_survive_save_and_load(conv_linear, tmp_path: Path) -> None:
    _, _, plan = conv_linear
    plan.save(tmp_path)
    doc = json.loads((tmp_path / PLAN_FILE).read_text())
    assert doc["schema_version"] == SCHEMA_VERSION == 3
    assert all({"op_class", "flops", "bytes_read", "bytes_written"} <= k.keys() for k in doc["kernels"])
    loaded = KernelPlan.load(tmp_path)
    assert loaded == plan
    assert [cost_model.cost_of(k) for k in loaded.kernels] == [cost_model.cost_of(k) for k in plan.kernels]
    assert loaded.kernel_seconds("v100-16gb") == plan.kernel_seconds("v100-16gb")


def test_a_plan_of_an_older_schema_is_stale_and_a_newer_one_is_refused(conv_linear, tmp_path: Path) -> None:
    _, _, plan = conv_linear
    plan.save(tmp_path)
    doc = json.loads((tmp_path / PLAN_FILE).read_text())
    doc["schema_version"] = SCHEMA_VERSION - 1
    (tmp_path / PLAN_FILE).write_text(json.dumps(doc))
    with pytest.raises(StalePlan, match=rf"schema version {SCHEMA_VERSION - 1} is not {SCHEMA_VERSION}"):
        KernelPlan.load(tmp_path)
    doc["schema_version"] = 99
    (tmp_path / PLAN_FILE).write_text(json.dumps(doc))
    newer = rf"schema version 99 is not {SCHEMA_VERSION}; lower again"
    with pytest.raises(ValueError, match=newer) as raised:
        KernelPlan.load(tmp_path)
    assert not isinstance(raised.value, StalePlan)


@pytest.mark.parametrize("name", sorted(ZOO))
def test_every_zoo_op_has_a_class_and_every_conv_and_matmul_counts_flops(name, pool) -> None:
    plan = pool.get_or_lower(name, 1, get_entry(name).small_input_shape)
    unclassed = sorted({k.source_op for k in plan.kernels if k.op_class == "other"})
    assert not unclassed, f"{name}: ops without a cost class: {unclassed}"
    assert all(k.flops > 0 for k in plan.kernels if k.op_class in ("conv", "matmul"))
    assert all(k.bytes_written > 0 for k in plan.kernels if k.kind == "compute")


def test_the_v100_preset_is_within_25_percent_of_every_published_latency(pool) -> None:
    """The calibration's claim (docs/device.md): batch 1, the zoo's full input shape."""
    assert {p.model for p in PUBLISHED} | set(UNPUBLISHED) == set(ZOO)
    assert not {p.model for p in PUBLISHED} & set(UNPUBLISHED)
    for figure in PUBLISHED:
        plan = pool.get_or_lower(figure.model, 1)
        modelled_ms = sum(plan.kernel_seconds("v100-16gb")) * 1e3
        error = (modelled_ms - figure.ms) / figure.ms
        assert abs(error) <= 0.25, f"{figure.model}: modelled {modelled_ms:.2f} ms, published {figure.ms:.2f}"
