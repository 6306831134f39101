"""Checkpoints from the NN side: the consistent cut of DESIGN §7.

``TrainCtx.dump_checkpoint(dst)`` is called by every rank at the same step:

1. Quiesce this rank: stop prefetching, hand every served but untrained batch back to its
   worker (``return_batches``: unapplied, first in line again) and wait until every
   gradient push has been answered (the servers applied it).
2. Barrier: now no rank has anything in flight.
3. Rank 0 asks every worker for its ``frontier`` (the cut:
   :func:`stream_persia.checkpoint.read_cut`, which also refuses workers that mix Kafka
   and direct ingest): with nothing in flight, every batch
   before those offsets is applied and none after it, and no worker found an embedding
   server restarted (its table lost: the workers check every server's incarnation then,
   and again after the dump, so a restart in between refuses the checkpoint too;
   :mod:`stream_persia.worker.router`). It writes the dense model, the
   optimizer (and the GradScaler with mixed precision), optionally the TorchScript model,
   has every embedding server dump its shard into the checkpoint, and commits the
   manifest with the offsets (:class:`stream_persia.checkpoint.CheckpointWriter`: the
   checkpoint becomes visible atomically), the servers' configuration (embedding
   optimizer and EmbeddingConfig) and, in ``extra["inputs"]``, the ID slots and non-ID
   features of the batches the model was trained on, in order (serving matches requests
   to them by name), in ``extra["label_names"]`` their labels' names in order, and in
   ``extra["dense_lineage"]`` the lineage rank 0's dense publisher publishes this model
   in (None: it publishes none;
   :mod:`stream_persia.nn.dense_publisher`), so that a serving replica restored from the
   checkpoint compares published versions with its step only within that lineage. Then
   the workers ``commit_offsets`` to the consumer group (for lag monitors only:
   restoring uses the manifest).
4. Barrier; prefetching resumes.

The manifest's ``config_digest`` is the digest of the job's embedding schema (the file
``PERSIA_EMBEDDING_CONFIG`` names, else the one the embedding workers plan batches with:
:func:`checkpoint_schema`; :mod:`stream_persia.checkpoint.digest`).

``load_checkpoint(src)`` (every rank): refuse a checkpoint whose ``config_digest`` is not
this job's embedding schema, or whose dense model or optimizer state is not this one's
(``Misuse`` naming what differs), quiesce, barrier; for a
Kafka stream rank 0 first
asks every worker whether the brokers still hold the manifest's offsets (``check_stream``:
a :class:`~stream_persia.errors.DataLost` naming the partitions and offsets retention
deleted, before anything changed), then loads the embeddings into the servers (any number
of them: rows are resharded by hash; servers that restarted are configured and loaded like
the others, and the workers serve them again once they see the load) and has every worker
``reset_stream`` to those
offsets; every rank loads the dense model and optimizer state, and takes the checkpoint's
step, ``trained_through`` and inputs (slots, features and labels in the restored model's
order); barrier.

Size: the NN side's dump and restore of one checkpoint, with the checks a restore makes
before anything changes (embedding schema, dense model and optimizer state); the file
formats and the servers' part live in :mod:`stream_persia.checkpoint`.
"""

from __future__ import annotations

import concurrent.futures
import io
import logging
import os
import threading
import warnings
from collections.abc import Callable
from typing import Any

import torch

from stream_persia.checkpoint import (
    CheckpointWriter,
    Cut,
    Manifest,
    check_config,
    load_embeddings,
    load_torch,
    read_cut,
    read_manifest,
)
from stream_persia.checkpoint.cut import check_servers_kept
from stream_persia.config.embedding import EmbeddingSchema
from stream_persia.core.data import check_event_time
from stream_persia.errors import BadInput, Misuse, RemoteError
from stream_persia.nn.seams import ContextSeam, TrainerSeam

__all__ = ["checkpoint_schema", "dump_checkpoint", "dump_embedding", "dump_torch_state_dict",
           "job_schema", "load_checkpoint", "load_embedding", "load_torch_state_dict", "scripted"]

log = logging.getLogger(__name__)

GRAD_SCALER_FILENAME = "grad_scaler.pt"


