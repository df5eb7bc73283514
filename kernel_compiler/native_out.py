"""Kernels that write straight into their out tensors, for ops whose ``.out`` overload torch generates.

A plan's compute kernel calls its op's ``.out`` overload on views of the pool's memory. For many ops
(convolution, eval batch norm, relu, clone, adaptive average pooling) torch has no out kernel of its
own: the overload is generated (``CompositeExplicitAutograd``) as the functional op, whose result
comes from torch's allocator (the caching allocator on a GPU), then a resize check and a ``copy_`` into
the out tensor. That is two dispatches and an extra device kernel per plan kernel, and device memory
outside the pool. Here each such op maps to native kernels with the same result that take the out
tensor: ``clamp_min.out`` for relu, ``native_batch_norm.out`` (training off) for eval batch norm,
``adaptive_avg_pool2d.out``, ``copy_`` for clone, and on CUDA ``cudnn_convolution.out`` plus the bias
added in place (what eager torch's cuDNN path runs, with its cuDNN flags read at each call; also for
fp32 depthwise convolutions, where eager picks its own kernel). Batch norm, pooling and convolution
go native only on default-layout tensors.

`native_call` is a pure choice on the op, its arguments and the device; `kernel_compiler.ops.bind_kernel`
uses it when `ENABLED` (``bench_executor.py --torch-out-wrappers`` turns it off to measure the difference).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

#: Off: every kernel calls its op's own ``.out`` overload (torch's generated wrapper where it has one).
ENABLED = True

Call = Callable[[], object]
_aten = torch.ops.aten


def bound_arguments(
    op: torch._ops.OpOverload, args: Sequence[Any], kwargs: Mapping[str, Any]
) -> dict[str, Any]:
    """The op's non-out arguments by schema name: positional, keyword, else the schema's default."""
    named: dict[str, Any] = {}
    for i, arg in enumerate(op._schema.arguments):
        if arg.is_out:
            continue
        if i < len(args):
            named[arg.name] = args[i]
        elif arg.name in kwargs:
            named[arg.name] = kwargs[arg.name]
        elif arg.has_default_value():
            named[arg.name] = arg.default_value
    return named


def _relu(a: dict[str, Any], outs: list[torch.Tensor]) -> Call | None:
    # relu(x) == clamp_min(x, 0), NaN included; clamp_min has CPU and CUDA out kernels
    return functools.partial(_aten.clamp_min.out, a["self"], 0, out=outs[0])


def _same_default_layout(*tensors: torch.Tensor) -> bool:
    """Every tensor contiguous in the default layout. The native kernels below index their out tensor
    in the input's layout (batch norm) or restride it to the input's (adaptive pooling), where torch's
    generated overload copies into whatever layout the out tensor has; a plan input may arrive in the
    caller's layout (channels last, say), so anything else keeps the generated overload."""
    return all(t.is_contiguous() for t in tensors)


def _eval_batch_norm(a: dict[str, Any], outs: list[torch.Tensor]) -> Call | None:
    # `_native_batch_norm_legit_no_training` is `native_batch_norm` with training off, whose out kernels
    # (batch_norm_cpu_out, batch_norm_cuda_out) write the normalised input and the saved statistics
    if not _same_default_layout(a["input"], outs[0]):
        return None
    return functools.partial(
        _aten.native_batch_norm.out, a["input"], a["weight"], a["bias"], a["running_mean"],
        a["running_var"], False, a["momentum"], a["eps"], out=outs[0], save_mean=outs[1], save_invstd=outs[2],
    )


def _adaptive_avg_pool2d(a: dict[str, Any], outs: list[torch.Tensor]) -> Call | None:
    if not _same_default_layout(a["self"], outs[0]):
        return None
    return functools.partial(_aten.adaptive_avg_pool2d.out, a["self"], a["output_size"], out=outs[0])


def _clone(a: dict[str, Any], outs: list[torch.Tensor]) -> Call | None:
    # the out tensor's layout is the plan's; clone's memory_format only chose it at lowering
    return functools.partial(outs[0].copy_, a["self"])


def cudnn_convolution_applies(a: Mapping[str, Any], out: torch.Tensor) -> bool:
    """Whether the convolution can run as `cudnn_convolution.out`: a plain (not transposed) 2-D
    convolution of floating, default-layout tensors on a CUDA device with cuDNN there and enabled.
    That includes fp32 depthwise convolutions, for which eager torch picks its own depthwise kernel
    (`_select_conv_backend`); cuDNN's were checked against eager on an H200 (docs/device.md)."""
    x, weight = a["input"], a["weight"]
    dtypes = (torch.float32, torch.float16, torch.bfloat16)
    return (
        out.device.type == "cuda"
        and not a["transposed"]
        and x.dim() == 4
        and x.dtype in dtypes
        and weight.dtype == x.dtype
        and _same_default_layout(x, weight, out)
        and torch.backends.cudnn.enabled
        and torch.backends.cudnn.is_available()
        and (x.dtype != torch.bfloat16 or torch.cuda.is_bf16_supported())
    )


def _cudnn_flags() -> tuple[bool, bool, bool]:
    """(benchmark, deterministic, allow_tf32) as eager's convolution reads them, at each call."""
    cudnn = torch.backends.cudnn
    deterministic = cudnn.deterministic or torch.are_deterministic_algorithms_enabled()
    return cudnn.benchmark, deterministic, cudnn.allow_tf32


def _convolution(a: dict[str, Any], outs: list[torch.Tensor]) -> Call | None:
    out = outs[0]
    if not cudnn_convolution_applies(a, out):
        return None  # elsewhere eager picks another backend (oneDNN on a CPU): keep torch's overload
    conv, x, weight = _aten.cudnn_convolution.out, a["input"], a["weight"]
    padding, stride, dilation, groups = a["padding"], a["stride"], a["dilation"], a["groups"]
    bias = a["bias"]
    bias_view = None if bias is None else bias.view(1, -1, 1, 1)  # once per bound call

    def conv_and_bias() -> object:
        conv(x, weight, padding, stride, dilation, groups, *_cudnn_flags(), out=out)
        return out if bias_view is None else out.add_(bias_view)

    return conv_and_bias


#: op (a plan kernel's ``.out`` overload) -> the native call for its named arguments and out tensors,
#: or None where it does not apply (then the overload runs as before).
NATIVE: dict[str, Callable[[dict[str, Any], list[torch.Tensor]], Call | None]] = {
    "aten.relu.out": _relu,
    "aten._native_batch_norm_legit_no_training.out": _eval_batch_norm,
    "aten._adaptive_avg_pool2d.out": _adaptive_avg_pool2d,
    "aten.clone.out": _clone,
    "aten.convolution.out": _convolution,
}


def native_call(
    op_name: str, op: torch._ops.OpOverload, args: Sequence[Any], kwargs: Mapping[str, Any],
    outs: list[torch.Tensor],
) -> Call | None:
    """A call that computes `op(*args, **kwargs)` into `outs` with native out kernels, or None (no such
    mapping for the op, or it does not apply to these arguments, or `ENABLED` is off)."""
    build = NATIVE.get(op_name) if ENABLED else None
    return None if build is None else build(bound_arguments(op, args, kwargs), outs)
