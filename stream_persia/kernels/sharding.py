"""Which embedding server owns an id, and which embedding worker reads a Kafka partition.

Ids are routed by ``stable_hash64(id) % num_shards``. The hash is SplitMix64's output
function applied to ``id + 0x9E3779B97F4A7C15`` (``stable_hash64(0)`` is the first output of
a SplitMix64 generator seeded with 0). Python's ``hash`` cannot be used: it is salted per
process for strings and differs between builds.

Two functions, two names (the Cython sources call them ``_mix64`` and ``sp_mix64``):

- :func:`splitmix64_finalizer_inplace`: SplitMix64's finaliser alone (``_mix64`` in
  ``cython_ext/segments.pyx``): the hash stack's bucket function.
- :func:`stable_hash64` / :func:`stable_hash64_int`: the finaliser of
  ``z + 0x9E3779B97F4A7C15`` (``sp_mix64`` in ``cython_ext/store_kernels.h``; ``_mix64`` of
  ``id + 0x9E3779B97F4A7C15`` in ``segments.pyx``): the shard owner, a server's internal
  shard, and the store's initial rows and admission draws.

**Fixed forever.** Every role must agree on the owner of an id, across versions and
machines, or lookups go to a server that never saw the id. Checkpoints re-shard rows by
this hash when loaded into a different number of servers, so changing it would also
silently scatter a restored model's rows. The tests pin output values to catch a change.

Everything here is batched numpy; there is no per-id Python loop.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import Any

import numpy as np

from stream_persia.errors import BadInput, Misuse

__all__ = ["as_uint64_ids", "splitmix64_finalizer_inplace", "stable_hash64", "stable_hash64_int", "shard_of",
           "split_by_shard", "ShardSplit", "static_partitions"]

_INCREMENT = np.uint64(0x9E3779B97F4A7C15)
_MUL1 = np.uint64(0xBF58476D1CE4E5B9)
_MUL2 = np.uint64(0x94D049BB133111EB)
_S30, _S27, _S31 = np.uint64(30), np.uint64(27), np.uint64(31)


def as_uint64_ids(ids: Any) -> np.ndarray:
    """``ids`` as a uint64 array (itself when it is one); signed ids must be >= 0.

    The one check of id arrays for the kernels (hashing, prefixing).

    Raises:
        BadInput: negative ids, or a dtype that is not an integer.
    """
    arr = np.asarray(ids)
    if arr.dtype == np.uint64:
        return arr
    if arr.dtype.kind == "u" or (arr.dtype.kind == "i" and (arr.size == 0 or arr.min() >= 0)):
        return arr.astype(np.uint64)
    if arr.dtype.kind == "i":
        raise BadInput(f"ids must be non-negative, got minimum {int(arr.min())}", field="ids",
                       hint="ids are uint64; map signed ids to unsigned before sending")
    raise BadInput(f"ids must be a uint64 array, got dtype {arr.dtype}", field="ids",
                   hint="np.asarray(ids, dtype=np.uint64)")


def _check_num_shards(num_shards: int) -> int:
    try:
        n = operator.index(num_shards)
    except TypeError:
        raise Misuse(f"num_shards must be an integer, got {num_shards!r}",
                     field="num_shards") from None
    if isinstance(num_shards, bool) or n < 1:
        raise Misuse(f"num_shards must be >= 1, got {num_shards!r}", field="num_shards")
    return n


def splitmix64_finalizer_inplace(z: np.ndarray) -> np.ndarray:
    """SplitMix64's finaliser applied in place to a uint64 array the caller owns; returns it.

    The one implementation of the finaliser in Python: :func:`stable_hash64` and the hash
    stack (:func:`stream_persia.kernels.ids.hash_stack`) use it.
    """
    tmp = np.empty_like(z)
    with np.errstate(over="ignore"):  # uint64 arithmetic is meant to wrap modulo 2**64
        np.right_shift(z, _S30, out=tmp)
        z ^= tmp
        z *= _MUL1
        np.right_shift(z, _S27, out=tmp)
        z ^= tmp
        z *= _MUL2
        np.right_shift(z, _S31, out=tmp)
        z ^= tmp
    return z


def stable_hash64(ids: np.ndarray) -> np.ndarray:
    """SplitMix64 mix of each id: a new uint64 array of the same shape. Fixed forever."""
    with np.errstate(over="ignore"):
        z = np.add(as_uint64_ids(ids), _INCREMENT, dtype=np.uint64)  # a copy: input untouched
    return splitmix64_finalizer_inplace(z)


_U64 = (1 << 64) - 1


def stable_hash64_int(z: int) -> int:
    """:func:`stable_hash64` of one Python int (the store's admission draw, per miss)."""
    z = (z + 0x9E3779B97F4A7C15) & _U64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _U64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _U64
    return z ^ (z >> 31)


def shard_of(ids: np.ndarray, num_shards: int) -> np.ndarray:
    """Index of the embedding server owning each id (int64, in ``[0, num_shards)``)."""
    n = _check_num_shards(num_shards)
    if n == 1:
        return np.zeros(np.shape(as_uint64_ids(ids)), dtype=np.int64)
    return (stable_hash64(ids) % np.uint64(n)).astype(np.int64)


@dataclass(frozen=True, eq=False)
class ShardSplit:
    """Positions of a batch's ids grouped by owning shard, to fan a request out and put
    the replies back in the batch's order.

    Attributes:
        num_shards: number of shards.
        order: int64 positions into the ids, grouped by shard (ascending position within
            a shard).
        offsets: int64, ``num_shards + 1``; shard ``k`` owns ``order[offsets[k]:offsets[k+1]]``.
    """

    num_shards: int
    order: np.ndarray
    offsets: np.ndarray

    @property
    def counts(self) -> np.ndarray:
        """Number of ids owned by each shard."""
        return np.diff(self.offsets)

    def positions(self, shard: int) -> np.ndarray:
        """Positions (into the original ids) of the ids owned by ``shard``."""
        if not 0 <= shard < self.num_shards:
            raise Misuse(f"shard must be in [0, {self.num_shards}), got {shard!r}",
                         field="shard")
        return self.order[self.offsets[shard]:self.offsets[shard + 1]]

    def gather(self, values: np.ndarray) -> list[np.ndarray]:
        """``values`` (aligned with the ids, first axis) cut into one array per shard."""
        values = np.asarray(values)
        if values.shape[:1] != self.order.shape:
            raise Misuse(f"values has {values.shape[:1]} rows, the split has "
                         f"{self.order.shape[0]}", field="values")
        grouped = values[self.order]
        return [grouped[self.offsets[k]:self.offsets[k + 1]] for k in range(self.num_shards)]

    def scatter(self, parts: list[np.ndarray]) -> np.ndarray:
        """Inverse of :meth:`gather`: one array per shard (rows in that shard's
        :meth:`positions` order) back into one array in the ids' original order."""
        if len(parts) != self.num_shards:
            raise Misuse(f"expected {self.num_shards} parts, got {len(parts)}", field="parts")
        parts = [np.asarray(p) for p in parts]
        counts = self.counts
        for k, part in enumerate(parts):
            if part.shape[:1] != (counts[k],):
                raise Misuse(f"part {k} has {part.shape[:1]} rows, shard {k} owns "
                             f"{counts[k]} ids", field=f"parts[{k}]")
        stacked = np.concatenate(parts, axis=0)
        out = np.empty_like(stacked)
        out[self.order] = stacked
        return out


def split_by_shard(ids: np.ndarray, num_shards: int) -> ShardSplit:
    """Group the positions of ``ids`` (1-D) by owning shard with one stable sort.

    Example::

        split = split_by_shard(unique_ids, len(servers))
        replies = [lookup(s, unique_ids[split.positions(s)]) for s in range(len(servers))]
        rows = split.scatter(replies)            # rows[i] belongs to unique_ids[i]
    """
    ids = as_uint64_ids(ids)
    if ids.ndim != 1:
        raise Misuse(f"ids must be 1-D, got shape {ids.shape}", field="ids")
    n = _check_num_shards(num_shards)
    shard = shard_of(ids, n)
    # A narrow key lets numpy's stable sort use radix sort (linear time).
    key = shard.astype(np.uint16) if n <= 1 << 16 else shard
    order = np.argsort(key, kind="stable").astype(np.int64, copy=False)
    offsets = np.zeros(n + 1, dtype=np.int64)
    np.cumsum(np.bincount(shard, minlength=n), out=offsets[1:])
    return ShardSplit(n, order, offsets)


def static_partitions(num_partitions: int, replica_index: int, replica_size: int) -> list[int]:
    """Kafka partitions read by embedding worker ``replica_index`` of ``replica_size``:
    every ``p`` with ``p % replica_size == replica_index`` (static assignment, no consumer
    group; see :mod:`stream_persia.config.kafka`). A worker may get none when there are
    fewer partitions than workers."""
    for name, value, lo in (("num_partitions", num_partitions, 0),
                            ("replica_size", replica_size, 1),
                            ("replica_index", replica_index, 0)):
        if isinstance(value, bool) or not isinstance(value, int) or value < lo:
            raise Misuse(f"{name} must be an integer >= {lo}, got {value!r}", field=name)
    if replica_index >= replica_size:
        raise Misuse(f"replica_index must be < replica_size ({replica_size}), got "
                     f"{replica_index}", field="replica_index")
    return list(range(replica_index, num_partitions, replica_size))
