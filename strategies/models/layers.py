"""Blocks shared by the model families: parameters with logical axes, Linear, norms, rotary, attention.

Every parameter is an ``nnx.Param`` carrying its logical axis names (``out_sharding``, one per
dimension, resolved by the rules of :mod:`consensus.mesh`) and how :meth:`CausalLM.init` draws
it (``init_std`` / ``init_fill``). Module attribute names follow Hugging Face's (``kernel``,
``bias``, ``embedding``, ``scale`` being the leaf names), so a parameter's tree path maps to its
Hugging Face tensor name mechanically (:mod:`strategies.models.keys`).

Compute follows the dtype of the activations (the params' dtype): normalization statistics and
the attention softmax run in float32 whatever it is, as Hugging Face does.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

Array = jax.Array
Axes = tuple[str | None, ...]


def param(shape: tuple[int, ...], axes: Axes, *, std: float = 0.0, fill: float = 0.0) -> nnx.Param:
    """A float32 Param ``fill`` (or zeros) with its logical axes and init spec as metadata.

    The value is a constant: models are built under ``nnx.eval_shape`` for their structure, and
    :meth:`CausalLM.init` draws the random values leaf by leaf from the ``init_std`` metadata.

    Args:
      shape: the parameter's shape.
      axes: one logical axis name per dimension.
      std: standard deviation of the normal draw in ``init`` (0: the constant ``fill``).
      fill: the mean (1 for norm scales).

    Returns:
      The Param.
    """
    return nnx.Param(
        jnp.full(shape, fill, jnp.float32),
        out_sharding=axes,
        eager_sharding=False,
        init_std=std,
        init_fill=fill,
    )


@functools.partial(jax.tree_util.register_dataclass, data_fields=["w", "a", "b"], meta_fields=["scale"])
@dataclasses.dataclass(frozen=True)
class LowRankKernel:
    """A kernel with a LoRA update beside it: ``x @ (w + scale a b)`` as ``x @ w + scale (x @ a) @ b``.

    A :class:`Linear` whose kernel is one of these never forms ``w + scale a b``, so the backward
    pass has no gradient for the dense kernel: only ``x^T`` times the rank-r cotangent for ``b`` and
    ``(dy b^T)`` against ``x`` for ``a``. Merging first (``w + scale a b`` as one matrix) makes
    autodiff compute the full ``x^T dy`` (a third of a layer's training FLOPs) and then project it
    onto ``a`` and ``b``; this is what lets a LoRA step skip the frozen weights' gradients.
    (:class:`strategies.lora.LoraTask` builds them for tasks whose models take them.)

    Attributes:
      w: the (in, out) frozen kernel.
      a: (in, r).
      b: (r, out).
      scale: the LoRA scale ``alpha / r`` (static).
    """

    w: Array
    a: Array
    b: Array
    scale: float

    @property
    def shape(self) -> tuple[int, ...]:
        """The kernel's shape."""
        return tuple(self.w.shape)

    @property
    def dtype(self) -> Any:
        """The kernel's dtype."""
        return self.w.dtype

    def __getitem__(self, index: Any) -> LowRankKernel:
        if index is not Ellipsis:  # nnx reads a Param's value as param[...]
            raise TypeError(f"a LowRankKernel is read whole (kernel[...]), not at {index!r}")
        return self

    def astype(self, dtype: Any) -> LowRankKernel:
        """All three matrices in ``dtype`` (the activations' compute dtype)."""
        return LowRankKernel(self.w.astype(dtype), self.a.astype(dtype), self.b.astype(dtype), self.scale)

    def dense(self) -> Array:
        """``w + scale a b`` as one matrix (for checks; the forward pass never forms it)."""
        return self.w + jnp.asarray(self.scale, self.w.dtype) * (self.a @ self.b)

    def __rmatmul__(self, x: Array) -> Array:
        low = (x @ self.a) * jnp.asarray(self.scale, x.dtype)
        return x @ self.w + low @ self.b


@jax.custom_vjp
def _gram_probe(x: Array, gram: Array) -> Array:
    return x


def _gram_probe_fwd(x: Array, gram: Array) -> tuple[Array, Array]:
    return x, x


def _gram_probe_bwd(x: Array, ct: Array) -> tuple[Array, Array]:
    rows = x.reshape(-1, x.shape[-1]).astype(jnp.float32)
    return ct, jnp.dot(rows.T, rows, precision=jax.lax.Precision.HIGHEST)


_gram_probe.defvjp(_gram_probe_fwd, _gram_probe_bwd)


@functools.partial(jax.tree_util.register_dataclass, data_fields=["w", "gram"], meta_fields=[])
@dataclasses.dataclass(frozen=True)
class GramKernel:
    """A kernel that reports the Gram matrix of its inputs as the gradient of a zero probe.

    ``x @ GramKernel(w, g)`` is ``x @ w``; its backward pass gives ``g`` the cotangent
    ``X^T X`` (X: every row fed to the layer, float32) whatever the loss, so one ``jax.grad``
    over the probes collects every layer's input Gram matrix, through ``lax.scan`` over
    stacked blocks too, without the model recording anything (RegMean's statistics,
    :func:`strategies.statistics.linear_input_grams`).

    Attributes:
      w: the (in, out) kernel.
      gram: an (in, in) float32 probe (its value is unused: zeros).
    """

    w: Array
    gram: Array

    @property
    def shape(self) -> tuple[int, ...]:
        """The kernel's shape."""
        return tuple(self.w.shape)

    @property
    def dtype(self) -> Any:
        """The kernel's dtype."""
        return self.w.dtype

    def __getitem__(self, index: Any) -> GramKernel:
        if index is not Ellipsis:
            raise TypeError(f"a GramKernel is read whole (kernel[...]), not at {index!r}")
        return self

    def astype(self, dtype: Any) -> GramKernel:
        """The kernel in ``dtype`` (the probe stays float32)."""
        return GramKernel(self.w.astype(dtype), self.gram)

    def __rmatmul__(self, x: Array) -> Array:
        return _gram_probe(x, self.gram) @ self.w


class Linear(nnx.Module):
    """``x @ kernel (+ bias)`` with a 2-D ``(in, out)`` kernel (Hugging Face stores ``(out, in)``).

    Args:
      din: input width.
      dout: output width.
      axes: logical axes of the kernel (in, out); the bias takes the second.
      bias: whether there is a bias.
      std: the init standard deviation of the kernel.
    """

    def __init__(self, din: int, dout: int, axes: Axes, *, bias: bool, std: float):
        self.kernel = param((din, dout), axes, std=std)
        if bias:
            self.bias = param((dout,), (axes[1],))

    def __call__(self, x: Array) -> Array:
        """Apply the layer in ``x``'s dtype.

        Args:
          x: (..., din) activations.

        Returns:
          (..., dout), x's dtype.
        """
        y = x @ self.kernel[...].astype(x.dtype)
        if hasattr(self, "bias"):
            y = y + self.bias[...].astype(x.dtype)
        return y


class Embedding(nnx.Module):
    """A lookup table ``(num, dim)`` (token or position embeddings).

    Args:
      num: rows (vocabulary or positions).
      dim: the embedding width.
      axes: logical axes of the table.
      std: the init standard deviation.
    """

    def __init__(self, num: int, dim: int, axes: Axes, *, std: float):
        self.embedding = param((num, dim), axes, std=std)

    def __call__(self, ids: Array) -> Array:
        """Rows of the table.

        Args:
          ids: int indices of any shape.

        Returns:
          ``ids.shape + (dim,)`` in the table's dtype.
        """
        return jnp.take(self.embedding[...], ids, axis=0)

    def attend(self, x: Array) -> Array:
        """``x @ table.T``: the tied output head.

        Args:
          x: (..., dim) activations.

        Returns:
          (..., num) logits in x's dtype.
        """
        return x @ self.embedding[...].astype(x.dtype).T


class RMSNorm(nnx.Module):
    """Llama's RMSNorm: statistics in float32, scaled in the input dtype (as Hugging Face does).

    Args:
      dim: the normalized width.
      eps: added to the mean square.
    """

    def __init__(self, dim: int, eps: float):
        self.eps = eps
        self.scale = param((dim,), ("norm",), fill=1.0)

    def __call__(self, x: Array) -> Array:
        """Normalize over the last axis.

        Args:
          x: (..., dim) activations.

        Returns:
          x's shape and dtype.
        """
        x32 = x.astype(jnp.float32)
        var = jnp.mean(jnp.square(x32), axis=-1, keepdims=True)
        y = (x32 * jax.lax.rsqrt(var + jnp.float32(self.eps))).astype(x.dtype)
        return self.scale[...].astype(x.dtype) * y


class LayerNorm(nnx.Module):
    """LayerNorm with scale and bias; statistics in float32.

    Args:
      dim: the normalized width.
      eps: added to the variance.
    """

    def __init__(self, dim: int, eps: float):
        self.eps = eps
        self.scale = param((dim,), ("norm",), fill=1.0)
        self.bias = param((dim,), ("norm",))

    def __call__(self, x: Array) -> Array:
        """Normalize over the last axis, then scale and shift.

        Args:
          x: (..., dim) activations.

        Returns:
          x's shape and dtype.
        """
        x32 = x.astype(jnp.float32)
        mean = jnp.mean(x32, axis=-1, keepdims=True)
        var = jnp.mean(jnp.square(x32 - mean), axis=-1, keepdims=True)
        y = (x32 - mean) * jax.lax.rsqrt(var + jnp.float32(self.eps))
        return (y * self.scale[...].astype(jnp.float32) + self.bias[...].astype(jnp.float32)).astype(x.dtype)


def activation(name: str, x: Array) -> Array:
    """Apply an activation by its :data:`strategies.models.config.ACTIVATIONS` name.

    Args:
      name: "silu", "gelu" (exact), "gelu_tanh" or "relu".
      x: the input.

    Returns:
      The activation of ``x``.

    Raises:
      ValueError: for an unknown name.
    """
    if name == "silu":
        return jax.nn.silu(x)
    if name == "gelu":
        return jax.nn.gelu(x, approximate=False)
    if name == "gelu_tanh":
        return jax.nn.gelu(x, approximate=True)
    if name == "relu":
        return jax.nn.relu(x)
    raise ValueError(f"unknown activation {name!r}")


def rope_inv_freq(head_dim: int, theta: float, rope_type: str, scaling: dict[str, Any]) -> Array:
    """Inverse frequencies of the rotary embedding (float32), with Hugging Face's scalings.

    Math:
      inv_freq_i = theta^(-2i / head_dim), i < head_dim / 2; "linear" divides them by ``factor``;
      "llama3" divides the low frequencies (wavelength above original_len / low_freq_factor) by
      ``factor``, keeps the high ones, and interpolates smoothly in between.

    Args:
      head_dim: the rotated width.
      theta: the rotary base.
      rope_type: "default", "linear" or "llama3".
      scaling: the type's parameters (``factor``, llama3's frequency factors and original length).

    Returns:
      (head_dim // 2,) float32.
    """
    # float64 on the host, then float32, as transformers computes them (int64 arange -> float).
    import numpy as np

    inv = 1.0 / (theta ** (np.arange(0, head_dim, 2, dtype=np.int64).astype(np.float32) / head_dim))
    inv = inv.astype(np.float32)
    if rope_type == "linear":
        inv = inv / np.float32(scaling["factor"])
    elif rope_type == "llama3":
        factor = float(scaling["factor"])
        low, high = float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])
        old_len = float(scaling["original_max_position_embeddings"])
        wavelen = 2 * math.pi / inv
        scaled = np.where(wavelen > old_len / low, inv / factor, inv)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < old_len / high) & ~(wavelen > old_len / low)
        inv = np.where(medium, smoothed, scaled).astype(np.float32)
    return jnp.asarray(inv, jnp.float32)


