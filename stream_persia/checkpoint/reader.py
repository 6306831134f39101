"""Reading a checkpoint: manifest, checksums, embedding restore (any server count), torch.

Size: one module because a restore is one protocol: the chain it reads (``chain_of``), the
files it checks and the staged load across servers, with its commit, roll-forward and
fallbacks for older servers, share one load request and one set of checks of the
manifest; split, the request would be built in one place and its fallbacks handled in
another.
"""

from __future__ import annotations

import asyncio
import hashlib
import io
import json
import logging
from collections.abc import Sequence
from datetime import datetime, timezone
from typing import Any

from stream_persia.checkpoint._common import (
    DEFAULT_SHARD_TIMEOUT_MS,
    Location,
    check_replica,
    check_server_set,
    sha256_file,
)
from stream_persia.checkpoint.manifest import (
    MANIFEST_NAME,
    Manifest,
    check_file_name,
    not_taken_since,
)
from stream_persia.core.data import check_event_time
from stream_persia.errors import (
    BadInput,
    InternalError,
    PeerUnavailable,
    PersiaError,
    RemoteError,
    RemoteTimeout,
    refused_as_unknown,
)

__all__ = ["read_manifest", "verify", "chain_of", "load_embeddings", "load_torch", "list_checkpoints",
           "latest_checkpoint"]

log = logging.getLogger(__name__)

# How long load_embeddings keeps loading a server whose commit failed while it cannot be
# reached: long enough for a supervisor (Kubernetes, stream-persia run) to restart it.
DEFAULT_ROLL_FORWARD_S = 120.0


def read_manifest(src: str) -> Manifest:
    """The manifest of the checkpoint at ``src`` (``path`` set to ``src``).

    Raises:
        BadInput: no manifest ("incomplete or not a checkpoint"), invalid JSON, or a
            manifest that fails validation (names the key), or an unknown format version.
    """
    loc = Location(src)
    try:
        raw = loc.fs.cat_file(loc.join(MANIFEST_NAME))
    except (FileNotFoundError, IsADirectoryError, NotADirectoryError):
        raise BadInput(f"{loc.url} is incomplete or not a checkpoint: it has no "
                       f"{MANIFEST_NAME}", field="src", hint=_interrupted_hint(loc)) from None
    try:
        d = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise BadInput(f"{loc.url}/{MANIFEST_NAME} is not valid JSON: {e}",
                       field="manifest") from None
    try:
        return Manifest.from_dict(d, path=loc.url)
    except BadInput as e:
        raise BadInput(f"{loc.url}/{MANIFEST_NAME}: {e.message}", field=e.field,
                       hint=e.hint) from None


def _interrupted_hint(loc: Location) -> str | None:
    """Point at a complete checkpoint left under a hidden name by an interrupted publish."""
    if not loc.local or loc.fs.exists(loc.path):
        return None
    parent = loc.path.rsplit("/", 1)[0] or "/"
    try:
        names = loc.fs.ls(parent, detail=False)
    except FileNotFoundError:
        return None
    prefixes = {f".{loc.name}.old-": "previous", f".{loc.name}.staging-": "new"}
    found = [f"{path} ({what})" for path in sorted(names)
             for prefix, what in prefixes.items()
             if path.rsplit("/", 1)[-1].startswith(prefix)
             and loc.fs.exists(f"{path}/{MANIFEST_NAME}")]
    if not found:
        return None
    return (f"publishing {loc.path} was interrupted; complete checkpoint(s) left under hidden "
            f"names: {', '.join(found)}; rename one to {loc.path}")


