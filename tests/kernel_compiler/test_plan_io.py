from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import nn

from streambox.kernel_compiler.lowering import lower_module
from streambox.kernel_compiler.plan import PLAN_FILE, SCHEMA_VERSION, WEIGHTS_FILE, KernelPlan


def _tiny_plan() -> KernelPlan:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU(), nn.MaxPool2d(2), nn.Flatten())
    return lower_module(model, torch.rand(1, 3, 8, 8), "tiny_cnn")


def test_save_load_round_trip(tmp_path: Path) -> None:
    plan = _tiny_plan()
    plan.save(tmp_path)
    loaded = KernelPlan.load(tmp_path)
    assert loaded == plan  # dataclass equality over every serialised field
    original, restored = plan.load_weights(), loaded.load_weights()
    assert original.keys() == restored.keys() == set(plan.weight_names)
    for name, w in original.items():
        assert torch.equal(w, restored[name]) and restored[name].is_contiguous()
    assert loaded.load_weights([plan.weight_names[0]]).keys() == {plan.weight_names[0]}
    # Saving a loaded plan again gives the same JSON.
    loaded.save(tmp_path / "again")
    assert (tmp_path / "again" / PLAN_FILE).read_text() == (tmp_path / PLAN_FILE).read_text()


def test_plan_json_schema(tmp_path: Path) -> None:
    plan = _tiny_plan()
    plan.save(tmp_path)
    doc = json.loads((tmp_path / PLAN_FILE).read_text())
    assert {
        "schema_version",
        "model",
        "batch",
        "input_shape",
        "input_dtype",
        "variables",
        "kernels",
        "inputs",
        "outputs",
    } <= doc.keys()
    assert doc["schema_version"] == SCHEMA_VERSION
    assert doc["batch"] == 1 and doc["input_shape"] == [3, 8, 8] and doc["input_dtype"] == "float32"
    kinds = {v["kind"] for v in doc["variables"]}
    assert kinds == {"input", "weight", "intermediate", "output", "view"}
    ops = {k["op"] for k in doc["kernels"]}
    assert {"aten.convolution.out", "aten.max_pool2d_with_indices.out"} <= ops
    assert (tmp_path / WEIGHTS_FILE).stat().st_size >= plan.weight_bytes
