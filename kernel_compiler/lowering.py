"""Lowering: a torch module -> ``KernelPlan`` via ``torch.export`` and core-ATen decomposition.

Steps: export the eval-mode model for one example input (static shapes), decompose to core ATen, then
walk the graph in order. Placeholders become input/weight variables; each op node becomes one kernel:
a *view* kernel when the op's schema says its output aliases an input (``Tensor(a)`` return), otherwise
a *compute* kernel calling the op's ``.out`` overload (found by schema, since overload names vary:
``add.Tensor`` -> ``add.out``, ``add.Scalar`` -> ``add.Scalar_out``, ...), or a fallback kernel where no
``.out`` overload exists. ``getitem`` nodes only name the outputs of multi-output ops. Last, every
kernel gets its cost (FLOPs, bytes, op class: ``cost_model``).
"""

from __future__ import annotations

import operator
import time
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any

import torch
from torch import fx, nn
from torch.export import ExportedProgram
from torch.export.graph_signature import InputKind

from . import argcodec, cost_model
from .ops import DEVICE_SIZED_OUTPUTS
from .plan import SCHEMA_VERSION, Kernel, KernelPlan, VarSpec
from .zoo import build_model, example_input, get_entry

# Factory ops' functional overloads take these; their .out overloads take the out tensor instead.
_TENSOR_OPTIONS = frozenset({"dtype", "layout", "device", "pin_memory"})


# Views whose schema carries no alias annotation: ``_unsafe_view`` (what ``reshape`` of a temporary
# decomposes to) returns a view of its input; its ``.out`` overload would copy.
_UNANNOTATED_VIEWS = frozenset({torch.ops.aten._unsafe_view.default})


class LoweringError(RuntimeError):
    """The exported graph contains something a kernel plan cannot express."""


# --- schema helpers --------------------------------------------------------------------------------


def is_view_op(op: torch._ops.OpOverload) -> bool:
    """An op whose output aliases an input without writing it (``-> Tensor(a)``) is a view."""
    if op in _UNANNOTATED_VIEWS:
        return True
    rets = op._schema.returns
    return bool(rets) and all(r.alias_info is not None and not r.alias_info.is_write for r in rets)


def _mutates(op: torch._ops.OpOverload) -> bool:
    return any(a.alias_info is not None and a.alias_info.is_write for a in op._schema.arguments)


def _sig(args: Iterable[Any]) -> list[tuple[str, str, bool]]:
    return [(a.name, str(a.type), a.kwarg_only) for a in args]


_OUT_CACHE: dict[torch._ops.OpOverload, tuple[torch._ops.OpOverload, list[str]] | None] = {}


def find_out_overload(op: torch._ops.OpOverload) -> tuple[torch._ops.OpOverload, list[str]] | None:
    """The ``.out`` overload of a functional op and its out-argument names, or None.

    An overload qualifies when its non-out arguments equal the functional ones (dropping the
    TensorOptions kwargs of factory ops, implied by the out tensor) and it has one written (``!``)
    kwarg-only tensor argument per functional return.
    """
    if op in _OUT_CACHE:
        return _OUT_CACHE[op]
    functional = _sig(op._schema.arguments)
    no_options = [a for a in functional if a[0] not in _TENSOR_OPTIONS]
    n_returns = len(op._schema.returns)
    found = None
    for name in op.overloadpacket.overloads():
        cand = getattr(op.overloadpacket, name)
        outs = [a for a in cand._schema.arguments if a.alias_info is not None and a.alias_info.is_write]
        if len(outs) != n_returns or not all(a.kwarg_only and str(a.type) == "Tensor" for a in outs):
            continue
        out_ids = {id(a) for a in outs}
        rest = _sig(a for a in cand._schema.arguments if id(a) not in out_ids)
        if rest in (functional, no_options):
            found = (cand, [a.name for a in outs])
            break
    _OUT_CACHE[op] = found
    return found


# --- layout helpers --------------------------------------------------------------------------------


def _storage_nbytes(shape: list[int], strides: list[int], itemsize: int) -> int:
    if any(s == 0 for s in shape):
        return 0
    return (1 + sum((n - 1) * st for n, st in zip(shape, strides, strict=True))) * itemsize


def _contiguous_strides(shape: list[int]) -> list[int]:
    strides, acc = [], 1
    for n in reversed(shape):
        strides.append(acc)
        acc *= max(n, 1)
    return strides[::-1]


def _spec(name: str, kind: str, t: torch.Tensor, base: str | None = None) -> VarSpec:
    shape, strides = [int(s) for s in t.shape], [int(s) for s in t.stride()]
    if kind == "view":
        nbytes, offset = 0, int(t.storage_offset())
    else:
        nbytes, offset = _storage_nbytes(shape, strides, t.element_size()), 0
    return VarSpec(
        name=name,
        kind=kind,
        dtype=argcodec.dtype_name(t.dtype),
        shape=shape,
        strides=strides,
        storage_offset=offset,
        nbytes=nbytes,
        base=base,
    )


