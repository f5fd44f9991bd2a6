"""Stacked trees: construction, validation messages, Gram statistics, weighted sums."""

import jax
import jax.numpy as jnp
import numpy as np
import numpy_reference as ref
import pytest

import consensus
from consensus import tree


def _tree(seed=0, dtype=np.float32):
    rng = np.random.default_rng(seed)
    return {
        "layer": {
            "kernel": rng.standard_normal((4, 3)).astype(dtype),
            "bias": rng.standard_normal(3).astype(dtype),
        }
    }


def test_stack_unstack_round_trip():
    trees = [_tree(i) for i in range(5)]
    stacked = consensus.stack(trees)
    assert stacked["layer"]["kernel"].shape == (5, 4, 3)
    assert consensus.num_nodes(stacked) == 5
    for a, b in zip(trees, consensus.unstack(stacked), strict=True):
        jax.tree.map(np.testing.assert_array_equal, a, jax.tree.map(np.asarray, b))


def test_structure_mismatch_names_node_and_leaf():
    trees = [_tree(0), _tree(1), {"layer": {"kernel": np.zeros((4, 3), np.float32)}}]
    with pytest.raises(consensus.TreeMismatchError, match=r"node 2.*missing leaves.*bias"):
        consensus.stack(trees)


def test_shape_mismatch_names_node_and_leaf():
    bad = _tree(1)
    bad["layer"]["kernel"] = np.zeros((4, 4), np.float32)
    with pytest.raises(
        consensus.TreeMismatchError, match=r"node 1, leaf \['layer'\]\['kernel'\]: shape \(4, 4\)"
    ):
        consensus.stack([_tree(0), bad])


def test_dtype_mismatch_names_node_and_leaf():
    with pytest.raises(consensus.TreeMismatchError, match=r"node 1, leaf .*bias.*dtype float16"):
        consensus.stack([_tree(0), _tree(1, np.float16)])


def test_nonfinite_report_and_check_name_node_and_leaf():
    trees = [_tree(i) for i in range(4)]
    trees[2]["layer"]["bias"][1] = np.inf
    trees[3]["layer"]["kernel"][0, 0] = np.nan
    stacked = consensus.stack(trees)
    assert consensus.nonfinite_report(stacked) == [(2, "['layer']['bias']"), (3, "['layer']['kernel']")]
    np.testing.assert_array_equal(np.asarray(consensus.finite_mask(stacked)), [True, True, False, False])
    with pytest.raises(consensus.NonFiniteError, match=r"node 2 leaf \['layer'\]\['bias'\]"):
        consensus.check_finite(stacked)


def test_stacked_against_params_mismatch():
    stacked = consensus.stack([_tree(i) for i in range(3)])
    params = _tree(9)
    params["layer"]["bias"] = np.zeros(4, np.float32)
    with pytest.raises(consensus.TreeMismatchError, match=r"bias.*not \(n=3,\) \+ params shape \(4,\)"):
        consensus.mean().update(stacked, consensus.mean().init(params), params)


def test_gram_sums_over_leaves_without_concatenating():
    trees = [_tree(i) for i in range(6)]
    centre = _tree(10)
    stacked = consensus.stack(trees)
    X = ref.flatten_stacked(stacked) - ref.flatten_tree(centre)
    np.testing.assert_allclose(np.asarray(consensus.gram(stacked, centre)), X @ X.T, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(tree.gram_f64(stacked, centre), X @ X.T, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(consensus.sq_norms(stacked, centre)), (X**2).sum(1), rtol=1e-5)


def test_weighted_sum_and_combine():
    trees = [_tree(i) for i in range(4)]
    stacked = consensus.stack(trees)
    w = np.array([0.1, 0.2, 0.3, 0.4], np.float32)
    X = ref.flatten_stacked(stacked)
    np.testing.assert_allclose(
        ref.flatten_tree(consensus.weighted_sum(stacked, jnp.asarray(w))), w @ X, rtol=1e-6
    )
    c = _tree(7)
    a = np.array([0.2, 0.1, 0.0, 0.3], np.float32)  # sums to 0.6: 0.4 stays on c
    got = ref.flatten_tree(consensus.combine(stacked, jnp.asarray(a), c))
    cf = ref.flatten_tree(c)
    np.testing.assert_allclose(got, cf + a @ (X - cf), rtol=1e-5, atol=1e-6)


def test_krum_picks_right_winner_when_nodes_differ_by_1e_4_relative():
    """Fine-tunes from one init: nodes 1e-4 apart relative to the parameters."""
    rng = np.random.default_rng(0)
    d = 200_000
    base = {"w": (1.0 + rng.standard_normal(d)).astype(np.float32)}
    scales = np.array([1.0, 1.0, 1.0, 1.0, 1.0, 1.3, 3.0, 3.0])  # nodes 6, 7 are farther out
    nodes = [{"w": (base["w"] * (1 + 1e-4 * s * rng.standard_normal(d))).astype(np.float32)} for s in scales]
    stacked = consensus.stack(nodes)
    X = ref.flatten_stacked(stacked)
    want_winner = int(np.argmin(ref.krum_scores(X, 2, np.ones(8, bool))))
    for params in (base, None):  # centred on params, or on the coordinate-wise median
        agg = consensus.krum(2)
        merged, state = agg.update(stacked, agg.init(base), params)
        assert int(np.argmax(np.asarray(consensus.get_info(state).selected))) == want_winner
        np.testing.assert_array_equal(np.asarray(merged["w"]), np.asarray(stacked["w"][want_winner]))
    # And the centred distances agree with float64 where the raw Gram cannot.
    g = np.asarray(consensus.gram(stacked, base), np.float64)
    dg = np.diag(g)
    d2 = dg[:, None] + dg[None, :] - 2 * g
    np.testing.assert_allclose(d2, ref.sq_dists(X), rtol=1e-3, atol=1e-6 * ref.sq_dists(X).max())


def test_a_stacked_tuple_of_like_arrays_is_a_stacked_tree_but_a_list_of_node_trees_is_refused():
    from consensus import median, stack

    rng = np.random.default_rng(0)
    w, b = rng.normal(size=(5, 3)).astype(np.float32), rng.normal(size=(5, 3)).astype(np.float32)
    assert tree.num_nodes((jnp.asarray(w), jnp.asarray(b))) == 5
    agg = median()
    merged, _ = agg.update((jnp.asarray(w), jnp.asarray(b)), agg.init(None))
    np.testing.assert_allclose(np.asarray(merged[0]), np.median(w, axis=0), rtol=1e-6)
    nodes = [{"w": jnp.asarray(w[i])} for i in range(5)]
    with pytest.raises(tree.TreeMismatchError, match="got a list of 5 trees"):
        tree.num_nodes(nodes)
    assert tree.num_nodes(stack(nodes)) == 5
