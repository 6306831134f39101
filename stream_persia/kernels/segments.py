"""Segment kernels of the pooled lookup path: de-duplication, pooling, gradient scatter.

A batch's summation slots of one dim form one *pooled lookup*: every id occurrence of every
(slot, sample) pair, in slot-major then sample order, becomes

- ``ids``: the distinct ids, in first-occurrence order (:func:`factorize`);
- ``index``: int32, for every occurrence, its id's position in ``ids``;
- ``offsets``: int64 ``(k + 1,)``; segment s (one slot of one sample) is the occurrences
  ``index[offsets[s]:offsets[s+1]]``.

:func:`pooled_lookup` builds all three from the slots' CSR ids in one pass (prefixing,
concatenation, de-duplication, offsets); :func:`factorize` is its de-duplication alone.

The embedding server looks ``ids`` up and returns ``(k, dim)`` pooled sums
(:func:`pool`) instead of ``(len(ids), dim)`` rows: about 1.7 MB instead of 5 MB for a
1,024 x 26-slot batch of dim 16. With several servers the worker splits the lookup by owner
(:func:`split`) and adds the servers' partial sums. Gradients go the other way: the
``(k, dim)`` segment gradient reaches every occurrence and is summed per distinct id
(:func:`scatter`), in occurrence order, as the classic path in
:mod:`stream_persia.worker.pooling` does.

Each function is a Cython loop (``cython_ext/segments.pyx``, the GIL released) with a numpy
twin here that gives the same result bit for bit (every sum starts from 0.0 and adds its
terms in occurrence order); ``STREAM_PERSIA_PURE_PYTHON=1`` (:mod:`stream_persia.kernels.twins`)
or an unbuilt extension selects the twins. Arguments are validated before either runs: a
malformed index or offsets raises :class:`~stream_persia.errors.BadInput` naming ``field``.

:func:`segment_sum` is the embedding worker's pooling of the slots it pools itself (raw and
hash-stacked slots: :mod:`stream_persia.worker.pooling`), with torch's CPU ``embedding_bag``:
on a 1024-sample slot with ~3 ids per sample and dim 16 it measured ~10 us, against 140-400 us
for the numpy alternatives (``np.add.reduceat``, whose per-segment overhead dominates with
short segments; ``np.add.at``; a per-column ``np.bincount``; a float64 cumsum-and-difference).
torch is a dependency of the package already, but importing it costs a process ~1 s and
~190 MB; the ``np.add.reduceat`` twin runs under the same flag, and the tests hold both to
the same results; :data:`SEGMENT_SUM_IMPLEMENTATION` says which one runs.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, NoReturn

import numpy as np

from stream_persia.errors import BadInput, Misuse
from stream_persia.kernels.ids import prefix_ids, sqrt_scale
from stream_persia.kernels.sharding import stable_hash64
from stream_persia.kernels.twins import PURE_PYTHON

__all__ = ["IMPLEMENTATION", "SEGMENT_SUM_IMPLEMENTATION", "Split", "factorize",
           "pooled_lookup", "pool", "scatter", "split", "split_part", "internal_owner",
           "check_pooled", "check_types", "raise_for", "segment_sum", "load_segment_sum"]

try:
    from stream_persia.kernels import _segments as _c
except ImportError:  # a source checkout that was never built: the twins run
    _c = None  # type: ignore[assignment]  # then IMPLEMENTATION is "python": no use of _c runs

IMPLEMENTATION = "python" if _c is None or PURE_PYTHON else "cython"
SEGMENT_SUM_IMPLEMENTATION = (
    "numpy" if PURE_PYTHON or importlib.util.find_spec("torch") is None else "torch")

_E_INDEX, _E_OFFSETS, _E_OWNER, _E_VALUES = 1, 2, 3, 4


def raise_for(status: int, at: int, field: str, n_ids: int) -> NoReturn:
    """BadInput for a kernel's error code, worded and named as :func:`check_pooled`."""
    if status == _E_INDEX:
        raise BadInput(f"{field}.index must lie in [0, {n_ids}) (one entry per id occurrence "
                       f"into ids); position {at} does not", field=f"{field}.index")
    if status == _E_OWNER:
        raise BadInput(f"{field}: the owner of distinct id {at} is out of range",
                       field=f"{field}.owner")
    raise BadInput(f"{field}.offsets must be nondecreasing from 0 to len(index)",
                   field=f"{field}.offsets")


