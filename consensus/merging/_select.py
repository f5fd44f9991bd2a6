"""Exact k-th largest magnitude of every row of an (n, s) array, without sorting.

``jnp.sort`` over 1e7 entries costs hundreds of passes over memory on XLA:CPU.
The magnitudes are non-negative floats, whose IEEE bit patterns read as int32
are ordered like the values, so the k-th largest magnitude is the largest
integer T with ``count(bits >= T) >= k``, and it is always one of the row's own
bit patterns. It is found by a bracketing search on that integer, ``[lo, hi)``
with ``count(bits >= lo) >= k > count(bits >= hi)``:

* a strided sample of the row (2048 entries, sorted) puts the first
  ``PROBES`` probes at the sample's quantiles around rank k (+-4 sampling
  standard deviations);
* every later pass puts its probes around the linear interpolation of the
  count between lo and hi (at up to 3 expected interpolation errors, the error
  of a count being about the square root of the entries in the bracket), plus
  quarter points of the bracket as a bisection safeguard;
* each pass also takes the largest pattern below hi and the smallest at or
  above lo: the answer is a pattern of the row, so hi drops to just above the
  former and lo rises to the latter (a row of zeros, or a block of tied
  magnitudes, closes in one pass).

Every pass is one streaming read of the row: the counts at all probes and the
two extremes are the outputs of ONE variadic ``lax.reduce`` whose operands are
the compare masks, computed from the node and the base inside the loop, so
no (n, s) intermediate is written and the row is read once per pass (XLA:CPU
runs separate reductions, or a reduction over a probe axis, as one read of the
row per probe). The search stops for a row when ``count(bits >= lo) == k``
(then ``{|d| >= lo}`` is exactly the set of the k largest, which is all TIES
needs: ``mask_only``) or when ``hi == lo + 1`` (ties at the k-th value); the
exact k-th value is then the smallest pattern at or above lo (one more pass,
skipped with ``mask_only``). All counting is exact integer counting, so the
result is exact whatever the sample says; the sample only decides how many
passes it takes (typically 3-4).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

SAMPLE = 2048  # sampled entries per row for the first probes (XLA:CPU's sort of them is not free)
PROBES = 16  # counts per pass: one variadic reduce of 16 compare masks still streams at memory speed
MAX_PASSES = 40  # the quarter-point safeguard alone shrinks a 31-bit bracket to width 1 in 16
TOP = 0x7F800001  # above +inf: count(bits >= TOP) = 0 for finite rows
INF_BITS = 0x7F800000


def _bits(x: jax.Array, base: jax.Array, valid: jax.Array) -> jax.Array:
    """int32 bit patterns of |x - base| for (n, m) x and (m,) base; invalid rows 0, NaN clamped to +inf."""
    d = x.astype(jnp.float32) - base.astype(jnp.float32)[None]
    d = jnp.where(valid[:, None], d, 0.0)
    bits = jax.lax.bitcast_convert_type(jnp.abs(d), jnp.int32)
    return jnp.minimum(bits, jnp.int32(INF_BITS))  # NaN's pattern is above +inf's


def _pass(x, base, valid, probes, lo, hi):
    """One read of x: (n, P) counts of bits >= probes, the largest bits < hi, the smallest bits >= lo."""
    bits = _bits(x, base, valid)
    num = probes.shape[1]
    ops = [(bits >= probes[:, j : j + 1]).astype(jnp.int32) for j in range(num)]
    ops.append(jnp.where(bits < hi[:, None], bits, -1))
    ops.append(jnp.where(bits >= lo[:, None], bits, TOP))

    def combine(a, b):
        return (*(a[j] + b[j] for j in range(num)), jnp.maximum(a[num], b[num]), jnp.minimum(a[-1], b[-1]))

    init = (*(jnp.int32(0) for _ in range(num)), jnp.int32(-1), jnp.int32(TOP))
    out = jax.lax.reduce(tuple(ops), init, combine, (1,))
    return jnp.stack(out[:num], axis=1), out[num], out[-1]


def _first_probes(x: jax.Array, base: jax.Array, valid: jax.Array, k: int) -> jax.Array:
    """(n, PROBES) int32 probes: sample quantiles from rank k - 4 sd to k + 4 sd (from the top)."""
    s = x.shape[1]
    stride = max(1, s // SAMPLE)
    sample = jnp.sort(_bits(x[:, ::stride], base[::stride], valid), axis=1)  # ascending
    m = sample.shape[1]
    r = k * m / s  # rank k from the top among s ~ rank r from the top among the m sampled
    spread = 4.0 * (r * max(1.0 - r / m, 0.0)) ** 0.5 + 2.0
    ranks = [r - spread + 2.0 * spread * j / (PROBES - 1) for j in range(PROBES)]
    idx = [min(max(int(m - q), 0), m - 1) for q in ranks]  # index from the bottom (ascending)
    return jnp.stack([sample[:, i] for i in idx], axis=1)


def _next_probes(lo, hi, c_lo, c_hi, k):
    """(n, PROBES) probes inside (lo, hi): around the count's linear interpolation, plus quarter points."""
    width = (hi - lo).astype(jnp.float32)
    entries = jnp.maximum((c_lo - c_hi).astype(jnp.float32), 1.0)
    frac = (c_lo - k).astype(jnp.float32) / entries  # share of the bracket's entries below the answer
    # A count in the bracket errs by about sqrt(entries * frac * (1 - frac)) entries.
    err = (jnp.sqrt(entries * frac * (1.0 - frac)) + 1.0) / entries * width
    quarters = [0.25, 0.5, 0.75]
    num = PROBES - len(quarters)
    offsets = [frac * width + (-3.0 + 6.0 * j / (num - 1)) * err for j in range(num)]
    offsets += [q * width for q in quarters]
    # Offsets from lo in float32, added in int32: lo itself may be ~2^30, beyond float32's integers.
    steps = jnp.clip(jnp.round(jnp.stack(offsets, axis=1)), 0.0, width[:, None]).astype(jnp.int32)
    return lo[:, None] + steps


