"""A bounded FIFO for asyncio with timeouts and put-back at the front.

``asyncio.Queue`` cannot return an item to the head, which the embedding worker needs when
serving a batch fails half-way (an embedding server is down): the batch goes back first in
line instead of being lost or reordered.

The buffer is bounded by item count and, optionally, by bytes: ``size_of(item)`` gives an
item's size once, when it is put, and ``put`` waits while the buffer holds ``maxsize``
items or the item would take it past ``max_bytes`` bytes. One item is always let into an
empty buffer, however large, so that a single batch bigger than the budget still flows
(one at a time). Items returned with ``put_front`` may exceed both bounds by that item.

Puts that wait go in in the order they were called: a later put never overtakes one that
is waiting, not when room comes free in the loop iteration it arrives in (an
``asyncio.Condition`` lets a newcomer take the lock before the waiters it woke), and not
when its smaller item would fit where the waiting one does not. Pipelined ``ingest``
calls from one data loader therefore keep their order, which reproducible training
relies on.

A ``put`` or ``get`` cancelled while it waits neither adds nor takes an item, even when
room or an item arrived in the same loop iteration (``asyncio.wait_for`` before Python
3.12 returned then, and the cancellation was lost: :func:`stream_persia.core.backoff.
wait_bounded`).
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Callable
from typing import Generic, TypeVar

from stream_persia.core.backoff import wait_bounded
from stream_persia.errors import Backpressure, Misuse

T = TypeVar("T")

__all__ = ["BoundedBuffer"]


class BoundedBuffer(Generic[T]):
    """At most ``maxsize`` items (and ``max_bytes`` bytes by ``size_of``, when given);
    ``put`` waits while full, ``get`` waits while empty."""

    def __init__(self, maxsize: int, name: str = "buffer", *, max_bytes: int | None = None,
                 size_of: Callable[[T], int] | None = None):
        if maxsize < 1:
            raise Misuse(f"{name}: maxsize must be >= 1, got {maxsize}", field="maxsize")
        if max_bytes is not None and (max_bytes < 1 or size_of is None):
            raise Misuse(f"{name}: max_bytes must be >= 1 and come with size_of, got "
                         f"{max_bytes!r}", field="max_bytes")
        self.maxsize = maxsize
        self.max_bytes = max_bytes
        self.name = name
        self._size_of = size_of
        self._items: deque[tuple[T, int]] = deque()
        self.bytes = 0     # the sizes of the items held, as size_of gave them
        self._changed = asyncio.Condition()
        self._putters: deque[object] = deque()   # puts waiting for room, oldest first

    def __len__(self) -> int:
        return len(self._items)

    def full(self, item: T | None = None) -> bool:
        """No room for ``item`` (``put`` would wait: no room, or earlier puts wait), or
        with no item, for any: ``maxsize`` items or ``max_bytes`` bytes held (an empty
        buffer is never full, though a put into it waits behind the puts already waiting).
        """
        if item is not None:
            return bool(self._putters) or not self._fits(
                self._size_of(item) if self._size_of is not None else 0)
        n = len(self._items)
        return n >= self.maxsize or (self.max_bytes is not None and n > 0
                                     and self.bytes >= self.max_bytes)


    def _fits(self, size: int) -> bool:
        """Room for an item of ``size`` bytes: under ``maxsize`` items and, with it, within
        ``max_bytes`` (or the buffer is empty)."""
        n = len(self._items)
        return n < self.maxsize and (self.max_bytes is None or n == 0
                                     or self.bytes + size <= self.max_bytes)

    async def put(self, item: T, timeout: float | None = None) -> None:
        """Append ``item``, waiting up to ``timeout`` s for room (then :class:`Backpressure`)
        behind any puts already waiting."""
        size = self._size_of(item) if self._size_of is not None else 0
        async with self._changed:
            if self._putters or not self._fits(size):
                turn = object()
                self._putters.append(turn)
                try:
                    await wait_bounded(self._changed.wait_for(
                        lambda: self._putters[0] is turn and self._fits(size)), timeout)
                except TimeoutError:
                    held = (f"{len(self._items)} items"
                            + (f", {self.bytes} bytes" if self.max_bytes is not None else ""))
                    raise Backpressure(
                        f"{self.name} stayed full ({held}) for {timeout} s",
                        hint="the consumer is slower than the producer; retry later") from None
                finally:
                    self._putters.remove(turn)
                    self._changed.notify_all()   # the next in line may go now
            self._items.append((item, size))
            self.bytes += size
            self._changed.notify_all()

    async def put_front(self, item: T) -> None:
        """Return an item taken by :meth:`get` to the head (may exceed the bounds by one)."""
        size = self._size_of(item) if self._size_of is not None else 0
        async with self._changed:
            self._items.appendleft((item, size))
            self.bytes += size
            self._changed.notify_all()

    async def get(self, timeout: float | None = None) -> T | None:
        """Take the oldest item, waiting up to ``timeout`` s; None when none arrived."""
        async with self._changed:
            if not self._items:
                try:
                    await wait_bounded(self._changed.wait_for(lambda: bool(self._items)),
                                       timeout)
                except TimeoutError:
                    return None
            item, size = self._items.popleft()
            self.bytes -= size
            self._changed.notify_all()
            return item

    async def wait_not_full(self) -> None:
        async with self._changed:
            await self._changed.wait_for(lambda: not self.full())

    async def clear(self) -> list[T]:
        """Take every item (oldest first) and wake the puts waiting for room: with room
        for all of them, none may be left waiting behind a turn nobody wakes."""
        async with self._changed:
            items = [item for item, _ in self._items]
            self._items.clear()
            self.bytes = 0
            self._changed.notify_all()
            return items
