"""The gateway's safe defaults over real HTTP: deep JSON gets a clear 400 (not a 500), a bearer token
guards every route but /healthz, binding beyond loopback needs an explicit opt-in, and invocations past
the admission limits (in flight, body bytes in flight) get a 503 with Retry-After."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time

import aiohttp
import pytest

from streambox.cli import _gateway_options, build_parser
from streambox.workflows.commands import invoke_async, serve_async
from streambox.workflows.engine import Engine
from streambox.workflows.gateway import MAX_JSON_DEPTH, Gateway, GatewayServer, is_loopback, json_depth
from streambox.workflows.validation import parse_spec

from .conftest import HERE

ECHO = "name: echo\nslo_ms: 1000\nfunctions:\n  echo: {handler: fault_handlers:echo}\n"
NAP = "name: nap\nslo_ms: 5000\nfunctions:\n  nap: {handler: fault_handlers:nap, max_instances: 4}\n"
TOKEN = "s3cret-token-of-32-characters!!!"


def _serve(local_invoker, scenario, spec=ECHO, idle_timeout_s=75.0, **gateway_options):
    async def go():
        engine = Engine(local_invoker)
        await engine.deploy(parse_spec(spec, "spec.yaml", HERE))
        try:
            server = GatewayServer(Gateway(engine, **gateway_options), idle_timeout_s=idle_timeout_s)
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


def test_serve_refuses_a_remote_host_before_it_deploys_anything(capsys, tmp_path, monkeypatch):
    """The refusal used to come after the workflows' checks and deploys (about 15 s)."""
    from streambox.cli import main

    monkeypatch.setenv("STREAMBOX_STATE_DIR", str(tmp_path / "state"))
    started = time.monotonic()
    assert main(["serve", "traffic", "--host", "0.0.0.0"]) == 2
    assert "exposes it beyond this machine" in capsys.readouterr().err
    assert time.monotonic() - started < 5 and not (tmp_path / "state").exists()


def test_invoke_names_an_image_file_that_is_no_image(capsys, tmp_path):
    from streambox.cli import main

    bad = tmp_path / "bad.json"
    bad.write_text("{}")
    assert main(["invoke", "traffic", "--sample", "--image", str(bad)]) == 2
    assert f"--image {bad}: not an image" in capsys.readouterr().err
    assert main(["invoke", "traffic", "--sample", "--image", str(tmp_path / "missing.png")]) == 2
    assert f"--image {tmp_path / 'missing.png'}: No such file or directory" in capsys.readouterr().err


def test_json_depth():
    assert json_depth(1) == 0
    assert json_depth({}) == 1
    assert json_depth({"a": [1, {"b": []}]}) == 4


def test_invocations_past_the_admission_limits_get_503_and_the_gateway_goes_on(local_invoker):
    """Two invocations sleeping in flight fill `max_in_flight=2`: a third is refused at once, with
    Retry-After and the limit named, and counted; once they end the next is admitted. A body that
    would pass the body bytes in flight is refused while another holds bytes, admitted alone."""

    async def scenario(session, url):
        invoke = f"{url}/workflows/nap/invoke"

        async def post(event, **kw):
            async with session.post(invoke, json=event, **kw) as r:
                return r.status, dict(r.headers), await r.json()

        nappers = [asyncio.create_task(post({"seconds": 1.0, "value": i})) for i in range(2)]
        await asyncio.sleep(0.3)  # both admitted and asleep
        refused = await post({"value": "third"})
        slept = await asyncio.gather(*nappers)
        after = await post({"value": "after"})
        big = {"value": "x" * 980}  # 993 bytes: alone within 1,000, not beside another body
        napper = asyncio.create_task(post({"seconds": 1.0, "value": "small"}))
        await asyncio.sleep(0.3)
        big_refused = await post(big)
        async with session.post(invoke) as r:  # no body: reserves nothing, so not refused for bytes
            bodiless = r.status
        await napper
        big_alone = await post(big)
        async with session.get(f"{url}/metrics") as r:
            metrics = await r.text()
        return refused, slept, after, big_refused, bodiless, big_alone, metrics

    refused, slept, after, big_refused, bodiless, big_alone, metrics = _serve(
        local_invoker, scenario, spec=NAP, max_in_flight=2, max_body_bytes_in_flight=1000
    )
    status, headers, body = refused
    assert status == 503 and headers["Retry-After"] == "1"
    assert body["error"] == "the gateway is at its limit of 2 invocations in flight; retry in 1 s"
    assert [(s, b["output"]) for s, _, b in slept] == [(200, {"echo": 0}), (200, {"echo": 1})]
    assert after[0] == 200 and after[2]["output"] == {"echo": "after"}
    assert big_refused[0] == 503
    assert "would pass its limit of 1,000; retry in 1 s" in big_refused[2]["error"]
    assert bodiless == 400  # not an event; it used to count as a 64 MiB body and get 503
    assert big_alone[0] == 200
    assert 'streambox_requests_refused_total{workflow="nap"} 2.0' in metrics


