"""Running one request of a workflow DAG through an `Invoker`.

The engine invokes the entry functions with the request's event, follows the edges as outputs arrive
(fan-out: one downstream invocation per list item; fan-in: one invocation once every upstream
invocation has finished), and assembles the response's output (rules in `spec.py`). Data between
functions travels as request-scoped keys that handlers put and get through their `ctx`; the events
carry only the keys and small JSON values.

Each invocation is recorded (latency as the invoker measured it, time queued behind the function's
`max_instances`, cold start). A failing or timed-out invocation fails its request: the other
invocations of that request are cancelled, its keys are dropped (`Invoker.end_request`) and the
result says which function failed and why. Nothing a handler does can raise out of `Engine.run`.

Bounds: a fan-out longer than its edge's `max_items`, or an output that would start invocations past
the workflow's `max_invocations` (all of the request's together), fails the call; items start lazily, at most
`LAUNCH_WINDOW` x `max_instances` tasks per function and request at a time (back-pressure), so a wide
fan-out neither stalls the event loop nor holds a task per item; dropping a request's keys waits at
most `END_REQUEST_WAIT_S` (a dead proxy answers at once through its client's liveness check).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from collections import defaultdict, deque
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from streambox.phases import OTHER, QUEUE, request_phases, split_call

from .invoker import InvocationError, InvocationTimeout, Invoker
from .spec import MAX_INVOCATIONS_CEILING, MAX_ITEMS_CEILING, EdgeSpec, WorkflowGraph, WorkflowSpec

log = logging.getLogger(__name__)

Path = tuple[int, ...]  # positions in the fan-out lists on the way to an invocation

OK, ERROR, TIMEOUT, CANCELLED = "ok", "error", "timeout", "cancelled"
LAUNCH_WINDOW = 2  # launched invocations per function and request, in units of its max_instances
END_REQUEST_WAIT_S = 2.0  # the longest a request's answer waits for its keys to be dropped
#: What the outputs of one request's invocations may hold in the gateway together, in bytes of JSON:
#: they are kept until the request ends and become fan-in events and the response, both bounded like
#: a request's body (each output alone is bounded the same way where it is made).
MAX_REQUEST_OUTPUT_BYTES = 64 << 20


class UnknownWorkflow(KeyError):
    def __init__(self, name: str, known: list[str]) -> None:
        super().__init__(name)
        self.name = name
        self.known = sorted(known)

    def __str__(self) -> str:
        return f"unknown workflow {self.name!r}; deployed: {', '.join(self.known) or 'none'}"


def new_request_id() -> str:
    return uuid.uuid4().hex


def call_label(function: str, path: Path) -> str:
    """`face[2]`: the third item of a fan-out; `report`: a function that runs once."""
    return function + "".join(f"[{i}]" for i in path)


@dataclass
class CallRecord:
    """One invocation of one function within a request."""

    function: str
    path: Path
    status: str = "running"  # ok | error | timeout | cancelled
    cold_start: bool = False
    latency_s: float | None = None  # as the invoker measured it (cold start included)
    queued_s: float = 0.0  # waiting for a free instance (max_instances)
    wall_s: float = 0.0  # from being ready to run to its end, as the engine saw it
    error: str | None = None
    error_type: str | None = None  # the handler's exception class (`InvocationError.error_type`)
    after: CallRecord | None = None  # the call whose end made this one ready (None: an entry)
    ready_s: float = 0.0  # when it became ready, from the start of the request
    #: seconds by phase (`streambox.phases`), adding up to `wall_s`; empty unless it succeeded
    phases: dict[str, float] = field(default_factory=dict)
    #: `other` by where it went: the invoker's parts (`InvocationResult.other`) and `engine`, the rest
    other: dict[str, float] = field(default_factory=dict)
    detail: dict[str, float] = field(default_factory=dict)  # `InvocationResult.detail`

    @property
    def label(self) -> str:
        return call_label(self.function, self.path)

    def to_json(self) -> dict[str, Any]:
        return {
            "function": self.function,
            "call": self.label,
            "status": self.status,
            "cold_start": self.cold_start,
            "latency_ms": None if self.latency_s is None else round(self.latency_s * 1e3, 3),
            "queued_ms": round(self.queued_s * 1e3, 3),
            "wall_ms": round(self.wall_s * 1e3, 3),
            "after": self.after.label if self.after is not None else None,
            "phases_ms": _ms(self.phases),
            "other_ms": _ms(self.other),
            "detail_ms": _ms(self.detail),
            **({"error": self.error} if self.error else {}),
        }


@dataclass
class RequestResult:
    request_id: str
    workflow: str
    status: str  # ok | error | timeout
    output: Any
    latency_s: float
    slo_ms: float
    calls: list[CallRecord] = field(default_factory=list)
    error: str | None = None
    failed_call: str | None = None
    traceback: str | None = None
    error_type: str | None = None  # the failed call's handler exception class, if a handler raised

    @property
    def ok(self) -> bool:
        return self.status == OK

    @property
    def cold_starts(self) -> int:
        return sum(c.cold_start for c in self.calls)

    def critical_path(self) -> list[CallRecord]:
        """The chain of calls that decided the latency: from the call that ended last, back through
        the calls whose end made each one ready."""
        ended = [c for c in self.calls if c.phases]
        if not ended:
            return []
        call: CallRecord | None = max(ended, key=lambda c: c.ready_s + c.wall_s)
        path = []
        while call is not None:
            path.append(call)
            call = call.after
        return path[::-1]

    def phases(self) -> dict[str, float]:
        """Seconds by phase along the critical path, adding up to the latency (empty unless ok)."""
        path = self.critical_path()
        if not self.ok or not path:
            return {}
        return request_phases([c.phases for c in path], sum(c.wall_s for c in path), self.latency_s)

    def other(self) -> dict[str, float]:
        """The `other` phase by where it went along the critical path; `engine` includes the gaps
        between the path's calls and the request's start and end."""
        path = self.critical_path()
        if not self.ok or not path:
            return {}
        out: dict[str, float] = {}
        for call in path:
            for part, seconds in call.other.items():
                out[part] = out.get(part, 0.0) + seconds
        out["engine"] = out.get("engine", 0.0) + self.latency_s - sum(c.wall_s for c in path)
        return out

    def detail(self) -> dict[str, float]:
        """The calls' `detail` (parts of their phases) summed along the critical path."""
        out: dict[str, float] = {}
        for call in self.critical_path() if self.ok else []:
            for part, seconds in call.detail.items():
                out[part] = out.get(part, 0.0) + seconds
        return out

    @property
    def slo_met(self) -> bool:
        return self.ok and self.latency_s * 1e3 <= self.slo_ms

    def breakdown(self) -> dict[str, dict[str, Any]]:
        """Per function: invocations, cold starts, summed and slowest invoker latency."""
        out: dict[str, dict[str, Any]] = {}
        for call in self.calls:
            row = out.setdefault(
                call.function,
                {"invocations": 0, "cold_starts": 0, "total_ms": 0.0, "max_ms": 0.0, "queued_ms": 0.0},
            )
            row["invocations"] += 1
            row["cold_starts"] += call.cold_start
            ms = (call.latency_s or 0.0) * 1e3
            row["total_ms"] = round(row["total_ms"] + ms, 3)
            row["max_ms"] = round(max(row["max_ms"], ms), 3)
            row["queued_ms"] = round(row["queued_ms"] + call.queued_s * 1e3, 3)
        return out

    def to_json(self) -> dict[str, Any]:
        body: dict[str, Any] = {
            "request_id": self.request_id,
            "workflow": self.workflow,
            "status": self.status,
            "output": self.output,
            "latency_ms": round(self.latency_s * 1e3, 3),
            "slo_ms": self.slo_ms,
            "slo_met": self.slo_met,
            "cold_starts": self.cold_starts,
            "breakdown": self.breakdown(),
            "phases_ms": _ms(self.phases()),
            "other_ms": _ms(self.other()),
            "detail_ms": _ms(self.detail()),
            "calls": [c.to_json() for c in self.calls],
        }
        if not self.ok:
            body.update(error=self.error, failed_call=self.failed_call)
            if self.error_type:
                body["error_type"] = self.error_type
            if self.traceback:
                body["traceback"] = self.traceback
        return body


