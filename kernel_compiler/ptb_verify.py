"""CPU checks of the PTB rewrite: every kernel computes what it computed before, for any cap.

Method (``verify_ptb``): for every scheduled PrimFunc ``f`` of a model, build two functions for LLVM
from the *same* scheduled TIR -- ``serialize_threads(f)`` and ``serialize_threads(ptb_rewrite(f))`` --
and run them on identical random inputs. Outputs start as NaN (integers: a sentinel), so a virtual
block that the PTB form skipped leaves poison behind. The PTB form runs at caps 1, 2, 7, V and V + 3
(V: virtual blocks of the function's largest grid); the cap is an ordinary argument, so one build
serves every cap. Outputs must be *bitwise* identical: each element is computed by the same
block/thread code with the same reduction order; only the order of the virtual blocks changes.

What this shows and what it does not: scheduled TIR has sequential semantics (``ptb.serialize_threads``),
so this checks that the rewrite maps the block-index space onto itself exactly once for each cap, with
the values the body saw before -- linearised 2-D/3-D grids and the masked tail included. Interleaving of
threads inside a block is not exercised on the CPU. The hazards the rewrite could add there are checked
structurally instead: ``ptb_rewrite`` makes TVM lower as many cross-thread reductions as before, and
``ptb.audit_shared_sync`` checks the per-virtual-block barrier on each lowered kernel. Because
serialisation happens before TVM's lowering (no barriers exist yet; cross-thread reductions are plain
reductions), kernels with shared memory and ``__syncthreads`` need no special treatment: none is
excluded.

``CpuKernels`` and ``run_graph_cpu`` run a whole model from the serialised PTB PrimFuncs (a model-level
check against torch, and the bodies of kernels launched on the emulated device).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import tvm
from tvm import tirx

from .ptb import nests_of, ptb_rewrite, serialize_threads, written_params

DEFAULT_CAPS = (1, 2, 7)
_INT_SENTINEL = -12345


@dataclass
class KernelCheck:
    prim_func: str
    grids: list[list[int]]  # original grid of each kernel of the function
    caps: list[int]
    ok: bool
    mismatches: list[str] = field(default_factory=list)


@dataclass
class VerifyReport:
    checks: list[KernelCheck]
    excluded: dict[str, str]  # PrimFunc -> why it was not checked
    build_s: float
    run_s: float
    kernels: Any = field(default=None, repr=False)  # the CpuKernels the check built

    @property
    def ok(self) -> bool:
        return all(c.ok for c in self.checks)

    @property
    def kernels_checked(self) -> int:
        return sum(max(1, len(c.grids)) for c in self.checks)

    def summary(self) -> str:
        bad = [c.prim_func for c in self.checks if not c.ok]
        return (
            f"{len(self.checks)} PrimFuncs ({self.kernels_checked} kernels) checked, {len(bad)} mismatching"
            f"{' ' + str(bad) if bad else ''}, {len(self.excluded)} excluded; "
            f"LLVM build {self.build_s:.1f} s, runs {self.run_s:.1f} s"
        )


def _random_inputs(func: tirx.PrimFunc, outputs: set[int], rng: np.random.Generator) -> list[np.ndarray]:
    arrays = []
    for i, p in enumerate(func.params):
        ty = p.ty
        shape = [int(s) for s in ty.shape]
        dtype = str(ty.dtype)
        if "float" in dtype:
            a = np.full(shape, np.nan, dtype) if i in outputs else rng.standard_normal(shape).astype(dtype)
        elif dtype == "bool":
            a = np.zeros(shape, bool) if i in outputs else rng.integers(0, 2, shape).astype(bool)
        else:
            # Integer inputs are indices in the zoo (token ids): small non-negative values stay in bounds.
            a = (
                np.full(shape, _INT_SENTINEL, dtype)
                if i in outputs
                else rng.integers(0, 8, shape).astype(dtype)
            )
        arrays.append(a)
    return arrays


def _buffer_params(func: tirx.PrimFunc) -> bool:
    return all(hasattr(p.ty, "shape") for p in func.params)


class CpuKernels:
    """LLVM builds of the serialised PTB form of scheduled PrimFuncs (and, with ``originals``, of the
    serialised originals): ``kernels(name, tensors, cap)`` runs one, ``kernels.original(name, tensors)``
    runs the original. ``tensors``: ``tvm.runtime`` tensors, the PrimFunc's parameters in order."""

    def __init__(
        self,
        prim_funcs: Mapping[str, tirx.PrimFunc],
        originals: bool = False,
        rewrite: Callable[[tirx.PrimFunc], tirx.PrimFunc] = ptb_rewrite,
    ) -> None:
        self.names = list(prim_funcs)
        self.ptb: dict[str, tirx.PrimFunc] = {}
        funcs = {}
        for i, (name, f) in enumerate(prim_funcs.items()):
            g = f if nests_of(f) else rewrite(f)
            self.ptb[name] = g
            funcs[f"ptb_{i}"] = serialize_threads(g).with_attr("global_symbol", f"ptb_{i}")
            if originals:
                funcs[f"orig_{i}"] = serialize_threads(f).with_attr("global_symbol", f"orig_{i}")
        t0 = time.perf_counter()
        self.lib = tvm.compile(tvm.IRModule(funcs), target="llvm").mod
        self.build_s = time.perf_counter() - t0
        self._index = {name: i for i, name in enumerate(self.names)}

    def __call__(self, name: str, tensors: list[Any], cap: int) -> None:
        self.lib[f"ptb_{self._index[name]}"](*tensors, cap)

    def original(self, name: str, tensors: list[Any]) -> None:
        self.lib[f"orig_{self._index[name]}"](*tensors)


