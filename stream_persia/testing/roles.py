"""Role processes for tests: the job most process-level tests start, an embedding server and
an embedding worker that reads one Kafka topic, each a process of its own
(:class:`KafkaRoles`); and :func:`running`, any set of role processes for one block."""

from __future__ import annotations

import contextlib
import os
import signal
from collections.abc import Iterator, Sequence
from pathlib import Path

import numpy as np

from stream_persia.config import GlobalConfig, KafkaConfig
from stream_persia.ctx import DataCtx
from stream_persia.errors import Misuse
from stream_persia.launch.processes import RoleProcess
from stream_persia.testing.samples import EMBEDDING_YAML, make_batch
from stream_persia.testing.servers import dumped_rows

__all__ = ["KafkaRoles", "assert_same_training", "fill_topic", "running", "start_server"]


@contextlib.contextmanager
def running(procs: Sequence[RoleProcess], ready_s: float = 60) -> Iterator[list[RoleProcess]]:
    """Start every process, wait until each is ready, and stop them all when the block
    ends (one a test froze with SIGSTOP is continued first, so that it can stop)."""
    try:
        for p in procs:
            p.start()
        for p in procs:
            p.wait_ready(ready_s)
        yield list(procs)
    finally:
        for p in procs:
            if p.proc is not None and p.alive():
                os.kill(p.proc.pid, signal.SIGCONT)
            p.stop()


def fill_topic(bootstrap: str, topic: str, n: int, seed: int) -> None:
    """Send ``n`` test batches (:func:`~stream_persia.testing.samples.make_batch` ``i`` of
    ``seed``) to ``topic``, one at a time, so that they land in order."""
    with DataCtx(kafka_bootstrap_servers=bootstrap,
                 global_config=GlobalConfig(kafka=KafkaConfig(samples_topic=topic)),
                 max_inflight=1) as dc:
        for i in range(n):
            dc.send_data(make_batch(i, seed=seed))


def start_server(tmp: Path, name: str, port: str | None = None,
                 args: Sequence[str] = ()) -> RoleProcess:
    """An embedding server process whose checkpoint root is ``tmp`` (on ``port``: a restart
    at the same address), with more CLI ``args`` (``--replica-index``, ...) if given."""
    return RoleProcess("embedding-server", ["--checkpoint-root", str(tmp),
                                            *(["--port", port] if port else []), *args],
                       log_path=tmp / f"{name}.log", name=name).start()


class KafkaRoles:
    """An embedding server and an embedding worker reading partition 0 of ``topic``, both
    ready when the constructor returns. Configs and logs go to ``tmp`` (``<name>-server.log``,
    ``<name>-worker.log``), which is also the server's checkpoint root.

    Args:
        server: a server process already running, to use instead of a new one (it outlives
            these roles: :meth:`stop` stops it too, as it does its own).
        global_yaml: the worker's global config (``--global-config``), if any.
    """

    def __init__(self, tmp: Path, name: str, bootstrap: str, topic: str, *,
                 server: RoleProcess | None = None, global_yaml: str | None = None):
        self.tmp, self.name = tmp, name
        self.bootstrap, self.topic = bootstrap, topic
        (tmp / "embedding_config.yml").write_text(EMBEDDING_YAML)
        self._global = None
        if global_yaml is not None:
            self._global = tmp / "global_config.yml"
            self._global.write_text(global_yaml)
        self.server = server if server is not None else start_server(tmp, f"{name}-server")
        self.server.wait_ready()
        self.worker = self.start_worker(f"{name}-worker")
        self.worker.wait_ready()

    def start_worker(self, name: str, port: str | None = None) -> RoleProcess:
        """A worker process of this job (on ``port``: a restart at its address)."""
        return RoleProcess("embedding-worker", [
            "--embedding-config", str(self.tmp / "embedding_config.yml"),
            *(["--global-config", str(self._global)] if self._global else []),
            "--embedding-servers", self.server.wait_ready(), "--kafka", self.bootstrap,
            "--topic", self.topic, "--num-partitions", "1",
            *(["--port", port] if port else [])],
            log_path=self.tmp / f"{name}.log", name=name).start()

    def rows(self, dump_dir: Path | None = None) -> dict[int, tuple[np.ndarray, np.ndarray]]:
        """Every row of the server, dumped into ``dump_dir`` (default ``<tmp>/<name>-dump``):
        id -> (weights, optimizer state)."""
        address = self.server.address
        if address is None:   # set by wait_ready, which __init__ calls
            raise Misuse(f"{self.server.name} has no address yet", hint="wait_ready() first")
        return dumped_rows(address, str(dump_dir or self.tmp / f"{self.name}-dump"))

    def stop(self) -> None:
        self.worker.stop()
        self.server.stop()

    def kill(self) -> None:
        self.worker.kill()
        self.server.kill()


def assert_same_training(expected_dense: Path, dense: Path,
                         expected_rows: dict[int, tuple[np.ndarray, np.ndarray]],
                         rows: dict[int, tuple[np.ndarray, np.ndarray]]) -> None:
    """Two runs trained the same model: their saved dense ``state_dict`` files and every
    embedding row (weights and optimizer state, :meth:`KafkaRoles.rows`) equal within
    1e-6, and they hold the same ids."""
    import torch

    want, got = torch.load(expected_dense), torch.load(dense)
    for name, value in want.items():
        torch.testing.assert_close(got[name], value, atol=1e-6, rtol=0)
    assert set(rows) == set(expected_rows)
    for x, (w, s) in expected_rows.items():
        np.testing.assert_allclose(rows[x][0], w, atol=1e-6, rtol=0)
        np.testing.assert_allclose(rows[x][1], s, atol=1e-6, rtol=0)
