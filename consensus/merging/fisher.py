"""Fisher merging: a coordinate-wise average weighted by each node's diagonal Fisher."""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp

from consensus import tree
from consensus.base import Aggregator
from consensus.merging import _common as common
from consensus.specs import RULES, at_least
from kernels.compile_options import kernel_jit
from kernels.rows import tree_sum

PyTree = Any


@kernel_jit
def _fisher_leaf(x, base, fisher, w, valid, epsilon):
    b = base.astype(jnp.float32)
    num, den = [], []
    for i in range(x.shape[0]):
        f = w[i] * (jnp.maximum(fisher[i].astype(jnp.float32), 0.0) + epsilon)
        num.append(jnp.where(valid[i], f * (x[i].astype(jnp.float32) - b), 0.0))
        den.append(jnp.where(valid[i], f, 0.0))
    den_sum = tree_sum(den)
    merged = b + tree_sum(num) / jnp.where(den_sum > 0, den_sum, 1.0)
    return merged.astype(x.dtype)


@RULES.declare(
    kind="merge",
    precondition=at_least(1),
    sensitivity="not bounded (data-dependent coordinate weights)",
    needs=("params", "fisher"),
)
def fisher_merge(epsilon: float = 1e-8, weights: Any = None) -> Aggregator:
    r"""Fisher merging (Matena and Raffel, "Merging Models with Fisher-Weighted Averaging", NeurIPS 2022).

    .. math:: \theta_j = \frac{\sum_{i \in V} w_i (F_{i,j} + \epsilon)\, x_{i,j}}
                          {\sum_{i \in V} w_i (F_{i,j} + \epsilon)}

    coordinate by coordinate, with F_i node i's diagonal empirical Fisher (the
    mean over its examples of the squared per-example gradient of the loss,
    see :func:`strategies.statistics.node_statistics`) and w the node weights
    (the paper's lambda_i, default 1). The nodes submit F_i with their
    parameters: ``update(stacked, state, params=base, fisher=stacked_fisher)``,
    a stacked tree like ``stacked``. epsilon (the paper's implementation floors
    the Fisher at 1e-6; default here 1e-8) keeps coordinates that no node's
    data touches at the plain weighted mean instead of 0/0. Computed on task
    vectors around ``params`` (the same formula; better float32 accuracy).
    Negative Fisher entries are read as 0.

    Not robust: a node reporting a huge Fisher owns the coordinate; compose
    with a vote. Permutation invariant. DP sensitivity: not bounded (the
    weights are data-dependent). Precondition: at least 1 valid node, and
    ``fisher`` given. A node whose Fisher is non-finite is invalid.

    Args:
      epsilon: The floor added to every Fisher entry (>= 0).
      weights: (n,) non-negative node weights w (the paper's lambda_i), or None for 1.

    Returns:
      An :class:`~consensus.base.Aggregator` whose ``update`` needs ``params`` (the base) and
      ``fisher=``.

    Raises:
      ValueError: If ``epsilon`` < 0 or the weights are invalid; from ``update``, when the
        base or ``fisher`` is missing.
      TreeMismatchError: From ``update``, when ``fisher`` is not a stacked tree like the stack.
      ByzantineToleranceError: From ``update``, when no node is valid.

    References:
      Matena and Raffel 2022, NeurIPS, "Merging Models with Fisher-Weighted Averaging".
    """
    eps = float(epsilon)
    if not eps >= 0:
        raise ValueError(f"fisher_merge: epsilon must be >= 0, got {epsilon!r}")
    fixed = common.fixed_weights("fisher_merge", weights)

    def update(
        stacked, state, params=None, *, mask=None, fisher=None, weights=None, assume_finite=False, **extra
    ):
        del state, extra
        stacked, n = common.require_base("fisher_merge", stacked, params)
        if fisher is None:
            raise ValueError(
                "fisher_merge: needs the nodes' diagonal Fisher: "
                "update(stacked, state, base, fisher=stacked_fisher)"
            )
        try:
            tree.check_stacked_against(fisher, params)
        except tree.TreeMismatchError as e:
            raise tree.TreeMismatchError(
                f"fisher_merge: fisher must be stacked like the nodes: {e}"
            ) from None
        w = common.node_weights("fisher_merge", fixed, weights, n)
        fisher_ok = jnp.ones((n,), bool) if assume_finite else tree.finite_mask(fisher)

        def compute(valid):
            valid = valid & fisher_ok
            outs = [
                _fisher_leaf(x, b, f, w, valid, jnp.float32(eps))
                for x, b, f in zip(*common.leaves_of(stacked, params, fisher), strict=True)
            ]
            return common.unflatten_like(params, outs)

        merged, valid = common.optimistic(stacked, mask, n, assume_finite, compute)
        valid = valid & fisher_ok
        common.require_valid_count("fisher_merge", at_least(1), valid, n)
        return merged, common.RuleState(common.info(valid, w, False))

    return Aggregator(common.init_rule_state, update, "fisher_merge")
