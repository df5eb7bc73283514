"""Helpers of the proxy's end-to-end tests."""

from __future__ import annotations

import time
from collections.abc import Callable

import pytest


def _settled(client, predicate: Callable[[dict], bool], timeout: float = 10.0) -> dict:
    """The proxy's stats once `predicate(stats)` holds, or the last ones after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        stats = client.stats()
        if predicate(stats) or time.monotonic() > deadline:
            return stats
        time.sleep(0.05)


@pytest.fixture(scope="session")
def settled() -> Callable[..., dict]:
    """`settled(client, predicate, timeout=10.0)`: poll a proxy's stats until the predicate holds."""
    return _settled
