"""The shared property table: every aggregation rule passes every row.

Rows: agreement with the float64 numpy reference (random and adversarial
inputs), permutation invariance, output x when every node is x, translation
equivariance, jit == eager (with and without a mask), sharded == unsharded,
and robustness to f attackers under every attack.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np
import numpy_reference as ref
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import consensus
from strategies import attacks

F = 2
N = 11
TAU = 4.0  # centered clipping radius
CLIP = 5.0  # pre-aggregator clip norm
ALPHA = np.linspace(1.0, 3.0, N)


@dataclass(frozen=True)
class Rule:
    make: Callable[[int], consensus.Aggregator]  # n -> aggregator
    reference: Callable  # (X, valid, c) -> output (float64 vector)
    kind: str  # "coord": output in the honest coordinate range; "select": picks nodes; "ball": near honest


def _alpha(n):
    return np.linspace(1.0, 3.0, n)


RULES = {
    "mean": Rule(lambda n: consensus.mean(), lambda X, v, c: ref.mean(X, v), "none"),
    "weighted_mean": Rule(
        lambda n: consensus.weighted_mean(_alpha(n)),
        lambda X, v, c: (X[v] * _alpha(len(v))[v, None]).sum(0) / _alpha(len(v))[v].sum(),
        "none",
    ),
    "median": Rule(lambda n: consensus.median(), lambda X, v, c: ref.median(X, v), "coord"),
    "trimmed_mean": Rule(
        lambda n: consensus.trimmed_mean(F), lambda X, v, c: ref.trimmed_mean(X, F, v), "coord"
    ),
    "krum": Rule(lambda n: consensus.krum(F), lambda X, v, c: ref.krum(X, F, v)[0], "select"),
    "multi_krum": Rule(
        lambda n: consensus.multi_krum(F, 5), lambda X, v, c: ref.multi_krum(X, F, 5, v)[0], "select"
    ),
    "bulyan": Rule(lambda n: consensus.bulyan(F), lambda X, v, c: ref.bulyan(X, F, v)[0], "coord"),
    "geometric_median": Rule(
        lambda n: consensus.geometric_median(max_iter=2000, tol=1e-8),
        lambda X, v, c: ref.geometric_median(X, v),
        "ball",
    ),
    "centered_clipping": Rule(
        lambda n: consensus.centered_clipping(TAU, iterations=3),
        lambda X, v, c: ref.centered_clipping(X, v, c, TAU, 3),
        "ball",
    ),
    "nnm+krum": Rule(
        lambda n: consensus.chain(consensus.nnm(F), consensus.krum(F)),
        lambda X, v, c: ref.krum(ref.nnm(X, F, v), F, v)[0],
        "ball",
    ),
    "clip+mean": Rule(
        lambda n: consensus.chain(consensus.clip(CLIP), consensus.mean()),
        lambda X, v, c: ref.mean(ref.clip(X, c, CLIP), v),
        "none",
    ),
    "nnm+trimmed_mean": Rule(
        lambda n: consensus.process(consensus.trimmed_mean(F), pre=[consensus.nnm(F)]),
        lambda X, v, c: ref.trimmed_mean(ref.nnm(X, F, v), F, v),
        "coord",
    ),
}
NAMES = sorted(RULES)


def make_params(seed=0):
    rng = np.random.default_rng(seed)
    return {
        "dense": {
            "w": rng.standard_normal((7, 5)).astype(np.float32),
            "b": rng.standard_normal(5).astype(np.float32),
        },
        "scale": np.float32(rng.standard_normal()),
    }


def make_nodes(params, n=N, seed=1, spread=0.3, drift=0.2):
    """Honest nodes: params + a common drift + independent noise (fine-tunes of one init)."""
    rng = np.random.default_rng(seed)
    drift_tree = jax.tree.map(lambda p: drift * rng.standard_normal(np.shape(p)).astype(np.float32), params)
    nodes = []
    for _ in range(n):
        nodes.append(
            jax.tree.map(
                lambda p, d: (p + d + spread * rng.standard_normal(np.shape(p))).astype(np.float32),
                params,
                drift_tree,
            )
        )
    return consensus.stack(nodes)


def run(rule_name, stacked, params, mask=None, jit=False):
    agg = RULES[rule_name].make(consensus.num_nodes(stacked))
    state = agg.init(params)
    if jit:
        merged, state = jax.jit(lambda s, st, p, m: agg.update(s, st, p, mask=m))(
            stacked, state, params, mask
        )
    else:
        merged, state = agg.update(stacked, state, params, mask=mask)
    return merged, consensus.get_info(state)


def expected(rule_name, stacked, params, mask=None):
    X = ref.flatten_stacked(stacked)
    c = ref.flatten_tree(params)
    valid = ref.finite_rows(X)
    if mask is not None:
        valid &= np.asarray(mask)
    return RULES[rule_name].reference(X, valid, c)


def assert_close(out_tree, want, scale=1.0, rtol=2e-5):
    got = ref.flatten_tree(out_tree)
    np.testing.assert_allclose(got, want, rtol=rtol, atol=rtol * scale)


@pytest.mark.parametrize("name", NAMES)
def test_matches_float64_reference(name):
    params = make_params()
    stacked = make_nodes(params)
    merged, info = run(name, stacked, params)
    assert_close(merged, expected(name, stacked, params), scale=3.0)
    # Output has the params' structure, shapes and dtypes.
    consensus.check_same_structure([merged], params)
    assert info.valid.shape == (N,) and info.selected.shape == (N,) and info.weights.shape == (N,)


@pytest.mark.parametrize("name", NAMES)
def test_matches_reference_with_outliers_nan_and_mask(name):
    params = make_params(3)
    stacked = make_nodes(params, seed=4)
    # Node 0: NaN in one leaf only; node 6: a far outlier (1e3 away); node 9 masked out.
    stacked = jax.tree.map(lambda x: x, stacked)
    stacked["dense"]["b"] = stacked["dense"]["b"].at[0, 2].set(jnp.nan)
    stacked = jax.tree.map(lambda x: x.at[6].add(1e3), stacked)
    n = N + 4  # more nodes so Bulyan still has m >= 4f + 3 after exclusions
    extra = make_nodes(params, n=4, seed=5)
    stacked = jax.tree.map(lambda a, b: jnp.concatenate([a, b]), stacked, extra)
    mask = np.ones(n, bool)
    mask[9] = False
    merged, info = run(name, stacked, params, mask=mask)
    want_valid = mask.copy()
    want_valid[0] = False
    np.testing.assert_array_equal(np.asarray(info.valid), want_valid)
    assert not np.asarray(info.selected)[~want_valid].any()
    np.testing.assert_allclose(float(np.sum(np.asarray(info.weights)[~want_valid])), 0.0, atol=0)
    scale = 1e3 if RULES[name].kind == "none" else 3.0
    assert_close(merged, expected(name, stacked, params, mask), scale=scale)


@pytest.mark.parametrize("name", [n for n in NAMES if n != "weighted_mean"])
def test_permutation_invariance(name):
    # weighted_mean's weights belong to node positions: see the test below.
    params = make_params(7)
    stacked = make_nodes(params, seed=8)
    perm = np.random.default_rng(0).permutation(N)
    a, _ = run(name, stacked, params)
    b, _ = run(name, jax.tree.map(lambda x: x[perm], stacked), params)
    np.testing.assert_allclose(ref.flatten_tree(a), ref.flatten_tree(b), rtol=1e-5, atol=1e-5)


def test_weighted_mean_permutes_with_its_weights():
    params = make_params(7)
    stacked = make_nodes(params, seed=8)
    perm = np.random.default_rng(0).permutation(N)
    agg = consensus.weighted_mean()
    a, _ = agg.update(stacked, agg.init(params), weights=ALPHA)
    b, _ = agg.update(jax.tree.map(lambda x: x[perm], stacked), agg.init(params), weights=ALPHA[perm])
    np.testing.assert_allclose(ref.flatten_tree(a), ref.flatten_tree(b), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("name", NAMES)
def test_identical_nodes_give_that_node(name):
    params = make_params(9)
    x = jax.tree.map(lambda p: (p + 0.05).astype(p.dtype), params)  # inside every clip radius
    stacked = consensus.broadcast(x, N)
    merged, _ = run(name, stacked, params)
    np.testing.assert_allclose(ref.flatten_tree(merged), ref.flatten_tree(x), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("name", NAMES)
def test_translation_equivariance(name):
    params = make_params(10)
    stacked = make_nodes(params, seed=11)
    shift = jax.tree.map(lambda p: np.full(np.shape(p), 2.5, np.float32), params)
    a, _ = run(name, stacked, params)
    b, _ = run(
        name,
        jax.tree.map(lambda x, t: x + t[None], stacked, shift),
        jax.tree.map(lambda p, t: p + t, params, shift),
    )
    np.testing.assert_allclose(
        ref.flatten_tree(b), ref.flatten_tree(a) + ref.flatten_tree(shift), rtol=1e-5, atol=2e-5
    )


@pytest.mark.parametrize("name", NAMES)
def test_jit_equals_eager_with_and_without_mask(name):
    params = make_params(12)
    stacked = make_nodes(params, n=N + 2, seed=13)
    for mask in (None, np.arange(N + 2) != 4):
        a, ia = run(name, stacked, params, mask=mask)
        b, ib = run(name, stacked, params, mask=None if mask is None else jnp.asarray(mask), jit=True)
        np.testing.assert_allclose(ref.flatten_tree(a), ref.flatten_tree(b), rtol=1e-5, atol=1e-5)
        np.testing.assert_array_equal(np.asarray(ia.selected), np.asarray(ib.selected))
        np.testing.assert_allclose(np.asarray(ia.weights), np.asarray(ib.weights), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("name", NAMES)
def test_sharded_equals_unsharded(name):
    devices = np.array(jax.devices()[:8])
    assert len(devices) == 8, "conftest must give 8 CPU devices"
    mesh = Mesh(devices, ("node",))
    params = make_params(14)
    stacked = make_nodes(params, n=16, seed=15)
    sharded = jax.tree.map(lambda x: jax.device_put(x, NamedSharding(mesh, P("node"))), stacked)
    assert len(jax.tree_util.tree_leaves(sharded)[0].sharding.device_set) == 8
    a, _ = run(name, stacked, params)
    b, _ = run(name, sharded, params)
    np.testing.assert_allclose(ref.flatten_tree(a), ref.flatten_tree(b), rtol=1e-5, atol=1e-5)


ATTACKS = {
    "sign_flip": {"scale": 10.0},
    "gaussian": {"std": 30.0},
    "alie": {},
    "ipm": {"epsilon": 2.0},
    "nonfinite": {},
    "mimic": {},
}
IN_RANGE_ATTACKS = {"alie", "mimic"}  # they hide inside the honest spread by design


@pytest.mark.parametrize("attack", sorted(ATTACKS))
@pytest.mark.parametrize("name", [n for n in NAMES if RULES[n].kind != "none"])
def test_robust_to_f_attackers(name, attack):
    # n = 15 so that Bulyan (m >= 4f + 3) still runs when the 2 NaN attackers are excluded.
    n = 15
    params = make_params(16)
    stacked = make_nodes(params, n=n, seed=17, spread=0.1, drift=1.0)
    byz = np.zeros(n, bool)
    byz[[2, 7]] = True
    attacked = attacks.apply_attack(attack, jax.random.key(0), stacked, byz, params, **ATTACKS[attack])
    merged, info = run(name, attacked, params)
    X = ref.flatten_stacked(stacked)[~byz]
    out = ref.flatten_tree(merged)
    lo, hi = X.min(0), X.max(0)
    kind = RULES[name].kind
    assert np.isfinite(out).all()
    if kind == "select" and attack not in IN_RANGE_ATTACKS:
        assert not np.asarray(info.selected)[byz].any(), "a Byzantine node was selected"
    if kind in ("coord", "select"):
        assert ((out >= lo - 1e-5) & (out <= hi + 1e-5)).all(), "output left the honest range"
    else:  # ball: the attackers move the output by less than the honest spread
        clean = ref.flatten_tree(run(name, attacked, params, mask=~byz)[0])
        radius = np.linalg.norm(X - X.mean(0), axis=1).max()
        if name == "centered_clipping":
            # Each of the 3 steps: f clipped attackers pull by at most f * tau / m.
            radius += 3 * F * TAU / n
        assert np.linalg.norm(out - clean) <= radius
    if attack == "nonfinite":
        assert not np.asarray(info.valid)[byz].any(), "NaN nodes must be reported as invalid"


def test_too_few_valid_nodes_after_excluding_nan_is_a_clear_error():
    params = make_params(16)
    stacked = make_nodes(params, n=N, seed=17)
    byz = np.zeros(N, bool)
    byz[[2, 7]] = True
    attacked = attacks.apply_attack("nonfinite", jax.random.key(0), stacked, byz, params)
    with pytest.raises(consensus.ByzantineToleranceError, match=r"bulyan.*f=2.*n=9 valid.*4f \+ 3 = 11"):
        run("bulyan", attacked, params)


def test_plain_mean_breaks_under_the_same_attacks():
    """The attacks in the table are real: the unprotected mean leaves the honest range."""
    params = make_params(16)
    stacked = make_nodes(params, n=N, seed=17, spread=0.1, drift=1.0)
    byz = np.zeros(N, bool)
    byz[[2, 7]] = True
    X = ref.flatten_stacked(stacked)[~byz]
    for attack in ("sign_flip", "gaussian", "ipm"):
        attacked = attacks.apply_attack(attack, jax.random.key(0), stacked, byz, params, **ATTACKS[attack])
        out = ref.flatten_tree(run("mean", attacked, params)[0])
        assert np.linalg.norm(out - X.mean(0)) > np.linalg.norm(X - X.mean(0), axis=1).max()


def _no_params_centre(name, X, valid):
    """What a rule centres on when it gets no params (only centered clipping and clip depend on it)."""
    if name == "centered_clipping":
        return X[ref.medoid(X, valid)]  # v_0 = the medoid node
    return np.zeros(X.shape[1])  # clip without params clips the raw rows (around 0)


@pytest.mark.parametrize("name", NAMES)
def test_without_params_jit_equals_eager_and_reference(name):
    """Issue 13: no params (the Gram centre is the nodes' mean), eager and under an outer jit.

    Inputs: every node valid (the jit fast paths), a traced mask that allows every node, and a
    mask that drops one node with a NaN in another (the fallbacks: robust centre, finiteness pass).
    """
    params = make_params(18)
    n = N + 4
    clean = make_nodes(params, n=n, seed=19)
    with_nan = jax.tree.map(lambda x: x, clean)
    with_nan["dense"]["w"] = with_nan["dense"]["w"].at[3, 1, 2].set(jnp.nan)
    drop_one = np.arange(n) != 5
    cases = [(clean, None), (clean, np.ones(n, bool)), (with_nan, drop_one)]
    agg = RULES[name].make(n)
    jitted = jax.jit(lambda s, st, m: agg.update(s, st, mask=m))
    for stacked, mask in cases:
        a, sa = agg.update(stacked, agg.init(params), mask=mask)
        b, sb = jitted(stacked, agg.init(params), None if mask is None else jnp.asarray(mask))
        ia, ib = consensus.get_info(sa), consensus.get_info(sb)
        np.testing.assert_allclose(ref.flatten_tree(a), ref.flatten_tree(b), rtol=1e-5, atol=1e-5)
        np.testing.assert_array_equal(np.asarray(ia.valid), np.asarray(ib.valid))
        np.testing.assert_array_equal(np.asarray(ia.selected), np.asarray(ib.selected))
        np.testing.assert_allclose(np.asarray(ia.weights), np.asarray(ib.weights), rtol=1e-5, atol=1e-6)
        X = ref.flatten_stacked(stacked)
        valid = ref.finite_rows(X) & (np.ones(n, bool) if mask is None else mask)
        np.testing.assert_array_equal(np.asarray(ia.valid), valid)
        want = RULES[name].reference(X, valid, _no_params_centre(name, X, valid))
        assert_close(a, want, scale=3.0)
