"""The public warm start: the initial consensus trained on the task's public pool before round 1.

The public (general) pool is data no node owns (digits' and Fashion-MNIST's public split, the
text tasks' general windows), so training the first consensus on it costs no node's privacy and
gives every node a common start. The ablations (results/ablations_digits.md) measure it against
the node strategies that draw the same pool themselves: every node training locally from this
warm start was the best strategy mix there, above hierarchical curricula on the same data.

One model, Adam at the nodes' batch size and learning rate, from the run's params key: every
process (and a resumed run) computes the same start, and nothing is cached outside the run.
"""

from __future__ import annotations

import logging
from typing import Any

import jax

from meta_consensus.config import ConfigError

PyTree = Any


def public_warm_start(
    task: Any,
    data: Any,
    params: PyTree,
    key: jax.Array,
    *,
    steps: int,
    learning_rate: float,
    batch_size: int,
    optimizer: str = "adam",
    setting: str = "nodes.public_warm_start",
) -> PyTree:
    """``params`` after ``steps`` optimizer steps on the task's general pool (itself when 0).

    Args:
      task: the task (a LoRA run passes its base task: the whole model trains).
      data: the task's data (any process's: every one holds the general pool).
      params: the starting params (the task's init, ``init_from`` or the caller's).
      key: the run's params key (the trainer's key is derived from it).
      steps: optimizer steps (0: ``params`` unchanged).
      learning_rate: the optimizer's learning rate.
      batch_size: rows per step.
      optimizer: ``"adam"`` or ``"sgd"``.
      setting: the config key that asked for it (named in the error).

    Returns:
      The trained params (one tree, not stacked); ``params`` itself, with a logged note, for a
      task that starts from a pretrained model: its checkpoint is a given start, used as is.

    Raises:
      ConfigError: when the task's general pool is empty.
    """
    from meta_consensus.fleet import _trainer  # the fleet's cache: one compile per settings
    from strategies.tasks.base import NodeData

    if steps <= 0:
        return params
    if getattr(task, "pretrained", False):
        logging.getLogger(__name__).warning(
            "meta-consensus: note: task %r starts from a pretrained model; %s = %d is not applied",
            getattr(task, "name", "task"), setting, steps,
        )  # fmt: skip
        return params
    general = data.everything()
    if int(general.count[0]) < 1 or len(data.general_groups) == 0:
        raise ConfigError(f"{setting} needs the task's general (public) pool; it is empty")
    one = NodeData(general.pool, general.index[:1], general.count[:1], True, "general")
    trainer = _trainer(task, float(learning_rate), int(batch_size), None, optimizer)
    state = trainer.init(jax.random.fold_in(key, 0xBA5E), params, 1)
    state, _ = trainer.fit(state, one, int(steps))
    return jax.tree.map(lambda x: x[0], state.params)