def _check_file(loc: Location, name: str, entry: dict[str, Any], *, checksum: bool) -> None:
    path = loc.join(name)
    if not loc.fs.exists(path):
        raise BadInput(f"checkpoint {loc.url}: file {name} is missing", field=f"files.{name}")
    if checksum:
        digest, size = sha256_file(loc.fs, path)
    else:
        digest, size = None, loc.fs.size(path)
    if size != entry["bytes"]:
        raise BadInput(f"checkpoint {loc.url}: file {name} has {size} bytes but the manifest "
                       f"records {entry['bytes']} (truncated or overwritten)",
                       field=f"files.{name}")
    if digest is not None and digest != entry["sha256"]:
        raise BadInput(f"checkpoint {loc.url}: file {name} is corrupt (sha256 {digest[:12]}… "
                       f"but the manifest records {entry['sha256'][:12]}…)",
                       field=f"files.{name}")


def chain_of(src: str) -> list[Manifest]:
    """The checkpoints a restore of ``src`` loads, its base first and ``src`` last (one
    for a full checkpoint). A patch's parent is its sibling directory named by
    ``chain.parent`` (:mod:`stream_persia.checkpoint.manifest`).

    Raises:
        BadInput: ``src`` or a checkpoint of its chain is missing, incomplete or not the
            one the patch was taken on (names it; the chain up to its parent restores).
    """
    manifest = read_manifest(src)
    chain = [manifest]
    while manifest.is_patch:
        link = manifest.chain or {}
        loc = Location(manifest.path or src)
        parent_url = f"{loc.url.rsplit('/', 1)[0]}/{link['parent']}"
        try:
            parent = read_manifest(parent_url)
        except BadInput as e:
            raise BadInput(f"checkpoint {chain[-1].path} is a patch of {link['parent']!r}, "
                           f"which cannot be read: {e.message}", field="chain.parent",
                           hint=f"restore a checkpoint that does not depend on it; "
                                f"{parent_url} is needed by every later patch of its "
                                "chain") from None
        pc = parent.chain
        if pc is None or pc["id"] != link["parent"] or pc["base"] != link["base"] \
                or pc["depth"] != link["depth"] - 1:
            raise BadInput(f"checkpoint {manifest.path} is a patch of {link['parent']!r} "
                           f"(base {link['base']!r}, depth {link['depth'] - 1}), but "
                           f"{parent_url} is another checkpoint ({pc and pc['id']!r}, base "
                           f"{pc and pc['base']!r}, depth {pc and pc['depth']})",
                           field="chain.parent")
        why = not_taken_since(parent, manifest)
        if why is not None:
            raise BadInput(f"checkpoint {manifest.path} is a patch of {link['parent']!r}, but "
                           f"{parent_url} is not the checkpoint it was taken on: {why}",
                           field="chain.parent", hint="it was written again at its path since")
        if len(chain) > 100_000:
            raise BadInput(f"checkpoint {src}: its chain does not end", field="chain")
        chain.append(parent)
        manifest = parent
    return chain[::-1]


def verify(src: str) -> None:
    """Recompute the size and sha256 of every file the manifest lists, and, for a patch,
    of every checkpoint of its chain (:func:`chain_of`).

    Raises:
        BadInput: the manifest is missing or invalid, or a file is missing, truncated or
            corrupt (the message names the checkpoint and the file), or the chain is
            broken (names the missing parent).
    """
    for manifest in chain_of(src):
        loc = Location(manifest.path or src)
        for name, entry in manifest.files.items():
            _check_file(loc, name, entry, checksum=True)


