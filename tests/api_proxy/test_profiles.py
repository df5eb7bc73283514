"""Offline profiles for Algorithm 1: computed for the device, cached in the model pool, used by the
proxy memory's scaler; a run without one is counted and its reason logged once."""

from __future__ import annotations

import json
import logging
import threading
from functools import partial

import pytest

from streambox.api_proxy.device_tensor import upload_tensor
from streambox.api_proxy.executor import PlanExecutor
from streambox.api_proxy.profiling import NoProfile, device_profile, measure_plan_on_device, measured_source
from streambox.api_proxy.proxy_memory import MemoryOptions, ProxyMemory
from streambox.device.emulated import EmulatedBackend
from streambox.device.specs import V100_16GB, GiB
from streambox.kernel_compiler.cost_model import preset_for_device
from streambox.kernel_compiler.model_pool import PROFILE_FILE
from streambox.kernel_compiler.zoo import example_input, get_entry
from streambox.memory_pool.modes import PoolMode

SPEC = V100_16GB.with_overrides(total_memory=2 * GiB, context_create_s=0.0, context_memory=0)
MODEL = "resnet18"


@pytest.fixture
def runtime(tmp_path):
    backend = EmulatedBackend(spec=SPEC, count=1, state_dir=tmp_path / "state", timeline=False)
    with backend.open_runtime(0) as rt:
        yield rt


@pytest.fixture
def plan(pool):
    return pool.get_or_lower(MODEL, 1, get_entry(MODEL).small_input_shape)


def test_the_device_profile_has_the_plans_kernel_times_and_is_cached_in_the_model_pool(pool, plan, runtime):
    name = runtime.properties().name
    preset = preset_for_device(name)
    assert preset is not None, name
    profile = device_profile(pool, plan, name)
    assert profile.runtime_s == plan.kernel_seconds(preset) and profile.runtime_source == preset
    assert len(profile.runtime_s) == len(profile.kernels) and sum(profile.runtime_s) > 0
    stored = json.loads((pool.path_for(MODEL, 1, tuple(plan.input_shape)) / PROFILE_FILE).read_text())
    assert stored["runtime_s"] == profile.runtime_s and stored["runtime_source"] == preset
    # Another device's preset replaces the times; a device no preset models has none to give.
    other = device_profile(pool, plan, "NVIDIA H100 80GB HBM3")
    assert other.runtime_source == "h100-80gb" and other.runtime_s != profile.runtime_s
    with pytest.raises(NoProfile, match="no cost-model preset models device 'Toaster 3000'"):
        device_profile(pool, plan, "Toaster 3000")
    # ... unless its times were measured there.
    stored = pool.profile(MODEL, 1, tuple(plan.input_shape))
    stored.runtime_s, stored.runtime_source = [1e-3] * len(stored.kernels), measured_source("Toaster 3000")
    pool.store_profile(stored)
    assert device_profile(pool, plan, "Toaster 3000").runtime_s == stored.runtime_s


def _run(memory: ProxyMemory, plan, runtime, times: int) -> None:
    stream = runtime.create_stream()
    x = example_input(MODEL, 1, tuple(plan.input_shape))
    for _ in range(times):
        handle = upload_tensor(runtime, x, memory.pool.allocate, stream)
        result = memory.infer("f0", plan, {plan.inputs[0]: handle}, stream)
        memory.pool.free_many([handle.address, *(t.address for t in result.outputs.values())], stream)
    stream.synchronize()
    stream.destroy()


@pytest.mark.parametrize("profiles", [True, False])
def test_the_scaler_runs_with_profiles_unless_they_are_off(profiles, pool, plan, runtime, caplog):
    options = MemoryOptions(mode=PoolMode.FM_RS, keep_alive_s=0.0, t_interval_s=0.004, profiles=profiles)
    profile_for = partial(device_profile, pool, device_name=runtime.properties().name)
    caplog.set_level(logging.WARNING, logger="streambox.api_proxy.proxy_memory")
    with ProxyMemory(runtime, options, profile_for=profile_for) as memory:
        _run(memory, plan, runtime, 3)
        stats = memory.profile_stats()
        assert memory.scaler is not None
        logged = [r.getMessage() for r in caplog.records if r.name == "streambox.api_proxy.proxy_memory"]
        if profiles:
            assert (MODEL, 1) in memory.scaler.profiles
            assert stats["profiled"] == [f"{MODEL}@1"] and stats["unprofiled"] == {}
            assert (stats["profiled_runs"], stats["unprofiled_runs"]) == (3, 0)
            assert logged == []
        else:
            assert memory.scaler.profiles == {}
            assert stats["unprofiled"] == {f"{MODEL}@1": "profiles are off (memory.profiles=false)"}
            assert (stats["profiled_runs"], stats["unprofiled_runs"]) == (0, 3)
            assert logged == [f"{MODEL} (batch 1) runs unprofiled: profiles are off (memory.profiles=false)"]


def test_a_device_without_run_times_runs_unprofiled_and_says_why(pool, plan, runtime):
    options = MemoryOptions(mode=PoolMode.FM_RS, keep_alive_s=0.0, t_interval_s=0.004)
    profile_for = partial(device_profile, pool, device_name="Toaster 4000")
    with ProxyMemory(runtime, options, profile_for=profile_for) as memory:
        assert memory.ensure_profile(plan) is False
        _run(memory, plan, runtime, 1)
        stats = memory.profile_stats()
    assert "Toaster 4000" in stats["unprofiled"][f"{MODEL}@1"] and stats["unprofiled_runs"] == 1


def test_a_measured_run_is_issued_whole_while_its_stream_is_held(pool, runtime):
    """gpu_check holds the stream behind a gate while the host issues a profiled run, so that the events
    time kernels and not the host's issuing: the measuring pool must never make the host wait for the
    device (it grows instead). The first H200 run's pool waited for its own frees mid-issue, so resnet50
    measured 33 ms against resnet18's 1 ms. Here a host gate holds the emulated stream; a wait would
    last until the gate's timeout."""
    gate_timeout_s = 5.0
    issue_seconds: list[float] = []

    class HeldExecutor(PlanExecutor):
        def run(self, model, inputs, stream, **options):  # type: ignore[no-untyped-def]
            gate = threading.Event()
            self.runtime.launch(stream, lambda: gate.wait(gate_timeout_s), name="gate")
            result = super().run(model, inputs, stream, **options)
            issue_seconds.append(result.stats.issue_seconds)  # a wait would last the gate's timeout
            gate.set()
            return result

    plan = pool.get_or_lower("espcn", 1)  # the zoo's full input: tens of MB of frees per run
    seconds = measure_plan_on_device(runtime, plan, repeats=2, executor=HeldExecutor)
    assert len(issue_seconds) == 3 and max(issue_seconds) < gate_timeout_s / 2, issue_seconds
    assert len(seconds) == len(plan.kernels) and sum(seconds) > 0
