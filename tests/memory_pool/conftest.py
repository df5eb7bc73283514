"""A small emulated GPU for the memory pool's shell tests."""

from __future__ import annotations

import pytest

from streambox.device.emulated import EmulatedBackend
from streambox.device.specs import V100_16GB

MiB = 1 << 20


def small_spec(total: int = 64 * MiB):
    return V100_16GB.with_overrides(total_memory=total, context_create_s=0.0, context_memory=0)


@pytest.fixture
def runtime(tmp_path):
    """One runtime of a 64 MiB GPU."""
    with EmulatedBackend(spec=small_spec(), state_dir=tmp_path / "state", timeline=False) as backend:
        rt = backend.open_runtime(0)
        yield rt
        rt.close()
