"""Cross-process state of one emulated GPU: memory and streams per runtime, its link and its SMs.

A real GPU is shared by every process of the machine. The emulated one keeps a small ledger file per
device under a state directory, mmap'ed and guarded by `fcntl.flock` (between processes) and a lock
(between threads):

- fixed slots, one per runtime (pid, process start time, runtime id, used bytes, streams). Every
  capacity check sums all live slots under the lock. A slot whose process has died (exit, `os._exit`,
  SIGKILL) is reclaimed by whoever next takes the lock; a slot is released on `close` and, for
  runtimes still open, at interpreter exit;
- the PCIe link: per direction (host-to-device, device-to-host) the copies in flight on it, which
  share its bandwidth by processor sharing in modelled time (`link_share.py`), whichever runtime of
  whichever process issued them;
- the compute units: busy intervals of each context's kernels (timed mode), so that kernels of other
  contexts time-slice with them (or, under MPS, run beside them); see `gpu_schedule.py`. A counter
  in the header moves with every change to them, so a process re-reads them only when one happened
  since it last looked (placing a kernel is then one lock, a counter read and one record written).

Times are `time.perf_counter()` seconds: CLOCK_MONOTONIC, the same in every process of the machine.

The state directory is checked before use (`ensure_state_dir`): a real directory (not a link), owned
by this user, mode 0700 (tightened if it is ours and looser); ledger files are opened without
following links. Another user cannot plant a directory or link at the predictable default path.
"""

from __future__ import annotations

import atexit
import contextlib
import fcntl
import hashlib
import mmap
import os
import stat
import struct
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from .base import DeviceError, OutOfDeviceMemory
from .gpu_schedule import Placed
from .link_share import Flow, advance, finish_times
from .procfs import stat_fields

_MAGIC = b"SBXLEDG1"
_VERSION = 4
_HEADER = struct.Struct("<8sIIQ40x")  # magic, version, slot count, total memory -> 64 bytes
_HIGH_WATER = struct.Struct("<Q")  # at offset 24: slots ever used (scans stop there)
_HIGH_WATER_OFFSET = 24
_BUSY_HIGH_OFFSET = 48  # a Q: busy-interval records ever used
_BUSY_GENERATION = struct.Struct("<Q")  # at offset 32: bumped by every write to the busy records
_BUSY_GENERATION_OFFSET = 32
_SLOT = struct.Struct("<qqqqqq")  # pid, start time, runtime id, used bytes, streams, reserved -> 48 bytes
_BUSY = struct.Struct("<ddqq")  # start, end, slot + 1, MPS client (1) or not (0) -> 32 bytes
_FLOW_HEAD = struct.Struct("<dq")  # per link direction: time of the state, last flow id -> 16 bytes
_FLOW = struct.Struct("<qdqd")  # flow id (0: free), link seconds left, owner pid, end (0: active)
DEFAULT_SLOTS = 512
BUSY_RECORDS = 1024
FLOWS = 128  # copies in flight per link direction, all processes together
LIVENESS_TTL_S = 0.5  # how long a link flow's owner, once seen alive, is taken to be alive
LINK_DIRECTIONS = ("h2d", "d2h")
_FLOW_REGION = _FLOW_HEAD.size + FLOWS * _FLOW.size


def default_state_dir() -> Path:
    """`$STREAMBOX_STATE_DIR`, else `$XDG_RUNTIME_DIR/streambox`, else `/tmp/streambox-<uid>`."""
    if env := os.environ.get("STREAMBOX_STATE_DIR"):
        return Path(env)
    if xdg := os.environ.get("XDG_RUNTIME_DIR"):
        return Path(xdg) / "streambox"
    return Path(f"/tmp/streambox-{os.getuid()}")


def ensure_state_dir(path: Path) -> Path:
    """Create `path` (0700) or check it: a directory, not a link, owned by this user; a directory of
    ours that others may read or write is tightened to 0700. Raises `DeviceError` naming the problem."""
    path = Path(path)
    with contextlib.suppress(FileExistsError):
        path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        path.mkdir(mode=0o700)
    info = os.lstat(path)
    problem = None
    if stat.S_ISLNK(info.st_mode):
        problem = "is a symbolic link"
    elif not stat.S_ISDIR(info.st_mode):
        problem = "is not a directory"
    elif info.st_uid != os.getuid():
        problem = f"is owned by uid {info.st_uid}, not by this user (uid {os.getuid()})"
    if problem is not None:
        raise DeviceError(
            f"the emulated devices' state directory {path} {problem}; remove it or point "
            "STREAMBOX_STATE_DIR at a directory of your own"
        )
    if stat.S_IMODE(info.st_mode) != 0o700:
        os.chmod(path, 0o700)
    return path


