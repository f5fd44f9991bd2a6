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
