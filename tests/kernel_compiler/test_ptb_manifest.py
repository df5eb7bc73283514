"""The parts of the kernel compiler that need no TVM: the kernels.json manifest, launch arguments,
nvcc discovery, and that importing the compiler's entry point does not import TVM (the core suite
runs without the ``compiler`` extra)."""

from __future__ import annotations

import ctypes
import os
import subprocess
import sys
import textwrap

import pytest

from streambox.kernel_compiler import cuda_build
from streambox.kernel_compiler.ptb_manifest import (
    KernelManifest,
    KernelSpec,
    kernel_args,
    kernels_dir,
    launch_prim_func,
)


def _spec(name="k_kernel", grid=40, args=("x", "w", "y")) -> KernelSpec:
    return KernelSpec(
        name=name,
        prim_func="k",
        grid=[grid, 1, 1],
        original_grid=[10, 4, 1],
        block=[128, 1, 1],
        dynamic_shared_mem=0,
        static_shared_mem=512,
        args=[
            *(
                {"name": n, "kind": "buffer", "dtype": "float32", "shape": [4], "param_index": i}
                for i, n in enumerate(args)
            ),
            {"name": "cap", "kind": "cap", "dtype": "int32", "shape": [], "param_index": -1},
        ],
        cap_arg=len(args),
    )


def _manifest() -> KernelManifest:
    return KernelManifest(
        model="m",
        batch=1,
        input_shape=[4],
        arch="sm_90",
        kernels=[_spec()],
        prim_funcs={"k": {"params": [], "kernels": ["k_kernel"]}},
        graph={"calls": []},
        images={"cubin": "kernels.cubin"},
    )


def test_manifest_round_trip(tmp_path):
    m = _manifest()
    d = kernels_dir(tmp_path / "plan", "sm_90")
    d.mkdir(parents=True)
    m.save(d)
    assert d == tmp_path / "plan" / "kernels" / "sm_90"
    loaded = KernelManifest.load(d)
    assert loaded == m
    assert loaded.kernels_of("k") == [m.kernels[0]]
    spec = loaded.kernel("k_kernel")
    assert spec.virtual_blocks == 40
    assert [spec.physical_blocks(c) for c in (1, 2, 7, 40, 1000, None)] == [1, 2, 7, 40, 40, 40]


def test_kernel_args_follow_param_indices():
    spec = _spec(args=("w", "y"))
    spec.args[0]["param_index"], spec.args[1]["param_index"] = 1, 2
    args = kernel_args(spec, [0x1000, 0x2000, 0x3000])
    assert [a.value for a in args] == [0x2000, 0x3000]
    assert all(isinstance(a, ctypes.c_uint64) for a in args)


def test_launch_prim_func_passes_the_cap_last_through_cu_cap():
    calls = []

    class FakeRuntime:
        def launch_function(self, stream, function, grid, block, args, shared_mem=0, cu_cap=None):
            calls.append((function, grid, block, [a.value for a in args], shared_mem, cu_cap))

    m = _manifest()
    launch_prim_func(FakeRuntime(), "s", {"k_kernel": "F"}, m, "k", [1, 2, 3], cap=6)
    launch_prim_func(FakeRuntime(), "s", {"k_kernel": "F"}, m, "k", [1, 2, 3])
    assert calls == [
        ("F", [40, 1, 1], [128, 1, 1], [1, 2, 3], 0, 6),
        ("F", [40, 1, 1], [128, 1, 1], [1, 2, 3], 0, 40),  # uncapped: cap = the virtual grid
    ]


def test_arch_and_nvcc_discovery(tmp_path, monkeypatch):
    assert cuda_build.check_arch("sm_75") == "sm_75"
    with pytest.raises(ValueError, match="sm_90"):
        cuda_build.check_arch("sm_100")
    fake = tmp_path / "nvcc"
    fake.write_text("#!/bin/sh\n")
    monkeypatch.setenv(cuda_build.ENV_NVCC, str(fake))
    assert cuda_build.find_nvcc() == str(fake)
    monkeypatch.setenv(cuda_build.ENV_NVCC, str(tmp_path / "missing"))
    assert cuda_build.find_nvcc() is None
    with pytest.raises(cuda_build.NvccError, match="not found"):
        cuda_build.compile_cuda(tmp_path / "k.cu", tmp_path, "sm_90")


def test_entry_point_does_not_import_tvm(tmp_path):
    """``tvm_compile`` (the CLI's entry point) imports without TVM and says how to get it."""
    code = textwrap.dedent(
        """
        import sys
        from streambox.kernel_compiler import tvm_compile, ptb_manifest, cuda_build
        assert "tvm" not in sys.modules, "importing the entry point imported tvm"
        sys.modules["tvm"] = None  # as if apache-tvm were not installed
        try:
            tvm_compile.compile_model("espcn", "sm_90", sys.argv[1])
        except tvm_compile.CompilerUnavailable as exc:
            assert "streambox[compiler]" in str(exc), exc
            print("ok")
        """
    )
    proc = subprocess.run(
        [sys.executable, "-c", code, str(tmp_path / "pool")],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": ""},
        timeout=120,
    )
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr
