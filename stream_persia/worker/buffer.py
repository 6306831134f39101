"""A bounded FIFO for asyncio with timeouts and put-back at the front.

``asyncio.Queue`` cannot return an item to the head, which the embedding worker needs when
serving a batch fails half-way (an embedding server is down): the batch goes back first in
line instead of being lost or reordered.
"""

from __future__ import annotations

import asyncio
from collections import deque
from typing import Generic, TypeVar

from stream_persia.errors import Backpressure, Misuse

T = TypeVar("T")

__all__ = ["BoundedBuffer"]


class BoundedBuffer(Generic[T]):
    """At most ``maxsize`` items; ``put`` waits while full, ``get`` waits while empty."""

    def __init__(self, maxsize: int, name: str = "buffer"):
        if maxsize < 1:
            raise Misuse(f"{name}: maxsize must be >= 1, got {maxsize}", field="maxsize")
        self.maxsize = maxsize
        self.name = name
        self._items: deque[T] = deque()
        self._changed = asyncio.Condition()

    def __len__(self) -> int:
        return len(self._items)

    def full(self) -> bool:
        return len(self._items) >= self.maxsize

    async def put(self, item: T, timeout: float | None = None) -> None:
        """Append ``item``, waiting up to ``timeout`` s for room (then :class:`Backpressure`)."""
        async with self._changed:
            if self.full():
                try:
                    await asyncio.wait_for(self._changed.wait_for(lambda: not self.full()),
                                           timeout)
                except TimeoutError:
                    raise Backpressure(
                        f"{self.name} stayed full ({self.maxsize} items) for {timeout} s",
                        hint="the consumer is slower than the producer; retry later") from None
            self._items.append(item)
            self._changed.notify_all()

    async def put_front(self, item: T) -> None:
        """Return an item taken by :meth:`get` to the head (may exceed maxsize by one)."""
        async with self._changed:
            self._items.appendleft(item)
            self._changed.notify_all()

    async def get(self, timeout: float | None = None) -> T | None:
        """Take the oldest item, waiting up to ``timeout`` s; None when none arrived."""
        async with self._changed:
            if not self._items:
                try:
                    await asyncio.wait_for(self._changed.wait_for(lambda: bool(self._items)),
                                           timeout)
                except TimeoutError:
                    return None
            item = self._items.popleft()
            self._changed.notify_all()
            return item

    async def wait_not_full(self) -> None:
        async with self._changed:
            await self._changed.wait_for(lambda: not self.full())

    def clear(self) -> list[T]:
        items = list(self._items)
        self._items.clear()
        return items
