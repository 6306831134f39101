"""The checkpoint's stream cut from the workers' ``frontier`` replies (``checkpoint.cut``):
the one computation NN rank 0 and the API both use. Paths through real roles are in
tests/nn/test_nn_checkpoint.py and tests/api/test_api_checkpoints.py."""

from __future__ import annotations

import pytest

from stream_persia.checkpoint import Cut, read_cut, stream_cut
from stream_persia.checkpoint.cut import check_nothing_in_flight
from stream_persia.errors import Misuse, ServerRestarted
from stream_persia.kafka import KafkaUnavailable


def kafka(offsets: dict, **kw) -> dict:
    return {"stream": "kafka", "offsets": offsets, "inflight": 0, "pending": 0, "failed": [],
            "lost": [], **kw}


def direct(**kw) -> dict:
    return {"stream": "direct", "offsets": {}, "inflight": 0, "pending": 0, "failed": [],
            "lost": [], **kw}


def test_a_kafka_cut_merges_every_workers_partitions():
    fronts = [kafka({"0": 10, "2": 4}, pending=3), kafka({1: 7})]
    cut = stream_cut(fronts, ["samples", "samples"])
    assert cut == Cut("kafka", {"samples": {"0": 10, "1": 7, "2": 4}})
    assert cut.partitions == {"0": 10, "1": 7, "2": 4}


def test_a_direct_cut_has_no_offsets():
    assert stream_cut([direct(), direct()]) == Cut("direct", {})
    assert stream_cut([]) == Cut("direct", {})    # no worker (an API with servers only)


def test_workers_that_mix_kafka_and_direct_ingest_are_refused_naming_them():
    with pytest.raises(Misuse, match=r"mix Kafka \(embedding worker 0, embedding worker 2\) "
                                     r"and direct ingest \(embedding worker 1\)") as err:
        stream_cut([kafka({"0": 3}), direct(), kafka({"1": 4})], ["t", None, "t"])
    assert err.value.field == "stream" and "--kafka" in err.value.hint
    with pytest.raises(Misuse, match=r"Kafka \(w-a\) and direct ingest \(w-b\)"):
        stream_cut([kafka({"0": 3}), direct()], ["t", None], names=["w-a", "w-b"])


def test_batches_in_flight_are_refused_with_one_message_for_every_caller():
    fronts = [kafka({"0": 10}), kafka({"1": 7}, inflight=2)]
    with pytest.raises(Misuse, match=r"embedding worker 1 has 2 batch\(es\) in flight .*"
                                     r"not at a consistent cut") as err:
        stream_cut(fronts, ["t", "t"])
    assert "dump_checkpoint" in err.value.hint and "mailbox" in err.value.hint
    with pytest.raises(Misuse, match=r"^embedding-worker-1 10\.0\.0\.2:9 has 2 batch"):
        stream_cut(fronts, ["t", "t"], names=["embedding-worker-0 10.0.0.1:9",
                                              "embedding-worker-1 10.0.0.2:9"])
    with pytest.raises(Misuse, match="in flight"):
        stream_cut([direct(inflight=1)])


def test_failed_pushes_and_restarted_servers_refuse_the_cut():
    failed = [{"batch_id": 4, "partition": 0, "offset": 9, "servers": [1], "error": "boom"}]
    with pytest.raises(Misuse, match="batch 4 .*partition 0 offset 9"):
        stream_cut([kafka({"0": 9}, inflight=1, failed=failed)], ["t"])
    lost = [{"server": 1, "address": "h:1", "error": "embedding server 1 at h:1 restarted"}]
    with pytest.raises(ServerRestarted, match="restarted"):
        stream_cut([direct(lost=lost)])


def test_a_restore_counts_failed_batches_out_of_flight():
    failed = [{"batch_id": 4, "servers": [1], "error": "boom"}]
    front = kafka({"0": 9}, inflight=1, failed=failed)
    check_nothing_in_flight([front], failed_in_flight=False)   # a restore drops it
    with pytest.raises(Misuse, match="1 batch"):
        check_nothing_in_flight([front])
    with pytest.raises(Misuse, match="1 batch"):
        check_nothing_in_flight([{**front, "inflight": 2}], failed_in_flight=False)