def _ms(seconds: Mapping[str, float]) -> dict[str, float]:
    return {phase: round(s * 1e3, 3) for phase, s in seconds.items()}


class _CallFailed(Exception):
    def __init__(
        self,
        record: CallRecord,
        message: str,
        *,
        timeout: bool = False,
        deadline: bool = False,
        tb: str | None = None,
    ) -> None:
        super().__init__(message)
        self.record = record
        self.timeout = timeout or deadline
        self.deadline = deadline  # the request's deadline passed (not the function's own limit)
        self.traceback = tb


@dataclass
class _Deployed:
    spec: WorkflowSpec
    graph: WorkflowGraph
    many: dict[str, bool]
    order: dict[str, int]
    slots: dict[str, asyncio.Semaphore]


class _Run:
    """The state of one request: in-flight invocations per function, what fan-ins collected."""

    def __init__(self, engine: Engine, wf: _Deployed, request_id: str) -> None:
        self.invoker = engine.invoker
        self.wf = wf
        self.request_id = request_id
        self.inflight: dict[str, int] = defaultdict(int)  # launched or waiting for a launch
        self.running: dict[str, int] = defaultdict(int)  # launched tasks
        self.waiting: dict[str, deque[tuple[Any, Path]]] = defaultdict(deque)
        self.complete: set[str] = set()
        self.fan_in_started: set[str] = set()
        self.collected: dict[str, dict[str, list[tuple[Path, Any]]]] = defaultdict(lambda: defaultdict(list))
        self.outputs: dict[str, list[tuple[Path, Any]]] = defaultdict(list)
        self.calls: list[CallRecord] = []
        self.launched = 0  # invocations launched or waiting for a launch, all functions together
        self.output_bytes = 0  # of JSON, every output so far together (`MAX_REQUEST_OUTPUT_BYTES`)
        self.deadline = 0.0
        self.started = time.perf_counter()
        self._group: asyncio.TaskGroup | None = None

    async def execute(self, event: dict[str, Any], timeout_s: float) -> None:
        loop = asyncio.get_running_loop()
        self.deadline = time.perf_counter() + timeout_s
        async with asyncio.timeout_at(loop.time() + timeout_s), asyncio.TaskGroup() as group:
            self._group = group
            for name in self.wf.graph.entries:
                self._launch(name, event, (), None)

    def _event(self, function: str, item: Any) -> dict[str, Any]:
        event = dict(item) if isinstance(item, dict) else {"value": item}
        # The function's YAML params, always: a caller's own "params" key must not reach the handler
        # as its author's settings (an image size, a box limit) that nothing else bounds.
        event["params"] = dict(self.wf.spec.functions[function].params)
        return event

    def _launch(self, function: str, item: Any, path: Path, after: CallRecord | None) -> None:
        self.launched += 1
        self.inflight[function] += 1
        self.waiting[function].append((item, path, after))
        self._pump(function)

    def _pump(self, function: str) -> None:
        """Start waiting items of `function` while fewer than its window are running."""
        assert self._group is not None
        window = LAUNCH_WINDOW * self.wf.spec.functions[function].max_instances
        waiting = self.waiting[function]
        while waiting and self.running[function] < window:
            item, path, after = waiting.popleft()
            self.running[function] += 1
            record = CallRecord(function, path, after=after)
            self.calls.append(record)
            self._group.create_task(self._call(record, self._event(function, item)))

    async def _call(self, record: CallRecord, event: dict[str, Any]) -> None:
        fn = self.wf.spec.functions[record.function]
        started = time.perf_counter()
        record.ready_s = started - self.started
        try:
            async with self.wf.slots[record.function]:
                record.queued_s = time.perf_counter() - started
                remaining = max(self.deadline - time.perf_counter(), 0.0)
                own = fn.timeout_ms / 1e3 if fn.timeout_ms is not None else None
                limit = remaining if own is None else min(remaining, own)
                try:
                    async with asyncio.timeout(limit):
                        result = await self.invoker.invoke(
                            self.wf.spec.name, record.function, event, self.request_id, timeout_s=limit
                        )
                except TimeoutError as error:  # asyncio's or the invoker's InvocationTimeout
                    record.status = TIMEOUT
                    if own is None or remaining <= own:
                        record.error = "the request's deadline passed"
                        raise _CallFailed(record, record.error, deadline=True) from error
                    record.error = f"timed out after {limit:.3f} s"
                    raise _CallFailed(record, f"{record.label} {record.error}", timeout=True) from error
        except asyncio.CancelledError:
            record.status = CANCELLED
            raise
        except _CallFailed:
            raise
        except InvocationError as error:
            record.status = ERROR
            record.error = f"{error.error_type}: {error.message}"
            record.error_type = error.error_type
            message = f"{record.label} failed: {record.error}"
            raise _CallFailed(record, message, tb=error.traceback) from error
        except Exception as error:  # the invoker itself broke: still only this request fails
            record.status = ERROR
            record.error = f"{type(error).__name__}: {error}"
            raise _CallFailed(record, f"{record.label} failed: {record.error}") from error
        finally:
            record.wall_s = time.perf_counter() - started
        record.status = OK
        record.cold_start = result.cold_start
        record.latency_s = result.latency_s
        measured = dict(result.phases)
        measured[QUEUE] = measured.get(QUEUE, 0.0) + record.queued_s  # the engine's own wait too
        record.phases = split_call(record.wall_s, measured)
        record.other = {**result.other, "engine": record.phases[OTHER] - sum(result.other.values())}
        record.detail = dict(result.detail)
        self._deliver(record, result.output)
        self.running[record.function] -= 1
        self.inflight[record.function] -= 1
        self._pump(record.function)
        self._settle(record.function, record)

    def _deliver(self, record: CallRecord, output: Any) -> None:
        self.output_bytes += len(json.dumps(output, default=str))  # JSON from a proxy; any invoker's counts
        if self.output_bytes > MAX_REQUEST_OUTPUT_BYTES:
            record.status = ERROR
            record.error = (
                f"the request's outputs hold {self.output_bytes} bytes of JSON with this one, more than "
                f"{MAX_REQUEST_OUTPUT_BYTES}: put large data in the store (ctx.put) and return its key"
            )
            raise _CallFailed(record, f"{record.label} failed: {record.error}")
        self.outputs[record.function].append((record.path, output))
        graph = self.wf.graph
        deliveries = [(edge, self._items(record, edge, output)) for edge in graph.downstream[record.function]]
        launches = sum(len(items) for edge, items in deliveries if not graph.is_fan_in(edge.to))
        due = set(self.collected) - self.fan_in_started  # fan-ins with items, each to run once, later
        fed = {edge.to for edge, items in deliveries if items and graph.is_fan_in(edge.to)}
        launches += len(fed - due - self.fan_in_started)  # a fan-in counts from its first item
        limit = self.wf.spec.max_invocations
        if self.launched + len(due) + launches > limit:
            record.status = ERROR
            record.error = (
                f"its output would start {launches} invocations, which would take the request past {limit} "
                f"({self.launched} so far; the workflow's max_invocations, up to {MAX_INVOCATIONS_CEILING})"
            )
            raise _CallFailed(record, f"{record.label} failed: {record.error}")
        for edge, items in deliveries:
            for path, item in items:
                if graph.is_fan_in(edge.to):
                    self.collected[edge.to][edge.source].append((path, item))
                else:
                    self._launch(edge.to, item, path, record)

    def _items(self, record: CallRecord, edge: EdgeSpec, output: Any) -> list[tuple[Path, Any]]:
        value = output
        where = f"edge {edge.source} -> {edge.to}"
        if edge.select is not None:
            if not isinstance(output, dict) or edge.select not in output:
                fields = sorted(output) if isinstance(output, dict) else type(output).__name__
                record.status = ERROR
                record.error = f"{where}: the output has no field {edge.select!r} (it has: {fields})"
                raise _CallFailed(record, f"{record.label} failed: {record.error}")
            value = output[edge.select]
        if not edge.fan_out:
            return [(record.path, value)]
        if not isinstance(value, list):
            record.status = ERROR
            record.error = f"{where} fans out, but got a {type(value).__name__}, not a list"
            raise _CallFailed(record, f"{record.label} failed: {record.error}")
        if len(value) > edge.max_items:
            record.status = ERROR
            record.error = (
                f"{where} fans out {len(value)} items; the edge allows at most {edge.max_items} "
                f"(its max_items, up to {MAX_ITEMS_CEILING})"
            )
            raise _CallFailed(record, f"{record.label} failed: {record.error}")
        return [((*record.path, i), item) for i, item in enumerate(value)]

    def _settle(self, function: str, after: CallRecord) -> None:
        """Mark `function` complete once nothing more can start it; start fan-ins that became ready
        (`after`: the call whose end made it so)."""
        graph = self.wf.graph
        if function in self.complete or self.inflight[function] > 0:
            return
        if any(e.source not in self.complete for e in graph.upstream[function]):
            return
        if graph.is_fan_in(function) and function not in self.fan_in_started:
            self.fan_in_started.add(function)
            inputs = {
                e.source: [item for _, item in sorted(self.collected[function][e.source], key=_first)]
                for e in graph.upstream[function]
            }
            self._launch(function, {"inputs": inputs}, (), after)
            return
        self.complete.add(function)
        for edge in graph.downstream[function]:
            self._settle(edge.to, after)

    def result_of(self, function: str) -> Any:
        outputs = [out for _, out in sorted(self.outputs[function], key=_first)]
        if self.wf.many[function]:
            return outputs
        return outputs[0] if outputs else None

    def output(self) -> Any:
        spec, sinks = self.wf.spec, self.wf.graph.sinks
        if spec.output is not None:
            return self.result_of(spec.output)
        if len(sinks) == 1:
            return self.result_of(sinks[0])
        return {name: self.result_of(name) for name in sinks}


