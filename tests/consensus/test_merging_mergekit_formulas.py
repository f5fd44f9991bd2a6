"""mergekit 0.1.5's per-tensor formulas (consensus.merging.{sparsify,generalized,spherical}) against
float64 numpy references written here from mergekit's source, and the random ones in distribution."""

from __future__ import annotations

import numpy as np
import pytest

from consensus.merging import generalized, sparsify, spherical


@pytest.fixture
def data():
    rng = np.random.default_rng(0)
    base = rng.normal(size=(12, 10))
    xs = [base + 0.3 * rng.normal(size=base.shape) for _ in range(3)]
    xs[0][0, :5] = base[0, :5]  # unchanged entries: ties at 0 in the task vector
    return base, xs


def _top(a, k):
    """The k largest entries of a flat array (ties by position), as a 0/1 mask: mergekit's argsort[:k]."""
    m = np.zeros(a.size)
    m[np.argsort(-a, kind="stable")[:k]] = 1
    return m


def _trim(d, density):
    if density >= 1:
        return d
    k = max(1, int(density * d.size))
    return d * _top(np.abs(d).reshape(-1), k).reshape(d.shape)


def _breadcrumbs(d, density, gamma):
    if density >= 1:
        return d
    n = d.size
    target, top = int(density * n), int(gamma * n)
    bottom = max(0, n - target - top)
    m = np.zeros(n)
    m[np.argsort(np.abs(d).reshape(-1), kind="stable")[bottom : bottom + target]] = 1
    return d * m.reshape(d.shape)


def test_rank_window_matches_a_stable_sort():
    rng = np.random.default_rng(1)
    a = rng.integers(0, 5, 200).astype(np.float32)  # many ties
    order = np.argsort(a, kind="stable")
    for lo, hi in [(0, 10), (37, 120), (150, 200), (3, 3), (0, 200)]:
        want = np.zeros(a.size, bool)
        want[order[lo:hi]] = True
        np.testing.assert_array_equal(sparsify.rank_window(a, lo, hi), want)


def test_magnitude_and_breadcrumbs(data):
    base, xs = data
    d = xs[0] - base
    for density in (0.05, 0.3, 0.9, 1.0):
        np.testing.assert_array_equal(sparsify.magnitude(d, density), _trim(d, density))
        for gamma in (0.0, 0.01, 0.2):
            np.testing.assert_array_equal(
                sparsify.magnitude_outliers(d, density, gamma), _breadcrumbs(d, density, gamma)
            )
    kept = _trim(d, 0.3)
    np.testing.assert_allclose(
        sparsify.magnitude(d, 0.3, rescale=True), kept * np.abs(d).sum() / np.abs(kept).sum(), rtol=1e-12
    )


def _gta(base, xs, w, dens, sparse, consensus, normalize, lam, gamma=0.01):
    ds = []
    for x, d_ in zip(xs, dens, strict=True):
        d = x - base
        if sparse == "magnitude":
            d = _trim(d, d_)
        elif sparse == "magnitude_outliers":
            d = _breadcrumbs(d, d_, gamma)
        ds.append(d)
    wv = np.asarray(w)[:, None, None]
    D = np.stack(ds) * wv
    if consensus:
        mask = np.sign(D) == np.where(D.sum(0) >= 0, 1.0, -1.0)
        mixed, div = (D * mask).sum(0), (wv * mask).sum(0)
        div[div == 0] = 1
    else:
        mixed, div = D.sum(0), wv.sum(0)
        div = np.where(np.abs(div) < 1e-8, 1.0, div)
    if normalize:
        mixed = mixed / div
    return base + lam * mixed


@pytest.mark.parametrize(
    ("method", "normalize"),
    [
        ("ties", True),
        ("ties", False),
        ("task_arithmetic", False),
        ("breadcrumbs", False),
        ("breadcrumbs_ties", True),
    ],
)
def test_generalized_task_arithmetic_per_model_parameters(data, method, normalize):
    base, xs = data
    sparse, consensus, _, _ = generalized.GTA_METHODS[method]
    w, dens = [1.0, 0.3, 0.5], [0.8, 0.5, 0.33]
    got = generalized.generalized_task_arithmetic(
        base,
        xs,
        w,
        sparsification=sparse,
        consensus=consensus,
        densities=dens,
        normalize=normalize,
        scale=0.7,
        gammas=[0.05] * 3,
    )
    want = _gta(base, xs, w, dens, sparse, consensus, normalize, 0.7, gamma=0.05)
    np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-12)


def test_random_sparsifications_in_distribution():
    rng = np.random.default_rng(2)
    d = rng.normal(size=(400, 500))
    kept = sparsify.bernoulli(d, 0.3, np.random.default_rng(0), rescale=False)
    assert abs(np.mean(kept != 0) - 0.3) < 0.005
    np.testing.assert_array_equal(kept[kept != 0], d[kept != 0])  # kept entries untouched
    scaled = sparsify.bernoulli(d, 0.3, np.random.default_rng(0), rescale=True)
    np.testing.assert_allclose(np.abs(scaled).sum(), np.abs(d).sum(), rtol=1e-10)  # L1 kept
    della = sparsify.della_magprune(d, 0.5, 0.2, np.random.default_rng(0), rescale=False)
    assert abs(np.mean(della != 0) - 0.5) < 0.005
    # larger magnitudes are kept more often: p = 0.3 at rank 0 ... 0.7 at the top rank of each row
    rank = np.argsort(np.argsort(np.abs(d), axis=1), axis=1) / (d.shape[1] - 1)
    low, high = della[rank < 0.1], della[rank > 0.9]
    assert abs(np.mean(low != 0) - 0.32) < 0.02 and abs(np.mean(high != 0) - 0.68) < 0.02
    with pytest.raises(ValueError, match="density"):
        sparsify.della_magprune(d, 0.9, 0.2, np.random.default_rng(0))


