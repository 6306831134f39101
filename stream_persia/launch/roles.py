"""Role entry points behind ``stream-persia launch <role>``.

Each role runs on uvloop (when available) until SIGTERM or SIGINT, then drains: it stops
taking new work, lets in-flight requests finish, and exits 0 (``nn-worker``: its ranks stop
at a step boundary, :func:`nn_worker`; an embedding worker still waiting for its broker at
start just stops). A role started with ``PERSIA_PARENT_PID`` (by ``stream-persia run``)
sends itself SIGTERM once that parent is gone, even killed with SIGKILL
(:mod:`stream_persia.core.lifecycle`). A role whose supervised
background task fails (:mod:`stream_persia.core.supervisor`: the embedding worker's Kafka
ingest loop), or that reports a condition it cannot work on (the embedding worker: an
embedding server restarted and lost its table), answers ``health`` not ok for
:data:`~stream_persia.core.supervisor.EXIT_GRACE_S`, then drains the same way and exits 1
(unless the condition was resolved meanwhile). With ``--ready-file`` the
role writes its RPC ``host:port`` there once it is listening (atomically), which is how
``stream-persia run`` and the tests learn ports chosen by the OS.

The edge of the embedding server and worker roles (:func:`role_settings`): the job's role
secret (``PERSIA_ROLE_SECRET`` / ``PERSIA_ROLE_SECRET_FILE``; without one a role listens
on loopback only, and ``--host 0.0.0.0`` exits 2 before anything starts), the checkpoint
root their RPCs are confined to (``--checkpoint-root``, env ``PERSIA_CHECKPOINT_ROOT``,
else ``PERSIA_CHECKPOINT_DIR``) and the connection bounds (``rpc`` in the global config).
``--metrics-port`` serves on the RPC ``--host``: loopback without a secret; with one it
may face the network, unauthenticated and read-only (counters and gauges, nothing else),
bounded to a few connections at once, each dropped after 10 s without a byte.
With no ``--port`` they listen on their well-known local port, and a worker with no
servers given finds them on theirs, waiting up to ``--peer-timeout-s``
(:mod:`stream_persia.rpc.local_ports`).

Size: five role entry points and the edge they share (:func:`role_settings`, the serve
loop, the ready file and metrics); split by role, each module would import that edge back.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import runpy
import signal
import socket
import sys
import threading
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from stream_persia.checkpoint.root import CheckpointRoot
from stream_persia.config import (
    EmbeddingSchema,
    GlobalConfig,
    load_embedding_config,
    load_global_config,
    resolve_bootstrap_servers,
)
from stream_persia.core import aio
from stream_persia.core.supervisor import EXIT_GRACE_S
from stream_persia.errors import ConfigError
from stream_persia.launch.memory import KEEP_FREED_ENV, freeze_startup_heap, keep_freed_memory
from stream_persia.launch.stop_signals import stop_signals, unless_stopped, until_signal
from stream_persia.rpc import local_ports
from stream_persia.rpc.auth import RoleSecret, check_bind
from stream_persia.rpc.server import ConnectionLimits

if TYPE_CHECKING:
    from stream_persia.core.lifecycle import ParentWatch

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RoleSettings:
    """What an RPC-serving role takes from the environment and flags, read once."""

    secret: RoleSecret | None
    checkpoint_root: CheckpointRoot | None
    connection_limits: ConnectionLimits


def role_settings(args: argparse.Namespace, gc: GlobalConfig, role: str) -> RoleSettings:
    """The role secret, checkpoint root and connection limits of a server or worker.

    Raises:
        ConfigError: a bad secret setting or root, or a non-loopback ``--host`` without a
            secret (before the role starts anything).
    """
    secret = RoleSecret.from_env()
    check_bind(args.host, secret, f"{role} {args.replica_index}")
    root = CheckpointRoot(args.checkpoint_root) if args.checkpoint_root else None
    if root is None:
        log.info("%s %d: no checkpoint root (--checkpoint-root, PERSIA_CHECKPOINT_ROOT): "
                 "checkpoint requests are refused", role, args.replica_index)
    rpc = gc.rpc
    limits = ConnectionLimits(max_connections=rpc.max_connections,
                              idle_timeout_s=rpc.idle_timeout_s or float("inf"),
                              handshake_timeout_s=rpc.handshake_timeout_s)
    return RoleSettings(secret, root, limits)


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


#: scrapes served at once by a role's metrics port; more connections are closed at once
METRICS_MAX_CONNECTIONS = 8
#: how long a metrics connection may stay open in all, and wait for its peer's next bytes
METRICS_TIMEOUT_S = 10.0
#: at most one warning per this many seconds about connections refused at the cap
_METRICS_LOG_EVERY_S = 10.0


def serve_metrics(port: int | None, host: str, render: Callable[[], bytes]) -> Any:
    """Serve ``GET /metrics`` on ``port`` from a daemon thread (stdlib HTTP server);
    returns the server (None without a port).

    The port may face the network unauthenticated, so it is bounded: at most
    :data:`METRICS_MAX_CONNECTIONS` connections are served at once (each on its own
    thread; one more is closed unanswered, counted in the server's ``refused`` and
    logged at most every 10 s), and each is closed :data:`METRICS_TIMEOUT_S` after it was
    accepted (``cut_off``), whatever it sends: the socket timeout alone bounds each
    read, so a peer that trickled a byte every few seconds kept its slot for good, and
    :data:`METRICS_MAX_CONNECTIONS` of them refused every scrape.
    """
    if port is None:
        return None
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    from stream_persia.core.metrics import CONTENT_TYPE

    class Server(ThreadingHTTPServer):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            self.slots = threading.BoundedSemaphore(METRICS_MAX_CONNECTIONS)
            self.refused = 0    # connections closed unanswered at the cap
            self.cut_off = 0    # connections closed at their deadline
            self._logged_at = -_METRICS_LOG_EVERY_S
            self._logged_refused = 0
            # One thread enforces every connection's deadline (not a timer each: the
            # threads a hostile peer can make the role hold stay bounded as they were).
            self._deadlines: dict[Any, float] = {}
            self._closing = False
            self._wake = threading.Condition()
            # Set first: a port that cannot be bound calls server_close from here.
            super().__init__(*args, **kwargs)
            threading.Thread(target=self._enforce_deadlines, name="metrics deadlines",
                             daemon=True).start()

        def process_request(self, request: Any, client_address: Any) -> None:
            if not self.slots.acquire(blocking=False):
                self.shutdown_request(request)
                self._note_refused(client_address)
                return
            try:
                super().process_request(request, client_address)   # starts its thread
            except BaseException:
                self.slots.release()
                raise

        def _note_refused(self, client_address: Any) -> None:
            self.refused += 1   # only the serve_forever thread refuses
            now = time.monotonic()
            if now - self._logged_at >= _METRICS_LOG_EVERY_S:
                log.warning("metrics port: refused %d connection(s) since the last warning, "
                            "the latest from %s: %d are open (each for at most %g s)",
                            self.refused - self._logged_refused,
                            client_address[0] if client_address else "?",
                            METRICS_MAX_CONNECTIONS, METRICS_TIMEOUT_S)
                self._logged_at, self._logged_refused = now, self.refused

        def process_request_thread(self, request: Any, client_address: Any) -> None:
            with self._wake:
                self._deadlines[request] = time.monotonic() + METRICS_TIMEOUT_S
                self._wake.notify()
            try:
                super().process_request_thread(request, client_address)
            finally:
                with self._wake:
                    self._deadlines.pop(request, None)
                self.slots.release()

        def _enforce_deadlines(self) -> None:
            with self._wake:
                while not self._closing:
                    now = time.monotonic()
                    for request in [r for r, t in self._deadlines.items() if t <= now]:
                        del self._deadlines[request]
                        self.cut_off += 1
                        with contextlib.suppress(OSError):   # wakes the handler's recv
                            request.shutdown(socket.SHUT_RDWR)
                    soonest = min(self._deadlines.values(), default=None)
                    self._wake.wait(None if soonest is None else soonest - now)

        def handle_error(self, request: Any, client_address: Any) -> None:
            # A connection cut off at its deadline (or dropped by its peer) fails the
            # handler's write: counted in cut_off, not a traceback per connection.
            if isinstance(sys.exc_info()[1], OSError):
                return
            super().handle_error(request, client_address)

        def server_close(self) -> None:
            with self._wake:
                self._closing = True
                self._wake.notify()
            super().server_close()

    class Handler(BaseHTTPRequestHandler):
        timeout = METRICS_TIMEOUT_S

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

    try:
        httpd = Server((host, port), Handler)
    except OSError as e:
        raise ConfigError(f"--metrics-port {port}: cannot listen on {host}:{port} "
                          f"({e.strerror or e})", field="--metrics-port",
                          hint="pick a free port, or leave the flag out") from None
    threading.Thread(target=httpd.serve_forever, name="metrics", daemon=True).start()
    log.info("metrics on http://%s:%d/metrics", host, httpd.server_address[1])
    return httpd


async def _serve(role: Any, args: argparse.Namespace,
                 before_stop: Callable[[], Awaitable[None]] | None = None,
                 stop: asyncio.Event | None = None) -> int:
    try:
        await role.start()
    except OSError as e:  # the RPC port: a traceback would bury the reason
        if getattr(args, "well_known_port", False):
            raise local_ports.taken(args.host, args.port, f"{args.role} {args.replica_index}",
                                    e) from None
        raise ConfigError(f"--port {args.port}: cannot listen on {args.host}:{args.port} "
                          f"({e.strerror or e})", field="--port",
                          hint="pick a free port, or 0 for any") from None
    freeze_startup_heap()
    # Exported so that a deployment (and the tests) can see what the role runs with.
    role.metrics.gauge("malloc_keep_freed_bytes",
                       f"free heap kept for reuse ({KEEP_FREED_ENV}; 0: glibc's defaults)"
                       ).set(keep_freed_memory())
    supervisor = getattr(role, "supervisor", None)   # stream_persia.core.supervisor
    code = 0
    try:
        httpd = serve_metrics(args.metrics_port, args.host, role.metrics.render)
        if httpd is not None:
            role.metrics.add_callback(
                "metrics_port", lambda: {"refused": httpd.refused, "cut_off": httpd.cut_off},
                counters={"refused", "cut_off"})
        write_ready_file(args.ready_file, role.address)
        if stop is None:
            stop = stop_signals()
        while await until_signal(supervisor.failed if supervisor is not None else None,
                                  stop):
            # A background task failed: health says why for a moment, then exit 1.
            assert supervisor is not None
            log.error("stopping in %.0f s with exit status 1: %s", EXIT_GRACE_S,
                      supervisor.error)
            await asyncio.sleep(EXIT_GRACE_S)
            if not supervisor.ok:
                code = 1
                break
            # A reported condition was resolved meanwhile (a restore): serve on (or drain,
            # if a signal came during the grace: the loop sees it at once).
            log.warning("the failure was resolved within %.0f s: serving on", EXIT_GRACE_S)
        if code == 0 and before_stop is not None:
            await before_stop()
    finally:
        await role.stop()
    if code and supervisor is not None:
        # Again, now last in the log: a supervisor shows a failed role's log tail, and the
        # Kafka client may have logged a line per retry while the role drained.
        log.error("exit status 1: %s", supervisor.error)
    return code


def embedding_server(args: argparse.Namespace) -> int:
    from stream_persia.server.service import EmbeddingServer

    gc = global_config(args)
    # PERSIA's command lines pass it: the server holds its table policies from its start (a
    # restarted one too), and a bad file fails here, not in the first role that reads it.
    policies = embedding_schema(args).policy_params() if args.embedding_config else None
    cfg = gc.embedding_parameter_server_config
    capacity = args.capacity or cfg.capacity
    threads = args.store_threads or cfg.store_threads   # the store checks it with capacity
    edge = role_settings(args, gc, "embedding server")

    async def main() -> int:
        from stream_persia.kafka.updates import server_sink
        mu = gc.model_updates
        server = EmbeddingServer(
            capacity, replica_index=args.replica_index, replica_size=args.replica_size,
            host=args.host, port=args.port, stage_ttl_s=cfg.restore_stage_ttl_s,
            store_threads=threads, update_tokens=cfg.update_tokens,
            checkpoint_root=edge.checkpoint_root, secret=edge.secret,
            connection_limits=edge.connection_limits, job=gc.kafka.job_name,
            update_sink=await server_sink(gc, args.replica_index, args.replica_size),
            max_dense_bytes=mu.max_dense_bytes, model_updates=mu.enabled,
            update_log_bytes=mu.update_log_bytes,
            model_update_interval_ms=mu.model_update_interval_ms,
            policies=policies, sketch_bytes=gc.admission.sketch_bytes)
        return await _serve(server, args)

    return aio.run(main())


def embedding_worker(args: argparse.Namespace) -> int:
    from stream_persia.kernels.segments import load_segment_sum
    from stream_persia.worker import batchplan
    from stream_persia.worker.service import EmbeddingWorker

    if not args.embedding_servers and getattr(args, "well_known_port", False):   # listens later
        local_ports.check_port_free(args.host, args.port, f"embedding worker "
                                                          f"{args.replica_index}")
    gc = global_config(args)
    schema = embedding_schema(args)
    # Slots pooled on the worker run torch's segment sums on every batch: import torch now
    # (~1 s), not inside the first batch. A job whose slots all pool on the servers never
    # imports it.
    if batchplan.pools_on_worker(schema) and (torch := load_segment_sum()) is not None:
        torch.set_num_threads(1)   # the kernels are small; leave the cores to the NN worker
    kafka_cfg = gc.kafka
    if args.topic:
        import dataclasses
        kafka_cfg = dataclasses.replace(kafka_cfg, samples_topic=args.topic, dlq_topic=None)
    if args.on_data_loss:
        import dataclasses
        kafka_cfg = dataclasses.replace(kafka_cfg, on_data_loss=args.on_data_loss)
    bootstrap = resolve_bootstrap_servers(kafka_cfg, args.kafka)
    wc = gc.embedding_worker_config
    edge = role_settings(args, gc, "embedding worker")

    async def main() -> int:
        stop = stop_signals()
        if not args.embedding_servers:   # zero-config: the servers' well-known local ports
            find = asyncio.ensure_future(local_ports.find_local(
                "embedding-server", timeout_s=args.peer_timeout_s, base=args.base_port))
            if not await unless_stopped(find, stop):
                return 0
            args.embedding_servers = find.result()
        worker = EmbeddingWorker(schema, args.embedding_servers,
                                 replica_index=args.replica_index,
                                 replica_size=args.replica_size, host=args.host, port=args.port,
                                 ready_buffer_batches=wc.ready_buffer_batches,
                                 max_inflight_lookups=wc.max_inflight_lookups,
                                 rpc_timeout_ms=wc.rpc_timeout_ms,
                                 push_retry_ms=wc.push_retry_ms,
                                 on_server_restart=wc.on_server_restart,
                                 ready_buffer_bytes=wc.ready_buffer_bytes,
                                 checkpoint_root=edge.checkpoint_root, secret=edge.secret,
                                 connection_limits=edge.connection_limits)
        if bootstrap:
            from stream_persia.kafka import DeadLetterWriter, SampleConsumer
            from stream_persia.worker.ingest import KafkaIngest

            def make_ingest(start_offsets: dict[int, int] | None) -> KafkaIngest:
                return KafkaIngest(
                    worker,
                    SampleConsumer.from_config(kafka_cfg, replica_index=args.replica_index,
                                               replica_size=args.replica_size,
                                               bootstrap_servers=bootstrap,
                                               expected_partitions=args.num_partitions),
                    DeadLetterWriter.from_config(kafka_cfg, bootstrap_servers=bootstrap),
                    start_offsets=start_offsets)

            # A worker started before its broker waits for it; SIGTERM meanwhile is a
            # stop with nothing to drain (exit 0), not a death by signal.
            if not await unless_stopped(worker.start_kafka_ingest(make_ingest), stop):
                await worker.stop()
                return 0
            return await _serve(worker, args, stop=stop)
        return await _serve(worker, args, stop=stop)

    return aio.run(main())


def entry_script(entry: str | None, what: str, env: str) -> Path:
    """The user script a role runs (a flag, else PERSIA's environment variable ``env``)."""
    if not entry:
        raise ConfigError(f"no {what} script: pass it as an argument or set {env}", field=env)
    path = Path(entry)
    if not path.is_file():
        raise ConfigError(f"{what} script {path} does not exist", field=env)
    return path


def data_loader(args: argparse.Namespace) -> int:
    entry = entry_script(args.entry, "data loader", "PERSIA_DATALOADER_ENTRY")
    RoleSecret.from_env()   # a bad secret setting exits 2 now, not in the script's first call
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

    def stop(signum: int, _frame: Any) -> None:
        signal.signal(signum, signal.SIG_IGN)   # once: let the script unwind
        raise _LoaderStopped(signum)

    # SIGTERM drains: the script stops where it is and its DataCtx, leaving its `with`
    # block, delivers the batches already sent (bounded), then the role exits 0.
    signal.signal(signal.SIGTERM, stop)
    try:
        runpy.run_path(str(entry), run_name="__main__")
    except _LoaderStopped:
        log.info("SIGTERM: the data loader stopped; batches it had sent were flushed")
    return 0


class _LoaderStopped(BaseException):
    """SIGTERM while a data loader script runs (unwinds it like KeyboardInterrupt)."""


def nn_worker_command(args: argparse.Namespace) -> list[str]:
    """The torchrun command line that ``launch nn-worker`` runs (static rendezvous). Each
    rank runs the script through :mod:`stream_persia.launch.rank` (how it stops)."""
    entry = entry_script(args.entry, "NN worker", "PERSIA_NN_WORKER_ENTRY")
    for name, value, lo in (("--nproc-per-node", args.nproc_per_node, 1),
                            ("--nnodes", args.nnodes, 1), ("--node-rank", args.node_rank, 0)):
        if value < lo:
            raise ConfigError(f"{name} must be >= {lo}, got {value}", field=name)
    if args.node_rank >= args.nnodes:
        raise ConfigError(f"--node-rank {args.node_rank} must be below --nnodes {args.nnodes}",
                          field="--node-rank")
    port = args.master_port
    if not port:
        if args.nnodes > 1:
            raise ConfigError("--master-port (or MASTER_PORT) is needed with --nnodes > 1: "
                              "every node must use the same rendezvous port",
                              field="--master-port")
        from stream_persia.nn.utils import find_free_port

        port = find_free_port()
    # torchrun, with its rendezvous store on loopback only on one host (see the module)
    return [sys.executable, "-m", "stream_persia.launch.torchrun",
            f"--nproc-per-node={args.nproc_per_node}", f"--nnodes={args.nnodes}",
            f"--node-rank={args.node_rank}", f"--master-addr={args.master_addr}",
            f"--master-port={port}", "--module", "stream_persia.launch.rank", str(entry),
            *args.script_args]


#: Default of ``launch nn-worker --drain-timeout-s``.
DRAIN_TIMEOUT_S = 60.0
#: Seconds ``launch nn-worker`` lets its ranks drain once its parent process is gone
#: (``PERSIA_PARENT_PID``): the rest of the job is stopping too, so waiting longer for
#: pushes to workers that are going away gains nothing.
PARENT_GONE_DRAIN_S = 10.0


def nn_worker(args: argparse.Namespace) -> int:
    """Run the training script on this node with torchrun (one process per GPU/rank).

    torchrun sets ``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``, ``MASTER_ADDR`` and
    ``MASTER_PORT`` for each process, which ``TrainCtx`` reads.

    SIGTERM or SIGINT drains (:mod:`stream_persia.core.lifecycle`): this process creates the
    node's stop file, every rank stops training at the next step boundary (the same step
    on every rank), returns its untrained batches, waits for its gradient pushes and
    finishes its script, and the role exits with torchrun's status (0). Signals are not
    passed on to torchrun, which would kill its ranks and fail: it runs in a session of
    its own and dies with this process (``PR_SET_PDEATHSIG``). A rank that has not
    finished ``--drain-timeout-s`` after the request (or a second signal) is stopped:
    torchrun gets SIGTERM and ends its ranks (SIGKILL after its own 30 s), and the role
    exits non-zero.
    """
    import shutil
    import subprocess
    import tempfile
    import time

    from stream_persia.core import lifecycle

    cmd = nn_worker_command(args)
    RoleSecret.from_env()   # checked before torchrun starts the ranks, which present it
    env = dict(os.environ)
    if args.embedding_workers:
        env["PERSIA_EMBEDDING_WORKERS"] = ",".join(args.embedding_workers)
    if args.global_config:
        env["PERSIA_GLOBAL_CONFIG"] = args.global_config
    if args.embedding_config:
        env["PERSIA_EMBEDDING_CONFIG"] = args.embedding_config
    env["PERSIA_NN_WORKER_ENTRY"], env["LOG_LEVEL"] = str(args.entry), args.log_level  # ranks too
    stop_dir = Path(tempfile.mkdtemp(prefix="persia-nn-stop-"))
    stop_file = stop_dir / "stop"
    env[lifecycle.STOP_FILE_ENV] = str(stop_file)
    drain_timeout_s = getattr(args, "drain_timeout_s", None) or DRAIN_TIMEOUT_S
    signals: list[int] = []
    previous = {sig: signal.signal(sig, lambda s, _f: signals.append(s))
                for sig in (signal.SIGTERM, signal.SIGINT)}
    log.info("starting %s", " ".join(cmd))
    proc: subprocess.Popen | None = None
    try:
        proc = subprocess.Popen(cmd, env=env, start_new_session=True,
                                preexec_fn=lifecycle.die_with_parent(signal.SIGTERM))
        deadline: float | None = None
        hard = False
        while True:
            try:
                return proc.wait(lifecycle.POLL_S)
            except subprocess.TimeoutExpired:
                pass
            if signals and deadline is None:
                stop_file.touch()
                watch = _PARENT_WATCH
                bound = drain_timeout_s
                if watch is not None and watch.gone:
                    bound = min(bound, PARENT_GONE_DRAIN_S)
                deadline = time.monotonic() + bound
                log.warning("%s: the NN ranks stop at their next step boundary (at most "
                            "%.0f s)", signal.Signals(signals[0]).name, bound)
            if deadline is not None and not hard and (
                    len(signals) > 1 or time.monotonic() > deadline):
                hard = True
                log.error("%s: stopping torchrun, which ends the ranks",
                          "a second signal" if len(signals) > 1
                          else "the NN ranks did not stop in time")
                proc.send_signal(signal.SIGTERM)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        if proc is not None and proc.poll() is None:   # an error here: leave nothing behind
            proc.kill()
            proc.wait()
        shutil.rmtree(stop_dir, ignore_errors=True)


def api(args: argparse.Namespace) -> int:
    """``launch api``: the HTTP control plane and inference service (uvicorn; SIGTERM
    drains in-flight requests and exits 0)."""
    from stream_persia.api.settings import ApiSettings

    RoleSecret.from_env()   # the API's clients of the roles present it
    gc = load_global_config(args.global_config) if args.global_config else None
    schema = load_embedding_config(args.embedding_config) if args.embedding_config else None
    settings = ApiSettings.from_env(
        gc, host=args.host, port=args.port, schema=schema,
        embedding_workers=args.embedding_workers or None,
        embedding_servers=args.embedding_servers or None,
        checkpoint_dir=args.checkpoint_dir, model_checkpoint=args.model,
        model_class=args.model_class, embeddings=args.embeddings,
        predict_requires_token=True if args.predict_auth else None,
        batch_wait_ms=args.batch_wait_ms, max_batch_rows=args.max_batch_rows, table_rows=args.table_rows)
    settings.check_bind()   # before importing the app: a refusal should be quick
    from stream_persia.api.server import serve

    return serve(settings, ready_file=args.ready_file, log_level=str(args.log_level).lower())


#: The watch on the process that started this role (``PERSIA_PARENT_PID``), if any.
_PARENT_WATCH: ParentWatch | None = None


def _with_parent_watch(role: Callable[[argparse.Namespace], int]
                       ) -> Callable[[argparse.Namespace], int]:
    """Run ``role`` under a :class:`~stream_persia.core.lifecycle.ParentWatch` when the
    environment names the starter's pid (``PERSIA_PARENT_PID``: ``stream-persia run`` and
    :class:`~stream_persia.launch.processes.RoleProcess` set it): once the starter is gone, even
    killed with SIGKILL, the role gets SIGTERM and drains instead of running orphaned."""
    def run(args: argparse.Namespace) -> int:
        global _PARENT_WATCH
        from stream_persia.core.lifecycle import ParentWatch

        watch = ParentWatch.from_env()
        if watch is None:
            return role(args)
        _PARENT_WATCH = watch
        watch.start()
        try:
            return role(args)
        finally:
            watch.stop()
            _PARENT_WATCH = None

    run.__name__ = role.__name__
    run.__doc__ = role.__doc__
    return run


ROLES: dict[str, Callable[[argparse.Namespace], int]] = {
    name: _with_parent_watch(role) for name, role in {
        "api": api,
        "embedding-server": embedding_server,
        "embedding-worker": embedding_worker,
        "data-loader": data_loader,
        "nn-worker": nn_worker,
    }.items()}
