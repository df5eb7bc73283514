"""The daemon replayed in virtual time on the link model (pure: no threads, no device).

The same policy code as the daemon (`split_into_blocks`, `BlockScheduler`) drives a `LinkClock` (the
emulated copy engine's own clock), so the result is what the design achieves on the modelled link
when the host costs only `issue_s` per copy call: no Python, no emulator. Benchmarks print it beside
the emulated measurement. Stream-only is replayed as CUDA queues async copies: every request goes to
the one FIFO engine when its function issues it, behind everything issued before.

Time 0 is when the first function arrives; `SimFunction.arrival` is when a function submits.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Hashable, Sequence
from dataclasses import dataclass

from streambox.device.copy_engine import LinkClock
from streambox.device.specs import LinkModel

from .blocks import split_into_blocks
from .config import DaemonConfig
from .scheduler import BlockScheduler


@dataclass(frozen=True)
class SimFunction:
    name: Hashable
    arrival: float
    sizes: Sequence[int]  # its copy requests in order (bytes)
    pinned_source: bool = False  # stream-only: the source is pinned memory already


@dataclass(frozen=True)
class SimResult:
    finish: dict[Hashable, float]  # when each function's last byte arrived
    calls: dict[Hashable, int]
    link_busy: float  # seconds the link moved data (per-call latency included)


def simulate(
    link: LinkModel, functions: Sequence[SimFunction], config: DaemonConfig, *, issue_s: float = 0.0
) -> SimResult:
    """Replay `functions` through `config` on `link`; see the module doc."""
    if config.mode == "stream-only":
        return _stream_only(link, functions, issue_s)
    clock = LinkClock()
    scheduler = BlockScheduler(config.batch_blocks)
    arrivals = deque(sorted(functions, key=lambda f: f.arrival))
    sizes = {f.name: f.sizes for f in functions}
    finish: dict[Hashable, float] = {}
    calls: dict[Hashable, int] = {f.name: 0 for f in functions}
    staged: set[tuple[Hashable, int]] = set()
    batch_ends: deque[float] = deque()  # modelled end of each batch in flight, oldest first
    now = 0.0  # the daemon thread's time

    while arrivals or scheduler:
        # batch boundary: at most `inflight_batches` in flight
        while len(batch_ends) >= config.inflight_batches:
            now = max(now, batch_ends.popleft())
        if not scheduler and arrivals:
            now = max(now, arrivals[0].arrival)
        while arrivals and arrivals[0].arrival <= now:
            f = arrivals.popleft()
            split = split_into_blocks(f.sizes, list(range(len(f.sizes))), config.block_size, function=f.name)
            scheduler.submit(f.name, split.blocks)
        end = now
        for block in scheduler.next_batch():
            for piece in block.pieces:
                if not config.pinned_buffer and (block.function, piece.request) not in staged:
                    staged.add((block.function, piece.request))  # per-request pinned staging
                    now += sizes[block.function][piece.request] * link.pinned_alloc_s_per_byte
            n_calls = 1 if config.pinned_buffer else len(block.pieces)  # adjacent destinations assumed
            for piece_bytes in [block.nbytes] if config.pinned_buffer else [p.nbytes for p in block.pieces]:
                now += issue_s
                _, end = clock.schedule(now, link.copy_seconds(piece_bytes), piece_bytes)
            calls[block.function] += n_calls
            finish[block.function] = end
        batch_ends.append(end)
    return SimResult(finish, calls, clock.busy_seconds)


def _stream_only(link: LinkModel, functions: Sequence[SimFunction], issue_s: float) -> SimResult:
    clock = LinkClock()
    queue = sorted(
        (
            (f.arrival + i * issue_s, f.name, n, f.pinned_source)
            for f in functions
            for i, n in enumerate(f.sizes)
        ),
        key=lambda item: item[0],
    )
    finish: dict[Hashable, float] = {}
    calls: dict[Hashable, int] = {f.name: 0 for f in functions}
    for issued, name, n, pinned in queue:
        if n:
            _, finish[name] = clock.schedule(issued, link.copy_seconds(n, pinned), n)
            calls[name] += 1
    return SimResult(finish, calls, clock.busy_seconds)
