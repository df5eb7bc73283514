"""Turning a user's model into a checked kernel plan: calling a factory, loading weights, exporting and
lowering with errors that name the file and the construct, and checking a plan against eager torch.
``registry`` uses it to register models; the error types are the ones a user sees.
"""

from __future__ import annotations

import importlib
import operator
import time
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file
from torch import nn
from torch.utils._pytree import tree_leaves

from . import cost_model
from .lowering import LoweringError, lower_program
from .plan import KernelPlan
from .reference import plan_outputs
from .zoo import SEED

SUPPORTED = (
    "one tensor input of a static shape (batch first); tensor outputs; core ATen ops after "
    "torch.export (ops with a .out overload run in place of their destination, others as fallback "
    "kernels); no control-flow ops (torch.cond, while_loop), data-dependent shapes or .item()"
)


class ModelRegistrationError(ValueError):
    """A model that cannot be registered; the message names the file and what is wrong."""

    def __init__(self, file: str, problem: str) -> None:
        super().__init__(f"{file}: {problem}")
        self.file = file
        self.problem = problem


class UnsupportedModelError(ModelRegistrationError):
    """Export or lowering failed: the message names the op or construct, what is supported, the file."""

    def __init__(self, file: str, construct: str) -> None:
        super().__init__(file, f"cannot lower this model: {construct.rstrip('.')}. Supported: {SUPPORTED}")
        self.construct = construct


def call_factory(factory: str) -> tuple[nn.Module, tuple[int, ...] | None]:
    """Import and call ``package.module:build``; it returns a module, or (module, input shape)."""
    module_name, colon, attr = factory.partition(":")
    if not colon or not module_name or not attr:
        raise ModelRegistrationError(factory, "a factory is written package.module:function")
    try:
        fn = getattr(importlib.import_module(module_name), attr)
    except ModuleNotFoundError as error:
        if error.name is None or not f"{module_name}.".startswith(f"{error.name}."):  # what it imports
            raise ModelRegistrationError(factory, f"cannot import the factory: {error}") from None
        raise ModelRegistrationError(
            factory,
            f"cannot import the factory: {error}. Its module must be importable from Python's path in "
            "every process that lowers the model (the current folder is not on it for the `streambox` "
            "command): install its package, or set PYTHONPATH to the folder holding it",
        ) from None
    except (ImportError, AttributeError) as error:
        raise ModelRegistrationError(factory, f"cannot import the factory: {error}") from None
    except (Exception, SystemExit) as error:  # its module's own code failed while it was imported
        raise ModelRegistrationError(factory, f"its module failed on import: {first_line(error)}") from None
    try:
        built = fn()
    except (Exception, SystemExit) as error:  # the user's code: its failure is a registration error
        raise ModelRegistrationError(factory, f"the factory failed: {first_line(error)}") from None
    shape = None
    if isinstance(built, tuple) and len(built) == 2:
        built, shape = built
    if not isinstance(built, nn.Module):
        raise ModelRegistrationError(
            factory, f"the factory returned {type(built).__name__}, not an nn.Module"
        )
    if shape is None or (isinstance(shape, (tuple, list)) and not shape):  # none given beside the module
        shape = getattr(built, "example_input_shape", None)
    return built.eval(), None if shape is None else _shape(factory, shape)


def _shape(factory: str, shape: object) -> tuple[int, ...]:
    """The input shape a factory gave (returned beside its module, or `example_input_shape`): a
    sequence of whole numbers, named as the factory's mistake otherwise."""
    if isinstance(shape, (str, bytes)) or not isinstance(shape, Iterable):
        raise ModelRegistrationError(factory, f"its input shape {shape!r} is not a sequence of integers")
    shape = list(shape)  # a tuple, a list, torch.Size, a numpy array or tensor of ints
    try:
        if any(isinstance(d, bool) for d in shape):
            raise TypeError
        return tuple(operator.index(d) for d in shape)  # ints, numpy's too
    except TypeError:
        not_whole = f"its input shape {list(shape)} holds a value not an integer"
        raise ModelRegistrationError(factory, not_whole) from None


def load_weights(module: nn.Module, weights: Path) -> None:
    try:
        if weights.suffix == ".safetensors":
            state = load_file(str(weights))
        else:
            state = torch.load(weights, map_location="cpu", weights_only=True)
    except Exception as error:  # noqa: BLE001 - any reader's failure means the same: not weights
        why = f"cannot be read as weights: {first_line(error)}"
        raise ModelRegistrationError(str(weights), why) from None
    if isinstance(state, dict) and isinstance(state.get("state_dict"), dict):
        state = state["state_dict"]
    if not isinstance(state, dict):
        raise ModelRegistrationError(str(weights), f"holds a {type(state).__name__}, not a state dict")
    try:
        module.load_state_dict(state, strict=True)
    except RuntimeError as error:
        raise ModelRegistrationError(str(weights), f"does not fit the factory's module: {error}") from None


