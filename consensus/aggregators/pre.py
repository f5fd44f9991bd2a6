"""Pre-aggregators: node-to-node transforms (n -> n) applied before a rule.

Both are linear maps of the nodes around a centre c, ``y_i = c + sum_j A[i, j]
(x_j - c)``: clipping scales each node's delta (A diagonal), nearest-neighbour
mixing averages neighbours (A dense). Inside :func:`consensus.process` they
stay lazy (a :class:`~consensus.aggregators.view.NodeView`), so the pipeline
never writes an intermediate copy of the stack; called on their own they
return an ordinary stacked tree. Their state records A, so a pipeline can
report the final weight of every *original* node.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp

from consensus import tree
from consensus.aggregators import view as views
from consensus.aggregators._common import (
    allowed,
    check_count,
    check_f,
    check_stacked,
    gram_stats,
    static_count,
)
from consensus.base import PreAggregator
from consensus.specs import RULES, Precondition, at_least, honest_majority
from kernels import weiszfeld


class ClipState(NamedTuple):
    """The state of a norm-scaling pre-aggregator (:func:`clip`, ARC).

    Attributes:
      scale: (n,) factor applied to each node's delta (0 for invalid nodes).
    """

    scale: jax.Array


class MixState(NamedTuple):
    """The state of :func:`nnm`.

    Attributes:
      mixing: (n, n) matrix; row i holds the weights of the nodes averaged into node i.
    """

    mixing: jax.Array


def _finish(view: views.NodeView, lazy: bool):
    return view if lazy else views.materialize(view)


def norm_scaling_update(
    name: str,
    scales_of: Callable[[jax.Array, jax.Array], jax.Array],
    precondition: Precondition | None = None,
    f: int = 0,
):
    """Build the update of a pre-aggregator that scales each node's delta by a function of its norm.

    ``scales_of(sq_norms, valid) -> (n,) scale`` (0 at invalid nodes); clipping and ARC differ
    only there. The squared norms come from the view's Gram matrix when a stage before formed
    one, else from one norm pass; the output is a lazy view (``lazy``) or its rows. With a
    ``precondition`` it is checked on n and on the valid count (:func:`check_count`).

    Args:
      name: The pre-aggregator's name, for error messages.
      scales_of: ``scales_of(sq_norms, valid) -> (n,) scale``.
      precondition: Optional precondition on (n, f), checked before and after validity.
      f: The number of Byzantine nodes the precondition is checked with.

    Returns:
      ``update(stacked, state, params=None, *, mask=None, lazy=False, **extra) ->
      (rows or view, ClipState)``.
    """

    def update(stacked, state, params=None, *, mask=None, lazy=False, **extra):
        del state, extra
        n = check_stacked(stacked, params)
        if precondition is not None:
            check_count(name, precondition, f, n)
        v = views.with_norms(stacked) if views.is_view(stacked) else views.identity(stacked, params)
        if v.gram is not None:
            sq, valid = jnp.diagonal(v.gram), v.valid
        elif v.mixing is None:
            sq = tree.sq_norms(v.base, v.centre)
            valid = jnp.isfinite(sq) if v.valid is None else jnp.isfinite(sq) & v.valid
        else:
            stats = gram_stats(v, params, None)
            sq, valid = jnp.diagonal(stats.gram), stats.valid
        valid = valid & allowed(mask, n)
        if precondition is not None:
            check_count(name, precondition, f, static_count(valid))
        scale = scales_of(sq, valid)
        gram = None if v.gram is None else v.gram * scale[:, None] * scale[None, :]
        out = views.compose(v, jnp.diag(scale), diagonal=True, gram=gram, valid=valid)
        return _finish(out, lazy), ClipState(scale)

    return update


@RULES.declare(
    kind="pre",
    precondition=at_least(1),
    defaults={"max_norm": 10.0},
    sensitivity="C (each node's delta clipped to max_norm = C)",
    centre="zero",
)
def clip(max_norm: float) -> PreAggregator:
    r"""Per-node L2 clipping of the node's delta over the whole tree.

    .. math:: x_i' = c + (x_i - c) \min(1, C / \lVert x_i - c \rVert_2)

    with c = ``params`` (the current global params), or 0 when params is None.
    The norm is taken over every leaf together, not leaf by leaf. Non-finite or
    masked-out nodes come out as NaN ("no value"), so every rule downstream
    excludes them. Cost: one norm pass (none inside a pipeline that already has
    a Gram matrix). DP sensitivity: after clipping to C, each node's delta has norm <= C.

    Args:
      max_norm: C > 0, the largest L2 norm of a node's delta after clipping.

    Returns:
      A :class:`~consensus.base.PreAggregator` with a :class:`ClipState`.

    Raises:
      ValueError: If ``max_norm`` is not > 0.
    """
    if not max_norm > 0:
        raise ValueError(f"clip: max_norm must be > 0, got {max_norm}")

    def init(params):
        del params
        return ClipState(jnp.zeros((0,), jnp.float32))

    def clip_scales(sq: jax.Array, valid: jax.Array) -> jax.Array:
        return jnp.where(valid, weiszfeld.clip_factors(jnp.where(valid, sq, 0.0), float(max_norm)), 0.0)

    update = norm_scaling_update("clip", clip_scales)

    return PreAggregator(init, update, "clip")


@RULES.declare(kind="pre", takes_f=True, precondition=honest_majority, centre="none")
def nnm(num_byzantine: int) -> PreAggregator:
    """Nearest-neighbour mixing (Allouah et al. 2023, AISTATS, "Fixing by Mixing").

    Every valid node is replaced by the mean of the m - f valid nodes nearest
    to it (itself included; ties to the lower index), distances from a Gram
    matrix centred on ``params``, or without params on the nodes' mean formed
    inside the same pass (``_common.gram_stats``): the mixed rows
    ``y_i = sum_j M_ij x_j`` need no centre (every valid row of M sums to 1)
    and distances do not depend on where the Gram matrix is centred, so no
    pass over the parameters goes to a centre. Invalid nodes come out as NaN
    so that any rule downstream excludes them. Precondition: m > 2f (the
    paper's setting f < m/2). One Gram pass; inside a pipeline the mixed Gram
    matrix M G M^T is handed on, so a vector-wise rule after NNM needs no
    second Gram pass.

    Args:
      num_byzantine: f; each node is replaced by the mean of its m - f nearest valid nodes.

    Returns:
      A :class:`~consensus.base.PreAggregator` with a :class:`MixState`.

    Raises:
      ValueError: If ``num_byzantine`` is not a non-negative int.
      ByzantineToleranceError: From ``update``, when m > 2f does not hold.

    References:
      Allouah, Farhadkhani, Guerraoui, Gupta, Pinot and Stephan 2023, AISTATS, "Fixing by
      Mixing: A Recipe for Optimal Byzantine ML under Heterogeneity".
    """
    f = check_f("nnm", num_byzantine)

    def init(params):
        del params
        return MixState(jnp.zeros((0, 0), jnp.float32))

    def update(stacked, state, params=None, *, mask=None, lazy=False, **extra):
        del state, extra
        n = check_stacked(stacked, params)
        check_count("nnm", honest_majority, f, n)
        if views.is_view(stacked):
            v, stats = stacked, gram_stats(stacked, params, mask)
        elif params is not None:
            v = views.identity(stacked, params)
            stats = gram_stats(v, params, mask)
        else:
            # Gram matrix centred on the nodes' mean (one pass, robust fallback on non-finite
            # nodes); the mixed rows are M x with no centre, so the view floats.
            stats = gram_stats(stacked, None, mask)
            v = views.identity(stacked, None)._replace(floating=True)
        check_count("nnm", honest_majority, f, static_count(stats.valid))
        mixing = weiszfeld.nnm_matrix(stats.sq_dists, f, stats.valid)
        out = views.compose(v, mixing, diagonal=False, gram=mixing @ stats.gram @ mixing.T, valid=stats.valid)
        return _finish(out, lazy), MixState(mixing)

    return PreAggregator(init, update, "nnm")


def pull_back_weights(pre_state, weights: jax.Array) -> jax.Array:
    """Turn weights on a pre-aggregator's outputs into weights on its inputs.

    Args:
      pre_state: The pre-aggregator's state (:class:`MixState`, :class:`ClipState`, or
        another state, which passes the weights through).
      weights: (n,) weights on the outputs.

    Returns:
      (n,) weights on the inputs: ``M^T w`` after mixing, ``w * scale`` after clipping.
    """
    if isinstance(pre_state, MixState):
        return pre_state.mixing.T @ weights
    if isinstance(pre_state, ClipState):
        return weights * pre_state.scale
    return weights
