"""The persistent-thread-block pass on small kernels: structure, CPU equivalence at several caps, the
lowered launch (cap last, 1-D grid = min(V, cap)), barriers, rejections, and the emulated device's
compute-unit accounting of capped kernels. Needs apache-tvm (the ``compiler`` extra); skips without."""

from __future__ import annotations

import numpy as np
import pytest

tvm = pytest.importorskip("tvm", reason="apache-tvm is not installed (pip install 'streambox[compiler]')")

import tvm_ffi  # noqa: E402
from tvm import te, tirx, topi  # noqa: E402
from tvm.script import tirx as T  # noqa: E402

from streambox.device.emulated import EmulatedBackend  # noqa: E402
from streambox.device.specs import V100_16GB  # noqa: E402
from streambox.kernel_compiler import ptb  # noqa: E402
from streambox.kernel_compiler.ptb_manifest import KernelSpec, emulated_launch  # noqa: E402
from streambox.kernel_compiler.ptb_verify import CpuKernels, verify_ptb  # noqa: E402
from streambox.kernel_compiler.tvm_codegen import lower_to_cuda  # noqa: E402
from streambox.kernel_compiler.tvm_frontend import cuda_target, schedule  # noqa: E402


@T.prim_func(s_tir=True)
def ew3d(A: T.Buffer((5, 7, 300), "float32"), B: T.Buffer((5, 7, 300), "float32")):
    T.func_attr({"tirx.noalias": True})
    for bz in T.thread_binding(5, thread="blockIdx.z"):
        for by in T.thread_binding(7, thread="blockIdx.y"):
            for bx in T.thread_binding(3, thread="blockIdx.x"):
                for tx in T.thread_binding(128, thread="threadIdx.x"):
                    with T.sblock("B"):
                        vi, vj = T.axis.remap("SS", [bz, by])
                        vk = T.axis.spatial(300, bx * 128 + tx)
                        T.where(bx * 128 + tx < 300)
                        B[vi, vj, vk] = A[vi, vj, vk] * T.float32(2) + T.float32(1)


@T.prim_func(s_tir=True)
def ew2d_yx(A: T.Buffer((48, 64), "float32"), B: T.Buffer((48, 64), "float32")):
    T.func_attr({"tirx.noalias": True})
    for bx in T.thread_binding(4, thread="blockIdx.x"):  # x outside y: the order must not matter
        for by in T.thread_binding(3, thread="blockIdx.y"):
            for ty in T.thread_binding(16, thread="threadIdx.y"):
                for tx in T.thread_binding(16, thread="threadIdx.x"):
                    with T.sblock("B"):
                        vi = T.axis.spatial(48, by * 16 + ty)
                        vj = T.axis.spatial(64, bx * 16 + tx)
                        B[vi, vj] = A[vi, vj] - T.float32(3)


