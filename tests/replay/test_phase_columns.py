"""A streambox replay writes each request's phases (`streambox.phases`) into requests.csv: one column
per phase, in ms, adding up to the system's own latency of the request; the first request, which
starts the function instances (`prewarm=0`: none started at deploy), has a cold start phase, the
later warm ones none. The summary carries the proxy's running counts (`counters`)."""

from __future__ import annotations

import csv
import json

import pytest

from streambox.replay import run_replay
from streambox.replay.metrics import PHASE_COLUMNS


def test_requests_csv_has_phases_that_add_up(tmp_path):
    result = run_replay(
        system="streambox",
        out=tmp_path / "run",
        system_options={"keep_alive_s": "60", "device_mode": "timed", "prewarm": "0"},
        workflow="image-processing",
        minutes=30,
        minute_seconds=0.05,
        max_requests=3,
        sample_interval_s=0.1,
        progress=False,
    )
    assert result.summary["requests"]["by_status"] == {"ok": 3}, result.summary
    with (result.run_dir / "requests.csv").open() as f:
        rows = list(csv.DictReader(f))
    assert PHASE_COLUMNS == (
        "cold_start_ms",
        "queue_ms",
        "model_load_ms",
        "compute_ms",
        "comm_ms",
        "other_ms",
    )
    for row in rows:
        phases = {column: float(row[column]) for column in PHASE_COLUMNS}
        # each column is rounded to 1 µs; the latency to 1 µs
        assert sum(phases.values()) == pytest.approx(float(row["target_latency_s"]) * 1e3, abs=0.05)
        assert all(ms >= -1.0 for ms in phases.values()), phases  # `other` is not overcounted
        assert phases["compute_ms"] > 0
    first, *later = sorted(rows, key=lambda r: float(r["sent_s"]))
    assert first["cold_start"] == "True" and float(first["cold_start_ms"]) > 0
    for row in later:
        assert (row["cold_start"] == "True") == (float(row["cold_start_ms"]) > 0), row
    counters = result.summary["counters"]  # the proxy's pool and IO daemon, summed, as of the last sample
    assert counters["pool.allocations"] >= counters["pool.frees"] > 0
    assert counters["pool.grows"] >= 1 and counters["io.blocks"] >= 1
    assert counters["store.puts"] >= 1  # the managed store's counters too (PA and AM show there)
    # What the proxy itself reported running, beside what the replay asked for.
    system_config = json.loads((result.run_dir / "config.json").read_text())["system_config"]
    reported = system_config["reported_settings"]["image-processing"]
    asked = system_config["settings"]
    assert (reported["pool_mode"], reported["comm_store"]) == (asked["pool_mode"], "managed")
    assert counters["proxy.cpu_user_s"] + counters["proxy.cpu_system_s"] > 0  # the proxy's own CPU time
    # its startup heap (torch and the project's imports) is out of its collections (`gc_pauses`)
    assert counters["proxy.gc_frozen_objects"] > 100_000
    assert set(result.summary["driver"]["gc"]) >= {"gc_full_collections", "gc_pause_s"}
    with (result.run_dir / "samples.csv").open() as f:
        grows = [float(r["counter.pool.grows"]) for r in csv.DictReader(f) if r["counter.pool.grows"]]
    assert grows == sorted(grows) and grows[-1] == counters["pool.grows"]
    by_workflow = result.summary["memory_by_workflow"]  # the one proxy's runtime: context and all it holds
    assert list(by_workflow) == ["image-processing"]
    peak = result.summary["memory"]["memory_used_bytes"]["peak_bytes"]
    assert 0 < by_workflow["image-processing"]["mean_bytes"] <= peak
