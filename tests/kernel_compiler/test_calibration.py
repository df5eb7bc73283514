"""Calibration tables: measured through gpu-check's own measuring step (here on the emulated device's
CPU), stored beside the plan, read back, overriding the cost model; bad tables fail with their file."""

from __future__ import annotations

import json

import pytest

from streambox.device.emulated import EmulatedBackend
from streambox.device.specs import V100_16GB, GiB
from streambox.gpu_check import calibrate, compare, table_key
from streambox.kernel_compiler.calibration import (
    CalibrationError,
    CalibrationTable,
    calibration_path,
    read_calibration,
    write_calibration,
)
from streambox.kernel_compiler.model_pool import ModelPool
from streambox.kernel_compiler.plan import KernelPlan

SPEC = V100_16GB.with_overrides(total_memory=2 * GiB, context_create_s=0.0, context_memory=0)
MODEL, SHAPE = "text_encoder", (16,)


@pytest.fixture
def own_pool(tmp_path, pool) -> ModelPool:
    """A pool of its own (tables are written into it) that reuses the session's lowering."""
    return ModelPool(tmp_path / "pool", lower_fn=pool._lower)


@pytest.fixture
def runtime(tmp_path):
    backend = EmulatedBackend(spec=SPEC, count=1, state_dir=tmp_path / "state")
    with backend.open_runtime(0) as rt:
        yield rt


def test_a_measured_table_is_stored_beside_the_plan_and_overrides_the_model(own_pool, runtime) -> None:
    modelled = own_pool.get_or_lower(MODEL, 1, SHAPE).kernel_seconds("v100-16gb")
    table = calibrate(own_pool, runtime, MODEL, 1, SHAPE, preset="v100-16gb", repeats=1)

    path = calibration_path(own_pool.path_for(MODEL, 1, SHAPE), "v100-16gb")
    assert path.exists()
    stored = json.loads(path.read_text())
    assert (stored["device"], stored["backend"], stored["preset"]) == (SPEC.name, "emulated", "v100-16gb")

    plan = own_pool.get_or_lower(MODEL, 1, SHAPE)  # a fresh load sees the table
    assert plan.kernel_seconds("v100-16gb") == table.seconds != modelled
    assert len(table.seconds) == len(plan.kernels)
    assert all(s == 0.0 for s, k in zip(table.seconds, plan.kernels, strict=True) if k.kind == "view")
    assert all(s > 0.0 for s, k in zip(table.seconds, plan.kernels, strict=True) if k.kind == "compute")
    # Other presets keep the model.
    assert plan.kernel_seconds("h100-80gb") == KernelPlan.load(plan._dir).kernel_seconds("h100-80gb")
    assert read_calibration(plan, "h100-80gb") is None

    check = compare(own_pool, table)
    assert check.measured_ms == pytest.approx(sum(table.seconds) * 1e3)
    assert check.modelled_ms == pytest.approx(sum(modelled) * 1e3)
    assert check.error == pytest.approx((check.modelled_ms - check.measured_ms) / check.measured_ms)


def _table(plan: KernelPlan, **changes) -> CalibrationTable:
    fields = dict(
        preset="v100-16gb",
        device="Tesla V100-PCIE-16GB",
        backend="cuda",
        model=plan.model,
        batch=plan.batch,
        input_shape=list(plan.input_shape),
        kernels=[k.name for k in plan.kernels],
        seconds=[1e-4 * (i + 1) for i in range(len(plan.kernels))],
    )
    return CalibrationTable(**{**fields, **changes})


def test_a_table_for_another_lowering_is_refused_with_its_file(own_pool) -> None:
    plan = own_pool.get_or_lower(MODEL, 1, SHAPE)
    path = write_calibration(plan._dir, _table(plan, kernels=[k.name for k in plan.kernels][:-1] + ["gone"]))
    message = rf"{path}: field kernels does not match .*first difference at index"
    with pytest.raises(CalibrationError, match=message):
        KernelPlan.load(plan._dir).kernel_seconds("v100-16gb")


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda d: d.update(seconds=d["seconds"][:-1]), "seconds for"),
        (lambda d: d["seconds"].__setitem__(2, -1.0), r"field seconds\[2\] is -1.0; allowed: a finite"),
        (lambda d: d.update(schema_version=7), "field schema_version is 7"),
        (lambda d: d.update(colour="red"), r"unknown fields \['colour'\]"),
        (lambda d: d.pop("kernels"), r"missing fields \['kernels'\]"),
    ],
)
def test_malformed_tables_name_the_file_and_field(own_pool, edit, message) -> None:
    plan = own_pool.get_or_lower(MODEL, 1, SHAPE)
    path = write_calibration(plan._dir, _table(plan))
    doc = json.loads(path.read_text())
    edit(doc)
    path.write_text(json.dumps(doc))
    with pytest.raises(CalibrationError, match=message):
        KernelPlan.load(plan._dir).kernel_seconds("v100-16gb")


def test_tables_are_keyed_by_the_devices_preset() -> None:
    assert table_key("NVIDIA H100 80GB HBM3") == "h100-80gb"
    assert table_key("Tesla V100-SXM2-16GB") == "v100-16gb"
    assert table_key("NVIDIA A100-SXM4-40GB") == "nvidia-a100-sxm4-40gb"  # no preset: a slug, no model


@pytest.mark.gpu
def test_on_a_gpu_the_gate_times_kernels_not_the_hosts_issuing(own_pool) -> None:
    from streambox.api_proxy.profiling import profile_on_device
    from streambox.gpu_check import _open_gpu, measure_kernel_seconds

    backend, why = _open_gpu()
    if backend is None:
        pytest.skip(f"no GPU: {why}")
    plan = own_pool.get_or_lower("resnet18", 1)
    with backend.open_runtime(0) as runtime:
        gated = measure_kernel_seconds(runtime, plan, repeats=3)
        # The plain executor's profiled run: its events also catch the gaps while the host issues.
        ungated = profile_on_device(own_pool, runtime, "resnet18", 1, repeats=3, force=True).runtime_s
    assert ungated is not None and len(gated) == len(ungated) == len(plan.kernels)
    assert all(s > 0 for s, k in zip(gated, plan.kernels, strict=True) if k.kind == "compute")
    assert sum(gated) < sum(ungated)


def test_the_checks_measuring_step_stores_a_table_per_model_and_reports_the_error(own_pool, tmp_path) -> None:
    """gpu-check's step 2 as it runs on a GPU, here on the emulated V100 (its CPU times)."""
    from streambox.gpu_check import calibrate_models

    with EmulatedBackend(spec=SPEC, count=1, state_dir=tmp_path / "state2") as backend:
        report = calibrate_models(backend, own_pool, ["espcn", "text_encoder"], repeats=1)
    assert report["device"] == SPEC.name and report["preset"] == "v100-16gb"
    for row in report["models"]:
        plan = own_pool.get_or_lower(row["model"], 1)
        table = read_calibration(plan, "v100-16gb")
        assert table is not None and report["calibration"][row["model"]]["seconds"] == table.seconds
        assert row["measured_ms"] == pytest.approx(table.total_seconds * 1e3)
        assert row["error"] == pytest.approx((row["modelled_ms"] - row["measured_ms"]) / row["measured_ms"])
