"""A serving replica following the update stream on Kafka (``<job>.model.updates``).

The same messages as the servers' RPC logs (:mod:`stream_persia.kafka.updates` describes
the topic), read with manually assigned partitions, one per embedding server, from the
offsets the checkpoint's manifest records (else from the start of each partition). Every
record is validated on receipt: one that does not decode or is not a valid update
message goes to ``<topic>.dlq`` with the reason and is counted
(``persia_api_replica_bad_messages_total``), except a record of another job size (the
topic keeps the records of the servers before a rescale, read from every partition's start
when the checkpoint was written by another number of servers): skipped, said once per
partition. Per partition the replica keeps the
incarnation and sequence it applied last (:func:`admit`): a record applied already (a
producer retry) is skipped; a gap (a record lost to retention or refused) or an
incarnation joined in the middle makes it skip to the next ``reset`` and ask that server,
over RPC, for a full pass; so does a partition read to its end from its start (the
checkpoint recorded no offset) without the checkpoint's place in it, ending in another
server process's records (retention deleted the place; one ending in the checkpoint's own
process's records, or empty, waits for the place, not written yet). Nothing is applied
twice; nothing is missed silently.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

from stream_persia.api.replica import (
    Replica,
    ShardCursor,
    TableRefused,
    apply_messages,
    check_message,
    message_bytes,
)

from stream_persia.core import wire
from stream_persia.core.aio import cancel_and_wait
from stream_persia.errors import BadInput, PersiaError
from stream_persia.server.dense_hub import lineage_or_legacy

__all__ = ["KafkaFollow", "admit", "check_dense"]

log = logging.getLogger(__name__)

#: Seconds before a failed ask of a full pass is made again (doubled after each failure,
#: up to RESYNC_RETRY_MAX_S).
RESYNC_RETRY_S = 1.0
RESYNC_RETRY_MAX_S = 30.0
#: how long one ask of a server (a full pass, its shard) may hold the topic's loop: every
#: partition, and the dense model, wait meanwhile
ASK_TIMEOUT_MS = 2000


def check_dense(msg: Any, shards: int) -> dict[str, Any]:
    """A ``dense`` record as it must be (BadInput naming the field)."""
    if not isinstance(msg, dict) or msg.get("kind") != "dense":
        raise BadInput("a record of the dense partition must be a 'dense' message",
                       field="kind")
    if msg.get("shard") != shards or msg.get("shards") != shards:
        raise BadInput(f"dense record for shard {msg.get('shard')!r}", field="shard")
    for key, lo in (("version", 0), ("chunk", 0), ("chunks", 1), ("seq", 0)):
        v = msg.get(key)
        if isinstance(v, bool) or not isinstance(v, int) or v < lo:
            raise BadInput(f"dense record {key} must be an int >= {lo}, got {v!r}", field=key)
    if msg["chunk"] >= msg["chunks"] or msg["chunks"] > 1 << 20:
        raise BadInput(f"dense record chunk {msg['chunk']} of {msg['chunks']}", field="chunk")
    if not isinstance(msg.get("data"), (bytes, bytearray, memoryview)):
        raise BadInput("dense record data must be bytes", field="data")
    if not isinstance(msg.get("sha256"), str) or not isinstance(msg.get("incarnation"), str):
        raise BadInput("dense record needs sha256 and incarnation strings", field="sha256")
    # absent: relayed by a server from before lineages (the legacy lineage)
    msg["lineage"] = lineage_or_legacy(msg.get("lineage"))
    return msg


def admit(cursor: ShardCursor, msg: dict[str, Any]) -> str:
    """Whether a valid message of the cursor's partition is applied, in stream order:
    ``"apply"``, ``"skip"`` (before the start position, or applied already) or
    ``"gap"`` (messages are missing before it: apply it, but the cursor now skips to the
    next reset; resync). Advances ``cursor.next_seq`` past an admitted message."""
    inc, seq = msg["incarnation"], msg["seq"]
    if cursor.start is not None:
        if inc == cursor.start[0] and seq >= cursor.start[1]:
            # From the checkpoint's place on: a first record past it means the ones
            # between are gone (retention, a broker that lost its data): a gap below.
            cursor.incarnation, cursor.next_seq = inc, cursor.start[1]
        elif inc != cursor.start[0] and cursor.start_at_offset:
            # Read from the checkpoint's offset: a later server process (restarted since),
            # its log joined past its reset when retention deleted that (a gap below). It
            # used to be skipped, as a process from before the checkpoint would be, record
            # after record until that server's next full pass: nothing said, no resync.
            pass
        elif not (inc != cursor.start[0] and seq == 0 and msg["kind"] == "reset"):
            return "skip"   # before the checkpoint's place in its server's log
        # (else: a server process restarted since the checkpoint; its log starts here)
        cursor.start = None
    verdict = "apply"
    if inc != cursor.incarnation:
        if cursor.incarnation is not None:
            cursor.restarts += 1
            log.warning("replica: embedding server %d restarted (incarnation %s, was %s)",
                        cursor.shard, inc, cursor.incarnation)
        cursor.incarnation = inc
        if seq != 0 and msg["kind"] != "reset":   # joined a log in its middle
            verdict = "gap"
    elif seq < cursor.next_seq:
        return "skip"
    elif seq > cursor.next_seq and msg["kind"] != "reset":
        verdict = "gap"
    if verdict == "gap":
        cursor.skipping = True
    cursor.next_seq = seq + 1
    return verdict


class KafkaFollow:
    """Consumes the update topic for a :class:`Replica` (its RPC followers are not used).

    Args:
        replica: the replica whose cursors and store are updated.
        bootstrap_servers, topic: the brokers and ``<job>.model.updates``.
        positions: the manifest's ``model_updates`` (``offset`` where recorded).
        security_kwargs: aiokafka's security settings.
        enable_idempotence: of the dead-letter writer's producer (``kafka.enable_idempotence``).
    """

    def __init__(self, replica: Replica, bootstrap_servers: str, topic: str,
                 positions: list[dict[str, Any]] | None, *,
                 security_kwargs: dict[str, Any] | None = None,
                 startup_timeout_s: float = 60.0, enable_idempotence: bool = True):
        self.replica = replica
        self.bootstrap_servers = bootstrap_servers
        self.topic = topic
        self.positions = positions
        self.security_kwargs = security_kwargs or {}
        self.startup_timeout_s = startup_timeout_s
        self.enable_idempotence = enable_idempotence
        self._consumer: Any = None
        self._dense_key: tuple | None = None
        self._dense_parts: dict[int, bytes] = {}
        self._dlq: Any = None
        self._task: asyncio.Task | None = None
        #: records skipped per partition as another job size's (:meth:`_other_layout`)
        self.other_layout: dict[int, int] = {}
        self._checked: set[int] = set()       # shards whose listed server answers as them
        self._failing: set[int] = set()       # partitions whose last batch failed (said)
        self._retry_at: dict[int, float] = {}   # when a failed ask of a full pass is retried
        self._retry_s: dict[int, float] = {}    # ... and the wait before the one after
        #: per partition, the incarnation of the last valid record read
        self._last_incarnation: dict[int, str] = {}
        self._warned_order: dict[int, bool] = {}
        for c in replica.cursors:
            pos = positions[c.shard] if positions is not None else None
            if pos:   # where the checkpoint left this server's log: read on from there
                c.start = (str(pos["incarnation"]), int(pos["seq"]))
                c.start_at_offset = "offset" in pos
                c.incarnation, c.next_seq = c.start

    async def start(self) -> None:
        from aiokafka import AIOKafkaConsumer, TopicPartition

        from stream_persia.kafka._client import client_kwargs
        from stream_persia.kafka.dlq import DeadLetterWriter
        from stream_persia.kafka.liveness import start_client

        kw = client_kwargs(self.bootstrap_servers, self.security_kwargs, "stream-persia-replica")
        kw.update(enable_auto_commit=False, auto_offset_reset="earliest", fetch_max_wait_ms=50,
                  max_partition_fetch_bytes=16 << 20, fetch_max_bytes=64 << 20)
        self._consumer = await start_client(lambda: AIOKafkaConsumer(**kw),
                                            self.bootstrap_servers,
                                            timeout_s=self.startup_timeout_s)
        tps = [TopicPartition(self.topic, c.shard) for c in self.replica.cursors]
        dense = TopicPartition(self.topic, self.replica.shards)
        self._consumer.assign([*tps, dense])
        # The dense model: from now on on Kafka; the one held now, once over RPC (older
        # blobs in the partition are never needed).
        await self._consumer.seek_to_end(dense)
        try:
            await self.replica.pull_dense()
        except PersiaError as e:
            log.warning("replica: no dense model from embedding server 0 yet: %s", e)
        # Said now, not at the first full pass a shard needs; at once (a server not up
        # costs one deadline, not one each): one not up is checked before it is asked.
        await asyncio.gather(*(self._server_is(c.shard) for c in self.replica.cursors),
                             return_exceptions=True)
        for tp in tps:
            pos = self.positions[tp.partition] if self.positions is not None else None
            if pos and "offset" in pos:
                self._consumer.seek(tp, int(pos["offset"]))
            else:
                await self._consumer.seek_to_beginning(tp)
        self._dlq = DeadLetterWriter(f"{self.topic}.dlq", bootstrap_servers=self.bootstrap_servers,
                                     security_kwargs=self.security_kwargs,
                                     startup_timeout_s=self.startup_timeout_s,
                                     enable_idempotence=self.enable_idempotence)
        await self._dlq.start()
        self._task = asyncio.create_task(self._run(), name="replica-kafka")

    async def stop(self) -> None:
        from stream_persia.kafka.liveness import stop_client

        await cancel_and_wait(self._task)
        if self._consumer is not None:
            await stop_client(self._consumer)
        if self._dlq is not None:
            await self._dlq.close()

    async def _run(self) -> None:
        failing = False
        while True:
            try:
                batches = await self._consumer.getmany(timeout_ms=200, max_records=2000)
                failing = False
            except asyncio.CancelledError:
                raise
            except Exception as e:   # a broker gone: the gap shows in trained_through
                self.replica.counts["pull_failures"] += 1
                if not failing:
                    log.warning("replica: cannot read %s: %r (retrying)", self.topic, e)
                failing = True
                await asyncio.sleep(1.0)
                continue
            for tp, records in batches.items():
                await self._take_batch(tp.partition, records)
            await self._start_not_found()
            await self._retry_resyncs()

    async def _take_batch(self, partition: int, records: list[Any]) -> None:
        """One partition's records of a fetch. An exception that is not a refusal (a bug, a
        table out of memory) is said once per partition until a batch of it goes through,
        counted in ``pull_failures`` (the records were fine), and the shard skips to a full
        pass, asked once: it used to be logged, counted as a bad message and asked again on
        every failing batch."""
        r = self.replica
        cursor = r.cursors[partition] if partition < r.shards else None
        skipping = cursor is not None and cursor.skipping
        resets = cursor.applied["resets"] if cursor is not None else 0
        try:
            if cursor is None:
                await self.take_dense(records)
            else:
                await self.take(cursor, records)
            self._failing.discard(partition)
        except asyncio.CancelledError:
            raise
        except Exception:   # a bug: it used to end this task, silently
            r.counts["pull_failures"] += 1
            if partition not in self._failing:
                self._failing.add(partition)
                log.exception("replica: applying records of %s/%d failed (said once until "
                              "they apply again)", self.topic, partition)
            if cursor is not None:   # they are read: a gap
                cursor.skipping, cursor.rebuilding, cursor.received = True, False, []
                # Else asked already (or refused: the next one will do), unless a reset
                # of this batch (the full pass asked) was taken before it failed: that
                # pass is spent, and none would come again.
                if not skipping or cursor.applied["resets"] != resets:
                    await self._ask_resync(cursor)

    async def _start_not_found(self) -> None:
        """A partition read to its end from its start (the checkpoint recorded no offset)
        without meeting the checkpoint's place in its server's log, nor a later process's
        reset: retention deleted them. Its records were skipped as older than the
        checkpoint; from now on the shard skips to the next reset, which it asks for.

        Only when its last record is another process's: the checkpoint's process may not
        have written its place yet (its sink had nothing acknowledged when the checkpoint
        was taken), and an empty partition or one ending in that process's records is
        waited on; a full pass asked then was followed by a second one when the place
        came ("joined mid-log")."""
        from aiokafka import TopicPartition

        for c in self.replica.cursors:
            if c.start is None or c.start_at_offset:
                continue
            last = self._last_incarnation.get(c.shard)
            if last is None or last == c.start[0]:
                continue
            tp = TopicPartition(self.topic, c.shard)
            hw = self._consumer.highwater(tp)
            if hw is None or await self._consumer.position(tp) < hw:
                continue
            log.warning("replica: %s/%d read to its end without the checkpoint's place in "
                        "embedding server %d's log (incarnation %s, message %d); asking it "
                        "for a full pass", self.topic, c.shard, c.shard, *c.start)
            c.start, c.incarnation = None, None
            c.skipping, c.rebuilding = True, False
            await self._ask_resync(c)

    async def take_dense(self, records: list[Any]) -> None:
        """Assemble ``dense`` records into blobs; serve each whole one that is newer or
        of another lineage (:meth:`Replica.apply_dense`)."""
        for rec in records:
            try:
                msg = check_dense(wire.unpack(rec.value), self.replica.shards)
            except (BadInput, ValueError) as e:
                await self._dead_letter(rec, e)
                continue
            key = (msg["incarnation"], msg["lineage"], msg["version"], msg["chunks"],
                   msg["sha256"])
            if self._dense_key != key:
                self._dense_key, self._dense_parts = key, {}
            self._dense_parts[msg["chunk"]] = bytes(msg["data"])
            if len(self._dense_parts) < msg["chunks"]:
                continue
            blob = b"".join(self._dense_parts[i] for i in range(msg["chunks"]))
            self._dense_key, self._dense_parts = None, {}
            try:
                if await self.replica.apply_dense(blob, msg["version"], msg["sha256"],
                                                  msg["event_time"], msg["lineage"]):
                    self.replica.counts["dense_kafka"] += 1
            except PersiaError as e:   # refused, or not loadable now: the next one comes
                await self._dead_letter(rec, e)

    async def _dead_letter(self, rec: Any, e: Exception) -> None:
        self.replica.counts["bad_messages"] += 1
        reason = e.message if isinstance(e, PersiaError) else f"{type(e).__name__}: {e}"
        log.error("replica: bad update record %s/%d@%d: %s (dead-lettered)",
                  rec.topic, rec.partition, rec.offset, reason)
        await self._dlq.write(rec.value, reason, (rec.topic, rec.partition, rec.offset),
                              key=rec.key, kind="update")

    async def take(self, cursor: ShardCursor, records: list[Any]) -> None:
        """Validate, filter and apply one partition's records (in order)."""
        todo: list[dict[str, Any]] = []
        resync = False
        for rec in records:
            try:
                raw = wire.unpack(rec.value)
                if self._other_layout(cursor, raw):
                    continue
                msg = check_message(raw, cursor, self.replica.shards)
            except (BadInput, ValueError) as e:
                await self._dead_letter(rec, e)
                continue
            self._last_incarnation[cursor.shard] = msg["incarnation"]
            verdict = admit(cursor, msg)
            if verdict == "skip":
                continue
            if verdict == "gap":
                resync = True
                if todo:   # what came before the gap first, in order
                    await self._apply(cursor, todo)
                    todo = []
                cursor.skipping = True   # (applying what came before cleared nothing)
            todo.append(msg)
        if todo:
            await self._apply(cursor, todo)
        if resync:
            await self._ask_resync(cursor)

    def _other_layout(self, cursor: ShardCursor, raw: Any) -> bool:
        """Whether ``raw`` is a record of the servers of another job size (the topic keeps
        them from before the job was rescaled: a checkpoint of another server count is
        read from every partition's start). Skipped, said once per partition and counted
        in ``other_layout``; they used to be dead-lettered one by one, at error."""
        n = raw.get("shards") if isinstance(raw, dict) else None
        if isinstance(n, bool) or not isinstance(n, int) or n < 1 or n == self.replica.shards:
            return False
        if not self.other_layout.get(cursor.shard):
            log.warning("replica: %s/%d holds records of %d embedding servers (the job has "
                        "%d: from before it was rescaled); skipping them", self.topic,
                        cursor.shard, n, self.replica.shards)
        self.other_layout[cursor.shard] = self.other_layout.get(cursor.shard, 0) + 1
        return True

    async def _apply(self, cursor: ShardCursor, msgs: list[dict[str, Any]]) -> None:
        r = self.replica
        r.counts["bytes"] += sum(message_bytes(m) for m in msgs)
        try:
            ended = await r.execute(lambda: apply_messages(r.store, cursor, r.shards, msgs))
        except TableRefused as e:   # the table refused one: it used to end this task, silently
            await r.refused_by_table(cursor, e, self._ask_resync)
            return
        r.advance(rewound=bool(ended))

    async def _server_is(self, shard: int) -> bool:
        """Whether the server listed at ``shard`` in ``PERSIA_EMBEDDING_SERVERS`` is that
        shard (asked once it is). The records come from each server's own partition
        whatever the list's order, but a full pass is asked of the listed address: in
        another order, another server did it and this shard waited on."""
        if shard in self._checked:
            return True
        r = self.replica
        role = r.roles.servers[shard]
        reply = await r.roles.call(role, "model_updates", {"from_seq": 1 << 62, "max_bytes": 1},
                                   ASK_TIMEOUT_MS)
        got = (reply.get("shard"), reply.get("shards")) if isinstance(reply, dict) else None
        if got != (shard, r.shards):
            r.counts["pull_failures"] += 1
            if not self._warned_order.get(shard):
                self._warned_order[shard] = True
                log.warning("replica: %s is embedding server %r of %r, listed as server %d of "
                            "%d in PERSIA_EMBEDDING_SERVERS: never asked for that shard's full "
                            "passes (list the servers in the job's replica order)", role.peer,
                            *(got or (None, None)), shard, r.shards)
            return False
        self._checked.add(shard)
        return True

    async def _ask_resync(self, cursor: ShardCursor) -> None:
        cursor.resync_pending = True   # until asked: retried (_retry_resyncs)
        # backing off: a server down costs this loop (every partition) a deadline each time
        wait = self._retry_s[cursor.shard] = min(
            RESYNC_RETRY_MAX_S, 2 * self._retry_s.get(cursor.shard, RESYNC_RETRY_S / 2))
        self._retry_at[cursor.shard] = time.monotonic() + wait
        try:
            if await self._server_is(cursor.shard):
                await self.replica.roles.call(self.replica.roles.servers[cursor.shard],
                                              "model_updates", {"resync": True},
                                              ASK_TIMEOUT_MS)
                cursor.resync_pending = False
                cursor.resyncs += 1
                self._retry_s.pop(cursor.shard, None)
        except PersiaError as e:
            log.warning("replica: could not ask embedding server %d for a full pass: %s "
                        "(asked again)", cursor.shard, e)

    async def _retry_resyncs(self) -> None:
        """Ask again the full passes whose ask failed (a server down then): they used to
        be never asked again, the shard skipping until a restart or restore of it."""
        now = time.monotonic()
        for c in self.replica.cursors:
            if c.resync_pending and c.skipping and now >= self._retry_at.get(c.shard, 0.0):
                await self._ask_resync(c)