def check_types(index: object, offsets: object, field: str) -> tuple[np.ndarray, np.ndarray]:
    """``index`` is 1-D int32 and ``offsets`` non-empty 1-D int64 (their values are
    :func:`check_pooled`'s or a kernel's to check); BadInput names ``field``. Returns both,
    as arrays."""
    if not (isinstance(index, np.ndarray) and index.dtype == np.int32 and index.ndim == 1):
        got = f"{index.dtype} {index.shape}" if isinstance(index, np.ndarray) else type(index).__name__
        raise BadInput(f"{field}.index must be a 1-D int32 array, got {got}",
                       field=f"{field}.index")
    if not (isinstance(offsets, np.ndarray) and offsets.dtype == np.int64 and offsets.ndim == 1
            and len(offsets) >= 1):
        got = (f"{offsets.dtype} {offsets.shape}" if isinstance(offsets, np.ndarray)
               else type(offsets).__name__)
        raise BadInput(f"{field}.offsets must be a non-empty 1-D int64 array, got {got}",
                       field=f"{field}.offsets")
    return index, offsets


def check_pooled(n_ids: int, index: object, offsets: object, field: str) -> None:
    """Validate a pooled lookup's ``index`` (int32 1-D, each in [0, n_ids)) and
    ``offsets`` (int64 1-D, nondecreasing, 0 .. len(index)); BadInput names ``field``."""
    index, offsets = check_types(index, offsets, field)
    # offsets[1:] < offsets[:-1], not np.diff(offsets) < 0: no int64 temporary (26k
    # segments a batch, checked on every lookup)
    if (offsets[0] != 0 or offsets[-1] != len(index)
            or bool((offsets[1:] < offsets[:-1]).any())):
        raise BadInput(f"{field}.offsets must be nondecreasing from 0 to len(index)="
                       f"{len(index)}", field=f"{field}.offsets")
    if len(index) and (int(index.min()) < 0 or int(index.max()) >= n_ids):
        raise BadInput(f"{field}.index must lie in [0, {n_ids}) (one entry per id occurrence "
                       f"into ids)", field=f"{field}.index")


