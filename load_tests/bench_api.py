"""Latency and throughput of ``POST /v1/predict`` against a baseline FastAPI app.

The baseline is the ceiling: the same TorchScript dense model behind the same server
(uvicorn, uvloop, httptools), with every embedding row already in a torch tensor indexed
by raw id, so a request costs JSON parsing, a gather, the forward pass and the JSON
answer and nothing else (no schema checks, no id prefixing or hashing, no micro-batching,
no metrics). The API under test serves the same checkpoint with its embeddings loaded
into the process (``--embeddings local``), or through an embedding worker and servers
(``--source workers``).

Both run as child processes. For each batch size the bench measures both apps'
closed-loop throughput with ``--concurrency`` clients, then drives both open-loop at the
same request rate (``--load`` times the lower throughput; requests sent on a fixed
schedule whether or not earlier ones came back) and reports p50/p99 latency measured from
the scheduled send time. Runs alternate between the apps (``--repeats``) and medians are
reported, since the machine may be shared. Target: API p99 at
most 1.5x the baseline's at the same rate. Figures depend on the machine; compare the
ratios::

    python load_tests/bench_api.py [--seconds 5] [--concurrency 8] [--load 0.5]
        [--batch-sizes 1,256] [--source local|workers] [--json out.json]
"""

from __future__ import annotations

import argparse
import asyncio
import io
import json
import os
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path

import httpx  # health probes only; the load uses Conn below
import numpy as np
import torch

from stream_persia.checkpoint import JIT_FILENAME, CheckpointWriter
from stream_persia.core import aio
from stream_persia.embedding import EmbeddingConfig
from stream_persia.rpc import RpcClient
from stream_persia.server.service import EmbeddingServer
from stream_persia.testing.samples import EMBEDDING_YAML, SCHEMA

VOCAB = 5000
SLOTS = {"user": 8, "item": 8, "tags": 4}