def ledger_path(state_dir: Path, index: int, name: str, total_memory: int) -> Path:
    """One file per emulated GPU: same index, same device name and same capacity = the same GPU."""
    digest = hashlib.sha1(f"{name}|{total_memory}|v{_VERSION}".encode()).hexdigest()[:12]
    return Path(state_dir) / f"emulated-gpu{index}-{digest}.ledger"


def _process_start_time(pid: int) -> int | None:
    """Field 22 of /proc/<pid>/stat (clock ticks since boot), None if unknown; -1 for a zombie."""
    fields = stat_fields(pid)
    if fields is None:
        return None
    if fields and fields[0] in (b"Z", b"X"):
        return -1
    try:
        return int(fields[19])
    except (IndexError, ValueError):
        return None


def process_alive(pid: int, start_time: int = 0) -> bool:
    """Whether `pid` runs and is the process that wrote the slot (guards against pid reuse)."""
    if pid <= 0:
        return False
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    now = _process_start_time(pid)
    if now == -1:  # zombie: dead, merely not reaped yet
        return False
    return not (start_time and now is not None and now != start_time)


@dataclass(frozen=True)
class LedgerUsage:
    used_memory: int
    total_memory: int
    streams: int
    runtimes: int


class Ledger:
    """The accounting of one emulated GPU, shared by every process that opens it.

    Obtain through `Ledger.open` (one object per file and process, so that the thread lock and the
    file lock compose). All methods are thread-safe.
    """

    _instances: dict[Path, Ledger] = {}
    _instances_lock = threading.Lock()

    def __init__(self, path: Path, total_memory: int, slots: int = DEFAULT_SLOTS) -> None:
        self.path = path
        self.total_memory = total_memory
        self.slots = slots
        self._lock = threading.RLock()
        self._depth = 0  # nesting of _locked in the thread holding _lock
        self._device_lock = _DeviceLock(self)
        self._owned: dict[int, int] = {}  # slot -> runtime id, slots this process holds
        self._last_busy: dict[int, int] = {}  # slot -> index of its latest busy record (a hint)
        # (slot, mps) -> (busy generation, intervals of other contexts that block it): re-read only
        # when the generation moved under another writer.
        self._blocking: dict[tuple[int, bool], tuple[int, list[tuple[float, float]]]] = {}
        self._seen_alive: dict[int, float] = {}  # pid -> when a link flow's owner was last seen alive
        ensure_state_dir(path.parent)
        try:
            self._fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        except OSError as exc:
            why = f"{exc.strerror} (links are not followed)"
            raise DeviceError(f"cannot open the ledger {path}: {why}") from None
        size = _HEADER.size + slots * _SLOT.size + BUSY_RECORDS * _BUSY.size + 2 * _FLOW_REGION
        fcntl.flock(self._fd, fcntl.LOCK_EX)
        try:
            current = os.fstat(self._fd).st_size
            if current == 0:
                os.ftruncate(self._fd, size)
                os.pwrite(self._fd, _HEADER.pack(_MAGIC, _VERSION, slots, total_memory), 0)
            else:
                magic, version, nslots, total = _HEADER.unpack(os.pread(self._fd, _HEADER.size, 0))
                if magic != _MAGIC or version != _VERSION or total != total_memory:
                    raise DeviceError(
                        f"ledger {path} does not describe this device "
                        f"(magic {magic!r}, version {version}, total {total}); remove it or use "
                        "another state dir"
                    )
                self.slots = nslots
                size = _HEADER.size + nslots * _SLOT.size + BUSY_RECORDS * _BUSY.size + 2 * _FLOW_REGION
                if current < size:  # cut short (a full disk, a copy): mmap's own error named nothing
                    raise DeviceError(
                        f"ledger {path} holds {current} bytes, its {nslots} slots need {size}: it was cut "
                        "short; remove it (no process may be using this state dir) or use another state dir"
                    )
            self._map = mmap.mmap(self._fd, size)
        finally:
            fcntl.flock(self._fd, fcntl.LOCK_UN)

    @classmethod
    def open(cls, path: Path, total_memory: int) -> Ledger:
        path = Path(path)
        ensure_state_dir(path.parent)  # before resolving: a planted link must not be followed
        path = path.parent.resolve() / path.name  # the file itself is opened with O_NOFOLLOW
        with cls._instances_lock:
            ledger = cls._instances.get(path)
            if ledger is None:
                ledger = cls._instances[path] = cls(path, total_memory)
            elif ledger.total_memory != total_memory:
                raise DeviceError(f"ledger {path} is open with capacity {ledger.total_memory}")
            return ledger

    # -- locking and slots ------------------------------------------------------------------
    def _locked(self) -> _DeviceLock:
        """The device lock: this process's threads (a re-entrant lock), then other processes (flock,
        taken by the outermost holder only)."""
        return self._device_lock

    def _read(self, slot: int) -> tuple[int, int, int, int, int, int]:
        return _SLOT.unpack_from(self._map, _HEADER.size + slot * _SLOT.size)

    def _write(self, slot: int, pid: int, start: int, rid: int, used: int, streams: int) -> None:
        _SLOT.pack_into(self._map, _HEADER.size + slot * _SLOT.size, pid, start, rid, used, streams, 0)

    def _clear(self, slot: int) -> None:
        self._write(slot, 0, 0, 0, 0, 0)

    def _scan(self) -> LedgerUsage:
        """Reclaim dead slots and sum the live ones. Caller holds the lock."""
        used = streams = runtimes = 0
        me = os.getpid()
        high = min(self.slots, _HIGH_WATER.unpack_from(self._map, _HIGH_WATER_OFFSET)[0])
        region = memoryview(self._map)[_HEADER.size : _HEADER.size + high * _SLOT.size]
        try:
            rows = list(_SLOT.iter_unpack(region))
        finally:
            region.release()
        for slot, (pid, start, rid, nbytes, nstreams, _) in enumerate(rows):
            if pid == 0:
                continue
            if pid == me:
                if self._owned.get(slot) != rid:  # left by a forked parent or a previous life
                    self._clear(slot)
                    continue
            elif not process_alive(pid, start):
                self._clear(slot)
                continue
            used += nbytes
            streams += nstreams
            runtimes += 1
        return LedgerUsage(used, self.total_memory, streams, runtimes)

    def _check_owned(self, slot: int, runtime_id: int) -> None:
        if self._owned.get(slot) != runtime_id:
            raise DeviceError(f"ledger slot {slot} is not held by runtime {runtime_id}")

    # -- public API -------------------------------------------------------------------------
    def usage(self) -> LedgerUsage:
        with self._locked():
            return self._scan()

    def acquire_slot(self, runtime_id: int, initial_bytes: int) -> int:
        """Register a runtime holding `initial_bytes` (its context); returns its slot."""
        with self._locked():
            usage = self._scan()
            free = self.total_memory - usage.used_memory
            if initial_bytes > free:
                raise OutOfDeviceMemory(initial_bytes, free, self.total_memory)
            for slot in range(self.slots):
                if self._read(slot)[0] == 0:
                    high = _HIGH_WATER.unpack_from(self._map, _HIGH_WATER_OFFSET)[0]
                    if slot >= high:
                        _HIGH_WATER.pack_into(self._map, _HIGH_WATER_OFFSET, slot + 1)
                    pid = os.getpid()
                    self._write(slot, pid, _process_start_time(pid) or 0, runtime_id, initial_bytes, 0)
                    self._owned[slot] = runtime_id
                    _track(self)
                    return slot
            raise DeviceError(f"ledger {self.path}: all {self.slots} runtime slots are in use")

    def reserve(self, slot: int, runtime_id: int, nbytes: int) -> None:
        """Add `nbytes` to the slot if the device has room, else raise `OutOfDeviceMemory`."""
        with self._locked():
            self._check_owned(slot, runtime_id)
            usage = self._scan()
            free = self.total_memory - usage.used_memory
            if nbytes > free:
                raise OutOfDeviceMemory(nbytes, free, self.total_memory)
            pid, start, rid, used, streams, _ = self._read(slot)
            self._write(slot, pid, start, rid, used + nbytes, streams)

    def release(self, slot: int, runtime_id: int, nbytes: int) -> None:
        with self._locked():
            self._check_owned(slot, runtime_id)
            pid, start, rid, used, streams, _ = self._read(slot)
            if nbytes > used:
                raise DeviceError(f"ledger slot {slot}: releasing {nbytes} bytes but only {used} held")
            self._write(slot, pid, start, rid, used - nbytes, streams)

    def add_streams(self, slot: int, runtime_id: int, delta: int) -> None:
        with self._locked():
            self._check_owned(slot, runtime_id)
            pid, start, rid, used, streams, _ = self._read(slot)
            self._write(slot, pid, start, rid, used, max(0, streams + delta))

    def slot_usage(self, slot: int, runtime_id: int) -> tuple[int, int]:
        """(used bytes, streams) recorded in one of this process's slots."""
        with self._locked():
            self._check_owned(slot, runtime_id)
            _, _, _, used, streams, _ = self._read(slot)
            return used, streams

    def release_slot(self, slot: int, runtime_id: int) -> None:
        """Forget a runtime entirely (its bytes and streams). Idempotent."""
        with self._locked():
            if self._owned.get(slot) != runtime_id:
                return
            del self._owned[slot]
            if self._read(slot)[2] == runtime_id:
                self._clear(slot)

    # -- the link and the compute units ------------------------------------------------------
    def _flow_base(self, direction: str) -> int:
        return self._busy_base() + BUSY_RECORDS * _BUSY.size + LINK_DIRECTIONS.index(direction) * _FLOW_REGION

    def _load_flows(self, direction: str) -> tuple[float, int, list[Flow], dict[int, tuple[int, float]]]:
        """(state time, last flow id, active flows, finished flows: id -> (owner, end))."""
        base = self._flow_base(direction)
        since, last_id = _FLOW_HEAD.unpack_from(self._map, base)
        active, finished = [], {}
        rows = _FLOW.iter_unpack(self._map[base + _FLOW_HEAD.size : base + _FLOW_REGION])
        for fid, left, owner, end in rows:
            if fid == 0:
                break  # `_store_flows` packs the rows: the first free one ends them
            if not self._flow_owner_alive(owner):
                continue  # its process died waiting: it moves nothing any more
            if end:
                finished[fid] = (owner, end)
            else:
                active.append(Flow(fid, left, owner))
        return since, last_id, active, finished

    def _flow_owner_alive(self, pid: int) -> bool:
        """`process_alive`, remembered for `LIVENESS_TTL_S`: a join or poll of the link reads every flow
        in flight, and checking a foreign process (a signal and a read of /proc) costs ~15 us, once
        per flow and call without this; a process that dies keeps its flows at most that much longer."""
        now = time.monotonic()
        seen = self._seen_alive.get(pid)
        if seen is not None and now - seen < LIVENESS_TTL_S:
            return True
        if not process_alive(pid):
            self._seen_alive.pop(pid, None)
            return False
        self._seen_alive[pid] = now
        return True

    def _store_flows(
        self,
        direction: str,
        since: float,
        last_id: int,
        active: list[Flow],
        finished: dict[int, tuple[int, float]],
    ) -> None:
        rows = [(f.flow_id, f.left, f.owner, 0.0) for f in active]
        rows += [(fid, 0.0, owner, end) for fid, (owner, end) in finished.items()]
        if len(rows) > FLOWS:
            raise DeviceError(f"ledger {self.path}: more than {FLOWS} copies in flight on one link direction")
        base = self._flow_base(direction)
        _FLOW_HEAD.pack_into(self._map, base, since, last_id)
        for i, row in enumerate(rows):
            _FLOW.pack_into(self._map, base + _FLOW_HEAD.size + i * _FLOW.size, *row)
        self._map[base + _FLOW_HEAD.size + len(rows) * _FLOW.size : base + _FLOW_REGION] = bytes(
            (FLOWS - len(rows)) * _FLOW.size
        )

    def link_join(self, direction: str, ready: float, cost: float) -> tuple[int, float, float]:
        """A copy of `cost` link seconds enters the link in `direction` at `ready` (or when the
        link's state is, if later). Returns (flow id, start, end if no other copy arrives)."""
        with self._locked():
            since, last_id, active, finished = self._load_flows(direction)
            start = max(ready, since)
            owners = {f.flow_id: f.owner for f in active}
            active, ends = advance(active, since, start)
            finished.update((fid, (owners[fid], end)) for fid, end in ends.items())
            last_id += 1
            active.append(Flow(last_id, cost, os.getpid()))
            self._store_flows(direction, start, last_id, active, finished)
            return last_id, start, finish_times(active, start)[last_id]

    def link_place_alone(
        self, direction: str, ready: float, cost: float, latest: float
    ) -> tuple[float, float] | None:
        """A short copy placed whole at issue: if no copy is in flight on the link when it enters (at
        `ready`, or when the link's state is, if later) and that is not after `latest`, it holds the
        link to its end and (start, end) is returned; else None and nothing changes (the caller joins
        as a flow). A copy arriving before that end starts at it (`link_join`): only the short copy
        is spared the sharing, see `copy_engine.SHORT_COPY_S`."""
        with self._locked():
            since, last_id, active, finished = self._load_flows(direction)
            start = max(ready, since)
            if start > latest:
                return None  # placed copies of other engines hold the link that far ahead: share it
            owners = {f.flow_id: f.owner for f in active}
            active, ends = advance(active, since, start)
            if active:
                return None
            finished.update((fid, (owners[fid], end)) for fid, end in ends.items())
            end = start + cost
            self._store_flows(direction, end, last_id, [], finished)
            return start, end

    def link_poll(self, direction: str, flow_id: int, now: float) -> tuple[bool, float]:
        """(True, end) once the flow has ended by `now` (its record is then dropped), else (False,
        the end expected so far)."""
        with self._locked():
            since, last_id, active, finished = self._load_flows(direction)
            if flow_id in finished:
                _, end = finished.pop(flow_id)
                self._store_flows(direction, since, last_id, active, finished)
                return True, end
            expected = finish_times(active, since).get(flow_id)
            if expected is None:
                raise DeviceError(f"ledger {self.path}: copy {flow_id} is not on the {direction} link")
            if expected > now:
                return False, expected
            owners = {f.flow_id: f.owner for f in active}
            active, ends = advance(active, since, expected)
            finished.update((fid, (owners[fid], end)) for fid, end in ends.items() if fid != flow_id)
            self._store_flows(direction, expected, last_id, active, finished)
            return True, ends[flow_id]

    def link(self, direction: str) -> LinkDirection:
        """One direction of this GPU's PCIe link, for a copy engine."""
        if direction not in LINK_DIRECTIONS:
            raise ValueError(f"link direction {direction!r} is not one of {LINK_DIRECTIONS}")
        return LinkDirection(self, direction)

    def _busy_base(self) -> int:
        return _HEADER.size + self.slots * _SLOT.size

    def _busy_rows(self) -> list[tuple[float, float, int, int]]:
        high = min(BUSY_RECORDS, _HIGH_WATER.unpack_from(self._map, _BUSY_HIGH_OFFSET)[0])
        base = self._busy_base()
        region = memoryview(self._map)[base : base + high * _BUSY.size]
        try:
            return list(_BUSY.iter_unpack(region))
        finally:
            region.release()

    def place_busy(
        self,
        slot: int,
        mps: bool,
        ready: float,
        now: float,
        fit: Callable[..., Placed],
        *fit_args: object,
    ) -> Placed:
        """Place one kernel of `slot`'s context atomically: `fit(*fit_args, blocked)` gets the busy
        intervals of other contexts ending after `ready` that the kernel must not overlap (every other
        context's, or, for an MPS client, those of contexts outside MPS) and returns (start, end,
        units); the interval is recorded before any other placement on this GPU can read the
        intervals. `fit_args` spare the caller a closure per kernel.

        The device lock is taken as `_DeviceLock` takes it, inline (once per timed kernel)."""
        lock, filed = self._lock, False
        lock.acquire()
        self._depth += 1
        try:
            if self._depth == 1:
                fcntl.flock(self._fd, fcntl.LOCK_EX)
                filed = True
            cached = self._blocking_locked(slot, mps)
            blocked = [b for b in cached[1] if b[1] > ready] if cached[1] else cached[1]
            placed = fit(*fit_args, blocked)
            overwrote = not self._add_busy_locked(slot, mps, placed[0], placed[1], now)
            self._wrote_busy_locked(slot, mps, cached, overwrote)
            return placed
        finally:
            self._depth -= 1
            try:
                if filed:
                    fcntl.flock(self._fd, fcntl.LOCK_UN)
            finally:
                lock.release()

    def busy_batch(self, slot: int, mps: bool) -> BusyBatch:
        """`place_busy` for several kernels of `slot`'s context in one transaction (`with
        ledger.busy_batch(...) as batch`): the device lock, the busy generation and the intervals
        that block the context are read once; each kernel's interval is recorded as it is placed
        (`BusyBatch.place`), the generation moved once at the end. A stream's segment of kernels
        (`EmulatedRuntime.launch_many`)."""
        return BusyBatch(self, slot, mps)

    def _blocking_locked(self, slot: int, mps: bool) -> tuple[int, list[tuple[float, float]]]:
        """(busy generation, the intervals of other contexts that block `slot`'s kernels), re-read
        only when the generation moved under another writer. Caller holds the lock."""
        generation = _BUSY_GENERATION.unpack_from(self._map, _BUSY_GENERATION_OFFSET)[0]
        cached = self._blocking.get((slot, mps))
        if cached is None or cached[0] != generation:
            cached = (generation, self._others(slot, mps))
        return cached

    def _wrote_busy_locked(
        self, slot: int, mps: bool, cached: tuple[int, list[tuple[float, float]]], overwrote: bool
    ) -> None:
        """After `slot` wrote its busy records: move the generation (other writers re-read); our own
        records do not change what blocks us, so our cache stays valid past the write, unless we
        reused another context's record. Caller holds the lock."""
        generation = cached[0] + 1
        if overwrote:
            self._blocking.pop((slot, mps), None)
        else:
            self._blocking[slot, mps] = (generation, cached[1])
        _BUSY_GENERATION.pack_into(self._map, _BUSY_GENERATION_OFFSET, generation)

    def _others(self, slot: int, mps: bool) -> list[tuple[float, float]]:
        """Busy intervals of the contexts that block `slot`'s kernels. Caller holds the lock."""
        return [
            (start, end)
            for start, end, owner, other_mps in self._busy_rows()
            if owner != slot + 1 and not (mps and other_mps)
        ]

    def _add_busy_locked(self, slot: int, mps: bool, start: float, end: float, now: float) -> bool:
        """Record that `slot`'s context holds compute units over [start, end). Extends its latest
        record when the two touch (back-to-back kernels stay one record); reuses expired records,
        its own latest first (no scan: a host slower than its device writes one record per kernel).
        Returns False when it overwrote another context's record. Caller holds the lock."""
        base = _HEADER.size + self.slots * _SLOT.size  # _busy_base(), inline: once per timed kernel
        hint = self._last_busy.get(slot)
        if hint is not None:
            s0, e0, owner, _ = _BUSY.unpack_from(self._map, base + hint * _BUSY.size)
            if owner == slot + 1 and s0 <= start <= e0 + 1e-9:
                _BUSY.pack_into(self._map, base + hint * _BUSY.size, s0, max(e0, end), owner, int(mps))
                return True
            if owner == slot + 1 and e0 <= now:  # our own latest record has expired: reuse it
                _BUSY.pack_into(self._map, base + hint * _BUSY.size, start, end, owner, int(mps))
                return True
        rows = self._busy_rows()
        index = next((i for i, row in enumerate(rows) if row[1] <= now), len(rows))
        if index == BUSY_RECORDS:  # all in use: drop the one that ends first
            index = min(range(len(rows)), key=lambda i: rows[i][1])
        if index == len(rows):
            _HIGH_WATER.pack_into(self._map, _BUSY_HIGH_OFFSET, index + 1)
        replaced = rows[index][2] if index < len(rows) else 0
        _BUSY.pack_into(self._map, base + index * _BUSY.size, start, end, slot + 1, int(mps))
        self._last_busy[slot] = index
        return replaced in (0, slot + 1)

    def _release_all_owned(self) -> None:
        with self._locked():
            for slot, rid in list(self._owned.items()):
                if self._read(slot)[2] == rid:
                    self._clear(slot)
            self._owned.clear()


