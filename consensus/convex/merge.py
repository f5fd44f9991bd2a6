"""Convex merge weights as an aggregator: solve for w on the host, merge in one pass.

:func:`convex_merge` wraps a *weigher*, a host-side function that returns
:class:`~consensus.convex.qp.ConvexWeights` for a stacked tree, into a
:class:`~consensus.base.Aggregator`. The weigher runs cvxpy (not jittable;
the problem is compiled once and re-solved each round), then the merge is one
streaming :func:`consensus.tree.weighted_sum` pass. Ready-made weighers:
:func:`quadratic_weigher`, :func:`mixture_nll_weigher`, :func:`anchor_weigher`.

With ``vote=`` a Byzantine-robust rule runs first and only the nodes it accepted
may get weight: ``vote -> convex weights`` is one aggregator, which
:func:`consensus.dp.privatize` (``project=True``) can wrap as a whole.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any, Literal, NamedTuple, Protocol

import jax
import jax.numpy as jnp
import numpy as np

from consensus import tree
from consensus.base import AggregationInfo, Aggregator, empty_info, get_info
from consensus.convex.curvature import LossModel
from consensus.convex.mixture import mixture_nll_weights
from consensus.convex.problems import accepted_mask
from consensus.convex.qp import ConvexWeights
from consensus.convex.weights import anchor_weights, quadratic_weights, trust_region_quadratic_weights
from consensus.mesh import to_host

PyTree = Any


class Weigher(Protocol):
    """``weigher(stacked, params, mask, **extra) -> ConvexWeights`` (host side).

    ``mask`` is the (n,) numpy bool of nodes allowed to take part (the vote's
    mask and finiteness already combined); ``params`` the current global tree
    or None; ``extra`` the keyword arguments given to the aggregator's update
    (for example the held-out ``batch``).
    """

    def __call__(
        self, stacked: PyTree, params: PyTree | None, mask: np.ndarray, **extra: Any
    ) -> ConvexWeights:
        """Return the weights for ``stacked`` (see the class docstring)."""
        ...


class SolverFailure(RuntimeError):
    """The convex problem could not be solved and the caller asked not to fall back (``on_fallback``)."""


# Host-side diagnostics ride in the state as static pytree nodes: they carry no arrays, so a
# checkpoint of the state (its array leaves) is the same before and after the first round.
jax.tree_util.register_static(ConvexWeights)


@jax.tree_util.register_static
class Seconds(dict):
    """Wall seconds of the phases of the last update (host telemetry: ``{"vote": .., "weights": ..}``)."""

    # Static pytree nodes must hash; telemetry never keys a jit cache. (dict declares __hash__ = None.)
    def __hash__(self) -> int:  # type: ignore[override]
        return 0


class ConvexMergeState(NamedTuple):
    """State of :func:`convex_merge`.

    Attributes:
      info: the round's :class:`~consensus.base.AggregationInfo`; ``selected``
        is the set of nodes the weigher accepted (allowed a positive weight).
      result: the round's :class:`~consensus.convex.qp.ConvexWeights`
        (status, objective, solve time, fallback and its reason), None before
        the first update.
      vote: the vote's state (None without a vote).
      seconds: wall seconds of the last update's phases, ``{"vote": .., "weights": ..}``.
    """

    info: AggregationInfo
    result: ConvexWeights | None = None
    vote: Any = None
    seconds: Seconds = Seconds()


def _sensitivity(clip_norm: float, num_nodes: float) -> float:
    del num_nodes
    return 2.0 * float(clip_norm)


def convex_merge(
    weigher: Weigher,
    *,
    vote: Aggregator | None = None,
    on_fallback: Literal["use", "raise"] = "use",
    name: str = "convex_merge",
) -> Aggregator:
    r"""An aggregator that merges with weights from a convex problem.

    .. math:: \bar x = \sum_i w_i x_i,\qquad w = \text{weigher}(x) \in
              \{w \ge 0, \textstyle\sum_i w_i = 1\}

    ``update(stacked, state, params=None, *, mask=None, **extra)`` combines
    ``mask`` with the finite-node mask, calls ``weigher(stacked, params, valid,
    **extra)`` on the host (``extra`` also reaches the vote, whose rules may need a
    ``key`` or a ``server_update``), and merges with one weighted-sum pass (nodes of
    weight 0 contribute exactly 0, even when they hold NaN). The state records
    the ConvexWeights result, so a solver fallback is visible in the round's
    info. Infeasible options (caps below 1/n_valid, no valid node) raise the
    weigher's ValueError. Not jittable (cvxpy runs on the host).

    Sensitivity (for DP): ``2 * clip_norm``, whatever n. The merged update
    ``sum_i w_i u_i`` is a convex combination of node updates clipped to norm
    C, so it lies in the C-ball, and any two such outputs (with or without one
    node) are at most 2C apart. No tighter bound is claimed: the weights are
    data-dependent, so adding or removing one node may move every weight (a
    node can take the whole mass up to the cap). Unlike the uniform mean's
    C/n this does not shrink with n, so DP noise for this rule is large. The
    bound is for stacked *updates* (deltas); merging parameter trees adds
    ``(1 - sum w) * params`` with ``|1 - sum w|`` at float32 rounding (~1e-7 n).

    With ``vote``, the vote runs first on the same nodes and mask; the nodes it
    accepted (``info.selected & info.valid``) are the weigher's mask, and the
    weigher also receives the vote's output as the keyword ``voted`` (an anchor
    for :func:`anchor_weigher`). A vote that accepts no node raises
    :class:`SolverFailure`. The state keeps the vote's state and the wall
    seconds of both phases (``state.seconds``).

    Args:
      weigher: see :class:`Weigher`.
      vote: an optional Byzantine-robust rule whose accepted nodes may get weight.
      on_fallback: "use" the weigher's uniform fallback when the solver fails (the
        result says so), or "raise" :class:`SolverFailure` instead.
      name: the aggregator's name.

    Returns:
      :class:`~consensus.base.Aggregator` with a :class:`ConvexMergeState`.

    Raises:
      TypeError: If ``weigher`` is not callable; from ``update``, when it returns something
        other than ConvexWeights.
      ValueError: If ``on_fallback`` is not "use" or "raise"; from ``update``, the weigher's
        ValueError for infeasible options.
      SolverFailure: From ``update``, when the vote accepts no node, or the solver fails and
        ``on_fallback="raise"``.

    Example:
      >>> from consensus import stack
      >>> def prob_fn(p, batch):  # one node's probability of each true label
      ...     probs = jax.nn.softmax(batch["x"] @ p["w"])
      ...     return jnp.take_along_axis(probs, batch["y"][:, None], 1)[:, 0]
      >>> params = {"w": jnp.zeros((2, 2))}
      >>> stacked = stack([{"w": s * jnp.eye(2)} for s in (1.0, 2.0, -3.0)])  # node 2 is wrong
      >>> held_out = {"x": jnp.eye(2), "y": jnp.array([0, 1])}
      >>> agg = convex_merge(mixture_nll_weigher(prob_fn, max_weight=0.5))
      >>> state = agg.init(params)
      >>> merged, state = agg.update(stacked, state, params, batch=held_out)
      >>> state.result.status, state.result.fallback
      ('optimal', False)
      >>> np.allclose(state.result.weights, [0.5, 0.5, 0.0], atol=1e-4)
      True
    """
    if not callable(weigher):
        raise TypeError(f"weigher must be callable, got {type(weigher).__name__}")
    if on_fallback not in ("use", "raise"):
        raise ValueError(f"on_fallback must be 'use' or 'raise', got {on_fallback!r}")

    def init(params: PyTree) -> ConvexMergeState:
        return ConvexMergeState(
            info=empty_info(), result=None, vote=None if vote is None else vote.init(params)
        )

    def update(stacked, state, params=None, *, mask=None, **extra):
        n = tree.num_nodes(stacked)
        if params is not None:
            tree.check_stacked_against(stacked, params)
        t0 = time.perf_counter()
        vote_state = None
        # to_host: the stack may be sharded over other processes' devices (multi-process meshes)
        finite = np.asarray(to_host(tree.finite_mask(stacked)), bool)
        if vote is not None:
            # extra reaches the vote too: its rules may need a key or the server's update.
            voted, vote_state = vote.update(stacked, state.vote, params, mask=mask, **extra)
            vinfo = get_info(vote_state)
            valid = np.asarray(to_host(vinfo.selected & vinfo.valid), bool) & finite  # waits for the vote
            if not valid.any():
                raise SolverFailure(f"the vote ({vote.name}) accepted no node")
            extra = {**extra, "voted": voted}
        else:
            valid = accepted_mask(mask, n) & finite
        t1 = time.perf_counter()
        result = weigher(stacked, params, valid, **extra)
        if not isinstance(result, ConvexWeights):
            raise TypeError(f"weigher must return ConvexWeights, got {type(result).__name__}")
        if result.fallback and on_fallback == "raise":
            raise SolverFailure(f"convex weights: solver failure ({result.status}): {result.message}")
        w = jnp.asarray(result.weights, jnp.float32)
        merged = jax.block_until_ready(tree.weighted_sum(stacked, w))
        info = AggregationInfo(
            valid=jnp.asarray(valid), selected=jnp.asarray(result.accepted & valid), weights=w
        )
        seconds = Seconds(vote=t1 - t0, weights=time.perf_counter() - t1)
        return merged, ConvexMergeState(info=info, result=result, vote=vote_state, seconds=seconds)

    return Aggregator(init=init, update=update, name=name, sensitivity=_sensitivity)


# ----------------------------------------------------------------------------- weighers


def _reference(stacked: PyTree, params: PyTree | None, mask: np.ndarray, reference: Any) -> PyTree:
    if reference == "mean":
        return tree.weighted_sum(stacked, jnp.asarray(mask.astype(np.float32) / mask.sum()))
    if reference == "params":
        if params is None:
            raise ValueError("reference='params' needs the current global params in update(..., params=...)")
        return params
    if isinstance(reference, Aggregator):
        merged, _ = reference.update(stacked, reference.init(params), params, mask=jnp.asarray(mask))
        return merged
    raise ValueError(
        f"reference must be 'mean', 'params' or an Aggregator (a robust mean), got {reference!r}"
    )


def quadratic_weigher(
    model_fn: Callable[..., LossModel],
    *,
    reference: Any = "mean",
    trust_region: bool = True,
    loss_fn: Callable[..., Any] | None = None,
    eta: float = 0.1,
    max_steps: int = 8,
    **options: Any,
) -> Weigher:
    """Weigher for the quadratic model of the held-out loss.

    Each round: theta_0 = ``reference`` ("mean": the uniform mean of the valid
    nodes; "params": the current global params; or an Aggregator such as a
    robust mean), then ``model_fn(theta_0, **extra) -> LossModel`` (for example
    :func:`~consensus.convex.curvature.softmax_gauss_newton` on the held-out
    batch passed to ``update``), then the QP. With ``trust_region`` (default)
    the weights go through
    :func:`~consensus.convex.weights.trust_region_quadratic_weights`, so the
    merge's true held-out loss is never above the uniform merge's; the loss of
    a candidate merge is ``loss_fn(params, **extra)`` or, if None,
    ``model_fn(params, **extra).loss``. Without it,
    :func:`~consensus.convex.weights.quadratic_weights` is used as is.

    Args:
      model_fn: builds the loss model at a point.
      reference: see above.
      trust_region: safeguard the weights by the true held-out loss.
      loss_fn: cheaper held-out loss for the trust region (optional).
      eta: The trust region's acceptance threshold on rho.
      max_steps: How many times the trust region's ridge may grow.
      **options: lambda_reg, max_weight, min_weight, damping, solver, cache, solver_options
        (see :func:`~consensus.convex.weights.quadratic_weights`).

    Returns:
      a :class:`Weigher`.

    Raises:
      ValueError: When the weigher runs, if ``reference`` is not "mean", "params" or an
        Aggregator, or is "params" without params.

    Example:
      >>> from consensus import softmax_gauss_newton, stack
      >>> def logits_fn(p, x): return x @ p["w"]
      >>> def model_fn(p, x, y): return softmax_gauss_newton(logits_fn, p, x, y)
      >>> stacked = stack([{"w": s * jnp.eye(2)} for s in (1.0, 2.0, -3.0)])  # node 2 is wrong
      >>> x_val, y_val = jnp.eye(2), jnp.array([0, 1])
      >>> agg = convex_merge(quadratic_weigher(model_fn, max_weight=0.75))
      >>> merged, state = agg.update(stacked, agg.init(None), x=x_val, y=y_val)
      >>> bool(state.result.weights[2] < 1e-6)
      True
    """

    def weigh(stacked, params, mask, *, voted=None, **extra):
        del voted
        ref = _reference(stacked, params, mask, reference)
        model = model_fn(ref, **extra)
        if not trust_region:
            return quadratic_weights(
                stacked, ref, model.grad, model.curvature, loss=float(model.loss), mask=mask, **options
            )

        def loss_at(p):
            return float(loss_fn(p, **extra)) if loss_fn is not None else float(model_fn(p, **extra).loss)

        return trust_region_quadratic_weights(
            stacked,
            ref,
            model.grad,
            model.curvature,
            loss_at,
            loss=float(model.loss),
            eta=eta,
            max_steps=max_steps,
            mask=mask,
            **options,
        )

    return weigh


def mixture_nll_weigher(prob_fn: Callable[..., jax.Array], **options: Any) -> Weigher:
    """Weigher for :func:`~consensus.convex.mixture.mixture_nll_weights` (stacking).

    ``prob_fn(node_params, **extra) -> (m,)`` gives one node's probability of
    the true label of each held-out example; it is vmapped over the node axis
    to form ``probs`` (n, m).

    Args:
      prob_fn: ``prob_fn(node_params, **extra) -> (m,)`` probabilities of the true labels.
      **options: Keyword arguments of :func:`~consensus.convex.mixture.mixture_nll_weights`
        (lambda_reg, max_weight, min_weight, method, solver, ...).

    Returns:
      a :class:`Weigher`.

    Example:
      >>> def prob_fn(p, batch):
      ...     return jnp.take_along_axis(jax.nn.softmax(batch["x"] @ p["w"] + p["b"]),
      ...                                batch["y"][:, None], 1)[:, 0]
      >>> agg = convex_merge(mixture_nll_weigher(prob_fn, max_weight=0.5))
      >>> agg.name
      'convex_merge'
    """

    def weigh(stacked, params, mask, *, voted=None, **extra):
        del params, voted
        probs = jax.vmap(lambda p: prob_fn(p, **extra))(stacked)
        return mixture_nll_weights(np.asarray(probs, np.float64), mask=mask, **options)

    return weigh


def anchor_weigher(anchor: Aggregator | None = None, **options: Any) -> Weigher:
    """Weigher for :func:`~consensus.convex.weights.anchor_weights` around a robust aggregator.

    The anchor aggregator (geometric median, trimmed mean, ...) runs on the same
    stacked tree and mask. If its info says its output is a weighted mean of the
    nodes (``info.linear``, e.g. Weiszfeld's weights of the geometric median),
    those weights are used (b = G v, exact); otherwise its output tree is the
    anchor. With ``anchor=None`` the anchor is the output of the vote that
    :func:`convex_merge` ran first (its ``vote=``): the convex combination of
    the accepted nodes closest to the vote.

    Args:
      anchor: The robust aggregator whose output is the anchor, or None for the vote's output.
      **options: Keyword arguments of :func:`~consensus.convex.weights.anchor_weights`
        (lambda_reg, max_weight, min_weight, solver, ...).

    Returns:
      a :class:`Weigher`.

    Raises:
      TypeError: If ``anchor`` is given and is not an Aggregator.
      ValueError: When the weigher runs without an anchor and without a vote's output.

    Example::

        agg = convex_merge(anchor_weigher(trimmed_mean(num_byzantine=2), max_weight=1 / (n - 2)))
        agg = convex_merge(anchor_weigher(), vote=multi_krum(2))  # closest to the vote's output
    """
    if anchor is not None and not isinstance(anchor, Aggregator):
        raise TypeError(f"anchor must be an Aggregator (a robust rule), got {type(anchor).__name__}")

    def weigh(stacked, params, mask, *, voted=None, **extra):
        if anchor is None:
            if voted is None:
                raise ValueError("anchor_weigher() without an anchor needs convex_merge(..., vote=...)")
            return anchor_weights(stacked, voted, mask=mask, **options)
        merged, st = anchor.update(stacked, anchor.init(params), params, mask=jnp.asarray(mask))
        info = get_info(st)
        if info.linear:
            v = np.asarray(info.weights, np.float64)
            v = np.where(mask, v, 0.0)
            return anchor_weights(stacked, anchor_node_weights=v / v.sum(), mask=mask, **options)
        return anchor_weights(stacked, merged, mask=mask, **options)

    return weigh
