"""Fixtures for the IO daemon's tests: an emulated device with a slow, exact link, so that the order
and timing of copies are unambiguous while the host keeps up with it."""

from __future__ import annotations

import threading

import pytest

from streambox.device.emulated import EmulatedBackend
from streambox.device.specs import V100_16GB, DeviceSpec, LinkModel, MiB

#: 200 MB/s pinned, 100 MB/s pageable: a 64 KiB block takes ~0.35 ms, far more than issuing it.
TEST_LINK = LinkModel(
    pinned_bandwidth=200e6,
    pageable_bandwidth=100e6,
    latency_s=20e-6,
    peer_bandwidth=2e9,
    peer_latency_s=5e-6,
    device_bandwidth=10e9,
    pinned_alloc_s_per_byte=1e-9,  # 1 ms per MB
)

TEST_SPEC: DeviceSpec = V100_16GB.with_overrides(
    name="io-daemon-test-gpu",
    total_memory=512 * MiB,
    compute_units=8,
    link=TEST_LINK,
    context_create_s=0.0,
    context_memory=0,
)


@pytest.fixture
def spec() -> DeviceSpec:
    return TEST_SPEC


@pytest.fixture
def rt(tmp_path, spec):
    backend = EmulatedBackend(spec=spec, count=1, state_dir=tmp_path / "state")
    runtime = backend.open_runtime(0)
    yield runtime
    runtime.close()
    assert backend.device_usage()[0].used_memory == 0


@pytest.fixture(autouse=True)
def no_leftover_daemons(thread_guard):
    with thread_guard("streambox-io-daemon"):
        yield


def hold(runtime, stream):
    """Block `stream` until the returned function is called."""
    release = threading.Event()
    runtime.launch(stream, lambda: release.wait(10), name="hold")
    return release.set
