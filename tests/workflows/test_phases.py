"""Per-request phase timings (`streambox.phases`): the bookkeeping, and a real workflow on a real proxy
whose requests' phases are measured where they happen and add up to their latency."""

from __future__ import annotations

import asyncio
import textwrap

import pytest

from streambox.config import Config
from streambox.phases import (
    COLD_START,
    COMM,
    COMPUTE,
    DEVICE_WAIT,
    MODEL_LOAD,
    OTHER,
    PHASES,
    QUEUE,
    PhaseClock,
    op_phase,
    request_phases,
    split_call,
)
from streambox.workflows import Engine, parse_spec
from streambox.workflows.proxy_invoker import ProxyInvoker

TOLERANCE_S = 1e-3  # rounding of the wire's floats and clocks read a few statements apart


def test_a_clock_counts_overlapping_intervals_once():
    clock = PhaseClock()
    clock.add(COMPUTE, 0.0, 2.0)
    clock.add(COMM, 1.0, 3.0)  # overlaps the compute interval: only [2, 3] is new
    clock.add(MODEL_LOAD, 3.5, 4.0)
    clock.add(COMM, 3.6, 3.9)  # inside what is counted already: nothing
    assert clock.seconds == {COMPUTE: 2.0, COMM: 1.0, MODEL_LOAD: 0.5}
    assert clock.total() == pytest.approx(3.5)


def test_ops_have_phases_and_unknown_ones_are_other():
    assert (op_phase("infer"), op_phase("get"), op_phase("download"), op_phase("noop")) == (
        COMPUTE,
        COMM,
        COMM,
        OTHER,
    )


def test_a_call_split_adds_up_and_shows_overcounting():
    split = split_call(1.0, {COMPUTE: 0.4, QUEUE: 0.1})
    assert split[OTHER] == pytest.approx(0.5) and sum(split.values()) == pytest.approx(1.0)
    assert list(split) == list(PHASES)
    assert split_call(1.0, {COMPUTE: 1.5})[OTHER] == pytest.approx(-0.5)  # never clamped away
    with pytest.raises(ValueError, match="unknown phase.*'gpu'"):
        split_call(1.0, {"gpu": 0.1})
    with pytest.raises(ValueError, match="unknown phase"):
        split_call(1.0, {OTHER: 0.1})  # `other` is what is left, never given


def test_a_request_adds_the_engine_gaps_to_other():
    path = [split_call(0.3, {COMPUTE: 0.2}), split_call(0.5, {COMM: 0.1, COLD_START: 0.2})]
    phases = request_phases(path, 0.8, 1.0)
    assert phases[COMPUTE] == 0.2 and phases[COMM] == 0.1 and phases[COLD_START] == 0.2
    assert phases[OTHER] == pytest.approx(0.1 + 0.2 + 0.2)
    assert sum(phases.values()) == pytest.approx(1.0)


HANDLERS = textwrap.dedent(
    """
    import torch
    import streambox

    @streambox.function(models=["resnet18"])
    def classify(ctx, event):
        x = torch.rand((1, 3, 32, 32), generator=torch.Generator().manual_seed(event.get("seed", 0)))
        (logits,) = ctx.infer("resnet18", x)
        ctx.put(ctx.key("logits"), logits, consumers=1)
        return {"key": ctx.key("logits")}

    @streambox.function
    def read(ctx, event):
        return {"best": int(ctx.download(ctx.get(event["key"])).argmax())}
    """
)


def _check_adds_up(result) -> None:
    """Every call's phases add up to its wall time with no overcounting (other >= 0), and the
    request's, along its critical path, to its latency."""
    for call in result.calls:
        assert set(call.phases) == set(PHASES)
        assert sum(call.phases.values()) == pytest.approx(call.wall_s, abs=TOLERANCE_S)
        for phase, seconds in call.phases.items():
            assert seconds >= -TOLERANCE_S, (call.label, phase, call.phases)
        assert sum(call.other.values()) == pytest.approx(call.phases[OTHER], abs=TOLERANCE_S)
        assert 0 <= call.detail[DEVICE_WAIT] <= call.phases[COMPUTE] + TOLERANCE_S  # a part of compute
    phases = result.phases()
    assert sum(phases.values()) == pytest.approx(result.latency_s, abs=TOLERANCE_S)
    assert all(seconds >= -TOLERANCE_S for seconds in phases.values()), phases
    assert [c.label for c in result.critical_path()] == ["classify", "read"]
    body = result.to_json()
    assert set(body["phases_ms"]) == set(PHASES) and set(body["other_ms"]) >= {"handler", "control", "engine"}


def test_a_cold_then_a_warm_request_through_a_real_proxy(tmp_path, pool):
    pool.get_or_lower("resnet18", 1, (3, 32, 32))  # the proxy reads it from the session's pool
    (tmp_path / "phase_test_handlers.py").write_text(HANDLERS)
    spec = parse_spec(
        textwrap.dedent(
            """
            name: phases
            slo_ms: 1000
            functions:
              classify: {handler: "phase_test_handlers:classify", models: [resnet18]}
              read: {handler: "phase_test_handlers:read"}
            edges:
              - {from: classify, to: read}
            """
        ),
        "phases.yaml",
        base_dir=tmp_path,
    )
    config = Config.from_env().with_overrides(state_dir=tmp_path / "state", model_pool=pool.root)

    async def scenario() -> tuple:
        invoker = ProxyInvoker(config, proxy_options={"prefork": 0, "model_shapes": "small"})
        engine = Engine(invoker)
        try:
            await engine.deploy(spec)
            cold = await engine.run("phases", {"seed": 1})
            warm = await engine.run("phases", {"seed": 2})
            return cold, warm
        finally:
            await engine.close()

    cold, warm = asyncio.run(scenario())
    assert cold.ok and warm.ok, (cold.error, warm.error)
    _check_adds_up(cold)
    _check_adds_up(warm)
    assert cold.cold_starts == 2 and warm.cold_starts == 0
    assert cold.phases()[COLD_START] > 0 and all(c.phases[COLD_START] > 0 for c in cold.calls)
    assert warm.phases()[COLD_START] == 0
    classify, read = warm.calls
    assert classify.phases[COMPUTE] > 0  # the inference issued and completed
    assert classify.phases[COMM] > 0 and read.phases[COMM] > 0  # the input's upload, put, get, download
    assert classify.phases[MODEL_LOAD] == 0  # the weights stayed resident
