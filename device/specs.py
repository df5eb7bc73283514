"""Device presets for the emulated backend: memory, compute units and the link model.

Numbers follow the paper's testbed (V100-16GB on PCIe 3.0: ~12 GB/s peak, ~4 GB/s with 16 KB blocks,
pinned allocation ~200 ms per 200 MB) and public H100 SXM figures. Every field can be overridden.
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
        peer_bandwidth=150e9,
        peer_latency_s=5e-6,
        device_bandwidth=900e9,
        pinned_alloc_s_per_byte=0.2 / (200 * MiB),
    ),
    context_create_s=0.5,
    context_memory=300 * MiB,
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
)

PRESETS: dict[str, DeviceSpec] = {"v100-16gb": V100_16GB, "h100-80gb": H100_80GB}


def preset(name: str) -> DeviceSpec:
    try:
        return PRESETS[name.lower()]
    except KeyError:
        known = ", ".join(sorted(PRESETS))
        raise KeyError(f"unknown device preset {name!r}; known presets: {known}") from None
