"""Keep-alive and warm limits: pure policies (no threads, no clocks, no processes).

- `InstancePool`: the instances of one function in a proxy. A request takes the most recently used
  idle instance (so that surplus instances stay idle and expire: scale down, and to zero), else
  starts a new one while fewer than `max_instances` exist, else queues. Idle instances expire after
  `keep_alive_s` (default 10 minutes, the paper's section 8).
- `WarmProxies`: the warm proxies (GPU runtimes) of a machine, placed on the GPU with the least
  memory in use (ties: fewer proxies, then lowest index). At most `max_per_device` per GPU
  (3, section 8); admitting one more on a full GPU evicts that GPU's longest-idle proxy; a proxy
  with requests in flight is never evicted (the caller waits instead). Idle proxies expire after
  `keep_alive_s`.

Both can be pinned: a replay deploys several workflows before its clock starts, and a deploy takes
seconds, longer than a time-compressed keep-alive; pinned, nothing expires until the warm-up ends.

Every method takes `now` (seconds, any monotonic origin) and returns decisions; the shells (the proxy
for instances, `ProxyInvoker` for proxies) carry them out.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Literal

DEFAULT_KEEP_ALIVE_S = 600.0
DEFAULT_MAX_PROXIES_PER_DEVICE = 3


def _expired(idle: Iterable[tuple[float, Hashable]], now: float, keep_alive_s: float) -> list[Hashable]:
    """Of idle things as (last used, key): the keys whose keep-alive has run out, oldest first."""
    due = [(t, k) for t, k in idle if now - t >= keep_alive_s]
    return [k for _, k in sorted(due, key=lambda item: item[0])]


@dataclass(frozen=True)
class Acquire:
    """What to do with one request: use a warm instance, start a new one, or queue."""

    action: Literal["warm", "start", "queue"]
    instance: Hashable | None = None


@dataclass
class _Inst:
    busy: bool
    last_used: float


class InstancePool:
    """The instances of one function (see the module doc)."""

    def __init__(self, max_instances: int, keep_alive_s: float = DEFAULT_KEEP_ALIVE_S) -> None:
        if max_instances < 1:
            raise ValueError(f"max_instances must be >= 1, got {max_instances}")
        if keep_alive_s < 0:
            raise ValueError(f"keep_alive_s must be >= 0, got {keep_alive_s}")
        self.max_instances = max_instances
        self.keep_alive_s = keep_alive_s
        self.pinned = False  # while pinned, no instance expires (a deployment's warm-up)
        self._instances: dict[Hashable, _Inst] = {}

    def __len__(self) -> int:
        return len(self._instances)

    @property
    def idle(self) -> list[Hashable]:
        return [i for i, s in self._instances.items() if not s.busy]

    @property
    def busy(self) -> list[Hashable]:
        return [i for i, s in self._instances.items() if s.busy]

    def acquire(self, now: float) -> Acquire:
        """Decide for one request; a `warm` answer marks that instance busy."""
        idle = [(s.last_used, i) for i, s in self._instances.items() if not s.busy]
        if idle:
            _, chosen = max(idle, key=lambda t: t[0])
            self._instances[chosen].busy = True
            self._instances[chosen].last_used = now
            return Acquire("warm", chosen)
        if len(self._instances) < self.max_instances:
            return Acquire("start")
        return Acquire("queue")

    def add(self, instance: Hashable, now: float, *, busy: bool = True) -> None:
        """A new instance (starting counts as busy: it serves the request that started it)."""
        if instance in self._instances:
            raise KeyError(f"instance {instance!r} is already in the pool")
        if len(self._instances) >= self.max_instances:
            raise RuntimeError(f"pool is full ({self.max_instances} instances)")
        self._instances[instance] = _Inst(busy, now)

    def release(self, instance: Hashable, now: float) -> None:
        """The instance finished its request and is idle from `now`."""
        state = self._instances[instance]
        state.busy = False
        state.last_used = now

    def reuse(self, instance: Hashable, now: float) -> None:
        """A busy instance goes straight on to a queued request."""
        state = self._instances[instance]
        state.busy = True
        state.last_used = now

    def remove(self, instance: Hashable) -> None:
        self._instances.pop(instance, None)

    def pin(self) -> None:
        """No instance expires until `unpin`: a deployment's warm-up is not idle time."""
        self.pinned = True

    def unpin(self, now: float) -> None:
        """Instances expire again; the idle ones count as used at `now` (their keep-alive starts)."""
        self.pinned = False
        for state in self._instances.values():
            if not state.busy:
                state.last_used = max(state.last_used, now)

    def expired(self, now: float) -> list[Hashable]:
        """Idle instances whose keep-alive has run out (oldest first); the caller stops and removes them."""
        if self.pinned:
            return []
        idle = ((s.last_used, i) for i, s in self._instances.items() if not s.busy)
        return _expired(idle, now, self.keep_alive_s)

    def next_expiry(self) -> float | None:
        """When the next idle instance expires (None: no idle instance, or pinned)."""
        if self.pinned:
            return None
        times = [s.last_used + self.keep_alive_s for s in self._instances.values() if not s.busy]
        return min(times) if times else None