async def load_embeddings(src: str, server_clients: Sequence[Any], *,
                          timeout_ms: float = DEFAULT_SHARD_TIMEOUT_MS,
                          verify_checksums: bool = False,
                          roll_forward_s: float = DEFAULT_ROLL_FORWARD_S) -> int:
    """Restore the embedding rows of a checkpoint into any number of embedding servers.

    Servers that hold no configuration (fresh ones) are first configured with the one
    the manifest records (``server_config``: the embedding optimizer and EmbeddingConfig
    the shards were written with), so the optimizer state loads and training goes on as
    it would have. Every server reads every shard file and keeps the rows it owns
    (``shard_of(id, len(server_clients))``), so a checkpoint written by S servers loads into
    S' servers. Each server's rows are replaced: afterwards the servers hold exactly the
    checkpoint's rows (with their optimizer state and recency order), and, with them, the
    checkpoint's cut as their stream watermarks (``load``'s ``cut``: the manifest's
    offsets for a Kafka stream, none for a direct one; :mod:`stream_persia.core.watermarks`),
    so that the workers serve the stream from the cut on and never below it.

    All or nothing across the servers, in two phases. First every server builds the new
    table beside the one it serves, checking every file against the manifest's size,
    sha256 and row count as it reads it (``load`` with ``stage``: see
    :mod:`stream_persia.server.service` and :mod:`stream_persia.server.shard_files`). Only when
    every server has staged its table, and the rows they kept add up to the checkpoint's,
    are the tables swapped in (``commit_load``, which allocates nothing and so cannot run
    out of memory). If any server fails to stage, the others drop what they staged and
    every server keeps what it held.

    Once every server has staged, the restore goes forward: a server whose commit fails
    (it died or restarted between the phases and lost what it staged, the reply was lost,
    the staged table expired) is loaded again directly (``load`` without ``stage``; the
    files were checked and the same load is idempotent), retried with backoff for up to
    ``roll_forward_s`` while the server cannot be reached, so a server restarted by its
    supervisor within that time ends with the checkpoint like the others.

    Args:
        src: the checkpoint directory.
        server_clients: an ``RpcClient`` per embedding server, in replica order.
        timeout_ms: per-server limit for each phase.
        verify_checksums: also hash the shard files here before any server reads them
            (reads them once more; the servers check the sha256 either way).
        roll_forward_s: how long to keep loading a server whose commit failed while it
            cannot be reached (0: one attempt).

    Returns:
        Rows loaded over all servers.

    Raises:
        BadInput: not a checkpoint, a shard file is missing, truncated or corrupt, or a
            server ran out of memory: no server changed.
        Misuse: the clients are not every server of one job in replica order.
        RemoteError: a server failed or could not be reached while staging (no server
            changed), or its commit failed and loading it again did not succeed within
            ``roll_forward_s``: then the error names the servers that hold the checkpoint
            and those that do not; load again.
    """
    chain = chain_of(src)
    manifest, base = chain[-1], chain[0]
    loc = Location(manifest.path or src)
    for m in chain:   # cheap checks before any server reads
        for name in [*m.embedding_files, *(m.chain["tombstone_files"] if m.chain else [])]:
            _check_file(Location(m.path or src), name, m.files[name],
                        checksum=verify_checksums)
    await check_server_set(server_clients, timeout_ms)
    await _configure_fresh(manifest, server_clients, timeout_ms)

    def expect(m: Manifest, names: list[str]) -> dict[str, dict[str, Any]]:
        return {name: {k: v for k, v in m.files[name].items()
                       if k in ("sha256", "bytes", "rows")} for name in names}

    request: dict[str, Any] = {
        "dir": Location(base.path or src).url, "files": base.embedding_files,
        "expected": expect(base, base.embedding_files),
        "cut": manifest.offsets if manifest.stream == "kafka" else {}}
    if manifest.stream == "kafka" and manifest.fingerprints:
        # kept with the restored watermarks: a worker that resumes at them (restarted
        # after the restore) checks the topic is still this one, as the restore did
        request["cut_fingerprints"] = manifest.fingerprints
    if len(chain) > 1:   # the patches, in order, over the base
        request["patches"] = [
            {"dir": Location(m.path or src).url, "files": m.embedding_files,
             "tombstones": (m.chain or {})["tombstone_files"],
             "expected": expect(m, [*m.embedding_files, *(m.chain or {})["tombstone_files"]])}
            for m in chain[1:]]
    through = _trained_through(manifest)
    if through is not None:   # the restored rows' trained_through (not the replaced ones')
        request["trained_through"] = through
    staged = await _stage(server_clients, request, timeout_ms)
    while (field := _refused_optional(staged, request)) is not None:
        # a server from before the field (a rolling upgrade): it goes without
        log.warning("restore of %s: an embedding server does not take the checkpoint's "
                    "%s (an older version): loading without it", loc.url, field)
        await _abort(server_clients, staged, timeout_ms)
        del request[field]
        staged = await _stage(server_clients, request, timeout_ms)
    failed = [(i, r) for i, r in enumerate(staged) if isinstance(r, BaseException)]
    loaded = sum(int(r["rows"]) for r in staged if not isinstance(r, BaseException))
    if failed or loaded != manifest.table_rows:
        await _abort(server_clients, staged, timeout_ms)
        if failed:
            i, error = failed[0]
            if len(failed) > 1:
                log.warning("restore of %s: %d servers failed to stage (replicas %s); "
                            "raising replica %d's error", loc.url, len(failed),
                            [k for k, _ in failed], i)
            raise error
        raise InternalError(f"servers staged {loaded} rows from {loc.url} but it holds "
                            f"{manifest.table_rows}: every row should have exactly one owner; "
                            "no server changed")
    replies = [r for r in staged if not isinstance(r, BaseException)]   # every one, now
    commits = await asyncio.gather(*(
        c.call("commit_load", {"token": r["token"]}, timeout_ms=timeout_ms)
        for c, r in zip(server_clients, replies, strict=True)), return_exceptions=True)
    bad = [i for i, r in enumerate(commits) if isinstance(r, BaseException)]
    if bad:
        failures = await asyncio.gather(*(
            _roll_forward(server_clients[i], i, len(server_clients), request,
                          int(replies[i]["rows"]), commits[i], timeout_ms, roll_forward_s,
                          _job_config(manifest))
            for i in bad))
        still = [(i, e) for i, e in zip(bad, failures, strict=True) if e is not None]
        if still:
            lost = [i for i, _ in still]
            done = [i for i in range(len(commits)) if i not in lost]
            raise RemoteError(f"restore of {loc.url}: embedding servers {lost} did not take "
                              f"the checkpoint ({still[0][1]}) while servers {done} did: "
                              "they disagree until a restore succeeds",
                              hint="load the checkpoint again") from still[0][1]
    held = sum(await asyncio.gather(*(c.call("size", None) for c in server_clients)))
    if held < loaded:
        log.warning("embedding servers hold %d of the %d rows restored from %s: their "
                    "capacity is too small and the least recent rows were evicted",
                    held, loaded, loc.url)
    return loaded


