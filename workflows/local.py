"""Run-local: the embedded invoker, for development (`streambox run-local`) and the engine's tests.

Handlers run in threads of this process instead of in forked function processes behind the API proxy.
Everything below the handler is real: the device (emulated by default, or CUDA), the model pool's
kernel plans, the plan executor (lazy allocation, eager recycling), stream-ordered memory, one stream
per function instance, and keys whose device tensors are handed over without a copy. What the proxy
adds and this mode does not have: process isolation (a hung handler cannot be killed here; its
request still times out), the forwarding channel, the IO daemon, the auto-scaling memory pool and the
elastic communication store (here: the device's stream-ordered pool and a dict of keys).

Instances: each function keeps up to `max_instances` instances, each with its own stream. A call takes
an idle instance (warm) or starts one (cold start: a new stream); instances idle longer than
`keep_alive_s` are stopped. Model weights are uploaded on first use and stay resident, shared by the
workflow's functions.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import threading
import time
import traceback
from collections import OrderedDict
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch

from streambox.api_proxy.device_tensor import DeviceTensor, download_tensor, upload_tensor
from streambox.api_proxy.errors import IsolationError
from streambox.api_proxy.executor import DeviceModel, PlanExecutor, StreamPoolAllocator, upload_model
from streambox.api_proxy.handles import Handle, handle_in_json
from streambox.comm.errors import GetTimeout  # one GET-timeout error in every runtime
from streambox.comm.lease import span_bytes
from streambox.comm.store_protocol import check_put_args
from streambox.comm.tables import dtype_name, parse_dtype
from streambox.config import Config
from streambox.device import Event, Runtime, Stream
from streambox.kernel_compiler.model_pool import ModelPool
from streambox.sdk import GET_TIMEOUT_S, error_message_of, error_type_of

from .handlers import Handler, resolve_handler
from .invoker import InvocationError, InvocationResult, InvocationTimeout, RuntimeStats, deployed
from .spec import WorkflowSpec

SYSTEMS = ("streambox", "stream-only")
DEFAULT_KEEP_ALIVE_S = 600.0
DEFAULT_GET_TIMEOUT_S = GET_TIMEOUT_S  # the SDK's, as in every runtime
_ENDED_REMEMBERED = 4096


class StoreError(RuntimeError):
    """A put/get/delete the store refuses (ended request, tensor not owned, unknown key)."""


class Got(NamedTuple):
    """What a function-side store's GET returns (`comm.store_protocol.KeyStore`)."""

    tensor: DeviceTensor
    consumed: bool  # this GET took the key's last consumer: the reader owns the tensor now
    copy: bool  # a private copy made for this GET on the reader's stream (the reader frees it)
    ready: Event | None  # the reader's stream waits for it before using the tensor (None: no wait)


def ready_event(runtime: Runtime, stream: Stream | None) -> Event | None:
    """An event recorded on the producer's `stream` now (None: no stream, the bytes are ready)."""
    if stream is None:
        return None
    ready = runtime.create_event(timing=False)
    ready.record(stream)
    return ready


def poll_get(
    key: str, timeout: float | None, attempt: Callable[[], Got | None], first_s: float, most_s: float
) -> Got:
    """A GET by polling (the stores of other processes): `attempt()` until it returns a `Got`, waiting
    `first_s` and then twice as long each time up to `most_s`; `GetTimeout` after `timeout` seconds
    (None: the SDK's)."""
    timeout = DEFAULT_GET_TIMEOUT_S if timeout is None else timeout
    deadline = time.monotonic() + timeout
    delay = first_s
    while (got := attempt()) is None:
        left_s = deadline - time.monotonic()
        if left_s <= 0:
            raise GetTimeout(key, timeout, "nothing put it")
        time.sleep(min(delay, left_s))
        delay = min(delay * 2, most_s)
    return got


