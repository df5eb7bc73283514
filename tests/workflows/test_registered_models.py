"""Models registered from outside the zoo (a factory and a .pt2 file) served in a workflow on the API
proxy (emulated device, functional mode): the outputs equal eager torch's."""

from __future__ import annotations

import asyncio
import os
import textwrap

import pytest
import torch

from streambox.config import Config
from streambox.kernel_compiler import registry
from streambox.workflows import Engine, parse_spec
from streambox.workflows.proxy_invoker import ProxyInvoker

MODELS = textwrap.dedent(
    """
    import torch
    from torch import nn

    def build():
        torch.manual_seed(11)
        net = nn.Sequential(
            nn.Conv2d(3, 6, 3, padding=1), nn.BatchNorm2d(6), nn.ReLU(),
            nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(6, 4),
        )
        return net, (3, 10, 10)

    def build_other():
        torch.manual_seed(12)
        return nn.Sequential(nn.Flatten(), nn.Linear(300, 3), nn.Tanh()), (3, 10, 10)
    """
)

HANDLERS = textwrap.dedent(
    """
    import torch
    import streambox

    @streambox.function(models=["net", "other@1"])
    def classify(ctx, event):
        x = torch.tensor(event["x"], dtype=torch.float32)
        (a,) = ctx.infer("net", x)
        if event.get("net_only"):
            return {"net": ctx.download(a).tolist()}
        (b,) = ctx.infer("other@1", x)
        return {"net": ctx.download(a).tolist(), "other": ctx.download(b).tolist()}
    """
)

SPEC = textwrap.dedent(
    """
    name: byom
    slo_ms: 5000
    functions:
      classify: {handler: "byom_handlers:classify"}
    """
)


def _modules(tmp_path, monkeypatch, **sources: str):
    """The test's model and handler modules, importable here and in the processes a proxy starts (it
    lowers a registered model's new batch sizes from its factory in a child); returns the model pool."""
    for name, source in sources.items():
        (tmp_path / f"{name}.py").write_text(source)
    monkeypatch.syspath_prepend(str(tmp_path))
    paths = [str(tmp_path), os.environ.get("PYTHONPATH")]
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, paths)))
    monkeypatch.setenv("STREAMBOX_MODEL_POOL", str(tmp_path / "pool"))
    return tmp_path / "pool"


def test_registered_factory_and_pt2_models_run_on_the_proxy_like_eager_torch(tmp_path, monkeypatch):
    pool = _modules(tmp_path, monkeypatch, byom_models=MODELS, byom_handlers=HANDLERS)
    import byom_models

    registry.register(pool, "net", factory="byom_models:build")
    other, _ = byom_models.build_other()
    exported = tmp_path / "other.pt2"
    torch.export.save(torch.export.export(other.eval(), (torch.rand(1, 3, 10, 10),)), exported)
    registry.register(pool, "other", pt2=exported)

    x = torch.rand(1, 3, 10, 10, generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        net, _ = byom_models.build()
        want_net, want_other = net.eval()(x), other(x)

    spec = parse_spec(SPEC, "byom.yaml", base_dir=tmp_path)
    assert spec.functions["classify"].models == ["net", "other@1"]  # from the decorator
    config = Config.from_env().with_overrides(state_dir=tmp_path / "state")
    assert config.model_pool == pool

    x2 = torch.rand(2, 3, 10, 10, generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        want_net2 = net(x2)

    async def scenario() -> tuple[dict, dict]:
        engine = Engine(ProxyInvoker(config, proxy_options={"prefork": 1}))
        try:
            await engine.deploy(spec)
            result = await engine.run("byom", {"x": x.tolist()})
            assert result.ok, result.error
            # A new version of "net" while it is served: the proxy keeps the version it resolved
            # "net" to (a new batch size ran net@2 beside batch 1's net@1).
            registry.register(pool, "net", factory="byom_models:build_other")
            again = await engine.run("byom", {"x": x2.tolist(), "net_only": True})
            assert again.ok, again.error
            return result.output, again.output
        finally:
            await engine.close()

    output, again = asyncio.run(scenario())
    torch.testing.assert_close(torch.tensor(output["net"]), want_net)
    torch.testing.assert_close(torch.tensor(output["other"]), want_other)
    torch.testing.assert_close(torch.tensor(again["net"]), want_net2)


def test_a_workflow_naming_an_unregistered_model_is_refused_with_the_known_ones(tmp_path, monkeypatch):
    monkeypatch.setenv("STREAMBOX_MODEL_POOL", str(tmp_path / "pool"))
    text = SPEC.replace('{handler: "byom_handlers:classify"}', '{handler: "h:f", models: [ghost]}')
    with pytest.raises(ValueError, match=r"unknown model 'ghost'; known models: .*resnet18"):
        parse_spec(text, "byom.yaml", base_dir=tmp_path, check_handlers=False)


FRAGILE = textwrap.dedent(
    """
    import os
    import torch
    from torch import nn

    def build():  # the author's code exits the process it runs in once FLAG exists
        if os.path.exists(os.environ["FRAGILE_FLAG"]):
            os._exit(7)
        torch.manual_seed(1)
        return nn.Sequential(nn.Linear(4, 2)), (4,)
    """
)

FRAGILE_HANDLERS = textwrap.dedent(
    """
    import torch
    import streambox

    @streambox.function(models=["fragile"])
    def run(ctx, event):
        (y,) = ctx.infer("fragile", torch.ones(event["batch"], 4))
        return ctx.download(y).tolist()
    """
)


def test_a_factory_that_exits_fails_its_lowering_only(tmp_path, monkeypatch):
    """A registered model's factory ran in the proxy when a new batch size was lowered: os._exit there
    ended the proxy and every call in flight (`ProxyDied`), again at each new batch."""
    pool = _modules(tmp_path, monkeypatch, fragile_models=FRAGILE, fragile_handlers=FRAGILE_HANDLERS)
    flag = tmp_path / "flag"
    monkeypatch.setenv("FRAGILE_FLAG", str(flag))
    registry.register(pool, "fragile", factory="fragile_models:build")
    text = "name: fragile\nslo_ms: 5000\nfunctions:\n  run: {handler: 'fragile_handlers:run'}\n"
    spec = parse_spec(text, "fragile.yaml", base_dir=tmp_path)
    config = Config.from_env().with_overrides(state_dir=tmp_path / "state")

    async def scenario() -> tuple:
        engine = Engine(ProxyInvoker(config, proxy_options={"prefork": 1}))
        try:
            await engine.deploy(spec)
            flag.touch()
            failed = await engine.run("fragile", {"batch": 3})  # a new batch size: lowered now
            return failed, await engine.run("fragile", {"batch": 1})  # the proxy still serves
        finally:
            await engine.close()

    failed, served = asyncio.run(scenario())
    assert failed.status == "error" and "its process exited with code 7, saying nothing" in failed.error
    assert served.ok, served.error
