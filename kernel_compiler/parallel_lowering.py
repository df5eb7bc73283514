"""Lowering a deploy's missing plans on several cores at once.

A proxy deploys with the plan of every (model, batch) its functions reach at hand: Traffic at batch
16 reaches 32. Lowering one plan is single-threaded Python (torch.export, decomposition, the walk
over the graph): 2-4 s on a 2-core host, so on a cold model pool such a deploy waited minutes on one
core. `lower_missing` splits the plans the pool lacks between this process and child processes (one
per core, at most `MAX_WORKERS` in all). Each lowers its share, model by model, into the pool,
which takes a plan whole or not at all (`ModelPool.get_or_lower`), so the caller's loads then read
them from disk. A child costs its start (the imports and its first build of each model: about two
plans' worth), so there is one only for every `PLANS_PER_WORKER` missing plans.

A child that fails, dies or runs past `CHILD_TIMEOUT_S` leaves its plans missing: the caller's own
loads lower them afterwards, raising what lowering them raises there. Children end with the call
(killed if still running), and stop between plans once their parent is gone.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import time
from collections.abc import Iterable
from pathlib import Path

from .lowering import reusing_built_models
from .model_pool import ModelPool, PlanKey

__all__ = ["MAX_WORKERS", "PLANS_PER_WORKER", "PlanKey", "lower_missing", "workers_for"]

#: The most processes lowering at once (this one included): each holds torch and a model.
MAX_WORKERS = 4
#: Missing plans per worker: a child's start costs about two plans' lowering.
PLANS_PER_WORKER = 3
#: The longest a child may take for its whole share before its plans are lowered here instead.
CHILD_TIMEOUT_S = 900.0


def workers_for(missing: int, cores: int | None = None) -> int:
    """Processes worth lowering `missing` plans with (1: this one alone)."""
    cores = cores if cores is not None else len(os.sched_getaffinity(0))
    return max(1, min(cores, MAX_WORKERS, missing // PLANS_PER_WORKER))


def lower_missing(pool: ModelPool, keys: Iterable[PlanKey], workers: int | None = None) -> int:
    """Lower the plans of `keys` that `pool` lacks, on up to `workers` processes (default:
    `workers_for` the missing count); returns how many were missing. A pool with a lowering of its
    own (`lower_fn`) lowers here, one after the other."""
    missing = [key for key in dict.fromkeys(keys) if not pool.has(*key)]
    workers = workers if workers is not None else workers_for(len(missing))
    if not pool.lowers_zoo_models:
        workers = 1
    shares = [missing[i::workers] for i in range(max(1, workers))]  # each share keeps the models' order
    children = [_start_child(pool.root, share) for share in shares[1:] if share]
    try:
        with reusing_built_models():
            for model, batch, shape in shares[0]:
                pool.get_or_lower(model, batch, shape)
        deadline = time.monotonic() + CHILD_TIMEOUT_S
        for child in children:  # one past the deadline is killed below; the caller's loads lower its plans
            with contextlib.suppress(subprocess.TimeoutExpired):
                child.wait(timeout=max(0.0, deadline - time.monotonic()))
    finally:
        for child in children:
            if child.poll() is None:
                child.kill()
                child.wait()
    return len(missing)


def _start_child(root: Path, share: list[PlanKey]) -> subprocess.Popen[bytes]:
    command = [sys.executable, "-m", __name__, str(root), json.dumps(share)]
    return subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL)


def main(argv: list[str]) -> int:
    """A child: lower each plan of its share (a JSON list of [model, batch, shape]) into the pool."""
    root, share = argv
    parent = os.getppid()
    pool = ModelPool(Path(root))
    failed = 0
    with reusing_built_models():
        for model, batch, shape in json.loads(share):
            if os.getppid() != parent:  # the deploy is gone: nobody will read these plans
                return 1
            try:
                pool.get_or_lower(model, int(batch), tuple(shape))
            except Exception as error:  # noqa: BLE001 - any failure: the parent lowers it and says why
                print(f"lowering {model} for batch {batch}: {type(error).__name__}: {error}", file=sys.stderr)
                failed += 1
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
