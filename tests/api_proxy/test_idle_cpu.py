"""Idle CPU of an instance: only spans with no invocation, idle at both ends, count (`idle_cpu.py`)."""

from __future__ import annotations

import os

import pytest

from streambox.api_proxy.idle_cpu import IDLE_CPU_BUDGET_S, IdleCpu, cpu_seconds


def test_only_burning_spans_idle_at_both_ends_with_nothing_dispatched_count() -> None:
    idle = IdleCpu()
    assert idle.observe(10.0, 0.0, 0, idle=True) == 0.0  # the first sample only starts a span
    assert idle.observe(10.9, 1.0, 0, idle=True) == pytest.approx(0.9)  # burning
    assert idle.observe(14.0, 2.0, 1, idle=True) == pytest.approx(0.9)  # sent an invocation meanwhile
    assert idle.observe(15.0, 3.0, 1, idle=False) == pytest.approx(0.9)  # busy now
    assert idle.observe(16.0, 4.0, 1, idle=True) == pytest.approx(0.9)  # busy at the span's start
    assert idle.observe(16.8, 5.0, 1, idle=True) == pytest.approx(1.7)
    assert not idle.over_budget()
    assert idle.observe(16.8 + IDLE_CPU_BUDGET_S, 5.0 + IDLE_CPU_BUDGET_S, 1, idle=True) > IDLE_CPU_BUDGET_S
    assert idle.over_budget()


def test_a_warm_instance_s_own_wait_never_adds_up() -> None:
    """Its channel's wait uses ~3 ms of CPU a second: a lifetime sum used to stop it after ~11 min."""
    idle, cpu = IdleCpu(), 0.0
    for second in range(100_000):
        cpu += 0.003
        idle.observe(cpu, float(second), 0, idle=True)
    assert idle.used_s == 0.0 and not idle.over_budget()
    idle.observe(cpu + 0.9, 100_000.0, 0, idle=True)  # then a thread burns
    idle.observe(cpu + 0.9 + 0.02, 100_001.0, 0, idle=True)  # and stops: the count restarts
    assert idle.used_s == 0.0


def test_cpu_seconds_reads_a_live_process_and_none_for_a_gone_one() -> None:
    mine = cpu_seconds(os.getpid())
    assert mine is not None and mine > 0
    assert cpu_seconds(2**22 + 12345) is None  # above pid_max's default range