def test_topics_and_partitions_must_agree():
    with pytest.raises(Misuse, match="several topics .*worker 0: a, embedding worker 1: b"):
        stream_cut([kafka({"0": 1}), kafka({"1": 1})], ["a", "b"])
    with pytest.raises(Misuse, match="embedding worker 1 reads Kafka but reports no topic"):
        stream_cut([kafka({"0": 1}), kafka({"1": 1})], ["a", None])
    with pytest.raises(Misuse, match="every worker's topic"):
        stream_cut([kafka({"0": 1})])
    with pytest.raises(Misuse, match="embedding worker 0 and embedding worker 1 disagree "
                                     "on partition 0: 10 and 11"):
        stream_cut([kafka({"0": 10}), kafka({"0": 11})], ["t", "t"])
    assert stream_cut([kafka({"0": 10}), kafka({"0": 10})], ["t", "t"]).partitions == {"0": 10}
    with pytest.raises(Misuse, match="reports stream 'files'"):
        stream_cut([{**direct(), "stream": "files"}])


def test_a_partition_no_worker_reads_refuses_the_cut_naming_it():
    # Workers started with --replica-size 2 and 3: partition 3 of 4 is nobody's.
    fronts = [kafka({"0": 5, "2": 1}, topic_partitions=4), kafka({"1": 2}, topic_partitions=4)]
    with pytest.raises(Misuse, match=r"partitions \[3\] of 't' \(4 partitions\) are read by "
                                     r"no embedding worker \(embedding worker 0 reads \[0, 2\]; "
                                     r"embedding worker 1 reads \[1\]\)"):
        stream_cut(fronts, ["t", "t"])
    # The workers' consumers learn of added partitions at different times: only those
    # every worker knows of must be read (worker 0 does not know of partition 3 yet).
    fronts = [kafka({"0": 5, "2": 0}, topic_partitions=3), kafka({"1": 2}, topic_partitions=4)]
    assert stream_cut(fronts, ["t", "t"]).partitions == {"0": 5, "1": 2, "2": 0}
    fronts[0]["topic_partitions"] = 4
    with pytest.raises(Misuse, match=r"partitions \[3\]"):
        stream_cut(fronts, ["t", "t"])


async def test_read_cut_asks_for_the_topic_only_with_kafka():
    asked: list[str] = []

    def fp(offset: int) -> dict:
        return {"offset": offset, "timestamp": 1, "digest": "0" * 16}

    def workers(fronts: list[dict], topics: list[str | None]):
        async def call(method: str, params: dict | None = None) -> list[dict]:
            asked.append(method)
            if method == "frontier":
                return fronts
            if method == "fingerprints":   # each worker: its partitions of the offsets
                mine = [{p: fp(o - 1) for p, o in params["offsets"].items()
                         if p in f["offsets"] and o > 0} for f in fronts]
                return mine
            return [{"kafka": {"topic": t}} if t else {} for t in topics]
        return call

    assert await read_cut(workers([direct()], [None])) == Cut("direct", {})
    assert asked == ["frontier"]
    asked.clear()
    got = await read_cut(workers([kafka({"0": 5}), kafka({"1": 6, "2": 0})], ["s", "s"]))
    assert got == Cut("kafka", {"s": {"0": 5, "1": 6, "2": 0}},
                      {"s": {"0": fp(4), "1": fp(5)}})
    assert asked == ["frontier", "status", "fingerprints"]
    asked.clear()
    got = await read_cut(workers([kafka({"0": 5})], ["s"]), fingerprints=False)
    assert got == Cut("kafka", {"s": {"0": 5}}) and asked == ["frontier", "status"]
    with pytest.raises(Misuse, match="mix Kafka"):
        await read_cut(workers([kafka({"0": 5}), direct()], ["s", None]))


async def test_a_cut_whose_fingerprints_cannot_be_read_is_kept_without_them(caplog):
    """The brokers are down (or a worker predates the method) while a checkpoint is cut,
    say a SIGTERM's last one: the checkpoint is written without fingerprints, and says so,
    rather than failing and losing what was trained."""
    async def call(method: str, params: dict | None = None) -> list[dict]:
        if method == "frontier":
            return [kafka({"0": 5})]
        if method == "status":
            return [{"kafka": {"topic": "s"}}]
        raise KafkaUnavailable("no broker answered within 5 s", field="kafka")

    assert await read_cut(call) == Cut("kafka", {"s": {"0": 5}})
    assert "records no fingerprints" in caplog.text and "no broker answered" in caplog.text
