"""One function of a workflow, its fields defined once: `FunctionSpec` is a function as the workflow
YAML writes it (`workflows/spec.py` takes it from here) and `ProxyFunction` is the same record with the
function's name, as one workflow's proxy serves it (`ProxyConfig.functions`).

Times are in milliseconds, as in the YAML; the proxy reads `timeout_s` and `max_queue_delay_s`.
Torch-free.
"""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, JsonValue, StringConstraints, field_validator

from streambox.api_proxy.wire import carries_int
from streambox.settings_base import SettingsModel

HANDLER_PATTERN = r"^[A-Za-z_][\w.]*:[A-Za-z_]\w*$"
HandlerRef = Annotated[str, StringConstraints(pattern=HANDLER_PATTERN, max_length=200)]
DEFAULT_TIMEOUT_MS = 30_000.0
MAX_TIMEOUT_MS = 86_400_000.0  # a day: a longer limit is a typo, not a plan
DEFAULT_MAX_INSTANCES = 4
MAX_BATCH_SIZE = 64  # plans for every batch size up to it are prepared at deploy
MAX_QUEUE_DELAY_MS = 10_000.0
#: Host memory an instance may allocate beyond what its warm template holds (torch's heap, the
#: handlers' modules): a generous default for image pre-processing, a bound for a leak.
DEFAULT_HOST_MEMORY_MB = 4096


class StrictModel(BaseModel):
    # strict: YAML has real types, so "200" for a number or `yes` for a flag is a mistake, not a value.
    # allow_inf_nan: `.inf` or `.nan` for a time is a mistake too (and no JSON can carry it back).
    model_config = ConfigDict(
        extra="forbid", strict=True, populate_by_name=True, frozen=True, allow_inf_nan=False
    )


class FunctionSpec(StrictModel):
    handler: HandlerRef = Field(description="the handler as module:function")
    models: list[str] = Field(
        default_factory=list, description="zoo or registered models the handler infers with"
    )
    batch_size: int = Field(1, ge=1, le=1024, description="batch the model plans are lowered for")
    max_instances: int = Field(DEFAULT_MAX_INSTANCES, ge=1, le=1024, description="concurrency limit")
    max_batch_size: int = Field(
        1, ge=1, le=MAX_BATCH_SIZE, description="samples one batched inference may hold (1: no batching)"
    )
    max_queue_delay_ms: float = Field(
        0.0, ge=0, le=MAX_QUEUE_DELAY_MS, description="how long an inference waits for others to batch with"
    )
    timeout_ms: float | None = Field(
        None, gt=0, le=MAX_TIMEOUT_MS, description="one invocation's time limit (at most a day)"
    )
    gpu_percent: int | None = Field(
        None, ge=1, le=100, description="share of the GPU's compute units its kernels use (GPU%)"
    )
    host_memory_mb: int = Field(
        DEFAULT_HOST_MEMORY_MB, ge=64, le=1 << 20,
        description="host memory (MiB) one instance may allocate beyond its warm template's",
    )
    params: dict[str, JsonValue] = Field(
        default_factory=dict, description="given to the handler in the event: JSON values only"
    )

    @field_validator("params")
    @classmethod
    def _params_fit_the_wire(cls, params: dict[str, JsonValue]) -> dict[str, JsonValue]:
        """Params reach the functions in every event, as msgpack: integers of 64 bits at most."""
        stack: list[JsonValue] = [params]
        while stack:
            value = stack.pop()
            if isinstance(value, dict):
                stack.extend(value.values())
            elif isinstance(value, list):
                stack.extend(value)
            elif isinstance(value, int) and not carries_int(value):
                raise ValueError(f"the integer {value} does not fit 64 bits (events cross as msgpack)")
        return params

    @property
    def timeout_s(self) -> float:
        """One invocation's limit in seconds (without `timeout_ms`: `DEFAULT_TIMEOUT_MS`)."""
        return (self.timeout_ms if self.timeout_ms is not None else DEFAULT_TIMEOUT_MS) / 1e3

    @property
    def max_queue_delay_s(self) -> float:
        return self.max_queue_delay_ms / 1e3


class ProxyFunction(FunctionSpec, SettingsModel):
    """A function as its workflow's proxy serves it: its name and its `FunctionSpec` fields; errors
    are `SettingsError`s naming the field. Built from the workflow's spec by `of`; in Python (tests,
    benchmarks) also as `ProxyFunction("name", "module:function", models=(...), ...)`."""

    # Not strict: built in Python and from the proxy's JSON config, where tuples stand for lists.
    model_config = ConfigDict(strict=False)

    name: str

    def __init__(self, *args: str, **values: Any) -> None:
        super().__init__(**dict(zip(("name", "handler"), args, strict=False)), **values)

    @classmethod
    def of(cls, name: str, spec: FunctionSpec, default_timeout_ms: float | None = None) -> ProxyFunction:
        """The proxy's record of workflow function `name`; without its own timeout it gets
        `default_timeout_ms` (the workflow's request timeout)."""
        fields = spec.model_dump()
        if fields["timeout_ms"] is None:
            fields["timeout_ms"] = default_timeout_ms
        return cls(name=name, **fields)
