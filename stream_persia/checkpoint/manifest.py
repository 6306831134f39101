"""The checkpoint manifest (``manifest.json``): what a checkpoint holds, and its checksums.

Schema (format version 1; JSON object, every key present, ``null`` where optional)::

    {"format_version": 1, "job": str, "step": int >= 0,
     "created_at": ISO-8601 UTC ("2024-05-01T12:00:00.123456Z"; whole seconds before),
     "stream": "kafka" | "direct",
     "offsets": {topic: {partition (decimal str): next offset to consume (int >= 0)}},
     "fingerprints"?: {topic: {partition: {"offset": int, "timestamp": int,
                                           "digest": 16 hex chars}}}  (optional, below),
     "config_digest": str | null, "shard_count": int >= 0,
     "files": {name: {"sha256": 64 hex chars, "bytes": int, "rows"?: int}},
     "embedding_files": [name, ...]  (one per embedding server, in replica order),
     "dense_filename": name | null, "opt_filename": name | null,
     "jit_filename": name | null,
     "server_config": {"digest": 16 hex chars, "optimizer": {...},
                       "embedding_config": {...}, "policies"?: {...}} | null,
     "chain": {...} | null  (incremental checkpoints; optional, below),
     "extra": {...}}

``chain`` (null or absent: written before incremental checkpoints, a full checkpoint no
patch can follow)::

    {"id": str          the checkpoint's name (its directory's; members of a chain are
                        siblings under one root),
     "parent": str | null   the id of the checkpoint this one patches; null: a full base,
     "base": str        the id of the full checkpoint the chain starts at (``id`` for a base),
     "depth": int >= 0  patches since the base (0 for a base; the parent's depth + 1),
     "rows": int >= 0   embedding rows held after applying the chain up to here,
     "tombstone_files": [name, ...]  a patch's files of evicted ids, one per server in
                        replica order ([] for a base), each a key of ``files``,
     "tracking": [{"incarnation": str, "loads": int, "version": int}, ...]  each server's
                        store position at the dump (what a child patch is taken since),
     "full_because": str | null  why a checkpoint asked to be a patch is a base instead}

A patch's ``embedding_files`` hold the rows changed since its parent (values with their
optimizer state); its dense files and offsets are whole, as a base's. Every file, of a
base or a patch, has its sha256 and size in ``files``. A restore of a patch loads the
base, then every patch in order (:func:`stream_persia.checkpoint.reader.chain_of`).

``fingerprints`` (absent or null: written before them, or a direct stream): for each
partition of ``offsets`` whose offset ``N`` is > 0, the record at ``N - 1`` as the broker
had it when the checkpoint was cut: its ``offset`` (``N - 1``), Kafka ``timestamp`` (ms)
and ``digest`` (the first 16 hex chars of a sha256 of its key and value). A restore reads
that record again and refuses a topic whose record differs, one deleted and created again
that has grown past ``N`` since (:mod:`stream_persia.kafka.fingerprint`). A partition
without one (its record could not be read at the cut), or whose fingerprint is not of
``N - 1`` (its offset edited by hand), is restored unchecked, and so is every partition of
a manifest without ``fingerprints`` (logged).

``config_digest`` is ``schema-v1:<sha256>`` of the job's embedding schema, which a restore
checks (:mod:`stream_persia.checkpoint.digest`; null: not known, restored unchecked).
``server_config`` is the configuration every embedding server held when it dumped its
shard (the embedding optimizer, whose state the shard files carry, and the
EmbeddingConfig), as the servers' ``get_config`` describes it; a restore configures the
servers that hold none with it (:func:`stream_persia.checkpoint.load_embeddings`).
Manifests written before it existed have none (``null``). ``extra`` holds what the writer
adds: the API's ``id`` and ``by``, the model's ``heads`` and ``inputs`` (the ID slots and
non-ID features it was trained with, in order; see ``stream_persia.nn.batch
.input_signature``), ...

Every name in ``embedding_files`` and the ``*_filename`` keys is a key of ``files``; file
names are plain (no ``/``). A reader that meets a ``format_version`` it does not know
refuses the checkpoint instead of guessing.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field, fields
from datetime import datetime, timezone
from typing import Any

from stream_persia.errors import BadInput

__all__ = ["FORMAT_VERSION", "MANIFEST_NAME", "DENSE_FILENAME", "OPT_FILENAME", "JIT_FILENAME",
           "STREAMS", "Manifest", "check_file_name", "not_taken_since", "utc_now"]

FORMAT_VERSION = 1
MANIFEST_NAME = "manifest.json"
DENSE_FILENAME = "dense.pt"
OPT_FILENAME = "opt.pt"
JIT_FILENAME = "jit_dense.pt"
STREAMS = ("kafka", "direct")

_SHA256 = re.compile(r"[0-9a-f]{64}")


def utc_now() -> str:
    """The current time as ISO-8601 UTC with a ``Z`` suffix (microsecond precision: the
    newest checkpoint is the one committed last, two in one second included)."""
    return datetime.now(timezone.utc).isoformat(timespec="microseconds").replace(
        "+00:00", "Z")


def check_file_name(name: Any, field_name: str = "name") -> str:
    """A checkpoint file name: a non-empty plain name, not hidden, not the manifest."""
    if not isinstance(name, str) or not name or "/" in name or "\\" in name \
            or name.startswith(".") or name == MANIFEST_NAME:
        raise BadInput(f"{field_name} must be a plain file name, got {name!r}", field=field_name,
                       hint=f"no '/', not starting with '.', not {MANIFEST_NAME!r}")
    return name


def _check_version(fv: Any) -> None:
    if isinstance(fv, bool) or not isinstance(fv, int) or fv != FORMAT_VERSION:
        raise BadInput(f"checkpoint format_version {fv!r} is not supported (this "
                       f"stream-persia reads format_version {FORMAT_VERSION})",
                       field="format_version",
                       hint="read it with the stream-persia version that wrote it")


def _int(value: Any, key: str, minimum: int = 0) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise BadInput(f"manifest {key!r} must be an int >= {minimum}, got {value!r}", field=key)
    return value


def _opt_str(value: Any, key: str) -> str | None:
    if value is not None and not isinstance(value, str):
        raise BadInput(f"manifest {key!r} must be a string or null, got {value!r}", field=key)
    return value


def _offsets(value: Any) -> dict[str, dict[str, int]]:
    """Normalise topic → partition → offset (partition keys may arrive as ints)."""
    if not isinstance(value, dict):
        raise BadInput(f"manifest 'offsets' must map topic -> {{partition: offset}}, got "
                       f"{type(value).__name__}", field="offsets")
    out: dict[str, dict[str, int]] = {}
    for topic, parts in value.items():
        if not isinstance(topic, str) or not topic:
            raise BadInput(f"offsets topic must be a non-empty string, got {topic!r}",
                           field="offsets")
        if not isinstance(parts, dict):
            raise BadInput(f"offsets[{topic!r}] must map partition -> offset, got {parts!r}",
                           field=f"offsets.{topic}")
        norm: dict[str, int] = {}
        for p, o in parts.items():
            key = str(p) if isinstance(p, int) and not isinstance(p, bool) else p
            if not (isinstance(key, str) and key.isdigit()):
                raise BadInput(f"offsets[{topic!r}] partition must be a number >= 0, got {p!r}",
                               field=f"offsets.{topic}")
            norm[str(int(key))] = _int(o, f"offsets.{topic}.{key}")
        out[topic] = dict(sorted(norm.items(), key=lambda kv: int(kv[0])))
    return out


_DIGEST = re.compile(r"[0-9a-f]{16}")


def _fingerprints(value: Any) -> dict[str, dict[str, dict[str, Any]]] | None:
    """``fingerprints`` (module docstring), validated. Not checked against ``offsets``: a
    fingerprint of another offset than the one below a partition's (offsets edited by
    hand) is not compared by a restore (logged)."""
    if value is None:
        return None
    if not isinstance(value, dict):
        raise BadInput(f"manifest 'fingerprints' must be null or map topic -> {{partition: "
                       f"fingerprint}}, got {type(value).__name__}", field="fingerprints")
    out: dict[str, dict[str, dict[str, Any]]] = {}
    for topic, parts in value.items():
        if not isinstance(topic, str) or not topic or not isinstance(parts, dict):
            raise BadInput(f"manifest 'fingerprints' must map topic -> {{partition: "
                           f"fingerprint}}, got {str(topic)[:60]!r}: {str(parts)[:60]}",
                           field="fingerprints")
        norm: dict[str, dict[str, Any]] = {}
        for p, fp in parts.items():
            key = str(p)
            where = f"fingerprints.{topic}.{key}"
            ok = (key.isdigit() and isinstance(fp, dict)
                  and set(fp) == {"offset", "timestamp", "digest"}
                  and all(isinstance(fp[k], int) and not isinstance(fp[k], bool)
                          for k in ("offset", "timestamp"))
                  and fp["offset"] >= 0
                  and isinstance(fp["digest"], str) and _DIGEST.fullmatch(fp["digest"]))
            if not ok:
                raise BadInput(f"manifest {where!r} must be {{'offset': int >= 0, "
                               f"'timestamp': int, 'digest': 16 hex chars}} under a "
                               f"partition number, got {str(fp)[:120]}", field=where)
            norm[str(int(key))] = dict(fp)
        out[topic] = dict(sorted(norm.items(), key=lambda kv: int(kv[0])))
    return out


def _files(value: Any) -> dict[str, dict[str, Any]]:
    if not isinstance(value, dict):
        raise BadInput(f"manifest 'files' must be a map, got {type(value).__name__}",
                       field="files")
    out: dict[str, dict[str, Any]] = {}
    for name, entry in value.items():
        check_file_name(name, "files")
        where = f"files.{name}"
        if not isinstance(entry, dict):
            raise BadInput(f"manifest {where!r} must be a map, got {entry!r}", field=where)
        unknown = set(entry) - {"sha256", "bytes", "rows"}
        if unknown:
            raise BadInput(f"manifest {where!r} has unknown key(s) {sorted(unknown)}",
                           field=where, hint="sha256, bytes, rows")
        sha = entry.get("sha256")
        if not (isinstance(sha, str) and _SHA256.fullmatch(sha)):
            raise BadInput(f"manifest '{where}.sha256' must be 64 lowercase hex chars, got "
                           f"{sha!r}", field=f"{where}.sha256")
        clean = {"sha256": sha, "bytes": _int(entry.get("bytes"), f"{where}.bytes")}
        if "rows" in entry:
            clean["rows"] = _int(entry["rows"], f"{where}.rows")
        out[name] = clean
    return out


def _server_config(value: Any) -> None:
    if value is None:
        return
    if not isinstance(value, dict) or not (
            {"digest", "optimizer", "embedding_config"} <= set(value)
            <= {"digest", "optimizer", "embedding_config", "policies"}):
        raise BadInput(f"manifest 'server_config' must be null or a map of digest, optimizer, "
                       f"embedding_config and (optional) policies, got {value!r}"[:300],
                       field="server_config")
    if "policies" in value and not isinstance(value["policies"], dict):
        raise BadInput(f"manifest 'server_config.policies' must be a map, got "
                       f"{value['policies']!r}"[:300], field="server_config.policies")
    digest = value["digest"]
    if not (isinstance(digest, str) and re.fullmatch(r"[0-9a-f]{16}", digest)):
        raise BadInput(f"manifest 'server_config.digest' must be 16 lowercase hex chars, got "
                       f"{digest!r}", field="server_config.digest")
    for key in ("optimizer", "embedding_config"):
        if not isinstance(value[key], dict):
            raise BadInput(f"manifest 'server_config.{key}' must be a map, got "
                           f"{value[key]!r}"[:300], field=f"server_config.{key}")


def _update_positions(v: Any, shards: int) -> list[dict[str, Any]] | None:
    """``model_updates``: per shard, where a serving replica restored from this checkpoint
    follows that server's update log (:mod:`stream_persia.server.updates`)."""
    if v is None:
        return None
    if not isinstance(v, list) or len(v) != shards:
        raise BadInput(f"manifest 'model_updates' must be a list of {shards} positions, got "
                       f"{str(v)[:80]}", field="model_updates")
    out = []
    def count(x: Any) -> bool:
        return isinstance(x, int) and not isinstance(x, bool) and x >= 0

    for i, p in enumerate(v):
        if not (isinstance(p, dict) and {"incarnation", "seq"} <= set(p)
                and set(p) <= {"incarnation", "seq", "offset"}
                and isinstance(p["incarnation"], str) and 0 < len(p["incarnation"]) <= 64
                and count(p["seq"]) and count(p.get("offset", 0))):
            raise BadInput(f"manifest 'model_updates'[{i}] must be {{'incarnation': str, "
                           f"'seq': int >= 0, 'offset'?: int >= 0}}, got {str(p)[:80]}",
                           field="model_updates")
        out.append(dict(p))
    return out


