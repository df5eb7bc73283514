"""Errors of the communication store: each names the key, so that a user can act on it."""

from __future__ import annotations


class CommError(RuntimeError):
    """Base class of every error raised by `streambox.comm`."""


class GetTimeout(CommError, TimeoutError):
    """A GET found no data for its key within its timeout (the PUT never came, or came too late)."""

    def __init__(self, key: str, timeout: float, detail: str = "") -> None:
        self.key, self.timeout = key, timeout
        message = f"GET {key!r}: no data under this key after waiting {timeout:g} s"
        super().__init__(f"{message} ({detail})" if detail else message)


class KeyExists(CommError, KeyError):
    """A PUT over a key that holds data, without `overwrite=True`."""

    def __init__(self, key: str) -> None:
        self.key = key
        super().__init__(
            f"PUT {key!r}: the key already holds data; delete it first (a function's ctx.delete) or put "
            f"under another key (the store's own put also takes overwrite=True)"
        )

    def __str__(self) -> str:  # KeyError would quote the whole message
        return str(self.args[0])


class StoreClosed(CommError):
    """The store has been closed."""


class RemoteError(CommError):
    """A remote node could not serve a request (unreachable, or it answered with an error)."""
