"""Writing a checkpoint: stage every file, write the manifest last, then publish atomically.

Size: one module because :class:`CheckpointWriter` is one state machine (open, then
committed or aborted) over one staging directory; its dump, checks and publication share
that state.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import shutil
import tempfile
import uuid
from collections.abc import Sequence
from typing import Any

from stream_persia.checkpoint._common import (
    DEFAULT_SHARD_TIMEOUT_MS,
    HASH_BLOCK_BYTES,
    HashingWriter,
    Location,
    check_server_set,
)
from stream_persia.checkpoint.digest import SCHEMA_KEY, config_digest
from stream_persia.checkpoint.leftovers import staging_owner
from stream_persia.checkpoint.manifest import (
    DENSE_FILENAME,
    JIT_FILENAME,
    MANIFEST_NAME,
    OPT_FILENAME,
    Manifest,
    check_file_name,
    not_taken_since,
)
from stream_persia.checkpoint.reader import read_manifest
from stream_persia.checkpoint.retention import delete_checkpoint
from stream_persia.config.embedding import EmbeddingSchema
from stream_persia.core import watermarks
from stream_persia.core.replies import WatermarksReply
from stream_persia.core.watermarks import RESTORE_HINT
from stream_persia.errors import BadInput, InternalError, Misuse, StreamReplay

__all__ = ["CheckpointWriter"]

log = logging.getLogger(__name__)


class CheckpointWriter:
    """Builds one checkpoint at ``dst``; a reader sees it only once :meth:`commit` returns.

    Local paths: files are staged in a hidden sibling directory (``.<name>.staging-*``)
    which :meth:`commit` renames to ``dst``. Remote fsspec filesystems have no atomic
    directory rename, so files go straight into ``dst`` and the manifest is written last;
    readers treat a directory without a manifest as incomplete. See the package docstring
    for what a crash at each point leaves behind.

    Use as a context manager to abort on error::

        with CheckpointWriter(dst) as w:
            w.write_torch(DENSE_FILENAME, model.state_dict())
            await w.dump_embeddings(router.clients)
            w.commit(job="ctr", step=step, offsets=offsets, stream="kafka")

    Args:
        dst: the checkpoint directory (local path or fsspec URL). An existing ``dst`` is
            replaced, but only if it looks like a checkpoint (a directory of plain files):
            a directory with sub-directories (say, the root of many checkpoints) is refused.

    Raises:
        BadInput: ``dst`` exists and is not replaceable.
    """

    def __init__(self, dst: str):
        self._dst = Location(dst)
        if self._dst.path == "/" or not self._dst.name:
            raise BadInput(f"checkpoint destination {dst!r} must name a directory below a root",
                           field="dst")
        self._files: dict[str, dict[str, Any]] = {}
        self._embedding_files: list[str] = []
        self._server_config: dict[str, Any] | None = None
        self._server_marks: list[Any] = []   # each server's stream watermarks at its dump
        # each server's update log position at its dump (None: one publishes none)
        self._update_positions: list[Any] | None = None
        self._chain: dict[str, Any] | None = None   # see dump_embeddings
        self._state = "open"
        self._check_replaceable()
        fs = self._dst.fs
        if self._dst.local:
            parent = os.path.dirname(self._dst.path)
            os.makedirs(parent, exist_ok=True)
            # The name says which process stages here, so retention can tell a staging
            # directory abandoned by a killed writer from a live one (retention.sweep_abandoned).
            self._stage = Location(tempfile.mkdtemp(
                prefix=f".{self._dst.name}.staging-{staging_owner()}-", dir=parent))
            # mkdtemp makes it private (0700); a published checkpoint reads like any dir.
            os.chmod(self._stage.path, 0o755)
        else:
            # The manifest goes first, so the old checkpoint is never seen complete while
            # its files are being replaced.
            if fs.exists(self._dst.join(MANIFEST_NAME)):
                fs.rm_file(self._dst.join(MANIFEST_NAME))
            if fs.exists(self._dst.path):
                fs.rm(self._dst.path, recursive=True)
            fs.makedirs(self._dst.path, exist_ok=True)
            self._stage = self._dst

    # ----------------------------------------------------------------- properties
    @property
    def dst(self) -> str:
        return self._dst.url

    @property
    def staging(self) -> str:
        """Where files go before commit: embedding servers ``dump`` into this directory."""
        return self._stage.url

    @property
    def files(self) -> dict[str, dict[str, Any]]:
        """Files written so far: name → ``{"sha256", "bytes", "rows"?}``."""
        return {k: dict(v) for k, v in self._files.items()}

    # ----------------------------------------------------------------- writing
    def write_bytes(self, name: str, data: bytes | bytearray | memoryview) -> dict[str, Any]:
        """Write one file into the checkpoint; returns its ``{"sha256", "bytes"}`` entry."""
        self._check_open()
        check_file_name(name)
        with self._stage.fs.open(self._stage.join(name), "wb") as f:
            w = HashingWriter(f)
            w.write(data)
        return self._record(name, w)

    def write_torch(self, name: str, obj: Any) -> dict[str, Any]:
        """``torch.save`` ``obj`` into the checkpoint (e.g. :data:`DENSE_FILENAME`)."""
        import torch

        self._check_open()
        check_file_name(name)
        with self._stage.fs.open(self._stage.join(name), "wb") as f:
            w = HashingWriter(f)
            torch.save(obj, w)  # type: ignore[arg-type]  # it only writes; typed as IO[bytes]
        return self._record(name, w)

    def copy_file(self, src: str, name: str, entry: dict[str, Any]) -> dict[str, Any]:
        """Copy file ``name`` of the checkpoint at ``src`` into this one, streamed, checking
        it against its manifest ``entry`` (``{"sha256", "bytes", ...}``: kept, ``rows``
        included). Raises BadInput naming the file when it differs."""
        self._check_open()
        check_file_name(name)
        loc = Location(src)
        with loc.fs.open(loc.join(name), "rb") as f, \
                self._stage.fs.open(self._stage.join(name), "wb") as g:
            w = HashingWriter(g)
            while block := f.read(HASH_BLOCK_BYTES):
                w.write(block)
        if w.bytes != entry["bytes"] or w.digest.hexdigest() != entry["sha256"]:
            raise BadInput(f"checkpoint {loc.url}: file {name} is corrupt or truncated (its "
                           "size or sha256 differs from the manifest)", field=f"files.{name}")
        self._files[name] = dict(entry)
        return dict(entry)

    def record_file(self, name: str, entry: dict[str, Any]) -> None:
        """Record a file another writer put into :attr:`staging` (``{"sha256", "bytes",
        "rows"?}``), as the servers' dumps are: compaction writes shard files so."""
        self._check_open()
        check_file_name(name)
        if not self._stage.fs.exists(self._stage.join(name)):
            raise Misuse(f"record_file: {name} is not in {self.staging}")
        self._files[name] = dict(entry)

    def _record(self, name: str, w: HashingWriter) -> dict[str, Any]:
        self._files[name] = {"sha256": w.digest.hexdigest(), "bytes": w.bytes}
        return dict(self._files[name])

    async def dump_embeddings(self, server_clients: Sequence[Any], *,
                              parent: Manifest | None = None,
                              timeout_ms: float = DEFAULT_SHARD_TIMEOUT_MS) -> list[str]:
        """Have every embedding server write its shard into :attr:`staging`, concurrently.

        With ``parent`` (a checkpoint under the same root as ``dst``), an incremental
        checkpoint: each server writes only what changed since the parent's dump (a
        patch: :mod:`stream_persia.server.patches`). When that cannot be known (the
        parent records no tracking, was written by another number of servers, a server
        restarted or was restored since, its eviction log was overrun), every server
        writes its full shard instead and the checkpoint is a new base whose manifest
        says why (``chain.full_because``; logged): never an incomplete patch.

        Each server dumps on its store thread, so its shard is a snapshot between two
        updates; a consistent cut across servers is the caller's job (nothing in flight).

        Args:
            server_clients: an ``RpcClient`` per embedding server, in replica order; their
                number becomes the manifest's ``shard_count``.
            timeout_ms: per-server limit for the dump.

        Returns:
            The shard file names, in replica order.

        Raises:
            Misuse: the clients are not every server of one job in replica order, or the
                servers hold different configurations (the manifest records theirs).
        """
        self._check_open()
        await check_server_set(server_clients, timeout_ms)
        since, why = _since(parent, self._dst, len(server_clients))
        replies = await self._dump(server_clients, since, timeout_ms)
        if since is not None:
            why = next((str(r["full_because"]) for r in replies if r.get("full_because")),
                       None)
            if why is not None:   # every server writes its full shard: a base
                self._drop_patch_files(replies)
                replies = await self._dump(server_clients, None, timeout_ms)
        if parent is not None and why is not None:
            log.warning("checkpoint %s: a full base instead of a patch of %s: %s",
                        self._dst.url, parent.path, why)
        names = []
        for i, r in enumerate(replies):
            try:
                name = check_file_name(r["file"], "file")
                entry = {"sha256": str(r["sha256"]), "bytes": int(r["bytes"]),
                         "rows": int(r["rows"])}
            except (KeyError, TypeError, ValueError, BadInput) as e:
                raise InternalError(f"embedding server {i} answered dump with {r!r}: {e}") \
                    from None
            if name in names:
                raise InternalError(f"embedding servers wrote the same shard file {name!r}")
            names.append(name)
            self._files[name] = entry
        for stale in set(self._embedding_files) - set(names):
            self._files.pop(stale, None)
        for r in replies:   # a patch's files of evicted ids
            if r.get("tombstones"):
                t = r["tombstones"]
                self._files[check_file_name(t["file"], "file")] = {
                    "sha256": str(t["sha256"]), "bytes": int(t["bytes"]), "rows": int(t["rows"])}
        self._embedding_files = names
        self._server_config = _one_config(replies)
        self._chain = _chain(self._dst.name, parent if why is None else None, replies, why,
                             self._files)
        self._server_marks = [r.get("watermarks") for r in replies]
        positions = [r.get("updates") for r in replies]
        self._update_positions = positions if all(p is not None for p in positions) else None
        return list(names)

    async def _dump(self, clients: Sequence[Any], since: list[dict] | None,
                    timeout_ms: float) -> list[dict]:
        return list(await asyncio.gather(*(
            c.call("dump", {"dir": self.staging} if since is None
                   else {"dir": self.staging, "since": since[i]}, timeout_ms=timeout_ms)
            for i, c in enumerate(clients))))

    def _drop_patch_files(self, replies: Sequence[dict]) -> None:
        """Remove the patch files some servers wrote before another could not patch."""
        for r in replies:
            for info in (r, r.get("tombstones")):
                if isinstance(info, dict) and r.get("tombstones") \
                        and _is_plain(info.get("file")):
                    path = self._stage.join(str(info["file"]))
                    if self._stage.fs.exists(path):
                        self._stage.fs.rm_file(path)

    @property
    def chain(self) -> dict[str, Any] | None:
        """The manifest's ``chain`` (after :meth:`dump_embeddings`)."""
        return None if self._chain is None else dict(self._chain)

    # ----------------------------------------------------------------- publishing
    def commit(self, *, job: str, step: int, offsets: dict[str, dict[str, int]], stream: str,
               schema: EmbeddingSchema | None = None, extra: dict[str, Any] | None = None,
               fingerprints: dict[str, dict[str, dict[str, Any]]] | None = None
               ) -> Manifest:
        """Write ``manifest.json`` (last), then make the checkpoint visible at ``dst``.

        Args:
            job: job name. step: training step of the cut.
            offsets: topic → partition → next offset to consume (partition keys may be
                ints; they are stored as decimal strings). ``{}`` for a direct stream.
            stream: ``"kafka"`` or ``"direct"``.
            schema: the job's embedding schema: its digest becomes the manifest's
                ``config_digest`` and the schema goes into ``extra["embedding_schema"]``,
                so that a restore into a job with another schema is refused naming what
                differs (:mod:`stream_persia.checkpoint.digest`). None: not known (no digest).
            extra: any JSON-serialisable metadata.
            fingerprints: topic → partition → the record below its offset (the cut's,
                :class:`~stream_persia.checkpoint.Cut`); None or empty: none recorded.

        Returns:
            The manifest, with ``path`` set to ``dst``.

        Raises:
            BadInput: an argument is invalid, or a patch's parent was deleted or written
                again meanwhile (``chain.parent``); nothing is published. Found before
                publishing, the writer stays open; found right after (a deletion that
                raced the publish), the patch is withdrawn and the writer aborted.
            StreamReplay: a Kafka cut whose offsets are at or below what an embedding
                server had applied when it dumped (its stream watermark): the cut is not
                consistent, and restoring it would train those batches twice.
        """
        self._check_open()
        if stream == "kafka":
            _check_cut(offsets, self._server_marks)
        files = self.files
        extra = {} if extra is None else dict(extra)
        if schema is not None:
            extra[SCHEMA_KEY] = schema.to_dict()
        manifest = Manifest(
            job=job, step=step, stream=stream, offsets=offsets,
            shard_count=len(self._embedding_files), files=files,
            embedding_files=list(self._embedding_files), config_digest=config_digest(schema),
            dense_filename=DENSE_FILENAME if DENSE_FILENAME in files else None,
            opt_filename=OPT_FILENAME if OPT_FILENAME in files else None,
            jit_filename=JIT_FILENAME if JIT_FILENAME in files else None,
            server_config=self._server_config, model_updates=self._update_positions,
            chain=self._chain, extra=extra, fingerprints=fingerprints or None)
        return self.publish(manifest)

    def publish(self, manifest: Manifest) -> Manifest:
        """Write ``manifest`` (last), then make the checkpoint visible at ``dst``: what
        :meth:`commit` does with the manifest it builds. ``manifest.files`` must be the
        files written (compaction builds its manifest from another one).

        Raises:
            Misuse: the manifest lists other files than were written.
        """
        self._check_open()
        if manifest.files != self._files:
            raise Misuse(f"the manifest for {self.dst} lists files "
                         f"{sorted(manifest.files)} but {sorted(self._files)} were written")
        self._check_parent(manifest)
        data = (json.dumps(manifest.to_dict(), indent=2) + "\n").encode()
        if self._dst.local:
            self._check_replaceable()
            _fsync_files(self._stage.path)
            with open(self._stage.join(MANIFEST_NAME), "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            _fsync_dir(self._stage.path)
            replaced = self._swap_into_place()
            self._recheck_parent(manifest, replaced)
            if replaced is not None:
                shutil.rmtree(replaced, ignore_errors=True)
        else:
            self._dst.fs.pipe_file(self._dst.join(MANIFEST_NAME), data)
            self._recheck_parent(manifest, None)
        self._state = "committed"
        manifest.path = self._dst.url
        log.info("checkpoint step %d of job %s committed at %s (%d shard(s), %d rows)",
                 manifest.step, manifest.job, self._dst.url, manifest.shard_count,
                 manifest.rows)
        return manifest

    def _check_parent(self, manifest: Manifest) -> None:
        """Refuse to publish a patch whose parent is gone (retention in another process, a
        delete) or was written again at its path since: no restore could load it, or one
        would load its rows over other rows.

        Raises:
            BadInput: naming the parent (``chain.parent``); nothing is published.
        """
        why = self._parent_changed(manifest)
        if why is not None:
            raise self._parent_error(manifest, why)

    def _recheck_parent(self, manifest: Manifest, replaced: str | None) -> None:
        """After publishing: a deletion of the parent that had checked for dependents
        before this patch was visible may have gone ahead since the check before
        publishing. Then the patch is withdrawn (the checkpoint it replaced at ``dst``, held
        at ``replaced`` until now, is put back) and the error raised; a deletion that
        checks after this patch was visible keeps the parent
        (:func:`~stream_persia.checkpoint.retention.delete_checkpoint`)."""
        why = self._parent_changed(manifest)
        if why is None:
            return
        self._state = "aborted"
        try:
            if self._dst.local:
                hidden = os.path.join(os.path.dirname(self._dst.path),
                                      f".{self._dst.name}.deleting-{uuid.uuid4().hex[:12]}")
                os.rename(self._dst.path, hidden)
                if replaced is not None:
                    os.rename(replaced, self._dst.path)
                shutil.rmtree(hidden, ignore_errors=True)
            else:
                delete_checkpoint(self._dst.url)
        except (OSError, Misuse) as e:
            parent = manifest.chain["parent"] if manifest.chain is not None else None
            raise BadInput(f"checkpoint {self.dst} is a patch of {parent!r}, which was "
                           f"deleted or written again as it was published ({why}), and it "
                           f"could not be withdrawn ({e}): it is published, but no restore "
                           "can load it", field="chain.parent",
                           hint="delete it and take a full checkpoint") from e
        raise self._parent_error(manifest, why)

    def _parent_changed(self, manifest: Manifest) -> str | None:
        link = manifest.chain
        if link is None or link["parent"] is None:
            return None
        url = f"{self._dst.url.rstrip('/').rsplit('/', 1)[0]}/{link['parent']}"
        try:
            parent = read_manifest(url)
            return (not_taken_since(parent, manifest) if parent.chain is not None
                    and parent.chain["id"] == link["parent"] else "another checkpoint")
        except BadInput as e:
            return e.message

    def _parent_error(self, manifest: Manifest, why: str) -> BadInput:
        parent = manifest.chain["parent"] if manifest.chain is not None else None
        return BadInput(f"checkpoint {self.dst} is a patch of {parent!r}, which changed "
                        f"while it was written ({why}): nothing was published",
                        field="chain.parent", hint="take a full checkpoint")

    def _swap_into_place(self) -> str | None:
        """Rename the staging directory to ``dst``; a checkpoint it replaces there is moved
        to a hidden sibling, returned (None: none) for the caller to delete once the new
        one stays."""
        dst = self._dst.path
        parent = os.path.dirname(dst)
        old = None
        if os.path.lexists(dst):
            old = os.path.join(parent, f".{self._dst.name}.old-{uuid.uuid4().hex[:12]}")
            os.rename(dst, old)
        # Between the two renames dst is missing; both the previous and the new checkpoint
        # are complete (each with its manifest) under their hidden names.
        try:
            os.rename(self._stage.path, dst)
        except BaseException:
            if old is not None:
                os.rename(old, dst)
            raise
        _fsync_dir(parent)
        return old

    def abort(self) -> None:
        """Remove everything written so far; ``dst`` is untouched (local) or left without a
        checkpoint (remote). Does nothing after :meth:`commit` or a previous abort."""
        if self._state != "open":
            return
        self._state = "aborted"
        if self._dst.local:
            shutil.rmtree(self._stage.path, ignore_errors=True)
        else:
            try:
                if self._stage.fs.exists(self._stage.path):
                    self._stage.fs.rm(self._stage.path, recursive=True)
            except OSError as e:   # best effort: without a manifest it is never read anyway
                log.warning("could not remove the partial checkpoint %s: %s", self.staging, e)

    def __enter__(self) -> CheckpointWriter:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.abort()

    # ----------------------------------------------------------------- checks
    def _check_open(self) -> None:
        if self._state != "open":
            raise Misuse(f"this checkpoint writer for {self.dst} is already {self._state}",
                         hint="create a new CheckpointWriter for another checkpoint")

    def _check_replaceable(self) -> None:
        fs, path = self._dst.fs, self._dst.path
        if not fs.exists(path):
            return
        if not fs.isdir(path):
            raise BadInput(f"checkpoint destination {self._dst.url} exists and is not a "
                           f"directory", field="dst")
        subdirs = [e["name"] for e in fs.ls(path, detail=True) if e.get("type") == "directory"]
        if subdirs:
            raise BadInput(f"checkpoint destination {self._dst.url} holds sub-directories "
                           f"({subdirs[0].rsplit('/', 1)[-1]!r}), so it is not a checkpoint: "
                           f"refusing to replace it", field="dst",
                           hint="give each checkpoint its own directory, e.g. ROOT/step-000100")


def _is_plain(name: Any) -> bool:
    return isinstance(name, str) and bool(name) and "/" not in name \
        and not name.startswith(".")


def _since(parent: Manifest | None, dst: Location, servers: int
           ) -> tuple[list[dict] | None, str | None]:
    """Each server's ``since`` for a patch of ``parent`` (None: none), and why not."""
    if parent is None:
        return None, None
    chain = parent.chain
    if chain is None:
        return None, f"the parent {parent.path} records no tracking (written before chains)"
    if Location(parent.path or "").url.rsplit("/", 1)[0] != dst.url.rsplit("/", 1)[0]:
        return None, f"the parent {parent.path} is not under the same root as {dst.url}"
    if chain["id"] == dst.name:
        return None, f"the parent {parent.path} is the checkpoint being replaced"
    if len(chain["tracking"]) != servers:
        return None, (f"the parent was written by {len(chain['tracking'])} embedding "
                      f"servers, the job has {servers} now")
    return [dict(t) for t in chain["tracking"]], None


def _chain(name: str, parent: Manifest | None, replies: Sequence[dict], why: str | None,
           files: dict[str, dict[str, Any]]) -> dict[str, Any] | None:
    """The manifest's ``chain`` (None: a server sent no tracking, an older one)."""
    tracking = [r.get("tracking") for r in replies]
    if not all(isinstance(t, dict) for t in tracking) \
            or not all(isinstance(r.get("held"), int) for r in replies):
        return None
    held = sum(int(r["held"]) for r in replies)
    if parent is None or parent.chain is None:
        return {"id": name, "parent": None, "base": name, "depth": 0, "rows": held,
                "tombstone_files": [], "tracking": tracking, "full_because": why}
    return {"id": name, "parent": parent.chain["id"], "base": parent.chain["base"],
            "depth": parent.chain["depth"] + 1, "rows": held,
            "tombstone_files": [str(r["tombstones"]["file"]) for r in replies],
            "tracking": tracking, "full_because": None}


def _one_config(replies: Sequence[dict]) -> dict[str, Any] | None:
    """The configuration every server dumped with (their ``dump`` replies' ``config``),
    recorded in the manifest; None when a server does not say (an older server).

    Raises:
        Misuse: the servers hold different configurations: their shards' optimizer state
            would not load into one job.
    """
    configs = [c for r in replies if isinstance(c := r.get("config"), dict)]
    if len(configs) != len(replies):
        return None
    digests = [c.get("digest") for c in configs]
    if len(set(digests)) != 1:
        raise Misuse(f"the embedding servers hold different configurations (digests "
                     f"{digests}): their shards cannot make one checkpoint",
                     hint="configure every server alike (POST /v1/embeddings/configure, "
                          "or TrainCtx does it) and checkpoint again")
    return dict(configs[0])


def _check_cut(offsets: dict[str, dict[str, int]], server_marks: Sequence[Any]) -> None:
    """Refuse a cut that records a partition at or below the offset some server had applied
    when it dumped (the rule a worker's start obeys, :func:`stream_persia.core.watermarks.
    refusals`): every batch at or after the cut must be unapplied in the checkpoint's rows.
    A server that sent no watermarks (an older one) says nothing."""
    replies: list[WatermarksReply] = [{"topics": m if isinstance(m, dict) else {}}
                                      for m in server_marks]
    for topic, parts in offsets.items():
        starts = {int(p): int(o) for p, o in parts.items()}
        for r in watermarks.refusals(topic, watermarks.merge(replies, topic), starts):
            m = r.mark
            by = m.writer or "a checkpoint restored before"
            raise StreamReplay(
                f"the checkpoint's offsets record {topic}/{r.partition} at {r.start}, but "
                f"embedding server {m.server} holds the updates of that partition up to "
                f"offset {m.offset} (applied by {by}): restoring it would train offsets "
                f"{r.start}..{m.offset} a second time; nothing was published (a worker "
                f"started the partition over, or a batch was applied after the cut was "
                f"read)", field="offsets", hint=RESTORE_HINT)


def _fsync_files(directory: str) -> None:
    for entry in os.scandir(directory):
        if entry.is_file(follow_symlinks=False):
            fd = os.open(entry.path, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)


def _fsync_dir(directory: str) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