@T.prim_func(s_tir=True)
def dynamic_grid(a: T.handle, b: T.handle):
    n = T.int32()
    A = T.match_buffer(a, (n,), "float32")
    B = T.match_buffer(b, (n,), "float32")
    for bx in T.thread_binding((n + 127) // 128, thread="blockIdx.x"):
        for tx in T.thread_binding(128, thread="threadIdx.x"):
            with T.sblock("B"):
                vi = T.axis.spatial(n, bx * 128 + tx)
                T.where(bx * 128 + tx < n)
                B[vi] = A[vi]


def _dlight_kernels() -> dict[str, tirx.PrimFunc]:
    """A cross-thread reduction (dlight Reduction), a shared-memory matmul (Matmul) and a softmax
    (GeneralReduction: shared memory and two cross-thread reductions)."""
    a = te.placeholder((37, 300), "float32", name="A")
    k = te.reduce_axis((0, 300), name="k")
    rowsum = te.compute((37,), lambda i: te.sum(a[i, k], axis=k), name="B")
    x = te.placeholder((64, 96), "float32", name="X")
    w = te.placeholder((96, 80), "float32", name="W")
    kk = te.reduce_axis((0, 96), name="kk")
    y = te.compute((64, 80), lambda i, j: te.sum(x[i, kk] * w[kk, j], axis=kk), name="Y")
    s = te.placeholder((6, 50), "float32", name="S")
    mod = tvm.IRModule(
        {
            "rowsum": te.create_prim_func([a, rowsum]),
            "matmul": te.create_prim_func([x, w, y]),
            "softmax": te.create_prim_func([s, topi.nn.softmax(s, axis=1)]),
        }
    )
    mod, used, _ = schedule(mod, cuda_target())
    assert used == {"rowsum": "Reduction", "matmul": "Matmul", "softmax": "GeneralReduction"}
    return {gv.name_hint: f for gv, f in mod.functions_items()}


@pytest.fixture(scope="module")
def kernels() -> dict[str, tirx.PrimFunc]:
    return {"ew3d": ew3d, "ew2d_yx": ew2d_yx, **_dlight_kernels()}


def _block_loops(func: tirx.PrimFunc) -> list[tirx.For]:
    found: list[tirx.For] = []

    def visit(f: tirx.For) -> None:
        if f.kind == tirx.ForKind.THREAD_BINDING and f.thread_binding.thread_tag.startswith("blockIdx"):
            found.append(f)

    tvm_ffi.structural_walk(func.body, (tirx.For, visit))
    return found


def test_signature_and_structure(kernels):
    for name, f in kernels.items():
        g = ptb.ptb_rewrite(f)
        assert [p.name for p in g.params] == [*(p.name for p in f.params), "cap"], name
        assert str(g.params[-1].ty) == "int32"
        loops = _block_loops(g)
        assert len(loops) == len(ptb.nests_of(g)) >= 1, name
        assert all(lp.thread_binding.thread_tag == "blockIdx.x" for lp in loops), name
        assert ptb.ptb_rewrite(g) is g  # idempotent
    assert [n.grid for n in ptb.nests_of(ptb.ptb_rewrite(kernels["ew3d"]))] == [(3, 7, 5)]
    assert [n.grid for n in ptb.nests_of(ptb.ptb_rewrite(kernels["ew2d_yx"]))] == [(4, 3, 1)]


def test_pass_wrapper(kernels):
    mod = tvm.IRModule({"a": kernels["ew3d"], "b": kernels["rowsum"]})
    out = ptb.PTBTransform()(mod)
    assert all(f.params[-1].name == "cap" for f in out.functions.values())
    again = ptb.PTBTransform()(out)
    assert all(len(f.params) == len(out[gv].params) for gv, f in again.functions_items())


def test_cpu_equivalence_at_every_cap(kernels):
    report = verify_ptb(kernels)
    assert report.ok, report.summary() + str([c.mismatches for c in report.checks if not c.ok])
    assert not report.excluded
    for c in report.checks:
        v = max(x * y * z for x, y, z in c.grids)
        assert {1, 2, 7, v, v + 3} <= set(c.caps)


def test_broken_rewrites_are_caught(kernels):
    """The CPU check has teeth: a rewrite that drops the last virtual block of each physical block,
    or one that maps every virtual block to blockIdx.z == 0, fails it."""

    def one_trip_short(f):
        g = ptb.ptb_rewrite(f)

        def visit(lp):
            if lp.loop_var.name == ptb.PTB_LOOP_VAR:
                return tirx.For(lp.loop_var, lp.min, lp.extent - 1, lp.kind, lp.body)
            return lp

        return g.with_body(tvm_ffi.structural_map(g.body, (tirx.For, visit), order="post"))

    def drop_z(f):
        g = ptb.ptb_rewrite(f)

        def visit(b):
            return tirx.Bind(b.var, tirx.IntImm(str(b.var.ty), 0)) if b.var.name == "bz" else b

        return g.with_body(tvm_ffi.structural_map(g.body, (tirx.Bind, visit), order="post"))

    small = {"ew2d_yx": kernels["ew2d_yx"], "rowsum": kernels["rowsum"]}
    report = verify_ptb(small, rewrite=one_trip_short)
    assert not any(c.ok for c in report.checks)
    assert all(c.mismatches[0].startswith("cap=1 ") for c in report.checks)
    assert not verify_ptb({"ew3d": kernels["ew3d"]}, rewrite=drop_z).ok


def test_cross_thread_reductions_survive(kernels):
    for name in ("rowsum", "softmax"):
        f = kernels[name]
        assert ptb.cross_thread_reductions(f) >= 1
        assert ptb.cross_thread_reductions(ptb.ptb_rewrite(f)) == ptb.cross_thread_reductions(f)


def test_barrier_only_where_shared_memory_is_used(kernels):
    def barriers(f):
        n = [0]
        tvm_ffi.structural_walk(
            f.body,
            (tvm.ir.Call, lambda c: n.__setitem__(0, n[0] + 1) if "storage_sync" in str(c.op) else None),
        )
        return n[0]

    assert barriers(ptb.ptb_rewrite(kernels["ew3d"])) == 0
    for name in ("matmul", "rowsum", "softmax"):
        assert barriers(ptb.ptb_rewrite(kernels[name])) == 1, name
        assert barriers(ptb.serialize_threads(ptb.ptb_rewrite(kernels[name]))) == 0


def test_lowered_kernels_follow_the_launch_convention(kernels):
    cuda = lower_to_cuda({n: ptb.ptb_rewrite(f) for n, f in kernels.items()}, cuda_target("sm_80"))
    by_func = {k.prim_func: k for k in cuda.kernels}
    assert set(by_func) == set(kernels)
    assert by_func["ew3d"].grid == [105, 1, 1] and by_func["ew3d"].original_grid == [3, 7, 5]
    assert by_func["ew3d"].block == [128, 1, 1]
    assert by_func["ew2d_yx"].grid == [12, 1, 1] and by_func["ew2d_yx"].block == [16, 16, 1]
    for k in cuda.kernels:
        assert k.args[-1] == {"name": "cap", "kind": "cap", "dtype": "int32", "shape": [], "param_index": -1}
        assert k.cap_arg == len(k.args) - 1
        assert [a["param_index"] for a in k.args[:-1]] == sorted(a["param_index"] for a in k.args[:-1])
        assert k.shared_sync["ok"], k
        assert f"{k.name}(" in cuda.source
        # the emitted signature ends with the cap
        decl = cuda.source.split(f"{k.name}(", 1)[1].split(")", 1)[0]
        assert decl.rstrip().endswith("int cap"), decl
    assert by_func["matmul"].shared_sync["shared_stores"] > 0
    assert by_func["matmul"].static_shared_mem > 0


def test_unsupported_kernels_are_rejected(kernels):
    with pytest.raises(ptb.PTBError, match="constant"):
        ptb.ptb_rewrite(dynamic_grid)
    g = ptb.ptb_rewrite(kernels["ew3d"]).without_attr(ptb.ATTR_NESTS)
    with pytest.raises(ptb.PTBError, match="cap"):
        ptb.ptb_rewrite(g)


def test_emulated_device_accounts_the_cap(tmp_path, kernels):
    """A PTB kernel launched on the emulated device with its virtual grid as ``blocks`` and a cap
    occupies min(grid, cap, CUs) compute units, and its body -- the CPU build of the PTB kernel at
    that cap -- computes the right result."""
    spec = V100_16GB.with_overrides(
        name="ptb-test-gpu", compute_units=8, context_create_s=0.0, context_memory=0
    )
    cuda = lower_to_cuda({"ew3d": ptb.ptb_rewrite(kernels["ew3d"])}, cuda_target())
    kspec = KernelSpec(**cuda.kernel_dicts()[0])
    assert kspec.virtual_blocks == 105
    cpu = CpuKernels({"ew3d": kernels["ew3d"]})
    a = np.random.default_rng(0).standard_normal((5, 7, 300)).astype("float32")
    with EmulatedBackend(spec=spec, state_dir=tmp_path / "state") as backend:
        rt = backend.open_runtime(0)
        stream = rt.create_stream()
        outs = {}
        for cap in (1, 2, 7, None, 1000):
            src, dst = tvm.runtime.tensor(a), tvm.runtime.empty((5, 7, 300), "float32")
            outs[cap] = dst
            name = f"{kspec.name}@{cap}"
            rt.launch(
                stream,
                lambda src=src, dst=dst, cap=cap: cpu("ew3d", [src, dst], cap or kspec.virtual_blocks),
                blocks=kspec.virtual_blocks,
                cu_cap=cap,
                name=name,
            )
        emulated_launch(rt, stream, kspec, lambda: None, cap=3)
        stream.synchronize()
        stats = rt.compute_stats().kernels
        assert {cap: stats[f"{kspec.name}@{cap}"].compute_units for cap in outs} == {
            1: 1,
            2: 2,
            7: 7,
            None: 8,
            1000: 8,
        }
        assert stats[kspec.name].compute_units == 3
        for dst in outs.values():
            np.testing.assert_array_equal(dst.numpy(), a * 2 + 1)
        rt.close()
