"""Digits: scikit-learn's bundled 8x8 handwritten digits and a Flax NNX MLP.

1,797 images (64 pixels in 0..16, scaled to [0, 1]) of the digits 0-9, shipped
with scikit-learn, so nothing is downloaded. A stratified split with a fixed
seed gives train / held-out / test sets; the training set is then split over
the nodes with a Dirichlet(alpha) label-skew partition. Every example's group
is its class, and a node specializes in its dominant classes (the fewest
classes holding ``dominant_mass`` of its shard), which feeds the middle level
of hierarchical training: all classes -> the node's classes -> its own shard.

A stratified ``public_fraction`` (default 0.1) of the training split is the
public pool, the "general data" of the first two hierarchical levels; the
private per-node shards are a partition of the rest, so no node draws another
node's rows (``general_pool = "union"`` adds every shard to the general pool:
centralised data, an upper bound). A process loads the shards of the nodes it
hosts only.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from strategies.tasks.base import (
    DEFAULT_PUBLIC_FRACTION,
    GENERAL_POOLS,
    TASKS,
    Array,
    PyTree,
    TaskData,
    cross_entropy,
    param_dtype,
    split_module,
)
from strategies.tasks.classification import ClassifierMethods, classification_splits

NUM_CLASSES = 10
NUM_FEATURES = 64


class MLP(nnx.Module):
    """ReLU multilayer perceptron with logical axis names on its kernels."""

    def __init__(self, sizes: tuple[int, ...], *, rngs: nnx.Rngs):
        # Named attributes (dense_0, dense_1, ...) rather than a list: string keys in the params
        # dict keep checkpoints (orbax) and leaf paths readable.
        self.num_layers = len(sizes) - 1
        for i, (a, b) in enumerate(zip(sizes[:-1], sizes[1:], strict=True)):
            out_name = "classes" if i == self.num_layers - 1 else "mlp"
            in_name = "embed" if i == 0 else "mlp"
            kernel_init = nnx.with_partitioning(
                nnx.initializers.lecun_normal(), (in_name, out_name), eager_sharding=False
            )
            bias_init = nnx.with_partitioning(nnx.initializers.zeros, (out_name,), eager_sharding=False)
            layer = nnx.Linear(a, b, rngs=rngs, kernel_init=kernel_init, bias_init=bias_init)
            setattr(self, f"dense_{i}", layer)

    def __call__(self, x: Array, *, dropout: float = 0.0, key: Array | None = None) -> Array:
        """The logits: ReLU between the layers, dropout after each hidden one when given a key.

        Args:
          x: (B, d) inputs.
          dropout: the dropout rate (0: none).
          key: the dropout key (None: no dropout).

        Returns:
          (B, C) logits.
        """
        for i in range(self.num_layers):
            x = getattr(self, f"dense_{i}")(x)
            if i < self.num_layers - 1:
                x = jax.nn.relu(x)
                if dropout > 0.0 and key is not None:
                    key, sub = jax.random.split(key)
                    keep = jax.random.bernoulli(sub, 1.0 - dropout, x.shape)
                    x = jnp.where(keep, x / jnp.asarray(1.0 - dropout, x.dtype), jnp.zeros_like(x))
        return x

    def tapped(self, x: Array, offsets: tuple[Array, ...]) -> tuple[Array, tuple[Array, ...]]:
        """Logits without dropout, with ``offsets[i]`` added to layer i's output, and every layer's input.

        The taps of ghost clipping (:class:`strategies.dpsgd.DenseTaps`): the cotangent of
        ``offsets[i]`` is the gradient with respect to layer i's output.

        Args:
          x: (B, d) inputs.
          offsets: one (B, out_i) array per layer.

        Returns:
          ``(logits, inputs)``: (B, C) logits and the tuple of every layer's input.
        """
        inputs = []
        for i in range(self.num_layers):
            inputs.append(x)
            x = getattr(self, f"dense_{i}")(x)
            x = x + offsets[i].astype(x.dtype)
            if i < self.num_layers - 1:
                x = jax.nn.relu(x)
        return x, tuple(inputs)


def mlp_dense_taps(sizes: tuple[int, ...], graphdef: Any, features: Any) -> Any:
    """:class:`strategies.dpsgd.DenseTaps` of an :class:`MLP` (no dropout) on ``features(params, x)``.

    The per-example loss is the task's cross entropy, so the fast DP-SGD path (ghost clipping)
    clips the gradients the task's ``loss`` has on one-row batches.

    Args:
      sizes: the MLP's layer widths, input first.
      graphdef: the MLP's NNX graph definition.
      features: ``features(params, x)``, the MLP's input from a batch's ``"x"``.

    Returns:
      The taps.
    """
    from strategies.dpsgd import DenseTaps

    def loss(params, batch, offsets):
        model = nnx.merge(graphdef, params)
        logits, inputs = model.tapped(features(params, batch["x"]), offsets)
        return cross_entropy(logits, batch["y"]), inputs

    return DenseTaps(tuple(int(s) for s in sizes[1:]), loss)


@functools.cache
def _load() -> tuple[np.ndarray, np.ndarray]:
    from sklearn.datasets import load_digits

    d = load_digits()
    return (d.data / 16.0).astype(np.float32), d.target.astype(np.int32)


@dataclasses.dataclass(frozen=True)
class DigitsTask(ClassifierMethods):
    """The digits classification task.

    Args:
      hidden: hidden layer widths of the MLP.
      dropout: dropout rate in training (0 disables it).
      test_fraction: share of the 1,797 examples in the test split.
      heldout_fraction: share of them in the held-out split.
      split_seed: seed of the train / held-out / test split (fixed, so test
        numbers compare across partition seeds).
      dominant_mass: share of a node's shard its specialized classes cover.
      public_fraction: stratified share of the training split reserved as the public pool
        (fixed by ``split_seed``), apart from every node's shard.
      general_pool: ``"public"`` (the public pool) or ``"union"`` (the public pool and every
        node's shard: centralised data).

    Raises:
      ValueError: for a dropout outside [0, 1), fractions that are not > 0 or sum to 1 or
        more, a ``public_fraction`` outside [0, 1), or an unknown ``general_pool``.

    Example:
      >>> task = DigitsTask()
      >>> data = task.splits(4, seed=0, alpha=0.5)
      >>> params = task.init(jax.random.key(0))
      >>> accuracy = float(task.metrics(params, data.test)["accuracy"])
      >>> accuracy < 0.3  # about 0.1 (chance) before training
      True
    """

    hidden: tuple[int, ...] = (128,)
    dropout: float = 0.0
    test_fraction: float = 0.2
    heldout_fraction: float = 0.1
    split_seed: int = 0
    dominant_mass: float = 0.8
    public_fraction: float = DEFAULT_PUBLIC_FRACTION
    general_pool: str = "public"
    name: str = "digits"
    kind: ClassVar[str] = "classification"  # what the weight objectives may assume (see Task)

    def __post_init__(self):
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"dropout must be in [0, 1), got {self.dropout}")
        fractions_ok = self.test_fraction > 0 and self.heldout_fraction > 0
        if not (fractions_ok and self.test_fraction + self.heldout_fraction < 1):
            raise ValueError("test_fraction and heldout_fraction must be > 0 and sum to less than 1")
        if not 0.0 <= self.public_fraction < 1.0:
            raise ValueError(f"public_fraction must be in [0, 1), got {self.public_fraction}")
        if self.general_pool not in GENERAL_POOLS:
            raise ValueError(f"general_pool must be one of {list(GENERAL_POOLS)}, got {self.general_pool!r}")

    @functools.cached_property
    def _graphdef(self) -> Any:
        abstract = nnx.eval_shape(lambda: MLP(self._sizes, rngs=nnx.Rngs(0)))
        return nnx.graphdef(abstract)

    @property
    def _sizes(self) -> tuple[int, ...]:
        return (NUM_FEATURES, *self.hidden, NUM_CLASSES)

    def init(self, key: Array) -> PyTree:
        """Fresh float32 params (a nested dict of arrays).

        Args:
          key: a JAX PRNG key.

        Returns:
          The parameters.
        """
        _, params, _ = split_module(MLP(self._sizes, rngs=nnx.Rngs(params=key)))
        return params

    def logical_axes(self, params: PyTree | None = None) -> PyTree:
        """Logical axis names per leaf ("embed", "mlp", "classes").

        Args:
          params: unused (the axes follow from the architecture).

        Returns:
          A tree like the parameters with a tuple of names per leaf.
        """
        _, _, axes = split_module(nnx.eval_shape(lambda: MLP(self._sizes, rngs=nnx.Rngs(0))))
        return axes

    def apply(self, params: PyTree, inputs: Array, *, train: bool = False, key: Array | None = None) -> Array:
        """Logits (B, 10) in the params' dtype.

        Args:
          params: the parameters.
          inputs: (B, 64) features.
          train: training mode (dropout on, when configured).
          key: the dropout key in training mode.

        Returns:
          (B, 10) logits.
        """
        model = nnx.merge(self._graphdef, params)
        x = inputs.astype(param_dtype(params))
        rate = self.dropout if train else 0.0
        return model(x, dropout=rate, key=key)

    def dp_dense_taps(self) -> Any:
        """Dense-layer taps for the fast DP-SGD path (ghost clipping); None with dropout.

        Returns:
          :class:`strategies.dpsgd.DenseTaps`, or None.
        """
        if self.dropout > 0.0:
            return None
        return mlp_dense_taps(self._sizes, self._graphdef, lambda params, x: x.astype(param_dtype(params)))

    def splits(
        self,
        num_nodes: int,
        *,
        seed: int = 0,
        alpha: float = 0.5,
        process_index: int = 0,
        process_count: int = 1,
    ) -> TaskData:
        """Train / held-out / test splits, the public pool and the Dirichlet(alpha) node shards.

        The partition depends on ``seed`` and ``alpha`` only (every process
        computes the same one from the labels); a process keeps the pixels of
        its hosted nodes' shards. With ``num_nodes=1`` the single shard is every
        private training row.

        Args:
          num_nodes: the number of nodes over all processes.
          seed: the partition's seed.
          alpha: the Dirichlet concentration of the non-IID partition.
          process_index: this process's index.
          process_count: the number of processes.

        Returns:
          The splits for this process's hosted nodes.
        """
        from sklearn.model_selection import train_test_split

        x, y = _load()
        idx = np.arange(len(y))
        rest, test = train_test_split(
            idx, test_size=self.test_fraction, random_state=self.split_seed, stratify=y
        )
        held_share = self.heldout_fraction / (1.0 - self.test_fraction)
        train, held = train_test_split(
            rest, test_size=held_share, random_state=self.split_seed + 1, stratify=y[rest]
        )
        return classification_splits(
            x,
            y,
            train=train,
            heldout=held,
            test=test,
            num_nodes=num_nodes,
            num_classes=NUM_CLASSES,
            seed=seed,
            alpha=alpha,
            dominant_mass=self.dominant_mass,
            process_index=process_index,
            process_count=process_count,
            public_fraction=self.public_fraction,
            general_pool=self.general_pool,
            public_seed=self.split_seed + 2,
        )


@TASKS.declare("digits")
def digits(hidden: tuple[int, ...] = (32,)) -> DigitsTask:
    """scikit-learn's 8x8 digits (1,797 images), an MLP."""
    return DigitsTask(hidden=tuple(hidden))
