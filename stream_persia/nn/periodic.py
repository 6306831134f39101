"""Periodic checkpoints: restore points taken from configuration, without the API.

``common_config.checkpointing_config`` (:class:`~stream_persia.config.CheckpointingConfig`)
turns them on with ``every_steps`` and/or ``every_s``. :class:`PeriodicCheckpoints`, built
into ``TrainCtx``, runs after every ``backward`` on every rank, after the checkpoint
mailbox (:mod:`~stream_persia.nn.checkpoint_poller`):

- **Who triggers.** NN rank 0 decides, at a step boundary: it knows the step, and every
  rank must run the cut at the same step. A checkpoint is due at every step that is a
  multiple of ``every_steps`` (the step count a restore brings back: the schedule is the
  job's, not the process's), or when ``every_s`` seconds have passed since the last one
  began (by steps or by time: whichever comes first). With several ranks, rank 0
  broadcasts its decision at the steps where one may be due (multiples of
  ``every_steps``, and every ``agree_steps`` steps when ``every_s`` is set), so every rank
  takes it at the same step; other steps cost a modulo.
- **The cut.** Every rank runs :func:`stream_persia.nn.checkpointing.dump_checkpoint`,
  the very cut of a checkpoint requested over HTTP or written by the script (Kafka
  offsets, the frontier, the update-stream offsets, dense model and optimizer, every
  embedding shard, committed atomically), with ``extra`` ``{"id": name, "by":
  "periodic"}``.
- **Names.** ``periodic-step-<step, 12 digits>-<UTC time, ms>-<4 hex>`` under ``periodic_dir``
  (default: the job's checkpoint directory, ``PERSIA_CHECKPOINT_DIR``, else the roles'
  root ``PERSIA_CHECKPOINT_ROOT``), so names sort by step, then time (a step reached
  again after a restore gets a new name). Each is also a valid API checkpoint id.
- **Retention.** After each one, rank 0 deletes the periodic checkpoints under
  ``periodic_dir`` beyond the ``keep_checkpoints`` newest
  (:func:`stream_persia.checkpoint.prune_checkpoints`, selecting ``extra.by ==
  "periodic"`` of this job, ``kafka.job_name``: other checkpoints in the same directory,
  another job's periodic ones included, are neither counted nor deleted).
- **Incremental.** With ``embedding_parameter_server_config.enable_incremental_update:
  true`` each periodic checkpoint after the first this process took is a patch of the
  previous one (only the embedding rows changed since: :mod:`stream_persia.checkpoint.
  manifest`'s ``chain``), and after ``full_every`` patches the next one is a full base.
  A patch the servers cannot take (one restarted or was restored, an eviction log
  overrun) is written as a full base instead, with the reason in the manifest and the
  log. Retention keeps every checkpoint a kept patch depends on.
- **Compaction.** With ``compact_after`` (and incremental checkpoints), once a periodic
  patch is ``compact_after`` patches from its base, rank 0 compacts its chain into a new
  base beside it (``<name>-compacted``, :func:`stream_persia.server.compaction.compact`:
  offline, from the files, in a background thread while training goes on). The compacted
  base records the servers' tracking of the patch it was made from, so the next periodic
  checkpoint after it is done is a patch of it (depth 1), not a full dump of every server:
  chains stay at most ``compact_after`` patches long, and the old chain, which no kept
  checkpoint needs any more, is deleted by retention as it ages out (the compacted base
  is periodic too: ``extra.by``). While a compaction runs, retention keeps the chain it
  reads; one runs at a time (a chain that grows meanwhile is patched on as before); a
  failed one is logged and counted (``compactions_failed``) and training goes on. The
  context's exit waits for a running one (:meth:`PeriodicCheckpoints.close`).
- **No pile-up.** The cut holds training still while it is written, so a checkpoint never
  overlaps the next; due times of ``every_s`` that passed while one was being written are
  skipped (counted in ``skipped``) rather than taken back to back, and the next one is
  due ``every_s`` after the last one began.
- **Failures.** A failed checkpoint (a server down, a full disk) is logged with its cause
  and counted (``failed``); training goes on (the cut's barriers are reached on every
  rank even when rank 0 fails to write) and the next one is tried when due.

Rank 0 logs one line per checkpoint (path, step, bytes, seconds) and relays its
:meth:`PeriodicCheckpoints.figures` in the mailbox heartbeat for embedding worker 0 to
export (:mod:`stream_persia.worker.nn_relay`: ``persia_nn_periodic_checkpoints_total
{outcome}``, ``persia_nn_periodic_checkpoint_last_*``).
"""

