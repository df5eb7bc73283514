"""The fault suite's run-local engine: an emulated V100 without context cost, the session's model pool."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from streambox.device.emulated import EmulatedBackend
from streambox.device.specs import V100_16GB
from streambox.workflows.local import LocalInvoker

HERE = Path(__file__).parent


@pytest.fixture
def local_invoker(tmp_path: Path, pool) -> Iterator[LocalInvoker]:
    """A run-local invoker on its own emulated runtime (closed with it)."""
    backend = EmulatedBackend(
        spec=V100_16GB.with_overrides(context_create_s=0.0), state_dir=tmp_path / "state"
    )
    runtime = backend.open_runtime(0)
    yield LocalInvoker(runtime, pool, on_close=runtime.close)