def _tensor_results(node: fx.Node, op: torch._ops.OpOverload) -> tuple[list[torch.Tensor], bool]:
    """(the example values of `node`'s results, whether it returns a list or tuple of them)."""
    vals = node.meta["val"]
    multi = isinstance(vals, list | tuple)
    vals = list(vals) if multi else [vals]
    if not all(isinstance(v, torch.Tensor) for v in vals):
        raise LoweringError(f"node {node.name}: {op} returns non-tensors")
    return vals, multi


# --- the graph walk --------------------------------------------------------------------------------


class _Builder:
    def __init__(self, ep: ExportedProgram) -> None:
        self.ep = ep
        self.vars: dict[str, VarSpec] = {}
        self.kernels: list[Kernel] = []
        self.weights: dict[str, torch.Tensor] = {}
        self.inputs: list[str] = []
        self.node_var: dict[str, str] = {}  # fx node name -> variable name

    def _var_of(self, node: Any) -> str:
        if not isinstance(node, fx.Node) or node.name not in self.node_var:
            raise LoweringError(f"argument {node!r} is not a tensor variable")
        return self.node_var[node.name]

    def _root(self, name: str) -> str:
        base = self.vars[name].base
        return base if base is not None else name

    def placeholders(self) -> None:
        sig = self.ep.graph_signature
        specs = {s.arg.name: s for s in sig.input_specs}
        for node in self.ep.graph.nodes:
            if node.op != "placeholder":
                continue
            spec = specs[node.name]
            if not node.users:  # e.g. num_batches_tracked: only training reads it
                continue
            if spec.kind == InputKind.USER_INPUT:
                self.vars[node.name] = _spec(node.name, "input", node.meta["val"])
                self.inputs.append(node.name)
            elif spec.kind in (InputKind.PARAMETER, InputKind.BUFFER, InputKind.CONSTANT_TENSOR):
                target = spec.target
                tensor = self.ep.state_dict.get(target)
                if tensor is None:
                    tensor = self.ep.constants[target]
                tensor = tensor.detach()
                if not tensor.is_contiguous():
                    tensor = tensor.contiguous()  # weights are stored contiguous (safetensors)
                self.weights[node.name] = tensor
                self.vars[node.name] = _spec(node.name, "weight", tensor)
            else:
                raise LoweringError(f"unsupported graph input {node.name} of kind {spec.kind}")
            self.node_var[node.name] = node.name

    def call(self, node: fx.Node) -> None:
        op = node.target
        if op is operator.getitem:
            return  # named when its producer was lowered
        if not isinstance(op, torch._ops.OpOverload):
            raise LoweringError(f"node {node.name}: unsupported target {op!r}")
        if not op._schema.returns:
            return  # runtime assertions (e.g. _assert_tensor_metadata) have no effect on buffers
        if _mutates(op):
            raise LoweringError(f"node {node.name}: in-place op {op} after functionalisation")
        vals, multi = _tensor_results(node, op)
        names = self._output_names(node, len(vals), multi)
        args = argcodec.encode(list(node.args), self._var_of)
        kwargs = {k: argcodec.encode(v, self._var_of) for k, v in node.kwargs.items()}
        self._add(self._kernel(node, op, args, kwargs, names, vals))
        for n in names:
            self.node_var[n] = n
        if not multi:
            self.node_var[node.name] = node.name

    def _output_names(self, node: fx.Node, count: int, multi: bool) -> list[str]:
        """The variable names of `node`'s `count` results: a multi-result op's are its getitem users'."""
        by_index = {u.args[1]: u.name for u in node.users if u.target is operator.getitem}
        # Outputs nobody reads (e.g. max-pool indices) still need a destination: name them after the node.
        names = [by_index.get(i, f"{node.name}__{i}") for i in range(count)] if multi else [node.name]
        if clash := [n for n in names if n in self.vars]:
            raise LoweringError(f"node {node.name}: variable names {clash} already taken")
        return names

    def _kernel(
        self,
        node: fx.Node,
        op: torch._ops.OpOverload,
        args: list[Any],
        kwargs: dict[str, Any],
        names: list[str],
        vals: list[torch.Tensor],
    ) -> Kernel:
        """`node`'s kernel, its results declared: a view of its first argument's storage, or a compute
        kernel writing fresh intermediates (through the op's out= overload where it has one)."""
        if is_view_op(op):
            base = self._root(argcodec.var_names(args)[0])
            for n, v in zip(names, vals, strict=True):
                self.vars[n] = _spec(n, "view", v, base=base)
            return Kernel(node.name, str(op), "view", args, kwargs, names, source_op=str(op))
        for n, v in zip(names, vals, strict=True):
            self.vars[n] = _spec(n, "intermediate", v)
        for index, arg in DEVICE_SIZED_OUTPUTS.get(str(op), {}).items():  # sized for CUDA's kernel
            like = node.args[arg].meta["val"]
            sized = torch.empty(like.shape, dtype=vals[index].dtype, device="meta")
            self.vars[names[index]] = _spec(names[index], "intermediate", sized)
        out = find_out_overload(op)
        if out is None:
            return Kernel(
                node.name, str(op), "compute", args, kwargs, names, fallback=True, source_op=str(op)
            )
        out_op, out_args = out
        accepted = {a.name for a in out_op._schema.arguments}
        kwargs = {k: v for k, v in kwargs.items() if k in accepted}
        return Kernel(node.name, str(out_op), "compute", args, kwargs, names, out_args, source_op=str(op))

    def _add(self, kernel: Kernel) -> None:
        touched = argcodec.var_names(kernel.args) + argcodec.var_names(list(kernel.kwargs.values()))
        roots = dict.fromkeys(self._root(n) for n in touched + kernel.outputs)
        kernel.accesses = list(roots)
        for r in roots:
            self.vars[r].expected_accesses += 1
        self.kernels.append(kernel)

    def outputs(self, node: fx.Node) -> list[str]:
        """Mark graph outputs; an output that is a view, an input, a weight or repeated is first
        materialised by a clone kernel, so that every output owns its storage."""
        result: list[str] = []
        (vals,) = node.args
        for i, out in enumerate(vals if isinstance(vals, list | tuple) else [vals]):
            name = self._var_of(out)
            var = self.vars[name]
            if var.kind != "intermediate":
                src = var
                name = f"output_{i}"
                while name in self.vars:
                    name += "_"
                shape = list(src.shape)
                self.vars[name] = VarSpec(
                    name,
                    "intermediate",
                    src.dtype,
                    shape,
                    _contiguous_strides(shape),
                    0,
                    _storage_nbytes(shape, _contiguous_strides(shape), src.torch_dtype.itemsize),
                )
                self._add(
                    Kernel(
                        name,
                        "aten.clone.out",
                        "compute",
                        [{"var": src.name}],
                        {},
                        [name],
                        ["out"],
                        source_op="aten.clone.default",
                    )
                )
            self.vars[name].kind = "output"
            result.append(name)
        return result


