"""A seeded click stream of any size, labelled by a hidden ground-truth model.

Every sample is a pure function of ``(seed, index)`` (counter-based hashing, no state), so
any range of the stream can be generated anywhere, in any chunking, by any number of data
loaders, and always comes out the same. Everything is vectorised numpy.

Sample ``i``:

- **ids**: one id per slot. Slot ``s`` draws a popularity rank ``r`` in ``[0, vocab)``
  from a bounded power law with exponent ``zipf_s[s]`` (continuous inverse CDF, floored:
  ``P(r) = ((r+2)**(1-a) - (r+1)**(1-a)) / ((V+1)**(1-a) - 1)``), and the id is a 64-bit
  hash of ``(seed, slot, rank)``: ids look random and never collide across slots.
- **dense**: ``num_dense`` standard normal values.
- **label**: ``Bernoulli(p)`` with ``p = sigmoid(logit)`` and
  ``logit = bias + sum_s w_s(rank_s) + f(dense)``. The per-id weight is
  ``w_s(r) = amp_s * z(seed, s, r) * sqrt(P(r) / (P(r) + popularity_floor))`` with ``z`` a
  standard normal derived from a hash, so no table of millions of weights is stored.
  The last factor keeps the signal in ids seen often enough to be learnt: an id drawn
  less often than once per ``1 / popularity_floor`` samples carries a shrinking weight
  (rare ids can never be learnt from a finite stream, and a benchmark whose optimum needs
  them would measure the stream size, not the trainer). ``f`` is a small fixed
  non-linear function of the dense features.

The generator returns ``p`` with every sample, so the Bayes-optimal AUC of any split is
known exactly: :func:`bayes_auc` (the AUC of ``p`` against the sampled labels).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

__all__ = ["ClickStream", "Samples", "EVAL_OFFSET", "slot_names", "bayes_auc"]

#: Eval samples are indices ``EVAL_OFFSET + k``: disjoint from any training range.
EVAL_OFFSET = 1 << 48

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)


def _mix64(x: np.ndarray) -> np.ndarray:
    """SplitMix64's finaliser: a bijective, well-mixed uint64 -> uint64 hash."""
    x = x + _GOLDEN
    x = (x ^ (x >> np.uint64(30))) * _M1
    x = (x ^ (x >> np.uint64(27))) * _M2
    return x ^ (x >> np.uint64(31))


def _key(*parts: int) -> np.uint64:
    """A stream key from small integers (hashed in sequence)."""
    k = np.zeros(1, np.uint64)
    for p in parts:
        k = _mix64(k ^ np.uint64(p & 0xFFFFFFFFFFFFFFFF))
    return k[0]


def _unit(h: np.ndarray) -> np.ndarray:
    """uint64 hash -> float64 uniform in (0, 1) (never exactly 0 or 1)."""
    return ((h >> np.uint64(11)).astype(np.float64) + 0.5) * (1.0 / (1 << 53))


