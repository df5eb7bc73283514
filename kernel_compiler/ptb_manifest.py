"""Compiled PTB kernels in the model pool: the ``kernels.json`` manifest and launching. No TVM import.

Layout, beside a plan (``ModelPool.path_for(model, batch, shape)``)::

    <plan dir>/kernels/<arch>/kernels.json         this manifest
                              kernels.cu           the CUDA C TVM emitted (PTB form)
                              kernels.ptx          nvcc -arch=compute_XX --ptx
                              kernels.cubin        PTX assembled for sm_XX (what load_module loads)
                              constants.safetensors  tensors the Relax frontend folded (BN statistics)

Every kernel is in persistent-thread-block form. Its arguments are the device pointers of the buffers
listed in ``args`` (in that order), then the cap as a last ``int32`` -- exactly what
``CudaRuntime.launch_function(stream, fn, grid, block, args, shared_mem, cu_cap=cap)`` passes -- and it
must be launched with a 1-D grid of ``min(grid[0], cap)`` blocks (``launch_function`` does that).
``grid[0]`` is the number of virtual blocks: launching with ``cap >= grid[0]`` is the original launch.

``graph`` lists the model as PrimFunc calls over named tensors (destination passing: a PrimFunc's
parameters are ``args + outputs``) and ``prim_funcs`` maps each PrimFunc to its kernels, launched in
order; ``weights`` maps the graph's weight inputs to torch ``state_dict`` keys.
"""

from __future__ import annotations

import ctypes
import json
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

MANIFEST_FILE = "kernels.json"
SOURCE_FILE = "kernels.cu"
CONSTANTS_FILE = "constants.safetensors"
KERNELS_DIR = "kernels"
MANIFEST_SCHEMA = 1


def kernels_dir(plan_dir: Path | str, arch: str) -> Path:
    return Path(plan_dir) / KERNELS_DIR / arch


@dataclass
class KernelSpec:
    name: str
    prim_func: str
    grid: list[int]  # [virtual blocks, 1, 1]
    original_grid: list[int]
    block: list[int]
    dynamic_shared_mem: int
    static_shared_mem: int
    args: list[dict[str, Any]]  # {"name", "kind": "buffer"|"cap", "dtype", "shape", "param_index"}
    cap_arg: int | None
    ptb: bool = True
    shared_sync: dict[str, Any] = field(default_factory=dict)

    @property
    def virtual_blocks(self) -> int:
        return self.grid[0] * self.grid[1] * self.grid[2]

    def physical_blocks(self, cap: int | None) -> int:
        return self.virtual_blocks if cap is None else min(self.virtual_blocks, max(1, int(cap)))


@dataclass
class KernelManifest:
    model: str
    batch: int
    input_shape: list[int]
    arch: str
    kernels: list[KernelSpec]
    prim_funcs: dict[str, dict[str, Any]]
    graph: dict[str, Any]
    images: dict[str, str]  # format -> file name: "cubin", "ptx"
    source: str = SOURCE_FILE
    constants: str | None = None
    tvm_version: str = ""
    nvcc_version: str = ""
    cap_convention: str = "last int32 argument; physical grid = min(grid[0], cap), 1-D"
    timings: dict[str, float] = field(default_factory=dict)
    schedule_rules: dict[str, str] = field(default_factory=dict)
    schema_version: int = MANIFEST_SCHEMA

    def kernel(self, name: str) -> KernelSpec:
        for k in self.kernels:
            if k.name == name:
                return k
        raise KeyError(name)

    def kernels_of(self, prim_func: str) -> list[KernelSpec]:
        return [self.kernel(n) for n in self.prim_funcs[prim_func]["kernels"]]

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def save(self, directory: Path | str) -> Path:
        path = Path(directory) / MANIFEST_FILE
        path.write_text(json.dumps(self.to_dict(), indent=1))
        return path

    @classmethod
    def load(cls, directory: Path | str) -> KernelManifest:
        d = json.loads((Path(directory) / MANIFEST_FILE).read_text())
        if d.get("schema_version") != MANIFEST_SCHEMA:
            raise ValueError(f"kernel manifest schema {d.get('schema_version')!r} is not {MANIFEST_SCHEMA}")
        d["kernels"] = [KernelSpec(**k) for k in d["kernels"]]
        return cls(**d)


def kernel_args(spec: KernelSpec, params: Sequence[int]) -> list[Any]:
    """``launch_function`` arguments of ``spec`` (without the cap, which ``cu_cap`` appends) from the
    device addresses of its PrimFunc's parameters, in PrimFunc order."""
    args: list[Any] = []
    for a in spec.args:
        if a["kind"] == "cap":
            continue
        if a["kind"] != "buffer":
            raise TypeError(f"{spec.name}: unsupported argument kind {a['kind']!r}")
        args.append(ctypes.c_uint64(int(params[a["param_index"]])))
    return args


def launch_prim_func(
    runtime: Any,
    stream: Any,
    functions: Mapping[str, Any],
    manifest: KernelManifest,
    prim_func: str,
    params: Sequence[int],
    cap: int | None = None,
) -> None:
    """Launch ``prim_func``'s kernels in order on a ``CudaRuntime`` with ``cap`` (None: uncapped).

    ``functions`` maps kernel names to ``CUfunction``s (``runtime.get_function``); ``params`` are the
    device addresses of the PrimFunc's buffer parameters in order."""
    for spec in manifest.kernels_of(prim_func):
        runtime.launch_function(
            stream,
            functions[spec.name],
            grid=spec.grid,
            block=spec.block,
            args=kernel_args(spec, params),
            shared_mem=spec.dynamic_shared_mem,
            cu_cap=spec.virtual_blocks if cap is None else cap,
        )


def emulated_launch(runtime: Any, stream: Any, spec: KernelSpec, body: Any, cap: int | None = None) -> None:
    """Account a PTB kernel on the emulated device: ``blocks`` is its virtual grid, ``cu_cap`` the cap,
    so it occupies min(grid, cap, compute units) units; ``body`` computes its effect on the host."""
    runtime.launch(stream, body, blocks=spec.virtual_blocks, cu_cap=cap, name=spec.name)
