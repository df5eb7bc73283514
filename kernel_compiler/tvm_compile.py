"""``compile_model``: a zoo model -> PTB CUDA kernels (source, PTX, cubin, manifest) in the model pool.

Pipeline (timed step by step in ``CompileReport.timings``):

    export/import   torch.export + Relax torch frontend                     (tvm_frontend)
    legalize        Relax ops -> fused TIR PrimFuncs                        (tvm_frontend)
    schedule        dlight GPU schedules                                    (tvm_frontend)
    ptb             persistent-thread-block rewrite of every PrimFunc       (ptb)
    lower/codegen   TVM TIR pipeline, launch analysis, CUDA C               (tvm_codegen)
    nvcc_ptx/cubin  nvcc -> PTX -> cubin for the arch                       (cuda_build)

and before all that ``plan``: the plan itself (``ModelPool.get_or_lower``: lowering plus the memory
profile -- the paper's "offline profiling"), so that the kernels land beside it in
``<plan dir>/kernels/<arch>/`` (see ``ptb_manifest``). The directory is written under a temporary
name and renamed into place, replacing an older compilation for the same arch.

This module imports TVM only when ``compile_model`` runs: without the ``compiler`` extra
(``pip install 'streambox[compiler]'``) it raises ``CompilerUnavailable``.
"""

from __future__ import annotations

import os
import resource
import shutil
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from .cuda_build import NvccError, check_arch, compile_cuda, find_nvcc
from .model_pool import ModelPool
from .ptb_manifest import CONSTANTS_FILE, SOURCE_FILE, KernelManifest, KernelSpec, kernels_dir
from .zoo import build_model, example_input, get_entry


class CompilerUnavailable(RuntimeError):
    """apache-tvm is not installed."""


def require_tvm() -> Any:
    try:
        import tvm
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise CompilerUnavailable(
            "the kernel compiler needs apache-tvm: pip install 'streambox[compiler]' (apache-tvm==0.27.*)"
        ) from exc
    return tvm


@dataclass
class CompileReport:
    model: str
    batch: int
    input_shape: list[int]
    arch: str
    out_dir: Path
    prim_funcs: int
    kernels: int
    kernels_with_shared_memory: int
    shared_sync_ok: bool  # every PTB kernel passed ptb.audit_shared_sync (lowering raises otherwise)
    source_bytes: int
    image_bytes: dict[str, int]  # "ptx"/"cubin" -> bytes
    timings: dict[str, float]  # seconds per step (module docstring)
    schedule_rules: dict[str, int]  # dlight rule -> PrimFuncs it scheduled
    graph_complete: bool
    plan_cached: bool = False
    nvcc_version: str = ""
    nvcc_warnings: int = 0
    nvcc_skipped: str = ""  # why nvcc did not run (no nvcc found, nvcc=False)
    rule_failures: dict[str, list[str]] = field(default_factory=dict)
    # CPU seconds (this process and its children, e.g. nvcc) of plan/frontend/ptb/codegen/nvcc: less
    # sensitive than wall time to other work on a shared machine.
    cpu_seconds: dict[str, float] = field(default_factory=dict)

    @property
    def frontend_s(self) -> float:
        return sum(self.timings.get(k, 0.0) for k in ("export", "import", "legalize", "schedule"))

    @property
    def ptb_s(self) -> float:
        return self.timings.get("ptb", 0.0)

    @property
    def codegen_s(self) -> float:
        return sum(self.timings.get(k, 0.0) for k in ("lower", "launch_analysis", "codegen"))

    @property
    def nvcc_s(self) -> float:
        return self.timings.get("nvcc_ptx", 0.0) + self.timings.get("nvcc_cubin", 0.0)

    @property
    def compile_s(self) -> float:
        """Everything but the plan: frontend, PTB, codegen and nvcc."""
        return self.frontend_s + self.ptb_s + self.codegen_s + self.nvcc_s

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["out_dir"] = str(self.out_dir)
        d.update(
            frontend_s=self.frontend_s,
            ptb_s=self.ptb_s,
            codegen_s=self.codegen_s,
            nvcc_s=self.nvcc_s,
            compile_s=self.compile_s,
        )
        return d

    def summary(self) -> str:
        t = self.timings
        return (
            f"{self.model} b{self.batch} {'x'.join(map(str, self.input_shape))} {self.arch}: "
            f"{self.prim_funcs} PrimFuncs, {self.kernels} PTB kernels -> {self.out_dir}\n"
            f"  frontend {self.frontend_s:.2f} s (export {t.get('export', 0):.2f}, "
            f"import {t.get('import', 0):.2f}, legalize {t.get('legalize', 0):.2f}, "
            f"schedule {t.get('schedule', 0):.2f}), "
            f"ptb {self.ptb_s:.3f} s, codegen {self.codegen_s:.2f} s, nvcc {self.nvcc_s:.2f} s"
            f"{' (' + self.nvcc_skipped + ')' if self.nvcc_skipped else ''}; plan {t.get('plan', 0):.2f} s"
        )


class _Clock:
    """Wall seconds into ``wall[key]`` (when given) and CPU seconds, children included, into ``cpu[key]``."""

    def __init__(self, wall: dict[str, float] | None, cpu: dict[str, float], key: str) -> None:
        self.wall, self.cpu, self.key = wall, cpu, key

    @staticmethod
    def _cpu() -> float:
        own = resource.getrusage(resource.RUSAGE_SELF)
        children = resource.getrusage(resource.RUSAGE_CHILDREN)
        return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime

    def __enter__(self) -> _Clock:
        self.t0, self.c0 = time.perf_counter(), self._cpu()
        return self

    def __exit__(self, *exc: object) -> None:
        if self.wall is not None:
            self.wall[self.key] = time.perf_counter() - self.t0
        self.cpu[self.key] = self._cpu() - self.c0


