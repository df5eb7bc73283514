"""Scheduled (and PTB-rewritten) TIR -> CUDA C source plus a launch description of every kernel.

``lower_to_cuda`` runs TVM's default TIR pipeline for the CUDA target, splits host from device code,
reads each kernel's launch from the host function's ``call_ffi_kernel`` (grid, block, dynamic shared
memory, as expressions of the ``cap`` parameter), reorders each kernel's parameters into the
PrimFunc's order with ``cap`` last (``ptb.cap_param_last``), and emits CUDA C with TVM's codegen.
Only the device code is generated: no host code is built and TVM never compiles the CUDA source
itself (``cuda_build`` runs nvcc).

CSE is disabled (``tirx.disable_cse_tir``) so that kernels receive ``cap`` itself: with CSE, the host
would hoist ``min(V, max(cap, 1))`` into a temporary and pass that to the kernel instead. nvcc's own
optimiser does common-subexpression elimination on the device code anyway.
"""

from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass, field
from typing import Any

import tvm
import tvm_ffi
from tvm import ir, tirx
from tvm.tirx.build import codegen_build, split_host_device_mods

from .ptb import CAP_PARAM, Nest, PTBError, audit_shared_sync, cap_param_last, nests_of, written_params

#: Caps at which each PTB kernel's physical grid is checked to be min(V, cap).
_CHECK_CAPS = (1, 2, 3, 7, 64)
_UNCAPPED = 1 << 30


class CodegenError(RuntimeError):
    """Lowering or source generation failed, or a kernel's launch cannot be described statically."""


@dataclass
class KernelInfo:
    """One CUDA kernel: how to launch it (JSON-able via ``asdict``)."""

    name: str  # the extern "C" symbol
    prim_func: str  # the PrimFunc it came from (a PrimFunc may launch several kernels in order)
    grid: list[int]  # the launch grid with no cap; PTB kernels: [virtual blocks, 1, 1]
    original_grid: list[int]  # the schedule's grid before the PTB rewrite
    block: list[int]
    dynamic_shared_mem: int  # bytes, the cuLaunchKernel sharedMemBytes argument
    static_shared_mem: int  # bytes of __shared__ arrays (informational)
    args: list[dict[str, Any]]  # {"name", "kind": "buffer"|"cap", "dtype", "shape", "param_index"}
    cap_arg: int | None  # index of the cap in args (always the last one) or None
    ptb: bool
    shared_sync: dict[str, Any] = field(default_factory=dict)  # ptb.SyncAudit of PTB kernels


@dataclass
class CudaSource:
    source: str
    kernels: list[KernelInfo]
    prim_funcs: dict[str, dict[str, Any]]  # name -> {"params": [...], "kernels": [...]}
    timings: dict[str, float]

    def kernel_dicts(self) -> list[dict[str, Any]]:
        return [asdict(k) for k in self.kernels]


