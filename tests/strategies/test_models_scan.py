"""Blocks run as one ``lax.scan`` over stacked weights give the Python loop's logits and gradients."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from strategies.models import from_config

LLAMA = {
    "model_type": "llama",
    "vocab_size": 97,
    "hidden_size": 32,
    "intermediate_size": 48,
    "num_hidden_layers": 3,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 8,
    "max_position_embeddings": 64,
    "tie_word_embeddings": True,
}
GPT2 = {"model_type": "gpt2", "vocab_size": 97, "n_embd": 32, "n_layer": 3, "n_head": 4, "n_positions": 64}


@pytest.mark.parametrize("cfg", [LLAMA, GPT2], ids=["llama", "gpt2"])
def test_scanned_blocks_equal_the_loop(cfg):
    loop, scanned = from_config(cfg, scan=False), from_config(cfg, scan=True)
    scanned_remat = from_config(cfg, scan=True, remat=True)
    params = loop.init(jax.random.key(0))
    tokens = jax.random.randint(jax.random.key(1), (2, 12), 0, 97)

    def loss(model):
        return lambda p: jnp.mean(jax.nn.log_softmax(model.apply(p, tokens))[..., 0])

    np.testing.assert_allclose(scanned.apply(params, tokens), loop.apply(params, tokens), atol=2e-6)
    ref = jax.grad(loss(loop))(params)
    for model in (scanned, scanned_remat):
        got = jax.grad(loss(model))(params)
        for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(ref), strict=True):
            np.testing.assert_allclose(a, b, atol=2e-6, rtol=1e-5)


def test_blocks_that_differ_are_not_scanned_and_still_match():
    # GPT-2 scaling attention by the inverse layer index: each block has its own scale.
    cfg = {**GPT2, "scale_attn_by_inverse_layer_idx": True}
    loop, scanned = from_config(cfg, scan=False), from_config(cfg, scan=True)
    params = loop.init(jax.random.key(0))
    tokens = jax.random.randint(jax.random.key(1), (1, 8), 0, 97)
    np.testing.assert_array_equal(scanned.apply(params, tokens), loop.apply(params, tokens))
