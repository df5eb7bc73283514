"""The workflow spec: a DAG of functions in YAML, as pydantic models, plus its graph checks.

The schema (every key is checked; unknown keys are errors)::

    name: traffic                 # [a-z0-9][a-z0-9_-]*: used in URLs, keys and metrics
    description: ...              # optional
    slo_ms: 200                   # latency objective of one request
    timeout_ms: 30000             # optional: a request that runs longer fails with a timeout
    output: null                  # optional: the function whose result is the response's output
    functions:
      detect:                     # function name, same pattern as `name`
        handler: streambox.workflows.examples.traffic:detect   # module:function
        models: [ssdlite320_mobilenet_v3]                      # zoo or registered models it infers with
        batch_size: 1             # batch its model plans are lowered for
        max_batch_size: 4         # optional: concurrent invocations' infers run as one batch of up to
        max_queue_delay_ms: 5     #   this many samples, gathered at most this long (Triton's dynamic batcher)
        max_instances: 4          # at most this many invocations of it run at once
        timeout_ms: 10000         # optional: one invocation's limit
        gpu_percent: 50           # optional: its kernels use at most this share of the GPU's units
        host_memory_mb: 4096      # optional: host memory one instance may allocate past its template's
        params: {image_size: 320} # optional: handed to the handler as event["params"]
    edges:
      - {from: detect, to: face, select: people, fan_out: true}   # max_items: 1000 (at most 100000)
      - {from: face, to: report, fan_in: true}
    max_invocations: 10000        # optional: invocations one request may run (at most 1000000)

Semantics (the engine's, `engine.py`):

- Entry functions (no incoming edge) are invoked once with the request's event.
- An edge delivers the upstream output (or its field ``select``) to the downstream function: once per
  upstream invocation, or, with ``fan_out``, once per item of that list.
- A fan-out list longer than the edge's ``max_items`` fails the upstream call (and so the request)
  with an error naming the edge and the limit; a call whose output would start invocations past the
  workflow's ``max_invocations`` fails too (every function's invocations together: fan-outs in a
  row multiply). Items start lazily: at most twice the downstream
  function's ``max_instances`` invocations of one request are launched at a time; the next item
  starts as one finishes (back-pressure: a wide fan-out holds no task per item).
- A function without ``fan_in`` is invoked once per delivered item; its event is the item (a JSON
  object; anything else arrives wrapped as ``{"value": item}``).
- A function whose incoming edges are ``fan_in`` waits until every upstream invocation of the request
  has finished and is invoked once with ``{"inputs": {upstream: [items...]}}`` (items in a fixed
  order: the order of the fan-out lists, not of completion). A function with more than one upstream
  function must be fan-in.
- Batching (``max_batch_size`` > 1 and ``max_queue_delay_ms`` > 0): an ``infer`` of one invocation
  waits up to ``max_queue_delay_ms`` for ``infer`` calls of other invocations of the same function
  on the same model and per-sample input shape and dtype; together (at most ``max_batch_size``
  samples) they run as one inference at the batch size they add up to, and each caller gets its own
  rows of the outputs. ``max_batch_size`` counts samples (as Triton's does), so it must hold at
  least two invocations' (``2 x batch_size``); both are set or neither (one alone is a validation
  error, docs/workflows.md "Batching").
- The response's output is the result of ``output``, or, by default, of the only sink (function
  without outgoing edges), or a mapping sink -> result when there are several. A function's result is
  a single value when it runs once per request, and a list when a fan-out upstream (not closed by a
  fan-in) makes it run once per item.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any

from pydantic import Field, PrivateAttr, StringConstraints, ValidationError

# A function's fields are defined once, beside the proxy's record of it (issue 15).
from streambox.api_proxy.function_spec import (
    DEFAULT_TIMEOUT_MS,
    MAX_TIMEOUT_MS,
    FunctionSpec,
    StrictModel,
)

NAME_PATTERN = r"^[a-z0-9][a-z0-9_-]*$"
Name = Annotated[str, StringConstraints(pattern=NAME_PATTERN, max_length=64)]
DEFAULT_MAX_ITEMS = 1000  # items one fan-out may start (per upstream invocation)
MAX_ITEMS_CEILING = 100_000
# Invocations one request may run, every function together: fan-outs in a row multiply, and each
# invocation costs a task, a record in the response and an instance's time.
DEFAULT_MAX_INVOCATIONS = 10_000
MAX_INVOCATIONS_CEILING = 1_000_000


class EdgeSpec(StrictModel):
    source: Name = Field(alias="from")
    to: Name
    select: str | None = Field(None, min_length=1, description="field of the upstream output to pass")
    fan_out: bool = Field(False, description="one downstream invocation per item of a list")
    max_items: int = Field(
        DEFAULT_MAX_ITEMS, ge=1, le=MAX_ITEMS_CEILING, description="a longer fan-out list fails its call"
    )
    fan_in: bool = Field(False, description="the downstream waits for all upstream invocations")


class WorkflowSpec(StrictModel):
    name: Name
    description: str = ""
    slo_ms: float = Field(gt=0, le=MAX_TIMEOUT_MS)
    timeout_ms: float = Field(DEFAULT_TIMEOUT_MS, gt=0, le=MAX_TIMEOUT_MS)
    output: Name | None = None
    functions: dict[Name, FunctionSpec] = Field(min_length=1)
    edges: list[EdgeSpec] = Field(default_factory=list)
    max_invocations: int = Field(
        DEFAULT_MAX_INVOCATIONS,
        ge=1,
        le=MAX_INVOCATIONS_CEILING,
        description="invocations one request may run, all functions together (fan-outs multiply)",
    )

    # Where the YAML file lives: handler modules beside it are importable (see `handlers.py`).
    _base_dir: Path | None = PrivateAttr(default=None)

    @property
    def base_dir(self) -> Path | None:
        return self._base_dir

    def with_base_dir(self, base_dir: Path | None) -> WorkflowSpec:
        spec = self.model_copy()
        spec._base_dir = base_dir
        return spec

    def with_params(self, params: dict[str, dict[str, Any]]) -> WorkflowSpec:
        """A copy whose functions' params are updated (merged) with `params[function]`."""
        unknown = sorted(set(params) - set(self.functions))
        if unknown:
            raise KeyError(f"workflow {self.name!r} has no functions {unknown}")
        functions = {}
        for name, fn in self.functions.items():  # checked as the YAML's are (JSON values, finite numbers)
            merged = {**fn.params, **params.get(name, {})}
            try:
                functions[name] = type(fn).model_validate({**fn.model_dump(), "params": merged})
            except ValidationError as error:
                first = error.errors()[0]
                where = ".".join(str(part) for part in first["loc"])
                why = f"{first['msg']} (got {first['input']!r})"
                raise ValueError(f"function {name!r}: {where}: {why}") from None
        return self.model_copy(update={"functions": functions}).with_base_dir(self._base_dir)

    def graph(self) -> WorkflowGraph:
        return WorkflowGraph.of(self)


