"""The API proxy: one process per workflow that owns the device runtime and serves its functions.

It holds the backend context (one `Runtime`), the memory side (`ProxyMemory`: the auto-scaling pool,
the plan executor, shared model weights), the IO daemon (host-to-device copies), the workflow's key
table, the warm template process and the function instances forked from it. Each instance gets its
own stream; nothing device-wide is ever synchronised.

This module is the dispatcher: one thread (`serve_forever`) drains the forwarding channel of every
instance and the control socket, and carries out what the parts decide. The parts, one job each:

- `protocol.decode`: every message from a function process, decoded and checked in one place; a
  malformed one ends its sender alone;
- `scheduler.InvocationScheduler` (pure): queues, instance choice, keep-alive;
- `supervisor.Supervisor`: the template, its spares, the instances' processes and their exits;
- `ops`: the forwarded ops, one function each; `calls.Calls` parks an op that waits (slow work off
  the dispatcher, device completion, a GET's PUT) and resumes it where it stopped;
- `resources.Resources`: what requests hold on the device (buffers, leases, plans, weights);
- `lifecycle.Lifecycle`: an invocation from `invoke` to its reply, and an instance's end.

Completion (`ProxyConfig.completion`): `poll` (sync-lite) records an event after a call's last device
operation and the dispatcher queries it between messages, sleeping `poll_us` between queries when it
has nothing else to do; `sync` hands the wait to a helper thread that posts the outcome back.

Failure isolation: a handler that raises fails its request (the instance stays warm); an instance
that dies, runs past its timeout or sends a malformed message fails only its own request; the proxy
then frees what the request held and the instance's stream, and goes on.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import os
import shutil
import signal
import sys
import time
from collections import OrderedDict
from functools import partial
from types import GeneratorType
from typing import Any

import msgpack
import zmq

from streambox.comm import CommStore
from streambox.comm.config import StoreConfig
from streambox.comm.ipc_store import IpcStore
from streambox.comm.store_protocol import Store
from streambox.config import Config, ineffective_settings
from streambox.gc_pauses import PAUSES, freeze_startup_heap, freezing
from streambox.io_daemon import IODaemon
from streambox.kernel_compiler.model_pool import ModelPool
from streambox.kernel_compiler.parallel_lowering import lower_missing
from streambox.memory_pool.idle import PoolIdleMemory
from streambox.phases import op_phase

from . import protocol
from .batched_infer import batch_sizes
from .calls import Calls
from .channel import make_server
from .control import ControlGuard, ControlRefused
from .errors import FunctionCrashed, ProxyError, encode_error
from .issuer import Issuer
from .lifecycle import Lifecycle
from .node_gpus import Neighbours, neighbour_indices, start_opening
from .ops import OPS, CallContext
from .profiling import device_profile
from .proxy_config import ProxyConfig
from .proxy_launch import proxy_directory, start_failed
from .proxy_memory import ProxyMemory, ReclaimingAllocator
from .resources import Resources
from .snapshot import snapshot
from .state import Instance, ProxyStats
from .supervisor import Supervisor, describe_status

__all__ = ["ProxyServer", "describe_status", "main"]

TIMER_PERIOD_S = 1e-3
#: How long deploying sleeps between looks for prewarmed instances' hellos.
PREWARM_POLL_S = 0.001
MAX_SLEEP_S = 0.05
CONTROL_PERIOD_S = 100e-6
PARENT_CHECK_S = 0.2
_ZMQ_EVENTS, _ZMQ_POLLIN = int(zmq.EVENTS), int(zmq.POLLIN)
ENDED_MEMORY = 4096


def _now() -> float:
    return time.perf_counter()


class ProxyServer:
    """One workflow's proxy (see the module doc). `start()`, then `serve_forever()`, then `close()`."""

    def __init__(self, config: ProxyConfig, supervisor: Supervisor | None = None) -> None:
        self.config = config
        self.supervisor = supervisor  # its template already spawned (`proxy_launch`), or by `start`
        self.workflow = config.workflow
        self.functions = {f.name: f for f in config.functions}
        self.stats = ProxyStats()
        self.timings: dict[str, float] = {}
        self._ended: OrderedDict[str, None] = OrderedDict()  # requests whose keys were dropped
        self._stop = False
        self._parent = os.getppid()
        self._next_parent_check = 0.0

    @property
    def instances(self) -> dict[int, Instance]:
        return self.supervisor.instances

    # ================================================================================= start / stop
    def start(self) -> ProxyServer:
        cfg = self.config
        started = _now()
        if self.supervisor is None:
            self.supervisor = Supervisor(cfg, proxy_directory(cfg))
            self.supervisor.spawn_template()  # before this process has any thread: a clean spawn
        self.dir = self.supervisor.dir
        self._open_device()
        self.transport = make_server(
            cfg.channel, self.dir, capacity=cfg.ring_bytes, spin_s=cfg.spin_us * 1e-6
        )
        self.calls = Calls(
            self.store,
            self._reply,
            self.transport.wake,
            self._handle_held,
            sync_completion=cfg.completion == "sync",
        )
        self.resources = Resources(
            cfg.workflow,
            self.runtime,
            self.memory,
            self.io,
            self.store,
            self.model_pool,
            model_shapes=cfg.model_shapes,
            post=self.calls.post,
            invocation_bytes=cfg.invocation_device_bytes,
            issuer=(
                Issuer(
                    self.transport.wake,
                    threads=cfg.issue_threads,
                    slice_kernels=cfg.issue_slice,
                    contended=lambda: self.transport.has_input() or self.calls.pending(),
                )
                if cfg.issue_threads
                else None
            ),
        )
        self.lifecycle = Lifecycle(self, self.stats)
        t = _now()
        # Deploying: every model's plans (the batches its batched infers reach too), weights and
        # offline profile at hand; the plans the model pool lacks lowered on several cores first.
        plans = [(model, size) for spec in cfg.functions for model in spec.models
                 for size in (spec.batch_size, *batch_sizes(spec))]
        lower_missing(self.model_pool, [self.resources.plan_key(m, size) for m, size in plans])
        for model, size in plans:
            self.memory.ensure_profile(self.resources.load(model, size))
        self.resources.service.synchronize()
        self.timings["models_s"] = _now() - t
        self._open_control()
        self.supervisor.await_template()
        self.timings.update(self.supervisor.timings)
        self.poller = zmq.Poller()
        for item in [self.control, *self.transport.poll_items(), self.supervisor.evt_fd]:
            self.poller.register(item, zmq.POLLIN)
        self._prewarm()
        self.timings["start_s"] = _now() - started
        return self

    def _open_device(self) -> Config:
        """The runtime, the IO daemon, the memory side and the store (the system's mechanisms, each
        switchable per run: `ProxyConfig.settings()`)."""
        cfg = self.config
        device = cfg.device_config()
        self.backend = device.open_backend()
        store_config = cfg.store_config()  # PA and AM as switched, the `store` group's knobs
        # AM's neighbour GPUs (node_gpus.py): their contexts open beside the home one.
        neighbours = start_opening(
            self.backend, neighbour_indices(cfg.device, device.gpus, store_config.adaptive_movement)
        )
        t = _now()
        self.runtime = self.backend.open_runtime(cfg.device)
        self.timings["runtime_s"] = _now() - t
        self.timings["modelled_context_s"] = getattr(
            getattr(self.backend, "spec", None), "context_create_s", 0.0
        )
        self.io = IODaemon(self.runtime, cfg.daemon_config())
        self.model_pool = ModelPool(device.model_pool)
        # Algorithm 1's profiles: memory per kernel from the plan, time per kernel for this device.
        profile_for = partial(device_profile, self.model_pool, device_name=self.runtime.properties().name)
        self.memory = ProxyMemory(
            self.runtime, cfg.memory_options(), profile_for=profile_for, daemon=self.io
        ).start()
        self.store = self._open_store(cfg, store_config, neighbours)
        for line in ineffective_settings(cfg.settings()):  # an ablation that measures nothing says so
            print(f"proxy of {cfg.workflow!r}: note: {line}", file=sys.stderr, flush=True)
        return device

    def _open_store(
        self, cfg: ProxyConfig, store_config: StoreConfig, neighbours: concurrent.futures.Future[Neighbours]
    ) -> Store:
        """The communication store the `comm_store` setting names: StreamBox's managed store, or
        stream-only's CUDA-IPC style one (fresh allocations outside the pool, no pressure awareness)."""
        t = _now()
        self.neighbours = neighbours.result()  # none unless AM is on (the managed store only)
        self.timings["neighbours_wait_s"] = _now() - t  # start-up time the neighbours' contexts added
        if cfg.resolved_comm_store == "ipc":
            return IpcStore({cfg.device: self.runtime, **self.neighbours.runtimes},
                            node=f"proxy-{cfg.workflow}", config=store_config, clock=_now).start()
        # The store's capacity: a fraction of the idle memory the pool's demand model predicts over
        # the window. It allocates from the pool (it fences and retires its own streams' frees).
        store_idle = PoolIdleMemory(self.memory.pool, self.memory.board, self.memory.scaler)
        # The store's own allocations (a reader's copy of data it moved to host memory) may evict idle
        # weights, but never ask the store itself to reclaim (no call re-enters the store).
        store_allocator = ReclaimingAllocator(self.memory.pool, [self.memory.models.evict_idle])
        store = CommStore(
            {cfg.device: self.runtime, **self.neighbours.runtimes},
            {cfg.device: store_allocator, **self.neighbours.allocators},
            node=f"proxy-{cfg.workflow}",
            # A neighbour's idle memory: observed free (None), its demand model is in other proxies.
            idle={cfg.device: store_idle, **dict.fromkeys(self.neighbours.runtimes)},
            config=store_config,
            clock=_now,  # the position board's clock, which the prediction compares `now` with
        )
        store_idle.store_bytes = lambda: store.usage()[cfg.device]
        # An allocation the pool cannot meet also has the store move stored data off the GPU (to a
        # peer GPU or host memory, by the store's rules) before it fails; run outside the pool's lock.
        self.memory.allocator.reclaimers.append(lambda nbytes: store.reclaim(cfg.device, nbytes))
        return store.start()

    def _open_control(self) -> None:
        self._zmq = zmq.Context(io_threads=1)
        self.control = self._zmq.socket(zmq.ROUTER)
        self.control.setsockopt(zmq.LINGER, 0)
        path = self.dir / "control.sock"
        self.control.bind(f"ipc://{path}")
        os.chmod(path, 0o600)
        self._guard = ControlGuard.for_proxy(f"ipc://{path}")  # every control message carries its key

    def close(self) -> None:
        self.lifecycle.stop_all()
        self.supervisor.close(self.lifecycle.STOP_GRACE_S)
        for inst in list(self.instances.values()):
            self.lifecycle.drop_instance(inst)
        self.lifecycle.retire_streams(self.lifecycle.STOP_GRACE_S)
        self.calls.run_posted()  # the channels of dropped instances go
        self.calls.close()
        self.resources.close()
        self.io.close()
        self.store.close()
        self.neighbours.close()
        self.memory.pool.fence(self.resources.service)
        self.memory.close()
        self.runtime.close()
        self.transport.close()
        self.control.close(0)
        self._zmq.term()
        self.supervisor.close_events()
        shutil.rmtree(self.dir, ignore_errors=True)

    # ================================================================================= the loop
    def serve_forever(self) -> None:
        spin_s = self.config.spin_us * 1e-6
        poll_s = self.config.poll_us * 1e-6
        last_busy = _now()
        next_timer = next_control = 0.0
        transport, calls, on_message = self.transport, self.calls, self._on_message
        issuer = self.resources.issuer
        while not self._stop:
            n = transport.poll(on_message)
            if calls.polls:
                n += calls.poll_completions()
            if calls.posted:
                n += calls.run_posted()
            now = _now()
            if now >= next_control:  # the gateway's calls: checked every CONTROL_PERIOD_S when busy
                n += self._poll_control()
                next_control = now + CONTROL_PERIOD_S
            if now >= next_timer:
                n += self._timers(now)
                next_timer = now + TIMER_PERIOD_S
            if n:
                last_busy = now
                continue
            if issuer is not None and issuer.waiting:  # nothing else to do: the issues go on a slice
                issuer.grant()
            if calls.polls:  # sync-lite: query the events again after a short sleep (the GIL is free)
                if issuer is not None:
                    issuer.pause(poll_s)  # an issue asking for its next turn ends the pause
                else:
                    time.sleep(poll_s)
                continue
            if now - last_busy < spin_s:
                os.sched_yield()
                continue
            if not transport.prepare_sleep():
                continue
            self.poller.poll(min(MAX_SLEEP_S, max(0.0, self._next_due() - now)) * 1000)
            transport.after_sleep()
            next_timer = next_control = 0.0

    def _on_message(self, instance_id: int, data: bytes) -> None:
        inst = self.instances.get(instance_id)
        if inst is None or inst.state == "dead":
            return
        try:
            message = protocol.decode(data)
        except protocol.ProtocolViolation as exc:  # a malformed message ends its sender alone
            self.stats.protocol_errors += 1
            self.lifecycle.kill(inst, f"sent a malformed message ({exc})", FunctionCrashed)
            return
        if inst.held is not None and not isinstance(message, protocol.Hello):
            inst.held.append(message)  # a call of the instance waits off the dispatcher: keep the order
            return
        self._handle_held(inst, message)

    def _handle_held(self, inst: Instance, message: protocol.Message) -> None:
        if isinstance(message, protocol.Call):
            self._on_call(inst, message)
        elif isinstance(message, protocol.Result):
            self.lifecycle.on_result(inst, message)
        else:
            self.lifecycle.on_hello(inst, message)

    def _on_call(self, inst: Instance, call: protocol.Call) -> None:
        self.stats.calls += 1
        inv = inst.invocation
        if inv is None:
            error = ProxyError(f"call {call.op!r} outside an invocation")
            self._reply(inst, call.call_id, False, encode_error(error))
            return
        context = CallContext(inst, inv, self.config.device, self._request_ended)
        op, phase = OPS[call.op], op_phase(call.op)
        started = time.perf_counter()
        try:
            if inst.gates:  # the instance's uploads first: issued by the daemon, then waited on
                result = self._after_uploads(op, context, call.args)
            else:
                result = op(self.resources, context, *call.args)
        except Exception as exc:  # noqa: BLE001 - a failed call fails only that call
            inv.phases.add(phase, started, time.perf_counter())
            self._reply(inst, call.call_id, False, encode_error(exc))
            return
        inv.phases.add(phase, started, time.perf_counter())  # a plain op's work (a generator's: none yet)
        self.calls.run(inst, inv, call.call_id, result, phase)

    def _after_uploads(self, op: Any, context: CallContext, args: list[Any]) -> Any:
        yield from self.resources.uploads_issued(context.inst)
        result = op(self.resources, context, *args)
        if isinstance(result, GeneratorType):
            result = yield from result
        return result

    def _reply(self, inst: Instance, call_id: int, ok: bool, value: Any) -> None:
        self.transport.send(inst.id, protocol.wire.pack([protocol.wire.REPLY, call_id, ok, value]))

    def _request_ended(self, key: str) -> bool:
        return any(key.startswith(prefix) for prefix in self._ended)

    # ================================================================================= control
    def _poll_control(self) -> int:
        n = 0
        while self.control.get(_ZMQ_EVENTS) & _ZMQ_POLLIN:
            try:
                route, body = self.control.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return n
            n += 1
            try:
                call_id, op, args = self._guard.open(body)
            except ControlRefused as refused:  # no key: told so, never served
                self.control_reply(route, refused.call_id, False, refused.wire)
                continue
            except Exception:  # noqa: BLE001 - not one of ours: ignore
                continue
            try:
                if op == "invoke":
                    self.lifecycle.invoke(route, call_id, args, _now())
                    continue
                value = self._control_op(op, args)
            except Exception as exc:  # noqa: BLE001 - reported to the caller
                self.control_reply(route, call_id, False, encode_error(exc))
            else:
                self.control_reply(route, call_id, True, value)
        return n

    def _control_op(self, op: str, args: Any) -> Any:
        if op == "ping":
            return {"workflow": self.workflow, "pid": os.getpid(), "timings": self.timings}
        if op == "end_request":
            return self.end_request(str(args["request_id"]))
        if op == "stats":
            return self.snapshot()
        if op == "pin":  # keep-alive paused for a replay's warm-up (keepalive.py)
            self.lifecycle.scheduler.pin(bool(args["pinned"]), _now())
            self.memory.models.pin(bool(args["pinned"]))
            return True
        if op == "shutdown":
            self._stop = True
            return True
        raise ProxyError(f"unknown control operation {op!r}")

    def control_reply(self, route: bytes, call_id: int, ok: bool, value: Any) -> None:
        self.control.send_multipart([route, msgpack.packb([call_id, ok, value], use_bin_type=True)])

    def end_request(self, request_id: str) -> int:
        """Drop every key of a finished request (freed once unleased); later PUTs under the request's
        keys are refused; its invocations still here are stopped (`Lifecycle.abandon`). Returns how
        many keys went."""
        prefix = f"{self.workflow}/{request_id}/"
        self._ended[prefix] = None
        while len(self._ended) > ENDED_MEMORY:
            self._ended.popitem(last=False)
        try:
            self.lifecycle.abandon(request_id)
        finally:  # the keys go whatever stopping the invocations met
            stored = self.store.keys()
            dropped = sum(self.store.delete(key) for key in stored if key.startswith(prefix))
        return dropped

    def snapshot(self) -> dict[str, Any]:
        return snapshot(self)

    def _prewarm(self) -> None:
        """Deploying: fork `prewarm` instances per function and serve their hellos until each has
        registered (or failed its start deadline), so the first request finds them idle."""
        t = _now()
        if self.lifecycle.prewarm():
            while self.lifecycle.starting() and not self._stop:
                if not self.transport.poll(self._on_message) + self._timers(_now()):
                    time.sleep(PREWARM_POLL_S)
        self.timings["prewarm_s"] = _now() - t

    # ================================================================================= timers
    def _timers(self, now: float) -> int:
        n = self.lifecycle.template_events()
        if now >= self._next_parent_check:
            self._next_parent_check = now + PARENT_CHECK_S
            if os.getppid() != self._parent:  # the launcher died: shut down (instances with us)
                self._stop = True
        n += self.lifecycle.timers(now)
        n += self.resources.batching.close_due(now)  # batches whose queue delay is over run now
        return n + self.calls.expire_keys(now)

    def _next_due(self) -> float:
        due = [_now() + MAX_SLEEP_S, *self.lifecycle.deadlines()]
        for at in (self.calls.next_key_deadline(), self.resources.batching.next_deadline()):
            if at is not None:
                due.append(at)
        return min(due)


