"""A node of several GPUs, end to end through a real proxy (functional mode, real bytes).

The proxy runs on GPU 0 of a 4-GPU node. After a function PUTs 16 MiB, another job fills GPU 0
(pressure), GPU 1 almost fully and GPU 2 half: with AM the store moves the data to the
least-pressured neighbour (GPU 3) over the peer link, and the next GET is a peer copy back whose
bytes are the PUT's; with `am=off` the data goes to host memory and the GET is a host-to-device copy.
"""

from __future__ import annotations

import asyncio
import textwrap

import pytest

from streambox.api_proxy.control import launch_proxy
from streambox.api_proxy.keepalive import Admission, WarmProxies
from streambox.api_proxy.node_gpus import neighbour_indices
from streambox.api_proxy.proxy_config import ProxyConfig, ProxyFunction
from streambox.config import Config
from streambox.device.emulated import EmulatedBackend
from streambox.device.specs import MiB, preset
from streambox.workflows import parse_spec
from streambox.workflows.proxy_invoker import ProxyInvoker

GPUS = 4
ITEM = 16 * MiB
KEY = "nodegpus/blob"

HANDLERS = textwrap.dedent(
    f"""
    import torch
    import streambox

    @streambox.function()
    def produce(ctx, event):
        x = ctx.upload(torch.arange({ITEM // 4}, dtype=torch.int32))
        ctx.put({KEY!r}, x, consumers=1)
        return {{}}

    @streambox.function()
    def consume(ctx, event):
        x = ctx.download(ctx.get({KEY!r}))
        return {{"n": x.numel(), "probe": x[::1 << 20].tolist(), "last": int(x[-1])}}
    """
)


def _proxy(root, am: bool) -> object:
    (root / "nodegpus_handlers.py").write_text(HANDLERS)
    functions = tuple(
        ProxyFunction(name, f"nodegpus_handlers:{name}") for name in ("produce", "consume")
    )
    config = ProxyConfig(
        workflow="nodegpus", functions=functions, sys_path=(str(root),), state_dir=str(root / "state"),
        prefork=0, gpus=GPUS, device=0, device_mode="functional", am=am,
    )
    return launch_proxy(config)


def _fill(root, leave: dict[int, int]) -> EmulatedBackend:
    """Another job on the node: allocate each GPU's free memory down to `leave[gpu]` bytes, in the
    dict's order (timed mode: accounted in the shared ledger, no host memory behind it)."""
    hog = EmulatedBackend(preset("v100-16gb").with_overrides(context_create_s=0.0), count=GPUS,
                          state_dir=root / "state", mode="timed")
    for gpu, left in leave.items():
        rt = hog.open_runtime(gpu)
        free, _ = rt.memory_info()
        rt.mem_alloc(max(0, free - left))
    return hog


@pytest.mark.parametrize("am", [True, False], ids=["am-on", "am-off"])
def test_pressure_moves_data_to_the_least_pressured_neighbour_then_get_copies_it_back(
    tmp_path, settled, am
):
    proxy = _proxy(tmp_path, am)
    hog = None
    try:
        client = proxy.client
        store = client.stats()["store"]
        assert store["gpus"] == ([0, 1, 2, 3] if am else [0])  # AM off: no neighbour is opened
        client.invoke("produce", {})
        assert client.stats()["store"]["held_bytes"]["gpu0"] == ITEM
        # The neighbours first: the pressure on GPU 0 comes last, once rule 2 can see every GPU's.
        hog = _fill(tmp_path, {1: 24 * MiB, 2: 8 << 30, 0: 8 * MiB})
        want = "gpu3" if am else "host"
        stats = settled(client, lambda s: want in s["store"]["moved_to"], 20.0)["store"]
        assert stats["moved_to"] == {want: {"count": 1, "bytes": ITEM}}
        assert stats["held_bytes"][want] == ITEM and stats["held_bytes"]["gpu0"] == 0
        out = client.invoke("consume", {})["output"]
        assert out["n"] == ITEM // 4 and out["last"] == ITEM // 4 - 1
        assert out["probe"] == list(range(0, ITEM // 4, 1 << 20))  # the PUT's bytes, moved and back
        after = client.stats()["store"]
        transport = "peer-copy" if am else "host-to-device"
        assert after["gets"][transport] == 1
        assert after["copied_from"] == {want: {"count": 1, "bytes": ITEM}}
        assert after["held_bytes"][want] == 0  # consumed: its one consumer read it
    finally:
        proxy.stop()
        if hog is not None:
            hog.close()


def test_neighbours_are_every_other_gpu_with_am_and_none_without():
    assert neighbour_indices(1, 4, adaptive=True) == [0, 2, 3]
    assert neighbour_indices(1, 4, adaptive=False) == []
    assert neighbour_indices(0, 1, adaptive=True) == []
    assert neighbour_indices(2, 1, adaptive=True) == []  # one GPU: nothing to check or open
    with pytest.raises(ValueError, match="home GPU 4 is not one of the node's 4 GPUs"):
        neighbour_indices(4, 4, adaptive=True)


def test_placement_is_least_memory_in_use_then_fewer_proxies_then_lowest_index():
    warm = WarmProxies(devices=3, max_per_device=2)
    assert warm.admit("a", 0.0, free=[5, 7, 7]) == Admission(1)  # the most memory free
    warm.started("a", 1, 0.0)
    warm.ready("a")
    assert warm.admit("b", 0.0, free=[7, 7, 7]) == Admission(0)  # tie: fewer proxies, lowest index
    warm.started("b", 0, 0.0)
    warm.started("c", 1, 0.0)  # GPU 1 is full (2 proxies): never chosen, however idle its memory
    for name in ("b", "c"):
        warm.ready(name)
    assert warm.admit("d", 0.0, free=[1, 10, 2]) == Admission(2)
    assert warm.admit("a", 0.0, free=[10, 1, 1]) == Admission(1)  # a warm proxy stays where it is
    with pytest.raises(ValueError, match="free memory for 2 devices, but the node has 3"):
        warm.admit("d", 0.0, free=[0, 0])


WORKFLOW = textwrap.dedent(
    """
    name: {name}
    slo_ms: 1000
    functions:
      produce: {{handler: "nodegpus_handlers:produce"}}
    """
)


def test_invoker_places_each_proxy_on_the_gpu_with_the_least_memory_in_use(tmp_path):
    """GPU 0 busy with another job: the first proxy goes to GPU 1 (tie with GPU 2: lowest index), the
    second to GPU 2 (GPU 1 now holds the first proxy's context and pool); stats agree."""
    (tmp_path / "nodegpus_handlers.py").write_text(HANDLERS)
    config = Config.from_env().with_overrides(state_dir=tmp_path / "state", gpus=3, device_mode="functional")
    job = EmulatedBackend(preset("v100-16gb").with_overrides(context_create_s=0.0), count=3,
                          state_dir=tmp_path / "state", mode="timed")
    job.open_runtime(0).mem_alloc(1 << 30)

    async def scenario() -> None:
        invoker = ProxyInvoker(config, proxy_options={"prefork": 0, "am": False})
        try:
            for name in ("one", "two"):
                spec = parse_spec(WORKFLOW.format(name=name), f"{name}.yaml", base_dir=tmp_path)
                await invoker.deploy(spec)
            assert invoker.placement() == {"one": 1, "two": 2}
            await invoker.refresh_stats()
            reported = {wf: s["device"]["index"] for wf, s in invoker.last_stats().items()}
            assert reported == {"one": 1, "two": 2}
        finally:
            await invoker.close()

    try:
        asyncio.run(scenario())
    finally:
        job.close()
