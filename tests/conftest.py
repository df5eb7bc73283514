"""Fixtures shared by every test folder: zoo models built once per session and one session-wide
model pool in a tmp dir, so that each (model, batch, shape) is lowered at most once per test run."""

from __future__ import annotations

from collections.abc import Callable

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
