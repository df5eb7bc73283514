"""An invocation's life in the proxy, from the gateway's `invoke` to its reply, and an instance's end.

`Lifecycle` carries out what the pure `InvocationScheduler` decides (dispatch to a warm instance,
start one, queue; expire queued requests; stop idle instances) through the `Supervisor` (processes)
and the dispatcher's transport, and settles each invocation: the handler's result waits for the
request's device work, then the request's buffers and leases are released and the gateway answered.
When an instance ends (exit, timeout, malformed message) its requests fail, and everything it held is
reclaimed: buffers, leases, waits, its stream and its channel.
"""

from __future__ import annotations

import contextlib
import logging
import time
from typing import TYPE_CHECKING, Any

import zmq

from streambox.device import Stream
from streambox.phases import COLD_START, COMPUTE, DEVICE_WAIT, OTHER, QUEUE

from . import protocol, wire
from .errors import (
    FunctionCancelled,
    FunctionCrashed,
    FunctionFailed,
    FunctionTimeout,
    ProxyError,
    UnknownFunction,
    encode_error,
    with_fields,
)
from .idle_cpu import IDLE_CPU_BUDGET_S, IDLE_CPU_CHECK_S, cpu_seconds
from .scheduler import Dispatch, Expire, InvocationScheduler, Start, Stop
from .state import Instance, Invocation, ProxyStats

if TYPE_CHECKING:
    from .proxy import ProxyServer


log = logging.getLogger(__name__)


def _now() -> float:
    return time.perf_counter()


