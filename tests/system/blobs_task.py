"""A task defined outside the package (not digits, not text): Gaussian blobs and a tiny NNX MLP.

The system runs it by import path (``task.name = "blobs_task:make_task"``) and as an object
(``MetaConsensus(cfg, task=make_task())``).
"""

from __future__ import annotations

import flax.nnx as nnx
import numpy as np

from strategies.tasks import task_from_arrays

CLASSES, FEATURES = 4, 6


class TinyMLP(nnx.Module):
    def __init__(self, rngs: nnx.Rngs, width: int = 16):
        self.hidden = nnx.Linear(FEATURES, width, rngs=rngs)
        self.out = nnx.Linear(width, CLASSES, rngs=rngs)

    def __call__(self, x):
        return self.out(nnx.relu(self.hidden(x)))


def blobs(n: int = 600, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """n points around CLASSES well-separated centres in FEATURES dimensions."""
    rng = np.random.default_rng(seed)
    centres = rng.normal(scale=3.0, size=(CLASSES, FEATURES))
    y = rng.integers(0, CLASSES, size=n)
    return (centres[y] + rng.normal(size=(n, FEATURES))).astype(np.float32), y.astype(np.int32)


def make_task(width: int = 16):
    x, y = blobs()
    return task_from_arrays(lambda rngs: TinyMLP(rngs, width), x, y, name="blobs")


not_a_task = object()
