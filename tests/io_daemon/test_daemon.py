"""The IO daemon on the emulated device: every byte arrives exactly once at its address, per function in
order, under every ablation switch and in stream-only mode; preemption, the in-flight bound, ring
reuse, per-request staging, errors and the ticket API."""

from __future__ import annotations

import random
import time

import pytest
import torch

from streambox.device import DeviceError, InvalidAddress
from streambox.io_daemon import CopyRequest, DaemonConfig, IODaemon

from .conftest import hold

KiB = 1 << 10
MiB = 1 << 20
SENTINEL = 0xAB

CONFIGS = {
    "streambox": DaemonConfig(block_size=64 * KiB),
    "no-PB": DaemonConfig(block_size=64 * KiB, pinned_buffer=False),
    "no-BT": DaemonConfig(block_size=64 * KiB, batch_blocks=1, inflight_batches=1),
    "small-blocks": DaemonConfig(block_size=4 * KiB),
    "tiny-ring": DaemonConfig(block_size=64 * KiB, ring_slots=2),
    "no-optimizations": DaemonConfig.ablation(rz=False, pb=False, bt=False, block_size=4 * KiB),
    "stream-only": DaemonConfig.stream_only(),
}


def make_requests(rng, base, sizes, layer_every=3):
    """Requests to disjoint, gapped ranges of one device region starting at `base`; the gaps keep the
    sentinel, so a copy that strays shows."""
    requests, offset = [], 0
    for i, n in enumerate(sizes):
        offset += rng.choice([0, 8, 256])
        src = torch.randint(0, 256, (n + 16,), dtype=torch.uint8)
        src_offset = rng.choice([0, 3, 16]) if n else 0
        requests.append(CopyRequest(base + offset, src, n, layer=i // layer_every, src_offset=src_offset))
        offset += n
    return requests, offset


def sizes_for(rng, total):
    sizes = []
    while sum(sizes) < total:
        sizes.append(rng.choice([0, 4, 256, 1000, 5 * KiB, 64 * KiB, 64 * KiB + 8, 300 * KiB]))
    return sizes


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_every_byte_arrives_exactly_once_and_in_order(rt, name):
    config = CONFIGS[name]
    rng = random.Random(7)
    functions = {
        f: sizes_for(rng, 600 * KiB if "small" in name or "optim" in name else 2 * MiB) for f in "abc"
    }
    region_bytes = sum(sum(s) + 256 * len(s) for s in functions.values())
    region = rt.mem_alloc(region_bytes)
    device = rt.view(region, torch.uint8, (region_bytes,))
    device.fill_(SENTINEL)
    placed, offset, tickets = {}, 0, {}
    with IODaemon(rt, config) as daemon:
        for f, sizes in functions.items():
            placed[f], used = make_requests(rng, region + offset, sizes)
            offset += used
            tickets[f] = daemon.submit(f, placed[f])
        daemon.synchronize()
        for t in tickets.values():
            t.synchronize()
            assert t.query() and t.error is None
        stats = daemon.stats
        trace = list(daemon.trace)

    # every byte at its address, and nothing outside the destinations was written
    written = torch.zeros(region_bytes, dtype=torch.bool)
    for f, requests in placed.items():
        for r in requests:
            at = r.dst - region
            want = r.src[r.src_offset : r.src_offset + r.nbytes]
            assert torch.equal(device[at : at + r.nbytes], want), (f, r.dst, r.nbytes)
            assert not written[at : at + r.nbytes].any()
            written[at : at + r.nbytes] = True
    assert bool((device[~written] == SENTINEL).all())

    # exactly once: the copy engine moved exactly the requested bytes, no more
    total = sum(r.nbytes for rs in placed.values() for r in rs)
    h2d = [rec for rec in rt.timeline() if rec.lane == "h2d"]
    assert sum(rec.nbytes for rec in h2d) == total == stats.nbytes
    assert len(h2d) == stats.copy_calls

    if config.mode == "stream-only":
        assert stats.blocks == 0 and stats.copy_calls == sum(
            r.nbytes > 0 for rs in placed.values() for r in rs
        )
        return
    # per function: blocks issued in seq order, and completed in that order
    for f in functions:
        mine = [b for b in trace if b.function == f]
        assert [b.seq for b in mine] == list(range(len(mine)))
        times = [b.event.marker.time for b in mine]
        assert times == sorted(times)
    assert all(b.nbytes <= config.block_size for b in trace)
    assert stats.blocks == len(trace)
    if config.pinned_buffer:
        assert stats.pinned_allocations == 1 and stats.pinned_bytes == config.ring_bytes
    else:
        assert stats.pinned_allocations == sum(r.nbytes > 0 for rs in placed.values() for r in rs)
    if config.batch_blocks == 1:
        assert stats.batches == stats.blocks


def test_newcomer_joins_the_next_batch_and_is_not_stuck_behind_the_large_load(rt, spec):
    big_n, small_n = 8 * MiB, 256 * KiB  # ~40 ms and ~1.3 ms on the test link
    big_src = torch.randint(0, 256, (big_n,), dtype=torch.uint8)
    small_src = torch.randint(0, 256, (small_n,), dtype=torch.uint8)
    big_dst, small_dst = rt.mem_alloc(big_n), rt.mem_alloc(small_n)
    clock = rt.create_stream()
    config = DaemonConfig(block_size=64 * KiB)
    with IODaemon(rt, config) as daemon:
        big = daemon.submit("big", [CopyRequest(big_dst, big_src, big_n)])
        while daemon.stats.blocks < 20:  # the large load is well under way
            time.sleep(0.001)
        start = rt.create_event()
        start.record(clock)
        formed = daemon.batches_formed
        small = daemon.submit("small", [CopyRequest(small_dst, small_src, small_n)])
        small.synchronize()
        big.synchronize()
        trace = list(daemon.trace)
    first_small = next(b for b in trace if b.function == "small")
    assert first_small.batch == formed  # preempted at the very next batch boundary
    # One copy stream: blocks reach the link in issue order. Before the small function's last block,
    # only the blocks already in flight when it arrived and one big block per small block
    # (round-robin) went ahead of it -- not the ~100 big blocks still queued.
    last_small = max(i for i, b in enumerate(trace) if b.function == "small")
    ahead = [
        b for b in trace[:last_small] if b.function == "big" and b.batch >= formed - config.inflight_batches
    ]
    blocks = small_n // config.block_size
    assert len(ahead) <= config.batch_blocks * config.inflight_batches + blocks
    behind = [b for b in trace[last_small:] if b.function == "big"]
    assert len(behind) > 64
    # and on the modelled timeline it finished long before the large load
    assert small.last_event().marker.time < big.last_event().marker.time
    assert start.elapsed_ms(small.last_event()) > 0
    assert torch.equal(rt.view(small_dst, torch.uint8, (small_n,)), small_src)
    assert torch.equal(rt.view(big_dst, torch.uint8, (big_n,)), big_src)


def test_at_most_inflight_batches_are_issued_and_layer_events_wait_for_issue(rt):
    config = DaemonConfig(block_size=64 * KiB, batch_blocks=3, inflight_batches=2)
    n = 20 * 64 * KiB
    src = torch.randint(0, 256, (n,), dtype=torch.uint8)
    dst = rt.mem_alloc(n)
    requests = [
        CopyRequest(dst + i * 64 * KiB, src, 64 * KiB, layer=i, src_offset=i * 64 * KiB) for i in range(20)
    ]
    daemon = IODaemon(rt, config)
    gate_stream = rt.create_stream()
    release = hold(rt, gate_stream)
    gate = rt.create_event()
    gate.record(gate_stream)
    daemon.stream.wait_event(gate)  # the link is blocked until release()
    ticket = daemon.submit("f", requests)
    assert ticket.event_for(5, timeout=5) is not None  # issued (batches 0 and 1), not yet arrived
    with pytest.raises(TimeoutError, match="layer 6"):
        ticket.event_for(6, timeout=0.3)  # a third batch waits for the first to complete
    assert daemon.stats.blocks == 6
    assert not ticket.query()
    release()
    ticket.synchronize(timeout=10)
    assert torch.equal(rt.view(dst, torch.uint8, (n,)), src)
    with pytest.raises(KeyError, match="layer 99"):
        ticket.event_for(99)
    daemon.close()
    assert not daemon._thread.is_alive()
    with pytest.raises(DeviceError, match="closed"):
        daemon.submit("f", requests)


def _until_idle(daemon: IODaemon, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not daemon._idle:
        assert time.monotonic() < deadline, "the daemon thread never went idle"
        time.sleep(0.001)


def test_an_idle_daemon_issues_a_one_batch_submission_on_the_submitters_thread(rt):
    """Nothing queued or in flight: the batch the daemon would form next is the submission itself, so
    `submit` issues it before returning (no thread hand-off). A larger one is the daemon thread's."""
    config = DaemonConfig(block_size=64 * KiB, batch_blocks=3)
    n = 3 * 64 * KiB
    src = torch.randint(0, 256, (2 * n,), dtype=torch.uint8)
    dst = rt.mem_alloc(2 * n + 1)
    with IODaemon(rt, config) as daemon:
        _until_idle(daemon)
        small = daemon.submit("f", [CopyRequest(dst, src, n)])
        assert small.issued and daemon.stats.batches == 1
        small.synchronize(timeout=10)
        _until_idle(daemon)
        large = daemon.submit("g", [CopyRequest(dst + n, src, n + 1, src_offset=n - 1)])  # 4 blocks
        assert daemon.stats.batches == 1  # more than one batch: the daemon thread issues it
        large.synchronize(timeout=10)
    assert torch.equal(rt.view(dst, torch.uint8, (n,)), src[:n])
    assert torch.equal(rt.view(dst + n, torch.uint8, (n + 1,)), src[n - 1 : 2 * n])


def test_ring_slot_is_reused_only_after_its_copy_completed(rt):
    """Two slots, many blocks with distinct bytes, and a link blocked at first: staging into a slot
    whose copy has not run yet would corrupt the destination."""
    config = DaemonConfig(block_size=16 * KiB, batch_blocks=4, ring_slots=2)
    n = 40 * 16 * KiB
    src = torch.arange(n, dtype=torch.int64).to(torch.uint8).roll(7)
    dst = rt.mem_alloc(n)
    with IODaemon(rt, config) as daemon:
        gate_stream = rt.create_stream()
        release = hold(rt, gate_stream)
        gate = rt.create_event()
        gate.record(gate_stream)
        daemon.stream.wait_event(gate)
        ticket = daemon.submit("f", [CopyRequest(dst, src, n)])
        with pytest.raises(TimeoutError):
            ticket.synchronize(timeout=0.2)
        assert daemon.stats.blocks == 2  # two slots: the third block waits for the first copy
        release()
        ticket.synchronize(timeout=10)
    assert torch.equal(rt.view(dst, torch.uint8, (n,)), src)


def test_per_request_staging_pays_the_pinned_allocation(rt, spec):
    sizes = [1 * MiB, 1 * MiB, 512 * KiB]
    srcs = [torch.randint(0, 256, (n,), dtype=torch.uint8) for n in sizes]
    times = {}
    for pb in (True, False):
        # one block per call (BT off), so no allocation hides behind copies in flight
        config = DaemonConfig.ablation(bt=False, pb=pb, block_size=256 * KiB)
        dsts = [rt.mem_alloc(n) for n in sizes]
        with IODaemon(rt, config) as daemon:
            clock = rt.create_stream()
            start = rt.create_event()
            start.record(clock)
            ticket = daemon.submit(
                "f", [CopyRequest(d, s, n) for d, s, n in zip(dsts, srcs, sizes, strict=True)]
            )
            ticket.synchronize()
            times[pb] = start.elapsed_ms(ticket.last_event()) / 1e3
            assert daemon.stats.pinned_allocations == (1 if pb else 3)
        for d, s, n in zip(dsts, srcs, sizes, strict=True):
            assert torch.equal(rt.view(d, torch.uint8, (n,)), s)
            rt.mem_free(d)
    # PB off: the per-request allocations sit between the copies on the modelled timeline
    link = sum(spec.link.copy_seconds(min(256 * KiB, n - k)) for n in sizes for k in range(0, n, 256 * KiB))
    pinned_cost = sum(sizes) * spec.link.pinned_alloc_s_per_byte
    assert times[True] >= link * 0.999
    assert times[False] >= link + 0.9 * pinned_cost


def test_a_failed_copy_fails_only_its_function(rt):
    config = DaemonConfig(block_size=64 * KiB)
    n = 4 * MiB
    src = torch.randint(0, 256, (n,), dtype=torch.uint8)
    doomed, ok = rt.mem_alloc(n), rt.mem_alloc(n)
    with IODaemon(rt, config) as daemon:
        bad = daemon.submit("bad", [CopyRequest(doomed, src, n)])
        good = daemon.submit("good", [CopyRequest(ok, src, n)])
        rt.mem_free(doomed)  # while its blocks are queued or in flight
        with pytest.raises(InvalidAddress):
            bad.synchronize(timeout=10)
        good.synchronize(timeout=10)
        assert daemon.stats.failed_blocks >= 1
        # the daemon goes on serving
        later = daemon.submit("bad", [CopyRequest(ok, src, 1024, src_offset=5)])
        later.synchronize(timeout=10)
    assert torch.equal(rt.view(ok, torch.uint8, (n,))[:1024], src[5:1029])
    assert torch.equal(rt.view(ok, torch.uint8, (n,))[1024:], src[1024:])


def test_cancel_fails_open_tickets_and_drops_queued_blocks(rt):
    n = 4 * MiB
    src = torch.zeros(n, dtype=torch.uint8)
    dst = rt.mem_alloc(n)
    with IODaemon(rt, DaemonConfig(block_size=64 * KiB)) as daemon:
        ticket = daemon.submit("f", [CopyRequest(dst, src, n)])
        daemon.cancel("f")
        with pytest.raises(DeviceError, match="cancelled"):
            ticket.synchronize(timeout=10)
        daemon.synchronize(timeout=10)
        assert daemon.stats.blocks < n // (64 * KiB)


def test_stream_only_copies_straight_on_the_functions_stream_in_issue_order(rt):
    sizes = [3000, 0, 70_000, 12]
    srcs = [torch.randint(0, 256, (n,), dtype=torch.uint8) for n in sizes]
    dsts = [rt.mem_alloc(max(n, 1)) for n in sizes]
    with IODaemon(rt, DaemonConfig.stream_only()) as daemon:
        assert daemon.stream is None  # no daemon thread, no copy stream of its own
        requests = [
            CopyRequest(d, s, n, layer=i) for i, (d, s, n) in enumerate(zip(dsts, srcs, sizes, strict=True))
        ]
        ticket = daemon.submit("f", requests)
        assert ticket.event_for(1) is None  # a layer without bytes: nothing to wait for
        compute = rt.create_stream()
        ticket.wait(2, compute)
        seen = []
        rt.launch(compute, lambda: seen.append(rt.view(dsts[2], torch.uint8, (70_000,)).clone()))
        compute.synchronize()
        assert torch.equal(seen[0], srcs[2])
        ticket.synchronize()
    lane = daemon.function_stream("f")
    h2d = [rec for rec in rt.timeline() if rec.lane == "h2d"]
    assert [rec.nbytes for rec in h2d] == [3000, 70_000, 12]
    assert {rec.name for rec in h2d} == {f"htod stream:{lane.id}"}
    for d, s, n in zip(dsts, srcs, sizes, strict=True):
        assert torch.equal(rt.view(d, torch.uint8, (max(n, 1),))[:n], s)


def test_bad_requests_are_refused_at_submit(rt):
    dst = rt.mem_alloc(1024)
    with IODaemon(rt) as daemon:
        with pytest.raises(ValueError, match="does not fit"):
            daemon.submit("f", [CopyRequest(dst, torch.zeros(10, dtype=torch.uint8), 11)])
        with pytest.raises(ValueError, match="contiguous"):
            daemon.submit("f", [CopyRequest(dst, torch.zeros(8, 8).t(), 4)])
        with pytest.raises(TypeError, match="CPU tensor"):
            daemon.submit("f", [CopyRequest(dst, b"bytes", 4)])  # type: ignore[arg-type]
        empty = daemon.submit("f", [])
        empty.synchronize()
        assert empty.last_event() is None


def test_config_labels_and_validation():
    assert DaemonConfig().label == "StreamBox"
    assert DaemonConfig.stream_only().label == "stream-only"
    assert DaemonConfig.ablation(rz=False, pb=False, bt=False).label == "no optimizations"
    assert DaemonConfig.ablation(pb=False, bt=False).label == "RZ"
    assert DaemonConfig.ablation(bt=False).label == "RZ+PB"
    wo = DaemonConfig.ablation(rz=False, pb=False, bt=False)
    assert (wo.block_size, wo.batch_blocks, wo.inflight_batches, wo.pinned_buffer) == (16 * KiB, 1, 1, False)
    assert DaemonConfig().ring_bytes == 12 * 2 * MiB
    with pytest.raises(ValueError, match="mode"):
        DaemonConfig(mode="fifo")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="positive"):
        DaemonConfig(batch_blocks=0)
