"""Incremental checkpoints on the embedding server: a shard's *patch* since a parent
checkpoint, and applying patches over a base when loading.

Tracking (no second bookkeeping: the store's change versions and eviction log, which the
update feed to serving replicas reads too, :mod:`stream_persia.server.updates`). Every
``dump`` reply carries ``tracking`` ``{"incarnation", "loads", "version"}``: the server
process, how many loads had replaced its table, and the store's ``change_version`` when
the shard was read (on the store thread, so the rows and the version are one moment).
A checkpoint records it per shard; a later ``dump`` given it as ``since`` writes only what
changed after it:

- ``embedding-patch-<i>-of-<n>.bin``: the rows changed after ``version`` with their
  optimizer state (``changed_since(version, state=True)``: values and state read together),
  in the shard-file format (:mod:`stream_persia.server.shard_files`);
- ``embedding-tombstones-<i>-of-<n>.bin``: the ids evicted or removed after ``version``
  (``evicted_since``), as records ``{"ids": uint64}`` in the same framing.

A patch is only taken when the store can say what changed: the same process
(``incarnation``), the same table (``loads``: a restore replaced it), ``version`` not
ahead of the store, and an eviction log that still reaches back to ``version`` with no
``clear()`` since (``evicted_since``'s ``complete``). Otherwise the server writes its full
shard and the reply's ``full_because`` says why; the checkpoint writer then takes a full
base (:class:`stream_persia.checkpoint.CheckpointWriter`), never an incomplete patch.

Loading (``load``'s ``patches``, in order after the base ``files``): for each patch, the
ids of its tombstone files this shard owns are removed from the staging table, then the
rows of its patch files this shard owns are written over it (tombstones first: an id
evicted and admitted again after the parent is in both). Every file is checked against
``expected`` as the base's are (size, sha256, row count), and a failure names the patch
directory and file.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from stream_persia.errors import BadInput, require
from stream_persia.kernels.sharding import shard_of
from stream_persia.server.shard_files import (
    is_plain_file_name,
    read_shard_file,
    stage_shard_files,
    write_shard_file,
)

__all__ = ["check_patches", "check_since", "patch_file_names", "stage_patches",
           "tracking", "write_patch"]

_TRACKING_KEYS = ("incarnation", "loads", "version")
#: most tombstones per record of a tombstone file (8 MiB of ids)
_TOMBSTONES_PER_RECORD = 1 << 20


def patch_file_names(replica_index: int, replica_size: int) -> tuple[str, str]:
    """(rows file, tombstones file) of shard ``replica_index`` of ``replica_size``."""
    tail = f"{replica_index:05d}-of-{replica_size:05d}.bin"
    return f"embedding-patch-{tail}", f"embedding-tombstones-{tail}"


def tracking(incarnation: str, loads: int, store: Any) -> dict[str, Any]:
    """Where ``store`` is now (read on the store thread with the rows)."""
    return {"incarnation": incarnation, "loads": int(loads),
            "version": int(store.change_version)}


def check_since(value: Any) -> dict[str, Any]:
    """``dump``'s ``since`` (a ``tracking`` a previous dump answered), validated."""
    if not isinstance(value, dict) or set(value) != set(_TRACKING_KEYS):
        raise BadInput(f"since must be {{'incarnation': str, 'loads': int, 'version': int}} "
                       f"(a dump's tracking), got {str(value)[:120]}", field="since")
    if not isinstance(value["incarnation"], str) or not 0 < len(value["incarnation"]) <= 64:
        raise BadInput(f"since.incarnation must be a non-empty string, got "
                       f"{value['incarnation']!r}"[:160], field="since.incarnation")
    for key in ("loads", "version"):
        v = value[key]
        if isinstance(v, bool) or not isinstance(v, int) or v < 0:
            raise BadInput(f"since.{key} must be an int >= 0, got {v!r}",
                           field=f"since.{key}")
    return dict(value)


