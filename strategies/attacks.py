"""Byzantine attacks: functions of the honest updates, keyed (ByzFL's vocabulary).

Every attack has the signature ``attack(key, honest, num_byzantine, **kw)``:
``honest`` is a stacked tree of the h honest *updates* (deltas from the
current global params) and the result is a stacked tree of ``num_byzantine``
malicious updates. The attackers are omniscient (they see every honest
update), the standard worst case of the robust-aggregation literature.
:func:`apply_attack` swaps them into a stacked tree of node params.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from scipy import stats

from kernels import rows as row_kernels

PyTree = Any
Attack = Callable[..., PyTree]


def _honest_mean(honest: PyTree) -> PyTree:
    def leaf(x):
        h = x.shape[0]
        return row_kernels.weighted_sum(x, jnp.full((h,), 1.0 / h, jnp.float32))

    return jax.tree.map(leaf, honest)


def _honest_std(honest: PyTree, mean: PyTree) -> PyTree:
    """Coordinate-wise population std of the honest updates (two-pass, no cancellation)."""

    def leaf(x, mu):
        h = x.shape[0]
        sq = jnp.square(x.astype(jnp.float32) - mu[None])
        return jnp.sqrt(row_kernels.weighted_sum(sq, jnp.full((h,), 1.0 / h, jnp.float32)))

    return jax.tree.map(leaf, honest, mean)


def _repeat(tree: PyTree, f: int, like: PyTree) -> PyTree:
    return jax.tree.map(lambda t, x: jnp.broadcast_to(t, (f, *t.shape)).astype(x.dtype), tree, like)


def sign_flip(key: jax.Array, honest: PyTree, num_byzantine: int, scale: float = 1.0) -> PyTree:
    """Every Byzantine node sends ``-scale`` times the honest mean update (Allen-Zhu et al. 2020)."""
    del key
    mean = _honest_mean(honest)
    return _repeat(jax.tree.map(lambda m: -scale * m, mean), num_byzantine, honest)


def gaussian(key: jax.Array, honest: PyTree, num_byzantine: int, std: float = 1.0) -> PyTree:
    """Each Byzantine node sends an independent N(0, std^2) update, keyed per node and leaf."""
    leaves, treedef = jax.tree_util.tree_flatten(honest)
    keys = jax.random.split(key, len(leaves))
    out = [
        (std * jax.random.normal(k, (num_byzantine, *x.shape[1:]), jnp.float32)).astype(x.dtype)
        for k, x in zip(keys, leaves, strict=True)
    ]
    return jax.tree_util.tree_unflatten(treedef, out)


def alie_z(num_nodes: int, num_byzantine: int) -> float:
    """z_max of "A Little Is Enough" (Baruch, Baruch and Goldberg 2019).

    s = floor(n/2 + 1) - f supporters are needed; z = Phi^{-1}((n - s) / n).
    """
    s = num_nodes // 2 + 1 - num_byzantine
    return float(stats.norm.ppf((num_nodes - s) / num_nodes))


def alie(
    key: jax.Array, honest: PyTree, num_byzantine: int, z: float | None = None, num_nodes: int | None = None
) -> PyTree:
    """A Little Is Enough: every Byzantine node sends mu - z * sigma, coordinate-wise.

    mu and sigma are the honest mean and std; z defaults to :func:`alie_z` with
    n = h + f nodes. Small per-coordinate shifts that stay inside the honest
    spread, so median- and Krum-type rules accept them.
    """
    del key
    h = jax.tree_util.tree_leaves(honest)[0].shape[0]
    if z is None:
        z = alie_z(num_nodes or h + num_byzantine, num_byzantine)
    mean = _honest_mean(honest)
    std = _honest_std(honest, mean)
    return _repeat(jax.tree.map(lambda m, s: m - z * s, mean, std), num_byzantine, honest)


def ipm(key: jax.Array, honest: PyTree, num_byzantine: int, epsilon: float = 0.1) -> PyTree:
    """Inner-product manipulation (Xie, Koyejo and Gupta 2020): -epsilon times the honest mean."""
    del key
    mean = _honest_mean(honest)
    return _repeat(jax.tree.map(lambda m: -epsilon * m, mean), num_byzantine, honest)


def nonfinite(key: jax.Array, honest: PyTree, num_byzantine: int, value: float = float("nan")) -> PyTree:
    """Byzantine (or crashed) nodes send NaN (or +-Inf with ``value``) everywhere."""
    del key
    return jax.tree.map(lambda x: jnp.full((num_byzantine, *x.shape[1:]), value, x.dtype), honest)


def mimic(key: jax.Array, honest: PyTree, num_byzantine: int, target: int = 0) -> PyTree:
    """Every Byzantine node copies honest node ``target`` (Karimireddy, He and Jaggi 2022).

    Over-represents one honest node: harmless for i.i.d. data, a bias under heterogeneity.
    """
    del key
    return jax.tree.map(lambda x: jnp.broadcast_to(x[target], (num_byzantine, *x.shape[1:])), honest)


ATTACKS: dict[str, Attack] = {
    "sign_flip": sign_flip,
    "gaussian": gaussian,
    "alie": alie,
    "ipm": ipm,
    "nonfinite": nonfinite,
    "mimic": mimic,
}


def get_attack(name: str) -> Attack:
    if name not in ATTACKS:
        raise ValueError(f"unknown attack {name!r}; valid choices: {sorted(ATTACKS)}")
    return ATTACKS[name]


def apply_attack(
    attack: str | Attack,
    key: jax.Array,
    stacked: PyTree,
    byzantine_mask: np.ndarray,
    params: PyTree | None = None,
    **kwargs: Any,
) -> PyTree:
    """Replace the Byzantine rows of a stacked tree of node params by attack outputs.

    Args:
      attack: a name from :data:`ATTACKS` or an attack function.
      key: jax.random key (the same key gives the same attack).
      stacked: stacked node params, n rows.
      byzantine_mask: concrete (n,) bool: which nodes are Byzantine.
      params: current global params; attacks act on updates x_i - params
        (on the raw rows when None).
      **kwargs: forwarded to the attack (``num_nodes`` is filled in for ALIE).
    Returns:
      stacked tree with the Byzantine rows replaced by ``params + attack(...)``.
    """
    fn = get_attack(attack) if isinstance(attack, str) else attack
    mask = np.asarray(byzantine_mask, bool)
    n = mask.shape[0]
    byz = np.flatnonzero(mask)
    hon = np.flatnonzero(~mask)
    if len(byz) == 0:
        return stacked
    if len(hon) == 0:
        raise ValueError("apply_attack: every node is Byzantine; attacks need at least one honest node")
    if fn is alie:
        kwargs.setdefault("num_nodes", n)
    ref = params

    def deltas(x, p):
        return x[hon] if p is None else x[hon] - p[None]

    honest = (
        jax.tree.map(deltas, stacked, ref) if ref is not None else jax.tree.map(lambda x: x[hon], stacked)
    )
    bad = fn(key, honest, len(byz), **kwargs)

    def put(x, b, p):
        rows = b if p is None else (b.astype(jnp.float32) + p[None].astype(jnp.float32)).astype(x.dtype)
        return jnp.asarray(x).at[byz].set(rows.astype(x.dtype))

    if ref is None:
        return jax.tree.map(lambda x, b: put(x, b, None), stacked, bad)
    return jax.tree.map(put, stacked, bad, ref)
