"""`ProxyInvoker` under the workflow engine: real proxies, the warm-proxy limit, error mapping."""

from __future__ import annotations

import asyncio
import contextlib
import textwrap
from collections.abc import AsyncIterator

import pytest

from streambox.config import Config
from streambox.workflows import Engine, parse_spec
from streambox.workflows.proxy_invoker import ProxyInvoker

HANDLERS = textwrap.dedent(
    """
    import torch
    import streambox

    @streambox.function
    def make(ctx, event):
        h = ctx.upload(torch.arange(6, dtype=torch.float32) * event.get("scale", 1))
        ctx.put(ctx.key("x"), h, consumers=1)
        return {"key": ctx.key("x"), "refuse": event.get("refuse", False)}

    @streambox.function
    def total(ctx, event):
        return {"sum": float(ctx.download(ctx.get(event["key"])).sum())}

    @streambox.function
    def fail(ctx, event):
        if event.get("refuse"):  # a handler's own kind of refusal: the caller's input is wrong
            raise type("BadScale", (streambox.InvalidInput,), {})("scale must be positive")
        raise RuntimeError("no luck")
    """
)


def _spec(name: str, tmp_path, fail: bool = False, models: str = "[]"):
    text = textwrap.dedent(
        f"""
        name: {name}
        slo_ms: 1000
        functions:
          make: {{handler: "invoker_test_handlers:make"}}
          total: {{handler: "invoker_test_handlers:{"fail" if fail else "total"}", models: {models}}}
        edges:
          - {{from: make, to: total}}
        """
    )
    return parse_spec(text, f"{name}.yaml", base_dir=tmp_path)


def test_engine_runs_workflows_through_proxies_with_at_most_one_warm_per_gpu(tmp_path):
    (tmp_path / "invoker_test_handlers.py").write_text(HANDLERS)
    config = Config.from_env().with_overrides(state_dir=tmp_path / "state")

    async def scenario() -> None:
        invoker = ProxyInvoker(config, max_proxies_per_device=1, proxy_options={"prefork": 1})
        engine = Engine(invoker)
        try:
            await engine.deploy(_spec("one", tmp_path))
            await engine.deploy(_spec("two", tmp_path, fail=True))
            first = await engine.run("one", {"scale": 2})
            assert first.ok, first.error
            assert first.output == {"sum": 30.0}
            assert first.cold_starts == 2  # both instances were started for it
            again = await engine.run("one", {"scale": 1})
            assert again.ok and again.output == {"sum": 15.0} and again.cold_starts == 0
            assert invoker.warm.warm() == ["one"]

            failed = await engine.run("two", {})  # the GPU's one slot: `one` is evicted
            assert invoker.warm.warm() == ["two"]
            assert failed.status == "error" and failed.failed_call == "total"
            assert "RuntimeError: no luck" in failed.error and failed.error_type == "RuntimeError"
            refused = await engine.run("two", {"refuse": True})  # a subclass crosses as InvalidInput
            assert refused.error_type == "InvalidInput" and "scale must be positive" in refused.error

            back = await engine.run("one", {"scale": 1})
            assert back.ok and back.cold_starts == 2  # a fresh proxy
            assert invoker.proxy_starts == 3
            await invoker.refresh_stats()
            (stats,) = list(invoker.runtime_stats())
            assert stats.workflow == "one" and stats.memory_total_bytes > 0
        finally:
            await engine.close()

    asyncio.run(scenario())


def test_concurrent_requests_of_more_workflows_than_slots_take_turns_on_the_gpu(tmp_path):
    """Three workflows, one slot: requests to all three at once wait for the slot instead of starting a
    second proxy on the GPU (a proxy counts from its admission, busy while it starts)."""
    (tmp_path / "invoker_test_handlers.py").write_text(HANDLERS)
    config = Config.from_env().with_overrides(state_dir=tmp_path / "state")

    async def scenario() -> None:
        invoker = ProxyInvoker(config, max_proxies_per_device=1, proxy_options={"prefork": 0})
        engine = Engine(invoker)
        try:
            for name in ("a", "b", "c"):
                await engine.deploy(_spec(name, tmp_path))
            results = await asyncio.gather(*(engine.run(name, {"scale": 1}) for name in ("a", "b", "c", "b")))
            assert [r.error for r in results if not r.ok] == []
            assert all(r.output == {"sum": 15.0} for r in results)
            assert len(invoker.warm.warm()) == 1
        finally:
            await engine.close()

    asyncio.run(scenario())


