"""Types of the Cython kernels (``cython_ext/segments.pyx``) that
:mod:`stream_persia.kernels.segments` calls; the twins and the contracts are there.

The ``c_*`` kernels fill the arrays they are given and return an error code (0: none; the
position at fault in ``at``).
"""

from typing import Any

import numpy as np

def factorize(keys: np.ndarray) -> tuple[np.ndarray, np.ndarray]: ...
def c_pool(rows: np.ndarray, index: np.ndarray, offsets: np.ndarray, out: np.ndarray,
           at: np.ndarray) -> int: ...
def c_scatter(grads: np.ndarray, index: np.ndarray, offsets: np.ndarray, active: np.ndarray,
              out: np.ndarray, touched: np.ndarray, at: np.ndarray) -> int: ...
def c_split(index: np.ndarray, offsets: np.ndarray, owner: np.ndarray, parts: int,
            id_order: np.ndarray, id_starts: np.ndarray, local_index: np.ndarray,
            index_starts: np.ndarray, part_offsets: np.ndarray, at: np.ndarray) -> int: ...
def c_internal_owner(ids: np.ndarray, parts: int, out: np.ndarray) -> None: ...
def c_split_part(index: np.ndarray, offsets: np.ndarray, owner: np.ndarray, part: int,
                 positions: np.ndarray, local_index: np.ndarray, part_offsets: np.ndarray,
                 at: np.ndarray) -> int: ...

# (status, ids, index, offsets, scale): the four arrays are None when status is an error
# code, and scale is None also when no slot is scaled; a union of the two tuples would not
# narrow once unpacked, so they are Any.
def c_pooled_lookup(values: list[np.ndarray], offsets: list[np.ndarray], prefix_bits: int,
                    index_prefixes: np.ndarray, sqrt_scaling: np.ndarray, scaled: bool,
                    at: np.ndarray) -> tuple[int, Any, Any, Any, Any]: ...
