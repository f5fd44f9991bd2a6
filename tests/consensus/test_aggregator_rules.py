"""Rule-specific conventions, preconditions, composition and the registry."""

import jax
import jax.numpy as jnp
import numpy as np
import numpy_reference as ref
import optax
import pytest

import consensus
from consensus import registry


def _nodes(n, d=12, seed=0):
    rng = np.random.default_rng(seed)
    params = {"w": rng.standard_normal(d).astype(np.float32)}
    stacked = {"w": (params["w"] + 0.5 * rng.standard_normal((n, d))).astype(np.float32)}
    return params, stacked


@pytest.mark.parametrize(
    "make,n,f,needed",
    [
        (consensus.krum, 6, 2, r"n > 2f \+ 2 = 6"),
        (lambda f: consensus.multi_krum(f, 2), 6, 2, r"n > 2f \+ 2 = 6"),
        (consensus.bulyan, 10, 2, r"n >= 4f \+ 3 = 11"),
        (consensus.trimmed_mean, 4, 2, r"n > 2f = 4"),
        (consensus.nnm, 4, 2, r"n > 2f = 4"),
    ],
)
def test_precondition_errors_name_rule_n_f_and_need(make, n, f, needed):
    params, stacked = _nodes(n)
    agg = make(f)
    with pytest.raises(ValueError, match=rf"f={f}.*n={n}.*needs {needed}"):
        agg.update(stacked, agg.init(params), params)


def test_preconditions_hold_at_the_boundary():
    for make, n in [(consensus.krum, 7), (consensus.bulyan, 11), (consensus.trimmed_mean, 5)]:
        params, stacked = _nodes(n)
        agg = make(2)
        merged, _ = agg.update(stacked, agg.init(params), params)
        assert np.isfinite(np.asarray(merged["w"])).all()


def test_multi_krum_selection_size_precondition():
    params, stacked = _nodes(9)
    agg = consensus.multi_krum(2, 8)
    with pytest.raises(ValueError, match=r"num_selected = 8 <= n - f"):
        agg.update(stacked, agg.init(params), params)


def test_krum_neighbour_count_is_n_minus_f_minus_2_sum():
    """Pin the convention: a configuration where sum over n-f-2 and ByzFL's mean over n-f-1 disagree."""
    # 1-D points: the winner under "sum of n - f - 2 = 2 nearest" is node 0; with 3 nearest it is node 3.
    pts = np.array([0.0, 1.0, 1.05, 2.1, 9.0, 9.5, 20.0], np.float32)[:, None]
    valid = np.ones(7, bool)
    s2 = ref.krum_scores(pts.astype(np.float64), 3, valid)  # n - f - 2 = 2 neighbours
    assert int(np.argmin(s2)) == 1
    agg = consensus.krum(2)  # k = 7 - 2 - 2 = 3 neighbours
    _, state = agg.update({"w": jnp.asarray(pts)}, agg.init(None))
    want = int(np.argmin(ref.krum_scores(pts.astype(np.float64), 2, valid)))
    got = int(np.argmax(np.asarray(consensus.get_info(state).selected)))
    assert got == want
    # Brute force of the documented formula: sum of the 3 smallest squared distances.
    d2 = (pts - pts.T) ** 2
    brute = [np.sort(np.delete(d2[i], i))[:3].sum() for i in range(7)]
    assert got == int(np.argmin(brute))


def test_all_nodes_invalid_is_a_clear_error():
    params, stacked = _nodes(3)
    stacked["w"] = stacked["w"] * np.nan
    with pytest.raises(ValueError, match="mean: no valid node"):
        consensus.mean().update(stacked, consensus.mean().init(params), params)
    with pytest.raises(ValueError, match="median"):
        consensus.median().update(stacked, consensus.median().init(params), params)


