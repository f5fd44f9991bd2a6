"""Plumbing shared by the merge methods: the base, valid nodes, node weights, checks.

A merge method is an :class:`~consensus.base.Aggregator` whose ``params`` is the
common base model: node i's *task vector* is ``x_i - params``. Nodes that are
masked out or hold NaN/Inf take no part (their task vector counts as absent,
never as zero, in every count and divisor).
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from consensus import tree
from consensus.aggregators import view as views
from consensus.aggregators._common import (
    RuleState,
    allowed,
    init_rule_state,
    is_concrete,
    static_count,
    unless_non_finite,
)
from consensus.base import AggregationInfo, ByzantineToleranceError
from consensus.specs import Precondition, least_count

PyTree = Any

# Re-exported for the method modules.
__all__ = ["RuleState", "init_rule_state"]


def require_base(rule: str, stacked: PyTree, params: PyTree | None) -> tuple[PyTree, int]:
    """The plain stacked tree (views materialized) and n; raise when the base is missing or mismatched."""
    if params is None:
        raise ValueError(
            f"{rule}: needs the base model: update(stacked, state, params=base); "
            "task vectors are the node deltas x_i - base"
        )
    stacked = views.materialize(stacked) if views.is_view(stacked) else stacked
    n = tree.num_nodes(stacked)
    tree.check_stacked_against(stacked, params)
    return stacked, n


def valid_nodes(stacked: PyTree, mask: jax.Array | None, n: int, assume_finite: bool = False) -> jax.Array:
    """(n,) bool: allowed by ``mask`` and, unless ``assume_finite``, finite in every leaf."""
    valid = allowed(mask, n)
    if not assume_finite:
        valid = valid & tree.finite_mask(stacked)
    return valid


def require_valid_count(rule: str, precondition: Precondition, valid: jax.Array, n: int) -> None:
    """Raise ByzantineToleranceError when a concrete valid count fails the method's declared precondition."""
    m = static_count(valid)
    needed = None if m is None else precondition(m, 0)
    if needed is not None:
        raise ByzantineToleranceError(f"{rule}: {m} valid node(s) out of n={n}; needs {needed}.")


def require_stack(rule: str, precondition: Precondition, n: int) -> None:
    """Raise ByzantineToleranceError when no valid count of a stack of n nodes meets the precondition."""
    if least_count(precondition, 0, n) > n:
        raise ByzantineToleranceError(f"{rule}: needs {precondition(n, 0)}, got a stack of n={n}")


def check_density(rule: str, density: float) -> float:
    if isinstance(density, bool) or not isinstance(density, (int, float, np.floating)):
        raise ValueError(f"{rule}: density must be a number in (0, 1], got {density!r}")
    if not (math.isfinite(density) and 0.0 < density <= 1.0):
        raise ValueError(f"{rule}: density must be in (0, 1], got {density!r}")
    return float(density)


def check_flag(rule: str, name: str, value: Any) -> bool:
    """A yes/no parameter: a bool (or numpy bool), nothing else (``"false"`` would read as true)."""
    if not isinstance(value, (bool, np.bool_)):
        raise ValueError(f"{rule}: {name} must be true or false, got {value!r}")
    return bool(value)


def check_scale(rule: str, scale: float) -> float:
    if not math.isfinite(float(scale)):
        raise ValueError(f"{rule}: scale must be finite, got {scale!r}")
    return float(scale)


def node_weights(rule: str, fixed: jax.Array | None, given: Any, n: int) -> jax.Array:
    """(n,) float32 node weights: per-call ``given`` over the factory's ``fixed``, default all 1."""
    if given is None and fixed is None:
        return jnp.ones((n,), jnp.float32)
    if given is None:
        assert fixed is not None  # ruled out above
        # The factory's weights were checked on the host (fixed_weights); only the count is
        # left. Under jit, a jnp operation on them would give a tracer that cannot be tested.
        if fixed.shape != (n,):
            raise ValueError(f"{rule}: weights must have shape ({n},) (one per input), got {fixed.shape}")
        return jnp.asarray(fixed)
    w = jnp.asarray(given, jnp.float32)
    if w.shape != (n,):
        raise ValueError(f"{rule}: weights must have shape ({n},) (one per input), got {w.shape}")
    if is_concrete(w) and bool(jnp.any(~jnp.isfinite(w) | (w < 0))):
        raise ValueError(f"{rule}: weights must be finite and non-negative")
    return w


