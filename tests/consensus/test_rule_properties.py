"""The property table: every registered rule, pre-aggregator and merge method, case by case.

``TABLE`` maps each name of ``consensus.registry.RULES`` to its cases, written by hand: how to build
the rule (parameters over the registry's defaults, pre-aggregators before it), its float64
reference (tests/numpy_reference.py, tests/robust_reference.py) and which properties apply to it.
``test_the_table_covers_every_registered_rule`` compares the hand-written keys with the registry:
a newly registered rule without a case fails it, by name.

Properties, each over the cases it applies to:

* agreement with the float64 reference, on honest nodes and with a NaN node, a far outlier and a mask;
* jit == eager, with and without a (traced) mask; sharded == unsharded; without params;
* permuting the nodes permutes nothing in the output (where the rule is permutation invariant);
* n copies of x give x (the votes); nodes equal to the base give the base (every case);
* translation equivariance;
* a non-finite node is excluded and reported invalid, and the output stays finite;
* robustness to f attackers (the attacks of ``strategies.attacks``) and to f outliers at 1e6;
* element-wise rules give the same values on column slices (what ``meta-consensus merge`` streams).

The shared data (parameter trees, node stacks, the server's update, the node mesh) are the
fixtures of tests/conftest.py.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import numpy_reference as ref
import pytest
import robust_reference as rref
from conftest import KEY, F, N
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import consensus
from consensus import registry
from consensus.aggregators._subsample import sample_coordinates
from consensus.convex import ConvexWeights, convex_merge
from consensus.tree import num_nodes
from strategies import attacks

TAU = 4.0  # centered clipping radius
CLIP = 5.0  # pre-aggregator clip norm
DNC_DIM = 20  # < the 41 coordinates of the test params: the subsets are really random
SG_DIM = 30
SLOW = pytest.mark.slow

# The attacks of the robustness rows, with their options.
ATTACKS = {
    "sign_flip": {"scale": 10.0},
    "gaussian": {"std": 30.0},
    "alie": {},
    "ipm": {"epsilon": 2.0},
    "nonfinite": {},
    "mimic": {},
}
IN_RANGE_ATTACKS = {"alie", "mimic"}  # they hide inside the honest spread by design
OUTLIERS = "outliers_1e6"  # f nodes moved by 1e6 (test_f_outliers_at_1e6_do_not_move_the_output)


def _alpha(n):
    return np.linspace(1.0, 3.0, n)


def _dnc_coords(total):
    return [np.asarray(sample_coordinates(k, total, DNC_DIM)) for k in jax.random.split(KEY, 2)]


def _medoid_centre(X, valid):
    return X[ref.medoid(X, valid)]  # centered clipping's v_0 without params: the medoid node


def _zero_centre(X, valid):
    return np.zeros(X.shape[1])  # clip without params clips the raw rows (around 0)


@dataclass(frozen=True)
class Case:
    """One row of the table: a rule built one way, and the properties it is checked for."""

    id: str
    rule: str  # the registry name of the rule that gives the output (the last stage)
    params: Mapping | Callable[[int], Mapping] = field(default_factory=dict)  # or n -> params
    pre: tuple[tuple[str, Mapping], ...] = ()  # registry pre-aggregators before it, with their params
    f: int = F
    nodes: int | None = None  # a rule that runs on exactly this many nodes (SLERP: 2)
    reference: Callable | None = None  # (X, valid, c, g) -> float64 output vector
    robust: str | None = None  # "coord": in the honest range; "select": picks nodes; "ball"; "server"
    attacks: tuple[str, ...] = ()  # the attacks of the robustness rows (ATTACKS names, OUTLIERS)
    permutation_invariant: bool | None = None  # None: what the registry says
    translation: bool = False  # translation equivariance
    sharded: bool = False  # sharded == unsharded over the node axis
    without_params: Callable | None = None  # (X, valid) -> the centre the rule uses without params
    slow: frozenset[str] = frozenset()  # the rows (property names below) marked slow for this case
    # False: the rule runs without the 0-d leaf "scale", which run() returns as the base's. The
    # nodes' values of a one-element leaf straddle 0: their unit directions are antipodal, where a
    # mean on the sphere is not defined (karcher_mean then depends on the nodes' order).
    scalar_leaf: bool = True
    # Rows (property names below) where the case is a known failure, with why: strict xfail, so
    # the row fails again, and names itself, the day the rule passes it.
    known_failures: Mapping[str, str] = field(default_factory=dict)

    @property
    def specs(self):
        return [registry.RULES[name] for name, _ in self.pre] + [registry.RULES[self.rule]]

    @property
    def kind(self) -> str:
        return registry.RULES[self.rule].kind

    @property
    def needs(self) -> frozenset[str]:
        return frozenset().union(*(s.needs for s in self.specs))

    @property
    def invariant(self) -> bool:
        if self.permutation_invariant is not None:
            return self.permutation_invariant
        return all(s.permutation_invariant for s in self.specs)

    def build(self, n: int):
        def one(name, params):
            spec = registry.RULES[name]
            return spec.build(self.f if spec.takes_f else None, **params)

        params = self.params(n) if callable(self.params) else self.params
        last = one(self.rule, params)
        if not self.pre:
            return last
        return consensus.chain(*(one(name, p) for name, p in self.pre), last)


def _ref(fn):
    """A reference of (X, valid) alone."""
    return lambda X, v, c, g: fn(X, v)


ALL_ATTACKS = tuple(sorted(ATTACKS))

# The table, by registry name. Written by hand: test_the_table_covers_every_registered_rule
# fails for a registered name missing here (and for a name here that is not registered).
TABLE: dict[str, tuple[Case, ...]] = {
    "mean": (
        Case(
            "mean",
            "mean",
            reference=_ref(ref.mean),
            translation=True,
            sharded=True,
            without_params=_zero_centre,
        ),
    ),
    "weighted_mean": (
        # Weights given at construction belong to node positions: not permutation invariant.
        Case(
            "weighted_mean",
            "weighted_mean",
            params=lambda n: {"weights": _alpha(n)},
            reference=_ref(lambda X, v: (X[v] * _alpha(len(v))[v, None]).sum(0) / _alpha(len(v))[v].sum()),
            permutation_invariant=False,
            translation=True,
            sharded=True,
            without_params=_zero_centre,
        ),
        # Weights given to update (per-node statistics): they travel with their node when permuted.
        Case("weighted_mean@update", "weighted_mean"),
    ),
    "median": (
        Case(
            "median",
            "median",
            reference=_ref(ref.median),
            robust="coord",
            attacks=ALL_ATTACKS,
            translation=True,
            sharded=True,
            without_params=_zero_centre,
            slow=frozenset({"jit", "without_params"}),
        ),
    ),
    "trimmed_mean": (
        Case(
            "trimmed_mean",
            "trimmed_mean",
            reference=_ref(lambda X, v: ref.trimmed_mean(X, F, v)),
            robust="coord",
            attacks=ALL_ATTACKS,
            translation=True,
            sharded=True,
            without_params=_zero_centre,
            slow=frozenset({"jit", "without_params"}),
        ),
    ),
    "krum": (
        Case(
            "krum",
            "krum",
            reference=_ref(lambda X, v: ref.krum(X, F, v)[0]),
            robust="select",
            attacks=ALL_ATTACKS,
            translation=True,
            sharded=True,
            without_params=_zero_centre,
        ),
    ),
    "multi_krum": (
        Case(
            "multi_krum",
            "multi_krum",
            params={"num_selected": 5},
            reference=_ref(lambda X, v: ref.multi_krum(X, F, 5, v)[0]),
            robust="select",
            attacks=ALL_ATTACKS,
            translation=True,
            sharded=True,
            without_params=_zero_centre,
            slow=frozenset({"sharded", "without_params"}),
        ),
    ),
    "bulyan": (
        Case(
            "bulyan",
            "bulyan",
            reference=_ref(lambda X, v: ref.bulyan(X, F, v)[0]),
            robust="coord",
            attacks=ALL_ATTACKS,
            translation=True,
            sharded=True,
            without_params=_zero_centre,
            slow=frozenset({"jit", "outliers_nan_mask", "attack:alie", "sharded", "without_params"}),
        ),
    ),
    "geometric_median": (
        Case(
            "geometric_median",
            "geometric_median",
            params={"max_iter": 2000, "tol": 1e-8},
            reference=_ref(ref.geometric_median),
            robust="ball",
            attacks=ALL_ATTACKS,
            translation=True,
            sharded=True,
            without_params=_zero_centre,
            slow=frozenset({"jit", "sharded", "without_params"}),
        ),
    ),
    "centered_clipping": (
        Case(
            "centered_clipping",
            "centered_clipping",
            params={"clip_radius": TAU, "iterations": 3},
            reference=lambda X, v, c, g: ref.centered_clipping(X, v, c, TAU, 3),
            robust="ball",
            attacks=ALL_ATTACKS,
            translation=True,
            sharded=True,
            without_params=_medoid_centre,
            slow=frozenset({"sharded", "without_params"}),
        ),
    ),
    "clip": (
        Case("clip", "clip"),
        Case(
            "clip+mean",
            "mean",
            pre=(("clip", {"max_norm": CLIP}),),
            reference=lambda X, v, c, g: ref.mean(ref.clip(X, c, CLIP), v),
            translation=True,
            sharded=True,
            without_params=_zero_centre,
            slow=frozenset({"sharded"}),
        ),
    ),
    "nnm": (
        Case("nnm", "nnm"),
        Case(
            "nnm+krum",
            "krum",
            pre=(("nnm", {}),),
            reference=_ref(lambda X, v: ref.krum(ref.nnm(X, F, v), F, v)[0]),
            robust="ball",
            attacks=ALL_ATTACKS,
            translation=True,
            sharded=True,
            without_params=_zero_centre,
            slow=frozenset({"sharded", "without_params"}),
        ),
        Case(
            "nnm+trimmed_mean",
            "trimmed_mean",
            pre=(("nnm", {}),),
            reference=_ref(lambda X, v: ref.trimmed_mean(ref.nnm(X, F, v), F, v)),
            robust="coord",
            attacks=ALL_ATTACKS,
            translation=True,
            sharded=True,
            without_params=_zero_centre,
            slow=frozenset({"jit", "outliers_nan_mask", "attack:alie", "sharded", "without_params"}),
        ),
    ),
    "interquartile_mean": (
        Case(
            "interquartile_mean",
            "interquartile_mean",
            reference=_ref(ref.interquartile_mean),
            robust="coord",  # trims m // 4 >= f values per side at n = 15, f = 2
            attacks=ALL_ATTACKS,
            translation=True,
            sharded=True,
            without_params=_zero_centre,
            slow=frozenset({"sharded"}),
        ),
    ),
    # Server-guided and adaptive rules.
    "fltrust": (
        Case(
            "fltrust",
            "fltrust",
            reference=lambda X, v, c, g: rref.fltrust(X, c, g, v),
            robust="server",
            attacks=(OUTLIERS,),
            slow=frozenset({"jit"}),
        ),
    ),
    "server_monna": (
        Case(
            "server_monna",
            "server_monna",
            reference=lambda X, v, c, g: rref.server_monna(X, c, g, F, v),
            robust="ball",
            attacks=(OUTLIERS,),
        ),
    ),
    "arc": (
        Case("arc", "arc"),
        Case(
            "arc+meamed",
            "meamed",
            pre=(("arc", {}),),
            reference=lambda X, v, c, g: rref.meamed(rref.arc(X, c, F, v), F, v),
            robust="ball",
            attacks=(OUTLIERS,),
            slow=frozenset({"jit"}),
        ),
    ),
    "dnc": (
        Case(
            "dnc",
            "dnc",
            params={"subsample_dim": DNC_DIM, "num_iters": 2},
            reference=_ref(lambda X, v: rref.dnc(X, F, v, _dnc_coords(X.shape[1]))[0]),
            robust="ball",
            attacks=(OUTLIERS,),
            permutation_invariant=True,  # for a fixed key: the key draws coordinates, not node positions
            slow=frozenset({"jit"}),
        ),
    ),
    "signguard": (
        Case(
            "signguard",
            "signguard",
            params={"subsample_dim": SG_DIM},
            reference=lambda X, v, c, g: rref.signguard(
                X, c, v, np.asarray(sample_coordinates(KEY, X.shape[1], SG_DIM))
            )[0],
            robust="ball",
            attacks=(OUTLIERS,),
            permutation_invariant=True,  # for a fixed key: the key draws coordinates, not node positions
            slow=frozenset({"jit", "reference", "outliers_nan_mask", "permutation"}),
        ),
    ),
    "caf": (
        Case(
            "caf",
            "caf",
            reference=_ref(lambda X, v: rref.caf(X, F, v)),
            robust="ball",
            attacks=(OUTLIERS,),
            slow=frozenset({"jit"}),
        ),
    ),
    "smea": (
        Case(
            "smea",
            "smea",
            reference=_ref(lambda X, v: rref.smea(X, F, v)[0]),
            robust="ball",
            attacks=(OUTLIERS,),
            slow=frozenset({"jit"}),
        ),
    ),
    "meamed": (
        Case(
            "meamed",
            "meamed",
            reference=_ref(lambda X, v: rref.meamed(X, F, v)),
            robust="coord",
            attacks=(OUTLIERS,),
            slow=frozenset({"jit"}),
        ),
    ),
    "bucketing": (
        Case(
            "bucketing",
            "bucketing",
            params={"bucket_size": 2},
            f=1,
            reference=_ref(
                lambda X, v: rref.bucketing(
                    X, v, np.asarray(jax.random.permutation(KEY, len(v))), 2, ref.geometric_median
                )
            ),
            robust="ball",
            attacks=(OUTLIERS,),
            slow=frozenset({"jit", "outliers_nan_mask"}),
        ),
    ),
    # Merge methods over task vectors (their float64 references are in test_merging.py).
    "task_arithmetic": (Case("task_arithmetic", "task_arithmetic"),),
    "ties": (Case("ties", "ties", slow=frozenset({"jit", "non_finite", "permutation", "base"})),),
    "dare": (Case("dare", "dare", slow=frozenset({"jit"})),),
    "linear": (Case("linear", "linear", translation=True),),
    "dare_linear": (Case("dare_linear", "dare_linear", slow=frozenset({"jit"})),),
    "dare_ties": (Case("dare_ties", "dare_ties", slow=frozenset({"jit", "non_finite", "permutation"})),),
    "model_stock": (Case("model_stock", "model_stock", slow=frozenset({"jit"})),),
    "slerp": (Case("slerp", "slerp", nodes=2, slow=frozenset({"jit"})),),
    "karcher_mean": (
        Case(
            "karcher_mean",
            "karcher_mean",
            slow=frozenset({"jit", "permutation", "non_finite"}),
            scalar_leaf=False,
        ),
    ),
    "fisher_merge": (Case("fisher_merge", "fisher_merge", slow=frozenset({"jit"})),),
    "regmean": (Case("regmean", "regmean", slow=frozenset({"jit"})),),
}
CASES = [case for cases in TABLE.values() for case in cases]
assert len({c.id for c in CASES}) == len(CASES), "case ids must be unique"
# The rows a case can mark slow: the first argument of cases() below, and "attack:<name>".
ROWS = {"reference", "outliers_nan_mask", "jit", "sharded", "permutation", "identical", "base"}
ROWS |= {"translation", "non_finite", "without_params", "elementwise", OUTLIERS}
ROWS |= {f"attack:{a}" for a in ATTACKS}
assert all(c.slow | set(c.known_failures) <= ROWS for c in CASES), "a slow or known-failure row misspelt"


def _marks(case: Case, row: str) -> list:
    marks = [SLOW] if row in case.slow else []
    if row in case.known_failures:
        marks.append(pytest.mark.xfail(strict=True, reason=case.known_failures[row]))
    return marks


def cases(row: str, applies: Callable[[Case], bool] = lambda case: True):
    """pytest params of the cases a row applies to, marked slow (or known failures) as the case says."""
    return [pytest.param(c, id=c.id, marks=_marks(c, row)) for c in CASES if applies(c)]


def _vote(case: Case) -> bool:
    return case.kind != "pre"


# ----------------------------------------------------------------------------- coverage


def uncovered(table: Mapping[str, object], rules) -> tuple[list[str], list[str]]:
    """(registered names with no case in ``table``, ``table`` names that are not registered)."""
    registered = [name for name, _ in rules.items()]
    missing = [name for name in registered if name not in table]
    unknown = [name for name in table if name not in set(registered)]
    return missing, unknown


def test_the_table_covers_every_registered_rule():
    missing, unknown = uncovered(TABLE, registry.RULES)
    assert not missing, f"registered rules with no case in TABLE: {missing}"
    assert not unknown, f"TABLE cases for names that are not registered: {unknown}"
    stages = {name for c in CASES for name in [c.rule, *(p for p, _ in c.pre)]}
    assert stages <= set(registry.RULES), (
        f"cases built from unregistered rules: {stages - set(registry.RULES)}"
    )


def test_the_coverage_check_names_what_is_missing():
    # A registry with one more rule than the table has cases for, and a table with a stray name.
    rules = dict(registry.RULES.items())
    rules["dummy_rule"] = registry.RULES["mean"]
    assert uncovered(TABLE, rules) == (["dummy_rule"], [])
    stray = {**TABLE, "not_a_rule": ()}
    assert uncovered(stray, registry.RULES) == ([], ["not_a_rule"])
    without_median = {k: v for k, v in TABLE.items() if k != "median"}
    assert uncovered(without_median, registry.RULES) == (["median"], [])


def test_docs_rules_page_shows_the_registry_as_it_is():
    page = (Path(__file__).parents[2] / "docs" / "rules.md").read_text()
    assert registry.markdown_table() in page, "regenerate docs/rules.md's table from consensus.registry"


# ----------------------------------------------------------------------------- running a case


PER_NODE = ("weights", "fisher", "grams")  # per-node statistics travel with their node


def extras(case: Case, stacked, params, g=None) -> dict:
    """Keyword inputs a case needs besides (stacked, params), from its registry ``needs``."""
    needs, n = case.needs, num_nodes(stacked)
    out = {}
    if "key" in needs:
        out["key"] = KEY
    if "server_update" in needs:
        out["server_update"] = g
    if "weights" in needs and not callable(case.params) and "weights" not in case.params:
        out["weights"] = _alpha(n)
    if "fisher" in needs:
        out["fisher"] = jax.tree.map(lambda x: jnp.abs(x) + 0.1, stacked)
    if "grams" in needs:  # the input Gram matrix of the dense kernel (d_in = 7), per node
        inputs = np.random.default_rng(2).normal(size=(n, 8, 7))
        out["grams"] = {"['dense']['w']": np.einsum("nki,nkj->nij", inputs, inputs).astype(np.float32)}
    return out


def permute_extras(extra: dict, perm) -> dict:
    return {k: (jax.tree.map(lambda v: v[perm], v) if k in PER_NODE else v) for k, v in extra.items()}


def info_of(state):
    try:
        return consensus.get_info(state)
    except TypeError:  # a pre-aggregator's state
        return None


def _without_scalar_leaf(tree):
    return None if tree is None else {k: v for k, v in tree.items() if k != "scale"}


def run(case: Case, stacked, params, *, mask=None, jit=False, g=None, extra=None):
    if not case.scalar_leaf:
        merged, info = run(
            dataclasses.replace(case, scalar_leaf=True),
            _without_scalar_leaf(stacked),
            _without_scalar_leaf(params),
            mask=mask,
            jit=jit,
            g=_without_scalar_leaf(g),
            extra=None
            if extra is None
            else {k: _without_scalar_leaf(v) if k in PER_NODE else v for k, v in extra.items()},
        )
        return {**merged, "scale": params["scale"]}, info
    agg = case.build(num_nodes(stacked))
    extra = extras(case, stacked, params, g) if extra is None else extra
    state = agg.init(params)

    def update(stacked, state, params, mask, extra):
        return agg.update(stacked, state, params, mask=mask, **extra)

    merged, state = (jax.jit(update) if jit else update)(stacked, state, params, mask, extra)
    return merged, info_of(state)


def expected(case: Case, stacked, params, g=None, mask=None):
    X = ref.flatten_stacked(stacked)
    valid = ref.finite_rows(X)
    if mask is not None:
        valid &= np.asarray(mask)
    gflat = None if g is None else ref.flatten_tree(g)
    return case.reference(X, valid, ref.flatten_tree(params), gflat)


def assert_close(tree, want, scale=1.0, rtol=2e-5):
    np.testing.assert_allclose(ref.flatten_tree(tree), want, rtol=rtol, atol=rtol * scale)


def assert_same(a, b, rtol=1e-5, atol=1e-5):
    np.testing.assert_allclose(ref.flatten_tree(a), ref.flatten_tree(b), rtol=rtol, atol=atol)


# ----------------------------------------------------------------------------- the rows


@pytest.mark.parametrize("case", cases("reference", lambda c: c.reference is not None))
def test_matches_float64_reference(case, make_params, make_nodes, make_server_update):
    params = make_params()
    stacked = make_nodes(params)
    g = make_server_update(params)
    merged, info = run(case, stacked, params, g=g)
    assert_close(merged, expected(case, stacked, params, g), scale=3.0)
    # Output has the params' structure, shapes and dtypes.
    consensus.check_same_structure([merged], params)
    assert info.valid.shape == (N,) and info.selected.shape == (N,) and info.weights.shape == (N,)


@pytest.mark.parametrize("case", cases("outliers_nan_mask", lambda c: c.reference is not None))
def test_matches_reference_with_outliers_nan_and_mask(case, make_params, make_nodes, make_server_update):
    params = make_params(3)
    stacked = make_nodes(params, seed=4)
    # Node 0: NaN in one leaf only; node 6: a far outlier (1e3 away); node 9 masked out;
    # node 13: +Inf in one leaf and NaN in another.
    stacked["dense"]["b"] = stacked["dense"]["b"].at[0, 2].set(jnp.nan)
    stacked = jax.tree.map(lambda x: x.at[6].add(1e3), stacked)
    n = N + 4  # more nodes so Bulyan still has m >= 4f + 3 after exclusions
    extra = make_nodes(params, n=4, seed=5)
    stacked = jax.tree.map(lambda a, b: jnp.concatenate([a, b]), stacked, extra)
    stacked["dense"]["w"] = stacked["dense"]["w"].at[13, 2, 3].set(jnp.inf)
    stacked["scale"] = stacked["scale"].at[13].set(jnp.nan)
    mask = np.ones(n, bool)
    mask[9] = False
    g = make_server_update(params, seed=5)
    merged, info = run(case, stacked, params, mask=mask, g=g)
    want_valid = mask.copy()
    want_valid[[0, 13]] = False
    np.testing.assert_array_equal(np.asarray(info.valid), want_valid)
    assert not np.asarray(info.selected)[~want_valid].any()
    assert float(np.abs(np.asarray(info.weights)[~want_valid]).sum()) == 0.0
    assert np.isfinite(ref.flatten_tree(merged)).all()
    scale = 3.0 if case.robust else 1e3  # the outlier moves the non-robust rules by ~1e3 / n
    assert_close(merged, expected(case, stacked, params, g, mask), scale=scale)


@pytest.mark.parametrize("case", cases("jit"))
def test_jit_equals_eager_with_and_without_mask(case, make_params, make_nodes, make_server_update):
    params = make_params(12)
    n = case.nodes or N + 2
    stacked = make_nodes(params, n=n, seed=13)
    g = make_server_update(params, seed=14)
    masks = (None,) if case.nodes else (None, np.arange(n) != 4)
    for mask in masks:
        a, ia = run(case, stacked, params, mask=mask, g=g)
        b, ib = run(case, stacked, params, mask=None if mask is None else jnp.asarray(mask), jit=True, g=g)
        assert_same(a, b)
        if ia is not None:
            np.testing.assert_array_equal(np.asarray(ia.selected), np.asarray(ib.selected))
            np.testing.assert_allclose(np.asarray(ia.weights), np.asarray(ib.weights), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("case", cases("sharded", lambda c: c.sharded))
def test_sharded_equals_unsharded(case, make_params, make_nodes, node_mesh):
    params = make_params(14)
    stacked = make_nodes(params, n=16, seed=15)
    sharded = jax.tree.map(lambda x: jax.device_put(x, NamedSharding(node_mesh, P("node"))), stacked)
    assert len(jax.tree_util.tree_leaves(sharded)[0].sharding.device_set) == 8
    a, _ = run(case, stacked, params)
    b, _ = run(case, sharded, params)
    assert_same(a, b)


@pytest.mark.parametrize("case", cases("permutation", lambda c: c.invariant))
def test_permutation_invariance(case, make_params, make_nodes, make_server_update):
    params = make_params(7)
    n = case.nodes or N
    stacked = make_nodes(params, n=n, seed=8)
    g = make_server_update(params, seed=9)
    perm = np.random.default_rng(0).permutation(n)
    extra = extras(case, stacked, params, g)
    a, _ = run(case, stacked, params, extra=extra)
    b, _ = run(case, jax.tree.map(lambda x: x[perm], stacked), params, extra=permute_extras(extra, perm))
    if case.kind == "pre":  # n -> n: the rows permute with the nodes
        a = jax.tree.map(lambda x: np.asarray(x)[perm], a)
    assert_same(a, b)


def test_weighted_mean_permutes_with_its_weights(make_params, make_nodes):
    params = make_params(7)
    stacked = make_nodes(params, seed=8)
    perm = np.random.default_rng(0).permutation(N)
    alpha = _alpha(N)
    agg = consensus.weighted_mean()
    a, _ = agg.update(stacked, agg.init(params), weights=alpha)
    b, _ = agg.update(jax.tree.map(lambda x: x[perm], stacked), agg.init(params), weights=alpha[perm])
    assert_same(a, b, atol=1e-6)


@pytest.mark.parametrize("case", cases("identical", lambda c: c.kind not in ("pre", "merge")))
def test_identical_nodes_give_that_node(case, make_params):
    params = make_params(9)
    x = jax.tree.map(lambda p: (p + 0.05).astype(p.dtype), params)  # inside every clip radius
    stacked = consensus.broadcast(x, N)
    # The server agrees with the nodes (FLTrust rescales every update to the server's norm).
    g = jax.tree.map(lambda a, p: (a - p).astype(p.dtype), x, params)
    merged, _ = run(case, stacked, params, g=g)
    assert_same(merged, x, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("case", cases("base"))
def test_nodes_equal_to_the_base_give_the_base(case, make_params, make_server_update):
    # For a vote: n copies of the params give the params (zero deltas: clip radii see norm 0);
    # for a merge method: zero task vectors give the base.
    params = make_params(20)
    n = case.nodes or N
    same = consensus.broadcast(params, n)
    out, _ = run(case, same, params, g=make_server_update(params, seed=21))
    if case.kind == "pre":  # n -> n: every node stays the base
        out = jax.tree.map(lambda x: np.asarray(x)[0], out)
    assert_same(out, params)


@pytest.mark.parametrize("case", cases("translation", lambda c: c.translation))
def test_translation_equivariance(case, make_params, make_nodes):
    params = make_params(10)
    stacked = make_nodes(params, seed=11)
    shift = jax.tree.map(lambda p: np.full(np.shape(p), 2.5, np.float32), params)
    a, _ = run(case, stacked, params)
    b, _ = run(
        case,
        jax.tree.map(lambda x, t: x + t[None], stacked, shift),
        jax.tree.map(lambda p, t: p + t, params, shift),
    )
    np.testing.assert_allclose(
        ref.flatten_tree(b), ref.flatten_tree(a) + ref.flatten_tree(shift), rtol=1e-5, atol=2e-5
    )


# The cases with a float64 reference check this in test_matches_reference_with_outliers_nan_and_mask.
@pytest.mark.parametrize("case", cases("non_finite", lambda c: _vote(c) and c.reference is None))
def test_non_finite_nodes_are_excluded_and_reported(case, make_params, make_nodes, make_server_update):
    params = make_params(22)
    g = make_server_update(params, seed=23)
    if case.nodes == 2:  # a rule of exactly two nodes: with one of them poisoned it refuses, naming why
        stacked = make_nodes(params, n=2, seed=24)
        stacked["dense"]["w"] = stacked["dense"]["w"].at[1, 0, 0].set(jnp.nan)
        with pytest.raises(ValueError, match=case.rule):
            run(case, stacked, params, g=g)
        return
    n = N + 3
    stacked = make_nodes(params, n=n, seed=24)
    # Node 4: a NaN in one leaf; node 8: +Inf in another; the last node: NaN and +Inf in two leaves.
    stacked["dense"]["w"] = stacked["dense"]["w"].at[4, 3, 1].set(jnp.nan).at[n - 1, 0, 0].set(jnp.nan)
    stacked["dense"]["b"] = stacked["dense"]["b"].at[8, 2].set(jnp.inf).at[n - 1, 1].set(jnp.inf)
    out, info = run(case, stacked, params, g=g)
    assert np.isfinite(ref.flatten_tree(out)).all()
    np.testing.assert_array_equal(np.asarray(info.valid), ~np.isin(np.arange(n), [4, 8, n - 1]))


@pytest.mark.parametrize(
    "case,attack",
    [
        pytest.param(c, a, id=f"{c.id}-{a}", marks=_marks(c, f"attack:{a}"))
        for c in CASES
        for a in c.attacks
        if a != OUTLIERS
    ],
)
def test_robust_to_f_attackers(case, attack, make_params, make_nodes):
    # n = 15 so that Bulyan (m >= 4f + 3) still runs when the 2 NaN attackers are excluded.
    n = 15
    params = make_params(16)
    stacked = make_nodes(params, n=n, seed=17, spread=0.1, drift=1.0)
    byz = np.zeros(n, bool)
    byz[[2, 7]] = True
    attacked = attacks.apply_attack(attack, jax.random.key(0), stacked, byz, params, **ATTACKS[attack])
    merged, info = run(case, attacked, params)
    X = ref.flatten_stacked(stacked)[~byz]
    out = ref.flatten_tree(merged)
    lo, hi = X.min(0), X.max(0)
    assert np.isfinite(out).all()
    if case.robust == "select" and attack not in IN_RANGE_ATTACKS:
        assert not np.asarray(info.selected)[byz].any(), "a Byzantine node was selected"
    if case.robust in ("coord", "select"):
        assert ((out >= lo - 1e-5) & (out <= hi + 1e-5)).all(), "output left the honest range"
    else:  # ball: the attackers move the output by less than the honest spread
        clean = ref.flatten_tree(run(case, attacked, params, mask=~byz)[0])
        radius = np.linalg.norm(X - X.mean(0), axis=1).max()
        if case.rule == "centered_clipping":
            # Each of the 3 steps: f clipped attackers pull by at most f * tau / m.
            radius += 3 * F * TAU / n
        assert np.linalg.norm(out - clean) <= radius
    if attack == "nonfinite":
        assert not np.asarray(info.valid)[byz].any(), "NaN nodes must be reported as invalid"


@pytest.mark.parametrize("case", cases(OUTLIERS, lambda c: OUTLIERS in c.attacks))
def test_f_outliers_at_1e6_do_not_move_the_output(case, make_params, make_nodes):
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
    merged, info = run(case, attacked, params, g=g)
    out = ref.flatten_tree(merged)
    assert np.isfinite(out).all()
    if case.robust == "coord":
        assert ((out >= X.min(0) - 1e-5) & (out <= X.max(0) + 1e-5)).all()
    elif case.robust == "server":  # a convex combination of vectors of the server's norm
        assert np.linalg.norm(out - c) <= np.linalg.norm(ref.flatten_tree(g)) * (1 + 1e-5)
    else:
        radius = np.linalg.norm(X - X.mean(0), axis=1).max()
        assert np.linalg.norm(out - X.mean(0)) <= radius
    if info.linear and not case.pre:
        assert float(np.abs(np.asarray(info.weights)[byz]).sum()) < 1e-6, "an outlier at 1e6 kept weight"


def test_too_few_valid_nodes_after_excluding_nan_is_a_clear_error(make_params, make_nodes):
    params = make_params(16)
    stacked = make_nodes(params, n=N, seed=17)
    byz = np.zeros(N, bool)
    byz[[2, 7]] = True
    attacked = attacks.apply_attack("nonfinite", jax.random.key(0), stacked, byz, params)
    with pytest.raises(consensus.ByzantineToleranceError, match=r"bulyan.*f=2.*n=9 valid.*4f \+ 3 = 11"):
        run(TABLE["bulyan"][0], attacked, params)


def test_plain_mean_breaks_under_the_same_attacks(make_params, make_nodes):
    """The attacks in the table are real: the unprotected mean leaves the honest range."""
    params = make_params(16)
    stacked = make_nodes(params, n=N, seed=17, spread=0.1, drift=1.0)
    byz = np.zeros(N, bool)
    byz[[2, 7]] = True
    X = ref.flatten_stacked(stacked)[~byz]
    for attack in ("sign_flip", "gaussian", "ipm"):
        attacked = attacks.apply_attack(attack, jax.random.key(0), stacked, byz, params, **ATTACKS[attack])
        out = ref.flatten_tree(run(TABLE["mean"][0], attacked, params)[0])
        assert np.linalg.norm(out - X.mean(0)) > np.linalg.norm(X - X.mean(0), axis=1).max()


@pytest.mark.parametrize("case", cases("without_params", lambda c: c.without_params is not None))
def test_without_params_jit_equals_eager_and_reference(case, make_params, make_nodes):
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
    agg = case.build(n)
    jitted = jax.jit(lambda s, st, m: agg.update(s, st, mask=m))
    for stacked, mask in [(clean, None), (clean, np.ones(n, bool)), (with_nan, drop_one)]:
        a, sa = agg.update(stacked, agg.init(params), mask=mask)
        b, sb = jitted(stacked, agg.init(params), None if mask is None else jnp.asarray(mask))
        ia, ib = consensus.get_info(sa), consensus.get_info(sb)
        assert_same(a, b)
        np.testing.assert_array_equal(np.asarray(ia.valid), np.asarray(ib.valid))
        np.testing.assert_array_equal(np.asarray(ia.selected), np.asarray(ib.selected))
        np.testing.assert_allclose(np.asarray(ia.weights), np.asarray(ib.weights), rtol=1e-5, atol=1e-6)
        X = ref.flatten_stacked(stacked)
        valid = ref.finite_rows(X) & (np.ones(n, bool) if mask is None else mask)
        np.testing.assert_array_equal(np.asarray(ia.valid), valid)
        want = case.reference(X, valid, case.without_params(X, valid), None)
        assert_close(a, want, scale=3.0)


REQUIRED = {"density": 0.6, "t": 0.3}  # required parameters that neither a factory nor the registry gives


def _has_a_default_case(name: str) -> bool:
    """Whether a case builds ``name`` exactly as configs do: alone, the registry's defaults, f = F."""
    return any(c.rule == name and not c.pre and not c.params and c.f == F for c in TABLE[name])


