"""Trace files that would exhaust the replayer fail with the file, line and column; arrivals are
generated lazily, so the replay's --max-requests / --max-duration bound memory, not the trace."""

from __future__ import annotations

import resource

import pytest

from streambox.replay.shaping import build_arrivals, choose_functions, iter_arrivals
from streambox.replay.traces import TraceFormatError, load_trace

HEADER = "HashOwner,HashApp,HashFunction,Trigger,1,2\n"


def _trace(tmp_path, text: str, name: str = "inv.csv"):
    path = tmp_path / name
    path.write_text(text)
    return path


@pytest.mark.parametrize(
    "count, message",
    [
        ("100000000", r"minute count 100000000 \(column 2\) is above the 10000000 invocations per minute"),
        ("100000000000000000000000", r"minute count 100000000000000000000000 \(column 2\) is above"),
        ("9223372036854775807", r"minute count 9223372036854775807 \(column 2\) is above"),
        ("-3", r"negative invocation count \(column 2: '-3'\)"),
        ("1e8", r"a minute count is not an integer \(column 2: '1e8'\)"),
        ("+5", r"a minute count is not an integer \(column 2: '\+5'\)"),  # was "negative"
        ("\u0663", r"a minute count is not an integer \(column 2: '\u0663'\)"),  # Arabic-Indic 3
        ("\u00b2", r"a minute count is not an integer \(column 2: '\u00b2'\)"),  # int() refuses it
    ],
)
def test_out_of_range_minute_counts_name_file_line_and_column(tmp_path, count, message):
    path = _trace(tmp_path, HEADER + "o,a,f,http,1,2\n" + f"o,a,g,http,3,{count}\n")
    assert len(path.read_bytes()) < 150
    with pytest.raises(TraceFormatError, match=rf"inv.csv, line 3: {message}"):
        load_trace(path)


@pytest.mark.parametrize("value", ["nan", "inf", "-inf", "1e300"])
def test_non_finite_or_absurd_2021_timestamps_are_refused(tmp_path, value):
    path = _trace(tmp_path, f"app,func,end_timestamp,duration\na,f,10.0,0.5\na,f,{value},0.5\n", "log.csv")
    with pytest.raises(TraceFormatError, match=r"log.csv, line 3: column end_timestamp is"):
        load_trace(path)


def test_arrivals_are_lazy_and_bounded_by_the_replay_limits(tmp_path):
    # 1440 minutes of 1,000,000 invocations each: 1.44e9 arrivals if built eagerly.
    minutes = ",".join(str(m) for m in range(1, 1441))
    counts = ",".join(["1000000"] * 1440)
    path = _trace(tmp_path, f"HashOwner,HashApp,HashFunction,Trigger,{minutes}\no,a,f,http,{counts}\n")
    trace = load_trace(path)
    chosen = choose_functions(trace.functions, 1, start_minute=0, minutes=1440)
    mapping = {chosen[0].key: "w"}
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    first = next(iter_arrivals(chosen, mapping, minutes=1440))
    assert first.time_s < 60
    limited = build_arrivals(chosen, mapping, minutes=1440, max_requests=1000)
    assert len(limited) == 1001  # one past the bound: the driver reports "max_requests"
    timed = build_arrivals(chosen, mapping, minutes=1440, spacing="even", max_duration_s=0.01)
    assert timed[-1].time_s >= 0.01 and all(a.time_s < 0.01 for a in timed[:-1])
    grown_mib = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) / 1024
    assert grown_mib < 200  # one minute of one function at a time (~1e6 floats), not 1.44e9 arrivals


def test_a_scale_that_explodes_a_minute_is_refused(tmp_path):
    trace = load_trace(_trace(tmp_path, HEADER + "o,a,f,http,5,5\n"))
    chosen = choose_functions(trace.functions, 1, start_minute=0, minutes=2)
    with pytest.raises(ValueError, match=r"scaling by 1e\+09 gives 5000000000 arrivals in one trace minute"):
        build_arrivals(chosen, {chosen[0].key: "w"}, minutes=2, rate_scale=1e9)


def test_a_damaged_gzip_or_non_utf8_trace_names_the_file(tmp_path):
    import gzip

    text = (HEADER + "o,a,f,http,1,2\n") * 200
    whole = gzip.compress(text.encode())
    cases = {
        "bad.csv.gz": (b"garbage, not gzip", "a damaged or truncated gzip file"),
        "cut.csv.gz": (whole[: len(whole) // 2], "a damaged or truncated gzip file"),
        "latin.csv": ((HEADER + "o,caf\xe9,f,http,1,2\n").encode("latin-1"), "not UTF-8 text"),
    }
    for name, (data, why) in cases.items():
        (tmp_path / name).write_bytes(data)
        with pytest.raises(TraceFormatError, match=rf"{name}: {why}"):
            load_trace(tmp_path / name)
