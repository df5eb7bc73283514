"""A runtime being opened (a new function instance: context, framework, its models uploaded and its
first kernels) beside a running stream of another process does not delay that stream's GPU work in
modelled time (timed mode). On a real GPU the new context's creation and framework start-up are CPU
work in the new process; its kernels, as an MPS client, run beside the others' within its share.

Modelled times only (each checked against when the work was issued, measured in this process), so the
test holds on a loaded host: a stall by the device would show as work starting after it was ready.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from streambox.device.emulated import EmulatedBackend
from streambox.device.specs import V100_16GB

KERNEL_S = 2e-3
DOWNLOAD = 1 << 20
#: The other process: what a starting instance does to the device.
STARTING = textwrap.dedent(
    """
    import sys
    from streambox.device.emulated import EmulatedBackend
    backend = EmulatedBackend("v100-16gb", state_dir=sys.argv[1], mode="timed")
    runtime = backend.open_runtime(0, gpu_percent=50, framework=True)  # context + framework init
    stream = runtime.create_stream()
    weights = 256 << 20
    runtime.copy_htod_async(runtime.mem_alloc(weights), runtime.host_alloc(weights), weights, stream)
    for _ in range(20):
        runtime.launch(stream, lambda: None, blocks=80, duration_s=2e-3)
    stream.synchronize()
    runtime.close()
    """
)


def test_a_starting_runtime_does_not_delay_a_running_streams_kernels_or_downloads(tmp_path):
    with EmulatedBackend(V100_16GB, state_dir=tmp_path, mode="timed") as backend:
        _run_beside_a_starting_runtime(backend, tmp_path)


def _run_beside_a_starting_runtime(backend: EmulatedBackend, tmp_path: Path) -> None:
    runtime = backend.open_runtime(0, gpu_percent=50)
    stream = runtime.create_stream()
    src, host = runtime.mem_alloc(DOWNLOAD), runtime.host_alloc(DOWNLOAD)
    env = {**os.environ, "STREAMBOX_FRAMEWORK_INIT_S": "0.3"}
    other = subprocess.Popen([sys.executable, "-c", STARTING, str(tmp_path)], env=env)
    issued: list[tuple[float, float]] = []  # (kernel issued by, download issued by)
    try:
        deadline = time.monotonic() + 120
        while other.poll() is None or len(issued) < 20:
            assert time.monotonic() < deadline, "the other process did not finish"
            runtime.launch(stream, lambda: None, blocks=80, duration_s=KERNEL_S)
            after_kernel = time.perf_counter()
            runtime.copy_dtoh_async(host, src, DOWNLOAD, stream)
            issued.append((after_kernel, time.perf_counter()))
            stream.synchronize()
    finally:
        other.wait(timeout=60)
    assert other.returncode == 0
    records = runtime.timeline()
    kernels = [r for r in records if r.lane == stream.lane and r.kind == "kernel"]
    downloads = [r for r in records if r.lane == "d2h" and r.kind == "dtoh"]
    assert len(kernels) == len(downloads) == len(issued)
    cost = V100_16GB.link.copy_seconds(DOWNLOAD)
    previous_end = 0.0
    for (kernel_by, download_by), kernel, download in zip(issued, kernels, downloads, strict=True):
        # The kernel starts when it was ready (issued, its stream free) and runs its share's length.
        assert kernel.start <= max(kernel_by, previous_end) + 1e-9
        assert kernel.end - kernel.start == pytest.approx(KERNEL_S * 80 / runtime.units)
        # The download follows it at once and has the device-to-host link to itself.
        assert download.start <= max(kernel.end, download_by) + 1e-9
        assert download.end - download.start == pytest.approx(cost, rel=1e-6)
        previous_end = download.end