def _first(pair: tuple[Path, Any]) -> Path:
    return pair[0]


def _first_failure(group: BaseExceptionGroup) -> _CallFailed | None:
    for error in group.exceptions:
        if isinstance(error, _CallFailed):
            return error
        if isinstance(error, BaseExceptionGroup) and (found := _first_failure(error)):
            return found
    return None


def _deadline_error(run: _Run, timeout_s: float) -> str:
    running = [c for c in run.calls if c.status in (CANCELLED, "running", TIMEOUT)]
    for call in running:
        call.status = TIMEOUT
    names = ", ".join(sorted(c.label for c in running)) or "-"
    return f"request timed out after {timeout_s:.3f} s; still running: {names}"


class Engine:
    """Runs requests of deployed workflows through one invoker."""

    def __init__(self, invoker: Invoker) -> None:
        self.invoker = invoker
        self._workflows: dict[str, _Deployed] = {}
        self._ending: set[asyncio.Future[None]] = set()

    @property
    def specs(self) -> Mapping[str, WorkflowSpec]:
        return {name: wf.spec for name, wf in self._workflows.items()}

    async def deploy(self, spec: WorkflowSpec) -> None:
        if spec.name in self._workflows:
            raise ValueError(f"a workflow named {spec.name!r} is already deployed")
        graph = spec.graph()
        await self.invoker.deploy(spec)
        self._workflows[spec.name] = _Deployed(
            spec=spec,
            graph=graph,
            many=graph.runs_many(),
            order={name: i for i, name in enumerate(graph.topological_order())},
            slots={name: asyncio.Semaphore(fn.max_instances) for name, fn in spec.functions.items()},
        )

    async def run(
        self,
        workflow: str,
        event: dict[str, Any],
        *,
        request_id: str | None = None,
        timeout_s: float | None = None,
    ) -> RequestResult:
        """Run one request; failures and timeouts come back as the result's status, never raised."""
        wf = self._workflows.get(workflow)
        if wf is None:
            raise UnknownWorkflow(workflow, list(self._workflows))
        request_id = request_id or new_request_id()
        timeout_s = timeout_s if timeout_s is not None else wf.spec.timeout_ms / 1e3
        run = _Run(self, wf, request_id)
        started = run.started
        status, output, error, failed, tb = OK, None, None, None, None
        error_type: str | None = None
        try:
            await run.execute(event, timeout_s)
            output = run.output()
        except TimeoutError:
            status, error = TIMEOUT, _deadline_error(run, timeout_s)
        except BaseExceptionGroup as group:
            failure = _first_failure(group)
            if failure is None:  # no invocation failed: the engine's own mistake
                log.error("workflow %s request %s: engine error", workflow, request_id, exc_info=group)
                status, error = ERROR, f"internal error: {group.exceptions[0]!r}"
            elif failure.deadline:
                status, error = TIMEOUT, _deadline_error(run, timeout_s)
            else:
                status = TIMEOUT if failure.timeout else ERROR
                error, failed, tb = str(failure), failure.record.label, failure.traceback
                error_type = failure.record.error_type
        except Exception as bug:  # the engine's own mistake must not take the gateway down
            log.exception("workflow %s request %s: engine error", workflow, request_id)
            status, error = ERROR, f"internal error: {type(bug).__name__}: {bug}"
        finally:
            await self._end_request(workflow, request_id)
        run.calls.sort(key=lambda c: (wf.order[c.function], c.path))
        return RequestResult(
            request_id=request_id,
            workflow=workflow,
            status=status,
            output=output,
            latency_s=time.perf_counter() - started,
            slo_ms=wf.spec.slo_ms,
            calls=run.calls,
            error=error,
            failed_call=failed,
            traceback=tb,
            error_type=error_type,
        )

    async def _end_request(self, workflow: str, request_id: str) -> None:
        """Drop the request's keys, waiting at most `END_REQUEST_WAIT_S`: a proxy that died answers
        at once (its client's liveness check), one that hangs must not hold the answer back; the
        clean-up goes on in the background then."""
        task = asyncio.ensure_future(self.invoker.end_request(workflow, request_id))
        self._ending.add(task)
        task.add_done_callback(self._ended)
        done, _ = await asyncio.wait({task}, timeout=END_REQUEST_WAIT_S)
        if not done:
            log.warning(
                "workflow %s request %s: end_request still running after %.1f s; answering anyway",
                workflow,
                request_id,
                END_REQUEST_WAIT_S,
            )

    def _ended(self, task: asyncio.Future[None]) -> None:
        self._ending.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.error("end_request failed", exc_info=task.exception())

    async def close(self) -> None:
        if self._ending:
            await asyncio.wait(set(self._ending), timeout=END_REQUEST_WAIT_S)
        await self.invoker.close()


__all__ = [
    "CallRecord",
    "Engine",
    "InvocationError",
    "InvocationTimeout",
    "RequestResult",
    "UnknownWorkflow",
    "call_label",
    "new_request_id",
]
