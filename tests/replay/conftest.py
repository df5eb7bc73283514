"""Shared by the replay tests: the driver test double (it sleeps; it is not a system under test)."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from streambox.replay.target import Outcome


class SleepingDriverTestDouble:
    """A driver test double: each request sleeps `seconds` (or fails / never answers, on request).
    It does no work of a system; it only lets the tests control how slow the target looks."""

    name = "driver-test-double"

    def __init__(self, seconds: float = 0.0, fail_every: int = 0, sample_fails: bool = False) -> None:
        self.seconds, self.fail_every, self.sample_fails = seconds, fail_every, sample_fails
        self.outstanding = 0
        self.events: list[dict[str, Any]] = []

    async def start(self) -> None: ...

    async def close(self) -> None: ...

    def describe(self) -> dict[str, Any]:
        return {"target": self.name, "seconds": self.seconds}

    async def send(self, workflow: str, event: dict[str, Any]) -> Outcome:
        self.events.append(event)
        self.outstanding += 1
        try:
            await asyncio.sleep(self.seconds)
        finally:
            self.outstanding -= 1
        if self.fail_every and event["request_id"] % self.fail_every == 0:
            raise ConnectionError("gateway went away")
        return Outcome(latency_s=self.seconds, status="ok", cold_start=event["request_id"] == 0)

    def sample(self) -> dict[str, float]:
        if self.sample_fails:
            raise RuntimeError("metrics endpoint down")
        return {
            "memory_used_bytes": 1000.0 + self.outstanding,
            "pool_bytes": 600.0 + self.outstanding,
            "demand_bytes": 500.0 + self.outstanding,
            "memory.weights_bytes": 400.0,
        }


@pytest.fixture
def double_cls() -> type[SleepingDriverTestDouble]:
    return SleepingDriverTestDouble
