"""TIES-merging: trim, elect sign, disjoint merge (Yadav et al., NeurIPS 2023)."""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp

from consensus.base import Aggregator
from consensus.merging._common import (
    RuleState,
    check_density,
    check_flag,
    check_scale,
    fixed_weights,
    info,
    init_rule_state,
    leaves_of,
    node_weights,
    optimistic,
    require_base,
    require_valid_count,
    unflatten_like,
)
from consensus.merging._select import kth_largest_delta_bits
from consensus.specs import RULES, at_least
from kernels.compile_options import kernel_jit
from kernels.rows import tree_sum

PyTree = Any
ELECTIONS = ("sum", "count")


def trim_thresholds(x: jax.Array, base: jax.Array, density: float, valid: jax.Array) -> jax.Array:
    """Find each node's trim threshold: node i keeps the entries with ``|x_i - base| >= threshold_i``.

    k = max(1, int(density * size)); threshold_i keeps exactly the entries whose ``|x_i - base|`` is at
    or above the k-th largest over the leaf (it is that value, or a float between it and the next
    smaller magnitude, which keeps the same entries), found exactly without sorting
    (:mod:`consensus.merging._select`). Invalid rows read as zeros (they are excluded later anyway).

    Args:
      x: (n, ...) node rows of one leaf.
      base: The base leaf (no node axis).
      density: The kept fraction, in (0, 1].
      valid: (n,) bool, the valid nodes.

    Returns:
      (n,) float32 thresholds.
    """
    n = x.shape[0]
    size = math.prod(x.shape[1:])  # not x[0].size: eagerly that slices out (copies) a row
    k = trim_count(density, size)
    if k is None:
        return jnp.zeros((n,), jnp.float32)
    return _thresholds(x, base, valid, k=k)


def trim_count(density: float, size: int) -> int | None:
    """Return k = max(1, int(density * size)), the entries of a leaf that the trim keeps per node.

    The merge command's streamed thresholds (:mod:`meta_consensus.merge.trim`) use this same count.

    Args:
      density: The kept fraction, in (0, 1].
      size: The number of values in the leaf.

    Returns:
      k, or None when the trim keeps them all (threshold 0).
    """
    k = max(1, int(density * size))
    return None if k >= size else k


@kernel_jit(static_argnames=("k",))
def _thresholds(x, base, valid, *, k: int):
    n = x.shape[0]
    # mask_only: a threshold keeping exactly the entries >= the k-th largest (never an extra pass).
    bits, _ = kth_largest_delta_bits(x.reshape(n, -1), base.reshape(-1), valid, k, mask_only=True)
    return jax.lax.bitcast_convert_type(bits, jnp.float32)


@kernel_jit(static_argnames=("election", "normalize"))
def _ties_leaf(x, base, thresholds, w, valid, scale, *, election: str, normalize: bool = True):
    """One fused pass over the rows: trim, weigh, elect, disjoint mean, add to the base."""
    b = base.astype(jnp.float32)
    n = x.shape[0]
    terms = []
    for i in range(n):
        d = x[i].astype(jnp.float32) - b
        # not(|d| < t) rather than |d| >= t: a NaN entry is kept, so it reaches the output and
        # the caller's finiteness check excludes the node instead of silently dropping entries.
        keep = valid[i] & ~(jnp.abs(d) < thresholds[i])
        terms.append(jnp.where(keep, w[i] * d, 0.0))
    votes = tree_sum(terms) if election == "sum" else tree_sum([jnp.sign(t) for t in terms])
    elected = jnp.where(votes >= 0, 1.0, -1.0)
    kept = [jnp.sign(t) == elected for t in terms]  # sign(0) = 0: zeros are never kept
    num = tree_sum([jnp.where(k, t, 0.0) for k, t in zip(kept, terms, strict=True)])
    if normalize:
        den = tree_sum([jnp.where(k, w[i], 0.0) for i, k in enumerate(kept)])
        num = num / jnp.where(den == 0, 1.0, den)
    # 0 where every kept-or-not term is finite, NaN where a valid node holds NaN/Inf: the
    # non-finite node must poison the output (and be excluded by the caller), not vanish.
    poison = tree_sum([t * 0.0 for t in terms])
    return (b + scale * num + poison).astype(x.dtype)