@functools.partial(jax.jit, static_argnames=("k", "mask_only"))
def kth_largest_delta_bits(
    x: jax.Array, base: jax.Array, valid: jax.Array, k: int, mask_only: bool = False
) -> tuple[jax.Array, jax.Array]:
    """The k-th largest |x_i - base| of every row, as int32 bits, exactly; and the number of passes.

    Args:
      x: (n, s) rows; base: (s,); valid: (n,) bool (invalid rows read as zeros).
      k: 1 <= k <= s, static.
      mask_only: return, per row, a pattern T with ``{bits >= T}`` = the set of entries at or above
        the k-th largest (all a top-k mask needs), without the last pass that finds the value.
    Returns:
      ((n,) int32 bit patterns, int32 number of reads of x after the sample).
    """
    n, s = x.shape
    if not 1 <= k <= s:
        raise ValueError(f"k must be in [1, {s}], got {k}")
    kk = jnp.int32(k)

    def narrow(lo, hi, c_lo, c_hi, probes):
        probes = jnp.clip(probes.astype(jnp.int32), lo[:, None], hi[:, None])
        c, below, above = _pass(x, base, valid, probes, lo, hi)
        ok = c >= kk  # the probe is at or below the answer
        new_lo = jnp.max(jnp.where(ok, probes, lo[:, None]), axis=1)
        new_hi = jnp.min(jnp.where(ok, hi[:, None], probes), axis=1)
        n_lo = jnp.max(jnp.where(ok & (probes == new_lo[:, None]), c, -1), axis=1)
        n_hi = jnp.min(jnp.where(~ok & (probes == new_hi[:, None]), c, s + 1), axis=1)
        n_lo = jnp.where(new_lo == lo, c_lo, n_lo)
        n_hi = jnp.where(new_hi == hi, c_hi, n_hi)
        # The answer is a pattern of the row: none lies in (below, hi) or in [lo, above), so the
        # bracket shrinks to [max(new_lo, above), min(new_hi, below + 1)) with the same counts.
        return jnp.maximum(new_lo, above), jnp.minimum(new_hi, below + 1), n_lo, n_hi

    def done(lo, hi, c_lo):
        return (hi - lo <= 1) | (c_lo == kk)

    lo = jnp.zeros((n,), jnp.int32)  # count(bits >= 0) = s >= k
    hi = jnp.full((n,), TOP, jnp.int32)  # count = 0 < k
    lo, hi, c_lo, c_hi = narrow(
        lo, hi, jnp.full((n,), s), jnp.zeros((n,), jnp.int32), _first_probes(x, base, valid, k)
    )

    def cond(carry):
        lo, hi, c_lo, _, it = carry
        return jnp.any(~done(lo, hi, c_lo)) & (it < MAX_PASSES)

    def body(carry):
        lo, hi, c_lo, c_hi, it = carry
        fin = done(lo, hi, c_lo)
        probes = jnp.where(fin[:, None], lo[:, None], _next_probes(lo, hi, c_lo, c_hi, kk))
        nlo, nhi, nc_lo, nc_hi = narrow(lo, hi, c_lo, c_hi, probes)
        keep = lambda a, b: jnp.where(fin, a, b)  # noqa: E731
        return keep(lo, nlo), keep(hi, nhi), keep(c_lo, nc_lo), keep(c_hi, nc_hi), it + 1

    lo, hi, c_lo, c_hi, passes = jax.lax.while_loop(cond, body, (lo, hi, c_lo, c_hi, jnp.int32(1)))
    if mask_only:
        return lo, passes
    _, _, smallest = _pass(x, base, valid, lo[:, None], lo, hi)  # smallest pattern >= lo: the k-th value
    return smallest, passes + 1


def kth_largest_magnitude(delta: jax.Array, k: int) -> jax.Array:
    """(n,) float32: the k-th largest |delta| of every row of an (n, ...) array (exact)."""
    n = delta.shape[0]
    x = delta.reshape(n, -1)
    bits, _ = kth_largest_delta_bits(x, jnp.zeros((x.shape[1],), x.dtype), jnp.ones((n,), bool), k)
    return jax.lax.bitcast_convert_type(bits, jnp.float32)
