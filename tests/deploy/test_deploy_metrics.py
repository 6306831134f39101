"""Every metric deploy/'s alert rules and dashboard name is exported by a running job.

A short ``stream-persia run`` through the Kafka test broker starts every role as a real
process (embedding servers and workers consuming Kafka, the API, an NN rank, data
loaders, and a serving replica that follows the update stream); after training it saves
the API's ``/metrics`` (which relays every worker's and server's) and the replica's
(``metrics/*.prom`` in its output directory). Each name a rule or a panel uses must be a
sample of one of them: a renamed metric or a typo in a rule would otherwise stay silent
until the day it should have fired.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from monitoring import REPO, family, used_metric_names
from prometheus_client.parser import text_string_to_metric_families

pytestmark = pytest.mark.kafka


def scraped_names(out: Path) -> dict[str, set[str]]:
    """Sample and family names in each saved scrape of the run -> which process had it."""
    where: dict[str, set[str]] = {}
    for prom in sorted((out / "metrics").glob("*.prom")):
        for fam in text_string_to_metric_families(prom.read_text()):
            for name in {fam.name, *(s.name for s in fam.samples)}:
                where.setdefault(name, set()).add(prom.stem)
    return where


def _with_periodic_checkpoints(tmp_path: Path) -> Path:
    """synthetic_ctr with periodic checkpoints on, so their metrics are exported too."""
    topologies = tmp_path / "topologies"
    shutil.copytree(REPO / "topologies", topologies,
                    ignore=shutil.ignore_patterns("__pycache__", "*.png"))
    path = topologies / "synthetic_ctr" / "global_config.yml"
    data = yaml.safe_load(path.read_text())
    data["common_config"]["checkpointing_config"] = {"every_steps": 2}
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return topologies / "synthetic_ctr"


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_every_metric_named_by_an_alert_or_panel_is_exported(tmp_path, kafka_broker,
                                                             kafka_topic):
    topic = kafka_topic(2)
    cmd = [sys.executable, "-m", "stream_persia.launch.cli", "run",
           str(_with_periodic_checkpoints(tmp_path)),
           "--output-dir", str(tmp_path), "--samples", "4096", "--eval-samples", "1024",
           "--predict-samples", "256", "--no-gates", "--embedding-workers", "2",
           "--kafka", kafka_broker.bootstrap_servers, "--topic", topic]
    env = {k: v for k, v in os.environ.items() if k != "KAFKA_BOOTSTRAP_SERVERS"}
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=280,
                          env=env)
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stderr[-6000:]}"
    scraped = scraped_names(tmp_path)
    # Both API processes answered: the control plane and the serving replica.
    assert {"api", "replica"} <= {p for ps in scraped.values() for p in ps}, scraped
    assert "persia_api_freshness_seconds_bucket" in scraped, "the replica's scrape is empty"
    missing = {name: sorted(where) for name, where in sorted(used_metric_names().items())
               if name not in scraped and family(name) not in scraped}
    assert not missing, (
        f"{len(missing)} metric(s) that deploy/prometheus/alerts.yml or "
        f"deploy/grafana/stream-persia.json use are exported by no role of a running "
        f"job:\n" + "\n".join(f"  {n}: used by {', '.join(w)}" for n, w in missing.items()))
