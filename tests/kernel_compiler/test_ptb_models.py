"""Zoo models through the kernel compiler: every kernel's PTB form equals its original on the CPU at
caps 1, 2, 7 and >= grid; ``compile_model`` writes source, PTX, cubin and a manifest beside the plan
(nvcc runs; the nvcc part skips when nvcc is absent); the whole model, run from its PTB kernels at a
cap (on the CPU, and on the emulated device whose compute-unit accounting must honour each kernel's
cap), matches torch. Needs apache-tvm (the ``compiler`` extra); skips without.

The fast set is ESPCN (convolutions: dlight Matmul + shared memory) and the text encoder (matmuls,
layer norm and softmax: cross-thread reductions); MobileNetV3-Small and AlexNet (GEMV, depthwise
convolutions, adaptive pooling) are marked ``slow`` and run only with ``STREAMBOX_SLOW_TESTS=1``.
"""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
import torch

tvm = pytest.importorskip("tvm", reason="apache-tvm is not installed (pip install 'streambox[compiler]')")

from streambox.device.emulated import EmulatedBackend  # noqa: E402
from streambox.device.specs import V100_16GB  # noqa: E402
from streambox.kernel_compiler.cuda_build import compile_cuda, find_nvcc  # noqa: E402
from streambox.kernel_compiler.plan import PLAN_FILE  # noqa: E402
from streambox.kernel_compiler.ptb_manifest import KernelManifest, kernels_dir  # noqa: E402
from streambox.kernel_compiler.ptb_verify import CpuKernels, run_graph_cpu, verify_ptb  # noqa: E402
from streambox.kernel_compiler.tvm_compile import compile_model  # noqa: E402
from streambox.kernel_compiler.tvm_frontend import schedule_model  # noqa: E402
from streambox.kernel_compiler.zoo import example_input  # noqa: E402

FAST = {"espcn": (3, 16, 16), "text_encoder": (16,)}
SLOW = {"mobilenet_v3_small": (3, 32, 32), "alexnet": (3, 64, 64)}
RUN_SLOW = os.environ.get("STREAMBOX_SLOW_TESTS") == "1"
slow = [
    pytest.mark.slow,
    pytest.mark.skipif(not RUN_SLOW, reason="slow (minutes): set STREAMBOX_SLOW_TESTS=1 to run"),
]
MODELS = [*FAST, *(pytest.param(m, marks=slow) for m in SLOW)]
SHAPES = {**FAST, **SLOW}
NVCC = find_nvcc()
needs_nvcc = pytest.mark.skipif(NVCC is None, reason="nvcc not found (CUDA toolkit not installed)")

_scheduled: dict[str, object] = {}
_compiled: dict[str, object] = {}
_verified: dict[str, object] = {}


def _cpu_kernels(model, sm):
    """The LLVM builds of the PTB kernels: the equivalence test's when it ran first, else new ones."""
    report = _verified.get(model)
    return report.kernels if report is not None else CpuKernels(sm.prim_funcs)


@pytest.fixture
def scheduled(zoo_model):
    def get(model: str):
        if model not in _scheduled:
            _scheduled[model] = schedule_model(zoo_model(model), example_input(model, 1, SHAPES[model]))
        return _scheduled[model]

    return get


@pytest.fixture
def compiled(pool, scheduled):
    """compile_model into the session's model pool (nvcc when available), once per model."""

    def get(model: str):
        if model not in _compiled:
            _compiled[model] = compile_model(
                model, "sm_90", batch=1, input_shape=SHAPES[model], pool=pool, scheduled=scheduled(model)
            )
        return _compiled[model]

    return get


def _values(model, graph, manifest_dir=None):
    """Inputs, weights (torch state_dict) and constants by graph name."""
    state = {k: v.detach().numpy() for k, v in model.state_dict().items()}
    values = {name: state[key] for name, key in graph["weights"].items()}
    if manifest_dir is not None and graph["constants"]:
        from safetensors.numpy import load_file

        values.update(load_file(str(manifest_dir / "constants.safetensors")))
    return values


def _reference(model, x):
    with torch.no_grad():
        out = model(x)
    return [t.numpy() for t in (out if isinstance(out, tuple) else (out,))]


@pytest.mark.parametrize("model", MODELS)
def test_every_kernel_equals_its_original_at_every_cap(model, scheduled):
    sm = scheduled(model)
    report = _verified[model] = verify_ptb(sm.prim_funcs)
    print(f"{model}: {report.summary()}")
    assert report.ok, [(c.prim_func, c.mismatches[:3]) for c in report.checks if not c.ok]
    assert not report.excluded
    assert len(report.checks) == len(sm.prim_funcs) >= 7
    assert all(
        {1, 2, 7} <= set(c.caps) and max(c.caps) > max(g[0] * g[1] * g[2] for g in c.grids)
        for c in report.checks
    )