def scripted(model: torch.nn.Module) -> bytes:
    """The TorchScript archive of ``model`` (PERSIA's ``jit_dense.pt`` for serving)."""
    with warnings.catch_warnings():
        # torch marks TorchScript deprecated; PERSIA's checkpoint layout still has it.
        warnings.simplefilter("ignore", DeprecationWarning)
        buf = io.BytesIO()
        torch.jit.save(torch.jit.script(model), buf)
    return buf.getvalue()


def job_name() -> str:
    """This job's ``kafka.job_name`` (the global config ``PERSIA_GLOBAL_CONFIG`` names;
    ``persia`` without one): what its checkpoints record as their ``job``."""
    path = os.environ.get("PERSIA_GLOBAL_CONFIG")
    if path:
        from stream_persia.config import load_global_config

        return load_global_config(path).kafka.job_name
    return "persia"


def job_schema() -> EmbeddingSchema | None:
    """The job's embedding schema (the file ``PERSIA_EMBEDDING_CONFIG`` names), if any: its
    digest goes into every checkpoint written here and is checked by every restore, and
    its table policies are what ``TrainCtx`` configures the embedding servers with."""
    if not os.environ.get("PERSIA_EMBEDDING_CONFIG"):
        return None
    from stream_persia.config import load_embedding_config

    return load_embedding_config()


def checkpoint_schema(cluster: Any) -> EmbeddingSchema | None:
    """The schema checkpoints are digested and checked with: :func:`job_schema`, else
    the one the embedding workers plan batches with (their ``schema``). A training
    script run without ``PERSIA_EMBEDDING_CONFIG`` wrote checkpoints without a digest
    and restored any unchecked, so rows of a renamed or reordered slot were read as
    another slot's. None only when no worker is known or none answers ``schema``
    (older workers): then unchecked, as before (logged).

    Raises:
        Misuse: the workers plan batches with different schemas (names them).
    """
    schema = job_schema()
    if schema is not None or not getattr(cluster, "workers", None):
        return schema
    try:
        replies = cluster.run(cluster.call_workers("schema"))
    except (Misuse, RemoteError) as e:
        log.warning("PERSIA_EMBEDDING_CONFIG is not set and the embedding workers do not "
                    "tell their schema (%s): checkpoints are written and restored without "
                    "checking their embedding config", e)
        return None
    # by digest: slot order matters to it, and dict equality ignores order
    schemas = [EmbeddingSchema.from_dict(r) for r in replies]
    differ = [i for i, s in enumerate(schemas) if s.digest() != schemas[0].digest()]
    if differ:
        raise Misuse(f"embedding workers {differ} plan batches with another embedding "
                     f"schema than worker 0", field="embedding_config",
                     hint="start every embedding worker with the same embedding_config.yml")
    return schemas[0]


def _rank(ctx: ContextSeam) -> int:
    trainer = ctx.as_trainer()
    return trainer.rank if trainer is not None else 0


def _barrier(ctx: ContextSeam) -> None:
    trainer = ctx.as_trainer()
    if trainer is not None:
        trainer.barrier()


def _dense_model(ctx: ContextSeam) -> torch.nn.Module:
    trainer = ctx.as_trainer()
    model = trainer.raw_model if trainer is not None else ctx.model
    if model is None:
        raise Misuse("the context has no model to checkpoint", field="model")
    return model


