"""Deploy-time start-up of a real proxy: `prewarm` instances per function are forked from the template
and registered before `launch_proxy` returns, so the first request finds a warm instance; a handler
module's `warm_up()` runs once in the template, and the instances inherit what it built."""

from __future__ import annotations

import os
import sys
import textwrap

import pytest

from streambox.api_proxy.control import launch_proxy
from streambox.api_proxy.proxy_config import ProxyConfig, ProxyFunction
from streambox.api_proxy.template import WarmUpFailed, resolve_handler, warm_up_modules

HANDLERS = textwrap.dedent(
    """
    import os
    import streambox

    WARMED_BY = None

    def warm_up():
        global WARMED_BY
        assert WARMED_BY is None, "warm_up ran twice"
        WARMED_BY = os.getpid()

    @streambox.function
    def noop(ctx, event):
        return {"pid": os.getpid(), "warmed_by": WARMED_BY}
    """
)


@pytest.mark.parametrize("prefork", [0, 2])
def test_prewarmed_instances_are_idle_at_deploy_and_serve_the_first_requests_warm(tmp_path, prefork):
    (tmp_path / "prewarm_handlers.py").write_text(HANDLERS)
    config = ProxyConfig(
        workflow="wfp",
        functions=(
            ProxyFunction("noop", "prewarm_handlers:noop", max_instances=2),
            ProxyFunction("other", "prewarm_handlers:noop", max_instances=3),
        ),
        sys_path=(str(tmp_path),),
        state_dir=str(tmp_path / "state"),
        prewarm=2,
        prefork=prefork,
    )
    proxy = launch_proxy(config)
    try:
        stats = proxy.client.stats()
        assert stats["functions"]["noop"] == {"instances": 2, "idle": 2, "busy": 0, "queued": 0}
        assert stats["functions"]["other"]["idle"] == 2
        assert stats["instances_started"] == 4 and stats["cold_starts"] == 0
        first = proxy.client.invoke("noop", {}, request_id="r1")
        assert first["cold_start"] is False and first["start_s"] == 0
        pid, warmed_by = first["output"]["pid"], first["output"]["warmed_by"]
        assert pid != os.getpid() and warmed_by not in (None, pid)  # in the template, before the fork
        assert proxy.client.stats()["cold_starts"] == 0
    finally:
        proxy.stop()


def test_warm_up_runs_each_modules_hook_once_and_skips_modules_without(tmp_path, monkeypatch):
    hooked_source = "CALLS = []\ndef warm_up():\n    CALLS.append(1)\ndef noop(ctx, event):\n    pass\n"
    (tmp_path / "hooked_mod.py").write_text(hooked_source)
    (tmp_path / "plain_mod.py").write_text("def handler(ctx, event):\n    return None\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    hooked = [resolve_handler("hooked_mod:noop"), resolve_handler("hooked_mod:warm_up")]
    assert warm_up_modules([*hooked, resolve_handler("plain_mod:handler")]) == 1
    assert sys.modules["hooked_mod"].CALLS == [1]


def test_no_prewarm_by_default_the_first_request_forks():
    assert ProxyConfig(workflow="w", functions=()).prewarm == 0


def test_a_failing_warm_up_names_its_module_and_file(tmp_path, monkeypatch):
    (tmp_path / "failing_mod.py").write_text("def warm_up():\n    raise RuntimeError('no tables')\n"
                                             "def handler(ctx, event):\n    return None\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    match = r"warm_up\(\) of module 'failing_mod' \(.*failing_mod.py\)"
    with pytest.raises(WarmUpFailed, match=match) as failed:
        warm_up_modules([resolve_handler("failing_mod:handler")])
    assert str(failed.value.__cause__) == "no tables"
