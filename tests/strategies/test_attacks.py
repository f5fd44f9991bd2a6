"""Attacks: closed forms of each attack, keyed reproducibility, and apply_attack."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import stats

from strategies import attacks


def _honest(h=7, d=300, seed=0):
    rng = np.random.default_rng(seed)
    return {"w": (1.0 + rng.standard_normal((h, d))).astype(np.float32)}


def test_sign_flip_and_ipm_are_scaled_negative_means():
    hon = _honest()
    mu = hon["w"].astype(np.float64).mean(0)
    out = attacks.sign_flip(jax.random.key(0), hon, 3, scale=2.0)
    np.testing.assert_allclose(
        np.asarray(out["w"]), np.broadcast_to(-2.0 * mu, (3, 300)), rtol=1e-5, atol=1e-6
    )
    out = attacks.ipm(jax.random.key(0), hon, 2, epsilon=0.5)
    np.testing.assert_allclose(
        np.asarray(out["w"]), np.broadcast_to(-0.5 * mu, (2, 300)), rtol=1e-5, atol=1e-6
    )


def test_alie_matches_baruch_et_al():
    hon = _honest(h=9)
    n, f = 11, 2
    # s = floor(n / 2 + 1) - f = 4 supporters; z = Phi^-1((n - s) / n) = Phi^-1(7 / 11).
    z = stats.norm.ppf(7 / 11)
    assert attacks.alie_z(n, f) == pytest.approx(z)
    x = hon["w"].astype(np.float64)
    want = x.mean(0) - z * x.std(0)
    out = attacks.alie(jax.random.key(0), hon, f, num_nodes=n)
    np.testing.assert_allclose(np.asarray(out["w"]), np.broadcast_to(want, (2, 300)), rtol=1e-5, atol=1e-5)


def test_gaussian_is_keyed_and_has_the_stated_std():
    hon = _honest(d=20_000)
    a = attacks.gaussian(jax.random.key(1), hon, 2, std=3.0)
    b = attacks.gaussian(jax.random.key(1), hon, 2, std=3.0)
    c = attacks.gaussian(jax.random.key(2), hon, 2, std=3.0)
    np.testing.assert_array_equal(np.asarray(a["w"]), np.asarray(b["w"]))
    assert not np.array_equal(np.asarray(a["w"]), np.asarray(c["w"]))
    assert np.std(np.asarray(a["w"])) == pytest.approx(3.0, rel=0.02)
    assert abs(np.mean(np.asarray(a["w"]))) < 0.05


def test_nonfinite_and_mimic():
    hon = _honest()
    assert np.isnan(np.asarray(attacks.nonfinite(jax.random.key(0), hon, 2)["w"])).all()
    assert np.isposinf(np.asarray(attacks.nonfinite(jax.random.key(0), hon, 1, value=np.inf)["w"])).all()
    out = attacks.mimic(jax.random.key(0), hon, 2, target=3)
    np.testing.assert_array_equal(np.asarray(out["w"]), np.broadcast_to(hon["w"][3], (2, 300)))


def test_apply_attack_replaces_only_byzantine_rows_and_works_on_updates():
    rng = np.random.default_rng(3)
    params = {"w": rng.standard_normal(50).astype(np.float32)}
    stacked = {"w": (params["w"] + 0.1 * rng.standard_normal((6, 50))).astype(np.float32)}
    byz = np.array([False, True, False, False, True, False])
    out = attacks.apply_attack("sign_flip", jax.random.key(0), stacked, byz, params)
    np.testing.assert_array_equal(np.asarray(out["w"])[~byz], stacked["w"][~byz])
    honest_updates = stacked["w"][~byz].astype(np.float64) - params["w"]
    want = params["w"] - honest_updates.mean(0)
    np.testing.assert_allclose(
        np.asarray(out["w"])[byz], np.broadcast_to(want, (2, 50)), rtol=1e-5, atol=1e-5
    )
    assert out["w"].dtype == jnp.float32
    with pytest.raises(ValueError, match="unknown attack 'nope'; valid choices"):
        attacks.apply_attack("nope", jax.random.key(0), stacked, byz)
    with pytest.raises(ValueError, match="every node is Byzantine"):
        attacks.apply_attack("ipm", jax.random.key(0), stacked, np.ones(6, bool))


def _flat_honest(h=9, seed=4):
    rng = np.random.default_rng(seed)
    return {
        "a": (0.5 + rng.standard_normal((h, 4, 3))).astype(np.float32),
        "b": (rng.standard_normal((h, 5)) - 0.2).astype(np.float32),
    }


def _matrix(tree):
    h = tree["a"].shape[0]
    return np.concatenate(
        [np.asarray(tree["a"], np.float64).reshape(h, -1), np.asarray(tree["b"], np.float64)], 1
    )


@pytest.mark.parametrize("perturbation", ["std", "unit", "sign"])
@pytest.mark.parametrize("name", ["min_max", "min_sum"])
def test_min_max_and_min_sum_match_the_float64_bisection(name, perturbation):
    import robust_reference as rref

    hon = _flat_honest()
    H = _matrix(hon)
    out = getattr(attacks, name)(jax.random.key(0), hon, 3, perturbation=perturbation)
    got = _matrix(out)
    want = getattr(rref, name)(H, perturbation=perturbation)
    np.testing.assert_allclose(got, np.broadcast_to(want, got.shape), rtol=1e-4, atol=1e-4)
    # The constraint binds: the update sits on the honest spread's boundary, not inside it.
    dist = np.linalg.norm(H - want, axis=1)
    pair = np.linalg.norm(H[:, None] - H[None], axis=-1)
    if name == "min_max":
        assert dist.max() == pytest.approx(pair.max(), rel=1e-3)
    else:
        assert np.sum(dist**2) == pytest.approx(np.max(np.sum(pair**2, axis=1)), rel=1e-3)
    assert got.dtype == np.float64 and out["a"].dtype == jnp.float32


def test_fltrust_aware_has_the_stated_cosine_and_norm():
    hon = _flat_honest()
    H = _matrix(hon)
    mu = H.mean(0)
    out = _matrix(attacks.fltrust_aware(jax.random.key(0), hon, 2, cosine=0.2))
    for row in out:
        assert row @ mu / (np.linalg.norm(row) * np.linalg.norm(mu)) == pytest.approx(0.2, abs=1e-5)
        assert np.linalg.norm(row) == pytest.approx(np.linalg.norm(mu), rel=1e-5)
    # Its component orthogonal to mu follows -sigma (made orthogonal to mu).
    p = -H.std(0)
    p -= (p @ mu) / (mu @ mu) * mu
    ortho = out[0] - (out[0] @ mu) / (mu @ mu) * mu
    assert ortho @ p / (np.linalg.norm(ortho) * np.linalg.norm(p)) == pytest.approx(1.0, abs=1e-5)
    with pytest.raises(ValueError, match="cosine must be in"):
        attacks.fltrust_aware(jax.random.key(0), hon, 2, cosine=0.0)


def test_alie_at_its_theoretical_z_and_ipm_strengths():
    hon = _honest(h=12)
    x = hon["w"].astype(np.float64)
    n, f = 16, 4
    # s = 16 // 2 + 1 - 4 = 5; z = Phi^-1((16 - 5) / 16).
    z = stats.norm.ppf(11 / 16)
    out = attacks.alie(jax.random.key(0), hon, f, num_nodes=n)
    np.testing.assert_allclose(np.asarray(out["w"])[0], x.mean(0) - z * x.std(0), rtol=1e-5, atol=1e-5)
    for eps in (0.1, 0.5, 2.0):
        out = attacks.ipm(jax.random.key(0), hon, f, epsilon=eps)
        np.testing.assert_allclose(np.asarray(out["w"])[0], -eps * x.mean(0), rtol=1e-5, atol=1e-6)


def test_new_attacks_are_registered_and_run_under_apply_attack():
    from strategies import registry as strategy_registry

    rng = np.random.default_rng(5)
    params = {"w": rng.standard_normal(20).astype(np.float32)}
    stacked = {"w": (params["w"] + 0.1 * rng.standard_normal((8, 20))).astype(np.float32)}
    byz = np.zeros(8, bool)
    byz[-2:] = True
    for name in ("min_max", "min_sum", "fltrust_aware"):
        assert name in attacks.ATTACKS and name in strategy_registry.ATTACKS
        out = jax.jit(lambda s, p, name=name: attacks.apply_attack(name, jax.random.key(0), s, byz, p))(
            stacked, params
        )
        np.testing.assert_array_equal(np.asarray(out["w"])[~byz], stacked["w"][~byz])
        assert np.isfinite(np.asarray(out["w"])).all()