def test_a_pinned_proxy_and_its_instances_outlive_their_keep_alive_until_unpinned(tmp_path):
    """A replay deploys every workflow, then starts its clock: a proxy whose (time-compressed)
    keep-alive would run out during the deploys after its own is pinned meanwhile."""
    (tmp_path / "invoker_test_handlers.py").write_text(HANDLERS)
    config = Config.from_env().with_overrides(state_dir=tmp_path / "state")

    async def scenario() -> None:
        invoker = ProxyInvoker(config, keep_alive_s=0.5, proxy_options={"prefork": 1, "prewarm": 1})
        engine = Engine(invoker)
        try:
            await engine.deploy(_spec("one", tmp_path))
            await invoker.pin_warm("one", True)
            await asyncio.sleep(1.5)  # three keep-alives
            assert invoker.warm.warm() == ["one"]
            await invoker.pin_warm("one", False)
            first = await engine.run("one", {"scale": 2})
            assert first.ok and first.cold_starts == 0  # proxy and prewarmed instances still warm
            for _ in range(200):  # unpinned: the idle proxy goes at its keep-alive
                if not invoker.warm.warm():
                    break
                await asyncio.sleep(0.05)
            assert invoker.warm.warm() == [] and invoker.proxy_starts == 1
        finally:
            await engine.close()

    asyncio.run(scenario())


