"""The replay's own options: checked when the run is configured, and the settings flags and `--set`
merged into one mapping with the tree's names."""

from __future__ import annotations

import os

import pytest

from streambox.cli import build_parser
from streambox.config import SettingsError
from streambox.replay.cli import system_options
from streambox.replay.run import ReplayConfig, run_replay


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"minutes": 0}, "minutes 0 must be >= 1"),
        ({"scale": -1}, "scale -1 must be > 0"),
        ({"select": "best"}, "select 'best' is not one of volume, random, stratified"),
        ({"patterns": ("spiky",)}, "patterns .* is not one of sporadic, periodic, bursty"),
        ({"spacing": "uniform"}, "spacing 'uniform' is not one of poisson, even, trace"),
        ({"max_requests": 0}, "max_requests 0 must be >= 1"),
        ({"minuets": 3}, "minuets 3 is not a known setting"),
        ({"scale": float("inf")}, "scale inf Input should be a finite number"),
        ({"slo_ms": float("nan")}, "slo_ms nan Input should be a finite number"),
        ({"seed": -1}, "seed -1 must be >= 0"),
        ({"sample_interval_s": 1e-9}, "sample_interval_s 1e-09 must be >= 0.01"),
    ],
)
def test_bad_replay_options_name_the_field_the_value_and_the_allowed(options: dict, message: str) -> None:
    with pytest.raises(SettingsError, match=f"ReplayConfig: {message}"):
        ReplayConfig(**options)


def test_run_replay_checks_its_options_before_reading_the_trace(tmp_path) -> None:
    with pytest.raises(SettingsError, match="minute_seconds 0 must be > 0"):
        run_replay(tmp_path / "no-such-trace", minute_seconds=0, out=tmp_path / "run")


def test_flags_and_set_are_one_mapping_of_the_trees_names() -> None:
    parser = build_parser(["replay"])
    args = parser.parse_args(["replay", "--pa", "off", "--set", "Pool-Mode=fm", "--set", "pa=off"])
    assert system_options(args) == {"pa": "off", "pool_mode": "fm"}
    args = parser.parse_args(["replay", "--device-mode", "functional", "--set", "inputs=full"])
    assert system_options(args) == {"device_mode": "functional", "inputs": "full"}
    with pytest.raises(ValueError, match="--am off and --set am=on disagree"):
        system_options(parser.parse_args(["replay", "--am", "off", "--set", "am=on"]))
    # One setting given twice is a mistake; the same value spelled two ways is not.
    with pytest.raises(ValueError, match=r"--set pa given twice \('off', then 'on'\)"):
        system_options(parser.parse_args(["replay", "--set", "pa=off", "--set", "pa=on"]))
    with pytest.raises(ValueError, match=r"--set pa given twice"):
        system_options(parser.parse_args(["replay", "--set", "PA=off", "--set", "pa=off"]))
    same = parser.parse_args(["replay", "--set", "pa=false", "--pa", "off"])
    assert system_options(same) == {"pa": "false"}
    from streambox.replay.run import run_label
    from streambox.replay.target import SystemRequest, resolve_system

    # The label names and writes each option as the run resolved it: `--pa false` is `pa=off`.
    config = ReplayConfig(system_options=system_options(same))
    described = resolve_system(
        "streambox", SystemRequest("streambox", ("traffic",), options=config.system_options)
    )
    assert run_label(config, described.describe(), environ={}) == "streambox[pa=off]"


def test_a_comparison_refuses_options_before_its_first_run(tmp_path) -> None:
    """`rz=off` suits streambox but not stream-only (no IO daemon): nothing runs, nothing is written."""
    from streambox.replay.run import run_comparison

    with pytest.raises(ValueError, match="stream-only: rz: switches of the IO daemon"):
        run_comparison(["streambox", "stream-only"], out=tmp_path, system_options={"rz": "off"})
    assert not any(tmp_path.iterdir())


def test_a_replay_refuses_a_bad_window_workflow_or_folder_before_writing_anything(tmp_path) -> None:
    """Minutes past the trace's end (which used to pad with zeros until memory ran out), an unknown
    workflow, a folder that is a file, a system named twice: one clear error, nothing written."""
    from streambox.replay.run import run_comparison

    out = tmp_path / "out"
    with pytest.raises(ValueError, match=r"run past the end of azure2019-sample, which has 1440 minutes"):
        run_replay(minutes=100_000_000, out=out)
    with pytest.raises(ValueError, match=r"trace minutes \[1440, 1450\)"):
        run_replay(start_minute=1440, out=out)
    with pytest.raises(ValueError, match="workflow 'nosuch' is neither a shipped example"):
        run_replay(workflow="nosuch", minutes=1, out=out)
    with pytest.raises(ValueError, match="workflow 'nosuch' is neither a shipped example"):
        run_comparison(["streambox", "stream-only"], workflow="nosuch", minutes=1, out=out)
    with pytest.raises(ValueError, match="a system is named twice"):
        run_comparison(["streambox", "streambox"], minutes=1, out=out)
    assert not out.exists()
    afile = tmp_path / "afile"
    afile.write_text("")
    with pytest.raises(ValueError, match="--out .*afile is a file, not a folder"):
        run_replay(minutes=1, out=afile)
    with pytest.raises(ValueError, match="--out .*afile is a file, not a folder"):
        run_comparison(["streambox", "stream-only"], minutes=1, out=afile)


