"""The settings tree: environment, precedence (flag > environment > a command's default > the tree's),
one-line errors that name field, value and what is allowed, and agreement with the library's names."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from streambox.config import (
    BACKENDS,
    CHANNELS,
    POOL_MODES,
    RECYCLERS,
    Config,
    Mechanisms,
    Settings,
    SettingsError,
)
from streambox.flags import DEVICE, add_setting_flags, config_from


@pytest.fixture(autouse=True)
def _clean_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in (
        "BACKEND",
        "DEVICE_PRESET",
        "GPUS",
        "DEVICE_MODE",
        "INPUTS",
        "MODEL_SHAPES",
        "PA",
        "CHANNEL",
    ):
        monkeypatch.delenv(f"STREAMBOX_{name}", raising=False)


def test_the_environment_sets_every_field_with_one_name(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("STREAMBOX_GPUS", "4")
    monkeypatch.setenv("STREAMBOX_DEVICE_PRESET", "H100-80GB")
    monkeypatch.setenv("STREAMBOX_DEVICE_MODE", "timed")
    monkeypatch.setenv("STREAMBOX_MODEL_POOL", str(tmp_path))
    monkeypatch.setenv("STREAMBOX_PA", "off")
    monkeypatch.setenv("STREAMBOX_MODEL_SHAPES", "full")  # the former name of STREAMBOX_INPUTS
    config = Config.from_env()
    assert (config.gpus, config.device_preset, config.device_mode) == (4, "h100-80gb", "timed")
    assert config.model_pool == tmp_path
    settings = Settings.from_env()
    assert (settings.pa, settings.am, settings.inputs, settings.gpus) == (False, None, "full", 4)
    # A switch in the environment reaches every record built from the tree, the proxy's included.
    from streambox.api_proxy.proxy_config import ProxyConfig

    proxy = ProxyConfig(workflow="wf", functions=())
    assert (proxy.pa, proxy.model_shapes, proxy.settings()["store_label"]) == (False, "full", "AM")
    assert ProxyConfig(workflow="wf", functions=(), pa="on").pa is True  # what is given wins


def test_a_flag_beats_the_environment_which_beats_a_commands_default(monkeypatch: pytest.MonkeyPatch) -> None:
    parser = argparse.ArgumentParser()
    add_setting_flags(parser, DEVICE)
    assert Config.from_env().device_mode == "functional"  # the library's default
    assert config_from(parser.parse_args([]), device_mode="timed").device_mode == "timed"  # replay, burst
    monkeypatch.setenv("STREAMBOX_DEVICE_MODE", "functional")
    assert config_from(parser.parse_args([]), device_mode="timed").device_mode == "functional"
    args = parser.parse_args(["--device-mode", "timed", "--gpus", "2"])
    assert config_from(args).device_mode == "timed" and config_from(args).gpus == 2


def test_errors_name_the_field_the_value_and_what_is_allowed(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(
        SettingsError, match=r"Config: device_preset 'a100' is not one of h100-80gb, v100-16gb"
    ):
        Config(device_preset="a100")
    with pytest.raises(SettingsError, match=r"Config: backend 'rocm' is not one of emulated, cuda"):
        Config().with_overrides(backend="rocm")
    monkeypatch.setenv("STREAMBOX_GPUS", "many")
    with pytest.raises(SettingsError, match=r"environment \(STREAMBOX_\*\): gpus 'many' is not an integer"):
        Config.from_env()
    with pytest.raises(SettingsError, match=r"bt: switches of the IO daemon, which is off here"):
        Mechanisms(io_daemon="off", bt="on")


def test_the_trees_names_are_the_librarys() -> None:
    """The tree spells choices without importing torch or zmq; these are the modules' own lists."""
    from streambox.api_proxy.channel import CHANNELS as channel_names
    from streambox.api_proxy.executor import RECYCLERS as executor_recyclers
    from streambox.device import BACKENDS as device_backends
    from streambox.memory_pool.modes import PoolMode

    assert tuple(device_backends) == BACKENDS
    assert set(CHANNELS) == set(channel_names)
    assert set(RECYCLERS) == set(executor_recyclers)
    assert tuple(m.value for m in PoolMode) == POOL_MODES


