"""DP-FedAvg mechanism: clipping, fixed denominator, noise, sampling, sensitivity checks."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P
from scipy import stats

from consensus import dp, tree
from consensus.base import AggregationInfo, Aggregator, empty_info
from consensus.privacy import PrivacyBudgetExceeded, PrivacyLedger, rdp_epsilon


def make_params(rng, shapes=None):
    shapes = shapes or {"w": (3, 4), "b": (4,)}
    return {k: jnp.asarray(rng.normal(size=s), jnp.float32) for k, s in shapes.items()}


def make_nodes(rng, params, scales):
    """Node params = global params + a random update of the given whole-tree norm."""
    nodes = []
    for s in scales:
        u = {k: rng.normal(size=v.shape) for k, v in params.items()}
        norm = np.sqrt(sum(np.sum(x * x) for x in u.values()))
        nodes.append(
            {k: jnp.asarray(np.asarray(params[k], np.float64) + s * u[k] / norm, jnp.float32) for k in u}
        )
    return nodes


def ref_clipped_mean(nodes, params, clip, m, valid):
    """float64 numpy: sum over valid nodes of clip_C(x_i - p) / m, leaf dict."""
    out = {k: np.zeros(np.shape(v)) for k, v in params.items()}
    for x, ok in zip(nodes, valid, strict=True):
        if not ok:
            continue
        u = {k: np.asarray(x[k], np.float64) - np.asarray(params[k], np.float64) for k in params}
        norm = np.sqrt(sum(np.sum(v * v) for v in u.values()))
        s = min(1.0, clip / norm) if norm > 0 else 1.0
        for k in out:
            out[k] += s * u[k] / m
    return out


def test_clipped_mean_matches_float64_reference_with_nan_and_mask():
    rng = np.random.default_rng(0)
    params = make_params(rng)
    nodes = make_nodes(rng, params, [0.1, 0.5, 2.0, 7.0, 30.0, 1.0])
    nodes[3] = {k: v.at[0].set(jnp.nan) for k, v in nodes[3].items()}  # non-finite: excluded
    mask = jnp.array([True, True, True, True, True, False])  # node 5 refused by the caller
    clip, m = 1.5, 8.0
    agg = dp.dp_fedavg(clip, 0.0, expected_nodes=m, key=0)
    state = agg.init(params)
    new, state = agg.update(tree.stack(nodes), state, params, mask=mask)
    valid = [True, True, True, False, True, False]
    want = ref_clipped_mean(nodes, params, clip, m, valid)
    for k in params:
        np.testing.assert_allclose(np.asarray(new[k]) - np.asarray(params[k]), want[k], atol=2e-6)
    np.testing.assert_array_equal(np.asarray(state.info.valid), valid)
    assert isinstance(state.info, AggregationInfo) and state.info.linear is False
    np.testing.assert_allclose(np.asarray(state.info.weights), np.array(valid) / 4.0, rtol=1e-6)
    assert int(state.dp.participants) == 4
    np.testing.assert_allclose(
        np.asarray(state.dp.clip_scale)[[0, 1, 2, 4]], [1.0, 1.0, 0.75, 0.05], rtol=1e-5
    )


@pytest.mark.parametrize("scale", [1e-4, 0.3, 0.999, 1.0, 1.001, 50.0, 1e6])
def test_clipped_norm_never_exceeds_clip(scale):
    rng = np.random.default_rng(1)
    params = make_params(rng)
    nodes = make_nodes(rng, params, [scale])
    clip = 1.0
    agg = _one_node_agg()
    new, _ = agg.update(tree.stack(nodes), agg.init(params), params)
    got = np.sqrt(
        sum(np.sum((np.asarray(new[k], np.float64) - np.asarray(params[k], np.float64)) ** 2) for k in params)
    )
    assert got <= clip * (1 + 1e-5)
    assert got == pytest.approx(min(scale, clip), rel=1e-4 if scale > 1e-3 else 1e-2)


_ONE = {}


def _one_node_agg():
    # One aggregator (one compilation) shared by the parametrized cases above.
    if "agg" not in _ONE:
        _ONE["agg"] = dp.dp_fedavg(1.0, 0.0, expected_nodes=1.0, key=0)
    return _ONE["agg"]


def test_noise_std_matches_z_clip_over_denominator_and_is_gaussian():
    z, clip, m, n = 1.3, 0.7, 5.0, 3
    params = {"a": jnp.zeros((4000,), jnp.float32), "b": jnp.zeros((40, 50), jnp.float32)}
    stacked = tree.broadcast(params, n)  # every update is zero: the output is pure noise
    agg = dp.dp_fedavg(clip, z, expected_nodes=m, key=0)
    want_std = z * clip / m
    samples = []
    for seed in range(12):
        state = agg.init(params)._replace(key=jax.random.key_data(jax.random.key(seed)))
        new, state = agg.update(stacked, state, params)
        assert float(state.dp.noise_std) == pytest.approx(want_std, rel=1e-6)
        a, b = np.asarray(new["a"], np.float64), np.asarray(new["b"], np.float64).ravel()
        samples.append(np.concatenate([a, b]))
        # Leaves draw from different fold_in keys: no correlation between them.
        assert abs(np.corrcoef(a[:2000], b[:2000])[0, 1]) < 0.1
    x = np.concatenate(samples)  # 72,000 draws
    assert np.std(x) == pytest.approx(want_std, rel=0.015)
    assert abs(np.mean(x)) < 4 * want_std / np.sqrt(x.size)
    # Different keys give different noise; the pooled sample is Gaussian.
    assert not np.allclose(samples[0], samples[1])
    assert stats.kstest(x / want_std, "norm").pvalue > 1e-3


def test_same_key_same_noise_and_state_key_advances():
    rng = np.random.default_rng(2)
    params = make_params(rng)
    stacked = tree.stack(make_nodes(rng, params, [0.5, 3.0, 1.0]))
    agg = dp.dp_fedavg(1.0, 1.0, key=jax.random.key(7))
    s0 = agg.init(params)
    a1, s1 = agg.update(stacked, s0, params)
    b1, t1 = agg.update(stacked, agg.init(params), params)
    for k in params:
        np.testing.assert_array_equal(np.asarray(a1[k]), np.asarray(b1[k]))
    np.testing.assert_array_equal(np.asarray(s1.key), np.asarray(t1.key))
    assert not np.array_equal(np.asarray(s1.key), np.asarray(s0.key))
    a2, _ = agg.update(stacked, s1, params)  # next round: fresh noise
    assert not np.allclose(np.asarray(a2["w"]), np.asarray(a1["w"]))
    # An int seed equals the typed key of that seed.
    c1, _ = dp.dp_fedavg(1.0, 1.0, key=7).update(stacked, dp.dp_fedavg(1.0, 1.0, key=7).init(params), params)
    np.testing.assert_array_equal(np.asarray(c1["w"]), np.asarray(a1["w"]))


@pytest.mark.slow
def test_sharded_params_keep_sharding_and_match_unsharded():
    devices = np.array(jax.devices()[:8])
    if devices.size < 8:
        raise RuntimeError("conftest should provide 8 CPU devices")
    mesh = Mesh(devices, ("model",))
    rng = np.random.default_rng(3)
    params = {
        "w": jnp.asarray(rng.normal(size=(16, 6)), jnp.float32),
        "b": jnp.asarray(rng.normal(size=(8,)), jnp.float32),
    }
    stacked = tree.stack(make_nodes(rng, params, [0.3, 2.0, 5.0, 1.0]))
    agg = dp.dp_fedavg(1.0, 0.8, key=11)
    plain, _ = agg.update(stacked, agg.init(params), params)
    specs = {"w": P("model", None), "b": P("model")}
    sh = {k: NamedSharding(mesh, specs[k]) for k in params}
    p_sh = {k: jax.device_put(v, sh[k]) for k, v in params.items()}
    s_sh = {k: jax.device_put(v, NamedSharding(mesh, P(None, *specs[k]))) for k, v in stacked.items()}
    sharded, _ = agg.update(s_sh, agg.init(p_sh), p_sh)
    for k in params:
        assert sharded[k].sharding.is_equivalent_to(sh[k], params[k].ndim)
        np.testing.assert_allclose(np.asarray(sharded[k]), np.asarray(plain[k]), rtol=1e-6, atol=1e-6)


@pytest.mark.slow
def test_poisson_sampling_rate_and_update_uses_the_announced_sample():
    n, q = 64, 0.25
    assert dp.effective_sampling_rate(q) == q  # 0.25 * 2^32 is an integer
    assert abs(dp.effective_sampling_rate(0.1) - 0.1) < 2.0**-32
    params = {"w": jnp.zeros((3,), jnp.float32)}
    u = np.array([0.1, -0.2, 0.05], np.float32)
    stacked = {"w": jnp.broadcast_to(jnp.asarray(u), (n, 3))}
    agg = dp.dp_fedavg(10.0, 0.0, sampling_rate=q, key=5)
    state = agg.init(params)
    counts = []
    for _ in range(40):
        chosen = np.asarray(dp.round_participants(state, n))
        new, state = agg.update(stacked, state, params)
        np.testing.assert_array_equal(np.asarray(state.info.valid), chosen)
        # Fixed denominator q * n, not the realized count.
        np.testing.assert_allclose(np.asarray(new["w"]), chosen.sum() * u / (q * n), rtol=1e-5)
        counts.append(chosen.sum())
    # 40 * 64 Bernoulli(0.25) draws: mean within 4 standard errors.
    assert abs(np.mean(counts) / n - q) < 4 * np.sqrt(q * (1 - q) / (40 * n))
    assert dp.privacy_event(state).sampling_rate == q


def test_server_optimizer_receives_the_noised_mean_as_pseudo_gradient():
    rng = np.random.default_rng(4)
    params = make_params(rng)
    nodes = make_nodes(rng, params, [0.5, 4.0])
    stacked = tree.stack(nodes)
    want = ref_clipped_mean(nodes, params, 1.0, 2.0, [True, True])
    agg = dp.dp_fedavg(1.0, 0.0, server_optimizer=optax.sgd(0.5, momentum=0.9), key=0)
    state = agg.init(params)
    p1, state = agg.update(stacked, state, params)
    p2, state = agg.update(stacked, state, params)  # same params again: momentum builds up
    for k in params:
        base = np.asarray(params[k], np.float64)
        np.testing.assert_allclose(np.asarray(p1[k]), base + 0.5 * want[k], atol=2e-6)
        np.testing.assert_allclose(np.asarray(p2[k]), base + 0.5 * 1.9 * want[k], atol=2e-6)


@pytest.mark.slow
def test_weighted_mean_caps_weights_and_scales_noise_by_max_weight():
    rng = np.random.default_rng(5)
    params = make_params(rng)
    nodes = make_nodes(rng, params, [0.5, 3.0, 1.0])
    weights = np.array([0.1, 0.6, 0.25])
    w_max = 0.3
    agg = dp.dp_weighted_mean(2.0, 0.0, w_max, key=0)
    new, state = agg.update(
        tree.stack(nodes), agg.init(params), params, weights=jnp.asarray(weights, jnp.float32)
    )
    capped = np.minimum(weights, w_max)
    want = {k: 0.0 for k in params}
    for x, w in zip(nodes, capped, strict=True):
        one = ref_clipped_mean([x], params, 2.0, 1.0, [True])
        want = {k: want[k] + w * one[k] for k in params}
    for k in params:
        np.testing.assert_allclose(np.asarray(new[k]) - np.asarray(params[k]), want[k], atol=2e-6)
    noisy = dp.dp_weighted_mean(2.0, 1.5, w_max, key=0)
    _, s = noisy.update(
        tree.stack(nodes), noisy.init(params), params, weights=jnp.asarray(weights, jnp.float32)
    )
    assert float(s.dp.noise_std) == pytest.approx(1.5 * 2.0 * w_max, rel=1e-6)
    assert noisy.sensitivity(2.0, 3) == pytest.approx(2.0 * w_max)
    with pytest.raises(ValueError, match="weights"):
        noisy.update(tree.stack(nodes), noisy.init(params), params)
    with pytest.raises(ValueError, match="weights"):
        noisy.update(tree.stack(nodes), noisy.init(params), params, weights=jnp.array([0.1, -1.0, 0.2]))


def _fixed_denominator_sum(m):
    """A test rule: sum of (x_i - p) / m over valid nodes, sensitivity C / m."""

    def init(params):
        return None

    def update(stacked, state, params=None, *, mask=None):
        w = mask.astype(jnp.float32) / m
        return tree.combine(stacked, w, params), state

    return Aggregator(init, update, "fixed_sum", sensitivity=lambda c, n: c / m)


@pytest.mark.slow
def test_privatize_generic_rule_equals_dp_fedavg():
    rng = np.random.default_rng(6)
    params = make_params(rng)
    stacked = tree.stack(make_nodes(rng, params, [0.2, 2.0, 9.0, 1.0]))
    ref = dp.dp_fedavg(1.0, 0.9, expected_nodes=4.0, key=3)
    gen = dp.privatize(_fixed_denominator_sum(4.0), 1.0, 0.9, expected_nodes=4.0, key=3)
    a, sa = ref.update(stacked, ref.init(params), params)
    b, sb = gen.update(stacked, gen.init(params), params)
    for k in params:
        np.testing.assert_allclose(np.asarray(b[k]), np.asarray(a[k]), atol=2e-6)
    assert float(sb.dp.noise_std) == pytest.approx(float(sa.dp.noise_std))
    assert dp.dp_sensitivity(ref, 1.0, 4) == pytest.approx(0.25)


def test_rules_without_sensitivity_are_refused():
    median = Aggregator(lambda p: None, lambda s, st, p=None, **k: (s, st), "coordinate_median")
    with pytest.raises(ValueError, match="coordinate_median.*sensitivity"):
        dp.check_dp_compatible(median)
    with pytest.raises(ValueError, match="coordinate_median"):
        dp.dp_sensitivity(median, 1.0, 10)
    with pytest.raises(ValueError, match="coordinate_median"):
        dp.privatize(median, 1.0, 1.0, expected_nodes=10)
    with pytest.raises(TypeError):
        dp.check_dp_compatible("mean")
    dp.check_dp_compatible(dp.dp_fedavg(1.0, 1.0))  # stated sensitivity: accepted


def test_ledger_refuses_the_round_before_it_runs():
    rng = np.random.default_rng(7)
    params = make_params(rng)
    stacked = tree.stack(make_nodes(rng, params, [1.0] * 4))
    agg = dp.dp_fedavg(1.0, 2.0, sampling_rate=0.5, key=0)
    state = agg.init(params)
    ledger = PrivacyLedger(1e-5, budget=rdp_epsilon(2.0, 0.5, 3, 1e-5) + 1e-9)
    ran = 0
    with pytest.raises(PrivacyBudgetExceeded):
        for _ in range(10):
            ledger.spend(dp.privacy_event(state))  # raises before the round runs
            params, state = agg.update(stacked, state, params)
            ran += 1
    assert ran == 3 and int(state.round) == 3 and ledger.rounds == 3
    assert ledger.entries[-1]["clip_norm"] == 1.0 and ledger.entries[-1]["sampling_rate"] == 0.5


@pytest.mark.slow
def test_bfloat16_params_and_jit_of_update():
    rng = np.random.default_rng(8)
    params = {"w": jnp.asarray(rng.normal(size=(8,)), jnp.bfloat16)}
    stacked = tree.stack([{"w": params["w"] + jnp.bfloat16(0.5)}, {"w": params["w"] - jnp.bfloat16(0.25)}])
    agg = dp.dp_fedavg(10.0, 0.0, key=0)
    new, _ = agg.update(stacked, agg.init(params), params)
    assert new["w"].dtype == jnp.bfloat16
    np.testing.assert_allclose(
        np.asarray(new["w"], np.float32), np.asarray(params["w"], np.float32) + 0.125, atol=0.07
    )
    f32 = {"w": params["w"].astype(jnp.float32)}
    st32 = {"w": stacked["w"].astype(jnp.float32)}
    noisy = dp.dp_fedavg(1.0, 1.0, key=2)
    eager, _ = noisy.update(st32, noisy.init(f32), f32)
    jitted, _ = jax.jit(lambda s, st, p: noisy.update(s, st, p))(st32, noisy.init(f32), f32)
    np.testing.assert_allclose(np.asarray(jitted["w"]), np.asarray(eager["w"]), rtol=1e-6)


def test_bad_arguments_raise_clear_errors():
    params = {"w": jnp.zeros((3,), jnp.float32)}
    stacked = tree.broadcast(params, 2)
    agg = dp.dp_fedavg(1.0, 1.0)
    with pytest.raises(ValueError, match="params are required"):
        agg.update(stacked, agg.init(params))
    with pytest.raises(ValueError, match="mask"):
        agg.update(stacked, agg.init(params), params, mask=jnp.ones((3,), bool))
    with pytest.raises(TypeError, match="boolean"):
        agg.update(stacked, agg.init(params), params, mask=jnp.ones((2,), jnp.float32))
    with pytest.raises(ValueError, match="takes no weights"):
        agg.update(stacked, agg.init(params), params, weights=jnp.ones((2,), jnp.float32))
    with pytest.raises(ValueError, match="clip_norm"):
        dp.dp_fedavg(0.0, 1.0)
    with pytest.raises(ValueError, match="noise_multiplier"):
        dp.dp_fedavg(1.0, -0.5)
    with pytest.raises(ValueError, match="sampling_rate"):
        dp.dp_fedavg(1.0, 1.0, sampling_rate=0.0)
    with pytest.raises(ValueError, match="expected_nodes"):
        dp.dp_fedavg(1.0, 1.0, expected_nodes=0)
    with pytest.raises(ValueError, match="max_weight"):
        dp.dp_weighted_mean(1.0, 1.0, 0.0)
    with pytest.raises(ValueError, match="target_quantile"):
        dp.dp_fedavg(1.0, 1.0, adaptive=dp.AdaptiveClipConfig(target_quantile=1.0))
    assert empty_info().weights.shape == (0,)
