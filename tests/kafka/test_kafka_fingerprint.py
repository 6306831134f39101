"""A checkpoint's offsets are of one topic: the record below each stored offset is
fingerprinted at the cut and compared at every start there (stream_persia.kafka.fingerprint).

The mock broker cannot delete a topic, so "deleted and created again" is modelled as what
it looks like to a consumer: the same topic name on a new cluster (its own mock), holding
other records at the same offsets, grown past the stored ones.
"""

from __future__ import annotations

import asyncio
import logging

import pytest
from aiokafka import AIOKafkaProducer

from stream_persia.errors import BadInput
from stream_persia.kafka import KafkaDataLoss, SampleConsumer
from stream_persia.kafka.fingerprint import Fingerprint, parse_fingerprints, record_digest
from stream_persia.testing.kafka_mock import MockKafkaCluster

pytestmark = [pytest.mark.kafka, pytest.mark.timeout(60)]
BIG = b"x" * 100_000          # 80 of them overflow the mock's ~5 MiB per partition


async def produce(bootstrap: str, partition: int, values: list[bytes],
                  topic: str = "job") -> None:
    producer = AIOKafkaProducer(bootstrap_servers=bootstrap)
    await asyncio.wait_for(producer.start(), 30)
    try:
        for i, value in enumerate(values):   # one batch each (Tansu's ListOffsets: below)
            await asyncio.wait_for(producer.send_and_wait(topic, value, key=b"k%d" % i,
                                                          partition=partition), 30)
    finally:
        await producer.stop()


def cluster_with(records: dict[int, list[bytes]]) -> MockKafkaCluster:
    cluster = MockKafkaCluster().start()
    cluster.create_topic("job", len(records))
    return cluster


async def filled(records: dict[int, list[bytes]]) -> MockKafkaCluster:
    cluster = cluster_with(records)
    for p, values in records.items():
        await produce(cluster.bootstrap_servers, p, values)
    return cluster


def consumer_of(cluster: MockKafkaCluster, on_data_loss: str = "fail") -> SampleConsumer:
    return SampleConsumer(cluster.bootstrap_servers, "job", on_data_loss=on_data_loss,
                          startup_timeout_s=10, broker_timeout_s=10)


def test_digests_tell_key_value_and_absence_apart():
    assert record_digest(b"k", b"v") != record_digest(b"kv", b"")
    assert record_digest(None, b"v") != record_digest(b"", b"v")
    assert len(record_digest(None, None)) == 16
    fp = Fingerprint(2, 1700000000000, record_digest(b"k", b"v"))
    assert parse_fingerprints({"0": fp.to_dict()}) == {0: fp}
    with pytest.raises(BadInput, match="fingerprints.0"):
        parse_fingerprints({"0": {**fp.to_dict(), "digest": "xyz"}})
    with pytest.raises(BadInput, match="partition must be a number"):
        parse_fingerprints({"a": fp.to_dict()})


async def test_a_recreated_topic_grown_past_the_offsets_is_refused_and_the_same_one_starts():
    old = await filled({0: [b"a0", b"a1", b"a2"], 1: [b"b0", b"b1", b"b2"]})
    try:
        async with consumer_of(old) as reader:
            prints = await reader.fingerprints({0: 3, 1: 3})
            assert reader.partitions == [0, 1]
        assert sorted(prints) == [0, 1] and {fp.offset for fp in prints.values()} == {2}
        assert prints[0].digest == record_digest(b"k2", b"a2")
        # The same topic: the records match, the start goes on at the offsets.
        same = consumer_of(old)
        await same.start({0: 3, 1: 3}, prints)
        try:
            assert await same.positions() == {0: 3, 1: 3}
        finally:
            await same.stop()
    finally:
        old.stop()

    # The topic again, created anew with other records, grown past offset 3.
    new = await filled({0: [b"n%d" % i for i in range(5)], 1: [b"m%d" % i for i in range(5)]})
    try:
        consumer = consumer_of(new)
        with pytest.raises(KafkaDataLoss) as caught:
            await consumer.start({0: 3, 1: 3}, prints)
        err = caught.value
        assert [(d.partition, d.cause, d.first) for d in err.losses] == [
            (0, "recreated", 3), (1, "recreated", 3)]
        message = str(err)
        assert "job/0: the record at offset 2 is not the one the checkpoint recorded" in message
        assert f"recorded timestamp {prints[0].timestamp}, digest {prints[0].digest}" in message
        assert "the broker has timestamp" in message
        assert record_digest(b"k2", b"n2") in message
        assert "deleted and created again" in message
        assert "restore a checkpoint taken of this topic" in err.hint
        assert "train the new topic from its start on purpose" in err.hint
        # Offsets alone (a checkpoint from before fingerprints) start as they did.
        unchecked = consumer_of(new)
        await unchecked.start({0: 3, 1: 3})
        await unchecked.stop()
        # skip: the mismatch is counted, and the stream starts where it was asked.
        lenient = consumer_of(new, on_data_loss="skip")
        await lenient.start({0: 3, 1: 3}, prints)
        try:
            assert await lenient.positions() == {0: 3, 1: 3}
            stats = lenient.stats()
            assert (stats["fingerprint_mismatches"], stats["data_loss_events"]) == (2, 2)
            assert [d.cause for d in lenient.accepted_losses()] == ["recreated"] * 2
        finally:
            await lenient.stop()
    finally:
        new.stop()


