"""run_replay end to end (shipped sample -> run directory), the systems' registry, the report's PNGs
and table, and the command-line entry points."""

from __future__ import annotations

import csv
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from streambox.replay import report, run_replay
from streambox.replay.cli import main
from streambox.replay.report import PLOTS
from streambox.replay.run import RUN_FILES
from streambox.replay.target import SystemRequest, UnknownSystem, known_systems, resolve_system

# Minutes 0-20 of the shipped sample (about 115 invocations), a minute per 0.02 s: 0.4 s of replay.
FAST = {"minutes": 20, "minute_seconds": 0.02, "sample_interval_s": 0.02, "progress": False}


def _replay(tmp_path: Path, double_cls, name: str, seconds: float, **extra):
    return run_replay(
        None, workflow="traffic", system=name, out=tmp_path / name,
        target=double_cls(seconds=seconds), **{**FAST, **extra},
    )


def test_run_directory_holds_config_requests_samples_summary(tmp_path, double_cls):
    result = _replay(tmp_path, double_cls, "streambox", 0.01)
    run_dir = result.run_dir
    files = ["config.json", "requests.csv", "samples.csv", "summary.json"]
    assert sorted(p.name for p in run_dir.iterdir()) == files
    config = json.loads((run_dir / "config.json").read_text())
    assert config["config"]["minutes"] == 20 and config["config"]["workflows"] == ["traffic"]
    workload = config["workload"]
    assert workload["trace_layout"] == "invitro" and workload["trace_functions"] == 12
    assert {f["pattern"]["kind"] for f in workload["functions"]} <= {"sporadic", "periodic", "bursty"}
    assert config["system_config"] == {"target": "driver-test-double", "seconds": 0.01}
    with open(run_dir / "requests.csv") as stream:
        rows = list(csv.DictReader(stream))
    # every invocation of minutes 0-20 of the 12 functions, at scale 1
    assert len(rows) == sum(f["replayed_invocations"] for f in workload["functions"]) == workload["arrivals"]
    assert {r["pattern"] for r in rows} <= {"sporadic", "periodic", "bursty"}
    assert rows[0]["status"] == "ok" and rows[0]["cold_start"] == "True"
    summary = result.summary
    assert summary["requests"]["by_status"] == {"ok": len(rows)}
    assert summary["slo_violations"] == 0 and summary["cold_starts"] == 1
    assert summary["latency_ms"]["p50"] >= 10.0
    assert summary["memory"]["memory_used_bytes"]["peak_bytes"] >= 1000.0
    assert summary["throughput_rps"] > 0
    assert json.loads((run_dir / "summary.json").read_text())["label"] == "streambox"
    with pytest.raises(ValueError, match="already holds a run"):
        _replay(tmp_path, double_cls, "streambox", 0.01)


def test_scale_and_events_carry_trace_facts(tmp_path, double_cls):
    double = double_cls()
    result = run_replay(None, system="x", out=tmp_path / "x", scale=0.1, target=double, **FAST)
    full = json.loads((result.run_dir / "config.json").read_text())["workload"]["functions"]
    assert sum(f["replayed_invocations"] for f in full) == len(double.events)
    assert sum(f["window_invocations"] for f in full) > 5 * len(double.events)
    event = double.events[0]
    assert set(event) >= {"request_id", "workflow", "function", "pattern", "minute", "duration_hint_ms"}
    assert event["duration_hint_ms"] > 0


def test_a_workload_scaled_to_nothing_is_refused(tmp_path, double_cls):
    with pytest.raises(ValueError, match="no arrival left after scaling"):
        run_replay(None, system="x", out=tmp_path / "x", scale=1e-6, target=double_cls(), **FAST)
    assert not (tmp_path / "x").exists()