def main(argv: list[str] | None = None, supervisor: Supervisor | None = None) -> int:
    """Run one proxy: `argv[0]` is its `ProxyConfig` as JSON (or `supervisor`'s, its template already
    spawned). Exits when told to shut down, on SIGTERM, or when the process that started it dies."""
    args = sys.argv[1:] if argv is None else argv
    config = supervisor.config if supervisor is not None else ProxyConfig.from_json(args[0])
    if config.switch_interval_us is not None:
        sys.setswitchinterval(config.switch_interval_us * 1e-6)
    # Not PR_SET_PDEATHSIG: it fires when the launching *thread* ends (launchers use thread pools).
    # The dispatcher's timers watch the parent process instead and shut down when it is gone.
    PAUSES.install()
    try:
        server = ProxyServer(config, supervisor)
    except KeyboardInterrupt:  # Ctrl-C at the terminal: the command that started it reports it
        with contextlib.suppress(Exception):
            supervisor.template.kill()  # type: ignore[union-attr]
        return 130

    def stop(signum: int, frame: Any) -> None:
        server._stop = True

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    try:
        freeze = freezing()  # a bad STREAMBOX_FREEZE_HEAP fails the start, before any work
        server.start()
    except BaseException as exc:
        if server._stop:  # interrupted (Ctrl-C, SIGTERM) while starting: no error of its own to report
            with contextlib.suppress(Exception):
                server.supervisor.template.kill()
            return 130
        with contextlib.suppress(Exception):
            server.supervisor.template.kill()
        return start_failed(config, exc)
    # Everything set up so far lives as long as the proxy: out of every later collection, so that a
    # full one stops the proxy for milliseconds, not the ~0.2 s of walking torch's objects.
    if freeze:
        freeze_startup_heap()
    try:
        server.serve_forever()
    finally:
        server.close()
    return 0
