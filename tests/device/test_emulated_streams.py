"""Streams, events, kernels and compute units of the emulated backend."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from streambox.device.base import DeviceError, KernelError
from streambox.device.compute import units_for
from streambox.device.specs import MiB

from .conftest import hold


def _lane(rt, lane, kind=None):
    return [r for r in rt.timeline() if r.lane == lane and (kind is None or r.kind == kind)]


def test_stream_runs_in_issue_order(rt):
    s = rt.create_stream(priority=-1)
    assert s.priority == -1
    order = []
    for i in range(20):
        rt.launch(s, lambda i=i: order.append(i), name=f"k{i}")
    s.synchronize()
    assert order == list(range(20))
    assert s.query()


def test_copy_kernel_copy_chain_on_one_stream(rt):
    s = rt.create_stream()
    n = 1024
    a = rt.mem_alloc(n * 4)
    host_in = rt.host_alloc(n * 4)
    host_in.tensor().view(torch.float32).copy_(torch.arange(n, dtype=torch.float32))
    out = torch.empty(n, dtype=torch.float32)
    rt.copy_htod_async(a, host_in, n * 4, s)
    rt.launch(s, lambda: rt.view(a, torch.float32, (n,)).mul_(2), blocks=4, name="double")
    rt.copy_dtoh_async(out, a, n * 4, s)
    s.synchronize()
    assert torch.equal(out, torch.arange(n, dtype=torch.float32) * 2)
    h2d, kernel, d2h = _lane(rt, "h2d")[0], _lane(rt, f"stream:{s.id}")[0], _lane(rt, "d2h")[0]
    assert h2d.end <= kernel.start and kernel.end <= d2h.start


def test_event_never_recorded_is_complete(rt):
    e = rt.create_event()
    assert e.query()
    e.synchronize()
    s = rt.create_stream()
    s.wait_event(e)  # no-op
    assert s.query()
    with pytest.raises(DeviceError, match="recorded"):
        e.elapsed_ms(rt.create_event())


def test_event_on_one_stream_gates_another(rt):
    producer, consumer = rt.create_stream(), rt.create_stream()
    n = 4 * MiB  # ~4 ms on the 1 GB/s link
    dev = rt.mem_alloc(n)
    host = rt.host_alloc(n)
    host.tensor().fill_(7)
    seen = []
    ready = rt.create_event()
    rt.copy_htod_async(dev, host, n, producer)
    ready.record(producer)
    assert not ready.query()
    consumer.wait_event(ready)
    rt.launch(consumer, lambda: seen.append(int(rt.view(dev, torch.uint8, (n,)).min())), name="read")
    consumer.synchronize()
    assert ready.query()
    assert seen == [7]
    copy = _lane(rt, "h2d")[0]
    kernel = _lane(rt, f"stream:{consumer.id}", "kernel")[0]
    assert kernel.start >= copy.end


def test_wait_event_captures_the_record_at_wait_time(rt):
    """A record after the wait does not affect the waiting stream (else this would deadlock)."""
    a, b = rt.create_stream(), rt.create_stream()
    e = rt.create_event()
    b_ran = threading.Event()
    e.record(a)  # captures nothing but what a has: completes at once
    rt.launch(a, lambda: None, name="first")
    e.record(a)
    b.wait_event(e)
    rt.launch(b, b_ran.set, name="b")

    def wait_for_b():
        if not b_ran.wait(10):
            raise TimeoutError("b never ran")

    # a now waits for b; the re-record of e below must not make b wait for a
    rt.launch(a, wait_for_b, name="a2")
    e.record(a)
    a.synchronize()
    b.synchronize()
    assert b_ran.is_set()


def test_event_query_and_synchronize(rt):
    s = rt.create_stream()
    gate = threading.Event()
    rt.launch(s, lambda: gate.wait(10), name="held")
    e = rt.create_event()
    e.record(s)
    assert not e.query() and not s.query()
    gate.set()
    e.synchronize()
    assert e.query()
    s.synchronize()
    assert s.query()


def test_elapsed_time_of_a_copy_is_the_modelled_time(rt, spec):
    s = rt.create_stream()
    host = rt.host_alloc(8 * MiB)
    dev = rt.mem_alloc(8 * MiB)
    start, end = rt.create_event(), rt.create_event()
    release = hold(rt, s)
    start.record(s)
    rt.copy_htod_async(dev, host, 3 * MiB, s)
    end.record(s)
    release()
    end.synchronize()
    assert start.elapsed_ms(end) == pytest.approx(spec.link.copy_seconds(3 * MiB) * 1e3, abs=1e-6)
    untimed = rt.create_event(timing=False)
    untimed.record(s)
    untimed.synchronize()
    with pytest.raises(DeviceError, match="timing"):
        start.elapsed_ms(untimed)
    pending = rt.create_event()
    unblock = hold(rt, s)
    pending.record(s)
    with pytest.raises(DeviceError, match="not ready"):
        start.elapsed_ms(pending)
    unblock()
    s.synchronize()


def test_kernel_exception_is_isolated_to_its_stream(rt):
    bad, good = rt.create_stream(), rt.create_stream()
    after = []

    def boom():
        raise ValueError("boom")

    rt.launch(bad, boom, name="exploding")
    rt.launch(bad, lambda: after.append("bad-stream-continues"), name="next")
    rt.launch(good, lambda: after.append("good"), name="other")
    good.synchronize()  # nothing to report on another stream
    with pytest.raises(KernelError, match="exploding") as info:
        bad.synchronize()
    assert info.value.kernel == "exploding"
    assert isinstance(info.value.__cause__, ValueError)
    assert sorted(after) == ["bad-stream-continues", "good"]
    bad.synchronize()  # raised once
    # through an event recorded after the failure
    rt.launch(bad, boom, name="again")
    e = rt.create_event()
    e.record(bad)
    rt.launch(bad, boom, name="after-event")
    with pytest.raises(KernelError, match="'again'"):
        e.synchronize()
    with pytest.raises(KernelError, match="after-event"):
        bad.synchronize()
    assert rt.compute_stats().kernels["again"].errors == 1


def test_launch_many_runs_a_segment_in_order_and_reports_its_first_failure(rt):
    """`launch_many` is one operation of the stream: its kernels run in order after the work before
    it and before the work after it; a failing kernel does not stop the rest, as separate launches."""
    s = rt.create_stream()
    ran = []

    def boom(tag):
        ran.append(tag)
        raise ValueError(tag)

    rt.launch(s, lambda: ran.append("before"), name="before")
    rt.launch_many(s, [
        (lambda: ran.append("k0"), 2, None, "k0", None),
        (lambda: boom("k1"), 100, 3, "k1", None),
        (lambda: boom("k2"), 1, None, "k2", None),
        (lambda: ran.append("k3"), 4, None, "k3", None),
    ])
    rt.launch(s, lambda: ran.append("after"), name="after")
    with pytest.raises(KernelError, match="'k1'") as info:
        s.synchronize()
    assert ran == ["before", "k0", "k1", "k2", "k3", "after"]
    assert info.value.kernel == "k1" and "1 more kernel of this launch failed" in str(info.value.__notes__)
    stats = rt.compute_stats()
    assert stats.kernels["k1"].compute_units == 3 and stats.kernels["k2"].errors == 1  # cap and errors kept
    assert stats.kernels["k3"].launches == 1


def test_compute_units_honour_blocks_and_cap(rt, spec):
    assert spec.compute_units == 8
    assert units_for(100, None, 8) == 8
    assert units_for(3, None, 8) == 3
    assert units_for(100, 2, 8) == 2
    assert units_for(100, 50, 8) == 8
    with pytest.raises(ValueError):
        units_for(0, None, 8)
    s = rt.create_stream()
    rt.launch(s, lambda: None, blocks=1000, name="full")
    rt.launch(s, lambda: None, blocks=3, name="small")
    rt.launch(s, lambda: None, blocks=1000, cu_cap=2, name="capped")
    s.synchronize()
    stats = rt.compute_stats()
    assert {k: v.compute_units for k, v in stats.kernels.items()} == {"full": 8, "small": 3, "capped": 2}
    assert [r.compute_units for r in _lane(rt, f"stream:{s.id}")] == [8, 3, 2]
    assert stats.peak_concurrent_cus == 8 and stats.in_use == 0


def test_capped_kernels_overlap_and_uncapped_ones_serialise(rt):
    s1, s2 = rt.create_stream(), rt.create_stream()
    both = threading.Barrier(2, timeout=10)
    # cap 4 + 4 fits in 8 CUs: both run at once (else the barrier would time out)
    rt.launch(s1, both.wait, blocks=64, cu_cap=4, name="half-a")
    rt.launch(s2, both.wait, blocks=64, cu_cap=4, name="half-b")
    s1.synchronize()
    s2.synchronize()
    assert rt.compute_stats().peak_concurrent_cus == 8
    # 6 + 6 does not fit: the second waits for the first's units
    spans = {}

    def timed(name):
        def kernel():
            t0 = time.perf_counter()
            time.sleep(0.02)
            spans[name] = (t0, time.perf_counter())

        return kernel

    rt.launch(s1, timed("x"), blocks=64, cu_cap=6, name="x")
    rt.launch(s2, timed("y"), blocks=64, cu_cap=6, name="y")
    s1.synchronize()
    s2.synchronize()
    (a0, a1), (b0, b1) = sorted(spans.values())
    assert a1 <= b0
    stats = rt.compute_stats()
    assert stats.peak_concurrent_cus == 8
    assert stats.kernels["x"].cu_seconds == pytest.approx(6 * stats.kernels["x"].busy_seconds)


def test_destroyed_stream_rejects_work_and_is_uncounted(backend):
    r = backend.open_runtime(0)
    s = r.create_stream()
    done = []
    r.launch(s, lambda: done.append(1))
    assert backend.device_usage()[0].streams == 1
    s.destroy()
    assert backend.device_usage()[0].streams == 0
    with pytest.raises(DeviceError, match="destroyed"):
        r.launch(s, lambda: None)
    r.close()
    assert done == [1]  # queued work still ran


def test_streams_of_another_runtime_are_rejected(backend):
    r0, r1 = backend.open_runtime(0), backend.open_runtime(1)
    s1 = r1.create_stream()
    with pytest.raises(DeviceError, match="not a stream"):
        r0.launch(s1, lambda: None)
    with pytest.raises(DeviceError, match="recorded"):
        r0.create_event().record(s1)
    r0.close()
    r1.close()
