"""A wide fan-out hurts only its own request: a list over the edge's `max_items` fails that call at
once with an error naming the edge and the limit, items start lazily (a bounded number of tasks at a
time), and another workflow's request meanwhile answers as fast as alone."""

from __future__ import annotations

import asyncio
import time

from streambox.workflows.engine import LAUNCH_WINDOW, Engine
from streambox.workflows.validation import parse_spec

from .conftest import HERE

FAN = """
name: fan
slo_ms: 1000
timeout_ms: 60000  # the test is about how many tasks run at once, not how fast: a slow host took 3 s
functions:
  wide: {handler: fault_handlers:wide}
  item: {handler: fault_handlers:item, max_instances: 4}
  gather: {handler: fault_handlers:gather}
edges:
  - {from: wide, to: item, select: items, fan_out: true, max_items: 500}
  - {from: item, to: gather, fan_in: true}
"""
ECHO = """
name: other
slo_ms: 1000
functions:
  echo: {handler: fault_handlers:echo}
"""


def test_a_fan_out_over_its_limit_fails_alone_and_fast(local_invoker):
    async def scenario():
        engine = Engine(local_invoker)
        await engine.deploy(parse_spec(FAN, "fan.yaml", HERE))
        await engine.deploy(parse_spec(ECHO, "other.yaml", HERE))
        try:
            alone = await engine.run("other", {"value": 0})
            t0 = time.perf_counter()
            wide, echo = await asyncio.gather(
                engine.run("fan", {"n": 300_000}), engine.run("other", {"value": 1})
            )
            return alone, wide, echo, time.perf_counter() - t0
        finally:
            await engine.close()

    alone, wide, echo, took = asyncio.run(scenario())
    assert wide.status == "error" and wide.failed_call == "wide"
    assert "edge wide -> item fans out 300000 items; the edge allows at most 500" in wide.error
    assert [c.label for c in wide.calls] == ["wide"]  # nothing of the list was launched
    assert echo.ok and echo.output == {"echo": 1} and alone.ok
    assert took < 2.0


def test_fan_out_items_start_lazily_within_a_window(local_invoker):
    n = 400
    window = LAUNCH_WINDOW * 4  # item's max_instances

    async def scenario():
        engine = Engine(local_invoker)
        await engine.deploy(parse_spec(FAN, "fan.yaml", HERE))
        peak = 0
        stop = asyncio.Event()

        async def sample():
            nonlocal peak
            while not stop.is_set():
                peak = max(peak, len(asyncio.all_tasks()))
                await asyncio.sleep(0)

        sampler = asyncio.ensure_future(sample())
        try:
            result = await engine.run("fan", {"n": n})
        finally:
            stop.set()
            await sampler
            await engine.close()
        return result, peak

    result, peak = asyncio.run(scenario())
    assert result.ok, result.error
    assert result.output == sum(2 * i for i in range(n))
    assert len(result.calls) == n + 2
    # The run, the sampler, the wide and gather calls, and at most one window of item calls.
    assert peak <= window + 6, peak