@pytest.mark.parametrize("name", [name for name in TABLE if not _has_a_default_case(name)])
def test_each_rule_builds_from_the_registry_defaults_and_runs(name, make_params, make_nodes):
    """What configs build: ``spec.build(f)`` with the registry's defaults, run once eagerly (for the
    rules whose cases all give other parameters; the other rules run so in every row)."""
    spec, case = registry.RULES[name], TABLE[name][0]
    params = make_params(25)
    agg = spec.build(
        F if spec.takes_f else None, **{k: REQUIRED[k] for k in spec.required if k not in spec.defaults}
    )
    stacked = make_nodes(params, n=case.nodes or N, seed=26)
    extra = extras(Case(name, name), stacked, params, params)
    out, _ = agg.update(stacked, agg.init(params), params, **extra)
    assert np.isfinite(ref.flatten_tree(out)).all()


# ----------------------------------------------------------------------------- element-wise rules


CUTS = [0, 1, 7, 35]  # column slices of the flattened kernel (7 x 5 = 35 coordinates)


def _on_column_slices(case, stacked, params, cuts) -> np.ndarray:
    """The rule run on column slices of the flattened leaf "w" (each slice its own tree), joined."""
    n = num_nodes(stacked)
    flat, flat_params = np.asarray(stacked["w"]).reshape(n, -1), np.asarray(params["w"]).reshape(-1)
    parts = []
    for lo, hi in zip(cuts[:-1], cuts[1:], strict=True):
        piece = {"w": np.ascontiguousarray(flat[:, lo:hi])}
        piece_params = {"w": flat_params[lo:hi].copy()}
        out, _ = run(case, piece, piece_params)
        parts.append(np.asarray(out["w"], np.float64))
    return np.concatenate(parts)