def test_linear_rules_report_weights_that_reproduce_the_output():
    params, stacked = _nodes(11, seed=3)
    X = ref.flatten_stacked(stacked)
    c = ref.flatten_tree(params)
    for agg in [
        consensus.mean(),
        consensus.krum(2),
        consensus.multi_krum(2, 4),
        consensus.geometric_median(),
        consensus.centered_clipping(1.0, iterations=2),
        consensus.chain(consensus.nnm(2), consensus.krum(2)),
        consensus.chain(consensus.clip(2.0), consensus.nnm(2), consensus.multi_krum(2, 3)),
    ]:
        merged, state = agg.update(stacked, agg.init(params), params)
        info = consensus.get_info(state)
        assert info.linear, agg.name
        w = np.asarray(info.weights, np.float64)
        np.testing.assert_allclose(
            ref.flatten_tree(merged), c + w @ (X - c), rtol=1e-5, atol=1e-5, err_msg=agg.name
        )


def test_process_with_server_optimizer():
    params, stacked = _nodes(9, seed=4)
    plain = consensus.trimmed_mean(2)
    merged, _ = plain.update(stacked, plain.init(params), params)
    # sgd(1) on the pseudo-gradient is the rule itself (FedAvg's server step).
    fedavg = consensus.process(consensus.trimmed_mean(2), post=optax.sgd(1.0))
    out, _ = fedavg.update(stacked, fedavg.init(params), params)
    np.testing.assert_allclose(np.asarray(out["w"]), np.asarray(merged["w"]), rtol=1e-6, atol=1e-6)
    # sgd(0.5): half-way between params and the merged tree.
    half = consensus.process(consensus.trimmed_mean(2), post=optax.sgd(0.5))
    out, _ = half.update(stacked, half.init(params), params)
    np.testing.assert_allclose(
        np.asarray(out["w"]), 0.5 * (params["w"] + np.asarray(merged["w"])), rtol=1e-6, atol=1e-6
    )
    # Momentum keeps state across rounds (FedAvgM): the second step differs from plain sgd.
    fedavgm = consensus.process(consensus.mean(), post=optax.sgd(1.0, momentum=0.9))
    state = fedavgm.init(params)
    p = params
    for _ in range(2):
        p, state = fedavgm.update(stacked, state, p)
    assert state.post is not None
    with pytest.raises(ValueError, match="needs the current params"):
        fedavgm.update(stacked, fedavgm.init(params), None)


def test_chain_rejects_wrong_order():
    with pytest.raises(TypeError, match="last stage must be an Aggregator"):
        consensus.chain(consensus.krum(1), consensus.nnm(1))
    with pytest.raises(TypeError, match="pre must hold PreAggregators"):
        consensus.process(consensus.mean(), pre=[consensus.krum(1)])


def test_clip_pre_aggregator_bounds_update_norms():
    params, stacked = _nodes(6, seed=5)
    clip = consensus.clip(0.7)
    out, state = clip.update(stacked, clip.init(params), params)
    norms = np.linalg.norm(np.asarray(out["w"], np.float64) - params["w"], axis=1)
    assert (norms <= 0.7 * (1 + 1e-6)).all()
    want = ref.clip(ref.flatten_stacked(stacked), ref.flatten_tree(params), 0.7)
    np.testing.assert_allclose(np.asarray(out["w"]), want, rtol=1e-5, atol=1e-6)


def test_registry_lists_valid_choices():
    valid = r"unknown aggregation rule 'krum2'; valid choices: \[.*'bulyan', .*'krum', "
    with pytest.raises(ValueError, match=valid):
        registry.make("krum2")


def test_bad_arguments():
    with pytest.raises(ValueError, match="num_byzantine must be a non-negative int"):
        consensus.krum(-1)
    with pytest.raises(ValueError, match="clip_radius must be > 0"):
        consensus.centered_clipping(0.0)
    with pytest.raises(ValueError, match="max_norm must be > 0"):
        consensus.clip(-1.0)
    params, stacked = _nodes(4)
    with pytest.raises(ValueError, match=r"mask must have shape \(n,\) = \(4,\)"):
        consensus.mean().update(stacked, consensus.mean().init(params), mask=np.ones(3, bool))


