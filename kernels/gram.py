"""Gram matrices and pairwise distances of the rows of an (n, ...) stack.

XLA:CPU's ``x @ x.T`` on a (16, 1e7) float32 stack is ~12x slower than one pass
over memory, and ``x - ref`` materializes a full copy before the product. Here
the columns are streamed in cache-sized chunks inside a ``fori_loop``: each
chunk is centred and multiplied while it is in cache, and the (n, n) partial
products are accumulated with Kahan compensation (the accumulator is tiny, the
compensation is free). ``python -m benchmarks aggregators`` times it against one numpy pass.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from kernels.compile_options import kernel_jit

HIGHEST = jax.lax.Precision.HIGHEST
CHUNK_BYTES = 128 * 1024  # one chunk of the stack: n rows x chunk_columns(n) x 4 B
MIN_CHUNK = 512
LARGE_N_CHUNK = 8192


def chunk_columns(n: int) -> int:
    """Columns per streamed chunk of an (n, d) float32 stack.

    Up to 64 rows the Gram pass is bound by memory and cache: a chunk of about
    128 KiB (n x 32768 / n columns) stays in cache while it is centred and
    multiplied; larger chunks spill out of it. Above 64 rows the product is bound
    by arithmetic and larger chunks amortize the loop better. The sizes were chosen
    by ``python -m benchmarks aggregators --n-sweep`` (the Gram-based rules).

    Args:
      n: the number of rows of the stack.

    Returns:
      The chunk width in columns.
    """
    if n > 64:
        return LARGE_N_CHUNK
    cols = CHUNK_BYTES // (4 * max(n, 1))
    return max(MIN_CHUNK, 1 << (cols.bit_length() - 1))  # a power of two at or below


def _centred(x: jax.Array, ref: jax.Array | None) -> jax.Array:
    x = x.astype(jnp.float32)
    return x if ref is None else x - ref.astype(jnp.float32)[None]


def _small_gram(x: jax.Array, ref: jax.Array | None) -> jax.Array:
    d = _centred(x, ref)
    return jnp.dot(d, d.T, precision=HIGHEST)


@kernel_jit
def gram(x: jax.Array, ref: jax.Array | None = None) -> jax.Array:
    """G[i, j] = <x_i - ref, x_j - ref> over all trailing dimensions, float32 (n, n).

    Centre on a point close to the rows (the current global params): the
    distances derived from G then do not cancel catastrophically when the rows
    are close together.

    Args:
      x: (n, ...) stack.
      ref: optional (...) centre (default: no centring).

    Returns:
      (n, n) float32 Gram matrix.
    """
    n = x.shape[0]
    x = x.reshape(n, -1)
    if ref is not None:
        ref = ref.reshape(-1)
    d = x.shape[1]
    chunk = chunk_columns(n)
    k = d // chunk
    if k < 2:
        return _small_gram(x, ref)

    def body(i, carry):
        acc, comp = carry
        xs = jax.lax.dynamic_slice_in_dim(x, i * chunk, chunk, axis=1)
        rs = None if ref is None else jax.lax.dynamic_slice_in_dim(ref, i * chunk, chunk)
        part = _small_gram(xs, rs)
        # Kahan summation of the (n, n) partial Grams.
        y = part - comp
        t = acc + y
        return t, (t - acc) - y

    zeros = jnp.zeros((n, n), jnp.float32)
    acc, comp = jax.lax.fori_loop(0, k, body, (zeros, zeros))
    if d % chunk:
        tail = _small_gram(x[:, k * chunk :], None if ref is None else ref[k * chunk :])
        acc = acc + (tail - comp)
    return acc


def _working_centre(xs: jax.Array, weights: jax.Array) -> jax.Array:
    """sum_i w_i xs_i over a chunk in cache (rows with w_i = 0 read as 0, even NaN).

    A (1, n) x (n, chunk) product: XLA:CPU vectorizes it, where a sum over the
    short leading axis, unrolled or not, is several times slower inside the chunk loop.
    """
    xs = jnp.where((weights != 0)[:, None], xs.astype(jnp.float32), 0.0)
    return jnp.dot(weights, xs, precision=HIGHEST)


def _self_centred_gram(xs: jax.Array, weights: jax.Array) -> jax.Array:
    return _small_gram(xs, _working_centre(xs, weights))


@kernel_jit
def gram_self_centred(x: jax.Array, allowed: jax.Array) -> jax.Array:
    """Gram matrix of the rows centred on the mean of the allowed rows, in the same single pass.

    For callers that have no params to centre on. Every chunk of columns is
    centred on the mean of its allowed rows, computed while the chunk is in
    cache (no extra pass over memory, no copy of the centre). The result is the
    Gram matrix ``<x_i - c, x_j - c>`` with c the mean of the allowed rows, so
    the distances ``G_ii + G_jj - 2 G_ij`` are those of the rows.

    Why the mean: it is a centre one pass can form, and it lies within
    ``(f / m) R`` of the honest rows when f rows sit at distance R, so the
    relative cancellation error of honest distances, ~eps (f R / (m sigma))^2,
    stays small until the attackers are so far away (R / sigma ~ 1e4) that they
    are rejected at any precision. Its weakness is non-finite or huge rows: a
    NaN/Inf in an allowed row (or a row whose values overflow) spreads to every
    row through the centre and every diagonal entry comes out non-finite.
    Callers therefore check that every allowed row came out finite and, when
    not, recompute on a robust centre (the coordinate-wise median).

    Args:
      x: (n, ...) stack.
      allowed: (n,) bool or 0/1 weights: the rows whose mean is the centre.

    Returns:
      (n, n) float32 Gram matrix of the centred rows.
    """
    n = x.shape[0]
    x = x.reshape(n, -1)
    allowed = allowed.astype(jnp.float32)
    weights = allowed / jnp.maximum(jnp.sum(allowed), 1.0)
    d = x.shape[1]
    chunk = chunk_columns(n)
    k = d // chunk
    if k < 2:
        return _self_centred_gram(x, weights)

    def body(i, carry):
        acc, comp = carry
        part = _self_centred_gram(jax.lax.dynamic_slice_in_dim(x, i * chunk, chunk, axis=1), weights)
        y = part - comp
        t = acc + y
        return t, (t - acc) - y

    zeros = jnp.zeros((n, n), jnp.float32)
    acc, comp = jax.lax.fori_loop(0, k, body, (zeros, zeros))
    if d % chunk:
        acc = acc + (_self_centred_gram(x[:, k * chunk :], weights) - comp)
    return acc


@kernel_jit
def sq_dists_from_gram(g: jax.Array) -> jax.Array:
    """Pairwise squared distances ||x_i - x_j||^2 = G_ii + G_jj - 2 G_ij, clamped at 0.

    Args:
      g: (n, n) Gram matrix.

    Returns:
      (n, n) squared distances, exactly 0 on the diagonal.
    """
    diag = jnp.diagonal(g)
    d2 = diag[:, None] + diag[None, :] - 2.0 * g
    d2 = jnp.maximum(d2, 0.0)
    # The diagonal is exactly zero, whatever rounding said.
    return jnp.where(jnp.eye(g.shape[0], dtype=bool), 0.0, d2)


def pairwise_sq_dists(x: jax.Array, ref: jax.Array | None = None) -> jax.Array:
    """Pairwise squared distances between the rows of x (centred on ``ref`` for accuracy).

    Args:
      x: (n, ...) stack.
      ref: optional (...) centre close to the rows.

    Returns:
      (n, n) float32 squared distances.
    """
    return sq_dists_from_gram(gram(x, ref))