def _chain(v: Any, shards: int, files: dict[str, Any]) -> dict[str, Any] | None:
    """``chain`` (module docstring), validated; BadInput naming ``chain.<key>``."""
    if v is None:
        return None
    keys = {"id", "parent", "base", "depth", "rows", "tombstone_files", "tracking",
            "full_because"}
    if not isinstance(v, dict) or set(v) != keys:
        raise BadInput(f"manifest 'chain' must be null or a map of {sorted(keys)}, got "
                       f"{str(v)[:120]}", field="chain")
    for key in ("id", "base"):
        check_file_name(v[key], f"chain.{key}")
    if v["parent"] is not None:
        check_file_name(v["parent"], "chain.parent")
    _opt_str(v["full_because"], "chain.full_because")
    depth = _int(v["depth"], "chain.depth")
    _int(v["rows"], "chain.rows")
    if (depth == 0) != (v["parent"] is None) or (depth == 0) != (v["base"] == v["id"]):
        raise BadInput(f"manifest 'chain': a base (depth 0) has no parent and is its own "
                       f"base, a patch (depth > 0) has a parent; got depth {depth}, parent "
                       f"{v['parent']!r}, base {v['base']!r}, id {v['id']!r}",
                       field="chain.depth")
    tombs = v["tombstone_files"]
    if not isinstance(tombs, list) or len(tombs) != (shards if depth else 0) \
            or any(t not in files or "rows" not in files[t] for t in tombs):
        raise BadInput(f"manifest 'chain.tombstone_files' must list {shards if depth else 0} "
                       f"file(s) of 'files' (with 'rows'), got {str(tombs)[:120]}",
                       field="chain.tombstone_files")
    tracking = v["tracking"]
    if not isinstance(tracking, list) or len(tracking) != shards or not all(
            isinstance(t, dict) and set(t) == {"incarnation", "loads", "version"}
            and isinstance(t["incarnation"], str)
            and all(isinstance(t[k], int) and not isinstance(t[k], bool) and t[k] >= 0
                    for k in ("loads", "version")) for t in tracking):
        raise BadInput(f"manifest 'chain.tracking' must be {shards} "
                       f"{{incarnation, loads, version}}, got {str(tracking)[:120]}",
                       field="chain.tracking")
    return json.loads(json.dumps(v))


