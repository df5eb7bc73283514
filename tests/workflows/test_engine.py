"""The engine: fan-out, fan-in, output assembly, failures, timeouts, concurrency limits and cold
starts, through the run-local invoker (handlers in `wf_test_handlers.py`)."""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any

import pytest

from streambox.workflows.engine import Engine, UnknownWorkflow
from streambox.workflows.handlers import resolve_handler
from streambox.workflows.invoker import InvocationResult
from streambox.workflows.spec import WorkflowSpec
from streambox.workflows.validation import parse_spec

HERE = Path(__file__).parent
# The handlers' module, imported the way workflows import it (this folder on sys.path).
wf_test_handlers = sys.modules[resolve_handler("wf_test_handlers:probe", HERE).__module__]

FAN = """
name: fan
slo_ms: 1000
functions:
  split: {handler: wf_test_handlers:split}
  square: {handler: wf_test_handlers:square, max_instances: 8}
  total: {handler: wf_test_handlers:total}
edges:
  - {from: split, to: square, select: items, fan_out: true}
  - {from: square, to: total, fan_in: true}
"""


def spec_of(text: str) -> WorkflowSpec:
    return parse_spec(text, "test.yaml", HERE)


async def run_once(invoker, spec: WorkflowSpec, *events: dict[str, Any], **options: Any):
    engine = Engine(invoker)
    await engine.deploy(spec)
    try:
        return [await engine.run(spec.name, event, **options) for event in events]
    finally:
        await engine.close()


def test_fan_out_then_fan_in_keeps_the_fan_out_order(make_invoker, run):
    (result,) = run(run_once(make_invoker(), spec_of(FAN), {"count": 5}))
    assert result.ok, result.error
    # squares finish in reverse order; the fan-in still sees them in list order
    assert result.output == {"total": 0 + 1 + 4 + 9 + 16, "order": [0, 1, 2, 3, 4]}
    assert [c.label for c in result.calls] == [
        "split",
        "square[0]",
        "square[1]",
        "square[2]",
        "square[3]",
        "square[4]",
        "total",
    ]
    assert all(c.status == "ok" and c.latency_s is not None for c in result.calls)
    breakdown = result.breakdown()
    assert {f: row["invocations"] for f, row in breakdown.items()} == {"split": 1, "square": 5, "total": 1}
    assert result.cold_starts == 7  # a new instance for each, as they all ran at once


def test_empty_fan_out_still_runs_the_fan_in(make_invoker, run):
    (result,) = run(run_once(make_invoker(), spec_of(FAN), {"count": 0}))
    assert result.ok and result.output == {"total": 0, "order": []}
    assert [c.label for c in result.calls] == ["split", "total"]


def test_several_sinks_give_a_mapping_and_fanned_out_results_are_lists(make_invoker, run):
    text = """
name: sinks
slo_ms: 1000
functions:
  split: {handler: wf_test_handlers:split}
  square: {handler: wf_test_handlers:square}
  tag: {handler: wf_test_handlers:echo, params: {mode: test}}
edges:
  - {from: split, to: square, select: items, fan_out: true}
  - {from: split, to: tag, select: tag}
"""
    (result,) = run(run_once(make_invoker(), spec_of(text), {"count": 3, "tag": "hello"}))
    assert result.ok, result.error
    assert result.output["square"] == [{"n": 0, "sq": 0}, {"n": 1, "sq": 1}, {"n": 2, "sq": 4}]
    # a non-object item arrives wrapped; params come with every event of the function
    assert result.output["tag"] == {
        "event": {"value": "hello", "params": {"mode": "test"}},
        "request_id": result.request_id,
    }


def test_a_callers_params_never_reach_the_handler(make_invoker, run):
    """`params` are the workflow author's settings (image sizes, limits): a caller's event cannot set
    them, whether the YAML gives the function params or none."""
    text = (
        "name: p\nslo_ms: 10\nfunctions:\n  plain: {handler: wf_test_handlers:echo}\n"
        "  tuned: {handler: wf_test_handlers:echo, params: {image_size: 64}}\n"
    )
    sneaky = {"image": "x", "params": {"image_size": 1_000_000}}
    (result,) = run(run_once(make_invoker(), spec_of(text), sneaky))
    assert result.ok, result.error
    assert result.output["plain"]["event"] == {"image": "x", "params": {}}
    assert result.output["tuned"]["event"] == {"image": "x", "params": {"image_size": 64}}


def test_a_failing_function_fails_only_its_request(make_invoker, run):
    spec = spec_of(FAN.replace("square: {", "square: {params: {bad: 2}, "))
    bad, good = run(run_once(make_invoker(), spec, {"count": 4}, {"count": 2}))
    assert bad.status == "error" and bad.output is None
    assert bad.failed_call == "square[2]"
    assert bad.error == "square[2] failed: ValueError: item 2 is bad"
    assert "item 2 is bad" in bad.traceback and "wf_test_handlers.py" in bad.traceback
    statuses = {c.label: c.status for c in bad.calls}
    assert statuses["split"] == "ok" and statuses["square[2]"] == "error" and "total" not in statuses
    body = bad.to_json()
    assert body["status"] == "error" and body["failed_call"] == "square[2]" and not body["slo_met"]
    # the same engine goes on: the next request (items 0 and 1 only) succeeds
    assert good.ok and good.output == {"total": 1, "order": [0, 1]}


