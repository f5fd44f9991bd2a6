"""DARE: drop task-vector entries at random and rescale the rest (Yu et al., ICML 2024)."""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from consensus.aggregators import view as views
from consensus.aggregators._common import allowed, check_stacked
from consensus.base import Aggregator, PreAggregator
from consensus.merging._common import check_density
from consensus.specs import RULES, at_least
from kernels import dropout
from kernels.compile_options import kernel_jit

# Re-exported: the keyed bits live with the kernels that consume them.
keyed_bits = dropout.keyed_bits

PyTree = Any
RESCALES = (True, False, "l1")


class DareState(NamedTuple):
    """State of :func:`dare`.

    Attributes:
      key: The factory's key, or None.
      rounds: The number of rounds run (folded into the factory's key).
    """

    key: jax.Array | None
    rounds: jax.Array


@kernel_jit
def _dare_l1_leaf(x, base, key, density, valid):
    """Apply mergekit's L1 rescale: each node's leaf keeps the L1 norm of its task vector (two reductions)."""
    n = x.shape[0]
    axes = tuple(range(1, x.ndim))
    b = base.astype(jnp.float32)
    d = x.astype(jnp.float32) - b[None]
    keep = dropout.keep_mask(key, x.shape, density)
    kept = jnp.where(keep, d, d * 0.0)  # NaN stays NaN (see kernels.dropout)
    before = jnp.sum(jnp.abs(d), axis=axes, keepdims=True)
    after = jnp.sum(jnp.abs(kept), axis=axes, keepdims=True)
    factor = jnp.where(after > 0, before / jnp.where(after > 0, after, 1.0), 1.0)
    y = b[None] + kept * factor
    return jnp.where(valid.reshape((n,) + (1,) * (x.ndim - 1)), y, jnp.nan).astype(x.dtype)


