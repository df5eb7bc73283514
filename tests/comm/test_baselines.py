"""The baselines: Func-IPC through a real Redis server, and the modelled CUDA-IPC handle costs."""

from __future__ import annotations

import time

import pytest
import torch

from streambox.api_proxy.device_tensor import DeviceTensor, download_tensor, upload_tensor
from streambox.comm.baselines import CudaIpcModel, FuncIpc, RedisServer, RedisUnavailable


@pytest.fixture(scope="module")
def redis_server():
    why = RedisServer.why_unavailable()
    if why is not None:
        pytest.skip(f"Func-IPC baseline needs Redis: {why}")
    with RedisServer() as server:
        yield server


def test_func_ipc_round_trips_through_redis(redis_server, runtimes, allocators):
    rt0, rt1 = runtimes[0], runtimes[1]
    s0, s1 = rt0.create_stream(), rt1.create_stream()
    x = torch.randn(1000)
    produced = upload_tensor(rt0, x, allocators[0].allocate, s0)
    ipc = FuncIpc(redis_server.client())
    ipc.put("req-1/out", rt0, produced, s0)
    assert redis_server.client().strlen("req-1/out") == 4000  # the bytes really are in Redis
    got = ipc.get("req-1/out", rt1, allocators[1], s1)
    back = download_tensor(rt1, DeviceTensor(got.address, x.dtype, (1000,), (1,), 4000), s1)
    assert torch.equal(back, x)
    ipc.delete("req-1/out")
    with pytest.raises(KeyError, match="req-1/out"):
        ipc.get("req-1/out", rt1, allocators[1], s1)
    allocators[0].free(produced.address, s0)
    allocators[1].free(got.address, s1)
    s0.synchronize()
    s1.synchronize()
    s0.destroy()
    s1.destroy()


def test_redis_server_stops_and_reports_a_missing_binary(tmp_path):
    with pytest.raises(RedisUnavailable, match="cannot run .*no-such-redis"):
        RedisServer(executable=str(tmp_path / "no-such-redis")).start()


def test_cuda_ipc_model_charges_its_costs_and_shares_the_address():
    model = CudaIpcModel(export_s=1e-3, open_s=2e-3, close_s=1e-3)

    class T:
        address = 0xABC

    started = time.perf_counter()
    assert model.get(T()) == 0xABC
    model.release()
    assert time.perf_counter() - started >= 4e-3
    assert "modelled" in CudaIpcModel().label
