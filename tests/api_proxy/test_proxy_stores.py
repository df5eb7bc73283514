"""PUT/GET/DELETE through a real proxy with each communication store (`comm_store`): StreamBox's managed
store keeps the producer's pool buffer; the CUDA-IPC style store copies it into a fresh device
allocation outside the pool, spills to host memory when the GPU is full, and charges each handle's
open."""

from __future__ import annotations

import concurrent.futures
import textwrap

import pytest
import torch

from streambox.api_proxy.control import launch_proxy
from streambox.api_proxy.proxy_config import ProxyConfig, ProxyFunction
from streambox.comm.ipc_store import IpcCosts
from streambox.device.emulated import EmulatedBackend
from streambox.device.specs import MiB

HANDLERS = textwrap.dedent(
    """
    import torch
    import streambox

    @streambox.function
    def produce(ctx, event):
        x = torch.arange(event["n"], dtype=torch.float32) * event["scale"]
        ctx.put(ctx.key("x"), ctx.upload(x), consumers=event.get("consumers"))
        ctx.synchronize()
        return "ok"

    @streambox.function
    def consume(ctx, event):
        h = ctx.get(ctx.key("x"), timeout=event.get("timeout", 10.0))
        return ctx.download(h).tolist()

    @streambox.function
    def drop(ctx, event):
        return ctx.delete(ctx.key("x")).result()
    """
)

FUNCTIONS = tuple(ProxyFunction(n, f"store_test_handlers:{n}") for n in ("produce", "consume", "drop"))
N = 256 * 1024  # floats: 1 MiB


@pytest.fixture(scope="module")
def proxies(tmp_path_factory):
    root = tmp_path_factory.mktemp("proxy_stores")
    (root / "store_test_handlers.py").write_text(HANDLERS)
    common = {"functions": FUNCTIONS, "sys_path": (str(root),), "state_dir": str(root / "state")}
    configs = [
        ProxyConfig(workflow="managed", comm_store="managed", **common),
        ProxyConfig(workflow="ipc", system="stream-only", **common),  # resolves comm_store ipc
    ]
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        started = list(pool.map(launch_proxy, configs))
    yield {"state": root / "state", **dict(zip(("managed", "ipc"), started, strict=True))}
    for proxy in started:
        proxy.stop()


def _want(scale: float) -> list[float]:
    return (torch.arange(N, dtype=torch.float32) * scale).tolist()


@pytest.mark.parametrize("kind", ["managed", "ipc"])
def test_put_get_delete_with_each_store(proxies, kind):
    client = proxies[kind].client
    assert client.stats()["settings"]["comm_store"] == kind
    client.invoke("produce", {"n": N, "scale": 2.0, "consumers": 1}, request_id="r1")
    assert client.invoke("consume", {}, request_id="r1")["output"] == _want(2.0)
    client.invoke("produce", {"n": N, "scale": 3.0}, request_id="r2")
    assert client.invoke("drop", {}, request_id="r2")["output"] is True
    assert client.invoke("drop", {}, request_id="r2")["output"] is False
    store = client.stats()["store"]
    assert store["kind"] == kind and store["puts"] >= 2
    transport = "ipc-handle" if kind == "ipc" else "same-gpu"
    assert store["gets"][transport] >= 1


def test_the_ipc_store_allocates_outside_the_pool(proxies, settled):
    """After a PUT the request's own buffer goes back to the pool: the managed store still holds it
    in the pool, the IPC store holds a copy outside it (the device ledger counts it)."""
    for kind in ("managed", "ipc"):
        client = proxies[kind].client
        before = settled(client, lambda s: s["buffers"] == 0)
        client.invoke("produce", {"n": N, "scale": 1.0}, request_id=f"held-{kind}")
        held = before["pool"]["allocated_bytes"] + (0 if kind == "ipc" else 4 * N)
        after = settled(client, lambda s, held=held: s["pool"]["allocated_bytes"] <= held)
        pool_grew = after["pool"]["allocated_bytes"] - before["pool"]["allocated_bytes"]
        outside = after["device"]["runtime_bytes"] - before["device"]["runtime_bytes"] - (
            after["pool"]["reserved_bytes"] - before["pool"]["reserved_bytes"]
        )
        if kind == "managed":
            assert pool_grew >= 4 * N and outside == 0
        else:
            assert pool_grew == 0 and outside >= 4 * N
            assert after["store"]["held_bytes"]["gpu0"] == 4 * N and after["store"]["device_allocs"] >= 1
        assert client.end_request(f"held-{kind}") == 1


def test_the_ipc_store_spills_to_host_when_the_gpu_is_full_and_charges_handle_opens(proxies):
    client = proxies["ipc"].client
    opens = client.stats()["store"]["modelled_host_s"].get("open", 0.0)
    client.invoke("produce", {"n": N, "scale": 5.0, "consumers": 1}, request_id="warm")  # instance warm
    client.invoke("consume", {}, request_id="warm")
    # Another process's runtime takes all but 256 KiB of the GPU (the ledger is shared; timed: no bytes).
    backend = EmulatedBackend(state_dir=proxies["state"], mode="timed")
    rt = backend.open_runtime(0)
    try:
        filler = rt.mem_alloc(rt.memory_info()[0] - MiB // 4)
        client.invoke("produce", {"n": N, "scale": 7.0, "consumers": 1}, request_id="full")
        store = client.stats()["store"]
        assert store["spills"] == 1 and store["held_bytes"]["host"] == 4 * N  # in host memory
        rt.mem_free(filler)
        assert client.invoke("consume", {}, request_id="full")["output"] == _want(7.0)
        store = client.stats()["store"]
        assert store["gets"]["host-to-device"] == 1 and store["held_bytes"]["host"] == 0
    finally:
        rt.close()
        backend.close()
    spent = store["modelled_host_s"]["open"] - opens
    assert spent == pytest.approx(IpcCosts().ipc.open_s)  # one opened handle since: the warm-up's


def test_stream_only_resolves_the_ipc_store_and_pa_am_need_the_managed_one():
    from streambox.config import Mechanisms, SettingsError

    assert ProxyConfig(workflow="w", functions=(), system="stream-only").settings()["comm_store"] == "ipc"
    assert ProxyConfig(workflow="w", functions=()).settings()["comm_store"] == "managed"
    with pytest.raises((SettingsError, ValueError), match="switches of the managed store"):
        Mechanisms(system="stream-only", pa="off")
    managed = Mechanisms(system="stream-only", comm_store="managed", pa="off")
    assert managed.store_config().pressure_aware is False


def test_comm_store_has_one_spelling(monkeypatch):
    from streambox.api_proxy.proxy_config import ablation_options
    from streambox.config import Mechanisms, SettingsError

    assert ablation_options({"Comm-Store": "IPC"}) == {"comm_store": "ipc"}  # replay's --set
    monkeypatch.setenv("STREAMBOX_COMM_STORE", "ipc")
    assert ProxyConfig(workflow="w", functions=()).settings()["comm_store"] == "ipc"
    with pytest.raises((SettingsError, ValueError), match="comm_store 'shm' is not one of managed, ipc"):
        Mechanisms(comm_store="shm")
