"""Streaming reductions over the small leading node axis of an (n, ...) stack.

XLA:CPU is slow at generic reductions over a short leading axis (``x.mean(0)``
on a (16, 1e7) stack costs ~20 passes over memory), but an unrolled chain of
elementwise ops over the n rows fuses into one loop that reads each row once.
Every kernel here is written that way for n <= ``UNROLL_MAX`` and falls back to
the generic formulation for larger n, where the fixed cost is amortised.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

# Above this many rows the unrolled form compiles slowly and the generic
# reduction is no longer dominated by its per-row overhead.
UNROLL_MAX = 64


def rows(x: jax.Array) -> list[jax.Array]:
    """Split an (n, ...) array into its n rows (static slices, fused by XLA)."""
    return [x[i] for i in range(x.shape[0])]


def _tree_sum(terms: list[jax.Array]) -> jax.Array:
    # Pairwise summation: error grows with log n instead of n, same cost.
    while len(terms) > 1:
        nxt = [terms[i] + terms[i + 1] for i in range(0, len(terms) - 1, 2)]
        if len(terms) % 2:
            nxt.append(terms[-1])
        terms = nxt
    return terms[0]


@jax.jit
def weighted_sum(x: jax.Array, w: jax.Array) -> jax.Array:
    """sum_i w[i] * x[i] over the leading axis, computed in float32.

    Rows with ``w[i] == 0`` contribute exactly 0 even when they hold NaN or Inf,
    so excluded (for example non-finite) nodes never poison the result.

    Args:
      x: (n, ...) array.
      w: (n,) weights.
    Returns:
      (...) float32 array.
    """
    n = x.shape[0]
    w = w.astype(jnp.float32)
    if n <= UNROLL_MAX:
        terms = [jnp.where(w[i] != 0, w[i] * x[i].astype(jnp.float32), 0.0) for i in range(n)]
        return _tree_sum(terms)
    keep = (w != 0).reshape((n,) + (1,) * (x.ndim - 1))
    safe = jnp.where(keep, x.astype(jnp.float32), 0.0)
    return jnp.tensordot(w, safe, axes=1, precision=jax.lax.Precision.HIGHEST)


@jax.jit
def row_sq_norms(x: jax.Array, ref: jax.Array | None = None) -> jax.Array:
    """||x[i] - ref||^2 for every row, float32, shape (n,)."""
    d = x.astype(jnp.float32)
    if ref is not None:
        d = d - ref.astype(jnp.float32)[None]
    return jnp.sum(jnp.square(d).reshape(x.shape[0], -1), axis=1)


@jax.jit
def finite_rows(x: jax.Array) -> jax.Array:
    """(n,) bool: True where every entry of row i is finite."""
    n = x.shape[0]
    # x * 0 is NaN exactly where x is NaN or +-Inf; one float sum per row is a
    # contiguous reduction that vectorises, unlike a boolean all().
    probe = jnp.sum((x.astype(jnp.float32) * 0.0).reshape(n, -1), axis=1)
    return jnp.isfinite(probe)


@functools.partial(jax.jit, static_argnames=("unroll",))
def masked_mean(x: jax.Array, mask: jax.Array, unroll: bool = True) -> jax.Array:
    """Mean of the rows where ``mask`` is True (NaN rows elsewhere are ignored)."""
    m = jnp.maximum(jnp.sum(mask), 1).astype(jnp.float32)
    return weighted_sum(x, mask.astype(jnp.float32) / m)