def _kernel_only(make_params, make_nodes, n):
    params = make_params(4)
    stacked = make_nodes(params, n=n, seed=5)
    return {"w": np.asarray(stacked["dense"]["w"])}, {"w": params["dense"]["w"]}


@pytest.mark.parametrize(
    "case", cases("elementwise", lambda c: not c.pre and registry.RULES[c.rule].elementwise)
)
def test_elementwise_rules_give_the_same_values_on_column_slices(case, make_params, make_nodes):
    # What meta-consensus merge relies on to stream these rules in column chunks.
    stacked, params = _kernel_only(make_params, make_nodes, case.nodes or N)
    whole, _ = run(case, stacked, params)
    sliced = _on_column_slices(case, stacked, params, CUTS)
    np.testing.assert_array_equal(sliced, np.asarray(whole["w"], np.float64).reshape(-1))


@pytest.mark.slow
def test_the_column_slice_check_fails_for_a_per_leaf_statistic(make_params, make_nodes):
    # TIES keeps the top-k magnitudes of each leaf: not element-wise, and the check above sees it.
    (case,) = TABLE["ties"]
    assert not registry.RULES["ties"].elementwise
    stacked, params = _kernel_only(make_params, make_nodes, N)
    whole, _ = run(case, stacked, params)
    sliced = _on_column_slices(case, stacked, params, CUTS)
    assert not np.allclose(sliced, np.asarray(whole["w"], np.float64).reshape(-1))


