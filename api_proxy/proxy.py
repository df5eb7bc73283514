"""The API proxy: one process per workflow that owns the device runtime and serves its functions.

It holds the backend context (one `Runtime`), the memory side (`ProxyMemory`: the auto-scaling pool,
the plan executor, shared model weights), the IO daemon (host-to-device copies), the workflow's key
table, the warm template process and the function instances forked from it. Each instance gets its
own stream; nothing device-wide is ever synchronised.

One dispatcher thread runs everything (`serve_forever`): it drains the forwarding channel of every
instance and the control socket (the gateway's `invoke`, `end_request`, `stats`, `shutdown`), issues
each call on the calling instance's stream and answers it, polls the completion events of calls that
must wait for the device (sync-lite), and keeps the timers: invocation timeouts, GET timeouts, key
TTLs, keep-alive. When there is nothing to do it spins briefly, then sleeps in one poller on the
control socket, the channel's doorbell and the template's pipe.

Completion (`ProxyConfig.completion`): `poll` (sync-lite) records an event after a call's last device
operation and the dispatcher queries it between messages, sleeping `poll_us` between queries when it
has nothing else to do (a spin would take the GIL from the emulated device's kernels); `sync` hands
the call to a helper thread that blocks in `Stream.synchronize` and posts the reply back (the
dispatcher itself must never block).

Nothing slow runs on the dispatcher: a call that needs a plan the proxy has not loaded yet (an input
shape met for the first time: read from the model pool, or lowered, seconds) or weights the IO daemon
has not issued yet (a model evicted after its keep-alive, reloaded) hands that wait to a helper thread
and is *held*, with every later message of its instance (calls keep their order on the stream), until
it is done; then the call runs again from the start (operations defer before doing anything). Other
instances' calls go on meanwhile. One lowering per (model, batch, shape) serves every call that wants
it; its error fails those calls, naming the model and shape.

Failure isolation: a handler that raises fails its request (the instance stays warm); an instance
that dies (the template reports its exit) or runs past its timeout (the proxy kills it) fails only
its own request; the proxy then frees what the request held and the instance's stream, and goes on.
"""

from __future__ import annotations

import contextlib
import itertools
import math
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections import OrderedDict, deque
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import msgpack
import torch
import zmq

from streambox.comm import CommStore, StoreConfig
from streambox.comm.errors import GetTimeout
from streambox.config import Config
from streambox.device import Event, Stream
from streambox.io_daemon import CopyRequest, IODaemon
from streambox.kernel_compiler.model_pool import ModelPool
from streambox.kernel_compiler.ops import invoke_kernel
from streambox.kernel_compiler.plan import KernelPlan
from streambox.memory_pool.idle import PoolIdleMemory

from . import wire
from .buffers import BufferTable
from .channel import make_server
from .device_tensor import DeviceTensor
from .errors import (
    FunctionCrashed,
    FunctionFailed,
    FunctionTimeout,
    IsolationError,
    KeyNotFound,
    ProxyError,
    UnknownFunction,
    UnknownHandle,
    UnknownModel,
    encode_error,
)
from .executor import ELEMENTS_PER_BLOCK
from .handles import DTYPES, Handle, check_key, contiguous_strides, request_prefix
from .keepalive import InstancePool
from .proxy_config import FunctionSpec, ProxyConfig
from .proxy_memory import MemoryOptions, ProxyMemory
from .shm_ring import private_dir
from .template import EXITED, FAILED, FORKED, LAUNCH, READY, SPARE, write_frame

_LATER = object()  # an operation that replies by itself, later
STOP_GRACE_S = 5.0
TIMER_PERIOD_S = 1e-3
MAX_SLEEP_S = 0.05
CONTROL_PERIOD_S = 100e-6
PARENT_CHECK_S = 0.2
_ZMQ_EVENTS, _ZMQ_POLLIN = int(zmq.EVENTS), int(zmq.POLLIN)
ENDED_MEMORY = 4096


def _now() -> float:
    return time.perf_counter()


def _dtype(name: Any) -> torch.dtype:
    if name not in DTYPES:
        raise TypeError(f"dtype {name!r} is not one of {sorted(DTYPES)}")
    return getattr(torch, name)


def describe_status(status: int) -> str:
    code = os.waitstatus_to_exitcode(status)
    if code < 0:
        with contextlib.suppress(ValueError):
            return f"was killed by {signal.Signals(-code).name}"
        return f"was killed by signal {-code}"
    return f"exited with code {code}"


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

    @property
    def holder(self) -> tuple[str, int]:
        return ("inv", self.id)


@dataclass(eq=False)
class Instance:
    id: int
    spec: FunctionSpec
    stream: Stream
    state: str  # starting, busy, idle, stopping, dead
    created: float
    deadline: float  # starting: registration deadline; stopping: kill deadline
    pid: int | None = None
    pidfd: int | None = None
    invocation: Invocation | None = None
    first: Invocation | None = None  # the request that started it
    gates: list[Any] = field(default_factory=list)  # IO-daemon tickets the stream must wait on
    refill: bool = False  # it took a pre-forked spare: ask for a new one after its first request
    held: deque[list[Any]] | None = None  # a call waits off the dispatcher: its later messages, in order

    @property
    def key(self) -> str:
        return f"{self.spec.name}#{self.id}"


@dataclass(eq=False)
class _Defer:
    """An operation that would block the dispatcher: its call (and every later message of the instance)
    is held until `future` is done, then the call runs again from the start, or `then()` continues it
    (its value, `_LATER` or another `_Defer`). `what` names the wait in the error of a failed `future`;
    `release` runs once the call has run again or was dropped."""

    future: Future[Any]
    what: str
    then: Callable[[], Any] | None = None
    release: Callable[[], None] | None = None


@dataclass(eq=False)
class _Waiter:
    instance: Instance
    invocation: Invocation
    call_id: int
    key: str
    timeout: float
    deadline: float


@dataclass
class ProxyStats:
    invocations: int = 0
    failures: int = 0
    cold_starts: int = 0
    instances_started: int = 0
    instances_stopped: int = 0
    instances_died: int = 0
    calls: int = 0
    cold_start_s: list[float] = field(default_factory=list)  # fork + stream + registration, recent


