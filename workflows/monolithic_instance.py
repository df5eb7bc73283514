"""One function instance of the monolithic baseline: a process with a runtime of its own.

Started by `MonolithicInvoker` as `python -c LAUNCH_INSTANCE '<json arguments>'` with one end of a
socket pair. At start it opens its own runtime on the configured device (a context of its own),
imports its handler and uploads its function's models into its own memory; then it answers
`{"ok": true, "pid", "stats"}` (or `{"ok": false, "error_type", "message", "traceback"}` and exits)
and serves `{"op": "invoke", "event", "request_id"}` messages one at a time until `{"op": "stop"}`
or the end of its socket (the invoker is gone). A batching function's instance also takes
`{"op": "invoke_batch", "calls": [...]}`: the invocations the invoker gathered, their handlers run on
threads (each its own context and stream) and their `infer` calls batched (`instance_batching.py`);
it prepares the plans of every batch size such a message can reach at start. Every reply carries
the instance's stats, its inference counts included.

Handlers run exactly as in run-local (`LocalContext`: `key`, `upload`, `download`, `infer` are
the same code) on a `stream-only` workflow (static caching pool, no eager recycling), except that
`put`, `get` and `delete` go through Redis (`FuncIpc`: GPU -> host -> Redis -> host -> GPU; the key
layout is in `monolithic.py`).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import socket
import sys
import time
import traceback
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, BinaryIO

import torch

from streambox.api_proxy.batched_infer import batch_sizes, limits_of
from streambox.api_proxy.device_tensor import DeviceTensor
from streambox.api_proxy.executor import DeviceModel
from streambox.api_proxy.function_spec import ProxyFunction
from streambox.api_proxy.shm_ring import wait_readable
from streambox.api_proxy.template import INSTANCE_PRELOAD, preload_modules, warm_up_modules
from streambox.comm.baselines import FuncIpc
from streambox.comm.lease import Allocator
from streambox.comm.store_protocol import check_put_args
from streambox.config import Config
from streambox.device import Runtime, Stream
from streambox.gc_pauses import freeze_startup_heap, freezing
from streambox.kernel_compiler.lowering import reusing_built_models
from streambox.kernel_compiler.plan import KernelPlan
from streambox.sdk import error_message_of, error_type_of

from .handlers import resolve_handler
from .instance_batching import BatchRun, InferCounts, InstanceContext
from .local import (
    Got,
    LocalInvoker,
    StoreError,
    _json_copy,
    _LocalWorkflow,
    poll_get,
    ready_event,
)
from .monolithic import decode_body, encode_message, ended_key, meta_key, request_set_key
from .monolithic_ipc import REAP_PERIOD_S, HandleRegistry, IpcHandleStore
from .spec import WorkflowSpec

# KEYS: K#meta, ended marker. Whether a put may go ahead.
PUT_CHECK_LUA = """
if redis.call('EXISTS', KEYS[2]) == 1 then return 'ended' end
if redis.call('EXISTS', KEYS[1]) == 1 then return 'exists' end
return 'ok'
"""
# KEYS: K, K#meta, ended marker, the request's set; ARGV: dtype, shape, strides, consumers, ttl ms, K.
PUT_COMMIT_LUA = """
if redis.call('EXISTS', KEYS[3]) == 1 then redis.call('DEL', KEYS[1]) return 'ended' end
if redis.call('EXISTS', KEYS[2]) == 1 then return 'exists' end
redis.call('HSET', KEYS[2], 'dtype', ARGV[1], 'shape', ARGV[2], 'strides', ARGV[3], 'left', ARGV[4],
           'set', KEYS[4])
