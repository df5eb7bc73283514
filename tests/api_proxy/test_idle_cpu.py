"""Idle CPU of an instance: only spans with no invocation, idle at both ends, count (`idle_cpu.py`)."""

from __future__ import annotations

import os

from streambox.api_proxy.idle_cpu import IDLE_CPU_BUDGET_S, IdleCpu, cpu_seconds


def test_only_spans_idle_at_both_ends_with_nothing_dispatched_count() -> None:
    idle = IdleCpu()
    assert idle.observe(10.0, 0, idle=True) == 0.0  # the first sample only starts a span
    assert idle.observe(10.5, 0, idle=True) == 0.5
    assert idle.observe(14.0, 1, idle=True) == 0.5  # it was sent an invocation meanwhile
    assert idle.observe(15.0, 1, idle=False) == 0.5  # busy now
    assert idle.observe(16.0, 1, idle=True) == 0.5  # busy at the span's start
    assert not idle.over_budget()
    idle.observe(16.0 + IDLE_CPU_BUDGET_S, 1, idle=True)
    assert idle.over_budget()


def test_cpu_seconds_reads_a_live_process_and_none_for_a_gone_one() -> None:
    mine = cpu_seconds(os.getpid())
    assert mine is not None and mine > 0
    assert cpu_seconds(2**22 + 12345) is None  # above pid_max's default range
