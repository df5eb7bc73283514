"""The memory side of one API proxy, assembled: pool, executor, shared weights, scaler, threads.

`ProxyMemory(runtime, MemoryOptions(mode=...))` wires the pieces for one pool mode:

- `pool`: the `DeviceMemoryPool`, the only source of device bytes (weights, activations, outputs,
  and the communication store when it arrives); `allocator` (`ReclaimingAllocator`) is how the
  parts take bytes from it: when the pool answers `Reclaim(n)` the reclaimers run (idle weights
  evicted; the proxy adds the store's `reclaim`), outside the pool's lock, and the pool goes on;
- `executor`: a `PlanExecutor` for the mode (static: up front; fm, fm+rs: lazy + eager), writing
  positions to `board`;
- `models`: the `ModelCache` (shared weights, keep-alive), also a reclaimer of `allocator`; with
  `daemon=` (the proxy's `IODaemon`) the weights are copied through the daemon;
- `scaler` (fm+rs only): the `ResilientScaler` thread, every T_interval/2 (with a floor);
  T_interval is measured on the runtime at start-up unless given;
- a sweep thread (keep-alive expiry, collecting completed frees) and, for `recycler="thread"`, the
  background recycler.

Profiles (fm+rs): Algorithm 1 and the store's idle-memory prediction need each model's offline
profile (memory and time per kernel). `ensure_profile(plan)` asks `profile_for(plan)` once per model
and batch (the proxy does so for every model it loads at deploy; `infer` for a plan met later); a
plan it cannot profile, or every plan when `MemoryOptions.profiles` is off, runs *unprofiled*: the
scaler counts what it holds as fixed bytes. `profile_stats()` counts profiled and unprofiled runs
and gives each unprofiled plan's reason, which is also logged once.

`infer(instance, plan, inputs, stream)` is one request of one function instance: acquire the model,
run, release the model when the run is done. A run that finds its model's weights still being
loaded through the daemon waits for them layer by layer (pipelined loading: kernel i waits only for
the weights it is the first to use).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Hashable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import Any

from streambox.device import Runtime, Stream
from streambox.io_daemon import IODaemon
from streambox.kernel_compiler.plan import KernelPlan
from streambox.memory_pool.modes import PoolMode
from streambox.memory_pool.periodic import PeriodicThread
from streambox.memory_pool.pool import DeviceMemoryPool, PoolConfig, Reclaim, check_fields
from streambox.memory_pool.scaler import (
    PositionBoard,
    ResilientScaler,
    ScalerTiming,
    measure_t_interval,
    model_profile_from,
)
from streambox.memory_pool.scaling import ScalingConfig

from .device_tensor import DeviceTensor
from .executor import PlanExecutor, RunResult
from .model_cache import ModelCache

__all__ = ["MemoryOptions", "ProxyMemory", "ReclaimingAllocator"]

log = logging.getLogger(__name__)

#: Asked to give device bytes back to the pool (evict idle weights, move stored data off the GPU);
#: returns the bytes it gave back.
Reclaimer = Callable[[int], int]


class ReclaimingAllocator:
    """The pool as the proxy's parts allocate from it: when the pool needs memory back it says so
    (`Reclaim`), the reclaimers run here, outside the pool's lock, and the allocation resumes where
    the pool's ladder stopped. The pool never calls up into its users."""

    def __init__(self, pool: DeviceMemoryPool, reclaimers: Iterable[Reclaimer] = ()) -> None:
        self.pool = pool
        self.reclaimers: list[Reclaimer] = list(reclaimers)
        # The executor's per-kernel call: the pool's `free_and_allocate`, reclaiming as `allocate`
        # does for a size the fast path cannot place; bound once (a partial adds no Python frame).
        self.free_and_allocate: Callable[[Sequence[int], Sequence[int], Stream], list[int]] = partial(
            pool.free_and_allocate, allocate=self.allocate
        )

    def allocate(self, nbytes: int, stream: Stream) -> int:
        got = self.pool.try_allocate(nbytes, stream)
        while isinstance(got, Reclaim):
            for reclaim in list(self.reclaimers):
                reclaim(got.nbytes)
            got = self.pool.try_allocate(nbytes, stream, resume=got)
        return got

    def free(self, address: int, stream: Stream | None) -> None:
        self.pool.free(address, stream)

    def free_many(self, addresses: Iterable[int], stream: Stream | None) -> None:
        self.pool.free_many(addresses, stream)

    def fence(self, stream: Stream, event: Any = None) -> None:
        self.pool.fence(stream, event)

    def hold_fences(self, stream: Stream) -> None:
        self.pool.hold_fences(stream)

    def release_fences(self, stream: Stream, *, hold: bool = False) -> None:
        self.pool.release_fences(stream, hold=hold)

    def retire_stream(self, stream: Stream, timeout_s: float | None = None) -> bool:
        return self.pool.retire_stream(stream, timeout_s)


