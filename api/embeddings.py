"""Embeddings for inference: model inputs built from pooled slots, from either source.

- **workers**: each request is looked up by an embedding worker (``lookup_batch``, mode
  ``infer``: nothing inserted, recency untouched), which plans and pools it exactly as it
  does for training; the served slots become tensors here.
- **local**: the rows of a checkpoint's shard files (for a patch, its whole chain's) are
  loaded into a read-only :class:`~stream_persia.server.store.EmbeddingStore` inside the
  API process (single-node serving). A micro-batch of requests is planned, looked up and pooled in
  one pass with the worker's own functions (:mod:`stream_persia.worker.batchplan` with
  ``server_pooling=False``, :mod:`stream_persia.worker.pooling`), so the
  result equals what a worker would serve.

Either way the model receives PERSIA's inputs: a ``(batch, dim)`` tensor for a summation
slot and the gathered ``(batch, sample_fixed_size, dim)`` tensor for a raw slot (as
:mod:`stream_persia.nn.batch` documents for training), in the order of the batch's ID
features; a raw slot's bool mask is attached as ``tensor.mask``, as ``EmbeddingCtx`` does.
``missing`` counts, per request, the distinct ids absent from the tables (as the
worker's ``lookup_batch`` does).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import numpy as np
import torch

from stream_persia.checkpoint import Manifest, chain_of
from stream_persia.checkpoint._common import Location
from stream_persia.config import EmbeddingSchema
from stream_persia.core.data import IDTypeFeature, PersiaBatch
from stream_persia.core.optim import SGD
from stream_persia.core.served import ServedSlot
from stream_persia.errors import InternalError
from stream_persia.server.shard_files import read_shard_file
from stream_persia.server.store import EmbeddingStore, Store
from stream_persia.worker import batchplan, pooling

__all__ = ["CheckpointTable", "as_tensor", "served_tensors", "concat_features", "non_id_tensors",
           "cat_slots"]

log = logging.getLogger(__name__)


def as_tensor(a: np.ndarray) -> torch.Tensor:
    """A tensor over ``a``; read-only arrays (wire views) are copied, torch cannot share them."""
    if not a.flags.writeable or not a.flags.c_contiguous:
        a = np.array(a, order="C", copy=True)
    return torch.from_numpy(a)


def _slot_tensor(kind_sum: bool, emb: np.ndarray, index: np.ndarray | None,
                 mask: np.ndarray | None) -> torch.Tensor:
    table = as_tensor(emb)
    if kind_sum:
        return table
    gathered = torch.nn.functional.embedding(as_tensor(np.asarray(index, dtype=np.int64)),
                                             table)
    # the documented tensor.mask, as EmbeddingCtx attaches it (torch tensors take attributes)
    gathered.mask = as_tensor(np.asarray(mask, dtype=bool))  # type: ignore[attr-defined]
    return gathered


def cat_slots(per_request: list[list[torch.Tensor]]) -> list[torch.Tensor]:
    """Concatenate each slot's tensors over requests (raw slots keep ``.mask``)."""
    if len(per_request) == 1:
        return per_request[0]
    out = []
    for parts in zip(*per_request, strict=True):
        t = torch.cat(parts)
        if hasattr(parts[0], "mask"):
            t.mask = torch.cat([p.mask for p in parts])  # type: ignore[attr-defined]
        out.append(t)
    return out


def served_tensors(slots: Sequence[ServedSlot]) -> list[torch.Tensor]:
    """Embedding tensors of a worker's ``lookup_batch`` reply (its slots, checked by
    :meth:`~stream_persia.core.served.ServedBatch.from_wire`), in slot order."""
    return [_slot_tensor(not e.is_raw(), e.emb, e.index, e.mask) for e in slots]


def concat_features(batches: Sequence[PersiaBatch]) -> list[IDTypeFeature]:
    """The ID features of same-signature batches as one batch (CSR concatenation)."""
    if len(batches) == 1:
        return list(batches[0].id_type_features)
    out = []
    for j, first in enumerate(batches[0].id_type_features):
        feats = [b.id_type_features[j] for b in batches]
        values = np.concatenate([f.values for f in feats])
        starts = np.cumsum([0] + [len(f.values) for f in feats])
        offsets = np.concatenate([f.offsets[:-1] + s for f, s in zip(feats, starts, strict=False)]
                                 + [np.array([starts[-1]], np.int64)])
        out.append(IDTypeFeature.from_csr(first.name, values, offsets))
    return out


def non_id_tensors(batches: Sequence[PersiaBatch]) -> list[torch.Tensor]:
    """The non-ID features of same-signature batches, concatenated along the samples."""
    if len(batches) == 1:
        return [as_tensor(f.data) for f in batches[0].non_id_type_features]
    return [torch.from_numpy(np.concatenate([b.non_id_type_features[j].data for b in batches]))
            for j in range(len(batches[0].non_id_type_features))]


