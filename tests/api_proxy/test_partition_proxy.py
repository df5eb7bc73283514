"""A proxy in timed mode deploys with its models' profiles and runs a `gpu_percent` function under its
cap: the `stats` reply says which cap, whether the device enforces it, and that no run was unprofiled."""

from __future__ import annotations

import textwrap

from streambox.api_proxy.control import launch_proxy
from streambox.api_proxy.proxy_config import ProxyConfig, ProxyFunction

HANDLERS = textwrap.dedent(
    """
    import torch
    import streambox

    @streambox.function(models=["resnet18"])
    def classify(ctx, event):
        (logits,) = ctx.infer("resnet18", ctx.upload(torch.zeros(1, 3, 32, 32)))
        return list(ctx.download(logits).shape)
    """
)


def test_a_gpu_percent_function_runs_profiled_under_its_cap(tmp_path):
    (tmp_path / "partition_handlers.py").write_text(HANDLERS)
    config = ProxyConfig(
        workflow="partition",
        functions=(
            ProxyFunction("half", "partition_handlers:classify", models=("resnet18",), gpu_percent=50),
            ProxyFunction("whole", "partition_handlers:classify", models=("resnet18",)),
        ),
        sys_path=(str(tmp_path),),
        state_dir=str(tmp_path / "state"),
        device_mode="timed",
        device_preset="v100-16gb",
        pool_mode="fm+rs",
        prefork=0,
    )
    proxy = launch_proxy(config)
    try:
        for name in ("half", "whole", "half"):
            assert proxy.client.invoke(name, {})["output"] == [1, 1000]
        stats = proxy.client.stats()
    finally:
        proxy.stop()
    half = {"gpu_percent": 50, "cu_cap": 40}  # of a V100's 80 SMs
    assert stats["partitioning"] == {"mode": "enforced", "functions": {"half": half}}
    profiles = stats["profiles"]
    assert profiles["profiled"] == ["resnet18@1"] and profiles["unprofiled"] == {}, profiles
    assert (profiles["profiled_runs"], profiles["unprofiled_runs"]) == (3, 0)
