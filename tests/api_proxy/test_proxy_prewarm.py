"""Deploy-time prewarm of a real proxy: `prewarm` instances per function are forked from the template
and registered before `launch_proxy` returns, so the first request finds a warm instance."""

from __future__ import annotations

import os
import textwrap

import pytest

from streambox.api_proxy.control import launch_proxy
from streambox.api_proxy.proxy_config import FunctionSpec, ProxyConfig

HANDLERS = textwrap.dedent(
    """
    import os
    import streambox

    @streambox.function
    def noop(ctx, event):
        return {"pid": os.getpid()}
    """
)


@pytest.mark.parametrize("prefork", [0, 2])
def test_prewarmed_instances_are_idle_at_deploy_and_serve_the_first_requests_warm(tmp_path, prefork):
    (tmp_path / "prewarm_handlers.py").write_text(HANDLERS)
    config = ProxyConfig(
        workflow="wfp",
        functions=(
            FunctionSpec("noop", "prewarm_handlers:noop", max_instances=2),
            FunctionSpec("other", "prewarm_handlers:noop", max_instances=3),
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
        assert first["output"]["pid"] != os.getpid()
        assert proxy.client.stats()["cold_starts"] == 0
    finally:
        proxy.stop()


def test_no_prewarm_by_default_the_first_request_forks():
    assert ProxyConfig(workflow="w", functions=()).prewarm == 0
