"""The reference interpreter: the simplest executor of a plan, to check lowering against eager torch."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from streambox.kernel_compiler.ops import invoke_kernel
from streambox.kernel_compiler.plan import KernelPlan


def run_reference(plan: KernelPlan, inputs: list[torch.Tensor]) -> dict[str, torch.Tensor]:
    """The simplest executor: allocate every storage variable up front (floats poisoned with NaN, so a
    kernel that fails to write its destination shows), then invoke the kernels in order."""
    weights = plan.load_weights()
    env: dict[str, torch.Tensor] = {}
    for v in plan.variables.values():
        if v.is_view:
            continue
        t = v.empty()
        if t.is_floating_point():
            t.fill_(float("nan"))
        env[v.name] = t
    for name, x in zip(plan.inputs, inputs, strict=True):
        env[name].copy_(x)
    for name, w in weights.items():
        env[name].copy_(w)
    for kernel in plan.kernels:
        produced = invoke_kernel(kernel, env)
        if kernel.kind == "view":
            for name, t in produced.items():
                spec = plan.variables[name]
                assert list(t.shape) == spec.shape and list(t.stride()) == spec.strides, name
                assert t.untyped_storage().data_ptr() == env[spec.base].untyped_storage().data_ptr()
            env.update(produced)
        else:
            assert all(produced[n] is env[n] for n in kernel.outputs), kernel.name
    return env


@pytest.fixture(scope="session")
def reference() -> Callable[[KernelPlan, list[torch.Tensor]], dict[str, torch.Tensor]]:
    return run_reference
