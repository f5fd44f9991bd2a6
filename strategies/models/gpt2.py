"""GPT-2: learned positions, LayerNorm, ``gelu_new`` MLP, fused q/k/v projection, head tied to the embedding.

The tree mirrors Hugging Face's ``GPT2LMHeadModel``: ``transformer/wte/embedding``,
``transformer/wpe/embedding``, ``transformer/h/<i>/{ln_1, attn/{c_attn, c_proj}, ln_2,
mlp/{c_fc, c_proj}}`` and ``transformer/ln_f/{scale, bias}``. GPT-2's ``Conv1D`` weights are
stored ``(in, out)``, which is already this package's kernel layout (no transpose).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import nnx

from strategies.models.config import ModelConfig
from strategies.models.layers import Array, Embedding, LayerNorm, Linear, activation, attention, run_blocks


class GPT2Attention(nnx.Module):
    """Multi-head causal self-attention with the fused ``c_attn`` (q, k, v) projection.

    Args:
      config: the model config.
      layer: the block's index (``scale_attn_by_inverse_layer_idx``).
    """

    def __init__(self, config: ModelConfig, layer: int):
        c = config
        std = c.initializer_range
        self.num_heads, self.head_dim = c.num_heads, c.head_dim
        scale = 1.0 / math.sqrt(c.head_dim) if c.scale_attn_weights else 1.0
        self.scale = scale / (layer + 1) if c.scale_attn_by_inverse_layer_idx else scale
        self.c_attn = Linear(c.hidden_size, 3 * c.hidden_size, ("embed", "heads"), bias=True, std=std)
        # GPT-2 scales the residual projections' init by 1/sqrt(2 * layers).
        self.c_proj = Linear(
            c.hidden_size, c.hidden_size, ("heads", "embed"), bias=True, std=std / math.sqrt(2 * c.num_layers)
        )

    def __call__(self, x: Array) -> Array:
        """Causal attention.

        Args:
          x: (B, T, hidden) activations.

        Returns:
          (B, T, hidden), x's dtype.
        """
        b, t, d = x.shape
        q, k, v = jnp.split(self.c_attn(x), 3, axis=-1)
        shape = (b, t, self.num_heads, self.head_dim)
        out = attention(q.reshape(shape), k.reshape(shape), v.reshape(shape), scale=self.scale, window=None)
        return self.c_proj(out.reshape(b, t, d))


class GPT2MLP(nnx.Module):
    """``c_proj(act(c_fc(x)))``.

    Args:
      config: the model config.
    """

    def __init__(self, config: ModelConfig):
        c = config
        std = c.initializer_range
        self.act = c.activation
        self.c_fc = Linear(c.hidden_size, c.intermediate_size, ("embed", "mlp"), bias=True, std=std)
        self.c_proj = Linear(
            c.intermediate_size,
            c.hidden_size,
            ("mlp", "embed"),
            bias=True,
            std=std / math.sqrt(2 * c.num_layers),
        )

    def __call__(self, x: Array) -> Array:
        """Apply the MLP at every position.

        Args:
          x: (..., hidden) activations.

        Returns:
          x's shape and dtype.
        """
        return self.c_proj(activation(self.act, self.c_fc(x)))


class GPT2Block(nnx.Module):
    """Pre-norm block: ``x + attn(ln_1(x))``, then ``x + mlp(ln_2(x))``.

    Args:
      config: the model config.
      layer: the block's index.
    """

    def __init__(self, config: ModelConfig, layer: int):
        self.ln_1 = LayerNorm(config.hidden_size, config.norm_eps)
        self.attn = GPT2Attention(config, layer)
        self.ln_2 = LayerNorm(config.hidden_size, config.norm_eps)
        self.mlp = GPT2MLP(config)

    def __call__(self, x: Array) -> Array:
        """The block's output.

        Args:
          x: (B, T, hidden) activations.

        Returns:
          (B, T, hidden).
        """
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT2Model(nnx.Module):
    """Embeddings, the blocks and the final LayerNorm (Hugging Face's ``transformer`` submodule).

    Args:
      config: the model config.
      remat: recompute each block's activations in the backward pass (``nnx.remat``).
      scan: run the blocks as one ``lax.scan`` (one block compiled instead of every one).
    """

    def __init__(self, config: ModelConfig, *, remat: bool = False, scan: bool = True):
        c = config
        self.remat = remat
        self.scan = scan
        self.wte = Embedding(c.vocab_size, c.hidden_size, ("vocab", "embed"), std=c.initializer_range)
        self.wpe = Embedding(c.max_position_embeddings, c.hidden_size, ("length", "embed"), std=0.01)
        self.h = nnx.List([GPT2Block(c, i) for i in range(c.num_layers)])
        self.ln_f = LayerNorm(c.hidden_size, c.norm_eps)

    def __call__(self, tokens: Array, dtype: jax.typing.DTypeLike) -> Array:
        """The final hidden states.

        Args:
          tokens: (B, T) int tokens, T <= n_positions.
          dtype: the compute dtype.

        Returns:
          (B, T, hidden) in ``dtype``.
        """
        t = tokens.shape[1]
        x = self.wte(tokens).astype(dtype) + self.wpe.embedding[...][:t].astype(dtype)
        # Blocks differ (their attention scale) under scale_attn_by_inverse_layer_idx: not scanned.
        alike = len({block.attn.scale for block in self.h}) == 1
        x = run_blocks(self.h, x, remat=self.remat, scan=self.scan and alike)
        return self.ln_f(x)


class GPT2LMHeadModel(nnx.Module):
    """GPT-2 with its head tied to ``wte`` (an untied config gets an ``lm_head`` kernel).

    Args:
      config: the model config.
      remat: recompute each block's activations in the backward pass.
      scan: run the blocks as one ``lax.scan``.
    """

    def __init__(self, config: ModelConfig, *, remat: bool = False, scan: bool = True):
        self.tied = config.tie_word_embeddings
        self.transformer = GPT2Model(config, remat=remat, scan=scan)
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
        h = self.transformer(tokens, dtype)
        return self.transformer.wte.attend(h) if self.tied else self.lm_head(h)
