"""`MonolithicInvoker`: one process and one runtime per function instance, keep-alive, Func-IPC
through a real Redis server. Every instance here is a real child process (a cold start imports torch:
seconds), so the module starts three of them in all."""

from __future__ import annotations

import asyncio
import textwrap
import time
from pathlib import Path

import pytest
import torch

from streambox.comm.baselines import RedisServer, RedisUnavailable
from streambox.config import Config
from streambox.workflows.engine import Engine
from streambox.workflows.invoker import InvocationError, InvocationTimeout, Invoker
from streambox.workflows.monolithic import MonolithicInvoker, meta_key
from streambox.workflows.validation import parse_spec

needs_redis = pytest.mark.skipif(
    RedisServer.why_unavailable() is not None,
    reason=f"Func-IPC needs Redis: {RedisServer.why_unavailable()}",
)

HANDLERS = textwrap.dedent(
    """
    import os
    import time

    import torch


    def act(ctx, event):
        do = event["do"]
        if do == "produce":  # put the data for one consumer, then wait for its answer
            ctx.put(ctx.key("data"), ctx.upload(torch.arange(event["n"], dtype=torch.float32)), consumers=1)
            answer = ctx.get(ctx.key("answer"), timeout=120)
            return {"pid": os.getpid(), "answer": ctx.download(answer).tolist()}
        if do == "consume":  # take the data, answer with its sum (kept until the request ends)
            data = ctx.get(ctx.key("data"), timeout=120)
            total = float(ctx.download(data).sum())
            ctx.put(ctx.key("answer"), ctx.upload(torch.tensor([total])))
            return {"pid": os.getpid(), "sum": total, "shape": list(data.shape)}
        if do == "put":
            ctx.put(ctx.key("late"), ctx.upload(torch.zeros(2)))
        if do == "export":  # put the data for one consumer and return at once
            ctx.put(ctx.key("data"), ctx.upload(torch.arange(event["n"], dtype=torch.float32)), consumers=1)
        if do == "raise":
            raise ValueError("bad input")
        if do == "refuse":  # a handler's own kind of refusal crosses as InvalidInput (the gateway's 400)
            import streambox
            raise type("BadN", (streambox.InvalidInput,), {})("n must be positive")
        if do == "sleep":
            time.sleep(event["s"])
        if do == "exit":
            os._exit(3)
        return {"pid": os.getpid()}


    def classify(ctx, event):
        ids = torch.randint(0, 8000, (1, 16), generator=torch.Generator().manual_seed(0))
        (logits,) = ctx.infer("text_encoder", ids)
        return {"class": int(ctx.download(logits).argmax()), "shape": list(logits.shape)}
    """
)

WORKFLOW = """
name: mono
slo_ms: 1000
functions:
  act: {handler: "mono_test_handlers:act", max_instances: 2}
"""

CLASSIFY = """
name: mono-infer
slo_ms: 1000
functions:
  classify: {handler: "mono_test_handlers:classify", models: [text_encoder], max_instances: 1}
"""


PRODUCE_THEN_CONSUME = """
name: mono
slo_ms: 1000
functions:
  produce: {handler: "mono_test_handlers:act", max_instances: 1}
  consume: {handler: "mono_test_handlers:act", max_instances: 1}
"""


def _config(tmp_path: Path, **changes: object) -> Config:
    (tmp_path / "mono_test_handlers.py").write_text(HANDLERS)
    return Config(backend="emulated", device_preset="v100-16gb", state_dir=tmp_path / "state").with_overrides(
        **changes
    )


def _runtimes(config: Config) -> int:
    return sum(u.runtimes for u in config.open_backend().device_usage())


async def _until(predicate, timeout_s: float = 60.0) -> None:
    end = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < end, "condition not reached"
        await asyncio.sleep(0.05)