def dump_checkpoint(ctx: ContextSeam, dst_dir: str, *, dense_filename: str = "dense.pt",
                    jit_dense_filename: str = "jit_dense.pt", opt_filename: str | None = None,
                    with_jit_model: bool | str = False,
                    progress: Callable[..., None] | None = None,
                    extra: dict[str, Any] | None = None,
                    parent: str | None = None) -> Manifest | None:
    """Write a checkpoint of ``ctx``'s job at ``dst_dir`` (see the module docstring).

    Args:
        with_jit_model: also write the TorchScript model; ``"if_possible"`` skips it
            (with a warning) when the model cannot be scripted.
        progress: rank 0 calls ``progress(phase, **details)`` as the checkpoint advances
            (the checkpoint mailbox reports it to the API).
        extra: more entries for the manifest's ``extra`` (e.g. the API's id and ``by``).
        parent: a checkpoint under the same root as ``dst_dir``: write an incremental
            checkpoint, its embedding rows only those changed since ``parent`` (a full
            base instead when that cannot be known; see
            :meth:`~stream_persia.checkpoint.CheckpointWriter.dump_embeddings`).

    Returns:
        The committed manifest on rank 0, None on the other ranks.
    """
    trainer = ctx.as_trainer()
    cluster = ctx.require_cluster()
    resume = trainer.quiesce() if trainer is not None else []
    manifest = None
    try:
        _barrier(ctx)
        failure: Exception | None = None
        if _rank(ctx) == 0:
            try:
                manifest = _write(ctx, cluster, dst_dir, trainer=trainer,
                                  dense_filename=dense_filename,
                                  jit_dense_filename=jit_dense_filename,
                                  opt_filename=opt_filename, with_jit_model=with_jit_model,
                                  note=progress or (lambda phase, **details: None),
                                  extra=extra or {}, parent=parent)
            except Exception as e:
                failure = e
        # Every rank reaches this barrier, even when rank 0 failed to write: the ranks
        # stay in step and training can go on after a failed checkpoint.
        _barrier(ctx)
        if failure is not None:
            raise failure
    finally:
        if trainer is not None:
            trainer.resume_prefetchers(resume)
    return manifest


def _write(ctx: ContextSeam, cluster: Any, dst_dir: str, *, trainer: TrainerSeam | None,
           dense_filename: str, jit_dense_filename: str, opt_filename: str | None,
           with_jit_model: bool | str, note: Callable[..., None], extra: dict[str, Any],
           parent: str | None = None) -> Manifest:
    """Rank 0's part of :func:`dump_checkpoint`, once every rank is quiet."""
    train = trainer is not None
    note("reading the stream position")
    if train:
        cut = cluster.run(read_cut(cluster.call_workers))
    else:   # no training here: the workers' position means nothing for this model
        cut = Cut("direct", {})
    stream, offsets = cut.stream, cut.offsets
    model = _dense_model(ctx)
    jit = None
    if with_jit_model:
        note("scripting the dense model")
        try:
            jit = scripted(model)
        except Exception as e:
            if with_jit_model != "if_possible":
                raise
            log.warning("the checkpoint has no TorchScript model (%s: %s); serving it needs "
                        "the model class", type(e).__name__, e)
    with CheckpointWriter(dst_dir) as writer:
        note("writing the dense model")
        writer.write_torch(dense_filename, model.state_dict())
        if trainer is not None and opt_filename:
            writer.write_torch(opt_filename, trainer.dense_optimizer.state_dict())
            if trainer.grad_scaler is not None:
                writer.write_torch(GRAD_SCALER_FILENAME, trainer.grad_scaler.state_dict())
        if jit is not None:
            writer.write_bytes(jit_dense_filename, jit)
        note("dumping embeddings", servers=len(cluster.servers))
        cluster.run(writer.dump_embeddings(cluster.servers, parent=_parent(parent)))
        if train:
            # A server that restarted between the frontier and its dump wrote an empty
            # table: the workers find it now (its incarnation changed), before the commit.
            check_servers_kept(cluster.run(cluster.call_workers("frontier")))
        note("committing")
        manifest = writer.commit(job=job_name(), step=getattr(ctx, "steps", 0),
                                 offsets=offsets, stream=stream,
                                 fingerprints=cut.fingerprints,
                                 schema=checkpoint_schema(cluster),
                                 extra={"world_size": getattr(ctx, "world_size", 1),
                                        # the newest sample event time in the dense model
                                        # (a serving replica starts its trained_through)
                                        "trained_through": getattr(ctx, "trained_through",
                                                                   None),
                                        # the lineage rank 0 publishes this model
                                        # in (a replica restored from it takes a
                                        # published one of another lineage only)
                                        "dense_lineage": _dense_lineage(ctx),
                                        "dense_filename": dense_filename,
                                        "opt_filename": opt_filename if train else None,
                                        **_heads(model), **_inputs(ctx), **extra})
    if stream == "kafka":
        for topic_offsets in offsets.values():
            cluster.run(cluster.call_workers("commit_offsets", {"offsets": topic_offsets}))
    return manifest


def _dense_lineage(ctx: ContextSeam) -> int | None:
    """The lineage of rank 0's dense publisher (None: it publishes nothing)."""
    publisher = getattr(ctx, "dense_publisher", None)
    return getattr(publisher, "lineage", None)


