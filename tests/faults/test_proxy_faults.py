"""Faults and adversaries at the proxy's control socket, with real proxy processes:

- a function of workflow B that finds workflow A's control socket cannot invoke, read from or shut
  down A's proxy (the control key), and A keeps serving;
- clients of a proxy that dies learn it at once: calls in flight fail with `ProxyDied` naming the exit
  code (not after their timeout), are counted, and later calls fail immediately; through the engine,
  the requests of a dead proxy fail at once and the next request starts a new proxy.
"""

from __future__ import annotations

import asyncio
import os
import signal
import textwrap
import time

import pytest

from streambox.api_proxy.control import AsyncProxyClient, ProxyClient, ProxyDied, launch_proxy
from streambox.api_proxy.errors import IsolationError
from streambox.api_proxy.proxy_config import ProxyConfig, ProxyFunction
from streambox.config import Config
from streambox.workflows import Engine, parse_spec
from streambox.workflows.proxy_invoker import ProxyInvoker

HANDLERS = textwrap.dedent(
    """
    import time
    import msgpack, zmq
    import streambox

    @streambox.function
    def echo(ctx, event):
        return {"echo": event.get("value"), "workflow": ctx.workflow}

    @streambox.function
    def sleepy(ctx, event):
        time.sleep(event["s"])
        return "slept"

    @streambox.function
    def intrude(ctx, event):
        # Workflow B's function, given A's control address: try every operation, with no key, a
        # wrong key, and a key-shaped guess.
        sock = zmq.Context.instance().socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(event["address"])
        out = {}
        attempts = [
            ("invoke", [1, "invoke", {"function": "echo", "event": {"value": 1}}]),
            ("stats", [2, "stats", {}]),
            ("end_request", [3, "end_request", {"request_id": "r"}, b"x" * 32]),
            ("shutdown", [4, "shutdown", {}, b"\\0" * 32]),
        ]
        for what, message in attempts:
            sock.send(msgpack.packb(message, use_bin_type=True))
            if sock.poll(5000):
                call_id, ok, value = msgpack.unpackb(sock.recv(), raw=False)
                out[what] = [ok, value]
            else:
                out[what] = "no answer"
        sock.close(0)
        return out
    """
)

FUNCTIONS = (
    ProxyFunction("echo", "fault_ctl_handlers:echo"),
    ProxyFunction("sleepy", "fault_ctl_handlers:sleepy", max_instances=4),
    ProxyFunction("intrude", "fault_ctl_handlers:intrude"),
)


@pytest.fixture(scope="module")
def handlers_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("fault_ctl")
    (root / "fault_ctl_handlers.py").write_text(HANDLERS)
    return root


def _launch(root, name: str):
    return launch_proxy(
        ProxyConfig(
            workflow=name,
            functions=FUNCTIONS,
            sys_path=(str(root),),
            state_dir=str(root / "state"),
            prefork=0,
        )
    )


def test_a_function_of_another_workflow_cannot_use_a_proxys_control_socket(handlers_dir):
    a, b = _launch(handlers_dir, "ctla"), _launch(handlers_dir, "ctlb")
    try:
        before = a.client.stats()
        out = b.client.invoke("intrude", {"address": a.address}, request_id="r1", timeout_s=20.0)["output"]
        for what in ("invoke", "stats", "end_request", "shutdown"):
            ok, value = out[what]
            assert not ok, what
            assert value[0] == "IsolationError" and "does not hold this proxy's key" in value[1], what
        assert a.alive
        after = a.client.stats()
        assert after["invocations"] == before["invocations"]  # nothing of A ran for B
        assert a.client.invoke("echo", {"value": 7}, request_id="r2")["output"] == {
            "echo": 7,
            "workflow": "ctla",
        }
        # This process launched A: its clients find the key by address; a wrong key is refused.
        assert ProxyClient(a.address).call("ping", {}, 5.0)["workflow"] == "ctla"
        with pytest.raises(IsolationError, match="key"):
            ProxyClient(a.address, key=bytes(32)).call("stats", {}, 5.0)
    finally:
        a.stop()
        b.stop()


def test_clients_of_a_dead_proxy_fail_at_once_and_count_what_was_lost(handlers_dir):
    proxy = _launch(handlers_dir, "ctld")
    try:

        async def scenario():
            client = AsyncProxyClient(proxy.address)
            try:
                assert (await client.invoke("echo", {"value": 1}, "r0", 10.0))["output"]["echo"] == 1
                calls = [
                    asyncio.ensure_future(client.invoke("sleepy", {"s": 30}, f"r{i}", timeout_s=60.0))
                    for i in range(3)
                ]
                await asyncio.sleep(1.0)  # the calls are in the proxy
                os.kill(proxy.process.pid, signal.SIGKILL)
                t0 = time.monotonic()
                results = await asyncio.gather(*calls, return_exceptions=True)
                failed_in = time.monotonic() - t0
                t1 = time.monotonic()
                with pytest.raises(ProxyDied, match="was killed by SIGKILL"):
                    await client.end_request("r1")
                return results, failed_in, time.monotonic() - t1, client.lost_calls
            finally:
                client.close()

        results, failed_in, end_in, lost = asyncio.run(scenario())
        assert all(isinstance(r, ProxyDied) for r in results), results
        assert "was killed by SIGKILL" in str(results[0])
        assert failed_in < 1.0  # not the 60 s timeout
        assert end_in < 0.1
        assert lost == 4  # three invocations in flight, one end_request after
        with pytest.raises(ProxyDied):
            proxy.client.stats()
    finally:
        proxy.stop()
    assert not proxy.directory.exists()


def test_the_engine_fails_a_dead_proxys_requests_at_once_and_the_next_request_restarts_it(
    handlers_dir, caplog
):
    spec = parse_spec(
        "name: ctle\nslo_ms: 100\ntimeout_ms: 60000\nfunctions:\n"
        "  sleepy: {handler: fault_ctl_handlers:sleepy, max_instances: 4}\n",
        "ctle.yaml",
        handlers_dir,
    )
    config = Config.from_env().with_overrides(state_dir=handlers_dir / "state")

    async def scenario():
        invoker = ProxyInvoker(config, proxy_options={"prefork": 0})
        engine = Engine(invoker)
        try:
            await engine.deploy(spec)
            pid = invoker._workflows["ctle"].proxy.process.pid
            runs = [asyncio.ensure_future(engine.run("ctle", {"s": 30})) for _ in range(3)]
            await asyncio.sleep(1.5)
            os.kill(pid, signal.SIGKILL)
            t0 = time.monotonic()
            failed = await asyncio.gather(*runs)
            took = time.monotonic() - t0
            # The dead proxy's last report is no gauge any more (its memory stayed on /metrics).
            await invoker.refresh_stats()
            assert list(invoker.runtime_stats()) == []
            again = await engine.run("ctle", {"s": 0})
            return failed, took, again, invoker.proxy_starts
        finally:
            await engine.close()

    failed, took, again, starts = asyncio.run(scenario())
    for result in failed:
        assert result.status == "error" and result.failed_call == "sleepy"
        assert "ProxyDied" in result.error and "was killed by SIGKILL" in result.error
    assert took < 2.0  # not the 60 s timeout, nor a wait for end_request
    assert again.ok and again.output == "slept" and starts == 2
    assert "workflow ctle: the proxy process was killed by SIGKILL; " in caplog.text
