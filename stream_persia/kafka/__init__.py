"""Kafka plumbing: static partition assignment, the samples consumer, producer and DLQ.

Partitions are shared by **static assignment from the replica index** (DESIGN §6):
partition ``p`` of the samples topic belongs to embedding worker ``p mod W``. We chose it
over a consumer group because a rebalance can move a partition in the middle of a batch
whose gradients are not applied yet, which breaks the consistent cut a checkpoint needs
(§7); with static assignment a restarted replica takes exactly its partitions back and
resumes at the checkpoint's offsets. :class:`SampleConsumer` therefore never subscribes
or joins a group (there is no option to), and ``group_id`` only *records* offsets when a
checkpoint calls :meth:`SampleConsumer.commit`: the checkpoint manifest is the source of
truth, the group's committed offsets are a courtesy for lag monitors. Nothing commits by
timer.

Samples topic records (written by :class:`BatchProducer`)::

    key     batch id as UTF-8 text (or absent)
    value   PersiaBatch.to_bytes()  (stream_persia.core.wire format, DESIGN §5)

Dead-letter records (``<samples topic>.dlq``, written by :class:`DeadLetterWriter`)::

    key     the original key
    value   the original bytes, unchanged
    headers persia-reason (UTF-8, at most 4 KiB), persia-source-topic,
            persia-source-partition, persia-source-offset (decimal text),
            persia-error-kind (only when known, e.g. "wire")

Brokers must accept messages of ``max_message_bytes`` (topic ``max.message.bytes``);
batches can be megabytes. snappy, lz4 and zstd compression come from ``cramjam`` (a
dependency); gzip runs at aiokafka's level 9 and is far slower.
Quirks of the test broker are listed in :mod:`stream_persia.testing.kafka_mock`.

No silent loss: offsets the broker no longer has (retention, gaps, truncation) stop the
partition by default, or are counted when ``kafka.on_data_loss: skip`` accepts them
(:mod:`~stream_persia.kafka.loss`); so does a restore onto the topic deleted and created
again (:mod:`~stream_persia.kafka.fingerprint`), or under a running consumer (checked
after long pauses, out-of-range answers, broker outages and metadata without the topic or
with another leader, and every ``recheck_every_s`` of reading). Partitions added to the topic while it is
read are adopted by their ``p mod W`` owner from offset 0; only committed records are
read (``read_committed``). Clients wait for the brokers at start-up
(``kafka.startup_timeout_ms``) and fail with :class:`KafkaUnavailable` naming the
bootstrap servers once none answers for ``kafka.broker_timeout_ms``
(:mod:`~stream_persia.kafka.liveness`).

Modules: :mod:`~stream_persia.kafka.consumer` (the samples consumer),
:mod:`~stream_persia.kafka.producer` (the samples producer),
:mod:`~stream_persia.kafka.dlq` (the dead-letter topic),
:mod:`~stream_persia.kafka.loss` (data loss), :mod:`~stream_persia.kafka.fingerprint`
(which topic a checkpoint's offsets are of), :mod:`~stream_persia.kafka.liveness`
(reaching the brokers) and ``_client`` (addresses, topic names and partitions, the
producer factory); import from this package.
"""

from stream_persia.kafka._client import (
    COMPRESSION_TYPES,
    DEFAULT_FETCH_MAX_WAIT_MS,
    DEFAULT_MAX_MESSAGE_BYTES,
    create_producer,
    partitions_for_replica,
    topic_partitions,
    validate_topic,
)
from stream_persia.kafka.consumer import SampleConsumer
from stream_persia.kafka.dlq import DeadLetter, DeadLetterWriter, parse_dead_letter
from stream_persia.kafka.liveness import KafkaUnavailable
from stream_persia.kafka.loss import DataLoss, KafkaDataLoss
from stream_persia.kafka.probe import TailProbe
from stream_persia.kafka.producer import BatchProducer

__all__ = [
    "DEFAULT_FETCH_MAX_WAIT_MS", "DEFAULT_MAX_MESSAGE_BYTES", "COMPRESSION_TYPES",
    "partitions_for_replica", "topic_partitions",
    "validate_topic", "create_producer", "SampleConsumer", "BatchProducer", "TailProbe",
    "DeadLetterWriter", "DeadLetter", "parse_dead_letter",
    "KafkaUnavailable", "KafkaDataLoss", "DataLoss",
]
