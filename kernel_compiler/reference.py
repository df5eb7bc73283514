"""The reference interpreter: the simplest executor of a kernel plan, on the CPU.

It allocates every storage variable up front (floats poisoned with NaN, so a kernel that fails to write
its destination shows in the result) and invokes the kernels in order. Registration uses it to check a
freshly lowered plan against eager torch; the tests use it to check lowering itself.
"""

from __future__ import annotations

import torch

from .ops import invoke_kernel
from .plan import KernelPlan


def run_plan(plan: KernelPlan, inputs: list[torch.Tensor], *, check: bool = False) -> dict[str, torch.Tensor]:
    """Every variable of one inference of ``plan`` on ``inputs``, by name.

    ``check`` also asserts what an executor relies on: a view kernel's result has the layout the plan
    recorded and aliases its base; a compute kernel writes into the tensors it was given."""
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
    for name, w in plan.load_weights().items():
        env[name].copy_(w)
    for kernel in plan.kernels:
        produced = invoke_kernel(kernel, env)
        if kernel.kind == "view":
            if check:
                for name, t in produced.items():
                    spec = plan.variables[name]
                    assert list(t.shape) == spec.shape and list(t.stride()) == spec.strides, name
                    assert t.untyped_storage().data_ptr() == env[spec.base].untyped_storage().data_ptr()
            env.update(produced)
        elif check:
            assert all(produced[n] is env[n] for n in kernel.outputs), kernel.name
    return env


def plan_outputs(plan: KernelPlan, inputs: list[torch.Tensor]) -> list[torch.Tensor]:
    """The plan's outputs, in order, for ``inputs``."""
    env = run_plan(plan, inputs)
    return [env[name] for name in plan.outputs]
