"""TVM front half of the kernel compiler: torch model -> Relax -> fused TIR with GPU schedules.

Steps (apache-tvm 0.27, whose TIR lives in ``tvm.tirx`` and schedules in ``tvm.s_tir``):

1. ``torch.export.export(model, (x,))`` and ``tvm.relax.frontend.torch.from_exported_program`` with the
   parameters kept as function inputs (the weights stay outside the compiled kernels, as in the plan);
2. legalisation: ``DecomposeOpsForInference`` (batch norm -> arithmetic), ``LegalizeOps`` (every Relax
   op -> a TIR PrimFunc), ``AnnotateTIROpPattern``/``FuseOps``/``FuseTIR`` (elementwise epilogues
   fused into their producers), as in TVM's CUDA pipeline;
3. GPU schedules from dlight (``tvm.s_tir.dlight.gpu``: Matmul, GEMV, Reduction, GeneralReduction,
   Fallback), applied per PrimFunc. Unlike ``dl.ApplyDefaultSchedule``, a rule that *raises* on a
   function is skipped and the next rule is tried (dlight's GEMV rule asserts on some of
   MobileNetV3's squeeze-excitation reductions), and a function no rule schedules gets a naive
   one-thread-per-output schedule (``_naive_schedule``); the rule used for each function is recorded.

``describe_graph`` records the Relax ``main`` as a flat list of kernel calls (which PrimFunc, on which
tensors), the tensor shapes, the constants the frontend folded (BatchNorm statistics), and which torch
``state_dict`` entry each weight input is, so that a backend can run the whole model from the
compiled kernels.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
import tvm
from torch import nn
from tvm import relax, s_tir, tirx
from tvm.s_tir import dlight as dl

#: The dlight rules tried in order (TVM's own CUDA legalize_passes list).
RULE_NAMES = ("Matmul", "GEMV", "Reduction", "GeneralReduction", "Fallback")


class FrontendError(RuntimeError):
    """The model could not be imported, legalised or scheduled."""


def cuda_target(arch: str = "sm_90") -> tvm.target.Target:
    """The CUDA target for ``arch`` (``sm_75`` .. ``sm_90``), with an LLVM host."""
    # 48 KiB: the static shared memory a block may use on every architecture from sm_75 up.
    return tvm.target.Target(
        {"kind": "cuda", "arch": arch, "max_shared_memory_per_block": 49152}, host="llvm"
    )


@dataclass
class ScheduledModel:
    """A model imported into Relax with every PrimFunc scheduled for the GPU."""

    mod: tvm.IRModule
    prim_funcs: dict[str, tirx.PrimFunc]  # scheduled, by name (the Relax GlobalVar's name)
    param_names: dict[str, str]  # Relax weight input -> torch state_dict key
    schedule_rules: dict[str, str]  # PrimFunc -> dlight rule that scheduled it
    rule_failures: dict[str, list[str]] = field(default_factory=dict)  # PrimFunc -> "Rule: error"
    timings: dict[str, float] = field(default_factory=dict)  # export, import, legalize, schedule


def import_model(
    model: nn.Module, example: torch.Tensor
) -> tuple[tvm.IRModule, dict[str, str], float, float]:
    """(Relax module, weight names, export seconds, import seconds)."""
    t0 = time.perf_counter()
    with torch.no_grad():
        ep = torch.export.export(model.eval(), (example,))
    t1 = time.perf_counter()
    from tvm.relax.frontend.torch import from_exported_program

    mod = from_exported_program(ep, keep_params_as_input=True)
    t2 = time.perf_counter()
    sig = ep.graph_signature
    names = {**sig.inputs_to_parameters, **sig.inputs_to_buffers, **sig.inputs_to_lifted_tensor_constants}
    return mod, dict(names), t1 - t0, t2 - t1


def legalize(mod: tvm.IRModule, target: tvm.target.Target) -> tvm.IRModule:
    with target:
        return tvm.transform.Sequential(
            [
                relax.transform.DecomposeOpsForInference(),
                relax.transform.LegalizeOps(),
                relax.transform.AnnotateTIROpPattern(),
                relax.transform.FoldConstant(),
                relax.transform.FuseOps(),
                relax.transform.FuseTIR(),
                relax.transform.DeadCodeElimination(),
            ]
        )(mod)


def _rules() -> list[tuple[str, Any]]:
    return [(name, getattr(dl.gpu, name)()) for name in RULE_NAMES]


def schedule(
    mod: tvm.IRModule, target: tvm.target.Target
) -> tuple[tvm.IRModule, dict[str, str], dict[str, list[str]]]:
    """Apply the first dlight rule that schedules each PrimFunc (see module docstring)."""
    rules = _rules()
    used: dict[str, str] = {}
    failures: dict[str, list[str]] = {}
    updates: dict[Any, tirx.PrimFunc] = {}
    with target:
        for gv, func in mod.functions_items():
            if not isinstance(func, tirx.PrimFunc):
                continue
            name = gv.name_hint
            if func.attrs is not None and "tirx.is_scheduled" in func.attrs:
                used[name] = "pre-scheduled"
                continue
            for rule_name, rule in rules:
                try:
                    space = rule.apply(func, target, False)
                except Exception as exc:  # dlight rules assert on patterns they half-recognise
                    failures.setdefault(name, []).append(f"{rule_name}: {type(exc).__name__}: {exc}"[:300])
                    continue
                if space is None:
                    continue
                sch = space[0] if isinstance(space, list) else space
                updates[gv] = sch.mod["main"].with_attr("tirx.is_scheduled", True)
                used[name] = rule_name
                break
            else:
                try:
                    updates[gv] = _naive_schedule(func).with_attr("tirx.is_scheduled", True)
                    used[name] = "Naive"
                except Exception as exc:
                    raise FrontendError(f"no rule schedules {name}: {failures.get(name, [])}; {exc}") from exc
    for gv, func in updates.items():
        mod[gv] = func
    return mod, used, failures


def _naive_schedule(func: tirx.PrimFunc, threads: int = 256) -> tirx.PrimFunc:
    """Last resort when no dlight rule applies (e.g. AlexNet's adaptive average pooling from a 1x1
    map, whose reduction extents depend on the output index): one thread per element of the last
    block's output -- its leading data-parallel loops fused, split by ``threads`` and bound to
    blockIdx.x/threadIdx.x -- with every earlier block computed at that thread loop into a local
    buffer, so the function stays one kernel without global temporaries."""
    sch = s_tir.Schedule(func)
    blocks = sch.get_child_blocks(sch.get_sblock("root"))
    last = blocks[-1]
    loops = sch.get_loops(last)
    iters = sch.get(last).iter_vars
    n = 0
    while n < min(len(loops), len(iters)) and iters[n].iter_type == tirx.IterVar.DataPar:
        n += 1
    if n == 0:
        raise FrontendError(f"block {sch.get(last).name_hint} has no leading data-parallel loop")
    fused = sch.fuse(*loops[:n]) if n > 1 else loops[0]
    extent = int(sch.get(fused).extent)
    bx, tx = sch.split(fused, [None, min(threads, extent)])
    sch.bind(bx, "blockIdx.x")
    sch.bind(tx, "threadIdx.x")
    for blk in reversed(blocks[:-1]):
        sch.compute_at(blk, tx, preserve_unit_loops=True)
        sch.set_scope(blk, 0, "local")
    return sch.mod["main"]


def schedule_model(model: nn.Module, example: torch.Tensor, arch: str = "sm_90") -> ScheduledModel:
    """Import, legalise and schedule ``model`` for ``example``'s shape (see module docstring)."""
    target = cuda_target(arch)
    try:
        mod, names, t_export, t_import = import_model(model, example)
    except Exception as exc:
        raise FrontendError(f"import failed: {type(exc).__name__}: {exc}") from exc
    t0 = time.perf_counter()
    mod = legalize(mod, target)
    t1 = time.perf_counter()
    mod, used, failures = schedule(mod, target)
    t2 = time.perf_counter()
    prims = {gv.name_hint: f for gv, f in mod.functions_items() if isinstance(f, tirx.PrimFunc)}
    return ScheduledModel(
        mod=mod,
        prim_funcs=prims,
        param_names=names,
        schedule_rules=used,
        rule_failures=failures,
        timings={"export": t_export, "import": t_import, "legalize": t1 - t0, "schedule": t2 - t1},
    )


