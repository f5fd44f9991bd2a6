"""Grouped vote: a rule inside each block of nodes, then a rule over the blocks' results."""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from consensus import tree
from consensus.base import AggregationInfo, Aggregator, empty_info, get_info


class GroupedVoteState(NamedTuple):
    """State of :func:`grouped_vote`.

    Attributes:
      groups: Each group's rule state, in block order.
      top: The top rule's state.
      info: The node-level :class:`~consensus.base.AggregationInfo`.
    """

    groups: tuple
    top: Any
    info: AggregationInfo


def grouped_vote(inner: Aggregator, top: Aggregator, groups: int) -> Aggregator:
    """Vote in each of ``groups`` contiguous node blocks with ``inner``, then over the results with ``top``.

    The n nodes are split into ``groups`` blocks of n / groups contiguous nodes
    (for example the nodes of one host or one organization); ``inner`` runs on each
    block with the block's mask, and ``top`` runs on the ``groups`` block results,
    where a block whose vote accepted no node is masked out. A node is accepted when
    its block's vote accepted it and the top vote accepted its block; its weight is
    the product of the two (exact for linear rules). The f of each rule is its own:
    ``inner``'s counts Byzantine nodes per block, ``top``'s counts wholly Byzantine
    blocks.

    Args:
      inner: The rule inside each block.
      top: The rule over the block results.
      groups: The number of blocks; must divide n.

    Returns:
      An :class:`~consensus.base.Aggregator` with a :class:`GroupedVoteState`.

    Raises:
      ValueError: If ``groups`` is not a positive int; from ``update``, when it does not
        divide n.
    """
    if not isinstance(groups, int) or groups < 1:
        raise ValueError(f"grouped_vote: groups must be a positive int, got {groups!r}")

    def init(params):
        return GroupedVoteState(
            tuple(inner.init(params) for _ in range(groups)), top.init(params), empty_info()
        )

    def update(stacked, state, params=None, *, mask=None, **extra):
        n = tree.num_nodes(stacked)
        if n % groups:
            raise ValueError(f"grouped_vote: {groups} groups do not divide n = {n} nodes")
        size = n // groups
        mask = jnp.ones((n,), bool) if mask is None else jnp.asarray(mask, bool)
        results, states, infos = [], [], []
        for g in range(groups):
            rows = slice(g * size, (g + 1) * size)
            sub = jax.tree.map(lambda x, rows=rows: x[rows], stacked)
            merged, st = inner.update(sub, state.groups[g], params, mask=mask[rows], **extra)
            results.append(merged)
            states.append(st)
            infos.append(get_info(st))
        group_stack = tree.stack(results)
        group_ok = jnp.stack([jnp.any(i.selected) for i in infos])
        merged, top_state = top.update(group_stack, state.top, params, mask=group_ok, **extra)
        top_info = get_info(top_state)
        valid = jnp.concatenate([i.valid for i in infos])
        selected = jnp.concatenate([i.selected & top_info.selected[g] for g, i in enumerate(infos)])
        weights = jnp.concatenate([i.weights * top_info.weights[g] for g, i in enumerate(infos)])
        linear = bool(top_info.linear) and all(bool(i.linear) for i in infos)
        info = AggregationInfo(valid, selected, weights, linear)
        return merged, GroupedVoteState(tuple(states), top_state, info)

    return Aggregator(init, update, f"grouped({inner.name}->{top.name})", None)
