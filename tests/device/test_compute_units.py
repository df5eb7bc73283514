"""Compute-unit statistics (`device/compute.py`): timed kernels are counted in deferred batches."""

from __future__ import annotations

import pytest

from streambox.device.compute import DEFER_LIMIT, ComputeUnits


def test_deferred_timed_kernels_are_in_the_statistics_when_read():
    units = ComputeUnits(80)
    units.account(20, "conv", 0.5)
    units.account(60, "conv", 0.25)
    units.account(10, "relu", 1.0)
    stats = units.stats()
    assert stats.peak_concurrent_cus == 60
    assert stats.busy_cu_seconds == pytest.approx(20 * 0.5 + 60 * 0.25 + 10)
    conv = stats.kernels["conv"]
    assert (conv.launches, conv.compute_units, conv.errors) == (2, 60, 0)
    assert conv.busy_seconds == pytest.approx(0.75) and conv.cu_seconds == pytest.approx(25.0)
    units.reset_stats()
    assert units.stats().kernels == {} and units.stats().busy_cu_seconds == 0.0


def test_pending_kernels_stay_bounded_without_a_reader():
    units = ComputeUnits(80)
    for _ in range(3 * DEFER_LIMIT):
        units.account(1, "k", 1e-6)
    assert len(units._deferred) < DEFER_LIMIT
    assert units.stats().kernels["k"].launches == 3 * DEFER_LIMIT
