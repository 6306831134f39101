"""A seeded click stream of any size, labelled by a hidden ground-truth model.

Every sample is a pure function of ``(seed, index)`` (``topologies/streamgen.py``), so
any range of the stream comes out the same in any chunking and in any data loader.
Everything is vectorised numpy (~200k samples/s on one core).

Sample ``i``:

- **ids**: one per slot. Slot ``s`` draws a popularity rank ``r`` in ``[0, vocab)`` from
  a bounded power law with exponent ``zipf_s[s]`` (1.1..1.2), and the id is a 64-bit hash
  of ``(seed, slot, rank)``: ids look random and never collide across slots.
- **dense**: ``num_dense`` standard normal values.
- **label**: ``Bernoulli(p)``, ``p = sigmoid(bias + sum_s w_s(rank_s) + f(dense))``. The
  weight of an id is ``w_s(r) = amp_s * z(seed, s, r) * sqrt(P(r) / (P(r) + floor))``,
  ``z`` a standard normal derived from a hash (no table of millions of weights exists)
  and ``P(r)`` the id's draw probability. The last factor puts the signal in ids drawn
  at least about once per ``1 / floor`` samples: a rare id cannot be learnt from a
  finite stream, so a benchmark whose optimum needed rare ids would measure the stream
  size rather than the trainer. ``f`` is a fixed non-linear function of the dense
  features (linear terms, a saturation, one interaction).

The true ``p`` comes with every sample, so the Bayes-optimal AUC of a split is known
exactly: the AUC of ``p`` against the sampled labels.

**Concept shift** (``shift_at`` >= 0, for ``load_tests/bench_freshness.py``): from sample
``shift_at`` on, samples whose slot-0 id has a popularity rank in ``shift_ranks`` (about
8% of samples by default) get ``shift_logit`` added to their logit: the hidden CTR of
those ids changes at a known sample. The eval split lies after any shift. Each side of
the shift is stationary (a sample's distribution does not depend on its index), so
:meth:`ClickStream.bayes_auc` gives the Bayes-optimal AUC before and after it from a
sample of either side.

**Settings from the environment** (:meth:`ClickStream.from_env`, read by the data loader,
``train.py`` and ``eval_data.py`` alike, so that all of them generate the same stream):

- ``STREAM_PERSIA_CONCEPT_SHIFT_AT=K`` (``stream-persia run --concept-shift-at K``): the
  concept shift from sample ``K`` on (-1 or unset: none).
- ``STREAM_PERSIA_CONCEPT_SHIFT_LOGIT=x``: its size (default 2.0).
- ``STREAM_PERSIA_SYNTHETIC_VOCAB=V``: values per slot (default 5,000,000). A small
  vocabulary (e.g. 100) puts every id's signal in ids seen hundreds of times in the
  first 100k samples, so a short run gets within 0.01 of the Bayes-optimal AUC: the
  drift test (``tests/launch/test_drift_run.py``) runs with 100.

Defaults (see the README): click rate ~0.27, Bayes AUC 0.862 on the 200k eval samples,
~3.8M distinct ids in the first 1M samples.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

_TOPOLOGIES = str(Path(__file__).resolve().parents[1])
if _TOPOLOGIES not in sys.path:
    sys.path.insert(0, _TOPOLOGIES)

from streamgen import (  # noqa: E402
    bayes_auc,
    hashed,
    key,
    normal,
    unit,
    zipf_probability,
    zipf_rank,
)

from stream_persia.embedding.data import (  # noqa: E402
    IDTypeFeatureWithSingleID,
    Label,
    NonIDTypeFeature,
    PersiaBatch,
)

__all__ = ["ClickStream", "Samples", "EVAL_OFFSET", "slot_names", "to_persia_batch"]

#: Eval samples are indices ``EVAL_OFFSET + k``: disjoint from any training range.
EVAL_OFFSET = 1 << 48

# Quantities hashed under their own key: key(seed, quantity, column).
_RANK, _WEIGHT_A, _WEIGHT_B, _ID, _DENSE_A, _DENSE_B, _LABEL = range(1, 8)


def slot_names(num_slots: int) -> list[str]:
    """``C1 .. Cn`` (Criteo's naming)."""
    return [f"C{i + 1}" for i in range(num_slots)]


@dataclass(frozen=True)
class Samples:
    """A chunk of the stream, column-major.

    Attributes:
        index: (n,) int64 sample indices.
        ids: (n, num_slots) uint64, one id per slot.
        dense: (n, num_dense) float32.
        label: (n,) float32 in {0, 1}.
        p: (n,) float64, the true click probability.
    """

    index: np.ndarray
    ids: np.ndarray
    dense: np.ndarray
    label: np.ndarray
    p: np.ndarray

    def __len__(self) -> int:
        return len(self.index)


def _default_amps(num_slots: int) -> tuple[float, ...]:
    # Like real CTR data: a few strong slots, many weak ones, some pure noise.
    pattern = (0.72, 0.56, 0.48, 0.4, 0.32, 0.28, 0.24, 0.2, 0.16, 0.0)
    return tuple(pattern[i % len(pattern)] for i in range(num_slots))


def _default_zipf(num_slots: int) -> tuple[float, ...]:
    return tuple(round(1.1 + 0.1 * (i % 5) / 4, 3) for i in range(num_slots))


@dataclass(frozen=True)
class ClickStream:
    """The stream's definition; :meth:`samples` generates any range of it.

    Args:
        num_slots: ID features (slots ``C1..Cn``).
        vocab_size: distinct values per slot.
        num_dense: dense (non-ID) features.
        seed: selects the stream and its hidden model.
        zipf_s: power-law exponent per slot (default: spread over 1.1..1.2).
        amps: weight scale per slot (default: a spread from 0.72 down to 0).
        popularity_floor: ids drawn with probability well below this carry little weight.
        bias: intercept of the hidden logit (sets the click rate).
    """

    num_slots: int = 26
    vocab_size: int = 5_000_000
    num_dense: int = 4
    seed: int = 0
    zipf_s: tuple[float, ...] = ()
    amps: tuple[float, ...] = ()
    popularity_floor: float = 1e-3
    bias: float = -1.8
    shift_at: int = -1
    shift_ranks: tuple[int, int] = (4, 12)
    shift_logit: float = 2.0
    _keys: dict = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.num_slots < 1 or self.vocab_size < 1 or self.num_dense < 0:
            raise ValueError(f"need num_slots >= 1, vocab_size >= 1, num_dense >= 0; got "
                             f"{self.num_slots}, {self.vocab_size}, {self.num_dense}")
        zs = self.zipf_s or _default_zipf(self.num_slots)
        amps = self.amps or _default_amps(self.num_slots)
        if len(zs) != self.num_slots or len(amps) != self.num_slots:
            raise ValueError(f"zipf_s and amps need {self.num_slots} values each, got "
                             f"{len(zs)} and {len(amps)}")
        if any(s <= 1.0 for s in zs):
            raise ValueError(f"zipf_s values must be > 1, got {zs}")
        object.__setattr__(self, "zipf_s", tuple(float(s) for s in zs))
        object.__setattr__(self, "amps", tuple(float(a) for a in amps))
        keys = {(q, c): key(self.seed, q, c) for q in range(1, 8)
                for c in range(max(self.num_slots, self.num_dense, 1))}
        object.__setattr__(self, "_keys", keys)

    @classmethod
    def from_env(cls, seed: int, environ: Mapping[str, str] | None = None) -> ClickStream:
        """The stream of a job whose settings come from the environment (module
        docstring): the concept shift and the vocabulary."""
        env = os.environ if environ is None else environ

        def number(name: str, kind: type, default: float, low: float):
            raw = env.get(name, "").strip()
            try:
                value = kind(raw) if raw else default
            except ValueError:
                raise SystemExit(f"{name}={raw!r}: expected a {kind.__name__}") from None
            if not value >= low:
                raise SystemExit(f"{name}={raw!r}: must be >= {low}")
            return value

        return cls(seed=seed, shift_at=number("STREAM_PERSIA_CONCEPT_SHIFT_AT", int, -1, -1),
                   shift_logit=number("STREAM_PERSIA_CONCEPT_SHIFT_LOGIT", float, 2.0, -50.0),
                   vocab_size=number("STREAM_PERSIA_SYNTHETIC_VOCAB", int, 5_000_000, 1))

    def bayes_auc(self, start: int, n: int, chunks: int = 10) -> tuple[float, float]:
        """``(auc, stderr)``: the Bayes-optimal AUC of the stream around ``start`` from the
        true ``p`` of samples ``start .. start + n - 1`` (``streamgen.bayes_auc``: the
        expected AUC of scoring by ``p``, no label noise; ``stderr`` from ``chunks``
        parts). The stream is stationary on each side of the shift, so any range on one
        side stands for all of that side."""
        p = np.concatenate([self.samples(lo, min(65_536, start + n - lo)).p
                            for lo in range(start, start + n, 65_536)])
        return bayes_auc(p, chunks)

    @property
    def slots(self) -> list[str]:
        return slot_names(self.num_slots)

    def _k(self, quantity: int, column: int = 0) -> np.uint64:
        return self._keys[(quantity, column)]

    # ------------------------------------------------------------- hidden model
    def rank_probability(self, slot: int, rank: np.ndarray) -> np.ndarray:
        """Exact probability that slot ``slot`` draws popularity rank ``rank``."""
        return zipf_probability(rank, self.zipf_s[slot], self.vocab_size)

    def id_weight(self, slot: int, rank: np.ndarray) -> np.ndarray:
        """The hidden model's weight of each rank of one slot."""
        z = normal(hashed(rank, self._k(_WEIGHT_A, slot)), hashed(rank, self._k(_WEIGHT_B, slot)))
        pr = self.rank_probability(slot, rank)
        return self.amps[slot] * z * np.sqrt(pr / (pr + self.popularity_floor))

    def dense_logit(self, dense: np.ndarray) -> np.ndarray:
        """The hidden model's dense part."""
        d = np.asarray(dense, dtype=np.float64)
        out = np.zeros(len(d))
        for j, c in enumerate((0.6, -0.5, 0.4, 0.3)[:self.num_dense]):
            out += c * d[:, j]
        if self.num_dense >= 3:
            out += 0.8 * np.tanh(2.0 * d[:, 2])
        if self.num_dense >= 2:
            out += 0.4 * d[:, 0] * d[:, 1]
        return out

    # ------------------------------------------------------------- sampling
    def ranks(self, index: np.ndarray) -> np.ndarray:
        """(n, num_slots) int64 popularity ranks of the samples at ``index``."""
        out = np.empty((len(index), self.num_slots), np.int64)
        for s in range(self.num_slots):
            u = unit(hashed(index, self._k(_RANK, s)))
            out[:, s] = zipf_rank(u, self.zipf_s[s], self.vocab_size)
        return out

    def ids_of(self, ranks: np.ndarray) -> np.ndarray:
        """uint64 ids of (n, num_slots) ranks: a hash of (seed, slot, rank)."""
        out = np.empty(ranks.shape, np.uint64)
        for s in range(self.num_slots):
            out[:, s] = hashed(ranks[:, s], self._k(_ID, s))
        return out

    def samples(self, start: int, n: int) -> Samples:
        """Samples ``start .. start + n - 1`` (the same whatever the chunking)."""
        if start < 0 or n < 0:
            raise ValueError(f"start and n must be >= 0, got {start}, {n}")
        return self.samples_at(np.arange(start, start + n, dtype=np.int64))

    def samples_at(self, index: np.ndarray) -> Samples:
        """The samples at arbitrary indices."""
        index = np.asarray(index, dtype=np.int64)
        ranks = self.ranks(index)
        logit = np.full(len(index), self.bias)
        for s in range(self.num_slots):
            if self.amps[s]:
                logit += self.id_weight(s, ranks[:, s])
        dense = np.empty((len(index), self.num_dense), np.float32)
        for j in range(self.num_dense):
            dense[:, j] = normal(hashed(index, self._k(_DENSE_A, j)),
                                 hashed(index, self._k(_DENSE_B, j)))
        logit += self.dense_logit(dense)
        if self.shift_at >= 0:
            logit[self.shifted(index, ranks)] += self.shift_logit
        p = 1.0 / (1.0 + np.exp(-logit))
        label = (unit(hashed(index, self._k(_LABEL))) < p).astype(np.float32)
        return Samples(index=index, ids=self.ids_of(ranks), dense=dense, label=label, p=p)

    def shifted(self, index: np.ndarray, ranks: np.ndarray) -> np.ndarray:
        """Which samples the concept shift changes (bool)."""
        lo, hi = self.shift_ranks
        return (index >= self.shift_at) & (ranks[:, 0] >= lo) & (ranks[:, 0] < hi)

    def shift_probe(self, n: int, scan: int = 1 << 20) -> Samples:
        """Up to ``n`` eval samples the concept shift changes (their ``p`` is after it)."""
        index = np.arange(EVAL_OFFSET, EVAL_OFFSET + scan, dtype=np.int64)
        lo, hi = self.shift_ranks
        r0 = zipf_rank(unit(hashed(index, self._k(_RANK, 0))), self.zipf_s[0], self.vocab_size)
        return self.samples_at(index[(r0 >= lo) & (r0 < hi)][:n])

    def eval_samples(self, n: int, start: int = 0) -> Samples:
        """The held-out split: never overlaps any training range."""
        return self.samples(EVAL_OFFSET + start, n)


def to_persia_batch(samples: Samples, slots: list[str], *, requires_grad: bool = True,
                    with_labels: bool = True) -> PersiaBatch:
    """One ``PersiaBatch``: a single-id feature per slot, the dense features, the label.

    ``meta`` carries the first sample index (8 bytes, little endian), so that a batch can
    be traced back to its place in the stream.
    """
    if len(slots) != samples.ids.shape[1]:
        raise ValueError(f"{len(slots)} slot names for {samples.ids.shape[1]} id columns")
    ids = [IDTypeFeatureWithSingleID(name, np.ascontiguousarray(samples.ids[:, k]))
           for k, name in enumerate(slots)]
    labels = [Label(samples.label.reshape(-1, 1), "click")] if with_labels else None
    meta = int(samples.index[0]).to_bytes(8, "little") if len(samples) else None
    return PersiaBatch(ids, non_id_type_features=[NonIDTypeFeature(samples.dense, "dense")],
                       labels=labels, requires_grad=requires_grad, meta=meta)