def test_registry_resolves_and_names_the_known_systems():
    assert "inprocess-cpu" in known_systems()
    with pytest.raises(UnknownSystem, match=r"unknown system 'nope'; known systems: .*inprocess-cpu"):
        resolve_system("nope")
    assert {"streambox", "stream-only", "monolithic"} <= set(known_systems())
    with pytest.raises(ValueError, match="unknown options"):
        resolve_system("inprocess-cpu", SystemRequest("inprocess-cpu", ("traffic",), options={"FM": "off"}))
    for options, says in (({"model_mib": "-1"}, "model_mib -1.0 must be above 0"),  # every request failed
                          ({"slots": "two"}, "slots 'two' is not a number \\(int\\)")):
        with pytest.raises(ValueError, match=says):
            resolve_system("inprocess-cpu", SystemRequest("inprocess-cpu", ("traffic",), options=options))


def test_inprocess_target_through_the_registry(tmp_path):
    result = run_replay(
        None, system="inprocess-cpu", out=tmp_path / "cpu", max_requests=20,
        system_options={"model_mib": "2", "runtime_mib": "1"}, **FAST,
    )
    summary = result.summary
    assert summary["label"] == "inprocess-cpu[model_mib=2,runtime_mib=1]"
    assert summary["requests"]["by_status"] == {"ok": 20}
    with open(result.run_dir / "requests.csv") as stream:
        functions = {row["function"] for row in csv.DictReader(stream)}
    # the first request of each function starts an instance; with 2 slots at most 2 run at once
    assert len(functions) <= summary["cold_starts"] <= 2 * len(functions)
    components = summary["memory_components"]
    assert components["memory.weights_bytes"]["peak_bytes"] >= 2 * (1 << 20) * 0.99
    assert components["memory.runtime_bytes"]["peak_bytes"] >= 1 << 20


def test_report_writes_the_plots_and_the_comparison(tmp_path, capsys, double_cls):
    runs = [
        _replay(tmp_path, double_cls, "streambox", 0.005).run_dir,
        _replay(tmp_path, double_cls, "stream-only", 0.02).run_dir,
        _replay(tmp_path, double_cls, "monolithic", 0.3).run_dir,
    ]
    capsys.readouterr()
    out = tmp_path / "report"
    assert main(["report", *map(str, runs), "--out", str(out)]) == 0  # streambox report RUN_DIR ...
    printed = capsys.readouterr().out
    assert "Replay comparison" in printed and "stream-only" in printed and "beside the paper" in printed
    for name in PLOTS:
        png = out / f"{name}.png"
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000
    comparison = json.loads((out / "comparison.json").read_text())
    assert [r["system"] for r in comparison["rows"]] == ["streambox", "stream-only", "monolithic"]
    assert comparison["rows"][2]["SLO viol."] > 0 and comparison["rows"][0]["SLO viol."] == 0
    assert [r["against"] for r in comparison["ratios"]] == ["stream-only", "monolithic"]
    assert comparison["ratios"][0]["mean memory (paper)"].startswith("-71%")
    assert (out / "comparison.md").read_text().count("\n| ") >= 3
    # A baseline that replayed another workload is not set beside the paper (its ratios were printed as
    # StreamBox's factor, with no word).
    other = _replay(tmp_path / "other", double_cls, "stream-only", 0.02, minutes=10).run_dir
    assert main(["report", str(runs[0]), str(other), "--out", str(tmp_path / "report2")]) == 0
    printed = capsys.readouterr().out
    assert "is not set beside stream-only and the paper: another workload (minutes)" in printed
    assert json.loads((tmp_path / "report2" / "comparison.json").read_text())["ratios"] == []