def _parent(path: str | None) -> Manifest | None:
    """The parent of an incremental checkpoint; one that cannot be read (deleted, say)
    makes the checkpoint a full base (logged), not a failure."""
    if path is None:
        return None
    try:
        return read_manifest(path)
    except BadInput as e:
        log.warning("checkpoint parent %s cannot be read (%s): writing a full base", path, e)
        return None


def load_checkpoint(ctx: ContextSeam, src_dir: str, *, map_location: Any = None,
                    dense_filename: str = "dense.pt", opt_filename: str | None = None) -> None:
    """Restore ``ctx``'s job from the checkpoint at ``src_dir``."""
    trainer = ctx.as_trainer()
    train = trainer is not None
    cluster = ctx.require_cluster()
    manifest = read_manifest(src_dir)
    # Every rank, before anything changes: rows of another embedding schema are refused.
    check_config(manifest, checkpoint_schema(cluster), f"checkpoint {src_dir}")
    # ... and a dense model or optimizer state of another model, before the servers'
    # rows and the stream are replaced (a script that goes on after a failed restore
    # would train the checkpoint's embeddings with a dense model they were not trained
    # with).
    model = _dense_model(ctx)
    dense_state = load_torch(src_dir, dense_filename, map_location)
    _check_dense_state(model, dense_state, f"checkpoint {src_dir}: {dense_filename}")
    opt_state = None
    if trainer is not None and opt_filename and opt_filename in manifest.files:
        opt_state = load_torch(src_dir, opt_filename, map_location)
        _check_optimizer_state(trainer.dense_optimizer, opt_state,
                               f"checkpoint {src_dir}: {opt_filename}")
    resume = trainer.quiesce(strict=False) if trainer is not None else []
    try:
        _barrier(ctx)
        if _rank(ctx) == 0:
            replay = train and manifest.stream == "kafka"
            streams = _stream_params(manifest, src_dir) if replay else []
            # Before anything is loaded: offsets the brokers no longer have (retention),
            # or of a topic that is not the one the checkpoint was cut from (recreated),
            # refuse the restore (DataLost naming them) and leave the job as it was.
            # The workers refuse another topic than theirs (a checkpoint of another job).
            for params in streams:
                cluster.run(cluster.call_workers("check_stream", params))
            cluster.run(load_embeddings(src_dir, cluster.servers))
            for params in streams:
                cluster.run(cluster.call_workers("reset_stream", params))
        model.load_state_dict(dense_state)
        if trainer is not None and opt_state is not None:
            trainer.dense_optimizer.load_state_dict(opt_state)
            if trainer.grad_scaler is not None and GRAD_SCALER_FILENAME in manifest.files:
                trainer.grad_scaler.load_state_dict(load_torch(src_dir, GRAD_SCALER_FILENAME))
        if trainer is not None:
            _restore_trainer(trainer, manifest)
            trainer.drop_kept(f"the restore of {src_dir}")
        else:
            _restore_inputs(ctx, manifest)
        _barrier(ctx)
    finally:
        if trainer is not None:
            trainer.resume_prefetchers(resume)


def _check_dense_state(model: torch.nn.Module, state: Any, where: str) -> None:
    """Refuse a dense state dict ``model.load_state_dict`` would refuse (another model:
    keys missing or unknown, shapes that differ), naming them, before anything changed.

    Raises:
        Misuse: on field ``model``.
    """
    if not isinstance(state, dict):
        raise Misuse(f"{where} holds a {type(state).__name__}, not a state dict",
                     field="model")
    want = model.state_dict()
    missing = [k for k in want if k not in state]
    unknown = [k for k in state if k not in want]
    shapes = [f"{k} {tuple(state[k].shape)} (the model's: {tuple(v.shape)})"
              for k, v in want.items() if k in state and isinstance(v, torch.Tensor)
              and isinstance(state[k], torch.Tensor) and state[k].shape != v.shape]
    if missing or unknown or shapes:
        raise Misuse(f"{where} is the state of another dense model: "
                     + "; ".join(f"{what} {names[:5]}" + (" ..." if len(names) > 5 else "")
                                 for what, names in (("missing", missing),
                                                     ("unknown", unknown),
                                                     ("other shapes", shapes)) if names)
                     + "; nothing was restored", field="model",
                     hint="restore a checkpoint of this model (its class and sizes)")