@needs_redis
def test_instances_are_processes_keys_cross_them_through_redis_and_failures_stay_isolated(tmp_path, run):
    config = _config(tmp_path)
    spec = parse_spec(WORKFLOW, "mono.yaml", base_dir=tmp_path)
    context = config.device_spec().context_memory

    async def scenario() -> None:
        invoker = MonolithicInvoker(config)
        assert isinstance(invoker, Invoker)
        engine = Engine(invoker)
        try:
            await engine.deploy(spec)
            assert invoker.describe()["system"] == "monolithic" and invoker.describe()["redis_version"]
            assert invoker.memory_breakdown()["instances"] == 0  # nothing runs before the first call
            from redis import Redis

            redis = Redis(**invoker.redis_connection)

            # Two concurrent calls of one function: neither can finish without the other, so they
            # run in two instances (both cold), and the keys go across through Redis both ways.
            produced, consumed = await asyncio.gather(
                invoker.invoke("mono", "act", {"do": "produce", "n": 10}, "r1"),
                invoker.invoke("mono", "act", {"do": "consume"}, "r1"),
            )
            assert produced.cold_start and consumed.cold_start and invoker.cold_starts == 2
            assert consumed.output["sum"] == 45.0 and consumed.output["shape"] == [10]
            assert produced.output["answer"] == [45.0]
            pids = {produced.output["pid"], consumed.output["pid"]}
            assert len(pids) == 2 and set(invoker.live_instances("mono")["act"]) == pids
            assert not redis.exists("mono/r1/data", meta_key("mono/r1/data"))  # its one consumer took it
            assert redis.exists("mono/r1/answer") and redis.exists(meta_key("mono/r1/answer"))

            await invoker.end_request("mono", "r1")  # drops what the request left in Redis
            assert not redis.keys("mono/r1/*")
            with pytest.raises(InvocationError, match="request r1 has ended: PUT of key 'mono/r1/late'"):
                await invoker.invoke("mono", "act", {"do": "put"}, "r1")

            warm = await invoker.invoke("mono", "act", {"do": "pid"}, "r2")  # an idle instance: warm
            assert not warm.cold_start and warm.output["pid"] in pids and invoker.cold_starts == 2
            ran = await engine.run("mono", {"do": "put"})  # its key stays until the engine ends it
            assert ran.ok and ran.cold_starts == 0 and ran.output["pid"] in pids, ran.error
            assert not redis.keys(f"mono/{ran.request_id}/*")

            # A call its caller abandons (the engine cancels a failed request's other calls) runs
            # to its end; its instance then goes back to the pool.
            abandoned = asyncio.ensure_future(invoker.invoke("mono", "act", {"do": "sleep", "s": 0.3}, "r6"))
            await asyncio.sleep(0.05)
            abandoned.cancel()
            await _until(lambda: invoker.memory_breakdown()["busy_instances"] == 0)
            assert sorted(invoker.live_instances("mono")["act"]) == sorted(pids)

            memory = await asyncio.to_thread(invoker.memory_breakdown)  # the sampler's thread
            assert memory["instances"] == 2 and memory["busy_instances"] == 0
            assert memory["context_bytes"] == 2 * context  # one runtime (context) per instance
            assert memory["weights_bytes"] == 0 and memory["pool_reserved_bytes"] >= memory["pool_used_bytes"]
            assert _runtimes(config) == 2
            (stats,) = invoker.runtime_stats()
            assert stats.workflow == "mono" and stats.instances == {"act": 2}
            # per workflow: its instances' runtimes whole (contexts and all they allocated)
            (mono_bytes,) = invoker.memory_by_workflow().values()
            assert list(invoker.memory_by_workflow()) == ["mono"]
            assert mono_bytes >= 2 * context + memory["pool_reserved_bytes"]

            # A handler that raises fails its call only: the instance stays warm.
            with pytest.raises(InvocationError, match="bad input") as raised:
                await invoker.invoke("mono", "act", {"do": "raise"}, "r3")
            assert raised.value.error_type == "ValueError" and "Traceback" in (raised.value.traceback or "")
            with pytest.raises(InvocationError, match="n must be positive") as refused:
                await invoker.invoke("mono", "act", {"do": "refuse"}, "r3b")
            assert refused.value.error_type == "InvalidInput" and "BadN" in (refused.value.traceback or "")
            assert invoker.memory_breakdown()["instances"] == 2
            assert invoker.memory_breakdown()["mps_clients"] == 2  # each runtime holds an MPS share

            # An instance that dies fails its call and is discarded; its runtime leaves the device.
            with pytest.raises(InvocationError, match="exited with code 3") as crashed:
                await invoker.invoke("mono", "act", {"do": "exit"}, "r4")
            assert crashed.value.error_type == "InstanceCrashed"
            assert invoker.memory_breakdown()["instances"] == 1
            assert invoker.memory_breakdown()["context_bytes"] == context
            assert _runtimes(config) == 1

            # A call past its limit times out and its instance is killed.
            with pytest.raises(InvocationTimeout):
                await invoker.invoke("mono", "act", {"do": "sleep", "s": 120}, "r5", timeout_s=1.0)
            assert invoker.memory_breakdown() == {
                "context_bytes": 0.0,
                "weights_bytes": 0.0,
                "pool_reserved_bytes": 0.0,
                "pool_used_bytes": 0.0,
                "instances": 0.0,
                "busy_instances": 0.0,
                "mps_clients": 0.0,
            }
            assert _runtimes(config) == 0
            assert list(invoker.runtime_stats()) == [] and invoker.memory_by_workflow() == {}
        finally:
            await engine.close()

    run(scenario())


