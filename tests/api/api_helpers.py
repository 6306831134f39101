"""Helpers of the API tests (a uniquely named module, so test files can import it):
a real uvicorn server on a free loopback port, real embedding servers and workers on
loopback sockets in the same event loop, and checkpoints written with the checkpoint
library from a job that trained a little."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import io
import threading
from dataclasses import dataclass, field
from typing import Any

import httpx
import numpy as np
import torch
import uvicorn
from stream_persia.api import ApiSettings, create_app
from stream_persia.api.server import bind_socket

from stream_persia.checkpoint import JIT_FILENAME, CheckpointWriter
from stream_persia.embedding import EmbeddingConfig
from stream_persia.embedding.optim import SGD
from stream_persia.nn.checkpointing import scripted
from stream_persia.rpc import RpcClient
from stream_persia.server.service import EmbeddingServer
from stream_persia.testing.samples import SCHEMA, make_batch
from stream_persia.testing.servers import TEST_CHECKPOINT_ROOT
from stream_persia.worker.service import EmbeddingWorker

TOKEN = "s3cret-token-0123456789"
AUTH = {"Authorization": f"Bearer {TOKEN}"}


class TwoHeads(torch.nn.Module):
    """PERSIA-signature model over testing.samples.SCHEMA (dense 3, user 8, item 8, raw
    tags 3x4) with two heads, like a multi-task model."""

    def __init__(self, seed: int = 0):
        super().__init__()
        torch.manual_seed(seed)
        self.body = torch.nn.Linear(3 + 8 + 8 + 12, 16)
        self.click = torch.nn.Linear(16, 1)
        self.buy = torch.nn.Linear(16, 2)

    def forward(self, non_id: list[torch.Tensor], emb: list[torch.Tensor]
                ) -> dict[str, torch.Tensor]:
        parts = [non_id[0]] + [e.reshape(e.shape[0], -1) for e in emb]
        h = torch.relu(self.body(torch.cat(parts, dim=1)))
        return {"click": torch.sigmoid(self.click(h)).squeeze(1), "buy": self.buy(h)}


class Gated(TwoHeads):
    """TwoHeads whose forward sets ``ENTERED`` and then waits for ``GATE`` (set: no wait),
    so a test can make something happen while a forward pass is under way."""

    ENTERED = threading.Event()
    GATE = threading.Event()

    def forward(self, non_id: list[torch.Tensor], emb: list[torch.Tensor]
                ) -> dict[str, torch.Tensor]:
        Gated.ENTERED.set()
        if not Gated.GATE.wait(30):
            raise TimeoutError("the test never opened the gate")
        return super().forward(non_id, emb)


Gated.GATE.set()


class DenseAndContext(torch.nn.Module):
    """PERSIA-signature model over testing.samples.SCHEMA with two non-ID features of the
    same width (dense 3, ctx 3): swapping any two inputs still runs, but scores
    differently."""

    def __init__(self, seed: int = 0):
        super().__init__()
        torch.manual_seed(seed)
        self.body = torch.nn.Linear(3 + 3 + 8 + 8 + 12, 16)
        self.click = torch.nn.Linear(16, 1)

    def forward(self, non_id: list[torch.Tensor], emb: list[torch.Tensor]) -> torch.Tensor:
        parts = list(non_id) + [e.reshape(e.shape[0], -1) for e in emb]
        return torch.sigmoid(self.click(torch.relu(self.body(torch.cat(parts, dim=1))))
                             ).squeeze(1)


class Click(torch.nn.Module):
    """One-head PERSIA-signature model over testing.samples.SCHEMA, for training."""

    def __init__(self, seed: int = 0):
        super().__init__()
        torch.manual_seed(seed)
        self.linear = torch.nn.Linear(3 + 8 + 8 + 12, 1)

    def forward(self, non_id: list[torch.Tensor], emb: list[torch.Tensor]) -> torch.Tensor:
        parts = [non_id[0]] + [e.reshape(e.shape[0], -1) for e in emb]
        return torch.sigmoid(self.linear(torch.cat(parts, dim=1)))


@dataclass
class Job:
    servers: list[EmbeddingServer]
    workers: list[EmbeddingWorker]
    clients: list[RpcClient] = field(default_factory=list)

    @property
    def server_addresses(self) -> tuple[str, ...]:
        return tuple(s.address for s in self.servers)

    @property
    def worker_addresses(self) -> tuple[str, ...]:
        return tuple(w.address for w in self.workers)

    def client(self, address: str) -> RpcClient:
        c = RpcClient(address, timeout_ms=5000)
        self.clients.append(c)
        return c

    async def train(self, n_batches: int, seed: int = 0) -> None:
        """Ingest, serve and apply random gradients for ``n_batches`` batches."""
        worker = self.client(self.workers[0].address)
        rng = np.random.default_rng(seed)
        for i in range(n_batches):
            await worker.call("ingest", {"batch": make_batch(i, seed=seed).to_wire()})
            served = await worker.call("next_batch", {"timeout_ms": 2000})
            grads = {e["name"]: rng.normal(size=e["emb"].shape).astype(np.float32)
                     for e in served["embeddings"]}
            await worker.call("push_gradients", {"batch_id": served["batch_id"],
                                                 "grads": grads})


async def start_job(n_servers: int = 2, n_workers: int = 1, **worker_kw: Any) -> Job:
    servers = [EmbeddingServer(100_000, SGD(lr=0.5), EmbeddingConfig((-0.5, 0.5)),
                               replica_index=i, replica_size=n_servers,
                               checkpoint_root=TEST_CHECKPOINT_ROOT) for i in range(n_servers)]
    for s in servers:
        await s.start()
    worker_kw.setdefault("checkpoint_root", TEST_CHECKPOINT_ROOT)
    workers = [EmbeddingWorker(SCHEMA, [s.address for s in servers], replica_index=i,
                               replica_size=n_workers, **worker_kw) for i in range(n_workers)]
    for w in workers:
        await w.start()
    return Job(servers, workers)


async def stop_job(job: Job) -> None:
    for c in job.clients:
        await c.close()
    for w in job.workers:
        await w.stop()
    for s in job.servers:
        await s.stop()


async def write_checkpoint(job: Job, dst: str, model: torch.nn.Module, *, step: int = 1,
                           jit: bool = True, heads: list[str] | None = None,
                           inputs: dict | None = None, dense_lineage: int | None = None,
                           trained_through: float | None = None) -> str:
    """A checkpoint of ``job``'s servers and ``model`` at ``dst`` (direct stream); with
    ``inputs`` (``nn.batch.input_signature``), ``dense_lineage`` (rank 0's dense
    publisher's) and ``trained_through`` recorded as ``dump_checkpoint`` does."""
    clients = [job.client(a) for a in job.server_addresses]
    with CheckpointWriter(dst) as w:
        w.write_torch("dense.pt", model.state_dict())
        if jit:
            w.write_bytes(JIT_FILENAME, scripted(model))
        await w.dump_embeddings(clients)
        extra = ({"heads": heads} if heads else {}) | ({"inputs": inputs} if inputs else {}) \
            | ({} if dense_lineage is None else {"dense_lineage": dense_lineage}) \
            | ({} if trained_through is None else {"trained_through": trained_through})
        # the API's job name (kafka.job_name) with no global config: its replica serves it
        w.commit(job="persia", step=step, offsets={}, stream="direct", extra=extra or None)
    return dst


async def publish_dense(job: Job, model: torch.nn.Module, step: int, event_time: float,
                        lineage: int | None = None) -> None:
    """Publish ``model`` to server 0 as NN rank 0 does (one ``put_dense`` chunk; without
    ``lineage``, as a publisher from before lineages does)."""
    buf = io.BytesIO()
    torch.save(model.state_dict(), buf)
    blob = buf.getvalue()
    client = job.client(job.server_addresses[0])
    await client.call("put_dense", {"version": step, "event_time": event_time, "chunk": 0,
                                    "chunks": 1, "data": blob,
                                    "sha256": hashlib.sha256(blob).hexdigest(),
                                    **({} if lineage is None else {"lineage": lineage})})


class LiveApi:
    """``create_app(settings)`` served by uvicorn on 127.0.0.1:<free port> in this loop."""

    def __init__(self, settings: ApiSettings, **app_kw: Any):
        self.app = create_app(settings, **app_kw)
        self.settings = settings
        self.server: uvicorn.Server | None = None
        self.task: asyncio.Task | None = None
        self.url = ""
        self.client: httpx.AsyncClient | None = None

    async def __aenter__(self) -> LiveApi:
        sock = bind_socket("127.0.0.1", 0)
        self.url = f"http://127.0.0.1:{sock.getsockname()[1]}"
        config = uvicorn.Config(self.app, lifespan="on", log_level="warning", http="httptools",
                                timeout_graceful_shutdown=5)
        self.server = uvicorn.Server(config)
        self.server.capture_signals = contextlib.nullcontext   # the test owns the signals
        self.task = asyncio.create_task(self.server.serve(sockets=[sock]))
        async with asyncio.timeout(30):
            while not self.server.started:
                if self.task.done():
                    self.task.result()    # raises the startup error
                    raise RuntimeError("uvicorn exited during startup")
                await asyncio.sleep(0.01)
        self.client = httpx.AsyncClient(base_url=self.url, timeout=30)
        return self

    @property
    def state(self) -> Any:
        return self.app.state

    async def __aexit__(self, *exc: object) -> None:
        if self.client is not None:
            await self.client.aclose()
        if self.server is not None and self.task is not None:
            self.server.should_exit = True
            await asyncio.wait_for(self.task, 30)


async def take_checkpoint(api: LiveApi, ident: str) -> dict:
    """Take checkpoint ``ident`` over HTTP (``POST /v1/checkpoints``); its info once done."""
    r = await api.client.post("/v1/checkpoints", headers=AUTH, json={"id": ident})
    assert r.status_code == 202, r.text
    async with asyncio.timeout(30):
        while (info := (await api.client.get(f"/v1/checkpoints/{ident}", headers=AUTH)
                        ).json())["state"] in ("pending", "running"):
            await asyncio.sleep(0.02)
    assert info["state"] == "done", info
    return info


def settings_for(job: Job | None = None, **kw: Any) -> ApiSettings:
    base: dict[str, Any] = {"host": "127.0.0.1", "port": 0, "token": TOKEN, "schema": SCHEMA}
    if job is not None:
        base["embedding_workers"] = job.worker_addresses
        base["embedding_servers"] = job.server_addresses
    base.update(kw)
    return ApiSettings(**base)


@contextlib.contextmanager
def threaded_job_and_api(tmp_dir: str, **settings_kw: Any):
    """For synchronous tests: a trained job and the API serving a checkpoint of it, all on
    a background loop thread. Yields ``(url, job)``."""
    from stream_persia.core.aio import LoopThread

    lt = LoopThread(name="api-test")
    job = lt.run(start_job(), timeout=60)
    try:
        lt.run(job.train(4), timeout=60)
        ckpt = lt.run(write_checkpoint(job, f"{tmp_dir}/ckpts/served", TwoHeads()), timeout=60)
        settings = settings_for(job, model_checkpoint=ckpt, embeddings="local",
                                checkpoint_dir=f"{tmp_dir}/ckpts", **settings_kw)
        api = LiveApi(settings)
        lt.run(api.__aenter__(), timeout=60)
        try:
            yield api.url, job
        finally:
            lt.run(api.__aexit__(None, None, None), timeout=60)
    finally:
        lt.run(stop_job(job), timeout=60)
        lt.close()