#: ``load`` fields newer than the rest: a server from before one refuses it as unknown,
#: and is then loaded without it (a rolling upgrade) rather than fail the restore.
OPTIONAL_LOAD_FIELDS = ("trained_through", "cut_fingerprints")


def _refused_optional(results: Sequence[Any], request: dict[str, Any]) -> str | None:
    """The optional field of ``request`` a server refused as unknown, if any."""
    for r in results:
        if isinstance(r, BadInput):
            for field in OPTIONAL_LOAD_FIELDS:
                if field in request and refused_as_unknown(r, field):
                    return field
    return None


async def _stage(clients: Sequence[Any], request: dict[str, Any],
                 timeout_ms: float) -> list[Any]:
    """Every server's staged ``load`` of ``request``: its reply, or its error."""
    return list(await asyncio.gather(*(
        c.call("load", {**request, "stage": True}, timeout_ms=timeout_ms)
        for c in clients), return_exceptions=True))


def _trained_through(manifest: Manifest) -> float | None:
    """The event time the checkpoint is trained through (its ``extra``), if valid."""
    value = (manifest.extra or {}).get("trained_through")
    try:
        return check_event_time(value, "extra.trained_through")
    except BadInput as e:
        log.warning("checkpoint %s: %s; its trained_through is unknown", manifest.path,
                    e.message)
        return None