@needs_redis
def test_prewarmed_instance_infers_with_its_own_weights_and_scales_to_zero(tmp_path, run, pool, zoo_model):
    plan = pool.get_or_lower("text_encoder", 1, (16,))  # lowered here once; the instance reads it
    weights = sum(v.nbytes for v in plan.vars_of_kind("weight"))
    config = _config(tmp_path, model_pool=pool.root)
    spec = parse_spec(CLASSIFY, "infer.yaml", base_dir=tmp_path)
    ids = torch.randint(0, 8000, (1, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = int(zoo_model("text_encoder").eval()(ids).argmax())

    async def scenario() -> None:
        invoker = MonolithicInvoker(config, keep_alive_s=3.0, prewarm=1)
        try:
            await invoker.deploy(spec)  # starts the instance: runtime, its own copy of the weights
            await invoker.pin_warm("mono-infer", True)  # a replay's warm-up: no keep-alive
            await asyncio.sleep(3.5)
            assert invoker.memory_breakdown()["instances"] == 1
            await invoker.pin_warm("mono-infer", False)  # it counts from now
            memory = invoker.memory_breakdown()
            assert memory["instances"] == 1 and memory["weights_bytes"] == weights
            assert memory["context_bytes"] == config.device_spec().context_memory
            result = await invoker.invoke("mono-infer", "classify", {}, "r1")
            assert not result.cold_start and invoker.cold_starts == 0 and invoker.instance_starts == 1
            assert result.output == {"class": expected, "shape": [1, 16]}
            # Idle past its keep-alive: the instance stops, its runtime and memory with it.
            await _until(lambda: invoker.memory_breakdown()["instances"] == 0)
            assert all(v == 0 for v in invoker.memory_breakdown().values())
            assert _runtimes(config) == 0  # counted until its process was gone
        finally:
            await invoker.close()

    run(scenario())


def test_deploy_says_why_without_redis(tmp_path, run):
    invoker = MonolithicInvoker(_config(tmp_path), redis_executable=str(tmp_path / "no-redis-server"))
    spec = parse_spec(WORKFLOW, "mono.yaml", base_dir=tmp_path)

    async def scenario() -> None:
        try:
            with pytest.raises(RedisUnavailable, match="passes data through Redis"):
                await invoker.deploy(spec)
        finally:
            await invoker.close()

    run(scenario())


@needs_redis
def test_a_call_waiting_on_a_slow_start_takes_an_instance_that_goes_idle_first(tmp_path, run, monkeypatch):
    """The cause of a short monolithic replay leaving every request outstanding until its drain: a
    call that started an instance waited for that start (tens of seconds on a loaded machine) while
    the warm instance it could use went idle beside it."""
    config = _config(tmp_path)
    spec = parse_spec(WORKFLOW, "mono.yaml", base_dir=tmp_path)

    async def scenario() -> None:
        invoker = MonolithicInvoker(config, keep_alive_s=600.0, prewarm=1)
        try:
            await invoker.deploy(spec)
            # From now on an instance start takes two minutes (the framework's modelled init).
            monkeypatch.setenv("STREAMBOX_FRAMEWORK_INIT_S", "120")
            began = time.monotonic()
            first, second = await asyncio.gather(
                invoker.invoke("mono", "act", {"do": "sleep", "s": 1.0}, "r1", timeout_s=60),
                invoker.invoke("mono", "act", {"do": "sleep", "s": 1.0}, "r2", timeout_s=60),
            )
            waited = time.monotonic() - began
            assert first.output["pid"] == second.output["pid"]  # the one warm instance, twice
            assert not first.cold_start and not second.cold_start and invoker.cold_starts == 0
            assert waited < 30, f"the second call waited {waited:.1f} s for its own start"
        finally:
            await invoker.close()

    run(scenario())


@needs_redis
def test_a_prewarm_that_finds_the_gpu_full_is_skipped_and_the_deploy_goes_on(tmp_path, run):
    """Users past a GPU's capacity (the paper's section 9.3): pre-warming is best effort, the
    function starts at its first request instead of the deploy failing."""
    config = _config(tmp_path, device_mode="timed")  # phantom data: the hog below holds no host memory
    hog = config.open_backend().open_runtime(0)
    free, _ = hog.memory_info()
    held = hog.mem_alloc(free - 64 * 2**20)  # less than one instance's context is left
    spec = parse_spec(WORKFLOW, "mono.yaml", base_dir=tmp_path)

    async def scenario() -> None:
        invoker = MonolithicInvoker(config, prewarm=1)
        try:
            await invoker.deploy(spec)
            assert invoker.prewarm_skipped == len(spec.functions) and invoker.instance_starts == 0
            assert invoker.memory_breakdown()["instances"] == 0
        finally:
            await invoker.close()

    try:
        run(scenario())
    finally:
        hog.mem_free(held)
        hog.close()


def test_astraea_keeps_a_producer_alive_past_its_keep_alive_while_its_keys_await_their_consumer(
    tmp_path, run
):
    """CUDA-IPC: the producer's runtime holds the data it exported. Idle past its keep-alive, it is not
    stopped while a key of it is still to be taken (stopping it would take the key with it: the
    consumer's GET would fail); once the request ends, it scales to zero."""
    config = _config(tmp_path)
    spec = parse_spec(PRODUCE_THEN_CONSUME, "mono.yaml", base_dir=tmp_path)

    async def scenario() -> None:
        invoker = MonolithicInvoker(config, keep_alive_s=0.3, data_path="cuda-ipc")
        try:
            await invoker.deploy(spec)
            await invoker.invoke("mono", "produce", {"do": "export", "n": 5}, "r1")
            await asyncio.sleep(1.5)  # several keep-alives: the producer is idle and expired
            assert invoker.memory_breakdown()["instances"] == 1
            result = await invoker.invoke("mono", "consume", {"do": "consume"}, "r1")
            assert result.output["sum"] == 10.0
            await invoker.end_request("mono", "r1")  # retires r1's keys: nothing holds either
            await _until(lambda: invoker.memory_breakdown()["instances"] == 0)
        finally:
            await invoker.close()

    run(scenario())


def test_an_instances_mps_share_is_the_invokers_else_the_functions_else_an_equal_one(tmp_path: Path) -> None:
    """INFless and Astraea ignored a function's `gpu_percent` from the YAML."""
    spec = parse_spec(
        textwrap.dedent(
            """
            name: shares
            slo_ms: 200
            functions:
              a: {handler: "h:a", gpu_percent: 60}
              b: {handler: "h:b"}
            edges: [{from: a, to: b}]
            """
        ),
        "shares.yaml",
        base_dir=tmp_path,
        check_handlers=False,
    )
    config = _config(tmp_path)
    assert [MonolithicInvoker(config).share(spec, f) for f in ("a", "b")] == [60, 50]
    assert [MonolithicInvoker(config, gpu_percent=20).share(spec, f) for f in ("a", "b")] == [20, 20]