@pytest.mark.parametrize("option", ["max_in_flight", "max_body_bytes_in_flight", "max_body_bytes"])
@pytest.mark.parametrize("value", [0, -1, 1.5, True])
def test_admission_limits_must_be_positive_integers(option, value):
    with pytest.raises(ValueError, match=f"gateway {option} must be a positive integer, got {value!r}"):
        Gateway(None, **{option: value})  # type: ignore[arg-type]


def test_serve_sets_the_gateway_limits_from_its_flags(local_invoker):
    """`streambox serve --max-in-flight 1 --max-in-flight-mib 1`: the server it runs has those limits."""
    flags = ["--max-in-flight", "1", "--max-in-flight-mib", "1"]
    options = _gateway_options(build_parser().parse_args(["serve", "nap.yaml", *flags]))
    assert options == {"max_in_flight": 1, "max_body_bytes_in_flight": 1 << 20}
    assert _gateway_options(build_parser().parse_args(["serve", "nap.yaml"])) == {}  # Gateway's defaults

    async def go():
        stop, ready = threading.Event(), asyncio.Event()
        urls = []

        def on_ready(url):
            urls.append(url)
            ready.set()

        server = asyncio.create_task(
            serve_async(
                [parse_spec(NAP, "nap.yaml", HERE)],
                port=0,
                invoker_factory=lambda config, system: local_invoker,
                on_ready=on_ready,
                stop=stop,
                gateway_options=options,
            )
        )
        await asyncio.wait_for(ready.wait(), 60)
        invoke = f"{urls[0]}/workflows/nap/invoke"
        async with aiohttp.ClientSession() as session:

            async def post(event):
                async with session.post(invoke, json=event) as r:
                    return r.status

            napper = asyncio.create_task(post({"seconds": 1.0}))
            await asyncio.sleep(0.3)
            second = await post({"value": 2})
            first = await napper
        stop.set()
        await asyncio.wait_for(server, 30)
        return first, second

    assert asyncio.run(go()) == (200, 503)


async def _raw(url: str, head: bytes, body: bytes = b"") -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    """A connection to the gateway that sent `head` (request line and headers) and `body` so far."""
    host, port = url.removeprefix("http://").rsplit(":", 1)
    reader, writer = await asyncio.open_connection(host, int(port))
    writer.write(head + b"\r\n" + body)
    await writer.drain()
    return reader, writer


def test_a_stalled_body_gets_408_and_its_admission_back(local_invoker):
    """A client that stops sending its body held its admission for ever (a few of them refused every
    other caller): it is answered 408 once `body_timeout_s` has passed, and the slot is free again."""

    async def scenario(session, url):
        head = b"POST /workflows/echo/invoke HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n"
        reader, writer = await _raw(url, head, b"{")
        await asyncio.sleep(0.1)
        async with session.post(f"{url}/workflows/echo/invoke", json={"value": 1}) as r:
            meanwhile = r.status  # the stalled one holds the only slot
        answer = await asyncio.wait_for(reader.read(4096), timeout=10)
        writer.close()
        async with session.post(f"{url}/workflows/echo/invoke", json={"value": 2}) as r:
            after = r.status, await r.json()
        return meanwhile, answer, after

    meanwhile, answer, (status, body) = _serve(local_invoker, scenario, max_in_flight=1, body_timeout_s=0.5)
    assert meanwhile == 503
    assert answer.startswith(b"HTTP/1.1 408") and b"the body did not arrive within 0.5 s" in answer
    assert status == 200 and body["output"] == {"echo": 2}


