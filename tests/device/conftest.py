"""Fixtures for the emulated device: a small, slow, deterministic spec and a private state dir."""

from __future__ import annotations

import threading

import pytest

from streambox.device.emulated import EmulatedBackend
from streambox.device.specs import V100_16GB, DeviceSpec, LinkModel, MiB

#: 1 GB/s pinned, 250 MB/s pageable: a 4 MiB copy takes ~4 ms, so the order of copies is unambiguous.
SLOW_LINK = LinkModel(
    pinned_bandwidth=1e9,
    pageable_bandwidth=0.25e9,
    latency_s=10e-6,
    peer_bandwidth=2e9,
    peer_latency_s=5e-6,
    device_bandwidth=10e9,
    pinned_alloc_s_per_byte=1e-9,  # 1 s per GB: 16 MiB pinned cost ~17 ms
)

SMALL_SPEC: DeviceSpec = V100_16GB.with_overrides(
    name="test-gpu-64mib",
    total_memory=64 * MiB,
    compute_units=8,
    link=SLOW_LINK,
    context_create_s=0.0,
    context_memory=0,
)


@pytest.fixture
def spec() -> DeviceSpec:
    return SMALL_SPEC


@pytest.fixture
def backend(tmp_path, spec):
    be = EmulatedBackend(spec=spec, count=2, state_dir=tmp_path / "state")
    yield be
    be.close()
    for usage in be.device_usage():
        assert usage.used_memory == 0 and usage.runtimes == 0 and usage.streams == 0, usage


@pytest.fixture
def rt(backend):
    runtime = backend.open_runtime(0)
    yield runtime
    runtime.close()


@pytest.fixture(autouse=True)
def no_leftover_threads(thread_guard):
    with thread_guard("streambox-emu-"):
        yield


def hold(runtime, stream):
    """Block `stream` until the returned function is called, so that work issued meanwhile chains on
    modelled times only (independent of how fast the host issues it)."""
    release = threading.Event()
    runtime.launch(stream, lambda: release.wait(10), name="hold")
    return release.set
