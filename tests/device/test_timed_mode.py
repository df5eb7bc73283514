"""Timed mode of the emulated device: kernels in GPU time, phantom data, and the same memory
behaviour as functional mode."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time

import pytest
import torch

from streambox.device.copy_engine import SHORT_COPY_S
from streambox.device.emulated import EmulatedBackend
from streambox.device.specs import MiB

from .conftest import SMALL_SPEC


@pytest.fixture
def timed(tmp_path):
    backend = EmulatedBackend(spec=SMALL_SPEC, state_dir=tmp_path / "state", mode="timed")
    yield backend
    backend.close()


def _kernels(rt):
    return [rec for rec in rt.timeline() if rec.kind == "kernel"]


def test_kernels_take_their_duration_in_stream_order_without_running(timed):
    rt = timed.open_runtime(0)
    s = rt.create_stream()
    ran = []
    begin, end = rt.create_event(), rt.create_event()
    begin.record(s)
    for i in range(5):
        rt.launch(s, lambda i=i: ran.append(i), blocks=8, duration_s=0.02, name=f"k{i}")
    end.record(s)
    assert not end.query()  # placed, not yet reached in GPU time
    t0 = time.perf_counter()
    s.synchronize()
    assert time.perf_counter() - t0 > 0.05  # the host waits for the modelled time
    assert ran == []  # phantom: the callables never run
    assert begin.elapsed_ms(end) == pytest.approx(100.0, abs=5.0)  # plus the host's issue time
    kernels = _kernels(rt)
    assert kernels[-1].end - kernels[0].start == pytest.approx(0.1, rel=1e-9)
    assert [k.name for k in kernels] == [f"k{i}" for i in range(5)]
    for a, b in zip(kernels, kernels[1:], strict=False):
        assert b.start == a.end  # back to back on one stream
    assert rt.timed_stats()["kernels"] == 5 and rt.timed_stats()["fallback_kernels"] == 0
    rt.launch(s, lambda: None, blocks=8, duration_s=0.05, name="last")
    t0 = time.perf_counter()
    rt.close()  # waits for the placed work, as a context's destruction does
    assert time.perf_counter() - t0 > 0.03


def test_fewer_units_make_a_kernel_longer_and_streams_share_the_context_units(timed):
    rt = timed.open_runtime(0)  # 8 compute units
    s1, s2, s3 = rt.create_stream(), rt.create_stream(), rt.create_stream()
    gate = rt.create_event()
    gate.record(s1)
    rt.launch(s1, lambda: None, blocks=8, cu_cap=2, duration_s=0.01, name="capped")
    (capped,) = _kernels(rt)
    assert capped.end - capped.start == pytest.approx(0.04)  # 8 blocks on 2 units: 4 waves
    # two full-width kernels on two streams: the second gets what the first leaves (nothing): serial
    for s in (s2, s3):
        rt.launch(s, lambda: None, blocks=8, duration_s=0.01, name="wide")
    wide = [k for k in _kernels(rt) if k.name == "wide"]
    assert wide[0].compute_units == 6  # the capped kernel still holds 2 of the 8 units
    assert wide[1].start >= min(wide[0].end, capped.end) - 1e-9
    rt.close()


def test_a_launch_without_duration_uses_the_documented_fallback_and_counts_it(timed):
    rt = timed.open_runtime(0)
    s = rt.create_stream()
    rt.launch(s, lambda: None, blocks=8)
    s.synchronize()
    (k,) = _kernels(rt)
    assert k.end - k.start == pytest.approx(SMALL_SPEC.fallback_kernel_s)
    assert rt.timed_stats()["fallback_kernels"] == 1
    with pytest.raises(ValueError, match="duration_s"):
        rt.launch(s, lambda: None, duration_s=-1.0)
    rt.close()


def test_data_is_phantom_but_memory_is_accounted(timed):
    rt = timed.open_runtime(0)
    s = rt.create_stream()
    used_before = timed.device_usage()[0].used_memory
    address = rt.mem_alloc(32 * MiB)
    assert timed.device_usage()[0].used_memory - used_before == 32 * MiB
    host = torch.full((1024,), 7.0)
    rt.copy_htod_async(address, host, host.numel() * 4, s)
    back = torch.full((1024,), 3.0)
    rt.copy_dtoh_async(back, address, back.numel() * 4, s)
    s.synchronize()
    assert torch.count_nonzero(back) == 0  # a download reads zeros
    view = rt.view(address, torch.float32, (16, 16))
    assert view.device.type == "meta" and view.shape == (16, 16)
    rt.mem_free(address)
    with pytest.raises(Exception, match="invalid|not an allocation|free"):
        rt.view(address, torch.float32, (4,))
    rt.close()


def test_a_free_takes_effect_at_its_modelled_time(timed):
    rt = timed.open_runtime(0)
    s = rt.create_stream()
    pool = rt.create_pool(release_threshold=16 * MiB)  # keeps what is freed cached
    address = pool.alloc_async(MiB, s)
    rt.launch(s, lambda: None, blocks=8, duration_s=0.1)
    pool.free_async(address, s)
    assert pool.used_bytes == MiB  # the stream reaches the free only after the kernel
    other = pool.alloc_async(MiB, s)
    assert other != address
    s.synchronize()
    assert pool.used_bytes == MiB  # the first block came back; the second is held
    assert pool.alloc_async(MiB, s) == address
    rt.close()


def test_an_event_gates_another_stream_in_modelled_time(timed):
    rt = timed.open_runtime(0)
    a, b = rt.create_stream(), rt.create_stream()
    done = rt.create_event()
    rt.launch(a, lambda: None, blocks=4, duration_s=0.05, name="first")
    done.record(a)
    b.wait_event(done)
    rt.launch(b, lambda: None, blocks=4, duration_s=0.01, name="second")
    b.synchronize()
    first, second = _kernels(rt)
    assert second.start == pytest.approx(first.end, abs=1e-9)
    rt.close()


def test_a_copy_in_flight_orders_the_kernels_behind_it(timed):
    rt = timed.open_runtime(0)
    s = rt.create_stream()
    address = rt.mem_alloc(4 * MiB)
    host = rt.host_alloc(4 * MiB)
    rt.copy_htod_async(address, host, 4 * MiB, s)
    rt.launch(s, lambda: None, blocks=8, duration_s=0.005, name="after")
    s.synchronize()
    (copy,) = [r for r in rt.timeline() if r.kind == "htod"]
    (kernel,) = _kernels(rt)
    assert copy.end - copy.start == pytest.approx(SMALL_SPEC.link.copy_seconds(4 * MiB), rel=1e-6)
    assert kernel.start == pytest.approx(copy.end, abs=1e-9)
    rt.close()


def test_a_short_copy_on_an_idle_link_is_placed_at_issue_and_others_wait_for_its_end(timed):
    """No thread serves a short copy issued to an idle stream, engine and link: it is placed at issue
    (start = issue time, its modelled cost), the kernel behind it starts at its end, and another
    runtime's copy issued meanwhile starts after it instead of sharing the link."""
    rt, other = timed.open_runtime(0), timed.open_runtime(0)
    s, s_other = rt.create_stream(), other.create_stream()
    n = 64 * 1024
    cost = SMALL_SPEC.link.copy_seconds(n)
    assert cost <= SHORT_COPY_S
    dst, dst_other, host = rt.mem_alloc(n), other.mem_alloc(n), rt.host_alloc(n)
    before = time.perf_counter()
    rt.copy_htod_async(dst, host, n, s)
    issued = time.perf_counter()
    rt.launch(s, lambda: None, blocks=8, duration_s=0.001, name="after")
    launched = time.perf_counter()
    other.copy_htod_async(dst_other, host, n, s_other)
    s.synchronize()
    s_other.synchronize()
    (copy,) = [r for r in rt.timeline() if r.kind == "htod"]
    (copy_other,) = [r for r in other.timeline() if r.kind == "htod"]
    assert before <= copy.start <= issued and copy.end - copy.start == pytest.approx(cost, rel=1e-6)
    assert copy_other.start >= copy.end - 1e-9  # never both on the link: the first held it whole
    assert copy_other.end - copy_other.start == pytest.approx(cost, rel=1e-6)
    (kernel,) = _kernels(rt)
    assert kernel.start >= copy.end - 1e-9  # stream order: behind the copy
    if launched < copy.end:  # issued while the copy was on the link: starts at its end
        assert kernel.start == pytest.approx(copy.end, abs=1e-9)
    assert rt.copy_engine_stats()["h2d"]["placed_at_issue"] == 1
    rt.close()
    other.close()


