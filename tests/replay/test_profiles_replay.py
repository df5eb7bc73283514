"""A streambox replay runs every function with its offline profile (Algorithm 1's inputs): no proxy
logs a plan as unprofiled (each does so once, at deploy or at the plan's first run), and no sample
counts an unprofiled run."""

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
def test_a_streambox_replay_runs_no_function_unprofiled(profiles, tmp_path, monkeypatch, capfd):
    # The profiles switch is a `memory` knob (the ablation that shows this test can fail).
    monkeypatch.setenv("STREAMBOX_MEMORY__PROFILES", "true" if profiles == "on" else "false")
    result = run_replay(
        system="streambox",
        out=tmp_path / profiles,
        system_options={"keep_alive_s": "60", "device_mode": "timed"},
        **SHORT,
    )
    assert result.summary["requests"]["by_status"] == {"ok": 3}, result.summary
    unprofiled = [line for line in capfd.readouterr().err.splitlines() if "runs unprofiled" in line]
    # (The samples lag the proxies' stats by up to their refresh period: a check that holds in any case.)
    peak = _peaks(result.run_dir)
    if profiles == "on":
        assert unprofiled == [] and peak["unprofiled_runs"] == 0, (unprofiled, peak)
    else:  # the switch that shows this test can fail: every model of the workflow named, with why
        assert sorted(unprofiled) == [
            "espcn (batch 1) runs unprofiled: profiles are off (memory.profiles=false)",
            "resnet18 (batch 1) runs unprofiled: profiles are off (memory.profiles=false)",
        ]
        assert peak["profiled_runs"] == 0
