"""The proxy's dispatcher never waits for slow work: a plan lowered for a new input shape, model
weights the IO daemon has not issued yet, or a long plan being issued (by an issuer thread,
`api_proxy/issuer.py`) are waited for off the dispatcher while the call that needs them is held;
other instances' calls complete meanwhile, and the held instance's later calls keep their order.

A real proxy (template, forked instances, shared-memory channel), run in this process so that its
slow steps can be gated deterministically: the model pool's lowering function and the IO daemon's
issue of weight blocks wait for the test to open a gate. The assertions are causal (a call completes
while another is provably still waiting), never timings.
"""

from __future__ import annotations

import concurrent.futures
import os
import signal
import textwrap
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch

from streambox.api_proxy import resources
from streambox.api_proxy.control import ProxyClient, control_address
from streambox.api_proxy.errors import FunctionCrashed, FunctionFailed
from streambox.api_proxy.proxy import ProxyServer
from streambox.api_proxy.proxy_config import ProxyConfig, ProxyFunction
from streambox.kernel_compiler.lowering import lower_module
from streambox.kernel_compiler.model_pool import ModelPool
from streambox.kernel_compiler.plan import KernelPlan
from streambox.kernel_compiler.zoo import example_input

HANDLERS = textwrap.dedent(
    """
    import os
    import torch
    import streambox

    @streambox.function
    def noop(ctx, event):
        return {"instance": ctx.instance_id}

    @streambox.function(models=["resnet18"])
    def classify(ctx, event):
        g = torch.Generator().manual_seed(event["seed"])
        x = torch.randn(1, 3, event["size"], event["size"], generator=g)
        if event.get("flat"):  # a rank the model does not take
            x = x.reshape(1, -1)
        (logits,) = ctx.infer("resnet18", x)
        return {"logits": ctx.download(logits).flatten().tolist(), "instance": ctx.instance_id}

    @streambox.function(models=["resnet18"])
    def overwrite_after_infer(ctx, event):
        g = torch.Generator().manual_seed(event["seed"])
        x = ctx.upload(torch.randn(1, 3, 32, 32, generator=g))
        zeros = ctx.upload(torch.zeros(1, 3, 32, 32))
        pending = ctx.infer_async("resnet18", x)
        ctx.memcpy(x, zeros)  # sent before the infer's reply: it must reach the stream after the plan
        (logits,) = pending.result()
        return {"logits": ctx.download(logits).flatten().tolist(), "x": ctx.download(x).abs().sum().item()}
    """
)

WAIT_S = 120.0  # generous: only a broken proxy (or a stuck CI machine) gets near it


class Gate:
    """A step that blocks until the test opens it; `entered` is set when the first caller arrives."""

    def __init__(self) -> None:
        self.entered = threading.Event()
        self.open = threading.Event()
        self.calls: list[Any] = []

    def __call__(self, what: Any) -> None:
        self.calls.append(what)
        self.entered.set()
        if not self.open.wait(WAIT_S):
            raise TimeoutError("the test never opened the gate")


@pytest.fixture(scope="module")
def served(tmp_path_factory, pool: ModelPool) -> Iterator[tuple[ProxyServer, ProxyClient]]:
    root = tmp_path_factory.mktemp("proxy_nonblocking")
    (root / "nonblocking_handlers.py").write_text(HANDLERS)
    config = ProxyConfig(
        workflow="wfnb",
        functions=(
            ProxyFunction("noop", "nonblocking_handlers:noop"),
            ProxyFunction("classify", "nonblocking_handlers:classify", models=("resnet18",), max_instances=3),
            ProxyFunction(
                "overwrite_after_infer", "nonblocking_handlers:overwrite_after_infer", models=("resnet18",)
            ),
        ),
        sys_path=(str(root),),
        state_dir=str(root / "state"),
        model_pool=str(pool.root),  # the session's pool: resnet18 at its small shape, lowered once
        model_shapes="small",
        channel="shm",
        completion="poll",
        prefork=2,
    )
    server = ProxyServer(config).start()
    thread = threading.Thread(target=server.serve_forever, name="proxy-under-test", daemon=True)
    thread.start()
    client = ProxyClient(control_address(server.dir))
    try:
        yield server, client
    finally:
        server._stop = True
        thread.join(30.0)
        client.close()
        if not thread.is_alive():
            server.close()


