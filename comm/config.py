"""Knobs of the communication store, including the paper's ablation switches PA and AM."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, replace

from .quota import StoreQuota

MiB = 1 << 20
IDLE_TICK_S = 0.1  # the ticker's default period while the store holds nothing

#: Predicted idle memory of a GPU: (gpu index, now, window seconds) -> bytes that the running
#: functions will not need during [now, now + window]. The memory pool's demand model provides it.
IdlePredictor = Callable[[int, float, float], float]


@dataclass(frozen=True)
class StoreConfig:
    """How the store behaves. Every field has a default that matches the paper where it gives one.

    - `pressure_aware` (PA): size the store on each GPU from the predicted idle memory of the next
      `window_s` and move data out *before* functions need the memory. Off: capacity is
      `static_capacity` and data moves only when the memory pool calls `reclaim` (on an OOM).
    - `adaptive_movement` (AM): data leaving a GPU goes to another GPU of the node by rules 1-2 (and
      rule 1 relocates data to its remote reader on GET). Off: it goes to host memory.
    - `capacity_fraction`: the share of predicted idle memory the store may use (the rest absorbs
      bursts; the paper uses "a part" without a figure).
    - `tick_s`: period of the background ticker (pressure check, TTL and lease expiry, global-table
      sync when due); half the window, so that data moves before the window it was predicted for.
    - `idle_tick_s`: the ticker's period while the store holds no data and no lease (nothing can
      expire or move; a PUT wakes it at once): an idle proxy does not wake 100 times a second. None:
      `max(IDLE_TICK_S, tick_s)` (`idle_period_s`).
    - `default_ttl_s`: TTL of a PUT that names none (None: data without consumers lives until
      deleted). A TTL bounds what a consumer that dies before its GET can leak.
    - `lease_ttl_s`: a GET's handle is force-released after this long (a reader that dies while
      holding one cannot pin the bytes forever; the proxy also calls `release_owner` on death).
    - `quota`: the store's bounds (bytes, keys, TTL ceiling, host tier; `quota.py`).
    - `rpc_chunk_bytes`, `rpc_pipeline`: cross-node transfers stream in chunks of this size with at
      most `rpc_pipeline` chunks in flight, so memory per transfer is bounded by their product.
    """

    pressure_aware: bool = True
    adaptive_movement: bool = True
    capacity_fraction: float = 0.5
    window_s: float = 0.02
    tick_s: float = 0.01
    idle_tick_s: float | None = None
    static_capacity: float = math.inf
    default_ttl_s: float | None = 600.0
    lease_ttl_s: float = 600.0
    get_timeout_s: float = 30.0
    global_refresh_s: float = 1.0
    rpc_chunk_bytes: int = 4 * MiB
    rpc_pipeline: int = 2
    rpc_timeout_s: float = 10.0
    quota: StoreQuota = StoreQuota()

    def __post_init__(self) -> None:
        if not 0 <= self.capacity_fraction <= 1:
            raise ValueError(f"capacity_fraction must be in [0, 1], got {self.capacity_fraction}")
        for name in ("window_s", "tick_s", "lease_ttl_s", "get_timeout_s", "global_refresh_s",
                     "rpc_timeout_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        if self.idle_tick_s is not None and not self.idle_tick_s >= self.tick_s:
            raise ValueError(f"idle_tick_s must be >= tick_s ({self.tick_s}), got {self.idle_tick_s}")
        if self.default_ttl_s is not None and not self.default_ttl_s > 0:
            raise ValueError(f"default_ttl_s must be > 0 or None, got {self.default_ttl_s}")
        if self.static_capacity < 0:
            raise ValueError(f"static_capacity must be >= 0, got {self.static_capacity}")
        if self.rpc_chunk_bytes < 1 or self.rpc_pipeline < 1:
            raise ValueError("rpc_chunk_bytes and rpc_pipeline must be >= 1")

    @property
    def idle_period_s(self) -> float:
        """The ticker's period while the store holds nothing (`idle_tick_s`, or its default)."""
        return self.idle_tick_s if self.idle_tick_s is not None else max(IDLE_TICK_S, self.tick_s)

    def ablation(self, pa: bool, am: bool) -> StoreConfig:
        """This configuration with PA and AM set (the paper's Fig. 16 right)."""
        return replace(self, pressure_aware=pa, adaptive_movement=am)

    @property
    def label(self) -> str:
        flags = [n for n, on in (("PA", self.pressure_aware), ("AM", self.adaptive_movement)) if on]
        return "+".join(flags) if flags else "no PA, no AM"