@dataclass
class _Entry:
    handle: DeviceTensor
    ready: Event | None  # recorded on the producer's stream at put: consumers wait on it
    request_id: str | None
    consumers: int | None  # gets left before the entry is consumed; None = until deleted
    expires: float | None


class LocalStore:
    """Keys to device tensors of one workflow (dict-backed PUT/GET; same device: no copy).
    A `comm.store_protocol.KeyStore`."""

    def __init__(self, runtime: Runtime, allocator: StreamPoolAllocator) -> None:
        self._runtime = runtime
        self._allocator = allocator
        self._stream = runtime.create_stream()  # frees of store-owned tensors
        self._cond = threading.Condition()
        self._entries: dict[str, _Entry] = {}
        self._ended: OrderedDict[str, None] = OrderedDict()

    def __len__(self) -> int:
        with self._cond:
            return len(self._entries)

    @property
    def stored_bytes(self) -> int:
        with self._cond:
            return sum(e.handle.nbytes for e in self._entries.values())

    def _free(self, entry: _Entry) -> None:
        if entry.ready is not None:
            self._stream.wait_event(entry.ready)
        self._allocator.free(entry.handle.address, self._stream)

    def _expire(self, now: float) -> None:
        for key in [k for k, e in self._entries.items() if e.expires is not None and e.expires <= now]:
            self._free(self._entries.pop(key))

    def put(
        self,
        key: str,
        value: DeviceTensor,
        *,
        consumers: int | None = None,
        ttl: float | None = None,
        stream: Stream | None = None,
        owner: str | None = None,
    ) -> None:
        """Store `value` (the store owns it from now on) under `key`; `owner`: the request whose end
        drops the key (None: kept until deleted or expired)."""
        check_put_args(key, consumers)  # the same PUT rules as the proxy's stores
        ready = ready_event(self._runtime, stream)
        now = time.monotonic()
        with self._cond:
            if owner in self._ended:
                raise StoreError(f"request {owner} has ended: PUT of key {key!r} refused")
            self._expire(now)
            if key in self._entries:
                raise StoreError(f"key {key!r} is already stored; delete it first")
            expires = now + ttl if ttl is not None else None
            self._entries[key] = _Entry(value, ready, owner, consumers, expires)
            self._cond.notify_all()

    def get(self, key: str, *, timeout: float | None = None, stream: Stream | None = None) -> Got:
        """The key's tensor itself (no copy: `stream` is not used), waiting up to `timeout` seconds
        for its PUT."""
        timeout = DEFAULT_GET_TIMEOUT_S if timeout is None else timeout
        deadline = time.monotonic() + timeout
        with self._cond:
            while True:
                self._expire(time.monotonic())
                entry = self._entries.get(key)
                if entry is not None:
                    break
                left = deadline - time.monotonic()
                if left <= 0:
                    raise GetTimeout(key, timeout, "nothing put it")
                self._cond.wait(left)
            consumed = False
            if entry.consumers is not None:
                entry.consumers -= 1
                consumed = entry.consumers == 0
                if consumed:
                    del self._entries[key]
            return Got(entry.handle, consumed, False, entry.ready)

    def delete(self, key: str) -> bool:
        with self._cond:
            entry = self._entries.pop(key, None)
            if entry is None:
                return False
            self._free(entry)
        self._stream.synchronize()
        return True

    def end_request(self, request_id: str) -> int:
        """Free what the request left stored; refuse its later puts. Returns how many keys went."""
        with self._cond:
            self._ended[request_id] = None
            while len(self._ended) > _ENDED_REMEMBERED:
                self._ended.popitem(last=False)
            keys = [k for k, e in self._entries.items() if e.request_id == request_id]
            for key in keys:
                self._free(self._entries.pop(key))
        if keys:
            self._stream.synchronize()  # the bytes are back in the pool when the request is over
        return len(keys)

    def close(self) -> None:
        with self._cond:
            for entry in self._entries.values():
                self._free(entry)
            self._entries.clear()
        self._stream.synchronize()
        self._stream.destroy()


