"""Native out kernels (`kernel_compiler/native_out.py`): the same bytes as torch's generated .out overload."""

from __future__ import annotations

import pytest
import torch

from streambox.kernel_compiler import native_out
from streambox.kernel_compiler.ops import bind_kernel, resolve_op
from streambox.kernel_compiler.plan import Kernel

aten = torch.ops.aten


def _cases() -> list[tuple[str, list, dict, list[torch.Tensor]]]:
    torch.manual_seed(0)
    x = torch.randn(2, 8, 5, 5)
    x[0, 0, 0, 0] = float("nan")
    strided = torch.randn(8, 2, 5, 5).transpose(0, 1)  # not contiguous: clone's copy_ follows strides
    w, b, mean, var = torch.randn(8), torch.randn(8), torch.randn(8), torch.rand(8) + 0.5
    return [
        ("aten.relu.out", [x], {}, [torch.empty_like(x)]),
        ("aten._native_batch_norm_legit_no_training.out", [x, w, b, mean, var, 0.1, 1e-5], {},
         [torch.empty_like(x), torch.empty(0), torch.empty(0)]),
        ("aten._adaptive_avg_pool2d.out", [x, [2, 3]], {}, [torch.empty(2, 8, 2, 3)]),
        ("aten.clone.out", [x], {"memory_format": torch.contiguous_format}, [torch.empty_like(x)]),
        ("aten.clone.out", [strided], {}, [torch.empty(2, 8, 5, 5)]),
    ]


@pytest.mark.parametrize("case", _cases(), ids=lambda c: c[0])
def test_a_native_call_writes_what_the_generated_out_overload_writes(case):
    name, args, kwargs, outs = case
    op = resolve_op(name)
    call = native_out.native_call(name, op, args, kwargs, outs)
    assert call is not None
    call()
    want = [torch.empty_strided(t.shape, t.stride()) for t in outs]
    op(*args, **kwargs, **dict(zip([a.name for a in op._schema.arguments if a.is_out], want, strict=True)))
    for got, expected in zip(outs, want, strict=True):
        torch.testing.assert_close(got, expected, rtol=0, atol=0, equal_nan=True)


def test_a_convolution_off_cuda_keeps_torchs_overload_and_the_switch_turns_every_native_off():
    x, weight = torch.randn(1, 3, 8, 8), torch.randn(4, 3, 3, 3)
    args = [x, weight, None, [1, 1], [1, 1], [1, 1], False, [0, 0], 1]
    op = resolve_op("aten.convolution.out")
    assert native_out.native_call("aten.convolution.out", op, args, {}, [torch.empty(1, 4, 8, 8)]) is None
    relu = resolve_op("aten.relu.out")
    native_out.ENABLED = False
    try:
        assert native_out.native_call("aten.relu.out", relu, [x], {}, [torch.empty_like(x)]) is None
    finally:
        native_out.ENABLED = True


def test_bind_kernel_binds_relu_to_clamp_mins_out_kernel():
    """A kernel as the lowering records it (argument references, out_args) binds to clamp_min's kernel."""
    kernel = Kernel(
        name="relu_0", op="aten.relu.out", kind="compute", args=[{"var": "x"}], kwargs={},
        outputs=["y"], out_args=["out"], source_op="aten.relu.default",
    )
    x = torch.randn(3, 4)
    env = {"x": x, "y": torch.empty(3, 4)}
    call = bind_kernel(kernel, env)
    assert getattr(call, "func", None) is aten.clamp_min.out
    call()
    assert torch.equal(env["y"], torch.relu(x))


@pytest.mark.parametrize("case", _cases()[1:3], ids=["batch_norm", "adaptive_avg_pool2d"])
def test_a_channels_last_input_keeps_torchs_overload_and_the_out_tensors_layout(case):
    """Their native kernels index (batch norm) or restride (pooling) the out tensor in the input's layout:
    a plan input in the caller's channels-last layout would scramble the plan's contiguous buffer."""
    name, args, kwargs, outs = case
    op = resolve_op(name)
    args = [args[0].contiguous(memory_format=torch.channels_last), *args[1:]]
    assert native_out.native_call(name, op, args, kwargs, outs) is None
    kernel_outs = {f"o{i}": t for i, t in enumerate(outs)}
    kernel = Kernel(
        name="k", op=name, kind="compute", args=[{"var": "x"}, *args[1:]], kwargs={},
        outputs=list(kernel_outs), out_args=[a.name for a in op._schema.arguments if a.is_out],
    )
    strides = [t.stride() for t in outs]
    bind_kernel(kernel, {"x": args[0], **kernel_outs})()
    assert [t.stride() for t in outs] == strides
    reference = getattr(aten, name.split(".")[1]).default(args[0].contiguous(), *args[1:])
    reference = reference[0] if isinstance(reference, tuple | list) else reference
    torch.testing.assert_close(outs[0], reference, equal_nan=True)


def test_bound_arguments_fill_keywords_and_schema_defaults():
    x = torch.randn(2, 3)
    op = resolve_op("aten.clone.out")
    assert native_out.bound_arguments(op, [x], {}) == {"self": x, "memory_format": None}
    add = resolve_op("aten.add.out")
    assert native_out.bound_arguments(add, [x], {"other": x}) == {"self": x, "other": x, "alpha": 1}
