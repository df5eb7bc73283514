"""The contract between the workflow engine and whatever runs functions.

The engine never runs a handler itself: it calls an `Invoker`. The API proxy side implements one over
the real proxy (function instances forked from a warm template, one stream each); `local.py` has the
embedded one (handlers in threads of this process, on the real executor and device).

Rules every invoker follows:

- `deploy(spec)` comes before any `invoke` of that workflow (it may start the proxy, import handlers,
  prepare plans); deploying a workflow again with the same name replaces nothing and is allowed.
- `invoke` runs the handler of `function` once with `event` (a JSON object) and returns its JSON-able
  output. `request_id` scopes the keys the handler makes with `ctx.key(...)`. `timeout_s`, when given,
  is what is left of the request's time: past it the invoker stops the invocation if it can and
  raises `InvocationTimeout`. A handler that raises is reported as `InvocationError` (never as the
  handler's own exception type: it may live in another process).
- `end_request(workflow, request_id)` is called exactly once per request, after its last invocation
  returned or was abandoned (failure, timeout): it drops every key of that request still stored and
  must also drop keys that an abandoned invocation still running puts afterwards.
- Optional: `async pin_warm(workflow, pinned)` pauses (True) and resumes (False) the keep-alive of a
  deployed workflow's warm proxy and instances; resuming counts them as used then. A replay pins each
  workflow once deployed and resumes them all when its clock starts, so that a time-compressed
  keep-alive does not run out during the deploys that follow a workflow's own.
- Invokers are used from one asyncio event loop; `invoke` may be called concurrently (the engine
  limits each function to its `max_instances` concurrent invocations).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar, runtime_checkable

from .spec import WorkflowSpec


@dataclass(frozen=True)
class InvocationResult:
    output: Any  # JSON-able: dict, list, str, number, bool or None
    cold_start: bool  # a new function instance was started for this invocation
    latency_s: float  # from the invoker taking the call to the output being ready, cold start included
    #: seconds by phase, measured where they happened (`streambox.phases`: cold_start, queue,
    #: model_load, compute, comm); what the invoker cannot measure is left out (the engine's `other`)
    phases: Mapping[str, float] = field(default_factory=dict)
    #: where parts of the rest (`other`) went, in seconds, as far as the invoker can tell (e.g. the
    #: handler's own code and channel, the control hop); the engine adds its own share
    other: Mapping[str, float] = field(default_factory=dict)
    #: parts of measured phases worth telling apart (`device_wait`: of `compute`, the wait for the
    #: device work once issued), in seconds; already counted in `phases`
    detail: Mapping[str, float] = field(default_factory=dict)


class InvocationError(Exception):
    """A handler raised (or its instance died); says which function and what happened."""

    def __init__(self, function: str, error_type: str, message: str, traceback: str | None = None) -> None:
        super().__init__(f"{error_type}: {message}")
        self.function = function
        self.error_type = error_type
        self.message = message
        self.traceback = traceback


class InvocationTimeout(TimeoutError):
    """An invocation ran past its time limit."""


@dataclass(frozen=True)
class RuntimeStats:
    """One workflow's runtime on one device, for the gateway's gauges (`/metrics`)."""

    workflow: str
    device: int
    memory_used_bytes: int  # the whole device, every runtime counted
    memory_total_bytes: int
    pool_reserved_bytes: int  # this workflow's memory pool: bytes taken from the device
    pool_used_bytes: int  # of which handed out (weights, activations, stored data)
    instances: Mapping[str, int] = field(default_factory=dict)  # live function instances per function
    unprofiled_runs: int = 0  # model runs the pool's scaler saw without an offline profile (fm+rs)
    batches: int = 0  # batched inferences run (more than one invocation each; docs/workflows.md)
    batched_calls: int = 0  # the invocations' calls they served


#: The callback the gateway polls on each scrape of `/metrics`.
StatsSource = Callable[[], Iterable[RuntimeStats]]


W = TypeVar("W")


def deployed(workflows: Mapping[str, W], workflow: str) -> W:
    """An invoker's record of `workflow`, or a `KeyError` naming the deployed ones."""
    wf = workflows.get(workflow)
    if wf is None:
        raise KeyError(f"workflow {workflow!r} is not deployed; deployed: {', '.join(workflows)}")
    return wf


@runtime_checkable
class Invoker(Protocol):
    async def deploy(self, spec: WorkflowSpec) -> None: ...

    async def invoke(
        self,
        workflow: str,
        function: str,
        event: dict[str, Any],
        request_id: str,
        *,
        timeout_s: float | None = None,
    ) -> InvocationResult: ...

    async def end_request(self, workflow: str, request_id: str) -> None: ...

    async def close(self) -> None: ...
