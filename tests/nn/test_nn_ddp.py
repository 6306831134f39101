"""Two NN ranks with DDP (gloo, two CPU processes via ``stream-persia launch nn-worker``).

Both ranks pull from the same embedding worker; their dense parameters must be identical
after training, both take the same number of steps (they agree to stop when the stream
runs dry), and no batch is left in flight.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from nn_helpers import LEARNABLE_SCHEMA, learnable_batches

from stream_persia.checkpoint import list_checkpoints
from stream_persia.errors import ConfigError
from stream_persia.launch.roles import nn_worker_command

HERE = Path(__file__).resolve().parent


def test_two_ranks_keep_identical_dense_parameters(job_factory, tmp_path):
    job = job_factory(LEARNABLE_SCHEMA)
    fed = 41     # odd: one rank would get one batch more without the stop agreement
    feeder = job.feed(learnable_batches(fed, 64))
    # periodic checkpoints every 4 steps (issue 21): rank 0 decides, both ranks take the cut
    # at the same step (a rank out of step would hang or fail the collectives)
    ckpts = tmp_path / "periodic"
    (tmp_path / "global_config.yml").write_text(
        f"common_config:\n  checkpointing_config:\n    every_steps: 4\n"
        f"    keep_checkpoints: 0\n    periodic_dir: {ckpts}\n")
    env = {**os.environ, "PERSIA_EMBEDDING_WORKERS": ",".join(job.worker_addresses),
           "PERSIA_NN_WORKER_ENTRY": str(HERE / "ddp_train.py"),
           "PERSIA_GLOBAL_CONFIG": str(tmp_path / "global_config.yml"),
           "PYTHONPATH": os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run(
        [sys.executable, "-m", "stream_persia.launch.cli", "launch", "nn-worker",
         "--nproc-per-node", "2", "--nnodes", "1", "--node-rank", "0", "--", str(tmp_path)],
        env=env, capture_output=True, text=True, timeout=100)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    feeder.join(10)
    stats = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    dense = [torch.load(tmp_path / f"rank{r}.pt") for r in (0, 1)]
    assert stats[0]["steps"] == stats[1]["steps"] >= 10
    assert dense[0].keys() == dense[1].keys()
    for k in dense[0]:
        assert torch.equal(dense[0][k], dense[1][k]), k
    worker = job.workers[0]
    assert len(worker.inflight) == 0
    trained = stats[0]["steps"] + stats[1]["steps"]
    assert trained + len(worker.ready) == fed, "every batch trained once or back in line"
    # progressive validation merged both ranks' samples, the same on each rank
    scored = np.concatenate([np.load(tmp_path / f"scored{r}.npy") for r in (0, 1)])
    p, y = scored[:, 0], scored[:, 1]
    prog = stats[0]["progressive"]["task0"]
    assert stats[1]["progressive"] == stats[0]["progressive"]
    assert prog["samples"] == prog["window_samples"] == trained * 64 == len(p)
    pos, neg = p[y == 1][:, None], p[y == 0][None, :]
    assert prog["auc"] == pytest.approx(((pos > neg) + 0.5 * (pos == neg)).mean(), rel=1e-6)
    taken = sorted(m.step for m in list_checkpoints(str(ckpts)))
    assert taken == list(range(4, stats[0]["steps"] + 1, 4)), taken
    assert all(m.extra["world_size"] == 2 for m in list_checkpoints(str(ckpts)))


def _args(**kw) -> argparse.Namespace:
    base = {"entry": str(HERE / "ddp_train.py"), "nproc_per_node": 2, "nnodes": 1,
            "node_rank": 0, "master_addr": "127.0.0.1", "master_port": 0, "script_args": []}
    return argparse.Namespace(**{**base, **kw})


def test_launcher_builds_a_torchrun_command():
    cmd = nn_worker_command(_args(script_args=["out"]))
    assert cmd[1:3] == ["-m", "stream_persia.launch.torchrun"]
    assert "--nproc-per-node=2" in cmd and "--nnodes=1" in cmd and "--node-rank=0" in cmd
    assert any(a.startswith("--master-port=") and int(a.split("=")[1]) > 0 for a in cmd)
    assert cmd[-2:] == [str(HERE / "ddp_train.py"), "out"]


@pytest.mark.parametrize("kw,field", [
    ({"entry": None}, "PERSIA_NN_WORKER_ENTRY"),
    ({"entry": "/no/such/train.py"}, "PERSIA_NN_WORKER_ENTRY"),
    ({"nnodes": 2, "node_rank": 1}, "--master-port"),
    ({"nnodes": 2, "node_rank": 2, "master_port": 29500}, "--node-rank"),
    ({"nproc_per_node": 0}, "--nproc-per-node"),
])
def test_launcher_refuses_bad_settings(kw, field):
    with pytest.raises(ConfigError) as err:
        nn_worker_command(_args(**kw))
    assert err.value.field == field


def test_launcher_takes_the_entry_from_the_environment(monkeypatch):
    from stream_persia.launch.cli import build_parser

    monkeypatch.setenv("PERSIA_NN_WORKER_ENTRY", "/somewhere/train.py")
    args = build_parser().parse_args(["launch", "nn-worker", "--nproc-per-node", "3"])
    assert args.entry == "/somewhere/train.py" and args.nproc_per_node == 3