class Model(torch.nn.Module):
    """Two heads over dense (3) + user (8) + item (8) + raw tags (3 x 4)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.body = torch.nn.Sequential(torch.nn.Linear(31, 64), torch.nn.ReLU(),
                                        torch.nn.Linear(64, 32), torch.nn.ReLU())
        self.click = torch.nn.Linear(32, 1)
        self.buy = torch.nn.Linear(32, 1)

    def forward(self, non_id: list[torch.Tensor], emb: list[torch.Tensor]
                ) -> dict[str, torch.Tensor]:
        parts = [non_id[0]] + [e.reshape(e.shape[0], -1) for e in emb]
        h = self.body(torch.cat(parts, dim=1))
        return {"click": torch.sigmoid(self.click(h)).squeeze(1),
                "buy": torch.sigmoid(self.buy(h)).squeeze(1)}


# ---------------------------------------------------------------------- the checkpoint
async def build_checkpoint(dst: str) -> None:
    """Every id of the vocabulary in every slot, in one server, with a scripted model."""
    # The default optimizer (Adagrad), so that `launch embedding-server` can load the dump.
    server = EmbeddingServer(10 * VOCAB, None, EmbeddingConfig((-0.5, 0.5)),
                             checkpoint_root=os.path.dirname(dst))   # its staging beside it
    await server.start()
    client = RpcClient(server.address)
    try:
        ids = np.arange(VOCAB, dtype=np.uint64)
        groups = [{"dim": dim, "ids": SCHEMA.prefix_ids(slot, ids)} for slot, dim in
                  SLOTS.items()]
        await client.call("lookup", {"mode": "train", "groups": groups})
        buf = io.BytesIO()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)
            torch.jit.save(torch.jit.script(Model().eval()), buf)
        with CheckpointWriter(dst) as w:
            w.write_bytes(JIT_FILENAME, buf.getvalue())
            await w.dump_embeddings([client])
            w.commit(job="bench", step=1, offsets={}, stream="direct")
    finally:
        await client.close()
        await server.stop()


# ---------------------------------------------------------------------- the baseline
BASELINE = r'''
import io, itertools, json, sys, warnings
import numpy as np, torch, uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from stream_persia.checkpoint import read_manifest
from stream_persia.checkpoint._common import Location
from stream_persia.server.shard_files import read_shard_file
from stream_persia.testing.samples import SCHEMA

ckpt, port = sys.argv[1], int(sys.argv[2])
torch.set_num_threads(1)   # as the API (PERSIA_API_TORCH_THREADS defaults to 1)
m = read_manifest(ckpt)
loc = Location(ckpt)
with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    model = torch.jit.load(io.BytesIO(loc.fs.cat_file(loc.join(m.jit_filename))))
model.eval()
VOCAB = int(sys.argv[3])
rows = {}
for name in m.embedding_files:
    for c in read_shard_file(loc.url, name):
        for i, w in zip(c["ids"].tolist(), c["weights"]):
            rows[i] = w
tables = {}
for slot in ("user", "item", "tags"):
    pref = SCHEMA.prefix_ids(slot, np.arange(VOCAB, dtype=np.uint64)).tolist()
    t = np.stack([rows[i] for i in pref]).astype(np.float32)
    tables[slot] = torch.from_numpy(np.vstack([np.zeros((1, t.shape[1]), np.float32), t]))
app = FastAPI()

def csr(lists, limit=None):
    if limit is not None:
        lists = [x[:limit] for x in lists]
    lens = np.fromiter(map(len, lists), np.int64, len(lists))
    flat = np.fromiter(itertools.chain.from_iterable(lists), np.int64, int(lens.sum()))
    return flat, lens


def bag(table, lists, scale):
    flat, lens = csr(lists)
    offsets = np.zeros(len(lens), np.int64)
    np.cumsum(lens[:-1], out=offsets[1:])
    out = torch.nn.functional.embedding_bag(torch.from_numpy(flat + 1), table,
                                            torch.from_numpy(offsets), mode="sum")
    if scale:
        out = out / torch.from_numpy(np.sqrt(np.maximum(lens, 1)).astype(np.float32))[:, None]
    return out


def gather3(table, lists):
    flat, lens = csr(lists, 3)
    index = np.zeros((len(lens), 3), np.int64)
    rows = np.repeat(np.arange(len(lens)), lens)
    cols = np.arange(len(flat)) - np.repeat(np.cumsum(lens) - lens, lens)
    index[rows, cols] = flat + 1
    return table[torch.from_numpy(index)]


@app.post("/v1/predict")
async def predict(request: Request):
    doc = json.loads(await request.body())
    ids = doc["id_type_features"]
    users = [x if isinstance(x, list) else [x] for x in ids["user"]]
    items = [x if isinstance(x, list) else [x] for x in ids["item"]]
    dense = torch.from_numpy(np.array(doc["non_id_type_features"]["dense"], np.float32))
    with torch.inference_mode():
        out = model([dense], [bag(tables["user"], users, False),
                              bag(tables["item"], items, True),
                              gather3(tables["tags"], ids["tags"])])
    cols = {k: v.tolist() for k, v in out.items()}
    preds = [dict(zip(cols, vals)) for vals in zip(*cols.values())]
    return JSONResponse({"model_version": "baseline", "rows": len(preds),
                         "missing_ids": 0, "heads": list(cols), "predictions": preds})


@app.get("/healthz")
async def healthz():
    return {"status": "ok"}

uvicorn.run(app, host="127.0.0.1", port=port, loop="uvloop", http="httptools",
            log_level="warning", access_log=False)
'''


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_baseline(ckpt: str) -> tuple[subprocess.Popen, str]:
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-c", BASELINE, ckpt, str(port), str(VOCAB)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    return proc, f"http://127.0.0.1:{port}"


def start_api(ckpt: str, workdir: str, source: str, extra_env: dict[str, str],
              extra_args: list[str]) -> tuple[subprocess.Popen, str]:
    ready = Path(workdir) / "api.ready"
    yaml = Path(workdir) / "embedding_config.yml"
    yaml.write_text(EMBEDDING_YAML)
    env = {**os.environ, **extra_env, "PERSIA_EMBEDDING_CONFIG": str(yaml)}
    cmd = [sys.executable, "-m", "stream_persia.launch.cli", "launch", "api", "--port", "0",
           "--model", ckpt, "--embeddings", source, "--ready-file", str(ready),
           "--log-level", "warning", *extra_args]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 120
    while not ready.exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"the API did not start: {proc.stderr.read().decode()[-2000:]}")
        time.sleep(0.05)
    return proc, f"http://{ready.read_text().strip()}"


def start_roles(ckpt: str, workdir: str) -> tuple[list[subprocess.Popen], dict[str, str]]:
    """One embedding server (loaded from the checkpoint) and one worker, as processes."""
    from stream_persia.launch.processes import RoleProcess

    yaml = Path(workdir) / "embedding_config.yml"
    yaml.write_text(EMBEDDING_YAML)
    server = RoleProcess("embedding-server", ["--port", "0", "--checkpoint-root",
                                                os.path.dirname(ckpt)])
    server.start()
    s_addr = server.wait_ready(120)
    worker = RoleProcess("embedding-worker", ["--port", "0", "--embedding-servers", s_addr,
                                              "--embedding-config", str(yaml)])
    worker.start()
    w_addr = worker.wait_ready(120)

    async def load() -> None:
        from stream_persia.checkpoint import load_embeddings

        c = RpcClient(s_addr, timeout_ms=120_000)
        try:
            await load_embeddings(ckpt, [c])
        finally:
            await c.close()

    aio.run(load())
    return [server, worker], {"PERSIA_EMBEDDING_WORKERS": w_addr,
                              "PERSIA_EMBEDDING_SERVERS": s_addr}


def wait_healthy(url: str, proc: subprocess.Popen) -> None:
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(proc.stderr.read().decode()[-2000:])
        try:
            if httpx.get(f"{url}/healthz", timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    raise RuntimeError(f"{url} never became healthy")


# ---------------------------------------------------------------------- load
def bodies(batch: int, n: int, seed: int = 0) -> list[bytes]:
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        doc = {"id_type_features": {
            "user": [rng.integers(0, VOCAB, rng.integers(1, 4)).tolist() for _ in range(batch)],
            "item": rng.integers(0, VOCAB, batch).tolist(),
            "tags": [rng.integers(0, VOCAB, rng.integers(0, 5)).tolist()
                     for _ in range(batch)]},
            "non_id_type_features": {"dense": rng.normal(size=(batch, 3)).round(4).tolist()}}
        out.append(json.dumps(doc).encode())
    return out


class Conn:
    """A minimal HTTP/1.1 keep-alive client connection: the load generator shares the
    machine with both servers, so it should cost as little CPU as possible (httpx costs
    several times more per request). Same client for both apps."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, host: str):
        self.reader, self.writer, self.host = reader, writer, host

    @classmethod
    async def open(cls, url: str) -> Conn:
        hostport = url.split("//", 1)[1]
        host, port = hostport.rsplit(":", 1)
        reader, writer = await asyncio.open_connection(host, int(port))
        return cls(reader, writer, hostport)

    async def post(self, path: str, body: bytes) -> int:
        self.writer.write(b"POST %s HTTP/1.1\r\nHost: %s\r\nContent-Type: application/json"
                          b"\r\nContent-Length: %d\r\n\r\n" % (path.encode(), self.host.encode(),
                                                             len(body)) + body)
        head = await self.reader.readuntil(b"\r\n\r\n")
        status = int(head[9:12])
        length = 0
        for line in head.split(b"\r\n"):
            if line[:15].lower() == b"content-length:":
                length = int(line[15:])
        await self.reader.readexactly(length)
        return status

    def close(self) -> None:
        self.writer.close()