@RULES.declare(
    kind="pre",
    precondition=at_least(1),
    sensitivity="that of the rule after it (DARE rescales deltas by 1/density: C / density per node)",
    needs=("params", "key"),
    defaults={"density": 0.5},
)
def dare(density: float, rescale: bool | str = True, *, key: jax.Array | None = None) -> PreAggregator:
    """DARE, Drop And REscale (Yu et al., "Language Models are Super Mario", ICML 2024).

    A keyed pre-aggregator (n -> n): with ``params`` = theta_0 the base and task
    vectors ``d_i = x_i - theta_0``, every entry of every d_i is kept
    independently with probability ``density`` (dropped with 1 - density) and

    * ``rescale=True`` (the paper): kept entries are divided by density, so
      ``E[y_i] = x_i``;
    * ``rescale="l1"`` (mergekit's ``rescale_norm: l1``): kept entries are
      scaled so each node's leaf keeps the L1 norm of its task vector;
    * ``rescale=False``: no rescaling.

    ``y_i = theta_0 + rescaled(mask_i * d_i)``. Compose with a merge:
    ``process(ties(0.5), pre=[dare(0.5)])`` is mergekit's ``dare_ties``,
    ``process(task_arithmetic(s), pre=[dare(p)])`` its ``dare_linear``.

    Randomness: the round's key is ``update(..., key=k)`` when given (the
    system passes the round's key), else the factory's ``key`` folded with the
    round counter kept in the state; without either the update raises. Leaf l
    uses ``fold_in(key, l)``; node i gets row i of that leaf's random bits, so
    the output is not invariant to permuting the nodes (each node's mask is a
    function of its position), only equal in distribution. Masked-out nodes
    come out as NaN ("no value"), like the other pre-aggregators; a node
    holding NaN/Inf comes out holding NaN/Inf (a dropped entry is ``d * 0``,
    NaN where d is not finite), so the rule downstream, which excludes every
    node with a non-finite entry, excludes it. The bits are a keyed
    counter-based hash (:func:`kernels.dropout.keyed_bits`), not threefry, for speed.

    Cost: called alone, one pass (bits, drop and rescale fused, no separate
    finiteness pass) writing a new stack, ~2x one read at least (a copy of
    the stack costs that). Inside ``process`` (``rescale`` not "l1") the
    output stays lazy (:class:`~consensus.aggregators.view.DroppedRows`):
    task arithmetic recomputes the mask where it reads each entry and sums
    the dropped task vectors in one read of the stack (mergekit's
    ``dare_linear``); every other rule gets the rows written out first.

    Precondition: density in (0, 1]. DP: DARE does not bound anything by
    itself; the rule after it decides.

    Args:
      density: The keep probability, in (0, 1].
      rescale: True (divide by density), ``"l1"`` (keep each leaf's L1 norm) or False.
      key: A jax.random key for the rounds without ``update(..., key=k)``, or None.

    Returns:
      A :class:`~consensus.base.PreAggregator` (n -> n) with a :class:`DareState`.

    Raises:
      ValueError: If ``density`` is outside (0, 1] or ``rescale`` is not one of True,
        False, ``"l1"``; from ``update``, when the base or a key is missing.

    References:
      Yu, Yu, Yu, Huang and Li 2024, ICML, "Language Models are Super Mario: Absorbing
      Abilities from Homologous Models as a Free Lunch".
    """
    rho = check_density("dare", density)
    if rescale not in RESCALES:
        raise ValueError(f"dare: rescale must be one of {RESCALES}, got {rescale!r}")
    own_key = None if key is None else jnp.asarray(key)

    def init(params):
        del params
        return DareState(own_key, jnp.zeros((), jnp.int32))

    def update(stacked, state, params=None, *, mask=None, lazy=False, key=None, **extra):
        del extra
        if params is None:
            raise ValueError("dare: needs the base model: update(stacked, state, params=base)")
        x = views.materialize(stacked) if views.is_view(stacked) else stacked
        n = check_stacked(x, params)
        if state is None:  # called without init (e.g. one-off): no own key, round 0
            state = init(params)
        if key is not None:
            round_key = key
        elif state.key is not None:
            round_key = jax.random.fold_in(state.key, state.rounds)
        else:
            raise ValueError("dare: needs a random key: dare(p, key=k) or update(..., key=round_key)")
        valid = allowed(mask, n)  # non-finite nodes stay non-finite (kernels.dropout): one pass
        leaves, tdef = jax.tree_util.tree_flatten(x)
        bases = jax.tree_util.tree_leaves(params)
        keys = tuple(jax.random.fold_in(round_key, idx) for idx in range(len(leaves)))
        new_state = DareState(state.key, state.rounds + 1)
        if rescale == "l1":
            out = [
                _dare_l1_leaf(v, b, k, jnp.float32(rho), valid)
                for v, b, k in zip(leaves, bases, keys, strict=True)
            ]
            return jax.tree_util.tree_unflatten(tdef, out), new_state
        factor = jnp.float32(1.0 / rho if rescale else 1.0)
        rows = views.DroppedRows(x, params, keys, jnp.float32(rho), factor, valid)
        return (rows if lazy else views.materialize(rows)), new_state

    return PreAggregator(init, update, "dare")


def _dare_then(rule: str, density: float, rescale: bool | str, merge: Any) -> Aggregator:
    """DARE's drop (keyed) composed with ``merge`` over the dropped task vectors, as one merge rule.

    The update takes the round's key as ``update(..., key=k)``; leaf l uses ``fold_in(k, l)`` as
    :func:`dare` does. Task arithmetic reads DARE's rows lazily (one pass over the stack); any
    other merge gets them written out first.
    """
    drop = dare(density, rescale)
    lazy = rescale != "l1" and merge.spec is not None and merge.spec.reads_dropped

    def update(stacked, state, params=None, *, mask=None, key=None, **extra):
        del state
        if key is None:
            raise ValueError(f"{rule}: is randomized; pass a jax.random key as update(..., key=key)")
        if params is None:
            raise ValueError(f"{rule}: needs the base model: update(stacked, state, params=base)")
        rows, _ = drop.update(stacked, None, params, mask=mask, lazy=lazy, key=key)
        return merge.update(rows, merge.init(params), params, mask=mask, **extra)

    return Aggregator(lambda params: merge.init(params), update, rule)


# What the two DARE merges share: a keyed drop of each task vector over a base, density 0.5
# unless given (mergekit's examples); they differ in the merge after the drop.
_DARE_MERGE: dict[str, Any] = {
    "kind": "merge",
    "precondition": at_least(1),
    "needs": ("params", "key"),
    "defaults": {"density": 0.5},
}


