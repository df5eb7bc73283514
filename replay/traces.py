"""Readers for the Azure Functions traces: the 2019 per-minute files and the 2021 per-invocation log.

Every file is recognised by its header, never by its name:

- invocations per function per minute (2019): id columns (`HashOwner`, `HashApp`, `HashFunction`,
  `Trigger`, any subset that holds `HashFunction`, in any order) followed by minute columns named
  `1..N` (the original layout) or `minute_1..minute_N` (the invitro layout);
- function durations (2019): `percentile_Average_*` and friends, in milliseconds;
- app memory (2019): `AverageAllocatedMb*`, keyed by app (original) or by function (Freyr's layout);
- per-invocation log (2021): `app,func,end_timestamp,duration` in seconds.

A file in another layout raises `TraceFormatError` naming the file, the columns found and the
layouts expected. `load_trace` takes one file or a folder and joins what it finds on (app, function),
as the dataset's documentation asks (HashFunction is unique only within an app).
"""

from __future__ import annotations

import csv
import gzip
import io
import math
import re
import warnings
import zlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import BinaryIO, TextIO

import numpy as np

TRIGGERS = ("http", "timer", "event", "queue", "storage", "orchestration", "others")
ID_COLUMNS = ("HashOwner", "HashApp", "HashFunction", "Trigger")
DURATION_PERCENTILES = (0, 1, 25, 50, 75, 99, 100)
MEMORY_PERCENTILES = (1, 5, 25, 50, 75, 95, 99, 100)
DURATION_COLUMNS = ("Average", "Count", "Minimum", "Maximum") + tuple(
    f"percentile_Average_{p}" for p in DURATION_PERCENTILES
)
MEMORY_COLUMNS = ("SampleCount", "AverageAllocatedMb") + tuple(
    f"AverageAllocatedMb_pct{p}" for p in MEMORY_PERCENTILES
)
LOG_2021_COLUMNS = ("app", "func", "end_timestamp", "duration")

_MINUTE = re.compile(r"^(minute_)?(\d+)$")
#: Range checks: no function of the Azure traces comes near these; beyond them a file is a mistake
#: (or an attack on the replayer's memory), reported with its file and line.
MAX_MINUTE_COUNT = 10_000_000  # invocations of one function in one minute
MAX_LOG_SECONDS = 31 * 24 * 3600.0  # timestamps and durations of the 2021 log

#: What each kind of file must look like, for error messages.
EXPECTED_LAYOUTS = {
    "invocations (2019, original)": "HashOwner,HashApp,HashFunction,Trigger,1,2,...,1440",
    "invocations (invitro)": "HashFunction,HashOwner,HashApp,minute_1,...,minute_N",
    "invocations (Freyr)": "HashFunction,Trigger,1,...,N",
    "durations (2019)": "[HashOwner,HashApp,]HashFunction," + ",".join(DURATION_COLUMNS),
    "memory (2019)": "HashOwner,HashApp," + ",".join(MEMORY_COLUMNS) + "  (or HashFunction,... as in Freyr)",
    "invocations (2021)": ",".join(LOG_2021_COLUMNS),
}


class TraceFormatError(ValueError):
    """A trace file that cannot be read; the message names the file, what was found and what was
    expected."""


def _layout_error(path: Path, found: Sequence[str], problem: str) -> TraceFormatError:
    shown = list(found[:12]) + ([f"... ({len(found)} columns)"] if len(found) > 12 else [])
    expected = "\n".join(f"  {kind}: {columns}" for kind, columns in EXPECTED_LAYOUTS.items())
    return TraceFormatError(
        f"{path}: {problem}\n columns found: {','.join(shown) or '(none: empty file)'}\n"
        f" layouts expected:\n{expected}"
    )


@dataclass(frozen=True, order=True)
class FunctionKey:
    """A function of the trace. `owner` and `app` are "" where the layout has none (Freyr's)."""

    app: str
    function: str
    owner: str = ""

    @property
    def join_key(self) -> tuple[str, str]:
        return (self.app, self.function)

    def label(self) -> str:
        """A short name for tables and plots: 8 characters of each hash."""
        return f"{self.app[:8]}/{self.function[:8]}" if self.app else self.function[:12]

    def __str__(self) -> str:
        return f"{self.app}/{self.function}" if self.app else self.function


