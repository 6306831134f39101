"""Restore equals uninterrupted (DESIGN §7), with every role a real process.

Deterministic mode (one partition, staleness 1, reproducible): an uninterrupted run trains
N batches. A second run trains from the same stream, checkpoints after batch k, keeps
going, and then every process (embedding server, embedding worker, NN worker) is killed
with SIGKILL. Fresh processes restore the checkpoint and finish. The final dense
parameters and every embedding row (weights and optimizer state) equal the uninterrupted
run's within 1e-6, and every batch was trained exactly once.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from stream_persia.testing.roles import KafkaRoles, assert_same_training, fill_topic

HERE = Path(__file__).resolve().parent
N, K = 12, 5


class Job(KafkaRoles):
    """One embedding server and one embedding worker (Kafka ingest) as processes."""

    def nn(self, out: Path, *flags: str) -> subprocess.Popen:
        return subprocess.Popen([sys.executable, str(HERE / "restore_train.py"),
                                 self.worker.address, str(out), "--batches", *flags],
                                start_new_session=True)



def _finish(proc: subprocess.Popen, timeout: float = 120) -> None:
    assert proc.wait(timeout) == 0, "NN worker failed"


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_restore_equals_uninterrupted(tmp_path, kafka_broker, kafka_topic):
    topic = kafka_topic(1)
    kafka_broker.create_topic(f"{topic}.dlq", 1)
    fill_topic(kafka_broker.bootstrap_servers, topic, N, seed=3)

    # 1. Uninterrupted: N batches.
    full = Job(tmp_path, "full", kafka_broker.bootstrap_servers, topic)
    try:
        _finish(full.nn(tmp_path / "full", str(N)))
        full_rows = full.rows(tmp_path / "full-dump")
    finally:
        full.worker.stop()
        full.server.stop()

    # 2. Checkpoint after batch K, train on, then kill every process.
    ck = tmp_path / "ck"
    part = Job(tmp_path, "part", kafka_broker.bootstrap_servers, topic)
    nn = part.nn(tmp_path / "part", str(N + 100), "--checkpoint-at", str(K), "--ckpt", str(ck))
    deadline = time.monotonic() + 120
    while not (tmp_path / "part" / "checkpointed").exists():
        assert nn.poll() is None and time.monotonic() < deadline, "no checkpoint was taken"
        time.sleep(0.05)
    while len(json.loads((tmp_path / "part" / "metas.json").read_text())) < K + 2:
        time.sleep(0.05)          # trained past the cut: that work must not survive
    nn.kill()
    nn.wait()
    part.kill()

    # 3. Fresh processes restore the checkpoint and finish the N batches.
    rest = Job(tmp_path, "rest", kafka_broker.bootstrap_servers, topic)
    try:
        _finish(rest.nn(tmp_path / "rest", str(N - K), "--restore", str(ck)))
        rest_rows = rest.rows(tmp_path / "rest-dump")
    finally:
        rest.worker.stop()
        rest.server.stop()

    full_metas = json.loads((tmp_path / "full" / "metas.json").read_text())
    part_metas = json.loads((tmp_path / "part" / "metas.json").read_text())[:K]
    rest_metas = json.loads((tmp_path / "rest" / "metas.json").read_text())
    assert full_metas == [f"batch-{i}" for i in range(N)]
    assert part_metas + rest_metas == full_metas, "every batch trained exactly once"

    assert len(full_rows) > 100
    assert_same_training(tmp_path / "full" / "dense.pt", tmp_path / "rest" / "dense.pt",
                         full_rows, rest_rows)
