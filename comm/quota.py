"""Bounds of one communication store (one workflow's proxy holds one): a pure policy.

A workflow may hold at most `max_bytes` stored bytes (GPU and host tiers together) under at most
`max_keys` keys; no key may ask for a TTL above `max_ttl_s`; data moved or placed in host memory may
total at most `max_host_bytes` (beyond it, data stays on its GPU, and a PUT that finds no room on any
GPU fails). `None` lifts a bound. The defaults keep one workflow's store below a quarter of a 16 GB
GPU and half as much in host memory.

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

    def __post_init__(self) -> None:
        for name in ("max_bytes", "max_keys", "max_host_bytes"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or value < 0):
                raise ValueError(f"{name} must be an int >= 0 or None, got {value!r}")
        if self.max_ttl_s is not None and not (0 < self.max_ttl_s < math.inf):
            raise ValueError(f"max_ttl_s must be a finite number > 0 or None, got {self.max_ttl_s!r}")


@dataclass(frozen=True)
class Usage:
    """What the store holds now, the PUT being checked included once reserved."""

    bytes: int  # every tier
    keys: int
    host_bytes: int


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


def host_allows(quota: StoreQuota, host_bytes: int, nbytes: int) -> bool:
    """May `nbytes` more land in host memory, where the store holds `host_bytes` already?"""
    return quota.max_host_bytes is None or host_bytes + nbytes <= quota.max_host_bytes


def host_full(quota: StoreQuota, key: str, host_bytes: int, nbytes: int) -> QuotaExceeded:
    """The error of a PUT that found no GPU room and no host room."""
    return QuotaExceeded(
        f"PUT {key!r}: no GPU has room for {nbytes} bytes and the host tier holds {host_bytes} of its "
        f"{quota.max_host_bytes} bytes"
    )
