"""Where an invocation's time goes inside the proxy, measured where it happens (pure bookkeeping).

The phases of a request (docs/api_proxy.md, "Per-request phase timings"):

- `cold_start`: starting a function instance (spare or fork, stream, registration);
- `queue`: waiting for an instance (the proxy's scheduler; the engine adds its own `max_instances` wait);
- `model_load`: a call waiting for a model's plan to be lowered or its weights to be resident;
- `compute`: an inference or kernel launch being issued, and the instance's device work completing
  (a download's wait for its stream, the result's wait for the request's device work); the latter
  is also reported on its own as `device_wait`, so that host and device time can be told apart;
- `comm`: data in and out of the device and between functions (upload, download, put, get, delete,
  memcpy), including a GET's wait for its key's PUT;
- `other`: the rest (handler code, the channel, the control hop, invoker and engine).

`PhaseClock` adds intervals as they end. Intervals of one invocation may overlap (an asynchronous
download's wait beside the next call), so only the part of an interval after the latest end already
counted is added: overlapping time is counted once, under the phase whose interval ended first.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

COLD_START, QUEUE, MODEL_LOAD, COMPUTE, COMM, OTHER = (
    "cold_start",
    "queue",
    "model_load",
    "compute",
    "comm",
    "other",
)
#: Every phase, in the order a breakdown shows them; they add up to the latency they break down.
PHASES = (COLD_START, QUEUE, MODEL_LOAD, COMPUTE, COMM, OTHER)
#: Part of `compute`: waiting for the instance's device work to complete once it is issued (the rest
#: of `compute` is the host issuing it). Reported beside the phases as a detail, never added twice.
DEVICE_WAIT = "device_wait"

#: The phase of each forwarded op's own time (its waits carry their own phase).
OP_PHASES = {
    "infer": COMPUTE,
    "launch": COMPUTE,
    "synchronize": COMPUTE,
    "plan": MODEL_LOAD,
    "upload": COMM,
    "download": COMM,
    "put": COMM,
    "get": COMM,
    "delete": COMM,
    "memcpy": COMM,
}


def op_phase(op: str) -> str:
    """The phase an op's own time counts under (`other` for bookkeeping ops: noop, alloc, free)."""
    return OP_PHASES.get(op, OTHER)


@dataclass
class PhaseClock:
    """Seconds per phase of one invocation, overlapping intervals counted once (see the module doc)."""

    seconds: dict[str, float] = field(default_factory=dict)
    counted_until: float = float("-inf")

    def add(self, phase: str, start: float, end: float) -> None:
        """Count the interval [start, end] (ended now) under `phase`, less what is counted already."""
        gained = end - max(start, self.counted_until)
        if gained > 0:
            self.seconds[phase] = self.seconds.get(phase, 0.0) + gained
        self.counted_until = max(self.counted_until, end)

    def total(self) -> float:
        return sum(self.seconds.values())


def split_call(total_s: float, measured: dict[str, float]) -> dict[str, float]:
    """Every phase of one call: `measured` (seconds by phase) and `other`, the rest of `total_s`.

    `other` is never made up: where the measured phases exceed the total (overcounted), it is the
    (negative) difference, which the tests catch."""
    allowed = PHASES[:-1]
    unknown = set(measured) - set(allowed)
    if unknown:
        raise ValueError(f"unknown phase(s) {sorted(unknown)}; measured phases are {', '.join(allowed)}")
    out = {phase: float(measured.get(phase, 0.0)) for phase in allowed}
    out[OTHER] = total_s - sum(out.values())
    return out


def request_phases(path: list[Mapping[str, float]], path_wall_s: float, latency_s: float) -> dict[str, float]:
    """A request's phases: those of the calls on its critical path (each call's phases, `other`
    included, adding up to its wall time) plus, as `other`, the engine's time around them: the request
    latency less the path's summed wall time (gaps between a call's end and the next one's start)."""
    out = dict.fromkeys(PHASES, 0.0)
    for phases in path:
        for phase, seconds in phases.items():
            out[phase] += seconds
    out[OTHER] += latency_s - path_wall_s
    return out
