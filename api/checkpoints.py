"""Checkpoints started, inspected and restored over HTTP.

Starting one returns at once with an id; a background task owned by :class:`Checkpoints`
takes it in one of two ways, both giving the consistent cut of DESIGN §7 (every batch
consumed before it applied, none after it, offsets pointing at the first batch after it):

- **NN ranks stepping** (a recent step's heartbeat in the checkpoint mailbox on embedding
  worker 0, :mod:`stream_persia.worker.mailbox`): the request goes to the mailbox;
  ``TrainCtx`` picks it up after its next ``backward`` (with one rank, also while its
  DataLoader waits for a batch) and every rank runs ``dump_checkpoint(dst)``
  at that same step, exactly as a checkpoint taken from ``train.py``. The API follows
  the progress rank 0 reports. When the ranks stop training before taking it (their
  context exits, or no step ends within the pickup time), the API takes it as below.
- **No NN rank stepping** (none attached, or rank 0 alive but between steps: waiting for
  a paused stream with several ranks, evaluating): nothing is training, so the API takes
  the cut itself. It checks
  that no batch is in flight on any worker, has every server dump its shard, checks again
  that nothing trained meanwhile (no batch in flight, no update applied, no row admitted
  or evicted), and commits with the workers' frontier offsets. When this job's newest
  checkpoint under the checkpoint directory is at the very same stream position (a Kafka
  stream whose offsets did not move since), its dense files are carried over
  (``extra.dense_from``, with its ``trained_through``) and the result serves too;
  otherwise nothing proves which dense state matches these embeddings, and the
  checkpoint holds the embeddings alone (``extra.embeddings_only``).
  If training starts meanwhile the attempt fails (nothing is published) and can be retried.

Both ways take the same cut (:func:`stream_persia.checkpoint.read_cut`; workers that mix
Kafka and direct ingest refuse it) and record the same ``config_digest`` (the embedding
schema, :mod:`stream_persia.checkpoint.digest`).

Restore refuses a checkpoint whose ``config_digest`` is not this job's embedding schema
(409 naming what differs; one without a digest is restored unchecked). It loads the
embedding rows into every server (any server count) and resets every
worker's stream to the checkpoint's offsets; it refuses while NN rank 0 heartbeats (any
heartbeat, stepping or only alive) or
batches are in flight, since NN ranks that are training would keep their own dense state. Batches whose push
failed and embedding servers that restarted (their tables lost) do not stop it: a restore
is the way back from both. NN ranks load the
dense model themselves (``load_checkpoint``) when they start again. One thing at a time:
a restore is refused (409) while a checkpoint is being taken or another one restored,
and a checkpoint while one is being taken or restored.

Size: one module because :class:`Checkpoints` is one state machine: listing, deleting,
taking (through the NN ranks or directly) and restoring share its in-use set, its
restore in progress and its job history (a checkpoint being taken or restored cannot be
deleted, two restores never interleave). Split across modules, that state would have to be passed around unguarded.
"""

from __future__ import annotations

import asyncio
import builtins  # Checkpoints.list shadows list in the class body
import collections
import contextlib
import logging
import os
import secrets
import threading
import time
from collections.abc import Collection, Iterator, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any

from stream_persia.api.checkpoint_root import CheckpointDir
from stream_persia.api.mailbox import REPORT_TIMEOUT_S, TERMINAL, MailboxClient
from stream_persia.api.roles import SERVER, WORKER, Roles
from stream_persia.api.settings import ApiSettings

from stream_persia.checkpoint import (
    CheckpointWriter,
    Cut,
    Manifest,
    check_config,
    delete_checkpoint,
    dependents,
    list_checkpoints,
    load_embeddings,
    prune_checkpoints,
    read_cut,
    read_manifest,
)
from stream_persia.checkpoint._common import Location
from stream_persia.checkpoint.cut import check_nothing_in_flight
from stream_persia.checkpoint.reader import newest_last
from stream_persia.errors import BadInput, ConfigError, DataLost, Misuse, PersiaError

__all__ = ["Checkpoints", "CheckpointJob", "new_checkpoint_id"]

log = logging.getLogger(__name__)

POLL_S = 0.1
SHARD_TIMEOUT_MS = 30 * 60 * 1000
_HISTORY = 64


def new_checkpoint_id() -> str:
    stamp = datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    return f"ckpt-{stamp}-{secrets.token_hex(3)}"


