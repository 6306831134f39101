"""A real Kafka broker named by address: topics made by the admin client (the
``kafka_broker`` fixture's ``KAFKA_BOOTSTRAP_SERVERS`` mode, and the way
:class:`~stream_persia.testing.tansu.TansuBroker` creates topics)."""

from __future__ import annotations

import asyncio
import os
import threading

from stream_persia.errors import ConfigError, RemoteError

__all__ = ["ExternalKafka"]


class ExternalKafka:
    """A real broker named by ``KAFKA_BOOTSTRAP_SERVERS``; topics via the admin client.

    ``create_topic`` is idempotent: an existing topic with at least the asked partitions
    is accepted as is. It blocks (runs aiokafka on its own thread and loop) so that sync
    and async tests can call it alike.
    """

    def __init__(self, bootstrap_servers: str, *, replication_factor: int | None = None,
                 timeout_s: float = 30.0):
        self.bootstrap_servers = bootstrap_servers
        self.replication_factor = replication_factor or int(
            os.environ.get("KAFKA_TEST_REPLICATION_FACTOR", "1"))
        self.timeout_s = timeout_s

    def create_topic(self, name: str, partitions: int) -> bool:
        result: list[bool] = []
        errors: list[BaseException] = []

        def run() -> None:
            try:
                result.append(asyncio.run(asyncio.wait_for(
                    self._create(name, partitions), self.timeout_s)))
            except BaseException as e:  # re-raised on the caller's thread
                errors.append(e)

        # A thread of its own: the caller may be inside (or between steps of) an event
        # loop that asyncio.run must not replace.
        thread = threading.Thread(target=run, name=f"create-topic-{name}")
        thread.start()
        thread.join()
        if errors:
            raise errors[0]
        return result[0]

    async def _create(self, name: str, partitions: int) -> bool:
        from aiokafka.admin import AIOKafkaAdminClient, NewTopic

        from stream_persia.kafka import topic_partitions

        existing = await topic_partitions(self.bootstrap_servers, name)
        if existing:
            if existing < partitions:
                raise ConfigError(f"topic {name!r} exists with {existing} partitions, "
                                  f"fewer than {partitions}", field="partitions")
            return False
        admin = AIOKafkaAdminClient(bootstrap_servers=self.bootstrap_servers)
        await admin.start()
        try:
            response = await admin.create_topics(
                [NewTopic(name, partitions, self.replication_factor)])
        except Exception as e:
            raise RemoteError(f"CreateTopics {name!r} failed at {self.bootstrap_servers}: "
                              f"{e!r}", hint="the broker must support the admin API") from e
        finally:
            await admin.close()
        for entry in response.topic_errors:
            code = entry[1]
            if code not in (0, 36):  # 36 = TOPIC_ALREADY_EXISTS (a concurrent creator)
                raise RemoteError(f"CreateTopics {name!r} failed with error code {code}: "
                                  f"{entry[2] if len(entry) > 2 else ''}")
        while await topic_partitions(self.bootstrap_servers, name) < partitions:  # metadata propagates lazily
            await asyncio.sleep(0.1)
        return True