async def closed_loop(url: str, payloads: list[bytes], concurrency: int, seconds: float
                      ) -> dict[str, float]:
    lat: list[float] = []
    errors = 0
    conns = [await Conn.open(url) for _ in range(concurrency)]
    try:
        for c, p in zip(conns, payloads, strict=False):   # warm-up
            await c.post("/v1/predict", p)
        t_end = time.perf_counter() + seconds

        async def run(k: int) -> None:
            nonlocal errors
            i = k
            while time.perf_counter() < t_end:
                t0 = time.perf_counter()
                status = await conns[k].post("/v1/predict", payloads[i % len(payloads)])
                lat.append(time.perf_counter() - t0)
                errors += status != 200
                i += concurrency

        t0 = time.perf_counter()
        await asyncio.gather(*(run(k) for k in range(concurrency)))
        elapsed = time.perf_counter() - t0
    finally:
        for c in conns:
            c.close()
    return {"rps": len(lat) / elapsed, "p50_ms": 1000 * float(np.percentile(lat, 50)),
            "p99_ms": 1000 * float(np.percentile(lat, 99)), "errors": errors}


async def open_loop(url: str, payloads: list[bytes], rate: float, seconds: float
                    ) -> dict[str, float]:
    """Requests at fixed times ``k / rate``; latency counts from the scheduled time, so a
    server that falls behind is charged for the queueing it causes."""
    n = max(1, int(rate * seconds))
    lat: list[float] = []
    errors = 0
    idle: list[Conn] = [await Conn.open(url) for _ in range(16)]
    for c, p in zip(idle, payloads, strict=False):
        await c.post("/v1/predict", p)
    start = time.perf_counter() + 0.05

    async def one(k: int) -> None:
        nonlocal errors
        due = start + k / rate
        await asyncio.sleep(max(0.0, due - time.perf_counter()))
        conn = idle.pop() if idle else await Conn.open(url)
        status = await conn.post("/v1/predict", payloads[k % len(payloads)])
        lat.append(time.perf_counter() - due)
        errors += status != 200
        idle.append(conn)

    await asyncio.gather(*(one(k) for k in range(n)))
    for c in idle:
        c.close()
    return {"rate_rps": rate, "p50_ms": 1000 * float(np.percentile(lat, 50)),
            "p99_ms": 1000 * float(np.percentile(lat, 99)), "errors": errors}


def closed(url: str, batch: int, args: argparse.Namespace) -> dict[str, float]:
    return aio.run(closed_loop(url, bodies(batch, 64), args.concurrency, args.seconds))