def test_bodies_past_the_bound_corrupt_or_compressed_get_their_own_json_errors(local_invoker):
    """Each its status and a JSON error (a corrupt gzip body was a 500, a body past the bound was read
    whole, then answered in plain text); a compressed body reserves the whole bound, as what it holds
    is known only once read (a gzip body of 60 KB held 60 MiB, counted as 60 KB)."""
    import gzip

    async def scenario(session, url):
        invoke = f"{url}/workflows/nap/invoke"
        out = {}
        head = b"POST /workflows/nap/invoke HTTP/1.1\r\nHost: x\r\nContent-Length: 2000\r\n"
        reader, writer = await _raw(url, head)  # answered before a byte of the body is sent
        out["declared"] = (await asyncio.wait_for(reader.read(4096), timeout=10)).split(b"\r\n")
        writer.close()
        corrupt = {"Content-Encoding": "gzip", "Content-Type": "application/json"}
        async with session.post(invoke, data=b"{}", headers=corrupt) as r:
            out["corrupt"] = r.status, await r.json()
        napper = asyncio.create_task(session.post(invoke, json={"seconds": 1.0}))
        await asyncio.sleep(0.3)
        packed = gzip.compress(b'{"value": 3}')
        head = b"POST /workflows/nap/invoke HTTP/1.1\r\nHost: x\r\nContent-Encoding: gzip\r\n"
        reader, writer = await _raw(url, head + b"Content-Length: %d\r\n" % len(packed), packed)
        out["compressed beside another"] = (await asyncio.wait_for(reader.read(4096), 10)).split(b"\r\n")[0]
        writer.close()
        (await napper).close()
        async with session.post(invoke, data=gzip.compress(b'{"value": 3}'), headers=corrupt) as r:
            out["compressed alone"] = r.status, (await r.json())["output"]
        return out

    out = _serve(local_invoker, scenario, spec=NAP, max_body_bytes=1000, max_body_bytes_in_flight=1000)
    assert out["declared"][0] == b"HTTP/1.1 413 Request Entity Too Large"
    assert out["declared"][-1] == b'{"error": "the body declares 2,000 bytes, more than 1,000"}'
    status, body = out["corrupt"]
    assert status == 400 and body["error"].startswith("the body could not be read")
    assert out["compressed beside another"] == b"HTTP/1.1 503 Service Unavailable"
    assert out["compressed alone"] == (200, {"echo": 3})


def test_a_client_that_goes_away_frees_its_admission_at_once(local_invoker):
    """Its request is cancelled (as a timeout ends one): a client could send and drop requests to hold
    the gateway's admission for the whole run of each."""

    async def scenario(session, url):
        body = b'{"seconds": 3.0, "value": 0}'
        head = b"POST /workflows/nap/invoke HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        _, writer = await _raw(url, head + b"Content-Length: %d\r\n" % len(body), body)
        await asyncio.sleep(0.5)  # admitted and asleep
        writer.close()
        await asyncio.sleep(0.3)
        started = time.monotonic()
        async with session.post(f"{url}/workflows/nap/invoke", json={"value": 1}) as r:
            status = r.status
        async with session.get(f"{url}/metrics") as r:
            metrics = await r.text()
        return status, time.monotonic() - started, metrics

    status, took, metrics = _serve(local_invoker, scenario, spec=NAP, max_in_flight=1)
    assert status == 200 and took < 2.0
    assert 'streambox_requests_in_flight{workflow="nap"} 0.0' in metrics


