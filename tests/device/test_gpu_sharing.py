"""One emulated GPU shared by two processes: its link and its compute units (timed mode).

Each context is a real child process of `benchmarks/device_timing.py` (the same code the benchmark
measures with); they share the device through its ledger and start their work at the same instant.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

_PATH = Path(__file__).resolve().parents[2] / "benchmarks" / "device_timing.py"
_SPEC = importlib.util.spec_from_file_location("device_timing", _PATH)
assert _SPEC is not None and _SPEC.loader is not None
device_timing = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(device_timing)

KERNELS = {"scenario": "kernels", "kernels": 10, "blocks": device_timing.SPEC.compute_units // 2,
           "duration_s": 5e-3}


def test_two_processes_copying_at_once_each_get_half_the_link(tmp_path):
    nbytes = 120 << 20  # 10 ms alone on the V100 preset
    alone = device_timing.SPEC.link.copy_seconds(nbytes)
    reports = device_timing.run_contexts([{"scenario": "copy", "nbytes": nbytes}] * 2, tmp_path)
    (a,), (b,) = (device_timing._spans(r, "htod") for r in reports)
    skew = abs(a[0] - b[0])  # when each process woke up for the common start
    assert skew < 0.5 * alone
    for start, end in (a, b):  # half the link each while both were on it, alone for `skew` each
        assert end - start == pytest.approx(2 * alone - skew, rel=1e-6)
    assert max(a[1], b[1]) - min(a[0], b[0]) == pytest.approx(2 * alone, rel=1e-6)  # never idle


def test_two_processes_kernels_never_overlap_without_mps(tmp_path):
    reports = device_timing.run_contexts([KERNELS, KERNELS], tmp_path)
    a, b = (device_timing._spans(r, "kernel") for r in reports)
    assert len(a) == len(b) == 10
    assert device_timing.overlap_seconds(a, b) == 0.0
    makespan = max(e for _, e in a + b) - min(s for s, _ in a + b)
    assert makespan == pytest.approx(2 * 10 * 5e-3, rel=0.05)  # time-sliced: one after the other


def test_two_processes_kernels_launched_in_segments_never_overlap_either(tmp_path):
    """`launch_many` places a segment in one ledger transaction; the other context still sees
    every kernel of it (and one-by-one launches beside it)."""
    segments = {**KERNELS, "segment": 4}
    reports = device_timing.run_contexts([segments, KERNELS], tmp_path)
    a, b = (device_timing._spans(r, "kernel") for r in reports)
    assert len(a) == len(b) == 10
    assert device_timing.overlap_seconds(a, b) == 0.0
    assert sum(end - start for start, end in a) == pytest.approx(10 * KERNELS["duration_s"], rel=1e-6)


def test_two_mps_clients_of_half_the_gpu_run_side_by_side(tmp_path):
    jobs = [{**KERNELS, "gpu_percent": 50}] * 2
    reports = device_timing.run_contexts(jobs, tmp_path)
    assert [r["units"] for r in reports] == [40, 40]
    a, b = (device_timing._spans(r, "kernel") for r in reports)
    assert device_timing.overlap_seconds(a, b) == pytest.approx(10 * 5e-3, rel=0.05)