def test_a_short_copy_beside_a_long_one_in_flight_shares_the_link(timed):
    """A copy in flight on the link (another runtime's long upload) sends the short one through its
    engine: it joins the link and shares it, ending later than its cost alone."""
    rt, other = timed.open_runtime(0), timed.open_runtime(0)
    s, s_other = rt.create_stream(), other.create_stream()
    big, n = 32 * MiB, 64 * 1024
    host = other.host_alloc(big)
    other.copy_htod_async(other.mem_alloc(big), host, big, s_other)  # 34 ms: far above SHORT_COPY_S
    flows = timed.ledger(0)._load_flows  # wait until its engine's thread has put it on the link
    deadline = time.monotonic() + 5
    while not flows("h2d")[2] and time.monotonic() < deadline:
        time.sleep(0.001)
    rt.copy_htod_async(rt.mem_alloc(n), host, n, s)
    s.synchronize()
    (copy,) = [r for r in rt.timeline() if r.kind == "htod"]
    assert copy.end - copy.start > 1.5 * SMALL_SPEC.link.copy_seconds(n)  # half the link, about 2x
    assert rt.copy_engine_stats()["h2d"]["placed_at_issue"] == 0
    s_other.synchronize()
    rt.close()
    other.close()


def test_mps_share_limits_units_and_bad_shares_are_refused(timed):
    rt = timed.open_runtime(0, gpu_percent=50)
    assert rt.units == 4 and rt.properties().extra["gpu_percent"] == 50
    s = rt.create_stream()
    rt.launch(s, lambda: None, blocks=8, duration_s=0.01)
    (k,) = _kernels(rt)
    assert k.compute_units == 4 and k.end - k.start == pytest.approx(0.02)
    rt.close()
    for bad in (0, 101, 50.0):
        with pytest.raises(ValueError, match="gpu_percent"):
            timed.open_runtime(0, gpu_percent=bad)