@dataclass
class FunctionSeries:
    """One function's invocations per minute (and, for the 2021 log, its arrival times)."""

    key: FunctionKey
    trigger: str | None
    counts: np.ndarray  # int64, one entry per trace minute
    arrivals_s: np.ndarray | None = None  # 2021 only: sorted arrival times in seconds from minute 0

    @property
    def total(self) -> int:
        return int(self.counts.sum())


@dataclass(frozen=True)
class DurationStats:
    """Execution time of a function in milliseconds (2019: weighted percentiles of 30 s averages,
    cold starts excluded; 2021: percentiles of single invocations)."""

    average_ms: float
    count: int
    minimum_ms: float
    maximum_ms: float
    percentiles_ms: tuple[float, ...]  # at DURATION_PERCENTILES

    def quantile(self, q: np.ndarray | float) -> np.ndarray:
        """Inverse CDF, linear between the published percentiles (q in [0, 1])."""
        points = np.asarray(DURATION_PERCENTILES, dtype=float) / 100.0
        values = np.maximum.accumulate(np.asarray(self.percentiles_ms, dtype=float))
        return np.interp(q, points, values)

    def sample_ms(self, rng: np.random.Generator, n: int) -> np.ndarray:
        return self.quantile(rng.random(n))


@dataclass(frozen=True)
class MemoryStats:
    """Allocated memory in MB, per app (2019 original) or per function (Freyr's layout)."""

    scope: str  # "app" or "function"
    sample_count: int
    average_mb: float
    percentiles_mb: tuple[float, ...]  # at MEMORY_PERCENTILES


@dataclass
class Trace:
    """What `load_trace` found: the invocation series and, where present, durations and memory."""

    functions: list[FunctionSeries]
    minutes: int
    layout: str
    sources: dict[str, str] = field(default_factory=dict)  # kind -> path
    durations: dict[tuple[str, str], DurationStats] = field(default_factory=dict)
    memory_by_app: dict[str, MemoryStats] = field(default_factory=dict)
    memory_by_function: dict[str, MemoryStats] = field(default_factory=dict)

    def duration(self, key: FunctionKey) -> DurationStats | None:
        return self.durations.get(key.join_key)

    def memory(self, key: FunctionKey) -> MemoryStats | None:
        if key.app and key.app in self.memory_by_app:
            return self.memory_by_app[key.app]
        return self.memory_by_function.get(key.function)

    def series(self, key: FunctionKey) -> FunctionSeries:
        for series in self.functions:
            if series.key == key:
                return series
        raise KeyError(f"function {key} is not in the trace ({len(self.functions)} functions)")


# -- opening and sniffing ------------------------------------------------------------------------------


class _NamedText(io.TextIOWrapper):
    """A trace file's text: a byte that is not UTF-8, or a damaged or truncated gzip stream, is a
    `TraceFormatError` naming the file, wherever the reading stops."""

    def __init__(self, path: Path, raw: BinaryIO) -> None:
        super().__init__(raw, encoding="utf-8-sig", newline="")
        self._path = path

    def _named(self, read: Callable[[], str]) -> str:
        try:
            return read()
        except (UnicodeDecodeError, EOFError, zlib.error, gzip.BadGzipFile) as error:
            utf8 = isinstance(error, UnicodeDecodeError)
            why = "not UTF-8 text" if utf8 else "a damaged or truncated gzip file"
            raise TraceFormatError(f"{self._path}: {why} ({type(error).__name__}: {error})") from None

    def readline(self, size: int = -1) -> str:  # type: ignore[override]
        return self._named(lambda: super(_NamedText, self).readline(size))

    def read(self, size: int | None = -1) -> str:  # type: ignore[override]
        return self._named(lambda: super(_NamedText, self).read(size))

    def __next__(self) -> str:
        return self._named(lambda: super(_NamedText, self).__next__())


