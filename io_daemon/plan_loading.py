"""Pipelined model loading: a plan's weights through the daemon, in first-use order, one layer per kernel.

The layer of a weight is the index of the first compute kernel that reads it (`plan.kernels[i].accesses`;
view kernels do no device work, so they do not count). Weights are requested in that order, so the
block that completes kernel i's weights is issued before those of kernel i+1, and the daemon's event
for layer i is what the function's stream waits on right before kernel i. Kernels that first use no
weight need no wait: their weights were waited for by an earlier kernel on the same in-order stream.

An executor uses it through its `on_kernel(index, kernel)` hook (called right before kernel `index` is
issued on the run's stream)::

    load = load_plan(daemon, function_id, plan, {name: t.address for name, t in weights.items()})
    executor.run(model, inputs, stream, on_kernel=load.on_kernel(stream))

or waits for everything first (load-then-run): `load.wait_all(stream)`.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Mapping, Sequence
from dataclasses import dataclass

import torch

from streambox.device import ALIGNMENT, Event, Stream, aligned
from streambox.kernel_compiler.plan import Kernel, KernelPlan

from .daemon import CopyRequest, IODaemon, Ticket


def first_use(plan: KernelPlan) -> dict[str, int]:
    """Weight name -> index of the first compute kernel that accesses it, in first-use order.

    A weight only view kernels touch gets its first view kernel; one no kernel touches gets
    `len(plan.kernels)` (it is still loaded, last)."""
    weights = set(plan.weight_names)
    order: dict[str, int] = {}
    viewed: dict[str, int] = {}
    for index, kernel in enumerate(plan.kernels):
        target = viewed if kernel.kind == "view" else order
        for name in kernel.accesses:
            if name in weights and name not in order:
                target.setdefault(name, index)
    for name, index in viewed.items():
        order.setdefault(name, index)
    for name in plan.weight_names:
        order.setdefault(name, len(plan.kernels))
    return dict(sorted(order.items(), key=lambda item: item[1]))


def weight_layout(plan: KernelPlan, alignment: int = ALIGNMENT) -> tuple[dict[str, int], int]:
    """Offsets of the weights in ONE device region, in first-use order, each aligned to `alignment`;
    and the region's size. Weights laid out this way are adjacent wherever their sizes are multiples
    of the alignment, so the daemon copies a block of fused small weights with one call."""
    offsets, end = {}, 0
    for name in first_use(plan):
        offsets[name] = end
        end += aligned(plan.variables[name].nbytes, alignment)
    return offsets, end


def weight_requests(
    plan: KernelPlan, addresses: Mapping[str, int], host_weights: Mapping[str, torch.Tensor] | None = None
) -> list[CopyRequest]:
    """One request per weight, in first-use order, layer = first-use kernel index.

    `addresses` maps every weight name to its device address; `host_weights` defaults to
    `plan.load_weights()` (CPU tensors, made contiguous here)."""
    missing = [name for name in plan.weight_names if name not in addresses]
    if missing:
        raise KeyError(f"model {plan.model}: no device address for weights {missing[:5]}")
    host = host_weights if host_weights is not None else plan.load_weights()
    requests = []
    for name, layer in first_use(plan).items():
        tensor = host[name].detach().contiguous()
        var = plan.variables[name]
        if tensor.numel() * tensor.element_size() != var.nbytes:
            raise ValueError(f"weight {name}: host tensor has {tensor.nbytes} bytes, the plan {var.nbytes}")
        requests.append(CopyRequest(addresses[name], tensor, var.nbytes, layer))
    return requests


@dataclass
class PlanLoad:
    """A plan's weights in flight: what a run must wait for before each kernel."""

    ticket: Ticket
    layers: frozenset[int]  # kernels that first use some weight
    inputs: tuple[Hashable, ...] = ()  # layers of the extra requests, waited for before kernel 0

    def before_kernel(self, index: int, stream: Stream, timeout: float | None = None) -> None:
        """Make `stream` wait for the weights kernel `index` is the first to use (if any)."""
        if index == 0:
            for layer in self.inputs:
                self.ticket.wait(layer, stream, timeout)
        if index in self.layers:
            self.ticket.wait(index, stream, timeout)

    def event_for(self, index: int, timeout: float | None = None) -> Event | None:
        """The event kernel `index` must wait for (None: it is the first to use no weight)."""
        return self.ticket.event_for(index, timeout) if index in self.layers else None

    def on_kernel(
        self, stream: Stream, before_wait: Callable[[], None] | None = None
    ) -> Callable[[int, Kernel], None]:
        """The executor's `on_kernel` hook for a run on `stream`; `before_wait()` runs before each
        kernel that waits for weights (the executor launches the kernels it has not launched yet)."""
        if before_wait is None:
            return lambda index, _kernel: self.before_kernel(index, stream)
        waits = self.layers | ({0} if self.inputs else set())

        def hook(index: int, _kernel: Kernel) -> None:
            if index in waits:
                before_wait()
                self.before_kernel(index, stream)

        return hook

    def wait_all(self, stream: Stream, timeout: float | None = None) -> None:
        """Load-then-run: make `stream` wait for every weight."""
        self.ticket.wait_all(stream, timeout)

    def synchronize(self, timeout: float | None = None) -> None:
        self.ticket.synchronize(timeout)


def load_plan(
    daemon: IODaemon,
    function: Hashable,
    plan: KernelPlan,
    addresses: Mapping[str, int],
    host_weights: Mapping[str, torch.Tensor] | None = None,
    *,
    inputs: Sequence[CopyRequest] = (),
    stream: Stream | None = None,
) -> PlanLoad:
    """Submit `plan`'s weights for `function` (destinations: `addresses`); see the module doc.

    `inputs`: requests to send ahead of the weights in the same submission (the request's input, say,
    with a layer key that is no kernel index, e.g. "input"); the run waits for them before kernel 0."""
    requests = weight_requests(plan, addresses, host_weights)
    ticket = daemon.submit(function, [*inputs, *requests], stream=stream)
    extra = tuple(dict.fromkeys(r.layer for r in inputs))
    return PlanLoad(ticket, frozenset(r.layer for r in requests), extra)