@dataclass(frozen=True)
class WorkflowGraph:
    """The DAG of a spec whose edges name existing functions (checked by `check_graph`)."""

    functions: tuple[str, ...]
    upstream: dict[str, tuple[EdgeSpec, ...]]
    downstream: dict[str, tuple[EdgeSpec, ...]]

    @classmethod
    def of(cls, spec: WorkflowSpec) -> WorkflowGraph:
        names = tuple(spec.functions)
        up: dict[str, list[EdgeSpec]] = {n: [] for n in names}
        down: dict[str, list[EdgeSpec]] = {n: [] for n in names}
        for edge in spec.edges:
            down.setdefault(edge.source, []).append(edge)
            up.setdefault(edge.to, []).append(edge)
        return cls(
            names,
            {n: tuple(e) for n, e in up.items()},
            {n: tuple(e) for n, e in down.items()},
        )

    @property
    def entries(self) -> list[str]:
        return [n for n in self.functions if not self.upstream[n]]

    @property
    def sinks(self) -> list[str]:
        return [n for n in self.functions if not self.downstream[n]]

    def is_fan_in(self, name: str) -> bool:
        return any(e.fan_in for e in self.upstream[name])

    def topological_order(self) -> list[str]:
        order: list[str] = []
        indegree = {n: len(self.upstream[n]) for n in self.functions}
        ready = [n for n in self.functions if indegree[n] == 0]
        while ready:
            name = ready.pop(0)
            order.append(name)
            for edge in self.downstream[name]:
                indegree[edge.to] -= 1
                if indegree[edge.to] == 0:
                    ready.append(edge.to)
        return order

    def runs_many(self) -> dict[str, bool]:
        """Per function: may it run more than once per request (a fan-out above it, not closed)?"""
        many: dict[str, bool] = {}
        for name in self.topological_order():
            many[name] = not self.is_fan_in(name) and any(
                e.fan_out or many[e.source] for e in self.upstream[name]
            )
        return many

    def find_cycle(self) -> list[str] | None:
        """One cycle as a closed path [a, b, ..., a], or None."""
        state: dict[str, int] = {}  # 1 = on the current path, 2 = done
        for root in self.functions:
            if root in state:
                continue
            # Depth-first with an explicit stack: a chain of thousands of functions must not exhaust
            # Python's recursion.
            path = [root]
            state[root] = 1
            stack = [iter(self.downstream[root])]
            while stack:
                edge = next(stack[-1], None)
                if edge is None:
                    state[path.pop()] = 2
                    stack.pop()
                elif state.get(edge.to) == 1:
                    return [*path[path.index(edge.to) :], edge.to]
                elif edge.to not in state:
                    state[edge.to] = 1
                    path.append(edge.to)
                    stack.append(iter(self.downstream[edge.to]))
        return None


