"""The API proxy end to end, with real processes: a proxy per workflow, instances forked from its
warm template, calls forwarded over the channel. Two proxies are shared by the whole module:

- `wfa`: shared-memory channel, event-polling completion, pre-forked spares;
- `wfb`: zmq channel, blocking stream-sync completion, fork on demand, 0.5 s keep-alive.
"""

from __future__ import annotations

import concurrent.futures
import textwrap
import time

import pytest
import torch

from streambox.api_proxy.control import ProxyClient, ProxyProcess, launch_proxy
from streambox.api_proxy.errors import (
    FunctionCancelled,
    FunctionCrashed,
    FunctionFailed,
    FunctionTimeout,
    UnknownFunction,
)
from streambox.api_proxy.proxy_config import ProxyConfig, ProxyFunction

HANDLERS = textwrap.dedent(
    """
    import os, signal, threading, time
    import torch
    import streambox
    from streambox import Handle

    def _input(seed):
        g = torch.Generator().manual_seed(seed)
        return torch.randn(1, 3, 32, 32, generator=g)

    @streambox.function
    def noop(ctx, event):
        return {"pid": os.getpid(), "instance": ctx.instance_id, "request": ctx.request_id}

    @streambox.function
    def sleepy(ctx, event):
        time.sleep(event["s"])
        return {"instance": ctx.instance_id}

    @streambox.function(models=["resnet18"])
    def classify(ctx, event):
        x = ctx.upload(_input(event["seed"]))
        (logits,) = ctx.infer("resnet18", x)
        if event.get("put"):
            ctx.put(ctx.key("logits"), logits, consumers=event.get("consumers"))
        return {"logits": ctx.download(logits).flatten().tolist(), "handle": list(logits)}

    @streambox.function(models=["resnet18"])
    def consume(ctx, event):
        h = ctx.get(ctx.key("logits"), timeout=event.get("timeout", 10.0))
        return {"logits": ctx.download(h).flatten().tolist(), "handle": list(h)}

    @streambox.function(models=["resnet18"])
    def by_kernels(ctx, event):
        plan = ctx.plan("resnet18")
        bound = {plan["inputs"][0]: ctx.upload(_input(event["seed"]))}
        for name, var in plan["variables"].items():
            if var["kind"] in ("intermediate", "output"):
                raw = ctx.alloc(var["nbytes"])
                bound[name] = Handle(raw.workflow, raw.address, var["dtype"], tuple(var["shape"]),
                                     tuple(var["strides"]), var["nbytes"])
        if event.get("overflow"):  # an output bound to a buffer smaller than the plan's variable
            index = next(i for i, k in enumerate(plan["kernels"]) if k["kind"] != "view")
            kernel = plan["kernels"][index]
            tiny = ctx.alloc(shape=[1], dtype="float32")
            try:
                ctx.launch("resnet18", index, {**bound, kernel["outputs"][0]: tiny}).result()
                return "accepted"
            except Exception as exc:
                return [type(exc).__name__, str(exc)]
        launched = 0
        for index, kernel in enumerate(plan["kernels"]):
            if kernel["kind"] != "view":
                ctx.launch("resnet18", index, {n: bound[n] for n in kernel["accesses"] if n in bound})
                launched += 1
        ctx.synchronize()
        out = bound[plan["outputs"][0]]
        copy = ctx.alloc(out.nbytes)
        ctx.memcpy(copy, out)
        copy = Handle(copy.workflow, copy.address, out.dtype, out.shape, out.strides, out.nbytes)
        return {"logits": ctx.download(copy).flatten().tolist(), "launched": launched}

    @streambox.function(models=["resnet18"])
    def infer_then_upload(ctx, event):
        ctx.infer("resnet18", _input(1))  # its blocks go back to the pool while its kernels still run
        uploaded = [ctx.upload(torch.full((n,), 1.0)) for n in (1000, 4096, 16384, 65536)]
        return [float(ctx.download(h).sum()) for h in uploaded]

    @streambox.function
    def boom(ctx, event):
        ctx.alloc(1 << 20)
        if event.get("exit"):  # sys.exit in a handler: its failure, not the instance's end
            raise SystemExit(event["exit"])
        raise ValueError("boom: " + event.get("msg", ""))

    HELD: list = []

    @streambox.function
    def hog(ctx, event):  # keeps what it allocates across invocations: a leak
        if "shout_mib" in event:  # an error whose text fills what the instance may allocate
            raise ValueError("x" * (event["shout_mib"] << 20))
        if "ttl" in event:  # refused by the store: a MemoryError too, but not of host memory
            ctx.put(ctx.key("k"), ctx.alloc(16), ttl=event["ttl"]).result()
        if event.get("unprintable"):
            class Unprintable(Exception):
                def __str__(self):
                    raise RuntimeError("no text")
            raise Unprintable()
        HELD.append(bytearray(event["mib"] << 20))
        return {"pid": os.getpid(), "held_mib": sum(len(b) for b in HELD) >> 20}

    @streambox.function
    def spinner(ctx, event):  # leaves a thread burning CPU after it returns
        def spin():
            while True:
                pass

        threading.Thread(target=spin, daemon=True).start()
        return {"pid": os.getpid()}

    @streambox.function(models=["resnet18"])
    def interrupted(ctx, event):
        ctx.infer("resnet18", _input(3))  # its device work still runs when the handler ends
        raise KeyboardInterrupt("stop here")

    @streambox.function
    def crash(ctx, event):
        ctx.alloc(1 << 20)
        os._exit(3)

    @streambox.function
    def spawner(ctx, event):  # starts a process that would outlive its instance, then crashes
        child = os.fork()
        if child == 0:
            if event.get("detach"):  # a daemon: its own session, and its parent gone at once
                os.setsid()
                if os.fork():
                    os._exit(0)
            with open(event["pid_file"], "w") as f:
                f.write(str(os.getpid()))
            time.sleep(120)
            os._exit(0)
        while not os.path.exists(event["pid_file"]):
            time.sleep(0.01)
        if event.get("stay"):  # the instance stays warm; its child runs on meanwhile
            return child
        os._exit(1)

    @streambox.function
    def sigkill(ctx, event):
        ctx.alloc(1 << 20)
        os.kill(os.getpid(), signal.SIGKILL)

    @streambox.function
    def hang(ctx, event):
        ctx.alloc(1 << 20)
        time.sleep(3600)

    @streambox.function
    def foreign(ctx, event):
        out = {}
        for what, call in (
            ("handle", lambda: ctx.download(Handle.from_wire(event["handle"]))),
            ("key", lambda: ctx.get(event["key"], timeout=0.5)),
            ("forged", lambda: ctx.download(Handle(ctx.workflow, 0x1234_0000, "float32", (4,), (1,), 16))),
        ):
            try:
                call()
                out[what] = "accepted"
            except Exception as exc:
                out[what] = [type(exc).__name__, str(exc)]
        return out

    @streambox.function(models=["resnet18"])
    def reput(ctx, event):
        h = ctx.get(ctx.key("logits"))
        try:
            ctx.put(ctx.key("again"), h).result()
            return "accepted"
        except Exception as exc:
            return [type(exc).__name__, str(exc)]

    LEFT: dict = {}

    @streambox.function
    def threads(ctx, event):
        if event["do"] == "fan":  # its own threads call at once during the invocation
            out = [None] * 4

            def work(i):
                h = ctx.upload(torch.full((1000,), float(i)))
                out[i] = float(ctx.download(h).sum())

            workers = [threading.Thread(target=work, args=(i,)) for i in range(4)]
            for w in workers:
                w.start()
            for w in workers:
                w.join()
            return out
        if event["do"] == "leave":  # a thread that calls once the invocation has ended
            go = LEFT["go"] = threading.Event()

            def late():
                go.wait(30)
                try:
                    ctx.noop()
                    LEFT["error"] = None
                except Exception as exc:
                    LEFT["error"] = [type(exc).__name__, str(exc)]

            LEFT["thread"] = threading.Thread(target=late)
            LEFT["thread"].start()
            return "left"
        LEFT["go"].set()  # "report": the next invocation, while the left thread calls
        LEFT["thread"].join(30)
        return {"error": LEFT["error"], "own_call": ctx.noop() is None}

    @streambox.function
    def odd_calls(ctx, event):  # a GET that would never expire, a key longer than the limit
        calls = (
            lambda: ctx.get(ctx.key("x"), timeout=float("nan")),
            lambda: ctx.put(ctx.key("k" * 2000), ctx.upload(torch.zeros(1))).result(),
            lambda: ctx.get(ctx.key("x"), timeout="1"),
            lambda: ctx.alloc(1.5),
            lambda: ctx.alloc(16, shape=[2], dtype="float32"),
            lambda: ctx.alloc(6, dtype="float32"),
            lambda: ctx.put(ctx.key("c"), ctx.upload(torch.zeros(1)), consumers=2**70),
            lambda: ctx.put(ctx.key("d"), ctx.upload(torch.zeros(1)), consumers=True).result(),
        )
        out = []
        for call in calls:
            try:
                call()
                out.append("accepted")
            except Exception as exc:
                out.append([type(exc).__name__, str(exc)])
        return out

    @streambox.function
    def not_json(ctx, event):
        return {"x": object()}

    @streambox.function
    def upload_hang(ctx, event):
        for _ in range(event["n"]):  # the IO daemon copies these while the handler sleeps
            ctx.upload(torch.ones(event["mib"] << 18))
        if event.get("hang", True):
            time.sleep(60)
        return {"uploaded": event["n"]}

    @streambox.function
    def odd_output(ctx, event):
        kind = event["kind"]
        if kind == "intkey":
            return {1: "a", "pid": os.getpid()}
        if kind == "bigint":
            return 10**40
        if kind == "nan":
            return {"f": float("nan")}
        if kind == "handle":
            return {"boxes": [ctx.upload(torch.zeros(2))], "pid": os.getpid()}
        if kind == "lookalike":  # a handle's JSON shape, made of the user's own values
            return {"row": ["w", 1, "float32", [2], [1], 8], "pid": os.getpid()}
        if kind == "deep":  # deeper than a request body may nest
            deep = []
            for _ in range(100):
                deep = [deep]
            return deep
        if kind == "many":  # more objects and lists than a request body may hold
            return [[] for _ in range(1_100_000)]
        return "x" * ((64 << 20) + 1)
    """
)

