"""The reference interpreter (``kernel_compiler.reference``) with its executor checks on, to check
lowering against eager torch."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from streambox.kernel_compiler.plan import KernelPlan
from streambox.kernel_compiler.reference import run_plan


def run_reference(plan: KernelPlan, inputs: list[torch.Tensor]) -> dict[str, torch.Tensor]:
    return run_plan(plan, inputs, check=True)


@pytest.fixture(scope="session")
def reference() -> Callable[[KernelPlan, list[torch.Tensor]], dict[str, torch.Tensor]]:
    return run_reference
