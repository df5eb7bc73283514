"""Resilient scaling's shell (paper section 5.2): a thread that resizes the pool by Algorithm 1.

- `PositionBoard`: where each running function is in its plan. The executor writes one entry per
  issued kernel (kernel index, when it was issued, bytes the run holds); the scaler reads a
  snapshot. Plain dict operations, atomic under the GIL: no lock on the executor's hot path.
- `ResilientScaler.step()`: one iteration of Algorithm 1 -- the pure `decide_pool_size` over the
  board's positions and the profiles, then `pool.resize(target)` (grow chunk by chunk, or trim
  whole free chunks). Bytes the profiles do not cover (shared weights, inputs, outputs, the
  communication store) are `fixed_bytes` = the pool's exact demand minus what the profiled
  functions hold now.
- `start()` runs `step` every `period_s` on a `PeriodicThread`.
- `measure_t_interval(runtime)`: T_interval = time to allocate and free 200 MB on the backend.

Positions are *issue* positions: the executor allocates a kernel's buffers when it issues the
kernel (lazy allocation happens on the host), so the issue position is what the pool's demand
follows. Frees become visible to other streams when the device gets there (see `pool.py`).
"""

from __future__ import annotations

import statistics
import time
from collections import deque
from collections.abc import Callable, Hashable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

from streambox.device.base import Runtime

from .periodic import PeriodicThread
from .scaling import (
    FunctionPosition,
    ModelProfile,
    ProfileKey,
    ScalingConfig,
    ScalingDecision,
    decide_pool_size,
)

__all__ = [
    "T_INTERVAL_BYTES",
    "PositionBoard",
    "ResilientScaler",
    "ScalerTiming",
    "measure_t_interval",
    "model_profile_from",
]

#: The paper's T_interval: the time to allocate and free this many bytes.
T_INTERVAL_BYTES = 200 * 1000 * 1000


class ResizablePool(Protocol):
    @property
    def reserved_bytes(self) -> int: ...

    @property
    def demand_bytes(self) -> int: ...

    def resize(self, target_bytes: int) -> int: ...


class PositionBoard:
    """Live functions' plan positions: instance -> (model, batch, kernel, issued_at, held_bytes)."""

    def __init__(self, on_arrival: Callable[[], None] | None = None) -> None:
        self._positions: dict[Hashable, tuple[str, int, int, float, int]] = {}
        self.on_arrival = on_arrival  # called when a function appears on the board (wakes the scaler)

    def update(
        self, instance: Hashable, model: str, batch: int, kernel: int, started_at: float, held_bytes: int = 0
    ) -> None:
        positions = self._positions
        if instance not in positions and self.on_arrival is not None:
            self.on_arrival()
        positions[instance] = (model, batch, kernel, started_at, held_bytes)

    def remove(self, instance: Hashable) -> None:
        self._positions.pop(instance, None)

    def snapshot(self) -> list[tuple[FunctionPosition, int]]:
        """(position, bytes held) of every running function."""
        items = list(self._positions.items())  # one C-level copy: atomic under the GIL
        return [(FunctionPosition(i, m, b, k, t), held) for i, (m, b, k, t, held) in items]

    def __len__(self) -> int:
        return len(self._positions)


def model_profile_from(profile: Any) -> ModelProfile:
    """Algorithm 1's profile from a kernel compiler `MemoryProfile` (duck-typed: `model`, `batch`,
    `kernels[i].live_eager`, `runtime_s`); needs the run times to be filled in."""
    if profile.runtime_s is None:
        raise ValueError(
            f"memory profile of {profile.model} (batch {profile.batch}) has no kernel run times yet: "
            "profile it on the device first (api_proxy.profiling)"
        )
    pairs = zip((k.live_eager for k in profile.kernels), profile.runtime_s, strict=True)
    return ModelProfile.from_pairs(profile.model, profile.batch, pairs)


@dataclass(frozen=True)
class ScalerTiming:
    """The scaler's period and Algorithm 1's horizon from a measured T_interval.

    The paper resizes every T_interval/2 and looks T_interval ahead. A measured T_interval can be
    far below what a Python thread should tick at (the emulated backend allocates 200 MB in ~0.1
    ms), so the period has a floor, and the horizon is kept at twice the period: a decision must
    cover the kernels that start before the next one takes effect.
    """

    t_interval_s: float
    period_s: float
    horizon_s: float

    @classmethod
    def from_t_interval(cls, t_interval_s: float, min_period_s: float = 5e-3) -> ScalerTiming:
        period = max(t_interval_s / 2, min_period_s)
        return cls(t_interval_s, period, max(t_interval_s, 2 * period))