def test_linear_sce_and_ram(data):
    base, xs = data
    np.testing.assert_allclose(
        generalized.linear(xs, [1.0, 0.3, 0.5]), (xs[0] + 0.3 * xs[1] + 0.5 * xs[2]) / 1.8, rtol=1e-12
    )
    # sce: variance selection, sign erase, weights mean(d^2) / sum
    tv = np.stack([x - base for x in xs])
    var = tv.var(0)
    k = int(np.count_nonzero(var) * 0.5)
    tv = tv * _top(np.abs(var).reshape(-1), k).reshape(var.shape)
    mask = np.sign(tv) == np.where(tv.sum(0) >= 0, 1.0, -1.0)
    w = (tv**2).reshape(3, -1).mean(1)
    w = w / w.sum()
    ew = w[:, None, None] * mask
    want = base + (tv * ew).sum(0) / np.maximum(ew.sum(0), 1e-6)
    np.testing.assert_allclose(generalized.sce(base, xs, 0.5), want, rtol=1e-12, atol=1e-12)
    # ram: unique changes whole, shared ones averaged; eps picks the changed entries
    tv = np.stack([x - base for x in xs])
    eps = 0.2
    nz = np.abs(tv) > eps
    c = nz.sum(0)
    want = base + np.where(c == 1, (tv * nz).sum(0), np.where(c > 1, (tv * nz).sum(0) / np.maximum(c, 1), 0))
    np.testing.assert_allclose(generalized.ram(base, xs, eps), want, rtol=1e-12, atol=1e-12)
    shared = (nz & (c > 1)).reshape(3, -1).sum(1)
    unique = (nz & (c == 1)).reshape(3, -1).sum(1)
    # torch divides the integer counts in its default float32, so mergekit's boost is a float32 number
    rho = shared.astype(np.float32) / np.maximum(unique, eps).astype(np.float32)
    lam = (1 + 0.1 * np.clip(rho, 0, 0.2)).astype(np.float32).astype(np.float64)
    want = base + (tv * nz * ((c == 1) * lam[:, None, None] + (c > 1) / np.maximum(c, 1))).sum(0)
    np.testing.assert_allclose(generalized.ram(base, xs, eps, plus=True), want, rtol=1e-12, atol=1e-12)


def _slerp_ref(t, a, b):
    ua, ub = a / np.linalg.norm(a), b / np.linalg.norm(b)
    th = np.arccos(np.clip(np.sum(ua * ub), -1, 1))
    return (np.sin((1 - t) * th) * a + np.sin(t * th) * b) / np.sin(th)


def test_spherical_methods(data):
    base, xs = data
    np.testing.assert_allclose(spherical.slerp(0.3, xs[0], xs[1]), _slerp_ref(0.3, xs[0], xs[1]), rtol=1e-12)
    np.testing.assert_allclose(
        spherical.slerp(0.3, xs[0], 2 * xs[0]), 1.3 * xs[0], rtol=1e-12
    )  # colinear: lerp
    # nuslerp: flattened, and row by row (vectors along the last axis)
    np.testing.assert_allclose(
        spherical.nuslerp(0.4, xs[0], xs[1]), _slerp_ref(0.4, xs[0], xs[1]), rtol=1e-10
    )
    rows = np.stack([_slerp_ref(0.4, a, b) for a, b in zip(xs[0], xs[1], strict=True)])
    np.testing.assert_allclose(spherical.nuslerp(0.4, xs[0], xs[1], flatten=False), rows, rtol=1e-10)
    cols = np.stack([_slerp_ref(0.4, a, b) for a, b in zip(xs[0].T, xs[1].T, strict=True)]).T
    np.testing.assert_allclose(
        spherical.nuslerp(0.4, xs[0], xs[1], flatten=False, row_wise=True), cols, rtol=1e-10
    )
    # multislerp of two equal-weight models: on the great circle, at the middle, norm the mean norm
    v = [x - base for x in xs[:2]]
    got = spherical.multislerp(xs[:2], [1.0, 1.0], base) - base
    mid = _slerp_ref(0.5, v[0] / np.linalg.norm(v[0]), v[1] / np.linalg.norm(v[1]))
    want = mid / np.linalg.norm(mid) * (np.linalg.norm(v[0]) + np.linalg.norm(v[1])) / 2
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-9)
    # nearswap: weight t / |b - x| clipped to [0, 1]
    t = 0.2
    w = np.clip(t / np.maximum(np.abs(base - xs[0]), 1e-6), 0, 1)
    np.testing.assert_allclose(spherical.nearswap(base, xs[0], t), w * xs[0] + (1 - w) * base, rtol=1e-12)


def test_arcee_fusion(data):
    base, xs = data
    x = xs[1]

    def sm(v):
        e = np.exp(v - v.max(-1, keepdims=True))
        return e / e.sum(-1, keepdims=True)

    p, q = sm(x) + 1e-8, sm(base) + 1e-8
    imp = np.abs(x - base) * (p * np.log(p / q)).sum(-1, keepdims=True)
    s = np.sort(imp.reshape(-1))
    q1, med, q3 = (s[int(np.floor(f * (s.size - 1)))] for f in (0.25, 0.5, 0.75))
    want = base + (x - base) * (imp >= med + 1.5 * (q3 - q1))
    got = spherical.arcee_fusion(base, x)
    np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-12)
    assert 0 < np.mean(got != base) < 0.5  # an upper-outlier selection: some changes, not most