def test_issuing_timed_kernels_costs_little_host_cpu(timed):
    """The point of virtual time: no thread hop and no sleep per kernel."""
    rt = timed.open_runtime(0)
    s = rt.create_stream()
    n = 2000
    cpu = time.process_time()
    for _ in range(n):
        rt.launch(s, lambda: None, blocks=8, duration_s=100e-6)
    s.synchronize()
    per_kernel = (time.process_time() - cpu) / n
    assert per_kernel < 100e-6, f"{per_kernel * 1e6:.1f} us of host CPU per kernel"
    assert threading.active_count() < 50
    rt.close()


def test_framework_runtime_costs_memory_and_counts_the_process_start_towards_its_init(tmp_path):
    spec = SMALL_SPEC.with_overrides(framework_memory=8 * MiB, framework_init_s=0.3)
    backend = EmulatedBackend(spec=spec, state_dir=tmp_path / "state")
    bare = backend.open_runtime(0)
    assert bare.allocated_bytes() == spec.context_memory
    t0 = time.perf_counter()
    framework = backend.open_runtime(0, framework=True)
    # this test process started long ago (its import of torch is older than 0.3 s): nothing is added
    assert time.perf_counter() - t0 < 0.25
    assert framework.allocated_bytes() == spec.context_memory + 8 * MiB
    assert framework.properties().extra["framework_memory"] == 8 * MiB
    assert backend.device_usage()[0].used_memory == 2 * spec.context_memory + 8 * MiB
    backend.close()


def test_presets_cost_what_the_paper_measured_and_name_every_source():
    from dataclasses import fields

    from streambox.device.specs import PRESETS, SOURCES, V100_16GB, LinkModel

    # paper Sec. 2, Figs. 2-3: a PyTorch function's runtime up to ~1.4 GB and ~5 s to initialise
    assert V100_16GB.context_memory + V100_16GB.framework_memory == 1400 * MiB
    assert V100_16GB.context_create_s + V100_16GB.framework_init_s == pytest.approx(5.0)
    numbers = [f.name for f in fields(V100_16GB) if f.name not in ("name", "link")]
    numbers += [f"link.{f.name}" for f in fields(LinkModel)]
    assert sorted(SOURCES) == sorted(numbers)
    assert set(PRESETS) == {"v100-16gb", "h100-80gb"}


def test_a_fresh_process_pays_the_framework_init_once_its_own_start_up_included(tmp_path):
    """The child really imports torch; the modelled initialisation only tops its age up to the
    framework's `framework_init_s` (here 3 s by the run's override), it does not add a second import."""
    script = (
        "import json, sys, time\n"
        "from streambox.device.emulated import EmulatedBackend, _process_uptime\n"
        "from streambox.device.specs import V100_16GB\n"
        "spec = V100_16GB.with_overrides(context_create_s=0.0)\n"
        "backend = EmulatedBackend(spec, state_dir=sys.argv[1])\n"
        "before = _process_uptime(); t = time.perf_counter()\n"
        "rt = backend.open_runtime(0, framework=True)\n"
        "print(json.dumps({'before': before, 'open': time.perf_counter() - t, 'after': _process_uptime(),\n"
        "                  'bytes': rt.allocated_bytes()}))\n"
        "rt.close()\n"
    )
    env = {**os.environ, "STREAMBOX_FRAMEWORK_INIT_S": "3", "STREAMBOX_FRAMEWORK_MEMORY": "1000"}
    out = subprocess.run(
        [sys.executable, "-c", script, str(tmp_path / "state")], env=env, cwd="/", capture_output=True,
        text=True, check=True, timeout=120,
    ).stdout
    report = json.loads(out.strip().splitlines()[-1])
    assert report["bytes"] == 300 * MiB + 1000  # the context, and the framework as the run overrides it
    assert report["after"] >= 3.0 - 0.05  # the process is at least as old as the framework's init
    assert report["open"] <= max(0.0, 3.0 - report["before"]) + 0.3  # its own start-up counted once


