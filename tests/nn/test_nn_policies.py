"""The NN rank 0 sends the job file's table policies (issue 20) with the configuration it
gives the embedding servers, so servers restarted mid-job get them back from it
(``on_server_restart: continue``)."""

from __future__ import annotations

import torch
import yaml
from test_nn_train import LR, TwoSlotLoss

from stream_persia.ctx import TrainCtx
from stream_persia.data import DataLoader, StreamingDataset
from stream_persia.embedding import EmbeddingConfig
from stream_persia.embedding.optim import SGD
from stream_persia.testing.samples import SCHEMA, make_batch


def test_the_nn_sends_the_files_policies_and_restarted_servers_get_them_back(
        job_factory, tmp_path, monkeypatch):
    d = SCHEMA.to_dict()
    d["slots_config"]["user"]["min_count"] = 2
    path = tmp_path / "embedding_config.yml"
    path.write_text(yaml.safe_dump(d, sort_keys=False))
    monkeypatch.setenv("PERSIA_EMBEDDING_CONFIG", str(path))
    job = job_factory(SCHEMA, on_server_restart="continue")
    model = TwoSlotLoss()
    with TrainCtx(SGD(lr=LR), torch.optim.SGD(model.parameters(), lr=0.1), model=model,
                  embedding_workers=job.worker_addresses, mixed_precision=False,
                  embedding_config=EmbeddingConfig((-0.001, 0.001)), ready_timeout_s=10) as ctx:
        want = ctx.cluster.server_config
        assert want["policies"]["policies"][1]["min_count"] == 2
        assert want["policies"]["names"] == [None, "user", "item", "tags"]
        job.restart_all()
        job.feed([make_batch(0, batch_size=16)], background=False)
        for tb in DataLoader(StreamingDataset(), embedding_staleness=1, max_batches=1):
            output, _ = ctx.forward(tb)
            ctx.backward(output)
    stats = job.servers[0].store.policy_stats()
    assert stats[1]["rejected"] > 0     # user ids seen once: no row yet
