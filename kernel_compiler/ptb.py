"""Persistent-thread-block ("elastic kernel") rewriting of scheduled TIR (``tvm.tirx``, apache-tvm 0.27).

The pass (``ptb_rewrite`` / ``PTBTransform``) runs on *scheduled* TIR -- after dlight, before TVM's
lowering pipeline -- where a kernel is a nest of loops bound to ``blockIdx.*`` around loops bound to
``threadIdx.*`` and SBlocks. Each nest with grid ``(X, Y, Z)`` becomes::

    for by in thread_binding(Y, "blockIdx.y"):        for b in thread_binding(S, "blockIdx.x"):
      for bx in thread_binding(X, "blockIdx.x"):  =>    for k in range((V + S - 1) // S):
        BODY                                              v = b + k * S           # virtual block
                                                          bx = v % X; by = v // X # Bind statements
                                                          [__syncthreads()]       # if shared memory
                                                          BODY, every SBlock predicated on v < V

with ``V = X * Y * Z`` virtual blocks and ``S = min(V, max(cap, 1))`` physical blocks, ``cap`` a new
trailing ``int32`` parameter. Physical block ``b`` runs virtual blocks ``b, b + S, b + 2S, ...``
(grid-stride over the linearised grid, x fastest): every virtual block runs exactly once, seeing the
block indices it had in the original grid, for every ``cap >= 1``; ``cap >= V`` is the original
launch. The physical grid is 1-D whatever the original grid, as ``device/cuda.py``'s
``launch_function`` requires for capped launches.

Three details are what make this correct *after* TVM's lowering, not just in the TIR's sequential
semantics:

- the trip count is the same for every physical block and the tail is masked with SBlock predicates
  (``T.where``), not with an ``if`` around the body or a block-dependent trip count: TVM's ``ThreadSync``
  cannot place barriers inside an ``if`` ("Cannot insert syncs inside condition"), and
  ``LowerCrossThreadReduction`` silently skips reduction blocks whose loop nest has a trip count that
  depends on another loop (it then leaves an unsynchronised, racy reduction behind);
- the block indices are ``Bind`` (let) variables rather than substituted expressions, so the SBlock
  bindings stay affine in the loop variables (the same ``LowerCrossThreadReduction`` requirement);
  ``ptb_rewrite`` checks that it lowers as many cross-thread reductions as in the original function;
- a kernel that uses shared memory (or a cross-thread reduction, which ``LowerThreadAllreduce`` turns
  into shared-memory traffic) gets a barrier at the top of each virtual block, so that the next
  virtual block cannot overwrite shared memory that slower threads still read for the previous one.
  The barrier is uniform (all threads of a block run the same trip count). ``audit_shared_sync``
  re-checks this on the lowered kernel.

Device side (``cap_param_last``): after ``SplitHostDevice`` the kernel's parameters are in TVM's order
(sorted by name); the kernel compiler reorders them into the PrimFunc's parameter order and puts
``cap`` last, adding an unused ``cap`` to kernels whose grid is a single block (where ``S`` simplifies
to 1). That is ``launch_function(..., cu_cap=cap)``'s convention.

``serialize_threads`` turns every thread binding into a serial loop (and drops barriers), giving the
sequential semantics of scheduled TIR that the CPU check (``ptb_verify``) builds for LLVM.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import tvm
import tvm_ffi
from tvm import ir, s_tir, tirx
from tvm.s_tir import SBlock, SBlockRealize

BLOCK_TAGS = ("blockIdx.x", "blockIdx.y", "blockIdx.z")
CAP_PARAM = "cap"
PTB_BLOCK_VAR = "ptb_block"
PTB_LOOP_VAR = "ptb_iter"
PTB_VIRTUAL_VAR = "ptb_virtual"
#: Function attribute recording the original grid ``[x, y, z]`` of each rewritten nest, in order.
ATTR_NESTS = "ptb.nests"
SHARED_SCOPES = ("shared", "shared.dyn")


class PTBError(ValueError):
    """A kernel whose block structure the PTB pass does not support."""


def _is_block_loop(stmt: Any) -> bool:
    return (
        isinstance(stmt, tirx.For)
        and stmt.kind == tirx.ForKind.THREAD_BINDING
        and stmt.thread_binding is not None
        and stmt.thread_binding.thread_tag in BLOCK_TAGS
    )


def _count_block_loops(stmt: Any) -> int:
    count = [0]

    def visit(s: Any) -> None:
        if _is_block_loop(s):
            count[0] += 1

    tvm_ffi.structural_walk(stmt, (tirx.For, visit), order="pre")
    return count[0]


def _uses_shared_memory(stmt: Any) -> bool:
    """Whether a kernel's scheduled TIR touches shared memory: a shared-scope buffer, or a reduction
    across threads (an SBlock reduce axis bound to a threadIdx loop), which ``LowerThreadAllreduce``
    later turns into a shared-memory tree reduction."""
    found = [False]
    thread_vars: list[Any] = []

    def buffers(b: Any) -> None:
        if any(buf.scope() in SHARED_SCOPES for buf in b.alloc_buffers):
            found[0] = True

    def loops(f: tirx.For) -> None:
        if f.kind == tirx.ForKind.THREAD_BINDING and f.thread_binding.thread_tag.startswith("threadIdx"):
            thread_vars.append(f.loop_var)

    def stores(s: tirx.BufferStore) -> None:
        if s.buffer.scope() in SHARED_SCOPES:
            found[0] = True

    tvm_ffi.structural_walk(stmt, [(SBlock, buffers), (tirx.For, loops), (tirx.BufferStore, stores)])
    if found[0]:
        return True

    def realize(r: Any) -> None:
        for iv, value in zip(r.block.iter_vars, r.iter_values, strict=True):
            if iv.iter_type == tirx.IterVar.CommReduce and _uses_any(value, thread_vars):
                found[0] = True

    tvm_ffi.structural_walk(stmt, (SBlockRealize, realize))
    return found[0]


def _uses_any(expr: Any, variables: list[Any]) -> bool:
    hit = [False]

    def var(v: Any) -> None:
        if any(v.same_as(t) for t in variables):
            hit[0] = True

    tvm_ffi.structural_walk(expr, (ir.Var, var))
    return hit[0]


@dataclass(frozen=True)
class Nest:
    """One rewritten kernel: its original grid and the number of virtual blocks."""

    grid: tuple[int, int, int]

    @property
    def virtual_blocks(self) -> int:
        return self.grid[0] * self.grid[1] * self.grid[2]


def _stores_outside_sblocks(stmt: Any) -> bool:
    """Whether ``stmt`` writes memory outside any SBlock (where a block predicate cannot guard it)."""
    found = [False]

    def store(_s: Any, _visitor: Any) -> None:
        found[0] = True

    tvm_ffi.structural_visit(stmt, [(SBlockRealize, lambda _r, _v: None), (tirx.BufferStore, store)])
    return found[0]


def _split_nest(loop: tirx.For) -> tuple[list[tirx.For], Any]:
    """The nest's blockIdx-bound loops, outermost first, and the body below them, checked to form one
    grid whose stores a block predicate can guard."""
    loops: list[tirx.For] = []
    stmt: Any = loop
    while _is_block_loop(stmt):
        loops.append(stmt)
        stmt = stmt.body
    if _count_block_loops(stmt):
        raise PTBError("blockIdx-bound loops below non-blockIdx statements (not a single grid)")
    if _stores_outside_sblocks(stmt):
        raise PTBError("stores outside SBlocks: the virtual-block predicate could not guard them")
    return loops, stmt


def _loops_by_tag(loops: list[tirx.For]) -> dict[str, tirx.For]:
    """Each loop by its blockIdx tag; every one bound once and running over [0, constant)."""
    by_tag: dict[str, tirx.For] = {}
    for lp in loops:
        tag = lp.thread_binding.thread_tag
        if tag in by_tag:
            raise PTBError(f"{tag} bound twice in one nest")
        if not isinstance(lp.extent, tirx.IntImm) or not isinstance(lp.min, tirx.IntImm) or int(lp.min):
            raise PTBError(f"{tag} loop is not [0, constant): min={lp.min}, extent={lp.extent}")
        by_tag[tag] = lp
    return by_tag


def _index_dtype(loops: list[tirx.For]) -> str:
    dtype = str(loops[0].loop_var.ty)
    if any(str(lp.loop_var.ty) != dtype for lp in loops):
        raise PTBError("blockIdx loops of different index types")
    return dtype


def _original_block_indices(
    by_tag: dict[str, tirx.For], nest: Nest, v: tirx.Var, dtype: str
) -> list[tuple[Any, Any]]:
    """(blockIdx loop variable, its value) for each original blockIdx loop, from the virtual block ``v``
    (x fastest, then y, then z)."""
    x, y, z = nest.grid
    values: list[tuple[Any, Any]] = []
    if "blockIdx.x" in by_tag:
        vx = v if nest.virtual_blocks == x else tirx.floormod(v, tirx.IntImm(dtype, x))
        values.append((by_tag["blockIdx.x"].loop_var, vx))
    if "blockIdx.y" in by_tag:
        vy = tirx.floordiv(v, tirx.IntImm(dtype, x))
        vy = vy if z == 1 else tirx.floormod(vy, tirx.IntImm(dtype, y))
        values.append((by_tag["blockIdx.y"].loop_var, vy))
    if "blockIdx.z" in by_tag:
        values.append((by_tag["blockIdx.z"].loop_var, tirx.floordiv(v, tirx.IntImm(dtype, x * y))))
    return values


def _guard_sblocks(body: Any, in_range: Any) -> Any:
    """``body`` with ``in_range`` and-ed into every SBlock's predicate."""

    def guard(r: Any) -> Any:
        # ``True && c`` must become ``c``: the affine-binding analysis does not see through it.
        pred = r.predicate
        always = isinstance(pred, tirx.IntImm) and int(pred) == 1
        return SBlockRealize(r.iter_values, in_range if always else tirx.And(pred, in_range), r.block)

    return tvm_ffi.structural_map(body, (SBlockRealize, guard), order="post")


