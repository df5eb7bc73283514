"""Azure-trace replay: the researchers' harness (see docs/replay.md).

Trace readers (`traces`), workload shaping (`shaping`), the open-loop driver (`driver`), metrics and the
run directory (`metrics`), comparison plots and table (`report`), the systems' registry (`target`), and
`run_replay` (`run`), which puts them together.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .driver import DriveResult, RequestRecord, drive
    from .run import (
        ReplayConfig,
        RunResult,
        build_workload,
        execute,
        execute_async,
        run_comparison,
        run_replay,
        sample_trace,
    )
    from .shaping import (
        Arrival,
        Pattern,
        PatternRules,
        build_arrivals,
        choose_functions,
        classify,
        map_to_workflows,
        minute_arrivals,
        scale_counts,
    )
    from .target import (
        Outcome,
        SystemRequest,
        Target,
        UnknownSystem,
        known_systems,
        register_system,
        resolve_system,
    )
    from .traces import FunctionKey, FunctionSeries, Trace, TraceFormatError, load_trace

#: Where each name lives: imported at first use, so that `streambox replay --help` (which imports
#: `replay.cli`) loads no more than the parser needs.
_EXPORTS = {
    **dict.fromkeys(("DriveResult", "RequestRecord", "drive"), "driver"),
    **dict.fromkeys(
        ("ReplayConfig", "RunResult", "build_workload", "execute", "execute_async", "run_comparison",
         "run_replay", "sample_trace"),
        "run",
    ),
    **dict.fromkeys(
        ("Arrival", "Pattern", "PatternRules", "build_arrivals", "choose_functions", "classify",
         "map_to_workflows", "minute_arrivals", "scale_counts"),
        "shaping",
    ),
    **dict.fromkeys(
        ("Outcome", "SystemRequest", "Target", "UnknownSystem", "known_systems", "register_system",
         "resolve_system"),
        "target",
    ),
    **dict.fromkeys(("FunctionKey", "FunctionSeries", "Trace", "TraceFormatError", "load_trace"), "traces"),
}  # fmt: skip


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f".{module}", __name__), name)


__all__ = [
    "Arrival",
    "DriveResult",
    "FunctionKey",
    "FunctionSeries",
    "Outcome",
    "Pattern",
    "PatternRules",
    "ReplayConfig",
    "RequestRecord",
    "RunResult",
    "SystemRequest",
    "Target",
    "Trace",
    "TraceFormatError",
    "UnknownSystem",
    "build_arrivals",
    "build_workload",
    "choose_functions",
    "classify",
    "drive",
    "execute",
    "execute_async",
    "known_systems",
    "load_trace",
    "map_to_workflows",
    "minute_arrivals",
    "register_system",
    "resolve_system",
    "run_comparison",
    "run_replay",
    "sample_trace",
    "scale_counts",
]


def report(run_dirs, out_dir):  # noqa: ANN001, ANN201 - lazy: matplotlib loads only when reporting
    """Comparison plots and table of replay runs; see `streambox.replay.report.report`."""
    from .report import report as _report

    return _report(run_dirs, out_dir)
