"""Shared model weights: loaded once per pool, refcounted, kept alive, never freed under a kernel.

The shell around the pure `WeightCache` policy. Every function instance running a model uses the
same device copy of its weights (keyed by model name: plans of one model at other batch sizes or
input shapes share them):

- `acquire(plan, stream)`: the first user allocates the weights (`allocate_weights`) and copies them
  (`copy_weights`, replaceable through `copy=`) on its stream and records a *ready* event; every
  user's stream waits on that event, so no kernel reads a weight before it has arrived. Users
  arriving during the load wait for its issue, not for the copy.
- With `daemon=` (the proxy's `IODaemon`), the weights go through the daemon instead: allocated on
  the cache's own stream (nothing runs there, so no pending kernel can still read a reused block),
  submitted with `io_daemon.load_plan` under the queue key `weights:<model>` (so a large model's
  blocks take turns with other models' and requests' copies), and a user's stream waits on the
  submission's events. `acquire_pipelined(plan, stream)` also returns an `on_kernel` hook while the
  load is still in flight: the run waits per layer (kernel i for the weights it is the first to
  use) instead of for the whole model. A daemon in `stream-only` mode issues the copies straight to
  the copy engine on the acquiring stream, in issue order.
- A thread that must never block (the proxy's dispatcher) asks `would_block(plan)` first: True while
  the model is not resident or its copies are not all issued yet (an acquire would then wait for the
  daemon, or read the weights from disk). `hold_issued(plan)`, on a helper thread, starts the load if
  needed and returns once every copy is issued, holding one user until `release(plan.model)`; the
  acquire that follows does not block (and still waits per layer on the device while the copies run).
- `release(model, after=done)`: the user leaves once `after` (its run's `done` event) has
  completed; until then it still counts as a user, so a running kernel never loses its weights.
- `expire()`: frees the weights of models idle for longer than `keep_alive_s` (the policy decides;
  a periodic sweep calls this); `pin(True)` pauses it (a replay's warm-up), `pin(False)` resumes it
  with every idle model idle from then. `evict_idle(nbytes)` frees idle models early, oldest first: a
  reclaimer of `ReclaimingAllocator`, run when the pool answers an allocation with `Reclaim`.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from streambox.device import Event, Runtime, Stream
from streambox.io_daemon import IODaemon, PlanLoad, load_plan
from streambox.kernel_compiler.plan import Kernel, KernelPlan
from streambox.memory_pool.mapping_table import WeightCache

from .executor import Allocator, DeviceModel, allocate_weights, copy_weights, free_all, plan_key
from .run_issue import launch_pending

__all__ = ["ModelCache"]

CopyFn = Callable[[Runtime, DeviceModel, Stream], None]
OnKernel = Callable[[int, Kernel], None]


def weights_queue(model: str) -> str:
    """The IO daemon's queue key for the weight copies of `model`."""
    return f"weights:{model}"


@dataclass
class _Resident:
    """One model's weights on the device, and the plans that use them."""

    name: str
    loaded: threading.Event = field(default_factory=threading.Event)
    model: DeviceModel | None = None  # the first plan's, owning the weight buffers
    ready: Event | None = None  # completes when the copies have arrived (direct copies)
    load: PlanLoad | None = None  # the copies through the IO daemon
    load_key: str = ""  # the plan whose kernel indices `load`'s layers are
    error: BaseException | None = None
    plans: dict[str, DeviceModel] = field(default_factory=dict)  # layout key -> model of that plan

    @property
    def nbytes(self) -> int:
        return self.model.weight_bytes if self.model is not None else 0


