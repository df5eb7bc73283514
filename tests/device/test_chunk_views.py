"""ChunkViews: the CUDA backend's fast views, checked on CPU tensors standing in for allocations."""

from __future__ import annotations

import pytest
import torch

from streambox.device.base import InvalidAddress, contiguous_strides
from streambox.device.chunk_views import ChunkViews

START, SIZE = 0x7000_0000, 4096


@pytest.fixture
def memory() -> dict[int, torch.Tensor]:
    return {}


@pytest.fixture
def views(memory: dict[int, torch.Tensor]) -> ChunkViews:
    def make_base(start: int, nbytes: int) -> torch.Tensor:
        memory[start] = memory.get(start, torch.zeros(nbytes, dtype=torch.uint8))
        assert memory[start].numel() == nbytes
        return memory[start]

    v = ChunkViews(make_base)
    v.add(START, SIZE)
    return v


def test_a_view_inside_an_allocation_aliases_its_bytes(views: ChunkViews, memory) -> None:
    t = views.view(START + 512, torch.float32, (2, 3))
    assert t is not None and t.shape == (2, 3) and t.stride() == (3, 1)
    t.fill_(1.5)
    assert memory[START][512:512 + 24].view(torch.float32).tolist() == [1.5] * 6
    assert memory[START][:512].eq(0).all() and memory[START][536:].eq(0).all()
    strided = views.view(START + 512, torch.float32, (3, 2), (1, 3))  # the transpose, strides in elements
    assert strided is not None and torch.equal(strided, t.t())


def test_views_outside_any_allocation_or_running_past_its_end_are_not_served(views: ChunkViews) -> None:
    assert views.view(START - 4, torch.float32, (1,)) is None
    assert views.view(START + SIZE, torch.float32, (1,)) is None
    assert views.view(START + SIZE - 8, torch.float32, (3,)) is None  # 12 bytes from 8 left
    assert views.view(START + SIZE - 8, torch.float32, (2,)) is not None
    with pytest.raises(InvalidAddress, match="misaligned"):
        views.view(START + 2, torch.float32, (1,))


def test_a_removed_allocation_is_no_longer_served_and_a_new_one_gets_a_new_base(views, memory) -> None:
    assert views.view(START, torch.int64, (4,)) is not None
    views.remove(START)
    views.remove(START)  # unknown: ignored
    assert views.view(START, torch.int64, (4,)) is None and len(views) == 0
    del memory[START]
    views.add(START, 2 * SIZE)  # the driver hands the address out again, larger
    assert views.view(START + SIZE, torch.int64, (4,)) is not None
    assert memory[START].numel() == 2 * SIZE


def test_contiguous_strides() -> None:
    assert contiguous_strides((2, 3, 4)) == (12, 4, 1)
    assert contiguous_strides((0, 3)) == (3, 1)
    assert contiguous_strides(()) == ()
