"""The four systems of the paper's Table 2, each replaying Traffic in timed mode through the replay's
own target (`WorkflowTarget`: start = deploy, send = one real request, sample = what the sampler
reads), checked for what makes each one itself rather than for speed."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from streambox.comm.baselines import CudaIpcModel, RedisServer
from streambox.replay.systems import WorkflowTarget, load_workflow
from streambox.replay.target import SystemRequest, resolve_system

REQUESTS = 2
FUNCTION_NAMES = list(load_workflow("traffic", small=True)[0].functions)
FUNCTIONS = len(FUNCTION_NAMES)
# Nothing expires within the run; timed: GPU time is modelled (the replay's default, said here too).
OPTIONS = {"keep_alive_s": "60", "device_mode": "timed"}

# Four deploys: about a minute of CPU, minutes of wall on a busy machine (the fixture's time counts
# against the first test's limit).
pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]


async def _replay(system: str) -> dict[str, Any]:
    """Deploy, send REQUESTS requests one after another, and read what the run shows."""
    target = resolve_system(system, SystemRequest(system, ("traffic",), options=OPTIONS))
    assert isinstance(target, WorkflowTarget)
    await target.start()
    try:
        after_deploy = target.sample()
        outcomes = [await target.send("traffic", {"request_id": i}) for i in range(REQUESTS)]
        invoker = target._engine.invoker  # type: ignore[union-attr]
        refresh = getattr(invoker, "refresh_stats", None)
        if refresh is not None:
            await refresh()
        seen = {
            "after_deploy": after_deploy,
            "outcomes": outcomes,
            "sample": target.sample(),
            "settings": target.describe()["settings"],
            "invoker": invoker.describe() if hasattr(invoker, "describe") else {},
        }
        if hasattr(invoker, "last_stats"):
            seen["proxies"] = list(invoker.last_stats().values())
        return seen
    finally:
        await target.close()


@pytest.fixture(scope="module")
def runs() -> dict[str, dict[str, Any]]:
    why = RedisServer.why_unavailable()
    if why is not None:
        pytest.skip(f"infless needs Redis: {why}")
    return {s: asyncio.run(_replay(s)) for s in ("streambox", "stream-only", "infless", "astraea")}


def test_every_system_answers_every_request(runs: dict[str, dict[str, Any]]) -> None:
    for system, run in runs.items():
        assert [o.status for o in run["outcomes"]] == ["ok"] * REQUESTS, (system, run["outcomes"])
        assert run["settings"]["device"]["device_mode"] == "timed"


@pytest.mark.parametrize("system", ["streambox", "stream-only"])
def test_the_proxies_share_one_runtime(runs: dict[str, dict[str, Any]], system: str) -> None:
    run = runs[system]
    sample = run["sample"]
    assert sample["runtimes"] == 1.0  # every function instance is a stream of the proxy's runtime
    assert sample["instances"] >= FUNCTIONS
    assert "mps_clients" not in sample  # PTB partitioning inside one context, not MPS
    (stats,) = run["proxies"]
    assert stats["partitioning"]["mode"] == "enforced"  # the emulated device holds kernels to cu_cap


def test_streambox_runs_its_own_mechanisms(runs: dict[str, dict[str, Any]]) -> None:
    (stats,) = runs["streambox"]["proxies"]
    settings = stats["settings"]
    assert settings["pool_mode"] == "fm+rs"  # auto-scaling memory pool
    assert settings["io_daemon"] is True  # PCIe sharing through the IO daemon
    assert settings["pa"] is True and settings["am"] is True  # the elastic communication store
    assert stats["store"]["kind"] == "managed" and stats["store"]["puts"] > 0  # direct access
    profiles = stats["profiles"]  # Algorithm 1 had a profile for every function that ran
    assert profiles["unprofiled_runs"] == 0 and profiles["profiled_runs"] > 0, profiles
    assert runs["streambox"]["sample"]["unprofiled_runs"] == 0


def test_stream_only_is_runtime_sharing_alone(runs: dict[str, dict[str, Any]]) -> None:
    (stats,) = runs["stream-only"]["proxies"]
    settings = stats["settings"]
    assert settings["pool_mode"] == "static"  # a static caching pool
    assert settings["io_daemon"] is False  # FIFO copies, no PCIe sharing
    # CUDA-IPC style data passing with no managed store: a PUT copies into a device allocation
    # outside the pool (comm/ipc_store.py); Traffic's crops went through it.
    store = stats["store"]
    assert store["kind"] == "ipc" and store["puts"] > 0 and store["device_allocs"] > 0, store


@pytest.mark.parametrize("system", ["infless", "astraea"])
def test_per_instance_systems_run_a_runtime_and_an_mps_share_per_instance(
    runs: dict[str, dict[str, Any]], system: str
) -> None:
    run = runs[system]
    for sample in (run["after_deploy"], run["sample"]):
        # Pre-warmed: one instance per function is up before the first request, each its own
        # process and runtime (context), each an MPS client.
        assert sample["instances"] >= FUNCTIONS
        assert sample["runtimes"] == sample["instances"] == sample["mps_clients"]
        assert sample["memory.context_bytes"] > 0
    assert not any(o.cold_start for o in run["outcomes"])  # the pre-warmed instances took the calls
    assert run["settings"]["prewarm"] == 1
    # The MPS share each instance ran with is recorded (config.json said null): an equal third each.
    assert run["invoker"]["gpu_percent_by_function"] == {"traffic": dict.fromkeys(FUNCTION_NAMES, 33)}


def test_infless_passes_data_through_redis(runs: dict[str, dict[str, Any]]) -> None:
    invoker = runs["infless"]["invoker"]
    assert invoker["func_ipc"] == "redis" and invoker["redis_version"]  # a real redis-server answered
    assert "ipc_opened" not in runs["infless"]["sample"]


def test_astraea_passes_handles_and_caches_data_in_gpu_memory(runs: dict[str, dict[str, Any]]) -> None:
    invoker = runs["astraea"]["invoker"]
    assert invoker["func_ipc"] == "cuda-ipc" and invoker["redis_version"] is None  # no Redis
    assert invoker["cuda_ipc_model"] == CudaIpcModel().label  # the modelled costs, labelled
    sample = runs["astraea"]["sample"]
    # Every request's detections went to their consumers by handle: exported by the producer,
    # opened by each consumer, held in the producer's GPU memory meanwhile.
    assert sample["ipc_exported"] >= REQUESTS and sample["ipc_opened"] >= sample["ipc_exported"]
    assert sample["ipc_cached_peak_bytes"] > 0