def _check_optimizer_state(opt: torch.optim.Optimizer, state: Any, where: str) -> None:
    """Refuse an optimizer state ``opt.load_state_dict`` would refuse (other parameter
    groups or sizes), before anything changed.

    Raises:
        Misuse: on field ``dense_optimizer``.
    """
    groups = state.get("param_groups") if isinstance(state, dict) else None
    sizes = [len(g.get("params", ())) for g in groups if isinstance(g, dict)] \
        if isinstance(groups, list) else None
    want = [len(g["params"]) for g in opt.param_groups]
    if sizes != want:
        raise Misuse(f"{where} is the state of another optimizer: parameter groups of "
                     f"{sizes} parameters, this one's {want}; nothing was restored",
                     field="dense_optimizer",
                     hint="build the dense optimizer over the same parameters as the "
                          "checkpointed run")


def _restore_trainer(trainer: TrainerSeam, manifest: Manifest) -> None:
    """What the restored model was trained as: its step, its ``trained_through`` (the
    newest event time in it: the next checkpoint, the heartbeat and the dense publisher
    carry it on; the one of the batches trained before the restore claimed a freshness
    the restored model lacks) and its inputs in order (slots, named features, labels:
    the batches trained from here are arranged to them, not to those trained before the
    restore, whose order the restored model may not have been trained with)."""
    trainer.steps = manifest.step
    extra = manifest.extra if isinstance(manifest.extra, dict) else {}
    try:
        trainer.trained_through = check_event_time(extra.get("trained_through"),
                                                   "extra.trained_through")
    except BadInput as e:
        log.warning("checkpoint %s: %s; its trained_through is unknown", manifest.path, e)
        trainer.trained_through = None
    _restore_inputs(trainer, manifest)   # kept in the next checkpoint


def _restore_inputs(ctx: ContextSeam, manifest: Manifest) -> None:
    """The inputs the restored model was trained with, in order: the batches ``ctx``
    runs through it from here (training or evaluation) are arranged to them by name
    (:func:`stream_persia.nn.batch.arrange`)."""
    extra = manifest.extra if isinstance(manifest.extra, dict) else {}
    trainer = ctx.as_trainer() is not None
    if isinstance(extra.get("inputs"), dict):
        ctx.input_signature = extra["inputs"]
    elif not trainer:   # a checkpoint taken before any step: nothing known, not older
        ctx.input_signature = None
    if isinstance(extra.get("label_names"), list):
        ctx.label_names = list(extra["label_names"])
    elif not trainer:
        ctx.label_names = None


def _stream_params(manifest: Manifest, where: str) -> list[dict[str, Any]]:
    """The ``check_stream`` / ``reset_stream`` parameters of a Kafka checkpoint, one per
    topic: its offsets, the fingerprints of the records below them (a manifest from
    before fingerprints: none, logged) and the topic (the workers refuse another)."""
    if manifest.fingerprints is None:
        log.warning("checkpoint %s records no fingerprints of its Kafka offsets (written "
                    "before them): the topic's identity cannot be checked (a topic deleted "
                    "and created again would not be noticed)", where)
    prints = manifest.fingerprints or {}
    return [{"offsets": parts, "fingerprints": prints.get(topic, {}), "topic": topic}
            for topic, parts in manifest.offsets.items()]


def _in_thread(fn: Any) -> concurrent.futures.Future:
    fut: concurrent.futures.Future = concurrent.futures.Future()

    def run() -> None:
        try:
            fut.set_result(fn())
        except BaseException as e:
            fut.set_exception(e)

    threading.Thread(target=run, name="embedding-dump", daemon=True).start()
    return fut


def dump_embedding(ctx: ContextSeam, dst_dir: str, blocking: bool = True
                   ) -> concurrent.futures.Future:
    """Write every server's embedding rows as a checkpoint without dense files.

    Blocking, in a TrainCtx, the rank quiesces first, so the rows include every update of
    the batches it trained. Non-blocking, the dump runs beside training and is not a cut.
    """
    cluster = ctx.require_cluster()

    def dump() -> None:
        with CheckpointWriter(dst_dir) as writer:
            cluster.run(writer.dump_embeddings(cluster.servers))
            writer.commit(job=job_name(), step=getattr(ctx, "steps", 0), offsets={},
                          stream="direct", schema=checkpoint_schema(cluster),
                          extra={"embedding_only": True})

    return _guarded(ctx, dump, blocking)


