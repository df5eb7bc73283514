"""The proxy's records of invocations and instances, and its counters: plain data, no behaviour."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Any

from streambox.device import Stream
from streambox.phases import PhaseClock

from .function_spec import ProxyFunction
from .idle_cpu import IdleCpu


@dataclass(eq=False)
class Invocation:
    id: int
    function: str
    request_id: str
    event: Any
    reply_to: tuple[bytes, int]  # control route, call id
    arrived: float
    deadline: float
    limit: float  # seconds the handler may run (the request's timeout, else the function's)
    cold: bool = False
    instance: int | None = None
    dispatched: float | None = None
    start_s: float = 0.0  # instance start (fork + stream + registration), cold starts only
    result_at: float | None = None  # when the handler's result arrived
    leases: list[Any] = field(default_factory=list)  # the store's handles this request got
    phases: PhaseClock = field(default_factory=PhaseClock)  # its calls' time by phase (`phases.py`)

    @property
    def holder(self) -> tuple[str, int]:
        return ("inv", self.id)


@dataclass(eq=False)
class Instance:
    id: int
    spec: ProxyFunction
    stream: Stream
    state: str  # starting, busy, finishing, idle, stopping, dead
    created: float
    deadline: float  # starting: registration deadline; stopping: kill deadline
    pid: int | None = None
    pidfd: int | None = None
    invocation: Invocation | None = None
    first: Invocation | None = None  # the request that started it
    gates: list[Any] = field(default_factory=list)  # IO-daemon tickets the stream must wait on
    refill: bool = False  # it took a pre-forked spare: ask for a new one after its first request
    held: deque[Any] | None = None  # a call waits off the dispatcher: its later messages, in order
    issue: Any = None  # the `issuer.IssueTicket` of its plan being issued off the dispatcher, if any
    dispatched: int = 0  # invocations sent to it
    idle_cpu: IdleCpu = field(default_factory=IdleCpu)  # CPU it used while serving nothing

    @property
    def key(self) -> str:
        return f"{self.spec.name}#{self.id}"


@dataclass
class ProxyStats:
    invocations: int = 0
    failures: int = 0
    cold_starts: int = 0
    instances_started: int = 0
    instances_stopped: int = 0
    instances_died: int = 0
    idle_cpu_stops: int = 0  # instances stopped for the CPU they used while idle (`idle_cpu.py`)
    cancelled: int = 0  # invocations stopped or unqueued because their request ended (`abandon`)
    calls: int = 0
    protocol_errors: int = 0  # instances ended for a malformed message
    cold_start_s: list[float] = field(default_factory=list)  # fork + stream + registration, recent