def test_edge_mistakes_in_outputs_are_reported(make_invoker, run):
    text = """
name: edges
slo_ms: 1000
functions:
  split: {handler: wf_test_handlers:split}
  echo: {handler: wf_test_handlers:echo}
edges:
  - {from: split, to: echo, select: nope}
"""
    missing, not_a_list = run(run_once(make_invoker(), spec_of(text), {"count": 1}))[0], None
    assert missing.error == (
        "split failed: edge split -> echo: the output has no field 'nope' (it has: ['items', 'tag'])"
    )
    text = text.replace("select: nope", "select: tag, fan_out: true")
    (not_a_list,) = run(run_once(make_invoker(), spec_of(text), {"count": 1, "tag": "x"}))
    assert not_a_list.error == "split failed: edge split -> echo fans out, but got a str, not a list"


def test_outputs_must_be_json(make_invoker, run):
    text = "name: j\nslo_ms: 10\nfunctions:\n  bad: {handler: wf_test_handlers:not_json}\n"
    (result,) = run(run_once(make_invoker(), spec_of(text), {}))
    assert result.error == (
        "bad failed: TypeError: the output of 'bad' is not JSON-able: "
        "Object of type Tensor is not JSON serializable"
    )
    (handle,) = run(run_once(make_invoker(), spec_of(text.replace("not_json", "returns_handle")), {}))
    assert handle.error == (
        "bad failed: TypeError: the output of 'bad' holds a device handle (value['kept'][0]): its memory "
        "is the invocation's; download it, or put it and pass the key"
    )


def test_a_subclass_of_invalid_input_is_reported_as_invalid_input(make_invoker, run):
    text = "name: r\nslo_ms: 10\nfunctions:\n  check: {handler: wf_test_handlers:refuse}\n"
    (result,) = run(run_once(make_invoker(), spec_of(text), {"tag": "z"}))
    assert result.error_type == "InvalidInput"  # the gateway's 400, as for the class itself
    assert result.error == "check failed: InvalidInput: tag 'z' is not one of 'a', 'b'"


def test_a_handler_that_calls_sys_exit_fails_its_request_only(make_invoker, run):
    text = "name: x\nslo_ms: 10\nfunctions:\n  quit: {handler: wf_test_handlers:exits}\n"
    first, second = run(run_once(make_invoker(), spec_of(text), {"code": 2}, {"code": 0}))
    assert first.error == "quit failed: SystemExit: 2" and first.error_type == "SystemExit"
    assert second.status == "error" and second.error_type == "SystemExit"  # the engine served on


SLOW = """
name: slow
slo_ms: 100
timeout_ms: 200
functions:
  slow: {handler: wf_test_handlers:sleepy, params: {sleep_s: 1.0}}
"""


def test_request_timeout(make_invoker, run):
    started = time.perf_counter()
    (result,) = run(run_once(make_invoker(), spec_of(SLOW), {}))
    assert time.perf_counter() - started < 0.9
    assert result.status == "timeout"
    assert result.error == "request timed out after 0.200 s; still running: slow"
    assert [c.status for c in result.calls] == ["timeout"]


def test_function_timeout_and_explicit_request_timeout(make_invoker, run):
    spec = spec_of(
        SLOW.replace("timeout_ms: 200", "timeout_ms: 5000").replace("{handler", "{timeout_ms: 100, handler")
    )
    (result,) = run(run_once(make_invoker(), spec, {}))
    assert result.status == "timeout" and result.failed_call == "slow"
    assert result.error == "slow timed out after 0.100 s"
    (result,) = run(run_once(make_invoker(), spec_of(SLOW.replace("200", "5000")), {}, timeout_s=0.15))
    assert result.status == "timeout"
    assert result.error == "request timed out after 0.150 s; still running: slow"


def test_max_instances_bounds_concurrency(make_invoker, run):
    text = """
name: probe
slo_ms: 1000
functions:
  split: {handler: wf_test_handlers:split}
  probe: {handler: wf_test_handlers:probe, max_instances: 2}
edges:
  - {from: split, to: probe, select: items, fan_out: true}
"""
    wf_test_handlers.peaks.pop("default", None)
    invoker = make_invoker()
    (result,) = run(run_once(invoker, spec_of(text), {"count": 6}))
    assert result.ok and [o["n"] for o in result.output] == [0, 1, 2, 3, 4, 5]
    assert wf_test_handlers.peaks["default"] == 2
    probes = [c for c in result.calls if c.function == "probe"]
    assert sum(c.cold_start for c in probes) == 2  # two instances, reused
    assert sum(c.queued_s > 0.03 for c in probes) >= 3