@dataclass
class _Instance:
    function: str
    stream: Stream
    last_used: float
    invocations: int = 0


@dataclass
class _InstancePool:
    """A function's instances: idle ones (most recently used first out) and how many live."""

    max_instances: int
    idle: list[_Instance] = field(default_factory=list)
    live: int = 0
    cold_starts: int = 0
    freed: asyncio.Condition | None = None


class _LocalWorkflow:
    """One deployed workflow: its allocator, executor, resident models, store and instances."""

    def __init__(self, invoker: LocalInvoker, spec: WorkflowSpec, handlers: dict[str, Handler]) -> None:
        runtime = invoker.runtime
        self.spec = spec
        self.handlers = handlers
        self.runtime = runtime
        stream_only = invoker.system == "stream-only"
        # stream-only keeps what it allocated cached (a static caching pool); StreamBox trims to zero.
        threshold = runtime.memory_info()[1] if stream_only else 0
        self.allocator = StreamPoolAllocator(runtime, release_threshold=threshold)
        self.executor = PlanExecutor(runtime, self.allocator, eager_recycling=not stream_only)
        self.model_pool = invoker.model_pool
        self.store = LocalStore(runtime, self.allocator)
        self.pools = {name: _InstancePool(fn.max_instances) for name, fn in spec.functions.items()}
        self._models: dict[tuple[str, int, tuple[int, ...]], DeviceModel] = {}
        self._load_lock = threading.Lock()
        self._loader = runtime.create_stream()

    def model(self, name: str, batch: int, shape: tuple[int, ...]) -> DeviceModel:
        """The resident model for (name, batch, shape): lowered and uploaded on first use."""
        key = (name, batch, shape)
        with self._load_lock:
            if key not in self._models:
                plan = self.model_pool.get_or_lower(name, batch, shape)
                self._models[key] = upload_model(self.runtime, plan, self.allocator, self._loader)
                self._loader.synchronize()
            return self._models[key]

    @property
    def model_bytes(self) -> int:
        return sum(m.weight_bytes for m in self._models.values())

    def close(self) -> None:
        self.store.close()
        for model in self._models.values():
            for tensor in model.weights.values():
                self.allocator.free(tensor.address, self._loader)
        self._models.clear()
        self._loader.synchronize()
        self._loader.destroy()
        for pool in self.pools.values():
            for instance in pool.idle:
                instance.stream.destroy()
            pool.idle.clear()
        self.allocator.pool.trim_to(0)


