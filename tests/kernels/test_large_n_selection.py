"""Bitwise-selection kernels (n > 64 rows) against numpy float64, with ties and NaN rows (issue 19).

The data are small integers: medians, distances to the median and window sums
are then exact in float32, so the float64 references must agree to rounding of
the final mean. Each case has f attacker rows repeating one vector (ties), a NaN
row that is excluded and, where said, a NaN row that is kept (NaN output).
"""

import jax
import jax.numpy as jnp
import numpy as np
import numpy_reference as ref
import pytest
import robust_reference as rref

from kernels import robust, rows, selection, sorting

# Compiling a kernel takes seconds on the shared 2-core machine: one size stays in the fast suite.
SIZES = [65] + [pytest.param(n, marks=pytest.mark.slow) for n in (128, 257, 1024)]


def _case(n: int, seed: int = 0):
    """(x, keep, m, f): integer data, n // 5 copies of one row, row 3 NaN and excluded."""
    # Two full column blocks plus a remainder: the fori loop and the overlapping last block both run.
    d = 2 * selection.block_columns(n) + 37
    rng = np.random.default_rng(seed + n)
    x = rng.integers(-12, 13, (n, d)).astype(np.float32)
    x[1 : 1 + n // 5] = x[0]
    x[3] = np.nan
    keep = np.ones(n, bool)
    keep[3] = False
    m = int(keep.sum())
    return x, keep, m, (m - 3) // 4


def _kept(x, keep):
    return x[keep].astype(np.float64)


@pytest.mark.parametrize("n", SIZES)
def test_median_and_trimmed_mean_match_numpy(n):
    """Both paths: the public kernel (a network up to NETWORK_MAX rows at a static m) and selection."""
    x, keep, m, f = _case(n)
    X = _kept(x, keep)
    for kernels in (sorting, selection):
        med = np.asarray(kernels.median(jnp.asarray(x), jnp.asarray(keep), m=m))
        np.testing.assert_array_equal(med, np.median(X, axis=0))  # integers and half-integers: exact
        tm = np.asarray(kernels.trimmed_mean(jnp.asarray(x), f, jnp.asarray(keep), m=m))
        np.testing.assert_allclose(tm, ref.trimmed_mean(X, f, np.ones(m, bool)), rtol=0, atol=2e-6)


def test_network_serves_static_positions_up_to_its_limit():
    """Networks up to NETWORK_MAX rows for static positions; selection for traced ones and dense views."""
    top = sorting.NETWORK_MAX
    assert sorting.network_fits(top, top) and not sorting.network_fits(top + 1, top + 1)
    assert sorting.network_fits(rows.UNROLL_MAX, jnp.int32(3))  # traced: networks to UNROLL_MAX only
    assert not sorting.network_fits(rows.UNROLL_MAX + 1, jnp.int32(3))
    dense = jnp.ones((top, top))
    assert not sorting.network_fits(top, top, dense, diagonal=False)
    assert sorting.network_fits(top, top, dense, diagonal=True)


@pytest.mark.parametrize("n", [pytest.param(17, marks=pytest.mark.slow), 65])
def test_meamed_above_the_network_limit_matches_numpy(n):
    """MeaMed hands over to selection above WINDOW_NETWORK_MAX rows: the m - f values nearest the median."""
    assert n > sorting.WINDOW_NETWORK_MAX
    x, keep, m, f = _case(n, seed=2)
    f = (m - 1) // 2  # MeaMed needs m > 2f; the widest trim exercises the distance ties most
    out = np.asarray(robust.meamed(jnp.asarray(x), f, jnp.asarray(keep), m=m))
    np.testing.assert_allclose(out, rref.meamed(x.astype(np.float64), f, keep), rtol=0, atol=2e-6)


@pytest.mark.slow
@pytest.mark.parametrize("n", [17, 49, 65, 128, 257, 1024])
def test_bulyan_second_stage_matches_numpy(n):
    x, keep, m, f = _case(n, seed=1)
    out = np.asarray(sorting.closest_to_median_mean(jnp.asarray(x), f, jnp.asarray(keep), m=m))
    np.testing.assert_allclose(out, ref.closest_to_median_mean(_kept(x, keep), m - 2 * f), rtol=0, atol=2e-6)


def test_window_rule_without_ties_is_the_sum_within_the_window_and_ignores_its_block():
    """Tie-free blocks skip the tie passes; a tied column in a block changes no other column's bits.

    Bulyan's second stage above WINDOW_NETWORK_MAX rows on continuous floats (one value at the
    window's edge distance per column) against float64, then the same stack with one column of
    its first block replaced by small integers (ties at the edge distance): that column matches
    the reference and every other column keeps its bits, whichever branch its block took.
    """
    n, f = 33, 5
    b = selection.block_columns(n)
    x = np.random.default_rng(11).standard_normal((n, 2 * b + 3)).astype(np.float32)
    ref_clean = ref.closest_to_median_mean(x.astype(np.float64), n - 2 * f)
    clean = np.asarray(sorting.closest_to_median_mean(jnp.asarray(x), f))
    np.testing.assert_allclose(clean, ref_clean, rtol=0, atol=2e-6)
    tied = x.copy()
    tied[:, 1] = np.random.default_rng(12).integers(-2, 3, n)  # 33 values on 5 integers: edge ties
    dist = np.abs(tied[:, 1] - np.median(tied[:, 1]))
    assert (dist <= np.sort(dist)[n - 2 * f - 1]).sum() > n - 2 * f  # more values at the edge than room
    out = np.asarray(sorting.closest_to_median_mean(jnp.asarray(tied), f))
    want = ref.closest_to_median_mean(tied[:, 1:2].astype(np.float64), n - 2 * f)[0]
    assert out[1] == pytest.approx(want, abs=1e-6)
    np.testing.assert_array_equal(np.delete(out, 1), np.delete(clean, 1))


@pytest.mark.slow
@pytest.mark.parametrize("n", [65, 257])
def test_traced_count_under_jit_equals_eager(n):
    """Under an outer jit the count m is traced (masks not concrete): same values as the static path."""
    x, keep, m, f = _case(n, seed=2)
    xj, kj = jnp.asarray(x), jnp.asarray(keep)
    eager = [
        sorting.median(xj, kj, m=m),
        sorting.trimmed_mean(xj, f, kj, m=m),
        sorting.closest_to_median_mean(xj, f, kj, m=m),
    ]
    traced = jax.jit(
        lambda x, k: (
            sorting.median(x, k),
            sorting.trimmed_mean(x, f, k),
            sorting.closest_to_median_mean(x, f, k),
        )
    )(xj, kj)
    for a, b in zip(eager, traced, strict=True):
        np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=0, atol=1e-6)


