"""RegMean's statistics on a Hugging Face model: every linear layer's input Gram matrix.

The probe kernel's gradient is ``X^T X`` of the rows the layer received. Checked against the
first block's inputs written out in float64 numpy (the RMS-normed embeddings feed q, k and v), a
Python loop over the blocks (``scan=False``) against the scanned model, additivity over chunks,
and RegMean on the Grams against its closed form.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import consensus
from strategies.statistics import linear_input_grams


@pytest.fixture(scope="module")
def lm(tmp_path_factory):
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    pytest.importorskip("tokenizers")
    from causal_lm_helpers import corpus, model_folder, task_options

    from strategies.registry import build_task

    folder = model_folder(tmp_path_factory.mktemp("tiny_llama"))
    text = corpus(tmp_path_factory.mktemp("corpus"))
    task = build_task("causal_lm", task_options(folder, text, windows_per_node=8))
    params = task.init(jax.random.key(0))
    batch = {k: jnp.asarray(v[:6]) for k, v in task.splits(2, seed=0).test.items()}
    return task, params, batch


def _path(params, *names):
    """The leaf path whose keys, read as strings, are ``names``."""
    for path, _ in jax.tree_util.tree_flatten_with_path(params)[0]:
        keys = [str(getattr(k, "key", getattr(k, "idx", k))) for k in path]
        if keys[-len(names) :] == list(names):
            return jax.tree_util.keystr(path)
    raise KeyError(names)


def _leaf(params, path):
    return {jax.tree_util.keystr(q): v for q, v in jax.tree_util.tree_flatten_with_path(params)[0]}[path]


def test_first_block_grams_are_the_normed_embeddings_second_moment(lm):
    task, params, batch = lm
    grams = linear_input_grams(task.loss, params, batch, chunk_size=4)
    flat = {jax.tree_util.keystr(p): np.asarray(v, np.float64)
            for p, v in jax.tree_util.tree_flatten_with_path(params)[0]}  # fmt: skip
    emb = flat[_path(params, "embed_tokens", "embedding")]
    norm = flat[_path(params, "0", "input_layernorm", "scale")]
    e = emb[np.asarray(batch["x"]).reshape(-1)]
    eps = task._get("lm").config.norm_eps
    h = e / np.sqrt(np.mean(e**2, axis=-1, keepdims=True) + eps) * norm
    want = h.T @ h
    for proj in ("q_proj", "k_proj", "v_proj"):
        got = np.asarray(grams[_path(params, "0", "self_attn", proj, "kernel")], np.float64)
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4 * np.abs(want).max())
    # every 2-D kernel has its Gram, square in the kernel's input width
    kernels = {p: v for p, v in flat.items() if p.endswith("['kernel']") and v.ndim == 2}
    assert set(grams) == set(kernels)
    for p, g in grams.items():
        assert g.shape == (kernels[p].shape[0],) * 2


@pytest.mark.slow
def test_scanned_blocks_give_the_loops_grams_and_chunks_add_up(lm):
    task, params, batch = lm
    scanned = linear_input_grams(task.loss, params, batch, chunk_size=6)
    from strategies.models.model import CausalLM

    loaded = task.__dict__["_loaded"]
    scanned_lm = loaded["lm"]
    loaded["lm"] = CausalLM(scanned_lm.config, scan=False)  # every block traced on its own
    try:  # (a new loss function: the jitted Gram pass is cached per loss function)
        looped = linear_input_grams(lambda p, b: task.loss(p, b), params, batch, chunk_size=2)
    finally:
        loaded["lm"] = scanned_lm
    halves = [linear_input_grams(task.loss, params, {k: v[s] for k, v in batch.items()}, chunk_size=3)
              for s in (slice(0, 3), slice(3, 6))]  # fmt: skip
    for p in scanned:
        ref = np.asarray(looped[p], np.float64)
        tol = 1e-4 * np.abs(ref).max()
        np.testing.assert_allclose(np.asarray(scanned[p]), ref, atol=tol)
        np.testing.assert_allclose(np.asarray(halves[0][p] + halves[1][p]), ref, atol=tol)


@pytest.mark.slow
def test_regmean_on_the_grams_is_the_least_squares_merge(lm):
    task, params, batch = lm
    rng = np.random.default_rng(0)
    nodes = [jax.tree.map(lambda v: v + 0.02 * jnp.asarray(rng.normal(size=v.shape), v.dtype), params)
             for _ in range(2)]  # fmt: skip
    grams = [linear_input_grams(task.loss, p, {k: v[3 * i : 3 * i + 3] for k, v in batch.items()})
             for i, p in enumerate(nodes)]  # fmt: skip
    stacked = consensus.stack(nodes)
    agg = consensus.regmean(ridge=0.0)
    merged, _ = agg.update(stacked, agg.init(params), params, grams=consensus.stack(grams))
    p = _path(params, "1", "mlp", "down_proj", "kernel")
    g = [np.asarray(gr[p], np.float64) for gr in grams]
    w = [np.asarray(_leaf(n, p), np.float64) for n in nodes]
    want = np.linalg.solve(g[0] + g[1], g[0] @ w[0] + g[1] @ w[1])
    got = _leaf(merged, p)
    np.testing.assert_allclose(np.asarray(got, np.float64), want, atol=2e-4 * np.abs(want).max())
