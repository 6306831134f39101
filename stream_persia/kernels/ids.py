"""What is done to a slot's ids before they are looked up: the slot prefix, the hash stack,
and de-duplication by sort.

**Slot prefix** (PERSIA's formula, kept bit for bit so ids match a PERSIA job's): with
``b = feature_index_prefix_bit > 0``, slot ids of feature group ``g`` (0-based) are stored
as ``id % (2**(64-b) - 1) + index_prefix(g, b)`` where ``index_prefix(g, b) = (g + 1) <<
(64 - b)``: the group's number in the top ``b`` bits. ``b = 0`` turns prefixing off. The
pooled-lookup kernel (``cython_ext/segments.pyx``) computes the same in C; the tests hold
the two to one result.

**Hash stack** (``hash_stack_rounds`` R > 0, ``embedding_size`` E): id x stands for the R
bucket ids ``splitmix64_finalizer(x + (r+1) * 0x9E3779B97F4A7C15) % E + r*E``. Fixed
forever: changing it moves every hash-stacked id to another bucket and invalidates
checkpoints that used hash stacks.

Everything here is batched numpy; there is no per-id Python loop.
"""

from __future__ import annotations

import numpy as np

from stream_persia.kernels.sharding import as_uint64_ids, splitmix64_finalizer_inplace

__all__ = ["MAX_PREFIX_BIT", "index_prefix", "prefix_ids", "hash_stack", "unique_inverse",
           "group_order", "sqrt_scale"]

#: Largest accepted ``feature_index_prefix_bit``. Ids keep ``64 - b`` bits; beyond 32 the
#: id space per group is smaller than 2**32 and hashed ids would collide en masse.
MAX_PREFIX_BIT = 32

# SplitMix64's increment: one seed per hash-stack round.
_GAMMA = np.uint64(0x9E3779B97F4A7C15)


# ---------------------------------------------------------------------------- slot prefix
def index_prefix(group: int, prefix_bits: int) -> int:
    """The prefix added to the ids of feature group ``group`` (0-based):
    ``(group + 1) << (64 - prefix_bits)``, or 0 when ``prefix_bits`` is 0."""
    return (group + 1) << (64 - prefix_bits) if prefix_bits > 0 else 0


def prefix_ids(ids: np.ndarray, *, index_prefix: int, prefix_bits: int) -> np.ndarray:
    """A slot's raw ids in its group's id space: ``id % (2**(64-b) - 1) + index_prefix``.

    Returns a new uint64 array, or ``ids`` itself (as uint64) when ``prefix_bits`` or
    ``index_prefix`` is 0. No overflow is possible: the remainder is below ``2**(64-b)``
    and the prefix is a multiple of it no larger than ``2**64 - 2**(64-b)``.

    Raises:
        BadInput: ids that are negative or not integers
            (:func:`~stream_persia.kernels.sharding.as_uint64_ids`).
    """
    arr = as_uint64_ids(ids)
    if prefix_bits == 0 or index_prefix == 0:
        return arr
    modulus = np.uint64((1 << (64 - prefix_bits)) - 1)
    # uint64 division is ~30x slower than a max, and ids below the modulus (any id space of
    # fewer than 2**(64-b) - 1 values) are left unchanged by it.
    if arr.size and arr.max() >= modulus:
        out = np.remainder(arr, modulus)
        out += np.uint64(index_prefix)
        return out
    return arr + np.uint64(index_prefix)


# ---------------------------------------------------------------------------- hash stack
def hash_stack(ids: np.ndarray, rounds: int, embedding_size: int) -> np.ndarray:
    """Bucket ids of a hash stack: uint64 ``(len(ids), rounds)``.

    Round r maps id x to ``splitmix64_finalizer(x + (r+1) * 0x9E3779B97F4A7C15) % E + r * E``
    (all arithmetic mod 2**64), so the rounds' buckets never overlap and every result lies
    in ``[0, rounds * E)``. Buckets stay distinct after :func:`prefix_ids` only while
    ``rounds * E < 2**(64-b) - 1``.
    """
    ids = np.asarray(ids, dtype=np.uint64)
    seeds = _GAMMA * np.arange(1, rounds + 1, dtype=np.uint64)
    z = splitmix64_finalizer_inplace(ids[:, None] + seeds)  # uint64 arithmetic wraps
    z %= np.uint64(embedding_size)
    z += np.arange(rounds, dtype=np.uint64) * np.uint64(embedding_size)
    return z


def sqrt_scale(counts: np.ndarray) -> np.ndarray:
    """float32 ``1/sqrt(n)`` per sample of ``n`` ids (0 for an empty sample): the factor of
    a ``sqrt_scaling`` slot's pooled sum and of its gradient. The pooled-lookup kernel
    computes the same in C (float64, then rounded to float32)."""
    with np.errstate(divide="ignore"):
        return np.where(counts > 0, 1.0 / np.sqrt(counts), 0.0).astype(np.float32)


# ---------------------------------------------------------------------------- sorting
def unique_inverse(keys: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``np.unique(keys, return_inverse=True)`` for uint64 ``keys``: sorted distinct keys
    and the int64 position of every key among them, without ``np.unique``'s per-call
    overhead (~40 us, a third of the work on a 3,000-id slot)."""
    n = len(keys)
    if n == 0:
        return keys.copy(), np.zeros(0, dtype=np.int64)
    order, ordered = _sort_with_order(keys)
    first = np.empty(n, dtype=bool)
    first[0] = True
    np.not_equal(ordered[1:], ordered[:-1], out=first[1:])
    inverse = np.empty(n, dtype=np.int64)
    inverse[order] = np.cumsum(first) - 1
    return ordered[first], inverse


def _sort_with_order(keys: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(order, keys[order]) with ``keys[order]`` sorted.

    When ``max - min`` of the keys leaves room for a key's position in the low bits of a
    uint64, as for ids drawn from a range below ~2**50, ``np.sort`` of
    ``(key - min) << bits | position`` gives both: a SIMD sort of plain uint64 takes less
    than half the time of ``np.argsort`` (hashed 64-bit ids take the argsort).
    """
    lo, hi = int(keys.min()), int(keys.max())
    bits = (len(keys) - 1).bit_length()
    if (hi - lo).bit_length() + bits > 64:
        order = np.argsort(keys)
        return order, keys[order]
    packed = keys - np.uint64(lo)
    packed <<= np.uint64(bits)
    packed |= np.arange(len(keys), dtype=np.uint64)
    packed.sort()
    order = (packed & np.uint64((1 << bits) - 1)).view(np.int64)
    packed >>= np.uint64(bits)
    packed += np.uint64(lo)
    return order, packed


def group_order(inverse: np.ndarray, n_groups: int) -> tuple[np.ndarray, np.ndarray]:
    """Stable order of ``inverse`` grouped by value, and each group's start in it.

    Stable so a gradient sum adds occurrences in batch order on every machine; done as
    16-bit radix passes because numpy's stable sort of 64-bit keys is ~10x slower.
    """
    counts = np.bincount(inverse, minlength=n_groups)
    starts = np.cumsum(counts) - counts
    if n_groups <= 1 << 16:
        order = np.argsort(inverse.astype(np.uint16), kind="stable")
    elif n_groups <= 1 << 32:
        order = np.argsort((inverse & 0xFFFF).astype(np.uint16), kind="stable")
        high = (inverse[order] >> 16).astype(np.uint16)
        order = order[np.argsort(high, kind="stable")]
    else:  # pragma: no cover - more than 4e9 distinct ids in one batch
        order = np.argsort(inverse, kind="stable")
    return order, starts
