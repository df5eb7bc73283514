"""Batched inference: concurrent `infer` calls of one function's invocations run as ONE plan run.

A function with `max_batch_size` > 1 and `max_queue_delay_s` > 0 has its `infer` calls gathered by
`batcher.Gatherer` (pure) per kind: (function, model, per-sample shape and dtype of every input). The
first member of a batch *leads* it: its op waits (an `Offload` on a future the dispatcher settles) until
the batch closes -- full, or at the deadline, which the dispatcher's timers check (`close_due`) -- and
then runs it on its own stream:

1. the plan of the batch's total size (prepared at deploy for every multiple of the function's
   `batch` up to `max_batch_size`, else read or lowered off the dispatcher by `Resources.plan_for`);
2. one input per plan input gathered from the pool: each member's rows copied in, after the member's
   stream reached its `infer` (an event recorded there);
3. the plan run (on the dispatcher or an issuer thread, as an unbatched one);
4. each member's rows of every output copied into a buffer of its own, registered to *its* invocation
   (freed when its request ends, like any output); the gathered inputs and whole outputs are freed on
   the leader's stream after the copies. The members' streams wait for the leader's work before their
   next call, and their ops (waiting on an `Offload` of their own) are resumed with their handles.

A batch that closes with its leader alone is not a batch: the leader's `infer` runs its own plan as
if unbatched (no gathering copies; it only waited). Other members (followers) never run anything. A
follower whose invocation ended before the batch ran is left out (of an open batch when the next
caller joins: its samples no longer fill it), and its call, parked on its `result`, is resumed so that
the dispatcher closes it (`release`). A leader whose call is dropped before its followers got their
rows (its request timed out or failed, its instance died) hands the batch on when its wait ends: the
first follower still alive leads it (waits for it to close, or runs it at once), so one request never
fails another's call; until then its samples count. A batch whose run fails (the plan, the memory)
fails its followers' calls with that error.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Generator
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from streambox.device import Event
from streambox.device.base import contiguous_strides
from streambox.kernel_compiler.plan import KernelPlan
from streambox.phases import QUEUE

from .batcher import Batch, Gatherer, Limits
from .device_tensor import DeviceTensor
from .errors import ProxyError, QuotaExceeded
from .executor import RunResult
from .function_spec import ProxyFunction
from .handles import Handle
from .waits import Offload, Wait

if TYPE_CHECKING:
    from .ops import CallContext
    from .resources import Resources

#: How many recent batches' sizes the stats report (and the proxy keeps).
RECENT_SIZES = 256
#: What a follower's `result` carries when the leader was dropped and it leads the batch instead.
LEAD: Any = object()

RunPlan = Callable[
    ["Resources", "CallContext", str, KernelPlan, dict[str, DeviceTensor]], Generator[Wait, Any, RunResult]
]


@dataclass(eq=False)
class Member:
    """One `infer` call waiting in a batch: its checked inputs, and the futures it waits on."""

    call: CallContext
    inputs: list[DeviceTensor]
    ready: Event  # recorded on the member's stream when it joined: its inputs are written by then
    result: Future[list[Handle]] = field(default_factory=Future)  # its handles (followers wait on it)
    closed: Future[Batch[Member]] = field(default_factory=Future)  # the batch closed (the leader waits)

    @property
    def samples(self) -> int:
        return int(self.inputs[0].shape[0])

    @property
    def alive(self) -> bool:
        inst = self.call.inst
        return inst.state != "dead" and inst.invocation is self.call.inv


def limits_of(spec: ProxyFunction, *, one_call_per_instance: bool = False) -> Limits | None:
    """The function's batching limits, or None when its infers run alone. `one_call_per_instance`
    (the proxy, whose instances run one invocation at a time): a batch holding `max_instances` calls
    closes at once, as no other invocation of the function can be running to join it (with
    `max_instances` 1 every call runs at once, alone, instead of waiting out the delay)."""
    if spec.max_batch_size <= 1 or spec.max_queue_delay_s <= 0:
        return None
    members = spec.max_instances if one_call_per_instance else None
    return Limits(spec.max_batch_size, spec.max_queue_delay_s, members)


def batch_sizes(spec: ProxyFunction) -> list[int]:
    """The batch sizes a function's batches reach when every invocation brings `spec.batch_size` samples:
    the plans prepared at deploy (other totals are lowered on first use)."""
    if limits_of(spec) is None:
        return []
    return list(range(2 * spec.batch_size, spec.max_batch_size + 1, spec.batch_size))


def joinable(limits: Limits, inputs: list[DeviceTensor]) -> bool:
    """Whether these inputs can share a batch: contiguous, one leading (batch) dimension for all, and
    fewer samples than a batch holds (a call that fills a batch alone runs alone)."""
    if not inputs or any(len(t.shape) == 0 for t in inputs):
        return False
    samples = inputs[0].shape[0]
    return 0 < samples < limits.max_samples and all(
        t.shape[0] == samples and tuple(t.strides) == contiguous_strides(tuple(t.shape)) for t in inputs
    )


class Batching:
    """The proxy's open batches (the dispatcher's side): joins, deadlines, and handing a closed batch
    to its leader."""

    def __init__(self) -> None:
        self.gatherer: Gatherer[Member] = Gatherer()
        self.batches_run = 0
        self.members_batched = 0
        self.sizes: deque[int] = deque(maxlen=RECENT_SIZES)  # samples of each recent batch run
        self.alone = 0  # batches that closed with no call but their first: run as plain infers
        self.handed_on = 0  # batches whose leader was dropped and a follower led instead
        self.left = 0  # followers that ended while their batch was open, and left it

    def counters(self) -> dict[str, Any]:
        """Batches run, the calls they served, how many samples each held (recent ones), and the calls
        that waited for a batch but ran alone."""
        return {
            "batches": self.batches_run,
            "members": self.members_batched,
            "sizes": list(self.sizes),
            "alone": self.alone,
            "handed_on": self.handed_on,
            "left": self.left,
        }

    def join(self, model: str, member: Member, limits: Limits, now: float) -> Batch[Member]:
        """`member` joins the open batch of its function, model and per-sample inputs, once the
        followers that ended there have left it (their samples would fill it)."""
        signature = tuple((str(t.dtype), tuple(t.shape[1:])) for t in member.inputs)
        kind = (member.call.inst.spec.name, model, signature)
        waiting = self.gatherer.open_batch(kind)
        if waiting is not None:
            for ended in [m for m in waiting.members[1:] if not m.alive]:
                self.leave(waiting, ended)
                release(ended)
        batch, closed = self.gatherer.add(kind, member, member.samples, limits, now)
        for done in closed:
            self._hand_over(done)
        return batch

    def close_due(self, now: float) -> int:
        """Hand every batch whose deadline came to its leader (the dispatcher's timers call this)."""
        due = self.gatherer.due(now)
        for batch in due:
            self._hand_over(batch)
        return len(due)

    def next_deadline(self) -> float | None:
        return self.gatherer.next_deadline()

    def abandon(self, batch: Batch[Member], why: BaseException) -> None:
        """The batch cannot run: drop it if open, and fail the followers' calls with `why`."""
        self.gatherer.discard(batch)
        for member in batch.members[1:]:
            if not member.result.done():
                member.result.set_exception(why)

    def leave(self, batch: Batch[Member], gone: Member) -> None:
        """A follower `gone` was dropped while it waited: out of its batch if still open, so its
        samples no longer fill it (a closed batch's run leaves out the members that ended)."""
        self.left += self.gatherer.leave(batch, gone)

    def hand_on(self, batch: Batch[Member], gone: Member) -> None:
        """The leader `gone` was dropped before its followers got their rows: the first follower still
        alive and waiting leads the batch instead (told through its `result`: `LEAD`; its `closed` is
        set at once if the batch closed already); with none, the batch is dropped (nobody waits)."""
        waiting = (m for m in batch.members if m is not gone and m.alive and not m.result.done())
        successor = next(waiting, None)
        if successor is None:
            self.gatherer.discard(batch)
            for member in batch.members:
                if member is not gone:
                    release(member)
            return
        batch.hand_on(gone, successor)
        self.handed_on += 1
        if not self.gatherer.is_open(batch) and not successor.closed.done():
            successor.closed.set_result(batch)
        successor.result.set_result(LEAD)

    @staticmethod
    def _hand_over(batch: Batch[Member]) -> None:
        if not batch.leader.closed.done():
            batch.leader.closed.set_result(batch)


def release(member: Member) -> None:
    """A member that ended before its batch ran, left out of it: its call (parked on `result`) is
    resumed, to be closed as its instance's or invocation's end requires, and lets go of what it
    holds (a hold on the model's weights)."""
    if not member.result.done():
        member.result.set_exception(ProxyError("the call ended before its batch ran"))


def infer_batched(
    res: Resources,
    call: CallContext,
    model: str,
    inputs: list[DeviceTensor],
    limits: Limits,
    run_plan: RunPlan,
) -> Generator[Wait, Any, list[Handle] | None]:
    """One `infer` as a member of a batch (see the module doc): returns this caller's handles, or None
    when no other call joined it (the caller then runs its own plan as usual: no copies)."""
    member = Member(call, inputs, res.record(call.inst.stream))
    batch = res.batching.join(model, member, limits, time.perf_counter())
    try:
        while batch.leader is not member:  # a follower, until it has its rows or leads
            got = yield Offload(member.result, f"the batched inference of {model!r}")
            if got is not LEAD:
                return got  # type: ignore[no-any-return]
    except GeneratorExit:  # dropped while it waited (as a follower, or told to lead, before it could)
        if batch.leader is member:
            res.batching.hand_on(batch, member)
        else:
            res.batching.leave(batch, member)
        raise
    return (yield from _lead(res, call, model, member, batch, run_plan))


def _lead(
    res: Resources, call: CallContext, model: str, member: Member, batch: Batch[Member], run_plan: RunPlan
) -> Generator[Wait, Any, list[Handle] | None]:
    """The leader's part: wait for the batch to close, then run it (or run alone if nobody joined)."""
    try:
        yield Offload(member.closed, f"gathering a batch for {model!r}", QUEUE)  # waiting for peers
        if not any(m.alive for m in batch.members[1:]):
            res.batching.alone += 1
            for ended in batch.members[1:]:  # followers that ended while it waited: resumed, to close
                release(ended)
            return None
        return (yield from _run_batch(res, call, model, batch, run_plan))
    except GeneratorExit:  # this call was dropped (its instance died or its request ended)
        res.batching.hand_on(batch, member)
        raise
    except BaseException as exc:
        why = exc if isinstance(exc, Exception) else ProxyError(f"the batch of {model!r} was dropped")
        res.batching.abandon(batch, why)
        raise


def _run_batch(
    res: Resources, call: CallContext, model: str, batch: Batch[Member], run_plan: RunPlan
) -> Generator[Wait, Any, list[Handle]]:
    members = [m for m in batch.members if m is batch.leader or m.alive]
    for ended in batch.members:
        if ended not in members:
            release(ended)
    total = sum(m.samples for m in members)
    sample_shape = tuple(members[0].inputs[0].shape[1:])
    plan = yield from res.plan_for(model, total, sample_shape)
    check_sliceable(model, plan, total)
    with (yield from res.weights(plan)):
        stream = call.inst.stream
        for m in members[1:]:
            stream.wait_event(m.ready)
        gathered: dict[str, DeviceTensor] = {}
        outputs: list[DeviceTensor] = []
        try:
            for i, name in enumerate(plan.inputs):
                var = plan.variables[name]
                t = gathered[name] = res.alloc(call.inst, var.torch_dtype, tuple(var.shape), quota=False)
                offset = 0
                for m in members:
                    src = m.inputs[i]
                    res.runtime.copy_dtod_async(t.address + offset, src.address, src.nbytes, stream)
                    offset += src.nbytes
            result = yield from run_plan(res, call, model, plan, gathered)
            outputs.extend(result.outputs[name] for name in plan.outputs)
            per_member = _scatter(res, call, outputs, members)
        finally:  # the batch's own buffers go back to the pool after its work, whatever happened
            spent = {t.address for t in gathered.values()} | {t.address for t in outputs}
            res.memory.pool.free_many(spent, stream)
            res.memory.pool.fence(stream)
        done = res.record(stream)
    res.batching.batches_run += 1
    res.batching.members_batched += len(members)
    res.batching.sizes.append(total)
    return _hand_out(res, call, batch, members, per_member, done)


def _hand_out(
    res: Resources,
    call: CallContext,
    batch: Batch[Member],
    members: list[Member],
    per_member: list[list[DeviceTensor]],
    done: Event,
) -> list[Handle]:
    """Each member's rows registered to its own invocation (the followers' through their `result`);
    the leader's returned. Rows past a member's quota, or of a member that ended, are freed."""
    refused: QuotaExceeded | None = None
    for m, tensors in zip(members, per_member, strict=True):
        if m is not batch.leader and not m.alive:  # ended while the batch ran: nobody to own its rows
            res.memory.pool.free_many([t.address for t in tensors], call.inst.stream)
            release(m)
            continue
        try:  # its rows count against its own invocation's quota, as its own inference's would
            res.check_quota(m.call.inst.spec.name, m.call.inv, sum(t.nbytes for t in tensors))
        except QuotaExceeded as exc:
            res.memory.pool.free_many([t.address for t in tensors], call.inst.stream)
            if m is batch.leader:
                refused = exc  # raised once the followers have their rows: theirs are their own
            else:
                m.result.set_exception(exc)
            continue
        handles = [res.register(t, m.call.inv) for t in tensors]
        if m is batch.leader:
            mine = handles
        else:
            m.call.inst.stream.wait_event(done)  # its next call sees its rows written
            m.result.set_result(handles)
    if refused is not None:
        raise refused
    return mine


def check_sliceable(model: str, plan: KernelPlan, total: int) -> None:
    """Raise unless every output of `plan` (the batch's) can be cut into its callers' rows: batch-major
    over `total` samples, contiguous, and not a view of a weight."""
    for name in plan.outputs:
        var = plan.variables[name]
        contiguous = tuple(var.strides) == contiguous_strides(tuple(var.shape))
        own = plan.variables[plan.root(name)].kind != "weight"
        if not var.shape or var.shape[0] != total or not contiguous or not own:
            raise ProxyError(
                f"model {model!r} cannot be batched: its output {name} of shape {list(var.shape)} "
                f"(batch {total}) is not a contiguous buffer leading with the batch; set max_batch_size: 1 "
                f"for its function"
            )


def _scatter(
    res: Resources, call: CallContext, outputs: list[DeviceTensor], members: list[Member]
) -> list[list[DeviceTensor]]:
    """Each member's rows of every output, copied (on the leader's stream) into buffers of its own."""
    stream = call.inst.stream
    per_member: list[list[DeviceTensor]] = [[] for _ in members]
    for out in outputs:
        row_bytes = out.nbytes // int(out.shape[0])
        offset = 0
        for mine, m in zip(per_member, members, strict=True):
            t = res.alloc(call.inst, out.dtype, (m.samples, *out.shape[1:]), quota=False)  # its caller's
            res.runtime.copy_dtod_async(t.address, out.address + offset, t.nbytes, stream)
            offset += m.samples * row_bytes
            mine.append(t)
    return per_member