# --- the Relax main as a kernel-call list -----------------------------------------------------------


def _tensor_desc(ty: Any) -> dict[str, Any]:
    shape = [int(s) for s in ty.shape.values] if hasattr(ty.shape, "values") else [int(s) for s in ty.shape]
    return {"shape": shape, "dtype": str(ty.dtype)}


@dataclass
class _GraphNames:
    """The tensor names ``describe_graph`` gives Relax expressions as it walks ``main`` in order."""

    names: dict[Any, str] = field(default_factory=dict)  # Relax var -> tensor name
    tuples: dict[Any, list[str]] = field(default_factory=dict)  # Relax tuple var -> its tensors' names
    taken: set[str] = field(default_factory=set)
    tensors: dict[str, dict[str, Any]] = field(default_factory=dict)  # name -> {"shape", "dtype"}
    constants: dict[str, np.ndarray] = field(default_factory=dict)
    const_names: dict[Any, str] = field(default_factory=dict)
    calls: list[dict[str, Any]] = field(default_factory=list)
    unsupported: list[str] = field(default_factory=list)

    def fresh(self, base: str) -> str:
        name, i = base, 1
        while name in self.taken:
            name, i = f"{base}_{i}", i + 1
        self.taken.add(name)
        return name

    def name_of(self, expr: Any) -> str | list[str]:
        if isinstance(expr, tvm.ir.GenericConst):
            return self._constant(expr)
        if expr in self.tuples:
            return self.tuples[expr]
        if expr in self.names:
            return self.names[expr]
        raise KeyError(f"unbound Relax expression {type(expr).__name__}")

    def _constant(self, expr: Any) -> str:
        """The name of a folded constant, recording its value the first time it is seen."""
        if expr in self.const_names:
            return self.const_names[expr]
        name = self.fresh(f"const_{len(self.constants)}")
        value = expr.value
        arr = value.numpy() if hasattr(value, "numpy") else np.asarray(value)
        self.constants[name] = arr
        self.const_names[expr] = name
        self.tensors[name] = {"shape": list(arr.shape), "dtype": str(arr.dtype)}
        return name

    def bind(self, var: Any, value: Any, call_tir: Any) -> None:
        """Name what one binding of ``main`` computes; a call_tir becomes a kernel call."""
        if isinstance(value, relax.Call) and value.op.same_as(call_tir):
            self._call(var, value)
        elif isinstance(value, relax.Tuple):
            self.tuples[var] = [self.name_of(f) for f in value.fields]
        elif isinstance(value, relax.TupleGetItem) and value.tuple_value in self.tuples:
            self.names[var] = self.tuples[value.tuple_value][value.index]
        elif isinstance(value, relax.Var) and value in self.names:
            self.names[var] = self.names[value]
        else:
            self.unsupported.append(f"{var.name} = {type(value).__name__}")

    def _call(self, var: Any, call: Any) -> None:
        args = [self.name_of(a) for a in call.args[1].fields]
        out_ty = call.ty_args[0]
        if isinstance(out_ty, relax.TupleType):
            outs = [self.fresh(f"{var.name}.{i}") for i in range(len(out_ty.fields))]
            for o, t in zip(outs, out_ty.fields, strict=True):
                self.tensors[o] = _tensor_desc(t)
            self.tuples[var] = outs
        else:
            outs = [self.fresh(var.name)]
            self.tensors[outs[0]] = _tensor_desc(out_ty)
            self.names[var] = outs[0]
        self.calls.append({"func": call.args[0].name_hint, "args": args, "outputs": outs})

    def outputs(self, ret: Any) -> list[str]:
        """The names of what ``main`` returns; none (and an unsupported entry) when it is not named."""
        try:
            out = self.name_of(ret)
        except KeyError:
            self.unsupported.append("return value")
            return []
        return out if isinstance(out, list) else [out]