def _normal(h1: np.ndarray, h2: np.ndarray) -> np.ndarray:
    """Box-Muller: two uint64 hashes -> one standard normal."""
    return np.sqrt(-2.0 * np.log(_unit(h1))) * np.cos(2.0 * np.pi * _unit(h2))


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
    # A spread like real CTR data: a few strong slots, many weak ones, a few pure noise.
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
        zipf_s: power-law exponent per slot (default spread over 1.1..1.2).
        amps: weight scale per slot (default a spread from 0.9 down to 0).
        popularity_floor: ids with draw probability well below this carry little weight.
        bias: intercept of the hidden logit (sets the click rate, ~0.2 by default).
    """

    num_slots: int = 26
    vocab_size: int = 5_000_000
    num_dense: int = 4
    seed: int = 0
    zipf_s: tuple[float, ...] = ()
    amps: tuple[float, ...] = ()
    popularity_floor: float = 1e-3
    bias: float = -1.8
    _norm: np.ndarray = field(init=False, repr=False, compare=False)

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
        one_minus = 1.0 - np.asarray(self.zipf_s)
        object.__setattr__(self, "_norm", (self.vocab_size + 1.0) ** one_minus - 1.0)

    @property
    def slots(self) -> list[str]:
        return slot_names(self.num_slots)

    # ------------------------------------------------------------- hidden model
    def rank_probability(self, slot: int, rank: np.ndarray) -> np.ndarray:
        """Exact probability that slot ``slot`` draws popularity rank ``rank``."""
        a = 1.0 - self.zipf_s[slot]
        r = np.asarray(rank, dtype=np.float64)
        return ((r + 2.0) ** a - (r + 1.0) ** a) / self._norm[slot]

    def id_weight(self, slot: int, rank: np.ndarray) -> np.ndarray:
        """The hidden model's weight of each rank of one slot."""
        rank = np.asarray(rank, dtype=np.uint64)
        k1, k2 = _key(self.seed, 2, slot), _key(self.seed, 3, slot)
        z = _normal(_mix64(rank ^ k1), _mix64(rank ^ k2))
        pr = self.rank_probability(slot, rank)
        return self.amps[slot] * z * np.sqrt(pr / (pr + self.popularity_floor))

    def dense_logit(self, dense: np.ndarray) -> np.ndarray:
        """The hidden model's dense part: linear terms, a saturation and one interaction."""
        d = np.asarray(dense, dtype=np.float64)
        out = np.zeros(len(d))
        coef = (0.6, -0.5, 0.4, 0.3)
        for j in range(min(self.num_dense, len(coef))):
            out += coef[j] * d[:, j]
        if self.num_dense >= 3:
            out += 0.8 * np.tanh(2.0 * d[:, 2])
        if self.num_dense >= 2:
            out += 0.4 * d[:, 0] * d[:, 1]
        return out

    # ------------------------------------------------------------- sampling
    def ranks(self, index: np.ndarray) -> np.ndarray:
        """(n, num_slots) int64 popularity ranks of samples ``index``."""
        idx = np.asarray(index, dtype=np.uint64)
        out = np.empty((len(idx), self.num_slots), np.int64)
        for s in range(self.num_slots):
            u = _unit(_mix64(idx ^ _key(self.seed, 1, s)))
            a = 1.0 - self.zipf_s[s]
            x = (1.0 + u * self._norm[s]) ** (1.0 / a)
            out[:, s] = np.minimum(np.floor(x).astype(np.int64) - 1, self.vocab_size - 1)
        return out

    def ids_of(self, ranks: np.ndarray) -> np.ndarray:
        """uint64 ids of (n, num_slots) ranks: a hash of (seed, slot, rank)."""
        r = np.asarray(ranks).astype(np.uint64)
        out = np.empty(r.shape, np.uint64)
        for s in range(self.num_slots):
            out[:, s] = _mix64(r[:, s] ^ _key(self.seed, 4, s))
        return out

    def samples(self, start: int, n: int) -> Samples:
        """Samples ``start .. start + n - 1`` (the same whatever the chunking)."""
        if start < 0 or n < 0:
            raise ValueError(f"start and n must be >= 0, got {start}, {n}")
        index = np.arange(start, start + n, dtype=np.int64)
        return self.samples_at(index)

    def samples_at(self, index: np.ndarray) -> Samples:
        """The samples at arbitrary indices."""
        index = np.asarray(index, dtype=np.int64)
        idx = index.astype(np.uint64)
        with np.errstate(over="ignore"):
            ranks = self.ranks(index)
            logit = np.full(len(idx), self.bias)
            for s in range(self.num_slots):
                if self.amps[s]:
                    logit += self.id_weight(s, ranks[:, s])
            dense = np.empty((len(idx), self.num_dense), np.float32)
            for j in range(self.num_dense):
                dense[:, j] = _normal(_mix64(idx ^ _key(self.seed, 5, j)),
                                      _mix64(idx ^ _key(self.seed, 6, j)))
            logit += self.dense_logit(dense)
            p = 1.0 / (1.0 + np.exp(-logit))
            label = (_unit(_mix64(idx ^ _key(self.seed, 7))) < p).astype(np.float32)
            ids = self.ids_of(ranks)
        return Samples(index=index, ids=ids, dense=dense, label=label, p=p)

    def eval_samples(self, n: int, start: int = 0) -> Samples:
        """The held-out split: never overlaps any training range."""
        return self.samples(EVAL_OFFSET + start, n)


def bayes_auc(samples: Samples) -> float:
    """AUC of the true probability against the sampled labels: the best any model can do
    on exactly these samples (in expectation over the labels)."""
    from common import roc_auc  # topologies/common.py, on sys.path in every entry script

    return roc_auc(samples.label, samples.p)