class Lifecycle:
    STOP_GRACE_S = 5.0

    def __init__(self, server: ProxyServer, stats: ProxyStats) -> None:
        self.server, self.stats = server, stats
        self.supervisor, self.resources, self.calls = server.supervisor, server.resources, server.calls
        cfg = server.config
        self.scheduler = InvocationScheduler(
            {f.name: f.max_instances for f in cfg.functions}, cfg.keep_alive_s
        )
        self._inv_ids = 0
        self._retiring: list[Stream] = []  # streams of dropped instances, destroyed once retired
        self._next_idle_cpu = 0.0  # when instances' CPU is sampled next (`idle_cpu.py`)

    # -- invocations ---------------------------------------------------------------------------
    def invoke(self, route: bytes, call_id: int, args: dict[str, Any], now: float) -> None:
        name = args.get("function")
        spec = self.server.functions.get(name)  # type: ignore[arg-type]
        if spec is None:
            known = ", ".join(self.server.functions)
            raise UnknownFunction(
                f"workflow {self.server.workflow!r} has no function {name!r}; its functions: {known}"
            )
        timeout = float(args.get("timeout_s") or spec.timeout_s)
        self._inv_ids += 1
        request_id = str(args.get("request_id") or "")
        inv = Invocation(
            self._inv_ids,
            spec.name,
            request_id,
            args.get("event"),
            (route, call_id),
            now,
            now + timeout,
            timeout,
        )
        self.stats.invocations += 1
        self._act(self.scheduler.submit(spec.name, inv, now))

    def _act(self, action: Dispatch | Start | None) -> None:
        if isinstance(action, Dispatch):
            self._dispatch(self.supervisor.instances[action.instance], action.item)  # type: ignore[index]
        elif isinstance(action, Start):
            self._start_instance(action)

    def prewarm(self) -> int:
        """Fork `config.prewarm` instances per function ahead of any request (deploy); how many.
        Each goes idle when it registers (`on_hello`); `starting()` says how many have not yet."""
        now, count = _now(), self.server.config.prewarm
        starts = [s for f in self.server.functions for s in self.scheduler.prewarm(f, count, now)]
        for start in starts:
            self._start_instance(start)
        return len(starts)

    def starting(self) -> int:
        """Instances forked but not registered yet."""
        return sum(inst.state == "starting" for inst in self.supervisor.instances.values())

    def _start_instance(self, start: Start) -> None:
        now = _now()
        spec = self.server.functions[start.function]
        inv: Invocation | None = start.item  # None: prewarmed, no request waits for it
        if inv is not None:
            inv.cold = True
            self.stats.cold_starts += 1
        endpoint = self.server.transport.add(start.instance)
        deadline = now + self.server.config.start_timeout_s
        stream = self.resources.runtime.create_stream()
        inst = Instance(start.instance, spec, stream, "starting", now, deadline, first=inv)
        self.stats.instances_started += 1
        failed = self.supervisor.start(inst, endpoint)
        if failed is not None:
            self.instance_died(inst, failed, FunctionCrashed)

    def on_hello(self, inst: Instance, hello: protocol.Hello) -> None:
        if inst.state != "starting" or hello.instance_id != inst.id:
            return
        now = _now()
        self.supervisor.registered(inst, hello.pid)
        start_s = now - inst.created
        self.stats.cold_start_s.append(start_s)
        if len(self.stats.cold_start_s) > 1024:
            del self.stats.cold_start_s[:512]
        inv, inst.first = inst.first, None
        if inv is not None:
            inv.start_s = start_s
            self._dispatch(inst, inv)
        else:
            self._instance_free(inst)

    def _dispatch(self, inst: Instance, inv: Invocation) -> None:
        now = _now()
        inv.instance = inst.id
        inv.dispatched = now
        inv.deadline = now + inv.limit
        inst.invocation = inv
        inst.state = "busy"
        inst.dispatched += 1
        self.server.transport.send(inst.id, wire.pack([wire.INVOKE, inv.id, inv.request_id, inv.event]))

    def on_result(self, inst: Instance, result: protocol.Result) -> None:
        inv = inst.invocation
        if inv is None or inv.id != result.invocation_id:
            return
        inst.state = "finishing"
        inv.result_at = _now()
        # Uploads the handler never used are still the daemon's to copy: the stream waits for them
        # before the tail that frees their buffers is recorded.
        self.resources.after_uploads_issued(inst, lambda: self._finish_result(inst, inv, result))

    def _finish_result(self, inst: Instance, inv: Invocation, result: protocol.Result) -> None:
        if inst.invocation is not inv:
            return  # the instance died while its uploads were being issued; the request failed then
        end = self.resources.record(inst.stream)

        def finished(error: BaseException | None) -> None:
            if inst.invocation is not inv:
                return  # the instance died meanwhile; the request has been failed already
            ok, value = result.ok, result.value
            retire = not ok and value[3:4] == [wire.RETIRE]
            if not ok:
                kind, message, text = [*value, "", "", ""][:3]
                where = f"(function {inv.function!r}, request {inv.request_id!r})"
                failed = FunctionFailed(f"{kind}: {message} {where}\n{text}")
                details = {"error_type": kind, "message": message, "traceback": text or None}
                value = encode_error(with_fields(failed, **details, **self._where(inv)))
            elif error is not None:
                ok, value = False, encode_error(error)
            self.resources.end_invocation(inv, inst, end)
            inst.invocation = None
            self.reply(inv, ok, value)
            if retire:
                self._stop_instance(inst, _now())
            else:
                self._instance_free(inst)

        self.calls.complete(inst, end, finished)

    @staticmethod
    def _where(inv: Invocation) -> dict[str, Any]:
        return {"function": inv.function, "request_id": inv.request_id}

    def reply(self, inv: Invocation, ok: bool, value: Any, *, failure: bool = True) -> None:
        """`failure=False`: an error that is not the function's (its request ended: `abandon`)."""
        if not ok and failure:
            self.stats.failures += 1
        now = _now()
        if ok:
            dispatched = inv.dispatched or now
            finish_s = now - (inv.result_at or now)
            value = {
                "output": value,
                "cold_start": inv.cold,
                "latency_s": now - inv.arrived,
                "start_s": inv.start_s,
                "queue_s": dispatched - inv.arrived - inv.start_s,
                "run_s": (inv.result_at or now) - dispatched,  # INVOKE sent -> result back
                "finish_s": finish_s,  # the request's device work completing
                "instance": inv.instance,
                "phases": self._phases(inv, dispatched, finish_s),
                "device_wait_s": inv.phases.seconds.get(DEVICE_WAIT, 0.0) + finish_s,  # within compute
            }
        route, call_id = inv.reply_to
        self.server.control_reply(route, call_id, ok, value)

    @staticmethod
    def _phases(inv: Invocation, dispatched: float, finish_s: float) -> dict[str, float]:
        """Seconds by phase measured here (`phases.py`); the rest of the call is the caller's `other`."""
        measured = dict(inv.phases.seconds)
        measured[COMPUTE] = measured.get(COMPUTE, 0.0) + measured.pop(DEVICE_WAIT, 0.0) + finish_s
        measured.pop(OTHER, None)  # bookkeeping ops: counted with the handler's own time
        return {COLD_START: inv.start_s, QUEUE: dispatched - inv.arrived - inv.start_s, **measured}

    def _instance_free(self, inst: Instance) -> None:
        """The instance finished a request: take the next queued one, or go idle."""
        self.supervisor.refill_spare(inst)
        action = self.scheduler.finished(inst.spec.name, inst.id, _now())
        if action is None:
            inst.state = "idle"
        else:
            self._dispatch(inst, action.item)

    # -- the end of instances ------------------------------------------------------------------
    def abandon(self, request_id: str) -> int:
        """The request ended (its last invocation returned, or it failed or was cancelled without the
        rest): what of it is still here has nobody to answer. A running invocation's instance is killed,
        as at a timeout (its handler cannot be stopped otherwise, and would hold the instance and its
        memory until its own deadline); a queued one leaves the queue; an instance starting for one
        serves the queue instead. Each is answered `FunctionCancelled`. Returns how many."""
        if not request_id:  # invocations without a request (a control client's tests) share ""
            return 0
        why = "stopped: its request ended without it (another call failed, or the client went away)"
        # The queue first: a killed instance's place goes to the queue's head (`drop_instance`).
        abandoned = [inv for _, inv in self.scheduler.withdraw(lambda item: item.request_id == request_id)]
        running = []
        for inst in list(self.supervisor.instances.values()):
            first = inst.first
            if inst.state == "starting" and first is not None and first.request_id == request_id:
                inst.first = None  # it serves the queue once registered
                abandoned.append(first)
            elif inst.state == "busy" and getattr(inst.invocation, "request_id", None) == request_id:
                running.append(inst)
        for inv in abandoned:
            self._cancelled(inv, why)
        for inst in running:
            self.kill(inst, f"was {why}", FunctionCancelled)
        self.stats.cancelled += len(abandoned) + len(running)
        return len(abandoned) + len(running)

    def _cancelled(self, inv: Invocation, why: str) -> None:
        error = FunctionCancelled(f"request {inv.request_id!r} of {inv.function!r} {why}")
        fields = {"error_type": "FunctionCancelled", "message": str(error), **self._where(inv)}
        self.reply(inv, False, encode_error(with_fields(error, **fields)), failure=False)

    def kill(self, inst: Instance, reason: str, error: type[ProxyError]) -> None:
        self.supervisor.kill(inst)
        self.instance_died(inst, reason, error)

    def instance_died(self, inst: Instance, reason: str, error: type[ProxyError]) -> None:
        if inst.state == "dead":
            return
        # An instance killed because its request ended was stopped, not lost to a fault.
        cancelled = error is FunctionCancelled
        self.stats.instances_stopped += cancelled
        self.stats.instances_died += inst.state != "stopping" and not cancelled
        # Its uploads may still be copying into its buffers: those must end before the buffers go.
        uploads_over = self._end_uploads(inst)
        for inv in (inst.invocation, inst.first):
            if inv is not None:
                self.resources.end_invocation(inv, inst, None, free_buffers=uploads_over)
                who = f"instance {inst.id} of function {inst.spec.name!r}"
                why = error(f"{who} {reason} during request {inv.request_id!r}")
                fields = {"error_type": error.__name__, "message": str(why), "instance": inst.id}
                error_reply = encode_error(with_fields(why, **fields, **self._where(inv)))
                self.reply(inv, False, error_reply, failure=not cancelled)
        self.drop_instance(inst)

    def drop_instance(self, inst: Instance) -> None:
        """Free everything of an instance: its requests' buffers, its waits, its stream, its channel;
        queued requests of its function get new instances if they may."""
        if inst.state != "dead" and not self.server._stop:
            self.supervisor.refill_spare(inst)
        inst.state = "dead"
        inst.invocation = inst.first = None
        inst.held = None
        self._end_uploads(inst)
        self._stop_issue(inst)
        self.calls.drop(inst)
        with contextlib.suppress(Exception):
            self.resources.memory.executor.release_instance(inst.key)
        with contextlib.suppress(Exception):
            self.resources.store.release_owner(inst.key)
        self._retiring.append(inst.stream)
        self.retire_streams(0.0)
        # Its channel goes once the transport's poll has returned: a message of this instance may be
        # being delivered now, from a view into the channel's memory.
        self.calls.post(lambda: self.server.transport.remove(inst.id))
        self.supervisor.forget(inst)
        for start in self.scheduler.removed(inst.spec.name, inst.id, _now()):
            if not self.server._stop:
                self._start_instance(start)

    def _end_uploads(self, inst: Instance) -> bool:
        """A departing instance's uploads: those fully issued are waited on by its stream (so frees
        on it come after them); the rest are cancelled and their blocks already in flight waited
        for, at most `STOP_GRACE_S`. False when some could still write into its buffers then: the
        caller keeps those buffers rather than free memory a copy will write (a use after free that
        used to fail an unrelated request)."""
        gates, inst.gates = inst.gates, []
        pending = []
        for gate in gates:
            if gate.issued and gate.error is None:
                gate.wait_all(inst.stream)  # all its blocks are on the device's queues: no wait here
            else:
                pending.append(gate)
        if not pending:
            return True
        self.resources.io.cancel(inst.key)  # queued blocks are dropped; those in flight finish
        deadline = _now() + self.STOP_GRACE_S
        while not all(gate.settled for gate in pending):
            if _now() >= deadline:
                log.error("instance %s: uploads still in flight after %.1f s; its buffers are kept",
                          inst.id, self.STOP_GRACE_S)
                return False
            time.sleep(1e-3)
        return True

    def _stop_issue(self, inst: Instance) -> None:
        """A plan of the instance still being issued off the dispatcher stops at its next slice (the
        executor hands back what it held); outputs of a run that finished unseen are freed."""
        ticket, inst.issue = inst.issue, None
        if ticket is None:
            return
        try:
            done = ticket.cancel(self.STOP_GRACE_S)
        except Exception:  # noqa: BLE001 - a stuck issue: its stream is retired only once idle
            return
        if done is not None:
            addresses = [t.address for t in done.outputs.values()]
            self.resources.memory.allocator.free_many(addresses, inst.stream)

    def retire_streams(self, timeout_s: float) -> None:
        """Destroy the streams of dropped instances once the pool holds no free pending on them:
        a stream still running (a killed instance's last kernels) waits for a later turn, so the
        dispatcher never blocks on it and no pending block ever refers to a destroyed stream."""
        still = []
        for stream in self._retiring:
            if self.resources.memory.pool.retire_stream(stream, timeout_s=timeout_s):
                stream.destroy()
            else:
                still.append(stream)
        self._retiring = still

    @property
    def retiring(self) -> int:
        return len(self._retiring)

    def stop_all(self) -> None:
        for inst in list(self.supervisor.instances.values()):
            if inst.state not in ("dead", "starting"):
                self.server.transport.send(inst.id, wire.pack([wire.STOP]))

    # -- events and timers ---------------------------------------------------------------------
    def template_events(self) -> int:
        n, exits, template_died = self.supervisor.poll()
        for ended in exits:
            inst = ended.instance
            if inst.state == "stopping":  # keep-alive ran out: scaled down
                self.stats.instances_stopped += 1
                self.drop_instance(inst)
            else:
                self.instance_died(inst, ended.reason, FunctionCrashed)
        if template_died:
            self.server.poller.unregister(self.supervisor.evt_fd)
            self.supervisor.restart()
            self.server.poller.register(self.supervisor.evt_fd, zmq.POLLIN)
        return n

    def timers(self, now: float) -> int:
        if self._retiring:
            self.retire_streams(0.0)
        n = self._stop_idle_cpu(now) if now >= self._next_idle_cpu else 0
        for inst in list(self.supervisor.instances.values()):
            why = self._overdue(inst, now)
            if why is not None:
                self.kill(inst, *why)
                n += 1
        for action in self.scheduler.tick(now):
            n += 1
            if isinstance(action, Expire):
                inv = action.item
                waited = f"waited {now - inv.arrived:.1f} s for an instance"
                error = FunctionTimeout(f"request {inv.request_id!r} of {action.function!r} {waited}")
                fields = {"error_type": "FunctionTimeout", "message": str(error), **self._where(inv)}
                self.reply(inv, False, encode_error(with_fields(error, **fields)))
            elif isinstance(action, Stop):
                self._stop_instance(self.supervisor.instances[action.instance], now)  # type: ignore[index]
        return n

    def _stop_idle_cpu(self, now: float) -> int:
        """Sample the instances' CPU; stop the idle ones past their idle-CPU budget (`idle_cpu.py`)."""
        self._next_idle_cpu = now + IDLE_CPU_CHECK_S
        n = 0
        for inst in list(self.supervisor.instances.values()):
            cpu = cpu_seconds(inst.pid) if inst.pid is not None else None
            if cpu is None or inst.state in ("starting", "stopping", "dead"):
                continue
            inst.idle_cpu.observe(cpu, now, inst.dispatched, inst.state == "idle")
            if inst.state == "idle" and inst.idle_cpu.over_budget():
                log.warning(
                    "instance %d of function %r burned %.1f CPU-s while serving nothing (a thread its "
                    "handler left running; at most %g s): stopped",
                    inst.id, inst.spec.name, inst.idle_cpu.used_s, IDLE_CPU_BUDGET_S,
                )
                self.stats.idle_cpu_stops += 1
                self.scheduler.retire(inst.spec.name, inst.id)
                self._stop_instance(inst, now)
                n += 1
        return n

    def _stop_instance(self, inst: Instance, now: float) -> None:
        """Ask an instance with no invocation to end (its exit drops it, `template_events`)."""
        inst.state = "stopping"
        inst.deadline = now + self.STOP_GRACE_S
        self.server.transport.send(inst.id, wire.pack([wire.STOP]))

    def _overdue(self, inst: Instance, now: float) -> tuple[str, type[ProxyError]] | None:
        if inst.state == "starting" and now >= inst.deadline:
            return f"did not register within {self.server.config.start_timeout_s} s", FunctionCrashed
        inv = inst.invocation
        if inst.state in ("busy", "finishing") and inv is not None and now >= inv.deadline:
            return f"timed out after {inv.limit:g} s and was killed", FunctionTimeout
        if inst.state == "stopping" and now >= inst.deadline:
            return "did not stop", FunctionCrashed
        return None

    def deadlines(self) -> list[float]:
        due = []
        for inst in self.supervisor.instances.values():
            if inst.state in ("starting", "stopping"):
                due.append(inst.deadline)
            elif inst.invocation is not None:
                due.append(inst.invocation.deadline)
        at = self.scheduler.next_due()
        if at is not None:
            due.append(at)
        return due
