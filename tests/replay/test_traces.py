"""Trace readers on real rows of the Azure Functions 2019 trace, in the original layout and in the
modified layouts users meet (invitro, Freyr), on a 2021-style log, and on files they cannot read."""

from __future__ import annotations

import gzip
from pathlib import Path

import numpy as np
import pytest

from streambox.replay import load_trace, sample_trace
from streambox.replay.traces import (
    TraceFormatError,
    read_durations,
    read_invocations,
    read_log_2021,
    read_memory,
    sniff,
)

DATA = Path(__file__).parent / "data"
SHARED = Path(__file__).resolve().parents[2].parent / "shared" / "traces" / "azure2019"


def test_original_layout_real_rows():
    series, layout = read_invocations(DATA / "function-simulator" / "test_workload.csv")
    assert layout == "azure2019"
    assert len(series) == 9
    first = series[0]
    assert first.key.owner.startswith("71ca12c7")
    assert first.key.app.startswith("7ca324d9")
    assert first.key.function.startswith("520dbd6b")
    assert first.trigger == "http"
    assert len(first.counts) == 1440
    assert first.counts[:10].tolist() == [0, 0, 0, 1, 0, 0, 0, 0, 1, 0]  # the file's first cells
    assert sorted({s.trigger for s in series}) == ["http", "orchestration"]


def test_shipped_sample_joins_invocations_durations_and_memory():
    trace = load_trace(sample_trace())
    assert trace.layout == "invitro"
    assert trace.minutes == 1440
    assert len(trace.functions) == 12
    assert sum(s.total for s in trace.functions) == 7861  # as ATTRIBUTION.md says
    for series in trace.functions:
        assert series.trigger is None  # the invitro layout drops the trigger
        assert trace.duration(series.key) is not None
        assert trace.memory(series.key) is not None
    key = next(s.key for s in trace.functions if s.key.function.startswith("bd28ee14"))
    assert trace.duration(key).percentiles_ms == (42.0, 46.0, 78.0, 109.0, 204.0, 1358.0, 38909.0)
    assert trace.duration(key).count == 1440
    assert trace.memory(key).average_mb == 112.0
    assert trace.memory(key).scope == "app"


def test_freyr_layout_real_rows():
    folder = DATA / "freyr-sim"
    kinds = {sniff(f): f for f in folder.iterdir() if f.suffix == ".csv"}
    assert set(kinds) == {"invocations", "durations", "memory"}
    trace = load_trace(folder)
    assert trace.layout == "freyr"
    assert trace.minutes == 60 and len(trace.functions) == 20
    zero = trace.functions[0]
    assert (zero.key.app, zero.key.function, zero.trigger) == ("", "0", "timer")
    assert zero.counts[:6].tolist() == [1, 0, 0, 0, 0, 1]
    assert trace.duration(zero.key).percentiles_ms[3] == 140.0  # percentile_Average_50 of function 0
    memory = trace.memory(zero.key)
    assert memory.scope == "function" and memory.average_mb == 189.0  # Freyr's Ideal column is ignored


@pytest.mark.skipif(not SHARED.exists(), reason="the workspace's shared/ traces are not beside the checkout")
@pytest.mark.parametrize("folder,functions,minutes", [
    ("invitro-2022", 100, 1440),
    ("freyr-sim", 1000, 60),
    ("function-simulator/integration_data.csv", 1, 1440),
])
def test_full_shared_samples(folder, functions, minutes):
    trace = load_trace(SHARED / folder)
    assert (len(trace.functions), trace.minutes) == (functions, minutes)


def test_wrong_layout_names_file_columns_found_and_expected(tmp_path):
    bad = tmp_path / "bad.csv"
    bad.write_text("func,when,count\nf,1,2\n")
    with pytest.raises(TraceFormatError) as error:
        load_trace(bad)
    message = str(error.value)
    assert str(bad) in message
    assert "columns found: func,when,count" in message
    assert "HashOwner,HashApp,HashFunction,Trigger,1,2,...,1440" in message  # the original layout
    assert "app,func,end_timestamp,duration" in message  # the 2021 log


def test_durations_file_given_as_invocations_says_what_is_missing(tmp_path):
    unexpected = r"not an invocations-per-minute layout \(unexpected columns: Average"
    with pytest.raises(TraceFormatError, match=unexpected):
        read_invocations(DATA / "freyr-sim" / "exp_sim_duration_traces_0.head20.csv")
    memory_file = tmp_path / "memory.csv"
    memory_file.write_text("HashApp,SampleCount,AverageAllocatedMb\na,1,2\n")
    with pytest.raises(TraceFormatError, match="missing: AverageAllocatedMb_pct1"):
        read_memory(memory_file)


