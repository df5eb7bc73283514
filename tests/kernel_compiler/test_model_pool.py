from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from streambox.kernel_compiler.calibration import CALIBRATION_DIR
from streambox.kernel_compiler.lowering import lower_model
from streambox.kernel_compiler.model_pool import ModelPool, PoolEntry, default_root
from streambox.kernel_compiler.plan import PLAN_FILE, SCHEMA_VERSION, KernelPlan

SHAPE = (3, 16, 16)


class CountingLower:
    def __init__(self) -> None:
        self.calls: list[tuple[str, int, tuple[int, ...]]] = []

    def __call__(self, model: str, batch: int, shape: tuple[int, ...]) -> KernelPlan:
        self.calls.append((model, batch, shape))
        return lower_model(model, batch, shape)


@pytest.mark.parametrize(
    ("batch", "shape"), [(0, SHAPE), (-1, SHAPE), (True, SHAPE), (1, (3, 0, 16)), (1, (3, -16, 16))]
)
def test_a_batch_or_dimension_below_one_is_refused_before_lowering(tmp_path: Path, batch, shape) -> None:
    """A batch of 0 lowered to a plan of empty tensors and was written into the pool."""
    lower = CountingLower()
    with pytest.raises(ValueError, match="must be a positive integer"):
        ModelPool(tmp_path, lower_fn=lower).get_or_lower("espcn", batch, shape)
    assert lower.calls == [] and not (tmp_path / "espcn").exists()


def test_lowers_once_and_lists(tmp_path: Path) -> None:
    lower = CountingLower()
    pool = ModelPool(tmp_path, lower_fn=lower)
    assert pool.get("espcn", 1, SHAPE) is None
    first = pool.get_or_lower("espcn", 1, SHAPE)
    second = pool.get_or_lower("espcn", 1, SHAPE)
    third = ModelPool(tmp_path, lower_fn=lower).get_or_lower("espcn", 1, SHAPE)  # a fresh process's view
    assert lower.calls == [("espcn", 1, SHAPE)]
    assert first == second == third
    path = tmp_path / "espcn" / "b1_3x16x16"
    assert pool.path_for("espcn", 1, SHAPE) == path
    assert pool.list() == [PoolEntry("espcn", 1, SHAPE, path)]
    assert not [p for p in (tmp_path / "espcn").iterdir() if p.name.startswith(".")]  # no temp left
    profile = pool.profile("espcn", 1, SHAPE)
    assert profile.model == "espcn" and len(profile.kernels) == len(first.kernels)
    assert len(lower.calls) == 1


def test_default_shape_comes_from_the_zoo(tmp_path: Path) -> None:
    pool = ModelPool(tmp_path)
    assert pool.path_for("text_encoder", 4) == tmp_path / "text_encoder" / "b4_64"


def test_lost_race_keeps_the_winner(tmp_path: Path) -> None:
    """Another process finishes the same key while we lower: our rename fails, theirs stays."""
    winner = ModelPool(tmp_path)

    def slow_lower(model: str, batch: int, shape: tuple[int, ...]) -> KernelPlan:
        winner.get_or_lower(model, batch, shape)  # the other process, finishing first
        plan = lower_model(model, batch, shape)
        plan.meta["loser"] = True
        return plan

    plan = ModelPool(tmp_path, lower_fn=slow_lower).get_or_lower("espcn", 1, SHAPE)
    assert "loser" not in plan.meta
    assert [e.model for e in winner.list()] == ["espcn"]
    assert not [p for p in (tmp_path / "espcn").iterdir() if p.name.startswith(".")]


def test_default_root_from_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("STREAMBOX_MODEL_POOL", str(tmp_path))
    assert default_root() == tmp_path and ModelPool().root == tmp_path
    monkeypatch.delenv("STREAMBOX_MODEL_POOL")
    assert default_root() == Path(os.path.expanduser("~")) / ".cache" / "streambox" / "model_pool"


def test_a_plan_of_an_older_schema_is_lowered_again_keeping_its_calibration(tmp_path: Path) -> None:
    lower = CountingLower()
    pool = ModelPool(tmp_path, lower_fn=lower)
    path = pool.get_or_lower("espcn", 1, SHAPE) and pool.path_for("espcn", 1, SHAPE)
    doc = json.loads((path / PLAN_FILE).read_text())
    (path / PLAN_FILE).write_text(json.dumps({**doc, "schema_version": SCHEMA_VERSION - 1}))
    (path / CALIBRATION_DIR).mkdir()
    (path / CALIBRATION_DIR / "h100-80gb.json").write_text("{}")
    plan = pool.get_or_lower("espcn", 1, SHAPE)
    assert plan.schema_version == SCHEMA_VERSION and len(lower.calls) == 2
    assert (path / CALIBRATION_DIR / "h100-80gb.json").read_text() == "{}"
    assert [p.name for p in (tmp_path / "espcn").iterdir()] == [path.name]  # nothing stale left


def test_plans_of_one_model_share_its_weights_file(tmp_path: Path) -> None:
    """Each new (batch, shape) used to store a full copy of the model's weights."""
    pool = ModelPool(tmp_path)
    keys = ((1, SHAPE), (2, SHAPE), (1, (3, 20, 20)))
    plans = [pool.get_or_lower("espcn", batch, shape) for batch, shape in keys]
    files = [pool.path_for("espcn", batch, shape) / "weights.safetensors" for batch, shape in keys]
    assert len({f.stat().st_ino for f in files}) == 1 and files[0].stat().st_nlink == 3
    for plan, path in zip(plans, [f.parent for f in files], strict=True):  # each still loads as written
        loaded, wrote = KernelPlan.load(path).load_weights(), plan.load_weights()
        assert loaded.keys() == wrote.keys() and all(loaded[k].equal(wrote[k]) for k in wrote)
