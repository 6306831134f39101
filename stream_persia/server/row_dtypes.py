"""Storage dtypes of row weights (issue 20, compact rows): the rounding both stores apply.

A row's weights are stored as ``float32`` (code 0), ``float16`` (1) or ``bfloat16`` (2); its
optimizer state stays float32, and every reader (lookups, ``dump``, ``changed_since``)
gets float32. Storing rounds to nearest even:

- ``float16``: numpy's float32 -> float16 conversion (subnormals kept, a NaN stays a NaN),
  except that a value beyond the largest float16 (or an infinity) *saturates* to ±65504
  instead of becoming inf: a row stays finite whatever ``weight_bound`` is (the store
  clamps to ±weight_bound first, then rounds, so with a bound over 65504 the effective
  bound of a float16 row is 65504);
- ``bfloat16``: the top 16 bits of the float32, rounded to nearest even with integer
  operations (a NaN keeps its top bits with the quiet bit set), except that a value that
  rounds past the largest bfloat16 (float32 values from about ±3.3961e38), or an infinity,
  *saturates* to ±3.3895e38 instead of becoming inf, as float16 rows do.

The Cython store's ``sp_narrow``/``sp_widen`` (``cython_ext/store_kernels.h``) give the
same bits; ``tests/server/test_store_dtypes.py`` checks it over many bit patterns.
"""

from __future__ import annotations

import numpy as np

from stream_persia.core.embedding_config import ROW_DTYPES

__all__ = ["ROW_DTYPES", "dtype_code", "weight_bytes", "round_weights"]

_F16_MAX = np.float32(65504.0)


def dtype_code(name: str) -> int:
    """0, 1, 2 for float32, float16, bfloat16 (the order of ``ROW_DTYPES``)."""
    return ROW_DTYPES.index(name)


def weight_bytes(dim: int, code: int) -> int:
    """Bytes of ``dim`` weights of a row of dtype ``code``, padded to 4 bytes as the
    Cython store lays rows out (weights, then the float32 state)."""
    return 4 * dim if code == 0 else 4 * ((dim + 1) // 2)


def round_weights(x: np.ndarray, code: int) -> np.ndarray:
    """float32 ``x`` rounded to dtype ``code`` and back to float32 (a new array)."""
    x = np.asarray(x, np.float32)
    if code == 0:
        return x.copy()
    if code == 1:
        with np.errstate(over="ignore", invalid="ignore"):
            out = np.clip(x, -_F16_MAX, _F16_MAX).astype(np.float16).astype(np.float32)
        nan = np.isnan(x)
        if nan.any():   # as the C kernel: the top 10 payload bits, quiet (numpy may not)
            out[nan] = ((x[nan].view(np.uint32) & 0xFFFFE000) | 0x7FC00000).view(np.float32)
        return out
    b = x.view(np.uint32).astype(np.uint64)
    nan = ((b & 0x7F800000) == 0x7F800000) & ((b & 0x007FFFFF) != 0)
    r = (b + 0x7FFF + ((b >> 16) & 1)) >> 16
    r = np.where(nan, (b >> 16) | 0x40, r) & 0xFFFF
    over = ~nan & ((r & 0x7F80) == 0x7F80)     # rounded to inf, or an inf: saturate
    r = np.where(over, (r & 0x8000) | 0x7F7F, r)
    return (r << 16).astype(np.uint32).view(np.float32)
