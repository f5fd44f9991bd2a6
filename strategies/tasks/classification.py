"""What every image / feature classification task shares: its loss and metrics, and its node protocol.

The node protocol (digits, Fashion-MNIST, arrays): fixed train / held-out /
test splits; a stratified ``public_fraction`` of the training split is the
**public pool** (fixed by the task's split seed, like the held-out split); the
rest, the private rows, is partitioned over the nodes by
:func:`~strategies.tasks.base.dirichlet_partition` over the classes (label
skew, alpha). The general pool shared by every node is the public pool, so no
node ever draws another node's rows; ``general_pool = "union"`` makes it the
public pool and every shard (centralised data, an upper bound for comparisons).
Each node specializes in its dominant classes (the fewest covering
``dominant_mass`` of its shard); a process keeps the examples of its hosted
nodes only.
"""

from __future__ import annotations

from typing import ClassVar

import jax.numpy as jnp
import numpy as np

from strategies.tasks.base import (
    DEFAULT_PUBLIC_FRACTION,
    GENERAL_POOLS,
    Array,
    Batch,
    PyTree,
    TaskData,
    cross_entropy,
    dirichlet_partition,
    dominant_groups,
    hosted_nodes,
    masked_mean,
    pad_stack,
    public_split,
)


class ClassifierMethods:
    """Loss, metrics and the label-flipping attack of a task whose ``apply`` returns (B, C) logits."""

    num_classes: ClassVar[int] = 10
    # loss and metrics read the model through self.apply only (strategies.tangent.linearize)
    linearizable: ClassVar[bool] = True

    def apply(self, params: PyTree, inputs: Array, *, train: bool = False, key: Array | None = None) -> Array:
        """The (B, C) logits; every task that mixes these methods in defines it.

        Args:
          params: the parameters.
          inputs: a batch of inputs.
          train: training mode (dropout on, when the model has it).
          key: the dropout key in training mode.

        Returns:
          (B, C) logits.

        Raises:
          NotImplementedError: here; the task's own ``apply`` replaces it.
        """
        raise NotImplementedError

    def loss(self, params: PyTree, batch: Batch, key: Array | None = None) -> Array:
        """Mean cross entropy (float32) over the batch rows (``batch["mask"]`` when present).

        Args:
          params: the parameters.
          batch: ``{"x", "y"}`` (``"mask"`` optional).
          key: the dropout key (training mode when given).

        Returns:
          A float32 scalar.
        """
        logits = self.apply(params, batch["x"], train=key is not None, key=key)
        return masked_mean(cross_entropy(logits, batch["y"]), batch.get("mask"))

    def metrics(self, params: PyTree, batch: Batch) -> dict[str, Array]:
        """``{"loss", "accuracy"}`` as float32 scalars.

        Args:
          params: the parameters.
          batch: ``{"x", "y"}`` (``"mask"`` optional).

        Returns:
          The metrics.
        """
        logits = self.apply(params, batch["x"])
        mask = batch.get("mask")
        correct = (jnp.argmax(logits, axis=-1) == batch["y"]).astype(jnp.float32)
        loss = masked_mean(cross_entropy(logits, batch["y"]), mask)
        return {"loss": loss, "accuracy": masked_mean(correct, mask)}

    def flip_labels(self, batch: Batch) -> Batch:
        """Label flipping attack: y -> C - 1 - y.

        Args:
          batch: a batch with labels ``"y"``.

        Returns:
          The batch with flipped labels (same dtype).
        """
        out = dict(batch)
        out["y"] = (self.num_classes - 1 - batch["y"]).astype(batch["y"].dtype)
        return out