def test_each_paper_ablation_maps_to_its_mechanism() -> None:
    """FM, RS (pool_mode), RZ, PB, BT (the daemon), PA, AM (the store): off turns exactly it off."""
    from streambox.comm.config import StoreConfig
    from streambox.io_daemon.config import DaemonConfig

    everything = Mechanisms()
    assert everything.resolved_pool_mode.value == "fm+rs"
    assert everything.daemon_config() == DaemonConfig() and everything.store_config() == StoreConfig()
    assert Mechanisms(pool_mode="fm").resolved_pool_mode.resilient_scaling is False  # RS off
    assert Mechanisms(pool_mode="static").resolved_pool_mode.lazy is False  # FM off
    for switch, daemon in (
        ("rz", DaemonConfig.ablation(rz=False)),
        ("pb", DaemonConfig.ablation(pb=False)),
        ("bt", DaemonConfig.ablation(bt=False)),
    ):
        assert Mechanisms(**{switch: "off"}).daemon_config() == daemon
    assert Mechanisms(pa="off").store_config() == StoreConfig(pressure_aware=False)
    assert Mechanisms(am="off").store_config() == StoreConfig(adaptive_movement=False)


def test_library_knobs_come_in_groups_checked_against_the_librarys_dataclasses(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """`STREAMBOX_<GROUP>__<FIELD>` (the nested delimiter): pool, store and memory knobs reach the
    `PoolConfig`, `StoreConfig` and `MemoryOptions` the proxy builds, typed and checked."""
    from streambox.api_proxy.proxy_config import ProxyConfig

    monkeypatch.setenv("STREAMBOX_POOL__CHUNK_BYTES", "4194304")
    monkeypatch.setenv("STREAMBOX_STORE__CAPACITY_FRACTION", "0.25")
    monkeypatch.setenv("STREAMBOX_MEMORY__HEADROOM_BYTES", "1048576")
    assert Settings.from_env().tuning() == {
        "pool": {"chunk_bytes": 4 << 20},
        "store": {"capacity_fraction": 0.25},
        "memory": {"headroom_bytes": 1 << 20},
    }
    proxy = ProxyConfig(workflow="wf", functions=(), pool_mode="fm", pa="off", weights_keep_alive_s=3)
    options = proxy.memory_options()
    assert (options.pool.chunk_bytes, options.headroom_bytes) == (4 << 20, 1 << 20)
    assert (options.mode.value, options.keep_alive_s, options.recycler) == ("fm", 3.0, "kernel")
    store = proxy.store_config()
    assert (store.capacity_fraction, store.pressure_aware, store.adaptive_movement) == (0.25, False, True)
    assert ProxyConfig.from_json(proxy.to_json()) == proxy  # the groups cross to the proxy process
    assert proxy.settings()["pool"] == {"chunk_bytes": 4 << 20}


def test_a_nested_knob_is_recorded_in_plain_types() -> None:
    """The store's `quota` is a dataclass: recorded as it was, it stopped the proxy at its first `stats`
    reply (msgpack cannot carry it) and a replay's config.json (JSON neither)."""
    import json

    from streambox.api_proxy.proxy_config import ProxyConfig

    quota_group = {"quota": {"max_bytes": 1024, "writer_share": 0.25}}
    proxy = ProxyConfig(workflow="wf", functions=(), store=quota_group)
    quota = proxy.tuning()["store"]["quota"]
    assert (quota["max_bytes"], quota["writer_share"], quota["max_keys"]) == (1024, 0.25, 65_536)
    json.dumps(proxy.settings())
    assert proxy.store_config().quota.writer_share == 0.25


def test_a_nested_knob_is_set_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    """`STREAMBOX_STORE__QUOTA__WRITER_SHARE` split one level only: `quota__writer_share` was refused
    as no setting of StoreConfig, so the environment could not set a quota bound."""
    from streambox.api_proxy.proxy_config import ProxyConfig

    monkeypatch.setenv("STREAMBOX_STORE__QUOTA__WRITER_SHARE", "1.0")
    monkeypatch.setenv("STREAMBOX_STORE__QUOTA__MAX_BYTES", "8589934592")
    quota = ProxyConfig(workflow="wf", functions=()).store_config().quota
    assert (quota.writer_share, quota.max_bytes, quota.max_keys) == (1.0, 8 << 30, 65_536)
    monkeypatch.setenv("STREAMBOX_STORE__QUOTA", "1")
    with pytest.raises(SettingsError, match="STREAMBOX_STORE__QUOTA.*store.quota is set as a whole and by"):
        ProxyConfig(workflow="wf", functions=())


@pytest.mark.parametrize(
    ("groups", "message"),
    [
        ({"pool": {"chunk_bytes": "big"}}, "pool: chunk_bytes 'big' is not an integer"),
        ({"pool": {"chunk_bytes": 3}}, "pool: need nbytes >= 0 and chunk_bytes a multiple of 256"),
        ({"store": {"pressure_aware": False}}, "store.pressure_aware: set by pa"),
        ({"store": {"window": 1}}, "store.window is not a setting of StoreConfig; known: capacity_fraction"),
        ({"memory": {"mode": "fm"}}, "memory.mode: set by pool_mode"),
        ({"pool": {"series_limit": -5}}, "pool: .*PoolConfig: series_limit -5 must be >= 1"),
        ({"pool": {"oom_wait_s": "nan"}}, "oom_wait_s nan must be finite and >= 0"),
        ({"memory": {"t_interval_s": 0}}, "MemoryOptions: t_interval_s 0.0 must be finite and > 0"),
        ({"memory": {"headroom_bytes": -1}}, "headroom_bytes -1 must be >= 0"),
    ],
)
def test_group_mistakes_name_the_group_and_field(groups: dict, message: str) -> None:
    from streambox.api_proxy.proxy_config import ProxyConfig

    with pytest.raises(SettingsError, match=message):
        ProxyConfig(workflow="wf", functions=(), **groups)


def test_a_streambox_variable_nothing_reads_is_named_with_the_nearest_one() -> None:
    """`STREAMBOX_POOLMODE=static` ran the default pool without a word."""
    from streambox.config import unknown_environment

    environ = {
        "STREAMBOX_POOLMODE": "static",
        "STREAMBOX_POOL_MODE": "fm",
        "STREAMBOX_POOL__CHUNK_BYTES": "1",
        "streambox_state_dir": "/tmp",
        "STREAMBOX_NVCC": "nvcc",
        "STREAMBOX_PREWARM": "0",
        "HOME": "/",
    }
    assert unknown_environment(environ) == [
        "STREAMBOX_POOLMODE is not a setting StreamBox reads and changes nothing; did you mean "
        "STREAMBOX_POOL_MODE?",
        "STREAMBOX_PREWARM is not a setting StreamBox reads and changes nothing",
    ]


def test_the_environment_a_measurement_records_is_what_changes_what_runs() -> None:
    from streambox.config import settings_environment

    environ = {"streambox_io_daemon": "off", "STREAMBOX_POOL__CHUNK_BYTES": "1"}
    environ |= {"STREAMBOX_STATE_DIR": "/tmp", "STREAMBOX_MODEL_POOL": "/p", "HOME": "/"}
    environ |= {"STREAMBOX_POOLMODE": "static", "STREAMBOX_SLOW_TESTS": "1"}  # read by nothing; a test's
    assert settings_environment(environ) == {"STREAMBOX_IO_DAEMON": "off", "STREAMBOX_POOL__CHUNK_BYTES": "1"}


def test_streambox_system_is_the_commands_default_system(monkeypatch) -> None:
    """`STREAMBOX_SYSTEM=stream-only streambox burst traffic` ran StreamBox: checked, then ignored."""
    from streambox.cli import build_parser
    from streambox.config import system_default

    assert system_default({}) == "streambox"
    assert system_default({"streambox_system": " Stream-Only "}) == "stream-only"
    monkeypatch.setenv("STREAMBOX_SYSTEM", "stream-only")
    for command in (["burst", "traffic"], ["serve", "traffic"], ["replay"]):
        assert build_parser(command[:1]).parse_args(command).system == "stream-only"
    given = build_parser(["burst"]).parse_args(["burst", "traffic", "--system", "streambox"])
    assert given.system == "streambox"
