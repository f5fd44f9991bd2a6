"""Exact k-th largest magnitude of every row of an (n, s) array, without sorting.

``jnp.sort`` over 1e7 entries costs tens of passes over memory on XLA:CPU. The
magnitudes are non-negative floats, whose IEEE bit patterns read as int32 are
ordered like the values, so the k-th largest magnitude is the largest integer
T with ``count(bits >= T) >= k``. It is found by a bracketing search on that
integer: a strided sample of the row (sorted; a few thousand entries) gives a
first bracket around the sample's quantile, then every counting pass (one read
of the row, three thresholds) narrows the bracket ``[lo, hi)`` (count at lo >=
k, count at hi < k) by interpolation with a bisection safeguard, until
``hi == lo + 1``: then ``lo`` is exactly the k-th largest value. Each count
streams the row in cache-sized chunks and counts the compare masks with a
matrix-vector product; the bit patterns are formed inside the chunk from the
node and the base, so no (n, s) intermediate is ever written. Every pass is
exact integer counting, so the result is exact whatever the sample says; the
sample only decides how many passes it takes (typically 2-4).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

SAMPLE = 4096  # sampled entries per row for the first bracket
MAX_PASSES = 64  # bisection alone needs at most 32 (31-bit range); a hard stop for safety
TOP = 0x7F800001  # above +inf: count(bits >= TOP) = 0 for finite rows
INF_BITS = 0x7F800000
# Columns per counting chunk: the chunk's compare masks stay in cache and are counted by a
# matrix-vector product (XLA:CPU's row reductions cost ~6-10 passes over memory; the chunked
# product costs about one). Counts per chunk <= CHUNK are exact in float32.
CHUNK = 8192


def _bits(x: jax.Array, base: jax.Array, valid: jax.Array) -> jax.Array:
    """int32 bit patterns of |x - base| for (n, m) x and (m,) base; invalid rows 0, NaN clamped to +inf."""
    d = x.astype(jnp.float32) - base.astype(jnp.float32)[None]
    d = jnp.where(valid[:, None], d, 0.0)
    bits = jax.lax.bitcast_convert_type(jnp.abs(d), jnp.int32)
    return jnp.minimum(bits, jnp.int32(INF_BITS))  # NaN's pattern is above +inf's


def _count_block(x, base, valid, probes):
    bits = _bits(x, base, valid)  # (n, m)
    masks = (bits[:, None, :] >= probes[:, :, None]).astype(jnp.float32)  # (n, P, m)
    ones = jnp.ones((bits.shape[1],), jnp.float32)
    return jnp.dot(masks, ones).astype(jnp.int32)


def _counts(x: jax.Array, base: jax.Array, valid: jax.Array, probes: jax.Array) -> jax.Array:
    """(n, P) int32: count(|x_i - base| bits >= probes[i, j]) for every row and probe, one read of x."""
    s = x.shape[1]
    k = s // CHUNK
    acc = jnp.zeros(probes.shape, jnp.int32)
    if k:

        def body(i, acc):
            xs = jax.lax.dynamic_slice_in_dim(x, i * CHUNK, CHUNK, axis=1)
            bs = jax.lax.dynamic_slice_in_dim(base, i * CHUNK, CHUNK)
            return acc + _count_block(xs, bs, valid, probes)

        acc = jax.lax.fori_loop(0, k, body, acc)
    if s % CHUNK:
        acc = acc + _count_block(x[:, k * CHUNK :], base[k * CHUNK :], valid, probes)
    return acc


def _first_probes(x: jax.Array, base: jax.Array, valid: jax.Array, k: int) -> jax.Array:
    """Sample quantiles around rank k (and a margin either side) as int32 probes, (n, 3)."""
    s = x.shape[1]
    stride = max(1, s // SAMPLE)
    sample = jnp.sort(_bits(x[:, ::stride], base[::stride], valid), axis=1)  # ascending
    m = sample.shape[1]
    # rank k from the top among s entries ~ rank k * m / s from the top among m.
    r = k * m / s
    spread = 4.0 * (r * (1.0 - r / m)) ** 0.5 + 2.0
    ranks = [r - spread, r, r + spread]
    idx = [min(max(int(m - q), 0), m - 1) for q in ranks]  # index from the bottom (ascending)
    return jnp.stack([sample[:, i] for i in idx], axis=1)


@functools.partial(jax.jit, static_argnames=("k",))
def kth_largest_delta_bits(
    x: jax.Array, base: jax.Array, valid: jax.Array, k: int
) -> tuple[jax.Array, jax.Array]:
    """The k-th largest |x_i - base| of every row, as int32 bits, exactly; and the number of passes.

    Args:
      x: (n, s) rows; base: (s,); valid: (n,) bool (invalid rows read as zeros).
      k: 1 <= k <= s, static.
    Returns:
      ((n,) int32 bit patterns, int32 number of counting passes after the first).
    """
    n, s = x.shape
    if not 1 <= k <= s:
        raise ValueError(f"k must be in [1, {s}], got {k}")
    kk = jnp.int32(k)
    lo = jnp.zeros((n,), jnp.int32)  # count(bits >= 0) = s >= k
    hi = jnp.full((n,), TOP, jnp.int32)  # count = 0 < k

    def narrow(lo, hi, probes):
        probes = jnp.clip(probes, lo[:, None], hi[:, None])
        c = _counts(x, base, valid, probes)
        ok = c >= kk  # probe is <= the answer
        new_lo = jnp.maximum(lo, jnp.max(jnp.where(ok, probes, lo[:, None]), axis=1))
        new_hi = jnp.minimum(hi, jnp.min(jnp.where(ok, hi[:, None], probes), axis=1))
        lo_count = jnp.max(jnp.where(ok & (probes == new_lo[:, None]), c, -1), axis=1)
        hi_count = jnp.min(jnp.where(~ok & (probes == new_hi[:, None]), c, s + 1), axis=1)
        return new_lo, new_hi, lo_count, hi_count

    lo, hi, c_lo, c_hi = narrow(lo, hi, _first_probes(x, base, valid, k))
    c_lo = jnp.where(c_lo < 0, s, c_lo)  # lo == 0 still: every entry counts
    c_hi = jnp.where(c_hi > s, 0, c_hi)  # hi == TOP still

    def cond(carry):
        lo, hi, _, _, it = carry
        return jnp.any(hi - lo > 1) & (it < MAX_PASSES)

    def body(carry):
        lo, hi, c_lo, c_hi, it = carry
        width = (hi - lo).astype(jnp.float32)
        # Interpolate the count linearly between (lo, c_lo) and (hi, c_hi) to hit k.
        frac = (c_lo - kk).astype(jnp.float32) / jnp.maximum((c_lo - c_hi).astype(jnp.float32), 1.0)
        guess = lo + jnp.floor(frac * width).astype(jnp.int32)
        # The interpolation errs by about sqrt(gap) entries (sampling noise of the counts): probe at
        # 1 and 3 such errors either side of the guess, plus the midpoint as the bisection safeguard.
        gap = jnp.maximum((c_lo - c_hi).astype(jnp.float32), 1.0)
        err = width * jnp.minimum(jnp.sqrt(gap) / gap, 0.25)
        offsets = [-3.0, -1.0, 0.0, 1.0, 3.0]
        mid = lo + ((hi - lo) // 2)
        probes = jnp.stack(
            [guess + jnp.ceil(o * err).astype(jnp.int32) + int(o > 0) for o in offsets] + [mid], axis=1
        )
        nlo, nhi, nc_lo, nc_hi = narrow(lo, hi, probes)
        nc_lo = jnp.where(nlo == lo, c_lo, nc_lo)
        nc_hi = jnp.where(nhi == hi, c_hi, nc_hi)
        return nlo, nhi, nc_lo, nc_hi, it + 1

    lo, hi, *_, passes = jax.lax.while_loop(cond, body, (lo, hi, c_lo, c_hi, jnp.int32(0)))
    return lo, passes


def kth_largest_magnitude(delta: jax.Array, k: int) -> jax.Array:
    """(n,) float32: the k-th largest |delta| of every row of an (n, ...) array (exact)."""
    n = delta.shape[0]
    x = delta.reshape(n, -1)
    bits, _ = kth_largest_delta_bits(x, jnp.zeros((x.shape[1],), x.dtype), jnp.ones((n,), bool), k)
    return jax.lax.bitcast_convert_type(bits, jnp.float32)