def _open_text(path: Path) -> TextIO:
    raw = gzip.open(path, "rb") if path.suffix == ".gz" else open(path, "rb")  # noqa: SIM115 - closed by the wrapper
    return _NamedText(path, raw)


def read_header(path: Path) -> list[str]:
    with _open_text(path) as stream:
        first = stream.readline()
    return [column.strip() for column in next(csv.reader([first]), [])]


def sniff(path: Path) -> str:
    """The kind of a trace file from its header: invocations, durations, memory or log2021."""
    header = read_header(path)
    names = set(header)
    if set(LOG_2021_COLUMNS) <= names:
        return "log2021"
    if any(_MINUTE.match(column) for column in header):
        return "invocations"
    if any(column.startswith("percentile_Average_") for column in header):
        return "durations"
    if "AverageAllocatedMb" in names:
        return "memory"
    raise _layout_error(path, header, "not a trace file layout this reader knows")


def _data_lines(stream: TextIO) -> Iterator[tuple[int, str]]:
    for number, line in enumerate(stream, start=2):
        line = line.rstrip("\r\n")
        if line.strip():
            yield number, line


# -- 2019: invocations per function per minute ---------------------------------------------------------


def read_invocations(path: str | Path) -> tuple[list[FunctionSeries], str]:
    """Read a 2019 invocations file; returns the series and the layout's name."""
    path = Path(path)
    header = read_header(path)
    ids = [column for column in header if column in ID_COLUMNS]
    minute_numbers = []
    unknown = []
    for column in header[len(ids):]:
        match = _MINUTE.match(column)
        if match:
            minute_numbers.append(int(match.group(2)))
        else:
            unknown.append(column)
    if header[: len(ids)] != ids or unknown or "HashFunction" not in ids or not minute_numbers:
        problem = "not an invocations-per-minute layout"
        if unknown:
            problem += f" (unexpected columns: {','.join(unknown[:5])})"
        elif "HashFunction" not in ids:
            problem += " (no HashFunction column)"
        raise _layout_error(path, header, problem)
    if minute_numbers != list(range(1, len(minute_numbers) + 1)):
        raise _layout_error(path, header, "minute columns are not numbered 1..N in order")
    layout = {
        ("HashOwner", "HashApp", "HashFunction", "Trigger"): "azure2019",
        ("HashFunction", "HashOwner", "HashApp"): "invitro",
        ("HashFunction", "Trigger"): "freyr",
    }.get(tuple(ids), "azure2019-variant")
    width = len(header)
    series: list[FunctionSeries] = []
    first_line: dict[str, tuple[int, int]] = {}  # app/function -> (its first line, its series' index)
    with _open_text(path) as stream:
        stream.readline()
        for number, line in _data_lines(stream):
            cells = line.split(",")
            if len(cells) != width:
                raise TraceFormatError(
                    f"{path}, line {number}: {len(cells)} cells where the header has {width} columns"
                )
            values = dict(zip(ids, cells, strict=False))
            counts = _minute_counts(path, number, cells[len(ids):], header[len(ids):])
            trigger = values.get("Trigger")
            key = FunctionKey(values.get("HashApp", ""), values["HashFunction"], values.get("HashOwner", ""))
            seen = first_line.get(str(key))
            if seen is not None:  # one function in two rows: one function, its invocations summed
                line, index = seen
                series[index].counts = series[index].counts + counts
                warnings.warn(
                    f"{path}, line {number}: function {key} already has line {line}; their invocations "
                    "are added up (one function of the trace)",
                    stacklevel=2,
                )
                continue
            first_line[str(key)] = (number, len(series))
            kind = trigger.strip().lower() if trigger is not None else None
            series.append(FunctionSeries(key, kind, counts))
    return series, layout


