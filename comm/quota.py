"""Bounds of one communication store (one workflow's proxy holds one): a pure policy.

A workflow may hold at most `max_bytes` stored bytes (GPU and host tiers together) under at most
`max_keys` keys; no key may ask for a TTL above `max_ttl_s`; data moved or placed in host memory may
total at most `max_host_bytes` (beyond it, data stays on its GPU, and a PUT that finds no room on any
GPU fails). `None` lifts a bound. The defaults keep one workflow's store below a quarter of a 16 GB
GPU and half as much in host memory.

Within a workflow, the keys one function PUT (its *writer*) may hold at most `writer_share` of
`max_bytes` and of `max_keys` (at least one key and one byte; 1.0: no share): a function that fills
the store (long-lived keys in a loop) has its own PUTs refused at its share, and the rest of the
bound is the workflow's other functions'. A key's bytes stay its writer's until the store frees them:
a key consumed or deleted while a reader still holds a lease on it counts until that lease ends (else
a function could read back its own keys and fill the store). The share is of the configured bound,
not of the room the GPUs and the host tier have, and two functions at their share take it all.
`WriterTally` keeps what each writer holds, for the stores; a PUT without a writer (a direct store
user) counts in the totals only.

The store calls `check_ttl` before a PUT does anything, `check_put` once the PUT's bytes are reserved
(so concurrent PUTs see each other) and `host_allows` before anything lands in host memory. The
checks take the usage and return or raise; they hold no state.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from .errors import CommError

GiB = 1 << 30


class QuotaExceeded(CommError):
    """A PUT over one of the store's bounds; the message names the key, the bound and the usage."""


@dataclass(frozen=True)
class StoreQuota:
    max_bytes: int | None = 4 * GiB
    max_keys: int | None = 65_536
    max_ttl_s: float | None = 3600.0
    max_host_bytes: int | None = 2 * GiB
    writer_share: float | None = 0.5

    def __post_init__(self) -> None:
        for name in ("max_bytes", "max_keys", "max_host_bytes"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or value < 0):
                raise ValueError(f"{name} must be an int >= 0 or None, got {value!r}")
        if self.max_ttl_s is not None and not (0 < self.max_ttl_s < math.inf):
            raise ValueError(f"max_ttl_s must be a finite number > 0 or None, got {self.max_ttl_s!r}")
        share = self.writer_share
        number = isinstance(share, int | float) and not isinstance(share, bool)
        if share is not None and not (number and 0 < share <= 1):
            raise ValueError(f"writer_share must be a number in (0, 1] or None, got {share!r}")


@dataclass(frozen=True)
class Usage:
    """What the store holds now, the PUT being checked included once reserved."""

    bytes: int  # every tier
    keys: int
    host_bytes: int
    writer: str | None = None  # the function whose PUT this is (None: counted in the totals only)
    writer_bytes: int = 0  # what the writer's keys hold, this PUT included
    writer_keys: int = 0


def check_ttl(quota: StoreQuota, key: str, ttl: float | None) -> None:
    """A TTL the store accepts: None (the default TTL) or a finite number in (0, max_ttl_s]."""
    if ttl is None:
        return
    if not (isinstance(ttl, (int, float)) and ttl > 0 and math.isfinite(ttl)):
        raise ValueError(f"PUT {key!r}: ttl must be a finite number of seconds > 0 or None, got {ttl!r}")
    if quota.max_ttl_s is not None and ttl > quota.max_ttl_s:
        ceiling = quota.max_ttl_s
        raise QuotaExceeded(f"PUT {key!r}: ttl {ttl:g} s is above the store's ceiling of {ceiling:g} s")


