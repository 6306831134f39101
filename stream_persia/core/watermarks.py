"""Stream watermarks: how far the embedding servers applied each Kafka partition, so that no
batch is trained twice.

A checkpoint is a consistent cut (DESIGN §7) and a restore rewinds the servers and the
stream together. An embedding worker restarted *alone* (kill -9, OOM, a Kubernetes pod
restart) does not: it has no checkpoint to start from, so it starts its partitions at
``auto_offset_reset``, while the servers still hold every update applied since the last
cut; the batches in between would be looked up and their gradients applied a second time,
silently. So the servers record, per topic and partition, the highest offset they applied
an update for (its *watermark*), and no partition is served from at or below it.

**Servers** (:class:`Watermarks`, kept on an embedding server's store thread, so always
consistent with its rows; :mod:`stream_persia.server.service`):

- an ``update`` that carries a ``source`` (every update of a Kafka batch does) advances
  the watermark of its topic/partition to its offset. It is refused with
  :class:`~stream_persia.errors.StreamReplay`, nothing applied, when its offset is at or
  below a watermark set by another *writer*: a writer is one stream of one worker process
  (its incarnation, and how many times ``reset_stream`` restarted it), so a stream never
  applies what another one applied (a worker restarted alone, two workers reading one
  partition, a push of a stream a restore replaced). One writer's updates may land in any
  order (pushes overlap with ``embedding_staleness`` > 1), and a retried push is
  recognised by its token before any of this.
- ``load`` replaces the watermarks with the checkpoint's cut: for each partition of the
  manifest's ``offsets``, offset - 1, marked *restored* (no writer). Every server gets the
  same cut, whichever shard files it reads, so a checkpoint loads into any number of
  servers, and checkpoints written before watermarks existed carry them too. A checkpoint
  of a direct stream (or an embedding-only dump) records no stream position: its load
  leaves none. With the cut comes the checkpoint's fingerprint of the record below each
  offset (``cut_fingerprints``, :mod:`stream_persia.kafka.fingerprint`), kept while the
  mark stays a restored one and given with it.
- ``clear`` drops them with the rows. A job that deliberately trains a stream again on
  servers it keeps clears them first (``POST /v1/embeddings/clear``).
- ``dump`` replies with them, and a checkpoint whose offsets are at or below one refuses
  to commit (:class:`stream_persia.checkpoint.CheckpointWriter`): its restore would replay
  updates its table already holds.

**Workers** (:class:`stream_persia.worker.ingest.KafkaIngest`) ask every server before
their ingest reads anything (at start and on each ``reset_stream``, :func:`merge`):

- a partition given no start offset whose watermarks are all restored ones (a restore, and
  nothing applied since) starts right after them, at the restored cut
  (:func:`resume_points`): a worker that restarted after a restore, or missed the
  restore's ``reset_stream``, resumes exactly where the table stands, and checks the
  restored fingerprints there (:func:`resume_fingerprints`) as the restore checked them: a
  topic deleted and created again since is not read from the old topic's offsets;
- a partition whose start offset is at or below the highest watermark of any server is
  *refused* (:func:`refusals`): never read nor served; the worker's ``health`` names the
  topic/partition, the start offset, the watermark and the server, and ``next_batch``
  raises StreamReplay, until a restore (the way back) resets its stream. The worker does
  not exit: the restore needs it to answer, and a new process would meet the same
  watermarks.

Wire schema (msgpack maps):

- ``update`` param ``source``: ``{"topic": str, "partition": int >= 0, "offset": int >= 0,
  "writer": str (1-64 chars)}``;
- ``watermarks {"topic"?: str}`` → ``{"topics": {topic: {partition (decimal str):
  {"offset": int >= -1, "writer": str | None, "fingerprint"?: {...}}}}}`` (``writer``
  None: restored, with the load's fingerprint of the record at ``offset`` when it had one;
  only ``topic``'s when given); ``dump`` replies carry the same map (every topic) as
  ``watermarks``;
- ``load`` params ``cut``: ``{topic: {partition (decimal str): next offset (int >= 0)}}``,
  a manifest's ``offsets``; ``cut_fingerprints``: ``{topic: {partition (decimal str):
  {"offset", "timestamp", "digest"}}}``, its ``fingerprints`` (one whose offset is not the
  cut's - 1 is not kept).

Cost: one dict lookup and a comparison per update request, none per id. Bounds: a server
tracks at most :data:`MAX_PARTITIONS` topic/partitions.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple, TypeVar

from stream_persia.core.replies import MarkWire, WatermarksReply
from stream_persia.errors import BadInput, StreamReplay

__all__ = ["Mark", "check_topic", "PartitionMark", "Refusal", "Source", "Watermarks", "merge", "parse_cut",
           "check_fingerprint", "parse_cut_fingerprints", "parse_source", "refusals", "resume_fingerprints",
           "resume_points", "RESTORE_HINT"]

T = TypeVar("T")

#: Kafka's own bound on a topic name.
MAX_TOPIC_CHARS = 249
MAX_WRITER_CHARS = 64
#: Topic/partitions one server tracks at most (a few bytes each; a job has a handful of
#: topics): an update or a cut that would add one more is refused.
MAX_PARTITIONS = 1 << 16
_MAX_OFFSET = (1 << 63) - 1

RESTORE_HINT = ("restore the newest checkpoint (TrainCtx.load_checkpoint, or POST "
                "/v1/checkpoints/{id}/restore): it rewinds the servers and the stream "
                "together; to train the stream again on purpose, clear the servers first "
                "(POST /v1/embeddings/clear)")


def _int(value: Any, field: str, lo: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= _MAX_OFFSET:
        raise BadInput(f"{field} must be an int in [{lo}, 2^63), got {value!r}", field=field)
    return value


def check_topic(value: Any, field: str) -> str:
    """``value`` as a Kafka topic name (BadInput naming ``field`` otherwise)."""
    if not isinstance(value, str) or not 0 < len(value) <= MAX_TOPIC_CHARS:
        raise BadInput(f"{field} must be a topic name of 1-{MAX_TOPIC_CHARS} characters, got "
                       f"{str(value)[:80]!r}", field=field)
    return value


def _partition_key(value: Any, field: str) -> int:
    """A partition given as a map key (decimal string, or an int)."""
    if isinstance(value, str) and value.isdigit() and len(value) <= 10:
        value = int(value)
    return _int(value, field, 0)


class Source(NamedTuple):
    """Where a batch came from, as its updates carry it (``update``'s ``source``)."""

    topic: str
    partition: int
    offset: int
    writer: str

    def to_wire(self) -> dict[str, Any]:
        return self._asdict()


def parse_source(value: Any) -> Source | None:
    """An ``update``'s ``source`` (None when it has none), validated (BadInput naming the
    field)."""
    if value is None:
        return None
    if not isinstance(value, dict):
        raise BadInput(f"source must be a map {{topic, partition, offset, writer}}, got "
                       f"{type(value).__name__}", field="source")
    unknown = sorted(map(str, set(value) - set(Source._fields)))
    if unknown:
        raise BadInput(f"unknown source field(s) {unknown}", field=f"source.{unknown[0]}",
                       hint="topic, partition, offset, writer")
    writer = value.get("writer")
    if not isinstance(writer, str) or not 0 < len(writer) <= MAX_WRITER_CHARS:
        raise BadInput(f"source.writer must be a string of 1-{MAX_WRITER_CHARS} characters, "
                       f"got {str(writer)[:80]!r}", field="source.writer")
    return Source(check_topic(value.get("topic"), "source.topic"),
                  _int(value.get("partition"), "source.partition", 0),
                  _int(value.get("offset"), "source.offset", 0), writer)


def _per_partition(value: Any, field: str, what: str,
                   parse: Callable[[Any, str], T]) -> dict[str, dict[int, T]]:
    """``{topic: {partition (int or decimal str): item}}`` with each item checked by ``parse(item,
    where)``, validated for shape and size (BadInput naming the field); None is {}."""
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise BadInput(f"{field} must map topic -> partition -> {what}, got "
                       f"{type(value).__name__}", field=field)
    if sum(len(p) if isinstance(p, dict) else 0 for p in value.values()) > MAX_PARTITIONS:
        raise BadInput(f"{field} names more than {MAX_PARTITIONS} topic/partitions",
                       field=field)
    out: dict[str, dict[int, T]] = {}
    for topic, parts in value.items():
        where = f"{field}.{str(topic)[:80]}"
        check_topic(topic, field)
        if not isinstance(parts, dict):
            raise BadInput(f"{where} must map partition -> {what}, got "
                           f"{type(parts).__name__}", field=where)
        out[topic] = {_partition_key(p, f"{where}.{str(p)[:20]}"):
                      parse(v, f"{where}.{str(p)[:20]}") for p, v in parts.items()}
    return out


def parse_cut(value: Any) -> dict[str, dict[int, int]]:
    """A ``load``'s ``cut`` (a manifest's offsets: topic → partition → next offset),
    validated (BadInput naming the field); None is no cut."""
    return _per_partition(value, "cut", "next offset", lambda o, where: _int(o, where, 0))


#: Hex characters of a fingerprint's digest (:mod:`stream_persia.kafka.fingerprint`,
#: which takes it from here: the server checks what the worker will read).
FINGERPRINT_DIGEST_HEX = 16


def check_fingerprint(d: Any, where: str) -> dict[str, Any]:
    """A copy of ``{"offset": int >= 0, "timestamp": int, "digest": hex}``, checked
    (BadInput naming ``where``): the one rule for a fingerprint, wherever it comes from."""
    ok = (isinstance(d, dict) and set(d) == {"offset", "timestamp", "digest"}
          and all(isinstance(d[k], int) and not isinstance(d[k], bool)
                  for k in ("offset", "timestamp"))
          and d["offset"] >= 0 and isinstance(d["digest"], str)
          and len(d["digest"]) == FINGERPRINT_DIGEST_HEX
          and all(c in "0123456789abcdef" for c in d["digest"]))
    if not ok:
        raise BadInput(f"{where} must be {{'offset': int >= 0, 'timestamp': int, "
                       f"'digest': {FINGERPRINT_DIGEST_HEX} hex chars}}, got {str(d)[:120]}",
                       field=where)
    return dict(d)


def parse_cut_fingerprints(value: Any) -> dict[str, dict[int, dict[str, Any]]]:
    """A ``load``'s ``cut_fingerprints`` (a manifest's ``fingerprints``: topic → partition
    → ``{"offset", "timestamp", "digest"}``), validated for shape and size (BadInput
    naming the field); None is none. The worker that compares them parses them as
    :class:`stream_persia.kafka.fingerprint.Fingerprint`."""
    return _per_partition(value, "cut_fingerprints", "fingerprint", check_fingerprint)


class Mark(NamedTuple):
    """One partition's watermark on one server."""

    offset: int            # the highest offset applied (restored: the cut - 1)
    writer: str | None     # the stream that applied it; None: restored from a checkpoint


class Watermarks:
    """One embedding server's watermarks (see the module docstring). Not thread-safe: the
    server keeps it on its store thread.

    Args:
        who: the server, for messages ("embedding server 0").
        cut: a checkpoint's offsets (:func:`parse_cut`): restored watermarks.
        fingerprints: the checkpoint's fingerprints of the records at them
            (:func:`parse_cut_fingerprints`); one of another offset is not kept.
    """

    def __init__(self, who: str, cut: Mapping[str, Mapping[int, int]] | None = None,
                 fingerprints: Mapping[str, Mapping[int, dict[str, Any]]] | None = None):
        self.who = who
        self._marks: dict[tuple[str, int], Mark] = {
            (topic, p): Mark(o - 1, None)
            for topic, parts in (cut or {}).items() for p, o in parts.items()}
        # The restored marks' fingerprints, while they stay restored ones.
        self._prints: dict[tuple[str, int], dict[str, Any]] = {
            (topic, p): d for topic, parts in (fingerprints or {}).items()
            for p, d in parts.items()
            if (m := self._marks.get((topic, p))) is not None and d["offset"] == m.offset}

    def __len__(self) -> int:
        return len(self._marks)

    def get(self, topic: str, partition: int) -> Mark | None:
        return self._marks.get((topic, partition))

    def check(self, src: Source) -> None:
        """Refuse (StreamReplay) an update another writer's watermark already covers, and
        (BadInput) one that would track more than :data:`MAX_PARTITIONS` partitions."""
        mark = self._marks.get((src.topic, src.partition))
        if mark is None:
            if len(self._marks) >= MAX_PARTITIONS:
                raise BadInput(f"{self.who} tracks {len(self._marks)} topic/partitions "
                               f"already, the most it keeps: {src.topic}/{src.partition} is "
                               f"one too many", field="source.partition")
            return
        if src.offset > mark.offset or src.writer == mark.writer:
            return
        by = (f"stream {mark.writer}" if mark.writer is not None
              else "a checkpoint restored since")
        raise StreamReplay(
            f"{self.who} refuses the update of {src.topic}/{src.partition} offset "
            f"{src.offset} from stream {src.writer}: it holds the updates of that partition "
            f"up to offset {mark.offset} (applied by {by}), so applying it would train "
            f"offset {src.offset} a second time (a worker restarted alone, or two workers "
            f"reading one partition); nothing was applied", field="offset", hint=RESTORE_HINT)

    def advance(self, src: Source) -> None:
        """Record that ``src``'s update was applied (after :meth:`check`)."""
        key = (src.topic, src.partition)
        mark = self._marks.get(key)
        if mark is None or src.offset > mark.offset:   # never lower a mark
            self._marks[key] = Mark(src.offset, src.writer)
            self._prints.pop(key, None)

    def clear(self) -> None:
        self._marks.clear()
        self._prints.clear()

    def to_wire(self, topic: str | None = None) -> dict[str, dict[str, MarkWire]]:
        """``{topic: {partition (str): {"offset", "writer", "fingerprint"?}}}`` (the
        ``watermarks`` reply), of every topic or of ``topic`` only."""
        out: dict[str, dict[str, MarkWire]] = {}
        for (t, p), mark in sorted(self._marks.items()):
            if topic is None or t == topic:
                wire: MarkWire = {"offset": mark.offset, "writer": mark.writer}
                if (t, p) in self._prints:
                    wire["fingerprint"] = dict(self._prints[(t, p)])
                out.setdefault(t, {})[str(p)] = wire
        return out


# ------------------------------------------------------------------ the workers' side
class PartitionMark(NamedTuple):
    """One partition's watermark over every server (:func:`merge`)."""

    offset: int            # the highest over the servers
    server: int            # the server holding it
    writer: str | None     # who applied it there (None: restored)
    restored: bool         # every server's mark of the partition is a restored one
    fingerprint: dict[str, Any] | None = None   # a restored mark's record, as loaded


def merge(replies: Sequence[WatermarksReply], topic: str) -> dict[int, PartitionMark]:
    """Per partition of ``topic``, the highest watermark of every server's ``watermarks``
    reply (in server order).

    Raises:
        BadInput: a reply that is not a ``watermarks`` reply (names the server).
    """
    out: dict[int, PartitionMark] = {}
    for s, reply in enumerate(replies):
        topics = reply.get("topics") if isinstance(reply, dict) else None
        if not isinstance(topics, dict):
            raise BadInput(f"embedding server {s} answered watermarks with {reply!r:.200}",
                           field="topics")
        for p, mark in (topics.get(topic) or {}).items():
            where = f"topics.{topic}.{p}"
            if not isinstance(mark, dict):
                raise BadInput(f"embedding server {s}: {where} is {mark!r:.80}", field=where)
            part = _partition_key(p, where)
            offset = _int(mark.get("offset"), f"{where}.offset", -1)
            writer = mark.get("writer")
            printed = mark.get("fingerprint") if writer is None else None
            printed = printed if isinstance(printed, dict) else None
            seen = out.get(part)
            restored = writer is None and (seen is None or seen.restored)
            if seen is None or offset > seen.offset:
                out[part] = PartitionMark(offset, s, writer, restored, printed)
            else:
                if seen.restored != restored:
                    seen = out[part] = seen._replace(restored=restored)
                if seen.fingerprint is None and printed is not None and offset == seen.offset:
                    out[part] = seen._replace(fingerprint=printed)
    return out


def resume_points(marks: Mapping[int, PartitionMark]) -> dict[int, int]:
    """Where a partition without a start offset starts: right after a restored cut no
    update has passed since (the partitions whose marks are all restored ones)."""
    return {p: m.offset + 1 for p, m in marks.items() if m.restored}


def resume_fingerprints(marks: Mapping[int, PartitionMark]) -> dict[int, dict[str, Any]]:
    """The restored fingerprints of the :func:`resume_points` partitions (partition →
    ``{"offset", "timestamp", "digest"}``): where a worker resumes, it checks that the
    record below is still the one the checkpoint was cut at."""
    return {p: m.fingerprint for p, m in marks.items()
            if m.restored and m.fingerprint is not None}


class Refusal(NamedTuple):
    """A partition a worker does not serve: its stream would start at ``start``, at or
    below ``mark`` (:func:`refusals`)."""

    topic: str
    partition: int
    start: int
    mark: PartitionMark

    def describe(self, worker: str, servers: Sequence[str] = ()) -> str:
        m = self.mark
        server = (f"embedding server {m.server}"
                  + (f" ({servers[m.server]})" if m.server < len(servers) else ""))
        by = (f"applied by stream {m.writer}" if m.writer is not None
              else "restored from a checkpoint")
        return (f"{worker} refuses to serve {self.topic}/{self.partition} from offset "
                f"{self.start}: {server} holds the updates of that partition up to offset "
                f"{m.offset} ({by}), so serving offsets {self.start}..{m.offset} again "
                f"would train them twice (a worker restarted alone starts its partitions "
                f"over); the partition is not read")

    def to_dict(self) -> dict[str, Any]:
        return {"topic": self.topic, "partition": self.partition, "start": self.start,
                "watermark": self.mark.offset, "server": self.mark.server,
                "writer": self.mark.writer}


def refusals(topic: str, marks: Mapping[int, PartitionMark],
             starts: Mapping[int, int]) -> list[Refusal]:
    """The partitions of ``starts`` (partition → the offset its stream starts at) whose
    start is at or below their watermark, in partition order."""
    return [Refusal(topic, p, o, marks[p]) for p, o in sorted(starts.items())
            if p in marks and o <= marks[p].offset]
