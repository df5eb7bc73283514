"""Resilient pool scaling (paper section 5.2, Algorithm 1) as one pure function.

Every T_interval/2 the shell asks `decide_pool_size` how large the pool should be. The answer comes
from offline profiles: for each model and batch size, per kernel, the bytes live while that kernel
runs (under lazy allocation and eager recycling) and the kernel's runtime. For each running function
(its plan position: current kernel and when that kernel started):

- m_c    = live bytes of its current kernel;
- m_next = max live bytes over the kernels it will run within the next T_interval, its current
  kernel included (the pool must hold them before the next decision takes effect);

and the target is max(sum m_c, sum m_next), plus bytes held outside the profiles (shared weights,
communication store: `fixed_bytes`) and a headroom, rounded up to a quantum (2 MiB by default:
device chunks come in such units, and rounding stops 256-byte jitter from resizing the pool).

Timing model (documented because tests pin it): a function's current kernel k has run
`now - kernel_started_at` seconds; it ends after max(0, runtime_k - elapsed) more (a kernel slower
than profiled is taken to end at any moment, so its successor is in the window). Kernel j > k starts
after the rest of k and the full runtimes of k+1..j-1. Kernel j is *in the window* when that start
offset is <= T_interval (inclusive, with a 1 ns tolerance for float sums): a kernel starting exactly
at now + T_interval counts, since the pool must already hold its memory then. Kernels after the last
one of the plan do not exist: a function that will finish inside the window adds nothing after.

Deviation from the paper's listing: its line 2 resets m_next once for all functions, which would
make each function's m_next at least the previous function's; we reset it per function, as the
text intends. The paper's M_resize = pool - target (negative: grow); `ScalingDecision.delta_bytes`
is target - pool (positive: grow).
"""

from __future__ import annotations

import math
from bisect import bisect_right
from collections.abc import Hashable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field

__all__ = [
    "EPSILON_S",
    "FunctionDemand",
    "FunctionPosition",
    "KernelProfile",
    "ModelProfile",
    "ScalingConfig",
    "ScalingDecision",
    "decide_pool_size",
    "function_demands",
    "index_profiles",
]

MiB = 1 << 20

#: Tolerance on the window boundary: sums of float runtimes must not drop a kernel that starts
#: exactly at now + T_interval.
EPSILON_S = 1e-9

ProfileKey = tuple[str, int]


@dataclass(frozen=True)
class KernelProfile:
    """One kernel of a profiled run: bytes live while it runs, and how long it ran offline."""

    live_bytes: int
    runtime_s: float