@dataclass(eq=False)
class CheckpointJob:
    """A checkpoint started through this API."""

    id: str
    dst: str
    state: str = "pending"
    by: str | None = None
    step: int | None = None
    progress: dict[str, Any] = field(default_factory=dict)
    error: str | None = None
    requested_at: float = field(default_factory=time.time)
    finished_at: float | None = None
    manifest: dict[str, Any] | None = None
    task: asyncio.Task | None = field(default=None, repr=False)

    def info(self) -> dict[str, Any]:
        chain = (self.manifest or {}).get("chain") or {}
        files = (self.manifest or {}).get("files")
        return {"id": self.id, "state": self.state, "dst": self.dst, "by": self.by,
                "step": self.step, "progress": dict(self.progress), "error": self.error,
                "requested_at": self.requested_at, "finished_at": self.finished_at,
                "parent": chain.get("parent"), "base": chain.get("base"),
                "depth": chain.get("depth"),
                "bytes": None if files is None else _bytes(files),
                "manifest": self.manifest}


def _bytes(files: dict[str, Any]) -> int:
    """Bytes of a checkpoint's own files, as its manifest records them."""
    return sum(int(e["bytes"]) for e in files.values())


def _manifest_info(m: Manifest) -> dict[str, Any]:
    from stream_persia.api.model import checkpoint_id

    created = datetime.fromisoformat(m.created_at.replace("Z", "+00:00")).timestamp()
    chain = m.chain or {}
    return {"id": checkpoint_id(m), "state": "done", "dst": m.path or "",
            "by": m.extra.get("by"), "step": m.step,
            "progress": {"phase": "committed"}, "error": None, "requested_at": None,
            "finished_at": created, "parent": chain.get("parent"), "base": chain.get("base"),
            "depth": chain.get("depth"), "bytes": _bytes(m.files), "manifest": m.to_dict()}


