"""Offenders fail alone, end to end through one real proxy: crashing, hanging, raising, flooding and
malformed-frame requests beside well-behaved ones of the same function. Every well-behaved request
keeps its result, every faulty one fails with its own error, no proxy dies, and once the requests
have ended the proxy holds no buffer, no key and no pool byte more than before."""

from __future__ import annotations

import asyncio
import textwrap
import time

from streambox.api_proxy.control import AsyncProxyClient, launch_proxy
from streambox.api_proxy.proxy_config import ProxyConfig, ProxyFunction

HANDLERS = textwrap.dedent(
    """
    import os, time
    import torch

    def act(ctx, event):
        do = event["do"]
        if do == "ok":
            data = torch.arange(4096, dtype=torch.float32) + event["n"]
            ctx.put(ctx.key("x"), ctx.upload(data), consumers=1)
            return float(ctx.download(ctx.get(ctx.key("x"))).sum())
        ctx.alloc(1 << 20)
        if do == "crash":
            os._exit(3)
        if do == "hang":
            time.sleep(3600)
        if do == "raise":
            raise ValueError("bad request")
        if do == "flood":
            for i in range(16):
                ctx.put(ctx.key(f"f{i}"), ctx.alloc(1 << 20))
            return "flooded"
        if do == "frame":
            ctx._client.channel.send(b"\\xc1")  # not msgpack: the proxy must end only this instance
            time.sleep(5)
    """
)
KINDS = ["ok", "crash", "ok", "hang", "ok", "raise", "ok", "flood", "ok", "frame", "ok", "ok"] * 3


def test_offenders_fail_alone_and_leave_nothing_behind(tmp_path):
    (tmp_path / "mixed_fault_handlers.py").write_text(HANDLERS)
    config = ProxyConfig(
        workflow="mixedf",
        functions=(ProxyFunction("act", "mixed_fault_handlers:act", max_instances=6, timeout_ms=1000.0),),
        sys_path=(str(tmp_path),),
        state_dir=str(tmp_path / "state"),
    )
    proxy = launch_proxy(config)
    try:

        async def scenario():
            client = AsyncProxyClient(proxy.address)
            try:
                await client.invoke("act", {"do": "ok", "n": -1}, "warm", 10.0)
                await client.end_request("warm")
                before = await client.stats()

                async def one(i: int, kind: str):
                    request = f"r{i}"
                    try:
                        out = await client.invoke("act", {"do": kind, "n": i}, request, 10.0)
                        result = ("ok", out["output"])
                    except Exception as exc:  # noqa: BLE001 - the outcome under test
                        result = (type(exc).__name__, str(exc))
                    await client.end_request(request)
                    return kind, i, result

                results = await asyncio.gather(*(one(i, k) for i, k in enumerate(KINDS)))
                deadline = time.monotonic() + 10
                while True:
                    after = await client.stats()
                    settled = after["buffers"] == 0 and after["keys"] == 0
                    if settled and after["pool"]["allocated_bytes"] <= before["pool"]["allocated_bytes"]:
                        break
                    if time.monotonic() > deadline:
                        break
                    await asyncio.sleep(0.1)
                return before, after, results, client.lost_calls
            finally:
                client.close()

        before, after, results, lost = asyncio.run(scenario())
        expected = {
            "crash": "FunctionCrashed",
            "hang": "FunctionTimeout",
            "raise": "FunctionFailed",
            "frame": "FunctionCrashed",
        }
        for kind, i, (status, value) in results:
            if kind == "ok":
                assert status == "ok" and value == sum(range(4096)) + 4096 * i, (i, status, value)
            elif kind == "flood":
                assert (status, value) == ("ok", "flooded")
            else:
                assert status == expected[kind], (kind, status, value)
        assert any("malformed message" in v for k, _, (s, v) in results if k == "frame")
        assert proxy.alive and lost == 0
        assert after["buffers"] == 0 and after["keys"] == 0
        # Not above the level before the load (that level may still hold the warm-up's stream-ordered
        # free, so "equal" would be too strict).
        assert after["pool"]["allocated_bytes"] <= before["pool"]["allocated_bytes"]
        assert after["instances_died"] >= 9  # 3 crashes, 3 hangs killed, 3 malformed senders ended
    finally:
        proxy.stop()
