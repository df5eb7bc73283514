"""Fixtures of the workflow tests: an emulated V100 (no context cost) per test, a run-local invoker on
it that shares the session's model pool (each plan lowered once per test run), and a helper that runs
an async test body."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import TypeVar

import pytest

from streambox.device.emulated import EmulatedBackend
from streambox.device.specs import V100_16GB
from streambox.workflows.local import LocalInvoker

HERE = Path(__file__).parent
T = TypeVar("T")


@pytest.fixture
def runtime(tmp_path: Path) -> Iterator[object]:
    backend = EmulatedBackend(
        spec=V100_16GB.with_overrides(context_create_s=0.0), state_dir=tmp_path / "state"
    )
    with backend.open_runtime(0) as rt:
        yield rt


@pytest.fixture
def make_invoker(runtime, pool) -> Callable[..., LocalInvoker]:
    def make(**options: object) -> LocalInvoker:
        return LocalInvoker(runtime, pool, **options)

    return make


@pytest.fixture
def run() -> Callable[[Awaitable[T]], T]:
    """Run a coroutine to its end on a new event loop (the tests need no asyncio plugin)."""

    def go(coro: Awaitable[T]) -> T:
        return asyncio.run(coro)  # type: ignore[arg-type]

    return go