# ----------------------------------------------------------------------------- compositions


def _uniform_weigher(stacked, params, mask, **extra):
    k = int(mask.sum())
    return ConvexWeights(mask / k, 0.0, "uniform", 0.0, False, "", mask.copy())


# What the system builds from the registered rules: DP recipes, the convex merge after a vote,
# the grouped vote.
COMPOSITIONS = {
    "dp_fedavg": lambda n: consensus.dp_fedavg(1e3, 0.0, key=0),
    "privatize(median, project)": lambda n: consensus.privatize(
        consensus.median(), 1e3, 0.0, expected_nodes=n, key=0, project=True
    ),
    "convex_merge(vote=trimmed_mean)": lambda n: convex_merge(
        _uniform_weigher, vote=consensus.trimmed_mean(F)
    ),
    "grouped_vote(median -> mean)": lambda n: consensus.grouped_vote(consensus.median(), consensus.mean(), 3),
}


@pytest.mark.parametrize("name", list(COMPOSITIONS))
def test_compositions_keep_the_properties(name, make_params, make_nodes):
    n = 12
    base = make_params(9)
    stacked = make_nodes(base, n=n, seed=10)
    agg = COMPOSITIONS[name](n)
    out, state = agg.update(stacked, agg.init(base), base)
    # Permutation invariance (the grouped vote only within groups: permute inside each block of 4).
    perm = np.concatenate([g + np.random.default_rng(g).permutation(4) for g in (0, 4, 8)])
    if not name.startswith("grouped"):
        perm = np.random.default_rng(1).permutation(n)
    out_p, _ = agg.update(jax.tree.map(lambda x: x[perm], stacked), agg.init(base), base)
    assert_same(out_p, out, rtol=2e-5, atol=2e-5)
    # n copies of the base give the base (no noise: z = 0).
    out_same, _ = agg.update(consensus.broadcast(base, n), agg.init(base), base)
    assert_same(out_same, base)
    # A non-finite node is excluded and the output is finite.
    stacked["dense"]["b"] = stacked["dense"]["b"].at[5, 1].set(jnp.inf)
    out_nan, state = agg.update(stacked, agg.init(base), base)
    assert np.isfinite(ref.flatten_tree(out_nan)).all()
    assert not bool(np.asarray(consensus.get_info(state).valid)[5])