@dataclass(frozen=True)
class Admission:
    """Whether a proxy may be (or stay) warm: which proxies to evict first, or wait."""

    device: int
    evict: tuple[Hashable, ...] = ()
    wait: bool = False


@dataclass
class _Proxy:
    device: int
    last_used: float
    inflight: int = 0
    pinned: bool = False


@dataclass
class WarmProxies:
    """The warm proxies of a machine (see the module doc)."""

    devices: int = 1
    max_per_device: int = DEFAULT_MAX_PROXIES_PER_DEVICE
    keep_alive_s: float = DEFAULT_KEEP_ALIVE_S
    _proxies: dict[Hashable, _Proxy] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.devices < 1 or self.max_per_device < 1:
            raise ValueError("devices and max_per_device must be >= 1")

    def warm(self, device: int | None = None) -> list[Hashable]:
        return [k for k, p in self._proxies.items() if device is None or p.device == device]

    def device_of(self, key: Hashable) -> int:
        return self._proxies[key].device

    def admit(self, key: Hashable, now: float, loads: Sequence[int] | None = None) -> Admission:
        """Where `key`'s proxy runs, and what must go first. A warm proxy is admitted as is.

        Placement: a new proxy goes to the device with the least memory in use (`loads`, bytes per
        device: every process's, as the node reports it), ties to the fewer warm proxies, then the
        lowest index, among devices with room for one more proxy; without `loads`, to the device
        with the fewest warm proxies (lowest index on ties). When every device is full, the device
        with the fewest warm proxies evicts its longest-idle proxy without requests in flight; if
        every one is busy, wait.
        """
        if key in self._proxies:
            return Admission(self._proxies[key].device)
        counts = [0] * self.devices
        for p in self._proxies.values():
            counts[p.device] += 1
        if loads is not None and len(loads) != self.devices:
            raise ValueError(f"loads for {len(loads)} devices, but the node has {self.devices}")
        room = [d for d in range(self.devices) if counts[d] < self.max_per_device]
        if loads is not None and room:
            return Admission(min(room, key=lambda d: (loads[d], counts[d], d)))
        device = min(range(self.devices), key=lambda d: (counts[d], d))
        if counts[device] < self.max_per_device:
            return Admission(device)
        idle = [(p.last_used, k) for k, p in self._proxies.items() if p.device == device and p.inflight == 0]
        if not idle:
            return Admission(device, wait=True)
        _, victim = min(idle, key=lambda t: t[0])
        return Admission(device, evict=(victim,))

    def started(self, key: Hashable, device: int, now: float) -> None:
        if sum(p.device == device for p in self._proxies.values()) >= self.max_per_device:
            raise RuntimeError(f"device {device} already has {self.max_per_device} warm proxies")
        self._proxies[key] = _Proxy(device, now)

    def begin(self, key: Hashable, now: float) -> None:
        p = self._proxies[key]
        p.inflight += 1
        p.last_used = now

    def end(self, key: Hashable, now: float) -> None:
        p = self._proxies[key]
        p.inflight = max(0, p.inflight - 1)
        p.last_used = now

    def remove(self, key: Hashable) -> None:
        self._proxies.pop(key, None)

    def pin(self, key: Hashable) -> None:
        """`key`'s proxy, if warm, does not expire until `unpin` (it may still be evicted for room)."""
        if key in self._proxies:
            self._proxies[key].pinned = True

    def unpin(self, key: Hashable, now: float) -> None:
        """`key`'s proxy expires again, its keep-alive counted from `now`."""
        p = self._proxies.get(key)
        if p is not None and p.pinned:
            p.pinned = False
            p.last_used = max(p.last_used, now)

    def expired(self, now: float) -> list[Hashable]:
        """Idle proxies past their keep-alive, oldest first (pinned ones never)."""
        idle = ((p.last_used, k) for k, p in self._proxies.items() if p.inflight == 0 and not p.pinned)
        return _expired(idle, now, self.keep_alive_s)
