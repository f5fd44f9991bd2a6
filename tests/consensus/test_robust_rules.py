"""Server-guided and adaptive rules (FLTrust, server MoNNA, ARC, DnC, SignGuard, CAF, SMEA, Meamed,
bucketing): rule-specific conventions, tie patterns, inner rules and the stated preconditions.

Their float64 references, jit == eager, permutation invariance, identical nodes, f outliers at 1e6,
NaN rows and masks are rows of the property table (test_rule_properties.py)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import numpy_reference as ref
import pytest
import robust_reference as rref
from conftest import KEY

import consensus
from consensus import aggregators as agg
from consensus import registry

F = 2


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
        "geometric_median": ref.geometric_median,
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


def test_randomized_and_server_rules_say_what_they_need(make_params, make_nodes):
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


SLOW_PRECONDITIONS = ("dnc", "fltrust", "signguard", "server_monna")


@pytest.mark.parametrize(
    "name",
    [
        pytest.param(name, marks=pytest.mark.slow) if name in SLOW_PRECONDITIONS else name
        for name in (
            "fltrust",
            "server_monna",
            "arc",
            "dnc",
            "signguard",
            "caf",
            "smea",
            "meamed",
            "bucketing",
        )
    ],
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
