"""Resharding on restore: a checkpoint from S embedding servers loads into S' servers.

The issue's test: a checkpoint from 2 servers loads into 3 and evaluation gives the same
predictions. Rows are trained through a real embedding worker (Adagrad on the servers),
and predictions come from the worker's eval ``lookup_batch`` plus a small torch model whose
weights travel in the checkpoint as ``dense.pt``.

Every row and optimizer state is restored bit for bit. Predictions agree to float32
rounding, not bit for bit: summation slots are pooled on the servers, and the worker adds
the servers' partial sums, so the order of the additions depends on how many servers own
a sample's ids (stream_persia.worker.batchplan).
"""

from __future__ import annotations

import asyncio
import contextlib

import numpy as np
import pytest
import torch

from stream_persia import checkpoint as ck
from stream_persia.checkpoint import CheckpointWriter
from stream_persia.embedding.optim import Adagrad
from stream_persia.kernels.sharding import shard_of
from stream_persia.rpc import RpcClient
from stream_persia.testing.samples import SCHEMA, make_batch
from stream_persia.testing.servers import running_servers
from stream_persia.worker.service import EmbeddingWorker


@contextlib.asynccontextmanager
async def cluster(n: int):
    """n embedding servers and one embedding worker over them, in this process."""
    async with running_servers(n, Adagrad(lr=0.05)) as (servers, router):
        worker = EmbeddingWorker(SCHEMA, [s.address for s in servers])
        await worker.start()
        client = RpcClient(worker.address, timeout_ms=5000)
        try:
            yield servers, client, router
        finally:
            await client.close()
            await worker.stop()


async def train(client: RpcClient, batches: int) -> None:
    rng = np.random.default_rng(3)
    for i in range(batches):
        await client.call("ingest", {"batch": make_batch(i).to_wire()})
        served = await client.call("next_batch", {"timeout_ms": 2000})
        grads = {e["name"]: rng.normal(size=e["emb"].shape).astype(np.float32)
                 for e in served["embeddings"]}
        await client.call("push_gradients", {"batch_id": served["batch_id"], "grads": grads})


class TinyModel(torch.nn.Module):
    """Pooled embeddings of every slot + dense features → click probability."""

    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(8 + 8 + 4 + 3, 1)

    def forward(self, served: dict) -> torch.Tensor:
        parts = []
        for e in served["embeddings"]:
            emb = torch.from_numpy(np.array(e["emb"]))
            if e["kind"] == "raw":
                mask = torch.from_numpy(np.array(e["mask"])).unsqueeze(-1)
                emb = (emb[torch.from_numpy(np.array(e["index"]))] * mask).sum(1)
            parts.append(emb)
        parts.append(torch.from_numpy(np.array(served["non_id_type_features"][0]["data"])))
        return torch.sigmoid(self.linear(torch.cat(parts, dim=1)))


async def predictions(client: RpcClient, model: TinyModel) -> list[np.ndarray]:
    out = []
    for i in range(6):   # ids seen in training and (vocab 80 > 50) ids never seen
        batch = make_batch(100 + i, requires_grad=False, vocab=80)
        served = await client.call("lookup_batch", {"batch": batch.to_wire(), "mode": "eval"})
        assert [e["name"] for e in served["embeddings"]] == ["user", "item", "tags"]
        with torch.no_grad():
            out.append(model(served).numpy())
    return out


def rows_by_id(servers) -> dict[int, tuple[np.ndarray, np.ndarray]]:
    """id → (weights, optimizer state) over every server; each id on exactly one server."""
    out = {}
    for s in servers:
        for chunk in s.store.dump():
            for i, key in enumerate(chunk["ids"].tolist()):
                assert key not in out, f"id {key} is on more than one server"
                out[key] = (chunk["weights"][i], chunk["state"][i])
    return out


def assert_each_id_on_its_owner(servers) -> None:
    n = len(servers)
    for j, s in enumerate(servers):
        for chunk in s.store.dump():
            assert (shard_of(chunk["ids"], n) == j).all(), f"server {j} holds ids it does not own"


async def test_checkpoint_from_2_servers_loads_into_3_with_same_predictions(tmp_path):
    dst = str(tmp_path / "step-8")
    torch.manual_seed(0)
    model = TinyModel()
    async with cluster(2) as (servers2, client2, router2):
        await asyncio.wait_for(train(client2, 8), 30)
        expected = await predictions(client2, model)
        rows2 = rows_by_id(servers2)
        with CheckpointWriter(dst) as w:
            w.write_torch(ck.DENSE_FILENAME, model.state_dict())
            await w.dump_embeddings(router2.clients)
            manifest = w.commit(job="reshard", step=8, offsets={}, stream="direct")
        assert manifest.shard_count == 2

        async with cluster(3) as (servers3, client3, router3):
            empty = await predictions(client3, model)
            assert not all(np.array_equal(a, b) for a, b in zip(empty, expected, strict=True))
            loaded = await asyncio.wait_for(ck.load_embeddings(dst, router3.clients), 30)
            assert loaded == len(rows2) == manifest.rows
            assert_each_id_on_its_owner(servers3)
            assert all(len(s.store) for s in servers3), "rows spread over all 3 servers"
            rows3 = rows_by_id(servers3)
            assert rows3.keys() == rows2.keys()
            for key, (w2, s2) in rows2.items():
                np.testing.assert_array_equal(rows3[key][0], w2)
                np.testing.assert_array_equal(rows3[key][1], s2)

            restored = TinyModel()
            restored.load_state_dict(ck.load_torch(dst, manifest.dense_filename))
            got = await predictions(client3, restored)
            for a, b in zip(got, expected, strict=True):
                np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)
            # The servers still train after a restore: updates land on the new owners.
            await asyncio.wait_for(train(client3, 1), 30)
            assert_each_id_on_its_owner(servers3)


@pytest.mark.parametrize("src_n, dst_n", [(3, 2), (2, 1), (1, 4)])
async def test_reshard_any_count(tmp_path, src_n, dst_n):
    dst = str(tmp_path / "c")
    async with cluster(src_n) as (servers, client, router):
        await asyncio.wait_for(train(client, 3), 30)
        rows = rows_by_id(servers)
        with CheckpointWriter(dst) as w:
            await w.dump_embeddings(router.clients)
            w.commit(job="j", step=3, offsets={}, stream="direct")
    async with cluster(dst_n) as (servers, client, router):
        assert await asyncio.wait_for(ck.load_embeddings(dst, router.clients), 30) == len(rows)
        assert_each_id_on_its_owner(servers)
        got = rows_by_id(servers)
        assert got.keys() == rows.keys()
        for key, (w, s) in rows.items():
            np.testing.assert_array_equal(got[key][0], w)
            np.testing.assert_array_equal(got[key][1], s)
