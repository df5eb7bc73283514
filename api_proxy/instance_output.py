"""What an instance writes to stdout and stderr: labelled, and bounded.

An instance inherits its proxy's stdout and stderr, which are the gateway's (`streambox serve`'s
terminal or log file). Unchecked, a handler that prints in a loop (or a native library that logs per
call) fills that log, or the disk under it, and its lines are mixed with every other function's with
nothing to tell them apart. `capture_output` points the instance's file descriptors 1 and 2 at pipes
(so output of C code and of processes the handler starts is caught too) and a reader thread forwards
them to the original descriptors:

- each line prefixed with `[<workflow>/<function>#<instance>] `, and cut at `MAX_LINE_BYTES`;
- at most `BURST_BYTES` at once and `RATE_BYTES_PER_S` on average per instance (a token bucket); what
  does not fit is dropped and counted, and the next line that fits is preceded by a notice saying how
  many bytes were dropped and why.

`drain_output` (the instance's last step) closes the write ends and lets the reader forward what is
left, for at most a second.
"""

from __future__ import annotations

import contextlib
import os
import selectors
import sys
import threading
import time

MAX_LINE_BYTES = 16 << 10
BURST_BYTES = 1 << 20
RATE_BYTES_PER_S = 64 << 10
DRAIN_S = 1.0
_READ = 1 << 16

_capture: dict[str, object] = {}  # "thread": the reader of this process's capture, if any


class TokenBucket:
    """`take(n)` succeeds while the bucket holds `n` tokens; it refills at `rate` per second up to
    `burst`. Pure: the caller passes the time."""

    def __init__(self, burst: int, rate: float, now: float) -> None:
        self.burst, self.rate = burst, rate
        self.tokens, self.at = float(burst), now

    def take(self, n: int, now: float) -> bool:
        self.tokens = min(self.burst, self.tokens + (now - self.at) * self.rate)
        self.at = now
        if n > self.tokens:
            return False
        self.tokens -= n
        return True


class LabelledLines:
    """Turns one stream's bytes into labelled, cut, rate-bounded lines for its destination."""

    def __init__(self, label: bytes, bucket: TokenBucket) -> None:
        self.label, self.bucket = label, bucket
        self.partial = bytearray()  # the current line, up to MAX_LINE_BYTES
        self.cut = 0  # bytes of the current line past MAX_LINE_BYTES
        self.dropped = 0  # bytes dropped for the rate since the last notice

    def feed(self, data: bytes, now: float) -> bytes:
        """The output for `data` (whole lines only; a partial line waits for its end or `flush`)."""
        out = bytearray()
        while data:
            end = data.find(b"\n")
            piece, data = (data, b"") if end < 0 else (data[:end], data[end + 1 :])
            room = MAX_LINE_BYTES - len(self.partial)
            self.partial += piece[:room]
            self.cut += max(0, len(piece) - room)
            if end >= 0:
                out += self._line(now)
        return bytes(out)

    def flush(self, now: float) -> bytes:
        """The partial line, if any (the stream ended without a newline)."""
        return self._line(now) if self.partial or self.cut else b""

    def _line(self, now: float) -> bytes:
        line = self.label + bytes(self.partial)
        if self.cut:
            line += f"... ({self.cut} more bytes of this line cut)".encode()
        line += b"\n"
        self.partial.clear()
        self.cut = 0
        notice = b""
        if self.dropped:
            bucket = self.bucket
            notice = self.label + (
                f"({self.dropped} bytes of output dropped: an instance writes at most "
                f"{bucket.burst / 1024:g} KiB at once and {bucket.rate / 1024:g} KiB/s)\n"
            ).encode()
        if not self.bucket.take(len(line) + len(notice), now):
            self.dropped += len(line)
            return b""
        self.dropped = 0
        return notice + line


def capture_output(label: str) -> None:
    """Point this process's stdout and stderr (fds 1 and 2) at pipes forwarded, labelled and bounded,
    to where they pointed before (module doc). Call once, early in the instance."""
    sys.stdout.flush()
    sys.stderr.flush()
    bucket = TokenBucket(BURST_BYTES, RATE_BYTES_PER_S, time.monotonic())
    prefix = f"[{label}] ".encode()
    streams = {}
    for fd in (1, 2):
        read, write = os.pipe()
        original = os.dup(fd)
        os.dup2(write, fd)
        os.close(write)
        streams[read] = (original, LabelledLines(prefix, bucket))
    for stream in (sys.stdout, sys.stderr):  # a pipe now: lines reach the log as they are printed
        with contextlib.suppress(AttributeError, ValueError):
            stream.reconfigure(line_buffering=True)  # type: ignore[union-attr]
    thread = threading.Thread(target=_forward, args=(streams,), name="streambox-output", daemon=True)
    thread.start()
    _capture["thread"] = thread


def _forward(streams: dict[int, tuple[int, LabelledLines]]) -> None:
    selector = selectors.DefaultSelector()
    for read in streams:
        selector.register(read, selectors.EVENT_READ)
    while streams:
        for key, _ in selector.select():
            read = key.fd
            original, lines = streams[read]
            data = os.read(read, _READ)
            now = time.monotonic()
            out = lines.feed(data, now) if data else lines.flush(now)
            if out:
                _write_all(original, out)
            if not data:  # every write end is closed: the instance is ending
                selector.unregister(read)
                os.close(read)
                del streams[read]


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        try:
            view = view[os.write(fd, view) :]
        except OSError:  # the destination is gone (the gateway exited): nothing to forward to
            return


def drain_output() -> None:
    """Close this process's stdout and stderr and let the reader forward what is left (at most
    `DRAIN_S`): an instance's last lines are not lost to its exit. Nothing without a capture."""
    thread = _capture.get("thread")
    if not isinstance(thread, threading.Thread):
        return
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError):
            stream.flush()
    for fd in (1, 2):
        with contextlib.suppress(OSError):
            os.close(fd)
    thread.join(DRAIN_S)
