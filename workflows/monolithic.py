"""`MonolithicInvoker`: the conventional serverless GPU deployment, the baseline StreamBox is measured
against (INFless-like; paper section 2 and 9).

- **One OS process and one device runtime (context) per function instance.** An instance is a child
  process started cold (`monolithic_instance.py`): it starts Python, imports the framework, opens its
  own runtime on the configured device (a context of its own: `context_memory` bytes and
  `context_create_s` on the emulated device), uploads its function's models into its own memory
  (a copy per instance) and then serves one message at a time. Its allocator is a static caching
  pool, as PyTorch's: what it reserved stays reserved until the instance stops.
- **An MPS share per instance** (INFless's GPU%): each instance opens its runtime with
  `open_runtime(i, gpu_percent=P)`, `P` the invoker's `gpu_percent` or an equal share per function
  of the workflow; the timed emulated device runs its kernels on that share of the compute units.
- **Instances per function**: up to the spec's `max_instances`. A call takes the most recently used
  idle instance, else starts one (cold start), else waits for one to go idle
  (`api_proxy.keepalive.InstancePool`, the same policy the proxy uses). Idle instances stop after
  `keep_alive_s` (scale to zero); `prewarm` instances per function start at deploy (best effort: one
  that finds the GPU's memory full is skipped, `prewarm_skipped`, and the function starts cold).
- **Batching (INFless's)**: a function with `max_batch_size` > 1 and `max_queue_delay_ms` > 0 (the
  settings the proxy reads) has its invocations queued (`batch_queue.py`: the proxy's pure
  `Gatherer`): up to `max_batch_size` samples (each invocation brings the function's `batch_size`),
  the first waiting at most `max_queue_delay_ms`; the batch then takes one instance (as a call does)
  and goes as ONE message, `{"op": "invoke_batch", "calls": [{event, request_id}, ...]}`, answered by
  `{"replies": [...], "stats"}`, one reply per invocation. The instance runs the handlers on threads
  and their `infer` calls of one model and per-sample shape as one inference
  (`instance_batching.py`). A batch of one goes as a plain `invoke`; other functions never wait.
- **Func-IPC through external storage**: one private `redis-server` (`comm.baselines.RedisServer`)
  starts at the first deploy. `ctx.put` copies the tensor device -> host and writes it to Redis;
  `ctx.get` waits until the key is there, reads it and copies it host -> device into the consumer's
  own runtime (`comm.baselines.FuncIpc` does both). Redis layout, per key `K` put by request `R` of
  workflow `W`:

  - `K`: the tensor's bytes (what `FuncIpc` writes and reads);
  - `K#meta`: a hash: dtype, shape, strides, consumers left (`-1`: until deleted), the request's set;
  - `streambox:request:W/R`: the set of keys request `R` put (dropped with them by `end_request`);
  - `streambox:ended:W/R`: set by `end_request` (for `ENDED_TTL_S`): later puts of `R` are refused.

  Consumers: a GET reads the bytes first and then takes one consumer in a Lua script; the GET that
  takes the last one deletes the key, and a GET that finds the consumers all taken keeps waiting (as
  with `LocalStore`, it times out). `ttl` becomes a Redis expiry of `K` and `K#meta`. Unlike run-local,
  every GET is a private copy in the consumer's runtime, freed at the end of its invocation.
- **Or CUDA-IPC handles** (`data_path="cuda-ipc"`, the replay's `astraea`): no Redis; the producer
  keeps the tensor in its own GPU memory, consumers open a handle and copy it device-to-device, the
  invoker's handle registry (a shared directory) holds the keys and `end_request` marks the request
  ended (`monolithic_ipc.py`).
- **Failures**: a handler that raises fails its call only (the instance stays warm); an instance that
  dies fails its call and is discarded (the device ledger reclaims its runtime when the process is
  gone); a call past its time limit is answered with `InvocationTimeout` and its instance is killed.
  A call the engine abandons (cancels) keeps running in its instance, which goes back to the pool
  when it answers (or is killed at the call's limit).
- **Stats**: `memory_breakdown()` (thread-safe, for the replay's sampler) and `runtime_stats()` (the
  gateway's) sum what each instance reported after starting and after each message;
  `inference_counts()` sums its inferences (plan runs against the `infer` calls they served).

Messages between the invoker and an instance: 4-byte big-endian length + a JSON object, over a
socket pair (never pickles).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import os
import shutil
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Hashable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from streambox.api_proxy.batched_infer import limits_of
from streambox.api_proxy.batcher import Limits
from streambox.api_proxy.function_spec import ProxyFunction
from streambox.api_proxy.keepalive import DEFAULT_KEEP_ALIVE_S, InstancePool
from streambox.comm.baselines import CudaIpcModel, RedisServer, RedisUnavailable
from streambox.config import Config
from streambox.phases import COLD_START, QUEUE

from .batch_queue import BatchQueue, Delivered, Pending
from .invoker import InvocationError, InvocationResult, InvocationTimeout, RuntimeStats, deployed
from .local import _json_copy
from .monolithic_ipc import HandleRegistry
from .spec import WorkflowSpec

SYSTEM = "monolithic"
#: How long `end_request` remembers an ended request (its later puts are refused meanwhile).
ENDED_TTL_S = 3600
#: How long a stopping instance may take to exit before it is killed.
STOP_GRACE_S = 5.0
LAUNCH_INSTANCE = "import sys; from streambox.workflows.monolithic_instance import main; sys.exit(main())"
#: The parts `memory_breakdown` sums over live instances (each instance reports them).
MEMORY_PARTS = ("context_bytes", "weights_bytes", "pool_reserved_bytes", "pool_used_bytes")
#: What `memory_breakdown` sums too for astraea's data path (`monolithic_ipc.py`).
CUDA_IPC_PARTS = ("ipc_cached_bytes", "ipc_cached_peak_bytes", "ipc_exported", "ipc_opened")
#: The inference counters each instance reports (`instance_batching.InferCounts`).
INFER_COUNTS = ("plan_runs", "infer_calls", "batched_runs", "batched_calls")
#: How intermediate data goes between instances: INFless's Func-IPC (Redis) or Astraea's CUDA-IPC
#: handles (`monolithic_ipc.py`), by the system name each one is replayed as.
DATA_PATHS = {"redis": "infless", "cuda-ipc": "astraea"}

_HEADER = struct.Struct("!I")


# -- wire: length-prefixed JSON ------------------------------------------------------------------


def encode_message(message: dict[str, Any]) -> bytes:
    body = json.dumps(message, allow_nan=False).encode()
    return _HEADER.pack(len(body)) + body


def decode_body(body: bytes) -> dict[str, Any]:
    message = json.loads(body)
    if not isinstance(message, dict):
        raise ValueError(f"a message is a JSON object, got {type(message).__name__}")
    return message


async def _read_message(reader: asyncio.StreamReader) -> dict[str, Any]:
    (size,) = _HEADER.unpack(await reader.readexactly(_HEADER.size))
    return decode_body(await reader.readexactly(size))


# -- Redis key space (shared with the instances) -------------------------------------------------


def meta_key(key: str) -> str:
    return f"{key}#meta"


def request_set_key(workflow: str, request_id: str) -> str:
    return f"streambox:request:{workflow}/{request_id}"


def ended_key(workflow: str, request_id: str) -> str:
    return f"streambox:ended:{workflow}/{request_id}"


# KEYS: ended marker, the request's key set; ARGV: marker ttl (s). Returns how many keys went.
END_REQUEST_LUA = """
redis.call('SET', KEYS[1], '1', 'EX', tonumber(ARGV[1]))
local keys = redis.call('SMEMBERS', KEYS[2])
for _, k in ipairs(keys) do redis.call('DEL', k, k .. '#meta') end
redis.call('DEL', KEYS[2])
return #keys
"""


# -- the invoker's records -----------------------------------------------------------------------


@dataclass(eq=False)
class _Instance:
    """One instance process of one function and its end of the socket pair."""

    id: int
    function: str
    device: int
    process: subprocess.Popen[bytes]
    reader: asyncio.StreamReader
    writer: asyncio.StreamWriter
    pid: int = 0
    invocations: int = 0

    def exit_reason(self) -> str:
        code = self.process.poll()
        if code is None:
            return "its connection closed"
        return f"it exited with code {code}" if code >= 0 else f"it was killed by signal {-code}"


@dataclass
class _Function:
    name: str
    pool: InstancePool
    timeout_s: float
    limits: Limits | None = None  # its batching (None: one invocation per message)
    samples: int = 1  # what one invocation brings to a batch: the function's batch_size
    instances: dict[int, _Instance] = field(default_factory=dict)
    changed: asyncio.Event = field(default_factory=asyncio.Event)  # an instance went idle or away

    def wake(self) -> None:
        self.changed.set()
        self.changed = asyncio.Event()


@dataclass
class _Workflow:
    spec: WorkflowSpec
    functions: dict[str, _Function]
    batches_sent: int = 0  # its messages that carried more than one invocation
    calls_batched: int = 0  # the invocations they carried


class MonolithicInvoker:
    """Runs every function instance in a process of its own, on a runtime of its own (see module)."""

    def __init__(
        self,
        config: Config | None = None,
        *,
        keep_alive_s: float = DEFAULT_KEEP_ALIVE_S,
        prewarm: int = 0,
        model_shapes: str | None = None,
        start_timeout_s: float = 300.0,
        redis_executable: str | None = None,
        gpu_percent: int | None = None,
        data_path: str = "redis",
    ) -> None:
        if data_path not in DATA_PATHS:
            raise ValueError(f"data_path must be one of {', '.join(DATA_PATHS)}, got {data_path!r}")
        if keep_alive_s < 0:
            raise ValueError(f"keep_alive_s must be >= 0, got {keep_alive_s}")
        if prewarm < 0:
            raise ValueError(f"prewarm must be >= 0, got {prewarm}")
        self.config = config or Config.from_env()
        self.keep_alive_s = keep_alive_s
        self.prewarm = prewarm
        self.model_shapes = model_shapes or os.environ.get("STREAMBOX_MODEL_SHAPES", "small")
        if self.model_shapes not in ("small", "full"):
            raise ValueError(f"model_shapes must be 'small' or 'full', got {self.model_shapes!r}")
        if gpu_percent is not None and not 1 <= gpu_percent <= 100:
            raise ValueError(f"gpu_percent must be from 1 to 100, got {gpu_percent}")
        self.gpu_percent = gpu_percent
        self.data_path = data_path
        self.start_timeout_s = start_timeout_s
        self.cold_starts = 0  # invocations that had to start their instance
        self.instance_starts = 0  # instances started, prewarmed ones included
        self.prewarm_skipped = 0  # pre-warm instances that found no device memory at deploy
        self.redis_version: str | None = None
        self._redis_executable = redis_executable
        self._redis: RedisServer | None = None
        self._client: Any = None  # redis.asyncio.Redis of this process (end_request)
        self._end_script: Any = None
        self._registry: HandleRegistry | None = None  # astraea: the shared directory of IPC handles
        self._workflows: dict[str, _Workflow] = {}
        self._ids = itertools.count(1)
        self._dir: Path | None = None  # the instances' working directory
        self._housekeeping: asyncio.Task[None] | None = None
        self._background: set[asyncio.Task[Any]] = set()
        # What instances reported last, read by `memory_breakdown` from any thread.
        self._lock = threading.Lock()
        self._reports: dict[int, dict[str, Any]] = {}
        self._owners: dict[int, tuple[str, str]] = {}  # instance -> (workflow, function)
        self._busy: set[int] = set()
        self._device_load = [0] * self.config.gpus  # instances per device, starting ones included
        self._starting: dict[int, subprocess.Popen[bytes]] = {}
        self._closed = False
        self._batches = BatchQueue(self._dispatch)
        self.batches_sent = 0  # messages that carried more than one invocation
        self.calls_batched = 0  # the invocations they carried
        self._retired_counts: dict[str, int] = dict.fromkeys(INFER_COUNTS, 0)  # of stopped instances

    @classmethod
    def factory(cls, **options: Any) -> Any:
        """An `InvokerFactory` for `workflows.commands.serve`: `(config, system) -> MonolithicInvoker`."""
        return lambda config, system: cls(config, **options)

    def describe(self) -> dict[str, Any]:
        return {
            "system": SYSTEM if self.data_path == "redis" else DATA_PATHS[self.data_path],
            "invoker": type(self).__name__,
            "keep_alive_s": self.keep_alive_s,
            "prewarm": self.prewarm,
            "model_shapes": self.model_shapes,
            "backend": self.config.backend,
            "device_preset": self.config.device_preset,
            "gpus": self.config.gpus,
            "gpu_percent": self.gpu_percent,
            "gpu_percent_by_function": self.shares(),  # what the instances open their runtimes with
            "func_ipc": self.data_path,
            "redis_version": self.redis_version,
            "cuda_ipc_model": CudaIpcModel().label if self.data_path == "cuda-ipc" else None,
        }

    def share(self, spec: WorkflowSpec, function: str) -> int:
        """The MPS share (GPU%) each instance of `function` opens its runtime with: the invoker's, else
        the function's own (`gpu_percent` in the YAML), else an equal share per function of the
        workflow (INFless sizes GPU% per function)."""
        return self.gpu_percent or spec.functions[function].gpu_percent or max(1, 100 // len(spec.functions))

    def shares(self) -> dict[str, dict[str, int]]:
        """The MPS share of every deployed function, by workflow (for the records: `describe`)."""
        return {
            name: {function: self.share(wf.spec, function) for function in wf.spec.functions}
            for name, wf in self._workflows.items()
        }

    # -- Invoker ---------------------------------------------------------------------------------
    async def deploy(self, spec: WorkflowSpec) -> None:
        if self._closed:
            raise RuntimeError("the invoker is closed")
        if spec.name in self._workflows:
            return  # deploying again replaces nothing
        await self._ensure_data_path()
        functions = {
            name: _Function(
                name,
                InstancePool(fn.max_instances, self.keep_alive_s),
                (fn.timeout_ms or spec.timeout_ms) / 1e3,
                limits_of(ProxyFunction.of(name, fn)),  # the same settings the proxy reads
                fn.batch_size,
            )
            for name, fn in spec.functions.items()
        }
        wf = self._workflows[spec.name] = _Workflow(spec, functions)
        if self._housekeeping is None or self._housekeeping.done():
            self._housekeeping = asyncio.get_running_loop().create_task(self._housekeep())
        if self.prewarm:
            starts = []
            for fn in functions.values():
                for _ in range(min(self.prewarm, fn.pool.max_instances)):
                    instance_id = next(self._ids)
                    fn.pool.add(instance_id, time.monotonic(), busy=True)
                    starts.append(self._start(wf, fn, instance_id))
            started = await asyncio.gather(*starts, return_exceptions=True)
            for result in started:
                if isinstance(result, _Instance):
                    self._release(wf.functions[result.function], result)
            # Pre-warming is best effort on a full GPU (users past its capacity, section 9.3): the
            # function then starts its instance at its first request, as without pre-warming.
            self.prewarm_skipped += sum(_out_of_memory(r) for r in started)
            errors = [r for r in started if isinstance(r, BaseException) and not _out_of_memory(r)]
            if errors:
                raise errors[0]

    async def pin_warm(self, workflow: str, pinned: bool) -> None:
        """Pause (True) or resume (False) the keep-alive of the workflow's instances; resuming counts
        the idle ones as used now (see `ProxyInvoker.pin_warm`)."""
        now = time.monotonic()
        for fn in deployed(self._workflows, workflow).functions.values():
            if pinned:
                fn.pool.pin()
            else:
                fn.pool.unpin(now)

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
        fn = wf.functions.get(function)
        if fn is None:
            raise KeyError(
                f"workflow {workflow!r} has no function {function!r}; functions: {', '.join(wf.functions)}"
            )
        event = _json_copy(event, f"the event of {function!r}")
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        if fn.limits is not None:
            return await self._invoke_batched(wf, fn, Pending(event, request_id, deadline, started))
        instance, cold = await self._acquire(wf, fn, deadline)
        # The phases this invoker can measure: the wait for an instance, its start when cold.
        phases = {COLD_START if cold else QUEUE: time.perf_counter() - started}
        limit = fn.timeout_s if deadline is None else min(fn.timeout_s, deadline - time.monotonic())
        if limit <= 0:
            self._release(fn, instance)
            raise InvocationTimeout(f"{function}: the request's time ran out before the call was sent")
        message = {"op": "invoke", "event": event, "request_id": request_id}
        # The call runs to its end (or its limit) even when the caller stops waiting (the engine
        # cancels a failed request's other calls): the instance goes back to the pool afterwards.
        call = self._spawn(self._call(fn, instance, message, limit))
        reply = await asyncio.shield(call)
        if not reply["ok"]:
            raise InvocationError(function, reply["error_type"], reply["message"], reply.get("traceback"))
        return InvocationResult(reply["output"], cold, time.perf_counter() - started, phases)

    async def _invoke_batched(self, wf: _Workflow, fn: _Function, pending: Pending) -> InvocationResult:
        """The invocation waits in its function's batch (`batch_queue.py`), which goes to one
        instance as one message (`_send_batch`)."""
        assert fn.limits is not None
        if self._closed:  # `close` already failed the queued ones: this one would wait for ever
            raise InvocationError(fn.name, "InvokerClosed", "the invoker closed")
        batch = self._batches.add((wf.spec.name, fn.name), pending, fn.samples, fn.limits)
        try:
            async with asyncio.timeout(_left(pending.deadline)):
                delivered = await pending.reply
        except BaseException as exc:  # cancelled or timed out while still queued: out of its batch
            self._batches.leave(batch, pending)
            if isinstance(exc, TimeoutError):
                raise InvocationTimeout(f"{fn.name}: the request's time ran out in its batch") from None
            raise
        reply = delivered.reply
        if not reply["ok"]:
            raise InvocationError(fn.name, reply["error_type"], reply["message"], reply.get("traceback"))
        phases = {COLD_START if delivered.cold else QUEUE: delivered.waited_s}
        elapsed = time.perf_counter() - pending.started
        return InvocationResult(reply["output"], delivered.cold, elapsed, phases)

    def _dispatch(self, kind: Hashable, members: list[Pending]) -> None:
        workflow, function = kind  # type: ignore[misc]
        wf = self._workflows.get(workflow)
        if wf is None or self._closed:  # closed meanwhile: fail the members, never leave them waiting
            for member in members:
                if member.waiting:
                    closed = InvocationError(function, "InvokerClosed", "the invoker closed")
                    member.reply.set_exception(closed)
            return
        self._spawn(self._send_batch(wf, wf.functions[function], members))

    async def _send_batch(self, wf: _Workflow, fn: _Function, members: list[Pending]) -> None:
        """A closed batch: one instance (warm, cold or waited for), one message, one reply each.
        Its time limit is the latest of its members' (each stops waiting at its own)."""
        deadlines = [m.deadline for m in members]
        deadline = None if None in deadlines else max(d for d in deadlines if d is not None)
        try:
            instance, cold = await self._acquire(wf, fn, deadline)
            sent = time.perf_counter()
            live = [m for m in members if m.waiting]
            limit = fn.timeout_s if deadline is None else min(fn.timeout_s, deadline - time.monotonic())
            if not live or limit <= 0:
                self._release(fn, instance)
                raise InvocationTimeout(f"{fn.name}: the request's time ran out before the batch was sent")
            calls = [{"event": m.event, "request_id": m.request_id} for m in live]
            if len(live) == 1:
                replies = [await self._call(fn, instance, {"op": "invoke", **calls[0]}, limit)]
            else:
                reply = await self._call(fn, instance, {"op": "invoke_batch", "calls": calls}, limit)
                replies = reply["replies"]
                self.batches_sent += 1
                self.calls_batched += len(live)
                wf.batches_sent += 1
                wf.calls_batched += len(live)
            for member, answer in zip(live, replies, strict=True):
                if member.waiting:
                    member.reply.set_result(Delivered(answer, cold, sent - member.started))
        except Exception as error:
            for member in members:
                if member.waiting:
                    member.reply.set_exception(error)
        finally:  # cancelled (the invoker closed): nobody waits for ever
            closed = InvocationError(fn.name, "InvokerClosed", "the invoker closed")
            for member in members:
                if member.waiting:
                    member.reply.set_exception(closed)

    async def end_request(self, workflow: str, request_id: str) -> None:
        if self._registry is not None:  # astraea: the producers free the request's cached data
            self._registry.end_request(workflow, request_id)
            return
        if self._end_script is None:
            return
        await self._end_script(
            keys=[ended_key(workflow, request_id), request_set_key(workflow, request_id)], args=[ENDED_TTL_S]
        )

    async def close(self) -> None:
        self._closed = True
        self._batches.fail_all(lambda kind: InvocationError(kind[1], "InvokerClosed", "the invoker closed"))  # type: ignore[index]
        if self._housekeeping is not None:
            self._housekeeping.cancel()
            with contextlib.suppress(BaseException):
                await self._housekeeping
        stops = [
            self._stop(fn, instance, kill=False)
            for wf in self._workflows.values()
            for fn in wf.functions.values()
            for instance in list(fn.instances.values())
        ]
        for process in self._starting.values():
            process.kill()  # its start fails at once
        await asyncio.gather(*stops, return_exceptions=True)
        # What is left (calls of stopped instances, starts, stops) ends quickly; cancel stragglers.
        late: set[asyncio.Task[Any]] = set()
        if self._background:
            _, late = await asyncio.wait(set(self._background), timeout=2 * STOP_GRACE_S)
        for task in late:
            task.cancel()
        await asyncio.gather(*late, return_exceptions=True)
        self._workflows.clear()
        if self._client is not None:
            with contextlib.suppress(Exception):
                await self._client.aclose()
            self._client = self._end_script = None
        if self._redis is not None:
            await asyncio.to_thread(self._redis.stop)
            self._redis = None
        if self._dir is not None:
            shutil.rmtree(self._dir, ignore_errors=True)
            self._dir = None

    # -- stats -----------------------------------------------------------------------------------
    def memory_breakdown(self) -> dict[str, float]:
        """Summed over live instances, as they reported last (callable from any thread):
        `context_bytes` (one runtime each), `weights_bytes` (each instance's own model copies),
        `pool_reserved_bytes` / `pool_used_bytes` (their caching allocators), `instances`,
        `busy_instances`, `mps_clients` (instances whose runtime holds an MPS share); astraea's
        `ipc_cached_bytes` (intermediate data held in producers' GPU memory), its peak per instance
        and the handles exported / opened (`CUDA_IPC_PARTS`)."""
        with self._lock:
            reports = list(self._reports.items())
            busy = len(self._busy & self._reports.keys())
        parts = (*MEMORY_PARTS, *CUDA_IPC_PARTS) if self.data_path == "cuda-ipc" else MEMORY_PARTS
        totals = {part: 0.0 for part in parts}
        for _, report in reports:
            for part in totals:
                totals[part] += float(report.get(part, 0))
        totals["instances"] = float(len(reports))
        totals["mps_clients"] = float(sum(1 for _, r in reports if r.get("gpu_percent")))
        totals["busy_instances"] = float(busy)
        return totals

    def memory_by_workflow(self) -> dict[str, int]:
        """Device bytes of each workflow's live instances, as they reported last: their runtimes'
        allocated bytes (context and framework runtime included, `Runtime.allocated_bytes`)."""
        with self._lock:
            reports = [(self._owners[i][0], r) for i, r in self._reports.items() if i in self._owners]
        totals: dict[str, int] = {}
        for workflow, report in reports:
            totals[workflow] = totals.get(workflow, 0) + int(report.get("allocated_bytes", 0))
        return totals

    def inference_counts(self) -> dict[str, int]:
        """The instances' inferences since the invoker started (stopped instances included):
        `plan_runs` (a batch counts once) against the `infer_calls` they served, `batched_runs` and
        the `batched_calls` in them; and the messages that carried several invocations (`batches_sent`,
        `calls_batched`)."""
        with self._lock:
            totals = dict(self._retired_counts)
            for report in self._reports.values():
                for part in INFER_COUNTS:
                    totals[part] += int(report.get(part, 0))
        return {**totals, "batches_sent": self.batches_sent, "calls_batched": self.calls_batched}

    def runtime_stats(self) -> Iterator[RuntimeStats]:
        """The gateway's stats callback: per workflow and device, its instances' runtimes summed."""
        with self._lock:
            reports = [(self._owners[i], r) for i, r in self._reports.items() if i in self._owners]
        groups: dict[tuple[str, int], list[tuple[str, dict[str, Any]]]] = {}
        for (workflow, function), report in reports:
            groups.setdefault((workflow, int(report["device"])), []).append((function, report))
        for (workflow, device), members in sorted(groups.items()):
            latest = max((r for _, r in members), key=lambda r: r["reported_at"])
            instances: dict[str, int] = {}
            for function, _ in members:
                instances[function] = instances.get(function, 0) + 1
            yield RuntimeStats(
                workflow=workflow,
                device=device,
                memory_used_bytes=int(latest["memory_used_bytes"]),
                memory_total_bytes=int(latest["memory_total_bytes"]),
                pool_reserved_bytes=sum(int(r["pool_reserved_bytes"]) for _, r in members),
                pool_used_bytes=sum(int(r["pool_used_bytes"]) for _, r in members),
                instances=instances,
                **self._batch_counts(workflow),
            )

    def _batch_counts(self, workflow: str) -> dict[str, int]:
        wf = self._workflows.get(workflow)
        if wf is None:
            return {}
        return {"batches": wf.batches_sent, "batched_calls": wf.calls_batched}

    @property
    def starting_instances(self) -> int:
        """Instance processes started and not yet up (a call that found a warm one leaves its
        start going on: a benchmark waits for them before it measures)."""
        return len(self._starting)

    def live_instances(self, workflow: str) -> dict[str, list[int]]:
        """Per function, the pids of its live instances (started and not stopped)."""
        wf = self._workflows[workflow]
        return {name: [i.pid for i in fn.instances.values()] for name, fn in wf.functions.items()}

    @property
    def redis_port(self) -> int | None:
        return self._redis.port if self._redis is not None else None

    @property
    def redis_connection(self) -> dict[str, Any] | None:
        """`redis.Redis` keyword arguments of the baseline's server (its password included)."""
        return self._redis.connection() if self._redis is not None else None

    # -- the data path: Redis (infless) or the handle registry (astraea) --------------------------
    async def _ensure_data_path(self) -> None:
        if self._dir is not None:
            return
        if self.data_path == "cuda-ipc":
            self._dir = Path(tempfile.mkdtemp(prefix="sbx-astraea-"))
            self._registry = HandleRegistry.create(self._dir / "handles")
            return
        server = RedisServer(self._redis_executable)
        try:
            await asyncio.to_thread(server.start)
        except RedisUnavailable as error:
            raise RedisUnavailable(f"the monolithic baseline passes data through Redis: {error}") from None
        import redis.asyncio

        self._redis = server
        self._client = redis.asyncio.Redis(**server.connection())
        self._end_script = self._client.register_script(END_REQUEST_LUA)
        with contextlib.suppress(Exception):
            self.redis_version = (await self._client.info("server")).get("redis_version")
        self._dir = Path(tempfile.mkdtemp(prefix="sbx-monolithic-"))

    # -- instances -------------------------------------------------------------------------------
    async def _acquire(self, wf: _Workflow, fn: _Function, deadline: float | None) -> tuple[_Instance, bool]:
        """An idle instance (warm), or a new one (cold), or wait for one; marks it busy."""
        while True:
            if self._closed:
                raise InvocationError(fn.name, "InvokerClosed", "the invoker is closed")
            decision = fn.pool.acquire(time.monotonic())
            if decision.action == "warm":
                instance = fn.instances[decision.instance]  # type: ignore[index]
                self._set_busy(instance.id, True)
                return instance, False
            if decision.action == "start":
                break
            changed = fn.changed
            try:
                async with asyncio.timeout(_left(deadline)):
                    await changed.wait()
            except TimeoutError:
                raise InvocationTimeout(
                    f"{fn.name}: no instance free before the request's time ran out "
                    f"({fn.pool.max_instances} busy)"
                ) from None
        instance_id = next(self._ids)
        fn.pool.add(instance_id, time.monotonic(), busy=True)
        start = self._spawn(self._start(wf, fn, instance_id))
        try:
            warm = await self._first_ready(fn, start, deadline)
        except (TimeoutError, asyncio.CancelledError) as error:
            # The start goes on: the instance joins the idle ones when it is up.
            start.add_done_callback(lambda t: self._release_started(fn, t))
            if isinstance(error, asyncio.CancelledError):
                raise
            raise InvocationTimeout(
                f"{fn.name}: the request's time ran out while its instance started"
            ) from None
        if warm is not None:
            # An instance went idle before ours was up: the call takes it, ours joins the idle ones.
            start.add_done_callback(lambda t: self._release_started(fn, t))
            self._set_busy(warm.id, True)
            return warm, False
        instance = start.result()
        self.cold_starts += 1
        self._set_busy(instance.id, True)
        return instance, True

    async def _first_ready(
        self, fn: _Function, start: asyncio.Task[_Instance], deadline: float | None
    ) -> _Instance | None:
        """Wait for the call's own start or for another instance to go idle, whichever comes first:
        the idle one (marked busy), or None once the start is done. A start takes seconds (a process,
        `import torch`, its models); a warm instance freed meanwhile must not sit idle beside a
        waiting call (the cause of a monolithic replay's requests outstanding until its drain)."""
        while not start.done():
            changed = asyncio.ensure_future(fn.changed.wait())
            try:
                await asyncio.wait(
                    {start, changed}, timeout=_left(deadline), return_when=asyncio.FIRST_COMPLETED
                )
            finally:
                changed.cancel()
            if start.done():
                break
            if changed.done() and not changed.cancelled():
                decision = fn.pool.acquire(time.monotonic())
                if decision.action == "warm":
                    return fn.instances[decision.instance]  # type: ignore[index]
            if deadline is not None and time.monotonic() >= deadline:
                raise TimeoutError
        return None

    def _release_started(self, fn: _Function, task: asyncio.Task[_Instance]) -> None:
        if not task.cancelled() and task.exception() is None:
            self._release(fn, task.result())

    async def _start(self, wf: _Workflow, fn: _Function, instance_id: int) -> _Instance:
        """Start an instance process and wait until it has its runtime and models. On failure the
        pool slot is freed and the call fails with why."""
        assert self._dir is not None
        spec = wf.spec
        device = self._pick_device()
        args = self._instance_args(spec, fn.name, device)
        ours, theirs = socket.socketpair()
        process: subprocess.Popen[bytes] | None = None
        writer: asyncio.StreamWriter | None = None
        try:
            args["fd"] = theirs.fileno()
            process = subprocess.Popen(
                [sys.executable, "-c", LAUNCH_INSTANCE, json.dumps(args)],
                cwd=self._dir,
                stdin=subprocess.DEVNULL,
                pass_fds=(theirs.fileno(),),
            )
            self._starting[instance_id] = process
            theirs.close()
            reader, writer = await asyncio.open_unix_connection(sock=ours)
            instance = _Instance(instance_id, fn.name, device, process, reader, writer)
            hello = await self._hello(instance)
        except BaseException:
            theirs.close()
            if writer is not None:
                writer.close()
            else:
                ours.close()
            if process is not None:
                process.kill()
                self._spawn(_reap(process, STOP_GRACE_S))
            fn.pool.remove(instance_id)
            self._device_load[device] -= 1
            fn.wake()
            raise
        finally:
            self._starting.pop(instance_id, None)
        instance.pid = int(hello["pid"])
        fn.instances[instance_id] = instance
        self.instance_starts += 1
        with self._lock:
            self._owners[instance_id] = (spec.name, fn.name)
            self._busy.add(instance_id)
            self._reports[instance_id] = hello["stats"]
        if self._closed:
            await self._stop(fn, instance, kill=True)
            raise InvocationError(fn.name, "InvokerClosed", "the invoker closed while the instance started")
        return instance

    def _instance_args(self, spec: WorkflowSpec, function: str, device: int) -> dict[str, Any]:
        """What an instance process of `function` is started with (JSON on its command line; the fd
        of its socket is added by the caller)."""
        one = spec.model_copy(
            update={"functions": {function: spec.functions[function]}, "edges": [], "output": None}
        )
        return {
            "spec": json.loads(one.model_dump_json(by_alias=True)),
            "base_dir": str(spec.base_dir.resolve()) if spec.base_dir is not None else None,
            "function": function,
            "device": device,
            "config": {
                "backend": self.config.backend,
                "device_preset": self.config.device_preset,
                "gpus": self.config.gpus,
                "model_pool": str(self.config.model_pool),
                "state_dir": str(self.config.state_dir) if self.config.state_dir is not None else None,
            },
            "model_shapes": self.model_shapes,
            "data_path": self._data_path_args(),
            "gpu_percent": self.share(spec, function),
        }

    async def _hello(self, instance: _Instance) -> dict[str, Any]:
        """The instance's first message once it has its runtime and models, or `InvocationError`
        saying why it did not start (timeout, exit, or its own error)."""
        name = instance.function
        try:
            async with asyncio.timeout(self.start_timeout_s):
                hello = await _read_message(instance.reader)
        except TimeoutError:
            raise InvocationError(
                name, "InstanceStartError", f"the instance did not start in {self.start_timeout_s:g} s"
            ) from None
        except (asyncio.IncompleteReadError, ConnectionError):
            await _reap(instance.process, STOP_GRACE_S)
            raise InvocationError(
                name, "InstanceStartError", f"the instance did not start: {instance.exit_reason()}"
            ) from None
        if not hello.get("ok"):
            raise InvocationError(
                name,
                hello.get("error_type", "InstanceStartError"),
                f"the instance could not start: {hello.get('message')}",
                hello.get("traceback"),
            )
        return hello

    def _data_path_args(self) -> dict[str, Any]:
        """How an instance reaches the data path (the Redis password is never on argv: a file)."""
        if self._registry is not None:
            return {"kind": "cuda-ipc", "registry": str(self._registry.root)}
        assert self._redis is not None
        return {
            "kind": "redis",
            "redis_port": self._redis.port,
            "redis_password_file": str(self._redis.password_file),
        }

    async def _call(
        self, fn: _Function, instance: _Instance, message: dict[str, Any], limit: float
    ) -> dict[str, Any]:
        """One round trip; maps a dead instance and the time limit to the engine's errors."""
        try:
            instance.writer.write(encode_message(message))
            await instance.writer.drain()
            async with asyncio.timeout(limit):
                reply = await _read_message(instance.reader)
        except TimeoutError:
            await self._stop(fn, instance, kill=True)
            raise InvocationTimeout(f"{fn.name} ran past {limit:.3f} s; its instance was killed") from None
        except (asyncio.IncompleteReadError, ConnectionError, OSError):
            await _reap(instance.process, STOP_GRACE_S)
            reason = instance.exit_reason()
            await self._stop(fn, instance, kill=True)
            raise InvocationError(
                fn.name, "InstanceCrashed", f"the instance (pid {instance.pid}) died: {reason}"
            ) from None
        except BaseException:
            await self._stop(fn, instance, kill=True)  # cancelled mid-call (close): it cannot be reused
            raise
        instance.invocations += 1
        with self._lock:
            self._reports[instance.id] = reply["stats"]
        self._release(fn, instance)
        return reply

    def _release(self, fn: _Function, instance: _Instance) -> None:
        self._set_busy(instance.id, False)
        if instance.id in fn.instances:
            fn.pool.release(instance.id, time.monotonic())
            fn.wake()

    def _set_busy(self, instance_id: int, busy: bool) -> None:
        with self._lock:
            (self._busy.add if busy else self._busy.discard)(instance_id)

    async def _stop(self, fn: _Function, instance: _Instance, *, kill: bool) -> None:
        """Take the instance out of the pool, then stop (or kill) its process."""
        if self._detach(fn, instance):
            await self._terminate(instance, kill=kill)

    def _detach(self, fn: _Function, instance: _Instance) -> bool:
        """No more calls go to the instance; False if it was detached already."""
        if fn.instances.pop(instance.id, None) is None:
            return False
        fn.pool.remove(instance.id)
        self._set_busy(instance.id, False)
        fn.wake()
        return True

    async def _terminate(self, instance: _Instance, *, kill: bool) -> None:
        """Ask a detached instance to exit (or kill it); its stats go when its process is gone."""
        try:
            if not kill and instance.process.poll() is None:
                with contextlib.suppress(Exception):
                    instance.writer.write(encode_message({"op": "stop"}))
                    await instance.writer.drain()
                await _reap(instance.process, STOP_GRACE_S)
            if instance.process.poll() is None:
                instance.process.kill()
            instance.writer.close()
            await _reap(instance.process, STOP_GRACE_S)
        finally:
            if instance.process.poll() is None:  # cancelled half-way: no process outlives its stop
                instance.process.kill()
            with self._lock:  # its memory is counted until its process is gone
                report = self._reports.pop(instance.id, None) or {}
                for part in INFER_COUNTS:
                    self._retired_counts[part] += int(report.get(part, 0))
                self._owners.pop(instance.id, None)
            self._device_load[instance.device] -= 1

    def _pick_device(self) -> int:
        """The device with the fewest instances (starting ones included; lowest index on ties)."""
        device = min(range(self.config.gpus), key=lambda d: (self._device_load[d], d))
        self._device_load[device] += 1
        return device

    async def _housekeep(self) -> None:
        """Stop idle instances whose keep-alive ran out (scale to zero)."""
        period = min(1.0, max(0.05, self.keep_alive_s / 4))
        while True:
            await asyncio.sleep(period)
            now = time.monotonic()
            holding = await asyncio.to_thread(self._registry.live_producers) if self._registry else set()
            for wf in list(self._workflows.values()):
                for fn in wf.functions.values():
                    for instance_id in fn.pool.expired(now):
                        instance = fn.instances.get(instance_id)  # type: ignore[arg-type]
                        if instance is not None and instance.pid in holding:
                            continue  # its exported keys await their consumers: stop it after
                        if instance is not None and self._detach(fn, instance):
                            self._spawn(self._terminate(instance, kill=False))
            if self._registry is not None:  # as Redis expires its ended markers
                self._registry.forget_ended(ENDED_TTL_S)

    def _spawn(self, coro: Any) -> asyncio.Task[Any]:
        task = asyncio.get_running_loop().create_task(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)
        task.add_done_callback(_retrieve)
        return task


def _out_of_memory(result: object) -> bool:
    """Whether an instance start failed for lack of device memory."""
    return isinstance(result, InvocationError) and result.error_type == "OutOfDeviceMemory"


def _retrieve(task: asyncio.Task[Any]) -> None:
    """Mark a background task's exception as seen (its awaiter, if any, still gets it)."""
    if not task.cancelled():
        task.exception()


def _left(deadline: float | None) -> float | None:
    return None if deadline is None else max(0.0, deadline - time.monotonic())


async def _reap(process: subprocess.Popen[bytes], timeout: float) -> int | None:
    """Wait (without blocking the loop) up to `timeout` for the process to exit; its exit code."""
    end = time.monotonic() + timeout
    delay = 0.002
    while process.poll() is None and time.monotonic() < end:
        await asyncio.sleep(delay)
        delay = min(delay * 2, 0.05)
    return process.poll()
