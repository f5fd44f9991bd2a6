"""Composition: pre-aggregators, then a rule, then a server optimizer.

``process(aggregator, pre=(clip(C), nnm(f)), post=optax.adam(1e-2))`` reads as
the pipeline it runs. The server optimizer is any optax transform applied to
the pseudo-gradient ``params - merged`` (Reddi et al. 2021, "Adaptive Federated
Optimization"): ``optax.sgd(1.0)`` is FedAvg, ``optax.sgd(lr, momentum)``
FedAvgM, ``optax.adam`` FedAdam.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple, cast

import jax
import optax

from consensus.aggregators import view as views
from consensus.aggregators._common import check_stacked, robust_centre
from consensus.aggregators.pre import pull_back_weights
from consensus.base import AggregationInfo, Aggregator, PreAggregator, empty_info


def reads_views(agg: Aggregator | PreAggregator) -> bool:
    """Tell whether the rule declared that its update reads a lazy view (``spec.reads_views``).

    Args:
      agg: A rule or pre-aggregator.

    Returns:
      True when its declaration says so; False for hand-built ones (no spec).
    """
    return agg.spec is not None and agg.spec.reads_views


def reads_dropped(agg: Aggregator | PreAggregator) -> bool:
    """Tell whether the rule declared that its update reads DARE's lazy rows (``spec.reads_dropped``).

    Args:
      agg: A rule or pre-aggregator.

    Returns:
      True when its declaration says so; False for hand-built ones (no spec).
    """
    return agg.spec is not None and agg.spec.reads_dropped


def view_centre(p: PreAggregator) -> str:
    """Return where a pre-aggregator without params centres its view, as declared.

    Args:
      p: A pre-aggregator.

    Returns:
      Its ``spec.centre`` (``"zero"``, ``"none"`` or ``"median"``); ``"median"`` when hand-built.
    """
    return "median" if p.spec is None else p.spec.centre


class ProcessState(NamedTuple):
    """The state of a :func:`process` pipeline.

    Attributes:
      pre: The pre-aggregators' states, in pipeline order.
      aggregator: The rule's state.
      post: The server optimizer's state (None without ``post``).
      info: The pipeline's :class:`~consensus.base.AggregationInfo`, with ``weights`` pulled
        back to the original nodes.
    """

    pre: tuple
    aggregator: Any
    post: Any
    info: AggregationInfo


def process(
    aggregator: Aggregator,
    pre: Sequence[PreAggregator] = (),
    post: optax.GradientTransformation | None = None,
) -> Aggregator:
    """A pipeline ``pre -> aggregator -> post`` as one :class:`Aggregator`.

    The pre-aggregators stay lazy (a linear view of the input, see
    :mod:`consensus.aggregators.view`): the pipeline reads the parameters once
    per Gram or weighted-sum pass and never writes an intermediate stack. A
    rule that cannot read views (``spec.reads_views`` false, or no spec) gets the
    view materialized once. The centre of the view is ``params``; without params
    it is what the pre-aggregators declare (``spec.centre``): 0 when one of them
    centres on zero (clipping is then around 0), none when every one needs no
    centre (nearest-neighbour mixing averages nodes, so its rows need no centre;
    distances come from a Gram matrix centred on the nodes' mean) and the
    coordinate-wise median otherwise.
    ``state.info.weights`` is pulled back through the pre-aggregators, so it is
    each *original* node's weight in the merged tree. With ``post`` the update
    needs ``params``.

    Args:
      aggregator: The rule (n -> 1).
      pre: Pre-aggregators (n -> n) applied first, in order.
      post: A server optimizer (an optax transform) applied to the pseudo-gradient
        ``params - merged``, or None for the merged tree itself.

    Returns:
      An :class:`~consensus.base.Aggregator` with a :class:`ProcessState`. Its DP sensitivity
      is the rule's when there is neither ``pre`` nor ``post``, else None (not worked out).

    Raises:
      TypeError: If ``pre`` holds something other than PreAggregators, or ``aggregator`` is
        not an Aggregator.
      ValueError: From ``update``, when ``post`` is given and ``params`` is None.

    References:
      Reddi, Charles, Zaheer, Garrett, Rush, Konečný, Kumar and McMahan 2021, ICLR,
      "Adaptive Federated Optimization" (the server optimizer).
    """
    pre = tuple(pre)
    for p in pre:
        if not isinstance(p, PreAggregator):
            raise TypeError(f"process: pre must hold PreAggregators, got {type(p).__name__}")
    if not isinstance(aggregator, Aggregator):
        raise TypeError(f"process: aggregator must be an Aggregator, got {type(aggregator).__name__}")
    name = "+".join([p.name for p in pre] + [aggregator.name] + (["server_opt"] if post else []))

    def init(params):
        return ProcessState(
            tuple(p.init(params) for p in pre),
            aggregator.init(params),
            None if post is None else post.init(params),
            empty_info(),
        )

    def update(stacked, state, params=None, *, mask=None, **extra):
        check_stacked(stacked, params)
        if post is not None and params is None:
            raise ValueError(f"{name}: a server optimizer (post) needs the current params")
        x = stacked
        if pre and not (params is None and all(view_centre(p) == "none" for p in pre)):
            if params is not None:
                centre = params
            elif any(view_centre(p) == "zero" for p in pre):
                centre = None
            else:
                centre = robust_centre(stacked)
            x = views.identity(stacked, centre)
        # Without params, mixing alone needs no centre: nnm takes the stack itself and hands on a
        # floating view (Gram matrix centred on the nodes' mean, formed in its one Gram pass).
        pre_states = []
        for p, s in zip(pre, state.pre, strict=True):
            if views.is_dropped(x):  # DARE's lazy rows feed only a rule that reads them
                x = views.materialize(x)
            x, s = p.update(x, s, params, mask=mask, lazy=True, **extra)
            pre_states.append(s)
        if views.is_view(x) and not reads_views(aggregator):
            x = views.materialize(x)
        if views.is_dropped(x) and not reads_dropped(aggregator):
            x = views.materialize(x)
        merged, agg_state = aggregator.update(x, state.aggregator, params, mask=mask, **extra)
        info = agg_state.info
        weights = info.weights
        for s in reversed(pre_states):
            weights = pull_back_weights(s, weights)
        info = info._replace(weights=weights)
        post_state = state.post
        if post is not None:
            pseudo_grad = jax.tree.map(lambda p_, m_: p_ - m_, params, merged)
            updates, post_state = post.update(pseudo_grad, post_state, params)
            merged = optax.apply_updates(params, updates)
        return merged, ProcessState(tuple(pre_states), agg_state, post_state, info)

    return Aggregator(init, update, name, aggregator.sensitivity if not pre and post is None else None)


def chain(*stages: PreAggregator | Aggregator) -> Aggregator:
    """Chain pre-aggregators and a rule: ``process(aggregator, pre=(pre_1, ..., pre_k))``.

    Args:
      *stages: ``pre_1, ..., pre_k, aggregator``: pre-aggregators first, the rule last.

    Returns:
      The pipeline, as :func:`process` builds it.

    Raises:
      TypeError: If the last stage is not an Aggregator or an earlier one is not a
        PreAggregator.

    Example:
      >>> import consensus
      >>> agg = consensus.chain(consensus.nnm(1), consensus.krum(1))
      >>> agg.name
      'nnm+krum'
    """
    if not stages or not isinstance(stages[-1], Aggregator):
        raise TypeError("chain: the last stage must be an Aggregator (pre-aggregators come first)")
    # process checks that each earlier stage is a PreAggregator (TypeError otherwise).
    return process(stages[-1], pre=cast("tuple[PreAggregator, ...]", stages[:-1]))
