"""Device presets for the emulated backend: memory, compute units, the link and the runtime's costs.

Numbers follow the paper's testbed (V100-16GB on PCIe 3.0: ~12 GB/s peak, ~4 GB/s with 16 KB blocks,
pinned allocation ~200 ms per 200 MB, Sec. 7.1) and public H100 SXM figures. Every field can be overridden
(`with_overrides`); `SOURCES` names where each number comes from (docs/device.md prints them).

A runtime costs two things, kept apart: the CUDA context (every runtime: `context_memory`,
`context_create_s`) and the ML framework's runtime on top of it (PyTorch with cuDNN/cuBLAS; only for
runtimes opened with `framework=True`, e.g. one per monolithic function instance:
`framework_memory`, `framework_init_s`). The paper measured the two together: a PyTorch function's
runtime takes up to ~1.4 GB of its 1.5 GB (ResNet, Fig. 2 left, Sec. 2) and its initialisation up to
~5 s (Fig. 3 left, Sec. 2); the framework's share is that total less the context's.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

GiB = 1 << 30
MiB = 1 << 20


@dataclass(frozen=True)
class LinkModel:
    """A copy costs `latency_s + nbytes / bandwidth` on its engine."""

    pinned_bandwidth: float  # bytes/s, host pinned memory <-> device
    pageable_bandwidth: float  # bytes/s, host pageable memory <-> device (staged by the driver)
    latency_s: float  # per copy call
    peer_bandwidth: float  # bytes/s between two GPUs of the node (NVLink)
    peer_latency_s: float
    device_bandwidth: float  # bytes/s, device-to-device within one GPU
    pinned_alloc_s_per_byte: float  # cost of allocating pinned host memory

    def copy_seconds(self, nbytes: int, pinned: bool = True) -> float:
        bandwidth = self.pinned_bandwidth if pinned else self.pageable_bandwidth
        return self.latency_s + nbytes / bandwidth

    def peer_seconds(self, nbytes: int) -> float:
        return self.peer_latency_s + nbytes / self.peer_bandwidth


@dataclass(frozen=True)
class DeviceSpec:
    name: str
    total_memory: int
    compute_units: int
    link: LinkModel
    context_create_s: float  # time to create a context (a runtime)
    context_memory: int  # device memory a context takes for itself
    framework_memory: int = 0  # device memory of the ML framework's runtime (framework runtimes only)
    framework_init_s: float = 0.0  # its initialisation, `import torch` included (framework runtimes only)
    fallback_kernel_s: float = 40e-6  # timed mode: a kernel launched without `duration_s`

    def with_overrides(self, **changes: object) -> DeviceSpec:
        return replace(self, **changes)  # type: ignore[arg-type]


# 16 KB blocks reach ~4 GB/s on the paper's V100 (Sec. 7.1): 16384/4e9 = 16384/12e9 + latency.
_V100_LATENCY = 16384 / 4e9 - 16384 / 12e9

V100_16GB = DeviceSpec(
    name="Tesla V100-PCIE-16GB (emulated)",
    total_memory=16 * GiB,
    compute_units=80,
    link=LinkModel(
        pinned_bandwidth=12e9,
        pageable_bandwidth=6e9,
        latency_s=_V100_LATENCY,
        peer_bandwidth=48e9,
        peer_latency_s=5e-6,
        device_bandwidth=900e9,
        pinned_alloc_s_per_byte=0.2 / (200 * MiB),
    ),
    context_create_s=0.5,
    context_memory=300 * MiB,
    framework_memory=1400 * MiB - 300 * MiB,
    framework_init_s=5.0 - 0.5,
)

H100_80GB = DeviceSpec(
    name="NVIDIA H100 80GB HBM3 (emulated)",
    total_memory=80 * GiB,
    compute_units=132,
    link=LinkModel(
        pinned_bandwidth=50e9,
        pageable_bandwidth=20e9,
        latency_s=2e-6,
        peer_bandwidth=450e9,
        peer_latency_s=3e-6,
        device_bandwidth=3000e9,
        pinned_alloc_s_per_byte=0.1 / (200 * MiB),
    ),
    context_create_s=0.5,
    context_memory=500 * MiB,
    framework_memory=1400 * MiB - 300 * MiB,
    framework_init_s=5.0 - 0.5,
)

_PAPER_RUNTIME = (
    "StreamBox paper (ATC'24) Sec. 2 and Fig. 2 left: a PyTorch ResNet function's GPU runtime (context "
    "and framework libraries) takes up to ~1.4 GB (95% of 1.5 GB); Fig. 3 left: its initialisation "
    "takes up to ~5 s"
)

#: Where every preset number comes from (field -> source); `modelled` marks an assumption of ours.
SOURCES: dict[str, str] = {
    "total_memory": "the products' specifications (V100-PCIE-16GB; H100 80GB)",
    "compute_units": "SM count of the products (V100: 80; H100 SXM: 132)",
    "link.pinned_bandwidth": "paper Sec. 7.1 (V100 on PCIe 3.0, ~12 GB/s peak); H100: PCIe 5.0 x16, ~50 GB/s",
    "link.latency_s": "V100: set so that 16 KB copies reach ~4 GB/s, as the paper measured (Sec. 7.1); "
    "H100: modelled (2 us)",
    "link.pageable_bandwidth": "modelled: about half the pinned bandwidth (V100; 40% on H100), staging "
    "through a bounce buffer",
    "link.pinned_alloc_s_per_byte": "paper Sec. 7.1 (pinned allocation ~200 ms per 200 MB, V100 host); "
    "H100: modelled at half that",
    "link.peer_bandwidth": "modelled, one GPU pair. V100: 48 GB/s, measured between two V100-SXM2 of a "
    "four-GPU server (two NVLink 2 links, 50 GB/s theoretical; 143.7 GB/s from one GPU to all three, "
    "of 150) by p2pBandwidthLatencyTest in Dell EMC's 'Ready Solutions for AI: Deep Learning with "
    "NVIDIA' reference guide (Table 3); the paper's 'NVLink up to 300GB/s' (Sec. 6.2) is a V100's "
    "six links, both directions. H100: NVLink 4 through NVSwitch, 450 GB/s per direction to any peer "
    "(specification)",
    "link.peer_latency_s": "modelled: a few microseconds per peer copy call",
    "link.device_bandwidth": "HBM2 / HBM3 bandwidth of the products (V100 900 GB/s; H100 ~3 TB/s)",
    "context_memory": "modelled: a bare CUDA context, ~300 MiB on V100 (CUDA 11, no lazy loading); "
    "the paper gives the context and framework only together",
    "context_create_s": "modelled: ~0.5 s for a bare context (the rest of the paper's 5 s is the framework)",
    "framework_memory": _PAPER_RUNTIME + "; the framework's share is 1.4 GB less context_memory (V100)",
    "framework_init_s": _PAPER_RUNTIME + "; the framework's share is 5 s less context_create_s",
    "fallback_kernel_s": "modelled: ResNet-50 on a V100 (~7 ms) over its ~170 kernels; used only when a "
    "launch gives no duration_s",
}

PRESETS: dict[str, DeviceSpec] = {"v100-16gb": V100_16GB, "h100-80gb": H100_80GB}


def preset(name: str) -> DeviceSpec:
    try:
        return PRESETS[name.lower()]
    except KeyError:
        known = ", ".join(sorted(PRESETS))
        raise KeyError(f"unknown device preset {name!r}; known presets: {known}") from None
