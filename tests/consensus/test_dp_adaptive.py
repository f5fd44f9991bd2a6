"""Adaptive clipping (Andrew et al. 2021): sign of the update, noise split, convergence."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import special

from consensus import dp, tree

D = 4  # parameter dimension of the synthetic nodes


def nodes_with_norms(rng, norms):
    u = rng.normal(size=(len(norms), D))
    u *= (np.asarray(norms) / np.linalg.norm(u, axis=1))[:, None]
    return {"w": jnp.asarray(u, jnp.float32)}


def test_geometric_update_sign_and_formula():
    # Count noise ~0: the new clip norm is exactly C exp(-lr (unclipped_fraction - gamma)).
    rng = np.random.default_rng(0)
    n, lr, gamma, c0 = 10, 0.3, 0.6, 1.0
    cfg = dp.AdaptiveClipConfig(target_quantile=gamma, learning_rate=lr, count_noise_multiplier=1e-6)
    agg = dp.dp_fedavg(c0, 0.0, adaptive=cfg, key=0)
    params = {"w": jnp.zeros((D,), jnp.float32)}
    for norms, frac in [([0.01] * n, 1.0), ([100.0] * n, 0.0), ([0.5] * 7 + [2.0] * 3, 0.7)]:
        _, state = agg.update(nodes_with_norms(rng, norms), agg.init(params), params)
        want = c0 * np.exp(-lr * (frac - gamma))
        assert float(state.clip_norm) == pytest.approx(want, rel=1e-5)
        assert float(state.dp.unclipped_fraction) == pytest.approx(frac, abs=1e-5)
    # All updates unclipped -> the clip norm was too large -> it shrinks; and vice versa.
    _, small = agg.update(nodes_with_norms(rng, [0.01] * n), agg.init(params), params)
    _, large = agg.update(nodes_with_norms(rng, [100.0] * n), agg.init(params), params)
    assert float(small.clip_norm) < c0 < float(large.clip_norm)


def test_noise_split_between_count_and_sum():
    z, m = 1.0, 20.0
    sigma_b = m / 20.0  # the paper's default
    want_z_sum = (z**-2 - (2 * sigma_b) ** -2) ** -0.5
    params = {"w": jnp.zeros((20_000,), jnp.float32)}
    agg = dp.dp_fedavg(0.5, z, expected_nodes=m, adaptive=dp.AdaptiveClipConfig(), key=4)
    new, state = agg.update(tree.broadcast(params, 3), agg.init(params), params)
    assert float(state.dp.noise_std) == pytest.approx(want_z_sum * 0.5 / m, rel=1e-6)
    assert np.std(np.asarray(new["w"])) == pytest.approx(want_z_sum * 0.5 / m, rel=0.03)
    # The accountant sees the combined multiplier z, not z_sum.
    assert dp.privacy_event(state).noise_multiplier == z
    # sigma_b <= z / 2 leaves nothing for the sum: refused with the reason.
    bad = dp.dp_fedavg(0.5, 3.0, expected_nodes=m, adaptive=dp.AdaptiveClipConfig(count_noise_multiplier=1.0))
    with pytest.raises(ValueError, match="sigma_b"):
        bad.update(tree.broadcast(params, 3), bad.init(params), params)


@pytest.mark.parametrize("gamma", [0.3, 0.8])
@pytest.mark.parametrize("start", [0.01, 100.0])
def test_adaptive_clip_converges_to_target_quantile(gamma, start):
    # Update norms ~ lognormal(0, 0.5) every round; the gamma-quantile is exp(0.5 z_gamma).
    rng = np.random.default_rng(int(gamma * 10) + int(start))
    # From far above, log C falls by at most lr * (1 - gamma) per round: 115 rounds at gamma = 0.8.
    n, rounds = 200, 220
    true_q = float(np.exp(0.5 * special.ndtri(gamma)))
    cfg = dp.AdaptiveClipConfig(target_quantile=gamma, learning_rate=0.2)
    agg = dp.dp_fedavg(start * true_q, 1.0, adaptive=cfg, key=jax.random.key(9))
    params = {"w": jnp.zeros((D,), jnp.float32)}
    state = agg.init(params)
    history = []
    for _ in range(rounds):
        stacked = nodes_with_norms(rng, rng.lognormal(0.0, 0.5, size=n))
        _, state = agg.update(stacked, state, params)
        history.append(float(state.clip_norm))
    history = np.array(history)
    # Never runs away: stays between the start and the target, up to a small overshoot.
    lo, hi = min(start, 1.0) * true_q, max(start, 1.0) * true_q
    assert np.all(history > lo / 1.5) and np.all(history < hi * 1.5)
    tail = history[-40:]
    assert abs(np.log(np.exp(np.mean(np.log(tail))) / true_q)) < 0.08
    # And the realized unclipped fraction at the final clip norm is the target.
    check = rng.lognormal(0.0, 0.5, size=200_000)
    assert np.mean(check <= np.exp(np.mean(np.log(tail)))) == pytest.approx(gamma, abs=0.04)
