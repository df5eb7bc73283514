"""Function instances run torch with `instance_threads` intra-op threads (0: torch's default), set once
in the warm template and inherited by every instance forked from it."""

from __future__ import annotations

import asyncio
import textwrap

import pytest
import torch

from streambox.config import Config
from streambox.workflows import Engine, parse_spec
from streambox.workflows.proxy_invoker import ProxyInvoker

HANDLERS = textwrap.dedent(
    """
    import torch
    import streambox

    @streambox.function
    def threads(ctx, event):
        return {"threads": torch.get_num_threads()}
    """
)


@pytest.mark.parametrize("threads", [1, 0])
def test_instances_run_torch_with_the_configured_threads(tmp_path, threads):
    (tmp_path / "threads_test_handlers.py").write_text(HANDLERS)
    spec = parse_spec(
        'name: threads\nslo_ms: 1000\nfunctions:\n  threads: {handler: "threads_test_handlers:threads"}\n',
        "threads.yaml",
        base_dir=tmp_path,
    )
    config = Config.from_env().with_overrides(state_dir=tmp_path / "state")

    async def scenario() -> int:
        invoker = ProxyInvoker(config, proxy_options={"prefork": 1, "instance_threads": threads})
        engine = Engine(invoker)
        try:
            await engine.deploy(spec)
            result = await engine.run("threads", {})
            assert result.ok, result.error
            return result.output["threads"]
        finally:
            await engine.close()

    expected = threads or torch.get_num_threads()  # 0: what torch picks by itself (one per core)
    assert asyncio.run(scenario()) == expected
