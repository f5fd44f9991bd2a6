"""consensus.lora: every adapter method against its float64 reference, and the input checks."""

from __future__ import annotations

import jax
import lora_reference as ref
import numpy as np
import pytest

import consensus
from consensus import lora

SHAPES = {"blocks/0/attn/kernel": (12, 7), "blocks/0/mlp/kernel": (7, 9)}


def adapters(n=4, r=3, seed=0, shapes=SHAPES):
    """Random float32 factors, drawn as one jax.random vector (one compilation) and cut per target."""
    sizes = [(n, fan_in, r) for fan_in, _ in shapes.values()] + [
        (n, r, fan_out) for _, fan_out in shapes.values()
    ]
    flat = np.asarray(jax.random.normal(jax.random.key(seed), (sum(int(np.prod(z)) for z in sizes),)))
    out, at = {}, 0
    for t, (fan_in, fan_out) in shapes.items():
        a = flat[at : at + n * fan_in * r].reshape(n, fan_in, r)
        at += a.size
        b = flat[at : at + n * r * fan_out].reshape(n, r, fan_out)
        at += b.size
        out[t] = {"a": a, "b": b}
    return out


def close(x, y, rtol=2e-5, atol=2e-5):
    np.testing.assert_allclose(np.asarray(x, np.float64), y, rtol=rtol, atol=atol)


def test_fedit_is_the_product_of_the_factor_means():
    st, w, s = adapters(), np.array([1.0, 2.0, 3.0, 4.0]), np.array([0.5, 0.5, 1.0, 2.0])
    m = lora.merge_adapters("fedit", st, scale=s, weights=w)
    wn = w / w.sum()
    for t, f in ref.f64(st).items():
        close(m.delta(t), ref.fedit(f, s, wn))
        # the product of the means is not the mean of the products (the cross terms); info says by how much
        gap = np.sum((ref.fedit(f, s, wn) - ref.weighted_product_sum(f, s, wn)) ** 2)
        assert gap > 1e-2
        np.testing.assert_allclose(m.info["approximation_error"][t], gap, rtol=1e-5)
    assert m.info["exactness"] == "approximate" and m.base_delta is None and m.scale == 0.5
    assert m.info["rank"] == 3


def test_ffa_is_exact_with_a_shared_a():
    st = adapters()
    for t in st:
        st[t]["a"] = np.broadcast_to(st[t]["a"][:1], st[t]["a"].shape)
    w = np.array([0.1, 0.2, 0.3, 0.4])
    m = lora.merge_adapters("ffa", st, scale=2.0, weights=w)
    for t, f in ref.f64(st).items():
        close(m.delta(t), ref.weighted_product_sum(f, np.full(4, 2.0), w))
    assert m.info["exactness"] == "exact"


def test_ffa_refuses_nodes_whose_a_differ():
    st = adapters()
    with pytest.raises(
        lora.AdapterError, match=r"ffa: the nodes' a differ at target 'blocks/0/attn/kernel' \(node 1"
    ):
        lora.merge_adapters("ffa", st, scale=1.0)


def test_stack_is_exact_with_rank_n_r_and_drops_zero_weight_nodes():
    st, s = adapters(), np.array([1.0, 0.5, 0.25, 2.0])
    w = np.array([3.0, 0.0, 1.0, 1.0])
    m = lora.merge_adapters("stack", st, scale=s, weights=w)
    for t, f in ref.f64(st).items():
        close(m.delta(t), ref.weighted_product_sum(f, s, w / w.sum()))
        assert m.adapter[t]["a"].shape == (f["a"].shape[1], 9)
    assert m.info["nodes"] == [0, 2, 3] and m.info["rank"] == 9
    full = lora.merge_adapters("stack", st, scale=1.0)
    assert full.info["rank"] == 12