FUNCTIONS = (
    ProxyFunction("noop", "proxy_test_handlers:noop"),
    ProxyFunction("sleepy", "proxy_test_handlers:sleepy", max_instances=3),
    ProxyFunction("classify", "proxy_test_handlers:classify", models=("resnet18",)),
    ProxyFunction("consume", "proxy_test_handlers:consume", models=("resnet18",), max_instances=2),
    ProxyFunction("by_kernels", "proxy_test_handlers:by_kernels", models=("resnet18",)),
    ProxyFunction("infer_then_upload", "proxy_test_handlers:infer_then_upload", models=("resnet18",)),
    ProxyFunction("boom", "proxy_test_handlers:boom"),
    ProxyFunction("crash", "proxy_test_handlers:crash"),
    ProxyFunction("interrupted", "proxy_test_handlers:interrupted", models=("resnet18",)),
    ProxyFunction("spinner", "proxy_test_handlers:spinner"),
    ProxyFunction("hog", "proxy_test_handlers:hog", host_memory_mb=256),
    ProxyFunction("sigkill", "proxy_test_handlers:sigkill"),
    ProxyFunction("spawner", "proxy_test_handlers:spawner"),
    ProxyFunction("hang", "proxy_test_handlers:hang", timeout_ms=1500.0),
    ProxyFunction("foreign", "proxy_test_handlers:foreign"),
    ProxyFunction("not_json", "proxy_test_handlers:not_json"),
    ProxyFunction("odd_output", "proxy_test_handlers:odd_output"),
    ProxyFunction("upload_hang", "proxy_test_handlers:upload_hang", timeout_ms=300.0),
    ProxyFunction("upload_return", "proxy_test_handlers:upload_hang"),
    ProxyFunction("reput", "proxy_test_handlers:reput", models=("resnet18",)),
    ProxyFunction("odd_calls", "proxy_test_handlers:odd_calls"),
    ProxyFunction("threads", "proxy_test_handlers:threads"),
)


