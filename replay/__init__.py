"""Azure-trace replay: the researchers' harness (see docs/replay.md).

Trace readers (`traces`), workload shaping (`shaping`), the open-loop driver (`driver`), metrics and the
run directory (`metrics`), comparison plots and table (`report`), the systems' registry (`target`), and
`run_replay` (`run`), which puts them together.
"""

from __future__ import annotations

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
