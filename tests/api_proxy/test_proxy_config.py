"""Per-run ablation switches of the API proxy: validation, string options, resolved settings, flags."""

from __future__ import annotations

import argparse

import pytest

from streambox.api_proxy.proxy_config import ProxyConfig, ablation_options, parse_bytes, parse_switch
from streambox.io_daemon import DaemonConfig
from streambox.memory_pool.modes import PoolMode
from streambox.workflows.commands import add_proxy_options, proxy_options_from


def config(**options) -> ProxyConfig:
    return ProxyConfig(workflow="wf", functions=(), **options)


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
    assert settings["recycler"] == "kernel"
    assert settings["weights_keep_alive_s"] == 5.0  # the instances' keep-alive unless given


def test_each_switch_overrides_one_mechanism():
    c = config(
        pool_mode="FM",
        io_block_bytes=16 << 10,
        io_batch_blocks=1,
        io_shared_pinned=False,
        recycler="thread",
        weights_keep_alive_s=0.0,
    )
    assert c.pool_mode == "fm" and c.resolved_pool_mode is PoolMode.FM
    assert c.daemon_config() == DaemonConfig.ablation(rz=False, pb=False, bt=False)
    s = c.settings()
    assert (s["io_block_bytes"], s["io_batch_blocks"], s["io_inflight_batches"]) == (16 << 10, 1, 1)
    assert s["io_label"] == "no optimizations" and s["recycler"] == "thread"
    assert s["weights_keep_alive_s"] == 0.0
    # The ablations cross the systems: stream-only with the daemon, StreamBox without it.
    assert config(system="stream-only", io_daemon=True).daemon_config() == DaemonConfig()
    assert config(io_daemon=False).daemon_config().mode == "stream-only"
    assert config(system="stream-only", pool_mode="fm+rs").settings()["pool_mode"] == "fm+rs"


def test_json_round_trip_keeps_the_switches():
    c = config(pool_mode="static", io_daemon=True, io_batch_blocks=3, recycler="thread")
    assert ProxyConfig.from_json(c.to_json()) == c


@pytest.mark.parametrize(
    ("options", "names"),
    [
        ({"pool_mode": "lazy"}, ["pool_mode", "static, fm, fm+rs"]),
        ({"recycler": "gc"}, ["recycler", "kernel, thread"]),
        ({"io_daemon": "on"}, ["io_daemon", "on or off"]),  # a bool, not a string, in the record
        ({"io_block_bytes": 0}, ["io_block_bytes", "positive integer"]),
        ({"io_batch_blocks": 2.5}, ["io_batch_blocks", "positive integer"]),
        ({"weights_keep_alive_s": -1}, ["weights_keep_alive_s", ">= 0"]),
        ({"io_daemon": False, "io_block_bytes": 4096}, ["io_block_bytes", "io_daemon on"]),
        ({"system": "stream-only", "io_shared_pinned": True}, ["io_shared_pinned", "off here"]),
    ],
)
def test_invalid_switches_name_the_field_and_the_allowed_values(options, names):
    with pytest.raises(ValueError) as error:
        config(**options)
    for name in names:
        assert name in str(error.value)


def test_string_options_are_parsed_and_checked():
    options = ablation_options(
        {
            "Pool-Mode": " fm+rs ",
            "io_daemon": "ON",
            "io-block-bytes": "16KiB",
            "io_batch_blocks": "1",
            "io_shared_pinned": "no",
            "recycler": "thread",
            "weights_keep_alive_s": "2.5s",
        }
    )
    assert options == {
        "pool_mode": "fm+rs",
        "io_daemon": True,
        "io_block_bytes": 16384,
        "io_batch_blocks": 1,
        "io_shared_pinned": False,
        "recycler": "thread",
        "weights_keep_alive_s": 2.5,
    }
    assert config(**options).settings()["io_label"] == "no optimizations"
    assert [parse_bytes(t) for t in ("2097152", "2MiB", "2m", "1.5k")] == [2 << 20, 2 << 20, 2 << 20, 1536]
    assert [parse_switch(t) for t in ("off", "True", "1", "no")] == [False, True, True, False]


def test_string_options_name_the_bad_key_or_value():
    with pytest.raises(ValueError, match=r"unknown proxy option 'fm'; known options: pool_mode, io_daemon"):
        ablation_options({"fm": "off"})
    with pytest.raises(ValueError, match=r"pool_mode 'FM\+' is not one of static, fm, fm\+rs"):
        ablation_options({"pool_mode": "FM+"})
    with pytest.raises(ValueError, match="io_block_bytes '2 parsecs' is not a byte count"):
        ablation_options({"io_block_bytes": "2 parsecs"})
    with pytest.raises(ValueError, match="io_daemon 'maybe' is not on or off"):
        ablation_options({"io_daemon": "maybe"})
    with pytest.raises(ValueError, match="io_batch_blocks 'six' is not an integer"):
        ablation_options({"io_batch_blocks": "six"})


def test_serve_flags_become_proxy_options():
    parser = argparse.ArgumentParser()
    add_proxy_options(parser)
    args = parser.parse_args(["--pool-mode", "static", "--io-daemon", "off", "--recycler", "thread"])
    assert proxy_options_from(args) == {"pool_mode": "static", "io_daemon": False, "recycler": "thread"}
    assert proxy_options_from(parser.parse_args([])) == {}
    with pytest.raises(ValueError, match="io_batch_blocks"):
        proxy_options_from(parser.parse_args(["--io-batch-blocks", "x"]))