def _rewrite_nest(loop: tirx.For, cap: tirx.Var, barrier: bool) -> tuple[tirx.For, Nest]:
    loops, body = _split_nest(loop)
    by_tag = _loops_by_tag(loops)
    dtype = _index_dtype(loops)

    def c(value: int) -> tirx.IntImm:
        return tirx.IntImm(dtype, value)

    x, y, z = (int(by_tag[t].extent) if t in by_tag else 1 for t in BLOCK_TAGS)
    nest = Nest((x, y, z))
    v_total = nest.virtual_blocks
    cap_i = cap if dtype == "int32" else tirx.Cast(dtype, cap)
    phys = tirx.Min(c(v_total), tirx.Max(cap_i, c(1)))
    b = tirx.Var(PTB_BLOCK_VAR, dtype)
    k = tirx.Var(PTB_LOOP_VAR, dtype)
    v = tirx.Var(PTB_VIRTUAL_VAR, dtype)
    values = [(v, b + k * phys), *_original_block_indices(by_tag, nest, v, dtype)]
    body = _guard_sblocks(body, v < c(v_total))
    stmts: list[Any] = [tirx.Bind(var, value) for var, value in values]
    if barrier:
        stmts.append(tirx.Evaluate(tirx.op.tvm_storage_sync("shared")))
    trips = tirx.floordiv(c(v_total) + phys - c(1), phys)
    inner = tirx.For(k, c(0), trips, tirx.ForKind.SERIAL, tirx.SeqStmt([*stmts, body]))
    iv = tirx.IterVar(ir.Range(c(0), phys), b, tirx.IterVar.ThreadIndex, "blockIdx.x")
    outer = tirx.For(
        b, c(0), phys, tirx.ForKind.THREAD_BINDING, inner, thread_binding=iv, annotations=loops[0].annotations
    )
    return outer, nest


