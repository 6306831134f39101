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
  ``memory_bytes() -> int``, ``close()`` (frees the rows at once; later calls that read or
  change rows raise Misuse)
- ``configure(optimizer=None, embedding_config=None)``
- ``dump(chunk_rows=65536)`` yields ``{"dim", "ids", "weights", "state", "state_kind"}``
  chunks, least recently used first; ``load(chunks)`` inserts them back.
"""

from __future__ import annotations

import warnings

from stream_persia.kernels.twins import PURE_PYTHON
from stream_persia.server._pystore import PyEmbeddingStore

__all__ = ["EmbeddingStore", "IMPLEMENTATION", "PyEmbeddingStore", "CEmbeddingStore"]

CEmbeddingStore: type | None
try:
    from stream_persia.server._cstore import CEmbeddingStore
except ImportError as exc:  # a source checkout that was never built
    CEmbeddingStore = None
    if not PURE_PYTHON:
        warnings.warn(f"the Cython embedding store is not built ({exc}); using the pure-Python "
                      "store, which is far slower (build it with `pip install -e .`)",
                      RuntimeWarning, stacklevel=2)

if PURE_PYTHON or CEmbeddingStore is None:
    EmbeddingStore: type = PyEmbeddingStore
    IMPLEMENTATION = "python"
else:
    EmbeddingStore = CEmbeddingStore
    IMPLEMENTATION = "cython"
