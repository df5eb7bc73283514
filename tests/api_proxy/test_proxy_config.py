"""The proxy's record of the settings tree: validation, string options, resolved settings, flags."""

from __future__ import annotations

import argparse

import pytest

from streambox.api_proxy.function_spec import FunctionSpec
from streambox.api_proxy.proxy_config import ProxyConfig, ProxyFunction, ablation_options
from streambox.comm.config import StoreConfig
from streambox.config import SettingsError
from streambox.flags import MECHANISMS, RUN, add_setting_flags
from streambox.io_daemon import DaemonConfig
from streambox.memory_pool.modes import PoolMode
from streambox.workflows.commands import proxy_options_from


def config(**options) -> ProxyConfig:
    return ProxyConfig(**{"workflow": "wf", "functions": (), **options})


@pytest.mark.parametrize(
    ("system", "mode", "daemon"),
    [
        ("streambox", PoolMode.FM_RS, DaemonConfig()),
        ("stream-only", PoolMode.STATIC, DaemonConfig.stream_only()),
    ],
)
def test_none_means_the_systems_default(system, mode, daemon):
    c = config(system=system, keep_alive_s=5.0)
    assert c.resolved_pool_mode is mode
    assert c.daemon_config() == daemon
    settings = c.settings()
    assert settings["pool_mode"] == mode.value
    assert settings["io_daemon"] is (system == "streambox")
    if system == "streambox":  # StreamBox's managed store, PA and AM on
        assert c.store_config() == StoreConfig()
        assert (settings["comm_store"], settings["pa"], settings["am"]) == ("managed", True, True)
        assert settings["store_label"] == "PA+AM"
    else:  # CUDA-IPC style data passing: no managed store, so no PA or AM
        assert (settings["comm_store"], settings["pa"], settings["am"]) == ("ipc", None, None)
    assert settings["recycler"] == "kernel"
    assert settings["weights_keep_alive_s"] == 5.0  # the instances' keep-alive unless given
    assert settings["device"]["device_mode"] == "functional"  # the library's default


def test_each_switch_overrides_one_mechanism():
    c = config(pool_mode="FM", rz="off", pb=False, bt="no", pa="off", am="on", recycler="thread")
    assert c.pool_mode == "fm" and c.resolved_pool_mode is PoolMode.FM
    assert c.daemon_config() == DaemonConfig.ablation(rz=False, pb=False, bt=False)
    assert c.store_config() == StoreConfig().ablation(pa=False, am=True)
    s = c.settings()
    assert (s["rz"], s["pb"], s["bt"], s["pa"], s["am"]) == (False, False, False, False, True)
    assert (s["io_block_bytes"], s["io_batch_blocks"], s["io_inflight_batches"]) == (16 << 10, 1, 1)
    assert s["io_label"] == "no optimizations" and s["store_label"] == "AM"
    # The ablations cross the systems: stream-only with the daemon, StreamBox without it.
    assert config(system="stream-only", io_daemon=True).daemon_config() == DaemonConfig()
    assert config(io_daemon=False).daemon_config().mode == "stream-only"
    assert config(system="stream-only", pool_mode="fm+rs").settings()["pool_mode"] == "fm+rs"


def test_json_round_trip_keeps_the_switches():
    c = config(pool_mode="fm", io_daemon=True, bt=False, pa=False, recycler="thread", device_mode="timed")
    c = c.with_overrides(functions=(ProxyFunction("f", "m:f", models=("resnet18",)),))
    assert ProxyConfig.from_json(c.to_json()) == c
    assert c.settings()["device"]["device_mode"] == "timed"