@pytest.mark.slow
def test_kept_nan_poisons_only_its_coordinates():
    n = 128
    x, _, _, f = _case(n, seed=3)
    x[5, ::3] = np.nan  # a kept row, NaN at every third coordinate
    x[7, 1] = np.inf  # a kept +inf: a value without poison, NaN with it
    x[3] = 0.0
    xj = jnp.asarray(x)
    for out in (sorting.median(xj), sorting.trimmed_mean(xj, f), sorting.closest_to_median_mean(xj, f)):
        out = np.asarray(out)
        np.testing.assert_array_equal(np.isnan(out), np.isnan(x[5]))
    clean = np.delete(x, 5, axis=0).astype(np.float64)
    med = np.asarray(sorting.median(xj, jnp.asarray(np.arange(n) != 5), m=n - 1))
    np.testing.assert_array_equal(med, np.median(clean, axis=0))
    assert np.isnan(np.asarray(sorting.median(xj, poison=True))[1])


@pytest.mark.slow
@pytest.mark.parametrize("n", [65, 1024])
def test_order_statistic_is_exact_on_distinct_floats(n):
    """Random floats (no ties), negative and positive zero, +-inf: every rank is numpy's."""
    d = selection.block_columns(n) + 5
    x = np.random.default_rng(n).standard_normal((n, d)).astype(np.float32)
    x[0, :4] = [-0.0, 0.0, np.inf, -np.inf]
    s = np.sort(x, axis=0)
    for k in (0, 1, n // 2, n - 1):
        np.testing.assert_array_equal(np.asarray(sorting.order_statistic(jnp.asarray(x), k)), s[k])
    keep = np.arange(n) % 2 == 0
    out = np.asarray(sorting.order_statistic(jnp.asarray(x), int(keep.sum()), jnp.asarray(keep)))
    assert np.all(out == np.inf)  # past the kept rows


@pytest.mark.slow
def test_selection_matches_sorting_network_below_64_rows():
    """Selection called directly at small n agrees with the sorting networks (ties, odd and even m)."""
    n = 24
    x = np.random.default_rng(9).integers(-4, 5, (n, 700)).astype(np.float32)
    xj = jnp.asarray(x)
    for m_keep in (24, 23):
        keep = jnp.asarray(np.arange(n) < m_keep)
        np.testing.assert_array_equal(
            np.asarray(selection.median(xj, keep, m=m_keep)), np.asarray(sorting.median(xj, keep, m=m_keep))
        )
    np.testing.assert_allclose(
        np.asarray(selection.closest_to_median_mean(xj, 5)),
        np.asarray(sorting.closest_to_median_mean(xj, 5)),
        rtol=0,
        atol=1e-6,
    )


@pytest.mark.slow
def test_dense_mixing_view_matches_materialized_rows():
    """A dense n -> n mixing (NNM's view) at n > 64: the kernel on the view equals it on the rows."""
    n = 80
    rng = np.random.default_rng(4)
    x = rng.integers(-6, 7, (n, 300)).astype(np.float32)
    a = (rng.random((n, n)) < 0.1).astype(np.float32) / 4.0  # quarters: exact products and sums
    c = np.full(300, 0.5, np.float32)
    rows = (c + a @ (x - c)).astype(np.float32)
    out = sorting.median(jnp.asarray(x), mixing=jnp.asarray(a), centre=jnp.asarray(c), diagonal=False)
    np.testing.assert_array_equal(np.asarray(out), np.median(rows.astype(np.float64), axis=0))


@pytest.mark.parametrize("n", [127, 128, 129, 255, 256, 257, 1024])
def test_row_counts_do_not_wrap_in_their_narrow_accumulators(n):
    # Counts accumulate in uint8 per group of 128 rows: every row True must still count n.
    rng = np.random.default_rng(n)
    mask = rng.random((n, 33)) < 0.5
    mask[:, 0] = True
    mask[:, 1] = False
    got = np.asarray(jax.jit(selection.count_rows)(jnp.asarray(mask)))
    np.testing.assert_array_equal(got, mask.sum(axis=0))
    assert got[0] == n and got[1] == 0
