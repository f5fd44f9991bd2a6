"""Gram, Krum, Weiszfeld, centered clipping, NNM and row kernels against float64 numpy."""

import jax.numpy as jnp
import numpy as np
import numpy_reference as ref
import pytest

from kernels import gram, krum, rows, weiszfeld


@pytest.mark.parametrize("d", [1, 100, gram.chunk_columns(6) * 2, gram.chunk_columns(6) * 3 + 17])
def test_gram_matches_float64_across_chunk_boundaries(d):
    rng = np.random.default_rng(d)
    x = rng.standard_normal((6, d)).astype(np.float32)
    c = rng.standard_normal(d).astype(np.float32)
    D = x.astype(np.float64) - c.astype(np.float64)
    np.testing.assert_allclose(
        np.asarray(gram.gram(jnp.asarray(x), jnp.asarray(c))), D @ D.T, rtol=2e-5, atol=1e-3
    )
    np.testing.assert_allclose(
        np.asarray(gram.gram(jnp.asarray(x))),
        x.astype(np.float64) @ x.T.astype(np.float64),
        rtol=2e-5,
        atol=1e-3,
    )


def test_pairwise_distances_are_accurate_for_close_nodes_when_centred():
    # Nodes 1e-4 apart relative to parameters of size ~1: raw Gram cancels, centred does not.
    rng = np.random.default_rng(0)
    d = 50_000
    base = rng.standard_normal(d).astype(np.float32)
    x = (base + 1e-4 * rng.standard_normal((5, d))).astype(np.float32)
    want = ref.sq_dists(x.astype(np.float64))
    got = np.asarray(gram.pairwise_sq_dists(jnp.asarray(x), jnp.asarray(base)))
    np.testing.assert_allclose(got, want, rtol=1e-3)
    raw = np.asarray(gram.pairwise_sq_dists(jnp.asarray(x)))
    assert np.abs(raw - want).max() > 10 * np.abs(got - want).max()


def _dists(n, d=40, seed=0):
    X = np.random.default_rng(seed).standard_normal((n, d))
    return X, ref.sq_dists(X).astype(np.float32)


@pytest.mark.parametrize("n,f", [(5, 1), (9, 2), (12, 3)])
def test_krum_scores_and_selection(n, f):
    X, d2 = _dists(n, seed=n)
    valid = np.ones(n, bool)
    valid[0] = False
    got = np.asarray(krum.krum_scores(jnp.asarray(d2), f, jnp.asarray(valid)))
    want = ref.krum_scores(X, f, valid)
    np.testing.assert_allclose(got[valid], want[valid], rtol=1e-5)
    assert np.isinf(got[0])
    sel = np.asarray(krum.krum_select(jnp.asarray(d2), f, jnp.asarray(valid)))
    assert sel.sum() == 1 and np.flatnonzero(sel)[0] == np.argmin(want)
    mk = np.asarray(krum.multi_krum_select(jnp.asarray(d2), f, jnp.asarray(valid), 3))
    assert set(np.flatnonzero(mk)) == set(np.argsort(want, kind="stable")[:3])


def test_iterated_krum_matches_reference():
    n, f = 13, 2
    X, d2 = _dists(n, seed=3)
    valid = np.ones(n, bool)
    got = np.asarray(krum.iterated_krum_select(jnp.asarray(d2), f, jnp.asarray(valid), n - 2 * f))
    assert set(np.flatnonzero(got)) == set(ref.iterated_krum(X, f, n - 2 * f, valid))


@pytest.mark.parametrize("n,f", [(7, 1), (13, 2), pytest.param(70, 10, marks=pytest.mark.slow)])
def test_iterated_krum_with_invalid_nodes_and_ties_matches_reference(n, f):
    # Rows sorted once, pointers moved per round: the same picks as re-scoring from scratch,
    # with invalid nodes and repeated (attacker-like) rows whose distances tie exactly.
    X, _ = _dists(n, seed=n)
    X[1:4] = X[0]
    valid = np.ones(n, bool)
    valid[[5, n - 1]] = False
    d2 = ref.sq_dists(X).astype(np.float32)
    theta = int(valid.sum()) - 2 * f
    got = np.asarray(krum.iterated_krum_select(jnp.asarray(d2), f, jnp.asarray(valid), theta))
    assert set(np.flatnonzero(got)) == set(ref.iterated_krum(X, f, theta, valid))
    # A traced limit stops picking at theta - 3 (the traced-count path of Bulyan).
    prefix = np.asarray(krum.iterated_picks(jnp.asarray(d2), f, jnp.asarray(valid), theta, limit=theta - 3))
    assert set(np.flatnonzero(prefix)) == set(ref.iterated_krum(X, f, theta - 3, valid))


