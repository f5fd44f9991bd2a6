"""Plumbing shared by the server-guided and adaptive rules: server Gram, keys, coordinate subsets."""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from consensus import tree
from consensus.aggregators._common import allowed, is_concrete
from kernels import robust as robust_kernels

PyTree = Any


def nan_if(bad: jax.Array | None, merged: PyTree) -> PyTree:
    """Under an outer jit a failed precondition cannot raise: the output is NaN instead."""
    if bad is None:
        return merged
    return jax.tree.map(lambda y: jnp.where(bad, jnp.full_like(y, jnp.nan), y), merged)


def require_params(rule: str, params: PyTree | None) -> PyTree:
    if params is None:
        raise ValueError(f"{rule}: needs the current global params (the nodes' updates are x_i - params)")
    return params


def require_key(rule: str, key: jax.Array | None) -> jax.Array:
    if key is None:
        raise ValueError(f"{rule}: is randomized; pass a jax.random key as update(..., key=key)")
    return key


class ServerStats(NamedTuple):
    gram: jax.Array  # (n, n) Gram of the node deltas x_i - params, invalid rows/cols zeroed
    cross: jax.Array  # (n,) <x_i - params, g>, 0 at invalid nodes
    server_sq: jax.Array  # ||g||^2
    valid: jax.Array  # (n,)


def server_stats(stacked: PyTree, params: PyTree, server_update: PyTree, mask) -> ServerStats:
    """One streamed pass: the node deltas' Gram matrix and their inner products with the server's update g."""
    try:
        tree.check_stacked_against(tree.broadcast(server_update, 1), params)
    except ValueError as e:
        raise ValueError(f"server_update must have the params' structure, shapes and dtypes: {e}") from None
    n = tree.num_nodes(stacked)
    total = None
    for x, p, g in zip(
        jax.tree_util.tree_leaves(stacked),
        jax.tree_util.tree_leaves(params),
        jax.tree_util.tree_leaves(server_update),
        strict=True,
    ):
        part = robust_kernels.gram_with_rows(x, p, jnp.asarray(g)[None])
        total = part if total is None else total + part
    g_nodes, cross, server_sq = total[:n, :n], total[:n, n], total[n, n]
    valid = allowed(mask, n) & jnp.isfinite(jnp.diagonal(g_nodes)) & jnp.isfinite(cross)
    both = valid[:, None] & valid[None, :]
    return ServerStats(jnp.where(both, g_nodes, 0.0), jnp.where(valid, cross, 0.0), server_sq, valid)


def check_server_finite(rule: str, server_sq: jax.Array) -> jax.Array | None:
    """Raise (eagerly) when the server's update is not finite; under jit return the NaN flag."""
    if is_concrete(server_sq):
        if not np.isfinite(float(server_sq)):
            raise ValueError(f"{rule}: the server_update holds NaN or Inf")
        return None
    return ~jnp.isfinite(server_sq)


def total_size(params_or_stacked: PyTree, stacked: bool) -> list[int]:
    """Sizes of the leaves (per node when ``stacked``)."""
    leaves = jax.tree_util.tree_leaves(params_or_stacked)
    return [int(np.prod(x.shape[1:] if stacked else x.shape)) for x in leaves]


def sample_coordinates(key: jax.Array, total: int, size: int) -> jax.Array:
    """``size`` flat coordinate indices in [0, total), uniform with replacement (all if size >= total).

    With replacement keeps the draw O(size) instead of a permutation of all
    ``total`` coordinates; at size << total repeats are rare and only reweigh
    a coordinate.
    """
    if size >= total:
        return jnp.arange(total, dtype=jnp.int32)
    return jax.random.randint(key, (size,), 0, total, dtype=jnp.int32)


def columns(stacked: PyTree, params: PyTree | None, index: jax.Array) -> jax.Array:
    """(n, b) float32: the flat coordinates ``index`` (over all leaves, in leaf order) of the deltas."""
    leaves = jax.tree_util.tree_leaves(stacked)
    refs = [None] * len(leaves) if params is None else jax.tree_util.tree_leaves(params)
    out = None
    offset = 0
    for x, r in zip(leaves, refs, strict=True):
        size = int(np.prod(x.shape[1:]))
        local = index - offset
        inside = (local >= 0) & (local < size)
        cols = robust_kernels.take_columns(x, r, jnp.clip(local, 0, size - 1))
        cols = jnp.where(inside[None, :], cols, 0.0)
        out = cols if out is None else out + cols
        offset += size
    return out


def top_eigenpair(h: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(largest eigenvalue, its unit eigenvector) of a symmetric PSD (n, n) matrix."""
    vals, vecs = jnp.linalg.eigh(h)
    return vals[-1], vecs[:, -1]


def median_of_valid(values: jax.Array, valid: jax.Array) -> jax.Array:
    """Median of ``values`` over the valid entries (mean of the two middle ones when their count is even)."""
    s = jnp.sort(jnp.where(valid, values, jnp.inf))
    m = jnp.sum(valid.astype(jnp.int32))
    lo = jnp.maximum((m - 1) // 2, 0)
    hi = jnp.maximum(m // 2, 0)
    return 0.5 * (s[lo] + s[jnp.minimum(hi, values.shape[0] - 1)])