# ---------------------------------------------------------------------------- factorize
def factorize(keys: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Distinct ``keys`` (uint64, first-occurrence order) and the int32 position of every
    key among them: ``uniq[inverse] == keys``. One hash pass (~5 ns per key), against a
    sort for ``np.unique``."""
    keys = np.ascontiguousarray(keys, dtype=np.uint64)
    if IMPLEMENTATION == "cython":
        return _c.factorize(keys)
    return _factorize_numpy(keys)


def _factorize_numpy(keys: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    if len(keys) == 0:
        return keys.copy(), np.zeros(0, dtype=np.int32)
    sorted_uniq, first, inverse = np.unique(keys, return_index=True, return_inverse=True)
    order = np.argsort(first, kind="stable")          # sorted position -> appearance rank
    rank = np.empty_like(order)
    rank[order] = np.arange(len(order))
    return sorted_uniq[order], rank[inverse.ravel()].astype(np.int32)


# ---------------------------------------------------------------------------- pooled lookup
def pooled_lookup(values: Sequence[np.ndarray], offsets: Sequence[np.ndarray],
                  index_prefixes: Sequence[int], prefix_bits: int,
                  sqrt_scaling: Sequence[bool] | None = None, field: str = "slots"
                  ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray | None]:
    """The pooled lookup of the summation slots of one dim, from their CSR ids.

    Slot i's ids ``values[i]`` (1-D uint64; sample b is
    ``values[i][offsets[i][b]:offsets[i][b+1]]``, ``offsets[i]`` 1-D int64 and as long for
    every slot) are prefixed as :func:`stream_persia.kernels.ids.prefix_ids` does with
    ``index_prefixes[i]`` and ``prefix_bits``, the slots are concatenated, and
    segment ``i * batch + b`` is slot i of sample b. One pass, against a prefix, a
    concatenation and a :func:`factorize` per batch.

    Returns:
        ``(ids, index, offsets, scale)``: the distinct prefixed ids (uint64,
        first-occurrence order), every id's int32 position among them, the int64 segment
        bounds, and, when ``sqrt_scaling`` has a True, float32 ``1/sqrt(n)`` per segment
        of the slots it names (0 for an empty sample, 1 for the other slots), else None.

    Raises:
        BadInput: values or offsets of the wrong type or shape, or offsets that do not run
            nondecreasing from 0 to ``len(values[i])``, naming ``field[i]``.
    """
    k = len(values)
    flags = [False] * k if sqrt_scaling is None else [bool(x) for x in sqrt_scaling]
    if not len(offsets) == len(index_prefixes) == len(flags) == k:
        raise Misuse(f"pooled_lookup: {k} values, {len(offsets)} offsets, "
                     f"{len(index_prefixes)} index prefixes and {len(flags)} sqrt flags; "
                     "give one of each per slot")
    if not 0 <= prefix_bits < 64:
        raise Misuse(f"pooled_lookup: prefix_bits must lie in [0, 64), got {prefix_bits}")
    prefixes = np.array(index_prefixes, dtype=np.uint64)
    scaled = any(flags)
    if IMPLEMENTATION == "cython":
        at = np.zeros(1, dtype=np.int64)
        status, ids, index, segs, scale = _c.c_pooled_lookup(
            values if isinstance(values, list) else list(values),
            offsets if isinstance(offsets, list) else list(offsets),
            int(prefix_bits), prefixes, np.array(flags, dtype=np.uint8), scaled, at)
        if status:
            _raise_slot(status, int(at[0]), field)
        return ids, index, segs, scale
    _check_slots(values, offsets, field)
    keys = [prefix_ids(v, index_prefix=int(p), prefix_bits=prefix_bits)
            for v, p in zip(values, prefixes, strict=True)]
    ids, index = _factorize_numpy(np.concatenate(keys) if k else np.zeros(0, np.uint64))
    batch = len(offsets[0]) - 1 if k else 0
    segs = np.empty(k * batch + 1, dtype=np.int64)
    base = 0
    for i, (v, off) in enumerate(zip(values, offsets, strict=True)):
        np.add(off[:-1], base, out=segs[i * batch:(i + 1) * batch])
        base += len(v)
    segs[-1] = base
    scale = None
    if scaled:
        scale = np.ones(k * batch, dtype=np.float32)
        for i, (off, sqrt) in enumerate(zip(offsets, flags, strict=True)):
            if sqrt:
                scale[i * batch:(i + 1) * batch] = sqrt_scale(off[1:] - off[:-1])
    return ids, index, segs, scale


def _check_slots(values: Sequence[np.ndarray], offsets: Sequence[np.ndarray], field: str
                 ) -> None:
    """The twin of the kernel's checks, in its order: every slot's types and lengths, then
    every slot's offsets."""
    for i, (v, off) in enumerate(zip(values, offsets, strict=True)):
        if not (isinstance(v, np.ndarray) and v.dtype == np.uint64 and v.ndim == 1):
            _raise_slot(_E_VALUES, i, field)
        if not (isinstance(off, np.ndarray) and off.dtype == np.int64 and off.ndim == 1
                and len(off) >= 1 and len(off) == len(offsets[0])):
            _raise_slot(_E_OFFSETS, i, field)
    for i, (v, off) in enumerate(zip(values, offsets, strict=True)):
        if off[0] != 0 or off[-1] != len(v) or bool((off[1:] < off[:-1]).any()):
            _raise_slot(_E_OFFSETS, i, field)