def test_weiszfeld_in_gram_space_matches_parameter_space():
    rng = np.random.default_rng(5)
    X = rng.standard_normal((9, 30))
    X[2] += 50.0
    valid = np.ones(9, bool)
    g = (X @ X.T).astype(np.float32)
    w, iters = weiszfeld.geometric_median_weights(jnp.asarray(g), jnp.asarray(valid), max_iter=5000, tol=1e-9)
    z = np.asarray(w, np.float64) @ X
    want = ref.geometric_median(X, valid)
    # Compare objectives (flat near the optimum) and points.
    assert ref.geometric_median_objective(X, valid, z) <= ref.geometric_median_objective(X, valid, want) * (
        1 + 1e-5
    )
    np.testing.assert_allclose(z, want, atol=1e-2)
    assert 1 <= int(iters) <= 5000


def test_centered_clipping_coefficients_match_parameter_space():
    rng = np.random.default_rng(6)
    X = rng.standard_normal((7, 20)) + 1.0
    c = np.zeros(20)
    valid = np.ones(7, bool)
    valid[3] = False
    g = (X @ X.T).astype(np.float32)
    a = np.asarray(
        weiszfeld.centered_clipping_coefficients(jnp.asarray(g), jnp.asarray(valid), 1.5, iterations=4)
    )
    np.testing.assert_allclose(c + a @ X, ref.centered_clipping(X, valid, c, 1.5, 4), rtol=1e-5, atol=1e-5)
    assert a[3] == 0


def test_nnm_matrix_and_mix_match_reference():
    n, f = 9, 2
    X, d2 = _dists(n, d=25, seed=8)
    valid = np.ones(n, bool)
    valid[4] = False
    M = np.asarray(weiszfeld.nnm_matrix(jnp.asarray(d2), f, jnp.asarray(valid)))
    Xf = X.astype(np.float32)
    Xf[4] = np.nan  # the excluded row must not leak through the mixing
    out = np.asarray(rows.mix(jnp.asarray(Xf), jnp.asarray(M)))
    want = ref.nnm(X, f, valid)
    np.testing.assert_allclose(out[valid], want[valid], rtol=1e-5, atol=1e-6)
    assert np.isnan(out[4]).all()


def test_mix_streams_long_rows():
    rng = np.random.default_rng(9)
    x = rng.standard_normal((4, rows.MIX_CHUNK * 2 + 5)).astype(np.float32)
    M = rng.random((4, 4)).astype(np.float32)
    np.testing.assert_allclose(
        np.asarray(rows.mix(jnp.asarray(x), jnp.asarray(M))), M.astype(np.float64) @ x, rtol=1e-5, atol=1e-5
    )


def test_weighted_sum_ignores_zero_weight_nonfinite_rows():
    x = np.random.default_rng(1).standard_normal((5, 100)).astype(np.float32)
    x[2] = np.nan
    x[3] = np.inf
    w = np.array([0.5, 0.25, 0.0, 0.0, 0.25], np.float32)
    got = np.asarray(rows.weighted_sum(jnp.asarray(x), jnp.asarray(w)))
    np.testing.assert_allclose(got, w[[0, 1, 4]].astype(np.float64) @ x[[0, 1, 4]], rtol=1e-6)
    np.testing.assert_array_equal(
        np.asarray(rows.finite_rows(jnp.asarray(x))), [True, True, False, False, True]
    )


def test_clip_factors_and_row_norms():
    x = np.random.default_rng(2).standard_normal((6, 50)).astype(np.float32) * np.arange(1, 7)[:, None]
    c = np.random.default_rng(3).standard_normal(50).astype(np.float32)
    sq = np.asarray(rows.row_sq_norms(jnp.asarray(x), jnp.asarray(c)))
    np.testing.assert_allclose(sq, ((x.astype(np.float64) - c) ** 2).sum(1), rtol=1e-5)
    s = np.asarray(weiszfeld.clip_factors(jnp.asarray(sq), 8.0))
    out = np.asarray(
        rows.materialize_view(jnp.asarray(x), jnp.diag(jnp.asarray(s)), jnp.asarray(c), None, diagonal=True)
    )
    np.testing.assert_allclose(
        out, ref.clip(x.astype(np.float64), c.astype(np.float64), 8.0), rtol=1e-5, atol=1e-5
    )
    assert (np.linalg.norm(out - c, axis=1) <= 8.0 * (1 + 1e-6)).all()


@pytest.mark.parametrize("d", [rows.NORM_LANES * 2, rows.NORM_LANES * 3 + 5])
def test_row_norms_across_lane_chunks_match_float64(d):
    """Lane-accumulated norms (several chunks and a tail), with and without a centre; NaN stays NaN."""
    rng = np.random.default_rng(d)
    x = (rng.standard_normal((5, d)) * np.arange(1, 6)[:, None]).astype(np.float32)
    c = rng.standard_normal(d).astype(np.float32)
    x[3, -1] = np.nan  # in the tail
    x[4, 7] = np.inf  # in the first chunk
    x64 = x.astype(np.float64)
    for centre, want in ((None, (x64**2).sum(1)), (c, ((x64 - c) ** 2).sum(1))):
        got = np.asarray(rows.row_sq_norms(jnp.asarray(x), None if centre is None else jnp.asarray(centre)))
        np.testing.assert_allclose(got[:3], want[:3], rtol=1e-5)
        assert np.isnan(got[3]) and not np.isfinite(got[4])
