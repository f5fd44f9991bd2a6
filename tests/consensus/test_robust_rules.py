"""Server-guided and adaptive rules (FLTrust, server MoNNA, ARC, DnC, SignGuard, CAF, SMEA, Meamed,
bucketing): float64 references, jit == eager, permutation invariance where it holds, identical nodes,
f outliers at 1e6, NaN rows and masks, and the stated preconditions."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np
import numpy_reference as ref
import pytest
import robust_reference as rref

import consensus
from consensus import aggregators as agg
from consensus import registry
from consensus.aggregators._robust import sample_coordinates

F = 2
N = 11
KEY = jax.random.key(42)
DNC_DIM = 20  # < the 41 coordinates of the test params: the subsets are really random
SG_DIM = 30


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
    nodes = [
        jax.tree.map(
            lambda p, d: (p + d + spread * rng.standard_normal(np.shape(p))).astype(np.float32),
            params,
            drift_tree,
        )
        for _ in range(n)
    ]
    return consensus.stack(nodes)


def server_update_for(params, seed=99, scale=0.4):
    rng = np.random.default_rng(seed)
    return jax.tree.map(lambda p: (scale * rng.standard_normal(np.shape(p))).astype(np.float32), params)


def _dnc_coords(total):
    return [np.asarray(sample_coordinates(k, total, DNC_DIM)) for k in jax.random.split(KEY, 2)]


def _sg_coords(total):
    return np.asarray(sample_coordinates(KEY, total, SG_DIM))


def _gm(X, v):
    return ref.geometric_median(X, v)


@dataclass(frozen=True)
class Rule:
    make: Callable[[], consensus.Aggregator]
    reference: Callable  # (X, valid, c, g) -> float64 vector
    kind: str  # "coord": in the honest coordinate range; "ball": near the honest mean; "server": FLTrust
    permutation_invariant: bool = True


RULES = {
    "fltrust": Rule(agg.fltrust, lambda X, v, c, g: rref.fltrust(X, c, g, v), "server"),
    "server_monna": Rule(
        lambda: agg.server_monna(F), lambda X, v, c, g: rref.server_monna(X, c, g, F, v), "ball"
    ),
    "arc+meamed": Rule(
        lambda: consensus.chain(agg.arc(F), agg.meamed(F)),
        lambda X, v, c, g: rref.meamed(rref.arc(X, c, F, v), F, v),
        "ball",
    ),
    "dnc": Rule(
        lambda: agg.dnc(F, subsample_dim=DNC_DIM, num_iters=2),
        lambda X, v, c, g: rref.dnc(X, F, v, _dnc_coords(X.shape[1]))[0],
        "ball",
    ),
    "signguard": Rule(
        lambda: agg.signguard(subsample_dim=SG_DIM),
        lambda X, v, c, g: rref.signguard(X, c, v, np.asarray(sample_coordinates(KEY, X.shape[1], SG_DIM)))[
            0
        ],
        "ball",
    ),
    "caf": Rule(lambda: agg.caf(F), lambda X, v, c, g: rref.caf(X, F, v), "ball"),
    "smea": Rule(lambda: agg.smea(F), lambda X, v, c, g: rref.smea(X, F, v)[0], "ball"),
    "meamed": Rule(lambda: agg.meamed(F), lambda X, v, c, g: rref.meamed(X, F, v), "coord"),
    "bucketing": Rule(
        lambda: agg.bucketing(1, bucket_size=2),
        lambda X, v, c, g: rref.bucketing(X, v, np.asarray(jax.random.permutation(KEY, len(v))), 2, _gm),
        "ball",
        permutation_invariant=False,  # a keyed random permutation forms the buckets
    ),
}
NAMES = sorted(RULES)


def run(name, stacked, params, g, mask=None, jit=False):
    rule = RULES[name].make()
    state = rule.init(params)
    kw = {"key": KEY, "server_update": g}
    if jit:
        merged, state = jax.jit(
            lambda s, st, p, m, gg: rule.update(s, st, p, mask=m, key=KEY, server_update=gg)
        )(stacked, state, params, mask, g)
    else:
        merged, state = rule.update(stacked, state, params, mask=mask, **kw)
    return merged, consensus.get_info(state)


def expected(name, stacked, params, g, mask=None):
    X = ref.flatten_stacked(stacked)
    valid = ref.finite_rows(X)
    if mask is not None:
        valid &= np.asarray(mask)
    return RULES[name].reference(X, valid, ref.flatten_tree(params), ref.flatten_tree(g))


def assert_close(tree, want, scale=3.0, rtol=2e-5):
    np.testing.assert_allclose(ref.flatten_tree(tree), want, rtol=rtol, atol=rtol * scale)


@pytest.mark.parametrize("name", NAMES)
def test_matches_float64_reference(name):
    params = make_params()
    stacked = make_nodes(params)
    g = server_update_for(params)
    merged, info = run(name, stacked, params, g)
    assert_close(merged, expected(name, stacked, params, g))
    consensus.check_same_structure([merged], params)
    assert info.valid.shape == (N,) and info.weights.shape == (N,)


@pytest.mark.parametrize("name", NAMES)
def test_nan_rows_and_masked_nodes_are_excluded(name):
    params = make_params(3)
    stacked = make_nodes(params, n=N + 2, seed=4)
    stacked["dense"]["b"] = stacked["dense"]["b"].at[0, 2].set(jnp.nan)
    mask = np.ones(N + 2, bool)
    mask[9] = False
    g = server_update_for(params, seed=5)
    merged, info = run(name, stacked, params, g, mask=mask)
    want_valid = mask.copy()
    want_valid[0] = False
    np.testing.assert_array_equal(np.asarray(info.valid), want_valid)
    assert not np.asarray(info.selected)[~want_valid].any()
    assert float(np.abs(np.asarray(info.weights)[~want_valid]).sum()) == 0.0
    assert_close(merged, expected(name, stacked, params, g, mask))


@pytest.mark.parametrize("name", NAMES)
def test_jit_equals_eager_with_and_without_mask(name):
    params = make_params(12)
    stacked = make_nodes(params, n=N + 2, seed=13)
    g = server_update_for(params, seed=14)
    for mask in (None, np.arange(N + 2) != 4):
        a, ia = run(name, stacked, params, g, mask=mask)
        b, ib = run(name, stacked, params, g, mask=None if mask is None else jnp.asarray(mask), jit=True)
        np.testing.assert_allclose(ref.flatten_tree(a), ref.flatten_tree(b), rtol=1e-5, atol=1e-5)
        np.testing.assert_array_equal(np.asarray(ia.selected), np.asarray(ib.selected))
        np.testing.assert_allclose(np.asarray(ia.weights), np.asarray(ib.weights), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("name", [n for n in NAMES if RULES[n].permutation_invariant])
def test_permutation_invariance(name):
    params = make_params(7)
    stacked = make_nodes(params, seed=8)
    g = server_update_for(params, seed=9)
    perm = np.random.default_rng(0).permutation(N)
    a, _ = run(name, stacked, params, g)
    b, _ = run(name, jax.tree.map(lambda x: x[perm], stacked), params, g)
    np.testing.assert_allclose(ref.flatten_tree(a), ref.flatten_tree(b), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name", NAMES)
def test_identical_nodes_give_that_node(name):
    params = make_params(9)
    x = jax.tree.map(lambda p: (p + 0.05).astype(p.dtype), params)
    stacked = consensus.broadcast(x, N)
    # The server agrees with the nodes (FLTrust rescales every update to the server's norm).
    g = jax.tree.map(lambda a, p: (a - p).astype(p.dtype), x, params)
    merged, _ = run(name, stacked, params, g)
    np.testing.assert_allclose(ref.flatten_tree(merged), ref.flatten_tree(x), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("name", NAMES)
def test_f_outliers_at_1e6_do_not_move_the_output(name):
    n = 15
    params = make_params(16)
    stacked = make_nodes(params, n=n, seed=17, spread=0.1, drift=1.0)
    byz = np.zeros(n, bool)
    byz[[2, 7]] = True
    attacked = jax.tree.map(lambda x: x.at[np.flatnonzero(byz)].add(1e6), stacked)
    # The server's update points the way the honest nodes went (its root set is like theirs).
    X = ref.flatten_stacked(stacked)[~byz]
    c = ref.flatten_tree(params)
    g = jax.tree.map(
        lambda m, p: (m - p).astype(np.float32), jax.tree.map(lambda x: x[~byz].mean(0), stacked), params
    )
    merged, info = run(name, attacked, params, g)
    out = ref.flatten_tree(merged)
    assert np.isfinite(out).all()
    kind = RULES[name].kind
    if kind == "coord":
        assert ((out >= X.min(0) - 1e-5) & (out <= X.max(0) + 1e-5)).all()
    elif kind == "server":  # a convex combination of vectors of the server's norm
        assert np.linalg.norm(out - c) <= np.linalg.norm(ref.flatten_tree(g)) * (1 + 1e-5)
    else:
        radius = np.linalg.norm(X - X.mean(0), axis=1).max()
        assert np.linalg.norm(out - X.mean(0)) <= radius
    if info.linear and name != "arc+meamed":
        assert float(np.abs(np.asarray(info.weights)[byz]).sum()) < 1e-6, "an outlier at 1e6 kept weight"


def test_fltrust_weights_follow_the_cosine_and_ignore_opposed_nodes():
    params = {"w": np.zeros(3, np.float32)}
    stacked = {"w": np.array([[2.0, 0, 0], [0, 1.0, 0], [-1.0, 0, 0], [1.0, 1.0, 0]], np.float32)}
    g = {"w": np.array([3.0, 0, 0], np.float32)}
    merged, state = agg.fltrust().update(stacked, agg.fltrust().init(params), params, server_update=g)
    info = consensus.get_info(state)
    # Trust: 1, 0, 0 (negative cosine), 1/sqrt(2); each update rescaled to norm 3.
    ts = np.array([1.0, 0.0, 0.0, 2**-0.5])
    want = (ts[0] * np.array([3.0, 0, 0]) + ts[3] * 3 * np.array([1.0, 1, 0]) / 2**0.5) / ts.sum()
    np.testing.assert_allclose(np.asarray(merged["w"]), want, rtol=1e-6)
    np.testing.assert_array_equal(np.asarray(info.selected), [True, False, False, True])


def test_arc_clips_the_right_number_of_largest_updates():
    # m = 10, f = 2: k = floor(2 * 2 * 8 / 10) = 3 largest clipped to the 4th largest norm (7).
    norms = np.arange(1.0, 11.0)
    stacked = {"w": np.stack([[v, 0.0] for v in norms]).astype(np.float32)}
    params = {"w": np.zeros(2, np.float32)}
    out, state = agg.arc(2).update(stacked, agg.arc(2).init(params), params)
    np.testing.assert_allclose(np.asarray(out["w"])[:, 0], np.minimum(norms, 7.0), rtol=1e-6)
    np.testing.assert_allclose(np.asarray(state.scale), np.minimum(1.0, 7.0 / norms), rtol=1e-6)


def test_meamed_drops_f_values_from_the_farther_side():
    x = np.array([[0.0], [1.0], [2.0], [3.0], [100.0]], np.float32)
    merged, _ = agg.meamed(1).update({"w": x}, agg.meamed(1).init(None))
    # Median 2; the 4 values nearest it are 0, 1, 2, 3 (a trimmed mean would drop 0 too).
    np.testing.assert_allclose(np.asarray(merged["w"]), [1.5])


def test_meamed_exact_distance_tie_keeps_the_smaller_value():
    # Median 0; -2 and 2 are equally far and compete for the last of m - f = 3 places.
    x = np.array([[2.0], [-9.0], [1.0], [0.0], [-2.0]], np.float32)
    merged, _ = agg.meamed(2).update({"w": x}, agg.meamed(2).init(None))
    np.testing.assert_allclose(np.asarray(merged["w"]), [(-2.0 + 0.0 + 1.0) / 3], rtol=1e-6)
    assert rref.meamed(x.astype(np.float64), 2, np.ones(5, bool))[0] == pytest.approx((-2.0 + 0.0 + 1.0) / 3)


@pytest.mark.parametrize("jitted", [False, True])
@pytest.mark.parametrize("n,f,copies_at", [(10, 4, "low"), (10, 4, "high"), (13, 3, "mid"), (16, 5, "low")])
def test_meamed_with_repeated_attacker_values(jitted, n, f, copies_at):
    """f rows carry one attacker vector (as ALIE and IPM send): the kernel keeps the m - f values
    nearest the median, as the float64 reference that sorts by distance does (issue 17's tie pattern:
    comparing the windows' farther ends left the attackers' window tied with the right one)."""
    d = 2000
    rng = np.random.default_rng(n + f)
    x = rng.standard_normal((n, d)).astype(np.float32)
    honest = np.sort(x[f:], axis=0)
    attacker = {
        "low": honest[0] - 0.3 * rng.random(d, dtype=np.float32),
        "high": honest[-1] + 0.3 * rng.random(d, dtype=np.float32),
        "mid": honest[len(honest) // 2 - 1],
    }[copies_at]
    x[:f] = attacker
    valid = np.ones(n, bool)
    if n == 16:
        x[7] = np.nan  # a dropped (non-finite) node: its garbage must not leak
        valid[7] = False
    want = rref.meamed(x.astype(np.float64), f, valid)
    rule = agg.meamed(f)
    update = jax.jit(rule.update) if jitted else rule.update
    merged, _ = update({"w": jnp.asarray(x)}, rule.init(None))
    np.testing.assert_allclose(np.asarray(merged["w"]), want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("jitted", [False, True])
@pytest.mark.parametrize("bad", [np.inf, -np.inf, np.nan])
def test_meamed_one_pass_falls_back_when_one_entry_is_not_finite(jitted, bad):
    """The one-pass path (the kernel poisons the output with a row's NaN/Inf) must drop a node
    whose only bad entry is one coordinate, as the float64 reference does."""
    rng = np.random.default_rng(3)
    x = rng.standard_normal((16, 301)).astype(np.float32)
    x[5, 200] = bad
    valid = np.ones(16, bool)
    valid[5] = False
    rule = agg.meamed(4)
    update = jax.jit(rule.update) if jitted else rule.update
    merged, state = update({"w": jnp.asarray(x)}, rule.init(None))
    want = rref.meamed(x.astype(np.float64), 4, valid)
    np.testing.assert_allclose(np.asarray(merged["w"]), want, rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(np.asarray(state.info.valid), valid)


@pytest.mark.parametrize("jitted", [False, True])
@pytest.mark.parametrize("inner", ["krum", "median", "geometric_median"])
def test_bucketing_inner_rules_with_an_empty_bucket(jitted, inner):
    """Gram-space inner rules (Krum, geometric median: the bucket means stay a lazy view) and
    coordinate-wise ones (median: the means are written) equal the float64 reference, which drops
    a bucket whose members are all invalid (here both masked) and averages a NaN node's partner alone."""
    n, s = 12, 2
    rng = np.random.default_rng(11)
    x = rng.standard_normal((n, 40)).astype(np.float32)
    perm = np.asarray(jax.random.permutation(KEY, n))
    a, b = perm[2], perm[3]  # the second bucket: both masked, so it is empty
    mask = np.ones(n, bool)
    mask[[a, b]] = False
    x[perm[6], 5] = np.nan  # a NaN node in the fourth bucket, whose other member stays
    valid = mask.copy()
    valid[perm[6]] = False
    refs = {
        "krum": lambda M, v: ref.krum(M, 1, v)[0],
        "median": lambda M, v: ref.median(M, v),
        "geometric_median": _gm,
    }
    want = rref.bucketing(x.astype(np.float64), valid, perm, s, refs[inner])
    rule = agg.bucketing(1, bucket_size=s, inner=inner)
    params = {"w": jnp.zeros(40, jnp.float32)}

    def go(st, m):
        return rule.update(st, rule.init(params), params, mask=m, key=KEY)

    merged, state = (jax.jit(go) if jitted else go)({"w": jnp.asarray(x)}, jnp.asarray(mask))
    np.testing.assert_allclose(np.asarray(merged["w"]), want, rtol=2e-4, atol=2e-5)
    info = consensus.get_info(state)
    np.testing.assert_array_equal(np.asarray(info.valid), valid)
    assert float(np.asarray(info.weights)[[a, b, perm[6]]].sum()) == 0.0


def test_smea_picks_the_subset_without_the_spread_out_pair():
    rng = np.random.default_rng(0)
    honest = 0.1 * rng.standard_normal((7, 5))
    far = np.array([[3.0, 0, 0, 0, 0], [0, -3.0, 0, 0, 0]])
    X = np.concatenate([honest[:3], far[:1], honest[3:], far[1:]]).astype(np.float32)
    merged, state = agg.smea(2).update({"w": X}, agg.smea(2).init(None))
    info = consensus.get_info(state)
    np.testing.assert_array_equal(np.asarray(info.selected), [True] * 3 + [False] + [True] * 4 + [False])
    np.testing.assert_allclose(np.asarray(merged["w"]), honest.mean(0), rtol=1e-5, atol=1e-6)


def test_randomized_and_server_rules_say_what_they_need():
    params = make_params()
    stacked = make_nodes(params)
    for name, factory in [
        ("dnc", lambda: agg.dnc(F)),
        ("signguard", agg.signguard),
        ("bucketing", lambda: agg.bucketing(1)),
    ]:
        rule = factory()
        with pytest.raises(ValueError, match=rf"{name}: is randomized; pass a jax.random key"):
            rule.update(stacked, rule.init(params), params)
    for rule in (agg.fltrust(), agg.server_monna(F)):
        with pytest.raises(ValueError, match="needs the server's update as update"):
            rule.update(stacked, rule.init(params), params)
        with pytest.raises(ValueError, match="needs the current global params"):
            rule.update(stacked, rule.init(params), server_update=params)
        bad = jax.tree.map(lambda p: np.full(np.shape(p), np.nan, np.float32), params)
        with pytest.raises(ValueError, match="server_update holds NaN or Inf"):
            rule.update(stacked, rule.init(params), params, server_update=bad)
    assert registry.RULES["fltrust"].needs == {"params", "server_update"}
    assert registry.RULES["dnc"].needs == {"key"}


def test_bucketing_refuses_when_too_many_buckets_can_be_bad():
    # 16 nodes in buckets of 2 are 8 buckets; 4 Byzantine nodes can spoil 4 of them: no majority.
    assert registry.RULES["bucketing"].requirement(16, 2) is None
    need = registry.RULES["bucketing"].requirement(16, 4)
    assert need is not None and "too many buckets can be bad" in need
    params = {"w": np.zeros(3, np.float32)}
    stacked = {"w": np.zeros((16, 3), np.float32)}
    rule = agg.bucketing(4)
    with pytest.raises(
        consensus.ByzantineToleranceError, match=r"bucketing: .*f=4.*n=16.*8 buckets > 2f = 8"
    ):
        rule.update(stacked, rule.init(params), params, key=KEY)
    # The inner rule's precondition on the buckets counts too: 8 buckets > 2f = 6, but Krum needs B > 2f + 2.
    with pytest.raises(consensus.ByzantineToleranceError, match="the inner krum on the buckets"):
        agg.bucketing(3, inner="krum").update(stacked, rule.init(params), params, key=KEY)


@pytest.mark.parametrize(
    "name", ["fltrust", "server_monna", "arc", "dnc", "signguard", "caf", "smea", "meamed", "bucketing"]
)
def test_registry_preconditions_match_the_rules(name):
    spec = registry.RULES[name]
    params = {"w": np.zeros(2, np.float32)}
    kw = {"key": KEY, "server_update": {"w": np.ones(2, np.float32)}}
    rng = np.random.default_rng(0)
    for n, f in [(5, 2), (4, 2), (9, 4), (8, 4), (3, 1), (2, 1)]:
        rule = spec.build(f if spec.takes_f else None)
        stacked = {"w": rng.standard_normal((n, 2)).astype(np.float32)}
        need = spec.requirement(n, f)
        if need is None:
            rule.update(stacked, rule.init(params), params, **kw)
        else:
            with pytest.raises(consensus.ByzantineToleranceError, match=name):
                rule.update(stacked, rule.init(params), params, **kw)
