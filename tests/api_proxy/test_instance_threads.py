"""Function instances run torch with `instance_threads` intra-op threads (0: torch's default), set once
in the warm template and inherited by every instance forked from it, as are its preloaded modules."""

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


def _run_once(tmp_path, name: str, handlers: str, event: dict, options: dict) -> dict:
    """Deploy a one-function workflow of `handlers` (module `<name>_test_handlers`, function `name`)
    on a proxy with `options`, run it once with `event`, return its output."""
    (tmp_path / f"{name}_test_handlers.py").write_text(handlers)
    spec = parse_spec(
        f'name: {name}\nslo_ms: 1000\nfunctions:\n  {name}: {{handler: "{name}_test_handlers:{name}"}}\n',
        f"{name}.yaml",
        base_dir=tmp_path,
    )
    config = Config.from_env().with_overrides(state_dir=tmp_path / "state")

    async def scenario() -> dict:
        engine = Engine(ProxyInvoker(config, proxy_options={"prefork": 1, **options}))
        try:
            await engine.deploy(spec)
            result = await engine.run(name, event)
            assert result.ok, result.error
            return result.output
        finally:
            await engine.close()

    return asyncio.run(scenario())


@pytest.mark.parametrize("threads", [1, 0])
def test_instances_run_torch_with_the_configured_threads(tmp_path, threads):
    output = _run_once(tmp_path, "threads", HANDLERS, {}, {"instance_threads": threads})
    expected = threads or torch.get_num_threads()  # 0: what torch picks by itself (one per core)
    assert output["threads"] == expected


DECODING_HANDLERS = textwrap.dedent(
    """
    import sys
    import streambox
    from streambox.workflows.image_input import decode_image_field

    @streambox.function
    def decode(ctx, event):
        inherited = "torchvision" in sys.modules
        return {"inherited": inherited, "shape": list(decode_image_field(event["image"]).shape)}
    """
)


def test_instances_inherit_the_image_decoder_from_the_template(tmp_path):
    """The SDK's image decoding imports torchvision (seconds of CPU): the template preloads it, so an
    instance's first image does not pay it (the demo's first requests waited 6 s for it)."""
    import base64
    import io

    from PIL import Image

    png = io.BytesIO()
    Image.new("RGB", (8, 6), (200, 10, 10)).save(png, format="PNG")
    event = {"image": base64.b64encode(png.getvalue()).decode()}
    output = _run_once(tmp_path, "decode", DECODING_HANDLERS, event, {})
    assert output == {"inherited": True, "shape": [3, 6, 8]}