@pytest.fixture(scope="module")
def proxies(tmp_path_factory):
    root = tmp_path_factory.mktemp("proxy_e2e")
    (root / "proxy_test_handlers.py").write_text(HANDLERS)
    common = {"functions": FUNCTIONS, "sys_path": (str(root),), "state_dir": str(root / "state")}
    configs = [
        ProxyConfig(workflow="wfa", channel="shm", completion="poll", prefork=2, **common),
        ProxyConfig(workflow="wfb", channel="zmq", completion="sync", prefork=0, keep_alive_s=0.5, **common),
    ]
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        started = list(pool.map(launch_proxy, configs))
    yield dict(zip(("a", "b"), started, strict=True))
    for proxy in started:
        proxy.stop()


@pytest.fixture(scope="module")
def a(proxies) -> ProxyProcess:
    return proxies["a"]


@pytest.fixture(scope="module")
def b(proxies) -> ProxyProcess:
    return proxies["b"]


def _eager_logits(zoo_model, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        return zoo_model("resnet18")(torch.randn(1, 3, 32, 32, generator=g)).flatten()


@pytest.mark.parametrize("side", ["a", "b"])
def test_cold_then_warm_instance(proxies, side):
    client = proxies[side].client
    first = client.invoke("noop", {}, request_id="r-cold")
    second = client.invoke("noop", {}, request_id="r-warm")
    assert first["cold_start"] is True and second["cold_start"] is False
    assert first["output"]["pid"] == second["output"]["pid"]  # the same warm instance
    assert second["output"]["request"] == "r-warm"
    assert first["start_s"] > 0 and second["start_s"] == 0


@pytest.mark.parametrize("side", ["a", "b"])
def test_infer_matches_eager_torch_and_get_is_zero_copy(proxies, side, zoo_model):
    client = proxies[side].client
    want = _eager_logits(zoo_model, seed=7)
    produced = client.invoke("classify", {"seed": 7, "put": True, "consumers": 1}, request_id="rq")
    consumed = client.invoke("consume", {}, request_id="rq")["output"]
    torch.testing.assert_close(torch.tensor(produced["output"]["logits"]), want, rtol=1e-4, atol=1e-5)
    assert consumed["logits"] == produced["output"]["logits"]
    assert consumed["handle"][1] == produced["output"]["handle"][1]  # same device address: no copy
    # consumers=1: the key is gone after its one GET
    with pytest.raises(FunctionFailed, match="KeyNotFound"):
        client.invoke("consume", {"timeout": 0.2}, request_id="rq")


def test_an_upload_after_an_infer_is_not_overwritten_by_its_kernels(a):
    # The IO daemon copies on its own stream: an upload's buffer must not be a block the infer's
    # still-running kernels freed on the instance's stream (stream order protects only that stream).
    for i in range(4):
        sums = a.client.invoke("infer_then_upload", {}, request_id=f"r-up-{i}")["output"]
        assert sums == [1000.0, 4096.0, 16384.0, 65536.0]


def test_end_request_drops_the_request_keys(a):
    a.client.invoke("classify", {"seed": 1, "put": True}, request_id="r-end")
    assert a.client.stats()["keys"] >= 1
    assert a.client.end_request("r-end") == 1
    with pytest.raises(FunctionFailed, match="KeyNotFound"):
        a.client.invoke("consume", {"timeout": 0.2}, request_id="r-end")


def test_a_value_of_the_store_cannot_be_put_again_without_a_copy(a):
    a.client.invoke("classify", {"seed": 4, "put": True}, request_id="r-reput")
    kind, message = a.client.invoke("reput", {}, request_id="r-reput")["output"]
    assert kind == "ProxyError" and "already belongs to the communication store" in message
    a.client.end_request("r-reput")


def test_get_waits_for_a_put_that_comes_later(a):
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        waiting = pool.submit(
            lambda: ProxyClient(a.address).invoke("consume", {"timeout": 20.0}, request_id="r-later")
        )
        time.sleep(0.5)
        a.client.invoke("classify", {"seed": 3, "put": True, "consumers": 1}, request_id="r-later")
        assert len(waiting.result(timeout=60)["output"]["logits"]) == 1000


def test_low_level_calls_reproduce_infer(a, zoo_model):
    out = a.client.invoke("by_kernels", {"seed": 11}, request_id="r-ll")["output"]
    assert out["launched"] > 10
    torch.testing.assert_close(
        torch.tensor(out["logits"]), _eager_logits(zoo_model, 11), rtol=1e-4, atol=1e-5
    )


def test_a_handlers_threads_call_during_its_invocation_and_not_after(a):
    """Its threads' calls share the instance's one channel; one left running after the handler
    returned used to read that channel beside the next invocation and act in it."""
    fan = a.client.invoke("threads", {"do": "fan"}, request_id="r-t1")["output"]
    assert fan == [0.0, 1000.0, 2000.0, 3000.0]
    assert a.client.invoke("threads", {"do": "leave"}, request_id="r-t2")["output"] == "left"
    out = a.client.invoke("threads", {"do": "report"}, request_id="r-t3")["output"]
    assert out["own_call"] and out["error"][0] == "ProxyError"
    assert "noop: the invocation of this ctx (wfa/threads, request 'r-t2') has ended" in out["error"][1]


def test_a_get_timeout_must_be_finite_and_a_key_short(a):
    """A NaN GET deadline never compared due: it sat at the top of the proxy's deadline heap and held
    every other GET's timeout behind it. Keys live in host memory, outside the store's byte quota."""
    (nan, nan_message), (long, long_message), *slips = a.client.invoke("odd_calls", {}, request_id="r-odd")[
        "output"
    ]
    assert nan == long == "ValueError"
    assert "a GET timeout is a finite number of seconds >= 0, got nan" in nan_message
    assert "a key has at most 1024 characters, got 2" in long_message
    # Argument slips are refused, not taken for something else (a string timeout, 1.5 bytes as 1).
    assert slips == [
        ["TypeError", "a GET timeout is a number of seconds, got '1'"],
        ["TypeError", "nbytes must be an int, got 1.5"],
        ["TypeError", "alloc takes nbytes or shape, one of the two"],
        ["ValueError", "alloc of 6 bytes: not a whole number of float32 (4 B)"],
        ["ValueError", f"PUT 'wfa/r-odd/c': consumers must be a positive int or None, got {2**70}"],
        ["ValueError", "PUT 'wfa/r-odd/d': consumers must be a positive int or None, got True"],
    ]


def test_a_launch_refuses_a_buffer_unlike_the_plans_variable(a, zoo_model):
    """Kernel outputs are written through the bound buffers: one smaller than the variable used to be
    written past its end, into other requests' memory (and crash the proxy)."""
    kind, message = a.client.invoke("by_kernels", {"seed": 11, "overflow": True}, request_id="r-of")["output"]
    assert kind == "ValueError" and "float32 shape [1] strides [1]; the plan's variable is float32" in message
    out = a.client.invoke("by_kernels", {"seed": 11}, request_id="r-of2")["output"]
    expected = _eager_logits(zoo_model, 11)
    torch.testing.assert_close(torch.tensor(out["logits"]), expected, rtol=1e-4, atol=1e-5)


def test_several_instances_of_a_function_run_at_once_on_their_own_streams(a):
    client_a = a.client
    client_a.invoke("sleepy", {"s": 0.0}, request_id="warm")
    clients = [ProxyClient(a.address) for _ in range(3)]
    started = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(3) as pool:
        results = list(pool.map(lambda c: c.invoke("sleepy", {"s": 1.0}, request_id="par"), clients))
    elapsed = time.perf_counter() - started
    for c in clients:
        c.close()
    assert len({r["output"]["instance"] for r in results}) == 3
    assert elapsed < 2.5, f"3 x 1 s handlers took {elapsed:.2f} s: they did not run concurrently"


def test_an_ended_request_s_invocations_are_stopped_not_left_running(a):
    """A request that ended without some of its invocations (a sibling failed, the client went away)
    left them running to their own deadline, holding their instances: later requests queued behind
    them. Ending the request stops them: the running one's instance is killed, the queued one leaves
    the queue, each answered `FunctionCancelled`."""
    clients = [ProxyClient(a.address) for _ in range(4)]
    before = a.client.stats()
    try:
        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            # Three run (max_instances 3), one queues.
            running = [pool.submit(c.invoke, "sleepy", {"s": 60.0}, "r-gone") for c in clients]
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline:
                sleepy = a.client.stats()["functions"]["sleepy"]
                if (sleepy["busy"], sleepy["queued"]) == (3, 1):
                    break
                time.sleep(0.05)
            started = time.perf_counter()
            a.client.end_request("r-gone")
            for future in running:
                with pytest.raises(FunctionCancelled, match="stopped: its request ended without it"):
                    future.result(timeout=30)
        assert time.perf_counter() - started < 10  # not the handlers' 60 s
        assert a.client.invoke("sleepy", {"s": 0.0}, request_id="r-next")["output"]["instance"] > 0
        after = a.client.stats()
        assert after["cancelled"] - before["cancelled"] == 4
        # Cancelled: neither the function's failures nor instances lost to a fault; the three killed
        # instances count as stopped.
        assert (after["failures"], after["instances_died"]) == (before["failures"], before["instances_died"])
        assert after["instances_stopped"] - before["instances_stopped"] == 3
    finally:
        for c in clients:
            c.close()


@pytest.mark.parametrize("side", ["a", "b"])
def test_a_failing_handler_fails_only_its_request(proxies, side, settled):
    client = proxies[side].client
    baseline = client.stats()
    with pytest.raises(FunctionFailed, match="ValueError: boom: x"):
        client.invoke("boom", {"msg": "x"}, request_id="r-boom")
    with pytest.raises(FunctionFailed, match="SystemExit: 3"):
        client.invoke("boom", {"exit": 3}, request_id="r-exit")
    with pytest.raises(FunctionFailed, match="not JSON-able"):
        client.invoke("not_json", {}, request_id="r-json")
    for name, match in (("crash", "exited with code 3"), ("sigkill", "SIGKILL")):
        with pytest.raises(FunctionCrashed, match=match):
            client.invoke(name, {}, request_id=f"r-{name}")
    with pytest.raises(FunctionTimeout, match="timed out after 1.5 s"):
        client.invoke("hang", {}, request_id="r-hang")
    assert client.invoke("noop", {}, request_id="r-after")["output"]["request"] == "r-after"
    stats = settled(
        client, lambda s: s["buffers"] == 0 and s["instances_died"] >= 3 and s["retiring_streams"] == 0
    )
    assert stats["buffers"] == 0 and stats["buffer_bytes"] == 0  # the failed requests' buffers are freed
    # The dead instances' streams are destroyed, and only once the pool holds no free pending on them.
    assert stats["retiring_streams"] == 0
    assert stats["instances_died"] - baseline["instances_died"] == 3
    assert stats["failures"] - baseline["failures"] == 6
    assert stats["functions"]["hang"]["instances"] == 0


@pytest.mark.parametrize("detach", [False, True])
def test_what_a_crashed_instance_started_ends_with_it(a, tmp_path, detach):
    pid_file = tmp_path / "child.pid"
    with pytest.raises(FunctionCrashed, match="exited with code 1"):
        a.client.invoke("spawner", {"pid_file": str(pid_file), "detach": detach}, request_id="r-spawn")
    child = int(pid_file.read_text())
    deadline = time.monotonic() + 10
    while _alive(child) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _alive(child)


def test_what_a_warm_instance_started_ends_with_the_proxy(tmp_path):
    (tmp_path / "proxy_test_handlers.py").write_text(HANDLERS)
    config = ProxyConfig(
        workflow="wfs", functions=(ProxyFunction("spawner", "proxy_test_handlers:spawner"),),
        sys_path=(str(tmp_path),), state_dir=str(tmp_path / "state"), prefork=0,
    )
    proxy = launch_proxy(config)
    try:
        pid_file = tmp_path / "child.pid"
        proxy.client.invoke("spawner", {"pid_file": str(pid_file), "stay": True}, request_id="r-stay")
        child = int(pid_file.read_text())
        assert _alive(child)  # its instance is warm: it runs on, as a thread the handler left would
    finally:
        proxy.stop()
    deadline = time.monotonic() + 10
    while _alive(child) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _alive(child)


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"  # a zombie has ended
    except FileNotFoundError:
        return False


def test_a_handler_s_keyboard_interrupt_reaches_its_caller_then_the_instance_ends(a):
    """It used to end the instance with nothing but "exited with code 1" for the caller."""
    for i in range(3):
        with pytest.raises(FunctionFailed, match="KeyboardInterrupt: stop here"):
            a.client.invoke("interrupted", {}, request_id=f"r-int-{i}")
    assert a.client.invoke("noop", {}, request_id="r-int-after")["output"]["request"] == "r-int-after"


def test_an_instance_s_host_memory_is_bounded(a):
    """A handler that leaked grew its instance without bound, into the proxy's and the others' memory."""
    first = a.client.invoke("hog", {"mib": 100}, request_id="r-hog-1")["output"]
    assert first["held_mib"] == 100
    with pytest.raises(FunctionFailed, match=r"MemoryError(.|\n)*256 MiB of host memory beyond"):
        a.client.invoke("hog", {"mib": 200}, request_id="r-hog-2")
    again = a.client.invoke("hog", {"mib": 100}, request_id="r-hog-3")["output"]
    assert again["held_mib"] == 100 and again["pid"] != first["pid"]  # a fresh instance, its leak gone
    # An error its instance could not format (a copy of its 120 MiB message did not fit): the instance
    # exited with code 1, unexplained.
    with pytest.raises(FunctionFailed, match=r"ValueError: \(not shown(.|\n)*256 MiB of host memory beyond"):
        a.client.invoke("hog", {"shout_mib": 120}, request_id="r-hog-4")
    pid = a.client.invoke("hog", {"mib": 1}, request_id="r-hog-5")["output"]["pid"]
    # Neither a store's refusal (it retired the instance with a false note on host memory) nor an
    # error whose str() raises (the instance exited, the error's type lost) ends the instance.
    with pytest.raises(FunctionFailed, match="QuotaExceeded") as refused:
        a.client.invoke("hog", {"mib": 0, "ttl": 1e300}, request_id="r-hog-6")
    assert "host_memory_mb" not in str(refused.value)
    with pytest.raises(FunctionFailed, match="Unprintable"):
        a.client.invoke("hog", {"mib": 0, "unprintable": True}, request_id="r-hog-7")
    assert a.client.invoke("hog", {"mib": 0}, request_id="r-hog-8")["output"]["pid"] == pid


def test_an_instance_burning_cpu_while_idle_is_stopped(a, settled):
    """A thread a handler left spinning took a core between invocations, with no timeout to end it."""
    before = a.client.stats()["idle_cpu_stops"]
    first = a.client.invoke("spinner", {}, request_id="r-spin")["output"]["pid"]
    settled(a.client, lambda s: s["idle_cpu_stops"] > before, timeout=30.0)
    deadline = time.monotonic() + 10
    while _alive(first) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _alive(first)


def test_an_output_is_json_s_or_fails_its_own_request(a):
    """An output is what JSON makes of it (string keys); one JSON or the channel cannot carry (NaN, an
    integer past 64 bits, more than the output bound), or one a request body could not be (too deep,
    too many objects: it is the next function's event), fails its request; the instance serves on."""
    client = a.client
    first = client.invoke("odd_output", {"kind": "intkey"}, request_id="r-intkey")["output"]
    assert first["1"] == "a"
    for kind, match in (("nan", "not JSON-able: Out of range float"), ("bigint", "64-bit"),
                        ("big", "more than the bound of 67108864"),
                        ("handle", r"returned a device handle \(output\['boxes'\]\[0\]\): its memory"),
                        ("deep", "nests objects or lists more than 64 levels deep"),
                        ("many", "holds about 1100001 objects or lists, more than 1000000")):
        with pytest.raises(FunctionFailed, match=match):
            client.invoke("odd_output", {"kind": kind}, request_id=f"r-{kind}")
    after = client.invoke("odd_output", {"kind": "intkey"}, request_id="r-after")["output"]
    assert after["pid"] == first["pid"]  # the same instance: none of these outputs took it down
    lookalike = client.invoke("odd_output", {"kind": "lookalike"}, request_id="r-look")["output"]
    assert lookalike["row"] == ["w", 1, "float32", [2], [1], 8]


def test_a_killed_instance_s_uploads_end_before_its_buffers_are_freed(a, settled):
    """An instance killed while the IO daemon still copies its uploads: its queued blocks are dropped
    and its buffers freed only after the blocks in flight landed (they used to be freed at once, and
    the daemon's copies then wrote into freed memory: a use after free another request could see)."""
    client = a.client
    before = client.stats()["io"]
    for i in range(3):
        with pytest.raises(FunctionTimeout):
            client.invoke("upload_hang", {"n": 8, "mib": 16}, request_id=f"r-up{i}")
        assert client.invoke("noop", {}, request_id=f"r-up-after{i}")["output"]["request"] == f"r-up-after{i}"
    stats = settled(client, lambda s: s["buffers"] == 0 and s["retiring_streams"] == 0)
    assert stats["io"]["failed_blocks"] == before["failed_blocks"]  # no copy met freed memory


def test_uploads_a_handler_never_used_land_before_its_buffers_are_freed(a, settled):
    """A handler that uploads and returns at once: its buffers are freed after the daemon's copies."""
    client = a.client
    before = client.stats()["io"]
    for i in range(3):
        out = client.invoke("upload_return", {"n": 8, "mib": 16, "hang": False}, request_id=f"r-ret{i}")
        assert out["output"] == {"uploaded": 8}
    stats = settled(client, lambda s: s["buffers"] == 0)
    assert stats["io"]["failed_blocks"] == before["failed_blocks"]


def test_a_reply_with_integer_keys_decodes() -> None:
    import msgpack

    from streambox.api_proxy.control import _reply

    assert _reply(msgpack.packb([7, True, {1: "a"}], use_bin_type=True)) == (7, True, {1: "a"})


def test_isolation_between_workflows(a, b):
    theirs = b.client.invoke("classify", {"seed": 2, "put": True}, request_id="rb")["output"]
    assert theirs["handle"][0] == "wfb"
    out = a.client.invoke("foreign", {"handle": theirs["handle"], "key": "wfb/rb/logits"}, request_id="ra")
    verdict = out["output"]
    assert verdict["handle"][0] == "IsolationError" and "belongs to workflow 'wfb'" in verdict["handle"][1]
    assert verdict["key"][0] == "IsolationError" and "wfb" in verdict["key"][1]
    assert verdict["forged"][0] == "UnknownHandle" and "no live buffer" in verdict["forged"][1]
    b.client.end_request("rb")


def test_unknown_function_is_refused_with_the_known_ones(a):
    with pytest.raises(UnknownFunction, match="its functions: noop"):
        a.client.invoke("nope", {})


def test_idle_instances_scale_to_zero_after_keep_alive(b, settled):
    b.client.invoke("noop", {}, request_id="r-ka")
    stats = settled(b.client, lambda s: all(f["instances"] == 0 for f in s["functions"].values()), 10.0)
    assert all(f["instances"] == 0 for f in stats["functions"].values())
    assert stats["instances_stopped"] >= 1
    assert b.client.invoke("noop", {}, request_id="r-ka2")["cold_start"] is True


def test_proxy_directory_is_owner_only(a):
    assert oct(a.directory.stat().st_mode & 0o777) == "0o700"
    for entry in a.directory.iterdir():
        assert entry.stat().st_mode & 0o077 == 0, f"{entry.name} is open to other users"
