"""The stream cut of a checkpoint: where every embedding worker's stream stands (DESIGN §7).

One computation for every taker of a checkpoint: NN rank 0 in ``dump_checkpoint``
(:mod:`stream_persia.nn.checkpointing`) and the API when no NN rank is attached
(:mod:`stream_persia.api.checkpoints`). :func:`read_cut` asks every worker for its
``frontier`` (and, for a Kafka stream, its ``status`` for the topic); :func:`stream_cut`
turns the replies into the manifest's ``stream`` and ``offsets``, refusing every state in
which a restore of the result would lose a batch or train one twice:

- a batch whose gradient push failed (only some servers applied it:
  :func:`check_no_failed_push`);
- an embedding server that restarted with an empty table
  (:func:`check_servers_kept`);
- a batch in flight (served to an NN rank, gradients not applied yet:
  :func:`check_nothing_in_flight`);
- workers that mix Kafka and direct ingest, or read more than one topic, or two workers
  that claim one partition at different offsets;
- a partition of the topic that no worker reads (``topic_partitions`` in the workers'
  replies): workers started with different ``--replica-size``, or fewer workers asked
  than run. Its samples are not trained, and a restore would start it at its log start
  while the servers hold what was trained of it.

The servers' stream watermarks are the last check, made where they are known: at the
commit (:meth:`stream_persia.checkpoint.CheckpointWriter.commit` refuses Kafka offsets at
or below what a server had applied when it dumped).

**Mixed Kafka and direct workers are refused** (``Misuse`` naming the workers of each
kind) rather than recorded. A checkpoint holds one stream position, and a restore resets
every worker's stream to it. Recording only the Kafka offsets would make a checkpoint that
either cannot be restored (a direct worker has no stream to reset and refuses) or, if the
direct workers were skipped, rolls their tables back to the cut with nothing to replay
the direct batches trained since: lost, with no record of it. Recording ``"direct"`` (what
the NN side did before) is worse: the Kafka workers are then not reset either, so the
rows of every Kafka batch after the cut are rolled back while the consumers read on past
them. Neither is a cut a demanding user can restore; run every worker with Kafka or none.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from stream_persia.checkpoint.manifest import STREAMS
from stream_persia.errors import Misuse, PersiaError, ServerRestarted

log = logging.getLogger(__name__)

__all__ = ["Cut", "stream_cut", "read_cut", "check_nothing_in_flight", "check_no_failed_push",
           "check_servers_kept", "worker_names"]


@dataclass(frozen=True)
class Cut:
    """The manifest's ``stream``, ``offsets`` (topic → partition → next offset) and
    ``fingerprints`` (topic → partition → the record below its offset; see
    :mod:`stream_persia.checkpoint.manifest`; empty when none was read)."""

    stream: str
    offsets: dict[str, dict[str, int]] = field(default_factory=dict)
    fingerprints: dict[str, dict[str, dict[str, Any]]] = field(default_factory=dict)

    @property
    def partitions(self) -> dict[str, int]:
        """Partition → next offset over the (one) topic: what ``reset_stream`` takes."""
        return {p: o for parts in self.offsets.values() for p, o in parts.items()}


def check_no_failed_push(frontiers: Sequence[Mapping[str, Any]]) -> None:
    """Refuse a checkpoint cut while a worker holds a batch whose gradients only some
    embedding servers applied (the ``failed`` list of each worker's ``frontier`` reply).

    Raises:
        Misuse: naming the worker, the batch, its partition and offset, and the servers.
    """
    for i, f in enumerate(frontiers):
        failed = (f.get("failed") if isinstance(f, dict) else None) or []
        if failed:
            first = failed[0]
            where = (f" (partition {first.get('partition')} offset {first.get('offset')})"
                     if first.get("partition") is not None else "")
            raise Misuse(
                f"embedding worker {i} holds {len(failed)} batch(es) whose gradient push "
                f"failed: batch {first.get('batch_id')}{where} is not applied on embedding "
                f"server(s) {', '.join(map(str, first.get('servers') or []))} "
                f"({first.get('error')}); a checkpoint now would record it as trained",
                field="batch_id",
                hint="bring the server back and push the batch again, or restore the "
                     "last checkpoint")


def check_servers_kept(frontiers: Sequence[Mapping[str, Any]]) -> None:
    """Refuse a checkpoint cut while a worker holds an embedding server lost (the ``lost``
    list of each worker's ``frontier`` reply: it restarted and lost its table).

    Raises:
        ServerRestarted: naming the worker, the server, its address and what was lost.
    """
    for i, f in enumerate(frontiers):
        lost = (f.get("lost") if isinstance(f, dict) else None) or []
        if lost:
            first = lost[0]
            raise ServerRestarted(
                f"embedding worker {i} found {len(lost)} embedding server(s) restarted: "
                f"{first.get('error')}; a checkpoint now would record the lost rows as "
                f"trained", field="incarnation",
                hint="restore the newest checkpoint instead")


def worker_names(n: int) -> list[str]:
    """The default names of ``n`` workers in messages: ``embedding worker <i>``."""
    return [f"embedding worker {i}" for i in range(n)]


def check_nothing_in_flight(frontiers: Sequence[Mapping[str, Any]],
                            names: Sequence[str] | None = None, *,
                            failed_in_flight: bool = True) -> None:
    """Refuse while a worker has batches served to an NN rank whose gradients are not
    applied yet: with them, the job is not at a consistent cut.

    Args:
        frontiers: every worker's ``frontier`` reply, in replica order.
        names: the workers' names in messages (default ``embedding worker <i>``).
        failed_in_flight: count the batches whose push failed as in flight (a checkpoint
            does; a restore does not: it drops them).

    Raises:
        Misuse: naming the first such worker and its number of batches.
    """
    names = list(names) if names is not None else worker_names(len(frontiers))
    for name, f in zip(names, frontiers, strict=True):
        busy = int(f.get("inflight") or 0)
        if not failed_in_flight:
            busy -= len(f.get("failed") or ())
        if busy > 0:
            raise Misuse(
                f"{name} has {busy} batch(es) in flight (served to an NN rank, gradients "
                f"not applied yet), so the job is not at a consistent cut",
                field="inflight",
                hint="NN ranks take checkpoints at a step boundary (every rank calls "
                     "dump_checkpoint at the same step, or picks up POST /v1/checkpoints "
                     "from the checkpoint mailbox); otherwise stop the NN workers first")


def stream_cut(frontiers: Sequence[Mapping[str, Any]],
               topics: Sequence[str | None] | None = None,
               names: Sequence[str] | None = None) -> Cut:
    """The cut from every worker's ``frontier`` reply (see the module docstring).

    Args:
        frontiers: each worker's ``frontier`` reply (``{"stream", "offsets", "inflight",
            "failed", "lost"}``), in replica order.
        topics: each worker's samples topic (``status``'s ``kafka.topic``; None for a
            worker without Kafka). Needed when the workers read Kafka.
        names: the workers' names in messages (default ``embedding worker <i>``).

    Returns:
        ``Cut("kafka", {topic: {partition: offset}})``, or ``Cut("direct", {})`` when no
        worker reads Kafka (or there is no worker).

    Raises:
        Misuse: a batch in flight, a push that failed, workers that mix Kafka and direct
            ingest or read several topics, or disagree on a partition's offset.
        ServerRestarted: a worker found an embedding server restarted (its rows lost).
    """
    names = list(names) if names is not None else worker_names(len(frontiers))
    if len(names) != len(frontiers):
        raise Misuse(f"{len(names)} worker names for {len(frontiers)} frontier replies")
    check_no_failed_push(frontiers)   # a batch only partly applied: name it
    check_servers_kept(frontiers)     # a server restarted with an empty table: name it
    check_nothing_in_flight(frontiers, names)
    kinds = [f.get("stream") for f in frontiers]
    odd = [(n, k) for n, k in zip(names, kinds, strict=True) if k not in STREAMS]
    if odd:
        raise Misuse(f"{odd[0][0]} reports stream {odd[0][1]!r}, expected one of {STREAMS}",
                     field="stream")
    if "kafka" not in kinds:
        return Cut("direct", {})
    if "direct" in kinds:
        kafka = [n for n, k in zip(names, kinds, strict=True) if k == "kafka"]
        direct = [n for n, k in zip(names, kinds, strict=True) if k == "direct"]
        raise Misuse(
            f"the embedding workers mix Kafka ({', '.join(kafka)}) and direct ingest "
            f"({', '.join(direct)}): a checkpoint records one stream position, and "
            f"restoring any would lose the batches that cannot be replayed or train "
            f"others twice; no checkpoint was taken", field="stream",
            hint="run every embedding worker with Kafka (--kafka) or none of them")
    if topics is None or len(topics) != len(frontiers):
        raise Misuse("a Kafka cut needs every worker's topic", field="topic")
    missing = [n for n, t in zip(names, topics, strict=True) if not t]
    if missing:
        raise Misuse(f"{missing[0]} reads Kafka but reports no topic", field="topic")
    if len(set(topics)) != 1:
        raise Misuse(f"the embedding workers read several topics "
                     f"({', '.join(f'{n}: {t}' for n, t in zip(names, topics, strict=True))}); "
                     f"a checkpoint records the offsets of one", field="topic",
                     hint="every worker of a job reads its kafka.samples_topic")
    offsets: dict[str, int] = {}
    owner: dict[str, str] = {}
    for name, f in zip(names, frontiers, strict=True):
        for p, o in (f.get("offsets") or {}).items():
            p, o = str(int(p)), int(o)
            if offsets.get(p, o) != o:
                raise Misuse(f"{owner[p]} and {name} disagree on partition {p}: "
                             f"{offsets[p]} and {o}", field="offsets",
                             hint="each partition is read by one worker (static assignment "
                                  "by replica index): check their replica indices")
            offsets[p], owner[p] = o, name
    topic = str(topics[0])
    check_every_partition_read(topic, frontiers, names, offsets)
    return Cut("kafka", {topic: dict(sorted(offsets.items(), key=lambda kv: int(kv[0])))})


def check_every_partition_read(topic: str, frontiers: Sequence[Mapping[str, Any]],
                               names: Sequence[str], offsets: Mapping[str, int]) -> None:
    """Refuse a Kafka cut that leaves out a partition of the topic that every worker
    knows of (below the least of the workers' ``topic_partitions``: a partition just
    added is not refused before every worker's consumer saw it; not checked when no
    worker reports a count).

    Raises:
        Misuse: naming the partitions no worker reads and what each worker reads.
    """
    counts = [f.get("topic_partitions") for f in frontiers]
    known = [n for n in counts if isinstance(n, int) and not isinstance(n, bool)]
    if not known:
        return
    unread = [p for p in range(min(known)) if str(p) not in offsets]
    if unread:
        reads = "; ".join(f"{name} reads {sorted(int(p) for p in f.get('offsets') or {})}"
                          for name, f in zip(names, frontiers, strict=True))
        raise Misuse(
            f"partitions {unread[:20]} of {topic!r} ({min(known)} partitions) are read by no "
            f"embedding worker ({reads}): their samples are not trained and no checkpoint "
            "can record them; no checkpoint was taken", field="offsets",
            hint="run one embedding worker per --replica-index 0..W-1, all with the same "
                 "--replica-size W, and name all of them to the trainer")


async def read_cut(call_workers: Callable[..., Awaitable[Sequence[Any]]],
                   names: Sequence[str] | None = None, *, fingerprints: bool = True) -> Cut:
    """Ask every worker for its ``frontier`` (and, when they read Kafka, ``status`` for
    the topic, then ``fingerprints`` of the records below the cut's offsets, which each
    worker reads from the brokers for its partitions: one fetch per worker) and return
    :func:`stream_cut` of the replies, with the fingerprints.

    Args:
        call_workers: ``call_workers(method, params=None)`` → every worker's reply, in
            replica order.
        names: the workers' names in messages (default ``embedding worker <i>``).
        fingerprints: False: leave them out (a check of the cut, not the one recorded).
    """
    frontiers = await call_workers("frontier")
    topics = None
    if any(f.get("stream") == "kafka" for f in frontiers):
        statuses = await call_workers("status")
        topics = [(s.get("kafka") or {}).get("topic") if isinstance(s, Mapping) else None
                  for s in statuses]
    cut = stream_cut(frontiers, topics, names)
    if not fingerprints or cut.stream != "kafka" or not any(o > 0 for o in cut.partitions.values()):
        return cut
    prints: dict[str, dict[str, Any]] = {}
    try:
        replies = await call_workers("fingerprints", {"offsets": cut.partitions})
    except PersiaError as e:
        # The cut stands without them (a broker down while a SIGTERM's last checkpoint is
        # cut, a worker from before the method): a restore then says it cannot check the
        # topic's identity. Failing the checkpoint would lose the trained state instead.
        log.warning("the checkpoint records no fingerprints of its Kafka offsets (%s): a "
                    "restore of it cannot tell a re-created topic from this one", e)
        return cut
    for reply in replies:
        prints.update({str(p): fp for p, fp in (reply or {}).items()})
    topic = next(iter(cut.offsets))
    return Cut("kafka", cut.offsets,
               {topic: dict(sorted(prints.items(), key=lambda kv: int(kv[0])))})
