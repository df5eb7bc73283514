"""Keep-alive and warm limits: pure policies (no threads, no clocks, no processes).

- `InstancePool`: the instances of one function in a proxy. A request takes the most recently used
  idle instance (so that surplus instances stay idle and expire: scale down, and to zero), else
  starts a new one while fewer than `max_instances` exist, else queues. Idle instances expire after
  `keep_alive_s` (default 10 minutes, the paper's section 8).
- `WarmProxies`: the warm proxies (GPU runtimes) of a machine, admitted by memory: a new proxy
  goes to the GPU with the most memory free where its predicted footprint fits (ties: fewer
  proxies, then lowest index). Where none fits, that GPU's idle proxies are evicted, longest-idle
  first, until it does; a proxy with requests in flight is never evicted (the caller waits
  instead). The paper's "each GPU can handle up to 3 concurrent inference workflows" (section 8)
  is a consequence of its 16 GB and its proxies' size, not a rule: an optional count cap
  (`max_per_device`; `PAPER_PROXIES_PER_DEVICE` reproduces the paper's) applies on top. Idle
  proxies expire after `keep_alive_s`. No workflow starves behind busy ones: once a workflow has
  waited `yield_after_s` for room on a GPU, every proxy there that has been warm that long `yields`,
  i.e. takes no new requests (those it has finish) until the waiter is admitted; a proxy's turn
  counts from its start.

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
#: How long a workflow waits for room on a GPU before the proxies there take no new requests: long
#: against a proxy's start (seconds), so that busy workflows sharing too small a GPU take turns of
#: several requests each rather than paying a start per request.
DEFAULT_YIELD_AFTER_S = 5.0
#: A waiter that has not asked again for this long gave up (its request ended): it is forgotten.
WAITER_TTL_S = 0.5
#: A proxy that has just started is not evicted before the request that started it has begun on it,
#: or for this long if that request gave up meanwhile.
START_GRACE_S = 1.0
#: The paper's warm GPU runtimes per GPU (section 8), as an optional cap: `WarmProxies(max_per_device=...)`.
PAPER_PROXIES_PER_DEVICE = 3


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
    """Whether a proxy may be (or stay) warm: which proxies to evict first, or wait.

    `fits` is False when the proxy is admitted although its predicted footprint exceeds what the
    device has free with nothing left to evict or wait for (an empty GPU): it starts, and may fail
    with the device's out-of-memory error, rather than wait for ever."""

    device: int
    evict: tuple[Hashable, ...] = ()
    wait: bool = False
    fits: bool = True


@dataclass
class _Proxy:
    device: int
    last_used: float
    footprint: int = 0  # predicted device bytes (the caller's estimate)
    ready: bool = False  # its memory shows in what the device reports (until then: `footprint`)
    inflight: int = 0
    pinned: bool = False
    turn_since: float = 0.0  # when its turn on the GPU began (its start)
    served: bool = False  # a request has begun on it (not only its start's reservation)


@dataclass
class _Waiter:
    device: int
    since: float  # first told to wait
    asked: float  # last told to wait (a waiter that stops asking is gone)