class ResilientScaler:
    """Resizes `pool` to Algorithm 1's target every `period_s` (the pure rule lives in `scaling.py`)."""

    def __init__(
        self,
        pool: ResizablePool,
        board: PositionBoard,
        profiles: Iterable[ModelProfile] | Mapping[ProfileKey, ModelProfile] = (),
        config: ScalingConfig | None = None,
        *,
        period_s: float | None = None,
        idle_period_s: float | None = None,
        clock: Callable[[], float] = time.perf_counter,
        history: int = 10_000,
    ) -> None:
        """`idle_period_s`: the thread's period while nothing runs and the pool did not move (None:
        `period_s` always); `wake()` ends such a wait (a function appears on the board: give it
        `board.on_arrival`; memory was freed)."""
        self.pool = pool
        self.board = board
        self.config = config or ScalingConfig()
        self.period_s = period_s if period_s is not None else self.config.t_interval_s / 2
        self.idle_period_s = idle_period_s
        self._last_state: tuple[int, int] | None = None
        self.clock = clock
        self._profiles: dict[ProfileKey, ModelProfile] = {}
        for p in profiles.values() if isinstance(profiles, Mapping) else profiles:
            self.add_profile(p)
        self.decisions: deque[tuple[float, ScalingDecision]] = deque(maxlen=history)
        self.unprofiled: set[ProfileKey] = set()
        self._thread: PeriodicThread | None = None

    def add_profile(self, profile: ModelProfile) -> None:
        self._profiles[profile.key] = profile  # dict assignment: atomic, safe while running

    @property
    def profiles(self) -> dict[ProfileKey, ModelProfile]:
        """The profiles the scaler knows, by (model, batch)."""
        return dict(self._profiles)

    def step(self, now: float | None = None) -> ScalingDecision:
        """One iteration of Algorithm 1: decide the target and resize the pool towards it."""
        now = self.clock() if now is None else now
        positions = []
        profiled_held = 0
        for position, held in self.board.snapshot():
            if position.key in self._profiles:
                positions.append(position)
                profiled_held += held
            else:  # no profile: what it holds counts as fixed bytes, and we say so
                self.unprofiled.add(position.key)
        fixed = max(0, self.pool.demand_bytes - profiled_held)
        decision = decide_pool_size(
            now, positions, self._profiles, self.pool.reserved_bytes, self.config, fixed
        )
        if decision.delta_bytes:
            self.pool.resize(decision.target_bytes)
        self.decisions.append((now, decision))
        return decision

    def idle(self) -> bool:
        """After a step: no function runs and the pool's reserved and demanded bytes are those of the
        step before, so the next step would decide the same (Algorithm 1 without positions depends on
        those two only). Records the state for the next call."""
        state = (self.pool.reserved_bytes, self.pool.demand_bytes)
        idle = not len(self.board) and state == self._last_state
        self._last_state = state
        return idle

    def wake(self) -> None:
        """Step now if the thread is waiting out its idle period (a run starts, memory was freed)."""
        if self._thread is not None:
            self._thread.wake()

    def start(self) -> ResilientScaler:
        if self._thread is None:
            self._thread = PeriodicThread(
                "streambox-pool-scaler",
                self.period_s,
                self.step,
                idle=self.idle,
                idle_period_s=self.idle_period_s,
            ).start()
        return self

    def stop(self) -> None:
        if self._thread is not None:
            self._thread.stop()
            self._thread = None

    @property
    def thread(self) -> PeriodicThread | None:
        return self._thread


def measure_t_interval(runtime: Runtime, nbytes: int = T_INTERVAL_BYTES, repeats: int = 5) -> float:
    """Median seconds to allocate and free `nbytes` through the backend's stream-ordered pool
    (alloc_async + free_async + reaching the free + giving the memory back to the device)."""
    pool = runtime.create_pool(0)
    stream = runtime.create_stream()
    samples = []
    try:
        for _ in range(repeats):
            started = time.perf_counter()
            address = pool.alloc_async(nbytes, stream)
            pool.free_async(address, stream)
            stream.synchronize()
            pool.trim_to(0)
            samples.append(time.perf_counter() - started)
    finally:
        stream.synchronize()
        pool.destroy()
        stream.destroy()
    return statistics.median(samples)
