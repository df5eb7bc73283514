"""nvcc: CUDA C -> PTX and cubin for one architecture (no GPU needed). No TVM import.

``compile_cuda(source, out_dir, arch)`` runs nvcc once to PTX (``-arch=compute_XX --ptx``: the front end
and NVVM, the slow part) and once more to assemble that PTX into a cubin for ``sm_XX`` (ptxas, fast).
The cubin is what ``device/cuda.py``'s ``load_module`` loads; the PTX is kept so a driver for a newer
GPU can JIT it.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

#: Architectures the kernel compiler targets (the brief's sm_75 .. sm_90).
SUPPORTED_ARCHS = ("sm_75", "sm_80", "sm_86", "sm_87", "sm_89", "sm_90")
ENV_NVCC = "STREAMBOX_NVCC"


class NvccError(RuntimeError):
    """nvcc is missing or failed; ``stderr`` holds its diagnostics."""

    def __init__(self, message: str, stderr: str = "") -> None:
        super().__init__(message if not stderr else f"{message}\n{stderr[-4000:]}")
        self.stderr = stderr


def check_arch(arch: str) -> str:
    if arch not in SUPPORTED_ARCHS:
        raise ValueError(f"unsupported architecture {arch!r}; choose one of {', '.join(SUPPORTED_ARCHS)}")
    return arch


def find_nvcc() -> str | None:
    """``$STREAMBOX_NVCC``, ``nvcc`` on PATH, or ``$CUDA_HOME/bin/nvcc``; None if none exists."""
    env = os.environ.get(ENV_NVCC)
    if env:
        return env if Path(env).exists() else None
    found = shutil.which("nvcc")
    if found:
        return found
    for home in (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"):
        if home and (Path(home) / "bin" / "nvcc").exists():
            return str(Path(home) / "bin" / "nvcc")
    return None


def nvcc_version(nvcc: str) -> str:
    out = subprocess.run([nvcc, "--version"], capture_output=True, text=True, check=True).stdout
    m = re.search(r"release ([\d.]+), V([\d.]+)", out)
    return m.group(2) if m else out.strip().splitlines()[-1]


@dataclass
class NvccResult:
    arch: str
    ptx: Path
    cubin: Path
    nvcc: str
    version: str
    timings: dict[str, float] = field(default_factory=dict)  # ptx, cubin
    warnings: int = 0  # nvcc warnings (TVM's sources declare some unused temporaries)


def _run(cmd: list[str], what: str) -> tuple[str, float]:
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise NvccError(f"{what} failed (exit {proc.returncode}): {' '.join(cmd)}", proc.stderr)
    return proc.stderr, time.perf_counter() - t0


def compile_cuda(
    source: Path | str,
    out_dir: Path | str,
    arch: str = "sm_90",
    *,
    nvcc: str | None = None,
    stem: str = "kernels",
    options: tuple[str, ...] = ("-O3",),
) -> NvccResult:
    """Compile the ``.cu`` file ``source`` into ``out_dir/<stem>.ptx`` and ``out_dir/<stem>.cubin``."""
    check_arch(arch)
    nvcc = nvcc or find_nvcc()
    if nvcc is None:
        raise NvccError("nvcc not found (set STREAMBOX_NVCC or put the CUDA toolkit's bin on PATH)")
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    number = arch.split("_", 1)[1]
    ptx, cubin = out_dir / f"{stem}.ptx", out_dir / f"{stem}.cubin"
    err1, t_ptx = _run(
        [nvcc, f"-arch=compute_{number}", "--ptx", *options, "-o", str(ptx), str(source)], "nvcc --ptx"
    )
    err2, t_cubin = _run(
        [nvcc, f"-arch={arch}", "--cubin", *options, "-o", str(cubin), str(ptx)], "nvcc --cubin"
    )
    warnings = len(re.findall(r"warning", err1 + err2))
    return NvccResult(arch, ptx, cubin, nvcc, nvcc_version(nvcc), {"ptx": t_ptx, "cubin": t_cubin}, warnings)