def test_a_switch_set_in_the_environment_is_part_of_the_runs_label(monkeypatch) -> None:
    """`STREAMBOX_POOL_MODE=static` ablates StreamBox as `--set pool_mode=static` does: the run is
    labelled so (the report sets only the unlabelled system beside the paper's claims)."""
    from streambox.replay.run import environment_ignored, run_label
    from streambox.replay.target import SystemRequest, resolve_system

    monkeypatch.setenv("STREAMBOX_POOL_MODE", "static")
    monkeypatch.setenv("STREAMBOX_IO_DAEMON", "off")
    described = resolve_system("streambox", SystemRequest("streambox", ("traffic",))).describe()
    assert (described["settings"]["pool_mode"], described["settings"]["io_daemon"]) == ("static", False)
    assert run_label(ReplayConfig(), described) == "streambox[io_daemon=off,pool_mode=static]"
    given = ReplayConfig(system_options={"Pool-Mode": "fm"})  # --set wins over the environment
    assert run_label(given, described) == "streambox[io_daemon=off,pool_mode=fm]"  # named as it resolved
    monkeypatch.delenv("STREAMBOX_POOL_MODE")
    monkeypatch.delenv("STREAMBOX_IO_DAEMON")
    plain = resolve_system("streambox", SystemRequest("streambox", ("traffic",))).describe()
    assert run_label(ReplayConfig(), plain) == "streambox"
    # Any spelling the settings read counts: lower case, and an alias (inputs is model_shapes too).
    monkeypatch.setenv("streambox_pool_mode", "static")
    monkeypatch.setenv("STREAMBOX_MODEL_SHAPES", "full")
    lower = resolve_system("streambox", SystemRequest("streambox", ("traffic",))).describe()
    assert run_label(ReplayConfig(), lower) == "streambox[inputs=full,pool_mode=static]"
    # A value the environment sets but the run does not take is no part of its label: said instead.
    assert run_label(ReplayConfig(), plain) == "streambox"
    assert sorted(environment_ignored(plain["settings"], {}, os.environ)) == [
        "STREAMBOX_MODEL_SHAPES=full is set, but this run takes inputs=small (the replay sets it; use --set "
        "inputs=...)",
        "STREAMBOX_POOL_MODE=static is set, but this run takes pool_mode=fm+rs (the replay sets it; use "
        "--set "
        "pool_mode=...)",
    ]
    # The device's settings too: an H100 or a functional-mode run was labelled as the V100 timed one,
    # so `paper --reuse` and `report` set it beside the others.
    monkeypatch.delenv("streambox_pool_mode")
    monkeypatch.delenv("STREAMBOX_MODEL_SHAPES")
    monkeypatch.setenv("STREAMBOX_DEVICE_PRESET", "h100-80gb")
    monkeypatch.setenv("STREAMBOX_DEVICE_MODE", "functional")
    on_h100 = resolve_system("streambox", SystemRequest("streambox", ("traffic",))).describe()
    assert run_label(ReplayConfig(), on_h100) == "streambox[device_mode=functional,device_preset=h100-80gb]"
    monkeypatch.setenv("STREAMBOX_DEVICE_PRESET", "v100-16gb")  # the replay's own device: no label
    monkeypatch.setenv("STREAMBOX_DEVICE_MODE", "timed")  # (a replay sets it for what it starts)
    on_v100 = resolve_system("streambox", SystemRequest("streambox", ("traffic",))).describe()
    assert run_label(ReplayConfig(), on_v100) == "streambox"


@pytest.mark.parametrize(("key", "value"), [("keep_alive_s", "inf"), ("weights_keep_alive_s", "1e999")])
def test_an_infinite_keep_alive_is_refused_before_anything_starts(key: str, value: str) -> None:
    """A proxy's configuration travels as JSON, which has no infinity: refused up front, named."""
    from streambox.replay.target import SystemRequest, resolve_system

    with pytest.raises(ValueError, match=f"{key} '{value}' Input should be a finite number"):
        resolve_system("streambox", SystemRequest("streambox", ("traffic",), options={key: value}))


@pytest.mark.parametrize("given", ["", ",,"])
def test_a_system_list_that_names_nothing_is_refused(given: str, capsys, tmp_path) -> None:
    from streambox.cli import main

    assert main(["replay", "--system", given, "--minutes", "1", "--out", str(tmp_path / "r")]) == 2
    assert f"--system {given!r} names no system; known: " in capsys.readouterr().err