class ProxyServer:
    """One workflow's proxy (see the module doc). `start()`, then `serve_forever()`, then `close()`."""

    def __init__(self, config: ProxyConfig) -> None:
        self.config = config
        self.workflow = config.workflow
        self.functions = {f.name: f for f in config.functions}
        self.stats = ProxyStats()
        self.timings: dict[str, float] = {}
        self.buffers = BufferTable()
        self._ended: OrderedDict[str, None] = OrderedDict()  # requests whose keys were dropped
        self.instances: dict[int, Instance] = {}
        self.pools = {f.name: InstancePool(f.max_instances, config.keep_alive_s) for f in config.functions}
        self.queues: dict[str, deque[Invocation]] = {f.name: deque() for f in config.functions}
        self.plans: dict[tuple[str, int, tuple[int, ...]], KernelPlan] = {}
        self._ids = itertools.count(1)
        self._inv_ids = itertools.count(1)
        self._waiters: dict[str, list[_Waiter]] = {}
        self._polls: list[tuple[Instance, Event, Callable[[BaseException | None], None]]] = []
        self._retiring: list[Stream] = []  # streams of dropped instances, destroyed once retired
        self._posted: deque[Callable[[], None]] = deque()
        self._pids: dict[int, int] = {}  # pid -> instance id
        self._spares = 0  # pre-forked spares the template reported and no assignment took yet
        self._stop = False
        self._parent = os.getppid()
        self._next_parent_check = 0.0
        self._evt_buf = bytearray()
        self._sync_pool: ThreadPoolExecutor | None = None
        # Work the dispatcher must not wait for: plans read or lowered, weights issued by the daemon.
        self._lower_pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="streambox-lower")
        self._wait_pool = ThreadPoolExecutor(max_workers=8, thread_name_prefix="streambox-issue")
        self._lowerings: dict[tuple[str, int, tuple[int, ...]], Future[KernelPlan]] = {}
        self._closing = False
        self._ops: dict[str, Callable[..., Any]] = {
            "noop": self._op_noop,
            "upload": self._op_upload,
            "download": self._op_download,
            "infer": self._op_infer,
            "put": self._op_put,
            "get": self._op_get,
            "delete": self._op_delete,
            "alloc": self._op_alloc,
            "free": self._op_free,
            "memcpy": self._op_memcpy,
            "launch": self._op_launch,
            "synchronize": self._op_synchronize,
            "plan": self._op_plan,
        }

    # ================================================================================= start / stop
    def start(self) -> ProxyServer:
        cfg = self.config
        started = _now()
        self.dir = Path(cfg.directory) if cfg.directory else private_dir(f"sbx-{cfg.workflow[:16]}-")
        self._spawn_template()  # before this process has any thread: the template is a clean spawn
        device = Config.from_env().with_overrides(
            backend=cfg.backend,
            device_preset=cfg.device_preset,
            gpus=cfg.gpus,
            state_dir=Path(cfg.state_dir) if cfg.state_dir else None,
            model_pool=Path(cfg.model_pool) if cfg.model_pool else None,
        )
        self.backend = device.open_backend()
        t = _now()
        self.runtime = self.backend.open_runtime(cfg.device)
        self.timings["runtime_s"] = _now() - t
        self.timings["modelled_context_s"] = getattr(
            getattr(self.backend, "spec", None), "context_create_s", 0.0
        )
        # The system's mechanisms, each switchable per run (`ProxyConfig.settings()`).
        self.io = IODaemon(self.runtime, cfg.daemon_config())
        options = MemoryOptions(
            mode=cfg.resolved_pool_mode,
            keep_alive_s=cfg.resolved_weights_keep_alive_s,
            recycler=cfg.resolved_recycler,
        )
        self.memory = ProxyMemory(self.runtime, options, daemon=self.io).start()
        self.service = self.runtime.create_stream()  # frees of buffers that outlive their holders
        # The store's capacity: a fraction of the idle memory the pool's demand model predicts over
        # the window. It allocates from the pool (it fences and retires its own streams' frees).
        store_idle = PoolIdleMemory(self.memory.pool, self.memory.board, self.memory.scaler)
        store = CommStore(
            {cfg.device: self.runtime},
            {cfg.device: self.memory.pool},
            node=f"proxy-{cfg.workflow}",
            idle={cfg.device: store_idle},
            config=StoreConfig(),
            clock=_now,  # the position board's clock, which the prediction compares `now` with
        )
        store_idle.store_bytes = lambda: store.usage()[cfg.device]
        self.store = store.start()
        # An allocation the pool cannot meet first asks the store to move stored data off the GPU
        # (to a peer GPU or host memory, by the store's rules) before it fails.
        self.memory.pool.add_pressure_handler(lambda nbytes: self.store.reclaim(cfg.device, nbytes))
        self.model_pool = ModelPool(device.model_pool)
        t = _now()
        for spec in cfg.functions:
            for model in spec.models:
                self._load(model, spec.batch)
        self.service.synchronize()
        self.timings["models_s"] = _now() - t
        if cfg.completion == "sync":
            self._sync_pool = ThreadPoolExecutor(max_workers=32, thread_name_prefix="streambox-sync")
        self.transport = make_server(
            cfg.channel, self.dir, capacity=cfg.ring_bytes, spin_s=cfg.spin_us * 1e-6
        )
        self._zmq = zmq.Context(io_threads=1)
        self.control = self._zmq.socket(zmq.ROUTER)
        self.control.setsockopt(zmq.LINGER, 0)
        path = self.dir / "control.sock"
        self.control.bind(f"ipc://{path}")
        os.chmod(path, 0o600)
        self._await_template()
        self.poller = zmq.Poller()
        self.poller.register(self.control, zmq.POLLIN)
        for item in self.transport.poll_items():
            self.poller.register(item, zmq.POLLIN)
        self.poller.register(self._evt_r, zmq.POLLIN)
        self.timings["start_s"] = _now() - started
        return self

    def _spawn_template(self) -> None:
        cfg = self.config
        cmd_r, self._cmd_w = os.pipe()
        self._evt_r, evt_w = os.pipe()
        self._assign, assign_r = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self.template = subprocess.Popen(
            [sys.executable, "-c", LAUNCH, str(cmd_r), str(evt_w), str(assign_r.fileno())],
            pass_fds=(cmd_r, evt_w, assign_r.fileno()),
            cwd=self.dir,
            close_fds=True,
        )
        os.close(cmd_r)
        os.close(evt_w)
        assign_r.close()
        write_frame(
            self._cmd_w,
            {
                "workflow": cfg.workflow,
                "functions": {f.name: f.handler for f in cfg.functions},
                "sys_path": list(cfg.sys_path),
                "preload": list(cfg.preload),
                "huge_pages": cfg.huge_pages,
                "prefork": cfg.prefork,
            },
        )

    def _await_template(self, timeout: float = 300.0) -> None:
        deadline = _now() + timeout
        while True:
            for event in self._read_template_events(block_until=deadline):
                if event[0] == SPARE:
                    self._spares += 1
                elif event[0] == READY:
                    self.timings["template_collapsed_bytes"] = event[2]
                    os.set_blocking(self._evt_r, False)
                    return
                if event[0] == FAILED:
                    raise ProxyError(
                        f"the template of workflow {self.workflow!r} could not start:\n{event[1]}"
                    )
            if _now() >= deadline:
                raise ProxyError(f"the template of workflow {self.workflow!r} was not ready in {timeout} s")

    def _load(self, model: str, batch: int, shape: tuple[int, ...] | None = None) -> KernelPlan:
        """The plan of (model, batch, input shape without the batch; None: the configured default
        shape), its weights resident. A plan the model pool lacks is lowered here, once (blocking:
        for start-up; at serve time `_plan_for` reads or lowers plans on a helper thread)."""
        if shape is None:
            entry = self.model_pool.entry(model)  # zoo or registered; UnknownModelError names both
            shape = entry.small_input_shape if self.config.model_shapes == "small" else None
            shape = tuple(shape or entry.input_shape)
        key = (model, batch, tuple(shape))
        plan = self.plans.get(key)
        if plan is None:
            plan = self.model_pool.get_or_lower(model, batch, tuple(shape))
            weights = self.memory.models.acquire(plan, self.service)
            del weights
            loaded = self.runtime.create_event(timing=False)
            loaded.record(self.service)
            self.memory.models.release(plan.model, after=loaded)
            self.plans[key] = plan
        return plan

    def close(self) -> None:
        for inst in list(self.instances.values()):
            if inst.state not in ("dead", "starting"):
                self.transport.send(inst.id, wire.pack([wire.STOP]))
        with contextlib.suppress(OSError):
            os.close(self._cmd_w)  # the template exits; its children die with it
        self._assign.close()  # spares waiting for an assignment see the end and exit
        try:
            self.template.wait(timeout=STOP_GRACE_S)
        except subprocess.TimeoutExpired:
            self.template.kill()
            self.template.wait()
        for inst in list(self.instances.values()):
            self._drop_instance(inst, None)
        self._retire_streams(STOP_GRACE_S)
        if self._sync_pool is not None:
            self._sync_pool.shutdown(wait=True, cancel_futures=True)
        self._closing = True  # waits for the daemon give up; a lowering in progress finishes unheard
        self._wait_pool.shutdown(wait=True, cancel_futures=True)
        self._lower_pool.shutdown(wait=False, cancel_futures=True)
        self.io.close()
        self.store.close()
        self.memory.pool.fence(self.service)
        self.memory.close()
        self.runtime.close()
        self.transport.close()
        self.control.close(0)
        self._zmq.term()
        with contextlib.suppress(OSError):
            os.close(self._evt_r)
        shutil.rmtree(self.dir, ignore_errors=True)

    # ================================================================================= the loop
    def serve_forever(self) -> None:
        spin_s = self.config.spin_us * 1e-6
        poll_s = self.config.poll_us * 1e-6
        last_busy = _now()
        next_timer = next_control = 0.0
        transport, polls, on_message = self.transport, self._polls, self._on_message
        while not self._stop:
            n = transport.poll(on_message)
            if polls:
                n += self._poll_completions()
            if self._posted:
                n += self._run_posted()
            now = _now()
            if now >= next_control:  # the gateway's calls: checked every CONTROL_PERIOD_S when busy
                n += self._poll_control()
                next_control = now + CONTROL_PERIOD_S
            if now >= next_timer:
                n += self._read_template()
                n += self._timers(now)
                next_timer = now + TIMER_PERIOD_S
            if n:
                last_busy = now
                continue
            if polls:  # sync-lite: query the events again after a short sleep (the GIL is free meanwhile)
                time.sleep(poll_s)
                continue
            if now - last_busy < spin_s:
                os.sched_yield()
                continue
            if not transport.prepare_sleep():
                continue
            timeout = min(MAX_SLEEP_S, max(0.0, self._next_due() - now))
            self.poller.poll(timeout * 1000)
            transport.after_sleep()
            next_timer = next_control = 0.0

    def _on_message(self, instance_id: int, data: bytes) -> None:
        inst = self.instances.get(instance_id)
        if inst is None or inst.state == "dead":
            return
        try:
            message = wire.unpack(data)
            kind = message[0]
            if kind == wire.CALL:
                _, call_id, op, args = message
        except Exception as exc:  # noqa: BLE001 - a malformed message kills only its sender
            self._kill(inst, f"sent a malformed message ({exc})", FunctionCrashed)
            return
        if inst.held is not None and kind in (wire.CALL, wire.RESULT):
            inst.held.append(message)  # a call of the instance waits off the dispatcher: keep the order
            return
        if kind == wire.CALL:
            self._on_call(inst, message)
        elif kind == wire.RESULT:
            self._on_result(inst, message)
        elif kind == wire.HELLO:
            self._on_hello(inst, message)

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
                call_id, op, args = msgpack.unpackb(body, raw=False)
            except Exception:  # noqa: BLE001 - not one of ours: ignore
                continue
            try:
                if op == "invoke":
                    self._invoke(route, call_id, args)
                    continue
                value = self._control_op(op, args)
            except Exception as exc:  # noqa: BLE001 - reported to the caller
                self._control_reply(route, call_id, False, encode_error(exc))
            else:
                self._control_reply(route, call_id, True, value)
        return n

    def _control_op(self, op: str, args: Any) -> Any:
        if op == "ping":
            return {"workflow": self.workflow, "pid": os.getpid(), "timings": self.timings}
        if op == "end_request":
            return self.end_request(str(args["request_id"]))
        if op == "stats":
            return self.snapshot()
        if op == "shutdown":
            self._stop = True
            return True
        raise ProxyError(f"unknown control operation {op!r}")

    def _control_reply(self, route: bytes, call_id: int, ok: bool, value: Any) -> None:
        self.control.send_multipart([route, msgpack.packb([call_id, ok, value], use_bin_type=True)])

    def end_request(self, request_id: str) -> int:
        """Drop every key of a finished request (freed once unleased); later PUTs under the request's
        keys (an abandoned invocation still running) are refused. Returns how many keys went."""
        prefix = request_prefix(self.workflow, request_id)
        self._ended[prefix] = None
        while len(self._ended) > ENDED_MEMORY:
            self._ended.popitem(last=False)
        stored = self.store.keys()
        return sum(self.store.delete(key) for key in stored if key.startswith(prefix))

    def snapshot(self) -> dict[str, Any]:
        free, total = self.runtime.memory_info()
        pool = self.memory.pool
        by_function = {
            name: {
                "instances": len(p),
                "idle": len(p.idle),
                "busy": len(p.busy),
                "queued": len(self.queues[name]),
            }
            for name, p in self.pools.items()
        }
        s = self.stats
        return {
            "workflow": self.workflow,
            "functions": by_function,
            "invocations": s.invocations,
            "failures": s.failures,
            "cold_starts": s.cold_starts,
            "instances_started": s.instances_started,
            "instances_stopped": s.instances_stopped,
            "instances_died": s.instances_died,
            "calls": s.calls,
            "cold_start_s": s.cold_start_s[-256:],
            "device": {
                "index": self.config.device,
                "runtime_bytes": self.runtime.allocated_bytes(),
                "used_bytes": total - free,
                "total_bytes": total,
            },
            "pool": {"reserved_bytes": pool.reserved_bytes, "allocated_bytes": pool.allocated_bytes},
            "keys": len(self.store.keys()),
            "buffers": len(self.buffers),
            # Streams of dropped instances not destroyed yet, and streams the pool holds frees for.
            "retiring_streams": len(self._retiring),
            "pool_tracked_streams": len(self.memory.pool.tracked_streams()),
            "buffer_bytes": self.buffers.nbytes,
            "models_resident_bytes": self.memory.models.resident_bytes,
            "models": {"loads": self.memory.models.loads, "evictions": self.memory.models.evictions},
            "io": asdict(self.io.stats),
            "settings": self.config.settings(),  # the mechanisms this run used, defaults resolved
            "timings": self.timings,
        }

    # ================================================================================= invocations
    def _invoke(self, route: bytes, call_id: int, args: dict[str, Any]) -> None:
        name = args.get("function")
        spec = self.functions.get(name)
        if spec is None:
            known = ", ".join(self.functions)
            raise UnknownFunction(
                f"workflow {self.workflow!r} has no function {name!r}; its functions: {known}"
            )
        now = _now()
        timeout = float(args.get("timeout_s") or spec.timeout_s)
        inv = Invocation(
            next(self._inv_ids),
            name,
            str(args.get("request_id") or ""),
            args.get("event"),
            (route, call_id),
            now,
            now + timeout,
            timeout,
        )
        self.stats.invocations += 1
        decision = self.pools[name].acquire(now)
        if decision.action == "warm":
            self._dispatch(self.instances[decision.instance], inv)  # type: ignore[index]
        elif decision.action == "start":
            inv.cold = True
            self._start_instance(spec, inv)
        else:
            self.queues[name].append(inv)

    def _start_instance(self, spec: FunctionSpec, inv: Invocation | None) -> Instance:
        now = _now()
        iid = next(self._ids)
        stream = self.runtime.create_stream()
        endpoint = self.transport.add(iid)
        inst = Instance(iid, spec, stream, "starting", now, now + self.config.start_timeout_s, first=inv)
        self.instances[iid] = inst
        self.pools[spec.name].add(iid, now, busy=True)
        self.stats.instances_started += 1
        if inv is not None:
            self.stats.cold_starts += 1
        try:
            if self._spares > 0:  # a pre-forked spare takes it
                self._spares -= 1
                inst.refill = True
                self._assign.send(msgpack.packb([iid, spec.name, endpoint], use_bin_type=True))
            else:  # no spare ready (or prefork 0): fork now
                write_frame(self._cmd_w, [iid, spec.name, endpoint])
        except OSError as exc:
            self._instance_died(inst, f"could not be forked: the template is gone ({exc})", FunctionCrashed)
        return inst

    def _on_hello(self, inst: Instance, message: list[Any]) -> None:
        _, iid, pid = message
        if inst.state != "starting" or iid != inst.id:
            return
        now = _now()
        inst.pid = pid
        self._pids[pid] = inst.id
        with contextlib.suppress(OSError):
            inst.pidfd = os.pidfd_open(pid)
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
        self.transport.send(inst.id, wire.pack([wire.INVOKE, inv.id, inv.request_id, inv.event]))

    def _on_result(self, inst: Instance, message: list[Any]) -> None:
        _, inv_id, ok, value = message
        inv = inst.invocation
        if inv is None or inv.id != inv_id:
            return
        inst.state = "finishing"
        inv.result_at = _now()
        end = self._record(inst.stream)

        def finished(error: BaseException | None) -> None:
            if inst.invocation is not inv:
                return  # the instance died meanwhile; the request has been failed already
            nonlocal ok, value
            if not ok:
                kind, message, text = (
                    [*value, "", "", ""] if isinstance(value, list) else ["?", str(value), ""]
                )[:3]
                value = encode_error(
                    FunctionFailed(
                        f"{kind}: {message} (function {inv.function!r}, request {inv.request_id!r})\n{text}"
                    )
                )
            elif error is not None:
                ok = False
                value = encode_error(error)
            self._end_invocation(inv, inst, end)
            inst.invocation = None
            self._reply_invocation(inv, ok, value)
            self._instance_free(inst)

        self._complete(inst, end, finished)

    def _reply_invocation(self, inv: Invocation, ok: bool, value: Any) -> None:
        if not ok:
            self.stats.failures += 1
        now = _now()
        if ok:
            value = {
                "output": value,
                "cold_start": inv.cold,
                "latency_s": now - inv.arrived,
                "start_s": inv.start_s,
                "queue_s": (inv.dispatched or now) - inv.arrived - inv.start_s,
                "run_s": (inv.result_at or now) - (inv.dispatched or now),  # INVOKE sent -> result back
                "finish_s": now - (inv.result_at or now),  # the request's device work completing
                "instance": inv.instance,
            }
        route, call_id = inv.reply_to
        self._control_reply(route, call_id, ok, value)

    def _refill_spare(self, inst: Instance) -> None:
        if inst.refill:
            inst.refill = False
            with contextlib.suppress(OSError):
                write_frame(self._cmd_w, [SPARE])

    def _instance_free(self, inst: Instance) -> None:
        """The instance finished a request: take the next queued one, or go idle."""
        self._refill_spare(inst)
        queue = self.queues[inst.spec.name]
        pool = self.pools[inst.spec.name]
        now = _now()
        if queue:
            pool.reuse(inst.id, now)
            self._dispatch(inst, queue.popleft())
        else:
            pool.release(inst.id, now)
            inst.state = "idle"

    # ================================================================================= instance death
    def _kill(self, inst: Instance, reason: str, error: type[ProxyError]) -> None:
        try:
            if inst.pidfd is not None:
                signal.pidfd_send_signal(inst.pidfd, signal.SIGKILL)
            elif inst.pid is not None:
                os.kill(inst.pid, signal.SIGKILL)
        except (ProcessLookupError, OSError):
            pass
        self._instance_died(inst, reason, error)

    def _instance_died(self, inst: Instance, reason: str, error: type[ProxyError]) -> None:
        if inst.state == "dead":
            return
        self.stats.instances_died += inst.state != "stopping"
        failed = [inv for inv in (inst.invocation, inst.first) if inv is not None]
        for inv in failed:
            where = f"during request {inv.request_id!r}"
            self._end_invocation(inv, inst, None)
            self._reply_invocation(
                inv,
                False,
                encode_error(error(f"instance {inst.id} of function {inst.spec.name!r} {reason} {where}")),
            )
        self._drop_instance(inst, reason)
        self._refill(inst.spec)

    def _drop_instance(self, inst: Instance, reason: str | None) -> None:
        """Free everything of an instance: its requests' buffers, its waits, its stream, its channel."""
        if inst.state != "dead" and not self._stop:
            self._refill_spare(inst)
        inst.state = "dead"
        inst.invocation = inst.first = None
        inst.held = None
        for gate in inst.gates:
            with contextlib.suppress(Exception):
                gate.wait_all(inst.stream, timeout=STOP_GRACE_S)
        inst.gates.clear()
        for waiters in self._waiters.values():
            waiters[:] = [w for w in waiters if w.instance is not inst]
        self._polls[:] = [p for p in self._polls if p[0] is not inst]
        with contextlib.suppress(Exception):
            self.memory.executor.release_instance(inst.key)
        with contextlib.suppress(Exception):
            self.store.release_owner(inst.key)
        self._retiring.append(inst.stream)
        self._retire_streams(0.0)
        self.transport.remove(inst.id)
        self.pools[inst.spec.name].remove(inst.id)
        self.instances.pop(inst.id, None)
        if inst.pid is not None:
            self._pids.pop(inst.pid, None)
        if inst.pidfd is not None:
            with contextlib.suppress(OSError):
                os.close(inst.pidfd)

    def _refill(self, spec: FunctionSpec) -> None:
        """Queued requests of `spec` whose instances are gone get new ones."""
        queue, pool = self.queues[spec.name], self.pools[spec.name]
        while queue and pool.acquire(_now()).action == "start":
            inv = queue.popleft()
            inv.cold = True
            self._start_instance(spec, inv)

    # ================================================================================= template events
    def _read_template_events(self, block_until: float | None = None) -> list[list[Any]]:
        if block_until is not None:
            import select

            select.select([self._evt_r], [], [], max(0.0, block_until - _now()))
        try:
            chunk = os.read(self._evt_r, 1 << 16)
        except BlockingIOError:
            chunk = None
        if chunk == b"":
            raise ProxyError(f"the template of workflow {self.workflow!r} exited")
        if chunk:
            self._evt_buf += chunk
        events = []
        buf = self._evt_buf
        while len(buf) >= 4:
            size = int.from_bytes(buf[:4], "little")
            if len(buf) < 4 + size:
                break
            events.append(msgpack.unpackb(bytes(buf[4 : 4 + size]), raw=False))
            del buf[: 4 + size]
        return events

    def _read_template(self) -> int:
        try:
            events = self._read_template_events()
        except ProxyError as exc:
            return self._template_died(str(exc))
        for event in events:
            if event[0] == SPARE:
                self._spares += 1
            elif event[0] == FORKED:
                _, iid, pid = event
                inst = self.instances.get(iid)
                if inst is not None and inst.pid is None:
                    inst.pid = pid
                    self._pids[pid] = iid
            elif event[0] == EXITED:
                _, pid, status = event
                iid = self._pids.pop(pid, None)
                inst = self.instances.get(iid) if iid is not None else None
                if inst is None:
                    continue
                if inst.state == "stopping":  # keep-alive ran out: scaled down
                    self.stats.instances_stopped += 1
                    self._drop_instance(inst, "stopped")
                else:
                    self._instance_died(inst, describe_status(status), FunctionCrashed)
        return len(events)

    def _template_died(self, reason: str) -> int:
        """Every instance died with the template: fail their requests, start a new template."""
        for inst in list(self.instances.values()):
            self._instance_died(inst, f"died with its template ({reason})", FunctionCrashed)
        with contextlib.suppress(OSError):
            os.close(self._cmd_w)
        self._assign.close()
        self.poller.unregister(self._evt_r)
        os.close(self._evt_r)
        self._evt_buf.clear()
        self._spares = 0
        with contextlib.suppress(Exception):
            self.template.wait(timeout=1.0)
        self._spawn_template()
        self._await_template()
        self.poller.register(self._evt_r, zmq.POLLIN)
        return 1

    # ================================================================================= timers
    def _retire_streams(self, timeout_s: float) -> None:
        """Destroy the streams of dropped instances once the pool holds no free pending on them:
        a stream still running (a killed instance's last kernels) waits for a later turn, so the
        dispatcher never blocks on it and no pending block ever refers to a destroyed stream."""
        still = []
        for stream in self._retiring:
            if self.memory.pool.retire_stream(stream, timeout_s=timeout_s):
                stream.destroy()
            else:
                still.append(stream)
        self._retiring = still

    def _timers(self, now: float) -> int:
        n = 0
        if self._retiring:
            self._retire_streams(0.0)
        if now >= self._next_parent_check:
            self._next_parent_check = now + PARENT_CHECK_S
            if os.getppid() != self._parent:  # the launcher died: shut down (instances with us)
                self._stop = True
        for inst in list(self.instances.values()):
            if inst.state == "starting" and now >= inst.deadline:
                self._kill(inst, f"did not register within {self.config.start_timeout_s} s", FunctionCrashed)
                n += 1
            elif inst.state in ("busy", "finishing") and inst.invocation and now >= inst.invocation.deadline:
                self._kill(
                    inst, f"timed out after {inst.invocation.limit:g} s and was killed", FunctionTimeout
                )
                n += 1
            elif inst.state == "stopping" and now >= inst.deadline:
                self._kill(inst, "did not stop", FunctionCrashed)
                n += 1
        for name, queue in self.queues.items():
            while queue and now >= queue[0].deadline:
                inv = queue.popleft()
                self._reply_invocation(
                    inv,
                    False,
                    encode_error(
                        FunctionTimeout(
                            f"request {inv.request_id!r} of {name!r} waited "
                            f"{now - inv.arrived:.1f} s for an instance"
                        )
                    ),
                )
                n += 1
        n += self._retry_waiters(now)
        for name, pool in self.pools.items():
            for iid in pool.expired(now):
                inst = self.instances[iid]
                pool.remove(iid)
                inst.state = "stopping"
                inst.deadline = now + STOP_GRACE_S
                self.transport.send(iid, wire.pack([wire.STOP]))
                n += 1
            del name
        return n

    def _next_due(self) -> float:
        due = [_now() + MAX_SLEEP_S]
        for inst in self.instances.values():
            if inst.state in ("starting", "stopping"):
                due.append(inst.deadline)
            elif inst.invocation is not None:
                due.append(inst.invocation.deadline)
        for pool in self.pools.values():
            at = pool.next_expiry()
            if at is not None:
                due.append(at)
        for queue in self.queues.values():
            if queue:
                due.append(queue[0].deadline)
        if self._waiters:  # GETs waiting for a PUT that may come from outside: look again soon
            due.append(_now() + TIMER_PERIOD_S)
        return min(due)

    # ================================================================================= completion
    def _record(self, stream: Stream) -> Event:
        event = self.runtime.create_event(timing=False)
        event.record(stream)
        return event

    def _complete(self, inst: Instance, event: Event, then: Callable[[BaseException | None], None]) -> None:
        """Call `then(error)` on the dispatcher once `event` (the tail of the instance's stream) is done."""
        if self._sync_pool is None:
            self._polls.append((inst, event, then))
            return

        def wait() -> None:
            error: BaseException | None = None
            try:
                inst.stream.synchronize()
            except BaseException as exc:  # noqa: BLE001 - handed to the dispatcher
                error = exc
            self._posted.append(lambda: then(error))
            self.transport.wake()

        self._sync_pool.submit(wait)

    def _poll_completions(self) -> int:
        done, waiting = [], []
        for p in self._polls:
            (done if p[1].query() else waiting).append(p)
        if not done:
            return 0
        self._polls[:] = waiting  # the same list: callbacks below may add to it
        for _, event, then in done:
            error: BaseException | None = None
            try:
                event.synchronize()  # complete already: returns at once, raising the stream's errors
            except BaseException as exc:  # noqa: BLE001 - reported to the call that waited
                error = exc
            then(error)
        return len(done)

    def _run_posted(self) -> int:
        n = 0
        while self._posted:
            self._posted.popleft()()
            n += 1
        return n

    # ================================================================================= calls
    def _reply(self, inst: Instance, call_id: int, ok: bool, value: Any) -> None:
        self.transport.send(inst.id, wire.pack([wire.REPLY, call_id, ok, value]))

    def _on_call(self, inst: Instance, message: list[Any], again: bool = False) -> None:
        _, call_id, op, args = message
        self.stats.calls += not again
        inv = inst.invocation
        try:
            fn = self._ops.get(op)
            if fn is None:
                raise ProxyError(f"unknown call {op!r}; calls: {', '.join(sorted(self._ops))}")
            if inv is None:
                raise ProxyError(f"call {op!r} outside an invocation")
            result = self._gates_pending(inst) if inst.gates else None
            if result is None:
                if inst.gates:
                    self._gate(inst)
                result = fn(inst, inv, call_id, *args)
        except Exception as exc:  # noqa: BLE001 - a failed call fails only that call
            self._reply(inst, call_id, False, encode_error(exc))
            return
        self._answer(inst, inv, message, result)

    def _answer(self, inst: Instance, inv: Invocation, message: list[Any], result: Any) -> None:
        if isinstance(result, _Defer):
            self._hold(inst, inv, message, result)
        elif result is not _LATER:
            self._reply(inst, message[1], True, result)

    # -- calls that wait off the dispatcher --------------------------------------------------------
    def _post(self, fn: Callable[[], None]) -> None:
        """Run `fn` on the dispatcher (from any thread)."""
        self._posted.append(fn)
        self.transport.wake()

    def _hold(self, inst: Instance, inv: Invocation, message: list[Any], defer: _Defer) -> None:
        """Hold the instance's messages until `defer.future` is done, then resume the call."""
        inst.held = deque()
        defer.future.add_done_callback(lambda _: self._post(lambda: self._resume(inst, inv, message, defer)))

    def _resume(self, inst: Instance, inv: Invocation, message: list[Any], defer: _Defer) -> None:
        held, inst.held = inst.held, None
        try:
            if inst.state == "dead" or inst.invocation is not inv:
                return  # the instance died or its request ended meanwhile (it was failed then)
            error = defer.future.exception()
            if error is not None:
                why = ProxyError(f"{defer.what} failed: {type(error).__name__}: {error}")
                self._reply(inst, message[1], False, encode_error(why))
            elif defer.then is None:
                self._on_call(inst, message, again=True)
            else:
                try:
                    result = defer.then()
                except Exception as exc:  # noqa: BLE001 - a failed call fails only that call
                    self._reply(inst, message[1], False, encode_error(exc))
                else:
                    self._answer(inst, inv, message, result)
        finally:
            if defer.release is not None:
                defer.release()
        while held and inst.state != "dead":
            if inst.held is not None:  # a call held again: the rest waits behind it
                inst.held.extend(held)
                return
            later = held.popleft()
            if later[0] == wire.CALL:
                self._on_call(inst, later)
            else:
                self._on_result(inst, later)

    def _wait_issued(self, tickets: list[Any]) -> None:
        """On a helper thread: until the daemon has issued every block of `tickets` (or failed them:
        the call that runs again meets the error)."""
        for ticket in tickets:
            while not self._closing:
                try:
                    ticket.last_event(timeout=0.2)
                except TimeoutError:
                    continue
                except Exception:  # noqa: BLE001 - the ticket's error, raised where the call uses it
                    pass
                break

    def _gates_pending(self, inst: Instance) -> _Defer | None:
        """The instance's uploads the daemon has not issued yet (waiting for their events would block)."""
        pending = [t for t in inst.gates if not t.issued and t.error is None]
        if not pending:
            return None
        return _Defer(self._wait_pool.submit(self._wait_issued, pending), "uploading the inputs")

    def _weights_pending(self, plan: KernelPlan) -> _Defer | None:
        """If the weights of `plan` are not resident or not all issued by the daemon yet: a wait for
        that on a helper thread (which holds the model until the call has run again)."""
        models = self.memory.models
        if not models.would_block(plan):
            return None
        future = self._wait_pool.submit(models.hold_issued, plan, lambda: self._closing)

        def release() -> None:
            if future.exception() is None:
                models.release(plan.model)

        return _Defer(future, f"loading the weights of {plan.model}", release=release)

    def _plan_for(self, model: str, batch: int, shape: tuple[int, ...]) -> KernelPlan | _Defer:
        """The plan of (model, batch, shape) if the proxy has it, else a wait for it: read from the model
        pool or lowered on a helper thread, once however many calls want it."""
        key = (model, batch, shape)
        plan = self.plans.get(key)
        if plan is not None:
            return plan
        future = self._lowerings.get(key)
        if future is None:
            future = self._lower_pool.submit(self.model_pool.get_or_lower, model, batch, shape)
            self._lowerings[key] = future
            future.add_done_callback(lambda f: self._post(lambda: self._lowered(key, f)))
        shape_text = "x".join(map(str, shape))
        return _Defer(future, f"lowering {model} for batch {batch}, input shape {shape_text}")

    def _lowered(self, key: tuple[str, int, tuple[int, ...]], future: Future[KernelPlan]) -> None:
        if self._lowerings.get(key) is future:
            del self._lowerings[key]  # a failed one is tried again by the next call that wants it
        if future.exception() is None:
            self.plans.setdefault(key, future.result())

    def _gate(self, inst: Instance) -> None:
        """Later work on the stream waits for the instance's uploads (IO daemon block events; issued
        already where the dispatcher calls this, so it does not block)."""
        gates, inst.gates = inst.gates, []
        for ticket in gates:
            ticket.wait_all(inst.stream)

    def _handle(self, t: DeviceTensor) -> Handle:
        return Handle(
            self.workflow,
            t.address,
            str(t.dtype).removeprefix("torch."),
            tuple(t.shape),
            tuple(t.strides),
            t.nbytes,
        )

    def _tensor(self, inv: Invocation, obj: Any) -> DeviceTensor:
        """The live buffer a function's handle names (held by `inv` from now on), or a clear refusal."""
        h = Handle.from_wire(obj)
        if h.workflow != self.workflow:
            raise IsolationError(
                f"handle {h.address:#x} belongs to workflow {h.workflow!r}; the proxy of workflow "
                f"{self.workflow!r} refuses it"
            )
        buf = self.buffers.get(h.address)
        if buf is None:
            raise UnknownHandle(
                f"handle {h.address:#x} names no live buffer of workflow {self.workflow!r} "
                f"(freed, or never allocated here)"
            )
        itemsize = DTYPES[h.dtype]
        span = (
            0
            if h.numel == 0
            else itemsize * (1 + sum((d - 1) * s for d, s in zip(h.shape, h.strides, strict=True)))
        )
        if span > buf.nbytes or h.nbytes > buf.nbytes or min(h.strides, default=0) < 0:
            raise UnknownHandle(
                f"handle {h.address:#x} claims {max(span, h.nbytes)} bytes; the buffer has {buf.nbytes}"
            )
        self.buffers.hold(h.address, inv.holder)
        return DeviceTensor(h.address, _dtype(h.dtype), h.shape, h.strides, h.nbytes)

    def _register(self, t: DeviceTensor, inv: Invocation) -> Handle:
        self.buffers.add(t.address, t.nbytes, t, inv.holder)
        return self._handle(t)

    def _release(self, address: int, holder: Any, event: Event | None, *, fence: bool = True) -> bool:
        """`holder` lets go of a buffer; the last one frees it (on the service stream, after the
        events its holders left). True if freed."""
        buf = self.buffers.release(address, holder, event)
        if buf is None or buf.external:
            return False
        stream = self.service
        for e in buf.events:
            stream.wait_event(e)
        self.memory.pool.free(address, stream)
        if fence:
            self.memory.pool.fence(stream)
        return True

    def _end_invocation(self, inv: Invocation, inst: Instance, event: Event | None) -> None:
        """The request is over: free the buffers it made (not PUT) and hand back the store's leases,
        both after the work issued on the instance's stream so far."""
        if event is None:
            event = self._record(inst.stream)
        freed = [self._release(a, inv.holder, event, fence=False) for a in self.buffers.held_by(inv.holder)]
        if any(freed):
            self.memory.pool.fence(self.service)
        for lease in inv.leases:
            with contextlib.suppress(Exception):
                lease.release(inst.stream)
        inv.leases.clear()

    def _function_plan(self, spec: FunctionSpec, model: str) -> KernelPlan:
        if model not in spec.models:
            raise UnknownModel(
                f"function {spec.name!r} declared models {list(spec.models)}; {model!r} is not among them"
            )
        return self._load(model, spec.batch)

    # -- the operations ------------------------------------------------------------------------
    def _op_noop(self, inst: Instance, inv: Invocation, call_id: int) -> None:
        return None

    def _alloc(self, inst: Instance, dtype: torch.dtype, shape: tuple[int, ...]) -> DeviceTensor:
        if any(d < 0 for d in shape):
            raise ValueError(f"negative dimension in shape {shape}")
        nbytes = math.prod(shape) * dtype.itemsize
        address = self.memory.pool.allocate(max(nbytes, 1), inst.stream)
        return DeviceTensor(address, dtype, shape, contiguous_strides(shape), nbytes)

    def _upload(self, inst: Instance, inv: Invocation, payload: Any) -> DeviceTensor:
        dtype_name, shape, data = payload
        dtype = _dtype(dtype_name)
        shape = tuple(int(d) for d in shape)
        t = self._alloc(inst, dtype, shape)
        if len(data) != t.nbytes:
            self.memory.pool.free(t.address, inst.stream)
            raise ValueError(f"tensor of {dtype_name}{list(shape)} needs {t.nbytes} bytes, got {len(data)}")
        if t.nbytes:
            host = torch.frombuffer(bytearray(data), dtype=torch.uint8)
            # stream: where stream-only mode issues the copy (the daemon's own ring and stream otherwise)
            inst.gates.append(
                self.io.submit(inst.key, [CopyRequest(t.address, host, t.nbytes)], stream=inst.stream)
            )
        self._register(t, inv)
        return t

    def _op_upload(self, inst: Instance, inv: Invocation, call_id: int, payload: Any) -> Handle:
        return self._handle(self._upload(inst, inv, payload))

    def _op_download(self, inst: Instance, inv: Invocation, call_id: int, handle: Any) -> Any:
        t = self._tensor(inv, handle)
        host = torch.empty(t.nbytes, dtype=torch.uint8)
        if t.nbytes:
            self.runtime.copy_dtoh_async(host, t.address, t.nbytes, inst.stream)
        done = self._record(inst.stream)

        def reply(error: BaseException | None) -> None:
            if error is None:
                self._reply(inst, call_id, True, host.numpy().data)
            else:
                self._reply(inst, call_id, False, encode_error(error))

        self._complete(inst, done, reply)
        return _LATER

    def _op_infer(self, inst: Instance, inv: Invocation, call_id: int, model: str, inputs: list[Any]) -> Any:
        plan = self._function_plan(inst.spec, model)
        if len(inputs) != len(plan.inputs):
            raise ValueError(
                f"model {model!r} takes {len(plan.inputs)} input(s) {plan.inputs}, got {len(inputs)}"
            )
        # Nothing is done before the plan and the weights are at hand (a deferred call runs again).
        item = inputs[0]
        shape = tuple(
            int(d) for d in (item["tensor"][1] if isinstance(item, dict) else Handle.from_wire(item).shape)
        )
        if len(shape) >= 1 and shape != tuple(plan.variables[plan.inputs[0]].shape):
            # Another batch size or input shape: that plan (read or lowered once), sharing the weights.
            found = self._plan_for(model, shape[0], shape[1:])
            if isinstance(found, _Defer):
                return found
            plan = found
        waiting = self._weights_pending(plan)
        if waiting is not None:
            return waiting
        given = [
            self._upload(inst, inv, item["tensor"]) if isinstance(item, dict) else self._tensor(inv, item)
            for item in inputs
        ]
        return self._infer_run(inst, inv, model, plan, given)

    def _infer_run(
        self, inst: Instance, inv: Invocation, model: str, plan: KernelPlan, given: list[DeviceTensor]
    ) -> list[Handle] | _Defer:
        """The rest of `infer`, its inputs uploaded: continued later (never run again) if the daemon
        has not issued the uploads' copies yet (or the weights went meanwhile)."""
        waiting = self._weights_pending(plan) or (self._gates_pending(inst) if inst.gates else None)
        if waiting is not None:
            waiting.then = lambda: self._infer_run(inst, inv, model, plan, given)
            return waiting
        tensors: dict[str, DeviceTensor] = {}
        for name, t in zip(plan.inputs, given, strict=True):
            var = plan.variables[name]
            if tuple(t.shape) != tuple(var.shape) or t.dtype != var.torch_dtype:
                raise ValueError(
                    f"model {model!r} (batch {plan.batch}) expects input {name} of "
                    f"{var.dtype}{list(var.shape)}, got {str(t.dtype).removeprefix('torch.')}{list(t.shape)}"
                )
            tensors[name] = t
        if inst.gates:
            self._gate(inst)
        result = self.memory.infer(inst.key, plan, tensors, inst.stream)
        handles = []
        for name in plan.outputs:
            out = result.outputs[name]
            if out.address in self.buffers:
                self.buffers.hold(out.address, inv.holder)
                handles.append(self._handle(out))
            elif plan.variables[plan.root(name)].kind in ("output", "intermediate"):
                handles.append(self._register(out, inv))
            else:
                raise ProxyError(f"model {model!r}: output {name} aliases a weight; not supported")
        return handles

    def _op_put(
        self, inst: Instance, inv: Invocation, call_id: int, key: str, handle: Any, consumers: Any, ttl: Any
    ) -> None:
        key = check_key(self.workflow, key)
        if any(key.startswith(prefix) for prefix in self._ended):
            raise ProxyError(f"PUT {key!r}: its request has ended and its keys were dropped")
        t = self._tensor(inv, handle)
        if self.buffers.get(t.address).external:  # type: ignore[union-attr]
            raise ProxyError(
                f"PUT {key!r}: this buffer already belongs to the communication store (it came from a GET "
                f"or an earlier PUT); PUT a copy instead (ctx.alloc + ctx.memcpy)"
            )
        self.store.put(key, t, device=self.config.device, consumers=consumers, ttl=ttl, stream=inst.stream)
        self.buffers.disown(t.address)  # the store owns the bytes now; the handle stays usable
        waiters = self._waiters.pop(key, [])
        if waiters:
            self._waiters[key] = waiters
            self._retry_waiters(_now(), key)

    def _take(self, inst: Instance, inv: Invocation, key: str) -> Any:
        """One GET served now (the caller's stream waits for the producer), or None if not there yet."""
        try:
            h = self.store.get(key, device=self.config.device, timeout=0.0, owner=inst.key)
        except GetTimeout:
            return None
        h.wait(inst.stream)
        inv.leases.append(h)
        t = DeviceTensor(h.address, h.dtype, tuple(h.shape), tuple(h.strides), h.nbytes)
        buf = self.buffers.get(h.address)
        if buf is not None and buf.external:
            self.buffers.hold(h.address, inv.holder)
        else:
            self.buffers.add(h.address, h.nbytes, t, inv.holder, external=True)
        return self._handle(t)

    def _retry_waiters(self, now: float, only: str | None = None) -> int:
        n = 0
        for key in [only] if only is not None else list(self._waiters):
            waiters = self._waiters.get(key, [])
            keep = []
            for w in waiters:
                if w.instance.invocation is not w.invocation:
                    continue  # its request ended or failed meanwhile
                value = self._take(w.instance, w.invocation, key)
                if value is not None:
                    self._reply(w.instance, w.call_id, True, value)
                    n += 1
                elif now >= w.deadline:
                    why = KeyNotFound(f"GET {key!r}: no data under this key after waiting {w.timeout:g} s")
                    self._reply(w.instance, w.call_id, False, encode_error(why))
                    n += 1
                else:
                    keep.append(w)
            if keep:
                self._waiters[key] = keep
            else:
                self._waiters.pop(key, None)
        return n

    def _op_get(self, inst: Instance, inv: Invocation, call_id: int, key: str, timeout: Any) -> Any:
        key = check_key(self.workflow, key)
        value = self._take(inst, inv, key)
        if value is not None:
            return value
        timeout = float(timeout if timeout is not None else 10.0)
        now = _now()
        self._waiters.setdefault(key, []).append(_Waiter(inst, inv, call_id, key, timeout, now + timeout))
        return _LATER

    def _op_delete(self, inst: Instance, inv: Invocation, call_id: int, key: str) -> bool:
        return self.store.delete(check_key(self.workflow, key))

    def _op_alloc(
        self, inst: Instance, inv: Invocation, call_id: int, dtype: str, shape: list[int]
    ) -> Handle:
        t = self._alloc(inst, _dtype(dtype), tuple(int(d) for d in shape))
        return self._register(t, inv)

    def _op_free(self, inst: Instance, inv: Invocation, call_id: int, handle: Any) -> None:
        t = self._tensor(inv, handle)
        self._release(t.address, inv.holder, self._record(inst.stream))

    def _op_memcpy(
        self, inst: Instance, inv: Invocation, call_id: int, dst: Any, src: Any, nbytes: Any
    ) -> None:
        d, s = self._tensor(inv, dst), self._tensor(inv, src)
        n = min(d.nbytes, s.nbytes) if nbytes is None else int(nbytes)
        if n < 0 or n > d.nbytes or n > s.nbytes:
            raise ValueError(f"memcpy of {n} bytes: destination has {d.nbytes}, source {s.nbytes}")
        self.runtime.copy_dtod_async(d.address, s.address, n, inst.stream)

    def _op_launch(
        self, inst: Instance, inv: Invocation, call_id: int, model: str, index: int, buffers: dict[str, Any]
    ) -> None:
        plan = self._function_plan(inst.spec, model)
        if not 0 <= index < len(plan.kernels):
            raise ValueError(f"model {model!r} has kernels 0..{len(plan.kernels) - 1}, not {index}")
        kernel = plan.kernels[index]
        if kernel.kind == "view":
            raise ValueError(
                f"kernel {index} ({kernel.name}) of {model!r} is a view: metadata only, nothing to launch"
            )
        waiting = self._weights_pending(plan)
        if waiting is not None:
            return waiting
        bound = {name: self._tensor(inv, h) for name, h in buffers.items()}
        missing = [n for n in kernel.accesses if plan.variables[n].kind != "weight" and n not in bound]
        if missing:
            raise ValueError(f"kernel {index} ({kernel.name}) of {model!r} needs buffers for {missing}")
        resident = self.memory.models.acquire(plan, inst.stream)  # issued: does not block
        try:
            env: dict[str, torch.Tensor] = dict(resident.weight_views)
            runtime = self.runtime
            views = [k for k in plan.kernels[:index] if k.kind == "view"]

            def run() -> object:
                for name, t in bound.items():
                    env[name] = t.view(runtime)
                for k in views:  # the aliases this kernel may read, rebuilt over the bound buffers
                    with contextlib.suppress(KeyError):
                        env.update(invoke_kernel(k, env))
                return invoke_kernel(kernel, env)

            out = plan.variables[kernel.outputs[0]]
            blocks = max(1, math.ceil(math.prod(out.shape) / ELEMENTS_PER_BLOCK))
            runtime.launch(inst.stream, run, blocks=blocks, name=kernel.name)
        finally:
            self.memory.models.release(plan.model, after=self._record(inst.stream))

    def _op_synchronize(self, inst: Instance, inv: Invocation, call_id: int) -> Any:
        def reply(error: BaseException | None) -> None:
            self._reply(inst, call_id, error is None, None if error is None else encode_error(error))

        self._complete(inst, self._record(inst.stream), reply)
        return _LATER

    def _op_plan(self, inst: Instance, inv: Invocation, call_id: int, model: str) -> dict[str, Any]:
        plan = self._function_plan(inst.spec, model)
        return {
            "model": plan.model,
            "batch": plan.batch,
            "inputs": plan.inputs,
            "outputs": plan.outputs,
            "variables": {
                v.name: {
                    "kind": v.kind,
                    "dtype": v.dtype,
                    "shape": v.shape,
                    "strides": v.strides,
                    "nbytes": v.nbytes,
                    "base": v.base,
                }
                for v in plan.variables.values()
            },
            "kernels": [
                {"name": k.name, "kind": k.kind, "accesses": k.accesses, "outputs": k.outputs}
                for k in plan.kernels
            ],
        }


def main(argv: list[str] | None = None) -> int:
    """Run one proxy: `argv[0]` is its `ProxyConfig` as JSON. Exits when told to shut down, on
    SIGTERM, or when the process that started it dies."""
    args = sys.argv[1:] if argv is None else argv
    config = ProxyConfig.from_json(args[0])
    # Not PR_SET_PDEATHSIG: it fires when the launching *thread* ends (launchers use thread pools).
    # The dispatcher's timers watch the parent process instead and shut down when it is gone.
    server = ProxyServer(config)

    def stop(signum: int, frame: Any) -> None:
        server._stop = True

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    try:
        server.start()
    except BaseException as exc:
        message = f"{type(exc).__name__}: {exc}"
        print(f"streambox proxy {config.workflow!r}: could not start: {message}", file=sys.stderr, flush=True)
        if config.directory:
            with contextlib.suppress(OSError):
                (Path(config.directory) / "start_error.txt").write_text(message)
        with contextlib.suppress(Exception):
            server.template.kill()
        return 2
    try:
        server.serve_forever()
    finally:
        server.close()
    return 0
