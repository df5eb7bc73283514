"""Batched inference inside one monolithic instance: the handlers of one message share plan runs.

The invoker sends an instance the invocations it gathered as one message (`monolithic.py`); the
instance runs their handlers on threads, each with its own `InstanceContext` and stream as for a
single invocation. Their `infer` calls meet in the message's `BatchRun` (policy: `infer_groups.py`):
calls of one model and per-sample input shape run as ONE inference at the summed batch size.

The first call of a group leads it: on its own stream it waits for every member's stream to reach its
`infer` (an event recorded at the join), copies the members' rows into one input, runs the plan of the
total batch (`_InstanceWorkflow.model`: the weights already resident, plans prepared at start), copies
each member's rows of every output into a tensor of its own (freed when its invocation ends, as an
unbatched output) and frees the gathered input and whole outputs. Every member's stream then waits for
the leader's work, so each handler sees outputs of its own shape, `[its samples, ...]`, as if it had run
alone. A group that closes with one call runs that call's own plan on its own stream (no copies). A
batched run that fails fails the `infer` of each of its members (each handler may handle it).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from typing import Any

from streambox.api_proxy.batched_infer import check_sliceable, joinable
from streambox.api_proxy.batcher import Batch, Limits
from streambox.api_proxy.device_tensor import DeviceTensor
from streambox.device import Event, Stream
from streambox.device.base import contiguous_strides

from .infer_groups import InferGroups
from .local import LocalContext, _LocalWorkflow, ready_event


@dataclass
class InferCounts:
    """What an instance's `infer` calls cost: plan runs against the calls they served (thread-safe)."""

    plan_runs: int = 0  # inferences run on the device (a batch counts once)
    infer_calls: int = 0  # `ctx.infer` calls served
    batched_runs: int = 0  # plan runs that served more than one call
    batched_calls: int = 0  # calls served by those
    sizes: list[int] = field(default_factory=list)  # samples of each batched run (recent ones)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def add(self, calls: int, samples: int) -> None:
        """One plan run that served `calls` calls of `samples` samples in all."""
        with self._lock:
            self.plan_runs += 1
            self.infer_calls += calls
            if calls > 1:
                self.batched_runs += 1
                self.batched_calls += calls
                self.sizes = [*self.sizes[-255:], samples]

    def to_json(self) -> dict[str, Any]:
        with self._lock:
            return {
                "plan_runs": self.plan_runs,
                "infer_calls": self.infer_calls,
                "batched_runs": self.batched_runs,
                "batched_calls": self.batched_calls,
                "batch_sizes": list(self.sizes),
            }


@dataclass(eq=False)
class _Call:
    """One member's `infer` waiting in a group: its input, stream, and what it gets back."""

    tensor: DeviceTensor
    stream: Stream
    ready: Event | None  # recorded on the member's stream at the join: its input is written by then
    alone: Callable[[], list[DeviceTensor]]  # its own plan run, when nobody joined it
    group: Batch[_Call] | None = None  # set when its group closes
    outputs: list[DeviceTensor] | None = None
    error: BaseException | None = None
    done: Event | None = None  # the leader's work: the member's stream waits for it

    @property
    def samples(self) -> int:
        return int(self.tensor.shape[0])