def load_embedding(ctx: ContextSeam, src_dir: str, blocking: bool = True
                   ) -> concurrent.futures.Future:
    """Replace the servers' rows by the checkpoint's (resharded to the server count).

    Blocking, in a TrainCtx, the rank quiesces first. Non-blocking while a Kafka stream
    trains (or on another rank), the batches in flight then fail their gradient push
    (``ServerRestarted`` on field ``loads``: their rows were replaced, and a restore would
    replay them) and the worker refuses checkpoints until a restore resets the stream:
    use :func:`load_checkpoint` to restore, or load before training starts."""
    cluster = ctx.require_cluster()
    # Fail here, not in the background, on a wrong path or another embedding schema.
    check_config(read_manifest(src_dir), checkpoint_schema(cluster),
                 f"checkpoint {src_dir}")

    def load() -> None:
        cluster.run(load_embeddings(src_dir, cluster.servers))

    return _guarded(ctx, load, blocking)


def _guarded(ctx: ContextSeam, fn: Any, blocking: bool) -> concurrent.futures.Future:
    if not blocking:
        return _in_thread(fn)
    fut: concurrent.futures.Future = concurrent.futures.Future()
    trainer = ctx.as_trainer()
    resume = trainer.quiesce() if trainer is not None else []
    try:
        fut.set_result(fn())
        if trainer is not None:
            trainer.drop_kept("the embeddings were loaded")
    except Exception as e:
        fut.set_exception(e)
    finally:
        if trainer is not None and resume:
            trainer.resume_prefetchers(resume)
    return fut


def dump_torch_state_dict(torch_instance: Any, dst_dir: str, file_name: str,
                          is_jit: bool = False) -> None:
    """Save ``torch_instance.state_dict()`` (or the scripted module) to ``dst_dir/file_name``
    (any fsspec URL)."""
    import fsspec

    fs, path = fsspec.core.url_to_fs(dst_dir)
    fs.makedirs(path, exist_ok=True)
    if is_jit:
        data = scripted(torch_instance)
    else:
        buf = io.BytesIO()
        torch.save(torch_instance.state_dict(), buf)
        data = buf.getvalue()
    fs.pipe_file(f"{path.rstrip('/')}/{file_name}", data)


def load_torch_state_dict(torch_instance: Any, src_dir: str, map_location: Any = None,
                          file_name: str = "dense.pt") -> None:
    """Load a state dict saved by :func:`dump_torch_state_dict` into ``torch_instance``.

    ``src_dir`` may name the file itself or the directory holding ``file_name``.
    """
    import fsspec

    fs, path = fsspec.core.url_to_fs(src_dir)
    if fs.isdir(path):
        path = f"{path.rstrip('/')}/{file_name}"
    state = torch.load(io.BytesIO(fs.cat_file(path)), map_location=map_location,
                       weights_only=True)
    torch_instance.load_state_dict(state)


def _heads(model: Any) -> dict[str, list[str]]:
    """Names of the model's outputs for serving, from a ``tasks`` list of str if it has
    one (e.g. ``["click", "buy"]``); the API names unnamed heads ``output``/``head_i``."""
    tasks = getattr(getattr(model, "module", model), "tasks", None)
    if isinstance(tasks, (list, tuple)) and tasks and all(isinstance(t, str) for t in tasks):
        return {"heads": list(tasks)}
    return {}


def _inputs(ctx: ContextSeam) -> dict[str, Any]:
    """The model's inputs as trained (:func:`stream_persia.nn.batch.input_signature`), so
    that serving matches requests to them by name; nothing if no batch was trained."""
    trainer = ctx.as_trainer()
    sig = trainer.input_signature if trainer is not None else None
    if sig is None:
        return {}
    labels = trainer.label_names if trainer is not None else None
    # the label names in order too: a restore arranges the batches' labels to them
    return {"inputs": sig} | ({} if labels is None else {"label_names": list(labels)})
