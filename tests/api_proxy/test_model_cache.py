"""Shared weights (loaded once, kept alive, never freed under a kernel) and the assembled proxy memory."""

from __future__ import annotations

import threading

import pytest
import torch

from streambox.api_proxy.device_tensor import download_tensor, upload_tensor
from streambox.api_proxy.model_cache import ModelCache
from streambox.api_proxy.proxy_memory import MemoryOptions, ProxyMemory, ReclaimingAllocator
from streambox.device.emulated import EmulatedBackend
from streambox.device.specs import V100_16GB
from streambox.kernel_compiler.zoo import example_input, get_entry
from streambox.memory_pool.modes import PoolMode
from streambox.memory_pool.pool import DeviceMemoryPool, PoolConfig, PoolOutOfMemory

MiB = 1 << 20


def open_runtime(tmp_path, total: int):
    spec = V100_16GB.with_overrides(total_memory=total, context_create_s=0.0, context_memory=0)
    return EmulatedBackend(spec=spec, state_dir=tmp_path / "state", timeline=False).open_runtime(0)


@pytest.fixture
def runtime(tmp_path):
    rt = open_runtime(tmp_path, 1024 * MiB)
    yield rt
    rt.close()


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def plan_of(pool, name: str, batch: int = 1):
    return pool.get_or_lower(name, batch, get_entry(name).small_input_shape)


def run_once(mem, executor, model, name, stream, runtime, instance):
    plan = model.plan
    x = example_input(name, plan.batch, tuple(plan.input_shape))
    handle = upload_tensor(runtime, x, mem.allocate, stream)
    result = executor.run(model, {plan.inputs[0]: handle}, stream, instance=instance)
    got = download_tensor(runtime, result.outputs[plan.outputs[0]], stream)
    mem.free_many([handle.address, *(t.address for t in result.outputs.values())], stream)
    return x, got, result


