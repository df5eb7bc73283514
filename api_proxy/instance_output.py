"""What an instance writes to stdout and stderr: labelled, and bounded.

An instance inherits its proxy's stdout and stderr, which are the gateway's (`streambox serve`'s
terminal or log file). Unchecked, a handler that prints in a loop (or a native library that logs per
call) fills that log, or the disk under it, and its lines are mixed with every other function's with
nothing to tell them apart. The template gives each child it forks two pipes as its file descriptors
1 and 2 (so output of C code, of a crash handler and of processes the handler starts is caught too)
and its `OutputForwarder` thread forwards them to the template's own descriptors:

- each line prefixed with `[<workflow>/<function>#<instance>] `, and cut at `MAX_LINE_BYTES`;
- at most `BURST_BYTES` at once and `RATE_BYTES_PER_S` on average per instance (a token bucket); what
  does not fit is dropped and counted, and the next line that fits is preceded by a notice saying how
  many bytes were dropped and why.

The reader lives in the template, which outlives its instances: what an instance wrote before it
crashed, was killed or timed out is still forwarded. A pre-forked spare learns its function only when
assigned; it names itself with one `label_line` on its stdout, which the forwarder takes as its label.
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

_LABEL_MARK = b"\x00streambox-label:"


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
        self.siblings: list[LabelledLines] = [self]  # the streams of one child: a label names them all
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
        if self.partial.startswith(_LABEL_MARK) and not self.cut:  # a spare names itself
            label = b"[" + bytes(self.partial[len(_LABEL_MARK) :]) + b"] "
            for lines in self.siblings:
                lines.label = label
            self.partial.clear()
            return b""
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


class OutputForwarder:
    """The template's thread that forwards its children's pipes (module doc). `pipes()` before a fork;
    the child calls `adopt_pipes`, the parent `add`."""

    def __init__(self) -> None:
        self._selector = selectors.DefaultSelector()
        self._lock = threading.Lock()
        self._added: list[tuple[int, int, LabelledLines]] = []  # (read fd, destination, lines)
        self._wake_r, self._wake_w = os.pipe()
        self._selector.register(self._wake_r, selectors.EVENT_READ)
        self._streams: dict[int, tuple[int, LabelledLines]] = {}
        self._thread = threading.Thread(target=self._run, name="streambox-output", daemon=True)
        self._thread.start()

    @staticmethod
    def pipes() -> tuple[int, int, int, int]:
        """(stdout read, stdout write, stderr read, stderr write) for one child."""
        out_r, out_w = os.pipe()
        err_r, err_w = os.pipe()
        return out_r, out_w, err_r, err_w

    def add(self, pipes: tuple[int, int, int, int], label: str) -> None:
        """The parent's side after the fork: forward the child's pipes under `label`."""
        out_r, out_w, err_r, err_w = pipes
        os.close(out_w)
        os.close(err_w)
        bucket = TokenBucket(BURST_BYTES, RATE_BYTES_PER_S, time.monotonic())
        out = LabelledLines(f"[{label}] ".encode(), bucket)
        err = LabelledLines(out.label, bucket)
        out.siblings = err.siblings = [out, err]
        with self._lock:
            self._added += [(out_r, 1, out), (err_r, 2, err)]
        os.write(self._wake_w, b"x")

    def fds(self) -> list[int]:
        """Its descriptors, for a forked child to close (they are the template's). Read without the
        lock: the child has one thread, and a lock the forwarder held at the fork stays held there."""
        return [self._wake_r, self._wake_w, *self._streams, *(read for read, _, _ in self._added)]

    def _run(self) -> None:
        while True:
            for key, _ in self._selector.select():
                if key.fd == self._wake_r:
                    os.read(self._wake_r, 4096)
                    with self._lock:
                        added, self._added = self._added, []
                    for read, destination, lines in added:
                        self._streams[read] = (destination, lines)
                        self._selector.register(read, selectors.EVENT_READ)
                    continue
                self._forward(key.fd)

    def _forward(self, read: int) -> None:
        destination, lines = self._streams[read]
        try:
            data = os.read(read, _READ)
        except OSError:
            data = b""
        now = time.monotonic()
        out = lines.feed(data, now) if data else lines.flush(now)
        if out:
            _write_all(destination, out)
        if not data:  # every write end is closed: the child and what it started are gone
            self._selector.unregister(read)
            os.close(read)
            del self._streams[read]

    def drain(self, timeout_s: float = DRAIN_S) -> None:
        """Wait (bounded) until every child's pipes have ended and been forwarded."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            with self._lock:
                pending = bool(self._added)
            if not pending and not self._streams:
                return
            time.sleep(0.01)


def adopt_pipes(pipes: tuple[int, int, int, int]) -> None:
    """The child's side after the fork: the pipes become its stdout and stderr, line-buffered."""
    out_r, out_w, err_r, err_w = pipes
    os.dup2(out_w, 1)
    os.dup2(err_w, 2)
    for fd in pipes:
        os.close(fd)
    for stream in (sys.stdout, sys.stderr):  # a pipe now: lines reach the log as they are printed
        with contextlib.suppress(AttributeError, ValueError):  # None: the proxy had no such stream
            stream.reconfigure(line_buffering=True)  # type: ignore[union-attr]


def label_line(label: str) -> str:
    """The line a spare prints to name itself once assigned (the forwarder does not forward it)."""
    return f"{_LABEL_MARK.decode()}{label}\n"


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        try:
            view = view[os.write(fd, view) :]
        except OSError:  # the destination is gone or closed (the gateway exited): nothing to forward to
            return