@RULES.declare(
    sensitivity="scale * max_i w_i * C / density (DARE's rescale, then a weighted sum)", **_DARE_MERGE
)
def dare_linear(
    density: float,
    weights: Any = None,
    normalize: bool = False,
    scale: float = 1.0,
    rescale: bool | str = True,
) -> Aggregator:
    """DARE then task arithmetic: mergekit's ``dare_linear`` (Yu et al., ICML 2024).

    Every entry of every task vector ``d_i = x_i - theta_0`` is kept with probability
    ``density`` and the kept ones rescaled (:func:`dare`: ``rescale=True`` divides by
    density, the paper's rule; ``"l1"`` keeps each tensor's L1 norm, current mergekit's
    ``rescale: true``; ``False`` keeps them as they are), then
    ``theta = theta_0 + scale * sum_i w_i d_i'`` (divided by ``sum_i w_i`` with
    ``normalize=True``; mergekit's default for dare_linear is ``normalize: false``).
    Randomized: the caller passes ``update(..., key=k)``. One pass over the stack.
    Precondition: density in (0, 1], at least 1 valid node.

    Args:
      density: The keep probability, in (0, 1].
      weights: (n,) non-negative node weights w, or None for 1.
      normalize: Divide by ``sum_i w_i`` (mergekit's default here is False).
      scale: The factor on the merged task vector.
      rescale: As for :func:`dare`: True, ``"l1"`` or False.

    Returns:
      An :class:`~consensus.base.Aggregator` whose ``update`` needs ``params`` and ``key=``.

    Raises:
      ValueError: If an argument is out of range; from ``update``, when the base or the key
        is missing.
      ByzantineToleranceError: From ``update``, when no node is valid.

    References:
      Yu, Yu, Yu, Huang and Li 2024, ICML, "Language Models are Super Mario: Absorbing
      Abilities from Homologous Models as a Free Lunch".
    """
    from consensus.merging.arithmetic import task_arithmetic

    merge = task_arithmetic(scale, weights, normalize=normalize)
    return _dare_then("dare_linear", density, rescale, merge)


@RULES.declare(sensitivity="not bounded (one node can flip every elected sign)", **_DARE_MERGE)
def dare_ties(
    density: float,
    weights: Any = None,
    normalize: bool = False,
    scale: float = 1.0,
    election: str = "sum",
    rescale: bool | str = True,
) -> Aggregator:
    """DARE then TIES' sign election and disjoint merge: mergekit's ``dare_ties``.

    The task vectors are dropped and rescaled as by :func:`dare_linear` (no magnitude
    trim: DARE's random drop is the sparsification), weighted by w, a sign elected per
    coordinate (``election``: "sum" or "count") and the entries of the elected sign
    summed (``normalize=True``: divided by the sum of the kept nodes' weights;
    mergekit's default for dare_ties is ``normalize: false``), times ``scale``, added to
    the base. Randomized: ``update(..., key=k)``.
    Precondition: density in (0, 1], at least 1 valid node.

    Args:
      density: The keep probability, in (0, 1].
      weights: (n,) non-negative node weights w, or None for 1.
      normalize: Divide by the sum of the kept nodes' weights (mergekit's default here is
        False).
      scale: The factor on the merged task vector.
      election: The sign election, ``"sum"`` or ``"count"`` (see :func:`~consensus.merging.ties`).
      rescale: As for :func:`dare`: True, ``"l1"`` or False.

    Returns:
      An :class:`~consensus.base.Aggregator` whose ``update`` needs ``params`` and ``key=``.

    Raises:
      ValueError: If an argument is out of range; from ``update``, when the base or the key
        is missing.
      ByzantineToleranceError: From ``update``, when no node is valid.

    References:
      Yu, Yu, Yu, Huang and Li 2024, ICML, "Language Models are Super Mario: Absorbing
      Abilities from Homologous Models as a Free Lunch"; Yadav, Tam, Choshen, Raffel and
      Bansal 2023, NeurIPS, "TIES-Merging: Resolving Interference When Merging Models".
    """
    from consensus.merging.ties import ties

    merge = ties(1.0, election=election, scale=scale, weights=weights, normalize=normalize)
    return _dare_then("dare_ties", density, rescale, merge)
