"""Fixtures shared by every test folder: zoo models built once per session and one session-wide
model pool in a tmp dir, so that each (model, batch, shape) is lowered at most once per test run."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import pytest
from torch import nn

from streambox.kernel_compiler.lowering import lower_module
from streambox.kernel_compiler.model_pool import ModelPool
from streambox.kernel_compiler.plan import KernelPlan
from streambox.kernel_compiler.zoo import build_model, example_input


@pytest.fixture(scope="session")
def zoo_model() -> Callable[[str], nn.Module]:
    cache: dict[str, nn.Module] = {}

    def get(name: str) -> nn.Module:
        if name not in cache:
            cache[name] = build_model(name)
        return cache[name]

    return get


@pytest.fixture(scope="session")
def pool(tmp_path_factory: pytest.TempPathFactory, zoo_model: Callable[[str], nn.Module]) -> ModelPool:
    def lower(name: str, batch: int, shape: tuple[int, ...]) -> KernelPlan:
        return lower_module(zoo_model(name), example_input(name, batch, shape), name)

    return ModelPool(tmp_path_factory.mktemp("model_pool"), lower_fn=lower)


@contextmanager
def no_new_threads(prefix: str, grace_s: float = 5.0) -> Iterator[None]:
    """Fail if threads named `prefix...` started inside the block are still running `grace_s` after it."""

    def named() -> set[threading.Thread]:
        return {t for t in threading.enumerate() if t.name.startswith(prefix)}

    before = named()
    yield
    deadline = time.monotonic() + grace_s
    while (left := named() - before) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not left, f"threads left running: {sorted(t.name for t in left)}"


@pytest.fixture(scope="session")
def thread_guard() -> Callable[..., object]:
    """`with thread_guard(prefix): ...` fails if threads named prefix... outlive the block."""
    return no_new_threads