class _DeviceLock:
    """`Ledger._locked` as a plain context manager: entered once per timed kernel, where a
    generator-based one costs more than the work it guards."""

    __slots__ = ("_ledger",)

    def __init__(self, ledger: Ledger) -> None:
        self._ledger = ledger

    def __enter__(self) -> None:
        ledger = self._ledger
        ledger._lock.acquire()
        ledger._depth += 1
        if ledger._depth == 1:
            try:
                fcntl.flock(ledger._fd, fcntl.LOCK_EX)
            except BaseException:
                ledger._depth -= 1
                ledger._lock.release()
                raise

    def __exit__(self, *exc: object) -> None:
        ledger = self._ledger
        try:
            ledger._depth -= 1
            if ledger._depth == 0:
                fcntl.flock(ledger._fd, fcntl.LOCK_UN)
        finally:
            ledger._lock.release()


class BusyBatch:
    """One transaction of `Ledger.busy_batch`: `place` as `Ledger.place_busy` places, the lock held
    from `__enter__` to `__exit__` (a class, not a generator: entered once per segment of timed
    kernels, where `contextlib.contextmanager` cost more than a segment's placements). Kernels placed
    back to back make one interval, written once (`flush`): no other process reads the records before
    the transaction ends."""

    __slots__ = ("_ledger", "_slot", "_mps", "_cached", "_others", "_now", "_run", "placed", "overwrote")

    def __init__(self, ledger: Ledger, slot: int, mps: bool) -> None:
        self._ledger, self._slot, self._mps = ledger, slot, mps
        self._cached: tuple[int, list[tuple[float, float]]] | None = None
        self._others: list[tuple[float, float]] = []
        self._now = 0.0
        self._run: list[float] | None = None  # [start, end] of the back-to-back kernels not yet written
        self.placed = 0
        self.overwrote = False  # another context's record was reused: its cache is stale

    def __enter__(self) -> BusyBatch:
        ledger = self._ledger
        lock = ledger._device_lock
        lock.__enter__()
        try:
            self._cached = ledger._blocking_locked(self._slot, self._mps)
        except BaseException:
            lock.__exit__(None, None, None)
            raise
        self._others = self._cached[1]
        return self

    def __exit__(self, *exc: object) -> None:
        ledger = self._ledger
        try:
            self.flush()
            if self.placed and self._cached is not None:
                ledger._wrote_busy_locked(self._slot, self._mps, self._cached, self.overwrote)
        finally:
            ledger._device_lock.__exit__(None, None, None)

    def place(self, ready: float, now: float, fit: Callable[..., Placed], *fit_args: object) -> Placed:
        others = self._others
        blocked = [b for b in others if b[1] > ready] if others else others
        placed = fit(*fit_args, blocked)
        run = self._run
        if run is not None and run[0] <= placed[0] <= run[1] + 1e-9:  # touches the run: one interval
            if placed[1] > run[1]:
                run[1] = placed[1]
        else:
            self.flush()
            self._run = [placed[0], placed[1]]
        self._now = now
        self.placed += 1
        return placed

    def flush(self) -> None:
        run = self._run
        if run is not None:
            self._run = None
            if not self._ledger._add_busy_locked(self._slot, self._mps, run[0], run[1], self._now):
                self.overwrote = True


