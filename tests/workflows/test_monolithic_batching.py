"""Batching in the per-instance baselines (infless, astraea): the invoker gathers a batching function's
concurrent invocations and sends them to ONE instance as one message; the instance runs their
handlers on threads and their `infer` calls as one inference at the summed batch size. Everything
here goes through the real invoker and real instance processes (each start imports torch: seconds)."""

from __future__ import annotations

import asyncio
import textwrap
from pathlib import Path

import pytest
import torch

from streambox.comm.baselines import RedisServer
from streambox.config import Config
from streambox.workflows.invoker import InvocationError, InvocationTimeout
from streambox.workflows.monolithic import MonolithicInvoker
from streambox.workflows.validation import parse_spec

HANDLERS = textwrap.dedent(
    """
    import os

    import torch


    def classify(ctx, event):
        if event.get("fail") == "before":
            raise ValueError("bad input before infer")
        generator = torch.Generator().manual_seed(event["seed"])
        ids = torch.randint(0, 8000, (1, event.get("tokens", 16)), generator=generator)
        (logits,) = ctx.infer("text_encoder", ids)
        if event.get("fail") == "after":
            raise ValueError("bad input after infer")
        return {"logits": ctx.download(logits)[0].tolist(), "shape": list(logits.shape), "pid": os.getpid()}
    """
)

WORKFLOW = """
name: mono-batch
slo_ms: 1000
functions:
  classify:
    handler: "mono_batch_handlers:classify"
    models: [text_encoder]
    max_instances: 1
    max_batch_size: 4
    max_queue_delay_ms: 300
"""


def _config(tmp_path: Path, pool_root: Path) -> Config:
    (tmp_path / "mono_batch_handlers.py").write_text(HANDLERS)
    return Config(
        backend="emulated", device_preset="v100-16gb", state_dir=tmp_path / "state", model_pool=pool_root
    )


def _delta(after: dict[str, int], before: dict[str, int]) -> dict[str, int]:
    return {k: after[k] - before[k] for k in after}


@pytest.mark.parametrize(
    "data_path",
    [
        pytest.param(
            "redis",
            marks=pytest.mark.skipif(
                RedisServer.why_unavailable() is not None, reason=f"{RedisServer.why_unavailable()}"
            ),
        ),
        "cuda-ipc",
    ],
)
def test_a_burst_runs_as_one_inference_in_one_instance_and_a_failing_member_fails_alone(
    tmp_path, run, pool, data_path
):
    for size in (1, 2, 3, 4):  # lowered here once; the instance reads them from the pool
        pool.get_or_lower("text_encoder", size, (16,))
    pool.get_or_lower("text_encoder", 1, (8,))
    config = _config(tmp_path, pool.root)
    spec = parse_spec(WORKFLOW, "batch.yaml", base_dir=tmp_path)

    async def scenario() -> None:
        invoker = MonolithicInvoker(config, prewarm=1, data_path=data_path)
        try:
            await invoker.deploy(spec)

            async def call(event: dict, request: str):
                return await invoker.invoke("mono-batch", "classify", event, request, timeout_s=120)

            # Unbatched reference: one at a time, each batch closes alone at its deadline and goes as
            # a plain invocation (the plan of batch 1).
            before = invoker.inference_counts()
            alone = [await call({"seed": s}, f"a{s}") for s in range(4)]
            counts = _delta(invoker.inference_counts(), before)
            assert counts["plan_runs"] == 4 and counts["batched_runs"] == 0 and counts["batches_sent"] == 0

            # A burst of four: one message, one instance, ONE inference at batch 4.
            before = invoker.inference_counts()
            burst = await asyncio.gather(*(call({"seed": s}, f"b{s}") for s in range(4)))
            counts = _delta(invoker.inference_counts(), before)
            assert counts == {
                "plan_runs": 1,
                "infer_calls": 4,
                "batched_runs": 1,
                "batched_calls": 4,
                "batches_sent": 1,
                "calls_batched": 4,
            }
            assert len({r.output["pid"] for r in burst}) == 1 and invoker.instance_starts == 1
            for one, many in zip(alone, burst, strict=True):
                assert many.output["shape"] == [1, len(one.output["logits"])]  # its own rows only
                # allclose, not bitwise: the batch-4 plan's CPU matmuls block (and so sum) in another
                # order than batch 1's; measured here: up to 3e-8 apart.
                got, want = torch.tensor(many.output["logits"]), torch.tensor(one.output["logits"])
                assert torch.allclose(got, want, atol=1e-5)

            # One member fails after its infer, one before any: they fail alone; of the others, the
            # two 16-token calls share one inference, the 8-token call (another shape) runs alone.
            before = invoker.inference_counts()
            events = [{"seed": 0, "fail": "after"}, {"seed": 1}, {"seed": 2, "fail": "before"},
                      {"seed": 3, "tokens": 8}, {"seed": 2}]
            results = await asyncio.gather(*(call(e, f"c{i}") for i, e in enumerate(events)),
                                           return_exceptions=True)
            counts = _delta(invoker.inference_counts(), before)
            assert isinstance(results[0], InvocationError) and "after infer" in results[0].message
            assert isinstance(results[2], InvocationError) and "before infer" in results[2].message
            assert results[1].output["logits"] == pytest.approx(alone[1].output["logits"], abs=1e-5)
            assert results[4].output["logits"] == pytest.approx(alone[2].output["logits"], abs=1e-5)
            assert results[3].output["shape"][0] == 1
            # 5 invocations, at most 4 samples a message: a message of the first 4, the fifth alone.
            # Runs: the two 16-token calls of the message together, its 8-token call, the fifth.
            assert counts["batches_sent"] == 1 and counts["calls_batched"] == 4
            assert counts["infer_calls"] == 4 and counts["plan_runs"] == 3
            assert counts["batched_runs"] == 1 and counts["batched_calls"] == 2
            assert invoker.memory_breakdown()["instances"] == 1  # the instance stayed warm
        finally:
            await invoker.close()

    run(scenario())


def test_a_queued_invocation_times_out_alone_and_closing_fails_the_waiting_ones(tmp_path, run, pool):
    """While its batch is open an invocation is only queued: its own deadline answers it, and closing
    the invoker fails it with a reason (no instance is started for either)."""
    config = _config(tmp_path, pool.root)
    slow = WORKFLOW.replace("max_queue_delay_ms: 300", "max_queue_delay_ms: 10000")
    spec = parse_spec(slow, "batch.yaml", base_dir=tmp_path)

    async def scenario() -> None:
        invoker = MonolithicInvoker(config, data_path="cuda-ipc")
        try:
            await invoker.deploy(spec)
            with pytest.raises(InvocationTimeout, match="ran out in its batch"):
                await invoker.invoke("mono-batch", "classify", {"seed": 0}, "r1", timeout_s=0.2)
            # r1 left its batch: three more (of four samples) keep it open, none is sent yet.
            waiting = [
                asyncio.ensure_future(invoker.invoke("mono-batch", "classify", {"seed": i}, f"r{i}"))
                for i in (2, 3, 4)
            ]
            await asyncio.sleep(0.2)
            assert not any(w.done() for w in waiting) and invoker.starting_instances == 0
        finally:
            await invoker.close()
        for w in waiting:
            with pytest.raises(InvocationError, match="the invoker closed") as closed:
                await w
            assert closed.value.function == "classify"
        assert invoker.instance_starts == 0

    run(scenario())
