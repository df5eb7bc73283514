"""The gateway over real HTTP on 127.0.0.1 (a free port), with the run-local invoker behind it."""

from __future__ import annotations

import asyncio
import json
import threading
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from multidict import CIMultiDict
from prometheus_client.parser import text_string_to_metric_families

from streambox.workflows.commands import GatewayUnreachable, invoke, load_event, serve
from streambox.workflows.engine import Engine
from streambox.workflows.examples import load_example, sample_event
from streambox.workflows.gateway import Gateway, GatewayServer
from streambox.workflows.invoker import RuntimeStats
from streambox.workflows.local import LocalInvoker
from streambox.workflows.metrics import GatewayMetrics
from streambox.workflows.validation import WorkflowValidationError, parse_spec

HERE = Path(__file__).parent

FAN = """
name: fan
slo_ms: 1000
functions:
  split: {handler: wf_test_handlers:split}
  square: {handler: wf_test_handlers:square, max_instances: 8, params: {bad: 13}}
  total: {handler: wf_test_handlers:total}
edges:
  - {from: split, to: square, select: items, fan_out: true}
  - {from: square, to: total, fan_in: true}
"""
SLOW = """
name: slow
slo_ms: 100
timeout_ms: 5000
functions:
  slow: {handler: wf_test_handlers:sleepy, params: {sleep_s: 0.5}}
"""


async def start(invoker, *specs, stats=None) -> tuple[Engine, GatewayServer]:
    engine = Engine(invoker)
    for spec in specs:
        await engine.deploy(spec)
    server = GatewayServer(Gateway(engine, stats=stats))
    await server.start()
    return engine, server


async def post(session: aiohttp.ClientSession, url: str, body: Any, **kwargs: Any) -> tuple[int, Any, Any]:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    async with session.post(url, data=data, headers={"Content-Type": "application/json"}, **kwargs) as r:
        return r.status, CIMultiDict(r.headers), await r.json()


