"""Leases on registered model versions: a process that serves a version holds it; removal waits for none.

Each version directory of the model pool has a lease file (`LEASE_FILE`). A process that resolves a
registered version to serve or lower it takes a shared `flock` on it (`hold`) and keeps it for its
life: the kernel drops it when the process ends, however it ends, so a crashed server leaves nothing
stale behind (no pid files). `models remove` takes the lease exclusively without waiting
(`exclusive`): a version some running process holds is refused, naming it, instead of vanishing under
a server whose next cold start or plan would fail (`UnknownModel` on every request).
"""

from __future__ import annotations

import fcntl
import logging
import os
import threading
from pathlib import Path

log = logging.getLogger(__name__)

LEASE_FILE = ".in-use"

# version directory -> the descriptor of this process's shared lease (inherited by forked children,
# which then hold it too: the same open file description).
_held: dict[Path, int] = {}
_held_lock = threading.Lock()


class ModelInUse(RuntimeError):
    """A registered version that a running process serves: it is not removed."""


def _open(version_dir: Path) -> int:
    return os.open(version_dir / LEASE_FILE, os.O_RDONLY | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)


def hold(version_dir: Path) -> None:
    """Hold a shared lease on `version_dir` for this process's life (once; a second call is free).
    A pool this process cannot write is served without a lease (logged): serving never fails on it."""
    version_dir = Path(version_dir)
    if version_dir in _held:
        return
    with _held_lock:
        if version_dir in _held:
            return
        try:
            fd = _open(version_dir)
            fcntl.flock(fd, fcntl.LOCK_SH)
        except OSError as error:
            log.info("no lease on %s (%s): `models remove` will not see it in use", version_dir, error)
            return
        _held[version_dir] = fd


def release(version_dir: Path) -> None:
    """Drop this process's own lease on `version_dir`, if it holds one."""
    with _held_lock:
        fd = _held.pop(Path(version_dir), None)
    if fd is not None:
        os.close(fd)


def exclusive(version_dir: Path, ref: str) -> int:
    """The exclusive lease of `version_dir` (a descriptor to close once the version is gone); raises
    `ModelInUse` when another process holds it. This process's own lease is dropped first."""
    release(version_dir)
    fd = _open(version_dir)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise ModelInUse(
            f"{ref} is in use by a running process (a server or a lowering holds its lease); stop it "
            "first, or pass --force to remove it anyway (its requests then fail with UnknownModel)"
        ) from None
    except BaseException:
        os.close(fd)
        raise
    return fd