@dataclass(frozen=True)
class LinkDirection:
    """`join` and `poll` a copy on one direction of a GPU's link (see `Ledger.link_join`)."""

    ledger: Ledger
    direction: str

    def join(self, ready: float, cost: float) -> tuple[int, float, float]:
        return self.ledger.link_join(self.direction, ready, cost)

    def poll(self, flow_id: int, now: float) -> tuple[bool, float]:
        return self.ledger.link_poll(self.direction, flow_id, now)

    def place_alone(self, ready: float, cost: float, latest: float) -> tuple[float, float] | None:
        return self.ledger.link_place_alone(self.direction, ready, cost, latest)


# -- process lifetime ---------------------------------------------------------------------------
_tracked: set[Ledger] = set()


def _track(ledger: Ledger) -> None:
    _tracked.add(ledger)


@atexit.register
def _release_at_exit() -> None:
    """Runtimes still open at interpreter exit give their slots back (threads are daemons)."""
    for ledger in list(_tracked):
        with contextlib.suppress(Exception):
            ledger._release_all_owned()


def _after_fork_in_child() -> None:
    """A forked child shares the parent's open file description (and so its flock): forget it all.

    The child's own runtimes (if it opens any) get fresh ledgers; the parent's slots stay the parent's.
    """
    Ledger._instances = {}
    Ledger._instances_lock = threading.Lock()
    _tracked.clear()


os.register_at_fork(after_in_child=_after_fork_in_child)