redis.call('SADD', KEYS[4], ARGV[6])
local ttl = tonumber(ARGV[5])
if ttl > 0 then redis.call('PEXPIRE', KEYS[1], ttl) redis.call('PEXPIRE', KEYS[2], ttl) end
return 'ok'
"""
# KEYS: K, K#meta; ARGV: K. Takes one consumer: -2 gone, -1 unlimited, else consumers left (0: deleted).
CLAIM_LUA = """
if redis.call('EXISTS', KEYS[2]) == 0 then return -2 end
local left = tonumber(redis.call('HGET', KEYS[2], 'left'))
if left < 0 then return -1 end
left = left - 1
if left <= 0 then
  local set = redis.call('HGET', KEYS[2], 'set')
  redis.call('DEL', KEYS[1], KEYS[2])
  redis.call('SREM', set, ARGV[1])
  return 0
end
redis.call('HSET', KEYS[2], 'left', left)
return left
"""
# KEYS: K, K#meta; ARGV: K. 1 if deleted, 0 if there was no such key.
DELETE_LUA = """
if redis.call('EXISTS', KEYS[2]) == 0 then return 0 end
local set = redis.call('HGET', KEYS[2], 'set')
redis.call('DEL', KEYS[1], KEYS[2])
redis.call('SREM', set, ARGV[1])
return 1
"""
GET_POLL_MAX_S = 0.01  # a waiting GET polls Redis at most this far apart
IDLE_PERIOD_S = REAP_PERIOD_S  # an idle instance's housekeeping period


def _weights(plan: KernelPlan) -> list[tuple[str, int]]:
    return [(v.name, v.nbytes) for v in plan.vars_of_kind("weight")]


class RedisStore:
    """The instance's keys, in Redis (Func-IPC): what `LocalStore` is to run-local.

    `put` copies the tensor device -> host -> Redis on the store's stream once the producer's work
    is done (`ready`), then frees the device tensor (the store owned it); `get` copies it back into
    a new device tensor of this runtime."""

    def __init__(self, client: Any, workflow: str, runtime: Runtime, allocator: Allocator) -> None:
        self.client = client
        self.workflow = workflow
        self.ipc = FuncIpc(client)
        self._runtime = runtime
        self._allocator = allocator
        self._stream = runtime.create_stream()
        self._check = client.register_script(PUT_CHECK_LUA)
        self._commit = client.register_script(PUT_COMMIT_LUA)
        self._claim = client.register_script(CLAIM_LUA)
        self._delete = client.register_script(DELETE_LUA)

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
        """Copy `value` out to Redis under `key` once `stream`'s work so far is done, then free it;
        `owner`: the request whose end drops the key (None: kept until deleted or expired)."""
        check_put_args(key, consumers)  # the same PUT rules as the proxy's stores
        handle, request_id = value, owner or ""  # "": no request has ended under that name
        ended = ended_key(self.workflow, request_id)
        if (verdict := self._check(keys=[meta_key(key), ended]).decode()) != "ok":
            raise StoreError(self._refusal(key, request_id, verdict))
        ready = ready_event(self._runtime, stream)
        if ready is not None:
            self._stream.wait_event(ready)  # the producer's kernels come first
        self.ipc.put(key, self._runtime, handle, self._stream)  # device -> host -> Redis
        ttl_ms = 0 if ttl is None else max(1, round(ttl * 1e3))
        verdict = self._commit(
            keys=[key, meta_key(key), ended, request_set_key(self.workflow, request_id)],
            args=[
                str(handle.dtype),
                json.dumps(list(handle.shape)),
                json.dumps(list(handle.strides)),
                -1 if consumers is None else consumers,
                ttl_ms,
                key,
            ],
        ).decode()
        if verdict != "ok":
            raise StoreError(self._refusal(key, request_id, verdict))
        self._allocator.free(handle.address, self._stream)  # the bytes live in Redis now

    @staticmethod
    def _refusal(key: str, request_id: str, verdict: str) -> str:
        if verdict == "ended":
            return f"request {request_id} has ended: PUT of key {key!r} refused"
        return f"key {key!r} is already stored; delete it first"

    def get(self, key: str, *, timeout: float | None = None, stream: Stream | None = None) -> Got:
        """A new device tensor (on `stream`; None: the store's) with the key's bytes, and whether
        this GET took the key's last consumer. Waits (polling) until someone puts the key, up to
        `timeout` seconds."""
        reader = stream or self._stream
        return poll_get(key, timeout, lambda: self._take(key, reader), 0.001, GET_POLL_MAX_S)

    def _take(self, key: str, stream: Stream) -> Got | None:
        """One try of a GET: the key's bytes copied in and one consumer taken, or None."""
        meta = self.client.hgetall(meta_key(key))
        if not meta:
            return None
        try:
            received = self.ipc.get(key, self._runtime, self._allocator, stream)  # Redis -> device
        except KeyError:
            return None  # consumed or deleted meanwhile
        left = int(self._claim(keys=[key, meta_key(key)], args=[key]))
        if left == -2:
            self._allocator.free(received.address, stream)  # its consumers were all taken
            return None
        dtype = getattr(torch, meta[b"dtype"].decode().removeprefix("torch."))
        shape = tuple(json.loads(meta[b"shape"]))
        strides = tuple(json.loads(meta[b"strides"]))
        tensor = DeviceTensor(received.address, dtype, shape, strides, received.nbytes)
        return Got(tensor, left == 0, True, None)

    def delete(self, key: str) -> bool:
        return bool(int(self._delete(keys=[key, meta_key(key)], args=[key])))

    def close(self) -> None:
        self._stream.synchronize()
        self._stream.destroy()
        with contextlib.suppress(Exception):
            self.client.close()


def _open_store(
    data_path: dict[str, Any], workflow: str, runtime: Runtime, allocator: Allocator
) -> RedisStore | IpcHandleStore:
    """The instance's keys: Redis (INFless's Func-IPC) or CUDA-IPC handles (Astraea)."""
    if data_path["kind"] == "cuda-ipc":
        return IpcHandleStore(HandleRegistry(Path(data_path["registry"])), workflow, runtime, allocator)
    import redis

    password = Path(data_path["redis_password_file"]).read_text()
    client = redis.Redis(host="127.0.0.1", port=int(data_path["redis_port"]), password=password)
    client.ping()
    return RedisStore(client, workflow, runtime, allocator)


class _InstanceWorkflow(_LocalWorkflow):
    """The instance's one function on its own runtime, its keys in Redis. Plans of one model at
    other input shapes share the weights already resident (one copy of each model per instance)."""

    def __init__(
        self, invoker: LocalInvoker, spec: WorkflowSpec, handlers: dict[str, Any], data_path: dict[str, Any]
    ) -> None:
        super().__init__(invoker, spec, handlers)
        self.store.close()  # run-local's in-process store: not used here
        self.store = _open_store(data_path, spec.name, self.runtime, self.allocator)  # type: ignore[assignment]

    def model(self, name: str, batch: int, shape: tuple[int, ...]) -> DeviceModel:
        key = (name, batch, shape)
        if key not in self._models:
            plan = self.model_pool.get_or_lower(name, batch, shape)
            for resident in list(self._models.values()):
                if resident.plan.model == name and _weights(resident.plan) == _weights(plan):
                    self._models[key] = DeviceModel(plan, resident.weights, resident.weight_views)
                    break
        return super().model(name, batch, shape)

    def _unique_models(self) -> dict[int, DeviceModel]:
        return {id(m.weights): m for m in self._models.values()}

    @property
    def model_bytes(self) -> int:
        return sum(m.weight_bytes for m in self._unique_models().values())

    def close(self) -> None:
        self._models = {i: m for i, m in self._unique_models().items()}  # type: ignore[misc]
        super().close()


def _error(error: BaseException) -> dict[str, Any]:
    message = error_message_of(error)
    return {"error_type": error_type_of(error), "message": message, "traceback": traceback.format_exc()}


class Instance:
    """The instance's runtime, workflow, handler, stream and Redis client."""

    def __init__(self, args: dict[str, Any]) -> None:
        c = args["config"]
        config = Config(
            backend=c["backend"],
            device_preset=c["device_preset"],
            gpus=int(c["gpus"]),
            model_pool=Path(c["model_pool"]),
            state_dir=Path(c["state_dir"]) if c.get("state_dir") else None,
            framework_runtime=True,  # a PyTorch function's own runtime: context + framework (paper Sec. 2)
        ).validated()
        base_dir = Path(args["base_dir"]) if args.get("base_dir") else None
        spec = WorkflowSpec.model_validate_json(json.dumps(args["spec"])).with_base_dir(base_dir)
        self.function = args["function"]
        fn = spec.functions[self.function]
        handler = resolve_handler(fn.handler, base_dir)
        preload_modules(INSTANCE_PRELOAD)  # as the proxy's template does for its instances
        warm_up_modules([handler])  # the lazy work its module does ahead of requests, as the proxy's template
        self.gpu_percent: int | None = args.get("gpu_percent")
        self.invoker = LocalInvoker.open(
            config, system="stream-only", device=int(args["device"]), gpu_percent=self.gpu_percent
        )
        try:
            self.runtime = self.invoker.runtime
            self.wf = _InstanceWorkflow(self.invoker, spec, {self.function: handler}, args["data_path"])
            self.stream = self.runtime.create_stream()
            self.limits = limits_of(ProxyFunction.of(self.function, fn))  # None: one invocation a message
            # Every batch a message can reach is planned at start (sharing the resident weights), as
            # the proxy prepares them at deploy.
            sizes = [fn.batch_size, *batch_sizes(ProxyFunction.of(self.function, fn))]
            with reusing_built_models():  # a model's plans lowered here share one build of it
                for model in fn.models:  # its own copy of its models, loaded at start
                    entry = self.wf.model_pool.entry(model)
                    shape = entry.small_input_shape if args.get("model_shapes", "small") == "small" else None
                    for size in sizes:
                        self.wf.model(model, size, tuple(shape or entry.input_shape))
        except BaseException:
            asyncio.run(self.invoker.close())
            raise
        self.counts = InferCounts()
        self._member_streams: list[Stream] = []  # members of a batched message after the first
        self.context_bytes = int(self.runtime.properties().extra.get("context_memory", 0))

    def stats(self) -> dict[str, Any]:
        free, total = self.runtime.memory_info()
        pool = self.wf.allocator.pool
        return {
            "device": self.runtime.index,
            "gpu_percent": self.runtime.properties().extra.get("gpu_percent"),  # as the device enforces it
            "context_bytes": self.context_bytes,
            "weights_bytes": self.wf.model_bytes,
            "pool_reserved_bytes": pool.reserved_bytes,
            "pool_used_bytes": pool.used_bytes,
            "allocated_bytes": self.runtime.allocated_bytes(),
            "memory_used_bytes": total - free,
            "memory_total_bytes": total,
            # Astraea: intermediate data this instance put, still cached in its GPU memory, the most
            # it ever cached, and the CUDA-IPC handles it exported (PUT) and opened (GET).
            "ipc_cached_bytes": getattr(self.wf.store, "cached_bytes", 0),
            "ipc_cached_peak_bytes": getattr(self.wf.store, "cached_peak_bytes", 0),
            "ipc_exported": getattr(self.wf.store, "exported", 0),
            "ipc_opened": getattr(self.wf.store, "opened", 0),
            "reported_at": time.time(),
            **self.counts.to_json(),
        }

    def invoke(self, event: dict[str, Any], request_id: str) -> dict[str, Any]:
        ctx = InstanceContext(self.wf, self.function, self.stream, request_id, self.counts)
        return {**self._run(ctx, event), "stats": self.stats()}

    def invoke_batch(self, calls: list[dict[str, Any]]) -> dict[str, Any]:
        """The invocations the invoker gathered, their handlers run concurrently (threads), their
        `infer` calls batched (`instance_batching.py`); one reply per invocation, in order."""
        if self.limits is None:
            raise ValueError(f"function {self.function!r} does not batch: a batch message is a mistake")
        while len(self._member_streams) < len(calls) - 1:
            self._member_streams.append(self.runtime.create_stream())
        batch = BatchRun(self.wf, len(calls), self.limits, self.counts)
        streams = [self.stream, *self._member_streams]

        def member(i: int) -> dict[str, Any]:
            request_id = calls[i]["request_id"]
            ctx = InstanceContext(self.wf, self.function, streams[i], request_id, self.counts, batch)
            try:
                return self._run(ctx, calls[i]["event"])
            finally:
                batch.finished()

        with ThreadPoolExecutor(len(calls), thread_name_prefix="streambox-member") as threads:
            replies = list(threads.map(member, range(len(calls))))
        return {"replies": replies, "stats": self.stats()}

    def _run(self, ctx: InstanceContext, event: dict[str, Any]) -> dict[str, Any]:
        """One handler call and its invocation's cleanup: its reply (without stats)."""
        try:
            output = self.wf.handlers[self.function](ctx, event)
            ctx.finish()
            return {"ok": True, "output": _json_copy(output, f"the output of {self.function!r}")}
        except (Exception, SystemExit) as error:  # a handler's sys.exit fails its request only
            reply = {"ok": False, **_error(error)}
            with contextlib.suppress(Exception):
                ctx.finish()  # the handler's error is the one to report
            return reply

    def close(self) -> None:
        for stream in [self.stream, *self._member_streams]:
            with contextlib.suppress(Exception):
                stream.destroy()
        with contextlib.suppress(Exception):
            self.wf.close()
        asyncio.run(self.invoker.close())


    def idle(self) -> None:
        """Between invocations: free the allocations of retired keys (Astraea's cached data)."""
        reap = getattr(self.wf.store, "reap", None)
        if reap is not None:
            reap()


def _receive(sock: socket.socket, stream: BinaryIO, idle: Callable[[], None]) -> dict[str, Any] | None:
    """The next message, or None at the end of the socket; `idle()` runs every `IDLE_PERIOD_S` while
    none comes. (The invoker sends one message at a time and waits for the reply, so nothing is
    buffered in `stream` past a message: a poll of the socket sees every new one.)"""
    while not wait_readable(sock, IDLE_PERIOD_S):
        idle()
    header = stream.read(4)
    if len(header) < 4:
        return None
    body = stream.read(int.from_bytes(header, "big"))
    return decode_body(body)


def main(argv: list[str] | None = None) -> int:
    args = json.loads((argv or sys.argv)[1])
    sock = socket.socket(fileno=int(args["fd"]))
    incoming = sock.makefile("rb")
    try:
        freeze = freezing()  # a bad STREAMBOX_FREEZE_HEAP fails the start, reported as any error
        instance = Instance(args)
    except BaseException as error:
        sock.sendall(encode_message({"ok": False, **_error(error)}))
        return 1
    # As a proxy does (`streambox.gc_pauses`): what the instance set up lives as long as it, and a
    # full collection walking torch's objects would stop its request for ~0.2 s.
    if freeze:
        freeze_startup_heap()
    try:
        sock.sendall(encode_message({"ok": True, "pid": os.getpid(), "stats": instance.stats()}))
        while (message := _receive(sock, incoming, instance.idle)) is not None:
            if message.get("op") == "invoke":
                reply = instance.invoke(message["event"], message["request_id"])
            elif message.get("op") == "invoke_batch":
                reply = instance.invoke_batch(message["calls"])
            else:
                break  # "stop"
            sock.sendall(encode_message(reply))
    except (BrokenPipeError, ConnectionResetError):
        pass  # the invoker is gone
    finally:
        instance.close()
    return 0