@dataclass(frozen=True)
class ModelProfile:
    """The profiled kernel sequence of one model at one batch size.

    Precomputes start offsets (prefix sums) and a sparse table of range maxima so that one
    function's window costs O(log n) (a bisect) plus O(1) (the range max), whatever the window.
    """

    model: str
    batch: int
    kernels: tuple[KernelProfile, ...]
    _starts: tuple[float, ...] = field(init=False, repr=False, compare=False)
    _maxima: tuple[tuple[int, ...], ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        kernels = tuple(self.kernels)
        if not kernels:
            raise ValueError(f"profile of {self.model} (batch {self.batch}) has no kernels")
        for i, k in enumerate(kernels):
            if k.live_bytes < 0 or not (k.runtime_s >= 0 and math.isfinite(k.runtime_s)):
                raise ValueError(
                    f"profile of {self.model} (batch {self.batch}), kernel {i}: need live_bytes >= 0 "
                    f"and a finite runtime_s >= 0, got {k}"
                )
        starts = [0.0]
        for k in kernels:
            starts.append(starts[-1] + k.runtime_s)
        level = tuple(k.live_bytes for k in kernels)
        maxima = [level]
        width = 1
        while 2 * width <= len(level):
            prev = maxima[-1]
            maxima.append(tuple(max(prev[i], prev[i + width]) for i in range(len(prev) - width)))
            width *= 2
        object.__setattr__(self, "kernels", kernels)
        object.__setattr__(self, "_starts", tuple(starts))
        object.__setattr__(self, "_maxima", tuple(maxima))

    @classmethod
    def from_pairs(
        cls, model: str, batch: int, pairs: Iterable[tuple[int, float]]
    ) -> ModelProfile:
        """Build from (live_bytes, runtime_s) per kernel, in plan order."""
        return cls(model, batch, tuple(KernelProfile(int(b), float(t)) for b, t in pairs))

    @property
    def key(self) -> ProfileKey:
        return (self.model, self.batch)

    @property
    def peak_bytes(self) -> int:
        """Most bytes live at any kernel."""
        return self.max_live(0, len(self.kernels) - 1)

    @property
    def total_runtime_s(self) -> float:
        return self._starts[-1]

    def start_offset(self, kernel: int) -> float:
        """Seconds from the start of kernel 0 to the start of `kernel` (offline timing)."""
        return self._starts[kernel]

    def max_live(self, first: int, last: int) -> int:
        """Max live bytes over kernels first..last (inclusive), O(1)."""
        if not 0 <= first <= last < len(self.kernels):
            raise IndexError(f"kernel range {first}..{last} outside 0..{len(self.kernels) - 1}")
        level = (last - first + 1).bit_length() - 1
        row = self._maxima[level]
        return max(row[first], row[last - (1 << level) + 1])

    def last_kernel_within(self, kernel: int, elapsed_s: float, horizon_s: float) -> int:
        """Index of the last kernel starting within `horizon_s` from now (see the module timing).

        `kernel` is running and has run `elapsed_s`; the result is >= `kernel`.
        """
        remaining = max(0.0, self.kernels[kernel].runtime_s - max(0.0, elapsed_s))
        starts = self._starts
        limit = starts[kernel + 1] + (horizon_s - remaining) + EPSILON_S
        return bisect_right(starts, limit, kernel + 1, len(self.kernels)) - 1


def index_profiles(profiles: Iterable[ModelProfile]) -> dict[ProfileKey, ModelProfile]:
    """Profiles keyed by (model, batch), as `decide_pool_size` takes them."""
    out: dict[ProfileKey, ModelProfile] = {}
    for p in profiles:
        if p.key in out:
            raise ValueError(f"two profiles for model {p.model!r} at batch {p.batch}")
        out[p.key] = p
    return out


@dataclass(frozen=True)
class FunctionPosition:
    """Where one running function is in its plan: kernel index and when that kernel started.

    `kernel_started_at` is on the same clock as the `now` given to `decide_pool_size`.
    """

    instance: Hashable
    model: str
    batch: int
    kernel: int
    kernel_started_at: float

    @classmethod
    def from_elapsed(
        cls, instance: Hashable, model: str, batch: int, kernel: int, elapsed_s: float, now: float
    ) -> FunctionPosition:
        """Position of a function whose current kernel has run `elapsed_s` at `now`."""
        return cls(instance, model, batch, kernel, now - elapsed_s)

    @property
    def key(self) -> ProfileKey:
        return (self.model, self.batch)


@dataclass(frozen=True)
class ScalingConfig:
    """Knobs of the scaling rule.

    `t_interval_s` is the paper's T_interval = T_alloc + T_free of 200 MB; the shell should measure
    it on its device (the default is a placeholder of the paper's order of magnitude). The pool is
    re-evaluated every T_interval/2 by the shell. `min_shrink_bytes` is a hysteresis: a shrink
    smaller than this is skipped (the target stays at the current pool size).
    """

    t_interval_s: float = 0.02
    quantum_bytes: int = 2 * MiB
    headroom_bytes: int = 0
    min_pool_bytes: int = 0
    min_shrink_bytes: int = 0

    def __post_init__(self) -> None:
        if not (self.t_interval_s >= 0 and math.isfinite(self.t_interval_s)):
            raise ValueError(f"t_interval_s must be finite and >= 0, got {self.t_interval_s}")
        if self.quantum_bytes < 1:
            raise ValueError(f"quantum_bytes must be >= 1, got {self.quantum_bytes}")
        for name in ("headroom_bytes", "min_pool_bytes", "min_shrink_bytes"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")


@dataclass(frozen=True)
class FunctionDemand:
    """One function's share of a decision: m_c, m_next and the kernels its window spans."""

    instance: Hashable
    model: str
    batch: int
    kernel: int
    last_kernel_in_window: int
    current_bytes: int
    next_bytes: int


@dataclass(frozen=True)
class ScalingDecision:
    """The pool size to aim for, and why.

    `delta_bytes` = target - pool: positive grows, negative shrinks (the paper's M_resize with the
    opposite sign).
    """

    target_bytes: int
    delta_bytes: int
    pool_bytes: int
    current_demand: int
    next_demand: int
    fixed_bytes: int
    functions: tuple[FunctionDemand, ...]

    @property
    def grow(self) -> bool:
        return self.delta_bytes > 0

    @property
    def shrink(self) -> bool:
        return self.delta_bytes < 0


def function_demands(
    now: float,
    positions: Sequence[FunctionPosition],
    profiles: Mapping[ProfileKey, ModelProfile],
    horizon_s: float,
) -> tuple[FunctionDemand, ...]:
    """Each running function's m_c and m_next over [now, now + horizon_s] (the module's timing).

    The demand model shared by Algorithm 1 (`decide_pool_size`) and the communication store's idle
    memory (`memory_pool.idle`). Raises KeyError for a position without a profile.
    """
    demands = []
    for pos in positions:
        profile = profiles.get(pos.key)
        if profile is None:
            known = sorted(f"{m}@{b}" for m, b in profiles)
            raise KeyError(
                f"no profile for model {pos.model!r} at batch {pos.batch} (instance {pos.instance!r});"
                f" profiled: {known}"
            )
        n = len(profile.kernels)
        if not 0 <= pos.kernel < n:
            raise ValueError(
                f"instance {pos.instance!r} is at kernel {pos.kernel}, but {pos.model} "
                f"(batch {pos.batch}) has kernels 0..{n - 1}"
            )
        last = profile.last_kernel_within(pos.kernel, now - pos.kernel_started_at, horizon_s)
        m_c = profile.kernels[pos.kernel].live_bytes
        m_next = profile.max_live(pos.kernel, last)
        demands.append(FunctionDemand(pos.instance, pos.model, pos.batch, pos.kernel, last, m_c, m_next))
    return tuple(demands)


def decide_pool_size(
    now: float,
    positions: Sequence[FunctionPosition],
    profiles: Mapping[ProfileKey, ModelProfile],
    pool_bytes: int,
    config: ScalingConfig | None = None,
    fixed_bytes: int = 0,
) -> ScalingDecision:
    """Algorithm 1, one iteration: the target pool size for the coming interval.

    target = roundup(max(M_c, M_next) + fixed_bytes + headroom, quantum), at least min_pool_bytes,
    held at `pool_bytes` when it would shrink by less than min_shrink_bytes.
    """
    cfg = config or ScalingConfig()
    if pool_bytes < 0 or fixed_bytes < 0:
        raise ValueError(f"pool_bytes and fixed_bytes must be >= 0, got {pool_bytes}, {fixed_bytes}")
    demands = function_demands(now, positions, profiles, cfg.t_interval_s)
    m_c_sum = sum(d.current_bytes for d in demands)
    m_next_sum = sum(d.next_bytes for d in demands)
    raw = max(m_c_sum, m_next_sum) + fixed_bytes + cfg.headroom_bytes
    q = cfg.quantum_bytes
    target = max(-(-raw // q) * q, cfg.min_pool_bytes)
    if target < pool_bytes and pool_bytes - target < cfg.min_shrink_bytes:
        target = pool_bytes
    return ScalingDecision(
        target_bytes=target,
        delta_bytes=target - pool_bytes,
        pool_bytes=pool_bytes,
        current_demand=m_c_sum,
        next_demand=m_next_sum,
        fixed_bytes=fixed_bytes,
        functions=demands,
    )