class LocalContext:
    """The `ctx` of a handler in run-local mode: `streambox.Context`, over this process's device.

    Its handles are `streambox.Handle`s, as behind the proxy: each names a tensor this invocation was
    handed (upload, infer, GET) and is checked against them when it comes back."""

    def __init__(self, wf: _LocalWorkflow, function: str, stream: Stream, request_id: str) -> None:
        self._wf = wf
        self._stream = stream
        self._owned: dict[int, DeviceTensor] = {}  # tensors this invocation must free at its end
        self._copies: dict[int, DeviceTensor] = {}  # GETs' private copies: freed at its end, not puttable
        self._seen: dict[int, DeviceTensor] = {}  # every tensor handed to the handler, by address
        self.function = function
        self.request_id = request_id
        self.workflow = wf.spec.name

    def key(self, name: str) -> str:
        """`<workflow>/<request id>/<name>`: a key scoped to this request, dropped when it ends."""
        if not isinstance(name, str) or not name:
            raise ValueError(f"a key name is a non-empty string, got {name!r}")
        return f"{self._wf.spec.name}/{self.request_id}/{name}"

    def _handle(self, tensor: DeviceTensor, owned: bool = False) -> Handle:
        """The handler's `Handle` of `tensor` (remembered, so that it is accepted back)."""
        if owned:
            self._owned[tensor.address] = tensor
        self._seen[tensor.address] = tensor
        layout = (dtype_name(tensor.dtype), tensor.shape, tensor.strides, tensor.nbytes)
        return Handle(self.workflow, tensor.address, *layout)

    def _tensor(self, handle: Any, what: str) -> DeviceTensor:
        """The device tensor a handle from the handler names, or an error saying why it names none."""
        try:
            h = Handle.from_wire(handle)
        except TypeError as error:
            raise TypeError(f"{what} takes a device-tensor handle: {error}") from None
        if h.workflow != self.workflow:
            raise IsolationError(
                f"{what}: the handle belongs to workflow {h.workflow!r}, not {self.workflow!r}"
            )
        known = self._seen.get(h.address)
        dtype = parse_dtype(h.dtype)
        # The layout must stay inside the tensor it names, as the proxy checks (`Resources.tensor`).
        span = span_bytes(h.shape, h.strides, dtype.itemsize) if min(h.strides, default=0) >= 0 else None
        if known is None or span is None or max(span, h.nbytes) > known.nbytes:
            raise StoreError(
                f"{what}: handle {h.address:#x} ({h.nbytes} bytes, shape {list(h.shape)}, strides "
                f"{list(h.strides)}) names no tensor this invocation made, got or still holds"
            )
        return DeviceTensor(h.address, dtype, h.shape, h.strides, h.nbytes)

    def upload(self, tensor: torch.Tensor) -> Handle:
        if not isinstance(tensor, torch.Tensor) or tensor.device.type != "cpu":
            raise TypeError(f"upload takes a CPU torch tensor, got {type(tensor).__name__}")
        uploaded = upload_tensor(self._wf.runtime, tensor, self._wf.allocator.allocate, self._stream)
        return self._handle(uploaded, owned=True)

    def download(self, handle: Handle) -> torch.Tensor:
        return download_tensor(self._wf.runtime, self._tensor(handle, "download"), self._stream)

    def infer(self, model: str, x: Handle | torch.Tensor) -> list[Handle]:
        declared = self._wf.spec.functions[self.function].models
        if model not in declared:
            raise ValueError(
                f"function {self.function!r} did not declare model {model!r} (declared: {declared})"
            )
        tensor = self._tensor(self.upload(x) if isinstance(x, torch.Tensor) else x, "infer")
        want = self._wf.model_pool.entry(model).input_dtype
        if tensor.dtype != want or len(tensor.shape) < 2:
            raise ValueError(
                f"model {model!r} takes a batch of {want} inputs [B, ...], got {tensor.dtype} "
                f"{list(tensor.shape)}"
            )
        return [self._handle(output, owned=True) for output in self._run_model(model, tensor)]

    def _run_model(self, model: str, tensor: DeviceTensor) -> list[DeviceTensor]:
        """One inference of `model` on this invocation's stream: its outputs, in the plan's order
        (the monolithic instance runs it as part of a batch instead: `instance_batching.py`)."""
        resident = self._wf.model(model, tensor.shape[0], tuple(tensor.shape[1:]))
        plan = resident.plan
        run = self._wf.executor.run(resident, {plan.inputs[0]: tensor}, self._stream)
        return [run.outputs[name] for name in plan.outputs]

    def put(self, key: str, handle: Handle, consumers: int | None = None, ttl: float | None = None) -> None:
        tensor = self._tensor(handle, f"PUT of key {key!r}")
        if tensor.address not in self._owned:
            raise StoreError(
                f"PUT of key {key!r}: only a tensor this invocation made (upload, infer) or consumed "
                "(a GET that used up its last consumer) can be put"
            )
        self._wf.store.put(
            key, tensor, consumers=consumers, ttl=ttl, stream=self._stream, owner=self.request_id
        )
        del self._owned[tensor.address]  # the store owns it now (the handler may still read it)

    def get(self, key: str, timeout: float = DEFAULT_GET_TIMEOUT_S) -> Handle:
        got = self._wf.store.get(key, timeout=timeout, stream=self._stream)
        if got.ready is not None:
            self._stream.wait_event(got.ready)  # the producer's kernels come first
        if got.consumed:
            return self._handle(got.tensor, owned=True)
        if got.copy:  # a private copy not taken from the store: freed at the end, not puttable
            self._copies[got.tensor.address] = got.tensor
        return self._handle(got.tensor)

    def delete(self, key: str) -> None:
        if not self._wf.store.delete(key):
            raise StoreError(f"DELETE of key {key!r}: no such key")

    def synchronize(self) -> None:
        """Wait for this invocation's own work (its stream), not the whole device."""
        self._stream.synchronize()

    def finish(self) -> None:
        """Free what the invocation still owns (stream-ordered) and wait for its stream."""
        for handle in [*self._owned.values(), *self._copies.values()]:
            self._wf.allocator.free(handle.address, self._stream)
        self._owned.clear()
        self._copies.clear()
        self._seen.clear()
        self._stream.synchronize()