def ptb_rewrite(func: tirx.PrimFunc, check: bool = True) -> tirx.PrimFunc:
    """The PTB form of a scheduled PrimFunc: a trailing ``int32 cap`` parameter, each blockIdx nest
    rewritten (module docstring). The original grids are recorded in the ``ptb.nests`` attribute.
    ``check``: verify that the rewrite keeps every cross-thread reduction lowerable."""
    if func.attrs is not None and ATTR_NESTS in func.attrs:
        return func
    if any(p.name == CAP_PARAM for p in func.params):
        raise PTBError(f"function already has a parameter named {CAP_PARAM!r}")
    cap = tirx.Var(CAP_PARAM, "int32")
    nests: list[Nest] = []

    errors: list[PTBError] = []

    def visit(stmt: tirx.For) -> Any:
        if _is_block_loop(stmt) and stmt.loop_var.name != PTB_BLOCK_VAR:
            try:
                new, nest = _rewrite_nest(stmt, cap, _uses_shared_memory(stmt))
            except PTBError as exc:  # an exception would cross the FFI as a RuntimeError
                errors.append(exc)
                return stmt
            nests.append(nest)
            return new
        return stmt

    body = tvm_ffi.structural_map(func.body, (tirx.For, visit), order="pre")
    if errors:
        raise errors[0]
    if _count_block_loops(body) != len(nests):
        raise PTBError("blockIdx-bound loops left after rewriting (nested grids?)")
    new = tirx.PrimFunc([*func.params, cap], body, ret_type=func.ret_type, attrs=func.attrs)
    new = new.with_attr(ATTR_NESTS, [list(n.grid) for n in nests])
    if check:
        before, after = cross_thread_reductions(func), cross_thread_reductions(new)
        if before != after:
            raise PTBError(f"{after} cross-thread reductions lowered after the rewrite, {before} before")
    return new