@RULES.declare(
    kind="merge",
    precondition=at_least(1),
    sensitivity="not bounded (one node can flip every elected sign)",
    needs=("params",),
    defaults={"density": 0.2},
    # the merge command streams TIES in column chunks: per-node thresholds of each leaf first
    # (a counting pass over its chunks, :func:`trim_count` of this parameter), then
    # ``update(..., thresholds=...)`` chunk by chunk (an element-wise pass).
    traits={"trim_density": "density"},
)
def ties(
    density: float, election: str = "sum", scale: float = 1.0, weights: Any = None, normalize: bool = True
) -> Aggregator:
    """TIES-merging (Yadav et al., "TIES-Merging: Resolving Interference When Merging Models", NeurIPS 2023).

    With ``params`` = theta_0 the base and task vectors ``d_i = x_i - theta_0``:

    1. *Trim*: per node and per leaf keep the k = max(1, int(density * size))
       largest-magnitude entries of d_i, zero the rest. Ties in magnitude at
       the k-th value are all kept: the rule keeps every entry with
       ``|d_i| >= t_i``, t_i the exact k-th largest magnitude, so more than k
       entries survive when several share t_i (mergekit keeps exactly k, and
       which of the tied entries it keeps depends on torch's argsort order).
    2. Multiply by the node weights w_i (default 1): ``tau_i = w_i trim(d_i)``.
    3. *Elect* a sign per coordinate: ``"sum"`` (the paper's and mergekit's
       default) takes ``sign(sum_i tau_i)``; ``"count"`` takes the majority of
       ``sign(tau_i)`` (mergekit's ``count``). A zero vote elects +.
    4. *Disjoint merge*: keep ``tau_i`` where ``sign(tau_i)`` equals the
       elected sign (zeros are never kept), and divide the sum of the kept
       entries by the sum of the kept nodes' weights (a divisor of 0 reads 1);
       ``normalize=False`` (mergekit's ``normalize: false``) keeps the sum.
    5. ``theta = theta_0 + scale * merged`` (the paper's lambda; 1 in mergekit).

    This is mergekit's ``ties`` (``normalize: true``) except for the tie rule
    of step 1. With ``"sum"`` one large Byzantine delta sets every elected
    sign (its magnitude outvotes the honest nodes); ``"count"`` is the safer
    election when some nodes may be Byzantine: an attacker then has one vote
    per coordinate, though its kept entries still enter the mean where its
    sign wins. Invalid nodes (masked or non-finite) take no part.

    Cost: the exact per-node thresholds take two streaming passes over the
    stack on continuous data (a counting pass and an extraction pass, more on
    heavily tied magnitudes; no sort, see :mod:`consensus.merging._select`),
    then one fused pass.
    ``update(..., thresholds=t)``: ``t`` a tree like ``params`` of (n,) float32 per-node
    thresholds (node i keeps ``|d_i| >= t_i``) found elsewhere, e.g. over a whole leaf while
    the update sees a column chunk of it (the merge command's streaming); the trim is then
    skipped and the rest is element-wise.
    Not permutation-sensitive: the output is invariant to node order.
    DP sensitivity: not bounded by this package (the elected sign of every
    coordinate can flip with one node); DP refuses it.
    Precondition: density in (0, 1], at least 1 valid node.

    Args:
      density: The fraction of each task vector's entries kept by the trim, in (0, 1].
      election: ``"sum"`` or ``"count"``.
      scale: lambda, the factor on the merged task vector (finite).
      weights: (n,) non-negative node weights w, or None for 1.
      normalize: Divide by the sum of the kept nodes' weights (mergekit's ``normalize: true``).

    Returns:
      An :class:`~consensus.base.Aggregator` whose ``update`` needs ``params`` (the base).

    Raises:
      ValueError: If ``density`` is outside (0, 1], ``election`` unknown, ``scale`` not
        finite, ``normalize`` not a bool or the weights invalid; from ``update``, when the
        base is missing or does not match the stack.
      ByzantineToleranceError: From ``update``, when no node is valid.

    References:
      Yadav, Tam, Choshen, Raffel and Bansal 2023, NeurIPS, "TIES-Merging: Resolving
      Interference When Merging Models".
    """
    rho = check_density("ties", density)
    if election not in ELECTIONS:
        raise ValueError(f"ties: election must be one of {ELECTIONS}, got {election!r}")
    lam = check_scale("ties", scale)
    fixed = fixed_weights("ties", weights)
    normalize = check_flag("ties", "normalize", normalize)

    def update(
        stacked, state, params=None, *, mask=None, weights=None, assume_finite=False, thresholds=None, **extra
    ):
        del state, extra
        stacked, n = require_base("ties", stacked, params)
        w = node_weights("ties", fixed, weights, n)
        given = None if thresholds is None else jax.tree_util.tree_leaves(thresholds)

        def compute(valid):
            xs, bs = leaves_of(stacked, params)
            out = []
            for i, (x, b) in enumerate(zip(xs, bs, strict=True)):
                t = trim_thresholds(x, b, rho, valid) if given is None else jnp.asarray(given[i], jnp.float32)
                out.append(
                    _ties_leaf(x, b, t, w, valid, jnp.float32(lam), election=election, normalize=normalize)
                )
            return unflatten_like(params, out)

        merged, valid = optimistic(stacked, mask, n, assume_finite, compute)
        require_valid_count("ties", at_least(1), valid, n)
        return merged, RuleState(info(valid, w, False))

    return Aggregator(init_rule_state, update, "ties")