def _raise_slot(status: int, at: int, field: str) -> NoReturn:
    if status == _E_VALUES:
        raise BadInput(f"{field}[{at}].values must be a 1-D uint64 array",
                       field=f"{field}[{at}].values", hint="np.asarray(ids, dtype=np.uint64)")
    raise BadInput(f"{field}[{at}].offsets must be a 1-D int64 array as long as every "
                   f"slot's (batch size + 1), nondecreasing from 0 to len(values)",
                   field=f"{field}[{at}].offsets")


# ---------------------------------------------------------------------------- pool
def pool(rows: np.ndarray, index: np.ndarray, offsets: np.ndarray,
         field: str = "pooled") -> np.ndarray:
    """float32 ``(len(offsets) - 1, dim)``: row s sums ``rows[index[offsets[s]:offsets[s+1]]]``
    (zeros for an empty segment)."""
    rows = np.ascontiguousarray(rows, dtype=np.float32)
    check_types(index, offsets, field)
    out = np.zeros((len(offsets) - 1, rows.shape[1]), dtype=np.float32)
    if IMPLEMENTATION == "cython":
        at = np.zeros(1, dtype=np.int64)
        status = _c.c_pool(rows, index, offsets, out, at)
        if status:
            raise_for(status, int(at[0]), field, len(rows))
        return out
    check_pooled(len(rows), index, offsets, field)
    _add_segments(out, rows, index, offsets)
    return out


def _add_segments(out: np.ndarray, rows: np.ndarray, index: np.ndarray,
                  offsets: np.ndarray) -> None:
    """The twins' loop, vectorised by position within the segment: pass t adds the t-th
    term of every segment that has one, so each sum runs in occurrence order from 0.0."""
    lengths = np.diff(offsets)
    segs = np.flatnonzero(lengths > 0)
    t = 0
    while len(segs):
        out[segs] += rows[index[offsets[segs] + t]]
        t += 1
        segs = segs[lengths[segs] > t]


# ---------------------------------------------------------------------------- scatter
def scatter(grads: np.ndarray, index: np.ndarray, offsets: np.ndarray, n_ids: int,
            active: np.ndarray | None = None, field: str = "gradients"
            ) -> tuple[np.ndarray, np.ndarray]:
    """Segment gradients summed per distinct id.

    Args:
        grads: float32 ``(k, dim)``, the gradient of every segment's pooled sum.
        index, offsets: the pooled lookup (``k = len(offsets) - 1``).
        n_ids: the number of distinct ids.
        active: bool ``(k,)``; False segments contribute nothing (frozen or skipped slots).

    Returns:
        ``(out, touched)``: float32 ``(n_ids, dim)`` sums (each in occurrence order) and
        bool ``(n_ids,)``, True where an active segment reached the id.
    """
    grads = np.ascontiguousarray(grads, dtype=np.float32)
    check_types(index, offsets, field)
    k = len(offsets) - 1
    active = np.ones(k, dtype=bool) if active is None else np.asarray(active, dtype=bool)
    if grads.ndim != 2 or grads.shape[0] != k:
        raise BadInput(f"{field}: grads must be (segments={k}, dim), got {grads.shape}",
                       field=f"{field}.grads")
    if active.shape != (k,):
        raise BadInput(f"{field}: active must be ({k},), got {active.shape}",
                       field=f"{field}.active")
    out = np.zeros((n_ids, grads.shape[1]), dtype=np.float32)
    if IMPLEMENTATION == "cython":
        touched = np.zeros(n_ids, dtype=np.uint8)
        at = np.zeros(1, dtype=np.int64)
        status = _c.c_scatter(grads, index, offsets, active.view(np.uint8), out, touched, at)
        if status:
            raise_for(status, int(at[0]), field, n_ids)
        return out, touched.view(bool)
    check_pooled(n_ids, index, offsets, field)
    lengths = np.diff(offsets)
    seg_of = np.repeat(np.arange(k), lengths)
    live = active[seg_of]
    ids, segs = index[live], seg_of[live]
    order = np.argsort(ids, kind="stable")              # per id, occurrence order
    ids, segs = ids[order], segs[order]
    starts = np.flatnonzero(np.r_[True, ids[1:] != ids[:-1]]) if len(ids) else ids
    counts = np.diff(np.r_[starts, len(ids)])
    t = 0
    group = np.arange(len(starts))
    while len(group):                                   # t-th contribution of each id
        out[ids[starts[group]]] += grads[segs[starts[group] + t]]
        t += 1
        group = group[counts[group] > t]
    touched = np.zeros(n_ids, dtype=bool)
    touched[ids] = True
    return out, touched