def rope_cos_sin(inv_freq: Array, length: int, dtype: Any) -> tuple[Array, Array]:
    """The cosines and sines of the rotary angles of positions 0..length-1 (rotate-half layout).

    Args:
      inv_freq: (head_dim // 2,) float32 inverse frequencies.
      length: the number of positions.
      dtype: the compute dtype they are cast to.

    Returns:
      ``(cos, sin)``, each (length, head_dim).
    """
    freqs = jnp.arange(length, dtype=jnp.float32)[:, None] * inv_freq[None, :]
    emb = jnp.concatenate([freqs, freqs], axis=-1)
    return jnp.cos(emb).astype(dtype), jnp.sin(emb).astype(dtype)


def apply_rope(x: Array, cos: Array, sin: Array) -> Array:
    """Rotate (B, T, N, H) queries or keys: ``x cos + rotate_half(x) sin``.

    Args:
      x: (B, T, N, H) activations.
      cos: (T, H) cosines.
      sin: (T, H) sines.

    Returns:
      The rotated x.
    """
    half = x.shape[-1] // 2
    rotated = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    return x * cos[:, None, :] + rotated * sin[:, None, :]


def attention(q: Array, k: Array, v: Array, *, scale: float, window: int | None) -> Array:
    """Causal attention through ``jax.nn.dot_product_attention`` (fused kernels where the backend has them).

    Grouped-query attention passes fewer key/value heads than query heads directly.

    Args:
      q: (B, T, N, H) queries.
      k: (B, T, K, H) keys, N a multiple of K.
      v: (B, T, K, H) values.
      scale: multiplies the logits.
      window: a query sees this many keys (itself and the previous ones), or all earlier ones (None).

    Returns:
      (B, T, N, H) in q's dtype.
    """
    local = None if window is None or window >= q.shape[1] else (window - 1, 0)
    # jax's XLA path promotes bfloat16 with float32 internally (its float32 logits), which a
    # program under jax_numpy_dtype_promotion="strict" (the tests') would refuse.
    with jax.numpy_dtype_promotion("standard"):
        return jax.nn.dot_product_attention(q, k, v, scale=scale, is_causal=True, local_window_size=local)


