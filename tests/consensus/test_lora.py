"""consensus.lora: every adapter method against its float64 reference, and the input checks."""

from __future__ import annotations

import jax
import lora_reference as ref
import numpy as np
import pytest

from consensus import lora

SHAPES = {"blocks/0/attn/kernel": (12, 7), "blocks/0/mlp/kernel": (7, 9)}


def adapters(n=4, r=3, seed=0, shapes=SHAPES):
    key = jax.random.key(seed)
    out = {}
    for i, (t, (fan_in, fan_out)) in enumerate(shapes.items()):
        ka, kb = jax.random.split(jax.random.fold_in(key, i))
        out[t] = {
            "a": jax.random.normal(ka, (n, fan_in, r)),
            "b": jax.random.normal(kb, (n, r, fan_out)),
        }
    return out


def close(x, y, rtol=2e-5, atol=2e-5):
    np.testing.assert_allclose(np.asarray(x, np.float64), y, rtol=rtol, atol=atol)


def test_fedit_is_the_product_of_the_factor_means():
    st, w, s = adapters(), np.array([1.0, 2.0, 3.0, 4.0]), np.array([0.5, 0.5, 1.0, 2.0])
    m = lora.merge_adapters("fedit", st, scale=s, weights=w)
    wn = w / w.sum()
    for t, f in ref.f64(st).items():
        close(m.delta(t), ref.fedit(f, s, wn))
        # the product of the means is not the mean of the products (the cross terms)
        assert np.abs(ref.fedit(f, s, wn) - ref.weighted_product_sum(f, s, wn)).max() > 1e-2
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