def verify_ptb(
    prim_funcs: Mapping[str, tirx.PrimFunc],
    caps: tuple[int, ...] = DEFAULT_CAPS,
    seed: int = 0,
    rewrite: Callable[[tirx.PrimFunc], tirx.PrimFunc] = ptb_rewrite,
) -> VerifyReport:
    """Check every scheduled PrimFunc as in the module docstring (``rewrite``: the PTB rewrite under
    test; the default is the real one, tests substitute broken ones to see the check fail). The
    report's ``kernels`` are the LLVM builds, for reuse."""
    rng = np.random.default_rng(seed)
    excluded = {name: "scalar parameters" for name, f in prim_funcs.items() if not _buffer_params(f)}
    funcs = {name: f for name, f in prim_funcs.items() if name not in excluded}
    kernels = CpuKernels(funcs, originals=True, rewrite=rewrite)
    t1 = time.perf_counter()
    checks: list[KernelCheck] = []
    for name, f in funcs.items():
        nests = nests_of(kernels.ptb[name])
        v = max((n.virtual_blocks for n in nests), default=1)
        all_caps = sorted({*caps, v, v + 3})
        inputs = _random_inputs(f, set(written_params(f)), rng)
        ref = [tvm.runtime.tensor(a.copy()) for a in inputs]
        kernels.original(name, ref)
        expected = [r.numpy() for r in ref]
        mismatches = []
        for cap in all_caps:
            out = [tvm.runtime.tensor(a.copy()) for a in inputs]
            kernels(name, out, cap)
            for j, (e, o) in enumerate(zip(expected, out, strict=True)):
                if not np.array_equal(e, o.numpy(), equal_nan=e.dtype.kind == "f"):
                    mismatches.append(f"cap={cap} param={f.params[j].name}")
        checks.append(KernelCheck(name, [list(n.grid) for n in nests], all_caps, not mismatches, mismatches))
    t2 = time.perf_counter()
    return VerifyReport(checks, excluded, kernels.build_s, t2 - t1, kernels)


def run_graph_cpu(
    graph: Mapping[str, Any],
    kernels: CpuKernels,
    values: Mapping[str, np.ndarray],
    cap: int,
    launch: Callable[[dict[str, Any], Callable[[], None]], None] | None = None,
) -> dict[str, np.ndarray]:
    """Run ``graph`` (``tvm_frontend.describe_graph``) with the PTB kernels at ``cap``. ``values``:
    the inputs, weights and constants by graph name. ``launch(call, body)`` runs each call's body
    (default: directly; the emulated-device test enqueues it on a stream instead)."""
    env: dict[str, Any] = {}
    for name, desc in graph["tensors"].items():
        if name in values:
            env[name] = tvm.runtime.tensor(np.ascontiguousarray(values[name], dtype=desc["dtype"]))
        else:
            env[name] = tvm.runtime.empty(desc["shape"], desc["dtype"])
    for call in graph["calls"]:
        tensors = [env[n] for n in (*call["args"], *call["outputs"])]

        def body(call: dict[str, Any] = call, tensors: list[Any] = tensors) -> None:
            kernels(call["func"], tensors, cap)

        if launch is None:
            body()
        else:
            launch(call, body)
    return {name: env[name] for name in graph["outputs"]}  # tvm tensors: read them after the launches