def test_bulyan_under_jit_with_traced_mask_equals_eager():
    params, stacked = _nodes(13, seed=6)
    mask = np.arange(13) != 2
    agg = consensus.bulyan(2)
    a, sa = agg.update(stacked, agg.init(params), params, mask=mask)
    b, sb = jax.jit(lambda s, st, p, m: agg.update(s, st, p, mask=m))(
        stacked, agg.init(params), params, jnp.asarray(mask)
    )
    np.testing.assert_allclose(np.asarray(a["w"]), np.asarray(b["w"]), rtol=1e-6, atol=1e-6)
    np.testing.assert_array_equal(np.asarray(sa.info.selected), np.asarray(sb.info.selected))


@pytest.mark.parametrize("masked", [False, True])
def test_bulyan_with_f_zero_is_the_mean_of_every_valid_node(masked):
    """f = 0: theta = m nodes chosen (the last one has no remaining neighbour, score +inf, and must
    still be picked) and beta = m values kept at every coordinate, so the result is the plain mean
    of the valid nodes. Eager (static count) and under jit (traced count)."""
    params, stacked = _nodes(9, seed=11)
    mask = np.arange(9) != 4 if masked else np.ones(9, bool)
    x = np.asarray(stacked["w"], np.float64)
    agg = consensus.bulyan(0)
    eager, st = agg.update(stacked, agg.init(params), params, mask=mask)
    jitted, sj = jax.jit(lambda s, st, p, m: agg.update(s, st, p, mask=m))(
        stacked, agg.init(params), params, jnp.asarray(mask)
    )
    for out, state in ((eager, st), (jitted, sj)):
        np.testing.assert_array_equal(np.asarray(state.info.selected), mask)
        np.testing.assert_allclose(np.asarray(out["w"]), x[mask].mean(0), rtol=1e-5, atol=1e-6)


@pytest.mark.slow
def test_lazy_pipeline_equals_materialized_composition():
    """process() keeps clip/nnm lazy; the result equals running each stage on materialized stacks."""
    params, stacked = _nodes(11, d=40, seed=7)
    stacked["w"] = jnp.asarray(stacked["w"]).at[3].set(jnp.nan)
    clip, nnm = consensus.clip(2.0), consensus.nnm(2)
    step1, _ = clip.update(stacked, clip.init(params), params)
    step2, _ = nnm.update(step1, nnm.init(params), params)
    for rule in (
        consensus.krum(2),
        consensus.median(),
        consensus.bulyan(1),
        consensus.centered_clipping(0.5),
    ):
        want, _ = rule.update(step2, rule.init(params), params)
        pipe = consensus.process(rule, pre=[clip, nnm])
        got, state = pipe.update(stacked, pipe.init(params), params)
        np.testing.assert_allclose(
            np.asarray(got["w"]), np.asarray(want["w"]), rtol=1e-5, atol=1e-5, err_msg=rule.name
        )
        assert not bool(np.asarray(consensus.get_info(state).valid)[3])

    # A rule that cannot read views gets the view materialized (NaN rows for invalid nodes).
    def plain_update(x, state, params=None, *, mask=None, **extra):
        assert isinstance(x, dict), "a rule without accepts_views must receive a plain stacked tree"
        return consensus.median().update(x, state, params, mask=mask)

    opaque = consensus.Aggregator(consensus.median().init, plain_update, "opaque_median")
    pipe = consensus.process(opaque, pre=[clip, nnm])
    got, _ = pipe.update(stacked, pipe.init(params), params)
    want, _ = consensus.median().update(step2, consensus.median().init(params), params)
    np.testing.assert_allclose(np.asarray(got["w"]), np.asarray(want["w"]), rtol=1e-5, atol=1e-5)