from __future__ import annotations

import logging
import os
import secrets
import threading
import time
from collections.abc import Callable
from datetime import datetime, timezone
from typing import Any

from stream_persia.checkpoint import Manifest, chain_of, list_checkpoints, prune_checkpoints
from stream_persia.checkpoint.reader import newest_last
from stream_persia.config import CheckpointingConfig
from stream_persia.errors import Misuse
from stream_persia.nn import checkpointing
from stream_persia.nn.seams import TrainerSeam
from stream_persia.server import compaction

__all__ = ["BY", "PeriodicCheckpoints", "checkpoint_name", "checkpointing_config",
           "incremental_enabled", "latest_parent", "periodic_root"]

log = logging.getLogger(__name__)

#: ``extra["by"]`` of a periodic checkpoint's manifest (retention selects on it)
BY = "periodic"
_FIELD = "common_config.checkpointing_config.periodic_dir"


def checkpointing_config() -> CheckpointingConfig:
    """The job's ``common_config.checkpointing_config``: from the global config file
    ``PERSIA_GLOBAL_CONFIG`` names, else the defaults (periodic checkpoints off)."""
    path = os.environ.get("PERSIA_GLOBAL_CONFIG")
    if not path:
        return CheckpointingConfig()
    from stream_persia.config import load_global_config

    return load_global_config(path).common_config.checkpointing_config


def incremental_enabled() -> bool:
    """Whether the job asks for incremental checkpoints (PERSIA's
    ``embedding_parameter_server_config.enable_incremental_update``)."""
    path = os.environ.get("PERSIA_GLOBAL_CONFIG")
    if not path:
        return False
    from stream_persia.config import load_global_config

    return load_global_config(path).embedding_parameter_server_config \
        .enable_incremental_update


def periodic_root(config: CheckpointingConfig) -> str:
    """Where periodic checkpoints go: ``periodic_dir`` (a relative local path made
    absolute here), else ``PERSIA_CHECKPOINT_DIR``, else ``PERSIA_CHECKPOINT_ROOT``.

    Raises:
        Misuse: (``common_config.checkpointing_config.periodic_dir``) none of them is set.
    """
    root = config.periodic_dir or os.environ.get("PERSIA_CHECKPOINT_DIR") \
        or os.environ.get("PERSIA_CHECKPOINT_ROOT")
    if not root:
        raise Misuse("periodic checkpoints are on (every_steps/every_s) but there is no "
                     "directory to write them to", field=_FIELD,
                     hint="set periodic_dir, or PERSIA_CHECKPOINT_DIR for the NN workers")
    if "://" not in root:
        root = os.path.abspath(root)
    return root


def latest_parent(dst: str, full_every: int, job: str | None = None) -> str | None:
    """The checkpoint an incremental checkpoint at ``dst`` patches: the newest complete
    one beside it (of ``job``, when given) that records a chain shorter than
    ``full_every`` patches (None: take a full base). Checkpoints requested over HTTP use
    it (the API's directory holds periodic ones and others alike, perhaps other jobs'; the
    servers refuse a parent they cannot patch)."""
    root = dst.rstrip("/").rsplit("/", 1)[0]
    found = [m for m in list_checkpoints(root)
             if m.chain is not None and (job is None or m.job == job)]
    if not found:
        return None
    newest = max(found, key=newest_last)
    depth = int(newest.chain["depth"]) if newest.chain is not None else full_every
    return newest.path if depth < full_every else None


def checkpoint_name(step: int, at: float) -> str:
    """``periodic-step-000000000300-20260101T120000.250Z-3f9a``: sorts by step, then time;
    the random tail keeps two runs that reach a step in the same millisecond apart (a
    checkpoint written at an existing name would replace it)."""
    t = datetime.fromtimestamp(at, timezone.utc)
    stamp = f"{t:%Y%m%dT%H%M%S}.{t.microsecond // 1000:03d}Z"
    return f"periodic-step-{step:012d}-{stamp}-{secrets.token_hex(2)}"


def _is_periodic(m: Manifest) -> bool:
    return isinstance(m.extra, dict) and m.extra.get("by") == BY


