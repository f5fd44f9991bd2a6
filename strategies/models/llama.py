"""Llama, Mistral (SmolLM2 is a Llama) and Qwen2: RMSNorm, SwiGLU, grouped-query attention with rotary.

The tree mirrors Hugging Face's ``LlamaForCausalLM``: ``model/embed_tokens/embedding``,
``model/layers/<i>/{input_layernorm, self_attn/{q,k,v,o}_proj, post_attention_layernorm,
mlp/{gate,up,down}_proj}``, ``model/norm/scale`` and ``lm_head/kernel`` (absent when the head is
tied to the embedding). Rotary embeddings keep Hugging Face's rotate-half layout, so q/k
kernels load without a permutation and a merged tree exports without one.
"""

from __future__ import annotations

import math

import jax
from flax import nnx

from strategies.models.config import ModelConfig
from strategies.models.layers import (
    Array,
    Embedding,
    Linear,
    RMSNorm,
    activation,
    apply_rope,
    attention,
    rope_cos_sin,
    rope_inv_freq,
    run_blocks,
)


class LlamaAttention(nnx.Module):
    """Grouped-query self-attention with rotary positions.

    Args:
      config: the model config.
      layer: the block's index (its sliding window).
    """

    def __init__(self, config: ModelConfig, layer: int):
        c = config
        std = c.initializer_range
        self.num_heads, self.num_kv_heads, self.head_dim = c.num_heads, c.num_kv_heads, c.head_dim
        self.window = c.sliding_window[layer] if c.sliding_window else None
        q_out, kv_out = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
        self.q_proj = Linear(c.hidden_size, q_out, ("embed", "heads"), bias=c.attention_bias, std=std)
        self.k_proj = Linear(c.hidden_size, kv_out, ("embed", "kv_heads"), bias=c.attention_bias, std=std)
        self.v_proj = Linear(c.hidden_size, kv_out, ("embed", "kv_heads"), bias=c.attention_bias, std=std)
        self.o_proj = Linear(q_out, c.hidden_size, ("heads", "embed"), bias=c.attention_out_bias, std=std)

    def __call__(self, x: Array, cos: Array, sin: Array) -> Array:
        """Attention of every position over itself and the earlier ones.

        Args:
          x: (B, T, hidden) activations.
          cos: (T, head_dim) rotary cosines.
          sin: (T, head_dim) rotary sines.

        Returns:
          (B, T, hidden), x's dtype.
        """
        b, t, _ = x.shape
        q = self.q_proj(x).reshape(b, t, self.num_heads, self.head_dim)
        k = self.k_proj(x).reshape(b, t, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x).reshape(b, t, self.num_kv_heads, self.head_dim)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        out = attention(q, k, v, scale=1.0 / math.sqrt(self.head_dim), window=self.window)
        return self.o_proj(out.reshape(b, t, self.num_heads * self.head_dim))


class LlamaMLP(nnx.Module):
    """The gated MLP ``down(act(gate(x)) * up(x))``.

    Args:
      config: the model config.
    """

    def __init__(self, config: ModelConfig):
        c = config
        std = c.initializer_range
        self.act = c.activation
        self.gate_proj = Linear(
            c.hidden_size, c.intermediate_size, ("embed", "mlp"), bias=c.mlp_bias, std=std
        )
        self.up_proj = Linear(c.hidden_size, c.intermediate_size, ("embed", "mlp"), bias=c.mlp_bias, std=std)
        self.down_proj = Linear(
            c.intermediate_size, c.hidden_size, ("mlp", "embed"), bias=c.mlp_bias, std=std
        )

    def __call__(self, x: Array) -> Array:
        """Apply the MLP at every position.

        Args:
          x: (..., hidden) activations.

        Returns:
          x's shape and dtype.
        """
        return self.down_proj(activation(self.act, self.gate_proj(x)) * self.up_proj(x))


class LlamaDecoderLayer(nnx.Module):
    """Pre-norm block: ``x + attn(norm(x))``, then ``x + mlp(norm(x))``.

    Args:
      config: the model config.
      layer: the block's index.
    """

    def __init__(self, config: ModelConfig, layer: int):
        self.input_layernorm = RMSNorm(config.hidden_size, config.norm_eps)
        self.self_attn = LlamaAttention(config, layer)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.norm_eps)
        self.mlp = LlamaMLP(config)

    def __call__(self, x: Array, cos: Array, sin: Array) -> Array:
        """The block's output.

        Args:
          x: (B, T, hidden) activations.
          cos: rotary cosines (T, head_dim).
          sin: rotary sines (T, head_dim).

        Returns:
          (B, T, hidden).
        """
        x = x + self.self_attn(self.input_layernorm(x), cos, sin)
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaModel(nnx.Module):
    """Embedding, the blocks and the final norm (Hugging Face's ``model`` submodule).

    Args:
      config: the model config.
      remat: recompute each block's activations in the backward pass (``nnx.remat``).
      scan: run the blocks as one ``lax.scan`` (one block compiled instead of every one).
    """

    def __init__(self, config: ModelConfig, *, remat: bool = False, scan: bool = True):
        c = config
        self.config = c
        self.remat = remat
        self.scan = scan
        self.embed_tokens = Embedding(
            c.vocab_size, c.hidden_size, ("vocab", "embed"), std=c.initializer_range
        )
        self.layers = nnx.List([LlamaDecoderLayer(c, i) for i in range(c.num_layers)])
        self.norm = RMSNorm(c.hidden_size, c.norm_eps)

    def __call__(self, tokens: Array, dtype: jax.typing.DTypeLike) -> Array:
        """The final hidden states.

        Args:
          tokens: (B, T) int tokens.
          dtype: the compute dtype.

        Returns:
          (B, T, hidden) in ``dtype``.
        """
        c = self.config
        x = self.embed_tokens(tokens).astype(dtype)
        inv_freq = rope_inv_freq(c.head_dim, c.rope_theta, c.rope_type, c.rope_parameters)
        cos, sin = rope_cos_sin(inv_freq, tokens.shape[1], dtype)
        # Scanned when every layer attends alike (sliding windows may differ per layer).
        alike = len({layer.self_attn.window for layer in self.layers}) == 1
        x = run_blocks(self.layers, x, cos, sin, remat=self.remat, scan=self.scan and alike)
        return self.norm(x)


class LlamaForCausalLM(nnx.Module):
    """A Llama-family causal LM: ``model`` and, unless tied to the embedding, ``lm_head``.

    Args:
      config: the model config.
      remat: recompute each block's activations in the backward pass.
      scan: run the blocks as one ``lax.scan``.
    """

    def __init__(self, config: ModelConfig, *, remat: bool = False, scan: bool = True):
        self.tied = config.tie_word_embeddings
        self.model = LlamaModel(config, remat=remat, scan=scan)
        if not self.tied:
            self.lm_head = Linear(
                config.hidden_size,
                config.vocab_size,
                ("embed", "vocab"),
                bias=False,
                std=config.initializer_range,
            )

    def __call__(self, tokens: Array, dtype: jax.typing.DTypeLike) -> Array:
        """Next-token logits.

        Args:
          tokens: (B, T) int tokens.
          dtype: the compute dtype.

        Returns:
          (B, T, vocab) logits in ``dtype``.
        """
        h = self.model(tokens, dtype)
        return self.model.embed_tokens.attend(h) if self.tied else self.lm_head(h)