def test_a_token_header_twice_or_in_odd_bytes_is_a_401(local_invoker):
    async def scenario(session, url):
        out = []
        for auth in (
            f"Authorization: Bearer {TOKEN}\r\nAuthorization: Bearer {TOKEN}x\r\n".encode(),
            f"Authorization: Bearer nope\r\nAuthorization: Bearer {TOKEN}\r\n".encode(),
            b"Authorization: Bearer \xff\xfe\r\n",  # was a 500
        ):
            reader, writer = await _raw(url, b"GET /metrics HTTP/1.1\r\nHost: x\r\n" + auth)
            out.append((await reader.read(4096)).split(b"\r\n", 1)[0])
            writer.close()
        return out

    assert _serve(local_invoker, scenario, token=TOKEN) == [b"HTTP/1.1 401 Unauthorized"] * 3


def test_a_connection_without_a_whole_request_is_closed(local_invoker):
    """Silent, or its headers never ended: it was kept for an hour (aiohttp's keep-alive default), so
    idle sockets could pile up to the descriptor limit."""

    async def scenario(session, url):
        closed_after = []
        for sent in (b"", b"GET /healthz HTTP/1.1\r\nHost: x\r\n"):
            host, port = url.removeprefix("http://").rsplit(":", 1)
            reader, writer = await asyncio.open_connection(host, int(port))
            writer.write(sent)
            started = time.monotonic()
            assert await asyncio.wait_for(reader.read(4096), timeout=10) == b""  # closed, unanswered
            closed_after.append(time.monotonic() - started)
            writer.close()
        async with session.post(f"{url}/workflows/echo/invoke", json={"value": 1}) as r:
            return closed_after, r.status

    closed_after, status = _serve(local_invoker, scenario, idle_timeout_s=0.5)
    assert all(0.3 < s < 5 for s in closed_after), closed_after
    assert status == 200


def test_stopping_the_server_waits_a_bounded_grace_for_requests_in_flight(local_invoker):
    """A request that hangs held `serve`'s stop for aiohttp's 60 s and up to 60 s more; now the
    requests in flight get `shutdown_timeout_s`, then are cancelled (their invocations stopped)."""

    async def go():
        engine = Engine(local_invoker)
        await engine.deploy(parse_spec(NAP, "spec.yaml", HERE))
        try:
            server = GatewayServer(Gateway(engine), shutdown_timeout_s=1.0)
            await server.start()
            async with aiohttp.ClientSession() as session:
                hung = asyncio.ensure_future(
                    session.post(f"{server.url}/workflows/nap/invoke", json={"seconds": 8})
                )
                await asyncio.sleep(0.5)  # it runs
                started = time.perf_counter()
                await server.stop()
                stopped = time.perf_counter() - started
                with contextlib.suppress(aiohttp.ClientError):
                    (await hung).close()
            return stopped
        finally:
            await engine.close()

    assert asyncio.run(go()) < 5.0


def test_a_port_in_use_is_refused_before_the_deploy(local_invoker):
    """A second `serve` on a busy port deployed (started its proxies) for 16 s, then failed to bind."""
    import socket

    made = []
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(OSError, match=f"cannot listen on 127.0.0.1:{port}: Address already in use"):
            asyncio.run(
                serve_async(
                    [parse_spec(NAP, "nap.yaml", HERE)],
                    port=port,
                    invoker_factory=lambda config, system: made.append(1) or local_invoker,
                )
            )
    assert made == []  # nothing deployed


def test_the_port_probe_binds_as_asyncio_does():
    """The probe of `--host ::` was dual-stack where asyncio's bind is IPv6 only: an IPv4 listener on
    the port refused a bind that would have worked."""
    import socket

    from streambox.workflows.gateway import check_port_free

    with socket.socket() as taken:
        taken.bind(("0.0.0.0", 0))
        taken.listen()
        port = taken.getsockname()[1]
        check_port_free("::", port)  # no IPv6 here: skipped; else IPv6 only, beside the IPv4 listener
        with pytest.raises(OSError, match=f"cannot listen on 127.0.0.1:{port}"):
            check_port_free("127.0.0.1", port)
    check_port_free("127.0.0.1", 0)