def cross_thread_reductions(func: tirx.PrimFunc) -> int:
    """How many ``tvm_thread_allreduce`` TVM's ``LowerCrossThreadReduction`` makes of ``func``."""
    mod = tvm.IRModule({"f": func})
    mod = tvm.transform.Sequential(
        [s_tir.transform.CanonicalizeLoop(), s_tir.transform.LowerCrossThreadReduction()]
    )(mod)
    count = [0]

    def call(c: Any) -> None:
        if _is_call(c, "tirx.tvm_thread_allreduce"):
            count[0] += 1

    tvm_ffi.structural_walk(mod["f"].body, (ir.Call, call))
    return count[0]


def nests_of(func: tirx.PrimFunc) -> list[Nest]:
    """The nests ``ptb_rewrite`` recorded on ``func`` (empty for a function it did not rewrite)."""
    if func.attrs is None or ATTR_NESTS not in func.attrs:
        return []
    return [Nest(tuple(int(d) for d in g)) for g in func.attrs[ATTR_NESTS]]  # type: ignore[arg-type]


def PTBTransform() -> tvm.transform.Pass:  # noqa: N802 -- TVM's pass naming
    """``ptb_rewrite`` as a ``tvm.tirx`` PrimFunc pass (functions already rewritten are left alone)."""

    @tirx.transform.prim_func_pass(opt_level=0, name="PTBTransform")
    def _pass(func: tirx.PrimFunc, _mod: tvm.IRModule, _ctx: tvm.transform.PassContext) -> tirx.PrimFunc:
        return ptb_rewrite(func)

    return _pass


# --- device side ------------------------------------------------------------------------------------


def cap_param_last(device_func: tirx.PrimFunc, prim_func: tirx.PrimFunc) -> tuple[tirx.PrimFunc, list[int]]:
    """Reorder a lowered kernel's parameters into ``prim_func``'s order, ``cap`` last (added if the
    kernel does not use it). Returns (kernel, PrimFunc parameter index of each kernel parameter but
    the cap). Kernel buffer parameters are the PrimFunc buffers' data pointers, ``<name>_ptr``."""
    index = {p.name: i for i, p in enumerate(prim_func.params)}
    if len(index) != len(prim_func.params):
        raise PTBError(f"duplicate parameter names in {prim_func.params}")
    keyed: list[tuple[int, Any]] = []
    cap = None
    for p in device_func.params:
        if p.name == CAP_PARAM:
            cap = p
            continue
        base = p.name[: -len("_ptr")] if p.name.endswith("_ptr") else p.name
        if base not in index or base == CAP_PARAM:
            raise PTBError(f"kernel parameter {p.name!r} matches no PrimFunc parameter")
        keyed.append((index[base], p))
    keyed.sort(key=lambda t: t[0])
    if cap is None:
        cap = tirx.Var(CAP_PARAM, "int32")
    params = [p for _, p in keyed] + [cap]
    new = tirx.PrimFunc(params, device_func.body, ret_type=device_func.ret_type, attrs=device_func.attrs)
    return new, [i for i, _ in keyed]


