"""Isolation between the requests of one workflow, with a real proxy process: an invocation can name
only the buffers it made or was handed (not another request's, found by scanning addresses), and use
only its own request's keys and workflow-wide ones (not another request's key). The offender's request
fails with `IsolationError`; the victim keeps its data and its result."""

from __future__ import annotations

import concurrent.futures
import textwrap
import time

import pytest

from streambox.api_proxy.control import ProxyClient, launch_proxy
from streambox.api_proxy.proxy_config import ProxyConfig, ProxyFunction

HANDLERS = textwrap.dedent(
    """
    import time
    import torch
    import streambox
    from streambox.api_proxy.handles import Handle

    @streambox.function
    def hold(ctx, event):
        # Uploads 64 secret bytes and PUTs them under this request's key, then keeps the buffer
        # for a while, so that another request may try to reach it.
        h = ctx.upload(torch.arange(16, dtype=torch.float32))
        ctx.put(ctx.key("secret"), h, consumers=1)
        with open(event["path"], "w") as f:  # where the test finds the address a scanner would try
            f.write(str(h.address))
        time.sleep(event["s"])
        return {"address": h.address, "sum": float(ctx.download(h).sum())}

    @streambox.function
    def scan(ctx, event):
        # Another request: forge a handle at the victim's address, and read the victim's key.
        h = Handle(ctx.workflow, event["address"], "float32", (16,), (1,), 64)
        out = {}
        try:
            out["buffer"] = ctx.download(h).tolist()
        except Exception as exc:
            out["buffer"] = f"{type(exc).__name__}: {exc}"
        try:
            out["key"] = ctx.download(ctx.get(event["key"], timeout=1.0)).tolist()
        except Exception as exc:
            out["key"] = f"{type(exc).__name__}: {exc}"
        return out
    """
)


@pytest.fixture(scope="module")
def proxy(tmp_path_factory):
    root = tmp_path_factory.mktemp("isolation")
    (root / "isolation_handlers.py").write_text(HANDLERS)
    functions = (
        ProxyFunction("hold", "isolation_handlers:hold"),
        ProxyFunction("scan", "isolation_handlers:scan"),
    )
    launched = launch_proxy(
        ProxyConfig(
            workflow="iso", functions=functions, sys_path=(str(root),), state_dir=str(root / "state"),
            prefork=0,
        )
    )
    try:
        yield launched
    finally:
        launched.stop()


def test_a_request_reaches_neither_another_requests_buffer_nor_its_key(proxy, tmp_path):
    client = proxy.client
    path = tmp_path / "address"
    victim_client = ProxyClient(proxy.address)  # a client (a zmq socket) per thread
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        victim = pool.submit(victim_client.invoke, "hold", {"s": 3.0, "path": str(path)}, "victim", 30.0)
        deadline = time.monotonic() + 20.0
        while not path.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(0.05)  # written in full
        address = int(path.read_text())
        out = client.invoke(
            "scan", {"address": address, "key": "iso/victim/secret"}, request_id="thief", timeout_s=20.0
        )["output"]
        result = victim.result()["output"]
    victim_client.close()
    assert out["buffer"].startswith("IsolationError") and "neither made nor was handed" in out["buffer"], out
    assert out["key"].startswith("IsolationError") and "scoped to request 'victim'" in out["key"], out
    assert result["sum"] == float(sum(range(16)))  # the victim kept its data
    client.end_request("victim")
    client.end_request("thief")
    assert client.stats()["buffers"] == 0
