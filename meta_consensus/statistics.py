"""Per-node statistics the round carries for the merge methods that need them (Fisher merging, RegMean).

``vote.rule = "fisher_merge"`` needs every node's diagonal empirical Fisher and
``vote.rule = "regmean"`` its Dense layers' input Gram matrices
(:mod:`strategies.statistics`). The registry says so (``RuleSpec.needs`` holds
``"fisher"`` / ``"grams"``); :func:`round_statistics` computes them after the
nodes' local fit, each node on its own training shard at the candidate it
submits, and hands them to the merge as ``update(..., fisher=..., grams=...)``
stacked over the nodes like the candidates.

What it is and is not:

* The statistics are computed by the system's simulation for every node, in one
  jitted call per node after the fit (not fused into the training step). A
  Byzantine node's statistics are computed honestly here; a real attacker could
  report anything, and a node reporting a huge Fisher owns the coordinate (see
  :func:`consensus.fisher_merge`): compose with a vote.
* Only the node's own shard is used (not a hierarchical strategy's shared pool).
* Neither statistic is differentially private (the Grams are second moments of a
  node's inputs), so the config refuses them with ``dp.enabled``.
* RegMean reads the inputs of a plain MLP's Dense layers
  (:func:`strategies.statistics.mlp_layer_inputs`); the task's model is checked
  to be that MLP on its (flattened) inputs, else the round raises a clear error.
* One process only (every node's shard must be on this host).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from consensus import tree
from meta_consensus.config import ConfigError
from strategies.statistics import mlp_layer_inputs, node_statistics

PyTree = Any
STATISTICS = ("fisher", "grams")


def check_config(cfg: Any, needs: frozenset[str], process_count: int) -> None:
    """Check that the run can provide the per-node statistics the vote needs.

    Args:
      cfg: the run config.
      needs: what the vote needs from the round.
      process_count: the number of JAX processes.

    Raises:
      ConfigError: when the vote needs per-node statistics under DP or with several processes.
    """
    wanted = statistics_needs(needs)
    if not wanted:
        return
    if cfg.dp.enabled:
        raise ConfigError(
            f"vote.rule = {cfg.vote.rule!r} needs the nodes' {list(wanted)}, which are not "
            "differentially private; disable dp or choose another rule"
        )
    if process_count > 1:
        raise ConfigError(
            f"vote.rule = {cfg.vote.rule!r} needs the nodes' {list(wanted)}; "
            "per-node statistics run in one process"
        )


def statistics_needs(needs: frozenset[str]) -> tuple[str, ...]:
    """The per-node statistics among what the vote needs, in a fixed order.

    Args:
      needs: what the vote needs from the round.

    Returns:
      The names among ``STATISTICS`` that ``needs`` holds.
    """
    return tuple(s for s in STATISTICS if s in needs)


def flat_inputs(x: jax.Array) -> jax.Array:
    """A batch of inputs as (B, d) float32 rows: integer images scaled to [0, 1] as the tasks read them.

    Args:
      x: (B, ...) inputs.

    Returns:
      (B, d) float32.
    """
    x = jnp.asarray(x)
    scaled = x.astype(jnp.float32) / 255.0 if jnp.issubdtype(x.dtype, jnp.integer) else x
    return scaled.astype(jnp.float32).reshape(x.shape[0], -1)


def mlp_inputs_on_raw(params: PyTree, x: jax.Array) -> dict[str, jax.Array]:
    """The Dense layers' inputs of a plain ReLU MLP on raw task inputs (flattened, integers scaled).

    Args:
      params: the MLP's parameters.
      x: (B, ...) raw inputs.

    Returns:
      Each Dense layer's (B, d_in) inputs by its path.
    """
    return mlp_layer_inputs(params, flat_inputs(x))


def check_plain_mlp(task: Any, params: PyTree, x: np.ndarray) -> None:
    """Raise unless ``task.apply`` is the plain ReLU MLP :func:`mlp_inputs_on_raw` assumes.

    The logits the MLP's last Dense layer gives on ``x`` must equal the task's own,
    else RegMean's Grams would describe some other model.

    Args:
      task: the task.
      params: one node's parameters.
      x: a few inputs to compare the logits on.

    Raises:
      ValueError: when the task's model is not such an MLP.
    """
    name = getattr(task, "name", type(task).__name__)
    try:
        inputs = mlp_inputs_on_raw(params, jnp.asarray(x))
    except (TypeError, ValueError) as e:
        raise ValueError(f"regmean in the system needs a plain MLP task, not {name!r}: {e}") from None
    last = max(inputs, key=lambda k: int(k.split("'")[1].split("_")[1]))
    layer = params[last.split("'")[1]]
    logits = inputs[last].astype(layer["kernel"].dtype) @ layer["kernel"] + layer["bias"]
    own = task.apply(params, jnp.asarray(x))
    if not np.allclose(np.asarray(logits, np.float32), np.asarray(own, np.float32), rtol=1e-3, atol=1e-3):
        raise ValueError(
            f"regmean in the system needs a plain ReLU MLP on the flattened inputs; task {name!r} "
            "transforms its inputs before the first Dense layer; use the library "
            "(strategies.statistics.node_statistics with its own layer_inputs)"
        )


def node_batch(train: Mapping[str, np.ndarray], count: np.ndarray, i: int) -> dict[str, np.ndarray]:
    """Node i's valid training rows (padding removed).

    Args:
      train: the (n, m, ...) training shards (a ``mask`` entry is left out).
      count: (n,) valid rows per node.
      i: the node.

    Returns:
      The node's rows by name.
    """
    m = int(count[i])
    return {k: np.asarray(v[i][:m]) for k, v in train.items() if k != "mask"}


def round_statistics(needs: frozenset[str], task: Any, data: Any, submitted: PyTree) -> dict[str, Any]:
    """``{"fisher": stacked tree, "grams": {leaf path: (n, d_in, d_in)}}`` for what ``needs`` names.

    Args:
      needs: what the vote needs from the round (:func:`meta_consensus.server.round_needs`).
      task: the fleet's task (its ``loss``; ``apply`` for the RegMean check).
      data: the fleet's TaskData (``train`` dict of (n, m, ...) shards, ``train_count``).
      submitted: the nodes' stacked candidates; node i's statistics are taken at its candidate.

    Returns:
      {} when the vote needs no statistic.

    Raises:
      ValueError: when this host lacks some node's shard, or (for Grams) the task's model is
        not a plain ReLU MLP.
    """
    wanted = statistics_needs(needs)
    if not wanted:
        return {}
    n = tree.num_nodes(submitted)
    count = np.asarray(data.train_count)
    if len(count) != n:
        raise ValueError(
            f"per-node statistics need every node's shard on this host: {len(count)} shards for {n} nodes"
        )
    layer_inputs = mlp_inputs_on_raw if "grams" in wanted else _no_layers
    per_node = []
    for i in range(n):
        params = jax.tree.map(lambda a, i=i: a[i], submitted)
        batch = node_batch(data.train, count, i)
        if i == 0 and "grams" in wanted:
            check_plain_mlp(task, params, batch["x"][:8])
        per_node.append(node_statistics(task.loss, params, batch, layer_inputs=layer_inputs))
    out: dict[str, Any] = {}
    if "fisher" in wanted:
        out["fisher"] = tree.stack([s.fisher for s in per_node])
    if "grams" in wanted:
        out["grams"] = {k: jnp.stack([s.grams[k] for s in per_node]) for k in per_node[0].grams}
    return out


def _no_layers(params: PyTree, x: jax.Array) -> dict[str, jax.Array]:
    del params, x
    return {}
