"""Lowering a deploy's missing plans on several cores at once.

A proxy deploys with the plan of every (model, batch) its functions reach at hand: Traffic at batch
16 reaches 33. Lowering one plan is single-threaded Python (torch.export, decomposition, the walk
over the graph): 2-4 s on a 2-core host, so on a cold model pool such a deploy waited minutes on one
core. `lower_missing` splits the plans the pool lacks between this process and child processes.
Each lowers its share, model by model, into the pool, which takes a plan whole or not at all
(`ModelPool.get_or_lower`), so the caller's loads then read them from disk. A child costs its start
(the imports and its first build of each model: about two plans' worth), so there are as many
processes as cores, at most `MAX_WORKERS`, at most one per `WORKER_BYTES` of available memory, and
at most one per `PLANS_PER_WORKER` missing plans.

A child that fails, dies or is still lowering `CHILD_TIMEOUT_S` after its start leaves its plans
missing: the caller's own loads lower them afterwards, raising what lowering them raises there. The
children run in a session of their own (a terminal's Ctrl-C is the parent's to handle), end with the
call (asked to stop, so they remove their unfinished plan folders, then killed) and stop between plans
once their parent is gone.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterable
from pathlib import Path

from .lowering import reusing_built_models
from .model_pool import ModelPool, PlanKey

__all__ = ["MAX_WORKERS", "PLANS_PER_WORKER", "WORKER_BYTES", "lower_missing", "usable_cores", "workers_for"]

#: The most processes lowering at once, this one included.
MAX_WORKERS = 4
#: Missing plans per process: a child's start costs about two plans' lowering.
PLANS_PER_WORKER = 3
#: Memory one lowering process may need: torch, a model and its export (VGG-16's child peaked at
#: 1.3 GiB resident on the project's host), with room.
WORKER_BYTES = 2 << 30
#: How long after its start a child may go on lowering before it is stopped (`launch_proxy` gives a
#: proxy's whole start 600 s).
CHILD_TIMEOUT_S = 600.0
_STOP_GRACE_S = 5.0  # between asking a child to stop and killing it


def usable_cores() -> int:
    """The CPUs this process may run on: its affinity, capped by a cgroup v2 CPU quota (`cpu.max`)."""
    cores = len(os.sched_getaffinity(0))
    with contextlib.suppress(OSError, ValueError):
        quota, period = Path("/sys/fs/cgroup/cpu.max").read_text().split()
        if quota != "max":
            cores = min(cores, max(1, int(quota) // int(period)))
    return cores


def _available_bytes() -> int | None:
    with contextlib.suppress(OSError, ValueError):
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return None


def workers_for(missing: int, cores: int | None = None, available_bytes: int | None = None) -> int:
    """Processes worth lowering `missing` plans with, this one included (1: this one alone).
    Defaults: `usable_cores()`, and the host's available memory (unbounded where unknown)."""
    cores = cores if cores is not None else usable_cores()
    memory = available_bytes if available_bytes is not None else _available_bytes()
    by_memory = memory // WORKER_BYTES if memory is not None else MAX_WORKERS
    return max(1, min(cores, MAX_WORKERS, by_memory, missing // PLANS_PER_WORKER))


def lower_missing(pool: ModelPool, keys: Iterable[PlanKey], workers: int | None = None) -> int:
    """Lower the plans of `keys` that `pool` lacks, on up to `workers` processes (default:
    `workers_for` the missing count); returns how many were missing. A pool with a lowering of its
    own (`lower_fn`) lowers here, one after the other."""
    missing = [key for key in dict.fromkeys(keys) if not pool.has(*key)]
    count = workers if workers is not None else workers_for(len(missing))
    count = max(1, count) if pool.lowers_zoo_models else 1
    shares = [missing[i::count] for i in range(count)]  # each share keeps the models' order
    children: list[subprocess.Popen[bytes]] = []
    try:
        for share in shares[1:]:
            if share:
                child = _start_child(pool.root, share)
                if child is not None:  # else its plans are lowered by the caller's loads
                    children.append(child)
        with reusing_built_models():
            for model, batch, shape in shares[0]:
                pool.get_or_lower(model, batch, shape)
        deadline = time.monotonic() + CHILD_TIMEOUT_S  # at the latest; each child's own start is earlier
        for child in children:
            with contextlib.suppress(subprocess.TimeoutExpired):
                child.wait(timeout=max(0.0, deadline - time.monotonic()))
    finally:
        _stop(children)
    return len(missing)


def _start_child(root: Path, share: list[PlanKey]) -> subprocess.Popen[bytes] | None:
    command = [sys.executable, "-m", __name__, str(os.getpid()), str(root), json.dumps(share)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}  # one core each: the processes share the host's
    try:
        return subprocess.Popen(
            command, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, env=env, start_new_session=True
        )
    except OSError as error:
        print(f"parallel lowering: no child ({error}); its {len(share)} plans lowered here", file=sys.stderr)
        return None


def _stop(children: list[subprocess.Popen[bytes]]) -> None:
    """Ask the children still lowering to stop (they remove their unfinished plan folders), kill
    those that do not, reap them all, and say which did not lower their whole share."""
    running = [child for child in children if child.poll() is None]
    for child in running:
        child.terminate()
    deadline = time.monotonic() + _STOP_GRACE_S
    for child in running:
        try:
            child.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            child.kill()
            child.wait()
    for child in children:
        if child.returncode != 0:
            how = "was stopped" if child in running else f"exited with status {child.returncode}"
            print(f"parallel lowering: child {child.pid} {how}; its plans are lowered here", file=sys.stderr)


def main(argv: list[str]) -> int:
    """A child: lower each plan of its share (a JSON list of [model, batch, shape]) into the pool."""
    parent, root, share = argv
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))  # `finally`s clean up
    pool = ModelPool(Path(root))
    failed = 0
    with reusing_built_models():
        for model, batch, shape in json.loads(share):
            if os.getppid() != int(parent):  # the deploy is gone: nobody will read these plans
                return 1
            try:
                pool.get_or_lower(model, int(batch), tuple(shape))
            except Exception as error:  # noqa: BLE001 - any failure: the parent lowers it and says why
                print(f"lowering {model} for batch {batch}: {type(error).__name__}: {error}", file=sys.stderr)
                failed += 1
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
