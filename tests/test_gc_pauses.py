"""Garbage-collector pauses (`streambox.gc_pauses`): the counter sees every collection, and a frozen
heap leaves a full collection only what the process made after the freeze."""

from __future__ import annotations

import gc
import os
import subprocess
import sys
import textwrap

import pytest

from streambox.api_proxy.control import ProxyStartError, launch_proxy
from streambox.api_proxy.proxy_config import ProxyConfig, ProxyFunction
from streambox.gc_pauses import GcPauses, freezing, frozen_heap


def test_the_counter_sees_each_collection_and_its_pause():
    pauses = GcPauses()
    pauses.install()
    pauses.install()  # idempotent: one hook
    try:
        gc.collect()
        gc.collect(0)
    finally:
        pauses.uninstall()
    assert pauses.collections[2] == 1 and pauses.collections[0] >= 1
    counters = pauses.counters()
    assert counters["gc_full_collections"] == 1 and counters["gc_collections"] >= 2
    assert counters["gc_pause_s"] >= counters["gc_full_pause_s"] > 0
    assert counters["gc_max_pause_s"] >= counters["gc_full_pause_s"]  # the one full collection's pause
    gc.collect()  # uninstalled: not counted
    assert pauses.collections[2] == 1


def test_a_frozen_startup_heap_leaves_collections_only_what_came_after():
    """In a process that imported torch and the proxy (as a proxy has), the objects a full collection
    walks drop from hundreds of thousands to what the process made since the freeze."""
    script = textwrap.dedent(
        """
        import gc
        import streambox.api_proxy.proxy, torch
        from streambox.gc_pauses import freeze_startup_heap
        before = len(gc.get_objects())
        frozen = freeze_startup_heap()
        made_after = [[i] for i in range(1000)]
        print(before, frozen, len(gc.get_objects()))
        """
    )
    argv = [sys.executable, "-c", script]
    out = subprocess.run(argv, capture_output=True, text=True, timeout=120, check=True)
    before, frozen, after = map(int, out.stdout.split())
    assert before > 100_000 and frozen >= before * 0.9
    assert 1000 <= after < 10_000


def test_a_frozen_heap_is_unfrozen_after_its_block():
    with frozen_heap() as pauses:
        assert gc.get_freeze_count() > 0
        gc.collect()
        counters = pauses.counters()
        assert counters["gc_full_collections"] == 1
        # counted once, at the freeze (frozen objects that die later leave the list)
        assert counters["gc_frozen_objects"] == pytest.approx(gc.get_freeze_count(), abs=100)
    assert gc.get_freeze_count() == 0 and pauses.counters()["gc_frozen_objects"] == 0


def test_the_environment_switches_freezing_off_and_a_bad_value_names_the_variable(monkeypatch):
    monkeypatch.setenv("STREAMBOX_FREEZE_HEAP", "0")
    assert not freezing()
    with frozen_heap():
        assert gc.get_freeze_count() == 0
    monkeypatch.setenv("STREAMBOX_FREEZE_HEAP", "sometimes")
    with pytest.raises(ValueError, match="STREAMBOX_FREEZE_HEAP='sometimes': expected a boolean"):
        freezing()
    monkeypatch.delenv("STREAMBOX_FREEZE_HEAP")
    assert freezing()


def test_a_proxy_refuses_to_start_on_a_bad_switch_and_says_why(tmp_path):
    """The switch is read before the proxy does any work; its error reaches the launcher."""
    (tmp_path / "gc_switch_handlers.py").write_text("def echo(ctx, event):\n    return event\n")
    config = ProxyConfig(
        workflow="gcswitch",
        functions=(ProxyFunction("echo", "gc_switch_handlers:echo"),),
        sys_path=(str(tmp_path),),
        state_dir=str(tmp_path / "state"),
        prefork=0,
    )
    env = {**os.environ, "STREAMBOX_FREEZE_HEAP": "sometimes"}
    with pytest.raises(ProxyStartError, match="STREAMBOX_FREEZE_HEAP='sometimes': expected a boolean"):
        launch_proxy(config, env=env, timeout=120)
