"""A whole batch's lookup plan: which slots the servers pool, which the worker pools.

Plain summation slots (``embedding_summation: true`` without a hash stack: almost every
slot of a CTR model) are pooled **on the embedding servers**: per dim, the worker sends the
batch's distinct ids with the pooled-lookup structure of :mod:`stream_persia.kernels.segments`
(every occurrence's position among the ids and one segment per (slot, sample)), and each
server returns the ``(slots x batch, dim)`` sums of the rows it owns. That is what
TorchRec's row-wise sharding does with partial pooling, and it moves about a third of the
bytes (for dim 16 and ~3 ids per sample: 1.7 MB of sums against 5 MB of rows per
1,024 x 26-slot batch), spares the worker the row scatter and pooling, and replaces the
per-slot sort that de-duplicated ids with one hash pass over the batch. Raw slots and
hash-stacked slots keep the classic plan of :mod:`stream_persia.worker.pooling` (rows come
back; the worker pools).

Results are PERSIA's either way: with one server the pooled sums equal the classic path
bit for bit (each sum adds its rows in occurrence order from 0.0); with several servers the
partial sums are added in server order, which changes float rounding only (about 1 ulp).
Gradients are summed per distinct id in occurrence order, bit for bit as the classic path
does for the ids of one slot (slots of one feature group that share ids are summed
occurrence by occurrence rather than slot by slot: equal up to rounding), and a slot whose
gradient holds NaN or infinity is skipped and reported.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from stream_persia.errors import BadInput, Misuse
from stream_persia.kernels import segments
from stream_persia.worker import pooling
from stream_persia.worker.shards import LookupGroup, PooledLookup, RowLookup

__all__ = ["BatchPlan", "PooledGroup", "plan_batch", "pooled_on_servers", "pools_on_worker",
           "reduce_gradients"]


@dataclass(frozen=True, eq=False)
class PooledGroup:
    """The summation slots of one dim, looked up and pooled on the servers.

    Attributes:
        dim: the embedding dim.
        names: the slots, in batch order; segment ``i * batch_size + b`` is slot
            ``names[i]`` of sample b.
        batch_size: samples in the batch.
        ids: uint64, the distinct prefixed ids, in first-occurrence order.
        index: int32, every occurrence's position in ``ids``.
        offsets: int64 ``(len(names) * batch_size + 1,)``, segment bounds in ``index``.
        scale: float32 ``(len(names) * batch_size,)`` ``1/sqrt(n)`` for sqrt-scaled slots
            (0 for an empty sample, 1 for slots without scaling), or None when no slot of
            the group scales.
    """

    dim: int
    names: tuple[str, ...]
    batch_size: int
    ids: np.ndarray
    index: np.ndarray
    offsets: np.ndarray
    scale: np.ndarray | None

    def outputs(self, sums: np.ndarray) -> dict[str, pooling.SlotOutput]:
        """Per slot, its ``(batch, dim)`` embeddings out of the servers' summed reply."""
        want = (len(self.names) * self.batch_size, self.dim)
        if not (isinstance(sums, np.ndarray) and sums.shape == want
                and sums.dtype == np.float32):
            got = f"{sums.dtype} {sums.shape}" if isinstance(sums, np.ndarray) else type(sums)
            raise BadInput(f"pooled embeddings for dim {self.dim} must be float32 {want}, "
                           f"got {got}", field=f"embeddings.dim{self.dim}")
        if self.scale is not None:
            sums = sums * self.scale[:, None]
        b = self.batch_size
        return {name: pooling.SlotOutput(name, sums[i * b:(i + 1) * b])
                for i, name in enumerate(self.names)}


