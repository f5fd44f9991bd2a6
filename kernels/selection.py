"""Exact coordinate-wise order statistics of a tall stack by bitwise selection.

Above ``kernels.sorting.NETWORK_MAX`` rows (128; 64 where a position is traced
or the rows are a dense view, 16 for the window rules) a sorting network no
longer compiles to one fused loop, and XLA:CPU's ``jnp.sort`` over the node axis
costs hundreds of passes over memory. Here every order statistic is *selected*, never
sorted. A float32 is mapped to a monotone int32 key (its bits, with the
magnitude bits flipped for negatives), so the k-th smallest value (0-based) is
the largest key t with ``count(key < t) <= k``; 32 bisection steps, one per bit
from the top, find it exactly. Each step is one compare-and-count over the n
rows, so the cost is ~32 n operations per coordinate, independent of how the
values are spread, and the answer is the exact order statistic (ties and all).

The columns are processed in blocks of ``block_columns(n)`` inside a
``fori_loop``: a block of n x B float32 stays in cache through all the
bisection steps and the final sums, so the stack is read from memory once and
the only temporaries are block-sized (no copy of the stack; the output is d).

Semantics match :mod:`kernels.sorting` at every n: excluded rows are +inf (they
sort last and only the first m positions are used; m may be traced), a NaN in
any kept row makes that coordinate NaN (as it propagates through a network), and
with ``poison`` a kept +-Inf does too. Keys order -0.0 before +0.0; both are
the same number, so the results are the same values a sort gives.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from kernels.columns import column_parallel
from kernels.compile_options import kernel_jit

HIGHEST = jax.lax.Precision.HIGHEST
INT_MIN = -(2**31)
SIGN_FLIP = 0x7FFFFFFF
INF_KEY = 0x7F800000  # the key (and bits) of +inf
# Row counts are summed by halving over contiguous row slices down to this many rows, then
# unrolled, which XLA:CPU vectorizes better than a reduce over the node axis.
FOLD_ROWS = 16
COUNT_GROUP = 128  # rows whose count fits a uint8 (see count_rows)


def block_columns(n: int) -> int:
    """Columns per block: n x B float32 within ~256 KiB (L2), B in [64, 512].

    A block that stays in L2 through the 32 bisection passes is read from memory once; the
    64-column minimum keeps the vector loops long at n = 1024. Chosen through the median rule
    by ``python -m benchmarks aggregators --n-sweep``.

    Args:
      n: the number of rows.

    Returns:
      The block width B.
    """
    b = 512
    while b > 64 and n * b > 65536:
        b //= 2
    return b


def float_keys(v: jax.Array) -> jax.Array:
    """Map float32 values to int32 keys ordered like the values (NaN must be replaced before).

    Args:
      v: float32 array without NaN.

    Returns:
      int32 keys of v's shape.
    """
    bits = jax.lax.bitcast_convert_type(v, jnp.int32)
    return jnp.where(bits < 0, bits ^ jnp.int32(SIGN_FLIP), bits)


def key_values(k: jax.Array) -> jax.Array:
    """Map int32 keys back to their float32 values: the inverse of :func:`float_keys`.

    Args:
      k: int32 keys.

    Returns:
      float32 values of k's shape.
    """
    return jax.lax.bitcast_convert_type(jnp.where(k < 0, k ^ jnp.int32(SIGN_FLIP), k), jnp.float32)


def fold_rows(v: jax.Array, op=jnp.add) -> jax.Array:
    """Reduce (n, ...) -> (...) with ``op`` by halving over contiguous row slices, then pairwise over rows.

    Every step is elementwise, so XLA fuses it into one vectorized loop over the
    columns; a reduce over the leading axis compiles to a scalar loop per column.

    Args:
      v: (n, ...) array.
      op: an associative elementwise binary op (default: addition).

    Returns:
      (...) reduction of the n rows.
    """
    while v.shape[0] > FOLD_ROWS:
        h = v.shape[0] // 2
        top = op(v[:h], v[h : 2 * h])
        v = top if v.shape[0] % 2 == 0 else jnp.concatenate([top, v[2 * h :]])
    terms = [v[j] for j in range(v.shape[0])]
    while len(terms) > 1:
        nxt = [op(terms[i], terms[i + 1]) for i in range(0, len(terms) - 1, 2)]
        terms = nxt + ([terms[-1]] if len(terms) % 2 else [])
    return terms[0]


def count_rows(mask: jax.Array) -> jax.Array:
    """(n, ...) bool -> (...) int32 number of True rows.

    Counting is the inner loop of every bisection step, so the counts accumulate
    in uint8 over groups of ``COUNT_GROUP`` rows (at most 128 < 256: no wrap) and
    only the per-group totals are widened: 32 lanes per AVX2 add instead of 8.
    This makes a whole median several times faster than int32 accumulation.

    Args:
      mask: (n, ...) bool.

    Returns:
      (...) int32 counts.
    """
    n = mask.shape[0]
    parts = [
        fold_rows(mask[i : i + COUNT_GROUP].astype(jnp.uint8)).astype(jnp.int32)
        for i in range(0, n, COUNT_GROUP)
    ]
    return parts[0] if len(parts) == 1 else fold_rows(jnp.stack(parts))


def sum_rows(v: jax.Array) -> jax.Array:
    """(n, B) float32 -> (B,) sum over the rows, as a product with a ones vector.

    Outside the bisection loop a single reduction over a block's rows is cheapest as a
    matrix-vector product, ahead of :func:`fold_rows` and ``jnp.sum(axis=0)``. (Inside the loop
    the uint8 :func:`count_rows` wins by far.) Compared by ``python -m benchmarks aggregators
    --n-sweep`` on Bulyan's second stage.

    Args:
      v: (n, B) array.

    Returns:
      (B,) float32 sums.
    """
    ones = jnp.ones((v.shape[0],), jnp.float32)
    return jnp.dot(ones, v.astype(jnp.float32), precision=HIGHEST)


def tally_rows(mask: jax.Array) -> jax.Array:
    """(n, B) bool -> (B,) int32 number of True rows, by :func:`sum_rows` (exact below 2^24 rows).

    Args:
      mask: (n, B) bool.

    Returns:
      (B,) int32 counts.
    """
    return sum_rows(mask.astype(jnp.float32)).astype(jnp.int32)


def select_keys(keys: jax.Array, ranks: jax.Array) -> jax.Array:
    """Exact k-th smallest key (0-based) per column, for every rank in ``ranks``.

    Args:
      keys: (n, B) int32.
      ranks: (q, B) int32 ranks, one per query and column (a rank >= n gives the largest key).

    Returns:
      (q, B) int32: for each query, the largest key t with ``count(keys < t) <= rank``.
    """

    def step(i, prefix):
        # Adding 2^(31-i) in wrapping int32 arithmetic sets bit (31 - i) of the offset key.
        probe = prefix + jnp.left_shift(jnp.int32(1), 31 - i)
        below = count_rows(keys[:, None, :] < probe[None])
        return jnp.where(below <= ranks, probe, prefix)

    found = jax.lax.fori_loop(0, 32, step, jnp.full(ranks.shape, INT_MIN, jnp.int32))
    # A rank past every row would run past +inf into NaN patterns: cap at +inf.
    return jnp.minimum(found, INF_KEY)


def _next_key_above(keys: jax.Array, k: jax.Array) -> jax.Array:
    """Smallest key strictly above k per column (INT_MAX-ish if none; callers never use it then)."""
    above = jnp.where(keys > k[None], keys, jnp.iinfo(jnp.int32).max)
    return fold_rows(above, jnp.minimum)


class Block:
    """One column block after the view, exclusions and NaN handling, ready to select on.

    Args:
      y: (n, B) float32 rows of the block (the view already applied).
      keep: optional (n,) bool; excluded rows become +inf.
      poison: turn +-Inf in kept rows into NaN (a NaN in a kept row poisons the column).
      count: the counting function used at the selected keys (default :func:`count_rows`).

    Attributes:
      bad: (B,) bool, the columns a NaN poisons.
      values: (n, B) float32 with NaN replaced by +inf.
      keys: (n, B) int32 keys of ``values``.
    """

    def __init__(self, y: jax.Array, keep: jax.Array | None, poison: bool, count=count_rows):
        # ``count`` for the counts at the selected keys: the uint8 fold is faster for the median
        # and the trimmed mean, the product with ones for the window rules. This is an empirical
        # choice (``python -m benchmarks aggregators --n-sweep``), not a derived one: XLA fuses
        # the two differently per consumer.
        self.count = count
        if poison:
            y = jnp.where(jnp.isinf(y), jnp.nan, y)
        if keep is not None:
            y = jnp.where(keep[:, None], y, jnp.inf)
        isnan = jnp.isnan(y)
        self.bad = tally_rows(isnan) > 0  # NaN in a kept row poisons the coordinate
        self.values = jnp.where(isnan, jnp.inf, y)
        self.keys = float_keys(self.values)

    def finish(self, out: jax.Array) -> jax.Array:
        """NaN in the poisoned columns of a (B,) result, the result elsewhere.

        Args:
          out: (B,) result of a rule on this block.

        Returns:
          (B,) result.
        """
        return jnp.where(self.bad, jnp.nan, out)

    def select(self, ranks) -> jax.Array:
        """(q, B) keys of the given ranks (q static; ranks static ints or traced scalars/arrays).

        Args:
          ranks: a sequence of q 0-based ranks, each an int, a traced scalar or a (B,) array.

        Returns:
          (q, B) int32 keys.
        """
        b = self.keys.shape[1]
        r = jnp.stack([jnp.broadcast_to(jnp.asarray(k, jnp.int32), (b,)) for k in ranks])
        return select_keys(self.keys, r)

    def count_below(self, k: jax.Array) -> jax.Array:
        """Per column, the number of keys strictly below ``k``.

        Args:
          k: (B,) int32 keys.

        Returns:
          (B,) int32 counts.
        """
        return self.count(self.keys < k[None])

    def count_at_most(self, k: jax.Array) -> jax.Array:
        """Per column, the number of keys at or below ``k``.

        Args:
          k: (B,) int32 keys.

        Returns:
          (B,) int32 counts.
        """
        return self.count(self.keys <= k[None])

    def median_values(self, m) -> tuple[jax.Array, jax.Array]:
        """Order statistics (m - 1) // 2 and m // 2 (the same when m is odd), one selection.

        Args:
          m: the kept count (int or traced scalar).

        Returns:
          ((B,) lower middle, (B,) upper middle) float32 values.
        """
        lo_rank, hi_rank = (m - 1) // 2, m // 2
        lo = self.select([lo_rank])[0]
        if isinstance(m, int) and m % 2 == 1:
            # One middle value: the count and the fold below would only find lo again.
            return key_values(lo), key_values(lo)
        # The upper middle is lo again when lo's ties reach past it, else the next key above.
        hi = jnp.where(self.count_at_most(lo) > hi_rank, lo, _next_key_above(self.keys, lo))
        return key_values(lo), key_values(hi)

    def window_sum(self, start, stop) -> jax.Array:
        """Sum of the order statistics at positions [start, stop] (inclusive; start <= stop), exactly.

        Values strictly between the two end values are summed; the end values
        count as often as their ties fall inside the window.

        Args:
          start: the first position (int, traced scalar or (B,) array).
          stop: the last position, inclusive.

        Returns:
          (B,) float32 sums.
        """
        ka, kb = (self.select([start, stop])[i] for i in range(2))
        a, b = key_values(ka), key_values(kb)
        inside = (self.keys > ka[None]) & (self.keys < kb[None])
        middle = sum_rows(jnp.where(inside, self.values, 0.0))
        n_a = (self.count_at_most(ka) - start).astype(jnp.float32)
        n_b = (stop + 1 - self.count_below(kb)).astype(jnp.float32)
        same = a * jnp.asarray(stop - start + 1).astype(jnp.float32)
        return jnp.where(ka == kb, same, middle + n_a * a + n_b * b)


def _view_block(xb: jax.Array, cb: jax.Array | None, mixing: jax.Array | None, diagonal: bool) -> jax.Array:
    """Rows ``c + A (x - c)`` of one (n, B) block in float32 (see kernels.rows.view_rows).

    A diagonal A is exact per term (zero weights read NaN rows as 0). A dense A
    is a matrix product over the block (n terms per entry, unrolled terms would
    be n^2); a non-finite x_j that a row uses with a non-zero weight makes that
    row's entry NaN there (its exact value would be non-finite anyway).
    """
    x = xb.astype(jnp.float32)
    if mixing is None:
        return x
    mixing = mixing.astype(jnp.float32)
    d = x if cb is None else x - cb[None]
    if diagonal:
        scale = jnp.diagonal(mixing)[:, None]
        y = jnp.where(scale != 0, scale * d, 0.0)
    else:
        finite = jnp.isfinite(d)
        y = jnp.dot(mixing, jnp.where(finite, d, 0.0), precision=HIGHEST)
        hits = jnp.dot((mixing != 0).astype(jnp.float32), (~finite).astype(jnp.float32), precision=HIGHEST)
        y = jnp.where(hits > 0, jnp.nan, y)
    return y if cb is None else y + cb[None]


def blockwise(
    fn,
    x: jax.Array,
    centre: jax.Array | None,
    mixing,
    diagonal: bool,
    start: jax.Array | int | None = None,
    width: int | None = None,
) -> jax.Array:
    """Apply ``fn(block_rows) -> (B,)`` to every column block of x (n, ...); returns x.shape[1:] float32.

    With ``start`` (traced) and ``width`` (static), only the columns [start, start + width) of
    ``x.reshape(n, -1)`` are computed, read in place, and the flat (width,) result is returned
    (:mod:`kernels.columns` runs such ranges on separate cores).

    Args:
      fn: maps the (n, B) float32 rows of a block to its (B,) results.
      x: (n, ...) stack.
      centre: optional (...) centre c of the view ``c + A (x - c)``.
      mixing: optional (n, n) matrix A of the view.
      diagonal: whether A is diagonal (static).
      start: optional traced first column of a range.
      width: the static width of that range (needed with ``start``).

    Returns:
      x.shape[1:] float32, or the flat (width,) results of the range.
    """
    n = x.shape[0]
    shape = x.shape[1:]
    x2 = x.reshape(n, -1)
    c = None if centre is None else centre.reshape(-1)
    if start is None:
        start, d = 0, x2.shape[1]
    else:
        assert width is not None, "a traced start needs a static width"
        d = int(width)
    b = block_columns(n)

    def run(col, cols):
        xb = jax.lax.dynamic_slice_in_dim(x2, col, cols, axis=1)
        cb = None if c is None else jax.lax.dynamic_slice_in_dim(c, col, cols)
        return fn(_view_block(xb, cb, mixing, diagonal))

    if d < b:
        out = run(start, d) if d < x2.shape[1] else fn(_view_block(x2, c, mixing, diagonal))
    else:

        def body(i, out):
            # The last block ends at column d (overlapping its predecessor when b does not divide
            # d): one traced block body instead of a second, separately compiled, tail.
            offset = jnp.minimum(i * b, d - b)
            return jax.lax.dynamic_update_slice_in_dim(out, run(start + offset, b), offset, axis=0)

        out = jax.lax.fori_loop(0, -(-d // b), body, jnp.zeros((d,), jnp.float32))
    return out.reshape(shape) if width is None else out


def _kept_count(keep: jax.Array | None, n: int, m: int | None):
    if m is not None:
        return int(m)
    return n if keep is None else jnp.sum(keep.astype(jnp.int32))


def _divide(total: jax.Array, denom) -> jax.Array:
    if isinstance(denom, int):
        return total / float(denom) if denom > 0 else jnp.full_like(total, jnp.nan)
    return jnp.where(denom > 0, total / jnp.maximum(denom, 1).astype(jnp.float32), jnp.nan)


@kernel_jit(static_argnames=("m", "diagonal", "poison", "width"))
def _median(
    x: jax.Array,
    keep: jax.Array | None = None,
    m: int | None = None,
    mixing: jax.Array | None = None,
    centre: jax.Array | None = None,
    diagonal: bool = True,
    poison: bool = False,
    start: jax.Array | None = None,
    width: int | None = None,
) -> jax.Array:
    """Coordinate-wise median over the kept rows (mean of the two middle values when m is even).

    Same contract as :func:`kernels.sorting.median`, for any n.

    Args:
      x: (n, ...) stack.
      keep: optional (n,) bool, the rows that take part (default: all).
      m: optional static count of True entries of ``keep``.
      mixing: optional (n, n) matrix A: the rows are the view ``c + A (x - c)``.
      centre: the centre c of that view (None: c = 0).
      diagonal: whether A is diagonal (static).
      poison: make a coordinate NaN when a kept row is NaN or Inf there.
      start: with ``width``, the first column of a range (traced; see :func:`blockwise`).
      width: the static number of columns of that range.

    Returns:
      (...) float32 medians (flat (width,) for a range).
    """
    m = _kept_count(keep, x.shape[0], m)

    def fn(y):
        blk = Block(y, keep, poison)
        lo, hi = blk.median_values(m)
        return blk.finish(0.5 * (lo + hi))

    return blockwise(fn, x, centre, mixing, diagonal, start, width)


@kernel_jit(static_argnames=("f", "m", "diagonal", "poison", "width"))
def _trimmed_mean(
    x: jax.Array,
    f: int,
    keep: jax.Array | None = None,
    m: int | None = None,
    mixing: jax.Array | None = None,
    centre: jax.Array | None = None,
    diagonal: bool = True,
    poison: bool = False,
    start: jax.Array | None = None,
    width: int | None = None,
) -> jax.Array:
    """Mean of the kept order statistics f .. m - f - 1 (f removed per side); NaN when m <= 2f.

    Same contract as :func:`kernels.sorting.trimmed_mean`, for any n.

    Args:
      x: (n, ...) stack.
      f: the number of values removed from each end.
      keep: optional (n,) bool, the rows that take part (default: all).
      m: optional static count of True entries of ``keep``.
      mixing: optional (n, n) matrix A: the rows are the view ``c + A (x - c)``.
      centre: the centre c of that view (None: c = 0).
      diagonal: whether A is diagonal (static).
      poison: make a coordinate NaN when a kept row is NaN or Inf there.
      start: with ``width``, the first column of a range (traced; see :func:`blockwise`).
      width: the static number of columns of that range.

    Returns:
      (...) float32 means, NaN where m <= 2f (flat (width,) for a range).
    """
    m = _kept_count(keep, x.shape[0], m)
    denom = m - 2 * f

    def fn(y):
        blk = Block(y, keep, poison)
        # Clamp so the selection stays defined when m <= 2f; the result is NaN then.
        stop = max(m - f - 1, f) if isinstance(m, int) else jnp.maximum(m - f - 1, f)
        total = blk.window_sum(f, stop)
        return blk.finish(_divide(total, denom))

    return blockwise(fn, x, centre, mixing, diagonal, start, width)


@kernel_jit(static_argnames=("k", "width"))
def _order_statistic(
    x: jax.Array,
    k: int,
    keep: jax.Array | None = None,
    start: jax.Array | None = None,
    width: int | None = None,
) -> jax.Array:
    """The k-th smallest value (0-based) over the kept rows, coordinate-wise (+inf if k >= m).

    Args:
      x: (n, ...) stack.
      k: the 0-based position (static).
      keep: optional (n,) bool, the rows that take part (default: all).
      start: with ``width``, the first column of a range (traced; see :func:`blockwise`).
      width: the static number of columns of that range.

    Returns:
      (...) float32 (flat (width,) for a range).
    """

    def fn(y):
        blk = Block(y, keep, False)
        return blk.finish(key_values(blk.select([k])[0]))

    return blockwise(fn, x, None, None, True, start, width)


def closest_to_median_mean(
    x: jax.Array,
    f: int,
    keep: jax.Array | None = None,
    m: int | None = None,
    mixing: jax.Array | None = None,
    centre: jax.Array | None = None,
    diagonal: bool = True,
) -> jax.Array:
    """Bulyan's second stage: per coordinate, the mean of the beta = m - 2f kept values nearest their median.

    :func:`nearest_to_median_mean` with ``trim = 2f``.

    Args:
      x: (n, ...) stack.
      f: the number of Byzantine nodes tolerated (2f values dropped per coordinate).
      keep: optional (n,) bool, the rows that take part (default: all).
      m: optional static count of True entries of ``keep``.
      mixing: optional (n, n) matrix A: the rows are the view ``c + A (x - c)``.
      centre: the centre c of that view (None: c = 0).
      diagonal: whether A is diagonal (static).

    Returns:
      (...) float32, NaN where m <= 2f.

    References:
      El Mhamdi, Guerraoui and Rouault, "The Hidden Vulnerability of Distributed Learning in
      Byzantium", ICML 2018.
    """
    return nearest_to_median_mean(x, 2 * f, keep, m, mixing, centre, diagonal)


@kernel_jit(static_argnames=("trim", "m", "diagonal", "width"))
def _nearest_to_median_mean(
    x: jax.Array,
    trim: int,
    keep: jax.Array | None = None,
    m: int | None = None,
    mixing: jax.Array | None = None,
    centre: jax.Array | None = None,
    diagonal: bool = True,
    start: jax.Array | None = None,
    width: int | None = None,
) -> jax.Array:
    """Per coordinate, the mean of the beta = m - trim kept values nearest their median.

    ``trim = 2f``: Bulyan's second stage; ``trim = f``: MeaMed (Xie et al. 2018).

    The same rule as :func:`kernels.sorting.closest_to_median_mean` (El Mhamdi
    et al. 2018; its docstring derives the window and the tie rule), found by
    selection: with med the median (float32, as there) and ``dist = |v - med|``,
    let D be the beta-th smallest distance. Every value with dist < D is in the
    window; the r = beta - count(dist < D) others come from the values at
    distance exactly D, those below the median first (the tie rule keeps the
    smaller value), then those above. Values on one side at distance exactly D
    are equal, except when distinct values round to the same float32 distance
    (they then differ by about an ulp of D): that side's share is taken at
    their mean.

    Args:
      x: (n, ...) stack.
      trim: the number of values dropped per coordinate (2f or f).
      keep: optional (n,) bool, the rows that take part (default: all).
      m: optional static count of True entries of ``keep``.
      mixing: optional (n, n) matrix A: the rows are the view ``c + A (x - c)``.
      centre: the centre c of that view (None: c = 0).
      diagonal: whether A is diagonal (static).
      start: with ``width``, the first column of a range (traced; see :func:`blockwise`).
      width: the static number of columns of that range.

    Returns:
      (...) float32, NaN where m <= trim (flat (width,) for a range).
    """
    m = _kept_count(keep, x.shape[0], m)
    beta = m - trim

    def fn(y):
        blk = Block(y, keep, False, count=tally_rows)
        lo, hi = blk.median_values(m)
        med = 0.5 * (lo + hi)
        vals = blk.values
        dist = jnp.abs(vals - med[None])  # +inf for excluded rows: never chosen (beta <= m)
        dist = jnp.where(jnp.isnan(dist), jnp.inf, dist)  # inf - inf, when the median itself is inf
        dkeys = float_keys(dist)
        rank = jnp.maximum(beta - 1, 0)
        kd = select_keys(dkeys, jnp.broadcast_to(jnp.asarray(rank, jnp.int32), (1, dkeys.shape[1])))[0]
        within = dkeys <= kd[None]
        n_within = blk.count(within)
        total = sum_rows(jnp.where(within, vals, 0.0))

        def with_ties(total):
            # Some column has more values at distance exactly D than the window has room for:
            # the values nearer than D, then the tied ones below the median first (the tie rule
            # keeps the smaller values), each side's share at that side's mean (see the docstring).
            near = dkeys < kd[None]
            tied = dkeys == kd[None]
            low = tied & (vals <= med[None])
            high = tied & (vals > med[None])
            n_low = tally_rows(low).astype(jnp.float32)
            n_high = tally_rows(high).astype(jnp.float32)
            need = (beta - tally_rows(near)).astype(jnp.float32)
            take_low = jnp.minimum(need, n_low)
            take_high = need - take_low
            sum_low = sum_rows(jnp.where(low, vals, 0.0))
            sum_high = sum_rows(jnp.where(high, vals, 0.0))
            tied_total = sum_rows(jnp.where(near, vals, 0.0))
            mean_low = sum_low / jnp.maximum(n_low, 1.0)
            mean_high = sum_high / jnp.maximum(n_high, 1.0)
            tied_total = tied_total + jnp.where(take_low > 0, take_low * mean_low, 0.0)
            tied_total = tied_total + jnp.where(take_high > 0, take_high * mean_high, 0.0)
            return jnp.where(n_within == beta, total, tied_total)

        # Continuous data has one value at distance D per column, so the window is exactly the
        # values within D and the tie passes, which cost about as much as a selection, are
        # skipped for the whole block. A column without ties gets the same sum in either
        # branch, so its result does not depend on the other columns of its block.
        total = jax.lax.cond(jnp.all(n_within == beta), lambda t: t, with_ties, total)
        return blk.finish(_divide(total, beta))

    return blockwise(fn, x, centre, mixing, diagonal, start, width)


# The public kernels: an eager call on a large stack runs its columns on every core
# (kernels.columns); inside a trace, the kernel above, over every column.
median = column_parallel(_median, block_columns)
trimmed_mean = column_parallel(_trimmed_mean, block_columns)
order_statistic = column_parallel(_order_statistic, block_columns)
nearest_to_median_mean = column_parallel(_nearest_to_median_mean, block_columns)
