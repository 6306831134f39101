"""The embedding store used by embedding servers: the Cython LRU store or its Python twin.

``EmbeddingStore(capacity, optimizer, embedding_config=None)`` is the Cython
``CEmbeddingStore`` (``cython_ext/store.pyx``) unless the environment sets
``STREAM_PERSIA_PURE_PYTHON=1`` (:mod:`stream_persia.kernels.twins`) or the extension
cannot be imported (then with a warning); it is the pure-Python ``PyEmbeddingStore``
otherwise. Both have the same interface and give
bit-identical results; :data:`IMPLEMENTATION` says which one this process uses.

Interface (see ``_pystore.PyEmbeddingStore`` for the full contract):

- ``lookup(ids: uint64 (n,), dim: int, train: bool = True) -> float32 (n, dim)``
- ``lookup_pooled(ids, dim, index: int32, offsets: int64, train=True) -> float32 (k, dim)``:
  the segment sums of a pooled lookup (:mod:`stream_persia.kernels.segments`), equal bit for bit
  to ``segments.pool(lookup(ids, dim, train), index, offsets)``; the Cython store adds the
  rows where they lie instead of copying them out (what embedding servers answer)
- ``update(ids: uint64 (n,), grads: float32 (n, dim)) -> None``
- ``contains(ids) -> bool (n,)``, ``len(store)``, ``clear()``, ``stats() -> dict``,
  ``memory_bytes() -> int``, ``memory_breakdown() -> {"rows", "bookkeeping"}`` (bytes of
  row storage, weights and optimizer state, and of the rest; they add up to
  ``memory_bytes``), ``close()`` (frees the rows at once; later calls that read or
  change rows raise Misuse)
- ``configure(optimizer=None, embedding_config=None)``
- ``dump(chunk_rows=65536)`` yields ``{"dim", "ids", "weights", "state", "state_kind"}``
  chunks, least recently used first; ``load(chunks)`` inserts them back.
- change tracking (the update stream to serving replicas; semantics in ``_pystore``'s
  docstring): ``change_version -> int``, ``advance_version(v)``,
  ``changed_since(since, chunk_rows=65536)`` yields ``{"dim", "ids", "weights",
  "versions"}`` chunks of the rows changed after ``since`` (empty ones, ``dim`` 0, bound
  each pause; a pass from the version read before the previous pass costs, in the Cython
  store, what changed since rather than the table's size),
  ``evicted_since(since) -> (ids, versions, complete)``, ``remove(ids) -> int``.
  The constructor's ``eviction_log`` (keyword, default 2**20 entries) bounds the log that
  ``evicted_since`` reads.
- table policies per feature group (issue 20; semantics in ``_pystore``'s docstring):
  ``set_policies(prefix_bits, policies, *, now=None)``, ``expire(now=None,
  max_rows=65536) -> int``, ``policy_stats() -> {index: {counter: int}}``,
  ``sketch_counts(ids) -> int64``; the constructor's ``sketch_bytes`` (keyword, default
  8 MiB) bounds the frequency-admission sketch.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterable, Iterator
from typing import Any, Protocol

import numpy as np

from stream_persia.kernels.twins import PURE_PYTHON
from stream_persia.server._pystore import PyEmbeddingStore

__all__ = ["EmbeddingStore", "IMPLEMENTATION", "PyEmbeddingStore", "CEmbeddingStore", "Store"]


class Store(Protocol):
    """The interface above as a type: the Cython store, its twin and the
    :class:`~stream_persia.server.sharded.ShardedStore` of either."""

    def __len__(self) -> int: ...
    def lookup(self, ids: np.ndarray, dim: int, train: bool = True) -> np.ndarray: ...
    def lookup_pooled(self, ids: np.ndarray, dim: int, index: np.ndarray,
                      offsets: np.ndarray, train: bool = True) -> np.ndarray: ...
    def update(self, ids: np.ndarray, grads: np.ndarray) -> None: ...
    def contains(self, ids: np.ndarray) -> np.ndarray: ...
    def clear(self) -> None: ...
    def stats(self) -> dict[str, int]: ...
    def memory_bytes(self) -> int: ...
    def memory_breakdown(self) -> dict[str, int]: ...
    def close(self) -> None: ...
    def configure(self, optimizer: Any = None, embedding_config: Any = None) -> None: ...
    def dump(self, chunk_rows: int = ...) -> Iterator[dict[str, Any]]: ...
    def load(self, chunks: Iterable[dict[str, Any]]) -> None: ...
    @property
    def change_version(self) -> int: ...
    def advance_version(self, version: int) -> None: ...
    def remove(self, ids: np.ndarray) -> int: ...
    def changed_since(self, since: int, chunk_rows: int = ..., *,
                      state: bool = ...) -> Iterator[dict[str, Any]]: ...
    def evicted_since(self, since: int) -> tuple[np.ndarray, np.ndarray, bool]: ...
    def set_policies(self, prefix_bits: int, policies: Any, *,
                     now: float | None = None) -> None: ...
    def expire(self, now: float | None = None, max_rows: int = ...) -> int: ...
    def policy_stats(self) -> dict[int, dict[str, int]]: ...
    def sketch_counts(self, ids: np.ndarray) -> np.ndarray: ...


try:
    from stream_persia.server import _cstore
    CEmbeddingStore: type[_cstore.CEmbeddingStore] | None = _cstore.CEmbeddingStore
except ImportError as exc:  # a source checkout that was never built
    CEmbeddingStore = None
    if not PURE_PYTHON:
        warnings.warn(f"the Cython embedding store is not built ({exc}); using the pure-Python "
                      "store, which is far slower (build it with `pip install -e .`)",
                      RuntimeWarning, stacklevel=2)

if PURE_PYTHON or CEmbeddingStore is None:
    EmbeddingStore: type[PyEmbeddingStore] | type[_cstore.CEmbeddingStore] = PyEmbeddingStore
    IMPLEMENTATION = "python"
else:
    EmbeddingStore = CEmbeddingStore
    IMPLEMENTATION = "cython"
