"""A workflow's API proxy's device memory, predicted before it starts: what admits it to a GPU.

A proxy holds one context (`DeviceSpec.context_memory`, plus the framework's runtime when the node's
runtimes pay it), its models' weights (each model once, however many functions use it: the proxy
shares them), and the memory pool's working set, at least the largest one-inference activation peak
of its plans (lazy allocation and eager recycling keep a run to its profile's peak). The weights and
peaks come from the memory profiles stored beside the plans in the model pool (lowered here first if
missing; the proxy then finds them there). Once a proxy of the workflow has run, `ProxyInvoker`
takes the larger of this and what the proxy last reported for itself (`stats`' `runtime_bytes`).
"""

from __future__ import annotations

from streambox.api_proxy.proxy_config import ProxyConfig
from streambox.config import Config
from streambox.kernel_compiler.model_pool import ModelPool


def runtime_overhead(config: Config) -> int:
    """Device bytes a runtime takes before any allocation: the context, and the framework's runtime
    where the node's runtimes pay it. Modelled on the CUDA backend too (the preset's figures)."""
    spec = config.device_spec()
    overhead = spec.context_memory
    if config.framework_runtime:
        from streambox.device.emulated import framework_cost

        overhead += framework_cost(spec)[0]
    return overhead


def predicted_footprint(proxy: ProxyConfig, overhead: int, pool: ModelPool | None = None) -> int:
    """Bytes `proxy` takes on its GPU once warm: `overhead` + each model's weights once + the largest
    activation peak (with its input) of one inference of any of its plans."""
    pool = pool or ModelPool(proxy.model_pool)
    weights: dict[str, int] = {}
    peak = 0
    for function in proxy.functions:
        for model in function.models:
            entry = pool.entry(model)
            small = entry.small_input_shape if proxy.model_shapes == "small" else None
            profile = pool.profile(model, function.batch_size, tuple(small or entry.input_shape))
            weights[model] = profile.weight_bytes
            peak = max(peak, profile.peak_eager + profile.input_bytes)
    return overhead + sum(weights.values()) + peak
