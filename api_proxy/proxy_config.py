"""What one workflow's proxy serves and how: a pydantic record of the settings tree, JSON round-trip,
torch-free.

`ProxyConfig` extends `streambox.config.Mechanisms` (the paper's mechanisms, one switch each: `system`,
`pool_mode`, `recycler`, `io_daemon`, `rz`, `pb`, `bt`, `pa`, `am`, `weights_keep_alive_s`; None: the
system's default) and `Tuning` (the `pool`, `store` and `memory` groups of library knobs) with the
workflow's functions, the channel, completion, keep-alive and the device options (None: from the
environment). `settings()` is the resolved tree the proxy reports in its `stats` reply;
`memory_options()`, `daemon_config()`, `store_config()` and `device_config()` build what the memory
side, the IO daemon, the communication store and the backend take.

`ablation_options({"pool_mode": "fm", "io-daemon": "off", "pa": "off"})` parses string options (the
replay harness's `--set KEY=VALUE`) into these fields; errors name the key, the value and what is
allowed.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Mapping
from functools import cached_property
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from pydantic import Field, field_validator, model_validator

from streambox.config import (
    CHANNELS,
    COMPLETIONS,
    MECHANISM_FIELDS,
    POOL_MODES,
    RECYCLERS,
    RUN_FIELDS,
    SYSTEMS,
    Config,
    Mechanisms,
    RunOptions,
    Tuning,
    build,
    check_keys,
    env_factory,
    option_name,
)

from .function_spec import ProxyFunction
from .keepalive import DEFAULT_KEEP_ALIVE_S
from .template import INSTANCE_PRELOAD

if TYPE_CHECKING:
    from streambox.comm.config import StoreConfig

MODEL_SHAPES = ("small", "full")

__all__ = [
    "CHANNELS",
    "COMPLETIONS",
    "MODEL_SHAPES",
    "POOL_MODES",
    "RECYCLERS",
    "SYSTEMS",
    "PROXY_OPTIONS",
    "ProxyFunction",
    "ProxyConfig",
    "ablation_options",
]


class ProxyConfig(Mechanisms, Tuning):
    """One proxy: a workflow's functions, the device, the channel, completion and keep-alive, and the
    mechanisms (see the module doc)."""

    workflow: str
    functions: tuple[ProxyFunction, ...]
    device: int = Field(0, ge=0)
    channel: Literal["shm", "zmq"] = Field(default_factory=env_factory("channel", default="shm"))
    completion: Literal["poll", "sync"] = Field(default_factory=env_factory("completion", default="poll"))
    keep_alive_s: float = Field(DEFAULT_KEEP_ALIVE_S, ge=0)  # idle instances stop after this
    spin_us: float = 200.0  # how long a waiting side spins before it sleeps on its doorbell
    poll_us: float = 200.0  # `poll` completion: the pause between two queries of pending events
    ring_bytes: int = Field(1 << 20, ge=1)
    # Device bytes one invocation may hold at once in buffers it made (uploads, allocs, its inferences'
    # outputs; not what it PUT, which the store's quota bounds): a handler that allocates in a loop
    # fails its own call instead of taking the GPU from the workflow's other functions.
    invocation_device_bytes: int = Field(4 << 30, ge=1)
    # Plans are issued by this many issuer threads, each waiting every `issue_slice` kernels for the
    # dispatcher to have nothing else to do (api_proxy/issuer.py); 0: issued on the dispatcher.
    issue_threads: int = Field(2, ge=0)
    issue_slice: int = Field(8, ge=1)
    # The proxy process's GIL switch interval (`sys.setswitchinterval`); None: Python's 5 ms. A thread
    # that gave the GIL up in a system call (a stream worker taking the device ledger's lock) waits
    # up to this long for it while another thread computes.
    switch_interval_us: float | None = Field(None, gt=0)
    model_shapes: Literal["small", "full"] = Field(
        default_factory=env_factory("inputs", "model_shapes", default="small")
    )
    preload: tuple[str, ...] = INSTANCE_PRELOAD  # modules the template imports before any handler
    # torch's intra-op threads in function instances (0: torch's default, one per core). Instances
    # share the host's cores with each other and with the proxy's issuing threads; their handlers'
    # CPU work is small (decoding, resizing, NMS), so more threads only oversubscribe the cores.
    instance_threads: int = Field(1, ge=0)
    sys_path: tuple[str, ...] = ()  # prepended in the template (where the handler modules live)
    huge_pages: bool = True  # back the template's heap with huge pages (cheaper forks)
    prefork: int = Field(2, ge=0)  # spare instances the template keeps forked ahead (0: on demand)
    # Instances per function forked and registered at start (deploy), before the first request: the
    # paper warms every system up (section 9) and replay does (1, as infless's and astraea's option
    # of the same name). 0: each forks at its first request (a cold start, 1-20 ms from the template).
    prewarm: int = Field(0, ge=0)
    start_timeout_s: float = Field(30.0, gt=0)  # an instance must register within this
    # Device options (None: from the environment, see `device_config()`).
    backend: str | None = None
    device_preset: str | None = None
    gpus: int | None = None
    device_mode: Literal["functional", "timed"] | None = None
    state_dir: str | None = None
    model_pool: str | None = None
    directory: str | None = None  # the proxy's owner-only directory (made by the launcher)

    @field_validator("channel", "completion", "model_shapes", "device_mode", mode="before")
    @classmethod
    def _lower_words(cls, value: Any) -> Any:
        return value.strip().lower() if isinstance(value, str) else value

    @field_validator("workflow")
    @classmethod
    def _workflow_name(cls, value: str) -> str:
        if not value or "/" in value:
            raise ValueError("must be non-empty and contain no '/'")
        return value

    @model_validator(mode="after")
    def _unique_functions(self) -> ProxyConfig:
        names = [f.name for f in self.functions]
        duplicates = sorted({n for n in names if names.count(n) > 1})
        if duplicates:
            raise ValueError(f"workflow {self.workflow!r}: duplicate function names {duplicates}")
        return self

    # -- resolved ---------------------------------------------------------------------------------
    @property
    def resolved_weights_keep_alive_s(self) -> float:
        keep = self.weights_keep_alive_s
        return float(keep if keep is not None else self.keep_alive_s)

    def memory_options(self) -> Any:
        """`ProxyMemory`'s `MemoryOptions`: the pool mode, recycler and weights' keep-alive as
        resolved, the `pool` group's `PoolConfig`, the `memory` group over the rest."""
        return dataclasses.replace(
            self.memory_base(),
            mode=self.resolved_pool_mode,
            pool=self.pool_config(),
            keep_alive_s=self.resolved_weights_keep_alive_s,
            recycler=self.resolved_recycler,
        )

    def store_config(self, base: StoreConfig | None = None) -> StoreConfig:
        """The store's configuration: the `store` group, then PA and AM as switched."""
        return super().store_config(base or self.store_base())

    def device_config(self) -> Config:
        """The device configuration: the environment's, with this record's device options over it."""
        return Config.from_env().with_overrides(
            backend=self.backend,
            device_preset=self.device_preset,
            gpus=self.gpus,
            device_mode=self.device_mode,
            state_dir=Path(self.state_dir) if self.state_dir else None,
            model_pool=Path(self.model_pool) if self.model_pool else None,
        )

    def settings(self) -> dict[str, Any]:
        """The resolved tree this proxy runs with (every default resolved): its `stats` `settings`.
        Resolved once (the environment included) and copied: every `stats` reply carries it."""
        return copy.deepcopy(self._resolved_settings)

    @cached_property
    def _resolved_settings(self) -> dict[str, Any]:
        device = self.device_config()
        return {
            **self.resolved(),
            "keep_alive_s": float(self.keep_alive_s),
            "weights_keep_alive_s": self.resolved_weights_keep_alive_s,
            "channel": self.channel,
            "completion": self.completion,
            "inputs": self.model_shapes,
            "device": {**device.resolved(), "index": self.device},
            **self.tuning(),
        }

    def function(self, name: str) -> ProxyFunction:
        for f in self.functions:
            if f.name == name:
                return f
        known = ", ".join(f.name for f in self.functions)
        raise KeyError(f"workflow {self.workflow!r} has no function {name!r}; its functions: {known}")

    def with_overrides(self, **changes: Any) -> ProxyConfig:
        given = {k: v for k, v in changes.items() if v is not None}
        return ProxyConfig(**{**self.model_dump(), **given}) if given else self

    def to_json(self) -> str:
        return self.model_dump_json()

    @classmethod
    def from_json(cls, text: str) -> ProxyConfig:
        return cls.model_validate_json(text)


#: The string options `ablation_options` takes: the mechanisms and the run options.
PROXY_OPTIONS = MECHANISM_FIELDS + RUN_FIELDS


class _ProxyOptions(Mechanisms, RunOptions):
    """What `ablation_options` validates against (mechanisms and run options together)."""


def ablation_options(strings: Mapping[str, Any]) -> dict[str, Any]:
    """Typed fields from string options (`{"pool_mode": "fm", "PA": "off", "completion": "sync"}`):
    keys ignore case and take `-` for `_`; values are parsed and checked here, so a mistake names its
    key (an unknown key lists the known ones). Only the given keys come back. The mechanisms and
    `completion`/`channel` are `ProxyConfig` fields; `inputs` is its `model_shapes`."""
    given = {option_name(key): value for key, value in strings.items()}
    check_keys(given, PROXY_OPTIONS, "proxy option")
    parsed = build(_ProxyOptions, "proxy option", **given)
    return {name: getattr(parsed, name) for name in given}
