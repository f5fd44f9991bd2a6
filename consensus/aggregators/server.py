"""Server-guided rules: the coordinator's own update on a small clean root set is the trusted reference.

Rules that see only the nodes' updates cannot tell honest disagreement from an
attack when the honest nodes are heterogeneous (Allouah et al. 2023, "Fixing
by Mixing"); a coordinator that holds a little data of its own is not bound the
same way. Both rules take that data as ``server_update``: the server's *delta*
``g = server_params - params``, a tree with the params' structure (for
example a few local SGD steps from the current consensus on a root set split
off the coordinator's held-out data). They assume the root set is clean and
roughly representative of the honest nodes' joint distribution.

Cost: one streamed pass for the nodes' Gram matrix together with their inner
products with g (:func:`kernels.robust.gram_with_rows`) and one weighted-sum pass.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from consensus import tree
from consensus.aggregators import view as views
from consensus.aggregators._common import (
    RuleState,
    allowed,
    check_count,
    check_f,
    check_stacked,
    init_rule_state,
    is_concrete,
    nan_if,
    require_params,
    static_count,
    too_few,
)
from consensus.base import AggregationInfo, Aggregator
from consensus.specs import RULES, at_least, need
from kernels import robust as robust_kernels

PyTree = Any


class ServerStats(NamedTuple):
    """What the server-guided rules read from their one pass (see :func:`server_stats`).

    Attributes:
      gram: (n, n) Gram matrix of the node deltas x_i - params, invalid rows/cols zeroed.
      cross: (n,) inner products <x_i - params, g>, 0 at invalid nodes.
      server_sq: The scalar ||g||^2.
      valid: (n,) bool, the valid nodes.
    """

    gram: jax.Array
    cross: jax.Array
    server_sq: jax.Array
    valid: jax.Array


def server_stats(stacked: PyTree, params: PyTree, server_update: PyTree, mask) -> ServerStats:
    """Compute, in one streamed pass, the deltas' Gram matrix and their inner products with g.

    Args:
      stacked: The stacked node trees.
      params: The current global tree (deltas are taken from it).
      server_update: The server's delta g, a tree like ``params``.
      mask: Optional (n,) bool vector of the nodes allowed to take part.

    Returns:
      The :class:`ServerStats`.

    Raises:
      ValueError: If ``server_update`` does not have the params' structure, shapes and dtypes.
    """
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
    assert total is not None, "a tree without leaves has no Gram matrix"
    g_nodes, cross, server_sq = total[:n, :n], total[:n, n], total[n, n]
    valid = allowed(mask, n) & jnp.isfinite(jnp.diagonal(g_nodes)) & jnp.isfinite(cross)
    both = valid[:, None] & valid[None, :]
    return ServerStats(jnp.where(both, g_nodes, 0.0), jnp.where(valid, cross, 0.0), server_sq, valid)


def check_server_finite(rule: str, server_sq: jax.Array) -> jax.Array | None:
    """Raise (eagerly) when the server's update is not finite; under jit return the NaN flag.

    Args:
      rule: The rule's name, for the message.
      server_sq: ||g||^2.

    Returns:
      None eagerly; under jit a traced bool that is True when g is not finite.

    Raises:
      ValueError: Eagerly, when g holds NaN or Inf.
    """
    if is_concrete(server_sq):
        if not np.isfinite(float(server_sq)):
            raise ValueError(f"{rule}: the server_update holds NaN or Inf")
        return None
    return ~jnp.isfinite(server_sq)


def _require_server(rule: str, server_update):
    if server_update is None:
        raise ValueError(
            f"{rule}: needs the server's update as update(..., server_update=g), a tree like params "
            "holding the coordinator's delta (server params - params) on its root set"
        )
    return server_update


def fltrust_weights(gram, cross, server_sq, valid):
    """Compute FLTrust's coefficients a (x = params + sum_i a_i d_i) and trust scores.

    Args:
      gram: (n, n) Gram matrix of the node deltas.
      cross: (n,) inner products of the deltas with g.
      server_sq: ||g||^2.
      valid: (n,) bool, the valid nodes.

    Returns:
      ``(a, trust)``: (n,) coefficients and (n,) trust scores TS_i = ReLU(cos(d_i, g)).
    """
    norms = jnp.sqrt(jnp.maximum(jnp.diagonal(gram), 0.0))
    server_norm = jnp.sqrt(jnp.maximum(server_sq, 0.0))
    positive = valid & (norms > 0)
    safe = jnp.where(positive, norms, 1.0)
    cos = cross / (safe * jnp.maximum(server_norm, 1e-30))
    trust = jnp.where(positive, jnp.maximum(cos, 0.0), 0.0)
    total = jnp.sum(trust)
    a = jnp.where(total > 0, trust * (server_norm / safe) / jnp.where(total > 0, total, 1.0), 0.0)
    return a, trust


@RULES.declare(
    kind="vector",
    precondition=at_least(1),
    sensitivity="2 ||g|| (the output update lies in the ball of the server update's norm)",
    needs=("params", "server_update"),
)
def fltrust() -> Aggregator:
    r"""FLTrust (Cao et al. 2021): node updates rescaled to the server's norm, weighed by their cosine.

    With node deltas d_i = x_i - params and the server's delta g (``server_update``):

    .. math::
        TS_i = \mathrm{ReLU}(\cos(d_i, g)), \qquad
        x = \mathrm{params} + \frac{1}{\sum_j TS_j}
            \sum_i TS_i \frac{\lVert g \rVert}{\lVert d_i \rVert} d_i

    Every node's update is rescaled to the server's norm and weighed by its
    non-negative cosine to the server's direction. When no valid node has a
    positive cosine (or a zero update), the output is ``params`` (no step).
    ``info.weights`` are the coefficients a_i = TS_i ||g|| / (||d_i|| sum TS)
    (they do not sum to 1), ``info.selected`` the nodes with TS_i > 0. The rule
    takes no f: its robustness comes from the server's data, not a majority.
    Needs ``params`` and ``server_update``. Precondition: m >= 1.
    DP sensitivity: 2 ||g|| (the output update is a convex combination of
    vectors of norm ||g||, so it lies in the ||g||-ball whatever the nodes send).

    Returns:
      An :class:`~consensus.base.Aggregator` whose ``update`` needs ``params`` and
      ``server_update=``.

    Raises:
      ValueError: From ``update``, when ``params`` or ``server_update`` is missing, the server
        update does not match the params or is not finite.
      ByzantineToleranceError: From ``update``, when no node is valid.

    References:
      Cao, Fang, Liu and Gong 2021, NDSS, "FLTrust: Byzantine-robust Federated Learning via
      Trust Bootstrapping".
    """

    def update(stacked, state, params=None, *, mask=None, server_update=None, **extra):
        del state, extra
        params = require_params("fltrust", params)
        server_update = _require_server("fltrust", server_update)
        check_stacked(stacked, params)
        stats = server_stats(stacked, params, server_update, mask)
        bad = check_server_finite("fltrust", stats.server_sq)
        check_count("fltrust", at_least(1), 0, static_count(stats.valid))
        a, trust = fltrust_weights(stats.gram, stats.cross, stats.server_sq, stats.valid)
        merged = views.combine(stacked, a, params)
        info = AggregationInfo(stats.valid, trust > 0, a, True)
        return nan_if(bad, merged), RuleState(info)

    return Aggregator(init_rule_state, update, "fltrust")


def server_monna_precondition(n: int, f: int) -> str | None:
    """Check server MoNNA's precondition: at least one node to average, n > f.

    Args:
      n: The number of valid nodes.
      f: The number of Byzantine nodes.

    Returns:
      None when it holds, else the requirement in words.
    """
    return need(n > f, f"n > f = {f}")


@RULES.declare(
    kind="vector",
    takes_f=True,
    precondition=server_monna_precondition,
    sensitivity="C / (n - f) once the selection is fixed; 2C in general (output in the C-ball)",
    needs=("params", "server_update"),
)
def server_monna(num_byzantine: int) -> Aggregator:
    """MoNNA with the server's update as the trusted reference (after Farhadkhani et al. 2023).

    MoNNA has each honest node average its m - f nearest neighbours. Here the
    coordinator plays that honest node with its own update g on its root set:
    the output is params plus the mean of the m - f valid node deltas nearest
    to g (squared distances ||d_i - g||^2 = G_ii - 2 <d_i, g> + ||g||^2; ties to
    the lower index). g itself is not averaged in. At most f of the averaged
    nodes are Byzantine, and each is no farther from g than the farthest
    honest node kept. Needs ``params`` and ``server_update``.
    Precondition: m > f (at least one node to average; ValueError otherwise,
    NaN under an outer jit). DP sensitivity: as the uniform mean of m - f
    nodes once the selection is fixed, C / (m - f) for deltas clipped to C.

    Args:
      num_byzantine: f; the m - f valid deltas nearest to g are averaged.

    Returns:
      An :class:`~consensus.base.Aggregator` whose ``update`` needs ``params`` and
      ``server_update=``.

    Raises:
      ValueError: If ``num_byzantine`` is not a non-negative int; from ``update``, when
        ``params`` or ``server_update`` is missing or the server update is not finite.
      ByzantineToleranceError: From ``update``, when m > f does not hold.

    References:
      Farhadkhani, Guerraoui, Gupta, Hoang, Pinot and Stephan 2023, ICML, "Robust Collaborative
      Learning with Linear Gradient Overhead".
    """
    f = check_f("server_monna", num_byzantine)

    def update(stacked, state, params=None, *, mask=None, server_update=None, **extra):
        del state, extra
        params = require_params("server_monna", params)
        server_update = _require_server("server_monna", server_update)
        n = check_stacked(stacked, params)
        check_count("server_monna", server_monna_precondition, f, n)
        stats = server_stats(stacked, params, server_update, mask)
        bad = check_server_finite("server_monna", stats.server_sq)
        m = static_count(stats.valid)
        check_count("server_monna", server_monna_precondition, f, m)
        d2 = jnp.diagonal(stats.gram) - 2.0 * stats.cross + stats.server_sq
        order = jnp.argsort(jnp.where(stats.valid, d2, jnp.inf), stable=True)
        rank = jnp.argsort(order, stable=True)
        k = jnp.sum(stats.valid.astype(jnp.int32)) - f
        chosen = stats.valid & (rank < k)
        w = chosen.astype(jnp.float32) / jnp.maximum(k, 1).astype(jnp.float32)
        merged = views.combine(stacked, w, params)
        if m is None:
            short = too_few(server_monna_precondition, f, stats.valid)
            bad = short if bad is None else bad | short
        return nan_if(bad, merged), RuleState(AggregationInfo(stats.valid, chosen, w, True))

    return Aggregator(init_rule_state, update, "server_monna")