class Checkpoints:
    """Starts, follows, lists and restores checkpoints (owned by the app's lifespan).

    Args:
        settings: the API settings (``checkpoint_dir`` is where new ones go).
        roles: clients of the workers (mailbox on replica 0) and servers.
        predictor: reloaded after a restore when asked.
        mailbox: override of the mailbox client (default: worker replica 0).
        timeout_s: the longest a checkpoint may take, either way.
        pickup_ttl_s: how long NN rank 0 has to take a request from the mailbox.
        report_timeout_s: once NN rank 0 took it, the longest it may go without reporting
            (it sends keepalives well within this) before the checkpoint fails as lost.

    Raises:
        ConfigError: a time limit is not a number of seconds > 0.
    """

    def __init__(self, settings: ApiSettings, roles: Roles, predictor: Any = None, *,
                 mailbox: MailboxClient | None = None, timeout_s: float = 3600.0,
                 pickup_ttl_s: float = 60.0, report_timeout_s: float = REPORT_TIMEOUT_S):
        for name, value in (("timeout_s", timeout_s), ("pickup_ttl_s", pickup_ttl_s),
                            ("report_timeout_s", report_timeout_s)):
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not (
                    0 < value < float("inf")):
                raise ConfigError(f"{name} must be a number of seconds > 0, got {value!r}",
                                  field=name)
        self.settings = settings
        self.roles = roles
        self.predictor = predictor
        if mailbox is None and roles.workers:
            first = roles.workers[0]
            mailbox = MailboxClient(lambda m, p: roles.call(first, m, p))
        self.mailbox = mailbox
        self.timeout_s = timeout_s
        self.pickup_ttl_s = pickup_ttl_s
        self.report_timeout_s = report_timeout_s
        self.jobs: dict[str, CheckpointJob] = {}
        self.root = CheckpointDir(settings.checkpoint_dir)
        # Checkpoints being read here (restored, loaded to serve, or the base a cut
        # copies), or deleted. Retention decides in its thread: both sets change only
        # under this lock, so a checkpoint is either pinned (and kept) or being deleted
        # (and a restore or reload of it refused), never both.
        self._lock = threading.RLock()
        self._using: collections.Counter[str] = collections.Counter()
        self._deleting: set[str] = set()
        self._foreign: set[str | None] = set()   # other jobs' checkpoints retention saw
        # The checkpoint being restored: one restore at a time, and no checkpoint taken
        # meanwhile (set and tested with no await in between).
        self._restoring: str | None = None
        self.job_name = settings.job_name
        if predictor is not None and hasattr(predictor, "pin"):
            predictor.pin = self.pin   # a reload pins what it loads

    async def stop(self) -> None:
        tasks = [j.task for j in self.jobs.values() if j.task is not None and not j.task.done()]
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    # ----------------------------------------------------------------- queries
    async def training(self) -> dict[str, Any] | None:
        """NN rank 0's last heartbeat (``step``, ``attached``), or None."""
        if self.mailbox is None:
            return None
        try:
            return await self.mailbox.nn_status()
        except PersiaError:
            return None

    async def last(self) -> dict[str, Any] | None:
        """This job's newest complete checkpoint (``/v1/status``): another job sharing
        the directory writes checkpoints this job would never restore or serve."""
        if self.settings.checkpoint_dir is None:
            return None
        found = [m for m in await self._complete() if m.job == self.job_name]
        return _manifest_info(max(found, key=newest_last)) if found else None

    async def _complete(self) -> list[Manifest]:
        """Complete checkpoints right under the directory, oldest step first, leaving out
        symbolic links that lead out of it (their manifests are not ours to show or use)."""
        if self.settings.checkpoint_dir is None:
            return []
        found = await asyncio.to_thread(list_checkpoints, self.settings.checkpoint_dir)
        return [m for m in found if self.root.id_of(m.path) is not None]

    async def list(self) -> list[dict[str, Any]]:
        """Complete checkpoints under the directory (oldest step first), then the ones
        this API is still taking or failed to take. A symbolic link that leads out of the
        directory is not listed."""
        found = [_manifest_info(m) for m in await self._complete()]
        on_disk = {f["id"] for f in found}
        return found + [j.info() for j in self.jobs.values() if j.id not in on_disk
                        and j.state != "done"]

    async def get(self, ident: str) -> dict[str, Any] | None:
        """One checkpoint's info (None: unknown).

        Raises:
            BadInput: ``ident`` is a symbolic link leading out of the directory.
        """
        job = self.jobs.get(ident)
        if job is not None:
            return job.info()
        src = self.resolve(ident)
        if src is None:
            return None
        try:
            return _manifest_info(await asyncio.to_thread(read_manifest, src))
        except BadInput:
            return None

    def resolve(self, ident: str) -> str | None:
        """Where the checkpoint with id ``ident`` lives (None: no checkpoint directory).

        Raises:
            BadInput: ``ident`` is not an id, or a symbolic link out of the directory.
        """
        job = self.jobs.get(ident)
        if job is not None:
            return job.dst
        if self.settings.checkpoint_dir is None:
            return None
        return self.root.resolve(ident, "checkpoint")

    # ----------------------------------------------------------------- retention
    def in_use(self) -> dict[str, str]:
        """Ids of the checkpoints that must not be deleted now → why (thread-safe:
        retention asks from its thread)."""
        out: dict[str, str] = {}
        with self._lock:
            using, deleting = builtins.list(self._using), builtins.list(self._deleting)
        for ident in using:
            out.setdefault(ident, "being restored, loaded or copied")
        if self.predictor is not None:
            for path, why in self.predictor.in_use().items():
                served = self.root.id_of(path)
                if served is not None:
                    out.setdefault(served, why)
        for ident in deleting:
            out.setdefault(ident, "being deleted")
        for job in builtins.list(self.jobs.values()):
            if job.state not in TERMINAL:
                out.setdefault(job.id, "being taken")
        return out

    def _pin(self, ident: str) -> None:
        """Count ``ident`` in use: neither retention nor a request deletes it until
        :meth:`_release`.

        Raises:
            Misuse: it is being deleted (its files may already be gone).
        """
        with self._lock:
            if ident in self._deleting:
                raise Misuse(f"checkpoint {ident!r} is being deleted", field="checkpoint",
                             hint="choose another checkpoint")
            self._using[ident] += 1

    def _release(self, ident: str) -> None:
        with self._lock:
            self._using[ident] -= 1
            if self._using[ident] <= 0:
                del self._using[ident]

    @contextlib.contextmanager
    def pin(self, path: str) -> Iterator[None]:
        """Keep the checkpoint at ``path`` from being deleted while the block runs (the
        predictor's reload); a path that is not right under the directory is not ours
        to delete and needs no pin.

        Raises:
            Misuse: it is being deleted.
        """
        ident = self.root.id_of(path)
        if ident is None:
            yield
            return
        self._pin(ident)
        try:
            yield
        finally:
            self._release(ident)

    def _mark_deleting(self, ident: str, users: Collection[str]) -> str | None:
        """In one step against the live in-use set: why ``ident`` cannot be deleted now
        (one of ``users``, the checkpoints deleting it would break, is in use), or None,
        and then it and ``users`` are marked as being deleted (restores and reloads of
        them are refused: without ``ident`` they cannot load) until
        :meth:`_unmark_deleting`."""
        with self._lock:
            busy = self.in_use()
            why = next((f"{u!r} is {busy[u]}" for u in sorted(users) if u in busy), None)
            if why is None:
                self._deleting.update({ident, *users})
            return why

    def _unmark_deleting(self, ident: str, users: Collection[str] = ()) -> None:
        with self._lock:
            self._deleting.difference_update({ident, *users})

    @contextlib.contextmanager
    def _retention_guard(self, name: str, users: Collection[str]) -> Iterator[str | None]:
        """:func:`prune_checkpoints`' ``guard`` (called in its thread)."""
        why = self._mark_deleting(name, users)
        if why is not None:
            yield why
            return
        try:
            yield None
        finally:
            self._unmark_deleting(name, users)

    async def delete(self, ident: str) -> dict[str, Any] | None:
        """Delete the checkpoint ``ident`` from the directory (None: there is none).

        Raises:
            Misuse: it is being taken, restored or served, or a patch needs it (one
                published while it was being deleted included: it is then kept).
            BadInput: ``ident`` is a symbolic link (its target may be another checkpoint,
                or lie outside the directory).
        """
        src = self.resolve(ident)
        if src is None:
            return None
        self._refuse_if_in_use(ident)
        if self.root.local and os.path.islink(os.path.join(self.root.base, ident)):
            raise BadInput(f"checkpoint {ident!r} is a symbolic link; delete it by hand",
                           field="checkpoint")
        try:
            manifest = await asyncio.to_thread(read_manifest, src)
        except BadInput:
            return None
        needed = await asyncio.to_thread(dependents, src.rstrip("/").rsplit("/", 1)[0], ident)
        if needed:
            raise Misuse(f"checkpoint {ident!r} is the base or a patch that incremental "
                         f"checkpoint(s) {needed[:5]} need to restore: it cannot be deleted "
                         "while they exist", field="checkpoint",
                         hint="delete the patches that depend on it first (newest first)")
        # Again, in one step with marking it: a restore or a reload may have begun meanwhile;
        # one that begins from now on is refused.
        busy = self._mark_deleting(ident, (ident,))
        if busy is not None:
            raise Misuse(f"checkpoint {busy}: it cannot be deleted now", field="checkpoint",
                         hint="reload another model or wait until it is no longer in use")
        try:
            await asyncio.to_thread(delete_checkpoint, src)
        except OSError as e:
            raise Misuse(f"checkpoint {ident!r} could not be deleted: {e}",
                         field="checkpoint") from None
        finally:
            self._unmark_deleting(ident)
        self.jobs.pop(ident, None)
        self._count_deleted("request", 1)
        log.info("deleted checkpoint %s (step %d) on request", src, manifest.step)
        return {"id": ident, "deleted": True, "dst": src}

    def _refuse_if_in_use(self, ident: str) -> None:
        busy = self.in_use().get(ident)
        if busy is not None:
            raise Misuse(f"checkpoint {ident!r} is {busy}: it cannot be deleted now",
                         field="checkpoint",
                         hint="reload another model or wait until it is no longer in use")

    async def _retain(self, job: CheckpointJob) -> None:
        """Apply ``keep_checkpoints`` after ``job`` committed (never deleting it, nor any
        checkpoint in use); a failure is logged, the checkpoint stays done."""
        keep = self.settings.keep_checkpoints
        if keep == 0 or self.settings.checkpoint_dir is None:
            return
        protect = set(self.in_use()) | {job.id}
        try:
            deleted = await asyncio.to_thread(
                prune_checkpoints, self.settings.checkpoint_dir, keep, protect,
                select=self._ours, guard=self._retention_guard)
        except Exception as e:   # retention must never fail the checkpoint it follows
            log.warning("retention after checkpoint %s failed: %s", job.id, e)
            return
        for ident in deleted:
            self.jobs.pop(ident, None)
        self._count_deleted("retention", len(deleted))

    def _ours(self, m: Manifest) -> bool:
        """Whether retention counts (and may delete) ``m``: a checkpoint of this job. Another
        job's under the same directory is left alone (said once per checkpoint)."""
        if m.job == self.job_name:
            return True
        if m.path not in self._foreign and len(self._foreign) < 1024:   # bounded: said once
            self._foreign.add(m.path)
            log.warning("retention: checkpoint %s is of job %r, not this job's (%r): it is "
                        "neither counted in keep_checkpoints nor deleted (give each job its "
                        "own checkpoint directory)", m.path, m.job, self.job_name)
        return False

    def _count_deleted(self, reason: str, n: int) -> None:
        metrics = getattr(self.predictor, "metrics", None)
        if metrics is not None and n:
            metrics.checkpoints_deleted.labels(reason).inc(n)

    # ----------------------------------------------------------------- start
    async def start(self, ident: str | None = None) -> CheckpointJob:
        """Start a checkpoint named ``ident`` under the checkpoint directory; returns its
        job at once (202).

        Raises:
            Misuse: another checkpoint is being taken, the id is taken, no checkpoint
                directory is configured, or the API has no embedding servers.
        """
        self.roles.require(SERVER)
        if self.settings.checkpoint_dir is None:
            raise Misuse("no checkpoint directory is configured", field="checkpoint_dir",
                         hint="set PERSIA_CHECKPOINT_DIR (or --checkpoint-dir)")
        self._check_startable()
        ident = ident or new_checkpoint_id()
        dst = f"{self.settings.checkpoint_dir.rstrip('/')}/{ident}"
        if ident in self.jobs or await asyncio.to_thread(_exists, dst):
            raise Misuse(f"checkpoint {ident!r} already exists", field="id",
                         hint="choose another id, or leave it out for a fresh one")
        self._check_startable()   # again: another request may have started one meanwhile
        if ident in self.jobs:
            raise Misuse(f"checkpoint {ident!r} already exists", field="id",
                         hint="choose another id, or leave it out for a fresh one")
        job = self.jobs[ident] = CheckpointJob(ident, dst)
        while len(self.jobs) > _HISTORY:
            oldest = next(iter(self.jobs))
            if self.jobs[oldest].state not in TERMINAL:
                break
            del self.jobs[oldest]
        job.task = asyncio.create_task(self._drive(job), name=f"checkpoint-{ident}")
        return job

    def _check_startable(self) -> None:
        """Misuse while a checkpoint is being taken or restored (no await: the caller
        starts its own before yielding)."""
        active = next((j for j in self.jobs.values() if j.state not in TERMINAL), None)
        if active is not None:
            raise Misuse(f"checkpoint {active.id} is {active.state}; one at a time",
                         hint=f"follow it at /v1/checkpoints/{active.id}")
        if self._restoring is not None:
            raise Misuse(f"checkpoint {self._restoring!r} is being restored: a checkpoint "
                         "taken now could hold its rows with the stream position from "
                         "before it", hint="start the checkpoint once the restore returned")

    async def _drive(self, job: CheckpointJob) -> None:
        try:
            hb = await self.training()
            # A rank that steps takes it at its next step; one alive but not stepping
            # (waiting for a paused stream with several ranks, evaluating) trains nothing:
            # the API cuts it now (the cut is refused if training moves meanwhile).
            if hb is not None and hb.get("stepping", hb.get("attached")):
                job.by = "nn"
                await asyncio.wait_for(self._through_nn(job), self.timeout_s)
                if job.state == "failed" and job.step is None:
                    await self._after_nn_left(job)
            else:
                job.by = "api"
                await asyncio.wait_for(self._by_api(job, hb), self.timeout_s)
            if job.state == "done":
                await self._retain(job)
        except asyncio.CancelledError:
            job.state, job.error = "failed", "the API stopped while taking the checkpoint"
            raise
        except TimeoutError:
            job.state, job.error = "failed", f"not finished within {self.timeout_s:.0f} s"
        except PersiaError as e:
            job.state, job.error = "failed", e.message
        except Exception as e:   # a bug: keep the API up, report it on the job
            log.exception("checkpoint %s failed", job.id)
            job.state, job.error = "failed", f"{type(e).__name__}: {e}"
        finally:
            job.finished_at = time.time()
            if job.state == "failed":
                log.warning("checkpoint %s failed: %s", job.id, job.error)

    async def _through_nn(self, job: CheckpointJob) -> None:
        assert self.mailbox is not None
        job.progress = {"phase": "waiting for NN rank 0 at its next step boundary"}
        await self.mailbox.request(job.id, job.dst, self.pickup_ttl_s, self.report_timeout_s)
        while True:
            rec = await self.mailbox.status(job.id)
            if rec is None:
                raise Misuse(f"the checkpoint mailbox forgot request {job.id}",
                             hint="embedding worker 0 restarted; start the checkpoint again")
            job.state = "running" if rec["state"] == "pending" else rec["state"]
            job.step = rec.get("step")
            job.progress = rec.get("progress") or job.progress
            if rec["state"] in TERMINAL:
                job.manifest = rec.get("manifest")
                job.error = rec.get("error")
                return
            await asyncio.sleep(POLL_S)

    async def _after_nn_left(self, job: CheckpointJob) -> None:
        """The NN ranks never took the request (they stopped training, or no step ended
        within the pickup time): take the cut here, which is safe whenever nothing is in
        flight (:meth:`_by_api` checks)."""
        why = job.error
        log.info("checkpoint %s: the NN ranks did not take it (%s); the API takes it",
                 job.id, why)
        job.by, job.state, job.error = "api", "running", None
        try:
            await self._by_api(job, await self.training())
        except PersiaError as e:
            job.state = "failed"
            job.error = (f"the NN ranks did not take it ({why}), and the API could not "
                         f"either: {e.message}")

    async def _call_workers(self, method: str, params: Any = None) -> Sequence[dict[str, Any]]:
        workers = self.roles.workers
        return await self.roles.fanout(workers, method, params) if workers else []

    async def _cut(self, *, fingerprints: bool = True) -> Cut:
        """The workers' stream cut (:func:`stream_persia.checkpoint.read_cut`: refused
        while something is in flight, a batch is only partly applied, a server restarted
        with an empty table, or the workers mix Kafka and direct ingest), with the
        fingerprints of the records below its offsets unless ``fingerprints`` is False."""
        return await read_cut(self._call_workers, [w.peer for w in self.roles.workers],
                              fingerprints=fingerprints)

    async def _check_restorable(self) -> None:
        """Refuse a restore while NN ranks may still be training: batches in flight that
        did not fail. Failed batches and servers that restarted are what a restore is
        for: the load replaces every table and reset_stream drops those batches."""
        check_nothing_in_flight(await self._call_workers("frontier"),
                                [w.peer for w in self.roles.workers], failed_in_flight=False)

    async def _check_no_nn_rank(self, ident: str) -> None:
        """Refuse a restore while NN rank 0 heartbeats (attached): between two steps it
        has nothing in flight, and it would go on training its own dense model over the
        restored rows and rewound stream. A rank that stopped (detached) or went silent
        (killed) does not stop it; one waiting for a paused stream heartbeats from the
        DataLoader's wait, so it does."""
        hb = await self.training()
        if hb is not None and hb.get("attached"):
            raise Misuse(f"checkpoint {ident!r} cannot be restored while NN ranks train "
                         f"(rank 0 at step {hb.get('step')}, last heard "
                         f"{float(hb.get('age_s') or 0.0):.1f} s ago): they would go on with "
                         f"their own dense model over the restored rows", field="checkpoint",
                         hint="stop the NN workers, restore, then start them with "
                              "load_checkpoint of this checkpoint")

    async def _updates(self) -> builtins.list[Any]:
        stats = await self.roles.fanout(self.roles.servers, "stats")
        # Training changes these, and a load (its own counts are not in them: "loads" tells
        # it) or a clear (which counts in none of the others); inference lookups
        # (eval/infer) never do.
        return [(s.get("updates"), s.get("admissions"), s.get("evictions"), s.get("loads"),
                 s.get("clears")) for s in stats]

    async def _by_api(self, job: CheckpointJob, hb: dict[str, Any] | None) -> None:
        servers = self.roles.require(SERVER)
        job.state = "running"
        job.progress = {"phase": "checking that nothing is in flight"}
        await self._cut(fingerprints=False)
        updates = await self._updates()
        # this job's newest only: another job's at the same offsets (of a topic both read)
        # holds another model
        complete = [m for m in await self._complete() if m.job == self.job_name]
        base = max(complete, key=newest_last) if complete else None
        base_id = self.root.id_of(base.path) if base is not None else None
        if base_id is not None:
            try:   # its dense files may be copied: not deleted meanwhile
                self._pin(base_id)
            except Misuse:   # being deleted: nothing to carry from it
                base, base_id = None, None
        try:
            await self._cut_by_api(job, hb, base, servers, updates)
        finally:
            if base_id is not None:
                self._release(base_id)

    async def _cut_by_api(self, job: CheckpointJob, hb: dict[str, Any] | None,
                          base: Manifest | None, servers: builtins.list[Any],
                          updates: builtins.list[Any]) -> None:
        writer = await asyncio.to_thread(CheckpointWriter, job.dst)
        try:
            job.progress = {"phase": "dumping embeddings", "done": 0, "total": len(servers)}
            await writer.dump_embeddings([s.client for s in servers],
                                         timeout_ms=SHARD_TIMEOUT_MS)
            job.progress = {"phase": "checking the cut", "done": len(servers),
                            "total": len(servers)}
            cut = await self._cut()   # raises if a batch went in flight meanwhile
            if await self._updates() != updates:
                raise Misuse("training moved (or a load or clear changed the servers' "
                             "tables) while the embeddings were dumped, so the cut is "
                             "not consistent; nothing was published",
                             hint="retry; an NN rank that trains must report to the "
                                  "checkpoint mailbox")
            offsets, stream = cut.offsets, cut.stream
            # The dense model of the newest checkpoint belongs to this cut only if nothing
            # was trained since: provable for a Kafka stream (same offsets), never for a
            # direct one. Otherwise the checkpoint holds the embeddings alone.
            same = (base is not None and stream == "kafka" and base.stream == "kafka"
                    and base.offsets == offsets)
            carried = await asyncio.to_thread(_carry_dense, writer, base) if same else None
            if carried is not None and base is not None:   # carried: base is the newest
                step = base.step
            else:
                step = int(hb["step"]) if hb and isinstance(hb.get("step"), int) else (
                    base.step if base is not None else 0)
            job.progress = {"phase": "committing"}
            extra = {"id": job.id, "by": "api", "dense_from": carried,
                     "embeddings_only": carried is None}
            if carried is not None and base is not None:   # what serving its model needs,
                # and the dense model's event time: a serving replica restored from this
                # checkpoint starts trained through it (without it, trained_through stays
                # unknown until training moves again)
                extra |= {k: base.extra[k] for k in ("heads", "inputs", "label_names",
                                                      "trained_through", "dense_lineage")
                          if k in base.extra}
            manifest = await asyncio.to_thread(
                lambda: writer.commit(job=self.job_name, step=step, offsets=offsets,
                                      stream=stream, schema=self.settings.schema,
                                      extra=extra, fingerprints=cut.fingerprints))
        except BaseException:
            await asyncio.to_thread(writer.abort)
            raise
        job.step, job.manifest = manifest.step, manifest.to_dict()
        job.state, job.progress = "done", {"phase": "committed"}
        if stream == "kafka" and offsets:
            parts = next(iter(offsets.values()))
            with contextlib.suppress(PersiaError):   # monitoring only; the manifest rules
                await self.roles.fanout(self.roles.workers, "commit_offsets",
                                        {"offsets": parts})

    # ----------------------------------------------------------------- restore
    async def restore(self, ident: str, reload_model: bool) -> dict[str, Any]:
        """Load a checkpoint back into the job (servers and stream position).

        Raises:
            Misuse: NN ranks are attached, batches are in flight, a checkpoint is being
                taken or another one restored, or the checkpoint
                was trained with another embedding schema than this job's (its
                ``config_digest``; the message names what differs).
            BadInput: not a checkpoint, or its stream offsets are not in the topic.
            DataLost: the brokers deleted data from its stream offsets on (retention);
                nothing was changed.
        """
        src = self.resolve(ident)
        if src is None:
            raise BadInput(f"unknown checkpoint {ident!r}", field="checkpoint")
        active = next((j for j in self.jobs.values() if j.state not in TERMINAL), None)
        if active is not None:
            raise Misuse(f"checkpoint {active.id} is being taken; restore after it finishes")
        if self._restoring is not None:
            # Two restores would interleave on the servers (a newer stage replaces an older
            # one) and the workers: both would answer 200 over the rows of one and, for a
            # Kafka stream, perhaps the offsets of the other.
            raise Misuse(f"checkpoint {self._restoring!r} is being restored; one restore at "
                         "a time", field="checkpoint",
                         hint="restore again once it returned")
        self._pin(ident)   # not deleted (by retention or a request) meanwhile
        self._restoring = ident
        try:
            return await self._restore(ident, src, reload_model)
        finally:
            self._release(ident)
            self._restoring = None

    async def _restore(self, ident: str, src: str, reload_model: bool) -> dict[str, Any]:
        manifest = await asyncio.to_thread(read_manifest, src)
        servers = self.roles.require(SERVER)
        # Rows of another embedding schema would be read as other slots or dims (409).
        check_config(manifest, self.settings.schema, f"checkpoint {ident!r}")
        await self._check_no_nn_rank(ident)
        await self._check_restorable()
        parts: dict[str, int] = {}
        prints: dict[str, Any] = {}
        replay = manifest.stream == "kafka" and bool(self.roles.workers)
        streams = manifest.offsets if replay else {}
        if replay and manifest.fingerprints is None:
            log.warning("checkpoint %s records no fingerprints of its Kafka offsets "
                        "(written before them): the topic's identity cannot be checked "
                        "(a topic deleted and created again would not be noticed)", ident)
        for topic, topic_parts in streams.items():
            parts.update(topic_parts)
            prints[topic] = (manifest.fingerprints or {}).get(topic, {})
            # Before anything is loaded: a stream the brokers cannot replay from there
            # (retention deleted it, or the topic is not the one the checkpoint was cut
            # from: recreated), or another topic than the workers read (a checkpoint of
            # another job), refuses the restore and leaves the job as it was.
            await self._stream_call(ident, "check_stream", topic, topic_parts, prints[topic])
        rows = await load_embeddings(src, [s.client for s in servers],
                                     timeout_ms=SHARD_TIMEOUT_MS)
        reset = 0
        for topic, topic_parts in streams.items():
            await self._stream_call(ident, "reset_stream", topic, topic_parts, prints[topic])
            reset = len(self.roles.workers)
        reloaded = False
        if reload_model and self.predictor is not None and (
                manifest.jit_filename is not None or manifest.dense_filename is not None):
            try:
                await self.predictor.load(src)
                reloaded = True
            except PersiaError as e:
                log.warning("restored %s but could not serve its model: %s", src, e)
        from stream_persia.api.model import checkpoint_id

        return {"id": checkpoint_id(manifest), "rows": rows, "offsets": parts,
                "workers_reset": reset, "model_reloaded": reloaded}


    async def _stream_call(self, ident: str, method: str, topic: str,
                           offsets: dict[str, int], fingerprints: dict[str, Any]) -> None:
        """``method`` (``check_stream``, ``reset_stream``) of ``topic``'s ``offsets`` (with
        the fingerprints of the records below them) on every worker, its refusal
        (DataLost: 409, BadInput: 422) said of the checkpoint."""
        try:
            await self.roles.fanout(self.roles.require(WORKER), method,
                                    {"offsets": offsets, "fingerprints": fingerprints,
                                     "topic": topic})
        except (DataLost, BadInput) as e:
            cls = DataLost if isinstance(e, DataLost) else BadInput
            err: PersiaError = cls(f"checkpoint {ident!r} cannot be restored: {e.message}",
                                   field="checkpoint", hint=e.hint)
            err.peer = getattr(e, "peer", None)  # type: ignore[attr-defined]
            raise err from None


def _exists(url: str) -> bool:
    loc = Location(url)
    return loc.fs.exists(loc.path)


def _carry_dense(writer: CheckpointWriter, base: Manifest | None) -> str | None:
    """Copy the dense files of ``base`` into ``writer`` (blocking); returns base's id, or
    None when it has none (an embeddings-only one: nothing carried)."""
    if base is None or (base.dense_filename is None and base.jit_filename is None):
        return None
    from stream_persia.api.model import checkpoint_id

    loc = Location(base.path or "")
    for name in (base.dense_filename, base.opt_filename, base.jit_filename):
        if name is not None:
            writer.write_bytes(name, loc.fs.cat_file(loc.join(name)))
    return checkpoint_id(base)
