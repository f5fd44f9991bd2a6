"""Kernels of the server-guided and adaptive robust rules (FLTrust, DnC, SignGuard, Meamed, ...).

* :func:`gram_with_rows` - one streamed pass: the Gram matrix of the centred
  rows of x together with k extra rows (the server's update), so a rule gets
  every <x_i - c, x_j - c>, <x_i - c, g> and ||g||^2 without a second pass or
  a concatenated copy of the stack;
* :func:`take_columns` - a few coordinates of every row (random-subset rules);
* :func:`meamed` - the coordinate-wise mean around the median, by a sorting network.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from kernels import rows as row_kernels
from kernels.gram import HIGHEST, chunk_columns
from kernels.sorting import count, exclude, pick, sort_rows, window_sum


def _block(xs: jax.Array, rs: jax.Array | None, es: jax.Array) -> jax.Array:
    d = xs.astype(jnp.float32)
    if rs is not None:
        d = d - rs.astype(jnp.float32)[None]
    # The concatenation is of one cache-sized chunk only, never of the whole stack.
    z = jnp.concatenate([d, es.astype(jnp.float32)], axis=0)
    return jnp.dot(z, z.T, precision=HIGHEST)


@jax.jit
def gram_with_rows(x: jax.Array, ref: jax.Array | None, extra: jax.Array) -> jax.Array:
    """Gram matrix of the rows ``[x_1 - ref, ..., x_n - ref, e_1, ..., e_k]``, float32 (n + k, n + k).

    ``extra`` (k, ...) holds rows that are already deltas (the server's update);
    they are not centred. Streamed in the same cache-sized chunks as
    :func:`kernels.gram.gram`, with Kahan-compensated accumulation.
    """
    n, k = x.shape[0], extra.shape[0]
    x = x.reshape(n, -1)
    e = extra.reshape(k, -1)
    r = None if ref is None else ref.reshape(-1)
    d = x.shape[1]
    chunk = chunk_columns(n + k)
    chunks = d // chunk
    if chunks < 2:
        return _block(x, r, e)

    def body(i, carry):
        acc, comp = carry
        xs = jax.lax.dynamic_slice_in_dim(x, i * chunk, chunk, axis=1)
        es = jax.lax.dynamic_slice_in_dim(e, i * chunk, chunk, axis=1)
        rs = None if r is None else jax.lax.dynamic_slice_in_dim(r, i * chunk, chunk)
        y = _block(xs, rs, es) - comp
        t = acc + y
        return t, (t - acc) - y

    zeros = jnp.zeros((n + k, n + k), jnp.float32)
    acc, comp = jax.lax.fori_loop(0, chunks, body, (zeros, zeros))
    if d % chunk:
        s = chunks * chunk
        acc = acc + (_block(x[:, s:], None if r is None else r[s:], e[:, s:]) - comp)
    return acc


@jax.jit
def take_columns(x: jax.Array, ref: jax.Array | None, index: jax.Array) -> jax.Array:
    """(n, b) float32: the flat coordinates ``index`` of every row of ``x - ref``."""
    n = x.shape[0]
    cols = jnp.take(x.reshape(n, -1), index, axis=1).astype(jnp.float32)
    if ref is None:
        return cols
    return cols - jnp.take(ref.reshape(-1), index).astype(jnp.float32)[None]


@functools.partial(jax.jit, static_argnames=("f", "m", "diagonal"))
def meamed(
    x: jax.Array,
    f: int,
    keep: jax.Array | None = None,
    m: int | None = None,
    mixing: jax.Array | None = None,
    centre: jax.Array | None = None,
    diagonal: bool = True,
) -> jax.Array:
    """Mean around the median: per coordinate, the mean of the m - f kept values nearest their median.

    The m - f values nearest the median form a contiguous window of the sorted
    values; of the f + 1 candidate windows the one whose farther end is nearest
    the median wins (the first on ties). With an even m the median is the
    mean of the two middle values.
    """
    m = count(keep, x.shape[0], m)
    s = sort_rows(exclude(x, keep, mixing, centre, diagonal))
    med = 0.5 * (pick(s, (m - 1) // 2) + pick(s, m // 2))
    width = m - f
    best_cost = best_sum = None
    for start in range(f + 1):
        lo = pick(s, start)
        hi = pick(s, start + width - 1)
        cost = jnp.maximum(med - lo, hi - med)
        total = window_sum(s, start, width)
        if best_cost is None:
            best_cost, best_sum = cost, total
        else:
            better = cost < best_cost
            best_cost = jnp.where(better, cost, best_cost)
            best_sum = jnp.where(better, total, best_sum)
    if isinstance(width, int):
        return best_sum / float(width) if width > 0 else jnp.full_like(best_sum, jnp.nan)
    return jnp.where(width > 0, best_sum / jnp.maximum(width, 1).astype(jnp.float32), jnp.nan)


# y_b = sum_j M[b, j] x_j for a (B, n) M: B new rows from n (bucket means), streamed in chunks.
mix_rows = row_kernels.mix
