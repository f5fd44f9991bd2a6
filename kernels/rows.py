"""Streaming reductions over the small leading node axis of an (n, ...) stack.

XLA:CPU is slow at generic reductions over a short leading axis (``x.mean(0)``
on a (16, 1e7) stack costs ~20 passes over memory), but an unrolled chain of
elementwise ops over the n rows fuses into one loop that reads each row once.
Every kernel here is written that way for n <= ``UNROLL_MAX`` and falls back to
the generic formulation for larger n, where the fixed cost is amortized.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from kernels.compile_options import kernel_jit

# Above this many rows the unrolled form compiles slowly and the generic
# reduction is no longer dominated by its per-row overhead.
UNROLL_MAX = 64


def rows(x: jax.Array) -> list[jax.Array]:
    """Split an (n, ...) array into its n rows (static slices, fused by XLA).

    Args:
      x: (n, ...) array.

    Returns:
      The n rows, each (...).
    """
    return [x[i] for i in range(x.shape[0])]


def tree_sum(terms: list[jax.Array]) -> jax.Array:
    """Sum of the terms by pairwise summation (error grows with log n instead of n, same cost).

    Args:
      terms: a non-empty list of arrays of one broadcastable shape.

    Returns:
      Their sum.
    """
    while len(terms) > 1:
        nxt = [terms[i] + terms[i + 1] for i in range(0, len(terms) - 1, 2)]
        if len(terms) % 2:
            nxt.append(terms[-1])
        terms = nxt
    return terms[0]


@kernel_jit
def weighted_sum(
    x: jax.Array, w: jax.Array, ref: jax.Array | None = None, ref_weight: jax.Array | float = 0.0
) -> jax.Array:
    """sum_i w[i] * x[i] (+ ref_weight * ref) over the leading axis, in float32, one pass.

    Rows with ``w[i] == 0`` contribute exactly 0 even when they hold NaN or Inf,
    so excluded (for example non-finite) nodes never poison the result. The
    optional ``ref`` term is fused into the same loop: added afterwards as a
    separate op it would cost a fresh d-sized allocation, which on XLA:CPU is
    page faults worth most of a pass.

    Args:
      x: (n, ...) array.
      w: (n,) weights.
      ref: optional (...) array.
      ref_weight: its coefficient.

    Returns:
      (...) float32 array.
    """
    n = x.shape[0]
    w = w.astype(jnp.float32)
    if n <= UNROLL_MAX:
        terms = [jnp.where(w[i] != 0, w[i] * x[i].astype(jnp.float32), 0.0) for i in range(n)]
        if ref is not None:
            terms.append(jnp.asarray(ref_weight, jnp.float32) * ref.astype(jnp.float32))
        return tree_sum(terms)
    keep = (w != 0).reshape((n,) + (1,) * (x.ndim - 1))
    safe = jnp.where(keep, x.astype(jnp.float32), 0.0)
    out = jnp.tensordot(w, safe, axes=1, precision=jax.lax.Precision.HIGHEST)
    if ref is not None:
        out = out + jnp.asarray(ref_weight, jnp.float32) * ref.astype(jnp.float32)
    return out


# Columns of the (n, NORM_LANES) accumulator of :func:`row_sq_norms`: 16 x 16384 x 4 B = 1 MiB.
NORM_LANES = 16384


def _sq_lanes(x: jax.Array, ref: jax.Array | None) -> jax.Array:
    d = x.astype(jnp.float32)
    if ref is not None:
        d = d - ref.astype(jnp.float32)[None]
    return jnp.square(d)


@kernel_jit
def row_sq_norms(x: jax.Array, ref: jax.Array | None = None) -> jax.Array:
    """||x[i] - ref||^2 for every row, float32, shape (n,).

    A row reduction of ``(x - ref)**2`` costs about one pass over the stack on
    XLA:CPU without ``ref`` and 1.7 with it (the centred copy is written out).
    Instead the squares are accumulated elementwise into an (n, NORM_LANES)
    array while the stack streams by in chunks, and only that small array is
    reduced at the end, which reads the stack once and writes nothing of its
    size. Each lane adds d / NORM_LANES terms in float32 (relative
    error at most ~d / NORM_LANES * 6e-8 of the norm, 4e-5 at d = 1e7 and
    about the square root of that in practice), ample for clipping and norms.

    Args:
      x: (n, ...) stack.
      ref: optional (...) centre.

    Returns:
      (n,) float32 squared norms.
    """
    n = x.shape[0]
    x = x.reshape(n, -1)
    r = None if ref is None else ref.reshape(-1)
    d = x.shape[1]
    k = d // NORM_LANES
    if k < 2:
        return jnp.sum(_sq_lanes(x, r), axis=1)

    def body(i, acc):
        xs = jax.lax.dynamic_slice_in_dim(x, i * NORM_LANES, NORM_LANES, axis=1)
        rs = None if r is None else jax.lax.dynamic_slice_in_dim(r, i * NORM_LANES, NORM_LANES)
        return acc + _sq_lanes(xs, rs)

    acc = jax.lax.fori_loop(0, k, body, jnp.zeros((n, NORM_LANES), jnp.float32))
    total = jnp.sum(acc, axis=1)
    if d % NORM_LANES:
        tail = None if r is None else r[k * NORM_LANES :]
        total = total + jnp.sum(_sq_lanes(x[:, k * NORM_LANES :], tail), axis=1)
    return total


@kernel_jit
def finite_rows(x: jax.Array) -> jax.Array:
    """Which rows are finite: True where every entry of row i is finite.

    Args:
      x: (n, ...) stack.

    Returns:
      (n,) bool.
    """
    n = x.shape[0]
    # x * 0 is NaN exactly where x is NaN or +-Inf; one float sum per row is a
    # contiguous reduction that vectorizes, unlike a boolean all().
    probe = jnp.sum((x.astype(jnp.float32) * 0.0).reshape(n, -1), axis=1)
    return jnp.isfinite(probe)


MIX_CHUNK = 16384


@kernel_jit
def mix(x: jax.Array, mixing: jax.Array) -> jax.Array:
    """y_b = sum_j M[b, j] x_j for a (B, n) mixing M (B = n: a mixing of the rows), float32.

    Streams the columns in cache-sized chunks (XLA:CPU's plain dot on a long
    (n, d) operand is ~10x slower than one pass). Columns j with an all-zero
    column of M are zeroed first so non-finite excluded rows cannot leak in,
    and output rows i with an all-zero row of M are NaN: "no value", which
    every aggregator then excludes as non-finite.

    Args:
      x: (n, ...) stack.
      mixing: (B, n) mixing matrix M.

    Returns:
      (B, ...) float32.
    """
    n, b = x.shape[0], mixing.shape[0]
    shape = (b,) + x.shape[1:]
    x = x.reshape(n, -1)
    used = jnp.any(mixing != 0, axis=0)
    produced = jnp.any(mixing != 0, axis=1)
    mixing = mixing.astype(jnp.float32)

    def block(xs):
        xs = jnp.where(used[:, None], xs.astype(jnp.float32), 0.0)
        y = jnp.dot(mixing, xs, precision=jax.lax.Precision.HIGHEST)
        return jnp.where(produced[:, None], y, jnp.nan)

    d = x.shape[1]
    k = d // MIX_CHUNK
    if k < 2:
        return block(x).reshape(shape)

    def body(i, out):
        xs = jax.lax.dynamic_slice_in_dim(x, i * MIX_CHUNK, MIX_CHUNK, axis=1)
        return jax.lax.dynamic_update_slice_in_dim(out, block(xs), i * MIX_CHUNK, axis=1)

    out = jax.lax.fori_loop(0, k, body, jnp.zeros((b, d), jnp.float32))
    if d % MIX_CHUNK:
        out = out.at[:, k * MIX_CHUNK :].set(block(x[:, k * MIX_CHUNK :]))
    return out.reshape(shape)


def view_rows(
    x: jax.Array, mixing: jax.Array | None, centre: jax.Array | None, *, diagonal: bool = True
) -> list[jax.Array]:
    """Rows ``y_i = c + sum_j A[i, j] (x_j - c)`` as float32 arrays, built lazily.

    Meant to be called inside a jitted kernel so the rows fuse into whatever
    consumes them (a sorting network) instead of being written out. Terms with
    ``A[i, j] == 0`` contribute exactly 0 even when x_j is NaN. ``diagonal``
    (static) says A is diagonal: one multiply-add per row instead of n.

    Args:
      x: (n, ...) stack.
      mixing: optional (n, n) matrix A (None: the rows of x themselves).
      centre: optional (...) centre c (None: c = 0).
      diagonal: whether A is diagonal.

    Returns:
      The n rows, float32, each (...).
    """
    r = [v.astype(jnp.float32) for v in rows(x)]
    if mixing is None:
        return r
    c = None if centre is None else centre.astype(jnp.float32)
    d = r if c is None else [v - c for v in r]
    n = len(r)
    if diagonal:
        out = [jnp.where(mixing[i, i] != 0, mixing[i, i] * d[i], 0.0) for i in range(n)]
    else:
        out = [
            tree_sum([jnp.where(mixing[i, j] != 0, mixing[i, j] * d[j], 0.0) for j in range(n)])
            for i in range(n)
        ]
    return out if c is None else [c + v for v in out]


@kernel_jit(static_argnames=("diagonal",))
def materialize_view(
    x: jax.Array, mixing: jax.Array, centre: jax.Array | None, valid: jax.Array | None, *, diagonal: bool
) -> jax.Array:
    """The rows ``c + A (x - c)`` written out as an (n, ...) array in x's dtype; invalid rows NaN.

    A diagonal A is one broadcast multiply-add over the stack (the fastest form
    XLA:CPU has for an n -> n map); a dense A streams through :func:`mix`.

    Args:
      x: (n, ...) stack.
      mixing: (n, n) matrix A.
      centre: optional (...) centre c (None: c = 0).
      valid: optional (n,) bool; invalid rows come out NaN.
      diagonal: whether A is diagonal (static).

    Returns:
      (n, ...) array in x's dtype.
    """
    n = x.shape[0]
    shape = (n,) + (1,) * (x.ndim - 1)
    xf = x.astype(jnp.float32)
    c = None if centre is None else centre.astype(jnp.float32)
    if diagonal:
        scale = jnp.diagonal(mixing).reshape(shape)
        d = xf if c is None else xf - c
        y = jnp.where(scale != 0, scale * d, 0.0)
    else:
        d = xf if c is None else xf - c
        y = mix(d, mixing)
    if c is not None:
        y = y + c
    if valid is not None:
        y = jnp.where(valid.reshape(shape), y, jnp.nan)
    return y.astype(x.dtype)
