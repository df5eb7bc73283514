"""A streambox replay runs every function with its offline profile (Algorithm 1's inputs), and the
samples say how many runs had one and how many did not."""

from __future__ import annotations

import csv
from pathlib import Path

import pytest

from streambox.replay import run_replay

SHORT = {
    "workflow": "image-processing",
    "minutes": 30,
    "minute_seconds": 0.05,
    "max_requests": 3,
    "sample_interval_s": 0.1,
    "progress": False,
}


def _peaks(run_dir: Path) -> dict[str, float]:
    with (run_dir / "samples.csv").open() as f:
        rows = list(csv.DictReader(f))
    return {key: max(float(row[key] or 0) for row in rows) for key in rows[0]}


@pytest.mark.parametrize("profiles", ["on", "off"])
def test_a_streambox_replay_runs_no_function_unprofiled(profiles, tmp_path, monkeypatch):
    # The profiles switch is a `memory` knob (the ablation that shows this test can fail).
    monkeypatch.setenv("STREAMBOX_MEMORY__PROFILES", "true" if profiles == "on" else "false")
    result = run_replay(
        system="streambox",
        out=tmp_path / profiles,
        system_options={"keep_alive_s": "60", "device_mode": "timed"},
        **SHORT,
    )
    assert result.summary["requests"]["by_status"] == {"ok": 3}, result.summary
    peak = _peaks(result.run_dir)
    if profiles == "on":
        assert peak["profiled_runs"] > 0 and peak["unprofiled_runs"] == 0, peak
    else:
        assert peak["unprofiled_runs"] > 0 and peak["profiled_runs"] == 0, peak
