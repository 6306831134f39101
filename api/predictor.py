"""Online inference: the served model, its embeddings, micro-batching and hot reload.

A :class:`Served` pairs a dense model with its embedding source and is immutable once
loaded. :meth:`Predictor.reload` loads the new checkpoint fully (dense model and, for local
embeddings, every row) off the event loop, then swaps one reference. A micro-batch takes
the reference once when it starts, so requests already running finish on the old model,
queued ones run on the new one, and none is dropped; each response names the version
that produced it.

Forward passes of big micro-batches run on one dedicated thread (torch releases the GIL),
one at a time, so the event loop keeps accepting requests, which queue up into the next
batch; tiny ones (``inline_max_rows``) run on the loop, where they cost less than the
hand-off to a thread. A
micro-batch whose merged forward is rejected as bad input is re-run request by request,
so one bad request never fails the others.

Size: one module because the served reference is one state: the reload that swaps it
(pinned against retention), the micro-batches that read it once and the replica source
that follows it would otherwise pass it around unguarded.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import itertools
import logging
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from stream_persia.api.batcher import Job, MicroBatcher
from stream_persia.api.checkpoint_root import CheckpointDir
from stream_persia.api.embeddings import CheckpointTable, cat_slots, non_id_tensors, served_tensors
from stream_persia.api.errors import NotReady
from stream_persia.api.features import signature
from stream_persia.api.inputs import ModelInputs
from stream_persia.api.metrics import ApiMetrics
from stream_persia.api.model import DenseModel, load_dense
from stream_persia.api.replica import Replica, ReplicaMetrics, rebuilt
from stream_persia.api.replica_kafka import KafkaFollow
from stream_persia.api.roles import WORKER, Roles
from stream_persia.api.settings import ApiSettings

from stream_persia.checkpoint import latest_checkpoint, list_checkpoints
from stream_persia.core.data import PersiaBatch
from stream_persia.core.served import ServedBatch
from stream_persia.errors import (
    BadInput,
    ConfigError,
    PeerUnavailable,
    PersiaError,
    RemoteError,
)
from stream_persia.server.dense_hub import LEGACY_LINEAGE, lineage_or_legacy

__all__ = ["Predictor", "Served", "Prediction", "predictions_json", "LATEST"]

#: ``PERSIA_API_MODEL`` value (the default of a serving replica): the newest checkpoint under
#: the checkpoint directory, retried until there is one.
LATEST = "latest"

log = logging.getLogger(__name__)


@dataclass(frozen=True, eq=False)
class Served:
    """One loaded checkpoint: dense model plus (local mode) its embedding rows."""

    dense: DenseModel
    table: CheckpointTable | None
    source: str
    inputs: ModelInputs

    @property
    def version(self) -> str:
        return self.dense.version

    def info(self) -> dict[str, Any]:
        m = self.dense.manifest
        return {"version": self.version, "checkpoint": m.path or "", "step": self.dense.step,
                "model_version": self.dense.step,
                "kind": self.dense.kind, "embeddings": self.source,
                "heads": list(self.dense.head_names or []), "loaded_at": self.dense.loaded_at,
                "inputs": self.inputs.describe()}


@dataclass(frozen=True)
class Prediction:
    """The answer to one request."""

    version: str
    heads: dict[str, np.ndarray]
    missing: int
    rows: int
    step: int = 0                       # the dense model's training step (model_version)
    trained_through: float | None = None


class Predictor:
    """Serves ``POST /v1/predict`` and ``POST /v1/model/reload``."""

    def __init__(self, settings: ApiSettings, roles: Roles, metrics: ApiMetrics):
        self.settings = settings
        self.roles = roles
        self.metrics = metrics
        self.source = settings.source
        self._served: Served | None = None
        self.root = CheckpointDir(settings.checkpoint_dir)
        self._reload_lock = asyncio.Lock()
        self._loading: str | None = None
        #: Set by the API's ``Checkpoints``: keeps a checkpoint from deletion while it loads
        #: (Misuse naming it if it is being deleted).
        self.pin: Callable[[str], contextlib.AbstractContextManager[None]] = \
            lambda src: contextlib.nullcontext()
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="predict")
        self._rr = itertools.count()
        self._last_error: str | None = None
        self._retry: asyncio.Task | None = None
        self.replica: Replica | None = None
        self.replica_metrics = (ReplicaMetrics(metrics.role) if self.source == "replica"
                                else None)
        self._kafka: KafkaFollow | None = None
        self.batcher = MicroBatcher(self._run, max_rows=settings.max_batch_rows,
                                    max_wait_s=settings.batch_wait_ms / 1000.0)

    # ----------------------------------------------------------------- lifecycle
    @property
    def expects_model(self) -> bool:
        """Whether readiness requires a loaded model (one was configured at start-up)."""
        return self.settings.model_checkpoint is not None

    async def start(self) -> None:
        """Start the micro-batcher and load the configured model. A model that cannot be
        loaded yet (say, its checkpoint is still being written) does not stop the API: it
        stays unready (``/readyz`` says why) and the load is retried with backoff."""
        torch.set_num_threads(self.settings.torch_threads)
        await self.batcher.start()
        start = self.settings.model_checkpoint
        if start is None and self.source == "replica":
            start = LATEST
        if start is not None:
            try:
                await self.load(self._start_path(start))
            except PersiaError as e:
                log.error("cannot serve %s yet: %s; retrying in the background", start, e)
                self._retry = asyncio.create_task(
                    self._retry_load(start, max_s=0.5 if start == LATEST else 60.0),
                    name="model-retry")

    def _start_path(self, start: str) -> str:
        """``start``, or for :data:`LATEST` the newest checkpoint under the directory."""
        if start != LATEST:
            return start
        if self.settings.checkpoint_dir is None:
            raise ConfigError("a serving replica needs a checkpoint to start from",
                              field="PERSIA_CHECKPOINT_DIR",
                              hint="set PERSIA_CHECKPOINT_DIR (its newest checkpoint is "
                                   "used) or PERSIA_API_MODEL")
        job = self.settings.job_name
        manifest = latest_checkpoint(self.settings.checkpoint_dir, job)
        if manifest is None or manifest.path is None:
            jobs = sorted({m.job for m in list_checkpoints(self.settings.checkpoint_dir)})
            raise NotReady(f"no checkpoint of job {job!r} (kafka.job_name) under "
                           f"{self.settings.checkpoint_dir} yet" + (
                               f"; it holds checkpoints of job(s) {jobs[:5]}" if jobs else ""),
                           hint="the replica starts from the first one its job writes "
                                "(the trainer's and the replica's kafka.job_name agree?)")
        return manifest.path

    async def _retry_load(self, path: str, first_s: float = 1.0, max_s: float = 60.0) -> None:
        delay = min(first_s, max_s)
        said = ""
        while self._served is None:
            await asyncio.sleep(delay)
            if self._served is not None:   # a manual reload won
                return
            try:
                await self.load(self._start_path(path))
            except PersiaError as e:
                if str(e) != said:   # once per reason, not once per try
                    log.warning("cannot serve %s yet: %s", path, e)
                    said = str(e)
                delay = min(max_s, delay * 2)

    async def stop(self) -> None:
        await self._stop_following()
        task, self._retry = self._retry, None
        if task is not None:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
        await self.batcher.stop()
        self._pool.shutdown(wait=True)

    def info(self) -> dict[str, Any] | None:
        info = self._info()
        if info is not None and self.replica is not None:
            info["trained_through"] = self.replica.trained_through
            info["replica"] = self.replica.info()
        return info

    def _info(self) -> dict[str, Any] | None:
        return self._served.info() if self._served is not None else None

    def not_ready_reason(self) -> str:
        why = f": {self._last_error}" if self._last_error else ""
        return f"no model loaded{why}"

    # ----------------------------------------------------------------- reload
    def in_use(self) -> dict[str, str]:
        """Paths of the checkpoints this predictor needs → why: the one served, the one
        being loaded, and the one configured at start-up (retried until it loads)."""
        out = {}
        for path, why in ((self.settings.model_checkpoint, "the model configured to serve"),
                          (self._loading, "being loaded to serve"),
                          (self._served.dense.manifest.path if self._served else None,
                           "the model being served")):
            if path:
                out[path] = why
        return out

    def _load(self, src: str) -> Served:
        dense = load_dense(src, self.settings.model_class)
        table = None
        if self.source in ("local", "replica"):
            if self.settings.schema is None:
                raise ConfigError(f"{self.source} embeddings need the job's embedding config",
                                  field="PERSIA_EMBEDDING_CONFIG",
                                  hint="set PERSIA_EMBEDDING_CONFIG (or use "
                                       "PERSIA_API_EMBEDDINGS=workers)")
            table = CheckpointTable.load(dense.manifest, self.settings.schema,
                                         capacity=self.settings.replica_rows()
                                         if self.source == "replica" else None)
        return Served(dense, table, self.source, ModelInputs.of(dense.manifest,
                                                                self.settings.schema))

    async def reload(self, checkpoint: str) -> dict[str, Any]:
        """Serve the checkpoint a request names: an id or a path/URL right under the
        checkpoint directory (:class:`~stream_persia.api.checkpoint_root.CheckpointDir`), nothing else.

        Raises:
            BadInput: ``checkpoint`` names something else, or not a loadable checkpoint
                (the field is ``checkpoint``).
        """
        return await self.load(self.root.resolve(checkpoint, "checkpoint"))

    async def load(self, src: str) -> dict[str, Any]:
        """Load the checkpoint at ``src`` completely, then swap it in; returns the new
        model's info. ``src`` is trusted (configured, or resolved under the root).

        Raises:
            BadInput: not a loadable checkpoint (the field is ``checkpoint``; the message
                names the file at fault).
            ConfigError: the API's own settings do not allow serving it (model class).
            Misuse: it is being deleted.
        """
        async with self._reload_lock:
            with self.pin(src):   # until served: retention's thread sees one or the other
                old, served = await self._load_pinned(src)
            if self.source == "replica":
                await self._follow(served)
        self.metrics.reloads.labels("ok").inc()
        log.info("serving model %s (was %s)", served.version,
                 old.version if old is not None else "none")
        return served.info()

    async def _load_pinned(self, src: str) -> tuple[Served | None, Served]:
        self._loading = src
        try:
            served = await asyncio.get_running_loop().run_in_executor(None, self._load, src)
            old, self._served = self._served, served   # served before it is not loading
        except ConfigError as e:
            self._failed(src, e.message)
            raise
        except BadInput as e:
            self._failed(src, e.message)
            raise BadInput(e.message, field="checkpoint", hint=e.hint) from None
        except PersiaError as e:
            self._failed(src, e.message)
            raise
        except Exception as e:   # any other failure to read it: this checkpoint's fault
            log.warning("cannot load checkpoint %s", src, exc_info=True)
            self._failed(src, f"{type(e).__name__}: {e}")
            raise BadInput(f"cannot load checkpoint {src}: {type(e).__name__}: {e}",
                           field="checkpoint") from None
        finally:
            self._loading = None
        self._last_error = None
        return old, served

    async def _stop_following(self) -> None:
        if self._kafka is not None:
            await self._kafka.stop()
            self._kafka = None
        if self.replica is not None:
            await self.replica.stop()
            self.replica = None

    async def _follow(self, served: Served) -> None:
        """(Re)start following the training job's updates into ``served``'s table: from
        Kafka when the job has brokers (``updates``), else over RPC from the servers."""
        await self._stop_following()
        assert served.table is not None
        loop = asyncio.get_running_loop()
        positions = served.dense.manifest.model_updates
        self.replica = Replica(
            self.roles, served.table.store, positions,
            execute=lambda fn: loop.run_in_executor(self._pool, fn),
            on_dense=self._on_dense, dense_step=served.dense.step,
            metrics=self.replica_metrics,
            dense_event_time=_event_time(served.dense.manifest.extra.get("trained_through")),
            dense_lineage=_lineage(served.dense.manifest.extra.get("dense_lineage")))
        kafka = self.settings.updates_kafka()
        if kafka is None:
            self.replica.start()
            return
        bootstrap, topic, security, idempotent = kafka
        self._kafka = KafkaFollow(self.replica, bootstrap, topic, self.replica.positions,
                                  security_kwargs=security, enable_idempotence=idempotent)
        await self._kafka.start()
        self.replica.start(over_rpc=False)

    async def _on_dense(self, state: dict[str, Any], step: int,
                        event_time: float | None) -> None:
        """Swap in a newer dense model: built off the loop into a copy of the served
        module, then one reference assignment (a micro-batch reads it once)."""
        served = self._served
        assert served is not None
        module = await asyncio.get_running_loop().run_in_executor(
            None, rebuilt, served.dense.module, state)
        dense = dataclasses.replace(served.dense, module=module, step=step)
        if self._served is served:   # not replaced by a reload meanwhile
            self._served = dataclasses.replace(served, dense=dense)

    def _failed(self, src: str, message: str) -> None:
        self._last_error = f"{src}: {message}"
        self.metrics.reloads.labels("failed").inc()

    # ----------------------------------------------------------------- predict
    async def predict(self, batch: PersiaBatch) -> Prediction:
        """Score one validated batch (micro-batched with concurrent requests). Its
        features are put in the served model's order by name first (:mod:`stream_persia.api.inputs`),
        so requests that differ only in their order share forward passes.

        Raises:
            BadInput: a slot or non-ID feature the model does not take or lacks (names it).
        """
        model = self._served
        if model is None:
            raise NotReady(self.not_ready_reason(), hint="POST /v1/model/reload with a "
                           "checkpoint, or start the API with PERSIA_API_MODEL")
        batch = model.inputs.arrange(batch)
        served = None
        if self.source == "workers":
            served = await self._lookup(batch)
        job = Job(signature(batch), batch.batch_size, (batch, served))
        self.metrics.predict_rows.observe(batch.batch_size)
        future = self.batcher.submit(job)
        try:
            prediction = await asyncio.wait_for(future, self.settings.predict_timeout_ms / 1000)
        except TimeoutError:
            raise NotReady(f"the prediction took longer than "
                           f"{self.settings.predict_timeout_ms} ms",
                           hint="the API is overloaded; retry or add replicas") from None
        self.metrics.missing_ids.inc(prediction.missing)
        return prediction

    async def _lookup(self, batch: PersiaBatch) -> ServedBatch:
        workers = self.roles.require(WORKER)
        start = next(self._rr)
        params = {"batch": batch.to_wire(), "mode": "infer"}
        last: PeerUnavailable | None = None
        for i in range(len(workers)):   # fail over to the next worker if one is down
            role = workers[(start + i) % len(workers)]
            try:
                reply = await self.roles.call(role, "lookup_batch", params)
            except PeerUnavailable as e:
                last = e
                continue
            served = ServedBatch.from_wire(reply)   # BadInput naming a malformed field
            if served.batch_size != batch.batch_size:
                # another batch's rows: concatenated with the other requests of a
                # micro-batch, every answer after it would be shifted
                raise RemoteError(f"{role.peer} answered lookup_batch with "
                                  f"{served.batch_size} rows for a request of "
                                  f"{batch.batch_size}", field="batch_size",
                                  hint="the embedding worker is not of this job or version")
            return served
        assert last is not None
        raise last

    async def _run(self, jobs: list[Job]) -> None:
        served = self._served     # one model per micro-batch, even if a reload lands now
        assert served is not None
        # ... and the trained_through of that model, taken with it on the loop: read after
        # the forward it could name a dense model or a checkpoint that landed meanwhile.
        through = self._trained_through(served)
        loop = asyncio.get_running_loop()
        self.metrics.batch_requests.observe(len(jobs))
        rows = sum(j.rows for j in jobs)
        self.metrics.batch_rows.observe(rows)
        if rows <= self.settings.inline_max_rows and self.replica is None:
            # Small enough (well under a millisecond) to run on the loop: handing it to the
            # thread costs more than that in wake-ups and GIL hand-offs. Not on a replica:
            # its table is written on the forward thread, so it is read there too.
            results = self._compute_safe(served, jobs, through)
        else:
            results = await loop.run_in_executor(self._pool, self._compute_safe, served, jobs,
                                                 through)
        for job, result in zip(jobs, results, strict=True):
            if job.future.done():
                continue
            if isinstance(result, BaseException):
                job.future.set_exception(result)
            else:
                job.future.set_result(result)

    def _trained_through(self, served: Served) -> float | None:
        """The replica's ``trained_through`` if it follows ``served``'s table (None while a
        reload is between models): dense swaps and table writes happen on the loop and on
        the forward thread, so at the start of a micro-batch the answer reflects at least
        that much."""
        replica = self.replica
        if replica is None or served.table is None or replica.store is not served.table.store:
            return None
        return replica.trained_through

    def _compute_safe(self, served: Served, jobs: list[Job], through: float | None
                      ) -> Sequence[Prediction | Exception]:
        try:
            return self._compute(served, jobs, through)
        except BadInput as e:
            if len(jobs) == 1:
                return [e]
        except Exception as e:   # a model or store bug: fail this micro-batch, keep serving
            log.exception("inference failed for a micro-batch of %d request(s)", len(jobs))
            return [e] * len(jobs)
        out: list[Prediction | Exception] = []
        for job in jobs:   # isolate the request(s) the model rejects
            try:
                out.extend(self._compute(served, [job], through))
            except Exception as e:
                out.append(e)
        return out

    def _compute(self, served: Served, jobs: list[Job], through: float | None
                 ) -> list[Prediction]:
        # Arranged for the model served when they arrived: a reload since may have
        # brought another order (arranging is a no-op otherwise).
        batches = [served.inputs.arrange(j.payload[0]) for j in jobs]
        if served.table is not None:
            embeddings, missing = served.table.embed(batches)
        else:
            replies: list[ServedBatch] = [j.payload[1] for j in jobs]
            embeddings = cat_slots([served_tensors(served.inputs.order_embeddings(r.embeddings))
                                    for r in replies])
            missing = [r.missing for r in replies]
        rows = [b.batch_size for b in batches]
        total = sum(rows)
        heads = served.dense.forward(non_id_tensors(batches), embeddings, total)
        out, start = [], 0
        for n, miss in zip(rows, missing, strict=True):
            part = {name: a[start:start + n] for name, a in heads.items()}
            out.append(Prediction(served.version, part, int(miss), n, served.dense.step,
                                  through))
            start += n
        return out


def _event_time(value: Any) -> float | None:
    """A manifest's ``extra["trained_through"]`` if it is a valid event time."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value) if np.isfinite(value) and value >= 0 else None


def _lineage(value: Any) -> int:
    """A manifest's ``extra["dense_lineage"]`` if it is a valid lineage, else the legacy
    one (the replica then takes the published model of any other lineage)."""
    try:
        return lineage_or_legacy(value, "dense_lineage")
    except BadInput as e:
        log.warning("checkpoint: %s; following the dense model as of the legacy lineage",
                    e.message)
        return LEGACY_LINEAGE


def predictions_json(p: Prediction) -> list[dict[str, Any]]:
    """Per sample: head → a float (one value per sample) or nested lists. JSON has no NaN
    or infinity, so a model output that is not finite becomes null."""
    names = list(p.heads)
    cols = []
    for a in p.heads.values():
        if a.ndim == 1 or (a.ndim == 2 and a.shape[1] == 1):
            a = a.reshape(p.rows)
        finite = np.isfinite(a)
        if not finite.all():
            a = a.astype(object)
            a[~finite] = None
        cols.append(a.tolist())
    return [dict(zip(names, vals, strict=True)) for vals in zip(*cols, strict=True)]