def _minute_counts(path: Path, number: int, cells: Sequence[str], columns: Sequence[str]) -> np.ndarray:
    """The minute counts of one line, each an integer in [0, MAX_MINUTE_COUNT]."""
    counts = np.empty(len(cells), dtype=np.int64)
    for i, cell in enumerate(cells):
        text = cell.strip()
        if not (text.isascii() and text.isdigit()):  # not str.isdigit alone: it takes '²' and '٣'
            negative = text.startswith("-") and text[1:].isascii() and text[1:].isdigit()
            what = "negative invocation count" if negative else "a minute count is not an integer"
            raise TraceFormatError(f"{path}, line {number}: {what} (column {columns[i]}: {cell!r})")
        if len(text) > 8 or int(text) > MAX_MINUTE_COUNT:
            raise TraceFormatError(
                f"{path}, line {number}: minute count {text} (column {columns[i]}) is above the "
                f"{MAX_MINUTE_COUNT} invocations per minute a trace may hold"
            )
        counts[i] = int(text)
    return counts


# -- 2019: durations and memory ------------------------------------------------------------------------


def _check_columns(path: Path, header: list[str], required: Sequence[str], what: str) -> None:
    missing = [column for column in required if column not in header]
    if missing:
        raise _layout_error(path, header, f"not a {what} layout (missing: {','.join(missing)})")


def _rows(path: Path) -> Iterator[tuple[int, dict[str, str]]]:
    with _open_text(path) as stream:
        reader = csv.DictReader(stream)
        for number, row in enumerate(reader, start=2):
            if any(value and value.strip() for value in row.values() if isinstance(value, str)):
                yield number, row


def _non_negative(path: Path, number: int, row: dict[str, str], column: str) -> float:
    """A duration, count or size: a number, not below 0."""
    value = _number(path, number, row, column)
    if value < 0:
        raise TraceFormatError(f"{path}, line {number}: column {column} is {row[column]!r}, below 0")
    return value


def _key(path: Path, number: int, row: dict[str, str], column: str) -> str:
    """A hash naming a function or app: not empty."""
    value = row.get(column) or ""
    if not value.strip():
        raise TraceFormatError(f"{path}, line {number}: column {column} is empty")
    return value  # as written: the invocations file's keys are too


def _number(path: Path, number: int, row: dict[str, str], column: str) -> float:
    try:
        value = float(row[column])
    except (TypeError, ValueError):
        raise TraceFormatError(
            f"{path}, line {number}: column {column} is {row.get(column)!r}, not a number"
        ) from None
    if not math.isfinite(value):
        raise TraceFormatError(f"{path}, line {number}: column {column} is {row[column]!r}, not finite")
    return value


def read_durations(path: str | Path) -> dict[tuple[str, str], DurationStats]:
    """Read a 2019 durations file, keyed by (HashApp or "", HashFunction)."""
    path = Path(path)
    header = read_header(path)
    _check_columns(path, header, ("HashFunction",) + DURATION_COLUMNS, "durations")
    result = {}
    for number, row in _rows(path):
        values = [_non_negative(path, number, row, column) for column in DURATION_COLUMNS]
        result[(row.get("HashApp", "") or "", _key(path, number, row, "HashFunction"))] = DurationStats(
            values[0], int(values[1]), values[2], values[3], tuple(values[4:])
        )
    return result


def read_memory(path: str | Path) -> tuple[dict[str, MemoryStats], str]:
    """Read a 2019 app-memory file; returns stats keyed by HashApp (original layout) or by HashFunction
    (Freyr's layout, whose synthetic `Ideal` column is ignored), and the scope."""
    path = Path(path)
    header = read_header(path)
    _check_columns(path, header, MEMORY_COLUMNS, "memory")
    if "HashApp" in header:
        scope, key_column = "app", "HashApp"
    elif "HashFunction" in header:
        scope, key_column = "function", "HashFunction"
    else:
        raise _layout_error(path, header, "a memory layout without HashApp or HashFunction")
    result = {}
    for number, row in _rows(path):
        values = [_non_negative(path, number, row, column) for column in MEMORY_COLUMNS]
        key = _key(path, number, row, key_column)
        result[key] = MemoryStats(scope, int(values[0]), values[1], tuple(values[2:]))
    return result, scope


# -- 2021: per-invocation log --------------------------------------------------------------------------


