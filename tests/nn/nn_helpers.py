"""Helpers for the NN-side tests: a job in this process, a learnable stream, a model.

The job's embedding servers and workers run on a loop thread of this process.

Real sockets on loopback, ports from the OS; batches go in through ``DataCtx``
(broker-less ingest RPC), exactly as a data loader sends them.
"""

from __future__ import annotations

import threading

import numpy as np
import torch

from stream_persia.config import EmbeddingSchema
from stream_persia.core.aio import LoopThread
from stream_persia.embedding.data import IDTypeFeature, Label, NonIDTypeFeature, PersiaBatch
from stream_persia.loader.data_ctx import DataCtx
from stream_persia.server.service import EmbeddingServer
from stream_persia.testing.servers import TEST_CHECKPOINT_ROOT, restarted
from stream_persia.worker.service import EmbeddingWorker

# Three summation slots with one id per sample: the label is a logistic function of hidden
# per-id weights, so an embedding model can learn it (AUC well above 0.5).
LEARNABLE_SCHEMA = EmbeddingSchema.from_dict({
    "feature_index_prefix_bit": 8,
    "slots_config": {"a": {"dim": 4}, "b": {"dim": 4}, "c": {"dim": 4}},
})
LEARNABLE_SLOTS = ("a", "b", "c")


class LocalJob:
    """Embedding servers and workers running on one loop thread of this process."""

    def __init__(self, schema: EmbeddingSchema, *, servers: int = 1, workers: int = 1,
                 capacity: int = 100_000, ready_buffer_batches: int = 16,
                 push_retry_ms: int = 20_000, on_server_restart: str = "fail",
                 model_updates: bool = True, model_update_interval_ms: int = 200):
        self.loop = LoopThread(name="test-job")
        self.servers: list[EmbeddingServer] = []
        self.workers: list[EmbeddingWorker] = []
        self.push_retry_ms = push_retry_ms
        self.on_server_restart = on_server_restart
        self.server_kw = {"model_updates": model_updates,
                          "model_update_interval_ms": model_update_interval_ms}
        self.loop.run(self._start(schema, servers, workers, capacity, ready_buffer_batches),
                      timeout=30)

    async def _start(self, schema, n_servers, n_workers, capacity, ready) -> None:
        for i in range(n_servers):
            s = EmbeddingServer(capacity, replica_index=i, replica_size=n_servers,
                                checkpoint_root=TEST_CHECKPOINT_ROOT, **self.server_kw)
            await s.start()
            self.servers.append(s)
        for i in range(n_workers):
            w = EmbeddingWorker(schema, [s.address for s in self.servers], replica_index=i,
                                replica_size=n_workers, ready_buffer_batches=ready,
                                push_retry_ms=self.push_retry_ms,
                                on_server_restart=self.on_server_restart,
                                checkpoint_root=TEST_CHECKPOINT_ROOT)
            await w.start()
            self.workers.append(w)

    def restart_server(self, i: int) -> None:
        """Replace server ``i`` by a fresh process at its address (kill -9 and a
        supervisor's restart: no rows, the defaults, another incarnation)."""
        async def restart() -> None:
            await self.servers[i].stop()
            fresh = restarted(self.servers[i])
            await fresh.start()
            self.servers[i] = fresh

        self.loop.run(restart(), timeout=30)

    def restart_all(self) -> None:
        """Replace every server and worker by a fresh one at the same address, as a
        supervisor restarting all of them at once would: the servers hold the defaults,
        the workers know nothing of the job's configuration."""
        self.loop.run(self._restart_all(), timeout=30)

    async def _restart_all(self) -> None:
        schema = self.workers[0].schema
        await self._stop()
        servers, workers = [], []
        for s in self.servers:
            fresh = restarted(s)
            await fresh.start()
            servers.append(fresh)
        for w in self.workers:
            host, port = w.address.rsplit(":", 1)
            fresh = EmbeddingWorker(schema, [s.address for s in servers],
                                    replica_index=w.replica_index,
                                    replica_size=w.replica_size, host=host, port=int(port),
                                    on_server_restart=self.on_server_restart,
                                    checkpoint_root=TEST_CHECKPOINT_ROOT)
            await fresh.start()
            workers.append(fresh)
        self.servers, self.workers = servers, workers

    def store_rows(self, ids, dim: int, server: int = 0) -> np.ndarray:
        """Rows of (slot-prefixed) ``ids`` in server ``server``'s table, read on its store
        thread (the update log's passes run there too), without training them."""
        s = self.servers[server]
        ids = np.asarray(ids, dtype=np.uint64)
        return self.loop.run(s.on_store(lambda: s.store.lookup(ids, dim, train=False)),
                             timeout=30)

    @property
    def worker_addresses(self) -> list[str]:
        return [w.address for w in self.workers]

    def feed(self, batches, *, background: bool = True) -> threading.Thread | None:
        """Send ``batches`` through DataCtx (in a thread: ingest waits while buffers fill)."""
        batches = list(batches)

        def send() -> None:
            with DataCtx(embedding_workers=self.worker_addresses) as dc:
                for b in batches:
                    dc.send_data(b)

        if not background:
            send()
            return None
        t = threading.Thread(target=send, name="test-feed", daemon=True)
        t.start()
        return t

    def rows(self) -> int:
        return sum(len(s.store) for s in self.servers)

    async def _stop(self) -> None:
        for w in self.workers:
            await w.stop()
        for s in self.servers:
            await s.stop()

    def close(self) -> None:
        try:
            self.loop.run(self._stop(), timeout=30)
        finally:
            self.loop.close()


def learnable_batches(n: int, batch_size: int = 256, *, seed: int = 0, vocab: int = 50,
                      requires_grad: bool = True) -> list[PersiaBatch]:
    """Batches whose label is Bernoulli(sigmoid(sum of hidden per-id weights))."""
    weights = np.random.default_rng(12345).normal(0, 1.5, size=(len(LEARNABLE_SLOTS), vocab))
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        ids = rng.integers(0, vocab, size=(len(LEARNABLE_SLOTS), batch_size))
        logit = weights[np.arange(len(LEARNABLE_SLOTS))[:, None], ids].sum(0)
        label = (rng.random(batch_size) < 1 / (1 + np.exp(-logit))).astype(np.float32)
        feats = [IDTypeFeature(s, [np.array([i], np.uint64) for i in ids[k]])
                 for k, s in enumerate(LEARNABLE_SLOTS)]
        dense = np.ones((batch_size, 1), np.float32)
        out.append(PersiaBatch(feats, non_id_type_features=[NonIDTypeFeature(dense, "one")],
                               labels=[Label(label[:, None], "click")],
                               requires_grad=requires_grad))
    return out


class SumModel(torch.nn.Module):
    """PERSIA's forward signature: concatenate every input, then an MLP."""

    def __init__(self, in_dim: int, hidden: int = 0):
        super().__init__()
        layers: list[torch.nn.Module] = []
        if hidden:
            layers += [torch.nn.Linear(in_dim, hidden), torch.nn.ReLU()]
            in_dim = hidden
        layers.append(torch.nn.Linear(in_dim, 1))
        self.mlp = torch.nn.Sequential(*layers)

    def forward(self, non_id_type_feature_tensors, id_type_feature_embedding_tensors):
        parts = [t.float() for t in non_id_type_feature_tensors]
        for e in id_type_feature_embedding_tensors:
            parts.append(e.sum(1) if e.dim() == 3 else e)
        return torch.sigmoid(self.mlp(torch.cat(parts, dim=1)))
