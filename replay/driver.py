"""The open-loop driver: every arrival is sent at its time, whatever is still outstanding.

One asyncio task per request; the issuing loop never awaits a response, so a slow or stuck system
cannot slow the offered load down (a closed-loop client would, and would hide queueing). Each request
is recorded with its scheduled and actual send time, the latency seen from outside, the target's
status and cold-start flag, and whether it violated the SLO. A sampler polls `Target.sample()` on a
fixed grid. The run is bounded by a count (`max_requests`) and by a duration (`max_duration_s`: no
arrival after it is sent; outstanding requests get `drain_timeout_s` more, then are cancelled).
"""

from __future__ import annotations

import asyncio
import inspect
import math
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from streambox.phases import PHASES

from .shaping import Arrival
from .target import Outcome, Target

EventFactory = Callable[[int, Arrival], dict[str, Any]]


def phase_columns(phases: Mapping[str, float]) -> dict[str, float]:
    """`Outcome.phases` (seconds) as RequestRecord's `<phase>_ms` columns (nan where not measured)."""
    return {f"{phase}_ms": phases[phase] * 1e3 if phase in phases else math.nan for phase in PHASES}


#: `DriveResult.stopped_by` when the user stopped the replay (Ctrl-C, SIGTERM: the run's `stop`).
INTERRUPTED = "interrupted"


@dataclass
class RequestRecord:
    request_id: int
    workflow: str
    function: str
    minute: int
    scheduled_s: float  # when the trace says it arrives, from the start of the run
    sent_s: float  # when the driver called Target.send
    latency_s: float  # from the send to the outcome, seen by the driver
    target_latency_s: float  # Outcome.latency_s, the target's own figure (nan when none)
    status: str
    cold_start: bool
    slo_violation: bool  # status != "ok" or latency_s > slo_s
    error: str = ""
    # Outcome.phases in ms (nan when the target did not measure them); they add up to target_latency_s
    cold_start_ms: float = math.nan
    queue_ms: float = math.nan
    model_load_ms: float = math.nan
    compute_ms: float = math.nan
    comm_ms: float = math.nan
    other_ms: float = math.nan


@dataclass
class DriveResult:
    records: list[RequestRecord]
    samples: list[dict[str, float]]
    planned: int  # arrivals after the count and duration bounds
    stopped_by: str  # "all sent", "max_requests", "max_duration" or "interrupted"
    duration_s: float  # from the start to the last completion (or cancellation)
    max_outstanding: int
    sample_errors: list[str] = field(default_factory=list)
    started_at: float = 0.0  # wall clock (time.time()) at the start


def _bounded(arrivals: Sequence[Arrival], max_requests: int | None, max_duration_s: float | None):
    stopped_by = "all sent"
    planned = list(arrivals)
    if max_duration_s is not None:
        within = [a for a in planned if a.time_s < max_duration_s]
        if len(within) < len(planned):
            planned, stopped_by = within, "max_duration"
    if max_requests is not None and len(planned) > max_requests:
        planned, stopped_by = planned[:max_requests], "max_requests"
    return planned, stopped_by


def default_event(request_id: int, arrival: Arrival) -> dict[str, Any]:
    return {
        "request_id": request_id,
        "workflow": arrival.workflow,
        "function": str(arrival.function),
        "minute": arrival.minute,
        "scheduled_s": arrival.time_s,
    }


