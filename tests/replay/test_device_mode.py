"""The replay's device mode: timed by default on the command line, functional one flag away, written
to config.json, and exported to the processes the system starts while the run lasts."""

from __future__ import annotations

import json
import os

from streambox.device.modes import ENV_DEVICE_MODE
from streambox.replay import run_replay
from streambox.replay.cli import main

from .conftest import SleepingDriverTestDouble

FAST = {"minutes": 20, "minute_seconds": 0.02, "sample_interval_s": 0.02, "progress": False}
CLI_FAST = ["--system", "inprocess-cpu", "--minutes", "30", "--minute-seconds", "0.02", "--max-requests", "5",
            "--set", "model_mib=1", "--functions", "2", "--no-progress"]


class ModeRecordingDouble(SleepingDriverTestDouble):
    async def start(self) -> None:
        self.mode_at_start = os.environ.get(ENV_DEVICE_MODE)


def test_the_command_line_replays_in_timed_mode_unless_told_otherwise(tmp_path, capsys, monkeypatch):
    monkeypatch.delenv(ENV_DEVICE_MODE, raising=False)
    assert main(["replay", *CLI_FAST, "--out", str(tmp_path / "timed")]) == 0
    assert "device mode: timed" in capsys.readouterr().out
    config = json.loads((tmp_path / "timed" / "config.json").read_text())
    assert config["device_mode"] == "timed"
    assert config["config"]["slo_ms"] == 200.0  # the paper's SLO
    # (--device-mode is an option of the systems that open a device: tests/replay/test_replay_options.py)
    monkeypatch.setenv(ENV_DEVICE_MODE, "functional")  # the environment chooses when no flag does
    assert main(["replay", *CLI_FAST, "--out", str(tmp_path / "env")]) == 0
    assert json.loads((tmp_path / "env" / "config.json").read_text())["device_mode"] == "functional"


def test_the_run_exports_its_mode_while_it_lasts(tmp_path, monkeypatch):
    monkeypatch.delenv(ENV_DEVICE_MODE, raising=False)
    double = ModeRecordingDouble()
    chosen = {"device_mode": "functional"}
    run_replay(None, system="x", out=tmp_path / "x", target=double, system_options=chosen, **FAST)
    assert double.mode_at_start == "functional"
    assert ENV_DEVICE_MODE not in os.environ  # restored
    default = ModeRecordingDouble()
    run_replay(None, system="y", out=tmp_path / "y", target=default, **FAST)
    assert default.mode_at_start == "timed"  # a replay is about time, from the library too


def test_a_bad_mode_is_refused_with_the_allowed_values(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv(ENV_DEVICE_MODE, "fast")
    assert main(["replay", *CLI_FAST, "--out", str(tmp_path / "bad")]) == 2
    err = capsys.readouterr().err
    assert "STREAMBOX_" in err and "device_mode" in err and "functional, timed" in err


def test_a_replay_on_the_cuda_backend_is_not_labelled_modelled():
    """The emulator's mode line ("modelled ... phantom data") on a real GPU's run would mislabel its
    measured numbers; the banner names the backend instead (no GPU is needed to print it)."""
    from streambox.device.modes import describe_device_mode

    line = describe_device_mode("timed", "cuda")
    assert "real GPU" in line and "modelled" not in line and "phantom" not in line
    assert "modelled" in describe_device_mode("timed", "emulated")
