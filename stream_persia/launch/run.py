"""``stream-persia run TOPOLOGY``: every role of a job on this machine, end to end.

Starts the embedding servers, embedding workers, the HTTP API, the NN worker ranks
(torchrun) and the data loaders as separate processes; by default the data loaders hand
batches to the workers directly (broker-less), with ``--kafka BOOTSTRAP`` (or
``KAFKA_BOOTSTRAP_SERVERS``) they go through a fresh samples topic (replayable:
exactly-once restore needs it). While it runs it prints
progress (samples/s, loss, buffers). Ctrl-C, SIGTERM and SIGHUP all stop the run the same
way: while training runs, the job is asked for a checkpoint through the API (at most
``--stop-checkpoint-s``, 60 s; the same signal again skips it), then every role is stopped
(SIGTERM to its process group, SIGKILL after a grace period), so none outlives the run.
At the end the API serves the final checkpoint, a few eval samples are predicted over
HTTP, and a report (``report.json`` + ``report.png``) is written into the output
directory::

    stream-persia run topologies/synthetic_ctr                 # the main job
    stream-persia run topologies/adult_income --embedding-staleness 8 --nn-workers 2
    stream-persia run topologies/synthetic_ctr --kafka 127.0.0.1:9092 --samples 2e5

Every flag, the topology's ``run:`` settings and the environment variables the roles
would read (``STREAM_PERSIA_SAMPLES``, ``EMBEDDING_STALENESS``, ...) are checked before any
role starts.
Every run gets a fresh role secret (``PERSIA_ROLE_SECRET``, which every role proves on
every RPC connection) and its output directory as the roles' checkpoint root
(``PERSIA_CHECKPOINT_ROOT``).

With ``--kafka``, a sample that never reaches training fails the run: an embedding worker
that finds offsets of the samples topic gone (retention deleted them before they were
read, a gap, a truncated log) stops that partition, and the run ends with exit 1 naming
the topic, partitions and offsets, whatever the accuracy (``--on-data-loss skip`` accepts
the loss: the run goes on and reports the messages lost). A broker that stops answering
fails the roles that use it after ``--broker-timeout-s`` (``kafka.broker_timeout_ms``,
default 60 s), naming it. A broker refusing idempotent producers (Tansu 0.6) stops the
run at once (exit 2), naming ``--no-kafka-idempotence``.

Exit status: 0 done (gates passed), 1 a role failed (or, with Kafka, data was lost),
2 bad flags or topology, 3 an accuracy gate failed, 128 + the signal's number when stopped
by one: 130 Ctrl-C (SIGINT), 143 SIGTERM, 129 SIGHUP.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import secrets
import signal
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import yaml

from stream_persia.config.files import read_yaml
from stream_persia.config.kafka import ENV_KAFKA_ENABLE_IDEMPOTENCE
from stream_persia.core.supervisor import UNHEALTHY_MARK
from stream_persia.errors import (
    ConfigError,
    DataLost,
    InternalError,
    PeerUnavailable,
    PersiaError,
    RemoteTimeout,
)
from stream_persia.launch.job_checkpoints import checkpoint_and_wait, request_checkpoint
from stream_persia.launch.processes import RoleProcess
from stream_persia.launch.replica_watch import (
    ReplicaWatch,
    log_ends,
    training_started,
)
from stream_persia.launch.report import (
    build_report,
    concept_shift_probe,
    plot_report,
    print_report,
    progress_line,
    save_scrapes,
    served_metrics,
    serving_inputs,
)
from stream_persia.launch.run_args import (
    PREDICT_SAMPLES,
    SETTINGS_ENV,
    check_args,
    check_topology,
    output_dir,
)
from stream_persia.launch.samples_topic import check_idempotence, ensure_topic, ensure_updates_topic
from stream_persia.launch.stop_signals import Stopped, StopSignals
from stream_persia.launch.topology import Topology, load_topology
from stream_persia.launch.watermark_watch import WatermarkWatch

__all__ = ["main"]

#: ``nice`` of the run's serving replica: on the training machine it takes the CPU the
#: training roles leave (a consumer; production replicas run on machines of their own).
REPLICA_NICE = 10


def torch_threads(nproc: int | None) -> dict[str, str]:
    """``OMP_NUM_THREADS`` for a role of a job whose roles share this machine (unless the
    environment sets it): each NN rank (``nproc`` of them) gets an equal part of the cores
    but one, which the servers, workers and loaders use; an API process (None) one thread.
    torch's intra-op threads spin while they wait for each other, so a core taken by
    another role stalls all of them: with two threads on two cores, a serving replica's 12%
    of a core cut training by 14%, and one thread trains as fast (bench_freshness.py)."""
    if os.environ.get("OMP_NUM_THREADS"):
        return {}
    n = 1 if nproc is None else max(1, ((os.cpu_count() or 1) - 1) // max(1, nproc))
    return {"OMP_NUM_THREADS": str(n)}


class Job:
    """The processes of one run, started in dependency order and stopped in reverse."""

    def __init__(self, topo: Topology, args: argparse.Namespace, out: Path):
        self.topo, self.args, self.out = topo, args, out
        self.logs = out / "logs"
        self.logs.mkdir(parents=True, exist_ok=True)
        self.roles: list[RoleProcess] = []
        self.nn: RoleProcess | None = None
        self.loaders: list[RoleProcess] = []
        self.api: RoleProcess | None = None
        self.replica: RoleProcess | None = None
        self.watch: ReplicaWatch | None = None
        self.watermarks: WatermarkWatch | None = None   # the API's /v1/status watermarks
        self.bootstrap_requested = False
        self.api_token = secrets.token_urlsafe(24)
        # Every role of this job proves it to the others (stream_persia/rpc/auth.py).
        self.role_secret = secrets.token_urlsafe(32)
        self.env = self._env()
        # Wraps each spawn: StopSignals.deferred in main(), so a stop signal never lands
        # between a child's fork and its record in self.roles.
        self.spawn_guard: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext

    def _env(self) -> dict[str, str]:
        a, topo = self.args, self.topo
        env = {"PERSIA_EMBEDDING_CONFIG": str(topo.path(topo.embedding_config)),
               "PERSIA_GLOBAL_CONFIG": str(self._global_config()),
               "PERSIA_OUTPUT_DIR": str(self.out),
               # Under the API's checkpoint directory: the API serves only checkpoints
               # there, and the report is made by reloading this one.
               "PERSIA_CKPT_DIR": str(self.out / "checkpoints" / "final"),
               "PERSIA_CHECKPOINT_DIR": str(self.out / "checkpoints"),
               # Role RPCs read and write checkpoints only under the run's directory.
               "PERSIA_CHECKPOINT_ROOT": str(self.out),
               "PERSIA_API_TOKEN": self.api_token,
               "PERSIA_ROLE_SECRET": self.role_secret,
               "PERSIA_ROLE_SECRET_FILE": "",   # a caller's file would conflict: unset
               "STREAM_PERSIA_CONCEPT_SHIFT_AT": str(a.concept_shift_at
                                                     if a.concept_shift_at is not None else -1),
               "PYTHONPATH": os.pathsep.join(
                   [str(topo.directory)] + [p for p in [os.environ.get("PYTHONPATH")] if p])}
        if getattr(a, "no_kafka_idempotence", False):
            env[ENV_KAFKA_ENABLE_IDEMPOTENCE] = "false"   # over an inherited one
        for key, var in SETTINGS_ENV.items():
            value = getattr(a, key, None)
            if value is None and key == "data" and topo.data.get("default"):
                default = Path(str(topo.data["default"]))
                if default.exists():
                    value = str(default.resolve())
                elif topo.data.get("required"):
                    raise ConfigError(
                        f"{topo.name} needs its dataset: {default} does not exist",
                        field="--data", hint=f"pass {topo.data.get('flag', '--data')} PATH "
                                             "(see the topology's README for where to get it)")
            if value is not None:
                env[var] = str(value)
        return env

    def _global_config(self) -> Path:
        """The topology's global config, with this run's Kafka topic when streaming."""
        src = self.topo.path(self.topo.global_config)
        off = getattr(self.args, "no_model_updates", False)
        if not self.args.kafka and not off:
            return src
        data, _ = read_yaml(src, "global config", "PERSIA_GLOBAL_CONFIG")   # bounded
        if off:
            data["model_updates"] = {**(data.get("model_updates") or {}), "enabled": False}
        if not self.args.kafka:
            dst = self.out / "global_config.yml"
            dst.write_text(yaml.safe_dump(data, sort_keys=False))
            return dst
        kafka = dict(data.get("kafka") or {})
        kafka["bootstrap_servers"] = self.args.kafka
        kafka["samples_topic"] = self.topic
        if getattr(self.args, "on_data_loss", None) is not None:
            kafka["on_data_loss"] = self.args.on_data_loss
        if getattr(self.args, "broker_timeout_s", None) is not None:
            kafka["broker_timeout_ms"] = int(self.args.broker_timeout_s * 1000)
        if getattr(self.args, "no_kafka_idempotence", False):
            kafka["enable_idempotence"] = False
        data["kafka"] = kafka
        dst = self.out / "global_config.yml"
        dst.write_text(yaml.safe_dump(data, sort_keys=False))
        return dst

    @property
    def topic(self) -> str:
        if self.args.topic:
            return self.args.topic
        return f"{self.topo.name}.{self.out.name}.samples"

    def _role(self, role: str, args: list[str], name: str, env: dict | None = None,
              nice: int = 0) -> RoleProcess:
        proc = RoleProcess(role, args, env={**self.env, **(env or {})},
                           log_path=self.logs / f"{name}.log", name=name, nice=nice)
        with self.spawn_guard():
            self.roles.append(proc)
            return proc.start()

    def start(self) -> None:
        topo, a = self.topo, self.args
        n_servers = a.embedding_servers or topo.embedding_servers
        n_workers = a.embedding_workers or topo.embedding_workers
        if a.kafka:
            check_idempotence(a.kafka, self.env["PERSIA_GLOBAL_CONFIG"])
        if a.kafka and not getattr(a, "no_model_updates", False):
            ensure_updates_topic(a.kafka, self.env["PERSIA_GLOBAL_CONFIG"], n_servers)
        servers = [self._role("embedding-server",
                              ["--replica-index", str(i), "--replica-size", str(n_servers)],
                              f"embedding-server-{i}") for i in range(n_servers)]
        server_addrs = [s.wait_ready() for s in servers]
        self.env["PERSIA_EMBEDDING_SERVERS"] = ",".join(server_addrs)
        if a.kafka:
            ensure_topic(a.kafka, self.topic, a.partitions or 4 * n_workers,
                         create=a.topic is None, min_partitions=n_workers)
        kafka_args = ["--kafka", a.kafka] if a.kafka else []
        workers = [self._role("embedding-worker",
                              ["--replica-index", str(i), "--replica-size", str(n_workers),
                               *kafka_args], f"embedding-worker-{i}")
                   for i in range(n_workers)]
        self.env["PERSIA_EMBEDDING_WORKERS"] = ",".join(w.wait_ready() for w in workers)
        if topo.api and not a.no_api:
            env = torch_threads(None)
            if topo.serving.get("model"):
                env["PERSIA_API_MODEL_CLASS"] = str(topo.serving["model"])
            self.api = self._role("api", [], "api", env)
            self.api.wait_ready()
            if not (getattr(a, "no_replica", False) or getattr(a, "no_model_updates", False)):
                # A serving replica: restores the first checkpoint (requested as soon as
                # training runs, see _bootstrap), then follows the training's updates.
                # On training's machine it yields the CPU to training (REPLICA_NICE):
                # in production replicas run on serving machines of their own.
                self.replica = self._role("api", ["--embeddings", "replica", "--port", "0"],
                                          "replica", env, nice=REPLICA_NICE)
                self.replica.wait_ready()
        nproc = a.nn_workers or topo.nproc_per_node
        self.nn = self._role("nn-worker", [str(topo.path(topo.nn_worker_entry)),
                                           "--nproc-per-node", str(nproc)], "nn-worker",
                             torch_threads(nproc))
        n_loaders = a.data_loaders or topo.data_loaders
        loader_env = {} if a.kafka else {"KAFKA_BOOTSTRAP_SERVERS": ""}
        self.loaders = [self._role("data-loader",
                                   [str(topo.path(topo.data_loader_entry)),
                                    "--replica-index", str(i), "--replica-size", str(n_loaders),
                                    *kafka_args], f"data-loader-{i}", loader_env)
                        for i in range(n_loaders)]

    def failed_role(self) -> tuple[RoleProcess, int] | None:
        """A role that exited with an error, or a server/worker/API that exited at all,
        with its exit code."""
        for r in self.roles:
            code = r.proc.poll() if r.proc else None
            if code is None:
                continue
            if r is self.nn or r in self.loaders:
                if code != 0:
                    return r, code
            else:
                return r, code
        return None

    def stop(self) -> None:
        for r in reversed(self.roles):
            r.stop(grace_s=15)

    def kafka_state(self) -> tuple[list[dict[str, Any]], dict[str, int], list[str]]:
        """From every embedding worker's ``status``: the partitions stopped on a data loss
        (each a ``DataLoss.to_dict()``), the messages lost and accepted per
        ``topic/partition``, and why a worker's Kafka ingest ended, if it did (a broker
        gone for ``kafka.broker_timeout_ms``). A worker that cannot be reached or does
        not answer in time reports nothing here (its own exit fails the run).

        Raises:
            RuntimeError: a worker refused the poll otherwise (another role secret, a
                bug): the run's data-loss check must not pass unseen.
        """
        addresses = [a for a in self.env.get("PERSIA_EMBEDDING_WORKERS", "").split(",") if a]
        if not self.args.kafka or not addresses:
            return [], {}, []
        from stream_persia.core import aio
        from stream_persia.rpc import RpcClient
        from stream_persia.rpc.auth import RoleSecret

        async def go() -> list[Any]:
            replies: list[Any] = []
            for i, address in enumerate(addresses):
                async with RpcClient(address, timeout_ms=5000, name="embedding-worker",
                                     secret=RoleSecret(self.role_secret)) as c:
                    try:
                        replies.append(await c.call("status"))
                    except (PeerUnavailable, RemoteTimeout):
                        replies.append(None)
                    except PersiaError as e:
                        raise RuntimeError(f"the Kafka status of embedding-worker-{i} at "
                                           f"{address} could not be read, so data loss "
                                           f"cannot be checked: {e}") from e
            return replies

        stopped: list[dict[str, Any]] = []
        lost: dict[str, int] = {}
        errors: list[str] = []
        for i, status in enumerate(aio.run(go())):
            kafka = status.get("kafka") if isinstance(status, dict) else None
            if not isinstance(kafka, dict):
                continue
            stopped += list((kafka.get("stopped") or {}).values())
            for p, n in (kafka.get("lost_messages") or {}).items():
                lost[f"{kafka.get('topic')}/{p}"] = int(n)
            if kafka.get("error"):
                errors.append(f"embedding-worker-{i}: {kafka['error']}")
        return stopped, lost, errors


def _why(role: RoleProcess) -> str:
    """The reason a role gave for exiting 1 (its supervisor's line, stream_persia/core/supervisor),
    if its log has one: the log's tail may be another library's noise."""
    for line in reversed(role.log_tail(1 << 20).splitlines()):
        if UNHEALTHY_MARK in line:
            return f": {line.split(' ', 3)[-1]}"
    return ""


def check_kafka(job: Job) -> dict[str, int]:
    """Raise :class:`DataLost` if an embedding worker stopped a partition on a data loss,
    RuntimeError if a worker's Kafka ingest ended (no broker answered); else return the
    messages lost and accepted (``--on-data-loss skip``)."""
    stopped, lost, errors = job.kafka_state()
    if errors:
        raise RuntimeError("Kafka ingest stopped: " + "; ".join(errors))
    if stopped:
        lines = "\n".join(f"  {loss.get('message')}" for loss in stopped)
        raise DataLost(f"Kafka data was lost: the embedding workers stopped ingest of "
                       f"{len(stopped)} partition(s) rather than train without it:\n{lines}\n"
                       f"Checkpoints record offsets up to the loss only. Replay the data, "
                       f"or accept the loss with --on-data-loss skip (kafka.on_data_loss).")
    return lost


def _read_metrics(out: Path) -> dict[str, Any]:
    try:
        return json.loads((out / "metrics.json").read_text())
    except (OSError, ValueError):
        return {}


LOSS_CHECK_EVERY_S = 3.0


def _wait(job: Job, t0: float, deadline: float) -> None:
    nn = job.nn
    if nn is None or nn.proc is None:   # started with the job, before anything waits
        raise InternalError("the NN worker was never started")
    proc = nn.proc
    tty = sys.stderr.isatty()
    last_print = last_loss_check = 0.0
    while proc.poll() is None:
        failed = job.failed_role()
        if failed is not None:
            bad, code = failed
            raise RuntimeError(f"{bad.name} exited with {code}{_why(bad)}; the "
                               f"last lines of {bad.log_path}:\n{bad.log_tail(3000)}")
        if time.monotonic() > deadline:
            raise TimeoutError(f"the job did not finish within {job.args.timeout_s:.0f} s")
        if job.args.kafka and time.monotonic() - last_loss_check >= LOSS_CHECK_EVERY_S:
            check_kafka(job)
            last_loss_check = time.monotonic()
        now = time.monotonic()
        metrics = _read_metrics(job.out)
        if (job.replica is not None and job.api is not None and job.api.address
                and not job.bootstrap_requested and training_started(job.api.address,
                                                                     job.api_token)):
            job.bootstrap_requested = True   # the checkpoint the replica starts from
            request_checkpoint(job.api.address, job.api_token, "bootstrap")
        for watch in (job.watch, job.watermarks):   # each polls at its own pace
            if watch is not None:
                watch.poll()
        if tty or now - last_print >= 10:
            line = progress_line(metrics, time.monotonic() - t0)
            print(f"\r{line}" if tty else line, end="" if tty else "\n", file=sys.stderr,
                  flush=True)
            last_print = now
        time.sleep(1.0)
    if tty:
        print(file=sys.stderr)
    if proc.returncode != 0:
        raise RuntimeError(f"the NN worker exited with {proc.returncode}; the last "
                           f"lines of {nn.log_path}:\n{nn.log_tail(4000)}")


def _checkpoint_on_interrupt(job: Job, budget_s: float) -> str | None:
    """Ask the job for a consistent checkpoint over the API, waiting at most ``budget_s``.

    Only while the NN worker runs (it takes the checkpoint) and the API is up; a job whose
    training ended has written its final checkpoint already."""
    if (budget_s <= 0 or job.api is None or job.api.address is None or not job.api.alive()
            or job.nn is None or not job.nn.alive()):
        return None
    return checkpoint_and_wait(job.api.address, job.api_token, budget_s)


def main(args: argparse.Namespace) -> int:
    check_args(args)
    topo = load_topology(args.topology)
    check_topology(topo, args)
    if args.predict_samples is None:
        args.predict_samples = PREDICT_SAMPLES
    out = output_dir(topo, args, Path("runs") / f"{topo.name}-{time.strftime('%Y%m%d-%H%M%S')}")
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ConfigError(f"--output-dir: cannot make {out}: {e.strerror or e}",
                          field="--output-dir", hint="a directory path you can write") from None
    job = Job(topo, args, out)
    t0 = time.monotonic()
    mode = f"Kafka {args.kafka} topic {job.topic}" if args.kafka else "broker-less stream"
    print(f"stream-persia run {topo.name}: {mode}; output in {out}", file=sys.stderr)
    with StopSignals() as signals:
        job.spawn_guard = signals.deferred
        try:
            job.start()
            print(f"roles up after {time.monotonic() - t0:.1f}s: "
                  f"servers {job.env['PERSIA_EMBEDDING_SERVERS']}, "
                  f"workers {job.env['PERSIA_EMBEDDING_WORKERS']}"
                  + (f", API http://{job.api.address}" if job.api else ""), file=sys.stderr)
            eval_batches = serving_inputs(topo, job.env, args.predict_samples)
            if job.replica is not None and job.replica.address:
                job.watch = ReplicaWatch(job.replica.address, job.api_token, eval_batches,
                                         list(topo.tasks), probe=concept_shift_probe(topo, job.env))
            if job.api is not None and job.api.address:
                job.watermarks = WatermarkWatch(job.api.address, job.api_token, replica=(
                    job.replica.address if job.replica is not None else None))
            _wait(job, t0, t0 + args.timeout_s)
            lost = check_kafka(job)   # a loss near the end, before any gate
            if lost:
                print(f"stream-persia run: data loss accepted (--on-data-loss skip): messages "
                      f"lost per partition {lost}", file=sys.stderr)
            metrics = _read_metrics(out)
            metrics["watermarks"] = job.watermarks.summary() if job.watermarks else {}
            served = None
            if job.api is not None and job.api.address and metrics.get("checkpoint"):
                served = served_metrics(job.api.address, job.api_token, metrics["checkpoint"],
                                        eval_batches, list(topo.tasks))
            report = build_report(topo, metrics, served, out, time.monotonic() - t0, mode)
            if job.watch is not None:
                final = job.watch.drain(log_ends(job.env["PERSIA_EMBEDDING_SERVERS"],
                                                 job.role_secret),
                                        (served or {}).get("step"))
                report["replica"] = job.watch.summary(final, (served or {}).get("_preds"),
                                                      out / "concept_shift.json")
            save_scrapes(out, {"api": job.api.address if job.api else None,
                               "replica": job.replica.address if job.replica else None})
            if lost:
                report["kafka_messages_lost"] = lost
        except Stopped as stop:
            name = signal.Signals(stop.signum).name
            print(f"\nstream-persia run: {name}: checkpointing before stopping every role "
                  f"(at most {args.stop_checkpoint_s:g} s; send it again to skip)...",
                  file=sys.stderr)
            try:
                with signals.interruptible():
                    ckpt = _checkpoint_on_interrupt(job, args.stop_checkpoint_s)
            except Stopped:
                ckpt = None
            print(f"stream-persia run: checkpoint {ckpt or 'not taken'}; stopping",
                  file=sys.stderr)
            return 128 + stop.signum
        except (RuntimeError, TimeoutError, DataLost) as e:
            print(f"stream-persia run: {e}", file=sys.stderr)
            return 1
        finally:
            with signals.shielded():   # a signal now must not leave roles behind
                job.stop()
    (out / "report.json").write_text(json.dumps(report, indent=1))
    plot_report({**_read_metrics(out), "freshness_curve": job.watch.curve() if job.watch
                 else [], "stage_lag_curve": job.watermarks.curve() if job.watermarks
                 else {}}, out / "report.png", topo.name)
    if job.watch is not None:
        job.watch.close()
    print_report(report)
    failed = [g for g in report["gates"] if not g["passed"]]
    if failed and not args.no_gates:
        print(f"stream-persia run: accuracy gate(s) failed: {failed}", file=sys.stderr)
        return 3
    return 0
