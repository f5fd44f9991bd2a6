"""Coordinate subsampling: the rules that score nodes on a random subset of coordinates (DnC, SignGuard)."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from kernels import robust as robust_kernels

PyTree = Any


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
    assert out is not None, "a tree without leaves has no columns"
    return out