def example_for(shape: Sequence[int], dtype: torch.dtype, batch: int) -> torch.Tensor:
    """The seeded input registration checks a plan with."""
    gen = torch.Generator().manual_seed(SEED + 1)
    if dtype.is_floating_point:
        return torch.rand((batch, *shape), generator=gen, dtype=dtype)
    return torch.randint(0, 2, (batch, *shape), generator=gen, dtype=dtype)


def first_line(error: BaseException) -> str:
    text = str(error).strip() or type(error).__name__
    return f"{type(error).__name__}: {text.splitlines()[0]}"


def _refuse_control_flow(graph: torch.fx.Graph) -> None:
    """Name the first control-flow construct (a higher-order op such as ``cond``): a plan is a
    straight line of kernels."""
    for node in graph.nodes:
        if node.op == "call_function" and isinstance(node.target, torch._ops.HigherOrderOperator):
            raise LoweringError(f"node {node.name}: control-flow op torch.{node.target.name()}")


def lower_for(
    file: str,
    ref: str,
    eager: nn.Module,
    example: torch.Tensor,
    program: Any | None = None,
    *,
    check_input: bool = False,
) -> KernelPlan:
    """Lower for ``example``'s shape; export and lowering failures become ``UnsupportedModelError``.
    ``check_input`` (registration, which runs eager torch on it anyway): eager torch runs ``example``
    first, so that a shape the module cannot take is named as the input's mistake."""
    start = time.perf_counter()
    if program is None and check_input:
        _check_takes(file, eager, example)  # in eval mode
    elif program is None and not isinstance(eager, torch.fx.GraphModule):  # a .pt2's has no modes
        eager.eval()
    try:
        # torch.export and its decompositions push global dispatch modes: two at once (a proxy lowers on
        # two helper threads) corrupt each other's ("Trying to pop empty mode stack").
        with cost_model.TORCH_MODE_LOCK:
            if program is None:
                with torch.no_grad():
                    program = torch.export.export(eager, (example,))
            ep = program.run_decompositions()  # default table: core ATen
        _refuse_control_flow(ep.graph)
        plan = lower_program(ep, ref, int(example.shape[0]), list(example.shape[1:]), example.dtype)
        plan.meta["lowering_s"] = round(time.perf_counter() - start, 3)
    except LoweringError as error:
        raise UnsupportedModelError(file, str(error)) from error
    except Exception as error:  # torch.export raises many types; all of them mean "cannot export"
        raise UnsupportedModelError(file, f"torch.export failed with {first_line(error)}") from error
    if len(plan.inputs) != 1:
        raise UnsupportedModelError(file, f"the model takes {len(plan.inputs)} tensor inputs, not one")
    return plan


def _check_takes(file: str, eager: nn.Module, example: torch.Tensor) -> None:
    """Eager torch runs `example` (in eval mode): a shape the module rejects is named as the input's
    mistake here, not as a lowering failure after torch.export has logged its own traceback."""
    if not isinstance(eager, torch.fx.GraphModule):  # a .pt2's module refuses eval(); it has no modes
        eager.eval()
    try:
        with torch.no_grad():
            eager(example)
    except Exception as error:  # the user's module: whatever it raises means "not this input"
        raise ModelRegistrationError(
            file,
            f"the model rejects an input of shape {list(example.shape)} ({example.dtype}; batch first, then "
            f"the input shape given): {first_line(error)}",
        ) from None


def check_plan(file: str, plan: KernelPlan, eager: nn.Module, example: torch.Tensor) -> float:
    """The largest |plan - eager| over the outputs for ``example``; raises if they disagree."""
    with torch.no_grad():
        want = [t for t in tree_leaves(eager(example)) if isinstance(t, torch.Tensor)]
    got = plan_outputs(plan, [example])
    shapes_got, shapes_want = [list(t.shape) for t in got], [list(t.shape) for t in want]
    if shapes_got != shapes_want:
        raise ModelRegistrationError(file, f"plan outputs {shapes_got} but eager torch gives {shapes_want}")
    worst = 0.0
    for i, (w, g) in enumerate(zip(want, got, strict=True)):
        if not w.numel():
            continue
        # Each output against its own size: one output of 1e6s hid an error of 30 in another of 1s.
        error, scale = float((w.double() - g.double()).abs().max()), max(1.0, float(w.double().abs().max()))
        if not error <= 1e-4 * scale:  # also catches NaN: a kernel that never wrote its output
            which = f"output {i}" if len(want) > 1 else "its output"
            differs = f"the lowered plan differs from eager torch by {error:.3g} in {which}"
            raise ModelRegistrationError(file, differs)
        worst = max(worst, error)
    return worst