async def drive(
    target: Target,
    arrivals: Sequence[Arrival],
    *,
    slo_s: float = 0.2,
    max_requests: int | None = None,
    max_duration_s: float | None = None,
    request_timeout_s: float | None = None,
    drain_timeout_s: float = 60.0,
    sample_interval_s: float = 0.5,
    event_for: EventFactory = default_event,
    progress: bool = False,
    stop: asyncio.Event | None = None,
) -> DriveResult:
    """Send `arrivals` (sorted by time) to an already started `target`, open loop; see the module.
    `stop` set (the user's Ctrl-C): nothing more is sent, what is outstanding is cancelled (recorded
    so), and the result is what was measured until then (`stopped_by` "interrupted")."""
    loop = asyncio.get_running_loop()
    planned, stopped_by = _bounded(arrivals, max_requests, max_duration_s)
    records: list[RequestRecord | None] = [None] * len(planned)
    outstanding: set[asyncio.Task] = set()
    counters = {"sent": 0, "done": 0, "max_outstanding": 0}
    samples: list[dict[str, float]] = []
    sample_errors: list[str] = []
    started_at = time.time()
    t0 = loop.time()

    bar = Progress(
        TextColumn("[bold]replay[/bold] {task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("sent {task.fields[sent]} · outstanding {task.fields[outstanding]}"),
        TimeElapsedColumn(),
        disable=not progress,
        refresh_per_second=4,
    )
    bar_task = bar.add_task(getattr(target, "name", "target"), total=len(planned), sent=0, outstanding=0)

    async def one(request_id: int, arrival: Arrival) -> None:
        sent = loop.time() - t0
        counters["sent"] += 1
        outcome: Outcome | None = None
        status, error = "ok", ""
        try:
            call = target.send(arrival.workflow, event_for(request_id, arrival))
            async with asyncio.timeout(request_timeout_s or None):
                outcome = await call
            status, error = outcome.status, outcome.error or ""
        except TimeoutError:
            status, error = "timeout", f"no outcome within {request_timeout_s} s"
        except asyncio.CancelledError:
            status = "cancelled"
            error = (
                "still outstanding when the replay was interrupted"
                if stop is not None and stop.is_set()
                else "still outstanding when the drain timeout ran out"
            )
        except Exception as exc:  # the system's failure is a result, not a crash of the harness
            status, error = "error", f"{type(exc).__name__}: {exc}"
        latency = loop.time() - t0 - sent
        records[request_id] = RequestRecord(
            request_id,
            arrival.workflow,
            str(arrival.function),
            arrival.minute,
            arrival.time_s,
            sent,
            latency,
            outcome.latency_s if outcome is not None else math.nan,
            status,
            bool(outcome.cold_start) if outcome is not None else False,
            status != "ok" or latency > slo_s,
            error,
            **phase_columns(outcome.phases if outcome is not None else {}),
        )
        counters["done"] += 1
        bar.update(
            bar_task, completed=counters["done"], sent=counters["sent"], outstanding=len(outstanding) - 1
        )

    def where() -> dict[str, float]:
        return {
            "t_s": loop.time() - t0,
            "outstanding": float(len(outstanding)),
            "sent": float(counters["sent"]),
            "completed": float(counters["done"]),
        }

    async def sampler() -> None:
        tick = 0
        while True:
            await _take_sample(target, where(), samples, sample_errors)
            # next point of the grid that is still ahead (a slow sample skips ticks, never bunches)
            tick = max(tick + 1, math.floor((loop.time() - t0) / sample_interval_s) + 1)
            await asyncio.sleep(max(t0 + tick * sample_interval_s - loop.time(), 0))

    with bar:
        sampling = asyncio.create_task(sampler())
        for request_id, arrival in enumerate(planned):
            if await _stopped(stop, t0 + arrival.time_s - loop.time()):
                stopped_by = INTERRUPTED
                break
            task = asyncio.create_task(one(request_id, arrival))
            outstanding.add(task)
            task.add_done_callback(outstanding.discard)
            counters["max_outstanding"] = max(counters["max_outstanding"], len(outstanding))
        if outstanding and await _drain(set(outstanding), drain_timeout_s, stop):
            stopped_by = INTERRUPTED
        duration = loop.time() - t0
        sampling.cancel()
        await asyncio.gather(sampling, return_exceptions=True)
        # a last sample after the last request, its figures read again where the target can
        # (`Target.refresh`): the run's counts as they ended, not as of the last periodic refresh
        await _take_sample(target, where(), samples, sample_errors, refresh=True)
    return DriveResult(
        records=[r for r in records if r is not None],
        samples=samples,
        planned=len(planned),
        stopped_by=stopped_by,
        duration_s=duration,
        max_outstanding=counters["max_outstanding"],
        sample_errors=sample_errors,
        started_at=started_at,
    )


async def _drain(tasks: set[asyncio.Task], timeout_s: float, stop: asyncio.Event | None) -> bool:
    """Wait until every one of `tasks` is done, `timeout_s` has passed, or `stop` is set, then cancel
    what is left (each records itself cancelled); True if `stop` was set."""
    waits = {asyncio.ensure_future(asyncio.wait(tasks))}  # cancelling this wait leaves the tasks be
    if stop is not None:
        waits.add(asyncio.ensure_future(stop.wait()))
    try:
        await asyncio.wait(waits, timeout=timeout_s, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for wait in waits:
            wait.cancel()
    pending = [t for t in tasks if not t.done()]
    for task in pending:
        task.cancel()
    await asyncio.gather(*pending, return_exceptions=True)
    return stop is not None and stop.is_set()


async def _stopped(stop: asyncio.Event | None, delay: float) -> bool:
    """Sleep `delay` seconds; True at once if `stop` is (or becomes) set meanwhile."""
    if stop is None:
        await asyncio.sleep(max(delay, 0))
        return False
    if stop.is_set():
        return True
    try:
        async with asyncio.timeout(max(delay, 0)):
            await stop.wait()
        return True
    except TimeoutError:
        return False


async def _take_sample(
    target: Target,
    where: dict[str, float],
    samples: list[dict[str, float]],
    errors: list[str],
    refresh: bool = False,
) -> None:
    """Append the target's sample (`Target.sample`, on a worker thread unless it is a coroutine),
    after `Target.refresh` when asked and defined; an error is recorded, not raised."""
    try:
        if refresh and (again := getattr(target, "refresh", None)) is not None:
            await again()
        if inspect.iscoroutinefunction(target.sample):
            values = await target.sample()
        else:
            values = await asyncio.to_thread(target.sample)
    except Exception as exc:  # noqa: BLE001 - a sample's error is kept with the run, not raised
        errors.append(f"{where['t_s']:.3f}s {type(exc).__name__}: {exc}")
        return
    samples.append({**where, **{k: float(v) for k, v in values.items()}})
