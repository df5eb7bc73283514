"""The block splitter/fuser: exact cuts on examples, and its invariants by hypothesis (every byte covered
exactly once, in order, no block over the size, sync flags exactly on each layer's last block)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from streambox.io_daemon.blocks import Piece, coalesce, layer_ends, split_into_blocks

KiB = 1 << 10
MiB = 1 << 20


def test_large_tensor_is_cut_and_small_ones_fuse_with_its_tail():
    # 5 MiB weight, then a 1 KiB bias, then a 2 MiB weight, then two 256 B tensors
    sizes = [5 * MiB, 1 * KiB, 2 * MiB, 256, 256]
    layers = [0, 0, 1, 2, 2]
    split = split_into_blocks(sizes, layers, 2 * MiB, function="f")
    assert [b.pieces for b in split.blocks] == [
        (Piece(0, 0, 2 * MiB),),
        (Piece(0, 2 * MiB, 2 * MiB),),
        (Piece(0, 4 * MiB, 1 * MiB), Piece(1, 0, 1 * KiB)),  # tail of the weight + fused bias
        (Piece(2, 0, 2 * MiB),),  # does not fit beside the open block: a fresh one, exactly full
        (Piece(3, 0, 256), Piece(4, 0, 256)),  # small tensors fused
    ]
    assert [b.flags for b in split.blocks] == [(), (), (0,), (1,), (2,)]
    assert [b.seq for b in split.blocks] == [0, 1, 2, 3, 4]
    assert {b.function for b in split.blocks} == {"f"}
    assert split.empty_layers == ()


def test_block_with_several_layers_and_layers_without_bytes():
    split = split_into_blocks([100, 0, 200, 300, 0], ["a", "b", "c", "c", "d"], 1024, first_seq=7)
    (block,) = split.blocks
    assert block.seq == 7
    assert block.flags == ("a", "c")  # several small layers complete in one block
    assert block.nbytes == 600
    assert split.empty_layers == ("b", "d")  # no bytes: complete at once, no event


def test_layer_of_non_adjacent_requests_is_flagged_on_its_last_byte():
    split = split_into_blocks([10, 10, 10], ["x", "y", "x"], 10)
    assert [b.flags for b in split.blocks] == [(), ("y",), ("x",)]


def test_bad_arguments():
    with pytest.raises(ValueError, match="layers"):
        split_into_blocks([1, 2], [0], 8)
    with pytest.raises(ValueError, match="block size"):
        split_into_blocks([1], [0], 0)
    with pytest.raises(ValueError, match="negative"):
        split_into_blocks([-1], [0], 8)


def test_layer_ends():
    closing, empty = layer_ends([4, 0, 4, 4], [1, 2, 1, 3])
    assert closing == {2: [1], 3: [3]} and empty == (2,)


def test_coalesce_merges_only_what_continues_on_both_sides():
    assert coalesce([(100, 0, 10), (110, 10, 5), (200, 15, 5), (205, 21, 1)]) == [
        (100, 0, 15),
        (200, 15, 5),
        (205, 21, 1),
    ]
    assert coalesce([]) == []


sizes_st = st.lists(st.integers(0, 5000), min_size=0, max_size=40)


@settings(max_examples=300, deadline=None)
@given(sizes=sizes_st, block_size=st.integers(1, 3000), data=st.data())
def test_every_byte_exactly_once_in_order_with_exact_flags(sizes, block_size, data):
    layers = [data.draw(st.integers(0, 6)) for _ in sizes]
    split = split_into_blocks(sizes, layers, block_size, function="f", first_seq=3)
    blocks = split.blocks

    # Every byte of every request exactly once, and in request/offset order across blocks.
    pieces = [p for b in blocks for p in b.pieces]
    covered = [(p.request, p.offset + k) for p in pieces for k in range(p.nbytes)]
    expected = [(i, k) for i, n in enumerate(sizes) for k in range(n)]
    assert covered == expected
    assert all(p.nbytes > 0 for p in pieces)

    # Blocks: never over the size, never empty, numbered in order.
    assert all(0 < b.nbytes <= block_size for b in blocks)
    assert [b.seq for b in blocks] == list(range(3, 3 + len(blocks)))

    # Fit or split: a request shares a block with another only if it lies whole in it (fusion), or it
    # is the tail of a large request that the following small ones join.
    for b in blocks:
        if len(b.pieces) > 1:
            for p in b.pieces[1:]:
                assert p.offset == 0 and p.nbytes == sizes[p.request]
    assert sum(1 for b in blocks if b.nbytes < block_size) <= len(sizes)

    # Flags: each layer with bytes is flagged once, on the block holding its last byte.
    last_block = {}
    for bi, b in enumerate(blocks):
        for p in b.pieces:
            last_block[layers[p.request]] = bi
    flagged = {}
    for bi, b in enumerate(blocks):
        for layer in b.flags:
            assert layer not in flagged
            flagged[layer] = bi
    assert flagged == last_block
    assert set(split.empty_layers) == set(layers) - set(last_block)