def test_bad_inputs_name_the_problem():
    st = adapters()
    bad = {t: dict(f) for t, f in st.items()}
    bad["blocks/0/mlp/kernel"]["b"] = np.asarray(bad["blocks/0/mlp/kernel"]["b"]).copy()
    bad["blocks/0/mlp/kernel"]["b"][2, 0, 0] = np.nan
    with pytest.raises(
        lora.AdapterError, match=r"non-finite .* 'b' of target 'blocks/0/mlp/kernel', node\(s\) \[2\]"
    ):
        lora.merge_adapters("fedit", bad, scale=1.0)
    mism = {t: dict(f) for t, f in st.items()}
    mism["blocks/0/mlp/kernel"]["b"] = mism["blocks/0/mlp/kernel"]["b"][:, :2]
    with pytest.raises(lora.AdapterError, match="rank mismatch at target 'blocks/0/mlp/kernel'"):
        lora.merge_adapters("fedit", mism, scale=1.0)
    with pytest.raises(lora.AdapterError, match="one entry per node"):
        lora.merge_adapters("fedit", st, scale=1.0, weights=[1.0, 2.0])
    with pytest.raises(lora.AdapterError, match="fedit takes no rank"):
        lora.merge_adapters("fedit", st, scale=1.0, rank=2)
    with pytest.raises(ValueError, match="unknown adapter merge method 'nope'; valid choices"):
        lora.merge_adapters("nope", st, scale=1.0)


def test_stack_adapters_names_a_missing_target_and_a_rank_mismatch():
    one = {t: {"a": f["a"][0], "b": f["b"][0]} for t, f in adapters().items()}
    two = {t: {"a": f["a"][1], "b": f["b"][1]} for t, f in adapters().items()}
    stacked = lora.stack_adapters([one, two])
    np.testing.assert_array_equal(stacked["blocks/0/attn/kernel"]["a"][1], two["blocks/0/attn/kernel"]["a"])
    lacking = {"blocks/0/attn/kernel": two["blocks/0/attn/kernel"]}
    with pytest.raises(lora.AdapterError, match=r"node 1 lacks target\(s\) \['blocks/0/mlp/kernel'\]"):
        lora.stack_adapters([one, lacking])
    low = {t: {"a": f["a"][:, :2], "b": f["b"][:2]} for t, f in two.items()}
    with pytest.raises(
        lora.AdapterError, match="rank mismatch at target 'blocks/0/attn/kernel': node 0 has r=3, node 1 r=2"
    ):
        lora.stack_adapters([one, low])


def test_fresh_adapter_adds_nothing_and_follows_peft_init_bounds():
    fresh = lora.fresh_adapter(jax.random.key(3), {"w": (16, 5)}, 4)
    a, b = np.asarray(fresh["w"]["a"]), np.asarray(fresh["w"]["b"])
    assert a.shape == (16, 4) and b.shape == (4, 5) and not b.any()
    assert np.abs(a).max() <= 0.25 and a.std() > 0.05  # kaiming_uniform(a=sqrt 5): U(-1/sqrt(in), 1/sqrt(in))


# ----------------------------------------------------------------------------- svd, exact_residual, Gram


@pytest.mark.parametrize("rank", [2, 5])
def test_svd_is_the_truncated_weighted_sum_with_the_eckart_young_error(rank):
    st, s = adapters(n=3, r=3), np.array([0.5, 1.0, 2.0])
    w = np.array([0.7, -0.2, 0.9])  # PEFT's convention: as given, negative allowed
    m = lora.merge_adapters("svd", st, scale=s, weights=w, rank=rank)
    total_err = total_norm = 0.0
    for t, f in ref.f64(st).items():
        target = ref.weighted_product_sum(f, s, w)
        best, err = ref.truncated(target, rank)
        close(m.delta(t), best, rtol=1e-4, atol=1e-4)
        np.testing.assert_allclose(m.info["truncation_error"][t], err, rtol=1e-4)
        np.testing.assert_allclose(err, np.sum((target - best) ** 2), rtol=1e-9)
        assert m.adapter[t]["a"].shape[1] == rank
        total_err, total_norm = total_err + err, total_norm + np.sum(target**2)
    np.testing.assert_allclose(m.info["relative_truncation_error"], total_err / total_norm, rtol=1e-4)
    assert m.info["exactness"] == "approximate" and m.info["rank"] == rank


