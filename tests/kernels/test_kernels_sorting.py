"""Sorting-network kernels against numpy float64 and the 0-1 principle."""

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import numpy_reference as ref
import pytest

from kernels import sorting
from kernels.rows import UNROLL_MAX


@pytest.mark.parametrize("n", range(1, 17))
def test_network_sorts_every_binary_input(n):
    # 0-1 principle (Knuth 5.3.4): a comparator network sorts every input iff it sorts all 2^n 0/1 inputs.
    bits = ((np.arange(2**n)[:, None] >> np.arange(n)) & 1).T.astype(np.int8)
    r = [bits[i].copy() for i in range(n)]
    for a, b in sorting.batcher_pairs(n):
        r[a], r[b] = np.minimum(r[a], r[b]), np.maximum(r[a], r[b])
    assert (np.diff(np.stack(r), axis=0) >= 0).all()


@pytest.mark.parametrize("n", [17, 23, 32, 40])
def test_network_sorts_random_inputs_for_larger_n(n):
    x = np.random.default_rng(n).standard_normal((n, 3000)).astype(np.float32)
    out = np.stack([np.asarray(v) for v in sorting.sort_rows([jnp.asarray(v) for v in x])])
    np.testing.assert_array_equal(out, np.sort(x, axis=0))


def _data(n, d=257, seed=0):
    return np.random.default_rng(seed).standard_normal((n, d)).astype(np.float32)


@pytest.mark.parametrize("n", [1, 2, 5, 8, 16, 33, UNROLL_MAX + 6])
def test_median_matches_numpy(n):
    x = _data(n, seed=n)
    valid = np.ones(n, bool)
    np.testing.assert_allclose(
        np.asarray(sorting.median(jnp.asarray(x))),
        ref.median(x.astype(np.float64), valid),
        rtol=1e-6,
        atol=1e-6,
    )


@pytest.mark.parametrize("n,f", [(5, 1), (9, 2), (16, 3), (16, 7), (UNROLL_MAX + 6, 10)])
def test_trimmed_mean_matches_numpy(n, f):
    x = _data(n, seed=n + f)
    got = np.asarray(sorting.trimmed_mean(jnp.asarray(x), f))
    np.testing.assert_allclose(
        got, ref.trimmed_mean(x.astype(np.float64), f, np.ones(n, bool)), rtol=1e-5, atol=1e-6
    )


@pytest.mark.parametrize("static", [True, False])
def test_masked_kernels_static_and_traced_counts(static):
    n, f = 13, 2
    x = _data(n, seed=3)
    keep = np.ones(n, bool)
    keep[[1, 5, 6]] = False
    m = int(keep.sum()) if static else None
    x64 = x.astype(np.float64)
    # Put garbage (NaN/Inf) in the excluded rows: it must not leak.
    x[1] = np.nan
    x[5] = np.inf
    k = jnp.asarray(keep)
    np.testing.assert_allclose(
        np.asarray(sorting.median(jnp.asarray(x), k, m=m)), ref.median(x64, keep), rtol=1e-6, atol=1e-6
    )
    np.testing.assert_allclose(
        np.asarray(sorting.trimmed_mean(jnp.asarray(x), f, k, m=m)),
        ref.trimmed_mean(x64, f, keep),
        rtol=1e-5,
        atol=1e-6,
    )
    want = np.empty(x.shape[1])
    for j in range(x.shape[1]):
        col = x64[keep, j]
        med = np.median(col)
        want[j] = col[np.argsort(np.abs(col - med), kind="stable")[: len(col) - 2 * f]].mean()
    got = np.asarray(sorting.closest_to_median_mean(jnp.asarray(x), f, k, m=m))
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


def test_traced_count_under_jit_equals_static():
    x = jnp.asarray(_data(11, seed=4))
    keep = jnp.asarray(np.arange(11) % 4 != 0)
    a = jax.jit(lambda x, k: sorting.trimmed_mean(x, 2, k))(x, keep)
    b = sorting.trimmed_mean(x, 2, keep, m=int(np.sum(np.asarray(keep))))
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("k", [0, 3, 8])
def test_order_statistic(k):
    x = _data(9, seed=k)
    np.testing.assert_array_equal(np.asarray(sorting.order_statistic(jnp.asarray(x), k)), np.sort(x, 0)[k])


