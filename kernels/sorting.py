"""Coordinate-wise order statistics of an (n, ...) stack by sorting networks.

A sorting network is a fixed list of compare-exchange pairs (i, j): row i
becomes ``minimum(x_i, x_j)`` and row j ``maximum(x_i, x_j)``. For the small n
of consensus it is a chain of elementwise ops that XLA fuses into one loop over
the coordinates, so it streams memory once and is exact; ``jnp.sort(x, 0)``
and ``jnp.median(x, 0)`` are ~100x slower on XLA:CPU. Outputs that are not used
(a median needs one or two positions) let XLA drop the comparators that only
feed them. Above ``NETWORK_MAX`` rows (``WINDOW_NETWORK_MAX`` for the window
rules, whose network cannot be pruned, and ``UNROLL_MAX`` where the positions
read or the rows themselves make the network unprunable or too large; see
:func:`network_fits`) the public kernels hand over to :mod:`kernels.selection`
(exact bitwise selection, same semantics).

Every rule here is an *L-estimator*: a weighted sum of the order statistics
``sum_k c_k x_(k)`` with position weights c. Rows that must not take part
(masked, non-finite or not selected nodes) are replaced by +inf, so they sort
to the end and the c_k only cover the first m positions; m may be a traced
value, which keeps shapes static under jit.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from kernels import selection, stack_sort
from kernels.backend import order_impl
from kernels.compile_options import kernel_jit
from kernels.rows import UNROLL_MAX, rows, tree_sum, view_rows

# The window rules (Bulyan's second stage, MeaMed) need the whole sorted column, not one or two
# positions, so their network cannot be pruned and grows as n log^2 n comparators: above this
# many rows exact selection is faster. The unpruned network's cost jumps just past 16 rows while
# selection's grows slowly with n (and splits over the cores, kernels.columns), so selection wins
# from 17 rows. Chosen by ``python -m benchmarks aggregators --n-sweep``, which times Bulyan's
# second stage alone on 4 + 2f rows.
WINDOW_NETWORK_MAX = 16

# The median, the trimmed mean and single order statistics read a few static positions (or one
# static window) of the sorted column, so XLA prunes the network to what feeds them and fuses the
# rest into one loop. Up to here the pruned network beats exact selection for both rules; past it
# the trimmed mean's network falls behind, and a little above 192 rows the median's network no
# longer fits the fused loop and its cost explodes, so the limit keeps a wide margin. A traced
# position (a count m that is not static) reads every output through a chain of selects, which
# compiles for minutes and runs far slower than selection at 128 rows, so traced positions go to
# selection above ``UNROLL_MAX``. Chosen by ``python -m benchmarks aggregators --n-sweep``.
NETWORK_MAX = 128


def network_fits(n: int, m, mixing: jax.Array | None = None, diagonal: bool = True) -> bool:
    """Whether the sorting network serves n rows with m kept (else exact selection does).

    Up to ``UNROLL_MAX`` rows always. Up to ``NETWORK_MAX`` when the kept count m is static
    (every position read is a constant, so XLA prunes the network) and the rows are x itself or
    a diagonal view of it (a dense view unrolls n^2 terms per coordinate).

    Args:
      n: the number of rows.
      m: the kept count, a Python int when static (anything else counts as traced).
      mixing: the view's matrix, if any.
      diagonal: whether that matrix is diagonal.

    Returns:
      True when the sorting network is used.
    """
    if n <= UNROLL_MAX:
        return True
    return n <= NETWORK_MAX and _is_static(m) and (mixing is None or diagonal)


@functools.cache
def batcher_pairs(n: int) -> tuple[tuple[int, int], ...]:
    """Compare-exchange pairs of Batcher's odd-even merge sort for n inputs.

    Built for the next power of two and pruned: inputs past n are taken as
    +inf, so every comparator touching them is a no-op and is dropped.

    Args:
      n: the number of inputs.

    Returns:
      The (i, j) pairs, i < j, in the order they are applied.
    """
    size = 1 << max(n - 1, 0).bit_length()
    pairs = []
    p = 1
    while p < size:
        k = p
        while k >= 1:
            for j in range(k % p, size - k, 2 * k):
                for i in range(min(k, size - j - k)):
                    a, b = i + j, i + j + k
                    if a // (2 * p) == b // (2 * p) and b < n:
                        pairs.append((a, b))
            k //= 2
        p *= 2
    return tuple(pairs)


def sort_rows(r: list[jax.Array]) -> list[jax.Array]:
    """Rows sorted coordinate-wise (ascending) by Batcher's network, as a new list.

    Args:
      r: the rows, arrays of one shape.

    Returns:
      The sorted rows: entry k holds the k-th smallest value of every coordinate.
    """
    r = list(r)
    for a, b in batcher_pairs(len(r)):
        r[a], r[b] = jnp.minimum(r[a], r[b]), jnp.maximum(r[a], r[b])
    return r


def _is_static(v) -> bool:
    return isinstance(v, (int, np.integer))


def pick(sorted_rows: list[jax.Array], index) -> jax.Array:
    """``sorted_rows[index]`` for a Python int or a traced scalar index.

    Args:
      sorted_rows: the rows.
      index: a Python int, or a traced int scalar (a chain of selects).

    Returns:
      The row at ``index`` (zeros for a traced index past the end).
    """
    if _is_static(index):
        return sorted_rows[int(index)]
    out = jnp.zeros_like(sorted_rows[0])
    for k, v in enumerate(sorted_rows):
        out = jnp.where(index == k, v, out)
    return out


def window_sum(sorted_rows: list[jax.Array], start, length) -> jax.Array:
    """Sum of ``sorted_rows[start:start + length]`` (start/length static or traced).

    Args:
      sorted_rows: the rows.
      start: the first position (int, traced scalar, or a per-coordinate array).
      length: the number of positions.

    Returns:
      The sum, of one row's shape (zeros for an empty window).
    """
    if _is_static(start) and _is_static(length):
        window = sorted_rows[int(start) : int(start) + int(length)]
        return tree_sum(window) if window else jnp.zeros_like(sorted_rows[0])
    terms = [jnp.where((k >= start) & (k < start + length), v, 0.0) for k, v in enumerate(sorted_rows)]
    return tree_sum(terms)


def exclude(
    x: jax.Array,
    keep: jax.Array | None,
    mixing: jax.Array | None = None,
    centre: jax.Array | None = None,
    diagonal: bool = True,
    poison: bool = False,
) -> list[jax.Array]:
    """The rows (float32) with rows where ``keep`` is False replaced by +inf.

    The rows are those of x, or of the lazy view ``c + A (x - c)`` when a
    mixing matrix is given (see :func:`kernels.rows.view_rows`). The
    replacement is a per-row scalar select: an (n, ...) ``where`` with a
    broadcast mask stops XLA from fusing the network and costs ~6x.

    Args:
      x: (n, ...) stack.
      keep: optional (n,) bool (None: every row).
      mixing: optional (n, n) matrix A of the view.
      centre: optional centre c of the view.
      diagonal: whether A is diagonal (static).
      poison: turn +-Inf into NaN, so any non-finite kept value poisons its coordinate.

    Returns:
      The n rows, float32.
    """
    r = view_rows(x, mixing, centre, diagonal=diagonal)
    if poison:
        # +-Inf -> NaN: NaN propagates through every comparator it meets, and every
        # input reaches every output of a sorting network, so any non-finite value
        # in a kept row makes the result at that coordinate NaN (a cheap check).
        r = [jnp.where(jnp.isinf(v), jnp.nan, v) for v in r]
    if keep is None:
        return r
    return [jnp.where(keep[i], v, jnp.inf) for i, v in enumerate(r)]


def count(keep: jax.Array | None, n: int, m: int | None = None):
    """Number of kept rows: static (a Python int) when known, else traced.

    Passing the count as a static ``m`` when the mask is concrete keeps every
    order position static, which is ~7x faster than the traced-position path.

    Args:
      keep: optional (n,) bool mask.
      n: the number of rows.
      m: the count when the caller knows it.

    Returns:
      ``m`` or n as a Python int, or the traced number of True entries of ``keep``.
    """
    if m is not None:
        return int(m)
    return n if keep is None else jnp.sum(keep.astype(jnp.int32))


def _median_of_sorted(sorted_rows: list[jax.Array], m) -> jax.Array:
    lo = (m - 1) // 2
    hi = m // 2
    return 0.5 * (pick(sorted_rows, lo) + pick(sorted_rows, hi))


def _sorted(r: list[jax.Array]) -> list[jax.Array]:
    if len(r) <= NETWORK_MAX:
        return sort_rows(r)
    return rows(jnp.sort(jnp.stack(r), axis=0))


def _static_count(keep: jax.Array | None, n: int, m: int | None):
    """The kept count when it is static (a Python int), else None: what ``network_fits`` needs.

    Decided before any compilation, so the public kernels below can hand a large stack to
    :mod:`kernels.selection` eagerly (its columns then run on every core).
    """
    if m is not None:
        return int(m)
    return n if keep is None else None


def median(
    x: jax.Array,
    keep: jax.Array | None = None,
    m: int | None = None,
    mixing: jax.Array | None = None,
    centre: jax.Array | None = None,
    diagonal: bool = True,
    poison: bool = False,
    *,
    impl: str | None = None,
) -> jax.Array:
    """Coordinate-wise median over the kept rows (mean of the two middle values when m is even).

    ``m``, if given, must equal the number of True entries of ``keep``. With
    ``poison``, a NaN or Inf in any kept row makes the result NaN at that
    coordinate, so a finite result certifies that every kept row was finite.
    ``impl``: the formulation (:func:`kernels.backend.order_impl`; default: the backend's).

    Args:
      x: (n, ...) stack.
      keep: optional (n,) bool, the rows that take part (default: all).
      m: optional static count of True entries of ``keep`` (faster: every position is static).
      mixing: optional (n, n) matrix A: the rows are the view ``c + A (x - c)``.
      centre: the centre c of that view (None: c = 0).
      diagonal: whether A is diagonal (static).
      poison: make a coordinate NaN when a kept row is NaN or Inf there.
      impl: one of :data:`kernels.backend.ORDER_IMPLS` (default: the backend's).

    Returns:
      (...) float32 medians.

    Raises:
      ValueError: for an unknown ``impl`` (argument, context or environment).

    Examples:
      >>> import jax.numpy as jnp
      >>> median(jnp.array([[1.0, 5.0], [3.0, -1.0], [2.0, 0.0]]))
      Array([2., 0.], dtype=float32)
    """
    chosen = order_impl(impl)
    if chosen == "sort":
        return stack_sort.median(x, keep, m, mixing, centre, diagonal, poison)
    if not network_fits(x.shape[0], _static_count(keep, x.shape[0], m), mixing, diagonal):
        above = stack_sort if chosen == "hybrid" else selection
        return above.median(x, keep, m, mixing, centre, diagonal, poison)
    return _network_median(x, keep, m, mixing, centre, diagonal, poison)


@kernel_jit(static_argnames=("m", "diagonal", "poison"))
def _network_median(x, keep, m, mixing, centre, diagonal, poison) -> jax.Array:
    kept = count(keep, x.shape[0], m)
    return _median_of_sorted(_sorted(exclude(x, keep, mixing, centre, diagonal, poison)), kept)


def trimmed_mean(
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
    """Coordinate-wise mean after removing the f smallest and f largest kept values.

    Needs m > 2f kept rows; with fewer the result is NaN (callers check first).
    ``poison`` and ``impl`` as in :func:`median`.

    Args:
      x: (n, ...) stack.
      f: the number of values removed from each end.
      keep: optional (n,) bool, the rows that take part (default: all).
      m: optional static count of True entries of ``keep`` (faster: every position is static).
      mixing: optional (n, n) matrix A: the rows are the view ``c + A (x - c)``.
      centre: the centre c of that view (None: c = 0).
      diagonal: whether A is diagonal (static).
      poison: make a coordinate NaN when a kept row is NaN or Inf there.
      impl: one of :data:`kernels.backend.ORDER_IMPLS` (default: the backend's).

    Returns:
      (...) float32 means, NaN where m <= 2f.

    Raises:
      ValueError: for an unknown ``impl``.
    """
    chosen = order_impl(impl)
    if chosen == "sort":
        return stack_sort.trimmed_mean(x, f, keep, m, mixing, centre, diagonal, poison)
    if not network_fits(x.shape[0], _static_count(keep, x.shape[0], m), mixing, diagonal):
        above = stack_sort if chosen == "hybrid" else selection
        return above.trimmed_mean(x, f, keep, m, mixing, centre, diagonal, poison)
    return _network_trimmed_mean(x, f, keep, m, mixing, centre, diagonal, poison)


@kernel_jit(static_argnames=("f", "m", "diagonal", "poison"))
def _network_trimmed_mean(x, f, keep, m, mixing, centre, diagonal, poison) -> jax.Array:
    kept = count(keep, x.shape[0], m)
    s = _sorted(exclude(x, keep, mixing, centre, diagonal, poison))
    denom = kept - 2 * f
    total = window_sum(s, f, denom)
    if _is_static(denom):
        return total / float(denom) if denom > 0 else jnp.full_like(total, jnp.nan)
    return jnp.where(denom > 0, total / jnp.maximum(denom, 1).astype(jnp.float32), jnp.nan)


def order_statistic(
    x: jax.Array, k: int, keep: jax.Array | None = None, *, impl: str | None = None
) -> jax.Array:
    """The k-th smallest value (0-based) over the kept rows, coordinate-wise (+inf if k >= m).

    Args:
      x: (n, ...) stack.
      k: the 0-based position (static).
      keep: optional (n,) bool, the rows that take part (default: all).
      impl: one of :data:`kernels.backend.ORDER_IMPLS` (default: the backend's).

    Returns:
      (...) float32.

    Raises:
      ValueError: for an unknown ``impl``.
    """
    chosen = order_impl(impl)
    if chosen == "sort":
        return stack_sort.order_statistic(x, k, keep)
    if not network_fits(x.shape[0], k):  # k is static: the one position read is a constant
        return (stack_sort if chosen == "hybrid" else selection).order_statistic(x, k, keep)
    return _network_order_statistic(x, k, keep)


@kernel_jit(static_argnames=("k",))
def _network_order_statistic(x: jax.Array, k: int, keep: jax.Array | None) -> jax.Array:
    return pick(_sorted(exclude(x, keep)), k)


def closest_to_median_mean(
    x: jax.Array,
    f: int,
    keep: jax.Array | None = None,
    m: int | None = None,
    mixing: jax.Array | None = None,
    centre: jax.Array | None = None,
    diagonal: bool = True,
    *,
    impl: str | None = None,
) -> jax.Array:
    """Bulyan's second stage: per coordinate, the mean of the beta = m - 2f kept values nearest their median.

    El Mhamdi et al. 2018: beta = theta - 2f where theta (here m) is the number
    of values Krum selected. The beta values nearest the median always form a
    contiguous window ``s[j : j + beta]`` of the sorted values, j in [0, 2f], and
    the right window minimizes the sum of distances ``sum |s_k - med|`` over it.
    Moving the window from j to j + 1 swaps s_j out for s_{j+beta}, which lowers
    that sum exactly when ``|s_{j+beta} - med| < |s_j - med|``; that test is
    true for a prefix of the j and false after it (as j grows the value leaving
    moves towards the median and the one entering away from it), so the best
    window starts at j* = the number of j in [0, 2f) where it holds.

    Tie rule: when the value entering is exactly as far from the median as the
    one leaving, the window stays, so the smaller value is kept: the window
    holds the first beta values in the order (distance to the median, value).
    Comparing the farther ends only would leave several windows tied when
    attackers send one vector f times, and keeping the first of them could keep
    the attackers' copies. ``impl`` as in :func:`median`.

    Args:
      x: (n, ...) stack.
      f: the number of Byzantine nodes tolerated (2f values dropped per coordinate).
      keep: optional (n,) bool, the rows that take part (default: all).
      m: optional static count of True entries of ``keep`` (faster: every position is static).
      mixing: optional (n, n) matrix A: the rows are the view ``c + A (x - c)``.
      centre: the centre c of that view (None: c = 0).
      diagonal: whether A is diagonal (static).
      impl: one of :data:`kernels.backend.ORDER_IMPLS` (default: the backend's).

    Returns:
      (...) float32, NaN where m <= 2f.

    Raises:
      ValueError: for an unknown ``impl``.

    References:
      El Mhamdi, Guerraoui and Rouault, "The Hidden Vulnerability of Distributed Learning in
      Byzantium", ICML 2018.
    """
    chosen = order_impl(impl)
    if chosen == "sort" or (chosen == "hybrid" and x.shape[0] > WINDOW_NETWORK_MAX):
        return stack_sort.nearest_to_median_mean(x, 2 * f, keep, m, mixing, centre, diagonal)
    if x.shape[0] > WINDOW_NETWORK_MAX:
        return selection.closest_to_median_mean(x, f, keep, m, mixing, centre, diagonal)
    return _network_closest_to_median_mean(x, f, keep, m, mixing, centre, diagonal)


@kernel_jit(static_argnames=("f", "m", "diagonal"))
def _network_closest_to_median_mean(x, f, keep, m, mixing, centre, diagonal) -> jax.Array:
    m = count(keep, x.shape[0], m)
    s = _sorted(exclude(x, keep, mixing, centre, diagonal))
    med = _median_of_sorted(s, m)
    beta = m - 2 * f
    # Rows past m are +inf (excluded); the windows never reach them (j + beta <= m - 1).
    start = jnp.zeros(s[0].shape, jnp.int32)
    for j in range(2 * f):
        entering = pick(s, j + beta)
        start = start + (jnp.abs(entering - med) < jnp.abs(s[j] - med)).astype(jnp.int32)
    last = 2 * f + beta if _is_static(beta) else len(s)
    terms = [jnp.where((k >= start) & (k < start + beta), s[k], 0.0) for k in range(min(last, len(s)))]
    total = tree_sum(terms)
    if _is_static(beta):
        return total / float(beta) if beta > 0 else jnp.full_like(total, jnp.nan)
    return jnp.where(beta > 0, total / jnp.maximum(beta, 1).astype(jnp.float32), jnp.nan)
