"""Hierarchical training: ordered levels of data, from general to specialized to own.

A node trains through levels in order, each with its own data selection,
number of steps and learning rate. The default recipe for every task:

1. ``"general"``: the shared general pool (digits: every class; text: every module);
2. ``"groups"``: the general rows of the node's own groups (digits: its dominant
   classes; text: its module family);
3. ``"own"``: the node's own shard (fine-tuning).

Different nodes may sit on different schedules: steps are per node (0 skips a
level), or each node gets its own ordered list of ``(level, steps)``. All
nodes still train in one jitted step: :func:`plan` turns the schedules into an
``(n, T)`` table of which level each node draws from at each step (nodes that
finish early sit idle, :class:`~strategies.trainer.Schedule`), and a
``(n, L)`` table of learning rates. The optimizer state carries over from one
level to the next.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from strategies.tasks.base import NodeData, TaskData
from strategies.trainer import FitLog, NodeTrainer, Schedule, TrainState

Selector = str | Callable[[TaskData], NodeData]

SELECTORS: dict[str, Callable[[TaskData], NodeData]] = {
    "general": TaskData.everything,
    "groups": TaskData.in_groups,
    "own": TaskData.own,
    "own_groups": TaskData.own_in_groups,
}


@dataclasses.dataclass(frozen=True)
class Level:
    """One level of a hierarchical schedule.

    Args:
      data: ``"general"``, ``"groups"``, ``"own"``, ``"own_groups"`` (see
        :class:`~strategies.tasks.base.TaskData`), or a function
        ``TaskData -> NodeData``.
      steps: steps at this level, one int for every node or (n,) ints
        (0: the node skips the level).
      learning_rate: a float or (n,) floats.
      name: label (defaults to the data selector's name).

    Raises:
      ValueError: for an unknown selector name, negative or non-integer steps, or a negative
        learning rate.
    """

    data: Selector
    steps: int | Sequence[int] | np.ndarray
    learning_rate: float | Sequence[float] | np.ndarray
    name: str = ""

    def __post_init__(self):
        if isinstance(self.data, str) and self.data not in SELECTORS:
            raise ValueError(f"unknown data selector {self.data!r}; valid: {sorted(SELECTORS)} or a function")
        steps = np.asarray(self.steps)
        if not np.issubdtype(steps.dtype, np.integer) or np.any(steps < 0):
            raise ValueError(f"Level steps must be non-negative ints, got {self.steps!r}")
        if np.any(np.asarray(self.learning_rate, np.float64) < 0):
            raise ValueError(f"Level learning_rate must be >= 0, got {self.learning_rate!r}")

    def select(self, data: TaskData) -> NodeData:
        """The NodeData this level draws from.

        Args:
          data: the task data.

        Returns:
          The selected NodeData.
        """
        return SELECTORS[self.data](data) if isinstance(self.data, str) else self.data(data)

    @property
    def label(self) -> str:
        """The level's name: ``name``, else the selector's name."""
        return self.name or (
            self.data if isinstance(self.data, str) else getattr(self.data, "__name__", "level")
        )


def default_levels(
    steps: tuple[int, int, int] = (200, 100, 100),
    learning_rates: tuple[float, float, float] = (3e-3, 1e-3, 5e-4),
) -> tuple[Level, ...]:
    """General -> the node's groups -> its own shard, with decreasing learning rates.

    Args:
      steps: the steps of the three levels.
      learning_rates: their learning rates.

    Returns:
      The three levels.
    """
    return tuple(
        Level(d, s, lr) for d, s, lr in zip(("general", "groups", "own"), steps, learning_rates, strict=True)
    )


@dataclasses.dataclass(frozen=True)
class Plan:
    """Everything :meth:`NodeTrainer.fit` needs to run a hierarchical schedule.

    Attributes:
      data: the L NodeData, one per level.
      schedule: (n, T) level index and activity per node and step.
      hyperparams: ``{"learning_rate": (n, L)}``.
      steps: T, the longest node's total steps.
      labels: the level names.
    """

    data: tuple[NodeData, ...]
    schedule: Schedule
    hyperparams: Mapping[str, np.ndarray]
    steps: int
    labels: tuple[str, ...]


def _per_node(value: Any, n: int, what: str, dtype: Any) -> np.ndarray:
    v = np.asarray(value, dtype)
    if v.ndim == 0:
        return np.full((n,), v, dtype)
    if v.shape != (n,):
        raise ValueError(f"{what}: need one value or {n} (one per node), got shape {v.shape}")
    return v


def plan(
    levels: Sequence[Level],
    data: TaskData,
    *,
    node_orders: Sequence[Sequence[tuple[int, int]]] | None = None,
) -> Plan:
    """Build the per-node step table of a hierarchical schedule.

    Args:
      levels: the L levels, in their default order.
      data: the task data (this process's hosted nodes; ``data.num_nodes``
        is the global node count that schedules are given for).
      node_orders: optional per-node schedules: for node i, an ordered list of
        ``(level index, steps)`` pairs, overriding the levels' own ``steps``
        (a level may appear in any order, more than once, or not at all).

    Returns:
      A :class:`Plan`; node i's schedule is its levels in order, then idle.

    Raises:
      ValueError: for no level, per-node values or orders of the wrong length, a bad
        ``(level, steps)`` pair, or a schedule without steps.
    """
    if not levels:
        raise ValueError("plan needs at least one level")
    n, num_levels = data.num_nodes, len(levels)
    if node_orders is None:
        steps = np.stack([_per_node(lv.steps, n, f"level {lv.label} steps", np.int64) for lv in levels], 1)
        node_orders = [[(j, int(steps[i, j])) for j in range(num_levels)] for i in range(n)]
    if len(node_orders) != n:
        raise ValueError(f"node_orders has {len(node_orders)} entries, there are {n} nodes")
    for i, order in enumerate(node_orders):
        for j, s in order:
            if not 0 <= j < num_levels or s < 0:
                raise ValueError(f"node {i}: bad (level, steps) pair ({j}, {s}) for {num_levels} levels")
    totals = [sum(s for _, s in order) for order in node_orders]
    total = max(totals)
    if total < 1:
        raise ValueError("the schedule has no steps")
    level = np.zeros((n, total), np.int32)
    active = np.zeros((n, total), bool)
    for i, order in enumerate(node_orders):
        t = 0
        for j, s in order:
            level[i, t : t + s] = j
            t += s
        active[i, :t] = True
        # Idle steps keep the last level (their batches are drawn but never used).
        if 0 < t < total:
            level[i, t:] = level[i, t - 1]
    lr = np.stack(
        [_per_node(lv.learning_rate, n, f"level {lv.label} learning_rate", np.float32) for lv in levels], 1
    )
    return Plan(
        data=tuple(lv.select(data) for lv in levels),
        schedule=Schedule(level, active),
        hyperparams={"learning_rate": lr},
        steps=total,
        labels=tuple(lv.label for lv in levels),
    )


def fit_hierarchical(
    trainer: NodeTrainer,
    state: TrainState,
    data: TaskData,
    levels: Sequence[Level],
    *,
    node_orders: Sequence[Sequence[tuple[int, int]]] | None = None,
    **fit_kwargs: Any,
) -> tuple[TrainState, FitLog, Plan]:
    """Train every node through its levels in one jitted call.

    Args:
      trainer: the NodeTrainer (its optimizer must take ``learning_rate``).
      state: stacked TrainState.
      data: the task data.
      levels: the levels (see :func:`plan`).
      node_orders: optional per-node schedules (see :func:`plan`).
      **fit_kwargs: passed to :meth:`NodeTrainer.fit` (``flip_labels``,
        ``proximal``, ``record``, extra ``hyperparams``).

    Returns:
      ``(state, log, plan)``; ``log.level`` (T, n) says which level each node
      used at each step.

    Raises:
      ValueError: as :func:`plan`.

    Example (with a trainer, state and data as in :class:`~strategies.trainer.NodeTrainer`'s)::

        state, log, p = fit_hierarchical(trainer, state, data, default_levels((100, 50, 50)))
    """
    p = plan(levels, data, node_orders=node_orders)
    extra = dict(fit_kwargs.pop("hyperparams", None) or {})
    hyper = {**extra, **p.hyperparams}
    state, log = trainer.fit(state, p.data, p.steps, schedule=p.schedule, hyperparams=hyper, **fit_kwargs)
    return state, log, p
