"""Another job on the emulated node: it takes GPUs' free memory (as the paper runs a video task to
raise memory pressure, section 9.2), holds it, and gives it back.

Timed backend: the memory is accounted in the node's shared ledger (every process sees it) with no
host memory behind it. As a command, for a run in another process (a burst or a replay):

    .venv/bin/python benchmarks/other_job.py --leave 0=64 --leave 1=32 --after-s 25 --hold-s 60

(leave 64 MiB free on GPU 0 and 32 MiB on GPU 1, starting 25 s from now, for 60 s). The same
`STREAMBOX_STATE_DIR`, `--gpus` and preset as the run it presses on.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from streambox.config import Config
from streambox.device import Runtime
from streambox.device.emulated import EmulatedBackend
from streambox.device.specs import MiB


class OtherJob:
    """Takes each GPU's free memory down to `leave[gpu]` bytes on `grow` (in `leave`'s order), gives
    it back on `release`."""

    def __init__(self, state_dir: Path, gpus: int, leave: dict[int, int], preset: str = "v100-16gb") -> None:
        spec = Config(device_preset=preset).device_spec().with_overrides(context_create_s=0.0)
        self.backend = EmulatedBackend(spec, count=gpus, state_dir=state_dir, mode="timed")
        self.leave = dict(leave)
        self.runtimes: dict[int, Runtime] = {g: self.backend.open_runtime(g) for g in self.leave}
        self.held: list[tuple[Runtime, int]] = []

    def grow(self) -> None:
        for gpu, leave in self.leave.items():
            rt = self.runtimes[gpu]
            free, _ = rt.memory_info()
            if free > leave:
                self.held.append((rt, rt.mem_alloc(free - leave)))

    def release(self) -> None:
        for rt, address in self.held:
            rt.mem_free(address)
        self.held.clear()

    def close(self) -> None:
        self.backend.close()


def _leave(text: str) -> tuple[int, int]:
    gpu, _, mib = text.partition("=")
    try:
        return int(gpu), int(mib) * MiB
    except ValueError:
        raise argparse.ArgumentTypeError(f"--leave {text!r}: expected GPU=MiB, e.g. 0=64") from None


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--leave", type=_leave, action="append", required=True, metavar="GPU=MiB")
    p.add_argument("--after-s", type=float, default=0.0)
    p.add_argument("--hold-s", type=float, default=60.0)
    args = p.parse_args()
    config = Config.from_env()
    state_dir = config.state_dir or EmulatedBackend().state_dir
    time.sleep(args.after_s)  # before opening anything: placement must not see this job until it grows
    job = OtherJob(state_dir, config.gpus, dict(args.leave), config.device_preset)
    try:
        job.grow()
        free = ", ".join(f"GPU {g}: {rt.memory_info()[0] / MiB:.0f} MiB" for g, rt in job.runtimes.items())
        print(f"other job: holding; free now {free}", flush=True)
        time.sleep(args.hold_s)
    finally:
        job.release()
        job.close()


if __name__ == "__main__":
    main()
