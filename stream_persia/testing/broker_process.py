"""What the test brokers run as child processes share (:class:`~stream_persia.testing.
kafka_mock.MockKafkaCluster`, :class:`~stream_persia.testing.tansu.TansuBroker`): the
process and its bootstrap address, kill as a crash would, and use as a context manager.
A subclass sets ``_proc`` and ``_bootstrap`` in ``start()`` and clears them in ``stop()``."""

from __future__ import annotations

import subprocess
from typing import Self

from stream_persia.errors import Misuse

__all__ = ["BrokerProcess"]


class BrokerProcess:
    #: what :attr:`bootstrap_servers`' error calls the broker
    WHAT = "the Kafka test broker"

    def __init__(self) -> None:
        self._proc: subprocess.Popen[bytes] | None = None
        self._bootstrap: str | None = None

    def start(self) -> Self:
        raise NotImplementedError

    def stop(self) -> None:
        raise NotImplementedError

    def kill(self) -> None:
        """SIGKILL the broker, as a crash would (no more answers, no shutdown: a graceful
        :meth:`stop` may tear partitions down first and answer a last fetch with
        OFFSET_OUT_OF_RANGE), then reap it; its data is gone."""
        if self._proc is not None and self._proc.poll() is None:
            self._proc.kill()
            self._proc.wait()
        self.stop()

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    @property
    def bootstrap_servers(self) -> str:
        """``host:port[,host:port...]`` of the broker, on 127.0.0.1."""
        if self._bootstrap is None or self._proc is None:
            raise Misuse(f"{self.WHAT} is not running", hint="call start() first")
        return self._bootstrap

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    def is_running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None