def why_full(since: dict[str, Any], now: dict[str, Any], complete: bool) -> str | None:
    """Why the store cannot tell what changed after ``since`` (None: it can)."""
    if since["incarnation"] != now["incarnation"]:
        return (f"the server restarted since the parent (incarnation {since['incarnation']} "
                f"then, {now['incarnation']} now)")
    if since["loads"] != now["loads"]:
        return "a restore replaced the server's table since the parent"
    if since["version"] > now["version"]:
        return (f"the parent's version {since['version']} is ahead of the store's "
                f"{now['version']}")
    if not complete:
        return ("the store's eviction log no longer reaches back to the parent (it "
                "overflowed, or the table was cleared)")
    return None


def write_patch(store: Any, since: dict[str, Any], now: dict[str, Any], directory: str,
                replica_index: int, replica_size: int) -> dict[str, Any] | None:
    """Write the shard's patch since ``since`` into ``directory`` (on the store thread);
    returns ``{"rows": ShardFileInfo, "tombstones": ShardFileInfo}``, or None when the
    store cannot tell what changed (:func:`why_full` then says why)."""
    tombs, _, complete = store.evicted_since(since["version"])
    if why_full(since, now, complete) is not None:
        return None
    rows_name, tombs_name = patch_file_names(replica_index, replica_size)
    chunks = (_stored(c) for c in store.changed_since(since["version"], state=True)
              if len(c["ids"]))
    rows = write_shard_file(chunks, directory, rows_name)
    tombs = np.unique(tombs)   # an id evicted twice is removed once
    records = ({"ids": tombs[i:i + _TOMBSTONES_PER_RECORD]}
               for i in range(0, len(tombs), _TOMBSTONES_PER_RECORD))
    return {"rows": rows, "tombstones": write_shard_file(records, directory, tombs_name)}


def _stored(chunk: dict[str, Any]) -> dict[str, Any]:
    return {k: chunk[k] for k in ("dim", "ids", "weights", "state", "state_kind")}


def check_patches(params: Any) -> list[dict[str, Any]]:
    """``load``'s ``patches``: ``[{"dir", "files", "tombstones", "expected"}]``, each
    file named once with its expected entry (BadInput naming the field)."""
    patches = params.get("patches", [])
    if not isinstance(patches, list) or len(patches) > 4096:
        raise BadInput("patches must be a list of at most 4096 {dir, files, tombstones, "
                       "expected}", field="patches")
    out = []
    for i, p in enumerate(patches):
        where = f"patches[{i}]"
        if not isinstance(p, dict) or set(p) != {"dir", "files", "tombstones", "expected"}:
            raise BadInput(f"{where} must be {{dir, files, tombstones, expected}}, got "
                           f"{str(p)[:120]}", field=where)
        require(p, "dir", str)
        names = [*require(p, "files", list), *require(p, "tombstones", list)]
        expected = p["expected"]
        if not isinstance(expected, dict) or set(expected) != set(names) \
                or len(set(names)) != len(names):
            raise BadInput(f"{where}.expected must have one entry per file and tombstone "
                           f"file, and no file may be listed twice", field=f"{where}.expected")
        for name in names:
            entry = expected[name]
            if not is_plain_file_name(name) or not isinstance(entry, dict) \
                    or set(entry) != {"sha256", "bytes", "rows"}:
                raise BadInput(f"{where}: {name!r} must be a plain file name with an "
                               f"expected {{sha256, bytes, rows}}", field=f"{where}.files")
        out.append(p)
    return out


def stage_patches(staging: Any, patches: list[dict[str, Any]], replica_index: int,
                  replica_size: int, *, held_rows: int = 0) -> None:
    """Apply ``patches`` in order over the base staged in ``staging`` (module docstring).
    Raises BadInput naming the patch directory and file on any check that fails."""
    for i, p in enumerate(patches):
        directory, expected = p["dir"], p["expected"]
        for k, name in enumerate(p["tombstones"]):
            field = f"patches[{i}].tombstones[{k}]"
            for record in read_shard_file(directory, name, expected=expected[name],
                                          field=field):
                ids = np.asarray(record["ids"], np.uint64)
                owned = ids[shard_of(ids, replica_size) == replica_index]
                if len(owned):
                    staging.remove(np.ascontiguousarray(owned))
        try:
            stage_shard_files(staging, directory, p["files"], expected, replica_index,
                              replica_size, held_rows=held_rows)
        except BadInput as e:
            raise BadInput(f"patch {directory}: {e.message}",
                           field=f"patches[{i}].{e.field}", hint=e.hint) from None