def test_bad_cells_name_the_line(tmp_path):
    bad = tmp_path / "inv.csv"
    bad.write_text("HashFunction,Trigger,1,2\nf,http,1,x\n")
    with pytest.raises(TraceFormatError, match=r"inv.csv, line 2: a minute count is not an integer"):
        read_invocations(bad)
    short = tmp_path / "short.csv"
    short.write_text("HashFunction,Trigger,1,2\nf,http,1\n")
    with pytest.raises(TraceFormatError, match=r"line 2: 3 cells where the header has 4 columns"):
        read_invocations(short)
    gap = tmp_path / "gap.csv"
    gap.write_text("HashFunction,1,3\nf,1,1\n")
    with pytest.raises(TraceFormatError, match="not numbered 1..N"):
        read_invocations(gap)


def test_a_trace_without_functions_is_named(tmp_path):
    header_only = tmp_path / "invocations.csv"
    header_only.write_text("HashFunction,Trigger,1,2\n")
    from streambox.replay.run import build_workload, replay_config

    with pytest.raises(ValueError, match="holds no function's invocations"):
        build_workload(replay_config(header_only, minutes=1))


def test_a_function_in_two_rows_is_one_function_with_their_invocations_added(tmp_path):
    twice = tmp_path / "inv.csv"
    rows = ["HashFunction,HashOwner,HashApp,minute_1,minute_2", "f1,o1,a1,3,4", "f2,o1,a1,1,1"]
    rows.append("f1,o1,a1,7,0")
    twice.write_text("\n".join(rows) + "\n")
    with pytest.warns(UserWarning, match=r"inv.csv, line 4: function a1/f1 already has line 2; their"):
        series, _ = read_invocations(twice)
    assert [(str(s.key), s.counts.tolist()) for s in series] == [("a1/f1", [10, 4]), ("a1/f2", [1, 1])]


def test_missing_trace_is_a_clear_error(tmp_path):
    with pytest.raises(TraceFormatError, match="no such trace file or folder"):
        load_trace(tmp_path / "nope.csv")


LOG_2021 = """app,func,end_timestamp,duration
a1,f1,0.5,0.25
a1,f1,61.0,1.0
a1,f1,65.0,0.5
a2,f9,130.2,0.2
a1,f1,10.0,12.0
"""


def test_log_2021_arrivals_counts_and_durations(tmp_path):
    path = tmp_path / "invocations_2021.txt"
    path.write_text(LOG_2021)
    series, durations = read_log_2021(path)
    assert [str(s.key) for s in series] == ["a1/f1", "a2/f9"]
    f1, f9 = series
    # arrival = end - duration; the one that started before the trace (10 - 12 < 0) is put at 0
    assert f1.arrivals_s.tolist() == [0.0, 0.25, 60.0, 64.5]
    assert f1.counts.tolist() == [2, 2, 0]
    assert f9.counts.tolist() == [0, 0, 1]
    assert durations[("a1", "f1")].count == 4
    assert durations[("a1", "f1")].maximum_ms == 12000.0
    gz = tmp_path / "log.txt.gz"
    gz.write_bytes(gzip.compress(LOG_2021.encode()))
    trace = load_trace(gz)
    assert trace.layout == "azure2021" and trace.minutes == 3
    assert np.array_equal(trace.functions[0].counts, f1.counts)


def test_duration_quantiles_interpolate_between_published_percentiles():
    durations = read_durations(DATA / "freyr-sim" / "exp_sim_duration_traces_0.head20.csv")
    zero = durations[("", "0")]  # 23, 43, 107, 140, 280, 3317, 4084 at 0, 1, 25, 50, 75, 99, 100
    assert zero.quantile(0.5) == 140.0
    assert zero.quantile(0.375) == pytest.approx((107 + 140) / 2)
    assert zero.quantile(1.0) == 4084.0


def test_durations_and_memory_are_never_negative_and_name_their_function(tmp_path):
    """A negative Average, Count or percentile was taken as it was; an empty HashFunction too."""
    from streambox.replay.traces import DURATION_COLUMNS, MEMORY_COLUMNS

    durations = tmp_path / "durations.csv"
    header = "HashOwner,HashApp,HashFunction," + ",".join(DURATION_COLUMNS)
    cells = ["5"] * len(DURATION_COLUMNS)
    durations.write_text(f"{header}\no,a,f,{','.join(cells)}\n")
    assert read_durations(durations)[("a", "f")].average_ms == 5
    cells[1] = "-1"
    durations.write_text(f"{header}\no,a,f,{','.join(cells)}\n")
    with pytest.raises(TraceFormatError, match=r"durations.csv, line 2: column Count is '-1', below 0"):
        read_durations(durations)
    durations.write_text(f"{header}\no,a, ,{','.join(['5'] * len(DURATION_COLUMNS))}\n")
    with pytest.raises(TraceFormatError, match=r"line 2: column HashFunction is empty"):
        read_durations(durations)
    memory = tmp_path / "memory.csv"
    rest = ",3" * (len(MEMORY_COLUMNS) - 2)
    memory.write_text("HashApp," + ",".join(MEMORY_COLUMNS) + f"\na,1,-2{rest}\n")
    with pytest.raises(TraceFormatError, match=r"column AverageAllocatedMb is '-2', below 0"):
        read_memory(memory)
