"""The IO daemon's configuration, with the paper's ablation switches (Fig. 17 right).

- RZ (right-size): 2 MB blocks; off = 16 KB blocks.
- PB (pinned buffer): one shared pinned ring allocated once; off = a pinned staging buffer allocated
  per request (paying the pinned-allocation cost every time).
- BT (batched transfer): six blocks issued per call and up to two batches in flight, so the link never
  waits for the host; off = one block per call, each waited for before the next is issued.
- `stream-only`: no daemon at all; every request is one copy straight to the copy engine (pageable
  source, as the executor's direct upload does), in issue order: the baseline.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Literal

from .blocks import DEFAULT_BLOCK_SIZE, SMALL_BLOCK_SIZE
from .scheduler import DEFAULT_BATCH_BLOCKS

Mode = Literal["streambox", "stream-only"]


@dataclass(frozen=True)
class DaemonConfig:
    mode: Mode = "streambox"
    block_size: int = DEFAULT_BLOCK_SIZE
    batch_blocks: int = DEFAULT_BATCH_BLOCKS
    inflight_batches: int = 2  # batches issued and not yet complete, at most
    pinned_buffer: bool = True
    ring_slots: int | None = None  # default: enough for every block in flight

    def __post_init__(self) -> None:
        if self.mode not in ("streambox", "stream-only"):
            raise ValueError(f"mode must be 'streambox' or 'stream-only', got {self.mode!r}")
        if self.block_size < 1 or self.batch_blocks < 1 or self.inflight_batches < 1:
            raise ValueError(f"block_size, batch_blocks and inflight_batches must be positive: {self}")
        if self.ring_slots is not None and self.ring_slots < 1:
            raise ValueError(f"ring_slots must be positive, got {self.ring_slots}")

    @property
    def slots(self) -> int:
        """Ring slots: every block that may be in flight has its own slot, so staging never waits."""
        return self.ring_slots or self.batch_blocks * self.inflight_batches

    @property
    def ring_bytes(self) -> int:
        return self.slots * self.block_size

    @classmethod
    def stream_only(cls) -> DaemonConfig:
        return cls(mode="stream-only")

    @classmethod
    def ablation(cls, rz: bool = True, pb: bool = True, bt: bool = True, **overrides: object) -> DaemonConfig:
        """StreamBox with each optimisation on or off (all on = the default)."""
        config = cls(
            block_size=DEFAULT_BLOCK_SIZE if rz else SMALL_BLOCK_SIZE,
            batch_blocks=DEFAULT_BATCH_BLOCKS if bt else 1,
            inflight_batches=2 if bt else 1,
            pinned_buffer=pb,
        )
        return replace(config, **overrides)  # type: ignore[arg-type]

    @property
    def label(self) -> str:
        if self.mode == "stream-only":
            return "stream-only"
        on = [
            name
            for name, flag in (
                ("RZ", self.block_size >= DEFAULT_BLOCK_SIZE),
                ("PB", self.pinned_buffer),
                ("BT", self.batch_blocks > 1),
            )
            if flag
        ]
        return "StreamBox" if len(on) == 3 else ("+".join(on) if on else "no optimizations")