@dataclass(frozen=True)
class MemoryOptions:
    mode: PoolMode = PoolMode.FM_RS
    pool: PoolConfig = field(default_factory=PoolConfig)
    keep_alive_s: float = 60.0  # shared weights stay this long after their last user
    recycler: str = "kernel"  # "kernel" (at the kernel boundary) or "thread" (background recycler)
    recycler_period_s: float = 1e-3
    t_interval_s: float | None = None  # None: measured on the runtime at start-up
    min_scaler_period_s: float = 5e-3
    headroom_bytes: int = 0
    sweep_period_s: float = 0.02
    # The scaler's period while nothing runs and the pool does not move; a run or a free wakes it.
    scaler_idle_period_s: float = 0.1
    profiles: bool = True  # off: Algorithm 1 without profiles (an ablation: every function unprofiled)

    def __post_init__(self) -> None:
        def period(value: float | None) -> tuple[bool, str]:
            return value is not None and 0 < value < math.inf, "finite and > 0"

        check_fields(
            self,
            keep_alive_s=(0 <= self.keep_alive_s < math.inf, "finite and >= 0"),
            recycler=(self.recycler in ("kernel", "thread"), "'kernel' or 'thread'"),
            recycler_period_s=period(self.recycler_period_s),
            t_interval_s=period(self.t_interval_s) if self.t_interval_s is not None else (True, ""),
            min_scaler_period_s=period(self.min_scaler_period_s),
            headroom_bytes=(self.headroom_bytes >= 0, ">= 0"),
            sweep_period_s=period(self.sweep_period_s),
            scaler_idle_period_s=period(self.scaler_idle_period_s),
        )


