"""`inprocess-cpu`: a reference target that does real work in this process, to check the harness
end to end before the real systems are wired. It is not one of the systems under test.

Each trace function gets instances: an instance holds its own "model" (float32 weight matrices drawn
at creation, which is its cold start) and a runtime buffer (standing for a per-instance context). A
request takes an idle warm instance of its function or creates one, runs the model's layers
(`tanh(x @ W)`) on a thread pool of `slots` workers (numpy releases the GIL; BLAS is held to one
thread per call while the target runs, so that `slots` alone sets the parallelism and BLAS threads
do not fight over the cores), and returns the instance to the warm set. Instances idle for longer
than `keep_alive_s` are dropped. `sample` reports the bytes actually held: weights, runtime buffers
and live activations.
"""

from __future__ import annotations

import asyncio
import math
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, fields
from typing import Any

import numpy as np
from threadpoolctl import threadpool_limits

from .target import Outcome, SystemRequest

MIB = 1 << 20


@dataclass(frozen=True)
class InProcessOptions:
    slots: int = 2  # requests that compute at once; the others queue
    keep_alive_s: float = 600.0  # the paper's keep-alive is 10 minutes
    model_mib: float = 8.0  # weights per instance
    layers: int = 4
    batch: int = 8
    runtime_mib: float = 4.0  # per-instance runtime buffer

    def __post_init__(self) -> None:
        positive = ("slots", "layers", "batch", "model_mib")  # the rest may be 0: no buffer, no keep-alive
        for name in ("slots", "layers", "batch", "model_mib", "runtime_mib", "keep_alive_s"):
            value = getattr(self, name)
            if not math.isfinite(value) or value < 0 or (name in positive and value <= 0):
                allowed = "above 0" if name in positive else "0 or more"
                raise ValueError(f"inprocess-cpu: {name} {value!r} must be {allowed}")

    @classmethod
    def from_strings(cls, options: dict[str, str]) -> InProcessOptions:
        known = {f.name: f.type for f in fields(cls)}
        unknown = sorted(set(options) - set(known))
        if unknown:
            raise ValueError(f"inprocess-cpu: unknown options {unknown}; known: {', '.join(known)}")
        casts = {"int": int, "float": float}
        values = {}
        for key, value in options.items():
            try:
                values[key] = casts[str(known[key])](value)
            except ValueError:
                raise ValueError(f"inprocess-cpu: {key} {value!r} is not a number ({known[key]})") from None
        return cls(**values)


class _Instance:
    def __init__(self, options: InProcessOptions, seed: int) -> None:
        rng = np.random.default_rng(seed)
        dim = max(int((options.model_mib * MIB / options.layers / 4) ** 0.5), 8)
        scale = np.float32(1.0 / np.sqrt(dim))
        self.weights = [
            rng.standard_normal((dim, dim), dtype=np.float32) * scale for _ in range(options.layers)
        ]
        self.runtime = bytearray(int(options.runtime_mib * MIB))
        self.dim = dim
        self.last_used = time.monotonic()

    @property
    def nbytes(self) -> int:
        return sum(w.nbytes for w in self.weights)


class InProcessTarget:
    name = "inprocess-cpu"

    def __init__(self, options: InProcessOptions | None = None, seed: int = 0) -> None:
        self.options = options or InProcessOptions()
        self.seed = seed
        self._lock = threading.Lock()
        self._idle: dict[str, list[_Instance]] = {}
        self._busy = 0  # instances running a request
        self._busy_bytes = 0  # their weights + runtime
        self._instances = 0
        self._weights = 0
        self._runtime = 0
        self._activations = 0
        self._created = 0
        self._pool: ThreadPoolExecutor | None = None
        self._blas_limit: threadpool_limits | None = None

    async def start(self) -> None:
        self._blas_limit = threadpool_limits(limits=1, user_api="blas")
        self._pool = ThreadPoolExecutor(max_workers=self.options.slots, thread_name_prefix="inprocess")

    async def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
        if self._blas_limit is not None:
            self._blas_limit.restore_original_limits()
        with self._lock:
            self._idle.clear()
            self._instances = self._weights = self._runtime = 0

    def describe(self) -> dict[str, Any]:
        return {"target": self.name, **asdict(self.options), "blas_threads_per_call": 1}

    # -- the work --------------------------------------------------------------------------------------

    def _acquire(self, function: str) -> tuple[_Instance, bool]:
        with self._lock:
            idle = self._idle.get(function)
            instance = idle.pop() if idle else None
            if instance is None:
                self._created += 1
                seed = self.seed * 1_000_003 + self._created
        cold = instance is None
        if instance is None:
            instance = _Instance(self.options, seed)  # the cold start: draw the model's weights
            with self._lock:
                self._instances += 1
                self._weights += instance.nbytes
                self._runtime += len(instance.runtime)
        with self._lock:
            self._busy += 1
            self._busy_bytes += instance.nbytes + len(instance.runtime)
        return instance, cold

    def _release(self, function: str, instance: _Instance) -> None:
        instance.last_used = time.monotonic()
        with self._lock:
            self._busy -= 1
            self._busy_bytes -= instance.nbytes + len(instance.runtime)
            self._idle.setdefault(function, []).append(instance)

    def _expire(self) -> None:
        horizon = time.monotonic() - self.options.keep_alive_s
        with self._lock:
            for function, idle in list(self._idle.items()):
                keep = [i for i in idle if i.last_used >= horizon]
                for dropped in (i for i in idle if i.last_used < horizon):
                    self._instances -= 1
                    self._weights -= dropped.nbytes
                    self._runtime -= len(dropped.runtime)
                self._idle[function] = keep

    def _run(self, function: str) -> tuple[float, bool]:
        started = time.perf_counter()
        instance, cold = self._acquire(function)
        try:
            x = np.ones((self.options.batch, instance.dim), dtype=np.float32)
            for weight in instance.weights:
                with self._lock:
                    self._activations += x.nbytes
                y = np.tanh(x @ weight)
                with self._lock:
                    self._activations -= x.nbytes
                x = y
            if not np.isfinite(x).all():
                raise FloatingPointError("non-finite activations")
        finally:
            self._release(function, instance)
        return time.perf_counter() - started, cold

    async def send(self, workflow: str, event: dict[str, Any]) -> Outcome:
        if self._pool is None:
            raise RuntimeError("inprocess-cpu: send() before start()")
        self._expire()
        function = f"{workflow}:{event.get('function', 'default')}"
        latency, cold = await asyncio.get_running_loop().run_in_executor(self._pool, self._run, function)
        return Outcome(latency_s=latency, status="ok", cold_start=cold)

    def sample(self) -> dict[str, float]:
        self._expire()
        with self._lock:
            return {
                "memory_used_bytes": float(self._weights + self._runtime + self._activations),
                "demand_bytes": float(self._busy_bytes + self._activations),
                "memory.weights_bytes": float(self._weights),
                "memory.runtime_bytes": float(self._runtime),
                "memory.activations_bytes": float(self._activations),
                "instances": float(self._instances),
                "busy_instances": float(self._busy),
            }


def make_inprocess_target(request: SystemRequest) -> InProcessTarget:
    return InProcessTarget(InProcessOptions.from_strings(dict(request.options)), seed=request.seed)
