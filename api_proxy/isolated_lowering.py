"""Lowering a registered model in a process of its own.

A registered model is built by its author's code (the factory's module import, the factory, its
weights' loading), which a proxy would otherwise run on its helper threads, in the process that serves
every function of the workflow: a factory that calls `os._exit`, crashes the interpreter or hangs took
the proxy and every call in flight down with it. `lower_in_child` runs `ModelPool.get_or_lower` in a
child Python process that writes the plan into the pool (its usual place, all or nothing) and reads it
back here; the child's failure fails that lowering only, and names what the child said. A plan already
in the pool is read here, without a child (it runs no author code). The child dies with the thread that
started it (`die_with_parent`): a proxy that ends leaves no lowering running, nor its lease on the model.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

from streambox.kernel_compiler.model_pool import ModelPool
from streambox.kernel_compiler.plan import KernelPlan

from .template import die_with_parent

#: The longest one lowering may take in its child (a large model lowers in tens of seconds).
LOWER_TIMEOUT_S = 900.0
#: The child's exit status for a failure of the host (an OSError: a full disk), not of the model.
HOST_FAILED = 75  # EX_TEMPFAIL


class IsolatedLoweringFailed(RuntimeError):
    """The child lowering a registered model failed, exited or ran past its time: the message says how.
    `transient`: the host failed it (SIGKILL, the kernel's out-of-memory killer; an OSError), so a next
    try may succeed; a failure of the model's own (an error, a crash, a hang) would happen again."""

    def __init__(self, message: str, transient: bool = False) -> None:
        super().__init__(message)
        self.transient = transient


def lower_in_child(
    root: Path, model: str, batch: int, shape: tuple[int, ...], timeout_s: float = LOWER_TIMEOUT_S
) -> KernelPlan:
    """The plan of (model, batch, shape) from the pool at `root`, lowered in a child process if the
    pool lacks it."""
    pool = ModelPool(root)
    stored = pool.get(model, batch, shape)
    if stored is not None:
        return stored
    command = [sys.executable, "-m", __name__, str(root), model, str(batch), ",".join(map(str, shape))]
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=timeout_s, check=False)
    except subprocess.TimeoutExpired:
        raise IsolatedLoweringFailed(f"lowering {model} for batch {batch} ran past {timeout_s:g} s") from None
    if done.returncode != 0:
        said = [line for line in done.stderr.splitlines() if line.strip()]
        why = said[-1] if said else f"its process exited with code {done.returncode}, saying nothing"
        host = done.returncode in (HOST_FAILED, -signal.SIGKILL)
        raise IsolatedLoweringFailed(why[:2000], transient=host)
    return pool.get_or_lower(model, batch, shape)  # on disk now: read, not lowered


def main(argv: list[str]) -> int:
    die_with_parent()
    if os.getppid() == 1:  # its parent ended before the line above: nobody waits for this lowering
        return 1
    root, model, batch, shape = argv
    try:
        ModelPool(Path(root)).get_or_lower(model, int(batch), tuple(int(d) for d in shape.split(",") if d))
    except Exception as error:  # noqa: BLE001 - the author's code may raise anything: said, in one line
        message = " ".join(str(error).split())
        print(f"{type(error).__name__}: {message}", file=sys.stderr)
        return HOST_FAILED if isinstance(error, OSError) else 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
