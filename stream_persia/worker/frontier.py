"""The checkpoint frontier: per partition, the offset up to which every batch is done.

A batch consumed from Kafka is *pending* from the moment it is read until its gradients
have been applied on every embedding server (or until it is settled otherwise: an eval
batch served, a poisoned message written to the dead-letter topic). The frontier of a
partition is the offset of its oldest pending batch, or — with nothing pending — the
offset after the last batch read. Storing the frontier in a checkpoint therefore makes
restore replay exactly the batches whose effect the checkpoint does not contain.

A batch whose gradient push could not complete on every server (see *Gradient pushes* in
:mod:`stream_persia.worker.service`) stays pending: the frontier never passes it, and
:func:`stream_persia.checkpoint.cut.check_no_failed_push` makes every checkpoint refuse while
one exists, naming it. Likewise :func:`~stream_persia.checkpoint.cut.check_servers_kept` while
a worker holds an embedding server lost (it
restarted and lost its table, :mod:`stream_persia.worker.router`): the cut would record
the empty table as trained.

Offsets within one partition arrive in increasing order (one consumer per partition,
static assignment), so each partition is a FIFO of pending offsets with a done-set;
completing a batch is O(1) and advancing the frontier is amortised O(1).

Offsets also arrive *without holes*: the consumer hands over a partition's records only
where they continue the previous ones (:mod:`stream_persia.kafka.loss`). A record past the
next expected offset would move the frontier over offsets nobody trained, so it is
refused (``InternalError``) unless the job accepted data loss (``allow_gaps``, from
``kafka.on_data_loss: skip``), where the consumer has already counted the hole.
"""

from __future__ import annotations

from collections import deque

from stream_persia.errors import InternalError

__all__ = ["Frontier"]


class _Partition:
    __slots__ = ("queue", "done", "next_offset")

    def __init__(self, start: int):
        self.queue: deque[int] = deque()
        self.done: set[int] = set()
        self.next_offset = start


class Frontier:
    """Tracks pending batches per partition and answers where a checkpoint must resume.

    Args:
        start_offsets: partition -> the offset the first batch read will have.
        allow_gaps: accept a batch past the next expected offset (the loss was accepted
            and counted upstream); by default that is refused.
    """

    def __init__(self, start_offsets: dict[int, int] | None = None, *,
                 allow_gaps: bool = False):
        self.allow_gaps = allow_gaps
        self._parts: dict[int, _Partition] = {
            p: _Partition(o) for p, o in (start_offsets or {}).items()}

    def track(self, partition: int, offset: int) -> None:
        """Track ``partition`` from ``offset`` before anything is read from it (one added
        to the topic while it is read): the cut then records it; a no-op when tracked."""
        self._parts.setdefault(partition, _Partition(offset))

    def read(self, partition: int, offset: int) -> None:
        """Record that the batch at ``offset`` was read and is now pending."""
        part = self._parts.get(partition)
        if part is None:
            part = self._parts[partition] = _Partition(offset)
        if offset != part.next_offset:
            if offset < part.next_offset:
                raise InternalError(f"partition {partition}: offset {offset} read after "
                                    f"{part.next_offset - 1}")
            if not self.allow_gaps:
                raise InternalError(
                    f"partition {partition}: offset {offset} read, but offsets "
                    f"{part.next_offset}..{offset - 1} never were; the frontier would pass "
                    "untrained data", hint="the consumer must stop the partition at a gap "
                                           "(kafka.on_data_loss)")
        part.queue.append(offset)
        part.next_offset = offset + 1

    def done(self, partition: int, offset: int) -> None:
        """Record that the batch at ``offset`` is settled (applied, served or dead-lettered)."""
        part = self._parts.get(partition)
        if part is None or offset >= part.next_offset:
            raise InternalError(f"partition {partition}: offset {offset} settled before read")
        part.done.add(offset)
        q = part.queue
        while q and q[0] in part.done:
            part.done.discard(q.popleft())

    def offsets(self) -> dict[int, int]:
        """The frontier: per partition, the first offset a restore must consume."""
        return {p: (part.queue[0] if part.queue else part.next_offset)
                for p, part in self._parts.items()}

    def pending(self) -> int:
        """How many batches are read but not yet settled, over all partitions."""
        return sum(len(part.queue) for part in self._parts.values())