def read_log_2021(path: str | Path) -> tuple[list[FunctionSeries], dict[tuple[str, str], DurationStats]]:
    """Read the 2021 log (`app,func,end_timestamp,duration`, seconds). Arrival = end - duration;
    the few invocations that started before the trace (arrival < 0) are put at 0. Per-minute counts
    are derived from the arrivals; durations become per-function percentiles of single invocations."""
    path = Path(path)
    header = read_header(path)
    _check_columns(path, header, LOG_2021_COLUMNS, "2021 per-invocation")
    per_function: dict[tuple[str, str], list[tuple[float, float]]] = {}
    for number, row in _rows(path):
        end = _number(path, number, row, "end_timestamp")
        duration = _number(path, number, row, "duration")
        if duration < 0:
            raise TraceFormatError(f"{path}, line {number}: negative duration {duration}")
        for column, value in (("end_timestamp", end), ("duration", duration)):
            if abs(value) > MAX_LOG_SECONDS:
                raise TraceFormatError(
                    f"{path}, line {number}: column {column} is {value:g} s; a 2021 log spans at most "
                    f"{MAX_LOG_SECONDS:g} s (31 days)"
                )
        per_function.setdefault((row["app"], row["func"]), []).append((max(end - duration, 0.0), duration))
    if not per_function:
        return [], {}
    minutes = int(max(a for rows in per_function.values() for a, _ in rows) // 60) + 1
    series, durations = [], {}
    for (app, func), rows in sorted(per_function.items()):
        arrivals = np.sort(np.array([a for a, _ in rows]))
        counts = np.bincount((arrivals // 60).astype(np.int64), minlength=minutes).astype(np.int64)
        series.append(FunctionSeries(FunctionKey(app, func), None, counts, arrivals))
        ms = np.array([d for _, d in rows]) * 1000.0
        durations[(app, func)] = DurationStats(
            float(ms.mean()), len(ms), float(ms.min()), float(ms.max()),
            tuple(float(v) for v in np.percentile(ms, DURATION_PERCENTILES)),
        )
    return series, durations


# -- one entry point -----------------------------------------------------------------------------------


def _trace_files(path: Path) -> list[Path]:
    if path.is_dir():
        files = sorted(p for p in path.iterdir() if p.is_file() and p.name.endswith((".csv", ".txt", ".gz")))
        if not files:
            raise TraceFormatError(f"{path}: a folder with no .csv, .txt or .gz trace file")
        return files
    if not path.exists():
        raise TraceFormatError(f"{path}: no such trace file or folder")
    return [path]


def load_trace(path: str | Path) -> Trace:
    """Load one trace file, or a folder holding one invocations file (or one 2021 log) and optionally a
    durations file and a memory file of the same subset. Files are recognised by their headers."""
    path = Path(path)
    by_kind: dict[str, Path] = {}
    for file in _trace_files(path):
        kind = sniff(file)
        if kind in by_kind:
            raise TraceFormatError(
                f"{path}: two {kind} files ({by_kind[kind].name}, {file.name}); give one file or a folder "
                "holding one subset"
            )
        by_kind[kind] = file
    if "invocations" in by_kind and "log2021" in by_kind:
        raise TraceFormatError(f"{path}: both a 2019 invocations file and a 2021 log; give one")
    if "log2021" in by_kind:
        functions, durations = read_log_2021(by_kind["log2021"])
        layout = "azure2021"
    elif "invocations" in by_kind:
        functions, layout = read_invocations(by_kind["invocations"])
        durations = {}
    else:
        found = ", ".join(f"{f.name} ({kind})" for kind, f in by_kind.items())
        raise TraceFormatError(f"{path}: no invocations file among: {found}")
    trace = Trace(
        functions,
        max((len(s.counts) for s in functions), default=0),
        layout,
        sources={kind: str(file) for kind, file in by_kind.items()},
        durations=durations,
    )
    if "durations" in by_kind:
        trace.durations.update(read_durations(by_kind["durations"]))
    if "memory" in by_kind:
        memory, scope = read_memory(by_kind["memory"])
        if scope == "app":
            trace.memory_by_app = memory
        else:
            trace.memory_by_function = memory
    return trace