@pytest.mark.parametrize(
    ("options", "names"),
    [
        ({"pool_mode": "lazy"}, ["pool_mode 'lazy'", "static, fm, fm+rs"]),
        ({"recycler": "gc"}, ["recycler 'gc'", "kernel, thread"]),
        ({"pa": "maybe"}, ["pa 'maybe'", "on or off"]),
        ({"device_mode": "fast"}, ["device_mode 'fast'", "functional, timed"]),
        ({"weights_keep_alive_s": -1}, ["weights_keep_alive_s -1", ">= 0"]),
        ({"io_daemon": False, "rz": "on"}, ["rz", "io_daemon on"]),
        ({"system": "stream-only", "pb": True}, ["pb", "off here"]),
        ({"system": "stream-only", "recycler": "thread"}, ["recycler 'thread'", "'static' does not"]),
        ({"completion": "spin"}, ["completion 'spin'", "poll, sync"]),
        ({"workflow": "a/b"}, ["workflow 'a/b'", "no '/'"]),
        ({"turbo": True}, ["turbo", "not a known setting"]),
    ],
)
def test_invalid_settings_name_the_field_the_value_and_the_allowed(options, names):
    with pytest.raises(SettingsError) as error:
        ProxyConfig(**{"workflow": "wf", "functions": (), **options})
    for name in names:
        assert name in str(error.value)


def test_the_proxy_function_is_the_workflow_function_with_its_name():
    """One definition of a function's fields: the proxy's record adds the name, nothing else."""
    assert set(ProxyFunction.model_fields) == set(FunctionSpec.model_fields) | {"name"}
    spec = FunctionSpec(handler="m:f", models=["resnet18"], batch_size=2, max_queue_delay_ms=5.0, params={})
    record = ProxyFunction.of("f", spec, default_timeout_ms=2000.0)
    assert record.name == "f" and record.timeout_s == 2.0 and record.max_queue_delay_s == 0.005
    assert record.model_dump(exclude={"name", "timeout_ms"}) == spec.model_dump(exclude={"timeout_ms"})
    own = ProxyFunction.of("g", spec.model_copy(update={"timeout_ms": 500.0}), default_timeout_ms=2000.0)
    assert own.timeout_s == 0.5  # the function's own limit wins over the workflow's


def test_function_specs_are_checked():
    with pytest.raises(SettingsError, match=r"handler 'nocolon' String should match pattern '\^\[A-Za-z_\]"):
        ProxyFunction("f", "nocolon")
    with pytest.raises(SettingsError, match="duplicate function names"):
        config(functions=(ProxyFunction("f", "m:f"), ProxyFunction("f", "m:g")))


def test_string_options_are_parsed_and_checked():
    options = ablation_options(
        {
            "Pool-Mode": " fm+rs ",
            "io_daemon": "ON",
            "RZ": "off",
            "bt": "0",
            "pb": "no",
            "pa": "off",
            "am": "true",
            "recycler": "thread",
            "weights_keep_alive_s": "2.5",
            "completion": "sync",
        }
    )
    assert options == {
        "pool_mode": "fm+rs",
        "io_daemon": True,
        "rz": False,
        "bt": False,
        "pb": False,
        "pa": False,
        "am": True,
        "recycler": "thread",
        "weights_keep_alive_s": 2.5,
        "completion": "sync",
    }
    assert config(**options).settings()["io_label"] == "no optimizations"


def test_string_options_name_the_bad_key_or_value():
    with pytest.raises(SettingsError, match=r"unknown proxy option 'fm'; known: pool_mode, recycler"):
        ablation_options({"fm": "off"})
    with pytest.raises(
        SettingsError, match=r"proxy option: pool_mode 'fm\+' is not one of static, fm, fm\+rs"
    ):
        ablation_options({"pool_mode": "FM+"})
    with pytest.raises(SettingsError, match="io_daemon 'maybe' is not on or off"):
        ablation_options({"io_daemon": "maybe"})


def test_flags_become_proxy_options():
    parser = argparse.ArgumentParser()
    add_setting_flags(parser, RUN, MECHANISMS)
    args = parser.parse_args(
        ["--pool-mode", "static", "--io-daemon", "off", "--pa", "off", "--inputs", "full"]
    )
    assert proxy_options_from(args) == {
        "pool_mode": "static",
        "io_daemon": False,
        "pa": False,
        "model_shapes": "full",
    }
    assert proxy_options_from(parser.parse_args([])) == {}
    with pytest.raises(SettingsError, match="bt 'x' is not on or off"):
        proxy_options_from(parser.parse_args(["--bt", "x"]))
