"""The samples topic of a Kafka run (``stream-persia run --kafka``): check it, or create it."""

from __future__ import annotations

import asyncio
import sys

from stream_persia.errors import ConfigError

__all__ = ["check_idempotence", "ensure_topic", "ensure_updates_topic"]


def ensure_topic(bootstrap: str, topic: str, partitions: int, *, create: bool,
                 min_partitions: int = 1) -> int:
    """Check the samples topic exists and has at least ``min_partitions`` partitions (one
    per embedding worker); returns its partitions.

    With ``create``, a missing topic is created with ``partitions`` partitions by the
    admin client; where the broker has no working admin API (the librdkafka mock: its
    metadata names no controller), it is asked for the topic by name instead, which
    brokers with ``auto.create.topics.enable`` (the default, and the mock) answer by
    creating it with their default partition count.

    Raises:
        ConfigError: naming ``--topic`` (missing, or not creatable) or ``--partitions``
            (too few partitions for the embedding workers).
    """
    from stream_persia.core import aio
    from stream_persia.kafka import topic_partitions

    async def admin_create() -> None:
        from aiokafka.admin import AIOKafkaAdminClient, NewTopic

        admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap, request_timeout_ms=10_000)
        await admin.start()
        try:
            await admin.create_topics([NewTopic(topic, partitions, 1)])
        finally:
            await admin.close()

    async def auto_create() -> int:
        from aiokafka import AIOKafkaProducer

        producer = AIOKafkaProducer(bootstrap_servers=bootstrap, request_timeout_ms=10_000)
        await producer.start()
        try:
            return len(await producer.partitions_for(topic))
        finally:
            await producer.stop()

    async def go() -> int:
        found = await topic_partitions(bootstrap, topic)
        if found or not create:
            return found
        try:
            await admin_create()
        except Exception as admin_error:   # the mock fails inside aiokafka (AttributeError)
            print(f"stream-persia run: creating topic {topic!r} with the admin client failed "
                  f"({type(admin_error).__name__}: {admin_error}); asking the broker to "
                  "auto-create it", file=sys.stderr)
            try:
                found = await auto_create()
            except Exception as e:
                raise ConfigError(
                    f"cannot create topic {topic!r} on {bootstrap}: the admin client failed "
                    f"({type(admin_error).__name__}: {admin_error}) and the broker did not "
                    f"auto-create it ({type(e).__name__}: {e})", field="--topic",
                    hint=f"create it with {partitions} partitions (e.g. kafka-topics.sh "
                         f"--create --topic {topic} --partitions {partitions}) and pass "
                         f"--topic {topic}") from None
            if found != partitions:
                print(f"stream-persia run: the broker created {topic!r} with {found} "
                      f"partitions (its default), not {partitions}", file=sys.stderr)
            return found
        for _ in range(100):   # metadata propagates lazily
            if found := await topic_partitions(bootstrap, topic):
                return found
            await asyncio.sleep(0.1)
        return 0

    found = aio.run(go())
    if not found:
        raise ConfigError(f"topic {topic!r} does not exist on {bootstrap}", field="--topic",
                          hint="create it, or leave --topic out to have a fresh one created")
    if found < min_partitions:
        raise ConfigError(f"topic {topic!r} has {found} partitions, fewer than the "
                          f"{min_partitions} embedding workers", field="--partitions",
                          hint=f"use a topic with at least {min_partitions} partitions, or "
                               "fewer --embedding-workers")
    return found


def ensure_updates_topic(bootstrap: str, global_config: str, servers: int) -> int:
    """The model update stream's topic (``<kafka.job_name>.model.updates``): a partition
    per embedding server plus the dense model's (:mod:`stream_persia.kafka.updates`),
    created when missing; the servers check it when they start."""
    from stream_persia.config import load_global_config
    from stream_persia.kafka.updates import updates_topic

    job_name = load_global_config(global_config).kafka.job_name
    return ensure_topic(bootstrap, updates_topic(job_name), servers + 1, create=True,
                        min_partitions=servers + 1)


def check_idempotence(bootstrap: str, global_config: str) -> None:
    """Start (and stop) one producer as the roles will (idempotent unless the run's
    ``global_config`` or ``KAFKA_ENABLE_IDEMPOTENCE`` turns it off), so that a broker
    refusing idempotent producers stops the run before any role starts, naming the flag
    that turns idempotence off.

    Raises:
        ConfigError: naming ``--no-kafka-idempotence`` when the broker refused it.
    """
    from stream_persia.config import load_global_config
    from stream_persia.config.kafka import resolve_idempotence
    from stream_persia.core import aio
    from stream_persia.kafka import create_producer
    from stream_persia.kafka.liveness import stop_client

    enabled = resolve_idempotence(load_global_config(global_config))

    async def go() -> None:
        producer = await create_producer(bootstrap, enable_idempotence=enabled,
                                         startup_timeout_s=10.0, client_id="stream-persia-run")
        await stop_client(producer)

    try:
        aio.run(go())
    except ConfigError as e:
        if e.field != "kafka.enable_idempotence":
            raise
        raise ConfigError(f"--kafka {bootstrap}: {e.message}", field="--no-kafka-idempotence",
                          hint="pass --no-kafka-idempotence to run with producers that are "
                               "not idempotent (a retried send may then write a batch "
                               "twice), or use a broker that supports them") from None
