"""Model Stock: move from the base towards the mean by the angle between the task vectors."""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from consensus.base import AggregationInfo, Aggregator
from consensus.merging._common import (
    info,
    init_rule_state,
    leaves_of,
    optimistic,
    require_base,
    require_valid_count,
    unflatten_like,
)
from consensus.specs import RULES, at_least
from kernels import gram as gram_kernels
from kernels.compile_options import kernel_jit

PyTree = Any


class StockState(NamedTuple):
    """State of :func:`model_stock`.

    Attributes:
      info: The round's :class:`~consensus.base.AggregationInfo`.
      t: The per-leaf ratios t, a tree of scalars like params.
    """

    info: AggregationInfo
    t: PyTree = None


def stock_ratio(g: jax.Array, valid: jax.Array) -> jax.Array:
    """Compute Model Stock's t from the (n, n) Gram matrix of one leaf's task vectors.

    ``cos = mean over valid pairs i < j of <d_i, d_j> / (|d_i| |d_j|)``;
    t = m cos / (1 + (m - 1) cos), m the number of valid nodes. Singular cases
    (a zero task vector, fewer than 2 valid nodes, or 1 + (m - 1) cos = 0) give
    t = 0: the leaf keeps the base.

    Args:
      g: (n, n) Gram matrix of the task vectors.
      valid: (n,) bool, the valid nodes.

    Returns:
      The scalar ratio t.
    """
    n = g.shape[0]
    g = g.astype(jnp.float32)
    g = jnp.where(valid[:, None] & valid[None, :], g, 0.0)
    norms = jnp.sqrt(jnp.maximum(jnp.diagonal(g), 0.0))
    pair = valid[:, None] & valid[None, :] & ~jnp.eye(n, dtype=bool)
    safe = jnp.where(norms > 0, norms, 1.0)
    cos = g / (safe[:, None] * safe[None, :])
    m = jnp.sum(valid.astype(jnp.float32))
    pairs = jnp.sum(pair.astype(jnp.float32))
    mean_cos = jnp.sum(jnp.where(pair, cos, 0.0)) / jnp.maximum(pairs, 1.0)
    denom = 1.0 + (m - 1.0) * mean_cos
    zero = jnp.any(valid & (norms == 0))
    singular = zero | (pairs == 0) | (denom == 0)
    t = jnp.where(singular, 0.0, m * mean_cos / jnp.where(denom == 0, 1.0, denom))
    # A valid node holding NaN/Inf makes t NaN, so the output is NaN and the caller excludes the node.
    return jnp.where(jnp.isfinite(jnp.sum(jnp.where(pair | jnp.diag(valid), g, 0.0))), t, jnp.nan)


def _gram_and_sum(x: jax.Array, base: jax.Array, valid: jax.Array) -> tuple[jax.Array, jax.Array]:
    """The (n, n) Gram matrix of the task vectors and their sum over the valid nodes, in one read.

    Streams the columns in the Gram kernel's cache-sized chunks: each chunk of ``x - base``
    is centred once, multiplied by itself for the Gram matrix (Kahan-summed over chunks, as
    :func:`kernels.gram.gram`) and summed over the valid rows for the column sums, written
    in place into the (s,) sum. Rows that are not valid add 0 to the sum even when they hold
    NaN; they reach only their own row and column of G.
    """
    n = x.shape[0]
    x = x.reshape(n, -1)
    b = base.reshape(-1).astype(jnp.float32)
    s = x.shape[1]
    chunk = gram_kernels.chunk_columns(n)

    def part(xs, bs, unrolled=True):
        d = xs.astype(jnp.float32) - bs[None]
        g = jnp.dot(d, d.T, precision=gram_kernels.HIGHEST)
        kept = [jnp.where(valid[r], d[r], 0.0) for r in range(n)]
        if unrolled:
            # Inside the loop the column sums are an unrolled sum of the rows (a scalar select
            # per row), which XLA:CPU fuses into the chunk's loop; a (1, n) x (n, c) product
            # would not fuse and adds a pass over the chunk.
            return g, sum(kept[1:], kept[0])
        # The tail's sums as a product: fused into the update of the whole (s,) buffer, the
        # unrolled sum would be evaluated at every coordinate of it.
        return g, jnp.dot(valid.astype(jnp.float32)[None], jnp.stack(kept), precision=gram_kernels.HIGHEST)[0]

    k = s // chunk
    if k < 2:
        return part(x, b)

    def body(i, carry):
        acc, comp, total = carry
        g, col = part(
            jax.lax.dynamic_slice_in_dim(x, i * chunk, chunk, axis=1),
            jax.lax.dynamic_slice_in_dim(b, i * chunk, chunk),
        )
        y = g - comp
        t = acc + y
        return t, (t - acc) - y, jax.lax.dynamic_update_slice_in_dim(total, col, i * chunk, 0)

    zeros = jnp.zeros((n, n), jnp.float32)
    acc, comp, total = jax.lax.fori_loop(0, k, body, (zeros, zeros, jnp.zeros((s,), jnp.float32)))
    if s % chunk:
        g, col = part(x[:, k * chunk :], b[k * chunk :], unrolled=False)
        acc = acc + (g - comp)
        total = jax.lax.dynamic_update_slice_in_dim(total, col, k * chunk, 0)
    return acc, total