@pytest.mark.parametrize(
    ("flags", "says"),
    [
        (["--sample-interval", "0"], "streambox replay: error: --sample-interval 0.0 must be >= 0.01"),
        (["--pattern", "bogus"], "streambox replay: error: --pattern ('bogus',) is not one of"),
        (["--max-duration", "-1"], "streambox replay: error: --max-duration -1.0 must be > 0"),
    ],
)
def test_replay_mistakes_are_named_by_their_flags(flags: list[str], says: str, capsys, tmp_path) -> None:
    from streambox.cli import main

    assert main(["replay", "--minutes", "1", "--out", str(tmp_path / "r"), *flags]) == 2
    err = capsys.readouterr().err
    assert says in err and "ReplayConfig" not in err
    assert not (tmp_path / "r").exists()


def test_a_comparison_refuses_a_finished_run_in_its_folder_before_its_first_replay(tmp_path) -> None:
    from streambox.replay.run import run_comparison

    (tmp_path / "stream-only").mkdir()
    (tmp_path / "stream-only" / "summary.json").write_text("{}")
    refused = r"stream-only \(summary.json\) already hold\(s\) a run: .* or --overwrite"
    with pytest.raises(ValueError, match=refused):
        run_comparison(["inprocess-cpu", "stream-only"], out=tmp_path, minutes=1)
    assert not (tmp_path / "inprocess-cpu").exists()  # nothing replayed first


def test_fewer_functions_than_asked_are_said(capsys) -> None:
    """--functions 100000 replayed the sample's few without a word: the run's rate is theirs."""
    from streambox.replay.run import build_workload, replay_config

    workload = build_workload(replay_config(functions=100_000, minutes=2))
    err = capsys.readouterr().err
    assert f"replaying those {len(workload.chosen)}, not the 100000 asked for (--functions)" in err


def test_the_environments_library_knobs_and_every_spelling_of_a_switch_are_labelled(monkeypatch) -> None:
    """`STREAMBOX_MEMORY__PROFILES=false` ran (the scaler saw no profile) but the run was called plain
    StreamBox; `STREAMBOX_PA=f` is pydantic's false too; the weights' keep-alive the proxy takes from
    the environment is what the run records and labels."""
    from streambox.replay.run import environment_ignored, run_label
    from streambox.replay.target import SystemRequest, resolve_system

    monkeypatch.setenv("STREAMBOX_MEMORY__PROFILES", "false")
    monkeypatch.setenv("STREAMBOX_WEIGHTS_KEEP_ALIVE_S", "5")
    monkeypatch.setenv("STREAMBOX_PA", "f")
    described = resolve_system("streambox", SystemRequest("streambox", ("traffic",))).describe()
    assert described["settings"]["tuning"] == {"memory": {"profiles": False}}
    assert described["settings"]["weights_keep_alive_s"] == 5.0
    label = "streambox[memory.profiles=off,pa=off,weights_keep_alive_s=5]"
    assert run_label(ReplayConfig(), described) == label
    assert environment_ignored(described["settings"], {}, os.environ) == []
    # What the figure asked for, without the environment: plain (a paper table then names the ablation).
    assert run_label(ReplayConfig(), described, environ={}) == "streambox"


def test_given_options_are_labelled_as_they_resolved() -> None:
    """`--set pa=f` and `--set device_mode=FUNCTIONAL` were labelled as typed; numbers as given."""
    from streambox.replay.run import run_label
    from streambox.replay.target import SystemRequest, resolve_system

    config = ReplayConfig(system_options={"pa": "f", "device_mode": "FUNCTIONAL", "keep_alive_s": "60"})
    request = SystemRequest("streambox", ("traffic",), options=config.system_options)
    described = resolve_system("streambox", request).describe()
    label = "streambox[device_mode=functional,keep_alive_s=60,pa=off]"
    assert run_label(config, described, environ={}) == label


def test_an_ablation_that_changes_nothing_in_its_run_says_so() -> None:
    """AM chooses among the node's GPUs: `am=off` on one GPU runs exactly as `am=on`, so the run (the
    replay's stderr, the proxy's) says so instead of letting a table set it beside AM as an ablation."""
    from streambox.config import ineffective_settings
    from streambox.replay.target import SystemRequest, resolve_system

    def settings(**options: str) -> dict:
        request = SystemRequest("streambox", ("traffic",), options=options)
        return resolve_system("streambox", request).describe()["settings"]

    (note,) = ineffective_settings(settings(am="off"))
    assert note.startswith("am=off changes nothing on one GPU") and "--gpus" in note
    assert ineffective_settings(settings(am="off", gpus="4")) == []
    assert ineffective_settings(settings()) == []
