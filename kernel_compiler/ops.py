"""Running one kernel of a plan on tensors that someone else allocated.

``invoke_kernel`` is the only place that calls torch ops for a plan: it resolves the kernel's
arguments from ``env`` (variable name -> tensor) and writes into the output tensors already in
``env``. The executor owns allocation and recycling; this module allocates nothing except the
temporary result of a fallback kernel.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from . import argcodec
from .argcodec import DeviceArg, VarRef
from .native_out import native_call
from .op_libraries import import_op_libraries
from .plan import Kernel

#: Outputs whose shape depends on the device's kernel, by the op they were lowered from: output index ->
#: the argument whose shape CUDA's kernel gives it. Eval batch norm's save_mean/save_invstd are nobody's
#: input, but CUDA's kernel (`batch_norm_cuda_out`) resizes them to the channels and uses them as scratch,
#: where the CPU's and the meta kernel (which `torch.export` records) leave them empty. The lowering sizes
#: them for CUDA (so the pool holds their bytes); on any other device the call gets an empty view of them.
DEVICE_SIZED_OUTPUTS: dict[str, dict[int, int]] = {
    "aten._native_batch_norm_legit_no_training.default": {1: 3, 2: 3},
}


@functools.cache
def resolve_op(name: str) -> torch._ops.OpOverload:
    """``"aten.convolution.out"`` -> ``torch.ops.aten.convolution.out`` (cached per name)."""
    ns, packet, overload = name.split(".")
    import_op_libraries(ns)  # torchvision's ops exist once it is imported
    return getattr(getattr(getattr(torch.ops, ns), packet), overload)


@dataclass
class _Prepared:
    op: torch._ops.OpOverload
    args: list[Any]
    kwargs: dict[str, Any]


def _prepare(kernel: Kernel) -> _Prepared:
    # Decoding once per kernel keeps the per-call cost to a walk that swaps references for tensors.
    if kernel._prepared is None:
        kernel._prepared = _Prepared(
            resolve_op(kernel.op),
            argcodec.decode(kernel.args),
            {k: argcodec.decode(v) for k, v in kernel.kwargs.items()},
        )
    return kernel._prepared


def _resolve(value: Any, env: Mapping[str, torch.Tensor], device: torch.device | None) -> Any:
    if isinstance(value, VarRef):
        return env[value.name]
    if isinstance(value, list):
        return [_resolve(v, env, device) for v in value]
    if isinstance(value, DeviceArg):
        return device if device is not None else torch.device(value.recorded)
    return value


def invoke_kernel(kernel: Kernel, env: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Run ``kernel`` with tensors from ``env``; returns its outputs by variable name.

    Compute kernels write into ``env[name]`` for each output (preallocated by the caller) and return
    those tensors. View kernels return new alias tensors, which the caller stores into ``env``.
    """
    if kernel.kind == "view":
        p = _prepare(kernel)
        result = p.op(
            *_resolve(p.args, env, None), **{k: _resolve(v, env, None) for k, v in p.kwargs.items()}
        )
        if isinstance(result, list | tuple):
            return dict(zip(kernel.outputs, result, strict=True))
        return {kernel.outputs[0]: result}
    bind_kernel(kernel, env)()
    return {name: env[name] for name in kernel.outputs}


def bind_kernel(kernel: Kernel, env: Mapping[str, torch.Tensor]) -> Callable[[], object]:
    """A compute kernel's call with its arguments resolved from ``env`` now: ``invoke_kernel`` split in
    two, for a caller that runs the same kernel on the same tensors many times (the executor)."""
    if kernel.kind == "view":
        raise ValueError(f"kernel {kernel.name} is a view kernel: run it with invoke_kernel")
    p = _prepare(kernel)
    outs = [env[n] for n in kernel.outputs]
    device = outs[0].device
    args = _resolve(p.args, env, device)
    kwargs = {k: _resolve(v, env, device) for k, v in p.kwargs.items()}
    op = p.op
    if kernel.fallback:

        def call_and_copy() -> None:
            result = op(*args, **kwargs)
            for dst, src in zip(outs, result if isinstance(result, list | tuple) else [result], strict=True):
                dst.copy_(src)

        return call_and_copy
    if device.type != "cuda" and (sized := DEVICE_SIZED_OUTPUTS.get(kernel.source_op)):
        outs = [t[:0] if i in sized else t for i, t in enumerate(outs)]
    native = native_call(kernel.op, op, args, kwargs, outs)
    if native is not None:  # no functional result and copy_ behind torch's generated .out overload
        return native
    kwargs.update(zip(kernel.out_args, outs, strict=True))
    return functools.partial(op, *args, **kwargs)