class ModelCache:
    """Weights shared by every instance of a model in one pool, with keep-alive. Thread-safe."""

    def __init__(
        self,
        runtime: Runtime,
        allocator: Allocator,
        *,
        keep_alive_s: float = 60.0,
        clock: Callable[[], float] = time.monotonic,
        copy: CopyFn = copy_weights,
        daemon: IODaemon | None = None,
    ) -> None:
        if keep_alive_s < 0:
            raise ValueError(f"keep_alive_s must be >= 0, got {keep_alive_s}")
        self.runtime = runtime
        self.allocator = allocator
        self.keep_alive_s = keep_alive_s
        self.clock = clock
        self.copy = copy
        self.daemon = daemon
        self._policy = WeightCache()
        self._pinned = False  # keep-alive paused (a replay's warm-up): `pin`
        self._resident: dict[str, _Resident] = {}
        self._deferred: list[tuple[Event, str]] = []
        self._lock = threading.Lock()
        self._stream = runtime.create_stream()  # frees of evicted weights
        self.loads = 0
        self.evictions = 0

    # -- users ----------------------------------------------------------------------------------
    def acquire(self, plan: KernelPlan, stream: Stream) -> DeviceModel:
        """The plan's model with resident weights; `stream` waits for them. Loads on first use."""
        return self._acquire(plan, stream, pipelined=False)[0]

    def acquire_pipelined(self, plan: KernelPlan, stream: Stream) -> tuple[DeviceModel, OnKernel | None]:
        """As `acquire`, for a run of `plan` on `stream`: while the weights are still being issued by
        the IO daemon, returns the executor's `on_kernel` hook that makes `stream` wait per layer (and
        `stream` does not wait for the whole model); otherwise None (`stream` waits as in `acquire`)."""
        return self._acquire(plan, stream, pipelined=True)

    def would_block(self, plan: KernelPlan) -> bool:
        """Whether acquiring `plan` now could block the calling thread: its model is not resident (the
        load reads the weights from disk) or is still being loaded, or the daemon has not issued every
        copy yet. Never blocks (see `hold_issued`)."""
        with self._lock:
            resident = self._resident.get(plan.model)
        if resident is None or not resident.loaded.is_set():
            return True
        load = resident.load
        return load is not None and load.ticket.error is None and not load.ticket.issued

    def hold_issued(self, plan: KernelPlan, cancelled: Callable[[], bool] | None = None) -> None:
        """Blocking, for a helper thread: one more user of `plan`'s model (its load started here if it
        is not resident), returned once the IO daemon has issued every copy of the load, so that an
        `acquire` of it does not block any more. The caller leaves with `release(plan.model)`; on an
        error (a failed load, or `cancelled()` turning true) no user is held."""
        name = plan.model
        self._acquire(plan, self._stream, pipelined=True, wait=False)
        try:
            with self._lock:
                load = self._resident[name].load
            while load is not None:
                try:
                    load.ticket.last_event(timeout=0.2)
                    break
                except TimeoutError:
                    if cancelled is not None and cancelled():
                        raise
        except BaseException:
            self.release(name)
            raise

    def _acquire(
        self, plan: KernelPlan, stream: Stream, pipelined: bool, wait: bool = True
    ) -> tuple[DeviceModel, OnKernel | None]:
        name = plan.model
        with self._lock:
            self._settle_locked()
            is_new = self._policy.acquire(name, self.clock())
            if is_new:
                resident = self._resident[name] = _Resident(name)
            else:
                resident = self._resident[name]
        if is_new:
            try:
                # Through the daemon the copies run on its stream: allocate where nothing runs.
                where = stream if self.daemon is None else self._stream
                model = allocate_weights(self.runtime, plan, self.allocator, where)
                ready: Event | None = None
                load: PlanLoad | None = None
                try:
                    if self.daemon is None:
                        self.copy(self.runtime, model, stream)
                        ready = self.runtime.create_event(timing=False)
                        ready.record(stream)
                    else:
                        addresses = {n: t.address for n, t in model.weights.items()}
                        load = load_plan(self.daemon, weights_queue(name), plan, addresses, stream=stream)
                except BaseException:
                    free_all(self.allocator, [t.address for t in model.weights.values()], where, fence=True)
                    raise
            except BaseException as exc:
                with self._lock:
                    resident.error = exc
                    self._policy.release(name, self.clock())
                    self._policy.evict(name)
                    del self._resident[name]
                resident.loaded.set()
                raise
            resident.model, resident.ready, resident.load = model, ready, load
            resident.load_key = plan_key(plan)
            resident.plans[plan_key(plan)] = model
            self.loads += 1
            resident.loaded.set()
        else:
            resident.loaded.wait()
            if resident.error is not None:
                with self._lock:
                    self._release_locked(name)
                raise RuntimeError(f"loading the weights of {name} failed") from resident.error
        try:
            hook = self._wait_loaded(resident, plan, stream, pipelined) if wait else None
            return self._plan_model(resident, plan), hook
        except BaseException:
            with self._lock:
                self._release_locked(name)
            raise

    def _wait_loaded(
        self, resident: _Resident, plan: KernelPlan, stream: Stream, pipelined: bool
    ) -> OnKernel | None:
        """Make `stream` wait for the weights (or return the per-layer hook, see `acquire_pipelined`)."""
        load = resident.load
        if load is None:
            assert resident.ready is not None
            stream.wait_event(resident.ready)
            return None
        if load.ticket.error is not None:
            raise RuntimeError(f"loading the weights of {resident.name} failed") from load.ticket.error
        # Still in flight: wait per layer (direct, stream-only copies are issued at once and in order).
        direct = load.ticket.issued and self.daemon is not None and self.daemon.config.mode == "stream-only"
        if pipelined and resident.load_key == plan_key(plan) and not load.ticket.query() and not direct:
            return load.on_kernel(stream, launch_pending)  # the run's pending kernels go first
        load.wait_all(stream)  # blocks until the daemon has issued the last block, if it has not yet
        return None

    def _plan_model(self, resident: _Resident, plan: KernelPlan) -> DeviceModel:
        base = resident.model
        assert base is not None
        key = plan_key(plan)
        model = resident.plans.get(key)
        if model is None:
            missing = [n for n in plan.weight_names if n not in base.weights]
            if missing:
                raise ValueError(f"plan {key} has weights the resident {plan.model} lacks: {missing[:5]}")
            model = DeviceModel(plan, base.weights, base.weight_views)
            resident.plans[key] = model
        return model

    def release(self, model: str, after: Event | None = None) -> None:
        """One user of `model` leaves once `after` has completed (at once if None)."""
        with self._lock:
            if after is not None and not after.query():
                self._deferred.append((after, model))
            else:
                self._release_locked(model)

    def _release_locked(self, model: str) -> None:
        self._policy.release(model, self.clock())

    def _settle_locked(self) -> None:
        if self._deferred:
            still = []
            for event, model in self._deferred:
                if event.query():
                    self._release_locked(model)
                else:
                    still.append((event, model))
            self._deferred = still

    # -- keep-alive -----------------------------------------------------------------------------
    def expire(self, now: float | None = None) -> list[str]:
        """Free the weights of models idle for longer than `keep_alive_s`; returns their names."""
        with self._lock:
            self._settle_locked()
            now = self.clock() if now is None else now
            expired = [] if self._pinned else self._policy.expired(now, self.keep_alive_s)
            failed = [  # idle models whose daemon load failed: dropped now, loaded again on next use
                m
                for m, r in self._resident.items()
                if r.load is not None and r.load.ticket.error is not None and self._policy.users(m) == 0
            ]
            return self._evict_locked([*expired, *(m for m in failed if m not in expired)], None)

    def pin(self, pinned: bool) -> None:
        """Pause (True) or resume (False) the keep-alive; resuming counts idle models as idle from now."""
        with self._lock:
            self._pinned = pinned
            if not pinned:
                self._policy.restart_idle(self.clock())

    def evict_idle(self, nbytes: int) -> int:
        """Free idle models (no user; oldest idle first) until `nbytes` are freed; returns bytes."""
        with self._lock:
            self._settle_locked()
            idle = [m for m in self._policy.models() if self._policy.users(m) == 0]
            idle.sort(key=lambda m: self._policy.idle_since(m) or 0.0)
            sizes = {m: self._resident_bytes(m) for m in idle}  # before: evicted models are gone after
            return sum(sizes[m] for m in self._evict_locked(idle, nbytes))

    def _resident_bytes(self, model: str) -> int:
        resident = self._resident.get(model)
        return resident.nbytes if resident is not None else 0

    def _evict_locked(self, models: list[str], budget: int | None) -> list[str]:
        evicted: list[str] = []
        freed = 0
        for name in models:
            if budget is not None and freed >= budget:
                break
            resident = self._resident[name]
            if (resident.ready is not None and not resident.ready.query()) or (
                resident.load is not None and not resident.load.ticket.settled
            ):
                continue  # copies still in flight (a load whose users all left early): next sweep
            if resident.model is not None:
                freed += resident.nbytes
                # Every user's run has completed (`release(after=done)`): nothing on the device reads
                # these buffers any more, so they are free for every stream at once.
                addresses = [t.address for t in resident.model.weights.values()]
                free_all(self.allocator, addresses, self._stream, fence=True)
            self._policy.evict(name)
            del self._resident[name]
            self.evictions += 1
            evicted.append(name)
        return evicted

    # -- inspection -----------------------------------------------------------------------------
    def users(self, model: str) -> int:
        with self._lock:
            self._settle_locked()
            return self._policy.users(model)

    def resident(self) -> dict[str, int]:
        """Resident models and their weight bytes."""
        with self._lock:
            return {name: r.nbytes for name, r in self._resident.items()}

    @property
    def resident_bytes(self) -> int:
        with self._lock:
            return sum(r.nbytes for r in self._resident.values())

    def close(self) -> None:
        """Free every resident model (waits for deferred releases only as far as they completed)."""
        with self._lock:
            self._settle_locked()
            self._evict_locked(list(self._resident), None)
        self._stream.destroy()