def test_svd_with_a_rank_at_least_n_r_is_exact_and_pads_with_zeros():
    st = adapters(n=2, r=2)
    m = lora.merge_adapters("svd", st, scale=1.0, rank=6)  # rank(M) <= 4: two zero columns
    for t, f in ref.f64(st).items():
        close(m.delta(t), ref.weighted_product_sum(f, np.ones(2), np.full(2, 0.5)), rtol=1e-4, atol=1e-4)
        assert m.info["truncation_error"][t] < 1e-8 * np.sum(np.asarray(m.delta(t)) ** 2)
        assert not np.asarray(m.adapter[t]["b"])[4:].any()


def test_exact_residual_adds_up_to_the_mean_of_the_products():
    st, s, w = adapters(), np.full(4, 0.25), np.array([1.0, 1.0, 2.0, 4.0])
    m = lora.merge_adapters("exact_residual", st, scale=s, weights=w)
    wn = w / w.sum()
    for t, f in ref.f64(st).items():
        close(m.delta(t), ref.weighted_product_sum(f, s, wn))
        close(m.scale * np.asarray(m.adapter[t]["a"]) @ np.asarray(m.adapter[t]["b"]), ref.fedit(f, s, wn))
        close(m.base_delta[t], ref.weighted_product_sum(f, s, wn) - ref.fedit(f, s, wn))
    assert m.info["exactness"] == "exact"


def test_product_gram_from_the_factors_equals_the_brute_force_gram():
    st, s = adapters(n=5, r=4, seed=2), np.array([1.0, 0.5, 2.0, 1.0, 3.0])
    g = lora.product_gram(st, s)
    np.testing.assert_allclose(g, ref.brute_gram(st, s), rtol=1e-10, atol=1e-9)
    assert g.dtype == np.float64


# ----------------------------------------------------------------------------- PEFT's combinations


def test_cat_is_exact_with_the_weights_as_given_and_every_node_kept():
    st, s, w = adapters(n=3), np.array([0.5, 1.0, 2.0]), np.array([1.0, 0.0, -2.0])
    m = lora.merge_adapters("cat", st, scale=s, weights=w)
    for t, f in ref.f64(st).items():
        close(m.delta(t), ref.weighted_product_sum(f, s, w))
    assert m.scale == 1.0 and m.info["rank"] == 9


def test_peft_linear_and_ties_follow_pefts_formulas():
    st, s, w = adapters(n=3), np.array([0.5, 1.0, 2.0]), np.array([0.5, -0.3, 0.8])
    lin = lora.merge_adapters("linear", st, scale=s, weights=w)
    ties = lora.merge_adapters("ties", st, scale=s, weights=w, density=0.5, majority_sign_method="frequency")
    ca, cb = ref.peft_split(w, s)
    for t, f in ref.f64(st).items():
        close(lin.delta(t), ref.peft_linear(f, s, w))
        gap = np.sum((ref.peft_linear(f, s, w) - ref.weighted_product_sum(f, s, w)) ** 2)
        np.testing.assert_allclose(lin.info["approximation_error"][t], gap, rtol=1e-5)
        close(ties.adapter[t]["a"], ref.peft_ties_factor(f["a"], ca, 0.5, "frequency"))
        close(ties.adapter[t]["b"], ref.peft_ties_factor(f["b"], cb, 0.5, "frequency"))
    assert lin.scale == ties.scale == 1.0


def test_dare_keeps_entries_rescaled_or_drops_them_and_is_linear_at_density_one():
    st, w = adapters(n=3), np.array([0.2, 0.3, 0.5])
    key = jax.random.key(7)
    one = lora.merge_adapters("dare_linear", st, scale=1.0, weights=w, density=1.0, key=key)
    lin = lora.merge_adapters("linear", st, scale=1.0, weights=w)
    dt = lora.merge_adapters("dare_ties", st, scale=1.0, weights=w, density=1.0, key=key)
    ties = lora.merge_adapters("ties", st, scale=1.0, weights=w, density=1.0)
    ca, cb = ref.peft_split(w, np.ones(3))
    for t, f in ref.f64(st).items():
        close(one.delta(t), np.asarray(lin.delta(t), np.float64))
        close(dt.adapter[t]["a"], ref.peft_ties_factor(f["a"], ca, 1.0))  # nothing dropped: TIES' election
        close(ties.adapter[t]["b"], ref.peft_ties_factor(f["b"], cb, 1.0))
    single = adapters(n=1, r=8, shapes={"w": (50, 10)})
    half = lora.merge_adapters("dare_linear", single, scale=1.0, weights=[1.0], density=0.5, key=key)
    x, y = np.asarray(single["w"]["a"][0], np.float64), np.asarray(half.adapter["w"]["a"], np.float64)
    kept = y != 0
    np.testing.assert_allclose(y[kept], 2 * x[kept], rtol=1e-6)  # kept entries rescaled by 1/density
    assert 0.4 < kept.mean() < 0.6  # 400 draws of p = 0.5
    with pytest.raises(lora.AdapterError, match="dare_ties is randomised: pass key"):
        lora.merge_adapters("dare_ties", st, scale=1.0, density=0.5)
    with pytest.raises(lora.AdapterError, match="ties needs density"):
        lora.merge_adapters("ties", st, scale=1.0)
    with pytest.raises(lora.AdapterError, match=r"dare_linear: density must be in \(0, 1\]"):
        lora.merge_adapters("dare_linear", st, scale=1.0, density=0.0, key=key)


