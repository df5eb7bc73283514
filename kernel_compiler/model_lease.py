"""Leases on registered model versions: a process that serves a version holds it; removal waits for none.

Each version directory of the model pool has a lease file (`LEASE_FILE`). A process that resolves a
registered version to serve or lower it takes a shared `flock` on it (`hold`) and keeps it for its
life: the kernel drops it when the process ends, however it ends, so a crashed server leaves nothing
stale behind (no pid files). `models remove` takes the leases exclusively without waiting
(`exclusive`): a version some other running process holds is refused, naming it, instead of
vanishing under a server whose next cold start or plan would fail (`UnknownModel` on every request).
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import threading
from collections.abc import Iterator, Sequence
from pathlib import Path

log = logging.getLogger(__name__)

LEASE_FILE = ".in-use"
_NO_LEASE = -1  # a version this process could not lease (a pool it cannot write): not tried again

# version directory (absolute) -> the descriptor of this process's shared lease, or `_NO_LEASE`.
# Forked children inherit the descriptors, and so hold the leases too (the same open file description).
_held: dict[Path, int] = {}
_held_lock = threading.Lock()


class ModelLeaseError(RuntimeError):
    """A registered version's lease cannot be taken for its removal."""


class ModelInUse(ModelLeaseError):
    """A registered version that another running process serves: it is not removed."""


def _key(version_dir: Path) -> Path:
    return Path(os.path.abspath(version_dir))


def _open(version_dir: Path) -> int:
    return os.open(version_dir / LEASE_FILE, os.O_RDONLY | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)


def _shared(version_dir: Path, wait: bool = True) -> int:
    """A descriptor holding a shared lease on `version_dir` (raises `OSError`, leaving nothing open;
    `wait=False`: `BlockingIOError` at once while a remover holds it)."""
    fd = _open(version_dir)
    try:
        fcntl.flock(fd, fcntl.LOCK_SH if wait else fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BaseException:
        os.close(fd)
        raise
    return fd


def hold(version_dir: Path) -> None:
    """Hold a shared lease on `version_dir` for this process's life (once; a second call is free).
    A pool this process cannot write is served without a lease (logged once): serving never fails on it."""
    key = _key(version_dir)
    if key in _held:
        return
    with _held_lock:
        if key in _held:
            return
        try:
            _held[key] = _shared(key)
        except OSError as error:
            _held[key] = _NO_LEASE
            log.info("no lease on %s (%s): `models remove` will not see it in use", key, error)


def _drop_own_lease(key: Path) -> bool:
    """Close this process's own lease on `key`, if it holds one (its removal is its own choice)."""
    with _held_lock:
        fd = _held.pop(key, None)
    if fd is None or fd == _NO_LEASE:
        return False
    os.close(fd)
    return True


def _restore(key: Path) -> None:
    """Take this process's shared lease on `key` back, not waiting (a remover may hold it now)."""
    try:
        fd = _shared(key, wait=False)
    except OSError:
        return
    with _held_lock:
        _held[key] = fd


@contextlib.contextmanager
def exclusive(versions: Sequence[tuple[str, Path]]) -> Iterator[set[str]]:
    """Hold every version's (ref, directory) lease exclusively while the caller removes them; yields
    the refs still there (one a concurrent removal took is skipped). Raises `ModelInUse` when another process
    holds one, then holds none; this process's own leases are set aside meanwhile and taken back if
    the versions stay."""
    taken: list[int] = []
    set_aside: list[Path] = []
    present: set[str] = set()
    removed = False
    try:
        for ref, version_dir in versions:
            key = _key(version_dir)
            if _drop_own_lease(key):
                set_aside.append(key)
            try:
                fd = _open(key)
            except FileNotFoundError:
                continue  # removed meanwhile by another `models remove`
            except OSError as error:
                raise ModelLeaseError(f"cannot take {ref}'s lease ({key / LEASE_FILE}): {error}") from None
            taken.append(fd)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                raise ModelInUse(
                    f"{ref} is in use by a running process (a server or a lowering holds its lease); "
                    "stop it first, or pass --force to remove it anyway (its requests then fail with "
                    "UnknownModel)"
                ) from None
            present.add(ref)
        yield present
        removed = True
    finally:
        for fd in taken:
            os.close(fd)
        if not removed:
            for key in set_aside:
                _restore(key)