async def _configure_fresh(manifest: Manifest, clients: Sequence[Any],
                           timeout_ms: float) -> None:
    """Configure the servers that hold no configuration (fresh, or restarted and not yet
    configured by the job) with the one the checkpoint was written with, so that they
    take its optimizer state and then train as the job did. A server that holds a
    configuration keeps it (the job's, or one an operator set on purpose); one that
    differs from the checkpoint's is logged. The checkpoint's table policies are not
    given (:func:`_job_config`)."""
    want, given = manifest.server_config, _job_config(manifest)
    if want is None or given is None:
        return
    held = await asyncio.gather(*(c.call("get_config", None, timeout_ms=timeout_ms)
                                  for c in clients))
    fresh = [c for c, h in zip(clients, held, strict=True) if h is None]
    for i, h in enumerate(held):
        if h is not None and h.get("digest") != want["digest"]:
            log.warning("restore of %s: embedding server %d holds configuration %s, not the "
                        "checkpoint's %s (%s): it keeps its own", manifest.path, i,
                        h.get("digest"), want["digest"], want["optimizer"])
    if fresh:
        log.info("restore of %s: configuring %d embedding server(s) that hold no "
                 "configuration with the checkpoint's (%s)", manifest.path, len(fresh),
                 want["optimizer"])
        await asyncio.gather(*(c.call("configure", given, timeout_ms=timeout_ms)
                               for c in fresh))


def _job_config(manifest: Manifest) -> dict[str, Any] | None:
    """The ``configure`` a restore gives servers that hold none: the checkpoint's optimizer
    and EmbeddingConfig, without its table policies. Policies belong to the job (its
    embedding_config.yml, which the launcher gives every server, or the API's configure)
    and a restore reads rows across them (dtypes included), as the schema digest leaves
    them out: a fresh server keeps what it was launched with, whatever the order of the
    restore and the NN's own configure."""
    want = manifest.server_config
    if want is None:
        return None
    return {"optimizer": want["optimizer"], "embedding_config": want["embedding_config"]}