async def test_check_offsets_and_seek_compare_too_and_change_nothing(caplog):
    old = await filled({0: [b"a0", b"a1"]})
    new = await filled({0: [b"z0", b"z1", b"z2"]})
    try:
        async with consumer_of(old) as reader:
            prints = await reader.fingerprints({0: 2})
        async with consumer_of(new) as consumer:
            before = await consumer.positions()
            with pytest.raises(KafkaDataLoss, match="job/0: the record at offset 1"):
                await consumer.check_offsets({0: 2}, prints)
            with pytest.raises(KafkaDataLoss, match="job/0: the record at offset 1"):
                await consumer.seek({0: 2}, prints)
            assert await consumer.positions() == before
            # Offsets set by hand (on purpose): the fingerprint is of another offset, and
            # not compared.
            with caplog.at_level(logging.WARNING, "stream_persia.kafka.fingerprint"):
                await consumer.check_offsets({0: 3}, prints)
            assert "fingerprint is of offset 1, not of 2" in caplog.text
    finally:
        old.stop()
        new.stop()


async def test_a_record_below_the_offset_that_retention_deleted_cannot_be_checked(caplog):
    cluster = await filled({0: [b"a0"]})
    try:
        await produce(cluster.bootstrap_servers, 0, [BIG] * 80)
        async with consumer_of(cluster) as consumer:
            tp = consumer._tps[0]
            begin = (await consumer._live().beginning_offsets([tp]))[tp]
            assert begin > 1
            # The record at begin - 1 is gone: nothing to compare, whatever was recorded.
            prints = {0: Fingerprint(begin - 1, 0, "0" * 16)}
            with caplog.at_level(logging.INFO, "stream_persia.kafka.fingerprint"):
                await consumer.check_offsets({0: begin}, prints)
            assert f"the record at offset {begin - 1} is deleted" in caplog.text
            # A taker of the cut leaves a partition out when its record is gone.
            assert await consumer.fingerprints({0: begin}) == {}
            assert (await consumer.fingerprints({0: begin + 1}))[0].offset == begin
    finally:
        cluster.stop()


async def test_on_the_session_broker_the_same_topic_matches_and_another_does_not(
        kafka_broker, kafka_topic):
    """The same on the session's broker (Tansu in CI too): a topic of other records at
    the same offsets stands for the one created again. Each record is a batch of its own:
    Tansu's ListOffsets "latest" is the last batch's base offset + 1."""
    servers = kafka_broker.bootstrap_servers
    first, again = kafka_topic(1), kafka_topic(1)
    await produce(servers, 0, [b"a%d" % i for i in range(4)], topic=first)
    await produce(servers, 0, [b"z%d" % i for i in range(6)], topic=again)

    def consumer(topic: str) -> SampleConsumer:
        return SampleConsumer(servers, topic, startup_timeout_s=10, broker_timeout_s=10)

    async with consumer(first) as reader:
        prints = await reader.fingerprints({0: 3})
    assert prints[0].offset == 2 and prints[0].digest == record_digest(b"k2", b"a2")
    same = consumer(first)
    await same.start({0: 3}, prints)
    try:
        assert await same.positions() == {0: 3}
    finally:
        await same.stop()
    with pytest.raises(KafkaDataLoss, match=rf"{again}/0: the record at offset 2 is not"):
        await consumer(again).start({0: 3}, prints)