def check_put(quota: StoreQuota, key: str, nbytes: int, usage: Usage) -> None:
    """Raise `QuotaExceeded` if the store, with this PUT's `nbytes` counted in `usage`, is over a bound."""
    if quota.max_keys is not None and usage.keys > quota.max_keys:
        raise QuotaExceeded(
            f"PUT {key!r}: the workflow's store holds {usage.keys - 1} keys, at most {quota.max_keys} allowed"
        )
    if quota.max_bytes is not None and usage.bytes > quota.max_bytes:
        raise QuotaExceeded(
            f"PUT {key!r}: {nbytes} bytes would bring the workflow's store to {usage.bytes} bytes, "
            f"above its quota of {quota.max_bytes} bytes"
        )
    share = quota.writer_share
    if usage.writer is None or share is None or share >= 1:
        return
    if quota.max_keys is not None and usage.writer_keys > (keys := max(1, int(quota.max_keys * share))):
        raise QuotaExceeded(
            f"PUT {key!r}: function {usage.writer!r} holds {usage.writer_keys - 1} keys of the workflow's "
            f"store, at most {keys} allowed (writer_share {share:g} of max_keys {quota.max_keys}); the "
            "rest is kept for the workflow's other functions"
        )
    if quota.max_bytes is not None and usage.writer_bytes > (most := max(1, int(quota.max_bytes * share))):
        raise QuotaExceeded(
            f"PUT {key!r}: {nbytes} bytes would bring the keys of function {usage.writer!r} to "
            f"{usage.writer_bytes} bytes of the workflow's store, above its share of {most} bytes "
            f"(writer_share {share:g} of max_bytes {quota.max_bytes}); the rest is kept for the "
            "workflow's other functions"
        )


def host_allows(quota: StoreQuota, host_bytes: int, nbytes: int) -> bool:
    """May `nbytes` more land in host memory, where the store holds `host_bytes` already?"""
    return quota.max_host_bytes is None or host_bytes + nbytes <= quota.max_host_bytes


def host_full(quota: StoreQuota, key: str, host_bytes: int, nbytes: int) -> QuotaExceeded:
    """The error of a PUT that found no GPU room and no host room."""
    return QuotaExceeded(
        f"PUT {key!r}: no GPU has room for {nbytes} bytes and the host tier holds {host_bytes} of its "
        f"{quota.max_host_bytes} bytes"
    )


class WriterTally:
    """Bytes and keys held by the stored keys of each writer: the state behind `writer_share`. A key
    counts from its PUT until it leaves the store's table (`remove_key`), its bytes until the store
    frees them (`release`: later, while a reader holds a lease). Not thread-safe: a store calls it
    under its own lock."""

    def __init__(self) -> None:
        self._held: dict[str, list[int]] = {}  # writer -> [bytes, keys]

    def usage(
        self, writer: str | None, nbytes: int, replaced: tuple[str | None, int] | None = None
    ) -> tuple[int, int]:
        """What `writer` would hold with a PUT of `nbytes` counted, less the key it overwrites
        (`replaced`: that key's writer and bytes) if it was its own; (0, 0) without a writer."""
        if writer is None:
            return 0, 0
        held_bytes, held_keys = self._held.get(writer, (0, 0))
        if replaced is not None and replaced[0] == writer:
            return held_bytes + nbytes - replaced[1], held_keys
        return held_bytes + nbytes, held_keys + 1

    def add(self, writer: str | None, nbytes: int) -> None:
        """A key of `nbytes` PUT by `writer`."""
        if writer is not None:
            held = self._held.setdefault(writer, [0, 0])
            held[0] += nbytes
            held[1] += 1

    def remove_key(self, writer: str | None) -> None:
        """One of `writer`'s keys left the table (its bytes: `release`)."""
        self._change(writer, 0, -1)

    def release(self, writer: str | None, nbytes: int) -> None:
        """The store freed `nbytes` of one of `writer`'s keys."""
        self._change(writer, -nbytes, 0)

    def _change(self, writer: str | None, nbytes: int, keys: int) -> None:
        held = self._held.get(writer) if writer is not None else None
        if held is not None:
            held[0] += nbytes
            held[1] += keys
            if held[0] <= 0 and held[1] <= 0:
                del self._held[writer]  # type: ignore[arg-type]  # not None: it was found

    def held(self, writer: str) -> tuple[int, int]:
        """Bytes and keys `writer`'s stored keys hold now."""
        held_bytes, held_keys = self._held.get(writer, (0, 0))
        return held_bytes, held_keys