@dataclass
class Manifest:
    """What a checkpoint holds. Validated on construction (``BadInput`` naming the key).

    ``path`` is where the checkpoint was read from (set by the readers, not stored).
    """

    job: str
    step: int
    stream: str
    offsets: dict[str, dict[str, int]]
    shard_count: int
    files: dict[str, dict[str, Any]]
    embedding_files: list[str]
    created_at: str = field(default_factory=utc_now)
    config_digest: str | None = None
    dense_filename: str | None = None
    opt_filename: str | None = None
    jit_filename: str | None = None
    server_config: dict[str, Any] | None = None
    model_updates: list[dict[str, Any]] | None = None
    chain: dict[str, Any] | None = None
    extra: dict[str, Any] = field(default_factory=dict)
    fingerprints: dict[str, dict[str, dict[str, Any]]] | None = None
    format_version: int = FORMAT_VERSION
    path: str | None = field(default=None, compare=False, repr=False)

    def __post_init__(self) -> None:
        _check_version(self.format_version)
        if not isinstance(self.job, str) or not self.job:
            raise BadInput(f"manifest 'job' must be a non-empty string, got {self.job!r}",
                           field="job")
        _int(self.step, "step")
        if not isinstance(self.created_at, str):
            raise BadInput(f"manifest 'created_at' must be an ISO-8601 string, got "
                           f"{self.created_at!r}", field="created_at")
        try:
            datetime.fromisoformat(self.created_at)
        except ValueError:
            raise BadInput(f"manifest 'created_at' is not ISO-8601: {self.created_at!r}",
                           field="created_at", hint="e.g. '2024-05-01T12:00:00Z'") from None
        if self.stream not in STREAMS:
            raise BadInput(f"manifest 'stream' must be one of {STREAMS}, got {self.stream!r}",
                           field="stream")
        self.offsets = _offsets(self.offsets)
        self.fingerprints = _fingerprints(self.fingerprints)
        _opt_str(self.config_digest, "config_digest")
        _int(self.shard_count, "shard_count")
        self.files = _files(self.files)
        if not isinstance(self.embedding_files, list):
            raise BadInput("manifest 'embedding_files' must be a list of file names",
                           field="embedding_files")
        self.embedding_files = list(self.embedding_files)
        if len(self.embedding_files) != self.shard_count:
            raise BadInput(f"manifest lists {len(self.embedding_files)} embedding_files but "
                           f"shard_count is {self.shard_count}", field="embedding_files")
        for name in self.embedding_files:
            if name not in self.files or "rows" not in self.files[name]:
                raise BadInput(f"embedding file {name!r} has no entry with 'rows' in 'files'",
                               field="embedding_files")
        for key in ("dense_filename", "opt_filename", "jit_filename"):
            named = _opt_str(getattr(self, key), key)
            if named is not None and named not in self.files:
                raise BadInput(f"manifest {key!r} names {named!r}, which is not in 'files'",
                               field=key)
        _server_config(self.server_config)
        self.model_updates = _update_positions(self.model_updates, self.shard_count)
        self.chain = _chain(self.chain, self.shard_count, self.files)
        if not isinstance(self.extra, dict):
            raise BadInput(f"manifest 'extra' must be a map, got {type(self.extra).__name__}",
                           field="extra")
        try:
            json.dumps(self.extra, allow_nan=False)
        except (TypeError, ValueError) as e:
            raise BadInput(f"manifest 'extra' must be JSON-serialisable: {e}",
                           field="extra") from None

    @property
    def rows(self) -> int:
        """Embedding rows stored in the checkpoint (over every shard file; a patch's:
        the rows changed since its parent)."""
        return sum(self.files[n]["rows"] for n in self.embedding_files)

    @property
    def table_rows(self) -> int:
        """Embedding rows a restore of this checkpoint (its whole chain) loads."""
        return self.chain["rows"] if self.chain is not None else self.rows

    @property
    def is_patch(self) -> bool:
        return self.chain is not None and self.chain["parent"] is not None

    def to_dict(self) -> dict[str, Any]:
        """The JSON form written to ``manifest.json`` (``path`` is not stored)."""
        out = {f.name: getattr(self, f.name) for f in fields(self) if f.name != "path"}
        out = {"format_version": out.pop("format_version"), **out}
        for key in ("chain", "fingerprints"):   # a reader from before them reads it as it did
            if out[key] is None:
                del out[key]
        return json.loads(json.dumps(out))   # deep copy, JSON types only

    @classmethod
    def from_dict(cls, d: Any, path: str | None = None) -> Manifest:
        """Parse the JSON form. Raises ``BadInput`` naming a missing, unknown or bad key."""
        if not isinstance(d, dict):
            raise BadInput(f"a manifest must be a JSON object, got {type(d).__name__}",
                           field="manifest")
        # The version first: a future format may have other keys, and "unsupported version"
        # is the useful message then.
        _check_version(d.get("format_version"))
        names = [f.name for f in fields(cls) if f.name != "path"]
        unknown = set(d) - set(names)
        if unknown:
            raise BadInput(f"manifest has unknown key(s) {sorted(unknown)}",
                           field=sorted(unknown)[0], hint=f"known keys: {', '.join(names)}")
        required = ("job", "step", "stream", "offsets", "shard_count", "files",
                    "embedding_files", "created_at")
        for key in required:
            if key not in d:
                raise BadInput(f"manifest is missing {key!r}", field=key)
        kwargs = {k: d[k] for k in names if k in d}
        if kwargs.get("extra") is None:
            kwargs["extra"] = {}
        return cls(**kwargs, path=path)


def not_taken_since(parent: Manifest, patch: Manifest) -> str | None:
    """Why ``patch`` was not taken on ``parent`` as it is now (None: it may have been).
    A patch holds the rows its servers changed since the parent's dump, so each server's
    position at the parent (``chain.tracking``) is of the same incarnation and table load
    and not ahead of its position at the patch. A checkpoint written again at the
    parent's path (same id, base and depth) fails this: its servers were further on, or
    other ones."""
    before, after = (parent.chain or {}).get("tracking"), (patch.chain or {}).get("tracking")
    if not isinstance(before, list) or not isinstance(after, list) \
            or len(before) != len(after):
        return (f"it records {len(before or [])} server position(s), the patch "
                f"{len(after or [])}")
    for i, (b, a) in enumerate(zip(before, after, strict=True)):
        if b["incarnation"] != a["incarnation"] or b["loads"] != a["loads"] \
                or b["version"] > a["version"]:
            return (f"server {i} was at {b} when it was written, and at {a} when the patch "
                    "was")
    return None
