"""The systems under test as replay targets: options, and short real replays through the API proxy."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest

from streambox.replay.run import run_comparison
from streambox.replay.systems import PAPER_KEEP_ALIVE_S, WorkflowOptions, WorkflowTarget, load_workflow
from streambox.replay.target import SystemRequest, known_systems, resolve_system


def test_the_systems_are_registered_and_monolithic_is_a_deprecated_infless() -> None:
    assert {"streambox", "stream-only", "infless", "monolithic"} <= set(known_systems())
    for name in ("streambox", "stream-only", "infless"):
        target = resolve_system(name, SystemRequest(name, ("traffic",)))
        assert isinstance(target, WorkflowTarget) and target.name == name
    with pytest.warns(DeprecationWarning, match="it is 'infless' now"):
        old = resolve_system("monolithic", SystemRequest("monolithic", ("traffic",)))
    assert old.settings["system"] == "infless" and old.settings["prewarm"] == 1


def test_keep_alive_follows_the_time_compression() -> None:
    options, device, rest = WorkflowOptions.split("streambox", {}, time_scale=1 / 60)
    assert options.keep_alive_s == pytest.approx(PAPER_KEEP_ALIVE_S / 60)
    assert options.inputs == "small" and device == {} and rest == {}
    given = {"keep_alive_s": "3", "Pool-Mode": "fm", "device_mode": "functional"}
    options, device, rest = WorkflowOptions.split("streambox", given, 1.0)
    assert options.keep_alive_s == 3.0 and rest == {"pool_mode": "fm"}
    assert device == {"device_mode": "functional"}


def test_the_resolved_settings_are_what_config_json_shows() -> None:
    request = SystemRequest("streambox", ("traffic",), options={"pa": "off", "rz": "off", "inputs": "full"})
    settings = WorkflowTarget.describe(resolve_system("streambox", request))["settings"]
    assert (settings["pa"], settings["am"], settings["rz"], settings["pb"]) == (False, True, False, True)
    assert (settings["pool_mode"], settings["inputs"]) == ("fm+rs", "full")
    assert settings["io_block_bytes"] == 16 << 10
    assert settings["device"]["device_mode"] == "timed"  # replay's default, unless told otherwise
    only = resolve_system("stream-only", SystemRequest("stream-only", ("traffic",))).describe()["settings"]
    assert (only["pool_mode"], only["io_daemon"], only["rz"]) == ("static", False, None)
    request = SystemRequest("stream-only", ("traffic",), options={"device_mode": "functional"})
    device = resolve_system("stream-only", request).describe()["settings"]["device"]
    assert device["device_mode"] == "functional"


@pytest.mark.parametrize("system", ["streambox", "stream-only", "infless", "astraea"])
def test_every_system_prewarms_one_instance_per_function_at_deploy_unless_told(system: str) -> None:
    settings = resolve_system(system, SystemRequest(system, ("traffic",))).describe()["settings"]
    assert settings["prewarm"] == 1 and "deploy" in settings["startup"]
    request = SystemRequest(system, ("traffic",), options={"prewarm": "0"})
    target = resolve_system(system, request)
    assert target.describe()["settings"]["prewarm"] == 0
    if system in ("streambox", "stream-only"):  # what the proxy is started with
        assert "fork at their first request" in target.settings["startup"]
        assert target.invoker_options == {"prewarm": "0"}


@pytest.mark.parametrize(
    ("system", "options", "message"),
    [
        ("streambox", {"pa": "maybe"}, "streambox: proxy option: pa 'maybe' is not on or off"),
        ("streambox", {"fm": "off"}, "unknown proxy option 'fm'.*--set also takes prewarm, .*variants"),
        ("stream-only", {"bt": "off"}, "bt: switches of the IO daemon, which is off here"),
        ("infless", {"pool_mode": "fm"}, r"infless: unknown options \['pool_mode'\]"),
        ("infless", {"prewarm": "-1"}, "prewarm '-1' must be >= 0"),
        ("stream-only", {"prewarm": "-1"}, "stream-only: proxy option: prewarm '-1' must be >= 0"),
        ("infless", {"gpu_percent": "101"}, "gpu_percent '101' must be <= 100"),
        ("streambox", {"gpus": "0"}, "streambox: gpus '0' must be >= 1"),
    ],
)
def test_bad_system_options_fail_before_the_run(system: str, options: dict[str, str], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        resolve_system(system, SystemRequest(system, ("traffic",), options=options))


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"inputs": "huge"}, "inputs 'huge' is not one of small, full"),
        ({"variants": "x"}, "variants"),
        ({"variants": "10000000"}, "variants '10000000' must be <= 64"),  # each is built at the start
    ],
)
def test_bad_options_name_the_key(options: dict[str, str], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        WorkflowOptions.split("streambox", options, 1.0)


def test_unknown_workflow_names_the_examples(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="traffic"):
        load_workflow(str(tmp_path / "nope.yaml"), small=True)


def _rows(path: Path) -> list[dict[str, str]]:
    with path.open() as f:
        return list(csv.DictReader(f))


def test_the_three_systems_replay_a_real_workflow(tmp_path: Path) -> None:
    results, report = run_comparison(
        ["streambox", "stream-only", "infless"],
        out=tmp_path,
        workflow="image-processing",
        minutes=30,
        minute_seconds=0.05,
        max_requests=3,
        sample_interval_s=0.1,
        system_options={"keep_alive_s": "60"},  # nothing expires within the run (the trace's 0.5 s would)
        progress=False,
    )
    samples = {}
    for result in results:
        summary = result.summary
        assert summary["requests"]["by_status"] == {"ok": 3}, summary
        config = json.loads((result.run_dir / "config.json").read_text())
        assert config["system_config"]["target"] == result.config.system
        samples[result.config.system] = [
            {k: float(v or 0) for k, v in row.items()} for row in _rows(result.run_dir / "samples.csv")
        ]
    for system in ("streambox", "stream-only"):
        # One proxy, one context; the workflow's weights resident beside it.
        assert {s["runtimes"] for s in samples[system]} == {1.0}
        # (Peaks, not per sample: the weights are the proxy's last report, the device is read now.)
        peak = {k: max(s.get(k, 0.0) for s in samples[system]) for k in samples[system][0]}
        assert peak["memory.weights_bytes"] > 0
        assert peak["memory_used_bytes"] >= peak["memory.context_bytes"] + peak["memory.weights_bytes"]
    # INFless: a runtime (context) per function instance, two functions here, each an MPS client
    # (pre-warmed: up before the first request); each sample's device memory holds at least the
    # contexts of the runtimes it counted.
    mono = samples["infless"]
    assert min(s["runtimes"] for s in mono) >= 2
    assert all(s["mps_clients"] == s["instances"] == s["runtimes"] for s in mono)
    assert all(s["memory_used_bytes"] >= s["memory.context_bytes"] for s in mono)
    assert max(s.get("memory.weights_bytes", 0) for s in mono) > 0
    assert report["ratios"] and any((tmp_path / "report").glob("*.png"))


@pytest.mark.parametrize("system", ["streambox", "stream-only"])
def test_the_proxy_systems_admit_by_memory_unless_a_count_cap_is_set(system: str) -> None:
    from streambox.config import Config
    from streambox.replay.systems import _proxy_invoker

    options, _, _ = WorkflowOptions.split(system, {}, 1.0)
    assert _proxy_invoker(system)(Config(), options, {}).warm.max_per_device is None
    capped = _proxy_invoker(system)(Config(), options, {"max_proxies_per_device": "3"})
    assert capped.warm.max_per_device == 3
    request = SystemRequest(system, ("traffic",), options={"max_proxies_per_device": "3"})
    assert resolve_system(system, request).describe()["settings"]["max_proxies_per_device"] == 3
    with pytest.raises(ValueError, match="max_proxies_per_device '0' must be >= 1"):
        resolve_system(system, SystemRequest(system, ("traffic",), options={"max_proxies_per_device": "0"}))
