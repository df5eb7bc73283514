"""One invocation's device memory is bounded (`invocation_device_bytes`): a handler that allocates in
a loop fails its own call with `QuotaExceeded`, holds nothing afterwards, and the workflow's other
functions keep their weights and run; what an invocation PUT is the store's (its own quota), not
counted against the invocation. In the store, one function's keys hold at most its share of the
workflow's quota (`writer_share`), so a function filling it leaves the others room."""

from __future__ import annotations

import textwrap

import pytest

from streambox.api_proxy.control import ProxyProcess, launch_proxy
from streambox.api_proxy.errors import FunctionFailed
from streambox.api_proxy.proxy_config import ProxyConfig, ProxyFunction

MIB = 1 << 20
STORE_BYTES = 512 * MIB  # the workflow's store; one function's keys may hold half
HANDLERS = textwrap.dedent(
    """
    import torch
    import streambox

    @streambox.function
    def hog(ctx, event):
        held = []
        for _ in range(event["n"]):
            held.append(ctx.alloc(event["mib"] << 20))
        return len(held)

    @streambox.function
    def stash(ctx, event):
        # Puts what it allocates: the store holds those bytes, the invocation no longer does.
        for i in range(event["n"]):
            ctx.put(ctx.key(f"part/{i}"), ctx.alloc(event["mib"] << 20)).result()
        return event["n"]

    @streambox.function(models=["resnet18"])
    def infer_loop(ctx, event):
        # Holds most of its bound, then keeps every inference's output: those count too.
        x = ctx.upload(torch.ones(1, 3, 32, 32))
        ctx.alloc(event["held"])  # the invocation's until it ends
        return len([ctx.infer("resnet18", x) for _ in range(event["n"])])

    @streambox.function
    def keep(ctx, event):
        # Workflow-wide keys with a long TTL, in a loop: what fills a store across requests.
        kept, refused = 0, None
        for i in range(event.get("drop", 0)):  # keys of an earlier call, deleted first
            ctx.delete(f"{event['tag']}-{i}").result()
        try:
            for i in range(event["n"]):
                ctx.put(f"{event['tag']}-{i}", ctx.alloc(event["mib"] << 20), ttl=3600).result()
                kept += 1
        except Exception as exc:
            refused = f"{type(exc).__name__}: {exc}"
        if event.get("delete"):
            for i in range(kept):
                ctx.delete(f"{event['tag']}-{i}").result()
        return {"kept": kept, "refused": refused}

    @streambox.function(models=["resnet18"])
    def classify(ctx, event):
        (logits,) = ctx.infer("resnet18", ctx.upload(torch.ones(1, 3, 32, 32)))
        return list(ctx.download(logits).shape)
    """
)


@pytest.fixture(scope="module")
def proxy(tmp_path_factory) -> ProxyProcess:
    root = tmp_path_factory.mktemp("quota")
    (root / "quota_handlers.py").write_text(HANDLERS)
    functions = (
        ProxyFunction("hog", "quota_handlers:hog"),
        ProxyFunction("stash", "quota_handlers:stash"),
        ProxyFunction("classify", "quota_handlers:classify", models=("resnet18",)),
        ProxyFunction("infer_loop", "quota_handlers:infer_loop", models=("resnet18",)),
        ProxyFunction("keep", "quota_handlers:keep"),
        ProxyFunction("keep_too", "quota_handlers:keep"),
    )
    config = ProxyConfig(
        workflow="wfquota", functions=functions, sys_path=(str(root),), state_dir=str(root / "state"),
        invocation_device_bytes=64 * MIB, store={"quota": {"max_bytes": STORE_BYTES, "writer_share": 0.5}},
    )
    started = launch_proxy(config)
    yield started
    started.stop()


def test_an_invocation_past_its_device_bytes_fails_alone_and_holds_nothing(proxy, settled) -> None:
    assert proxy.client.invoke("hog", {"n": 4, "mib": 16})["output"] == 4  # exactly at the bound
    with pytest.raises(FunctionFailed, match="QuotaExceeded: hog: 16777216 more bytes would hold "
                       "83886080 device bytes in this invocation's buffers; at most 67108864"):
        proxy.client.invoke("hog", {"n": 1000, "mib": 16})
    # An inference's outputs are the invocation's too: a loop keeping them stops at the bound.
    with pytest.raises(FunctionFailed, match="QuotaExceeded: infer_loop: 4000 more bytes"):
        proxy.client.invoke("infer_loop", {"held": 64 * MIB - 4 * 3 * 32 * 32 - 8000, "n": 3})
    assert proxy.client.invoke("infer_loop", {"held": MIB, "n": 3})["output"] == 3
    assert settled(proxy.client, lambda s: s["buffers"] == 0)["buffers"] == 0  # the failed one's too
    assert proxy.client.invoke("classify", {})["output"] == [1, 1000]  # the others run as before


def test_what_an_invocation_put_counts_against_the_store_not_the_invocation(proxy) -> None:
    assert proxy.client.invoke("stash", {"n": 8, "mib": 16}, request_id="r-stash")["output"] == 8
    proxy.client.end_request("r-stash")


def test_one_function_filling_the_store_leaves_the_others_their_share(proxy) -> None:
    """A function keeping long-lived keys in a loop used to fill the workflow's store, and every other
    function's PUT failed until the TTL ran out: now its own PUTs are refused at its share."""
    client = proxy.client
    filled = client.invoke("keep", {"tag": "fill", "n": 40, "mib": 16}, request_id="r-fill")["output"]
    assert filled["kept"] == 16  # 16 x 16 MiB: half the store
    assert filled["refused"].startswith("QuotaExceeded: PUT 'wfquota/fill-16': 16777216 bytes would bring ")
    assert "the keys of function 'keep' to 285212672 bytes of the workflow's store, above its share of " \
        "268435456 bytes (writer_share 0.5 of max_bytes 536870912)" in filled["refused"]
    other = client.invoke("keep_too", {"tag": "other", "n": 8, "mib": 16, "delete": True})["output"]
    assert other == {"kept": 8, "refused": None}  # the rest of the store is still the others'
    again = client.invoke("keep", {"tag": "more", "n": 1, "mib": 16, "delete": True})["output"]
    assert again["kept"] == 0 and "above its share" in again["refused"]  # its keys still hold it
    # Its share comes back as its keys go.
    back = client.invoke("keep", {"tag": "fill", "drop": 16, "n": 1, "mib": 16, "delete": True})["output"]
    assert back == {"kept": 1, "refused": None}
