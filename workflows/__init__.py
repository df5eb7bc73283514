"""Workflows: DAGs of functions in YAML, the engine that runs one request of a DAG through an
invoker, the HTTP gateway, the run-local invoker, and the paper's three workflows (`examples`).

Modules: ``spec`` (schema and graph), ``validation`` (YAML with file/line/field errors),
``handlers`` (module:function references), ``invoker`` (the contract with the API proxy),
``engine`` (fan-out, fan-in, timeouts, per-function breakdown), ``local`` (embedded invoker on the
real executor and device), ``gateway`` + ``metrics`` (aiohttp server, Prometheus), ``commands``
(what the CLI calls).
"""

from .engine import CallRecord, Engine, RequestResult, UnknownWorkflow
from .invoker import InvocationError, InvocationResult, InvocationTimeout, Invoker, RuntimeStats, StatsSource
from .spec import EdgeSpec, FunctionSpec, WorkflowGraph, WorkflowSpec
from .validation import Issue, WorkflowValidationError, parse_spec, validate_file

__all__ = [
    "CallRecord",
    "EdgeSpec",
    "Engine",
    "FunctionSpec",
    "InvocationError",
    "InvocationResult",
    "InvocationTimeout",
    "Invoker",
    "Issue",
    "RequestResult",
    "RuntimeStats",
    "StatsSource",
    "UnknownWorkflow",
    "WorkflowGraph",
    "WorkflowSpec",
    "WorkflowValidationError",
    "parse_spec",
    "validate_file",
]