def metrics_of(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def test_invoke_health_workflows_and_metrics(make_invoker, run):
    invoker: LocalInvoker = make_invoker()
    specs = [parse_spec(FAN, "fan.yaml", HERE), parse_spec(SLOW, "slow.yaml", HERE)]

    async def go():
        engine, server = await start(invoker, *specs, stats=invoker.runtime_stats)
        base = server.url
        assert base.startswith("http://127.0.0.1:") and server.port > 0
        async with aiohttp.ClientSession() as session:
            oks = await asyncio.gather(
                *(post(session, f"{base}/workflows/fan/invoke", {"count": 4}) for _ in range(5))
            )
            failed = await post(session, f"{base}/workflows/fan/invoke", {"count": 14})
            timed_out = await post(session, f"{base}/workflows/slow/invoke?timeout_ms=100", {})
            unknown = await post(session, f"{base}/workflows/nope/invoke", {})
            not_json = await post(session, f"{base}/workflows/fan/invoke", b"{count: 1")
            not_object = await post(session, f"{base}/workflows/fan/invoke", [1, 2])
            bad_timeout = await post(session, f"{base}/workflows/fan/invoke?timeout_ms=-5", {})
            async with session.get(f"{base}/healthz") as r:
                health = (r.status, await r.json())
            async with session.get(f"{base}/workflows") as r:
                listing = await r.json()
            async with session.get(f"{base}/metrics") as r:
                metrics = (r.status, r.headers["Content-Type"], await r.text())
        await server.stop()
        await engine.close()
        return oks, failed, timed_out, unknown, not_json, not_object, bad_timeout, health, listing, metrics

    oks, failed, timed_out, unknown, not_json, not_object, bad_timeout, health, listing, metrics = run(go())

    ids = set()
    for status, headers, body in oks:
        assert status == 200 and body["status"] == "ok"
        assert body["output"] == {"total": 14, "order": [0, 1, 2, 3]}
        assert headers["X-Request-Id"] == body["request_id"]
        ids.add(body["request_id"])
        assert body["workflow"] == "fan" and body["slo_ms"] == 1000 and body["latency_ms"] > 0
        assert body["breakdown"]["square"]["invocations"] == 4
        assert [c["call"] for c in body["calls"]] == [
            "split",
            "square[0]",
            "square[1]",
            "square[2]",
            "square[3]",
            "total",
        ]
    assert len(ids) == 5  # a request id per invocation

    status, _, body = failed
    assert status == 500 and body["status"] == "error" and body["failed_call"] == "square[13]"
    assert body["error"] == "square[13] failed: ValueError: item 13 is bad" and "traceback" in body

    status, _, body = timed_out
    assert status == 504 and body["error"] == "request timed out after 0.100 s; still running: slow"

    assert unknown[0] == 404 and unknown[2] == {
        "error": "unknown workflow 'nope'",
        "workflows": ["fan", "slow"],
    }
    assert not_json[0] == 400 and not_json[2]["error"].startswith("the body is not JSON")
    assert (
        not_object[0] == 400
        and not_object[2]["error"] == "the body must be a JSON object (the event), got list"
    )
    assert (
        bad_timeout[0] == 400 and bad_timeout[2]["error"] == "timeout_ms must be a positive number, got '-5'"
    )
    assert health == (200, {"status": "ok", "workflows": ["fan", "slow"]})
    assert listing["fan"]["edges"][0] == {"from": "split", "to": "square", "select": "items", "fan_out": True}
    assert listing["fan"]["functions"]["square"] == {"models": [], "batch_size": 1, "max_instances": 8}

    status, content_type, text = metrics
    assert status == 200 and content_type.startswith("text/plain; version=")
    m = metrics_of(text)
    assert m[("streambox_requests_total", (("status", "ok"), ("workflow", "fan")))] == 5
    assert m[("streambox_requests_total", (("status", "error"), ("workflow", "fan")))] == 1
    assert m[("streambox_requests_total", (("status", "timeout"), ("workflow", "slow")))] == 1
    assert m[("streambox_request_latency_seconds_count", (("workflow", "fan"),))] == 6
    assert m[("streambox_slo_violations_total", (("workflow", "slow"),))] == 1
    assert (
        m[
            (
                "streambox_function_invocations_total",
                (("function", "square"), ("status", "ok"), ("workflow", "fan")),
            )
        ]
        >= 20
    )
    assert (
        m[
            (
                "streambox_function_invocations_total",
                (("function", "square"), ("status", "error"), ("workflow", "fan")),
            )
        ]
        == 1
    )
    cold = sum(v for (name, labels), v in m.items() if name == "streambox_cold_starts_total")
    assert cold >= 3  # at least one instance each of split, square and total was started
    assert m[("streambox_requests_in_flight", (("workflow", "fan"),))] == 0
    assert m[("streambox_device_memory_total_bytes", (("device", "0"),))] == 16 << 30
    assert m[("streambox_device_memory_used_bytes", (("device", "0"),))] > 0
    assert ("streambox_pool_reserved_bytes", (("device", "0"), ("workflow", "fan"))) in m
    assert m[("streambox_function_instances", (("function", "square"), ("workflow", "fan")))] >= 1
    assert m[("streambox_unprofiled_runs", (("workflow", "fan"),))] == 0
    assert m[("streambox_batches_total", (("workflow", "fan"),))] == 0  # nothing of it batches
    assert m[("streambox_runtime_stats_up", ())] == 1


def test_batching_counters_are_scraped_once_per_workflow():
    """A workflow's batching counters, from its runtime rows (one per device it runs on)."""
    def rows() -> list[RuntimeStats]:
        row = RuntimeStats("traffic", 0, 1, 2, 0, 0, batches=7, batched_calls=19)
        return [row, RuntimeStats("traffic", 1, 1, 2, 0, 0, batches=7, batched_calls=19)]

    m = metrics_of(GatewayMetrics(rows).render()[0].decode())
    assert m[("streambox_batches_total", (("workflow", "traffic"),))] == 7
    assert m[("streambox_batched_calls_total", (("workflow", "traffic"),))] == 19


def test_metrics_survive_a_failing_stats_callback(make_invoker, run):
    def broken() -> list[RuntimeStats]:
        raise RuntimeError("proxy is restarting")

    async def go():
        engine, server = await start(make_invoker(), parse_spec(FAN, "fan.yaml", HERE), stats=broken)
        async with aiohttp.ClientSession() as session, session.get(f"{server.url}/metrics") as r:
            result = (r.status, await r.text())
        await server.stop()
        await engine.close()
        return result

    status, text = run(go())
    assert status == 200 and metrics_of(text)[("streambox_runtime_stats_up", ())] == 0


def test_a_bundled_workflow_over_http(make_invoker, run):
    async def go():
        engine, server = await start(make_invoker(), load_example("image-processing", small=True))
        async with aiohttp.ClientSession() as session:
            first = await post(
                session,
                f"{server.url}/workflows/image-processing/invoke",
                sample_event("image-processing", 0),
            )
            second = await post(
                session,
                f"{server.url}/workflows/image-processing/invoke",
                sample_event("image-processing", 0),
            )
        await server.stop()
        await engine.close()
        return first, second

    (s1, _, first), (s2, _, second) = run(go())
    assert s1 == s2 == 200
    assert first["output"] == second["output"] and first["output"]["enhanced_shape"] == [64, 64, 3]
    assert first["cold_starts"] == 2 and second["cold_starts"] == 0
    assert first["breakdown"]["recognize"]["cold_starts"] == 1


def test_serve_and_invoke_commands(tmp_path, runtime, pool):
    (tmp_path / "served_handlers.py").write_text(
        "def hello(ctx, event):\n    return {'hello': event.get('name')}\n"
    )
    workflow = tmp_path / "hello.yaml"
    workflow.write_text("name: hello\nslo_ms: 50\nfunctions:\n  hi: {handler: served_handlers:hello}\n")
    event_file = tmp_path / "event.json"
    event_file.write_text(json.dumps({"name": "streambox"}))
    ready: list[str] = []
    stop = threading.Event()
    thread = threading.Thread(
        target=serve,
        args=([workflow],),
        kwargs={
            "port": 0,
            "invoker_factory": lambda config, system: LocalInvoker(runtime, pool, system=system),
            "on_ready": ready.append,
            "stop": stop,
        },
    )
    thread.start()
    try:
        for _ in range(1200):  # validation checks the handlers in a child process (imports torch)
            if ready or not thread.is_alive():
                break
            threading.Event().wait(0.05)
        (url,) = ready
        response = invoke("hello", load_event(event_file), url=url, timeout_s=10)
        assert response.ok and response.body["output"] == {"hello": "streambox"}
        missing = invoke("nope", {}, url=url)
        assert missing.http_status == 404 and not missing.ok
    finally:
        stop.set()
        thread.join(10)
    assert not thread.is_alive()
    with pytest.raises(GatewayUnreachable, match=f"cannot reach the gateway at {url}"):
        invoke("hello", {}, url=url, timeout_s=5)


def test_serve_validates_before_starting(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: bad\nslo_ms: 1\nfunctions: {}\n")
    with pytest.raises(WorkflowValidationError) as info:
        serve([bad], port=0)
    assert (
        str(info.value)
        == f"{bad}:3:1: functions: Dictionary should have at least 1 item after validation, not 0 (got {{}})"
    )


def test_load_event_errors(tmp_path):
    path = tmp_path / "e.json"
    path.write_text("[1]")
    with pytest.raises(ValueError, match="e.json must be a JSON object \\(the event\\), got list"):
        load_event(path)
    with pytest.raises(ValueError, match="No such file"):
        load_event(tmp_path / "none.json")
    # What the gateway would refuse is refused here, naming the file (a 5,000-digit integer gave
    # Python's own advice to call sys.set_int_max_str_digits; NaN went through to a 400).
    for text in ('{"n": ' + "9" * 5000 + "}", '{"x": NaN}'):
        path.write_text(text)
        with pytest.raises(ValueError, match="e.json is not JSON"):
            load_event(path)


def test_run_local_and_bundled_names(tmp_path):
    from streambox.config import Config
    from streambox.workflows.commands import load_specs, run_local

    (tmp_path / "local_handlers.py").write_text("def twice(ctx, event):\n    return {'n': 2 * event['n']}\n")
    workflow = tmp_path / "twice.yaml"
    workflow.write_text("name: twice\nslo_ms: 50\nfunctions:\n  t: {handler: local_handlers:twice}\n")
    config = Config(state_dir=tmp_path / "state", model_pool=tmp_path / "pool")
    results = run_local(workflow, [{"n": i} for i in range(4)], config=config, concurrency=2)
    assert [r.output for r in results] == [{"n": 0}, {"n": 2}, {"n": 4}, {"n": 6}]
    assert len({r.request_id for r in results}) == 4
    (traffic,) = load_specs(["traffic"], small=True)
    assert traffic.functions["detect"].params["image_size"] == 64
    assert load_specs(["traffic"])[0].functions["detect"].params["image_size"] == 320
    with pytest.raises(ValueError, match="share the name"):
        load_specs(["traffic", "traffic"])
