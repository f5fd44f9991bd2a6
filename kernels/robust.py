"""Kernels of the server-guided and adaptive robust rules (FLTrust, DnC, SignGuard, Meamed, ...).

* :func:`gram_with_rows` - one streamed pass: the Gram matrix of the centred
  rows of x together with k extra rows (the server's update), so a rule gets
  every <x_i - c, x_j - c>, <x_i - c, g> and ||g||^2 without a second pass or
  a concatenated copy of the stack;
* :func:`take_columns` - a few coordinates of every row (random-subset rules);
* :func:`meamed` - the coordinate-wise mean around the median, by a sorting network.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from kernels import rows as row_kernels
from kernels import selection, stack_sort
from kernels.backend import order_impl
from kernels.compile_options import kernel_jit
from kernels.gram import HIGHEST, chunk_columns
from kernels.sorting import WINDOW_NETWORK_MAX, count, exclude, pick, sort_rows, window_sum


def _block(xs: jax.Array, rs: jax.Array | None, es: jax.Array) -> jax.Array:
    d = xs.astype(jnp.float32)
    if rs is not None:
        d = d - rs.astype(jnp.float32)[None]
    # The concatenation is of one cache-sized chunk only, never of the whole stack.
    z = jnp.concatenate([d, es.astype(jnp.float32)], axis=0)
    return jnp.dot(z, z.T, precision=HIGHEST)


@kernel_jit
def gram_with_rows(x: jax.Array, ref: jax.Array | None, extra: jax.Array) -> jax.Array:
    """Gram matrix of the rows ``[x_1 - ref, ..., x_n - ref, e_1, ..., e_k]``, float32 (n + k, n + k).

    ``extra`` (k, ...) holds rows that are already deltas (the server's update);
    they are not centred. Streamed in the same cache-sized chunks as
    :func:`kernels.gram.gram`, with Kahan-compensated accumulation.

    Args:
      x: (n, ...) stack.
      ref: optional (...) centre of the rows of x.
      extra: (k, ...) rows appended as they are.

    Returns:
      (n + k, n + k) float32 Gram matrix.
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


@kernel_jit
def take_columns(x: jax.Array, ref: jax.Array | None, index: jax.Array) -> jax.Array:
    """The flat coordinates ``index`` of every row of ``x - ref``.

    Args:
      x: (n, ...) stack.
      ref: optional (...) centre.
      index: (b,) int flat coordinate indices.

    Returns:
      (n, b) float32.
    """
    n = x.shape[0]
    cols = jnp.take(x.reshape(n, -1), index, axis=1).astype(jnp.float32)
    if ref is None:
        return cols
    return cols - jnp.take(ref.reshape(-1), index).astype(jnp.float32)[None]


def meamed(
    x: jax.Array,
    f: int,
    keep: jax.Array | None = None,
    m: int | None = None,
    mixing: jax.Array | None = None,
    centre: jax.Array | None = None,
    diagonal: bool = True,
    poison: bool = False,
    *,
    impl: str | None = None,
) -> jax.Array:
    """Mean around the median (Xie et al. 2018): per coordinate, the mean of the m - f values nearest it.

    With an even m the median is the mean of the two middle values. The m - f
    values nearest the median form a contiguous window ``s[j : j + m - f]`` of
    the sorted values, j in [0, f]; moving the window from j to j + 1 swaps
    s_j out for s_{j+m-f}, which brings the window nearer exactly when
    ``|s_{j+m-f} - med| < |s_j - med|``, a test true for a prefix of the j, so
    the window starts at j* = the number of j in [0, f) where it holds (the
    argument of Bulyan's second stage, ``kernels.sorting.closest_to_median_mean``).

    Tie rule: when the value entering is exactly as far from the median as the
    one leaving, the window stays, so the smaller value is kept: the window
    holds the first m - f values in the order (distance to the median, value).
    Comparing the windows' farther ends only (an earlier version) left several
    windows tied when attackers send one vector f times, and kept the first,
    which could hold the attackers' copies instead of nearer honest values.
    Above ``WINDOW_NETWORK_MAX`` rows: exact selection
    (:func:`kernels.selection.nearest_to_median_mean`, the same rule).
    ``poison``: any NaN/Inf in a kept row makes the result NaN at that
    coordinate (as :func:`kernels.sorting.median`), for the one-pass optimistic path.
    ``impl``: the formulation (:func:`kernels.backend.order_impl`; default: the backend's).

    Args:
      x: (n, ...) stack.
      f: the number of values dropped per coordinate (the window holds m - f).
      keep: optional (n,) bool, the rows that take part (default: all).
      m: optional static count of True entries of ``keep``.
      mixing: optional (n, n) matrix A: the rows are the view ``c + A (x - c)``.
      centre: the centre c of that view (None: c = 0).
      diagonal: whether A is diagonal (static).
      poison: make a coordinate NaN when a kept row is NaN or Inf there (see above).
      impl: one of :data:`kernels.backend.ORDER_IMPLS` (default: the backend's).

    Returns:
      (...) float32, NaN where m <= f.

    Raises:
      ValueError: for ``poison`` with exact selection (above ``WINDOW_NETWORK_MAX`` rows with
        ``"network"``), or an unknown ``impl``.

    References:
      Xie, Koyejo and Gupta, "Generalized Byzantine-tolerant SGD", 2018.
    """
    chosen = order_impl(impl)
    if chosen == "sort" or (chosen == "hybrid" and x.shape[0] > WINDOW_NETWORK_MAX):
        return stack_sort.nearest_to_median_mean(x, f, keep, m, mixing, centre, diagonal, poison)
    if x.shape[0] > WINDOW_NETWORK_MAX:
        if poison:
            raise ValueError(f"meamed: poison is for the sorting network (at most {WINDOW_NETWORK_MAX} rows)")
        return selection.nearest_to_median_mean(x, f, keep, m, mixing, centre, diagonal)
    return _network_meamed(x, f, keep, m, mixing, centre, diagonal, poison)


@kernel_jit(static_argnames=("f", "m", "diagonal", "poison"))
def _network_meamed(x, f, keep, m, mixing, centre, diagonal, poison) -> jax.Array:
    m = count(keep, x.shape[0], m)
    s = sort_rows(exclude(x, keep, mixing, centre, diagonal, poison))
    med = 0.5 * (pick(s, (m - 1) // 2) + pick(s, m // 2))
    width = m - f
    start = jnp.zeros(s[0].shape, jnp.int32)
    for j in range(f):
        entering = pick(s, j + width)
        start = start + (jnp.abs(entering - med) < jnp.abs(s[j] - med)).astype(jnp.int32)
    # Rows past m are +inf (excluded); the window never reaches them (j + width <= m - 1).
    if isinstance(width, int) and width >= f:
        # With a static count the window [start, start + width) always holds s_f .. s_{width-1}
        # and, for each j < f, either s_j (j >= start) or s_{j + width}. Written so, XLA:CPU
        # fuses the network into one loop; the generic masked sum over every row made it copy
        # the 16 rows out first, several times the cost of the fused loop.
        total = sum(s[f:width], jnp.zeros_like(s[0]))
        for j in range(f):
            total = total + jnp.where(j >= start, s[j], 0.0) + jnp.where(j < start, s[j + width], 0.0)
    else:
        total = window_sum(s, start, width)
    if isinstance(width, int):
        return total / float(width) if width > 0 else jnp.full_like(total, jnp.nan)
    return jnp.where(width > 0, total / jnp.maximum(width, 1).astype(jnp.float32), jnp.nan)


# y_b = sum_j M[b, j] x_j for a (B, n) M: B new rows from n (bucket means), streamed in chunks.
mix_rows = row_kernels.mix