def _dtype_bytes(dtype: Any) -> int:
    dt = tvm_ffi.dtype(str(dtype))
    return max(1, dt.bits * dt.lanes // 8)


def _evaluate(expr: Any, cap: int) -> int:
    """``expr`` (a launch extent of the host function) as an int, its ``cap`` variable set to ``cap``."""
    expr = tvm_ffi.structural_map(
        expr, (ir.Var, lambda v: tirx.IntImm(str(v.ty), cap) if v.name == CAP_PARAM else v), order="post"
    )
    value = tvm.sym.Analyzer().simplify(expr)
    if not isinstance(value, tirx.IntImm):
        raise CodegenError(f"launch extent {expr} is not a constant once cap={cap}")
    return int(value)


def _param_desc(p: Any, index: int, outputs: set[int]) -> dict[str, Any]:
    ty = p.ty
    if hasattr(ty, "shape"):
        return {
            "name": p.name,
            "kind": "buffer",
            "dtype": str(ty.dtype),
            "shape": [int(s) for s in ty.shape],
            "param_index": index,
            "output": index in outputs,
        }
    kind = "cap" if p.name == CAP_PARAM else "scalar"
    return {"name": p.name, "kind": kind, "dtype": str(ty.dtype), "param_index": index}


def _kernel_calls(host_func: tirx.PrimFunc) -> list[Any]:
    calls: list[Any] = []
    in_loop = [False]

    def visit_for(f: tirx.For) -> None:
        found: list[Any] = []
        tvm_ffi.structural_walk(
            f.body,
            (ir.Call, lambda c: found.append(c) if c.op.same_as(ir.Op.get("tirx.call_ffi_kernel")) else None),
        )
        if found:
            in_loop[0] = True

    tvm_ffi.structural_walk(host_func.body, (tirx.For, visit_for), order="pre")
    if in_loop[0]:
        raise CodegenError("a kernel is launched from a host loop; a static launch list cannot describe it")
    op = ir.Op.get("tirx.call_ffi_kernel")
    tvm_ffi.structural_walk(
        host_func.body, (ir.Call, lambda c: calls.append(c) if c.op.same_as(op) else None), order="pre"
    )
    return calls


def _static_shared(device_func: tirx.PrimFunc) -> int:
    total = [0]

    def visit(a: Any) -> None:
        b = a.buffer
        if b.scope() == "shared":
            total[0] += math.prod(int(s) for s in b.shape) * _dtype_bytes(b.dtype)

    tvm_ffi.structural_walk(device_func.body, (tirx.AllocBuffer, visit), order="pre")
    return total[0]


def _launch_params(kname: str, call: Any, n_args: int) -> dict[str, Any]:
    """A kernel's launch parameters (``blockIdx.x``, ``threadIdx.x``, ...) by name, as host expressions."""
    launch_names = [str(s) for s in call.attrs.launch_params]
    values = list(call.args[1 + n_args :])
    if len(values) != len(launch_names):
        raise CodegenError(f"{kname}: {len(values)} launch values for {launch_names}")
    return dict(zip(launch_names, values, strict=True))


def _ptb_original_grid(
    kname: str, launch: dict[str, Any], uncapped: dict[str, int], grid: list[int], nest: Nest | None
) -> list[int]:
    """The schedule's grid of a PTB kernel, once its launch is checked: a 1-D grid of the nest's
    virtual blocks, ``min(V, cap)`` physical blocks, and nothing else depending on the cap."""
    if grid[1] != 1 or grid[2] != 1:
        raise CodegenError(f"{kname}: PTB kernel with a {grid} grid")
    original = list(nest.grid) if nest is not None else [1, 1, 1]
    if math.prod(original) != grid[0]:
        raise CodegenError(f"{kname}: {grid[0]} virtual blocks, original grid {original}")
    for cap in _CHECK_CAPS:
        phys = _evaluate(launch.get("blockIdx.x", tirx.IntImm("int32", 1)), cap)
        if phys != min(grid[0], cap):
            raise CodegenError(f"{kname}: physical grid {phys} at cap {cap}, virtual {grid[0]}")
    for k, v in launch.items():
        if k != "blockIdx.x" and _evaluate(v, 1) != uncapped[k]:
            raise CodegenError(f"{kname}: launch parameter {k} depends on the cap")
    return original


def _shared_sync(kname: str, dev: tirx.PrimFunc) -> dict[str, Any]:
    """The PTB kernel's shared-memory synchronisation audit (``ptb.audit_shared_sync``), which must pass."""
    audit = audit_shared_sync(dev)
    if not audit.ok:
        raise CodegenError(f"{kname}: {audit.detail}")
    return {"ptb_loops": audit.ptb_loops, "shared_stores": audit.shared_stores, "ok": audit.ok}


def _param_order(kname: str, dev: tirx.PrimFunc, prim: tirx.PrimFunc) -> list[int]:
    """For each parameter of a (non-PTB) device kernel, the index of the PrimFunc parameter it is."""
    order = []
    for p in dev.params:
        base = p.name[: -len("_ptr")] if p.name.endswith("_ptr") else p.name
        idx = next((j for j, q in enumerate(prim.params) if q.name == base), None)
        if idx is None:
            raise CodegenError(f"{kname}: parameter {p.name} matches no PrimFunc parameter")
        order.append(idx)
    return order


def _kernel_args(
    params: list[dict[str, Any]], order: list[int], ptb: bool
) -> tuple[list[dict[str, Any]], int | None]:
    """(the kernel's argument descriptions in launch order, the index of the cap among them or None)."""
    args = [{k: v for k, v in params[j].items() if k != "output"} for j in order]
    if not ptb:
        return args, None
    args.append({"name": CAP_PARAM, "kind": "cap", "dtype": "int32", "shape": [], "param_index": -1})
    return args, len(args) - 1


def _describe_kernel(
    call: Any,
    prim_name: str,
    prim: tirx.PrimFunc,
    params: list[dict[str, Any]],
    nest: Nest | None,
    dev_mod: tvm.IRModule,
    ptb: bool,
) -> tuple[KernelInfo, tirx.PrimFunc]:
    """One kernel launched by ``prim``'s host code: its description and its device function (with the
    cap moved last for PTB kernels)."""
    kname = str(call.args[0]).strip('"')
    dev = dev_mod[kname]
    launch = _launch_params(kname, call, len(dev.params))
    uncapped = {k: _evaluate(v, _UNCAPPED) for k, v in launch.items()}
    block = [uncapped.get(f"threadIdx.{a}", 1) for a in "xyz"]
    grid = [uncapped.get(f"blockIdx.{a}", 1) for a in "xyz"]
    dyn = uncapped.get("tirx.use_dyn_shared_memory", 0)
    if ptb:
        original = _ptb_original_grid(kname, launch, uncapped, grid, nest)
        dev, order = cap_param_last(dev, prim)
        sync = _shared_sync(kname, dev)
    else:
        original = grid
        order = _param_order(kname, dev, prim)
        sync = {}
    args, cap_arg = _kernel_args(params, order, ptb)
    info = KernelInfo(
        name=kname,
        prim_func=prim_name,
        grid=grid,
        original_grid=original,
        block=block,
        dynamic_shared_mem=dyn,
        static_shared_mem=_static_shared(dev),
        args=args,
        cap_arg=cap_arg,
        ptb=ptb,
        shared_sync=sync,
    )
    return info, dev


def _describe_prim_func(
    name: str, prim: tirx.PrimFunc, host_mod: tvm.IRModule, dev_mod: tvm.IRModule, ptb: bool
) -> tuple[list[dict[str, Any]], list[tuple[KernelInfo, tirx.PrimFunc]]]:
    """(``name``'s parameter descriptions, each kernel its host code launches, in order, with its
    device function)."""
    outputs = set(written_params(prim))
    params = [_param_desc(p, i, outputs) for i, p in enumerate(prim.params)]
    host = host_mod[name]
    if ptb and not any(p.name == CAP_PARAM for p in prim.params):
        raise CodegenError(f"{name} has no {CAP_PARAM} parameter: run the PTB pass first")
    nests = nests_of(prim)
    calls = _kernel_calls(host)
    if ptb and len(calls) != len(nests) and nests:
        raise CodegenError(f"{name}: {len(calls)} kernels for {len(nests)} PTB nests")
    launched = [
        _describe_kernel(call, name, prim, params, nests[i] if ptb and nests else None, dev_mod, ptb)
        for i, call in enumerate(calls)
    ]
    return params, launched


def lower_to_cuda(
    prim_funcs: dict[str, tirx.PrimFunc], target: tvm.target.Target, *, ptb: bool = True
) -> CudaSource:
    """Lower scheduled PrimFuncs (PTB-rewritten ones when ``ptb``) to CUDA C and launch descriptions."""
    t0 = time.perf_counter()
    mod = tvm.IRModule({name: f.with_attr("global_symbol", name) for name, f in prim_funcs.items()})
    with target, tvm.transform.PassContext(config={"tirx.disable_cse_tir": True}):
        mod = tirx.transform.BindTarget(target)(mod)
        pipeline, _finalize_host, finalize_device = tirx.get_default_tir_pipeline(target)
        lowered = pipeline(mod)
        host_mod, device_mods = split_host_device_mods(lowered)
        if len(device_mods) != 1:
            raise CodegenError(f"expected one device target, got {list(device_mods)}")
        ((dev_target, dev_mod),) = device_mods.items()
        t1 = time.perf_counter()

        kernels: list[KernelInfo] = []
        funcs: dict[str, dict[str, Any]] = {}
        new_device: dict[str, tirx.PrimFunc] = {}
        for name, prim in prim_funcs.items():
            params, launched = _describe_prim_func(name, prim, host_mod, dev_mod, ptb)
            for info, dev in launched:
                new_device[info.name] = dev
                kernels.append(info)
            funcs[name] = {"params": params, "kernels": [info.name for info, _ in launched]}
        t2 = time.perf_counter()
        unknown = {gv.name_hint for gv in dev_mod.functions} - set(new_device)
        if unknown:
            raise CodegenError(f"kernels not launched by any PrimFunc: {sorted(unknown)}")
        dev_mod = tvm.IRModule(new_device, attrs=dev_mod.attrs)
        dev_mod = finalize_device()(dev_mod)
        source = codegen_build(dev_mod, dev_target).inspect_source()
        t3 = time.perf_counter()
    return CudaSource(
        source=source,
        kernels=kernels,
        prim_funcs=funcs,
        timings={"lower": t1 - t0, "launch_analysis": t2 - t1, "codegen": t3 - t2},
    )


__all__ = ["CodegenError", "CudaSource", "KernelInfo", "PTBError", "lower_to_cuda"]