def lower_program(
    ep: ExportedProgram, model: str, batch: int, input_shape: list[int], input_dtype: torch.dtype
) -> KernelPlan:
    """Walk a (decomposed) exported program into a kernel plan."""
    b = _Builder(ep)
    b.placeholders()
    outputs: list[str] = []
    for node in ep.graph.nodes:
        if node.op == "call_function":
            b.call(node)
        elif node.op == "output":
            outputs = b.outputs(node)
        elif node.op not in ("placeholder",):
            raise LoweringError(f"unsupported graph node {node.format_node()}")
    plan = KernelPlan(
        model=model,
        batch=batch,
        input_shape=list(input_shape),
        input_dtype=argcodec.dtype_name(input_dtype),
        variables=b.vars,
        kernels=b.kernels,
        inputs=b.inputs,
        outputs=outputs,
        meta={"torch": torch.__version__, "schema_version": SCHEMA_VERSION},
    )
    plan._weights = b.weights
    return cost_model.annotate_costs(plan)


def lower_module(module: nn.Module, example: torch.Tensor, model: str) -> KernelPlan:
    """Lower ``module`` (put in eval mode) for the exact shape of ``example`` (batch first)."""
    start = time.perf_counter()
    module = module.eval()
    with cost_model.TORCH_MODE_LOCK:  # export is not safe against a concurrent export or FLOP count
        with torch.no_grad():
            ep = torch.export.export(module, (example,))
        ep = ep.run_decompositions()  # default table: core ATen
        plan = lower_program(ep, model, int(example.shape[0]), list(example.shape[1:]), example.dtype)
    plan.meta["lowering_s"] = round(time.perf_counter() - start, 3)
    return plan


# The zoo model `lower_model` built last, while this thread is inside `reusing_built_models` (else None).
_BUILT: ContextVar[dict[str, nn.Module] | None] = ContextVar("streambox_built_models", default=None)


@contextmanager
def reusing_built_models() -> Iterator[None]:
    """Within it, `lower_model` on this thread builds a zoo model once for consecutive lowerings of it
    (a deploy's plans: one per batch size a function's batches reach) instead of once per plan. The
    build is a seeded random initialisation, the same module every time, and costs as much as the
    lowering (VGG-16: 2.0 s of 4.2 s per plan on a 2-core host); export only reads the module. One
    model is kept at a time, and none after the block."""
    token = _BUILT.set({})
    try:
        yield
    finally:
        _BUILT.reset(token)


def lower_model(name: str, batch: int, input_shape: tuple[int, ...] | None = None) -> KernelPlan:
    """Lower the zoo model ``name`` for ``batch`` and ``input_shape`` (default: the zoo entry's)."""
    shape = tuple(input_shape) if input_shape is not None else get_entry(name).input_shape
    built = _BUILT.get()
    module = built.get(name) if built is not None else None
    if module is None:
        if built is not None:
            built.clear()  # the previous model goes before this one is built
        module = build_model(name)
        if built is not None:
            built[name] = module
    return lower_module(module, example_input(name, batch, shape), name)