class BatchRun:
    """The `infer` rendezvous of one batched message's members (see the module)."""

    def __init__(self, wf: _LocalWorkflow, members: int, limits: Limits, counts: InferCounts) -> None:
        self._wf = wf
        self._counts = counts
        self._groups: InferGroups[_Call] = InferGroups(members, limits)
        self._cond = threading.Condition()

    def infer(
        self, model: str, tensor: DeviceTensor, stream: Stream, alone: Callable[[], list[DeviceTensor]]
    ) -> list[DeviceTensor]:
        """The outputs of `model` on `tensor` for the member on `stream`, from a batched run when
        other members' calls join it (`alone`: this call's own run)."""
        if not joinable(self._groups.limits, [tensor]):
            self._counts.add(1, int(tensor.shape[0]))
            return alone()
        call = _Call(tensor, stream, ready_event(self._wf.runtime, stream), alone)
        with self._cond:
            kind = (model, tuple(tensor.shape[1:]))
            self._closed(self._groups.join(kind, call, call.samples, time.monotonic()))
            while call.group is None:
                deadline = self._groups.next_deadline()
                self._cond.wait(None if deadline is None else max(0.0, deadline - time.monotonic()))
                self._closed(self._groups.due(time.monotonic()))
        group = call.group
        if call is group.leader:
            self._lead(model, group)
        with self._cond:
            while call.outputs is None and call.error is None:
                self._cond.wait()
        if call.error is not None:
            raise call.error
        if call.done is not None:
            stream.wait_event(call.done)  # its rows are written by the leader's stream
        assert call.outputs is not None
        return call.outputs

    def finished(self) -> None:
        """A member's handler returned or raised: it will join no group."""
        with self._cond:
            self._closed(self._groups.finished())

    def _closed(self, groups: list[Batch[_Call]]) -> None:
        for group in groups:
            for call in group.members:
                call.group = group
        if groups:
            self._cond.notify_all()

    def _lead(self, model: str, group: Batch[_Call]) -> None:
        """Run the group (on the leader's thread and stream) and hand every member its outputs."""
        calls = group.members
        try:
            if len(calls) == 1:
                per_call: list[list[DeviceTensor]] = [calls[0].alone()]
                done = None
            else:
                per_call, done = self._run_batched(model, calls)
            self._counts.add(len(calls), group.total)
            error = None
        except Exception as exc:  # every member's infer fails with it
            per_call, done, error = [], None, exc
        with self._cond:
            for i, call in enumerate(calls):
                call.error = error
                if error is None:
                    call.outputs, call.done = per_call[i], done if i else None
            self._groups.resumed(len(calls))
            self._cond.notify_all()

    def _run_batched(self, model: str, calls: list[_Call]) -> tuple[list[list[DeviceTensor]], Event | None]:
        """Gather the calls' rows, run the plan of their total, scatter each call's rows of every
        output into tensors of its own; the event the members' streams wait for."""
        wf, stream = self._wf, calls[0].stream
        total = sum(c.samples for c in calls)
        resident = wf.model(model, total, tuple(calls[0].tensor.shape[1:]))
        plan = resident.plan
        check_sliceable(model, plan, total)
        for call in calls[1:]:
            if call.ready is not None:
                stream.wait_event(call.ready)
        first = calls[0].tensor
        spent: list[DeviceTensor] = []  # freed whatever happens (the instance's pool is static)
        per_call: list[list[DeviceTensor]] = [[] for _ in calls]
        try:
            gathered = self._alloc(first.dtype, (total, *first.shape[1:]), stream)
            spent.append(gathered)
            offset = 0
            for call in calls:
                source = call.tensor
                wf.runtime.copy_dtod_async(gathered.address + offset, source.address, source.nbytes, stream)
                offset += source.nbytes
            run = wf.executor.run(resident, {plan.inputs[0]: gathered}, stream)
            outputs = [run.outputs[name] for name in plan.outputs]
            spent.extend(outputs)
            for out in outputs:
                offset = 0
                for mine, call in zip(per_call, calls, strict=True):
                    rows = self._alloc(out.dtype, (call.samples, *out.shape[1:]), stream)
                    mine.append(rows)
                    wf.runtime.copy_dtod_async(rows.address, out.address + offset, rows.nbytes, stream)
                    offset += rows.nbytes
        except BaseException:  # nobody gets rows: free the members' too
            spent.extend(rows for mine in per_call for rows in mine)
            raise
        finally:
            for tensor in spent:  # stream-ordered: after the copies above
                wf.allocator.free(tensor.address, stream)
        return per_call, ready_event(wf.runtime, stream)

    def _alloc(self, dtype: Any, shape: tuple[int, ...], stream: Stream) -> DeviceTensor:
        nbytes = dtype.itemsize
        for d in shape:
            nbytes *= d
        address = self._wf.allocator.allocate(nbytes, stream)
        return DeviceTensor(address, dtype, shape, contiguous_strides(shape), nbytes)


class InstanceContext(LocalContext):
    """A monolithic instance's `ctx`: run-local's, counting its inferences, and running them through
    its message's `BatchRun` when it is one member of a batched message."""

    def __init__(
        self,
        wf: _LocalWorkflow,
        function: str,
        stream: Stream,
        request_id: str,
        counts: InferCounts,
        batch: BatchRun | None = None,
    ) -> None:
        super().__init__(wf, function, stream, request_id)
        self._counts = counts
        self._batch = batch

    def _run_model(self, model: str, tensor: DeviceTensor) -> list[DeviceTensor]:
        alone = partial(LocalContext._run_model, self, model, tensor)
        if self._batch is None:
            self._counts.add(1, int(tensor.shape[0]))
            return alone()
        return self._batch.infer(model, tensor, self._stream, alone)
