"""Run-local mode: the ctx of a handler on the real executor and emulated device. Keys hand device
tensors over without a copy, consumed and request-scoped data is freed, nothing leaks."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from streambox.device.specs import V100_16GB
from streambox.workflows.engine import Engine
from streambox.workflows.local import LocalInvoker
from streambox.workflows.validation import parse_spec

HERE = Path(__file__).parent

HANDOVER = """
name: handover
slo_ms: 1000
functions:
  produce: {handler: wf_test_handlers:produce}
  consume: {handler: wf_test_handlers:consume, params: {get_timeout: 0.3}}
edges:
  - {from: produce, to: consume, select: readers, fan_out: true}
"""


async def serve_requests(invoker: LocalInvoker, text: str, events: list[dict[str, Any]], **options: Any):
    spec = parse_spec(text, "test.yaml", HERE)
    engine = Engine(invoker)
    await engine.deploy(spec)
    results, pool_used = [], []
    for event in events:
        results.append(await engine.run(spec.name, event, **options))
        stats = {s.workflow: s for s in invoker.runtime_stats()}[spec.name]
        pool_used.append(stats.pool_used_bytes)
        assert invoker.stored_keys(spec.name) == 0  # the request's keys went with it
    await engine.close()
    return results, pool_used


def test_a_key_hands_the_same_device_tensor_over(make_invoker, run):
    (result,), used = run(serve_requests(make_invoker(), HANDOVER, [{"n": 10, "consumers": 1}]))
    assert result.ok, result.error
    (read,) = result.output
    assert read["sum"] == 45.0 and read["shape"] == [10]
    assert read["address"] == read["producer_address"]  # the consumer reads the producer's bytes
    assert used == [0]  # consumed, then freed at the consumer's end: nothing left in the pool's hands


def test_several_consumers_then_freed(make_invoker, run):
    events = [{"n": 4, "consumers": 3, "readers": 3}, {"n": 4, "consumers": None, "readers": 2}]
    results, used = run(serve_requests(make_invoker(), HANDOVER, events))
    for result in results:
        assert result.ok, result.error
        assert {r["address"] for r in result.output} == {result.output[0]["producer_address"]}
        assert [r["sum"] for r in result.output] == [6.0] * len(result.output)
    assert used == [0, 0]  # counted consumers free it; a kept key goes when its request ends


def test_get_of_a_missing_key_times_out_with_the_key(make_invoker, run):
    text = (
        "name: g\nslo_ms: 10\nfunctions:\n"
        "  c: {handler: wf_test_handlers:consume, params: {get_timeout: 0.2}}\n"
    )
    (result,), _ = run(serve_requests(make_invoker(), text, [{"key": "someone/else"}]))
    assert (
        result.error
        == "c failed: GetTimeout: GET 'someone/else': no data under this key after waiting 0.2 s "
        "(nothing put it)"
    )


def test_infer_runs_the_plan_and_checks_the_declared_models(make_invoker, run, zoo_model):
    text = """
name: infer
slo_ms: 1000
functions:
  classify: {handler: wf_test_handlers:classify, models: [resnet18]}
"""
    results, used = run(serve_requests(make_invoker(), text, [{"seed": 3}, {"seed": 3}, {"seed": 4}]))
    x = torch.rand((1, 3, 32, 32), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        want = int(zoo_model("resnet18")(x).argmax())
    assert results[0].output == {"class": want, "shape": [1, 1000]}
    assert results[1].output == results[0].output
    # weights stay resident; every activation, input and output of a request was freed
    assert used[0] == used[1] == used[2] > 0
    wrong = text.replace("handlers:classify", "handlers:wrong_model")
    (result,), _ = run(serve_requests(make_invoker(), wrong, [{}]))
    assert result.error == (
        "classify failed: ValueError: function 'classify' did not declare model 'vgg16' "
        "(declared: ['resnet18'])"
    )


def test_an_abandoned_invocation_cannot_leave_keys_behind(make_invoker, run):
    text = """
name: late
slo_ms: 10
timeout_ms: 100
functions:
  late: {handler: late_handlers:put_late}
"""
    invoker = make_invoker()

    async def go():
        spec = parse_spec(text, "test.yaml", Path(__file__).parent / "late")
        engine = Engine(invoker)
        await engine.deploy(spec)
        result = await engine.run("late", {})
        await asyncio.sleep(0.5)  # the handler wakes up after its request ended and tries to put
        stats = next(iter(invoker.runtime_stats()))
        keys = invoker.stored_keys("late")
        await engine.close()
        return result, stats, keys

    result, stats, keys = run(go())
    assert result.status == "timeout"
    assert keys == 0 and stats.pool_used_bytes == 0


def test_stats_and_systems(runtime, pool):
    with pytest.raises(ValueError, match="system 'monolithic' is not one of: streambox, stream-only"):
        LocalInvoker(runtime, pool, system="monolithic")
    invoker = LocalInvoker(runtime, pool, system="stream-only")
    assert list(invoker.runtime_stats()) == []


def test_open_uses_the_configuration(tmp_path, run):
    from streambox.config import Config

    config = Config(state_dir=tmp_path / "state", model_pool=tmp_path / "pool")
    invoker = LocalInvoker.open(config)
    assert invoker.runtime.memory_info()[1] == V100_16GB.total_memory
    run(invoker.close())
    assert invoker.runtime.closed  # the invoker owned its runtime


def test_keep_alive_scales_to_zero(make_invoker, run):
    text = "name: k\nslo_ms: 10\nfunctions:\n  e: {handler: wf_test_handlers:echo}\n"
    invoker = make_invoker(keep_alive_s=0.05)

    async def go():
        engine = Engine(invoker)
        await engine.deploy(parse_spec(text, "t.yaml", HERE))
        first = await engine.run("k", {})
        live_after_first = next(iter(invoker.runtime_stats())).instances["e"]
        time.sleep(0.1)
        second = await engine.run("k", {})
        await engine.close()
        return first, live_after_first, second

    first, live, second = run(go())
    assert live == 1 and first.cold_starts == 1 and second.cold_starts == 1


HANDLES = """
name: handles
slo_ms: 1000
functions:
  kinds: {handler: wf_test_handlers:handle_kinds}
"""


def test_run_local_hands_out_the_one_handle_and_checks_it(make_invoker, run):
    (result,), _ = run(serve_requests(make_invoker(), HANDLES, [{}]))
    assert result.ok, result.error
    out = result.output
    assert out["type"] == "Handle" and out["dtype"] == "float32" and out["sum"] == 6.0
    refused = out["refused"]
    assert refused["forged"].startswith("StoreError: download: handle")
    assert refused["strides_past_the_end"].startswith("StoreError: download: handle")
    assert refused["negative_strides"].startswith("StoreError: download: handle")
    assert refused["foreign"].startswith("IsolationError: download: the handle belongs to workflow 'other'")
    assert refused["not_a_handle"].startswith("TypeError: download takes a device-tensor handle")
