"""The block splitter/fuser (pure): a function's copy requests cut into data blocks with sync flags.

Paper section 7.1/7.2. Input: one function's requests in issue order, each a byte count and the layer
it belongs to (a hashable key: a kernel index, a variable name, ...). Output: blocks of at most
`block_size` bytes, in order, that together cover every byte of every request exactly once.

Rule ("fit or split"), request by request:
- the rest of a request that fits in the open block joins it (small tensors are *fused*);
- a request that does not fit goes into a new block; if it is larger than a block it is cut into
  full blocks, and its tail stays open so that the small requests after it fuse with it.
A block therefore never holds the middle of a large tensor next to another tensor, so with separate
device allocations a block is one copy call except where small tensors were fused (see `daemon.py`,
which coalesces pieces whose destinations are adjacent into one call).

Sync flags: a block's `flags` are the layers whose *last* byte it carries; after that block the daemon
records an event, and the layer's kernel waits on it. A layer with no bytes at all needs no event: it
is listed in `empty_layers` of the split and counts as complete from the start.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass

MiB = 1 << 20
KiB = 1 << 10

#: The paper's right-sized block (RZ on) and the small block it is compared with (RZ off).
DEFAULT_BLOCK_SIZE = 2 * MiB
SMALL_BLOCK_SIZE = 16 * KiB

Layer = Hashable


@dataclass(frozen=True)
class Piece:
    """Bytes [offset, offset + nbytes) of request `request` (its index in the submission)."""

    request: int
    offset: int
    nbytes: int


@dataclass(frozen=True)
class Block:
    """One data block of one function: transferred as a unit, in `seq` order within the function."""

    function: Hashable
    submission: int
    seq: int
    pieces: tuple[Piece, ...]
    flags: tuple[Layer, ...] = ()

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self.pieces)


@dataclass(frozen=True)
class Split:
    blocks: list[Block]
    empty_layers: tuple[Layer, ...]  # layers without a byte: complete at once, no event


def split_into_blocks(
    sizes: Sequence[int],
    layers: Sequence[Layer],
    block_size: int = DEFAULT_BLOCK_SIZE,
    *,
    function: Hashable = 0,
    submission: int = 0,
    first_seq: int = 0,
) -> Split:
    """Cut requests of `sizes` bytes (layer `layers[i]` each) into blocks; see the module doc."""
    if len(sizes) != len(layers):
        raise ValueError(f"{len(sizes)} request sizes but {len(layers)} layers")
    if block_size < 1:
        raise ValueError(f"block size must be positive, got {block_size}")
    if any(n < 0 for n in sizes):
        raise ValueError(f"negative request size in {list(sizes)}")

    closing, empty = layer_ends(sizes, layers)

    blocks: list[Block] = []
    pieces: list[Piece] = []
    flags: list[Layer] = []
    room = block_size

    def close() -> None:
        nonlocal pieces, flags, room
        if pieces:
            blocks.append(Block(function, submission, first_seq + len(blocks), tuple(pieces), tuple(flags)))
        pieces, flags, room = [], [], block_size

    for i, n in enumerate(sizes):
        if n == 0:
            continue
        if n > room and pieces:
            close()  # does not fit beside what is open: start a fresh block
        offset = 0
        while n - offset > room:  # only when the open block is empty: cut full blocks
            pieces.append(Piece(i, offset, room))
            offset += room
            close()
        pieces.append(Piece(i, offset, n - offset))
        room -= n - offset
        flags.extend(closing.get(i, ()))
        if room == 0:
            close()
    close()
    return Split(blocks, empty)


def layer_ends(
    sizes: Sequence[int], layers: Sequence[Layer]
) -> tuple[dict[int, list[Layer]], tuple[Layer, ...]]:
    """Which layers end with each request (its last non-empty one), and the layers without a byte."""
    last_request: dict[Layer, int] = {}
    seen: dict[Layer, None] = {}
    for i, (n, layer) in enumerate(zip(sizes, layers, strict=True)):
        seen.setdefault(layer, None)
        if n > 0:
            last_request[layer] = i
    closing: dict[int, list[Layer]] = {}
    for layer, i in last_request.items():
        closing.setdefault(i, []).append(layer)
    return closing, tuple(layer for layer in seen if layer not in last_request)


def coalesce(extents: Sequence[tuple[int, int, int]]) -> list[tuple[int, int, int]]:
    """Merge (dst, src, nbytes) extents that continue each other on both sides into one copy each."""
    runs: list[tuple[int, int, int]] = []
    for dst, src, n in extents:
        if runs and runs[-1][0] + runs[-1][2] == dst and runs[-1][1] + runs[-1][2] == src:
            d, s, m = runs[-1]
            runs[-1] = (d, s, m + n)
        else:
            runs.append((dst, src, n))
    return runs
