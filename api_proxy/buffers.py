"""Which device buffers a proxy's functions may name, and who holds them: pure bookkeeping.

Every buffer a function can name by handle (inputs it uploaded or allocated, outputs of its
inferences, values it got by key) is registered here with the set of its holders (the invocations
that made or used it). When the last holder lets go the table hands the buffer back to the shell,
which frees it stream-ordered after the events the holders left -- unless the buffer is *external*:
owned by the communication store (a PUT adopts the producer's buffer; a GET's handle is a lease of
the store), whose bytes the store frees itself. So a handler's own buffers are request-scoped: at the
end of an invocation, whatever it did not PUT is freed.
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass, field
from typing import Any


@dataclass
class Buffer:
    address: int
    nbytes: int
    payload: Any  # the proxy's DeviceTensor
    holders: set[Hashable] = field(default_factory=set)
    events: list[Any] = field(default_factory=list)  # completion events left by past holders
    external: bool = False  # the communication store owns the bytes: never freed from here
    maker: Hashable | None = None  # the holder that made it, while its bytes count against that holder


class BufferTable:
    def __init__(self) -> None:
        self._buffers: dict[int, Buffer] = {}
        # Bytes of the buffers each holder made (its first holder) and the proxy still frees: what an
        # invocation's device memory quota counts (a PUT hands the bytes to the store's own quota).
        self._made: dict[Hashable, int] = {}

    def __len__(self) -> int:
        return len(self._buffers)

    def __contains__(self, address: int) -> bool:
        return address in self._buffers

    def get(self, address: int) -> Buffer | None:
        return self._buffers.get(address)

    def add(
        self, address: int, nbytes: int, payload: Any, holder: Hashable, *, external: bool = False
    ) -> Buffer:
        """Register a buffer. An external record at the same address is stale (the store freed those
        bytes and the allocator handed the address out again): it is replaced."""
        old = self._buffers.get(address)
        if old is not None and not old.external:
            raise KeyError(f"buffer {address:#x} is already registered")
        buf = self._buffers[address] = Buffer(address, nbytes, payload, {holder}, external=external)
        if not external:
            buf.maker = holder
            self._made[holder] = self._made.get(holder, 0) + nbytes
        return buf

    def made_by(self, holder: Hashable) -> int:
        """Bytes of the live buffers `holder` made that are not the store's."""
        return self._made.get(holder, 0)

    def _unmade(self, buf: Buffer) -> None:
        maker, buf.maker = buf.maker, None
        if maker is not None:
            left = self._made[maker] - buf.nbytes
            if left:
                self._made[maker] = left
            else:
                del self._made[maker]

    def disown(self, address: int) -> None:
        """The store took the buffer over (PUT): it stays nameable, and is never freed from here."""
        buf = self._buffers[address]
        buf.external = True
        self._unmade(buf)

    def hold(self, address: int, holder: Hashable) -> Buffer:
        buf = self._buffers[address]
        buf.holders.add(holder)
        return buf

    def release(self, address: int, holder: Hashable, event: Any = None) -> Buffer | None:
        """`holder` lets go (after `event`, if given); returns the buffer if it has no holder left
        (removed from the table: the caller frees it after every event in `buffer.events`)."""
        buf = self._buffers.get(address)
        if buf is None or holder not in buf.holders:
            return None
        buf.holders.discard(holder)
        if event is not None:
            buf.events.append(event)
        if buf.holders:
            return None
        del self._buffers[address]
        self._unmade(buf)
        return buf

    def held_by(self, holder: Hashable) -> list[int]:
        return [a for a, b in self._buffers.items() if holder in b.holders]

    @property
    def nbytes(self) -> int:
        return sum(b.nbytes for b in self._buffers.values())