# ----------------------------------------------------------------------------- robust rules


def outlier_adapters(n=6, r=2, seed=4):
    """n - 1 honest nodes around one update and node 1 far away (a Byzantine update)."""
    st = adapters(n=n, r=r, seed=seed)
    out = {}
    for t, f in st.items():
        a, b = np.array(f["a"]), np.array(f["b"])
        a[:] = a[0] + 0.05 * (a - a[0])
        b[:] = b[0] + 0.05 * (b - b[0])
        b[1] *= 40.0
        out[t] = {"a": a, "b": b}
    return out


def test_krum_on_the_products_selects_as_on_the_dense_products():
    import numpy_reference as nref

    st, s = outlier_adapters(), np.full(6, 0.5)
    x = ref.flat_products(st, s)
    _, winner = nref.krum(x, 1, np.ones(6, bool))
    m = lora.merge_adapters("stack", st, scale=0.5, rule=consensus.krum(1))
    assert m.info["selected"] == [winner] and m.info["nodes"] == [winner] and m.info["rank"] == 2
    for t, p in ref.split_flat(x[winner], st).items():
        close(m.delta(t), p)
    mk = lora.merge_adapters("svd", st, scale=0.5, rule=consensus.multi_krum(1, 3), rank=6)
    want, chosen = nref.multi_krum(x, 1, 3, np.ones(6, bool))
    assert set(mk.info["selected"]) == chosen and 1 not in chosen
    for t, p in ref.split_flat(want, st).items():
        close(mk.delta(t), p, rtol=1e-4, atol=1e-5)


def test_geometric_median_on_the_products_matches_weiszfeld_on_the_dense_products():
    import numpy_reference as nref

    st = outlier_adapters()
    x = ref.flat_products(st, np.ones(6))
    m = lora.merge_adapters("exact_residual", st, scale=1.0, rule=consensus.geometric_median())
    want = ref.split_flat(nref.geometric_median(x, np.ones(6, bool)), st)
    for t, p in want.items():
        close(m.delta(t), p, rtol=1e-3, atol=1e-3 * np.abs(p).max())
    assert m.info["exactness"] == "exact" and m.info["space"] == "products"


@pytest.mark.parametrize("chunk", [None, 200])
def test_coordinatewise_median_on_the_products_is_streamed_per_target(monkeypatch, chunk):
    from consensus.lora import robust

    if chunk is not None:  # a few columns at a time: the same median
        monkeypatch.setattr(robust, "CHUNK_BYTES", chunk)
    st, s = outlier_adapters(n=5), np.full(5, 2.0)
    exact = lora.merge_adapters("exact_residual", st, scale=2.0, rule=consensus.median())
    svd = lora.merge_adapters("svd", st, scale=2.0, rule=consensus.median(), rank=1)
    for t, f in ref.f64(st).items():
        med = np.median(ref.products(f, s), axis=0)
        close(exact.delta(t), med)
        best, err = ref.truncated(med, 1)
        close(svd.delta(t), best, rtol=1e-4, atol=1e-5)
        np.testing.assert_allclose(svd.info["truncation_error"][t], err, rtol=1e-4)
    assert exact.info["exactness"] == "exact" and svd.info["exactness"] == "approximate"


