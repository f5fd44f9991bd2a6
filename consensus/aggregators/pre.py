"""Pre-aggregators: node-to-node transforms (n -> n) applied before a rule.

Each returns a stacked tree of the same shape, and records in its state how it
acted on the nodes, so a pipeline can report the final weight of every
*original* node: clipping scales node deltas, nearest-neighbour mixing is a
linear map of the nodes.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from consensus import tree
from consensus.aggregators._common import check_f, check_stacked, gram_stats, require_count, static_count
from consensus.base import PreAggregator, require
from kernels import rows as row_kernels
from kernels import weiszfeld


class ClipState(NamedTuple):
    scale: jax.Array  # (n,) factor applied to each node's delta


class MixState(NamedTuple):
    mixing: jax.Array  # (n, n) row i = weights of the nodes averaged into node i


def clip(max_norm: float) -> PreAggregator:
    """Per-node L2 clipping of the node's delta over the whole tree.

    .. math:: x_i' = c + (x_i - c) \\min(1, C / \\lVert x_i - c \\rVert_2)

    with c = ``params`` (the current global params), or 0 when params is None.
    The norm is taken over every leaf together, not leaf by leaf. Non-finite
    nodes stay non-finite (and are excluded downstream).
    """
    if not max_norm > 0:
        raise ValueError(f"clip: max_norm must be > 0, got {max_norm}")

    def init(params):
        del params
        return ClipState(jnp.zeros((0,), jnp.float32))

    def update(stacked, state, params=None, *, mask=None, **extra):
        del state, mask, extra
        check_stacked(stacked, params)
        scale = weiszfeld.clip_factors(tree.sq_norms(stacked, params), float(max_norm))
        if params is None:
            out = jax.tree.map(lambda x: row_kernels.scale_rows(x, scale).astype(x.dtype), stacked)
        else:
            out = jax.tree.map(
                lambda x, c: row_kernels.scale_rows(x, scale, c).astype(x.dtype), stacked, params
            )
        return out, ClipState(scale)

    return PreAggregator(init, update, "clip")


def nnm(num_byzantine: int) -> PreAggregator:
    """Nearest-neighbour mixing (Allouah et al. 2023, AISTATS, "Fixing by Mixing").

    Every valid node is replaced by the mean of the m - f valid nodes nearest
    to it (itself included), distances from a Gram matrix centred on
    ``params`` (or the coordinate-wise median). Invalid nodes come out as NaN so
    that any rule downstream excludes them. Precondition: m > 2f (the paper's
    setting f < m/2). One Gram pass, one mixing pass.
    """
    f = check_f("nnm", num_byzantine)

    def init(params):
        del params
        return MixState(jnp.zeros((0, 0), jnp.float32))

    def update(stacked, state, params=None, *, mask=None, **extra):
        del state, extra
        n = check_stacked(stacked, params)
        require("nnm", n, f, n > 2 * f, f"n > 2f = {2 * f}")
        stats = gram_stats(stacked, params, mask)
        m = static_count(stats.valid)
        require_count("nnm", m, f, m is not None and m > 2 * f, f"n > 2f = {2 * f}")
        mixing = weiszfeld.nnm_matrix(stats.sq_dists, f, stats.valid)
        out = jax.tree.map(lambda x: row_kernels.mix(x, mixing).astype(x.dtype), stacked)
        return out, MixState(mixing)

    return PreAggregator(init, update, "nnm")


def pull_back_weights(pre_state, weights: jax.Array) -> jax.Array:
    """Weights on a pre-aggregator's outputs -> weights on its inputs."""
    if isinstance(pre_state, MixState):
        return pre_state.mixing.T @ weights
    if isinstance(pre_state, ClipState):
        return weights * pre_state.scale
    return weights
