"""Argument types shared by the `streambox` subcommands: each turns bad text into a clear error that
names what is allowed (argparse prefixes the flag), before any work starts or anything is written.

Only the standard library here: building the parser must stay free of torch (`streambox.cli`).
"""

from __future__ import annotations

import argparse
import math
from urllib.parse import urlsplit


def _integer(text: str, what: str = "an integer") -> int:
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not {what}") from None


def positive_int(text: str) -> int:
    """An integer >= 1."""
    value = _integer(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} is not a positive integer")
    return value


def non_negative_int(text: str) -> int:
    """An integer >= 0."""
    value = _integer(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"{value} is negative: give 0 or more")
    return value


def port(text: str) -> int:
    """A TCP port: 1-65535 (0 would pick a random one nobody is told)."""
    value = _integer(text, "a port number")
    if not 1 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"port {value} is not in 1-65535")
    return value


def positive_seconds(text: str) -> float:
    """A finite number of seconds > 0 (`inf`, `nan`, 0 and -1 meant no timeout)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number of seconds: {text!r}") from None
    if not 0 < value < math.inf:
        raise argparse.ArgumentTypeError(f"must be a finite number of seconds > 0, got {text}")
    return value


def dimensions(text: str) -> tuple[int, ...]:
    """Positive integers separated by `x` or `,` (`3x224x224`, `3,224,224`); raises ValueError."""
    parts = [part.strip() for part in text.replace("x", ",").split(",")]
    if not text.strip() or any(not (part.isascii() and part.isdigit()) for part in parts):
        raise ValueError(f"takes positive integers separated by 'x' or ',', got {text!r}")
    values = tuple(int(part) for part in parts)
    if any(v < 1 for v in values):
        raise ValueError(f"takes positive integers, got {text!r}")
    return values


def shape(text: str) -> tuple[int, ...]:
    """`dimensions` as an argparse type."""
    try:
        return dimensions(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def http_url(text: str) -> str:
    """An http(s) URL with a host and, if given, a port in 1-65535 (the gateway's address)."""
    try:
        parts = urlsplit(text)
        port = parts.port
    except ValueError as error:  # a port that is no number or out of range
        raise argparse.ArgumentTypeError(f"{text!r}: {error}") from None
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise argparse.ArgumentTypeError(f"{text!r} is not an http(s) URL; e.g. http://127.0.0.1:8080")
    if port == 0:
        raise argparse.ArgumentTypeError(f"{text!r}: port 0 is not in 1-65535")
    return text
