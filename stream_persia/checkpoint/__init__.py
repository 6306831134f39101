"""Checkpoints: a consistent cut of a job, written atomically, restorable anywhere (DESIGN §7).

A checkpoint is one directory (a local path, or any fsspec URL such as ``s3://b/ckpt/7``)::

    manifest.json                          written last; see checkpoint.manifest
    dense.pt, opt.pt, jit_dense.pt         torch.save of the dense model / optimizer
    embedding-shard-00000-of-00002.bin     one file per embedding server (rows + optimizer
    embedding-shard-00001-of-00002.bin     state; format in stream_persia.server.shard_files)

The manifest records every file's sha256 and size, the Kafka offsets of the cut (topic →
partition → next offset) and the number of servers that wrote it. Restoring loads the rows
into *any* number of servers: each server reads every shard file and keeps the ids it owns
by ``sharding.shard_of``.

Atomicity (a checkpoint is visible only when complete; readers require the manifest):

- Local paths: files go into a hidden sibling ``.<name>.staging-<random>``, are fsynced,
  the manifest is written, then the directory is renamed to ``dst``. Replacing an
  existing ``dst`` renames it aside to ``.<name>.old-<random>`` first and deletes it after
  the swap. A crash before the commit leaves only the hidden staging directory (ignored
  by readers; delete it at leisure) and ``dst`` untouched. A crash between the two renames
  leaves ``dst`` missing while both the old and the new checkpoint are complete under
  their hidden names (``read_manifest(dst)`` says which to rename back). A crash after
  the swap leaves at most a hidden ``.old-`` directory.
- Remote filesystems (no atomic directory rename): the writer deletes an existing
  ``dst`` (its manifest first) when it starts, writes the files straight into ``dst`` and
  the manifest last. Until the commit, ``dst`` has no manifest and is not a checkpoint;
  so to keep the previous checkpoint, give each one its own ``dst`` (``ROOT/step-N``).

The cut the offsets record is computed in one place for every taker (NN rank 0 and the
API): :mod:`stream_persia.checkpoint.cut`. The manifest's ``config_digest`` is the job's
embedding schema, written and checked on restore by :mod:`stream_persia.checkpoint.digest`.

Embedding servers write their shard files themselves (RPC ``dump``), so ``dst`` must be
reachable from every server under the same path or URL (shared filesystem or object
store); an in-memory ``memory://`` URL only works with servers in the same process.
"""

from stream_persia.checkpoint.cut import Cut, read_cut, stream_cut
from stream_persia.checkpoint.digest import check_config, config_digest
from stream_persia.checkpoint.manifest import (
    DENSE_FILENAME,
    FORMAT_VERSION,
    JIT_FILENAME,
    MANIFEST_NAME,
    OPT_FILENAME,
    Manifest,
)
from stream_persia.checkpoint.reader import (
    chain_of,
    latest_checkpoint,
    list_checkpoints,
    load_embeddings,
    load_torch,
    read_manifest,
    verify,
)
from stream_persia.checkpoint.retention import (
    delete_checkpoint,
    dependents,
    prune_checkpoints,
)
from stream_persia.checkpoint.writer import CheckpointWriter

__all__ = [
    "CheckpointWriter", "Manifest", "read_manifest", "verify", "load_embeddings", "load_torch",
    "list_checkpoints", "latest_checkpoint", "chain_of", "Cut", "read_cut", "stream_cut",
    "config_digest", "check_config", "FORMAT_VERSION", "MANIFEST_NAME",
    "DENSE_FILENAME", "OPT_FILENAME", "JIT_FILENAME", "prune_checkpoints", "delete_checkpoint", "dependents",
]