def _is_call(node: Any, name: str) -> bool:
    return isinstance(node, ir.Call) and isinstance(node.op, ir.Op) and node.op.name == name


@dataclass(frozen=True)
class SyncAudit:
    """Shared memory in a lowered PTB kernel: does each virtual block start with a barrier?"""

    ptb_loops: int
    shared_stores: int  # stores to shared memory inside the PTB loops
    ok: bool  # no shared stores, or a barrier precedes the first one in every PTB loop body
    detail: str = ""


def audit_shared_sync(device_func: tirx.PrimFunc) -> SyncAudit:
    """Check, on a lowered kernel, that inside each PTB loop a ``tvm_storage_sync`` on shared memory
    comes before the loop body's first shared-memory store, so that a physical block's next virtual
    block cannot overwrite shared memory its threads still read for the previous one. (The barrier
    is TVM's ``ThreadSync`` doing, which runs after the PTB rewrite and sees the new loop.)"""
    loops: list[tirx.For] = []

    def collect(f: tirx.For) -> None:
        if f.loop_var.name == PTB_LOOP_VAR:
            loops.append(f)

    tvm_ffi.structural_walk(device_func.body, (tirx.For, collect), order="pre")
    total_stores = 0
    problems: list[str] = []
    for lp in loops:
        events = _shared_events(lp.body)
        stores = events.count("store")
        total_stores += stores
        first_sync = events.index("sync") if "sync" in events else len(events)
        if stores and events.index("store") < first_sync:
            problems.append(f"shared store before any barrier in {PTB_LOOP_VAR} loop")
    return SyncAudit(len(loops), total_stores, not problems, "; ".join(problems))


def _shared_events(stmt: Any) -> list[str]:
    """Shared-memory stores ("store") and shared-memory barriers ("sync") of ``stmt`` in program order."""
    events: list[str] = []

    def store(s: tirx.BufferStore) -> None:
        if s.buffer.scope() in SHARED_SCOPES:
            events.append("store")

    def call(c: Any) -> None:
        if _is_call(c, "tirx.tvm_storage_sync") and str(c.args[0]).strip('"') in SHARED_SCOPES:
            events.append("sync")
        elif _is_call(c, "tirx.ptx_cp_async") or _is_call(c, "tirx.ptx_ldmatrix"):
            events.append("store")

    tvm_ffi.structural_walk(stmt, [(tirx.BufferStore, store), (ir.Call, call)], order="pre")
    return events


# --- CPU semantics ---------------------------------------------------------------------------------


def serialize_threads(func: tirx.PrimFunc) -> tirx.PrimFunc:
    """Every thread-bound loop (blockIdx, vthread, threadIdx) of scheduled TIR as a serial loop,
    barriers dropped, and loop annotations (unroll pragmas) dropped to keep the LLVM build small.

    Scheduled TIR has sequential semantics: dlight's primitives preserve the meaning of the loop nest
    as written, thread bindings only license running iterations in parallel, and the barriers that
    shared memory needs are inserted later (``ThreadSync``). Serialising gives a function the LLVM
    backend builds and whose results the GPU kernel must reproduce."""

    def visit(f: tirx.For) -> Any:
        if f.kind == tirx.ForKind.THREAD_BINDING or len(f.annotations):
            kind = tirx.ForKind.SERIAL if f.kind == tirx.ForKind.THREAD_BINDING else f.kind
            return tirx.For(f.loop_var, f.min, f.extent, kind, f.body)
        return f

    def strip_sync(e: tirx.Evaluate) -> Any:
        return tirx.Evaluate(tirx.IntImm("int32", 0)) if _is_call(e.value, "tirx.tvm_storage_sync") else e

    body = tvm_ffi.structural_map(func.body, [(tirx.For, visit), (tirx.Evaluate, strip_sync)], order="post")
    return func.with_body(body)


def written_params(func: tirx.PrimFunc) -> list[int]:
    """Indices of the buffer parameters ``func`` stores to (its outputs, in destination passing)."""
    stored: list[Any] = []
    tvm_ffi.structural_walk(func.body, (tirx.BufferStore, lambda s: stored.append(s.buffer)), order="pre")
    return [i for i, p in enumerate(func.params) if any(p.same_as(b) for b in stored)]