@pytest.mark.parametrize("model", MODELS)
def test_compile_model_writes_kernels_beside_the_plan(model, compiled, pool):
    report = compiled(model)
    plan_dir = pool.path_for(model, 1, SHAPES[model])
    assert (plan_dir / PLAN_FILE).exists()
    out = kernels_dir(plan_dir, "sm_90")
    assert report.out_dir == out
    manifest = KernelManifest.load(out)
    assert (manifest.model, manifest.batch, manifest.arch) == (model, 1, "sm_90")
    assert report.kernels == len(manifest.kernels) >= report.prim_funcs == len(manifest.prim_funcs)
    assert report.shared_sync_ok and report.graph_complete
    source = (out / manifest.source).read_text()
    for k in manifest.kernels:
        assert k.args[-1]["kind"] == "cap" and k.cap_arg == len(k.args) - 1
        assert k.grid[1:] == [1, 1] and k.grid[0] == int(np.prod(k.original_grid))
        assert all(k.physical_blocks(c) == min(k.grid[0], c) for c in (1, 2, 7, 10**6))
        assert source.split(f"{k.name}(", 1)[1].split(")", 1)[0].rstrip().endswith("int cap")
        params = manifest.prim_funcs[k.prim_func]["params"]
        for a in k.args[:-1]:
            p = params[a["param_index"]]
            assert (a["name"], a["dtype"], a["shape"]) == (p["name"], p["dtype"], p["shape"])
    # the graph is consistent with the PrimFuncs' signatures
    g = manifest.graph
    for call in g["calls"]:
        params = [p for p in manifest.prim_funcs[call["func"]]["params"] if p["kind"] == "buffer"]
        tensors = [g["tensors"][n] for n in (*call["args"], *call["outputs"])]
        assert [(t["shape"], t["dtype"]) for t in tensors] == [(p["shape"], p["dtype"]) for p in params]
    t = report.timings
    assert {"export", "import", "legalize", "schedule", "ptb", "lower", "codegen", "plan"} <= set(t)
    json.dumps(report.to_dict())
    print(report.summary())


@needs_nvcc
@pytest.mark.parametrize("model", MODELS)
def test_nvcc_compiles_every_kernel(model, compiled):
    report = compiled(model)
    manifest = KernelManifest.load(report.out_dir)
    assert manifest.images == {"ptx": "kernels.ptx", "cubin": "kernels.cubin"}
    assert report.nvcc_version and not report.nvcc_skipped
    ptx = (report.out_dir / "kernels.ptx").read_text()
    cubin = (report.out_dir / "kernels.cubin").read_bytes()
    assert cubin[:4] == b"\x7fELF"
    for k in manifest.kernels:
        assert f".entry {k.name}(" in ptx, k.name
        assert k.name.encode() in cubin


@needs_nvcc
def test_nvcc_other_architectures(compiled, tmp_path):
    """The same source builds for the oldest supported architecture too."""
    report = compiled("espcn")
    result = compile_cuda(report.out_dir / "kernels.cu", tmp_path, "sm_75")
    assert result.cubin.read_bytes()[:4] == b"\x7fELF" and ".target sm_75" in result.ptx.read_text()


def test_compile_without_nvcc_and_recompile(pool, scheduled):
    def run():
        return compile_model(
            "espcn",
            "sm_86",
            batch=1,
            input_shape=FAST["espcn"],
            pool=pool,
            nvcc=False,
            scheduled=scheduled("espcn"),
        )

    report = run()
    assert report.nvcc_skipped == "nvcc=False" and report.image_bytes == {}
    assert KernelManifest.load(report.out_dir).images == {}
    again = run()  # replaces the arch directory in one step, leaving nothing behind
    assert again.out_dir == report.out_dir and report.out_dir.name == "sm_86"
    assert not [p.name for p in report.out_dir.parent.iterdir() if p.name.startswith(".")]


@pytest.mark.parametrize("model", MODELS)
def test_model_from_ptb_kernels_matches_torch(model, scheduled, compiled, zoo_model):
    report = compiled(model)
    manifest = KernelManifest.load(report.out_dir)
    sm = scheduled(model)
    torch_model = zoo_model(model)
    x = example_input(model, 1, SHAPES[model])
    values = _values(torch_model, manifest.graph, report.out_dir)
    values[manifest.graph["inputs"][0]] = x.numpy()
    kernels = _cpu_kernels(model, sm)
    expected = _reference(torch_model, x)
    for cap in (1, 3):
        got = run_graph_cpu(manifest.graph, kernels, values, cap)
        for e, o in zip(expected, got.values(), strict=True):
            np.testing.assert_allclose(o.numpy().reshape(e.shape), e, rtol=2e-4, atol=2e-5)


def test_emulated_device_honours_each_kernels_cap(scheduled, compiled, zoo_model, tmp_path):
    """ESPCN on the emulated device: every kernel launched with its virtual grid and a cap occupies
    min(grid, cap, compute units) units, and the model's output still matches torch."""
    model = "espcn"
    report = compiled(model)
    manifest = KernelManifest.load(report.out_dir)
    sm = scheduled(model)
    torch_model = zoo_model(model)
    x = example_input(model, 1, SHAPES[model])
    values = _values(torch_model, manifest.graph, report.out_dir)
    values[manifest.graph["inputs"][0]] = x.numpy()
    kernels = _cpu_kernels(model, sm)
    spec = V100_16GB.with_overrides(
        name="ptb-test-gpu", compute_units=8, context_create_s=0.0, context_memory=0
    )
    cap = 5
    with EmulatedBackend(spec=spec, state_dir=tmp_path / "state") as backend:
        rt = backend.open_runtime(0)
        stream = rt.create_stream()

        def launch(call, body):
            specs = manifest.kernels_of(call["func"])
            for i, k in enumerate(specs):  # the CPU build runs the PrimFunc's kernels in one go
                rt.launch(
                    stream,
                    body if i == 0 else (lambda: None),
                    blocks=k.virtual_blocks,
                    cu_cap=cap,
                    name=k.name,
                )

        out = run_graph_cpu(manifest.graph, kernels, values, cap, launch=launch)
        stream.synchronize()
        stats = rt.compute_stats().kernels
        assert set(stats) == {k.name for k in manifest.kernels}
        for k in manifest.kernels:
            assert stats[k.name].compute_units == min(k.virtual_blocks, cap, spec.compute_units), k.name
        assert any(k.virtual_blocks > cap for k in manifest.kernels)  # the cap did bind somewhere
        (expected,) = _reference(torch_model, x)
        np.testing.assert_allclose(next(iter(out.values())).numpy(), expected, rtol=2e-4, atol=2e-5)
        rt.close()
