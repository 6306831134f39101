"""Role entry points behind ``stream-persia launch <role>``.

Each role runs on uvloop (when available) until SIGTERM or SIGINT, then drains: it stops
taking new work, lets in-flight requests finish, and exits 0. With ``--ready-file`` the
role writes its RPC ``host:port`` there once it is listening (atomically), which is how
``stream-persia run`` and the tests learn ports chosen by the OS.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import runpy
import signal
import sys
import threading
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from stream_persia import aio
from stream_persia.config import (
    EmbeddingSchema,
    GlobalConfig,
    load_embedding_config,
    load_global_config,
    resolve_bootstrap_servers,
)
from stream_persia.errors import ConfigError

log = logging.getLogger(__name__)


def global_config(args: argparse.Namespace) -> GlobalConfig:
    return load_global_config(args.global_config) if args.global_config else GlobalConfig()


def embedding_schema(args: argparse.Namespace) -> EmbeddingSchema:
    if not args.embedding_config:
        raise ConfigError("no embedding config: pass --embedding-config or set "
                          "PERSIA_EMBEDDING_CONFIG", field="PERSIA_EMBEDDING_CONFIG")
    return load_embedding_config(args.embedding_config)


def write_ready_file(path: str | None, address: str) -> None:
    if not path:
        return
    tmp = Path(f"{path}.tmp")
    tmp.write_text(address)
    os.replace(tmp, path)


def serve_metrics(port: int | None, host: str, render: Callable[[], bytes]) -> None:
    """Serve ``GET /metrics`` on ``port`` from a daemon thread (stdlib HTTP server)."""
    if port is None:
        return
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    from stream_persia.metrics import CONTENT_TYPE

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 (http.server's naming)
            if self.path.split("?")[0] not in ("/metrics", "/"):
                self.send_error(404)
                return
            body = render()
            self.send_response(200)
            self.send_header("Content-Type", CONTENT_TYPE)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: Any) -> None:
            pass

    httpd = ThreadingHTTPServer((host, port), Handler)
    threading.Thread(target=httpd.serve_forever, name="metrics", daemon=True).start()
    log.info("metrics on http://%s:%d/metrics", host, httpd.server_address[1])


async def _until_signal() -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    log.info("signal received: draining")


async def _serve(role: Any, args: argparse.Namespace,
                 before_stop: Callable[[], Awaitable[None]] | None = None) -> int:
    await role.start()
    try:
        serve_metrics(args.metrics_port, args.host, role.metrics.render)
        write_ready_file(args.ready_file, role.address)
        await _until_signal()
        if before_stop is not None:
            await before_stop()
    finally:
        await role.stop()
    return 0


def embedding_server(args: argparse.Namespace) -> int:
    from stream_persia.embedding_server import EmbeddingServer

    gc = global_config(args)
    capacity = args.capacity or gc.embedding_parameter_server_config.capacity
    server = None

    async def main() -> int:
        nonlocal server
        server = EmbeddingServer(capacity, replica_index=args.replica_index,
                                 replica_size=args.replica_size, host=args.host,
                                 port=args.port)
        return await _serve(server, args)

    return aio.run(main())


def embedding_worker(args: argparse.Namespace) -> int:
    import torch

    from stream_persia.kafka import DeadLetterWriter, SampleConsumer
    from stream_persia.worker.ingest import KafkaIngest
    from stream_persia.worker.service import EmbeddingWorker

    torch.set_num_threads(1)   # pooling kernels are small; leave the cores to the NN worker
    gc = global_config(args)
    schema = embedding_schema(args)
    if not args.embedding_servers:
        raise ConfigError("no embedding servers: pass --embedding-servers or set "
                          "PERSIA_EMBEDDING_SERVERS", field="PERSIA_EMBEDDING_SERVERS")
    kafka_cfg = gc.kafka
    if args.topic:
        import dataclasses
        kafka_cfg = dataclasses.replace(kafka_cfg, samples_topic=args.topic, dlq_topic=None)
    bootstrap = resolve_bootstrap_servers(kafka_cfg, args.kafka)
    wc = gc.embedding_worker_config

    async def main() -> int:
        worker = EmbeddingWorker(schema, args.embedding_servers,
                                 replica_index=args.replica_index,
                                 replica_size=args.replica_size, host=args.host, port=args.port,
                                 ready_buffer_batches=wc.ready_buffer_batches,
                                 rpc_timeout_ms=wc.rpc_timeout_ms)
        if bootstrap:
            worker.kafka = KafkaIngest(
                worker,
                SampleConsumer.from_config(kafka_cfg, replica_index=args.replica_index,
                                           replica_size=args.replica_size,
                                           bootstrap_servers=bootstrap,
                                           expected_partitions=args.num_partitions),
                DeadLetterWriter.from_config(kafka_cfg, bootstrap_servers=bootstrap))
            await worker.kafka.start()
        return await _serve(worker, args)

    return aio.run(main())


def data_loader(args: argparse.Namespace) -> int:
    if not args.entry:
        raise ConfigError("no data loader script: pass it as an argument or set "
                          "PERSIA_DATALOADER_ENTRY", field="PERSIA_DATALOADER_ENTRY")
    entry = Path(args.entry)
    if not entry.is_file():
        raise ConfigError(f"data loader script {entry} does not exist",
                          field="PERSIA_DATALOADER_ENTRY")
    # The script builds DataCtx(), which reads these (PERSIA's variable names first).
    os.environ["REPLICA_INDEX"] = str(args.replica_index)
    os.environ["REPLICA_SIZE"] = str(args.replica_size)
    if args.embedding_workers:
        os.environ["PERSIA_EMBEDDING_WORKERS"] = ",".join(args.embedding_workers)
    if args.kafka:
        os.environ["KAFKA_BOOTSTRAP_SERVERS"] = args.kafka
    if args.global_config:
        os.environ["PERSIA_GLOBAL_CONFIG"] = args.global_config
    if args.embedding_config:
        os.environ["PERSIA_EMBEDDING_CONFIG"] = args.embedding_config
    sys.argv = [str(entry)]
    sys.path.insert(0, str(entry.parent.resolve()))
    runpy.run_path(str(entry), run_name="__main__")
    return 0


ROLES: dict[str, Callable[[argparse.Namespace], int]] = {
    "embedding-server": embedding_server,
    "embedding-worker": embedding_worker,
    "data-loader": data_loader,
}