def test_rules_on_the_factors_see_the_factors():
    st = outlier_adapters(n=5)
    m = lora.merge_adapters("fedit", st, scale=1.0, rule=consensus.median(), space="factors")
    for t, f in ref.f64(st).items():
        close(m.adapter[t]["a"], np.median(f["a"], axis=0))
        close(m.adapter[t]["b"], np.median(f["b"], axis=0))
    assert m.info["space"] == "factors" and m.info["exactness"] == "approximate"
    shared = {t: {"a": np.broadcast_to(f["a"][:1], f["a"].shape), "b": f["b"]} for t, f in st.items()}
    ffa = lora.merge_adapters("ffa", shared, scale=1.0, rule=consensus.trimmed_mean(1), space="factors")
    for t, f in ref.f64(shared).items():
        srt = np.sort(f["b"], axis=0)
        close(ffa.adapter[t]["b"], srt[1:4].mean(0))
        np.testing.assert_array_equal(ffa.adapter[t]["a"], f["a"][0])


def test_robust_errors_name_the_problem():
    st = outlier_adapters(n=4)
    with pytest.raises(consensus.ByzantineToleranceError, match="krum"):
        lora.merge_adapters("stack", st, scale=1.0, rule=consensus.krum(2))  # needs n > 2f + 2
    with pytest.raises(lora.AdapterError, match="stack combines the nodes with weights.*median"):
        lora.merge_adapters("stack", st, scale=1.0, rule=consensus.median())
    with pytest.raises(lora.AdapterError, match="space='factors'.*svd works on the products"):
        lora.merge_adapters("svd", st, scale=1.0, rule=consensus.median(), space="factors")
    with pytest.raises(lora.AdapterError, match="pre-aggregator"):
        lora.merge_adapters("stack", st, scale=1.0, rule=consensus.nnm(1))


def test_a_non_finite_node_is_left_out_of_a_robust_merge():
    st = outlier_adapters(n=5)
    st["blocks/0/attn/kernel"]["a"][3, 0, 0] = np.inf
    m = lora.merge_adapters("exact_residual", st, scale=1.0, rule=consensus.median())
    assert m.info["valid"] == [0, 1, 2, 4]
    for t, f in ref.f64(st).items():
        keep = [0, 1, 2, 4]
        close(m.delta(t), np.median(ref.products(f, np.ones(5))[keep], axis=0))


def test_every_adapter_method_has_a_reference_and_a_row_in_the_docs():
    import re
    from pathlib import Path

    page = (Path(__file__).resolve().parents[2] / "docs" / "merging.md").read_text()
    table = page.split("### The methods", 1)[1].split("###", 1)[0]
    rows = [line for line in table.splitlines() if line.startswith("| `")]
    documented = {name for row in rows for name in re.findall(r"`(\w+)`", row.split("|")[1])}
    assert documented == set(lora.ADAPTER_METHODS)
    for name, spec in lora.ADAPTER_METHODS.items():
        doc = spec.factory.__doc__ or ""
        assert "References:" in doc and spec.kind == "adapter", name
        exact = next(r for r in rows if f"`{name}`" in r.split("|")[1]).split("|")[3].strip()
        assert exact.startswith("yes") == spec.traits["exact"], name


def test_ffa_under_a_vector_rule_leaves_a_non_finite_node_out_and_stays_exact():
    import numpy_reference as nref

    st = outlier_adapters(n=6)
    st = {t: {"a": np.broadcast_to(f["a"][:1], f["a"].shape).copy(), "b": f["b"]} for t, f in st.items()}
    st["blocks/0/mlp/kernel"]["b"][4, 1, 2] = np.nan
    m = lora.merge_adapters("ffa", st, scale=1.0, rule=consensus.multi_krum(1, 3))
    valid = np.arange(6) != 4
    x = ref.flat_products(st, np.ones(6))
    want, chosen = nref.multi_krum(np.where(valid[:, None], x, 0.0), 1, 3, valid)
    assert m.info["valid"] == [0, 1, 2, 3, 5] and set(m.info["selected"]) == chosen
    assert m.info["exactness"] == "exact"
    for t, p in ref.split_flat(want, st).items():
        close(m.delta(t), p, rtol=1e-4, atol=1e-5)
