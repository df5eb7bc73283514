"""The call runner: an op that waits is parked at what it yields and resumed there (never run again
from the start), an instance's later messages wait behind an offloaded call, in order, and a GET
waits for its key's PUT or its deadline."""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

from streambox.api_proxy.calls import Calls
from streambox.api_proxy.errors import KeyNotFound
from streambox.api_proxy.proxy_config import ProxyFunction
from streambox.api_proxy.state import Instance, Invocation
from streambox.api_proxy.waits import KeyPut, Offload


class Watches:
    """The store's side of `watch` (one-shot callbacks on a key's PUT), without the device."""

    def __init__(self) -> None:
        self.callbacks: dict[str, list[Callable[[], None]]] = {}

    def watch(self, key: str, callback: Callable[[], None]) -> Callable[[], None]:
        waiting = self.callbacks.setdefault(key, [])
        waiting.append(callback)

        def cancel() -> None:
            if callback in waiting:
                waiting.remove(callback)

        return cancel

    def put(self, key: str) -> None:
        for callback in self.callbacks.pop(key, []):
            callback()


def _setup() -> tuple[Calls, Instance, Invocation, list[Any], list[Any], Watches]:
    replies: list[Any] = []
    handled: list[Any] = []
    store = Watches()
    calls = Calls(
        store,  # type: ignore[arg-type]
        lambda inst, call_id, ok, value: replies.append((call_id, ok, value)),
        lambda: None,
        lambda inst, message: handled.append(message),
        sync_completion=False,
    )
    inst = Instance(1, ProxyFunction("f", "m:f"), None, "busy", 0.0, 0.0)  # type: ignore[arg-type]
    inv = Invocation(1, "f", "r", None, (b"", 0), 0.0, 1e9, 1e9)
    inst.invocation = inv
    return calls, inst, inv, replies, handled, store


def test_an_offloaded_op_is_resumed_where_it_stopped_and_held_messages_follow_in_order():
    calls, inst, inv, replies, handled, _ = _setup()
    starts = []
    future: Future[int] = Future()

    def op() -> Any:
        starts.append(1)
        got = yield Offload(future, "lowering x")
        return got + 1

    calls.run(inst, inv, 7, op())
    assert inst.held is not None and replies == []
    inst.held.extend(["m1", "m2"])  # the dispatcher queues the instance's later messages
    future.set_result(41)
    assert calls.run_posted() == 1
    assert starts == [1] and replies == [(7, True, 42)]
    assert handled == ["m1", "m2"] and inst.held is None


def test_a_failed_offload_fails_the_call_naming_the_wait_and_a_dead_instance_closes_the_op():
    calls, inst, inv, replies, _, _ = _setup()
    failed: Future[int] = Future()
    calls.run(inst, inv, 1, (x for x in [Offload(failed, "loading the weights of m")]))
    failed.set_exception(RuntimeError("disk"))
    calls.run_posted()
    assert replies == [(1, False, ["ProxyError", "loading the weights of m failed: RuntimeError: disk", {}])]

    closed = []

    def op() -> Any:
        try:
            yield Offload(pending, "w")
        finally:
            closed.append(True)

    pending: Future[int] = Future()
    calls.run(inst, inv, 2, op())
    inst.state = "dead"
    pending.set_result(0)
    calls.run_posted()
    assert closed == [True] and len(replies) == 1  # no reply for a dead instance's call


def test_a_get_waits_for_the_put_of_its_key_or_fails_at_its_deadline():
    calls, inst, inv, replies, _, store = _setup()
    present: set[str] = set()

    def get(key: str, deadline: float) -> Any:
        while key not in present:
            yield KeyPut(key, deadline, KeyNotFound(f"GET {key!r}: no data"))
        return key

    calls.run(inst, inv, 1, get("wf/a", 100.0))
    calls.run(inst, inv, 2, get("wf/b", 5.0))
    assert calls.next_key_deadline() == 5.0
    store.put("wf/a")  # a PUT of another key first: the waiter looks, finds nothing, waits again
    calls.run_posted()
    assert replies == []
    present.add("wf/a")
    store.put("wf/a")
    calls.run_posted()
    assert replies == [(1, True, "wf/a")]
    assert calls.expire_keys(4.9) == 0
    assert calls.expire_keys(5.0) == 1
    assert replies[1] == (2, False, ["KeyNotFound", "GET 'wf/b': no data", {}])
