"""Exact k-th largest magnitude of every row of an (n, s) array, without sorting.

``jnp.sort`` over 1e7 entries costs tens of passes over memory on XLA:CPU. The
magnitudes are non-negative floats, whose IEEE bit patterns read as int32 are
ordered like the values, so the k-th largest magnitude is the largest integer
T with ``count(bits >= T) >= k``. It is found by a bracketing search on that
integer: a strided sample of the row (sorted; a few thousand entries) gives a
first bracket around the sample's quantile, then every counting pass (one read
of the row, three thresholds) narrows the bracket ``[lo, hi)`` (count at lo >=
k, count at hi < k) by interpolation with a bisection safeguard, until
``hi == lo + 1``: then ``lo`` is exactly the k-th largest value. Every pass is
exact integer counting, so the result is exact whatever the sample says; the
sample only decides how many passes it takes (typically 2-4).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

SAMPLE = 4096  # sampled entries per row for the first bracket
PROBES = 3
MAX_PASSES = 64  # bisection alone needs at most 32 (31-bit range); a hard stop for safety
# above +inf: count(bits >= TOP) = 0 for finite rows. A Python int, not a jax array: an array
# here would start jax's backends at import, before the CLI sets the device count or starts
# jax.distributed.
TOP = 0x7F800001


def _counts(bits: jax.Array, probes: jax.Array) -> jax.Array:
    """(n, P) int32: count(bits[i] >= probes[i, j]) for every row and probe, one read of bits."""
    return jnp.stack(
        [jnp.sum(bits >= probes[:, j : j + 1], axis=1, dtype=jnp.int32) for j in range(probes.shape[1])],
        axis=1,
    )


def _first_probes(bits: jax.Array, k: int) -> jax.Array:
    """Sample quantiles around rank k (and a wide margin either side) as int32 probes, (n, 3)."""
    n, s = bits.shape
    stride = max(1, s // SAMPLE)
    sample = jnp.sort(bits[:, ::stride], axis=1)  # ascending
    m = sample.shape[1]
    # rank k from the top among s entries ~ rank k * m / s from the top among m.
    r = k * m / s
    spread = 4.0 * (r * (1.0 - r / m)) ** 0.5 + 2.0
    ranks = [r - spread, r, r + spread]
    idx = [min(max(int(m - q), 0), m - 1) for q in ranks]  # index from the bottom (ascending)
    return jnp.stack([sample[:, i] for i in idx], axis=1)


@functools.partial(jax.jit, static_argnames=("k",))
def kth_largest_bits(bits: jax.Array, k: int) -> jax.Array:
    """(n,) int32: the k-th largest of every row of ``bits`` (non-negative int32), exactly.

    Args:
      bits: (n, s) int32, each entry >= 0 and < 0x7F800001 (finite non-negative float32 bit patterns).
      k: 1 <= k <= s, static.
    """
    n, s = bits.shape
    if not 1 <= k <= s:
        raise ValueError(f"k must be in [1, {s}], got {k}")
    kk = jnp.int32(k)
    lo = jnp.zeros((n,), jnp.int32)  # count(bits >= 0) = s >= k
    hi = jnp.full((n,), TOP, jnp.int32)  # count = 0 < k

    def narrow(lo, hi, probes):
        probes = jnp.clip(probes, lo[:, None], hi[:, None])
        c = _counts(bits, probes)
        ok = c >= kk  # probe is <= the answer
        new_lo = jnp.maximum(lo, jnp.max(jnp.where(ok, probes, lo[:, None]), axis=1))
        new_hi = jnp.minimum(hi, jnp.min(jnp.where(ok, hi[:, None], probes), axis=1))
        lo_count = jnp.max(jnp.where(ok & (probes == new_lo[:, None]), c, -1), axis=1)
        hi_count = jnp.min(jnp.where(~ok & (probes == new_hi[:, None]), c, s + 1), axis=1)
        return new_lo, new_hi, lo_count, hi_count

    lo, hi, c_lo, c_hi = narrow(lo, hi, _first_probes(bits, k))
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
        step = jnp.maximum((width / 64.0).astype(jnp.int32), 1)
        mid = lo + ((hi - lo) // 2)
        probes = jnp.stack([guess - step, guess + step, mid], axis=1)
        nlo, nhi, nc_lo, nc_hi = narrow(lo, hi, probes)
        nc_lo = jnp.where(nlo == lo, c_lo, nc_lo)
        nc_hi = jnp.where(nhi == hi, c_hi, nc_hi)
        return nlo, nhi, nc_lo, nc_hi, it + 1

    lo, hi, *_ = jax.lax.while_loop(cond, body, (lo, hi, c_lo, c_hi, jnp.int32(0)))
    return lo


def magnitude_bits(delta: jax.Array) -> jax.Array:
    """int32 bit patterns of ``|delta|`` (float32), ordered like the magnitudes."""
    return jax.lax.bitcast_convert_type(jnp.abs(delta.astype(jnp.float32)), jnp.int32)


def kth_largest_magnitude(delta: jax.Array, k: int) -> jax.Array:
    """(n,) float32: the k-th largest |delta| of every row of an (n, ...) array (exact)."""
    n = delta.shape[0]
    bits = magnitude_bits(delta).reshape(n, -1)
    return jax.lax.bitcast_convert_type(kth_largest_bits(bits, k), jnp.float32)