class ProxyMemory:
    def __init__(
        self,
        runtime: Runtime,
        options: MemoryOptions | None = None,
        profiles: Iterable[Any] = (),
        profile_for: Callable[[KernelPlan], Any] | None = None,
        daemon: IODaemon | None = None,
    ) -> None:
        """`profiles`: memory profiles with run times for the scaler; `profile_for(plan)` is asked once
        per model and batch that `infer` meets without one (e.g. `ModelPool.profile`); `daemon`: the
        IO daemon the weights are loaded through (None: direct copies on the acquiring stream)."""
        self.options = options = options or MemoryOptions()
        self.profile_for = profile_for if options.profiles else None
        self._asked: set[tuple[str, int]] = set()  # (model, batch) whose profile was looked for
        self._profiled: set[tuple[str, int]] = set()  # ... and found
        self.unprofiled: dict[tuple[str, int], str] = {}  # ... and not found: why
        self.profiled_runs = 0
        self.unprofiled_runs = 0
        self.mode = PoolMode.parse(options.mode) if isinstance(options.mode, str) else options.mode
        self.runtime = runtime
        self.pool = DeviceMemoryPool(runtime, options.pool)
        self.allocator = ReclaimingAllocator(self.pool)
        self.board = PositionBoard()
        self.executor = PlanExecutor.for_mode(
            runtime, self.allocator, self.mode, positions=self.board, recycler=options.recycler
        )
        self.models = ModelCache(runtime, self.allocator, keep_alive_s=options.keep_alive_s, daemon=daemon)
        self.allocator.reclaimers.append(self.models.evict_idle)
        self.scaler: ResilientScaler | None = None
        self.timing: ScalerTiming | None = None
        if self.mode.resilient_scaling:
            t_interval = (
                options.t_interval_s if options.t_interval_s is not None else measure_t_interval(runtime)
            )
            self.timing = ScalerTiming.from_t_interval(t_interval, options.min_scaler_period_s)
            config = ScalingConfig(
                t_interval_s=self.timing.horizon_s,
                quantum_bytes=options.pool.chunk_bytes,
                headroom_bytes=options.headroom_bytes,
            )
            self.scaler = ResilientScaler(
                self.pool,
                self.board,
                config=config,
                period_s=self.timing.period_s,
                idle_period_s=max(options.scaler_idle_period_s, self.timing.period_s),
            )
            self.board.on_arrival = self.scaler.wake  # a run's first kernel ends an idle wait
        for profile in profiles if options.profiles else ():  # off: the scaler runs without any
            self.add_profile(profile)
        self._threads: list[PeriodicThread] = [
            PeriodicThread("streambox-pool-sweep", options.sweep_period_s, self._sweep)
        ]
        if options.recycler == "thread" and self.mode.eager_recycling:
            self._threads.append(
                PeriodicThread("streambox-recycler", options.recycler_period_s, self.executor.recycle)
            )
        self._started = False

    def add_profile(self, profile: Any) -> None:
        """A kernel compiler `MemoryProfile` with run times (or a scaling `ModelProfile`)."""
        self._profiled.add((profile.model, profile.batch))
        if self.scaler is not None:
            self.scaler.add_profile(profile if hasattr(profile, "key") else model_profile_from(profile))

    def ensure_profile(self, plan: KernelPlan) -> bool:
        """Look for `plan`'s profile once (fm+rs only: the other modes do not scale); True when the
        scaler has it. Without one the plan runs unprofiled, logged once with the reason."""
        key = (plan.model, plan.batch)
        if self.scaler is None or key in self._asked or key in self._profiled:
            return key in self._profiled
        self._asked.add(key)
        reason = self._find_profile(plan)
        if reason is not None:
            self.unprofiled[key] = reason
            log.warning("%s (batch %d) runs unprofiled: %s", plan.model, plan.batch, reason)
        return reason is None

    def _find_profile(self, plan: KernelPlan) -> str | None:
        """Add `plan`'s profile to the scaler; None, or why there is none."""
        if not self.options.profiles:
            return "profiles are off (memory.profiles=false)"
        if self.profile_for is None:
            return "this proxy memory was given no profile source (profile_for)"
        try:
            profile = self.profile_for(plan)
        except (LookupError, OSError, ValueError) as exc:
            return f"{type(exc).__name__}: {exc}"
        if profile is None or getattr(profile, "runtime_s", True) is None:
            return "its profile has no kernel run times"
        self.add_profile(profile)
        return None

    def profile_stats(self) -> dict[str, Any]:
        """Runs with and without a profile (fm+rs), the profiled plans, and why the others have none."""
        return {
            "used": self.scaler is not None,
            "enabled": self.options.profiles,
            "profiled": sorted(f"{m}@{b}" for m, b in self._profiled),
            "unprofiled": {f"{m}@{b}": why for (m, b), why in sorted(self.unprofiled.items())},
            "profiled_runs": self.profiled_runs,
            "unprofiled_runs": self.unprofiled_runs,
        }

    def _sweep(self) -> None:
        expired = self.models.expire()
        collected = self.pool.collect()
        if (expired or collected) and self.scaler is not None:
            self.scaler.wake()  # the pool may shrink now

    def start(self) -> ProxyMemory:
        if not self._started:
            self._started = True
            for thread in self._threads:
                thread.start()
            if self.scaler is not None:
                self.scaler.start()
        return self

    def threads(self) -> list[PeriodicThread]:
        """The pool's background threads (sweep, recycler, scaler), e.g. to read their CPU use."""
        scaler = [self.scaler.thread] if self.scaler is not None and self.scaler.thread is not None else []
        return [*self._threads, *scaler]

    def infer(
        self,
        instance: Hashable,
        plan: KernelPlan,
        inputs: Mapping[str, DeviceTensor],
        stream: Stream,
        **options: Any,
    ) -> RunResult:
        """One request of `instance`: shared weights in, the plan run, the weights released after it."""
        if self.scaler is not None:
            if self.ensure_profile(plan):
                self.profiled_runs += 1
            else:
                self.unprofiled_runs += 1
        model, loading = self.models.acquire_pipelined(plan, stream)
        if loading is not None:  # the weights are still arriving: wait per layer, then the caller's hook
            given = options.get("on_kernel")
            options["on_kernel"] = loading if given is None else _chain(loading, given)
        try:
            result = self.executor.run(model, inputs, stream, instance=instance, **options)
        except BaseException:
            issued = self.runtime.create_event(timing=False)  # kernels issued before the failure
            issued.record(stream)
            self.models.release(plan.model, after=issued)
            raise
        self.models.release(plan.model, after=result.done)
        return result

    def close(self) -> None:
        if self.scaler is not None:
            self.scaler.stop()
        for thread in self._threads:
            thread.stop()
        for instance in self.executor.instances():
            self.executor.release_instance(instance)
        self.models.close()
        self.pool.close()

    def __enter__(self) -> ProxyMemory:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()


def _chain(first: Callable[[int, Any], None], then: Callable[[int, Any], None]) -> Callable[[int, Any], None]:
    def hook(index: int, kernel: Any) -> None:
        first(index, kernel)
        then(index, kernel)

    return hook
