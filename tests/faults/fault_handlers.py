"""Handlers of the fault suite's engine and gateway tests (imported from this folder, the workflows'
base directory)."""

from __future__ import annotations

import time
from typing import Any


def wide(ctx: Any, event: dict[str, Any]) -> dict[str, Any]:
    return {"items": list(range(event["n"]))}


def item(ctx: Any, event: dict[str, Any]) -> int:
    time.sleep(0.002)
    return event["value"] * 2


def gather(ctx: Any, event: dict[str, Any]) -> int:
    return sum(event["inputs"]["item"])


def echo(ctx: Any, event: dict[str, Any]) -> dict[str, Any]:
    return {"echo": event.get("value")}


def nap(ctx: Any, event: dict[str, Any]) -> dict[str, Any]:
    time.sleep(event.get("seconds", 0.0))
    return {"echo": event.get("value")}