async def _roll_forward(client: Any, replica: int, replicas: int, request: dict,
                        rows: int, error: BaseException, timeout_ms: float,
                        budget_s: float, config: dict | None = None) -> BaseException | None:
    """Bring replica ``replica``, whose commit failed with ``error``, to the checkpoint
    the others committed: ``load`` it directly (``rows`` holds the rows it staged, which
    the load must keep again). Retried with backoff while the server cannot be reached,
    for up to ``budget_s``; None once it holds the checkpoint, else the last error."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + budget_s
    delay = 0.2
    log.warning("restore of %s: embedding server %d did not commit its staged load (%s); "
                "loading it again (retrying for up to %g s while it cannot be reached)",
                request["dir"], replica, error, budget_s)
    while True:
        try:
            # A server restarted at this address must still be this replica of this job.
            check_replica(await client.call("health", None, timeout_ms=timeout_ms),
                          replica, replicas)
            if config is not None and await client.call("get_config", None,
                                                        timeout_ms=timeout_ms) is None:
                await client.call("configure", config, timeout_ms=timeout_ms)  # restarted
            reply = await client.call("load", request, timeout_ms=timeout_ms)
        except (PeerUnavailable, RemoteTimeout) as exc:
            error = exc
        except PersiaError as exc:   # another replica there, out of memory, a file changed
            field = _refused_optional([exc], request)
            if field is not None:
                # it came back as an older version (a rolling upgrade): load it without
                request = {k: v for k, v in request.items() if k != field}
                continue
            return exc
        else:
            if int(reply["rows"]) != rows:
                return InternalError(f"embedding server {replica} kept {reply['rows']} rows "
                                     f"of the checkpoint on loading it again, {rows} when "
                                     "it staged it")
            log.info("restore of %s: embedding server %d loaded it again", request["dir"],
                     replica)
            return None
        if loop.time() + delay > deadline:
            return error
        await asyncio.sleep(delay)
        delay = min(delay * 2, 5.0)


async def _abort(clients: Sequence[Any], staged: Sequence[Any], timeout_ms: float) -> None:
    """Drop what the servers staged (best effort: a server that cannot be told drops it
    after its ``stage_ttl_s``, or when it loads again)."""
    tokens = [(c, r["token"]) for c, r in zip(clients, staged, strict=True)
              if not isinstance(r, BaseException)]
    results = await asyncio.gather(*(c.call("abort_load", {"token": t}, timeout_ms=timeout_ms)
                                     for c, t in tokens), return_exceptions=True)
    for r in results:
        if isinstance(r, BaseException):
            log.warning("could not abort a staged load (it is dropped after the server's "
                        "stage_ttl_s): %s", r)


def load_torch(src: str, name: str, map_location: Any = None, *,
               weights_only: bool = True) -> Any:
    """``torch.load`` one file of the checkpoint, after checking it against the manifest.

    Args:
        src: the checkpoint directory. name: e.g. ``manifest.dense_filename``.
        map_location: as for ``torch.load`` (e.g. ``"cpu"``).
        weights_only: as for ``torch.load``; state dicts need nothing more.

    Raises:
        BadInput: not a checkpoint, no such file in it, the file is corrupt, or torch
            cannot load it (names the file).
    """
    import torch

    manifest = read_manifest(src)
    check_file_name(name)
    entry = manifest.files.get(name)
    if entry is None:
        raise BadInput(f"checkpoint {manifest.path} has no file {name!r}", field="name",
                       hint=f"files: {', '.join(sorted(manifest.files)) or 'none'}")
    loc = Location(src)
    data = loc.fs.cat_file(loc.join(name))
    if len(data) != entry["bytes"] or hashlib.sha256(data).hexdigest() != entry["sha256"]:
        raise BadInput(f"checkpoint {loc.url}: file {name} is corrupt or truncated "
                       f"(its size or sha256 differs from the manifest)", field=f"files.{name}")
    try:
        return torch.load(io.BytesIO(data), map_location=map_location,
                          weights_only=weights_only)
    except Exception as e:   # whatever torch raises on bytes that are not its format
        detail = (str(e).strip().splitlines() or [""])[-1][:200]
        raise BadInput(f"checkpoint {loc.url}: file {name} matches its checksum but torch "
                       f"cannot load it ({type(e).__name__}: {detail})",
                       field=f"files.{name}",
                       hint="it was not written by torch.save, or by an incompatible "
                            "torch") from None


def _created(m: Manifest) -> datetime:
    t = datetime.fromisoformat(m.created_at.replace("Z", "+00:00"))
    return t if t.tzinfo is not None else t.replace(tzinfo=timezone.utc)


def newest_last(m: Manifest) -> tuple:
    """Sort key putting the newest checkpoint last: latest ``created_at``, then highest
    step, then path (not step first: a run restored from an older one goes on below)."""
    return _created(m), m.step, m.path or ""


def list_checkpoints(root: str) -> list[Manifest]:
    """Complete checkpoints directly under ``root``, oldest step first (then time, path).

    Directories without a manifest (being written, or abandoned) and hidden staging
    directories are skipped; so are directories whose manifest is invalid (logged).
    A missing ``root`` has no checkpoints.
    """
    loc = Location(root)
    if not loc.fs.exists(loc.path) or not loc.fs.isdir(loc.path):
        return []
    found = []
    for entry in loc.fs.ls(loc.path, detail=True):
        if entry.get("type") != "directory":
            continue
        path = str(entry["name"]).rstrip("/")
        if path.rsplit("/", 1)[-1].startswith("."):
            continue
        child = path if loc.local else loc.fs.unstrip_protocol(path)
        if not loc.fs.exists(f"{path}/{MANIFEST_NAME}"):
            log.debug("skipping %s: no manifest (incomplete)", child)
            continue
        try:
            found.append(read_manifest(child))
        except BadInput as e:
            log.warning("skipping %s: %s", child, e)
    found.sort(key=lambda m: (m.step, _created(m), m.path or ""))
    return found


def latest_checkpoint(root: str, job: str | None = None) -> Manifest | None:
    """The newest complete checkpoint under ``root`` (:func:`newest_last`), of ``job``
    only when given (a shared root), or None."""
    found = [m for m in list_checkpoints(root) if job is None or m.job == job]
    return max(found, key=newest_last) if found else None
