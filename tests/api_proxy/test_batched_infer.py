"""Batched inference end to end (functional device, real bytes): concurrent invocations of a function
with `max_batch_size` > 1 run their `infer` as one plan run, and each gets its own rows back."""

from __future__ import annotations

import concurrent.futures
import textwrap
import time

import pytest
import torch

from streambox.api_proxy.control import ProxyClient, ProxyProcess, launch_proxy
from streambox.api_proxy.errors import FunctionFailed, FunctionTimeout
from streambox.api_proxy.proxy_config import ProxyConfig, ProxyFunction

HANDLERS = textwrap.dedent(
    """
    import os, time
    from pathlib import Path
    import torch
    import streambox

    def _meet(event):
        # Every invocation of the group reaches its infer together (a barrier of files).
        room = Path(event["room"])
        (room / str(event["seed"])).touch()
        deadline = time.monotonic() + 30
        while len(list(room.iterdir())) < event["group"] and time.monotonic() < deadline:
            time.sleep(0.005)

    @streambox.function(models=["resnet18"])
    def classify(ctx, event):
        g = torch.Generator().manual_seed(event["seed"])
        x = ctx.upload(torch.randn(event.get("n", 1), 3, 32, 32, generator=g))
        if "room" in event:
            _meet(event)
        time.sleep(event.get("late_s", 0.0))
        if "hold" in event:  # most of its device-memory quota, held until it ends
            ctx.alloc(event["hold"])
        (logits,) = ctx.infer("resnet18", x)
        return {"logits": ctx.download(logits).flatten().tolist(), "shape": list(logits.shape)}
    """
)

QUOTA = 64 << 20  # each invocation's device bytes
GROUP_DELAY_S = 2.0  # generous on a loaded machine: a full batch closes before it anyway
SLOW_DELAY_S = 6.0  # room for a follower to join, time out, and another to join after it
LONG_DELAY_S = 10.0  # the most a batch may wait: one that waited for it shows in the call's time
FUNCTIONS = (
    ProxyFunction("alone", "batch_handlers:classify", models=("resnet18",)),
    ProxyFunction(  # closes when 3 have joined
        "full", "batch_handlers:classify", models=("resnet18",), max_instances=3,
        max_batch_size=3, max_queue_delay_ms=GROUP_DELAY_S * 1e3,
    ),
    ProxyFunction(  # 2 of at most 4 join: closes at the deadline
        "timed", "batch_handlers:classify", models=("resnet18",), max_instances=4,
        max_batch_size=4, max_queue_delay_ms=500.0,
    ),
    ProxyFunction(  # a long delay: a call may end while its batch is open
        "slow", "batch_handlers:classify", models=("resnet18",), max_instances=4,
        max_batch_size=4, max_queue_delay_ms=SLOW_DELAY_S * 1e3,
    ),
    ProxyFunction(  # its 2 instances both waiting in a batch: nobody else can join, it closes at once
        "pair", "batch_handlers:classify", models=("resnet18",), max_instances=2,
        max_batch_size=4, max_queue_delay_ms=LONG_DELAY_S * 1e3, timeout_ms=3 * LONG_DELAY_S * 1e3,
    ),
    ProxyFunction(  # one instance: no call could ever join another, each runs at once
        "single", "batch_handlers:classify", models=("resnet18",), max_instances=1,
        max_batch_size=4, max_queue_delay_ms=LONG_DELAY_S * 1e3, timeout_ms=3 * LONG_DELAY_S * 1e3,
    ),
    ProxyFunction(  # no queue delay: unbatched, whatever max_batch_size says
        "nodelay", "batch_handlers:classify", models=("resnet18",), max_instances=2, max_batch_size=4,
    ),
)


@pytest.fixture(scope="module")
def proxy(tmp_path_factory) -> ProxyProcess:
    root = tmp_path_factory.mktemp("batched")
    (root / "batch_handlers.py").write_text(HANDLERS)
    config = ProxyConfig(
        workflow="wfbatch", functions=FUNCTIONS, sys_path=(str(root),), state_dir=str(root / "state"),
        invocation_device_bytes=QUOTA,
    )
    started = launch_proxy(config)
    yield started
    started.stop()