@kernel_jit
def _stock_leaf(x, base, valid):
    # Rows of invalid nodes may hold NaN: they only reach their own row and column of G,
    # which stock_ratio masks out, and add 0 to the sum.
    g, total = _gram_and_sum(x, base, valid)
    t = stock_ratio(g, valid)
    m = jnp.maximum(jnp.sum(valid.astype(jnp.float32)), 1.0)
    # base + t * (mean - base) = base + (t / m) sum_i (x_i - base): the sum came with the Gram
    # matrix, so the stack is read once.
    out = base.astype(jnp.float32) + (t / m) * total.reshape(base.shape)
    return out.astype(x.dtype), t


@RULES.declare(
    kind="merge",
    precondition=at_least(2),
    sensitivity="not bounded (t depends on every node)",
    needs=("params",),
)
def model_stock() -> Aggregator:
    r"""Model Stock (Jang, Yun and Han, ECCV 2024): from the base towards the mean by the task vectors' angle.

    Per leaf, with task vectors ``d_i = x_i - theta_0`` of the m valid nodes:

    .. math:: \cos = \operatorname{mean}_{i<j} \frac{\langle d_i, d_j\rangle}{\lVert d_i\rVert
              \lVert d_j\rVert},\quad t = \frac{m \cos}{1 + (m - 1)\cos},\quad
              \theta = t\,\bar x + (1 - t)\,\theta_0

    ``params`` = theta_0 is the base (the paper's pre-trained model). mergekit's
    ``model_stock`` computes the same t per tensor (it clamps nothing either;
    a negative mean cosine gives t < 0 here and there). Singular leaves (a zero
    task vector, or 1 + (m - 1) cos = 0) keep the base (t = 0), as mergekit's
    zero-norm guard does. ``state.t`` holds the per-leaf ratios.
    Cost: one read of the stack per leaf (the Gram matrix and the sum of the task
    vectors in the same streamed pass), then one pass over leaf-sized arrays.

    Not robust (the mean of the nodes is the target). Permutation invariant.
    DP sensitivity: not bounded by this package (t depends on every node).
    Precondition: at least 2 valid nodes (the angle needs a pair).

    Returns:
      An :class:`~consensus.base.Aggregator` with a :class:`StockState`; ``update`` needs
      ``params`` (the base).

    Raises:
      ValueError: From ``update``, when the base is missing or does not match the stack.
      ByzantineToleranceError: From ``update``, when fewer than 2 nodes are valid.

    References:
      Jang, Yun and Han 2024, ECCV, "Model Stock: All we need is just a few fine-tuned models".
    """

    def update(stacked, state, params=None, *, mask=None, assume_finite=False, **extra):
        del state, extra
        stacked, n = require_base("model_stock", stacked, params)

        def compute(valid):
            outs, ratios = [], []
            for x, b in zip(*leaves_of(stacked, params), strict=True):
                y, t = _stock_leaf(x, b, valid)
                outs.append(y)
                ratios.append(t)
            return unflatten_like(params, outs), ratios

        # t is NaN when an allowed node is not finite (stock_ratio), so the ratios prove the merge.
        merged, ratios, valid = optimistic(
            stacked, mask, n, assume_finite, compute, aux=True, aux_proves=True
        )
        require_valid_count("model_stock", at_least(2), valid, n)
        return merged, StockState(
            info(valid, jnp.ones((n,), jnp.float32), False), unflatten_like(params, ratios)
        )

    return Aggregator(lambda params: StockState(init_rule_state().info, None), update, "model_stock")