@dataclass
class WarmProxies:
    """The warm proxies of a machine (see the module doc)."""

    devices: int = 1
    max_per_device: int | None = None
    keep_alive_s: float = DEFAULT_KEEP_ALIVE_S
    yield_after_s: float = DEFAULT_YIELD_AFTER_S
    _proxies: dict[Hashable, _Proxy] = field(default_factory=dict)
    _waiting: dict[Hashable, _Waiter] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.devices < 1 or (self.max_per_device is not None and self.max_per_device < 1):
            raise ValueError("devices and max_per_device must be >= 1")
        if self.yield_after_s < 0:
            raise ValueError(f"yield_after_s must be >= 0, got {self.yield_after_s}")

    def warm(self, device: int | None = None) -> list[Hashable]:
        return [k for k, p in self._proxies.items() if device is None or p.device == device]

    def device_of(self, key: Hashable) -> int:
        return self._proxies[key].device

    def admit(
        self, key: Hashable, now: float, free: Sequence[int] | None = None, footprint: int = 0
    ) -> Admission:
        """Where `key`'s proxy runs, and what must go first. A warm proxy is admitted as is.

        `free`: device bytes free per GPU as the node reports them (every process's use), less the
        predicted `footprint` of proxies admitted but not yet `ready`; None: memory unknown, only the
        count cap applies. A new proxy goes to a device where its `footprint` fits and the count cap
        (if any) has room: the one with the most memory free, ties to fewer warm proxies, then the
        lowest index. Where none has room, the device with the most memory free evicts its idle
        proxies, longest-idle first, until the footprint fits; if evicting every idle one is not
        enough, wait for a busy one to finish; a device with no proxy at all admits it (`fits`
        False).
        """
        if key in self._proxies:
            return Admission(self._proxies[key].device)
        if free is not None and len(free) != self.devices:
            raise ValueError(f"free memory for {len(free)} devices, but the node has {self.devices}")
        counts = [0] * self.devices
        for p in self._proxies.values():
            counts[p.device] += 1
        left = list(free) if free is not None else [0] * self.devices
        for p in self._proxies.values():
            if not p.ready:
                left[p.device] -= p.footprint
        need = footprint if free is not None else 0
        cap = self.max_per_device

        def has_room(device: int, evicted: int = 0, freed: int = 0) -> bool:
            count_ok = cap is None or counts[device] - evicted < cap
            return count_ok and left[device] + freed >= need

        order = sorted(range(self.devices), key=lambda d: (-left[d], counts[d], d))
        for device in order:
            if has_room(device):
                return Admission(device)
        device = order[0] if free is not None else min(range(self.devices), key=lambda d: (counts[d], d))
        idle = sorted(
            (p.last_used, k)
            for k, p in self._proxies.items()
            if p.device == device and p.inflight == 0 and (p.served or now - p.last_used >= START_GRACE_S)
        )
        victims: list[Hashable] = []
        freed = 0
        for _, victim in idle:
            victims.append(victim)
            freed += self._proxies[victim].footprint
            if has_room(device, len(victims), freed):
                return Admission(device, evict=tuple(victims))
        if counts[device] > len(victims):  # busy proxies hold the rest: one of them will finish
            self._note_waiting(key, device, now)
            return Admission(device, wait=True)
        return Admission(device, evict=tuple(victims), fits=False)

    def _note_waiting(self, key: Hashable, device: int, now: float) -> None:
        waiter = self._waiting.get(key)
        if waiter is None or now - waiter.asked > WAITER_TTL_S or waiter.device != device:
            self._waiting[key] = _Waiter(device, now, now)
        else:
            waiter.asked = now

    def yields(self, key: Hashable, now: float) -> bool:
        """Whether `key`'s warm proxy should take no new request now: a workflow still asking has
        waited `yield_after_s` for room on its GPU, and this proxy's turn has lasted as long."""
        p = self._proxies.get(key)
        if p is None or now - p.turn_since < self.yield_after_s:
            return False
        return any(
            w.device == p.device and now - w.since >= self.yield_after_s and now - w.asked <= WAITER_TTL_S
            for k, w in self._waiting.items()
            if k != key
        )

    def started(self, key: Hashable, device: int, now: float, footprint: int = 0) -> None:
        """`key`'s proxy holds its place on `device` from now (starting, not yet `ready`); its turn
        begins, and it waits no more."""
        count = sum(p.device == device for p in self._proxies.values())
        if self.max_per_device is not None and count >= self.max_per_device:
            raise RuntimeError(f"device {device} already has {self.max_per_device} warm proxies")
        self._proxies[key] = _Proxy(device, now, footprint, turn_since=now)
        self._waiting.pop(key, None)

    def ready(self, key: Hashable) -> None:
        """`key`'s proxy has started: its memory now shows in what the device reports free."""
        if key in self._proxies:
            self._proxies[key].ready = True

    def begin(self, key: Hashable, now: float, reservation: bool = False) -> None:
        """A request (or, `reservation`, the proxy's own start) holds `key`'s proxy busy until `end`."""
        p = self._proxies[key]
        p.served = p.served or not reservation
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
