"""The proxy's per-run ablation switches, end to end: two proxies of one workflow, one per setting.

- `static`: pool mode `static`, IO daemon off (FIFO copies);
- `fm+rs`: StreamBox's pool (resilient scaling), the IO daemon on (weights included), model weights
  kept 0 s after their last user (so every request loads them again, through the daemon).
"""

from __future__ import annotations

import concurrent.futures
import textwrap

import pytest
import torch

from streambox.api_proxy.control import launch_proxy
from streambox.api_proxy.proxy_config import ProxyConfig, ProxyFunction, ablation_options
from streambox.kernel_compiler.zoo import get_entry

HANDLERS = textwrap.dedent(
    """
    import torch
    import streambox

    @streambox.function(models=["resnet18"])
    def classify(ctx, event):
        g = torch.Generator().manual_seed(event["seed"])
        x = ctx.upload(torch.randn(1, 3, 32, 32, generator=g))
        (logits,) = ctx.infer("resnet18", x)
        return {"logits": ctx.download(logits).flatten().tolist()}
    """
)

SETTINGS = {
    "static": {"pool_mode": "static", "io_daemon": "off"},
    "fm+rs": {"pool_mode": "fm+rs", "io_daemon": "on", "weights_keep_alive_s": "0"},
}


@pytest.fixture(scope="module")
def proxies(tmp_path_factory):
    root = tmp_path_factory.mktemp("proxy_ablation")
    (root / "ablation_handlers.py").write_text(HANDLERS)
    common = {
        "functions": (ProxyFunction("classify", "ablation_handlers:classify", models=("resnet18",)),),
        "sys_path": (str(root),),
        "state_dir": str(root / "state"),
        "prefork": 0,
    }
    configs = [
        ProxyConfig(workflow=f"abl-{name.replace('+', '')}", **common, **ablation_options(options))
        for name, options in SETTINGS.items()
    ]
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        started = list(pool.map(launch_proxy, configs))
    yield {name: proxy.client for name, proxy in zip(SETTINGS, started, strict=True)}
    for proxy in started:
        proxy.stop()


def _eager_logits(zoo_model, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        return zoo_model("resnet18")(torch.randn(1, 3, 32, 32, generator=g)).flatten()


def test_stats_report_the_resolved_settings(proxies):
    static = proxies["static"].stats()["settings"]
    assert (static["pool_mode"], static["io_daemon"], static["recycler"]) == ("static", False, "kernel")
    assert static["io_block_bytes"] is None and static["io_label"] == "stream-only"
    rs = proxies["fm+rs"].stats()["settings"]
    assert (rs["pool_mode"], rs["io_daemon"], rs["recycler"]) == ("fm+rs", True, "kernel")
    assert (rs["io_block_bytes"], rs["io_batch_blocks"], rs["io_shared_pinned"]) == (2 << 20, 6, True)
    assert rs["weights_keep_alive_s"] == 0.0 and rs["keep_alive_s"] == static["keep_alive_s"]


def test_weights_load_through_the_daemon_and_outputs_stay_exact(proxies, zoo_model, pool, settled):
    rs = proxies["fm+rs"]
    weights = pool.get_or_lower("resnet18", 1, get_entry("resnet18").small_input_shape).weight_bytes
    want = _eager_logits(zoo_model, seed=3)
    outputs = {}
    for name, client in proxies.items():
        outputs[name] = client.invoke("classify", {"seed": 3})["output"]["logits"]
        torch.testing.assert_close(torch.tensor(outputs[name]), want, rtol=1e-4, atol=1e-5)
    # Keep-alive 0: the weights go once idle; the next request loads them again (pipelined) and
    # must still be exact.
    stats = settled(rs, lambda s: s["models_resident_bytes"] == 0, 20.0)
    assert stats["models_resident_bytes"] == 0
    again = rs.invoke("classify", {"seed": 3})["output"]["logits"]
    assert again == outputs["fm+rs"]
    stats = rs.stats()
    assert stats["models"]["loads"] >= 2
    io = stats["io"]
    # Every weight byte of every load went through the daemon's blocks (plus the request inputs).
    inputs = 2 * 3 * 32 * 32 * 4
    assert io["nbytes"] == stats["models"]["loads"] * weights + inputs
    assert io["blocks"] >= stats["models"]["loads"] * (weights // (2 << 20))
    # IO daemon off: straight copies (no blocks), the weights once, then the input.
    static = proxies["static"].stats()
    assert static["io"]["blocks"] == 0 and static["models"]["loads"] == 1
    assert static["io"]["nbytes"] == static["models_resident_bytes"] + inputs // 2


def test_static_pool_keeps_its_memory_while_fm_rs_shrinks(proxies, settled):
    before = {name: client.stats()["pool"]["trims"] for name, client in proxies.items()}
    for client in proxies.values():
        client.invoke("classify", {"seed": 5})
    after = {name: client.stats()["pool"]["reserved_bytes"] for name, client in proxies.items()}
    # (fm+rs may have shrunk already when `after` is read: its trim count is what shows it.)
    rs = settled(
        proxies["fm+rs"],
        lambda s: s["pool"]["trims"] > before["fm+rs"] and s["models_resident_bytes"] == 0,
        20.0,
    )
    assert rs["pool"]["trims"] > before["fm+rs"]  # resilient scaling gave memory back
    # Meanwhile the static pool (no scaler, it never shrinks) still holds what it grew to.
    static = proxies["static"].stats()["pool"]
    assert static["reserved_bytes"] == after["static"] > 0 and static["trims"] == before["static"]