@dataclass(frozen=True, eq=False)
class BatchPlan:
    """Everything the worker needs to serve one batch and apply its gradients.

    Attributes:
        names: every slot of the batch, in batch order.
        pooled: dim -> the summation slots the servers pool.
        classic: slot name -> its :class:`~stream_persia.worker.pooling.SlotPlan` (raw and
            hash-stacked slots; the worker pools them).
        requires_grad: whether gradients may be reduced.
        truncated: raw slot name -> ids of the batch past ``sample_fixed_size`` in their
            sample, which get no row (PERSIA's rule); only slots that dropped some.
    """

    names: tuple[str, ...]
    pooled: dict[int, PooledGroup]
    classic: dict[str, pooling.SlotPlan]
    requires_grad: bool
    truncated: Mapping[str, int] = field(default_factory=dict)

    def nbytes(self) -> int:
        """Bytes of the plan's arrays (per dim and per classic slot, not per id): what a
        planned batch adds to its decoded one in the worker's ready buffer."""
        total = 0
        for g in self.pooled.values():
            total += g.ids.nbytes + g.index.nbytes + g.offsets.nbytes
            total += g.scale.nbytes if g.scale is not None else 0
        for p in self.classic.values():
            for a in (p.lookup_ids, p.pool_index, p.pool_starts, p.scale, p.index, p.mask):
                total += a.nbytes if a is not None else 0
        return total

    def is_summation(self, name: str) -> bool:
        plan = self.classic.get(name)
        return plan is None or plan.summation

    def lookup_groups(self) -> tuple[dict[int, pooling.MergedLookup], list[LookupGroup]]:
        """The classic merged lookups, and the groups for
        :meth:`~stream_persia.worker.router.ShardRouter.lookup`: a ``RowLookup`` for each
        classic lookup, then a ``PooledLookup`` for each pooled group."""
        merged = pooling.merge_lookups(self.classic)
        groups: list[LookupGroup] = [RowLookup(m.dim, m.ids) for m in merged.values()]
        groups += [PooledLookup(g.dim, g.ids, g.index, g.offsets) for g in self.pooled.values()]
        return merged, groups

    def outputs(self, merged: Mapping[int, pooling.MergedLookup], results: list[np.ndarray]
                ) -> dict[str, pooling.SlotOutput]:
        """Every slot's output, in batch order, from the router's results for
        :meth:`lookup_groups` (same order)."""
        n = len(merged)
        out = pooling.pool_batch(self.classic, merged, dict(zip(merged, results[:n],
                                                                strict=True)))
        for group, sums in zip(self.pooled.values(), results[n:], strict=True):
            out.update(group.outputs(sums))
        return {name: out[name] for name in self.names}


def pooled_on_servers(slot: Any) -> bool:
    """Whether a slot's lookups are pooled on the embedding servers (a :class:`PooledGroup`):
    summation slots without a hash stack. Every other slot is planned by
    :func:`stream_persia.worker.pooling.plan_slot` and pooled on the worker."""
    return bool(slot.embedding_summation) and int(slot.hash_stack_config.hash_stack_rounds) == 0


def pools_on_worker(schema: Any) -> bool:
    """Whether any slot of ``schema`` is pooled on the worker, which then runs
    :func:`stream_persia.kernels.segments.segment_sum` (torch) on every batch."""
    return not all(pooled_on_servers(slot) for slot in schema.slots.values())


def plan_batch(id_features: Iterable[Any], schema: Any, requires_grad: bool = True, *,
               csr_checked: bool = False, server_pooling: bool = True) -> BatchPlan:
    """Plan every ID feature of a batch (``IDTypeFeature``-likes with ``name``, ``values``,
    ``offsets``) against an ``EmbeddingSchema``.

    Args:
        requires_grad: False skips the gradient maps (inference, evaluation).
        server_pooling: True pools the slots :func:`pooled_on_servers` names on the servers;
            False plans every slot for pooling here (``plan.classic``: the API's
            in-process table, whose rows are not on servers).
        csr_checked: True when every feature's ``values`` and ``offsets`` were checked
            already and not changed since: the features of a batch that
            ``PersiaBatch.from_wire`` or ``from_bytes`` just decoded (the embedding
            worker's). They are then not checked again (26 slots: ~0.1 ms per batch).

    Raises:
        BadInput: an unknown slot, a slot twice, malformed ids, disagreeing batch sizes
            (the error names the feature).
    """
    names: list[str] = []
    classic: dict[str, pooling.SlotPlan] = {}
    truncated: dict[str, int] = {}
    parts: dict[int, list[tuple[str, np.ndarray, np.ndarray, bool, int]]] = {}
    batch_size, first = -1, ""
    bits = schema.feature_index_prefix_bit
    for feature in id_features:
        name = feature.name
        if name in names:
            raise BadInput(f"ID feature {name!r} appears twice in one batch",
                           field=f"id_type_features.{name}")
        slot = schema.slot(name)
        if csr_checked:
            # pooled_lookup's kernel still bounds-checks offsets in C, so a feature passed
            # as checked by mistake raises BadInput there instead of reading out of range.
            values, offsets = feature.values, feature.offsets
        else:
            values, offsets = pooling.check_csr(name, feature.values, feature.offsets)
        size = len(offsets) - 1
        if not names:
            batch_size, first = size, name
        elif size != batch_size:
            raise BadInput(f"ID feature {name!r} has {size} samples but {first!r} has "
                           f"{batch_size}", field=f"id_type_features.{name}",
                           hint="every feature of a batch holds the same samples")
        names.append(name)
        if server_pooling and pooled_on_servers(slot):
            parts.setdefault(int(slot.dim), []).append(
                (name, values, offsets, bool(slot.sqrt_scaling), slot.index_prefix))
        else:
            classic[name] = plan = pooling.plan_slot(values, offsets, slot, bits,
                                                     requires_grad, csr_checked=True)
            if not plan.summation:
                over = int(np.maximum(np.diff(offsets) - plan.sample_fixed_size, 0).sum())
                if over:
                    truncated[name] = over
    pooled = {dim: _pooled_group(dim, items, batch_size, bits) for dim, items in parts.items()}
    return BatchPlan(tuple(names), pooled, classic, requires_grad, truncated)