def check_graph(spec: WorkflowSpec) -> Iterator[tuple[tuple[str | int, ...], str]]:
    """Graph mistakes as (location in the spec, message): unknown functions, self-loops, duplicate
    edges, cycles, joins without fan-in, a bad `output`."""
    names = list(spec.functions)
    known = ", ".join(names)
    seen: dict[tuple[str, str], int] = {}
    edges_ok = True
    for i, edge in enumerate(spec.edges):
        for field, value in (("from", edge.source), ("to", edge.to)):
            if value not in spec.functions:
                edges_ok = False
                yield ("edges", i, field), f"unknown function {value!r}; functions: {known}"
        if edge.source == edge.to:
            edges_ok = False
            yield ("edges", i, "to"), f"edge from {edge.source!r} to itself"
        pair = (edge.source, edge.to)
        if pair in seen:
            edges_ok = False
            yield ("edges", i), f"duplicate edge {edge.source} -> {edge.to} (first at edges[{seen[pair]}])"
        seen.setdefault(pair, i)
    if spec.output is not None and spec.output not in spec.functions:
        yield ("output",), f"unknown function {spec.output!r}; functions: {known}"
    if not edges_ok:
        return
    graph = spec.graph()
    cycle = graph.find_cycle()
    if cycle is not None:
        closing = next(i for i, e in enumerate(spec.edges) if (e.source, e.to) == (cycle[-2], cycle[-1]))
        yield ("edges", closing), "edges form a cycle: " + " -> ".join(cycle)
        return
    for name in names:
        upstream = graph.upstream[name]
        fan_in = [e.fan_in for e in upstream]
        if any(fan_in) and not all(fan_in):
            first = spec.edges.index(next(e for e in upstream if not e.fan_in))
            yield (
                ("edges", first, "fan_in"),
                f"function {name!r} is fan-in on some incoming edges but not on this one: "
                "set fan_in on all of them",
            )
        elif len(upstream) > 1 and not any(fan_in):
            first = spec.edges.index(upstream[0])
            sources = ", ".join(e.source for e in upstream)
            yield (
                ("edges", first, "to"),
                f"function {name!r} has {len(upstream)} upstream functions ({sources}): "
                "a join must wait for all of them, set fan_in: true on its incoming edges",
            )
