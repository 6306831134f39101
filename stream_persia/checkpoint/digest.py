"""The manifest's ``config_digest``: which job configuration a checkpoint's rows belong to.

Written by :meth:`stream_persia.checkpoint.CheckpointWriter.commit` from the job's
embedding schema (every writer passes it: ``dump_checkpoint``, ``dump_embedding``, the
API's cut) and checked by every restore (``load_checkpoint`` / ``load_embedding``, the
API's ``POST /v1/checkpoints/{id}/restore``) with :func:`check_config`.

What it covers: the embedding schema (``embedding_config.yml``,
:meth:`stream_persia.config.EmbeddingSchema.digest`): ``feature_index_prefix_bit``, every
slot in order with its ``dim``, ``sample_fixed_size``, ``embedding_summation``,
``sqrt_scaling`` and ``hash_stack_config``, and the ``feature_groups``. Those decide which
row an id is (the group prefix, the hash stack) and what a row means (its width, how the
dense model consumes it): rows restored under another schema are read as other slots or
dims, silently. What it leaves out: ``global_config.yml`` (addresses, ports, batch sizes,
timeouts, Kafka names: a job moved or retuned still reads its rows), and the embedding
optimizer and initialisation, which the manifest's ``server_config`` carries (a restore
configures fresh servers with it), and the slots' table policies (``min_count``, ``ttl_s``,
``max_rows``, ``dtype``, ...: which rows are kept and how they are stored, not what a row
is; ``server_config`` records them, and a restore leaves them to the job).

The digest is ``schema-v1:<sha256 hex>``; the schema itself goes into the manifest's
``extra["embedding_schema"]``, so a refused restore names what differs (a slot, its dim,
the prefix bits, ...). A checkpoint without a digest, or with one in an older form (a bare
hex digest of other inputs), is restored without the check, and the restore logs it.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

from stream_persia.checkpoint.manifest import Manifest
from stream_persia.config.embedding import EmbeddingSchema
from stream_persia.errors import Misuse

__all__ = ["DIGEST_PREFIX", "SCHEMA_KEY", "config_digest", "check_config",
           "schema_differences"]

log = logging.getLogger(__name__)

DIGEST_PREFIX = "schema-v1:"
SCHEMA_KEY = "embedding_schema"   # the key of ``Manifest.extra`` that holds the schema


def config_digest(schema: EmbeddingSchema | None) -> str | None:
    """The manifest's ``config_digest`` of a job with ``schema`` (None: not known)."""
    return None if schema is None else DIGEST_PREFIX + schema.digest()


def check_config(manifest: Manifest, schema: EmbeddingSchema | None,
                 what: str | None = None) -> None:
    """Refuse to restore ``manifest``'s checkpoint into a job whose embedding schema is
    not the one its rows were trained with.

    Args:
        manifest: the checkpoint's manifest.
        schema: the running job's embedding schema (None: not known here; nothing to
            check against, which is logged).
        what: how to name the checkpoint in messages (default: its path).

    Raises:
        Misuse: the digests differ; the message names what differs (slots, dims, ...).
    """
    what = what or f"checkpoint {manifest.path or manifest.job!r}"
    saved = manifest.config_digest
    if saved is None or not saved.startswith(DIGEST_PREFIX):
        log.info("%s records %s: restoring it without checking its embedding config "
                 "against this job's", what,
                 "no config digest" if saved is None else f"config digest {saved!r} in an "
                 "older form")
        return
    if schema is None:
        log.warning("%s has config digest %s but this job's embedding config is not known "
                    "here (PERSIA_EMBEDDING_CONFIG is not set): restoring it unchecked",
                    what, saved)
        return
    here = config_digest(schema)
    if saved == here:
        return
    recorded = manifest.extra.get(SCHEMA_KEY)
    diffs = (schema_differences(recorded, schema.to_dict()) if isinstance(recorded, Mapping)
             else [])
    shown = "; ".join(diffs[:5]) + (f"; and {len(diffs) - 5} more" if len(diffs) > 5 else "")
    raise Misuse(
        f"{what} was trained with another embedding config than this job's"
        f"{': ' + shown if shown else ''} (config digest {saved} in the checkpoint, "
        f"{here} here): its rows would be read as other slots or dims, so nothing was "
        f"restored", field="config_digest",
        hint="restore it into a job started with the embedding_config.yml it was trained "
             f"with (its manifest's extra.{SCHEMA_KEY}), or start this one from scratch")


def schema_differences(saved: Mapping[str, Any], current: Mapping[str, Any]) -> list[str]:
    """What differs between two ``EmbeddingSchema.to_dict()`` forms, in words (the
    checkpoint's ``saved``, the running job's ``current``)."""
    out: list[str] = []
    bits = (saved.get("feature_index_prefix_bit"), current.get("feature_index_prefix_bit"))
    if bits[0] != bits[1]:
        out.append(f"feature_index_prefix_bit is {bits[0]} in the checkpoint, {bits[1]} here")
    old = saved.get("slots_config") or {}
    new = current.get("slots_config") or {}
    for name in old:
        if name not in new:
            out.append(f"slot {name!r} is in the checkpoint but not in this job's config")
    for name in new:
        if name not in old:
            out.append(f"slot {name!r} is in this job's config but not in the checkpoint")
    for name in (n for n in old if n in new):
        a, b = old[name] or {}, new[name] or {}
        for key in dict.fromkeys([*a, *b]):
            if a.get(key) != b.get(key):
                out.append(f"slot {name!r} has {key} {a.get(key)!r} in the checkpoint, "
                           f"{b.get(key)!r} here")
    common = [n for n in old if n in new]
    if common != [n for n in new if n in old]:
        out.append("slots_config lists the slots in another order (it decides the id "
                   "prefixes)")
    groups = (saved.get("feature_groups") or {}, current.get("feature_groups") or {})
    if {g: list(m) for g, m in groups[0].items()} != {g: list(m) for g, m in groups[1].items()} \
            or list(groups[0]) != list(groups[1]):
        out.append(f"feature_groups are {dict(groups[0])} in the checkpoint, "
                   f"{dict(groups[1])} here")
    return out