def opened(url: str, batch: int, rate: float, args: argparse.Namespace) -> dict[str, float]:
    return aio.run(open_loop(url, bodies(batch, 64, seed=1), rate, args.seconds))


def median_of(runs: list[dict[str, float]]) -> dict[str, float]:
    return {k: float(np.median([r[k] for r in runs])) for k in runs[0]}


def run_case(batch: int, base_url: str, api_url: str, args: argparse.Namespace) -> dict:
    """Closed-loop throughput of both, then both open-loop at ``load`` x the lower one;
    runs alternate between the apps ``repeats`` times and the medians are reported, so a
    burst of noise on the shared machine hits both."""
    ceilings: dict[str, list] = {"api": [], "baseline": []}
    lat: dict[str, list] = {"api": [], "baseline": []}
    for _ in range(args.repeats):
        ceilings["baseline"].append(closed(base_url, batch, args))
        ceilings["api"].append(closed(api_url, batch, args))
    cb, ca = median_of(ceilings["baseline"]), median_of(ceilings["api"])
    rate = max(1.0, args.load * min(cb["rps"], ca["rps"]))
    for _ in range(args.repeats):
        lat["baseline"].append(opened(base_url, batch, rate, args))
        lat["api"].append(opened(api_url, batch, rate, args))
    lb, la = median_of(lat["baseline"]), median_of(lat["api"])
    errors = sum(r["errors"] for v in (*ceilings.values(), *lat.values()) for r in v)
    return {"rate_rps": round(rate, 1), "p99_ms": round(la["p99_ms"], 3),
            "p50_ms": round(la["p50_ms"], 3), "rps": round(ca["rps"], 1),
            "p99_vs_baseline": round(la["p99_ms"] / lb["p99_ms"], 3),
            "rps_vs_baseline": round(ca["rps"] / cb["rps"], 3), "errors": int(errors),
            "baseline": {"p50_ms": round(lb["p50_ms"], 3), "p99_ms": round(lb["p99_ms"], 3),
                         "rps": round(cb["rps"], 1)},
            "closed_loop": {"api_p99_ms": round(ca["p99_ms"], 3),
                            "baseline_p99_ms": round(cb["p99_ms"], 3)}}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--seconds", type=float, default=5.0)
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--load", type=float, default=0.5,
                   help="open-loop rate as a fraction of the lower closed-loop throughput")
    p.add_argument("--repeats", type=int, default=3,
                   help="alternating runs per app and measurement (medians reported)")
    p.add_argument("--batch-sizes", default="1,256")
    p.add_argument("--source", choices=("local", "workers"), default="local")
    p.add_argument("--json", default=None, help="also write the results here")
    p.add_argument("--api-arg", action="append", default=[],
                   help="extra argument for `launch api` (repeat), e.g. --api-arg=--batch-wait-ms=0")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    results: dict = {"source": args.source, "concurrency": args.concurrency,
                     "load": args.load, "api_args": args.api_arg, "cases": {}}
    with tempfile.TemporaryDirectory(prefix="bench-api-") as tmp:
        ckpt = f"{tmp}/ckpt"
        aio.run(build_checkpoint(ckpt))
        roles, env = ([], {})
        if args.source == "workers":
            roles, env = start_roles(ckpt, tmp)
        base, base_url = start_baseline(ckpt)
        api, api_url = start_api(ckpt, tmp, args.source, env, args.api_arg)
        try:
            wait_healthy(base_url, base)
            wait_healthy(api_url, api)
            for batch in (int(b) for b in args.batch_sizes.split(",")):
                case = run_case(batch, base_url, api_url, args)
                results["cases"][f"batch_{batch}"] = case
                b = case["baseline"]
                print(f"batch {batch:>4}: at {case['rate_rps']:7.1f} req/s  API p50 "
                      f"{case['p50_ms']:7.2f} ms p99 {case['p99_ms']:7.2f} ms | baseline p50 "
                      f"{b['p50_ms']:7.2f} ms p99 {b['p99_ms']:7.2f} ms | p99 "
                      f"x{case['p99_vs_baseline']:.2f} | closed-loop {case['rps']:7.1f} vs "
                      f"{b['rps']:7.1f} req/s (x{case['rps_vs_baseline']:.2f})", flush=True)
        finally:
            for proc in (api, base):
                proc.terminate()
                proc.wait(30)
            for r in roles:
                r.stop()
    worst = max(results["cases"].values(), key=lambda c: c["p99_vs_baseline"])
    results.update(p99_ms=worst["p99_ms"], p99_vs_baseline=worst["p99_vs_baseline"],
                   rps=min(c["rps"] for c in results["cases"].values()),
                   target_p99_vs_baseline=1.5,
                   meets_target=all(c["p99_vs_baseline"] <= 1.5
                                    for c in results["cases"].values()))
    text = json.dumps(results, indent=2)
    print(text)
    if args.json:
        Path(args.json).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