def _replace_dir(tmp: Path, final: Path) -> None:
    old = None
    if final.exists():
        old = Path(tempfile.mkdtemp(prefix=f".old-{final.name}-", dir=final.parent))
        os.rename(final, old / "x")
    os.rename(tmp, final)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def compile_model(
    model: str,
    arch: str = "sm_90",
    pool_root: Path | str | None = None,
    batch: int = 1,
    input_shape: tuple[int, ...] | None = None,
    *,
    nvcc: str | bool | None = None,
    pool: ModelPool | None = None,
    scheduled: Any = None,
) -> CompileReport:
    """Compile zoo model ``model`` for ``arch`` into ``<pool>/<plan dir>/kernels/<arch>/``.

    ``nvcc``: a path, None to look for one (skipped with a note when none is found), or False to emit
    only the CUDA source. ``pool`` overrides ``pool_root`` (a pool with its own lowering function).
    ``scheduled``: a ``tvm_frontend.ScheduledModel`` of this model and shape (scheduled for a CUDA
    target), to skip the frontend.
    """
    check_arch(arch)
    tvm = require_tvm()
    from . import ptb as ptb_mod
    from .tvm_codegen import lower_to_cuda
    from .tvm_frontend import cuda_target, describe_graph, schedule_model

    entry = get_entry(model)
    shape = tuple(input_shape) if input_shape is not None else entry.input_shape
    pool = pool if pool is not None else ModelPool(pool_root)
    timings: dict[str, float] = {}

    cpu: dict[str, float] = {}
    with _Clock(timings, cpu, "plan"):
        cached = pool.get(model, batch, shape) is not None
        pool.get_or_lower(model, batch, shape)
    plan_dir = pool.path_for(model, batch, shape)

    with _Clock(None, cpu, "frontend"):
        if scheduled is None:
            scheduled = schedule_model(build_model(model), example_input(model, batch, shape), arch)
    timings.update(scheduled.timings)

    with _Clock(timings, cpu, "ptb"):
        ptb_funcs = {name: ptb_mod.ptb_rewrite(f) for name, f in scheduled.prim_funcs.items()}

    with _Clock(None, cpu, "codegen"):
        cuda = lower_to_cuda(ptb_funcs, cuda_target(arch), ptb=True)
        graph, constants = describe_graph(scheduled.mod, scheduled.param_names)
    timings.update(cuda.timings)

    final = kernels_dir(plan_dir, arch)
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{arch}-", dir=final.parent))
    try:
        (tmp / SOURCE_FILE).write_text(cuda.source)
        if constants:
            from safetensors.numpy import save_file

            save_file({k: v.copy() for k, v in constants.items()}, str(tmp / CONSTANTS_FILE))
        images: dict[str, str] = {}
        version, warnings, skipped = "", 0, ""
        nvcc_path = None if nvcc is False else (nvcc if isinstance(nvcc, str) else find_nvcc())
        if nvcc is False:
            skipped = "nvcc=False"
        elif nvcc_path is None:
            skipped = "nvcc not found"
        else:
            with _Clock(None, cpu, "nvcc"):
                result = compile_cuda(tmp / SOURCE_FILE, tmp, arch, nvcc=nvcc_path)
            images = {"ptx": result.ptx.name, "cubin": result.cubin.name}
            version, warnings = result.version, result.warnings
            timings["nvcc_ptx"], timings["nvcc_cubin"] = result.timings["ptx"], result.timings["cubin"]
        manifest = KernelManifest(
            model=model,
            batch=batch,
            input_shape=list(shape),
            arch=arch,
            kernels=[KernelSpec(**k) for k in cuda.kernel_dicts()],
            prim_funcs=cuda.prim_funcs,
            graph=graph,
            images=images,
            constants=CONSTANTS_FILE if constants else None,
            tvm_version=str(tvm.__version__),
            nvcc_version=version,
            timings=timings,
            schedule_rules=scheduled.schedule_rules,
        )
        manifest.save(tmp)
        image_bytes = {fmt: (tmp / name).stat().st_size for fmt, name in images.items()}
        _replace_dir(tmp, final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise

    rules: dict[str, int] = {}
    for r in scheduled.schedule_rules.values():
        rules[r] = rules.get(r, 0) + 1
    with_shared = [k for k in cuda.kernels if k.shared_sync.get("shared_stores", 0)]
    return CompileReport(
        model=model,
        batch=batch,
        input_shape=list(shape),
        arch=arch,
        out_dir=final,
        prim_funcs=len(ptb_funcs),
        kernels=len(cuda.kernels),
        kernels_with_shared_memory=len(with_shared),
        shared_sync_ok=all(k.shared_sync.get("ok", True) for k in cuda.kernels),
        source_bytes=len(cuda.source.encode()),
        image_bytes=image_bytes,
        timings=timings,
        schedule_rules=rules,
        graph_complete=bool(graph["complete"]),
        plan_cached=cached,
        nvcc_version=version,
        nvcc_warnings=warnings,
        nvcc_skipped=skipped,
        rule_failures=scheduled.rule_failures,
        cpu_seconds=cpu,
    )


__all__ = ["CompileReport", "CompilerUnavailable", "NvccError", "compile_model", "require_tvm"]