def _logits(zoo_model: Callable[[str], Any], seed: int, size: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        return zoo_model("resnet18")(torch.randn(1, 3, size, size, generator=g)).flatten()


def _held(server: ProxyServer) -> int:
    """Instances with a call waiting off the dispatcher (a racy read of the dispatcher's state: fine
    for polling)."""
    return sum(inst.held is not None for inst in list(server.instances.values()))


def _until(predicate: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + WAIT_S
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.01)


def _invoke(server: ProxyServer, function: str, event: Any, request_id: str) -> dict[str, Any]:
    client = ProxyClient(control_address(server.dir))
    try:
        return client.invoke(function, event, request_id=request_id, timeout_s=WAIT_S)
    finally:
        client.close()


def test_a_new_shape_is_lowered_off_the_dispatcher_once_for_every_call_that_wants_it(
    served, tmp_path, zoo_model, monkeypatch
):
    server, client = served
    client.invoke("noop", {}, request_id="warm")
    client.invoke("classify", {"seed": 0, "size": 32}, request_id="warm")  # the default shape: loaded
    gate = Gate()

    def lower(name: str, batch: int, shape: tuple[int, ...]) -> KernelPlan:
        gate((name, batch, shape))
        if shape == (3, 44, 44):
            raise RuntimeError("this lowering fails on purpose")
        return lower_module(zoo_model(name), example_input(name, batch, shape), name)

    # Nothing on disk: every shape lowers.
    server.resources.model_pool = ModelPool(tmp_path / "pool", lower_fn=lower)
    with concurrent.futures.ThreadPoolExecutor(4) as calls:
        try:
            new = [
                calls.submit(_invoke, server, "classify", {"seed": s, "size": 40}, f"new-{s}") for s in (1, 2)
            ]
            gate.entered.wait(WAIT_S)
            _until(lambda: _held(server) == 2, "both calls at the new shape to wait for its lowering")
            # The lowering is stuck at the gate, both calls wait for it: the dispatcher still serves.
            assert client.invoke("noop", {}, request_id="meanwhile")["output"]["instance"] > 0
            old = calls.submit(_invoke, server, "classify", {"seed": 3, "size": 32}, "old").result(WAIT_S)
            assert not any(f.done() for f in new)
            assert _held(server) == 2
        finally:
            gate.open.set()
        results = [f.result(WAIT_S)["output"] for f in new]
    assert gate.calls == [("resnet18", 1, (3, 40, 40))]  # one lowering for both calls
    assert len({r["instance"] for r in results}) == 2
    torch.testing.assert_close(
        torch.tensor(old["output"]["logits"]), _logits(zoo_model, 3, 32), rtol=1e-4, atol=1e-5
    )
    for seed, r in zip((1, 2), results, strict=True):
        torch.testing.assert_close(
            torch.tensor(r["logits"]), _logits(zoo_model, seed, 40), rtol=1e-4, atol=1e-5
        )
    # Once lowered, the plan is the proxy's: no further lowering.
    again = client.invoke("classify", {"seed": 1, "size": 40}, request_id="again")["output"]
    assert again["logits"] == results[0]["logits"]
    assert len(gate.calls) == 1

    # A lowering that fails fails the calls that wanted it, naming the model and shape; the instance
    # stays warm, and a later call fails at once (the model refuses that shape: it is not lowered
    # again, at seconds of CPU each time).
    with pytest.raises(
        FunctionFailed,
        match=r"lowering resnet18 for batch 1, input shape 3x44x44 failed: "
        r"RuntimeError: this lowering fails on purpose",
    ):
        client.invoke("classify", {"seed": 1, "size": 44}, request_id="bad")
    with pytest.raises(
        FunctionFailed,
        match=r"cannot lower 'resnet18' for batch 1, shape \[3, 44, 44\]; RuntimeError: this lowering fails",
    ):
        client.invoke("classify", {"seed": 1, "size": 44}, request_id="bad-again")
    assert gate.calls[1:] == [("resnet18", 1, (3, 44, 44))]
    # A rank the model does not take is refused before any lowering; past MAX_PLANS_PER_MODEL plans
    # of a model (the usual one, 40 and the failed 44 make 3 here) a new shape is refused too.
    with pytest.raises(FunctionFailed, match=r"takes inputs of 4 dimensions, each >= 1 .* shape \[1, 3072\]"):
        client.invoke("classify", {"seed": 1, "size": 32, "flat": True}, request_id="flat")
    monkeypatch.setattr(resources, "MAX_PLANS_PER_MODEL", 3)
    with pytest.raises(FunctionFailed, match=r"has plans for 3 \(batch, input shape\) pairs in this proxy"):
        client.invoke("classify", {"seed": 1, "size": 48}, request_id="one-more")
    assert len(gate.calls) == 2
    assert (
        client.invoke("classify", {"seed": 3, "size": 32}, request_id="after")["output"]["logits"]
        == (old["output"]["logits"])
    )
    assert server.resources.lowerings == {}


def test_weights_reloaded_through_the_daemon_are_waited_for_off_the_dispatcher(served, zoo_model, settled):
    server, client = served
    client.invoke("noop", {}, request_id="warm")
    want = client.invoke("classify", {"seed": 9, "size": 32}, request_id="warm")["output"]["logits"]
    models = server.memory.models
    settled(client, lambda s: models.users("resnet18") == 0)
    assert models.evict_idle(1 << 50) > 0 and "resnet18" not in models.resident()
    loads = models.loads
    gate = Gate()
    issue = server.io._issue

    def gated_issue(block: Any, batch_no: int) -> None:  # the daemon's thread: weight blocks wait
        if str(block.function).startswith("weights:"):
            gate(block.function)
        issue(block, batch_no)

    server.io._issue = gated_issue
    try:
        with concurrent.futures.ThreadPoolExecutor(1) as calls:
            try:
                run = calls.submit(_invoke, server, "classify", {"seed": 9, "size": 32}, "reload")
                gate.entered.wait(WAIT_S)
                _until(lambda: _held(server) == 1, "the call to wait for its weights")
                # The daemon cannot issue a weight block: the run waits, the dispatcher serves others.
                assert client.invoke("noop", {}, request_id="meanwhile")["output"]["instance"] > 0
                assert not run.done()
            finally:
                gate.open.set()
            got = run.result(WAIT_S)["output"]["logits"]
    finally:
        del server.io._issue
    assert got == want
    assert models.loads == loads + 1
    torch.testing.assert_close(torch.tensor(got), _logits(zoo_model, 9, 32), rtol=1e-4, atol=1e-5)


# -- plans issued off the dispatcher (api_proxy/issuer.py): no head-of-line blocking ----------------

STOP_AT = 10  # the plan's issue stops before this kernel until the test opens the gate


class IssueGate:
    """Wraps the proxy's `memory.infer`: the issue of a resnet18 plan stops before kernel `STOP_AT`
    (on whatever thread issues it) until the test opens the gate."""

    def __init__(self, server: ProxyServer) -> None:
        self.memory = server.resources.memory
        self.real = self.memory.infer
        self.entered, self.open = threading.Event(), threading.Event()
        self.threads: list[str] = []

    def __enter__(self) -> IssueGate:
        def infer(instance: Any, plan: Any, inputs: Any, stream: Any, **options: Any) -> Any:
            hook = options.get("on_kernel")

            def on_kernel(index: int, kernel: Any) -> None:
                if index == STOP_AT and plan.model == "resnet18":
                    self.threads.append(threading.current_thread().name)
                    self.entered.set()
                    if not self.open.wait(WAIT_S):
                        raise TimeoutError("the test never opened the gate")
                if hook is not None:
                    hook(index, kernel)

            return self.real(instance, plan, inputs, stream, **{**options, "on_kernel": on_kernel})

        self.memory.infer = infer
        return self

    def __exit__(self, *exc: object) -> None:
        self.open.set()
        del self.memory.infer  # the bound method again


def test_a_small_call_completes_while_a_long_plan_is_issued_and_the_plans_instance_keeps_its_order(
    served, zoo_model
):
    server, client = served
    client.invoke("noop", {}, request_id="warm")
    client.invoke("overwrite_after_infer", {"seed": 1}, request_id="warm")
    with IssueGate(server) as gate, concurrent.futures.ThreadPoolExecutor(1) as calls:
        big = calls.submit(_invoke, server, "overwrite_after_infer", {"seed": 5}, "big")
        assert gate.entered.wait(WAIT_S), "the plan's issue never reached the gate"
        held = next(i for i in server.instances.values() if i.spec.name == "overwrite_after_infer")
        _until(lambda: held.held, "the instance's memcpy to queue behind its plan")
        # The plan is stuck in its issue (kernel STOP_AT); another instance's calls go through.
        for i in range(3):
            assert client.invoke("noop", {}, request_id=f"small-{i}", timeout_s=WAIT_S)["output"]["instance"]
        assert not big.done() and held.issue is not None
        gate.open.set()
        got = big.result(WAIT_S)["output"]
    assert gate.threads and all(name.startswith("streambox-issuer") for name in gate.threads)
    # The memcpy that zeroed the input was sent before the plan was issued, and ran after it.
    assert got["x"] == 0.0
    torch.testing.assert_close(torch.tensor(got["logits"]), _logits(zoo_model, 5, 32), rtol=1e-4, atol=1e-5)
    assert held.issue is None


def test_an_instance_killed_while_its_plan_is_issued_fails_alone_and_leaks_nothing(served, zoo_model):
    server, client = served
    client.invoke("overwrite_after_infer", {"seed": 1}, request_id="warm")
    pool = server.memory.pool
    _until(lambda: not any(i.state == "busy" for i in server.instances.values()), "the instances to idle")
    before = pool.allocated_bytes
    with IssueGate(server) as gate, concurrent.futures.ThreadPoolExecutor(1) as calls:
        doomed = calls.submit(_invoke, server, "overwrite_after_infer", {"seed": 2}, "doomed")
        assert gate.entered.wait(WAIT_S), "the plan's issue never reached the gate"
        inst = next(
            i for i in server.instances.values() if i.invocation and i.invocation.request_id == "doomed"
        )
        os.kill(inst.pid, signal.SIGKILL)
        _until(lambda: inst.state == "dead", "the proxy to see the instance die")
        gate.open.set()  # the issue goes on, sees the cancel at its next kernel and stops
        with pytest.raises(FunctionCrashed):
            doomed.result(WAIT_S)
    # The failure is replied before the instance is dropped: its issue stops, then its state goes.
    _until(lambda: inst.key not in server.memory.executor.instances(), "the killed instance to be released")
    _until(lambda: pool.allocated_bytes <= before, "the killed run's buffers to be freed")
    # The proxy goes on: another instance serves the function, and the other functions too.
    got = client.invoke("overwrite_after_infer", {"seed": 3}, request_id="after")["output"]
    torch.testing.assert_close(torch.tensor(got["logits"]), _logits(zoo_model, 3, 32), rtol=1e-4, atol=1e-5)
    assert client.invoke("noop", {}, request_id="after")["output"]["instance"]
