"""The coordinator's own update, for the server-guided rules (FLTrust, server MoNNA).

FLTrust (Cao et al. 2021, NDSS) and the server-reference variant of MoNNA trust the
coordinator's own update ``g`` on a small, clean *root set* (``update(...,
server_update=g)``, see :mod:`consensus.aggregators.server`). The system builds it so:

* **The root set** is ``vote.root_size`` rows (or that share of the held-out rows,
  :func:`root_rows`) split off the task's held-out split by a
  permutation drawn from the run's seed (:func:`split_root`). Held-out data is never a
  node's training data (each node trains on its own shard, and the hierarchical
  strategy on the shared general pool), so the root set is never node data.
* **It is removed from the held-out split the rest of the run sees**: the quality
  gate, the convex weights, the soups' greedy selection and the held-out accuracy
  all use the remaining rows. The server update is fitted on the root set; scoring
  candidates on the same rows would reward nodes for agreeing with the server on
  data it trained on, and the held-out accuracy of the consensus would no longer be
  held-out.
* **The update**: every round the coordinator starts from the current consensus and
  takes ``vote.server_steps`` (default: ``nodes.local_steps``) Adam steps of the
  task's loss on minibatches of ``nodes.batch_size`` root rows, at
  ``nodes.learning_rate``: a plain local node's budget and optimizer. The Adam state
  starts fresh every round (the coordinator keeps no optimizer state across rounds),
  and the minibatches come from the round key, so a resumed run computes the same
  update. ``g = params_after - consensus``.

What it assumes: the root set is clean and roughly representative of the task
(FLTrust's assumption); a skewed root set pulls every round towards its own classes.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import jax
import numpy as np
import optax

from consensus import registry
from meta_consensus.config import Config, ConfigError
from strategies.tasks.base import NodeData, Task
from strategies.trainer import NodeTrainer

PyTree = Any

SERVER_UPDATE = "server_update"
ROOT_STREAM = 0x5EED  # fold_in tag of the root split's key (a stream no other draw of the run uses)
SERVER_STREAM = 0x5E4  # fold_in tag of the server's minibatch key inside a round key


def vote_rules_of(cfg: Config) -> list[str]:
    """Every registered rule the config's vote runs (pre-aggregators, the rule, the top rule).

    Args:
      cfg: the run config.

    Returns:
      The rule names, in the order they run.
    """
    v = cfg.vote
    return [*v.pre, v.rule, *([v.top_rule] if v.groups > 1 else [])]


def vote_needs(cfg: Config) -> frozenset[str]:
    """What the config's vote rules need from the round besides the stack and params.

    Args:
      cfg: the run config.

    Returns:
      The union of the rules' ``needs``, ``"params"`` excluded.
    """
    out: set[str] = set()
    for name in vote_rules_of(cfg):
        out |= registry.RULES[name].needs
    return frozenset(out - {"params"})


def round_needs(cfg: Config) -> frozenset[str]:
    """What the round must compute for the merge.

    Args:
      cfg: the run config.

    Returns:
      The vote's needs, and the server update for ``vote.server_step`` (see :func:`server_step`).
    """
    return vote_needs(cfg) | ({SERVER_UPDATE} if cfg.vote.server_step > 0 else frozenset())


def server_step(merged: PyTree, server_update: PyTree, step: float) -> PyTree:
    """``merged + step * g``: the consensus moved by ``step`` times the coordinator's own update.

    ``vote.server_step``: the votes can only remove what is far from the others; when honest
    nodes disagree (strongly non-IID shards) and the attackers' shards are lost with them, the
    classes they held are under-represented in any merge of the honest nodes. The coordinator's
    update g (``vote.server_steps`` Adam steps from the round's starting consensus on its clean
    root set, see :class:`ServerReference`) puts its root set's data into the model; ``step``
    below 1 keeps the nodes' merge in charge (on digits at alpha = 0.3, 0.5 was chosen on
    held-out data; 1 and above overshoots). Server-side training on the coordinator's own data,
    as in server-side fine-tuning on proxy data; it assumes that data is clean and like the
    nodes' task. Dtypes are kept.

    Args:
      merged: the merged consensus.
      server_update: the coordinator's update g, like ``merged``.
      step: the step size (``vote.server_step``).

    Returns:
      The moved consensus, in ``merged``'s dtypes.
    """
    return jax.tree.map(lambda m, g: (m + step * g.astype(m.dtype)).astype(m.dtype), merged, server_update)


def root_rows(root_size: int | float, total: int) -> int:
    """Rows of the root set: ``root_size`` itself (an int), or that share of ``total`` rows, rounded.

    Halves round up (0.25 of 50 rows is 13), not to even as Python's ``round`` does.

    Args:
      root_size: a row count (int) or a share of the held-out rows (float).
      total: the number of held-out rows.

    Returns:
      The number of root rows.
    """
    return root_size if isinstance(root_size, int) else math.floor(root_size * total + 0.5)


def split_root(
    heldout: Mapping[str, np.ndarray], root_size: int | float, seed: int
) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
    """Split the held-out rows into the root set and the rest.

    The root set is :func:`root_rows` held-out rows drawn without replacement from ``seed``.
    Both keep the held-out split's row order.

    Args:
      heldout: the held-out split, arrays with one row count.
      root_size: a row count (int) or a share of the held-out rows (float).
      seed: the run's seed.

    Returns:
      ``(root set, the rest)``.

    Raises:
      ValueError: when the held-out arrays disagree on their row count.
      ConfigError: when the held-out split is too small to leave rows for the quality gate,
        the weights and evaluation.
    """
    sizes = {len(v) for v in heldout.values()}
    if len(sizes) != 1:
        raise ValueError(f"held-out arrays disagree on their row count: {sorted(sizes)}")
    total = sizes.pop()
    rows = root_rows(root_size, total)
    if not 1 <= rows < total:
        share = "" if isinstance(root_size, int) else f" (a share of {total} held-out rows: {rows} rows)"
        raise ConfigError(
            f"vote.root_size = {root_size}{share} is not valid: need 1 <= rows < {total} "
            "(the held-out rows of this task; the rest stay held out)"
        )
    key = jax.random.fold_in(jax.random.key(seed), ROOT_STREAM)
    perm = np.asarray(jax.random.permutation(key, total))
    in_root = np.zeros(total, bool)
    in_root[perm[:rows]] = True
    root = {k: np.asarray(v)[in_root] for k, v in heldout.items()}
    rest = {k: np.asarray(v)[~in_root] for k, v in heldout.items()}
    return root, rest


class ServerReference:
    """The coordinator's update on its root set (see the module docstring).

    Args:
      task: the task (its model and loss).
      root: the root set's rows.
      cfg: the run config (``vote.server_steps``, else ``nodes.local_steps``; the nodes'
        learning rate and batch size).
    """

    def __init__(self, task: Task, root: Mapping[str, np.ndarray], cfg: Config):
        nd = cfg.nodes
        self.steps = cfg.vote.server_steps if cfg.vote.server_steps is not None else nd.local_steps
        self.root_size = len(next(iter(root.values())))
        # Its own single-device trainer: one node, whatever the fleet's mesh.
        lr = {"learning_rate": nd.learning_rate}
        self.trainer = NodeTrainer(task, optax.adam, lr, batch_size=int(nd.batch_size))
        self.data = self.trainer.place(
            NodeData(
                dict(root),
                np.arange(self.root_size, dtype=np.int32)[None],
                np.asarray([self.root_size], np.int32),
                shared=True,
                name="root",
                identity=True,
            )
        )

    def update(self, params: PyTree, round_key: jax.Array) -> PyTree:
        """The update g = (``steps`` Adam steps on the root set from ``params``) - ``params``.

        Args:
          params: the round's starting consensus.
          round_key: the round's key (the minibatches are drawn from it).

        Returns:
          g, like ``params`` (its dtypes).
        """
        key = jax.random.fold_in(round_key, SERVER_STREAM)
        state = self.trainer.init(key, params, 1)
        state, _ = self.trainer.fit(state, self.data, self.steps)
        return jax.tree.map(lambda x, p: (x[0] - p).astype(p.dtype), state.params, params)


VOTE_STREAM = 0x707E  # fold_in tag of the randomized rules' key inside a round key


def round_extra(
    needs: frozenset[str], server: ServerReference | None, consensus: PyTree, round_key: jax.Array
) -> dict[str, Any]:
    """The keyword arguments the round hands the merge: ``key``, ``server_update`` when the vote needs them.

    Both come from the round key (a retry draws fresh ones; a resumed run the same ones).

    Args:
      needs: what the round must compute (:func:`round_needs`).
      server: the coordinator's root-set trainer, if it has one.
      consensus: the round's starting consensus.
      round_key: the round's key.

    Returns:
      The keyword arguments for the merge.

    Raises:
      ValueError: when the vote needs a server update and there is no root set.
    """
    extra: dict[str, Any] = {}
    if "key" in needs:
        extra["key"] = jax.random.fold_in(round_key, VOTE_STREAM)
    if SERVER_UPDATE in needs:
        if server is None:
            raise ValueError("the vote needs a server_update but the coordinator has no root set")
        extra[SERVER_UPDATE] = server.update(consensus, round_key)
    return extra
