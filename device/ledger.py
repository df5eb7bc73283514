"""Cross-process accounting of one emulated GPU: who holds how much memory and how many streams.

A real GPU's memory is shared by every process of the machine. The emulated one keeps a small ledger
file per device under a state directory: a header and fixed slots, one per runtime (pid, process start
time, runtime id, used bytes, streams), in an mmap'ed file guarded by `fcntl.flock` (between processes)
and a lock (between threads). Every capacity check sums all live slots under the lock. A slot whose
process has died (exit, `os._exit`, SIGKILL) is reclaimed by whoever next takes the lock; a slot is
released on `close` and, for runtimes still open, at interpreter exit.

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
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from .base import DeviceError, OutOfDeviceMemory

_MAGIC = b"SBXLEDG1"
_VERSION = 2
_HEADER = struct.Struct("<8sIIQ40x")  # magic, version, slot count, total memory -> 64 bytes
_HIGH_WATER = struct.Struct("<Q")  # at offset 24: slots ever used (scans stop there)
_HIGH_WATER_OFFSET = 24
_SLOT = struct.Struct("<qqqqqq")  # pid, start time, runtime id, used bytes, streams, reserved -> 48 bytes
DEFAULT_SLOTS = 512


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
    digest = hashlib.sha1(f"{name}|{total_memory}".encode()).hexdigest()[:12]
    return Path(state_dir) / f"emulated-gpu{index}-{digest}.ledger"


def _process_start_time(pid: int) -> int | None:
    """Field 22 of /proc/<pid>/stat (clock ticks since boot), None if unknown; -1 for a zombie."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            raw = f.read()
    except OSError:
        return None
    fields = raw[raw.rfind(b")") + 2 :].split()
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
        self._owned: dict[int, int] = {}  # slot -> runtime id, slots this process holds
        ensure_state_dir(path.parent)
        try:
            self._fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        except OSError as exc:
            why = f"{exc.strerror} (links are not followed)"
            raise DeviceError(f"cannot open the ledger {path}: {why}") from None
        size = _HEADER.size + slots * _SLOT.size
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
                size = _HEADER.size + nslots * _SLOT.size
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
    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        with self._lock:
            self._depth += 1
            if self._depth == 1:
                fcntl.flock(self._fd, fcntl.LOCK_EX)
            try:
                yield
            finally:
                self._depth -= 1
                if self._depth == 0:
                    fcntl.flock(self._fd, fcntl.LOCK_UN)

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

    def _release_all_owned(self) -> None:
        with self._locked():
            for slot, rid in list(self._owned.items()):
                if self._read(slot)[2] == rid:
                    self._clear(slot)
            self._owned.clear()


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