class CheckpointTable:
    """Every embedding row of one checkpoint, read-only, in this process.

    Args:
        store: an :class:`EmbeddingStore` holding the rows (never trained).
        schema: the embedding schema the checkpoint was trained with.
    """

    def __init__(self, store: Store, schema: EmbeddingSchema):
        self.store = store
        self.schema = schema

    @classmethod
    def load(cls, manifest: Manifest, schema: EmbeddingSchema,
             capacity: int | None = None) -> CheckpointTable:
        """Load the checkpoint's rows (blocking; call off the event loop): for a patch
        (an incremental checkpoint), its whole chain as a restore loads it, the base, then
        each patch's tombstones removed and its rows written over
        (:mod:`stream_persia.server.patches`); a patch alone holds only the rows changed
        since its parent. Every file is checked against the manifest (size, sha256, rows).

        Optimizer state is dropped: serving never updates a row. ``capacity``: the most
        rows held (LRU beyond it; default: the rows of the checkpoint's chain).

        Raises:
            BadInput: a checkpoint of the chain is missing or another one, or a file is
                missing, truncated or corrupt (names it).
        """
        chain = chain_of(manifest.path or "") if manifest.is_patch else [manifest]
        # the most rows held at any point of the chain (a patch may admit rows a later one
        # expires): a capacity of the last member's alone would evict live rows midway
        store = EmbeddingStore(capacity or max(max(m.table_rows for m in chain), 1),
                               SGD(lr=0.0))
        for m in chain:
            url = Location(m.path or "").url
            for name in (m.chain or {}).get("tombstone_files") or []:
                for record in read_shard_file(url, name, expected=m.files[name]):
                    ids = np.ascontiguousarray(record["ids"], np.uint64)
                    if len(ids):
                        store.remove(ids)
            for name in m.embedding_files:
                for chunk in read_shard_file(url, name, expected=m.files[name]):
                    store.load([{"dim": chunk["dim"], "ids": chunk["ids"],
                                 "weights": chunk["weights"]}])
        log.info("loaded %d embedding rows from %s (%d checkpoint(s) of its chain)",
                 len(store), Location(manifest.path or "").url, len(chain))
        return cls(store, schema)

    def __len__(self) -> int:
        return len(self.store)

    def embed(self, batches: Sequence[PersiaBatch]) -> tuple[list[torch.Tensor], list[int]]:
        """Look up and pool same-signature batches in one pass.

        Returns:
            The embedding tensors of the concatenated batch (slot order) and, per batch,
            the number of its distinct ids absent from the table.
        """
        # IDTypeFeatures: their CSR was checked when they were decoded or concatenated.
        plans = batchplan.plan_batch(concat_features(batches), self.schema, requires_grad=False,
                                     csr_checked=True, server_pooling=False).classic
        merged = pooling.merge_lookups(plans)
        rows, present = {}, {}
        for dim, m in merged.items():
            rows[dim] = self.store.lookup(m.ids, dim, train=False)
            present[dim] = self.store.contains(m.ids)
        pooled = pooling.pool_batch(plans, merged, rows)
        tensors = [_slot_tensor(plans[name].summation, out.embeddings, out.index, out.mask)
                   for name, out in pooled.items()]
        sizes = np.array([b.batch_size for b in batches], np.int64)
        return tensors, _missing(plans, merged, present, sizes)


def _occurrences(p: pooling.SlotPlan) -> tuple[np.ndarray, np.ndarray]:
    """(sample, position in ``p.lookup_ids``) of every id the slot's samples use."""
    if p.summation:
        if p.pool_index is None or p.pool_starts is None:
            raise InternalError(f"summation slot {p.name!r} has no pool map")
        counts = np.diff(np.append(p.pool_starts, len(p.pool_index)))
        return np.repeat(np.arange(p.batch_size, dtype=np.int64), counts), p.pool_index
    if p.index is None or p.mask is None:
        raise InternalError(f"raw slot {p.name!r} has no index or mask")
    sample, col = np.nonzero(p.mask)
    key = p.index[sample, col] - 1
    if p.pool_index is None:           # raw slot: one lookup id per distinct id
        return sample, key
    reps = (len(p.pool_index) // p.n_rows) if p.n_rows else 1   # hash stack rounds
    pos = (key[:, None] * reps + np.arange(reps)).ravel()
    return np.repeat(sample, reps), p.pool_index[pos]


def _missing(plans: dict[str, pooling.SlotPlan], merged: dict[int, pooling.MergedLookup],
             present: dict[int, np.ndarray], sizes: np.ndarray) -> list[int]:
    """Distinct absent ids per request, counted per dim like the worker counts them."""
    n_req = len(sizes)
    if n_req == 1:
        return [int(sum(int((~p).sum()) for p in present.values()))]
    bounds = np.cumsum(sizes)[:-1]
    total = np.zeros(n_req, np.int64)
    for dim, m in merged.items():
        absent = ~present[dim]
        if not absent.any():
            continue
        keys = []
        for name, p in plans.items():
            if p.dim != dim:
                continue
            sample, pos = _occurrences(p)
            g = m.slot_index[name][pos]
            hit = absent[g]
            req = np.searchsorted(bounds, sample[hit], side="right")
            keys.append(req * len(m.ids) + g[hit])
        uniq = np.unique(np.concatenate(keys))
        total += np.bincount(uniq // len(m.ids), minlength=n_req)
    return total.tolist()
