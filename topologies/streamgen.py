"""Counter-based randomness for the generated streams (vectorised numpy, no state).

A generated sample is a pure function of ``(seed, index)``: every random quantity is a
hash of the sample index under a key that names the quantity. So any range of a stream
can be produced anywhere, in any chunking, by any number of data loaders, identically.

- ``stable_hash64`` (:func:`stream_persia.kernels.sharding.stable_hash64`, re-exported):
  SplitMix64's finaliser of ``x + golden``, a bijective well-mixed ``uint64 -> uint64``.
- :func:`key`: a key from small integers (seed, quantity, column...).
- :func:`unit`, :func:`normal`: uniform in (0, 1) and standard normal from hashes.
- :func:`zipf_rank`, :func:`zipf_probability`: a bounded power law over ``[0, vocab)``
  (continuous inverse CDF on ``[1, vocab + 1)``, floored), and the exact probability of
  each rank under it: ``P(r) = ((r+2)**(1-a) - (r+1)**(1-a)) / ((V+1)**(1-a) - 1)``.
- :func:`bayes_auc`: the Bayes-optimal AUC of a stationary stretch of a stream from the
  true probabilities of a sample of it, with its sampling error.
"""

from __future__ import annotations

import numpy as np

from stream_persia.kernels.sharding import stable_hash64

__all__ = ["stable_hash64", "key", "hashed", "unit", "normal", "zipf_rank", "zipf_probability",
           "expected_auc", "bayes_auc"]

_MASK = (1 << 64) - 1


def key(*parts: int) -> np.uint64:
    """A key from integers, hashed in sequence (order matters)."""
    k = np.zeros(1, np.uint64)
    for p in parts:
        k = stable_hash64(k ^ np.uint64(int(p) & _MASK))
    return k[0]


def hashed(index: np.ndarray, k: np.uint64) -> np.ndarray:
    """The hash of every index under key ``k``."""
    return stable_hash64(np.asarray(index).astype(np.uint64) ^ k)


def unit(h: np.ndarray) -> np.ndarray:
    """uint64 hashes -> float64 uniform in (0, 1), never exactly 0 or 1."""
    return ((h >> np.uint64(11)).astype(np.float64) + 0.5) * (1.0 / (1 << 53))


def normal(h1: np.ndarray, h2: np.ndarray) -> np.ndarray:
    """Box-Muller: two independent hashes -> one standard normal."""
    return np.sqrt(-2.0 * np.log(unit(h1))) * np.cos(2.0 * np.pi * unit(h2))


def _norm(s: float, vocab: int) -> float:
    return (vocab + 1.0) ** (1.0 - s) - 1.0


def zipf_rank(u: np.ndarray, s: float, vocab: int) -> np.ndarray:
    """Ranks in ``[0, vocab)`` from uniforms ``u``, power law with exponent ``s > 1``."""
    if s <= 1.0:
        raise ValueError(f"the Zipf exponent must be > 1, got {s}")
    a = 1.0 - s
    x = (1.0 + np.asarray(u) * _norm(s, vocab)) ** (1.0 / a)
    return np.minimum(np.floor(x).astype(np.int64) - 1, vocab - 1)


def zipf_probability(rank: np.ndarray, s: float, vocab: int) -> np.ndarray:
    """Exact probability of each rank under :func:`zipf_rank`."""
    a = 1.0 - s
    r = np.asarray(rank, dtype=np.float64)
    return ((r + 2.0) ** a - (r + 1.0) ** a) / _norm(s, vocab)


def expected_auc(p: np.ndarray) -> float:
    """The AUC that scoring by ``p`` gets in expectation over the labels, when each sample
    is positive with probability ``p`` (its true probability): every sample counts as
    ``p`` of a positive and ``1 - p`` of a negative, ties one half. No label noise: the
    only error left is which samples were drawn."""
    p = np.asarray(p, dtype=np.float64).ravel()
    uniq, inverse = np.unique(p, return_inverse=True)
    pos = np.bincount(inverse, weights=p, minlength=len(uniq))
    neg = np.bincount(inverse, weights=1.0 - p, minlength=len(uniq))
    below = np.cumsum(neg) - neg          # negative weight strictly below each value
    total = pos.sum() * neg.sum()
    return float((pos * (below + 0.5 * neg)).sum() / total) if total > 0 else 0.5


def bayes_auc(p: np.ndarray, chunks: int = 10) -> tuple[float, float]:
    """``(auc, stderr)``: the Bayes-optimal AUC of the population ``p`` was drawn from
    (:func:`expected_auc` of all of it), and its sampling error estimated from the spread
    of ``chunks`` equal parts (batch means: ``std / sqrt(chunks)``; the AUC is not a mean
    of the parts, but for parts of thousands of samples it is close to one)."""
    p = np.asarray(p, dtype=np.float64).ravel()
    parts = [expected_auc(c) for c in np.array_split(p, chunks) if len(c)]
    err = float(np.std(parts, ddof=1) / np.sqrt(len(parts))) if len(parts) > 1 else float("nan")
    return expected_auc(p), err
