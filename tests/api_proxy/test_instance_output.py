"""An instance's stdout and stderr: labelled, lines cut, the rate bounded (`instance_output.py`)."""

from __future__ import annotations

import subprocess
import sys
import textwrap

from streambox.api_proxy.instance_output import (
    BURST_BYTES,
    MAX_LINE_BYTES,
    LabelledLines,
    TokenBucket,
)


def test_lines_are_labelled_cut_and_dropped_past_the_rate_with_a_notice() -> None:
    lines = LabelledLines(b"[w/f#1] ", TokenBucket(burst=1000, rate=10.0, now=0.0))
    assert lines.feed(b"hel", 0.0) == b""  # a partial line waits for its end
    assert lines.feed(b"lo\nsecond", 0.0) == b"[w/f#1] hello\n"
    assert lines.flush(0.0) == b"[w/f#1] second\n"
    assert lines.feed(b"x" * 2000 + b"\n", 0.0) == b""  # more than the bucket holds: dropped
    later = lines.feed(b"ok\n", 100.0)  # refilled
    assert later.startswith(b"[w/f#1] (2009 bytes of output dropped") and later.endswith(b"[w/f#1] ok\n")
    long = LabelledLines(b"", TokenBucket(burst=1 << 30, rate=0.0, now=0.0))
    cut = long.feed(b"y" * (MAX_LINE_BYTES + 5) + b"\n", 0.0)
    assert cut == b"y" * MAX_LINE_BYTES + b"... (5 more bytes of this line cut)\n"


TEMPLATE = textwrap.dedent(
    """
    import os, sys, time
    from streambox.api_proxy.instance_output import OutputForwarder, adopt_pipes, label_line
    forwarder = OutputForwarder()

    def fork(label, body):
        pipes = forwarder.pipes()
        pid = os.fork()
        if pid == 0:
            adopt_pipes(pipes)
            body()
        forwarder.add(pipes, label)
        os.waitpid(pid, 0)

    def chatty():
        print("hello")
        os.system("echo from-a-subprocess")
        sys.stderr.write("to stderr\\n")
        for _ in range(5000):  # 5 MB in a burst
            print("z" * 999)
        time.sleep(0.2)
        print("after the flood")
        os._exit(0)

    def spare():  # named once assigned, then crashes without flushing anything itself
        os.write(1, label_line("wf/late#9").encode())
        os.write(2, b"last words before a crash\\n")
        os._exit(3)

    fork("wf/fn#7", chatty)
    fork("wf/spare-1", spare)
    forwarder.drain()
    """
)


def test_children_s_output_is_labelled_bounded_and_outlives_them() -> None:
    done = subprocess.run([sys.executable, "-c", TEMPLATE], capture_output=True, timeout=60, check=True)
    out, err = done.stdout.decode(), done.stderr.decode()
    assert out.startswith("[wf/fn#7] hello\n[wf/fn#7] from-a-subprocess\n")
    assert err == "[wf/fn#7] to stderr\n[wf/late#9] last words before a crash\n"
    assert len(done.stdout) < BURST_BYTES + (64 << 10)  # of 5 MB, about the burst got through
    assert "bytes of output dropped: an instance writes at most 1024 KiB at once and 64 KiB/s" in out
    assert out.endswith("[wf/fn#7] after the flood\n")
    assert all(line.startswith("[wf/fn#7] ") for line in out.splitlines())