def test_trimmed_mean_with_too_few_rows_is_nan():
    x = jnp.asarray(_data(4))
    assert np.isnan(np.asarray(sorting.trimmed_mean(x, 2))).all()


def test_exact_on_ties_and_bf16_leaves():
    x = np.array(list(itertools.product([0.0, 1.0, 2.0], repeat=3)), np.float32).T  # (3, 27) with ties
    np.testing.assert_array_equal(np.asarray(sorting.median(jnp.asarray(x))), np.median(x, 0))
    xb = jnp.asarray(_data(7)).astype(jnp.bfloat16)
    want = np.median(np.asarray(xb.astype(jnp.float32)), 0)
    np.testing.assert_array_equal(np.asarray(sorting.median(xb)), want)


def test_closest_to_median_mean_issue_17_column():
    # The column of issue 17 (theta = 10, f = 3, beta = 4): four attacker copies of -0.833 tie
    # the old "farther end" cost with the window the beta nearest values really form.
    col = np.array([-0.833] * 4 + [-0.711, 0.408, 0.488, 0.9, 1.2, 1.5], np.float32)
    x = np.random.default_rng(0).permutation(col)[:, None]
    got = float(np.asarray(sorting.closest_to_median_mean(jnp.asarray(x), 3))[0])
    want = ref.closest_to_median_mean(x.astype(np.float64), 4)[0]
    assert want == pytest.approx((-0.711 + 0.408 + 0.488 - 0.833) / 4)
    assert got == pytest.approx(want, rel=1e-6)


def test_closest_to_median_mean_exact_distance_tie_keeps_the_smaller_value():
    # Median 0; -2 and 2 are equally far and compete for the last of beta = 3 places.
    x = np.array([2.0, -9.0, 1.0, 0.0, -2.0], np.float32)[:, None]
    got = float(np.asarray(sorting.closest_to_median_mean(jnp.asarray(x), 1))[0])
    assert got == pytest.approx((-2.0 + 0.0 + 1.0) / 3)
    assert ref.closest_to_median_mean(x.astype(np.float64), 3)[0] == pytest.approx(got)


@pytest.mark.parametrize("static", [True, False])
@pytest.mark.parametrize("n,f,copies_at", [(10, 3, "low"), (10, 3, "high"), (13, 2, "mid"), (16, 3, "low")])
def test_closest_to_median_mean_with_repeated_attacker_values(static, n, f, copies_at):
    """f rows carry one attacker vector (as ALIE and IPM send): compare with sorting by distance."""
    d = 2000
    rng = np.random.default_rng(n + f)
    x = rng.standard_normal((n, d)).astype(np.float32)
    honest = np.sort(x[f:], axis=0)
    attacker = {
        "low": honest[0] - 0.3 * rng.random(d, dtype=np.float32),  # below every honest value
        "high": honest[-1] + 0.3 * rng.random(d, dtype=np.float32),
        "mid": honest[len(honest) // 2 - 1],  # copies of an honest value near the median
    }[copies_at]
    x[:f] = attacker
    keep = np.ones(n, bool)
    if n == 16:
        # Bulyan's theta-set: drop 2f rows (garbage in them must not leak).
        keep[[4, 9, 11, 12, 14, 15]] = False
        x[4] = np.nan
        x[9] = np.inf
    m = int(keep.sum())
    want = ref.closest_to_median_mean(x[keep].astype(np.float64), m - 2 * f)
    got = np.asarray(
        sorting.closest_to_median_mean(jnp.asarray(x), f, jnp.asarray(keep), m=m if static else None)
    )
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    # The other order statistics pick fixed positions, so repeated values cannot tie them: check anyway.
    k, mm = jnp.asarray(keep), m if static else None
    x64 = x.astype(np.float64)
    np.testing.assert_allclose(np.asarray(sorting.median(jnp.asarray(x), k, m=mm)), ref.median(x64, keep))
    np.testing.assert_allclose(
        np.asarray(sorting.trimmed_mean(jnp.asarray(x), f, k, m=mm)),
        ref.trimmed_mean(x64, f, keep),
        rtol=1e-5,
        atol=1e-6,
    )
