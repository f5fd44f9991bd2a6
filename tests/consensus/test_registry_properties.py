"""The shared property table, generated from the registry: every registered rule, pre-aggregator and
merge method, plus the compositions the system builds (DP recipes, the convex merge after a vote, the
grouped vote).

Properties (each where it holds, as the registry says):
* the eager update equals the same update under an outer ``jax.jit`` (jittable rules);
* a stack whose every node equals the base gives the base (for a vote: n copies of x give x;
  for a merge method: zero task vectors give the base);
* permuting the nodes permutes nothing in the output (``RuleSpec.permutation_invariant``);
* a non-finite node is excluded and reported invalid, and the output stays finite (n -> 1 rules).
"""

from __future__ import annotations

from pathlib import Path

import jax
import numpy as np
import pytest

import consensus
from consensus import registry
from consensus.convex import ConvexWeights, convex_merge
from consensus.tree import num_nodes

# Values for required parameters that neither the factory nor the registry defaults give.
REQUIRED = {"density": 0.6, "t": 0.3}
# Multi-Krum's default num_selected (m - f) needs the valid count, which an outer jit hides.
JIT_PARAMS = {"multi_krum": {"num_selected": 9}}
F = 2


def _size(spec) -> int:
    """The smallest of a few node counts that satisfies the rule's precondition with f = F."""
    for n in (11, 12, 15, 2):
        if spec.requirement(n, F if spec.takes_f else 0) is None:
            return n
    raise AssertionError(f"{spec.name}: no test size satisfies its precondition")


