"""The virtual-time replay of the daemon on the link model: exact link arithmetic on small cases."""

from __future__ import annotations

import pytest

from streambox.device.specs import V100_16GB
from streambox.io_daemon import DaemonConfig
from streambox.io_daemon.simulate import SimFunction, simulate

MiB = 1 << 20
LINK = V100_16GB.link


def test_one_function_alone_keeps_the_link_busy():
    config = DaemonConfig()
    result = simulate(LINK, [SimFunction("f", 0.0, [5 * MiB, 1024, 3 * MiB])], config)
    # blocks: 2M, 2M, 1M+1K, 2M, 1M -> one call each, back to back
    want = sum(LINK.copy_seconds(n) for n in (2 * MiB, 2 * MiB, MiB + 1024, 2 * MiB, MiB))
    assert result.finish["f"] == pytest.approx(want)
    assert result.calls["f"] == 5
    assert result.link_busy == pytest.approx(want)


def test_stream_only_is_fifo_behind_everything_issued_before():
    big = SimFunction("big", 0.0, [64 * MiB] * 4)
    small = SimFunction("small", 0.001, [4 * MiB], pinned_source=True)
    result = simulate(LINK, [big, small], DaemonConfig.stream_only())
    big_end = 4 * LINK.copy_seconds(64 * MiB, pinned=False)
    assert result.finish["big"] == pytest.approx(big_end)
    assert result.finish["small"] == pytest.approx(big_end + LINK.copy_seconds(4 * MiB, pinned=True))


def test_newcomer_is_served_within_the_blocks_in_flight_plus_its_round_robin_share():
    config = DaemonConfig()
    block = LINK.copy_seconds(2 * MiB)
    big = SimFunction("big", 0.0, [200 * MiB])
    small = SimFunction("small", 10 * block + 1e-6, [8 * MiB])
    result = simulate(LINK, [big, small], config)
    latency = result.finish["small"] - small.arrival
    in_flight = config.batch_blocks * config.inflight_batches
    assert latency <= (in_flight + 2 * 4) * block + 1e-9
    so = simulate(LINK, [big, small], DaemonConfig.stream_only())
    assert so.finish["small"] - small.arrival > 10 * latency


def test_per_request_staging_and_one_block_per_call_cost_time():
    sizes = [4 * MiB, 4 * MiB]
    f = [SimFunction("f", 0.0, sizes)]
    base = simulate(LINK, f, DaemonConfig(), issue_s=10e-6).finish["f"]
    no_pb = simulate(LINK, f, DaemonConfig(pinned_buffer=False), issue_s=10e-6).finish["f"]
    no_bt = simulate(LINK, f, DaemonConfig.ablation(bt=False), issue_s=10e-6).finish["f"]
    allocations = sum(sizes) * LINK.pinned_alloc_s_per_byte  # serialised on the daemon thread
    assert allocations < no_pb <= base + allocations + 1e-12
    assert no_bt > base  # each call waits for the previous one: the issue cost is no longer hidden
