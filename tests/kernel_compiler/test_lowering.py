"""Every zoo model, lowered into a kernel plan and run kernel by kernel, matches eager torch."""

from __future__ import annotations

import warnings
from collections import Counter
from collections.abc import Callable

import pytest
import torch
from torch import nn

from streambox.kernel_compiler import argcodec
from streambox.kernel_compiler.lowering import find_out_overload, is_view_op, lower_module
from streambox.kernel_compiler.model_pool import ModelPool
from streambox.kernel_compiler.ops import invoke_kernel
from streambox.kernel_compiler.plan import Kernel, KernelPlan
from streambox.kernel_compiler.zoo import ZOO, example_input

TOLERANCE = {torch.float32: {"rtol": 1e-4, "atol": 1e-5}, torch.float64: {"rtol": 1e-10, "atol": 1e-12}}

CASES = [(name, 1, ZOO[name].small_input_shape) for name in ZOO] + [("resnet18", 2, (3, 32, 32))]


def _check_structure(plan: KernelPlan) -> None:
    """Invariants the executor relies on."""
    counts: Counter[str] = Counter()
    for k in plan.kernels:
        referenced = argcodec.var_names(k.args) + argcodec.var_names(list(k.kwargs.values())) + k.outputs
        roots = {plan.root(n) for n in referenced}
        assert set(k.accesses) == roots, k.name
        counts.update(roots)
        if k.kind == "view":
            assert all(plan.variables[n].is_view for n in k.outputs)
        else:
            assert all(plan.variables[n].kind in ("intermediate", "output") for n in k.outputs)
            assert k.fallback or (k.op.split(".")[-1].endswith("out") and len(k.out_args) == len(k.outputs))
    for v in plan.variables.values():
        if v.is_view:
            assert v.nbytes == 0 and plan.variables[v.base].kind != "view" and v.expected_accesses == 0
        else:
            assert v.base is None and v.expected_accesses == counts[v.name] > 0, v.name
    assert all(plan.variables[n].kind == "output" for n in plan.outputs)


def _eager(model: nn.Module, x: torch.Tensor) -> list[torch.Tensor]:
    with torch.no_grad():
        y = model(x)
    return list(y) if isinstance(y, tuple | list) else [y]


@pytest.mark.parametrize(("name", "batch", "shape"), CASES, ids=[f"{n}-b{b}" for n, b, _ in CASES])
def test_plan_matches_eager(
    name: str,
    batch: int,
    shape: tuple[int, ...],
    pool: ModelPool,
    zoo_model: Callable[[str], nn.Module],
    reference: Callable,
) -> None:
    plan = pool.get_or_lower(name, batch, shape)
    _check_structure(plan)
    assert plan.fallback_count == 0, [k.source_op for k in plan.kernels if k.fallback]
    x = example_input(name, batch, shape)
    env = reference(plan, [x])
    expected = _eager(zoo_model(name), x)
    assert len(plan.outputs) == len(expected)
    for out, ref in zip(plan.outputs, expected, strict=True):
        torch.testing.assert_close(env[out], ref, **TOLERANCE[ref.dtype])


def test_multi_output_op_uses_all_out_arguments(pool: ModelPool) -> None:
    plan = pool.get_or_lower("resnet18", 1, (3, 32, 32))
    (pool_kernel,) = [k for k in plan.kernels if k.source_op == "aten.max_pool2d_with_indices.default"]
    assert pool_kernel.op == "aten.max_pool2d_with_indices.out"
    assert pool_kernel.out_args == ["out", "indices"]
    values, indices = (plan.variables[n] for n in pool_kernel.outputs)
    assert values.dtype == "float32" and indices.dtype == "int64"
    # The indices are written and never read: one access, so the executor frees them at once.
    assert indices.expected_accesses == 1


def test_eval_batch_norm_scratch_is_sized_for_cuda_and_empty_elsewhere(pool: ModelPool) -> None:
    """CUDA's eval batch norm resizes save_mean/save_invstd to the channels (a GPU view cannot grow: the
    first GPU run failed with 'Trying to resize storage that is not resizable'); the CPU's and the meta
    kernel want them empty. The plan holds the channels' bytes; a CPU call gets empty views, so the
    kernel resizes nothing (torch warns where an out tensor with elements is resized)."""
    plan = pool.get_or_lower("resnet18", 1, (3, 32, 32))
    op = "aten._native_batch_norm_legit_no_training.default"
    kernel = next(k for k in plan.kernels if k.source_op == op)
    running_mean = plan.variables[argcodec.var_names(kernel.args)[3]]
    _, save_mean, save_invstd = (plan.variables[n] for n in kernel.outputs)
    assert save_mean.shape == save_invstd.shape == running_mean.shape == [64]
    assert save_mean.nbytes == save_invstd.nbytes == 64 * 4
    env = {name: torch.randn(spec.shape) for name, spec in plan.variables.items() if spec.kind != "view"}
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        outs = invoke_kernel(kernel, env)
    assert outs[kernel.outputs[0]].shape == (1, 64, 16, 16)
    assert outs[kernel.outputs[1]].shape == (64,)  # the plan's tensor is left as it was, not resized