def test_cold_then_warm_and_keep_alive(make_invoker, run):
    text = "name: w\nslo_ms: 10\nfunctions:\n  e: {handler: wf_test_handlers:echo}\n"
    first, second = run(run_once(make_invoker(), spec_of(text), {}, {}))
    assert (first.cold_starts, second.cold_starts) == (1, 0)
    assert first.request_id != second.request_id
    first, second = run(run_once(make_invoker(keep_alive_s=0.0), spec_of(text), {}, {}))
    assert (first.cold_starts, second.cold_starts) == (1, 1)  # the idle instance was stopped


class BrokenInvoker:
    """An invoker whose transport fails: the engine must turn it into a failed request."""

    def __init__(self) -> None:
        self.ended: list[str] = []

    async def deploy(self, spec: WorkflowSpec) -> None:
        pass

    async def invoke(self, workflow, function, event, request_id, *, timeout_s=None) -> InvocationResult:
        raise ConnectionResetError("proxy went away")

    async def end_request(self, workflow: str, request_id: str) -> None:
        self.ended.append(request_id)

    async def close(self) -> None:
        pass


def test_an_invoker_failure_fails_the_request_and_ends_it(run):
    invoker = BrokenInvoker()
    text = "name: w\nslo_ms: 10\nfunctions:\n  e: {handler: wf_test_handlers:echo}\n"
    (result,) = run(run_once(invoker, spec_of(text), {}))
    assert result.error == "e failed: ConnectionResetError: proxy went away"
    assert invoker.ended == [result.request_id]


def test_unknown_workflow_and_duplicate_deploy(make_invoker, run):
    async def go() -> None:
        engine = Engine(make_invoker())
        await engine.deploy(spec_of(FAN))
        with pytest.raises(ValueError, match="already deployed"):
            await engine.deploy(spec_of(FAN))
        with pytest.raises(UnknownWorkflow) as info:
            await engine.run("nope", {})
        assert str(info.value) == "unknown workflow 'nope'; deployed: fan"
        await engine.close()

    run(go())


def test_fan_outs_in_a_row_stop_at_the_workflows_max_invocations(make_invoker, run):
    """Each fan-out is within its max_items, but two in a row multiply: the request stops at
    max_invocations, every function's invocations together, with the bound named."""
    text = """
name: nested
slo_ms: 1000
max_invocations: 10
functions:
  outer: {handler: wf_test_handlers:split}
  inner: {handler: wf_test_handlers:split, max_instances: 4}
  leaf: {handler: wf_test_handlers:echo, max_instances: 4}
edges:
  - {from: outer, to: inner, select: items, fan_out: true}
  - {from: inner, to: leaf, select: items, fan_out: true}
"""
    small, big = run(run_once(make_invoker(), spec_of(text), {"count": 2}, {"count": 3}))
    assert small.ok and len(small.calls) == 1 + 2 + 4
    assert big.status == "error" and big.error.endswith(
        "failed: its output would start 3 invocations, which would take the request past 10 "
        "(10 so far; the workflow's max_invocations, up to 1000000)"
    )
    assert len(big.calls) <= 10
    # Plain edges count too (no fan-out after the first: 1 + 3 + 3 invocations, past 5) ...
    chain = text.replace("max_invocations: 10", "max_invocations: 5")
    chain = chain.replace("{from: inner, to: leaf, select: items, fan_out: true}", "{from: inner, to: leaf}")
    (stopped,) = run(run_once(make_invoker(), spec_of(chain), {"count": 3}))
    assert stopped.status == "error" and "would take the request past 5" in stopped.error
    # ... and items a fan-in only collects do not: ten items into one fan-in are two invocations.
    fan_in = FAN.replace("name: fan\n", "name: fan\nmax_invocations: 12\n")
    (ok,) = run(run_once(make_invoker(), spec_of(fan_in), {"count": 10}))
    assert ok.ok and len(ok.calls) == 12
    # The fan-in's own invocation counts, from the first item it collects: 1 + 10 + 1 is past 11.
    tighter = spec_of(fan_in.replace("max_invocations: 12", "max_invocations: 11"))
    (over,) = run(run_once(make_invoker(), tighter, {"count": 10}))
    assert over.status == "error" and "would take the request past 11" in over.error


def test_a_request_s_outputs_are_bounded_together(make_invoker, run, monkeypatch):
    """Each output was bounded alone, but the gateway kept them all: a fan-out's items gathered into a
    fan-in's event (or the response) grew with the items, up to max_items x 64 MiB in one process."""
    from streambox.workflows import engine

    monkeypatch.setattr(engine, "MAX_REQUEST_OUTPUT_BYTES", 300)
    small, big = run(run_once(make_invoker(), spec_of(FAN), {"count": 5}, {"count": 60}))
    assert small.ok, small.error
    assert big.status == "error" and "more than 300: put large data in the store (ctx.put)" in big.error
