"""What both embedding stores share for the table policies of issue 20.

The semantics are written out in :class:`~stream_persia.server._pystore.PyEmbeddingStore`'s
docstring; this module holds the argument checks (so both stores' errors read the same),
the geometry and hashes of the frequency sketch, and the sketch itself in numpy for the
twin (the Cython store has the same one in C, ``cython_ext/store_policy.pxi``).

Frequency sketch (count-min, conservative update). ``SKETCH_DEPTH`` = 4 rows of ``w``
8-bit saturating counters, ``w`` the largest power of two with ``4 * w <= sketch_bytes``,
allocated only while some policy has ``min_count > 1``. Id ``k`` has counter
``(H(k ^ SKETCH_SEEDS[j]) >> (64 - log2(w)))`` in row ``j`` (``H`` the stores' SplitMix64
finaliser). Counting ``k`` raises its counters that equal their minimum by one (saturating
at 255) and returns the new minimum, ``k``'s estimate. Every ``w`` counts (before the
next one) all counters are halved, so that an endless stream cannot saturate them: counts
decay by half every ``w`` counted lookups.

Checkpoints. A store with a sketch ends its ``dump`` with a *sketch chunk*
(:func:`sketch_chunk`): a store chunk of no rows (so a reader that does not know it loads
nothing from it) that carries the counters (``"sketch"``, uint8 ``(SKETCH_DEPTH, w)``),
the counts since the last halving (``"sketch_counted"``) and which sketch it is
(``"sketch_part"``: internal shard ``j`` of ``k``, ``[0, 1]`` for a plain store). A ``load``
merges it into the store's sketch (if it has one; :func:`merge_counters`): counters of
another width are first folded (width halved: the max of the two cells that become one)
or spread (doubled: each cell to both of its halves), then the element-wise max is taken.
Because an id's cell of the narrower sketch covers its cells of the wider one, a merged
sketch never counts an id below what the sketch it came from did: after a restore, an id
seen ``c`` times before the checkpoint needs ``min_count - c`` more lookups at most (sooner
when several sketches merge into one, their collisions adding up). A store that restores
into the same layout (same servers, same internal shards) gets back exactly its sketch.

Error bound. Between two halvings, for ``N`` counts since the last one, an id's estimate
``c`` and its exact count ``n`` in those ``N`` satisfy ``n <= c`` (never below; the
counters carried over from before the halving only add) and, with probability at least
``1 - e**-4`` (98%), ``c <= n + e * N / w`` (the count-min bound; conservative update
only lowers ``c``). With the default 8 MiB, ``w = 2**21`` and ``N <= w``: an id is
admitted early (a one-shot id given a row) only when its counters all collide with ids
counted ``min_count - 1`` times in total, less than 2% of ids once the sketch is full and
far fewer before. ``tests/server/test_store_policies.py`` checks the bound against exact
counts.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from stream_persia.core.embedding_config import (
    MAX_SKETCH_BYTES,
    MIN_SKETCH_BYTES,
    SKETCH_BYTES,
    SlotPolicy,
)
from stream_persia.errors import BadInput
from stream_persia.kernels.sharding import stable_hash64_int

__all__ = ["SKETCH_BYTES", "SKETCH_DEPTH", "SKETCH_SEEDS", "STAT_KEYS", "MAX_POLICIES",
           "PySketch", "check_policies", "check_sketch_bytes", "check_expire_rows", "sketch_bits",
           "policy_of", "sketch_chunk", "check_sketch_chunk", "merge_counters"]

SKETCH_DEPTH = 4
SKETCH_SEEDS = (0x243F6A8885A308D3, 0x13198A2E03707344, 0xA4093822299F31D0,
                0x082EFA98EC4E6C89)
MAX_PREFIX_BITS = 63
MAX_POLICIES = 1 << 15        # an entry keeps its policy index in 15 bits (and a mark)
EXPIRE_ROWS = 65536
#: policy_stats() keys, per policy index
STAT_KEYS = ("rows", "admitted", "rejected", "dropped_grads", "expired", "evicted_lru",
             "evicted_cap")


def check_sketch_bytes(n: Any) -> int:
    if isinstance(n, bool) or not isinstance(n, (int, np.integer)) \
            or not MIN_SKETCH_BYTES <= n <= MAX_SKETCH_BYTES:
        raise BadInput(f"sketch_bytes must be an int in [{MIN_SKETCH_BYTES}, "
                       f"{MAX_SKETCH_BYTES}], got {n!r}", field="sketch_bytes",
                       hint="memory of the frequency-admission sketch, e.g. 8388608")
    return int(n)


def sketch_bits(sketch_bytes: int) -> int:
    """log2 of the sketch's width ``w``: the largest power of two with 4 w <= bytes."""
    return int(math.floor(math.log2(sketch_bytes // SKETCH_DEPTH)))


def check_expire_rows(n: Any) -> int:
    if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or n < 1:
        raise BadInput(f"max_rows must be an int >= 1, got {n!r}", field="max_rows",
                       hint="the most rows one expire() call evicts")
    return int(n)


def check_policies(prefix_bits: Any, policies: Any
                   ) -> tuple[int, list[SlotPolicy]]:
    """``(prefix_bits, policies)`` checked: a list of at least one SlotPolicy (None and
    a missing index 0 are the default), none past index ``2**prefix_bits - 1`` but
    defaults. BadInput names ``prefix_bits`` or ``policies[i]``."""
    if isinstance(prefix_bits, bool) or not isinstance(prefix_bits, (int, np.integer)) \
            or not 0 <= prefix_bits <= MAX_PREFIX_BITS:
        raise BadInput(f"prefix_bits must be an int in [0, {MAX_PREFIX_BITS}], got "
                       f"{prefix_bits!r}", field="prefix_bits",
                       hint="the schema's feature_index_prefix_bit")
    if isinstance(policies, (str, bytes)) or not isinstance(policies, Sequence):
        raise BadInput(f"policies must be a list of SlotPolicy or None, got "
                       f"{type(policies).__name__}", field="policies")
    if len(policies) > MAX_POLICIES:
        raise BadInput(f"at most {MAX_POLICIES} policies, got {len(policies)}",
                       field="policies")
    out = []
    for i, p in enumerate(policies):
        if p is None:
            p = SlotPolicy()
        if not isinstance(p, SlotPolicy):
            raise BadInput(f"policies[{i}] must be a SlotPolicy or None, got "
                           f"{type(p).__name__}", field=f"policies[{i}]")
        out.append(p)
    if not out:
        out.append(SlotPolicy())
    # An id's policy index is its top prefix_bits bits: a policy at 2**prefix_bits or
    # beyond would never rule a row, and the table would say it does.
    unreachable = [i for i in range(1 << prefix_bits, len(out)) if not out[i].is_default]
    if unreachable and prefix_bits == 0:
        raise BadInput("policies of feature groups need prefixed ids (prefix_bits > 0)",
                       field="prefix_bits", hint="set feature_index_prefix_bit")
    if unreachable:
        i = unreachable[0]
        raise BadInput(f"policies[{i}] can never apply: ids carry {prefix_bits} prefix "
                       f"bits, so policy indices stop at {(1 << prefix_bits) - 1}",
                       field=f"policies[{i}]",
                       hint="the schema's feature_index_prefix_bit, or a shorter table")
    return int(prefix_bits), out


def policy_of(key: int, prefix_bits: int, n: int) -> int:
    """The policy index of id ``key``: its top ``prefix_bits`` bits, 0 when that is not
    below ``n`` (the number of policies) or ``prefix_bits`` is 0."""
    if prefix_bits == 0:
        return 0
    p = key >> (64 - prefix_bits)
    return p if p < n else 0


class PySketch:
    """The frequency sketch in numpy (see the module docstring)."""

    def __init__(self, sketch_bytes: int):
        self.bits = sketch_bits(sketch_bytes)
        self.width = 1 << self.bits
        self.counters = np.zeros((SKETCH_DEPTH, self.width), np.uint8)
        self.counted = 0      # counts since the last halving

    @property
    def nbytes(self) -> int:
        return self.counters.nbytes

    def _cells(self, key: int) -> list[int]:
        return [stable_hash64_int(key ^ s) >> (64 - self.bits) for s in SKETCH_SEEDS]

    def add(self, key: int) -> int:
        """Count ``key``; its new estimate."""
        if self.counted >= self.width:
            self.counters >>= 1
            self.counted = 0
        self.counted += 1
        cells = self._cells(key)
        c = self.counters
        m = min(int(c[j, x]) for j, x in enumerate(cells))
        m = min(m + 1, 255)
        for j, x in enumerate(cells):
            if c[j, x] < m:
                c[j, x] = m
        return m

    def estimate(self, key: int) -> int:
        return min(int(self.counters[j, x]) for j, x in enumerate(self._cells(key)))


def sketch_chunk(counters: np.ndarray, counted: int, part: tuple[int, int] = (0, 1)
                 ) -> dict[str, Any]:
    """The dump chunk that carries a sketch (see the module docstring): no rows."""
    return {"dim": 1, "ids": np.empty(0, np.uint64), "weights": np.empty((0, 1), np.float32),
            "sketch": np.ascontiguousarray(counters, np.uint8), "sketch_counted": int(counted),
            "sketch_part": [int(part[0]), int(part[1])]}


def check_sketch_chunk(chunk: dict[str, Any]) -> tuple[np.ndarray, int, tuple[int, int]]:
    """``(counters, counted, part)`` of a chunk with ``"sketch"``; BadInput naming the key."""
    c = chunk["sketch"]
    lo, hi = sketch_bits(MIN_SKETCH_BYTES), sketch_bits(MAX_SKETCH_BYTES)
    if not (isinstance(c, np.ndarray) and c.dtype == np.uint8 and c.ndim == 2
            and c.shape[0] == SKETCH_DEPTH and c.shape[1] & (c.shape[1] - 1) == 0
            and 1 << lo <= c.shape[1] <= 1 << hi):
        got = f"{c.dtype} {c.shape}" if isinstance(c, np.ndarray) else type(c).__name__
        raise BadInput(f"chunk sketch must be uint8 of shape ({SKETCH_DEPTH}, w), w a power "
                       f"of two in [{1 << lo}, {1 << hi}], got {got}", field="sketch")
    counted = chunk.get("sketch_counted")
    if isinstance(counted, bool) or not isinstance(counted, (int, np.integer)) \
            or not 0 <= counted <= c.shape[1]:
        raise BadInput(f"chunk sketch_counted must be an int in [0, {c.shape[1]}], got "
                       f"{counted!r}", field="sketch_counted")
    part = chunk.get("sketch_part", [0, 1])
    if not (isinstance(part, (list, tuple)) and len(part) == 2
            and all(isinstance(x, (int, np.integer)) and not isinstance(x, bool) for x in part)
            and 0 <= part[0] < part[1]):
        raise BadInput(f"chunk sketch_part must be [j, k] with 0 <= j < k, got {part!r}",
                       field="sketch_part")
    return np.ascontiguousarray(c), int(counted), (int(part[0]), int(part[1]))


def merge_counters(into: np.ndarray, counters: np.ndarray) -> None:
    """``into`` (uint8 ``(SKETCH_DEPTH, w)``, changed in place) takes the element-wise max
    with ``counters`` brought to its width (folded or spread: module docstring)."""
    w = into.shape[1]
    c = counters
    while c.shape[1] > w:                 # cell x of width w/2 covers cells 2x, 2x + 1
        c = np.maximum(c[:, 0::2], c[:, 1::2])
    if c.shape[1] < w:
        c = np.repeat(c, w // c.shape[1], axis=1)
    np.maximum(into, c, out=into)