def test_mean_one_pass_path_still_excludes_every_nonfinite_node():
    """mean() checks its result instead of every node; +Inf and -Inf at one coordinate cancel to NaN."""
    params, stacked = _nodes(6, seed=8)
    w = jnp.asarray(stacked["w"]).at[1, 0].set(jnp.inf).at[4, 0].set(-jnp.inf)
    for agg in (consensus.mean(), consensus.weighted_mean(np.arange(1.0, 7.0))):
        merged, state = agg.update({"w": w}, agg.init(params), params)
        valid = np.asarray(consensus.get_info(state).valid)
        np.testing.assert_array_equal(valid, [True, False, True, True, False, True])
        x = np.asarray(stacked["w"], np.float64)[valid]
        alpha = np.arange(1.0, 7.0)[valid] if agg.name == "weighted_mean" else np.ones(4)
        np.testing.assert_allclose(np.asarray(merged["w"]), alpha @ x / alpha.sum(), rtol=1e-6)
    # Large finite values whose sum overflows are not mistaken for non-finite nodes.
    big = jnp.full((3, 4), 2e38, jnp.float32)
    merged, state = consensus.mean().update({"w": big}, consensus.mean().init(None))
    assert np.asarray(consensus.get_info(state).valid).all()
    np.testing.assert_allclose(np.asarray(merged["w"]), 2e38, rtol=1e-6)


