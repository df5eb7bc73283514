"""Run-time configuration: which device backend and preset, where the model pool lives.

Every setting has an environment variable so that proxies, functions and benchmarks started as
separate processes agree without passing flags around; CLI flags override the environment.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from streambox.device import BACKENDS, PRESETS, Backend, DeviceSpec, get_backend, preset
from streambox.device.modes import check_device_mode, env_device_mode


def default_model_pool() -> Path:
    return Path(os.environ.get("STREAMBOX_MODEL_POOL", Path.home() / ".cache" / "streambox" / "model_pool"))


@dataclass(frozen=True)
class Config:
    backend: str = "emulated"
    device_preset: str = "v100-16gb"
    gpus: int = 1
    model_pool: Path = field(default_factory=default_model_pool)
    state_dir: Path | None = None  # emulated devices' shared ledger; None = backend default
    # functional | timed (emulated device; see device/modes.py). From $STREAMBOX_DEVICE_MODE even
    # when a Config is built field by field, so that child processes follow their parent's run.
    device_mode: str = field(default_factory=env_device_mode)
    # Every runtime opened through this config also pays the ML framework's runtime (memory and
    # initialisation, DeviceSpec.framework_*): the runtime of a monolithic PyTorch function.
    framework_runtime: bool = False

    @classmethod
    def from_env(cls) -> Config:
        env = os.environ
        state = env.get("STREAMBOX_STATE_DIR")
        return cls(
            backend=env.get("STREAMBOX_BACKEND", cls.backend),
            device_preset=env.get("STREAMBOX_DEVICE_PRESET", cls.device_preset),
            gpus=int(env.get("STREAMBOX_GPUS", cls.gpus)),
            model_pool=default_model_pool(),
            state_dir=Path(state) if state else None,
            device_mode=env_device_mode(),
        ).validated()

    def with_overrides(self, **changes: Any) -> Config:
        return replace(self, **{k: v for k, v in changes.items() if v is not None}).validated()

    def validated(self) -> Config:
        if self.backend not in BACKENDS:
            raise ValueError(f"backend {self.backend!r} is not one of: {', '.join(BACKENDS)}")
        if self.device_preset.lower() not in PRESETS:
            raise ValueError(
                f"device preset {self.device_preset!r} is not one of: {', '.join(sorted(PRESETS))}"
            )
        if self.gpus < 1:
            raise ValueError(f"gpus must be >= 1, got {self.gpus}")
        check_device_mode(self.device_mode, "config field device_mode")
        return self

    def device_spec(self) -> DeviceSpec:
        return preset(self.device_preset)

    def open_backend(self) -> Backend:
        if self.backend == "emulated":
            options: dict[str, Any] = {
                "spec": self.device_spec(),
                "count": self.gpus,
                "mode": self.device_mode,
                "framework": self.framework_runtime,
            }
            if self.state_dir is not None:
                options["state_dir"] = self.state_dir
            return get_backend("emulated", **options)
        return get_backend(self.backend)
