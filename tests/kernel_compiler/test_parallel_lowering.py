"""A deploy's missing plans lowered on several processes (`parallel_lowering.lower_missing`)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from streambox.kernel_compiler import parallel_lowering
from streambox.kernel_compiler.lowering import lower_model
from streambox.kernel_compiler.model_pool import ModelPool, PlanKey
from streambox.kernel_compiler.plan import PLAN_FILE, SCHEMA_VERSION, KernelPlan

SHAPE = (3, 16, 16)
KEYS: list[PlanKey] = [("espcn", batch, SHAPE) for batch in range(1, 7)]


def _children() -> list[int]:
    """This process's live children (zombies are reaped by `Popen.wait`, so none should be left)."""
    found = []
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            try:
                stat = Path(entry.path, "stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == os.getpid():
                found.append(int(entry.name))
    return found


GIB = 1 << 30


@pytest.mark.parametrize(
    ("missing", "cores", "memory", "workers"),
    [(0, 2, 64, 1), (2, 2, 64, 1), (5, 2, 64, 1), (6, 2, 64, 2), (33, 2, 64, 2), (33, 16, 64, 4),
     (9, 16, 64, 3), (33, 1, 64, 1), (33, 16, 5, 2), (33, 16, 1, 1)],
)
def test_processes_one_per_core_per_few_missing_plans_and_per_two_gib_at_most(
    missing: int, cores: int, memory: int, workers: int
) -> None:
    assert parallel_lowering.workers_for(missing, cores, memory * GIB) == workers


def test_the_children_lower_their_share_into_the_pool_and_the_plans_are_the_same(tmp_path: Path) -> None:
    pool = ModelPool(tmp_path / "pool")
    assert parallel_lowering.lower_missing(pool, [*KEYS, KEYS[0]], workers=2) == 6  # a repeat counts once
    assert all(pool.has(*key) for key in KEYS)  # this process lowered 1, 3, 5; its child 2, 4, 6
    assert parallel_lowering.lower_missing(pool, KEYS, workers=2) == 0
    assert _children() == []
    by_child = pool.get("espcn", 2, SHAPE)
    here = lower_model("espcn", 2, SHAPE)
    assert by_child is not None and by_child.kernels == here.kernels and by_child.variables == here.variables


def test_a_child_past_its_time_is_killed_and_its_plans_left_to_the_caller(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(parallel_lowering, "CHILD_TIMEOUT_S", 0.0)
    pool = ModelPool(tmp_path / "pool")
    parallel_lowering.lower_missing(pool, KEYS[:4], workers=2)
    assert _children() == []  # stopped and reaped
    assert not list(pool.root.rglob(".tmp-*"))  # a child stopped mid-plan removed its folder
    assert pool.has(*KEYS[0]) and pool.has(*KEYS[2])  # this process's share
    assert [pool.get_or_lower(*key).batch for key in KEYS[:4]] == [1, 2, 3, 4]  # the caller's loads


def test_a_pool_with_its_own_lowering_lowers_in_this_process(tmp_path: Path) -> None:
    calls: list[PlanKey] = []

    def lower(model: str, batch: int, shape: tuple[int, ...]) -> KernelPlan:
        calls.append((model, batch, shape))
        return lower_model(model, batch, shape)

    pool = ModelPool(tmp_path / "pool", lower_fn=lower)
    assert parallel_lowering.lower_missing(pool, KEYS[:3], workers=3) == 3
    assert calls == KEYS[:3] and _children() == []


def test_a_plan_of_an_older_schema_counts_as_missing(tmp_path: Path) -> None:
    pool = ModelPool(tmp_path / "pool")
    pool.get_or_lower(*KEYS[0])
    saved = pool.path_for(*KEYS[0]) / PLAN_FILE
    saved.write_text(saved.read_text().replace(f'"schema_version": {SCHEMA_VERSION}', '"schema_version": 1'))
    assert not pool.has(*KEYS[0])
    assert parallel_lowering.lower_missing(pool, KEYS[:1]) == 1 and pool.has(*KEYS[0])
