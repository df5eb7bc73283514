"""Handlers of the engine and gateway tests, imported through a workflow's folder on sys.path (the
tests' YAML uses this folder as its base directory)."""

from __future__ import annotations

import threading
import time
from typing import Any

import torch

import streambox

_lock = threading.Lock()
_running: dict[str, int] = {}
peaks: dict[str, int] = {}


def split(ctx: Any, event: dict[str, Any]) -> dict[str, Any]:
    return {
        "items": [{"n": i, "count": event["count"]} for i in range(event["count"])],
        "tag": event.get("tag"),
    }


def square(ctx: Any, event: dict[str, Any]) -> dict[str, Any]:
    # Later items finish first, so completion order is the reverse of the fan-out order.
    time.sleep(0.01 * (event["count"] - event["n"]))
    bad = event.get("params", {}).get("bad")
    if event["n"] == bad:
        raise ValueError(f"item {bad} is bad")
    return {"n": event["n"], "sq": event["n"] ** 2}


def total(ctx: Any, event: dict[str, Any]) -> dict[str, Any]:
    items = event["inputs"]["square"]
    return {"total": sum(x["sq"] for x in items), "order": [x["n"] for x in items]}


def echo(ctx: Any, event: dict[str, Any]) -> dict[str, Any]:
    return {"event": event, "request_id": ctx.request_id}


def sleepy(ctx: Any, event: dict[str, Any]) -> dict[str, Any]:
    time.sleep(event.get("params", {}).get("sleep_s", 0.0))
    return {"slept": True}


def probe(ctx: Any, event: dict[str, Any]) -> dict[str, Any]:
    """Records how many invocations of its group run at once."""
    group = event.get("group", "default")
    with _lock:
        _running[group] = _running.get(group, 0) + 1
        peaks[group] = max(peaks.get(group, 0), _running[group])
    time.sleep(0.05)
    with _lock:
        _running[group] -= 1
    return {"n": event.get("n")}


def not_json(ctx: Any, event: dict[str, Any]) -> Any:
    return {"tensor": torch.zeros(1)}


def returns_handle(ctx: Any, event: dict[str, Any]) -> Any:
    return {"kept": [ctx.upload(torch.zeros(1))]}


def produce(ctx: Any, event: dict[str, Any]) -> dict[str, Any]:
    """Puts a device tensor of 0..n-1 for the consumers and tells them its key."""
    handle = ctx.upload(torch.arange(event["n"], dtype=torch.float32))
    key = ctx.key("numbers")
    ctx.put(key, handle, consumers=event.get("consumers"))
    return {"readers": [{"key": key, "producer_address": handle.address}] * event.get("readers", 1)}


def consume(ctx: Any, event: dict[str, Any]) -> dict[str, Any]:
    handle = ctx.get(event["key"], timeout=event.get("params", {}).get("get_timeout", 5.0))
    return {
        "sum": float(ctx.download(handle).sum()),
        "address": handle.address,
        "producer_address": event.get("producer_address"),
        "shape": list(handle.shape),
    }


def classify(ctx: Any, event: dict[str, Any]) -> dict[str, Any]:
    """ResNet-18 at its small input size on a seeded image: the class it picks."""
    x = torch.rand((1, 3, 32, 32), generator=torch.Generator().manual_seed(event.get("seed", 0)))
    (logits,) = ctx.infer("resnet18", x)
    return {"class": int(ctx.download(logits).argmax()), "shape": list(logits.shape)}


def wrong_model(ctx: Any, event: dict[str, Any]) -> dict[str, Any]:
    ctx.infer("vgg16", torch.zeros(1, 3, 32, 32))
    return {}


def handle_kinds(ctx: Any, event: dict[str, Any]) -> dict[str, Any]:
    """What run-local hands a handler (a `streambox.Handle`), and what it refuses back."""
    from streambox import Handle

    h = ctx.upload(torch.arange(4, dtype=torch.float32))
    refused = {}
    for name, bad in (
        ("forged", Handle(ctx.workflow, h.address + 4096, "float32", (4,), (1,), 16)),
        # the tensor's own address, with a layout reaching past its 16 bytes
        ("strides_past_the_end", Handle(ctx.workflow, h.address, "float32", (4,), (64,), 16)),
        ("negative_strides", Handle(ctx.workflow, h.address, "float32", (4,), (-1,), 16)),
        ("foreign", Handle("other", h.address, "float32", (4,), (1,), 16)),
        ("not_a_handle", [1, 2]),
    ):
        try:
            ctx.download(bad)
        except Exception as error:  # the error's type and message are the result
            refused[name] = f"{type(error).__name__}: {error}"
    wire = list(h)  # a handle through JSON (as a 6-array) is still the same handle
    return {
        "type": type(h).__name__,
        "dtype": h.dtype,
        "sum": float(ctx.download(wire).sum()),
        "refused": refused,
    }


class BadTag(streambox.InvalidInput):
    """A handler's own kind of refusal: still the caller's fault (400)."""


def refuse(ctx: Any, event: dict[str, Any]) -> dict[str, Any]:
    raise BadTag(f"tag {event.get('tag')!r} is not one of 'a', 'b'")


def exits(ctx: Any, event: dict[str, Any]) -> dict[str, Any]:
    raise SystemExit(event.get("code", 0))
