"""The IO daemon: fine-grained sharing of the host-to-device link among functions (paper section 7).

- `blocks.py`: the block splitter/fuser with sync flags (pure);
- `scheduler.py`: per-function queues, round-robin device queue, preemption, batches (pure);
- `config.py`: block size, batch size, pinned ring, the RZ/PB/BT ablation switches, `stream-only`;
- `staging.py`: the shared pinned transfer ring;
- `daemon.py`: the thread that issues batches and records the events functions wait on;
- `plan_loading.py`: pipelined loading of a kernel plan's weights (per-kernel waits).
"""

from .blocks import DEFAULT_BLOCK_SIZE, SMALL_BLOCK_SIZE, Block, Piece, Split, split_into_blocks
from .config import DaemonConfig
from .daemon import CopyRequest, DaemonStats, IODaemon, IssuedBlock, Ticket
from .plan_loading import PlanLoad, first_use, load_plan, weight_layout, weight_requests
from .scheduler import DEFAULT_BATCH_BLOCKS, BlockScheduler

__all__ = [
    "DEFAULT_BATCH_BLOCKS",
    "DEFAULT_BLOCK_SIZE",
    "SMALL_BLOCK_SIZE",
    "Block",
    "BlockScheduler",
    "CopyRequest",
    "DaemonConfig",
    "DaemonStats",
    "IODaemon",
    "IssuedBlock",
    "Piece",
    "PlanLoad",
    "Split",
    "Ticket",
    "first_use",
    "load_plan",
    "split_into_blocks",
    "weight_layout",
    "weight_requests",
]
