"""Per-node weights of the merge methods, and DARE's merges, against mergekit's formulas in numpy float64.

mergekit is not a dependency: its definitions (``linear``, ``task_arithmetic``, ``ties``,
``dare_linear``, ``dare_ties``, ``karcher``) are written out here on small inputs.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import consensus

W = np.array([0.5, 0.3, 0.2])


def _inputs(n: int = 3, d: int = 40, seed: int = 0):
    rng = np.random.default_rng(seed)
    base = rng.normal(size=(d,)).astype(np.float32)
    xs = (base + rng.normal(size=(n, d))).astype(np.float32)
    return xs.astype(np.float64), base.astype(np.float64)  # float32 values: exact task vectors


def _run(rule, xs, base=None, jit=False, key=None):
    stacked = {"w": jnp.asarray(xs, jnp.float32)}
    params = None if base is None else {"w": jnp.asarray(base, jnp.float32)}
    extra = {} if key is None else {"key": key}

    def f(s, p):
        return rule.update(s, rule.init(p if p is not None else {"w": s["w"][0]}), p, **extra)[0]["w"]

    return np.asarray((jax.jit(f) if jit else f)(stacked, params), np.float64)


def ref_linear(xs, w, normalize=True):
    out = (w[:, None] * xs).sum(0)
    return out / w.sum() if normalize else out


def ref_task_arithmetic(xs, base, w, normalize=False, lam=1.0):
    mixed = (w[:, None] * (xs - base)).sum(0)
    if normalize:
        mixed /= w.sum() if abs(w.sum()) >= 1e-8 else 1.0
    return base + lam * mixed


def ref_magnitude(delta, density):
    k = int(density * delta.size)
    if density >= 1:
        return delta
    mask = np.zeros_like(delta)
    mask[np.argsort(-np.abs(delta), kind="stable")[:k]] = 1
    return delta * mask


def ref_gta_ties(deltas, base, w, normalize=True, lam=1.0):
    """mergekit's generalized task arithmetic with the "sum" sign consensus, on given (sparsified) deltas."""
    weighted = w[:, None] * deltas
    majority = np.where(weighted.sum(0) >= 0, 1.0, -1.0)
    mask = np.sign(weighted) == majority
    mixed = (weighted * mask).sum(0)
    if normalize:
        div = (w[:, None] * mask).sum(0)
        mixed /= np.where(div == 0, 1.0, div)
    return base + lam * mixed


def ref_karcher(xs, w, max_iter=100, tol=1e-6):
    norms = np.linalg.norm(xs, axis=1)
    units = xs / norms[:, None]
    a = w / w.sum()
    u = (a[:, None] * units).sum(0)
    u /= np.linalg.norm(u)
    for _ in range(max_iter):
        t = np.zeros_like(u)
        for ai, ui in zip(a, units, strict=True):
            dot = np.clip(u @ ui, -1, 1)
            th = np.arccos(dot)
            if th > 1e-12:
                t += ai * th / np.sin(th) * (ui - dot * u)
        nt = np.linalg.norm(t)
        if nt < tol:
            break
        u = np.cos(nt) * u + np.sin(nt) * t / nt
        u /= np.linalg.norm(u)
    return u * (a * norms).sum()


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
@pytest.mark.parametrize("normalize", [True, False])
def test_linear_is_mergekits_weighted_sum(normalize, jit):
    xs, _ = _inputs()
    got = _run(consensus.linear(list(W * 2), normalize=normalize), xs, jit=jit)
    np.testing.assert_allclose(got, ref_linear(xs, W * 2, normalize), rtol=1e-5, atol=1e-5)