# ---------------------------------------------------------------------------- split
@dataclass(frozen=True, eq=False)
class Split:
    """One part's share of a pooled lookup: ``positions`` of its ids among the lookup's
    distinct ids (int64, in order), and its own ``index`` (int32, into those ids) and
    ``offsets`` (int64, one segment per segment of the whole lookup)."""

    positions: np.ndarray
    index: np.ndarray
    offsets: np.ndarray


def internal_owner(ids: np.ndarray, parts: int) -> np.ndarray:
    """The internal shard (store thread, :mod:`stream_persia.server.sharded`) of each id
    of an embedding server: ``(stable_hash64(id) >> 32) % parts`` (int64). The high half of
    the hash that routes ids to servers (:func:`stream_persia.kernels.sharding.shard_of` reduces the
    whole of it modulo the server count, so for power-of-two counts only its low bits): the
    two are independent, and every server's ids spread over all its internal shards."""
    ids = np.ascontiguousarray(ids, dtype=np.uint64)
    if IMPLEMENTATION == "cython":
        out = np.empty(len(ids), dtype=np.int64)
        _c.c_internal_owner(ids, parts, out)
        return out
    return ((stable_hash64(ids) >> np.uint64(32)) % np.uint64(parts)).astype(np.int64)


def split_part(index: np.ndarray, offsets: np.ndarray, owner: np.ndarray, part: int,
               parts: int) -> Split:
    """``split(index, offsets, owner, parts)[part]``, cut without the other parts: one pass
    over the ids and one over the occurrences, so that several parts can be cut at once on
    their own threads (:class:`stream_persia.server.sharded.ShardedStore`)."""
    owner = np.ascontiguousarray(owner, dtype=np.int64)
    check_types(index, offsets, "split")
    if not 0 <= part < parts:
        raise Misuse(f"part must be in [0, {parts}), got {part!r}", field="part")
    if IMPLEMENTATION != "cython":
        return split(index, offsets, owner, parts)[part]
    positions = np.empty(len(owner), dtype=np.int64)
    part_index = np.empty(len(index), dtype=np.int32)
    part_offsets = np.empty(len(offsets), dtype=np.int64)
    at = np.zeros(2, dtype=np.int64)
    status = _c.c_split_part(index, offsets, owner, part, positions, part_index,
                             part_offsets, at)
    if status:
        raise_for(status, int(at[0]), "split", len(owner))
    return Split(positions[:at[0]], part_index[:at[1]], part_offsets)