def _json_copy(value: Any, what: str) -> Any:
    """Values cross the function boundary as JSON, as on the wire: refuse anything else, and a
    device handle (its memory is the invocation's)."""
    try:
        text = json.dumps(value, allow_nan=False)
    except (TypeError, ValueError) as error:
        raise TypeError(f"{what} is not JSON-able: {error}") from None
    where = handle_in_json(value, text, "value")
    if where is not None:
        raise TypeError(
            f"{what} holds a device handle ({where}): its memory is "
            "the invocation's; download it, or put it and pass the key"
        )
    return json.loads(text)


class LocalInvoker:
    """Runs handlers in this process on a real runtime (see the module docstring)."""

    def __init__(
        self,
        runtime: Runtime,
        model_pool: ModelPool | None = None,
        *,
        system: str = "streambox",
        keep_alive_s: float = DEFAULT_KEEP_ALIVE_S,
        max_threads: int = 64,
        on_close: Callable[[], None] | None = None,
    ) -> None:
        if system not in SYSTEMS:
            raise ValueError(f"system {system!r} is not one of: {', '.join(SYSTEMS)}")
        self.runtime = runtime
        self.model_pool = model_pool or ModelPool()
        self.system = system
        self.keep_alive_s = keep_alive_s
        self._threads = ThreadPoolExecutor(max_workers=max_threads, thread_name_prefix="streambox-fn")
        self._workflows: dict[str, _LocalWorkflow] = {}
        self._on_close = on_close

    @classmethod
    def open(
        cls,
        config: Config | None = None,
        *,
        system: str = "streambox",
        device: int = 0,
        keep_alive_s: float = DEFAULT_KEEP_ALIVE_S,
        gpu_percent: int | None = None,
    ) -> LocalInvoker:
        """A local invoker on its own runtime of the configured backend (closed with the invoker);
        `gpu_percent`: the runtime is an MPS client with that share of the compute units."""
        config = config or Config.from_env()
        backend = config.open_backend()
        runtime = backend.open_runtime(device, gpu_percent=gpu_percent)
        return cls(
            runtime,
            ModelPool(config.model_pool),
            system=system,
            keep_alive_s=keep_alive_s,
            on_close=runtime.close,
        )

    # -- Invoker ---------------------------------------------------------------------------------
    async def deploy(self, spec: WorkflowSpec) -> None:
        if spec.name in self._workflows:
            raise ValueError(f"workflow {spec.name!r} is already deployed")
        handlers = {name: resolve_handler(fn.handler, spec.base_dir) for name, fn in spec.functions.items()}
        self._workflows[spec.name] = _LocalWorkflow(self, spec, handlers)

    async def invoke(
        self,
        workflow: str,
        function: str,
        event: dict[str, Any],
        request_id: str,
        *,
        timeout_s: float | None = None,
    ) -> InvocationResult:
        started = time.perf_counter()
        wf = deployed(self._workflows, workflow)
        event = _json_copy(event, f"the event of {function!r}")
        instance, cold = await self._acquire(wf, function)
        loop = asyncio.get_running_loop()
        future = loop.run_in_executor(self._threads, self._run, wf, instance, function, event, request_id)
        # The instance is busy until its thread returns, even when the caller stops waiting.
        future.add_done_callback(lambda _: self._release(wf, instance))
        try:
            async with asyncio.timeout(timeout_s):
                output = await asyncio.shield(future)
        except TimeoutError:
            raise InvocationTimeout(f"{function} ran past {timeout_s:.3f} s") from None
        return InvocationResult(output, cold, time.perf_counter() - started)

    async def end_request(self, workflow: str, request_id: str) -> None:
        store = self._workflows[workflow].store
        await asyncio.get_running_loop().run_in_executor(self._threads, store.end_request, request_id)

    async def close(self) -> None:
        self._threads.shutdown(wait=False, cancel_futures=True)
        for wf in self._workflows.values():
            wf.close()
        self._workflows.clear()
        if self._on_close is not None:
            self._on_close()

    # -- stats -----------------------------------------------------------------------------------
    def runtime_stats(self) -> Iterator[RuntimeStats]:
        """The gateway's stats callback: device memory, pool and instances per workflow."""
        free, total = self.runtime.memory_info()
        for name, wf in self._workflows.items():
            yield RuntimeStats(
                workflow=name,
                device=self.runtime.index,
                memory_used_bytes=total - free,
                memory_total_bytes=total,
                pool_reserved_bytes=wf.allocator.pool.reserved_bytes,
                pool_used_bytes=wf.allocator.pool.used_bytes,
                instances={fn: pool.live for fn, pool in wf.pools.items()},
            )

    def stored_keys(self, workflow: str) -> int:
        return len(self._workflows[workflow].store)

    def cold_starts(self, workflow: str) -> dict[str, int]:
        return {fn: pool.cold_starts for fn, pool in self._workflows[workflow].pools.items()}

    # -- instances -------------------------------------------------------------------------------
    async def _acquire(self, wf: _LocalWorkflow, function: str) -> tuple[_Instance, bool]:
        pool = wf.pools[function]
        if pool.freed is None:
            pool.freed = asyncio.Condition()
        async with pool.freed:
            while True:
                now = time.monotonic()
                for old in [i for i in pool.idle if now - i.last_used > self.keep_alive_s]:
                    pool.idle.remove(old)  # kept alive long enough: scale towards zero
                    pool.live -= 1
                    old.stream.destroy()
                if pool.idle:
                    return pool.idle.pop(), False
                if pool.live < pool.max_instances:
                    pool.live += 1
                    pool.cold_starts += 1
                    return _Instance(function, self.runtime.create_stream(), now), True
                await pool.freed.wait()

    def _release(self, wf: _LocalWorkflow, instance: _Instance) -> None:
        pool = wf.pools[instance.function]
        instance.last_used = time.monotonic()
        instance.invocations += 1
        if wf.spec.name not in self._workflows:  # closed meanwhile
            instance.stream.destroy()
            return
        pool.idle.append(instance)

        async def notify() -> None:
            assert pool.freed is not None
            async with pool.freed:
                pool.freed.notify()

        asyncio.ensure_future(notify())

    def _run(
        self, wf: _LocalWorkflow, instance: _Instance, function: str, event: dict[str, Any], request_id: str
    ) -> Any:
        """In a worker thread: the handler, then the invocation's cleanup."""
        ctx = LocalContext(wf, function, instance.stream, request_id)
        try:
            output = wf.handlers[function](ctx, event)
            ctx.finish()
            return _json_copy(output, f"the output of {function!r}")
        except (Exception, SystemExit) as error:  # a handler's sys.exit fails its request only
            with contextlib.suppress(Exception):
                ctx.finish()  # the handler's error is the one to report
            raise InvocationError(
                function, error_type_of(error), error_message_of(error), traceback.format_exc()
            ) from None