def fixed_weights(rule: str, weights: Any) -> np.ndarray | None:
    """A factory's node weights, checked on the host: a float32 numpy vector (None stays None).

    Kept as numpy so that an update jitted around the rule sees constants, not tracers.
    """
    if weights is None:
        return None
    try:
        w = np.asarray(weights, np.float64)
    except (TypeError, ValueError) as e:
        raise ValueError(f"{rule}: weights must be a list of numbers, got {weights!r}") from e
    if w.ndim != 1 or not np.all(np.isfinite(w)) or np.any(w < 0):
        raise ValueError(
            f"{rule}: weights must be a 1-D vector of finite non-negative numbers, got {weights!r}"
        )
    return w.astype(np.float32)


def info(valid: jax.Array, weights: jax.Array, linear: bool) -> AggregationInfo:
    """Diagnostics: ``weights`` renormalized over the valid nodes (the uniform share if all are 0)."""
    w = jnp.where(valid, weights, 0.0)
    total = jnp.sum(w)
    share = valid.astype(jnp.float32) / jnp.maximum(jnp.sum(valid.astype(jnp.float32)), 1.0)
    w = jnp.where(total > 0, w / jnp.where(total > 0, total, 1.0), share)
    return AggregationInfo(valid, valid, w, linear)


def leaves_of(*trees: PyTree) -> list[list[jax.Array]]:
    return [jax.tree_util.tree_leaves(t) for t in trees]


def unflatten_like(like: PyTree, leaves: list[jax.Array]) -> PyTree:
    return jax.tree_util.tree_unflatten(jax.tree_util.tree_structure(like), leaves)


def optimistic(
    stacked: PyTree,
    mask: jax.Array | None,
    n: int,
    assume_finite: bool,
    compute,
    aux: bool = False,
    aux_proves: bool = False,
) -> tuple:
    """``compute(valid) -> merged`` with the finiteness pass only when it is needed.

    The merge is first computed over the allowed nodes: NaN and Inf survive every
    method here (they reach the output through a sum with a non-zero coefficient,
    or a product with a zero one), so a finite output proves every allowed node was
    finite and the separate finiteness pass over the stack is skipped. Eagerly the
    check is a Python ``if``; under an outer jit it is :func:`unless_non_finite`, a
    while loop that keeps the first result in place and runs the finite-mask pass
    and the merge again only when that result is not finite.

    With ``aux=True``, ``compute(valid)`` returns ``(merged, aux)`` (per-leaf
    diagnostics; it must be pure: under jit it is traced twice, once inside the
    loop) and the result is ``(merged, aux, valid)``; else ``(merged, valid)``.
    With ``aux_proves=True`` a finite ``aux`` stands for a finite ``merged`` (the method
    guarantees it: Model Stock's ratios are NaN whenever an allowed node is not finite), so the
    check reads the small aux instead of the merged tree.
    """
    leaves = jax.tree_util.tree_leaves(stacked)
    concrete = all(is_concrete(x) for x in leaves) and (mask is None or is_concrete(mask))

    def run(valid):
        out = compute(valid)
        return (*out, valid) if aux else (out, valid)

    if assume_finite:
        return run(allowed(mask, n))
    first = run(allowed(mask, n))
    check = 1 if aux and aux_proves else 0
    if not concrete:
        return unless_non_finite(first, lambda: run(valid_nodes(stacked, mask, n)), check)
    if all(bool(jnp.isfinite(y).all()) for y in jax.tree_util.tree_leaves(first[check])):
        return first
    return run(valid_nodes(stacked, mask, n))
