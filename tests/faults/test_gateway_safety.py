"""The gateway's safe defaults over real HTTP: deep JSON gets a clear 400 (not a 500), a bearer token
guards every route but /healthz, and binding beyond loopback needs an explicit opt-in."""

from __future__ import annotations

import asyncio
import logging

import aiohttp
import pytest

from streambox.workflows.commands import invoke_async
from streambox.workflows.engine import Engine
from streambox.workflows.gateway import MAX_JSON_DEPTH, Gateway, GatewayServer, is_loopback, json_depth
from streambox.workflows.validation import parse_spec

from .conftest import HERE

ECHO = "name: echo\nslo_ms: 1000\nfunctions:\n  echo: {handler: fault_handlers:echo}\n"
TOKEN = "s3cret-token-of-32-characters!!!"


def _serve(local_invoker, scenario, **gateway_options):
    async def go():
        engine = Engine(local_invoker)
        await engine.deploy(parse_spec(ECHO, "echo.yaml", HERE))
        try:
            server = GatewayServer(Gateway(engine, **gateway_options))
            async with server, aiohttp.ClientSession() as session:
                return await scenario(session, server.url)
        finally:
            await engine.close()

    return asyncio.run(go())


def test_deep_json_is_a_clear_400_and_the_gateway_keeps_serving(local_invoker):
    async def scenario(session, url):
        out = []
        for depth in (MAX_JSON_DEPTH + 1, 100_000):
            body = '{"value": ' + "[" * depth + "]" * depth + "}"
            async with session.post(f"{url}/workflows/echo/invoke", data=body) as r:
                out.append((r.status, await r.json()))
        async with session.post(f"{url}/workflows/echo/invoke", json={"value": [[1]]}) as r:
            out.append((r.status, await r.json()))
        return out

    (s1, b1), (s2, b2), (s3, b3) = _serve(local_invoker, scenario)
    for status, body in ((s1, b1), (s2, b2)):
        assert status == 400
        assert body["error"] == f"the body nests objects or lists more than {MAX_JSON_DEPTH} levels deep"
    assert s3 == 200 and b3["output"] == {"echo": [[1]]}


def test_a_token_guards_every_route_but_healthz(local_invoker):
    async def scenario(session, url):
        out = {}
        for name, headers in (
            ("none", {}),
            ("wrong", {"Authorization": "Bearer nope"}),
            ("right", {"Authorization": f"Bearer {TOKEN}"}),
        ):
            async with session.post(f"{url}/workflows/echo/invoke", json={"value": 1}, headers=headers) as r:
                out[name] = r.status
            async with session.get(f"{url}/metrics", headers=headers) as r:
                out[f"{name}-metrics"] = r.status
        async with session.get(f"{url}/healthz") as r:
            out["healthz"] = r.status
        out["cli"] = (await invoke_async("echo", {"value": 2}, url=url, token=TOKEN)).http_status
        out["cli-no-token"] = (await invoke_async("echo", {"value": 2}, url=url)).http_status
        return out

    out = _serve(local_invoker, scenario, token=TOKEN)
    assert out == {
        "none": 401,
        "none-metrics": 401,
        "wrong": 401,
        "wrong-metrics": 401,
        "right": 200,
        "right-metrics": 200,
        "healthz": 200,
        "cli": 200,
        "cli-no-token": 401,
    }
    with pytest.raises(ValueError, match="at least 16 characters"):
        Gateway(None, token="short")  # type: ignore[arg-type]


def test_binding_beyond_loopback_needs_an_opt_in_and_warns(caplog):
    gateway = Gateway(None)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="exposes it beyond this machine; pass allow_remote"):
        GatewayServer(gateway, "0.0.0.0")
    with caplog.at_level(logging.WARNING, logger="streambox.workflows.gateway"):
        GatewayServer(gateway, "0.0.0.0", allow_remote=True)
    assert "WITHOUT authentication" in caplog.text
    for host in ("127.0.0.1", "::1", "localhost", "127.0.0.2"):
        assert is_loopback(host)
    for host in ("0.0.0.0", "::", "10.0.0.1", "example.com"):
        assert not is_loopback(host)


def test_json_depth():
    assert json_depth(1) == 0
    assert json_depth({}) == 1
    assert json_depth({"a": [1, {"b": []}]}) == 4
