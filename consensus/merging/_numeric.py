"""Host-side (numpy) arithmetic shared by the per-tensor merge formulas of mergekit's methods.

The formulas run on one tensor at a time in a *compute dtype*: float32 (this package's default,
cast once at the end) or the configuration's float16 / bfloat16 (mergekit's behaviour, where
every intermediate is rounded). numpy rounds each element-wise operation of a float16 or
bfloat16 array to that dtype, as torch does on the CPU; a reduction is accumulated in float32
and rounded once, as torch's CPU reductions of half types are (numpy would add in float16).
"""

from __future__ import annotations

from typing import Any

import numpy as np

# The narrow floats whose reductions torch accumulates in float32.
NARROW = ("float16", "bfloat16")


def is_narrow(dtype: Any) -> bool:
    """Whether ``dtype`` is float16 or bfloat16 (reductions accumulate in float32).

    Args:
      dtype: A numpy dtype (``ml_dtypes.bfloat16`` included).

    Returns:
      True for float16 and bfloat16.
    """
    return np.dtype(dtype).name in NARROW


def reduce_sum(x: np.ndarray, axis: Any = None, keepdims: bool = False) -> np.ndarray:
    """``x.sum(axis)`` as torch computes it: float32 accumulation for narrow floats, then rounded.

    Args:
      x: The array.
      axis: The axis or axes (None: all).
      keepdims: Keep the reduced axes as size 1.

    Returns:
      The sum, in ``x``'s dtype.
    """
    if is_narrow(x.dtype):
        return np.asarray(x.sum(axis=axis, dtype=np.float32, keepdims=keepdims)).astype(x.dtype)
    return np.asarray(x.sum(axis=axis, keepdims=keepdims))


def norm(x: np.ndarray, axis: Any = None, keepdims: bool = False) -> np.ndarray:
    """The L2 norm accumulated in float64 (float32 and narrower inputs), in ``x``'s dtype.

    Args:
      x: The array.
      axis: The axis (None: all entries).
      keepdims: Keep the reduced axis as size 1.

    Returns:
      ``sqrt(sum x^2)``, rounded to ``x``'s dtype.
    """
    acc = np.float64 if np.dtype(x.dtype).itemsize <= 8 else x.dtype
    sq = np.square(x, dtype=acc) if not is_narrow(x.dtype) else np.square(x.astype(acc))
    return np.sqrt(sq.sum(axis=axis, keepdims=keepdims)).astype(x.dtype)


def as_weights(values: Any, dtype: Any, ndim: int) -> np.ndarray:
    """Per-model numbers as an (n, 1, ..., 1) array in the compute dtype (mergekit's ``unsqueeze``).

    Args:
      values: n numbers.
      dtype: The compute dtype (the numbers are rounded to it, as ``torch.tensor(w, dtype=...)`` does).
      ndim: The number of dimensions of one model's tensor.

    Returns:
      The (n, 1, ...) array.
    """
    w = np.asarray([float(v) for v in values], np.float64).astype(dtype)
    return w.reshape((len(w),) + (1,) * ndim)
