from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from streambox.kernel_compiler.lowering import lower_module
from streambox.kernel_compiler.memory_profile import MemoryProfile, profile_plan
from streambox.kernel_compiler.model_pool import ModelPool
from streambox.kernel_compiler.zoo import ZOO


def test_linear_relu_linear_by_hand() -> None:
    # x[1,4] -> Linear(4,8) -> ReLU -> Linear(8,2); fp32.
    # Kernels: permute(w1) [view], addmm -> a (32 B), relu -> r (32 B), permute(w2) [view], addmm -> y (8 B).
    # a is touched by addmm and relu (2 accesses), r by relu and the last addmm; y is the output.
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    plan = lower_module(model, torch.rand(1, 4), "mlp")
    prof = profile_plan(plan)
    assert [k.kind for k in prof.kernels] == ["view", "compute", "compute", "view", "compute"]
    assert [k.output_bytes for k in prof.kernels] == [0, 32, 32, 0, 8]
    assert [k.live_eager for k in prof.kernels] == [0, 32, 64, 32, 40]
    assert [k.live_no_eager for k in prof.kernels] == [72] * 5
    assert [k.freed for k in prof.kernels] == [[], [], ["addmm"], [], ["relu"]]
    assert prof.peak_eager == 64 and prof.peak_no_eager == 72
    assert prof.weight_bytes == (8 * 4 + 8 + 2 * 8 + 2) * 4 == 232
    assert prof.input_bytes == 16 and prof.output_bytes == 8
    # Weights loaded at first use: w1 with the first permute, b1 with the addmm, ...
    assert [k.weight_resident for k in prof.kernels] == [128, 160, 160, 224, 232]
    assert prof.demand() == [v + 232 + 16 for v in [0, 32, 64, 32, 40]]
    assert prof.demand(eager=False, weights=False, inputs=False) == [72] * 5
    assert prof.runtime_s is None


def test_json_round_trip() -> None:
    torch.manual_seed(0)
    plan = lower_module(nn.Sequential(nn.Linear(4, 8), nn.ReLU()), torch.rand(2, 4), "mlp")
    prof = profile_plan(plan)
    prof.runtime_s = [1e-5] * len(prof.kernels)
    assert MemoryProfile.from_json(prof.to_json()) == prof


@pytest.mark.parametrize("name", list(ZOO))
def test_eager_never_exceeds_no_eager(name: str, pool: ModelPool) -> None:
    plan = pool.get_or_lower(name, 1, ZOO[name].small_input_shape)
    prof = profile_plan(plan)
    assert len(prof.kernels) == len(plan.kernels)
    assert all(k.live_eager <= k.live_no_eager for k in prof.kernels)
    assert 0 < prof.peak_eager <= prof.peak_no_eager
    # Every intermediate is freed exactly once; what stays live at the end is the outputs.
    freed = [n for k in prof.kernels for n in k.freed]
    assert sorted(freed) == sorted(v.name for v in plan.vars_of_kind("intermediate"))
    last = prof.kernels[-1]
    assert last.live_eager - sum(plan.variables[n].nbytes for n in last.freed) == prof.output_bytes
    assert prof.kernels[-1].weight_resident == prof.weight_bytes == plan.weight_bytes


@settings(max_examples=8, deadline=None)
@given(widths=st.lists(st.integers(1, 16), min_size=1, max_size=5), batch=st.integers(1, 3))
def test_mlp_peak_is_two_adjacent_activations(widths: list[int], batch: int) -> None:
    """For a chain of Linear+ReLU, eager live bytes peak at two adjacent activations (fp32)."""
    layers: list[nn.Module] = []
    dims = [3, *widths]
    for a, b in zip(dims, dims[1:], strict=False):
        layers += [nn.Linear(a, b), nn.ReLU()]
    plan = lower_module(nn.Sequential(*layers), torch.rand(batch, 3), "chain")
    prof = profile_plan(plan)
    # Activations in order: addmm_0, relu_0, addmm_1, relu_1, ...; sizes batch * width * 4.
    acts = [batch * w * 4 for w in widths for _ in (0, 1)]
    expected = max(acts[0], *(a + b for a, b in zip(acts, acts[1:], strict=False)))
    assert prof.peak_eager == expected
    assert prof.peak_no_eager == sum(acts)