def _eager(zoo_model, seed: int, rows: int = 1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        return zoo_model("resnet18")(torch.randn(rows, 3, 32, 32, generator=g)).flatten()


def _together(proxy: ProxyProcess, function: str, seeds: list[int], room) -> list[dict]:
    room.mkdir()
    events = [{"seed": s, "room": str(room), "group": len(seeds)} for s in seeds]
    clients = [ProxyClient(proxy.address) for _ in seeds]
    with concurrent.futures.ThreadPoolExecutor(len(seeds)) as pool:
        return list(
            pool.map(lambda ce: ce[0].invoke(function, ce[1], request_id=f"r{ce[1]['seed']}")["output"],
                     zip(clients, events, strict=True))
        )


@pytest.mark.parametrize(("function", "seeds"), [("full", [11, 12, 13]), ("timed", [21, 22])])
def test_concurrent_infers_run_as_one_batch_with_each_callers_rows(
    proxy, function, seeds, zoo_model, tmp_path, settled
):
    stats = settled(proxy.client, lambda s: s["buffers"] == 0)
    before, pool_bytes = stats["batching"], stats["pool"]["allocated_bytes"]
    outputs = _together(proxy, function, seeds, tmp_path / "room")
    # Nothing of the batch stays allocated (<=: a block of an earlier test may be released meanwhile; CI
    # once saw 16 KiB fewer bytes than before, never more).
    after = settled(proxy.client, lambda s: s["buffers"] == 0 and s["pool"]["allocated_bytes"] <= pool_bytes)
    assert after["batching"]["batches"] == before["batches"] + 1  # one plan run for all of them
    assert after["batching"]["members"] == before["members"] + len(seeds)
    assert after["batching"]["sizes"][-1] == len(seeds)
    alone = [proxy.client.invoke("alone", {"seed": s})["output"]["logits"] for s in seeds]
    for seed, out, ref in zip(seeds, outputs, alone, strict=True):
        assert out["shape"] == [1, 1000]
        got = torch.tensor(out["logits"])
        assert torch.allclose(got, torch.tensor(ref), atol=1e-4), seed  # the unbatched result
        assert torch.allclose(got, _eager(zoo_model, seed), atol=1e-4), seed  # eager torch's
    # Every caller's output went with its request; the batch's gathered inputs and whole outputs too.
    assert (after["buffers"], after["pool"]["allocated_bytes"]) == (0, pool_bytes)


def test_a_call_no_other_joins_runs_its_own_plan_after_the_delay(proxy, zoo_model):
    before = proxy.client.stats()["batching"]
    out = proxy.client.invoke("timed", {"seed": 41})["output"]
    after = proxy.client.stats()["batching"]
    assert (after["batches"], after["alone"]) == (before["batches"], before["alone"] + 1)
    assert torch.allclose(torch.tensor(out["logits"]), _eager(zoo_model, 41), atol=1e-4)


def test_a_call_that_ends_while_its_batch_is_open_is_left_out(proxy, zoo_model, tmp_path, settled):
    stats = settled(proxy.client, lambda s: s["buffers"] == 0)
    before, pool_bytes = stats["batching"], stats["pool"]["allocated_bytes"]
    room = tmp_path / "room"
    room.mkdir()
    # 51 (1 row) leads; 53 (2 rows) joins, and its request times out while the batch is open; 52 (2
    # rows) joins after that: 1 + 2 fit in the batch of 4 only if 53's rows left it.
    events = [{"seed": s, "room": str(room), "group": 3, "n": n} for s, n in ((51, 1), (52, 2), (53, 2))]
    events[1]["late_s"], events[2]["late_s"] = 4.0, 0.3  # 53 ends 3 s after it was sent: before 52
    with concurrent.futures.ThreadPoolExecutor(3) as pool:
        futures = [
            pool.submit(ProxyClient(proxy.address).invoke, "slow", e, f"r{e['seed']}", timeout_s=t)
            for e, t in zip(events, (None, None, 3.0), strict=True)
        ]
        with pytest.raises(FunctionTimeout):
            futures[2].result()
        outputs = [f.result()["output"] for f in futures[:2]]
    # Nothing of the batch stays allocated (<=: a block of an earlier test may be released meanwhile; CI
    # once saw 16 KiB fewer bytes than before, never more).
    after = settled(proxy.client, lambda s: s["buffers"] == 0 and s["pool"]["allocated_bytes"] <= pool_bytes)
    assert after["batching"]["batches"] == before["batches"] + 1  # 51 and 52 together, not each alone
    assert after["batching"]["sizes"][-1] == 3  # the ended call's rows were not gathered
    assert after["batching"]["alone"] == before["alone"]
    assert after["batching"]["left"] == before["left"] + 1  # 53 joined, then left
    for seed, rows, out in zip((51, 52), (1, 2), outputs, strict=True):
        assert out["shape"] == [rows, 1000]
        assert torch.allclose(torch.tensor(out["logits"]), _eager(zoo_model, seed, rows), atol=1e-4)
    assert after["buffers"] == 0 and after["pool"]["allocated_bytes"] <= pool_bytes


def test_a_batch_closes_once_every_instance_waits_in_it(proxy, zoo_model, tmp_path):
    """An instance runs one invocation at a time: a batch holding `max_instances` calls cannot grow,
    so it runs at once instead of at the end of its delay (10 s here)."""
    before = proxy.client.stats()["batching"]
    started = time.perf_counter()
    outputs = _together(proxy, "pair", [61, 62], tmp_path / "room")
    single = proxy.client.invoke("single", {"seed": 63})["output"]
    took = time.perf_counter() - started
    after = proxy.client.stats()["batching"]
    assert took < LONG_DELAY_S / 2, f"{took:.1f} s: a batch waited out its delay"
    assert after["batches"] == before["batches"] + 1 and after["sizes"][-1] == 2  # the pair, together
    assert after["alone"] == before["alone"] + 1  # the single instance's call: at once, unbatched
    for seed, out in zip((61, 62, 63), [*outputs, single], strict=True):
        assert torch.allclose(torch.tensor(out["logits"]), _eager(zoo_model, seed), atol=1e-4)


def test_without_a_queue_delay_infers_run_alone(proxy, zoo_model, tmp_path):
    before = proxy.client.stats()["batching"]["batches"]
    outputs = _together(proxy, "nodelay", [31, 32], tmp_path / "room")
    assert proxy.client.stats()["batching"]["batches"] == before
    for seed, out in zip([31, 32], outputs, strict=True):
        assert torch.allclose(torch.tensor(out["logits"]), _eager(zoo_model, seed), atol=1e-4)


def test_which_functions_batch_which_calls_join_and_which_plans_deploy_prepares():
    from streambox.api_proxy.batched_infer import batch_sizes, joinable, limits_of
    from streambox.api_proxy.device_tensor import DeviceTensor
    from streambox.device.base import contiguous_strides

    def tensor(*shape: int, strides: tuple[int, ...] | None = None) -> DeviceTensor:
        return DeviceTensor(0x1000, torch.float32, shape, strides or contiguous_strides(shape), 4)

    plain = ProxyFunction("f", "m:f")
    assert limits_of(plain) is None and batch_sizes(plain) == []
    assert limits_of(ProxyFunction("f", "m:f", max_batch_size=4)) is None  # no delay: no batching
    spec = ProxyFunction("f", "m:f", max_batch_size=4, max_queue_delay_ms=5.0)
    limits = limits_of(spec)
    assert limits is not None and (limits.max_samples, limits.max_delay_s) == (4, 0.005)
    assert limits.max_members is None  # the per-instance systems send a batch to one instance
    on_proxy = limits_of(spec, one_call_per_instance=True)  # a batch can hold one call per instance
    assert on_proxy is not None and on_proxy.max_members == spec.max_instances
    assert batch_sizes(spec) == [2, 3, 4]
    pairs = ProxyFunction("f", "m:f", batch_size=2, max_batch_size=7, max_queue_delay_ms=1000.0)
    assert batch_sizes(pairs) == [4, 6]
    assert joinable(limits, [tensor(1, 3, 8, 8)])
    assert joinable(limits, [tensor(2, 3), tensor(2, 5)])
    assert not joinable(limits, [tensor(4, 3)])  # fills a batch alone
    assert not joinable(limits, [tensor(1, 3), tensor(2, 3)])  # no common batch dimension
    assert not joinable(limits, [tensor(2, 3, strides=(1, 2))])  # not contiguous
    assert not joinable(limits, [tensor()])  # a scalar has no batch dimension


def test_a_batch_whose_leader_times_out_is_led_by_a_follower(proxy, zoo_model, tmp_path, settled):
    """The leader's request gives up while the batch is open: its followers (other requests) still get
    their own rows, from the batch the first of them runs."""
    stats = settled(proxy.client, lambda s: s["buffers"] == 0)
    before, pool_bytes = stats["batching"], stats["pool"]["allocated_bytes"]
    room = tmp_path / "room"
    room.mkdir()
    events = [{"seed": s, "room": str(room), "group": 3} for s in (71, 72, 73)]
    for e in events[1:]:
        e["late_s"] = 0.3  # the first leads; these join after it, as followers
    with concurrent.futures.ThreadPoolExecutor(3) as pool:
        futures = [
            pool.submit(ProxyClient(proxy.address).invoke, "slow", e, f"r{e['seed']}", timeout_s=t)
            for e, t in zip(events, (1.5, None, None), strict=True)
        ]
        with pytest.raises(FunctionTimeout):
            futures[0].result()
        outputs = [f.result()["output"] for f in futures[1:]]
    after = settled(proxy.client, lambda s: s["buffers"] == 0 and s["pool"]["allocated_bytes"] <= pool_bytes)
    assert after["batching"]["handed_on"] == before["handed_on"] + 1
    assert after["batching"]["batches"] == before["batches"] + 1
    assert after["batching"]["sizes"][-1] == 2  # the followers' rows, run by the first of them
    for seed, out in zip((72, 73), outputs, strict=True):
        assert torch.allclose(torch.tensor(out["logits"]), _eager(zoo_model, seed), atol=1e-4)


def test_a_leader_past_its_quota_fails_alone_and_its_followers_get_their_rows(
    proxy, zoo_model, tmp_path, settled
):
    """A batch's rows count against each caller's own quota: the leader that holds almost all of its
    own fails its call, the followers (other requests) get theirs, and nothing is left allocated."""
    stats = settled(proxy.client, lambda s: s["buffers"] == 0)
    pool_bytes = stats["pool"]["allocated_bytes"]
    room = tmp_path / "room"
    room.mkdir()
    events = [{"seed": s, "room": str(room), "group": 3} for s in (81, 82, 83)]
    events[0]["hold"] = QUOTA - 3 * 32 * 32 * 4 - 2000  # with its input: its 4,000 bytes of rows do not fit
    for e in events[1:]:
        e["late_s"] = 0.3  # the first leads
    with concurrent.futures.ThreadPoolExecutor(3) as pool:
        futures = [pool.submit(ProxyClient(proxy.address).invoke, "full", e, f"r{e['seed']}") for e in events]
        with pytest.raises(FunctionFailed, match="QuotaExceeded: full: 4000 more bytes"):
            futures[0].result()
        outputs = [f.result()["output"] for f in futures[1:]]
    for seed, out in zip((82, 83), outputs, strict=True):
        assert torch.allclose(torch.tensor(out["logits"]), _eager(zoo_model, seed), atol=1e-4)
    after = settled(proxy.client, lambda s: s["buffers"] == 0 and s["pool"]["allocated_bytes"] <= pool_bytes)
    assert after["buffers"] == 0 and after["pool"]["allocated_bytes"] <= pool_bytes


def test_followers_that_ended_leave_the_open_batch_and_their_parked_calls_are_resumed():
    """The proxy's side of a batch, on stand-in calls (an instance's state and invocation are all it
    reads): a follower whose instance died gives its room to the next caller, and its call, parked on
    its result, is resumed (the dispatcher then closes it, releasing what it holds)."""
    from types import SimpleNamespace

    from streambox.api_proxy.batched_infer import Batching, Member, _lead
    from streambox.api_proxy.batcher import Limits
    from streambox.api_proxy.device_tensor import DeviceTensor

    def member(rows: int) -> Member:
        inv = object()
        inst = SimpleNamespace(state="busy", invocation=inv, spec=SimpleNamespace(name="f"))
        x = DeviceTensor(0x1000, torch.float32, (rows, 3), (3, 1), rows * 12)
        return Member(SimpleNamespace(inst=inst, inv=inv), [x], ready=None)  # type: ignore[arg-type]

    batching, limits = Batching(), Limits(4, 1.0, max_members=4)
    a, b, c = member(1), member(2), member(2)
    batch = batching.join("m", a, limits, now=0.0)
    assert batching.join("m", b, limits, now=0.1) is batch
    b.call.inst.state = "dead"
    assert batching.join("m", c, limits, now=0.2) is batch  # 1 + 2 rows: b's 2 no longer count
    assert batch.members == [a, c] and batching.gatherer.is_open(batch)
    assert b.result.done() and "ended before its batch ran" in str(b.result.exception())
    c.call.inst.invocation = object()  # c's request ended (its instance serves another)
    batching.hand_on(batch, a)  # a dropped too: nobody is left to run it
    assert not batching.gatherer.is_open(batch) and c.result.exception() is not None

    # A leader whose batch closed with no follower alive runs alone; the ended followers are resumed.
    lead, gone = member(1), member(1)
    batch = batching.join("m", lead, limits, now=1.0)
    batching.join("m", gone, limits, now=1.1)
    gone.call.inst.state = "dead"
    leading = _lead(SimpleNamespace(batching=batching), lead.call, "m", lead, batch, None)
    next(leading)  # waits for the batch to close
    with pytest.raises(StopIteration) as ran:
        leading.send(batch)
    assert ran.value.value is None and batching.alone == 1  # the leader's own plan, as if unbatched
    assert gone.result.done() and gone.result.exception() is not None