class PeriodicCheckpoints:
    """Take the job's periodic checkpoints at step boundaries (see the module docstring).

    Args:
        ctx: an entered ``TrainCtx``.
        config: the job's ``checkpointing_config`` (with ``every_steps`` or ``every_s``).
        root: where they go (:func:`periodic_root`).
        incremental: patches on a base, a base every ``config.full_every`` patches
            (default: the job's ``enable_incremental_update``, :func:`incremental_enabled`).
        agree_steps: with several ranks and ``every_s``, how often (in steps) rank 0 tells
            the others whether one is due.
        dump_kwargs: more arguments of :func:`~stream_persia.nn.checkpointing.
            dump_checkpoint` (default: the TorchScript model too when it can be scripted,
            as for checkpoints requested over HTTP).
        clock: monotonic seconds (tests).
    """

    def __init__(self, ctx: TrainerSeam, config: CheckpointingConfig, root: str, *,
                 agree_steps: int = 10, dump_kwargs: dict[str, Any] | None = None,
                 clock: Callable[[], float] = time.monotonic,
                 incremental: bool | None = None):
        if not config.periodic:
            raise Misuse("periodic checkpoints need every_steps or every_s",
                         field="common_config.checkpointing_config.every_steps")
        self.ctx = ctx
        self.every_steps = config.every_steps
        self.every_s = config.every_s
        self.keep = config.keep_checkpoints
        self.full_every = config.full_every
        self.compact_after = config.compact_after
        self._compaction: _Compaction | None = None   # rank 0: the one running
        self.compacted: list[str] = []       # rank 0: the compacted bases made, in order
        self.compactions_failed = 0
        self.incremental = incremental_enabled() if incremental is None else incremental
        self._parent: tuple[str, int] | None = None   # rank 0: (path, depth) to patch
        self.root = root.rstrip("/") or root
        self.agree_steps = max(1, int(agree_steps))
        self.dump_kwargs = dict(dump_kwargs) if dump_kwargs is not None else {
            "with_jit_model": "if_possible"}
        self._clock = clock
        self._next_due = clock() + self.every_s if self.every_s is not None else None
        self.taken: list[str] = []           # rank 0: the paths written, in order
        self.skipped = 0
        self.failed = 0
        self.last_step: int | None = None
        self.last_at: float | None = None    # wall-clock time the last one committed
        self.last_duration_s: float | None = None
        self.last_bytes: int | None = None

    def figures(self) -> dict[str, Any]:
        """What rank 0's heartbeat relays (:mod:`stream_persia.worker.nn_relay`). The
        compaction counts go only once non-zero, so a job that never compacts sends what
        a worker of the previous version accepts (it refuses unknown figures)."""
        out = {"taken": len(self.taken), "skipped": self.skipped, "failed": self.failed,
               "last_step": self.last_step, "last_at": self.last_at,
               "last_duration_s": self.last_duration_s, "last_bytes": self.last_bytes}
        if self.compacted or self.compactions_failed:
            out.update(compacted=len(self.compacted), compaction_failed=self.compactions_failed)
        return out

    def _agree(self, name: str | None) -> str | None:
        import torch.distributed as dist

        box = [name]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def step_boundary(self) -> str | None:
        """Take a checkpoint if one is due (every rank calls this after each step);
        returns its path (rank 0 and the others alike), None when none was due."""
        steps = int(self.ctx.steps)
        by_steps = self.every_steps is not None and steps > 0 \
            and steps % self.every_steps == 0
        multi = self.ctx.world_size > 1
        if multi and not by_steps and not (self.every_s is not None
                                           and steps % self.agree_steps == 0):
            return None
        name = None
        if self.ctx.rank == 0:
            by_time = self._next_due is not None and self._clock() >= self._next_due
            if by_steps or by_time:
                name = checkpoint_name(steps, time.time())
        if multi:
            name = self._agree(name)
        return self._take(name, steps) if name is not None else None

    def _take(self, name: str, step: int) -> str:
        dst = f"{self.root}/{name}"
        rank0 = self.ctx.rank == 0
        began = self._clock()
        parent = None
        if rank0:
            self._adopt()
        if self.incremental and self._parent is not None \
                and self._parent[1] < self.full_every:
            parent = self._parent[0]
        try:
            manifest = checkpointing.dump_checkpoint(
                self.ctx, dst, opt_filename="opt.pt", extra={"id": name, "by": BY},
                parent=parent, **self.dump_kwargs)
        except Exception as e:   # never stops training: logged, counted, tried again
            self.failed += 1
            log.error("periodic checkpoint at step %d into %s failed (%d so far; training "
                      "goes on): %s: %s", step, dst, self.failed, type(e).__name__, e)
            self._reschedule(began)
            return dst
        took = self._clock() - began
        if rank0 and manifest is not None:
            size = sum(int(f.get("bytes", 0)) for f in manifest.files.values())
            self.taken.append(dst)
            chain = manifest.chain
            self._parent = None if chain is None else (dst, int(chain["depth"]))
            self.last_step, self.last_at = step, time.time()
            self.last_duration_s, self.last_bytes = took, size
            log.info("periodic checkpoint %s: step %d, %d bytes, %.2f s", dst, step, size,
                     took)
            self._prune(name, manifest.job)
            if self.incremental and self.compact_after is not None and chain is not None \
                    and int(chain["depth"]) >= self.compact_after and self._compaction is None:
                self._compact(dst)
        self._reschedule(began)
        return dst

    def _compact(self, src: str) -> None:
        try:
            self._compaction = _Compaction(src)
        except Exception as e:   # its chain cannot be read: patched on, retried next time
            self.compactions_failed += 1
            log.error("periodic checkpoints: cannot compact %s (%d failed so far): %s: %s",
                      src, self.compactions_failed, type(e).__name__, e)

    def _adopt(self) -> None:
        """Take in a finished compaction: the next patch patches its base (when the chain
        it compacted is still the one being patched)."""
        job = self._compaction
        if job is None or job.thread.is_alive():
            return
        self._compaction = None
        if job.error is not None or job.result is None:
            self.compactions_failed += 1
            log.error("periodic checkpoints: compacting %s failed (%d so far; its chain is "
                      "patched on): %s: %s", job.src, self.compactions_failed,
                      type(job.error).__name__, job.error)
            return
        self.compacted.append(job.result)
        if self._parent is not None and self._parent[0] == job.src:
            self._parent = (job.result, 0)

    def wait_compaction(self, timeout_s: float | None = None) -> bool:
        """Wait for the running compaction, if any, and take it in; False when it is still
        running after ``timeout_s``."""
        job = self._compaction
        if job is not None:
            job.thread.join(timeout_s)
        self._adopt()
        return self._compaction is None

    def close(self, timeout_s: float | None = 600.0) -> None:
        """Wait (up to ``timeout_s``) for a running compaction; one still running then
        is abandoned with the process (it publishes nothing: a hidden staging directory
        is left, which readers skip and retention removes once abandoned:
        :mod:`stream_persia.checkpoint.leftovers`)."""
        if not self.wait_compaction(timeout_s):
            log.warning("periodic checkpoints: compacting %s still runs after %s s; it is "
                        "abandoned", self._compaction and self._compaction.src, timeout_s)

    def _reschedule(self, began: float) -> None:
        """The next time-based one is due ``every_s`` after ``began``; due times that
        passed while this one was written are skipped (counted), not taken back to back."""
        if self.every_s is None:
            return
        missed = int((self._clock() - began) // self.every_s)
        if missed and self.ctx.rank == 0:
            self.skipped += missed
            log.warning("periodic checkpoints: %d due while the last one was written "
                        "(%d skipped so far); every_s=%g is shorter than a checkpoint takes",
                        missed, self.skipped, self.every_s)
        self._next_due = began + self.every_s * (missed + 1)

    def _prune(self, name: str, job: str) -> None:
        """Retention after checkpoint ``name`` of ``job``: the periodic checkpoints of
        this job only (another job's under a shared root are not ours to count or
        delete)."""
        if self.keep <= 0:
            return
        try:
            running = self._compaction.reads if self._compaction is not None else set()
            prune_checkpoints(self.root, self.keep, protect={name} | running,
                              select=lambda m: _is_periodic(m) and m.job == job)
        except Exception as e:   # retention is retried after the next checkpoint
            log.warning("periodic checkpoints: retention under %s failed: %s: %s",
                        self.root, type(e).__name__, e)


class _Compaction:
    """One background compaction of the chain up to ``src`` (rank 0; see the module
    docstring): its thread, the names it reads (retention keeps them) and its outcome."""

    def __init__(self, src: str):
        self.src = src
        self.reads = {(m.path or "").rstrip("/").rsplit("/", 1)[-1] for m in chain_of(src)}
        self.result: str | None = None
        self.error: BaseException | None = None
        # A daemon: a process that exits abandons it (nothing is published then).
        self.thread = threading.Thread(target=self._run, name="periodic-compaction",
                                       daemon=True)
        log.info("periodic checkpoints: compacting the chain of %s (%d checkpoints) in the "
                 "background", src, len(self.reads))
        self.thread.start()

    def _run(self) -> None:
        try:
            self.result = compaction.compact(self.src).path
        except Exception as e:   # reported by PeriodicCheckpoints._adopt
            self.error = e