def test_two_comparisons_in_one_report_are_told_apart_and_keep_their_paper_table(tmp_path, double_cls):
    """Two comparisons' folders are named after their systems: the report names each run by the
    folder above it, not "streambox (streambox)" twice, and still sets StreamBox beside the paper."""
    runs = []
    for compare in ("monday", "tuesday"):
        for system in ("streambox", "stream-only"):
            runs.append(_replay(tmp_path / compare, double_cls, system, 0.005).run_dir)
    report(runs, tmp_path / "report")
    comparison = json.loads((tmp_path / "report" / "comparison.json").read_text())
    assert [r["system"] for r in comparison["rows"]] == [
        "streambox (monday/streambox)", "stream-only (monday/stream-only)",
        "streambox (tuesday/streambox)", "stream-only (tuesday/stream-only)",
    ]
    assert comparison["ratios"] and comparison["ratios"][0]["mean memory (paper)"].startswith("-71%")


def test_a_baseline_whose_every_request_failed_gets_na_ratios_not_a_crash(tmp_path, capsys, double_cls):
    """The first replay on a real GPU failed every request of both systems (a kernel bug since fixed):
    the report divided by a throughput of 0 and lost the runs' table."""
    runs = [
        _replay(tmp_path, double_cls, "streambox", 0.005).run_dir,
        run_replay(None, workflow="traffic", system="stream-only", out=tmp_path / "stream-only",
                   target=double_cls(seconds=0.001, fail_every=1), **FAST).run_dir,
    ]
    report(runs, tmp_path / "report")
    (ratio,) = json.loads((tmp_path / "report" / "comparison.json").read_text())["ratios"]
    assert ratio["throughput (ours)"] == "n/a" and ratio["p50 latency (ours)"] == "n/a"


def test_report_names_a_directory_that_is_not_a_run(tmp_path):
    with pytest.raises(ValueError, match="not a finished replay run .missing summary.json"):
        report([tmp_path], tmp_path / "out")
    # A run whose file is damaged: the error names that file (it said "could not convert string...")
    for name in ("summary.json", "requests.csv", "samples.csv"):
        (tmp_path / name).write_text("{}" if name == "summary.json" else "a,b\n1,2\n")
    (tmp_path / "summary.json").write_text("{not json")
    with pytest.raises(ValueError, match=r"summary.json: cannot be read as a replay's file .JSONDecodeError"):
        report([tmp_path], tmp_path / "out")
    (tmp_path / "summary.json").write_text("{}")
    with pytest.raises(ValueError, match=r"requests.csv: cannot be read as a replay's file"):
        report([tmp_path], tmp_path / "out")