def classification_splits(
    x: np.ndarray,
    y: np.ndarray,
    *,
    train: np.ndarray,
    heldout: np.ndarray,
    test: np.ndarray,
    num_nodes: int,
    num_classes: int,
    seed: int,
    alpha: float,
    dominant_mass: float,
    process_index: int = 0,
    process_count: int = 1,
    min_size: int = 8,
    group_names: tuple[str, ...] | None = None,
    public_fraction: float = DEFAULT_PUBLIC_FRACTION,
    general_pool: str = "public",
    public_seed: int = 0,
    public: np.ndarray | None = None,
) -> TaskData:
    """The :class:`TaskData` of a classification data set given the row indices of its three splits.

    The partition depends on ``seed`` and ``alpha`` only (every process computes
    the same one from the labels); a process keeps the rows of its hosted nodes'
    shards. With ``num_nodes=1`` the single shard is the whole training split.

    Args:
      x: every example (rows).
      y: the int class of every example.
      train: row indices of the training split.
      heldout: row indices of the held-out split (disjoint from the others).
      test: row indices of the test split (disjoint from the others).
      num_nodes: the number of nodes over all processes.
      num_classes: C.
      seed: the partition's seed.
      alpha: the Dirichlet concentration of the non-IID partition.
      dominant_mass: the share of a node's examples its groups cover
        (:func:`~strategies.tasks.base.dominant_groups`).
      process_index: this process's index.
      process_count: the number of processes.
      min_size: the smallest shard the partition accepts.
      group_names: the class names (default: ``"0"`` ... ``"C-1"``).
      public_fraction: the stratified share of ``train`` reserved as the public pool (drawn with
        ``public_seed``; ignored when ``public`` is given).
      general_pool: ``"public"`` (the general pool is the public rows only) or ``"union"``
        (the public rows and every node's shard: centralised data).
      public_seed: the seed of the public draw.
      public: the rows of the public pool given explicitly (disjoint from the three splits);
        then every row of ``train`` is private.

    Returns:
      The splits for this process's hosted nodes.

    Raises:
      ValueError: for an unknown ``general_pool``, public rows that overlap ``train``, or a
        partition that cannot be drawn (see :func:`~strategies.tasks.base.dirichlet_partition`).
    """
    if general_pool not in GENERAL_POOLS:
        raise ValueError(f"general_pool must be one of {list(GENERAL_POOLS)}, got {general_pool!r}")
    hosted = hosted_nodes(num_nodes, process_index, process_count)
    if public is None:
        public, train = public_split(y, train, public_fraction, public_seed)
    else:
        public, train = np.sort(np.asarray(public, np.int64)), np.sort(np.asarray(train, np.int64))
        if np.intersect1d(public, train).size:
            raise ValueError("the public rows overlap the training split")
    rng = np.random.default_rng(seed)
    if num_nodes == 1:
        shards = [np.arange(len(train))]
    else:
        shards = dirichlet_partition(y[train], num_nodes, alpha, rng, min_size=min_size)
    local = [train[shards[i]] for i in hosted]
    # The general pool: the public rows, or (explicitly) the public rows and every node's shard.
    general = public if general_pool == "public" else np.sort(np.concatenate([public, train]))
    size = max(len(s) for s in shards)  # the same padded size on every process
    groups = np.stack([dominant_groups(y[r], num_classes, mass=dominant_mass) for r in local])
    train_groups = pad_stack([y[r] for r in local], size)
    counts = np.array([len(r) for r in local], np.int32)
    # Global ids (rows of the data set) of each hosted node's examples, -1 on padding:
    # lets callers check that processes hold disjoint shards.
    example_ids = pad_stack([r.astype(np.int64) for r in local], size)
    for i, c in enumerate(counts):
        train_groups[i, c:] = -1
        example_ids[i, c:] = -1
    return TaskData(
        num_nodes=num_nodes,
        node_ids=hosted,
        train={"x": pad_stack([x[r] for r in local], size), "y": pad_stack([y[r] for r in local], size)},
        train_count=counts,
        train_groups=train_groups,
        general={"x": x[general], "y": y[general]},
        general_groups=y[general],
        heldout={"x": x[heldout], "y": y[heldout]},
        test={"x": x[test], "y": y[test]},
        node_groups=groups,
        group_names=group_names or tuple(str(c) for c in range(num_classes)),
        process_index=process_index,
        process_count=process_count,
        meta={
            "example_ids": example_ids,
            "general_ids": general.astype(np.int64),
            "public_ids": public.astype(np.int64),
            "general_pool": general_pool,
            "alpha": alpha,
            "seed": seed,
        },
    )