def test_proxies_are_admitted_by_the_gpus_free_memory_and_the_prediction_matches_the_proxy(tmp_path):
    """Another job leaves room for 1.5 times the second workflow's predicted footprint: the first
    proxy starts at deploy, the second does not, and its first request evicts the first (idle) proxy
    instead of overfilling the GPU. The prediction (context, resnet18's weights, its activation peak)
    is close to what the real proxy then holds."""
    from streambox.device.emulated import EmulatedBackend
    from streambox.device.specs import preset
    from streambox.workflows.proxy_footprint import predicted_footprint, runtime_overhead
    from streambox.workflows.proxy_invoker import proxy_config_for

    (tmp_path / "invoker_test_handlers.py").write_text(HANDLERS)
    config = Config.from_env().with_overrides(state_dir=tmp_path / "state", device_mode="functional")
    two = _spec("two", tmp_path, models="[resnet18]")
    predicted = predicted_footprint(proxy_config_for(two, config, "streambox"), runtime_overhead(config))
    spec = preset(config.device_preset).with_overrides(context_create_s=0.0)
    job = EmulatedBackend(spec, state_dir=tmp_path / "state", mode="timed")
    job_runtime = job.open_runtime(0)
    job_runtime.mem_alloc(spec.total_memory - job_runtime.allocated_bytes() - predicted * 3 // 2)

    async def scenario() -> None:
        invoker = ProxyInvoker(config, proxy_options={"prefork": 0})
        engine = Engine(invoker)
        try:
            await engine.deploy(_spec("one", tmp_path))
            await engine.deploy(two)
            assert invoker.warm.warm() == ["one"]  # no room for two: it waits for its first request
            result = await engine.run("two", {"scale": 1})
            assert result.ok and result.output == {"sum": 15.0}
            assert invoker.warm.warm() == ["two"] and invoker.proxy_starts == 2
            await invoker.refresh_stats()
            held = invoker.last_stats()["two"]["device"]["runtime_bytes"]
            assert predicted * 0.8 <= held <= predicted * 1.2, (predicted, held)
        finally:
            await engine.close()

    try:
        asyncio.run(scenario())
    finally:
        job.close()


@contextlib.asynccontextmanager
async def _one_slot(tmp_path, **options: float) -> AsyncIterator[ProxyInvoker]:
    """A proxy invoker with one GPU slot and workflows `a` (started at its deploy) and `b` deployed."""
    (tmp_path / "invoker_test_handlers.py").write_text(HANDLERS)
    config = Config.from_env().with_overrides(state_dir=tmp_path / "state")
    invoker = ProxyInvoker(config, max_proxies_per_device=1, proxy_options={"prefork": 0}, **options)
    try:
        for name in ("a", "b"):
            await invoker.deploy(_spec(name, tmp_path))
        yield invoker
    finally:
        await invoker.close()


def test_a_proxy_is_not_evicted_between_the_calls_of_a_request(tmp_path):
    """One slot. `a`'s request has made its key and not yet read it: its proxy is idle between the
    calls, but a request of `b` must wait for the slot until `a`'s request ends, not evict `a` (whose
    store holds the key: the next call would wait for it in vain)."""

    async def scenario() -> None:
        async with _one_slot(tmp_path) as invoker:
            made = await invoker.invoke("a", "make", {"scale": 1}, "r-a")
            other = asyncio.ensure_future(invoker.invoke("b", "make", {"scale": 1}, "r-b"))
            await asyncio.sleep(0.5)
            assert not other.done() and invoker.warm.warm() == ["a"]
            total = await invoker.invoke("a", "total", {"key": made.output["key"]}, "r-a", timeout_s=5)
            assert total.output == {"sum": 15.0}
            await invoker.end_request("a", "r-a")
            await asyncio.wait_for(other, 60)
            assert invoker.warm.warm() == ["b"]
            await invoker.end_request("b", "r-b")

    asyncio.run(scenario())


def test_a_request_that_gives_up_while_its_proxy_starts_abandons_nothing(tmp_path):
    """One slot, `a` warm and idle. `b`'s first request gives up (its deadline) while `a` is being
    stopped for `b`'s proxy: the start goes on in the invoker's own task, and `b`'s next request is
    served by that proxy (the reservation used to stay pending for good: every later request of `b`
    waited on it until its own timeout), started once."""

    async def scenario() -> None:
        async with _one_slot(tmp_path) as invoker:
            assert invoker.warm.warm() == ["a"] and invoker.proxy_starts == 1  # `b` did not fit
            await invoker.invoke("a", "make", {"scale": 1}, "r-a")
            await invoker.end_request("a", "r-a")
            with pytest.raises(TimeoutError):
                await asyncio.wait_for(invoker.invoke("b", "make", {"scale": 1}, "r-b1"), 0.05)
            made = await asyncio.wait_for(invoker.invoke("b", "make", {"scale": 1}, "r-b2"), 60)
            assert made.output["key"].startswith("b/r-b2/")
            assert invoker.warm.warm() == ["b"] and invoker.proxy_starts == 2
            await invoker.end_request("b", "r-b2")

    asyncio.run(scenario())


def test_a_workflow_waiting_for_the_slot_gets_its_turn_while_another_stays_busy(tmp_path):
    """One slot; `a`'s requests overlap (a new one every 30 ms, each open for 60 ms more after its
    calls), so its proxy never goes idle. `b` waits `yield_after_s`, then `a` takes no new request,
    the ones it has finish and `b` is served (it used to wait until its own timeout); `a`'s waiting
    requests are served after."""

    async def scenario() -> None:
        async with _one_slot(tmp_path, yield_after_s=0.3) as invoker:
            served: list[str] = []

            async def request(rid: str) -> None:
                made = await invoker.invoke("a", "make", {"scale": 1}, rid)
                await invoker.invoke("a", "total", {"key": made.output["key"]}, rid)
                await asyncio.sleep(0.06)
                await invoker.end_request("a", rid)
                served.append(rid)

            async def launch(stop: asyncio.Event) -> list[asyncio.Task[None]]:
                tasks = []
                while not stop.is_set():
                    tasks.append(asyncio.ensure_future(request(f"r-a{len(tasks)}")))
                    await asyncio.sleep(0.03)
                return tasks

            stop = asyncio.Event()
            launcher = asyncio.ensure_future(launch(stop))
            try:
                while len(served) < 5:  # `a` is serving, its turn under way
                    await asyncio.sleep(0.05)
                made = await asyncio.wait_for(invoker.invoke("b", "make", {"scale": 1}, "r-b"), 20)
                assert made.output["key"].startswith("b/r-b/"), made
                await invoker.end_request("b", "r-b")
                before = len(served)
                async with asyncio.timeout(30):
                    while len(served) < before + 3:
                        await asyncio.sleep(0.05)
                assert invoker.warm.warm() == ["a"] and invoker.proxy_starts == 3  # a, b, a again
            finally:
                stop.set()
                await asyncio.gather(*await launcher)

    asyncio.run(scenario())