@pytest.mark.parametrize("make", [consensus.median, lambda: consensus.trimmed_mean(1)])
def test_coordinatewise_one_pass_path_excludes_a_lone_inf(make):
    """A single +Inf would sort to the end and vanish from a median; it must still exclude its node."""
    params, stacked = _nodes(7, seed=9)
    w = jnp.asarray(stacked["w"]).at[5, 2].set(jnp.inf)
    agg = make()
    merged, state = agg.update({"w": w}, agg.init(params), params)
    valid = np.asarray(consensus.get_info(state).valid)
    np.testing.assert_array_equal(valid, np.arange(7) != 5)
    x = np.asarray(stacked["w"], np.float64)
    want = ref.median(x, valid) if agg.name == "median" else ref.trimmed_mean(x, 1, valid)
    np.testing.assert_allclose(np.asarray(merged["w"]), want, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("n", [16, pytest.param(60, marks=pytest.mark.slow)])
@pytest.mark.parametrize("attack,options", [("alie", {}), ("ipm", {"epsilon": 0.5}), ("sign_flip", {})])
def test_bulyan_with_repeated_attacker_vectors_matches_float64_reference(attack, options, n):
    """Issue 17: f = 3, the attackers send one vector f times; the second stage ties.

    n = 60 keeps theta = 54 rows, above the window network's 16: the chosen rows are gathered
    and the second stage runs by selection.
    """
    from strategies import attacks

    f, d = 3, 3000
    params, stacked = _nodes(n, d=d, seed=21)
    byz = np.zeros(n, bool)
    byz[[1, 6, 11]] = True
    attacked = attacks.apply_attack(attack, jax.random.key(3), stacked, byz, params, **options)
    X = ref.flatten_stacked(attacked)
    agg = consensus.bulyan(f)
    for p in (params, None):
        merged, state = agg.update(attacked, agg.init(params), p)
        want, chosen = ref.bulyan(X, f, np.ones(n, bool))
        assert set(np.flatnonzero(np.asarray(consensus.get_info(state).selected)).tolist()) == chosen
        got = np.asarray(merged["w"], np.float64)
        assert np.linalg.norm(got - want) <= 1e-5 * np.linalg.norm(want)


@pytest.mark.parametrize(
    "make",
    [
        consensus.mean,
        lambda: consensus.weighted_mean(np.arange(1.0, 10.0)),
        consensus.median,
        lambda: consensus.trimmed_mean(2),
    ],
    ids=["mean", "weighted_mean", "median", "trimmed_mean"],
)
def test_under_jit_a_non_finite_node_takes_the_fallback(make):
    """Issue 13: under an outer jit the one-pass result is kept in place unless it is not finite;
    then the finiteness pass runs and the rule equals eager and the float64 reference."""
    params, stacked = _nodes(9, seed=22)
    w = jnp.asarray(stacked["w"]).at[2, 4].set(jnp.nan).at[6, 0].set(-jnp.inf)
    agg = make()
    valid = ~np.isin(np.arange(9), [2, 6])
    x = np.asarray(stacked["w"], np.float64)
    alpha = np.arange(1.0, 10.0)
    want = {
        "mean": x[valid].mean(0),
        "weighted_mean": alpha[valid] @ x[valid] / alpha[valid].sum(),
        "median": ref.median(x, valid),
        "trimmed_mean": ref.trimmed_mean(x, 2, valid),
    }[agg.name]
    jitted = jax.jit(lambda s, st, m: agg.update(s, st, mask=m))
    for data, mask in (({"w": w}, None), ({"w": w}, jnp.ones(9, bool)), (stacked, None)):
        got, state = jitted(data, agg.init(params), mask)
        eager, eager_state = agg.update(data, agg.init(params), mask=mask)
        np.testing.assert_allclose(np.asarray(got["w"]), np.asarray(eager["w"]), rtol=1e-6, atol=1e-6)
        got_valid = np.asarray(consensus.get_info(state).valid)
        np.testing.assert_array_equal(got_valid, np.asarray(consensus.get_info(eager_state).valid))
        if data is stacked:
            assert got_valid.all()
        else:
            np.testing.assert_array_equal(got_valid, valid)
            np.testing.assert_allclose(np.asarray(got["w"]), want, rtol=1e-6, atol=1e-6)


def test_nnm_without_params_is_exact_far_from_the_origin():
    """Issue 13: NNM without params centres its Gram matrix on the nodes' mean (no centre pass).

    Nodes 300 away from the origin, 0.01 apart: a Gram matrix centred on 0 loses the distances
    to float32 cancellation (eps * 300^2 >> 0.01^2), so this checks the centring, against the
    float64 reference and against the same pipeline given params (distances are translation
    invariant, so the mixing, the selection and the output must agree)."""
    rng = np.random.default_rng(23)
    n, f, d = 11, 2, 64
    params = {"w": np.full(d, 300.0, np.float32)}
    w = (300.0 + 0.01 * rng.standard_normal((n, d))).astype(np.float32)
    w[4] += 0.5  # an outlier, so the selection has something to reject
    stacked = {"w": jnp.asarray(w)}
    X = np.asarray(w, np.float64)
    valid = np.ones(n, bool)
    want, i = ref.krum(ref.nnm(X, f, valid), f, valid)
    pipe = consensus.chain(consensus.nnm(f), consensus.krum(f))
    outs = [
        pipe.update(stacked, pipe.init(params)),
        jax.jit(lambda s, st: pipe.update(s, st))(stacked, pipe.init(params)),
        pipe.update(stacked, pipe.init(params), params),
    ]
    # Output values are float32 near 300 (spacing 3e-5); the mixed rows differ by ~3e-3.
    for got, state in outs:
        np.testing.assert_allclose(np.asarray(got["w"], np.float64) - 300.0, want - 300.0, atol=1e-4)
        assert np.flatnonzero(np.asarray(consensus.get_info(state).selected)).tolist() == [i]
    nnm = consensus.nnm(f)
    mixed, _ = nnm.update(stacked, nnm.init(params))
    want_mixed = ref.nnm(X, f, valid) - 300.0
    np.testing.assert_allclose(np.asarray(mixed["w"], np.float64) - 300.0, want_mixed, atol=1e-4)


def test_clip_after_lazy_nnm_without_params_clips_around_zero():
    """A floating view (NNM without params) carries a Gram matrix centred on the mean; clipping
    after it must still measure the norms around 0, as clip without params documents."""
    params, stacked = _nodes(9, d=20, seed=24)
    valid = np.ones(9, bool)
    nnm, clip = consensus.nnm(2), consensus.clip(3.0)
    view, _ = nnm.update(stacked, nnm.init(params), lazy=True)
    clipped, _ = clip.update(view, clip.init(params))
    mixed = ref.nnm(np.asarray(stacked["w"], np.float64), 2, valid)
    want = ref.clip(mixed, np.zeros(20), 3.0)
    np.testing.assert_allclose(np.asarray(clipped["w"]), want, rtol=1e-5, atol=1e-5)
