"""PTB kernels on a real GPU (marker ``gpu``): load the cubin that ``compile_model`` wrote with
``device/cuda.py``, launch every kernel with ``launch_function(..., cu_cap=cap)`` and compare with
torch (whole model) and across caps (each kernel, bitwise). Skips without apache-tvm, nvcc,
cuda-python or a GPU.
"""

from __future__ import annotations

import functools

import numpy as np
import pytest
import torch

pytestmark = pytest.mark.gpu
tvm = pytest.importorskip("tvm", reason="apache-tvm is not installed (pip install 'streambox[compiler]')")

from streambox.device.base import BackendUnavailable  # noqa: E402
from streambox.kernel_compiler.cuda_build import find_nvcc  # noqa: E402
from streambox.kernel_compiler.ptb_manifest import KernelManifest, launch_prim_func  # noqa: E402
from streambox.kernel_compiler.tvm_compile import compile_model  # noqa: E402
from streambox.kernel_compiler.zoo import example_input  # noqa: E402

MODELS = {"espcn": (3, 16, 16), "text_encoder": (16,), "mobilenet_v3_small": (3, 32, 32)}


@functools.cache
def _backend():
    try:
        from streambox.device.cuda import CudaBackend

        return CudaBackend(), ""
    except BackendUnavailable as exc:
        return None, str(exc)


@pytest.fixture(scope="module")
def runtime():
    backend, why = _backend()
    if backend is None:
        pytest.skip(f"no usable GPU: {why}")
    if find_nvcc() is None:
        pytest.skip("nvcc not found: no cubin to load")
    rt = backend.open_runtime(0)
    yield rt
    rt.close()


def _arch(rt) -> str:
    major, minor = rt.properties().extra["compute_capability"]
    arch = f"sm_{major}{minor}"
    return arch if arch in ("sm_75", "sm_80", "sm_86", "sm_87", "sm_89", "sm_90") else "sm_90"


_compiled: dict[str, KernelManifest] = {}


@pytest.fixture
def manifest(runtime, pool):
    def get(model: str) -> tuple[KernelManifest, object]:
        if model not in _compiled:
            report = compile_model(model, _arch(runtime), batch=1, input_shape=MODELS[model], pool=pool)
            _compiled[model] = (KernelManifest.load(report.out_dir), report.out_dir)
        return _compiled[model]

    return get


class _Loaded:
    """A manifest's cubin loaded into a runtime, with device buffers for every graph tensor."""

    def __init__(self, rt, manifest: KernelManifest, out_dir) -> None:
        self.rt, self.manifest = rt, manifest
        module = rt.load_module(out_dir / manifest.images["cubin"])
        self.functions = {k.name: rt.get_function(module, k.name) for k in manifest.kernels}
        self.addresses: dict[str, int] = {}
        self.views: dict[str, torch.Tensor] = {}
        for name, desc in manifest.graph["tensors"].items():
            dtype = getattr(torch, desc["dtype"])
            nbytes = max(1, int(np.prod(desc["shape"])) * dtype.itemsize)
            self.addresses[name] = rt.mem_alloc(nbytes)
            self.views[name] = rt.view(self.addresses[name], dtype, tuple(desc["shape"]))

    def run(self, stream, cap) -> None:
        for call in self.manifest.graph["calls"]:
            params = [self.addresses[n] for n in (*call["args"], *call["outputs"])]
            launch_prim_func(self.rt, stream, self.functions, self.manifest, call["func"], params, cap)

    def free(self) -> None:
        for address in self.addresses.values():
            self.rt.mem_free(address)


@pytest.mark.parametrize("model", list(MODELS))
def test_model_on_gpu_matches_torch_at_every_cap(model, runtime, manifest, zoo_model):
    m, out_dir = manifest(model)
    loaded = _Loaded(runtime, m, out_dir)
    try:
        torch_model = zoo_model(model)
        state = torch_model.state_dict()
        x = example_input(model, 1, MODELS[model])
        loaded.views[m.graph["inputs"][0]].copy_(x.cuda())
        for name, key in m.graph["weights"].items():
            loaded.views[name].copy_(state[key].cuda())
        if m.constants:
            from safetensors.torch import load_file

            for name, t in load_file(str(out_dir / m.constants)).items():
                loaded.views[name].copy_(t.cuda())
        torch.cuda.synchronize()  # the copies ran on torch's stream, the kernels run on ours
        with torch.no_grad():
            expected = torch_model(x)
        expected = expected if isinstance(expected, tuple) else (expected,)
        stream = runtime.create_stream()
        props = runtime.properties()
        results = {}
        for cap in (1, 3, props.compute_units // 2, None):
            loaded.run(stream, cap)
            stream.synchronize()
            results[cap] = [loaded.views[o].cpu().clone() for o in m.graph["outputs"]]
            for e, o in zip(expected, results[cap], strict=True):
                torch.testing.assert_close(o.reshape(e.shape), e, rtol=1e-3, atol=1e-4)
        for cap, outs in results.items():  # same code per element whatever the cap: bitwise equal
            for a, b in zip(results[None], outs, strict=True):
                assert torch.equal(a, b), cap
    finally:
        loaded.free()