def test_out_overload_lookup() -> None:
    aten = torch.ops.aten
    assert find_out_overload(aten.add.Tensor) == (aten.add.out, ["out"])
    assert find_out_overload(aten.add.Scalar) == (aten.add.Scalar_out, ["out"])
    assert find_out_overload(aten.full.default) == (aten.full.out, ["out"])  # TensorOptions dropped
    assert find_out_overload(aten.native_layer_norm.default) == (
        aten.native_layer_norm.out,
        ["out0", "out1", "out2"],
    )
    assert find_out_overload(aten.sym_size.int) is None
    assert is_view_op(aten.view.default) and is_view_op(aten.permute.default)
    assert is_view_op(aten.slice.Tensor) and is_view_op(aten.split_with_sizes.default)
    assert is_view_op(aten._unsafe_view.default)  # unannotated, but it aliases its input
    assert not is_view_op(aten.clone.default) and not is_view_op(aten.add.Tensor)


# --- a module that exercises the odd paths: no .out overload, factory ops, dtype casts, outputs
# that are views -------------------------------------------------------------------------------------


@torch.library.custom_op("streambox_kc_test::scale_shift", mutates_args=())
def scale_shift(x: torch.Tensor) -> torch.Tensor:
    return x * 3.0 + 1.0


@scale_shift.register_fake
def _(x: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(x)


class Odd(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(6, 6)
        self.register_buffer("offset", torch.linspace(-1, 1, 6))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        y = scale_shift(self.lin(x)) + torch.ones(x.shape[-1]) + self.offset
        z = y.to(torch.float64).clamp(min=float("-inf"), max=2.5)
        head, tail = y.split([2, 4], dim=-1)
        return z, y.view(-1), (head * 2).sum(-1, keepdim=True) + tail[..., :1]


def test_fallback_factories_and_view_outputs(reference: Callable) -> None:
    torch.manual_seed(0)
    model = Odd()
    x = torch.randn(2, 6)
    plan = lower_module(model, x, "odd")
    _check_structure(plan)
    fallbacks = [k for k in plan.kernels if k.fallback]
    assert [k.op for k in fallbacks] == ["streambox_kc_test.scale_shift.default"]
    assert plan.fallback_count == 1
    # The view output got its own storage through a clone kernel.
    assert plan.variables[plan.outputs[1]].kind == "output"
    env = reference(plan, [x])
    for out, ref in zip(plan.outputs, _eager(model, x), strict=True):
        assert env[out].dtype == ref.dtype
        torch.testing.assert_close(env[out], ref, **TOLERANCE[ref.dtype])


def test_invoke_fallback_kernel_copies_into_destination() -> None:
    from streambox.kernel_compiler.ops import invoke_kernel

    k = Kernel("r", "aten.relu.default", "compute", [{"var": "a"}], {}, ["b"], fallback=True)
    env = {"a": torch.tensor([-1.0, 2.0]), "b": torch.full((2,), float("nan"))}
    dst = env["b"]
    out = invoke_kernel(k, env)
    assert out["b"] is dst and dst.tolist() == [0.0, 2.0]


def test_a_deploy_builds_each_zoo_model_once_and_lowers_the_same_plans(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from streambox.kernel_compiler import lowering

    builds: list[str] = []
    build = lowering.build_model
    monkeypatch.setattr(lowering, "build_model", lambda name: builds.append(name) or build(name))
    shape = ZOO["espcn"].small_input_shape
    with lowering.reusing_built_models():
        reused = [lowering.lower_model("espcn", batch, shape) for batch in (1, 2, 3)]
        other = lowering.lower_model("text_encoder", 1, ZOO["text_encoder"].small_input_shape)
        again = lowering.lower_model("espcn", 4, shape)  # one model kept at a time: built anew
    assert builds == ["espcn", "text_encoder", "espcn"] and other.model == "text_encoder"
    fresh = lowering.lower_model("espcn", 2, shape)  # outside the block: a build of its own
    assert builds[-1] == "espcn" and len(builds) == 4
    assert reused[1].kernels == fresh.kernels and reused[1].variables == fresh.variables
    for name, tensor in fresh.load_weights().items():
        assert torch.equal(reused[1].load_weights()[name], tensor), name
    assert [p.batch for p in (*reused, again)] == [1, 2, 3, 4]
