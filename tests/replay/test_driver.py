"""The open-loop driver, tested against the driver test double of conftest.py (it sleeps; it is not
a system under test): sends stay on schedule however slow the target is, bounds hold, failures
become records."""

from __future__ import annotations

import asyncio

import pytest

from streambox.replay.driver import drive
from streambox.replay.shaping import Arrival
from streambox.replay.traces import FunctionKey


def arrivals(n: int, gap_s: float) -> list[Arrival]:
    key = FunctionKey("app", "f")
    return [Arrival(i * gap_s, "traffic", key, 0) for i in range(n)]


def run(coro):
    return asyncio.run(coro)


def test_sends_on_schedule_even_when_the_target_is_slow(double_cls):
    double = double_cls(seconds=1.0)
    result = run(drive(double, arrivals(20, 0.05), slo_s=0.2, sample_interval_s=0.1))
    assert len(result.records) == 20 and result.stopped_by == "all sent"
    lags = [r.sent_s - r.scheduled_s for r in result.records]
    # a closed-loop client would be 1 s late per earlier request; the margin is for a loaded machine
    assert max(lags) < 0.25, lags
    assert min(lags) >= -1e-3
    assert result.max_outstanding >= 18  # nothing waited for a response before sending
    assert all(0.99 <= r.latency_s < 2.0 for r in result.records)
    assert all(r.slo_violation for r in result.records)  # 1 s > 200 ms
    assert result.duration_s < 4.0  # 0.95 s of sends + 1 s of the last request, not 20 s
    assert [r.request_id for r in result.records] == list(range(20))
    assert result.records[0].cold_start and not result.records[1].cold_start


def test_bounded_by_count_and_by_duration(double_cls):
    double = double_cls(seconds=0.0)
    by_count = run(drive(double, arrivals(50, 0.01), max_requests=5))
    assert (len(by_count.records), by_count.stopped_by) == (5, "max_requests")
    by_time = run(drive(double, arrivals(50, 0.01), max_duration_s=0.1))
    assert (len(by_time.records), by_time.stopped_by) == (10, "max_duration")
    assert max(r.scheduled_s for r in by_time.records) < 0.1


def test_outstanding_requests_are_cancelled_after_the_drain_timeout(double_cls):
    double = double_cls(seconds=30.0)
    result = run(drive(double, arrivals(3, 0.01), drain_timeout_s=0.2))
    assert [r.status for r in result.records] == ["cancelled"] * 3
    assert all(r.slo_violation for r in result.records)
    assert result.duration_s < 5.0  # not the 30 s the requests would take


def test_a_stop_ends_the_sending_and_keeps_what_was_measured(double_cls):
    """The user's Ctrl-C (the run sets `stop`): no more sends, the outstanding requests are recorded
    as cancelled at once (not after the drain timeout), the completed ones as they were."""
    double = double_cls(seconds=0.3)

    async def interrupted():
        stop = asyncio.Event()
        asyncio.get_running_loop().call_later(0.5, stop.set)
        return await drive(double, arrivals(100, 0.05), drain_timeout_s=30.0, stop=stop)

    result = run(interrupted())
    assert result.stopped_by == "interrupted" and result.duration_s < 2.0
    statuses = [r.status for r in result.records]
    assert 5 <= len(statuses) <= 15 and statuses.count("ok") >= 3 and "cancelled" in statuses
    assert all(r.error == "still outstanding when the replay was interrupted" for r in result.records
               if r.status == "cancelled")


def test_timeouts_and_errors_are_recorded_not_raised(double_cls):
    slow = run(drive(double_cls(seconds=5.0), arrivals(2, 0.0), request_timeout_s=0.1))
    assert [r.status for r in slow.records] == ["timeout", "timeout"]
    assert all(0.09 < r.latency_s < 2.0 for r in slow.records)
    failing = run(drive(double_cls(fail_every=2), arrivals(4, 0.0)))
    assert [r.status for r in failing.records] == ["error", "ok", "error", "ok"]
    assert failing.records[0].error == "ConnectionError: gateway went away"
    assert [r.slo_violation for r in failing.records] == [True, False, True, False]


def test_samples_on_a_grid_and_survives_a_failing_sampler(double_cls):
    double = double_cls(seconds=0.3)
    result = run(drive(double, arrivals(5, 0.05), sample_interval_s=0.05))
    assert len(result.samples) >= 6
    times = [s["t_s"] for s in result.samples]
    assert times == sorted(times)
    assert max(s["outstanding"] for s in result.samples) >= 4
    assert max(s["memory_used_bytes"] for s in result.samples) >= 1004.0
    broken = run(drive(double_cls(sample_fails=True), arrivals(2, 0.05), sample_interval_s=0.05))
    assert len(broken.records) == 2 and broken.samples == []
    assert "metrics endpoint down" in broken.sample_errors[0]


@pytest.mark.parametrize("progress", [False, True])
def test_progress_bar_on_or_off(progress, capsys, double_cls):
    result = run(drive(double_cls(), arrivals(3, 0.0), progress=progress))
    assert len(result.records) == 3