def test_linear_default_is_the_mean_and_leaves_invalid_nodes_out():
    xs, _ = _inputs()
    np.testing.assert_allclose(_run(consensus.linear(), xs), xs.mean(0), rtol=1e-5, atol=1e-6)
    bad = xs.copy()
    bad[1, 3] = np.nan
    got = _run(consensus.linear(list(W)), bad)
    np.testing.assert_allclose(got, ref_linear(xs[[0, 2]], W[[0, 2]]), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
@pytest.mark.parametrize("normalize", [False, True])
def test_task_arithmetic_weights_under_jit(normalize, jit):
    """Factory weights used to crash under jit (a traced validity check); now they are host constants."""
    xs, base = _inputs()
    rule = consensus.task_arithmetic(0.7, weights=list(W), normalize=normalize)
    got = _run(rule, xs, base, jit=jit)
    np.testing.assert_allclose(got, ref_task_arithmetic(xs, base, W, normalize, 0.7), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
@pytest.mark.parametrize(("density", "normalize"), [(1.0, True), (0.3, True), (0.3, False)])
def test_ties_weighted_is_mergekits(density, normalize, jit):
    xs, base = _inputs()
    deltas = np.stack([ref_magnitude(x - base, density) for x in xs])
    want = ref_gta_ties(deltas, base, W, normalize)
    got = _run(consensus.ties(density, weights=list(W), normalize=normalize), xs, base, jit=jit)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_karcher_mean_weighted_under_jit():
    xs, _ = _inputs()
    got = _run(consensus.karcher_mean(weights=list(W)), xs, jit=True)
    np.testing.assert_allclose(got, ref_karcher(xs, W), rtol=1e-4, atol=1e-4)


def test_weights_of_the_wrong_length_are_refused():
    xs, base = _inputs()
    with pytest.raises(ValueError, match="one per input"):
        _run(consensus.task_arithmetic(weights=[1.0, 2.0]), xs, base)
    with pytest.raises(ValueError, match="non-negative"):
        consensus.ties(0.5, weights=[1.0, -1.0, 0.0])
    with pytest.raises(ValueError, match="true or false"):
        consensus.linear(normalize="false")


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_dare_linear_drops_and_rescales_by_one_over_density(jit):
    """One node: every output entry is base, or base + w * d / density (mergekit's DARE with 1/p rescale)."""
    xs, base = _inputs(n=1, d=4000)
    density, w = 0.4, 0.7
    got = _run(consensus.dare_linear(density, weights=[w]), xs, base, jit=jit, key=jax.random.key(1))
    d = xs[0] - base
    kept = ~np.isclose(got, base, rtol=0, atol=1e-6)
    np.testing.assert_allclose(got[kept], (base + w * d / density)[kept], rtol=1e-5, atol=1e-5)
    assert abs(kept.mean() - density) < 0.04  # kept with probability density


def test_dare_linear_and_dare_ties_at_density_1_are_task_arithmetic_and_ties():
    xs, base = _inputs()
    key = jax.random.key(0)
    got = _run(consensus.dare_linear(1.0, weights=list(W)), xs, base, key=key)
    np.testing.assert_allclose(got, ref_task_arithmetic(xs, base, W), rtol=1e-5, atol=1e-5)
    for normalize in (False, True):
        rule = consensus.dare_ties(1.0, weights=list(W), normalize=normalize)
        want = ref_gta_ties(xs - base, base, W, normalize)
        np.testing.assert_allclose(_run(rule, xs, base, key=key), want, rtol=1e-5, atol=1e-5)


def test_dare_ties_equals_the_ties_consensus_of_its_own_dropped_deltas():
    """The random mask is the library's own; given it, dare_ties is mergekit's sign consensus."""
    xs, base = _inputs(d=500)
    key, density = jax.random.key(5), 0.5
    drop = consensus.dare(density)
    stacked = {"w": jnp.asarray(xs, jnp.float32)}
    params = {"w": jnp.asarray(base, jnp.float32)}
    rows, _ = drop.update(stacked, None, params, key=key)
    deltas = np.asarray(rows["w"], np.float64) - base
    for normalize in (False, True):
        want = ref_gta_ties(deltas, base, W, normalize)
        rule = consensus.dare_ties(density, weights=list(W), normalize=normalize)
        got = _run(rule, xs, base, key=key)
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_dare_l1_rescale_keeps_each_tensors_l1_norm():
    xs, base = _inputs(n=1, d=2000)
    got = _run(consensus.dare_linear(0.3, rescale="l1"), xs, base, key=jax.random.key(2))
    np.testing.assert_allclose(np.abs(got - base).sum(), np.abs(xs[0] - base).sum(), rtol=1e-4)


def test_dare_merges_need_a_key_and_a_base():
    xs, base = _inputs()
    with pytest.raises(ValueError, match="randomized"):
        _run(consensus.dare_ties(0.5), xs, base)
    with pytest.raises(ValueError, match="base"):
        _run(consensus.dare_linear(0.5), xs, None, key=jax.random.key(0))