def _trees(n: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    base = {"w": rng.normal(size=(5, 3)).astype(np.float32), "b": rng.normal(size=(3,)).astype(np.float32)}
    stacked = {
        k: (v[None] + 0.3 * rng.normal(size=(n, *v.shape))).astype(np.float32) for k, v in base.items()
    }
    return base, stacked


def _extra(spec, stacked, base):
    """Keyword inputs a rule needs besides (stacked, params), from its registry ``needs``."""
    extra = {}
    if "key" in spec.needs:
        extra["key"] = jax.random.key(7)
    if "server_update" in spec.needs:
        rng = np.random.default_rng(1)
        extra["server_update"] = {
            k: (0.3 * rng.normal(size=v.shape)).astype(np.float32) for k, v in base.items()
        }
    if "fisher" in spec.needs:
        extra["fisher"] = {k: np.abs(v) + 0.1 for k, v in stacked.items()}
    if "weights" in spec.needs:
        extra["weights"] = np.linspace(1.0, 2.0, num_nodes(stacked)).astype(np.float32)
    if "grams" in spec.needs:  # the input Gram matrix of the dense kernel "w" (d_in = 5), per node
        rng = np.random.default_rng(2)
        inputs = rng.normal(size=(num_nodes(stacked), 8, 5))
        extra["grams"] = {"['w']": np.einsum("nki,nkj->nij", inputs, inputs).astype(np.float32)}
    return extra


# Per-node statistics travel with their node when the nodes are permuted.
PER_NODE = ("weights", "fisher", "grams")


def _permute_extra(extra, perm):
    return {k: (jax.tree.map(lambda v: v[perm], v) if k in PER_NODE else v) for k, v in extra.items()}


def _build(spec, **params):
    params = {**{k: REQUIRED[k] for k in spec.required if k not in spec.defaults}, **params}
    return spec.build(F if spec.takes_f else None, **params)


def _run(spec, stacked, base, jit=False, extra=None):
    agg = _build(spec, **JIT_PARAMS.get(spec.name, {}))
    extra = _extra(spec, stacked, base) if extra is None else extra
    state = agg.init(base)

    def update(stacked, base, extra):
        return agg.update(stacked, state, base, **extra)

    out, state = (jax.jit(update) if jit else update)(stacked, base, extra)
    return out, state


SPECS = [pytest.param(spec, id=name) for name, spec in registry.RULES.items()]


def _flat(tree) -> np.ndarray:
    return np.concatenate([np.ravel(np.asarray(tree[k], np.float64)) for k in sorted(tree)])


def test_docs_rules_page_shows_the_registry_as_it_is():
    page = (Path(__file__).parents[2] / "docs" / "rules.md").read_text()
    assert registry.markdown_table() in page, "regenerate docs/rules.md's table from consensus.registry"


def test_the_table_covers_every_registered_rule():
    assert {p.id for p in SPECS} == set(registry.RULES)
    assert len(SPECS) >= 20


@pytest.mark.parametrize("spec", SPECS)
def test_jit_equals_eager(spec):
    n = _size(spec)
    base, stacked = _trees(n)
    eager, _ = _run(spec, stacked, base)
    jitted, _ = _run(spec, stacked, base, jit=True)
    np.testing.assert_allclose(_flat(jitted), _flat(eager), rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("spec", SPECS)
def test_nodes_equal_to_the_base_give_the_base(spec):
    n = _size(spec)
    base, _ = _trees(n)
    same = {k: np.broadcast_to(v, (n, *v.shape)).copy() for k, v in base.items()}
    out, _ = _run(spec, same, base)
    if spec.kind == "pre":  # n -> n: every node stays the base
        out = {k: np.asarray(v)[0] for k, v in out.items()}
    np.testing.assert_allclose(_flat(out), _flat(base), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("spec", [p for p in SPECS if p.values[0].permutation_invariant])
def test_permutation_invariance(spec):
    n = _size(spec)
    base, stacked = _trees(n, seed=3)
    perm = np.random.default_rng(0).permutation(n)
    out, _ = _run(spec, stacked, base)
    permuted = {k: v[perm] for k, v in stacked.items()}
    out_p, _ = _run(spec, permuted, base, extra=_permute_extra(_extra(spec, stacked, base), perm))
    if spec.kind == "pre":
        out = {k: np.asarray(v)[perm] for k, v in out.items()}
    np.testing.assert_allclose(_flat(out_p), _flat(out), rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("spec", [p for p in SPECS if p.values[0].kind != "pre"])
def test_a_non_finite_node_is_excluded(spec):
    n = _size(spec)
    n = n + 1 if n > 2 else n  # the poisoned node comes on top of enough valid ones
    base, stacked = _trees(n, seed=5)
    if n == 2:  # a rule of exactly two nodes: with one of them poisoned it refuses, naming why
        stacked["w"][1, 0, 0] = np.nan
        with pytest.raises(ValueError, match=spec.name):
            _run(spec, stacked, base)
        return
    stacked["w"][n - 1, 0, 0] = np.nan
    stacked["b"][n - 1, 1] = np.inf
    out, state = _run(spec, stacked, base)
    assert np.isfinite(_flat(out)).all()
    assert not bool(np.asarray(consensus.get_info(state).valid)[n - 1])


# ----------------------------------------------------------------------------- compositions


def _uniform_weigher(stacked, params, mask, **extra):
    k = int(mask.sum())
    return ConvexWeights(mask / k, 0.0, "uniform", 0.0, False, "", mask.copy())


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
def test_compositions_keep_the_properties(name):
    n = 12
    base, stacked = _trees(n, seed=9)
    agg = COMPOSITIONS[name](n)
    out, state = agg.update(stacked, agg.init(base), base)
    # Permutation invariance (the grouped vote only within groups: permute inside each block of 4).
    perm = np.concatenate([g + np.random.default_rng(g).permutation(4) for g in (0, 4, 8)])
    if not name.startswith("grouped"):
        perm = np.random.default_rng(1).permutation(n)
    out_p, _ = agg.update({k: v[perm] for k, v in stacked.items()}, agg.init(base), base)
    np.testing.assert_allclose(_flat(out_p), _flat(out), rtol=2e-5, atol=2e-5)
    # n copies of the base give the base (no noise: z = 0).
    same = {k: np.broadcast_to(v, (n, *v.shape)).copy() for k, v in base.items()}
    out_same, _ = agg.update(same, agg.init(base), base)
    np.testing.assert_allclose(_flat(out_same), _flat(base), rtol=1e-5, atol=1e-5)
    # A non-finite node is excluded and the output is finite.
    stacked["b"][5, 1] = np.inf
    out_nan, state = agg.update(stacked, agg.init(base), base)
    assert np.isfinite(_flat(out_nan)).all()
    assert not bool(np.asarray(consensus.get_info(state).valid)[5])


def _on_column_slices(spec, stacked, base, cuts) -> np.ndarray:
    """The rule run on column slices of the flattened leaf "w" (each slice its own tree), joined."""
    n = num_nodes(stacked)
    flat, flat_base = stacked["w"].reshape(n, -1), base["w"].reshape(-1)
    parts = []
    for lo, hi in zip(cuts[:-1], cuts[1:], strict=True):
        piece = {"w": np.ascontiguousarray(flat[:, lo:hi])}
        piece_base = {"w": flat_base[lo:hi].copy()}
        out, _ = _run(spec, piece, piece_base, extra=_extra(spec, piece, piece_base))
        parts.append(np.asarray(out["w"], np.float64))
    return np.concatenate(parts)


@pytest.mark.parametrize("spec", [p for p in SPECS if p.values[0].elementwise])
def test_elementwise_rules_give_the_same_values_on_column_slices(spec):
    # What meta-consensus merge relies on to stream these rules in column chunks.
    n = _size(spec)
    base, stacked = _trees(n, seed=4)
    stacked = {"w": stacked["w"]}
    base = {"w": base["w"]}
    whole, _ = _run(spec, stacked, base)
    sliced = _on_column_slices(spec, stacked, base, [0, 1, 7, 15])
    np.testing.assert_array_equal(sliced, np.asarray(whole["w"], np.float64).reshape(-1))


def test_the_column_slice_check_fails_for_a_per_leaf_statistic():
    # TIES keeps the top-k magnitudes of each leaf: not element-wise, and the check above sees it.
    spec = registry.RULES["ties"]
    assert not spec.elementwise
    n = _size(spec)
    base, stacked = _trees(n, seed=4)
    stacked, base = {"w": stacked["w"]}, {"w": base["w"]}
    whole, _ = _run(spec, stacked, base)
    sliced = _on_column_slices(spec, stacked, base, [0, 1, 7, 15])
    assert not np.allclose(sliced, np.asarray(whole["w"], np.float64).reshape(-1))