def test_a_pageable_upload_stages_its_bytes_on_the_host_overlapped_with_its_transfer(timed):
    """The driver copies pageable memory into pinned staging on the issuing thread (real host work),
    while DMAing the chunks already staged: timed mode charges the memcpy, and the modelled transfer
    starts at the issue, not after the staging. Pinned uploads stage nothing."""
    rt = timed.open_runtime(0)
    s = rt.create_stream()
    n = 8 * MiB
    dst = rt.mem_alloc(n)
    pinned = rt.host_alloc(n, pinned=True)
    rt.copy_htod_async(dst, pinned, n, s)
    s.synchronize()
    assert rt.timed_stats()["pageable_staged_bytes"] == 0
    issued = time.perf_counter()
    rt.copy_htod_async(dst, torch.ones(n, dtype=torch.uint8), n, s)
    returned = time.perf_counter()
    s.synchronize()
    stats = rt.timed_stats()
    assert stats["pageable_staged_bytes"] == n and 0 < stats["pageable_staging_s"] <= returned - issued
    copy = [rec for rec in rt.timeline() if rec.kind == "htod"][-1]
    cost = rt.spec.link.copy_seconds(n, pinned=False)  # 8 MiB at 250 MB/s: ~34 ms, far above the memcpy
    assert issued <= copy.start < returned  # overlapped with the staging
    assert copy.end - copy.start == pytest.approx(cost, rel=1e-6)
    rt.close()


def test_a_pageable_transfer_ends_after_its_last_staged_chunk():
    from streambox.device.pageable import transfer_floor

    assert transfer_floor(issued=0.0, staged=0.005, cost=0.010, last_chunk_cost=0.001) == 0.0
    # staging slower than the link: the transfer ends one chunk's DMA after the staging
    assert transfer_floor(issued=0.0, staged=0.020, cost=0.010, last_chunk_cost=0.001) == pytest.approx(0.011)


def test_launch_many_places_a_segment_as_launches_one_by_one_would(tmp_path):
    """One placement transaction for a segment: the same intervals as five launches, in stream order
    after the work before it (another context sees them: tests/device/test_gpu_sharing.py)."""
    durations = [0.004, 0.001, 0.003, 0.002, 0.005]
    placed = {}
    for way in ("one by one", "launch_many"):
        backend = EmulatedBackend(spec=SMALL_SPEC, state_dir=tmp_path / way, mode="timed")
        rt = backend.open_runtime(0)
        s = rt.create_stream()
        rt.launch(s, lambda: None, blocks=8, duration_s=0.01, name="before")
        launches = [(lambda: None, 4, None, f"k{i}", d) for i, d in enumerate(durations)]
        if way == "one by one":
            for kernel, blocks, cap, name, d in launches:
                rt.launch(s, kernel, blocks=blocks, cu_cap=cap, name=name, duration_s=d)
        else:
            rt.launch_many(s, launches)
        s.synchronize()
        kernels = _kernels(rt)
        origin = kernels[0].start
        placed[way] = [(k.name, k.start - origin, k.end - origin, k.compute_units) for k in kernels]
        assert sum(k.launches for k in rt.compute_stats().kernels.values()) == 6
        rt.close()
        backend.close()
    assert [p[0] for p in placed["launch_many"]] == ["before", "k0", "k1", "k2", "k3", "k4"]
    for one, many in zip(placed["one by one"], placed["launch_many"], strict=True):
        assert one[0] == many[0] and one[3] == many[3]
        assert many[2] - many[1] == pytest.approx(one[2] - one[1], rel=1e-9)  # the same durations
    ends = [p[2] for p in placed["launch_many"]]
    starts = [p[1] for p in placed["launch_many"]]
    assert starts[1:] == pytest.approx(ends[:-1], abs=1e-9)  # back to back, in stream order