def _pooled_group(dim: int, items: list[tuple[str, np.ndarray, np.ndarray, bool, int]],
                  batch: int, prefix_bits: int) -> PooledGroup:
    names, values, offsets, sqrt, prefixes = zip(*items, strict=True)
    ids, index, segs, scale = segments.pooled_lookup(
        list(values), list(offsets), prefixes, prefix_bits, sqrt)
    return PooledGroup(dim, names, batch, ids, index, segs, scale)


def reduce_gradients(plan: BatchPlan, grads: Mapping[str, np.ndarray | None]
                     ) -> pooling.BatchGradients:
    """Every slot's gradient (None: the slot has none) reduced to one row per distinct id
    and merged by dim; slots with NaN or infinity are skipped and listed, and ids whose
    sums overflowed are left out and counted (:func:`pooling.drop_nonfinite`)."""
    if not plan.requires_grad:
        raise Misuse("the batch was planned with requires_grad=False",
                     hint="plan the batch with requires_grad=True to reduce gradients")
    unknown = [name for name in grads if name not in plan.names]
    missing = [name for name in plan.names if name not in grads]
    if unknown or missing:
        name = (unknown or missing)[0]
        raise BadInput(f"gradients must name exactly the batch's slots: unknown {unknown}, "
                       f"missing {missing}", field=f"gradients.{name}",
                       hint="send None for a slot that received no gradient")
    skipped: set[str] = set()
    parts: dict[int, list[tuple[np.ndarray, np.ndarray]]] = {}
    for name, slot_plan in plan.classic.items():
        grad = grads[name]
        if grad is None:
            continue
        reduced = pooling.reduce_slot_gradient(slot_plan, grad)
        if reduced is None:
            skipped.add(name)
        elif len(reduced[0]):
            parts.setdefault(slot_plan.dim, []).append(reduced)
    for group in plan.pooled.values():
        reduced = _reduce_group(group, grads, skipped)
        if reduced is not None:
            parts.setdefault(group.dim, []).append(reduced)
    by_dim, nonfinite = pooling.drop_nonfinite(pooling.merge_gradients(parts))
    return pooling.BatchGradients(by_dim, tuple(n for n in plan.names if n in skipped),
                                  nonfinite)


def _reduce_group(group: PooledGroup, grads: Mapping[str, np.ndarray | None],
                  skipped: set[str]) -> tuple[np.ndarray, np.ndarray] | None:
    b, k = group.batch_size, len(group.names) * group.batch_size
    # Only the slots that carry a finite gradient are copied in; ``seg`` is not zeroed
    # first (a 1.7 MB memset per 26 x 1,024 x 16 batch): the rows of the others are
    # inactive, which ``segments.scatter`` never reads, and are zeroed only when some
    # slot has no gradient (so that the scaling below multiplies zeros, not garbage).
    seg: np.ndarray | None = None
    active: np.ndarray | None = None
    for i, name in enumerate(group.names):
        grad = grads[name]
        if grad is None:
            continue
        grad = pooling.as_float32(name, "gradients", grad, (b, group.dim))
        if not pooling.is_finite(grad):
            skipped.add(name)
            continue
        if seg is None:
            seg = np.empty((k, group.dim), dtype=np.float32)
            active = np.zeros(k, dtype=bool)
        assert active is not None
        seg[i * b:(i + 1) * b] = grad
        active[i * b:(i + 1) * b] = True
    if seg is None or active is None:   # no slot of the group has a gradient
        return None
    if not active.all():
        seg[~active] = 0.0
    if group.scale is not None:
        seg *= group.scale[:, None]
    sums, touched = segments.scatter(seg, group.index, group.offsets, len(group.ids), active)
    if touched.all():
        return (group.ids, sums) if len(group.ids) else None
    if not touched.any():  # the slots with gradients had no ids in this batch
        return None
    return group.ids[touched], sums[touched]
