"""Coordinate-wise order statistics by ``jnp.sort`` of the whole stack over the node axis.

The ``"sort"`` formulation of :mod:`kernels.backend`: the same rules and semantics as
:mod:`kernels.sorting` (sorting networks) and :mod:`kernels.selection` (bitwise selection),
written for backends whose sort is a fast library kernel (GPU, TPU) rather than for XLA:CPU,
where it costs about 100 passes over memory. Rows that do not take part are +inf and sort last,
so only the first m positions are read (m may be traced); a NaN in any kept row makes that
coordinate NaN (``jnp.sort`` would move it to the end, so it is checked before the sort), and
with ``poison`` a kept +-Inf does too. A view ``c + A (x - c)`` is built as
:mod:`kernels.selection` builds it (the same result for a dense A).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from kernels.compile_options import kernel_jit
from kernels.selection import _view_block


def _is_static(v) -> bool:
    return isinstance(v, int)


def _sorted(
    x: jax.Array,
    keep: jax.Array | None,
    mixing: jax.Array | None,
    centre: jax.Array | None,
    diagonal: bool,
    poison: bool,
) -> tuple[jax.Array, jax.Array]:
    """The (n, D) float32 rows sorted over the node axis, excluded rows +inf; and where a kept row is NaN."""
    n = x.shape[0]
    c = None if centre is None else centre.reshape(-1)
    v = _view_block(x.reshape(n, -1), c, mixing, diagonal)
    if poison:
        v = jnp.where(jnp.isinf(v), jnp.nan, v)
    if keep is not None:
        v = jnp.where(keep[:, None], v, jnp.inf)
    return jnp.sort(v, axis=0), jnp.any(jnp.isnan(v), axis=0)


def _at(s: jax.Array, index) -> jax.Array:
    """Row ``index`` of s, for a Python int or a traced scalar."""
    if _is_static(index):
        return s[index]
    return jax.lax.dynamic_index_in_dim(s, index, 0, keepdims=False)


def _kept(keep: jax.Array | None, n: int, m: int | None):
    if m is not None:
        return int(m)
    return n if keep is None else jnp.sum(keep.astype(jnp.int32))


def _window_sum(s: jax.Array, start, stop) -> jax.Array:
    """Sum of the sorted rows [start, stop) per column (start may be a per-column array)."""
    k = jnp.arange(s.shape[0]).reshape((-1,) + (1,) * (s.ndim - 1))
    return jnp.sum(jnp.where((k >= start) & (k < stop), s, 0.0), axis=0)


def _divide(total: jax.Array, denom) -> jax.Array:
    if _is_static(denom):
        return total / float(denom) if denom > 0 else jnp.full_like(total, jnp.nan)
    return jnp.where(denom > 0, total / jnp.maximum(denom, 1).astype(jnp.float32), jnp.nan)


def _finish(out: jax.Array, nan: jax.Array, x: jax.Array) -> jax.Array:
    return jnp.where(nan, jnp.nan, out).reshape(x.shape[1:])


def _median_of(s: jax.Array, m) -> jax.Array:
    return 0.5 * (_at(s, (m - 1) // 2) + _at(s, m // 2))


@kernel_jit(static_argnames=("m", "diagonal", "poison"))
def median(x, keep=None, m=None, mixing=None, centre=None, diagonal=True, poison=False) -> jax.Array:
    """Coordinate-wise median over the kept rows (contract of :func:`kernels.sorting.median`).

    Args:
      x: (n, ...) stack.
      keep: optional (n,) bool, the rows that take part (default: all).
      m: optional static count of True entries of ``keep``.
      mixing: optional (n, n) matrix A: the rows are the view ``c + A (x - c)``.
      centre: the centre c of that view (None: c = 0).
      diagonal: whether A is diagonal (static).
      poison: make a coordinate NaN when a kept row is Inf there (a kept NaN always does).

    Returns:
      (...) float32 medians.
    """
    s, nan = _sorted(x, keep, mixing, centre, diagonal, poison)
    return _finish(_median_of(s, _kept(keep, x.shape[0], m)), nan, x)


@kernel_jit(static_argnames=("f", "m", "diagonal", "poison"))
def trimmed_mean(x, f, keep=None, m=None, mixing=None, centre=None, diagonal=True, poison=False) -> jax.Array:
    """Mean of the kept order statistics f .. m - f - 1, NaN when m <= 2f (as :func:`kernels.sorting`'s).

    Args:
      x: (n, ...) stack.
      f: the number of values removed from each end.
      keep: optional (n,) bool, the rows that take part (default: all).
      m: optional static count of True entries of ``keep``.
      mixing: optional (n, n) matrix A: the rows are the view ``c + A (x - c)``.
      centre: the centre c of that view (None: c = 0).
      diagonal: whether A is diagonal (static).
      poison: make a coordinate NaN when a kept row is Inf there (a kept NaN always does).

    Returns:
      (...) float32 means.
    """
    s, nan = _sorted(x, keep, mixing, centre, diagonal, poison)
    kept = _kept(keep, x.shape[0], m)
    return _finish(_divide(_window_sum(s, f, kept - f), kept - 2 * f), nan, x)


@kernel_jit(static_argnames=("k",))
def order_statistic(x, k, keep=None) -> jax.Array:
    """The k-th smallest kept value (0-based), coordinate-wise; +inf when k >= m.

    Args:
      x: (n, ...) stack.
      k: the 0-based position (static).
      keep: optional (n,) bool, the rows that take part (default: all).

    Returns:
      (...) float32.
    """
    s, nan = _sorted(x, keep, None, None, True, False)
    return _finish(s[k], nan, x)


@kernel_jit(static_argnames=("trim", "m", "diagonal", "poison"))
def nearest_to_median_mean(
    x, trim, keep=None, m=None, mixing=None, centre=None, diagonal=True, poison=False
) -> jax.Array:
    """Per coordinate, the mean of the beta = m - trim kept values nearest their median.

    ``trim = 2f``: Bulyan's second stage; ``trim = f``: MeaMed. The window rule and its tie rule
    are :func:`kernels.sorting.closest_to_median_mean`'s: the window ``s[j : j + beta]`` starts at
    the number of j in [0, trim) with ``|s[j + beta] - med| < |s[j] - med|``.

    Args:
      x: (n, ...) stack.
      trim: the number of values dropped per coordinate (2f or f).
      keep: optional (n,) bool, the rows that take part (default: all).
      m: optional static count of True entries of ``keep``.
      mixing: optional (n, n) matrix A: the rows are the view ``c + A (x - c)``.
      centre: the centre c of that view (None: c = 0).
      diagonal: whether A is diagonal (static).
      poison: make a coordinate NaN when a kept row is Inf there (a kept NaN always does).

    Returns:
      (...) float32, NaN where m <= trim.
    """
    s, nan = _sorted(x, keep, mixing, centre, diagonal, poison)
    kept = _kept(keep, x.shape[0], m)
    med = _median_of(s, kept)
    beta = kept - trim
    if _is_static(beta) and beta <= 0:
        return jnp.full(x.shape[1:], jnp.nan, jnp.float32)
    if trim > 0:
        # The values leaving (s[j]) and entering (s[j + beta]) as the window moves, j < trim.
        entering = (
            s[beta : beta + trim] if _is_static(beta) else jax.lax.dynamic_slice_in_dim(s, beta, trim, axis=0)
        )
        nearer = jnp.abs(entering - med[None]) < jnp.abs(s[:trim] - med[None])
        start = jnp.sum(nearer.astype(jnp.int32), axis=0)
    else:
        start = jnp.zeros(s.shape[1:], jnp.int32)
    return _finish(_divide(_window_sum(s, start[None], start[None] + beta), beta), nan, x)
