"""Types shared by every aggregation rule: optax-shaped (init, update) pairs.

An *aggregator* maps a stacked tree (leading node axis of size n) to one tree. A
*pre-aggregator* maps a stacked tree to another stacked tree of the same shape
(n -> n, ByzFL's vocabulary). Both are pairs of pure functions in the shape of
``optax.GradientTransformationExtraArgs``::

    state = agg.init(params)
    merged, state = agg.update(stacked, state, params=None, mask=None)

``params`` is the current global (consensus) tree. Rules that work with
distances centre the node vectors on it before forming Gram statistics, which
keeps them accurate when the nodes are close together (fine-tunes of one
init). ``mask`` is an optional boolean (n,) vector of nodes allowed to take
part (for example the output of a quorum or quality gate); nodes whose leaves
hold NaN or Inf are always excluded on top of it.

Every rule reports the same diagnostics in ``state.info`` (an
:class:`AggregationInfo`): which nodes were valid, which were selected, and
each node's weight in the merged result.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, NamedTuple, Protocol

import jax

if TYPE_CHECKING:
    from consensus.specs import Spec

PyTree = Any
Array = jax.Array


class AggregationInfo(NamedTuple):
    """Diagnostics of one aggregation, the same fields for every rule.

    Attributes:
      valid: (n,) bool. Nodes that took part: allowed by ``mask`` and finite.
      selected: (n,) bool. Nodes the rule kept (Krum's winner, Multi-Krum's and
        Bulyan's selection; every valid node for rules that keep all).
      weights: (n,) float32, summing to 1 over valid nodes. For rules whose
        output is a weighted mean of the nodes (mean, Krum family, geometric
        median, centered clipping, convex weights) this is that weight exactly.
        Coordinate-wise rules (median, trimmed mean, Bulyan's second stage) use
        different nodes at different coordinates; for them it is the uniform
        share over the nodes whose values were eligible (``selected``), and
        ``linear`` is False.
      linear: bool, static. Whether ``merged == sum_i weights[i] * x_i`` holds.
    """

    valid: Array
    selected: Array
    weights: Array
    linear: bool = True


def empty_info() -> AggregationInfo:
    """Return the placeholder info of ``init``, where the node count is not known yet.

    Returns:
      An :class:`AggregationInfo` whose ``valid``, ``selected`` and ``weights`` have length 0.
    """
    import jax.numpy as jnp

    return AggregationInfo(
        valid=jnp.zeros((0,), bool), selected=jnp.zeros((0,), bool), weights=jnp.zeros((0,), jnp.float32)
    )


class InitFn(Protocol):
    """The ``init`` half of an aggregator: ``init(params) -> state``."""

    def __call__(self, params: PyTree) -> Any:
        """Return the initial state for the global tree ``params``."""
        ...


class UpdateFn(Protocol):
    """The ``update`` half: ``update(stacked, state, params=None, *, mask=None, **extra) -> (out, state)``.

    ``stacked`` has a leading node axis; ``params`` is the current global tree (rules that
    work with distances centre on it); ``mask`` is an optional (n,) bool vector of the nodes
    allowed to take part. An aggregator returns one tree, a pre-aggregator a stacked tree.
    """

    def __call__(
        self,
        stacked: PyTree,
        state: Any,
        params: PyTree | None = None,
        *,
        mask: Array | None = None,
        **extra: Any,
    ) -> tuple[PyTree, Any]:
        """Combine ``stacked`` and return ``(output, new_state)``."""
        ...


class Aggregator(NamedTuple):
    """A robust (or plain) aggregation rule: n stacked trees -> one tree.

    Attributes:
      init: ``init(params) -> state``.
      update: ``update(stacked, state, params=None, *, mask=None, **extra) -> (merged, state)``.
      name: Short name used in diagnostics and error messages.
      sensitivity: For differential privacy. ``sensitivity(clip_norm, num_nodes)``
        returns the L2 sensitivity of the merged *update* to adding or removing one
        node whose update is clipped to ``clip_norm``, or None when this package has
        not worked out a bound for the rule (DP then refuses the rule).
      spec: The declaration of the rule that built it (:class:`consensus.specs.Spec`:
        capabilities such as reading lazy views), set by the declared factory; None for an
        aggregator assembled by hand or by a pipeline.
    """

    init: InitFn
    update: UpdateFn
    name: str = "aggregator"
    sensitivity: Callable[[float, float], float] | None = None
    spec: Spec | None = None


class PreAggregator(NamedTuple):
    """A node-to-node transform (n -> n): clipping, nearest-neighbour mixing, ...

    Attributes:
      init: ``init(params) -> state``.
      update: ``update(stacked, state, params=None, *, mask=None, **extra) -> (stacked, state)``;
        the output keeps the leading node axis.
      name: Short name used in diagnostics and error messages.
      spec: Its declaration (see :class:`Aggregator`), None when assembled by hand.
    """

    init: InitFn
    update: UpdateFn
    name: str = "pre_aggregator"
    spec: Spec | None = None


class ByzantineToleranceError(ValueError):
    """A rule's precondition on the number of nodes and Byzantine nodes does not hold."""


def require(rule: str, n: int, f: int, ok: bool, needed: str) -> None:
    """Raise a ByzantineToleranceError naming the rule, n, f and what is needed.

    Args:
      rule: The rule's name, the start of the message.
      n: The number of valid nodes.
      f: The number of Byzantine nodes to tolerate.
      ok: Whether the precondition holds; nothing happens when True.
      needed: The requirement in words, e.g. ``"n > 2f + 2 = 6"``.

    Raises:
      ByzantineToleranceError: When ``ok`` is False, with the message
        ``"{rule}: cannot tolerate f={f} Byzantine nodes with n={n} valid nodes; needs {needed}."``
    """
    if not ok:
        raise ByzantineToleranceError(
            f"{rule}: cannot tolerate f={f} Byzantine nodes with n={n} valid nodes; needs {needed}."
        )


def get_info(state: Any) -> AggregationInfo:
    """Return the :class:`AggregationInfo` of an aggregator state (chains included).

    Args:
      state: The state returned by an aggregator's ``update`` (or a chain's).

    Returns:
      Its ``info`` field.

    Raises:
      TypeError: When the state carries no :class:`AggregationInfo`.
    """
    info = getattr(state, "info", None)
    if isinstance(info, AggregationInfo):
        return info
    raise TypeError(f"state of type {type(state).__name__} carries no AggregationInfo")
