"""Copy engines and the modelled link of the emulated backend."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from streambox.device.base import DeviceError
from streambox.device.copy_engine import LinkClock
from streambox.device.emulated import EmulatedBackend
from streambox.device.specs import MiB

from .conftest import hold


def _copies(rt, lane):
    return [r for r in rt.timeline() if r.lane == lane]


def test_link_clock_is_fifo_and_exact():
    clock = LinkClock(now=10.0)
    assert clock.schedule(ready=10.0, cost=2.0) == (10.0, 12.0)
    assert clock.schedule(ready=10.5, cost=0.5) == (12.0, 12.5)  # behind the first: waits
    assert clock.schedule(ready=20.0, cost=1.0) == (20.0, 21.0)  # idle link: starts when ready
    assert clock.busy_seconds == 3.5 and clock.copies == 3


def test_large_copy_first_delays_another_streams_small_copy(rt, spec):
    """One host-to-device engine per runtime, FIFO across streams (paper C3)."""
    big_stream, small_stream = rt.create_stream(), rt.create_stream()
    host = rt.host_alloc(32 * MiB)
    big, small = rt.mem_alloc(32 * MiB), rt.mem_alloc(4096)
    done_small = rt.create_event()
    rt.copy_htod_async(big, host, 32 * MiB, big_stream)  # ~33.6 ms at 1 GB/s
    rt.copy_htod_async(small, host, 4096, small_stream)  # ~14 us on its own
    done_small.record(small_stream)
    done_small.synchronize()
    big_stream.synchronize()
    first, second = _copies(rt, "h2d")
    assert (first.name, second.name) == (f"htod stream:{big_stream.id}", f"htod stream:{small_stream.id}")
    assert second.start == first.end  # it queued behind the large copy
    assert second.end == pytest.approx(first.end + spec.link.copy_seconds(4096), abs=1e-9)
    assert second.end >= first.end
    assert first.end - first.start == pytest.approx(spec.link.copy_seconds(32 * MiB), abs=1e-9)


def test_directions_are_separate_and_runtimes_share_the_gpus_link(tmp_path, spec):
    spec = spec.with_overrides(total_memory=256 * MiB)
    backend = EmulatedBackend(spec=spec, state_dir=tmp_path / "big")
    n = 48 * MiB
    r = backend.open_runtime(0)
    other = backend.open_runtime(0)
    s1, s2, s3, held = r.create_stream(), r.create_stream(), other.create_stream(), r.create_stream()
    host = r.host_alloc(n, pinned=False)
    a, b = r.mem_alloc(n), r.mem_alloc(n)
    c = other.mem_alloc(n)
    release, gate = threading.Event(), r.create_event()
    r.launch(held, lambda: release.wait(10), name="gate")
    gate.record(held)
    for s in (s1, s2, s3):  # all three copies become ready at the same modelled instant
        s.wait_event(gate)
    r.copy_htod_async(a, host, n, s1)
    r.copy_dtoh_async(host, b, n, s2)
    other.copy_htod_async(c, host, n, s3)
    release.set()
    for s in (s1, s2, s3):
        s.synchronize()
    (h2d,), (d2h,), (h2d_other,) = _copies(r, "h2d"), _copies(r, "d2h"), _copies(other, "h2d")
    alone = spec.link.copy_seconds(n, pinned=False)
    # the other direction has a link of its own (PCIe is full duplex): the download ran alone
    assert d2h.end - d2h.start == pytest.approx(alone, rel=1e-6)
    # the two uploads of two runtimes shared the GPU's one link: each got half of it while both were
    # on it (processor sharing in modelled time). Both were ready at the gate's time; an engine
    # thread the host ran late enters the link `skew` later (normally ~0), and then both take
    # 2 * alone - skew (first alone for `skew`, then half each, then the last one alone for `skew`)
    skew = abs(h2d.start - h2d_other.start)
    assert skew < alone, "the host ran an engine thread later than the whole copy"
    for rec in (h2d, h2d_other):
        assert rec.end - rec.start == pytest.approx(2 * alone - skew, rel=1e-6)
    r.close()
    other.close()
    backend.close()
    n = 8 * MiB
    r = backend.open_runtime(0)
    s1, held, host, a = r.create_stream(), r.create_stream(), r.host_alloc(8 * MiB), r.mem_alloc(8 * MiB)
    release = threading.Event()
    r.launch(held, lambda: release.wait(10), name="gate")
    gate = r.create_event()
    gate.record(held)
    # while two copies in the same direction on one runtime share its engine
    s4 = r.create_stream()
    release.set()
    for s in (s1, s4):
        s.wait_event(gate)  # complete once `held` has run: no-op
    gate2 = r.create_event()
    r.launch(held, lambda: release.wait(10), name="gate2")
    gate2.record(held)
    s1.wait_event(gate2)
    s4.wait_event(gate2)
    r.copy_htod_async(a, host, n, s1)
    r.copy_htod_async(a, host, n, s4)
    s1.synchronize()
    s4.synchronize()
    x, y = sorted(_copies(r, "h2d"), key=lambda rec: rec.start)
    assert y.start == x.end
    r.close()


def test_pinned_versus_pageable_cost(rt, spec):
    n = 2 * MiB
    t0 = time.perf_counter()
    pinned = rt.host_alloc(n, pinned=True)
    assert time.perf_counter() - t0 >= n * spec.link.pinned_alloc_s_per_byte
    pageable_buffer = rt.host_alloc(n, pinned=False)
    assert pinned.pinned and not pageable_buffer.pinned
    s = rt.create_stream()
    dev = rt.mem_alloc(n)
    tensor = torch.arange(n, dtype=torch.int64).to(torch.uint8)
    marks = [rt.create_event() for _ in range(4)]
    release = hold(rt, s)
    marks[0].record(s)
    rt.copy_htod_async(dev, pinned, n, s)
    marks[1].record(s)
    rt.copy_htod_async(dev, tensor, n, s)
    marks[2].record(s)
    rt.copy_htod_async(dev, pageable_buffer, n, s)
    marks[3].record(s)
    release()
    s.synchronize()
    pinned_ms = marks[0].elapsed_ms(marks[1])
    pageable_ms = marks[1].elapsed_ms(marks[2])
    assert pinned_ms == pytest.approx(spec.link.copy_seconds(n, pinned=True) * 1e3, abs=1e-6)
    assert pageable_ms == pytest.approx(spec.link.copy_seconds(n, pinned=False) * 1e3, abs=1e-6)
    assert marks[2].elapsed_ms(marks[3]) == pytest.approx(pageable_ms, abs=1e-6)
    assert pageable_ms > 3.9 * pinned_ms  # 1 GB/s against 250 MB/s, same latency
    out = torch.empty(n, dtype=torch.uint8)
    rt.copy_dtoh_async(out, dev, n, s)
    s.synchronize()
    assert torch.equal(out, pageable_buffer.tensor())


def test_pageable_source_is_staged_at_issue(rt):
    s = rt.create_stream()
    blocker = rt.create_stream()
    host = rt.host_alloc(8 * MiB)
    big, dev = rt.mem_alloc(8 * MiB), rt.mem_alloc(1024)
    rt.copy_htod_async(big, host, 8 * MiB, blocker)  # the engine is busy ~8 ms
    src = torch.full((1024,), 3, dtype=torch.uint8)
    rt.copy_htod_async(dev, src, 1024, s)
    src.fill_(9)  # after issue: the staged copy is unaffected
    s.synchronize()
    assert int(rt.view(dev, torch.uint8, (1024,)).max()) == 3
    blocker.synchronize()


def test_typed_tensors_and_offsets(rt):
    s = rt.create_stream()
    dev = rt.mem_alloc(4096)
    src = torch.arange(256, dtype=torch.float32)
    rt.copy_htod_async(dev + 256, src, 1024, s)
    out = rt.host_alloc(2048, pinned=False)
    rt.copy_dtoh_async(out, dev + 256, 1024, s, dst_offset=512)
    s.synchronize()
    assert torch.equal(out.tensor()[512:1536].view(torch.float32), src)
    assert torch.equal(rt.view(dev + 256, torch.float32, (256,)), src)
    with pytest.raises(ValueError, match="exceeds"):
        rt.copy_dtoh_async(out, dev, 1024, s, dst_offset=1536)
    with pytest.raises(ValueError, match="contiguous"):
        rt.copy_htod_async(dev, torch.zeros(8, 8).t(), 256, s)


def test_dtod_copy_runs_on_the_stream_at_device_bandwidth(rt, spec):
    s = rt.create_stream()
    a, b = rt.mem_alloc(MiB), rt.mem_alloc(MiB)
    rt.view(a, torch.uint8, (MiB,)).fill_(5)
    rt.copy_dtod_async(b, a, MiB, s)
    rt.copy_dtod_async(a + 1, a, 1024, s)  # overlapping: memmove semantics
    s.synchronize()
    assert int(rt.view(b, torch.uint8, (MiB,)).min()) == 5
    first = [r for r in rt.timeline() if r.kind == "dtod"][0]
    assert first.lane == f"stream:{s.id}"
    assert first.end - first.start == pytest.approx(MiB / spec.link.device_bandwidth, abs=1e-9)


def test_peer_copy_lands_on_the_other_device(backend, spec):
    r0, r1 = backend.open_runtime(0), backend.open_runtime(1)
    s0, s1 = r0.create_stream(), r1.create_stream()
    n = 2 * MiB
    src, dst = r0.mem_alloc(n), r1.mem_alloc(n)
    payload = torch.randint(0, 256, (n,), dtype=torch.uint8)
    r0.copy_htod_async(src, payload, n, s0)
    done = r0.create_event()
    r0.copy_peer_async(dst + 0, r1, src, n, s0)
    done.record(s0)
    s1.wait_event(done)  # cross-device wait
    out = torch.empty(n, dtype=torch.uint8)
    r1.copy_dtoh_async(out, dst, n, s1)
    s1.synchronize()
    assert torch.equal(out, payload)
    (peer,) = _copies(r0, "peer")
    assert peer.end - peer.start == pytest.approx(spec.link.peer_seconds(n), abs=1e-9)
    assert r1.allocated_bytes() == n and backend.device_usage()[1].used_memory == n
    with pytest.raises(DeviceError):
        r0.copy_peer_async(dst, object(), src, n, s0)  # type: ignore[arg-type]
    r0.close()
    r1.close()


def test_timeline_is_bounded_and_switchable(tmp_path, spec):
    from streambox.device.emulated import EmulatedBackend

    with EmulatedBackend(spec, state_dir=tmp_path, timeline_limit=5) as be:
        r = be.open_runtime()
        s = r.create_stream()
        for i in range(12):
            r.launch(s, lambda: None, name=f"k{i}")
        s.synchronize()
        assert [x.name for x in r.timeline()] == [f"k{i}" for i in range(7, 12)]
        r.set_timeline(False)
        r.launch(s, lambda: None, name="hidden")
        s.synchronize()
        assert "hidden" not in [x.name for x in r.timeline()]
        r.clear_timeline()
        assert r.timeline() == []