def split(index: np.ndarray, offsets: np.ndarray, owner: np.ndarray, parts: int
          ) -> list[Split]:
    """Split a pooled lookup by the part owning each distinct id (``owner`` int64, one per
    distinct id, in [0, parts)). Pooling each part and adding the parts' sums gives the
    whole lookup's sums (up to float rounding: the order of the additions changes)."""
    owner = np.ascontiguousarray(owner, dtype=np.int64)
    check_types(index, offsets, "split")
    if IMPLEMENTATION == "cython":
        k, n, m = len(offsets) - 1, len(index), len(owner)
        id_order = np.empty(m, dtype=np.int64)
        id_starts = np.empty(parts + 1, dtype=np.int64)
        part_index = np.empty(n, dtype=np.int32)
        index_starts = np.empty(parts + 1, dtype=np.int64)
        part_offsets = np.empty((parts, k + 1), dtype=np.int64)
        at = np.zeros(1, dtype=np.int64)
        status = _c.c_split(index, offsets, owner, parts, id_order, id_starts, part_index,
                            index_starts, part_offsets, at)
        if status:
            raise_for(status, int(at[0]), "split", m)
        return [Split(id_order[id_starts[p]:id_starts[p + 1]],
                      part_index[index_starts[p]:index_starts[p + 1]], part_offsets[p])
                for p in range(parts)]
    check_pooled(len(owner), index, offsets, "split")
    if len(owner) and (int(owner.min()) < 0 or int(owner.max()) >= parts):
        raise BadInput(f"split: owners must lie in [0, {parts})", field="split.owner")
    part_index = np.zeros(len(owner), dtype=np.int32)
    seg_of = np.repeat(np.arange(len(offsets) - 1), np.diff(offsets))
    out = []
    for p in range(parts):
        mine = owner == p
        part_index[mine] = np.arange(int(mine.sum()), dtype=np.int32)
        occ = mine[index]
        counts = np.bincount(seg_of[occ], minlength=len(offsets) - 1)
        offs = np.zeros(len(offsets), dtype=np.int64)
        np.cumsum(counts, out=offs[1:])
        out.append(Split(np.flatnonzero(mine).astype(np.int64), part_index[index[occ]], offs))
    return out


# ---------------------------------------------------------------------------- segment sum
def _torch() -> Any:
    """torch, imported on first use: a process whose slots all pool on the embedding
    servers (summation slots without a hash stack) never runs a segment sum and never
    pays for it."""
    import torch
    return torch


def load_segment_sum() -> Any:
    """Import what :func:`segment_sum` runs on now (torch: ~1 s) rather than inside the
    first batch that needs it; returns torch, or None for the numpy twin."""
    return _torch() if SEGMENT_SUM_IMPLEMENTATION == "torch" else None


def segment_sum(table: np.ndarray, index: np.ndarray, starts: np.ndarray,
                impl: str | None = None) -> np.ndarray:
    """``out[s] = sum(table[index[starts[s]:starts[s+1]]])`` (last segment runs to the end).

    ``starts`` is nondecreasing int64 beginning at 0; empty segments give zero rows.
    ``impl``: ``"torch"`` or ``"numpy"``, default :data:`SEGMENT_SUM_IMPLEMENTATION`.
    Returns float32 ``(len(starts), table.shape[1])``.
    """
    impl = impl or SEGMENT_SUM_IMPLEMENTATION
    n_out, dim = len(starts), table.shape[1]
    if n_out == 0 or len(index) == 0:
        return np.zeros((n_out, dim), dtype=np.float32)
    if impl == "torch":
        torch = _torch()
        return torch.nn.functional.embedding_bag(
            torch.from_numpy(_torch_readable(index)), torch.from_numpy(_torch_readable(table)),
            torch.from_numpy(_torch_readable(starts)), mode="sum").numpy()
    out = np.zeros((n_out, dim), dtype=np.float32)
    ends = np.empty_like(starts)
    ends[:-1] = starts[1:]
    ends[-1] = len(index)
    nonempty = np.flatnonzero(ends > starts)
    out[nonempty] = np.add.reduceat(table.take(index, axis=0), starts[nonempty], axis=0)
    return out


def _torch_readable(a: np.ndarray) -> np.ndarray:
    """``a`` in a form ``torch.from_numpy`` takes without a warning: C-contiguous and
    writable. Wire arrays are read-only views; when the frame's buffer itself is writable
    (RPC receive buffers are), a writable alias of the same memory does instead of a copy
    (~1 ms per batch of 26 slots). Only for reading: the alias is never written through.
    """
    if a.flags.c_contiguous and not a.flags.writeable:
        alias = a.view()
        try:
            alias.flags.writeable = True
            return alias
        except ValueError:  # the memory is immutable (e.g. bytes)
            pass
    if not (a.flags.writeable and a.flags.c_contiguous):
        a = a.copy()
    return a