def run_blocks(blocks: Any, x: Array, *args: Array, remat: bool, scan: bool) -> Array:
    """``x`` through every block in order, as one ``lax.scan`` over the stacked blocks when ``scan``.

    A Python loop traces (and XLA compiles) every block separately: for SmolLM2's 30 blocks the
    compile of a training step takes as long as tens of steps on a CPU. Scanning compiles one
    block. The params stay one subtree per block (the checkpoint layout): the blocks' states are
    stacked inside the traced function, one copy of the block weights per call (and the
    gradient unstacked the same way), small next to a step's activations at any useful batch.

    Args:
      blocks: the blocks (an ``nnx.List`` of modules of one structure, each called as
        ``block(x, *args)``).
      x: the input activations.
      *args: further arguments every block receives (rotary tables).
      remat: recompute each block's activations in the backward pass.
      scan: scan over the stacked blocks (the caller checks that they are alike: same shapes
        and the same static settings).

    Returns:
      The last block's output.
    """
    if not scan or len(blocks) < 2:
        for block in blocks:
            x = nnx.remat(lambda blk, h, *a: blk(h, *a))(block, x, *args) if remat else block(x, *args)
        return x
    graphdef, _ = nnx.split(blocks[0])
    states = [nnx.split(block)[1] for block in blocks]
    stacked = jax.tree.map(lambda *leaves: jnp.stack(leaves), *states)

    def body(h: Array, state: Any) -> tuple[Array, None]:
        return nnx.merge(graphdef, state)(h, *args), None

    if remat:
        body = jax.checkpoint(body)
    x, _ = jax.lax.scan(body, x, stacked)
    return x