def test_two_instances_share_weights_loaded_once(pool, zoo_model, runtime):
    from streambox.api_proxy.executor import PlanExecutor

    mem = DeviceMemoryPool(runtime)
    cache = ModelCache(runtime, mem)
    plan1 = plan_of(pool, "resnet18", 1)
    plan8 = plan_of(pool, "resnet18", 8)  # another batch size of the same model: same weights
    s1, s2 = runtime.create_stream(), runtime.create_stream()
    m1 = cache.acquire(plan1, s1)
    m2 = cache.acquire(plan8, s2)
    assert cache.loads == 1 and cache.users("resnet18") == 2
    assert {n: t.address for n, t in m1.weights.items()} == {n: t.address for n, t in m2.weights.items()}
    assert mem.demand_bytes == plan1.weight_bytes  # one copy
    executor = PlanExecutor(runtime, mem)
    results = {}

    def function(instance, model, stream):
        results[instance] = run_once(mem, executor, model, "resnet18", stream, runtime, instance)

    threads = [threading.Thread(target=function, args=a) for a in (("f1", m1, s1), ("f2", m2, s2))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for instance in ("f1", "f2"):
        x, got, _ = results[instance]
        with torch.no_grad():
            want = zoo_model("resnet18")(x)
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
    cache.release("resnet18", after=results["f1"][2].done)
    cache.release("resnet18", after=results["f2"][2].done)
    assert cache.users("resnet18") == 0
    cache.close()
    mem.drain()
    assert mem.demand_bytes == 0


def cache_on(pool, runtime, keep_alive_s: float):
    """A pool, a fake clock, a weight cache over them, resnet18's plan and a stream."""
    mem = DeviceMemoryPool(runtime)
    clock = Clock()
    cache = ModelCache(runtime, mem, keep_alive_s=keep_alive_s, clock=clock)
    return mem, clock, cache, plan_of(pool, "resnet18"), runtime.create_stream()


def test_keep_alive_then_release_and_reload(pool, runtime):
    mem, clock, cache, plan, s = cache_on(pool, runtime, keep_alive_s=30.0)
    cache.acquire(plan, s)
    s.synchronize()
    cache.release("resnet18")
    clock.now += 30.0
    assert cache.expire() == [] and mem.demand_bytes == plan.weight_bytes  # kept alive (strictly longer)
    clock.now += 0.5
    assert cache.expire() == ["resnet18"]
    assert mem.demand_bytes == 0 and cache.resident() == {} and cache.evictions == 1
    cache.acquire(plan, s)  # the next user loads it again
    assert cache.loads == 2 and mem.demand_bytes == plan.weight_bytes
    cache.release("resnet18")
    cache.close()


def test_pinned_weights_outlive_their_keep_alive_and_count_as_idle_from_the_unpin(pool, runtime):
    mem, clock, cache, plan, s = cache_on(pool, runtime, keep_alive_s=30.0)
    cache.acquire(plan, s)
    s.synchronize()
    cache.release("resnet18")
    cache.pin(True)  # a replay's warm-up: other workflows deploy meanwhile
    clock.now += 100.0
    assert cache.expire() == [] and mem.demand_bytes == plan.weight_bytes
    cache.pin(False)  # the replay's clock starts: idle from now
    clock.now += 30.0
    assert cache.expire() == []
    clock.now += 0.5
    assert cache.expire() == ["resnet18"] and mem.demand_bytes == 0
    cache.close()


def test_weights_are_never_freed_under_a_running_kernel(pool, runtime):
    from streambox.api_proxy.executor import PlanExecutor

    mem, clock, cache, plan, s = cache_on(pool, runtime, keep_alive_s=0.0)
    model = cache.acquire(plan, s)
    opened = threading.Event()
    runtime.launch(s, lambda: opened.wait(10), name="gate")  # the device is busy before the run
    x = upload_tensor(runtime, example_input("resnet18", 1, tuple(plan.input_shape)), mem.allocate, s)
    result = PlanExecutor(runtime, mem).run(model, {"x": x}, s)
    cache.release("resnet18", after=result.done)  # the user leaves when its run is done
    clock.now += 1e6
    assert cache.expire() == [] and cache.users("resnet18") == 1
    assert cache.evict_idle(1 << 40) == 0  # not even under memory pressure
    opened.set()
    result.done.synchronize()
    assert cache.users("resnet18") == 0  # the keep-alive counts from when the release is seen
    clock.now += 1.0
    assert cache.expire() == ["resnet18"]
    mem.free_many([x.address, *(t.address for t in result.outputs.values())], s)
    mem.drain()
    assert mem.demand_bytes == 0
    cache.close()


def test_out_of_memory_fails_one_request_and_the_next_succeeds(pool, tmp_path):
    rt = open_runtime(tmp_path, 256 * MiB)  # vgg16's 528 MB of weights cannot fit
    try:
        options = MemoryOptions(mode=PoolMode.FM, pool=PoolConfig(oom_wait_s=0.05))
        with ProxyMemory(rt, options) as pm:
            s = rt.create_stream()
            with pytest.raises(PoolOutOfMemory, match=r"requested \d+ bytes; \d+ bytes free in the pool"):
                pm.models.acquire(plan_of(pool, "vgg16"), s)
            assert pm.models.resident() == {} and pm.pool.demand_bytes == 0  # nothing half-loaded stays
            plan = plan_of(pool, "resnet18")
            x = upload_tensor(rt, example_input("resnet18", 1, tuple(plan.input_shape)), pm.pool.allocate, s)
            result = pm.infer("f1", plan, {"x": x}, s)
            result.done.synchronize()
            pm.pool.free_many([x.address, *(t.address for t in result.outputs.values())], s)
        assert rt.allocated_bytes() == 0
    finally:
        rt.close()


def test_idle_weights_are_evicted_under_memory_pressure(pool, tmp_path):
    rt = open_runtime(tmp_path, 64 * MiB)
    try:
        mem = DeviceMemoryPool(rt, PoolConfig(oom_wait_s=0.05))
        allocator = ReclaimingAllocator(mem)
        cache = ModelCache(rt, allocator, keep_alive_s=3600.0)
        allocator.reclaimers.append(cache.evict_idle)
        s = rt.create_stream()
        plan = plan_of(pool, "resnet18")  # 45 MB of weights
        cache.acquire(plan, s)
        s.synchronize()
        cache.release("resnet18")
        big = allocator.allocate(40 * MiB, s)  # fits only once the idle weights go
        assert cache.resident() == {} and cache.evictions == 1
        mem.free(big, s)
        cache.close()
        mem.close()
    finally:
        rt.close()


@pytest.mark.parametrize("mode", ["static", "fm", "fm+rs"])
def test_proxy_memory_runs_concurrent_functions_and_gives_every_byte_back(mode, pool, zoo_model, runtime):
    from streambox.api_proxy.profiling import profile_on_device

    names = [("resnet18", 1), ("text_encoder", 8)]
    profiles = [profile_on_device(pool, runtime, n, b, get_entry(n).small_input_shape) for n, b in names]
    options = MemoryOptions(mode=PoolMode.parse(mode), keep_alive_s=0.0, t_interval_s=0.004)
    errors = []
    asked = []

    def profile_for(plan):  # the second model's profile is found on first use
        asked.append(plan.model)
        return profiles[1] if plan.model == "text_encoder" else None

    with ProxyMemory(runtime, options, profiles=profiles[:1], profile_for=profile_for) as pm:

        def function(index, name, batch):
            plan = plan_of(pool, name, batch)
            s = runtime.create_stream()
            x = example_input(name, batch, tuple(plan.input_shape))
            with torch.no_grad():
                want = zoo_model(name)(x)
            for _ in range(3):
                handle = upload_tensor(runtime, x, pm.pool.allocate, s)
                result = pm.infer(f"f{index}", plan, {plan.inputs[0]: handle}, s)
                got = download_tensor(runtime, result.outputs[plan.outputs[0]], s)
                pm.pool.free_many([handle.address, *(t.address for t in result.outputs.values())], s)
                try:
                    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
                except AssertionError as exc:
                    errors.append(exc)

        threads = [threading.Thread(target=function, args=(i, n, b)) for i, (n, b) in enumerate(names * 2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert errors == []
        assert pm.models.loads >= 2
        if mode == "fm+rs":
            assert pm.scaler is not None and len(pm.scaler.decisions) > 0 and pm.timing.period_s == 0.005
            assert asked == ["text_encoder"] and ("text_encoder", 8) in pm.scaler.profiles
    assert runtime.allocated_bytes() == 0


@pytest.mark.parametrize("daemon_mode", ["streambox", "stream-only"])
def test_weights_load_through_the_io_daemon_and_runs_stay_exact(daemon_mode, pool, zoo_model, runtime):
    """Every load's weight bytes go through the daemon (queue `weights:<model>`), a run that meets a
    load still in flight waits per layer, and the outputs are those of eager torch."""
    from streambox.api_proxy.model_cache import weights_queue
    from streambox.io_daemon import DaemonConfig, IODaemon

    config = DaemonConfig() if daemon_mode == "streambox" else DaemonConfig.stream_only()
    # BT off and small blocks: a load takes many blocks, so runs often meet it mid-flight.
    if daemon_mode == "streambox":
        config = DaemonConfig.ablation(rz=False, bt=False)
    plan = plan_of(pool, "resnet18", 1)
    x = example_input("resnet18", 1, tuple(plan.input_shape))
    with torch.no_grad():
        want = zoo_model("resnet18")(x)
    io = IODaemon(runtime, config)
    options = MemoryOptions(mode=PoolMode.FM, keep_alive_s=0.0)
    pipelined = 0
    try:
        with ProxyMemory(runtime, options, daemon=io) as pm:
            acquire = pm.models.acquire_pipelined

            def counting(plan, stream):
                nonlocal pipelined
                model, hook = acquire(plan, stream)
                pipelined += hook is not None
                return model, hook

            pm.models.acquire_pipelined = counting
            stream = runtime.create_stream()
            for _ in range(3):
                pm.models.expire()  # keep-alive 0: the weights go after each run, the next one loads again
                handle = upload_tensor(runtime, x, pm.pool.allocate, stream)
                result = pm.infer("f", plan, {plan.inputs[0]: handle}, stream)
                got = download_tensor(runtime, result.outputs[plan.outputs[0]], stream)
                pm.pool.free_many([handle.address, *(t.address for t in result.outputs.values())], stream)
                torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
                stream.synchronize()
            loads = pm.models.loads
    finally:
        io.close()
    assert loads >= 3
    assert io.stats.nbytes == loads * plan.weight_bytes  # only weights went through it, each byte once
    assert io.stats.requests == loads * len(plan.weight_names)
    if daemon_mode == "streambox":
        assert {b.function for b in io.trace} == {weights_queue("resnet18")}
        assert sum(b.nbytes for b in io.trace) == loads * plan.weight_bytes
    else:
        assert pipelined == 0  # direct copies are issued at once: nothing to wait for per layer
    assert runtime.allocated_bytes() == 0


def test_hold_issued_lets_a_thread_that_must_not_block_wait_elsewhere(pool, zoo_model, runtime):
    """`would_block` says whether an acquire would wait for the daemon (never blocking itself);
    `hold_issued` (a helper thread's call) loads the model and returns once every copy is issued,
    holding one user; the acquire after it does not block and the run is exact."""
    from streambox.io_daemon import DaemonConfig, IODaemon

    plan = plan_of(pool, "resnet18", 1)
    x = example_input("resnet18", 1, tuple(plan.input_shape))
    with torch.no_grad():
        want = zoo_model("resnet18")(x)
    gate = threading.Event()
    io = IODaemon(runtime, DaemonConfig.ablation(rz=False, bt=False))
    issue = io._issue

    def gated(block, batch_no):
        gate.wait(60)
        issue(block, batch_no)

    io._issue = gated
    try:
        with ProxyMemory(runtime, MemoryOptions(mode=PoolMode.FM), daemon=io) as pm:
            assert pm.models.would_block(plan)  # not resident
            holder = threading.Thread(target=pm.models.hold_issued, args=(plan,))
            holder.start()
            while "resnet18" not in pm.models.resident():
                holder.join(0.01)
            assert holder.is_alive() and pm.models.would_block(plan)  # loading, nothing issued yet
            gate.set()
            holder.join(60)
            assert not holder.is_alive()
            assert not pm.models.would_block(plan) and pm.models.users("resnet18") == 1
            stream = runtime.create_stream()
            handle = upload_tensor(runtime, x, pm.pool.allocate, stream)
            result = pm.infer("f", plan, {plan.inputs[0]: handle}, stream)
            got = download_tensor(runtime, result.outputs[plan.outputs[0]], stream)
            pm.pool.free_many([handle.address, *(t.address for t in result.outputs.values())], stream)
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
            pm.models.release("resnet18")
            stream.synchronize()
            assert pm.models.users("resnet18") == 0 and pm.models.loads == 1
    finally:
        gate.set()
        del io._issue
        io.close()
    assert runtime.allocated_bytes() == 0