def describe_graph(
    mod: tvm.IRModule, param_names: dict[str, str]
) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
    """(graph, constants): ``main`` as kernel calls over named tensors (JSON-able), and the constants.

    graph = {"inputs": [...], "weights": {relax name: torch state_dict key}, "constants": {name: desc},
    "tensors": {name: {"shape", "dtype"}}, "calls": [{"func", "args", "outputs"}], "outputs": [...],
    "complete": bool, "unsupported": [...]}. Calls follow destination passing: a PrimFunc's parameters
    are ``args + outputs``.
    """
    main = mod["main"]
    call_tir = tvm.ir.Op.get("relax.call_tir")
    walk = _GraphNames()
    inputs: list[str] = []
    weights: dict[str, str] = {}
    for p in main.params:
        n = walk.fresh(p.name)
        walk.names[p] = n
        walk.tensors[n] = _tensor_desc(p.ty)
        if p.name in param_names:
            weights[n] = param_names[p.name]
        else:
            inputs.append(n)
    for block in main.body.blocks:
        for b in block.bindings:
            walk.bind(b.var, b.value, call_tir)
    outputs = walk.outputs(main.body.body)
    graph = {
        "inputs": inputs,
        "weights": weights,
        "constants": {n: walk.tensors[n] for n in walk.constants},
        "tensors": walk.tensors,
        "calls": walk.calls,
        "outputs": outputs,
        "complete": not walk.unsupported,
        "unsupported": walk.unsupported,
    }
    return graph, walk.constants