def test_cli_errors_are_one_line(tmp_path, capsys):
    assert main(["replay", "--system", "nope", "--out", str(tmp_path / "r"), "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert "unknown system 'nope'; known systems:" in err and "Traceback" not in err
    bad = tmp_path / "bad.csv"
    bad.write_text("a,b\n1,2\n")
    assert main(["replay", "--trace", str(bad), "--system", "inprocess-cpu", "--out", str(tmp_path)]) == 2
    assert "columns found: a,b" in capsys.readouterr().err


def test_cli_replay(tmp_path, capsys):
    out = tmp_path / "cpu"
    code = main([
        "replay", "--system", "inprocess-cpu", "--minutes", "30", "--minute-seconds", "0.02",
        "--max-requests", "15", "--set", "model_mib=1", "--out", str(out), "--no-progress",
        "--pattern", "periodic,bursty", "--functions", "4", "--spacing", "even",
    ])
    assert code == 0
    config = json.loads((out / "config.json").read_text())
    assert {f["pattern"]["kind"] for f in config["workload"]["functions"]} <= {"periodic", "bursty"}
    assert len(config["workload"]["functions"]) == 4
    assert config["config"]["system_options"] == {"model_mib": "1"}
    assert config["config"]["spacing"] == "even"
    assert "inprocess-cpu[model_mib=1]" in capsys.readouterr().out


def test_cli_comparison_checks_every_system_before_the_first_run(tmp_path, capsys):
    out = tmp_path / "cmp"
    assert main(["replay", "--system", "inprocess-cpu,nope", "--out", str(out), "--no-progress"]) == 2
    assert "unknown system 'nope'" in capsys.readouterr().err
    assert not out.exists()


def test_config_json_holds_what_the_started_system_describes(tmp_path, double_cls):
    """A system knows some of its configuration only once started (an invoker's modelled costs, the
    Redis version): config.json is written again then."""

    class Started(double_cls):  # type: ignore[misc, valid-type]
        started = False

        async def start(self) -> None:
            self.started = True

        def describe(self) -> dict:
            return {**super().describe(), "invoker": "started" if self.started else "NoneType"}

    result = run_replay(None, system="x", out=tmp_path / "x", target=Started(seconds=0.01), **FAST)
    config = json.loads((result.run_dir / "config.json").read_text())
    assert config["system_config"]["invoker"] == "started"


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_an_interrupted_replay_writes_what_it_measured_and_says_so(tmp_path, sig):
    """Ctrl-C (or SIGTERM) while a replay sends: no traceback, exit status 130, and the run directory
    holds the requests measured until then, marked interrupted."""
    out = tmp_path / "run"
    command = [sys.executable, "-m", "streambox.cli", "replay", "--system", "inprocess-cpu"]
    command += ["--minutes", "30", "--minute-seconds", "1", "--out", str(out), "--no-progress"]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 60
    while not (out / "config.json").exists() and time.monotonic() < deadline:
        time.sleep(0.1)
    time.sleep(1.5)  # some requests sent and answered
    process.send_signal(sig)
    _, err = process.communicate(timeout=60)
    assert process.returncode == 130, err
    assert "Traceback" not in err and f"replay: {sig.name}: stopping" in err
    requests = json.loads((out / "summary.json").read_text())["requests"]
    assert requests["stopped_by"] == "interrupted" and 0 < requests["recorded"] < requests["planned"]
    with open(out / "requests.csv") as stream:
        assert len(list(csv.DictReader(stream))) == requests["recorded"]


def test_an_overwrite_that_stops_before_it_measured_leaves_the_previous_run_whole(tmp_path, double_cls):
    """--overwrite, then Ctrl-C while the system deployed: summary.json was gone and config.json was the
    new run's, beside the old run's requests; report called the folder unfinished."""
    first = _replay(tmp_path, double_cls, "x", 0.001)
    before = {name: (first.run_dir / name).read_bytes() for name in RUN_FILES}

    class Interrupted(double_cls):  # type: ignore[misc, valid-type]
        async def start(self) -> None:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        run_replay(None, workflow="traffic", system="x", out=first.run_dir, target=Interrupted(),
                   overwrite=True, **FAST)
    assert {name: (first.run_dir / name).read_bytes() for name in RUN_FILES} == before
    assert sorted(p.name for p in first.run_dir.iterdir()) == sorted(RUN_FILES)
    # A folder whose run measured requests but wrote no summary (it crashed) is not replaced unasked.
    (first.run_dir / "summary.json").unlink()
    with pytest.raises(ValueError, match=r"already holds a run \(requests.csv\)"):
        run_replay(None, workflow="traffic", system="x", out=first.run_dir, target=double_cls(), **FAST)
    again = run_replay(None, workflow="traffic", system="x", out=first.run_dir, target=double_cls(),
                       overwrite=True, **FAST)
    assert (again.run_dir / "summary.json").exists() and not (again.run_dir / ".previous-run").exists()
    # An --overwrite killed (kill -9) before it measured left the previous run set aside: the next run
    # into the folder puts it back first (it deleted it), and refuses to replace it unasked.
    aside = again.run_dir / ".previous-run"
    aside.mkdir()
    for name in RUN_FILES:
        os.replace(again.run_dir / name, aside / name)
    with pytest.raises(ValueError, match=r"already holds a run \(summary.json\)"):
        run_replay(None, workflow="traffic", system="x", out=again.run_dir, target=double_cls(), **FAST)
    assert sorted(p.name for p in again.run_dir.iterdir()) == sorted(RUN_FILES)
