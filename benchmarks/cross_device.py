"""The cross-device setting of the client-sampling benchmarks: thousands of digits clients of a few examples.

The digits task's own split gives every node a Dirichlet shard of at least 8 examples, so it
cannot make more than ~150 nodes out of its 1,257 training examples. :class:`ManyClientDigits`
cuts the training split into ``num_nodes`` disjoint IID random shards instead (about
1257 / n examples each, at least one), the setting of the privacy benchmark's 400 clients
(``benchmarks.quality_common.iid_clients``), as a task the system trains on
(``MetaConsensus(cfg, task=ManyClientDigits(...))``).
"""

from __future__ import annotations

import dataclasses

import numpy as np

from strategies.tasks.base import TaskData, dominant_groups, pad_stack
from strategies.tasks.digits import NUM_CLASSES, DigitsTask


@dataclasses.dataclass(frozen=True)
class ManyClientDigits(DigitsTask):
    """Digits with ``num_nodes`` IID shards of the training split (``seed`` draws the shards)."""

    name: str = "digits_many_clients"

    def splits(
        self,
        num_nodes: int,
        *,
        seed: int = 0,
        alpha: float = 0.5,
        process_index: int = 0,
        process_count: int = 1,
    ) -> TaskData:
        del alpha  # IID shards: the client's few examples are a random draw of the training split
        if process_count != 1:
            raise ValueError("ManyClientDigits runs in one process")
        whole = DigitsTask.splits(self, 1, seed=seed)
        x, y = whole.general["x"], whole.general["y"]
        if num_nodes > len(y):
            raise ValueError(f"{num_nodes} clients but only {len(y)} training examples")
        parts = np.array_split(np.random.default_rng(seed).permutation(len(y)), num_nodes)
        size = max(len(p) for p in parts)
        counts = np.array([len(p) for p in parts], np.int32)
        train_groups = pad_stack([y[p].astype(np.int32) for p in parts], size)
        for i, c in enumerate(counts):
            train_groups[i, c:] = -1
        groups = np.stack([dominant_groups(y[p], NUM_CLASSES, mass=self.dominant_mass) for p in parts])
        return dataclasses.replace(
            whole,
            num_nodes=num_nodes,
            node_ids=np.arange(num_nodes),
            train={"x": pad_stack([x[p] for p in parts], size), "y": pad_stack([y[p] for p in parts], size)},
            train_count=counts,
            train_groups=train_groups,
            node_groups=groups,
            meta={},
        )
