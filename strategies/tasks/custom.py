"""Bring your own model: a :class:`~strategies.tasks.base.Task` from a Flax model and arrays ``(x, y)``.

:func:`task_from_arrays` builds everything the system needs from a model and
labelled arrays: the public pool (``public=(x, y)`` given, or a stratified share
of the training split, 0.1 by default), the Dirichlet node split of the other
training rows over the classes, the general pool of hierarchical nodes (the
public pool) and the groups (classes), the held-out split the coordinator weighs
nodes on, and the test split, with cross entropy and accuracy unless you pass
your own loss and metrics. A custom task in a few lines::

    import flax.nnx as nnx
    from strategies.tasks import task_from_arrays

    class MLP(nnx.Module):
        def __init__(self, rngs):
            self.hidden, self.out = nnx.Linear(20, 32, rngs=rngs), nnx.Linear(32, 3, rngs=rngs)

        def __call__(self, x):
            return self.out(nnx.relu(self.hidden(x)))

    task = task_from_arrays(lambda rngs: MLP(rngs), x, y)   # x (N, 20) float, y (N,) int in 0..2
    MetaConsensus(config.load(None, ["vote.rule=median"]), task=task).train()

or, from the command line, a module ``my_tasks.py`` with ``def make_task(): return
task_from_arrays(...)`` and ``meta-consensus run --set task.name=my_tasks:make_task``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

import jax
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
    masked_mean,
    split_module,
)
from strategies.tasks.checks import (
    CHECK_ROWS,
    TaskError,
    TaskTypeError,
    check_features,
    check_labels,
    logit_count,
    one_line,
)
from strategies.tasks.classification import classification_splits

# (logits (B, C), labels (B,)) -> per-row values (B,)
RowFn = Callable[[Array, Array], Array]


def _accuracy(logits: Array, y: Array) -> Array:
    return (jnp.argmax(logits, axis=-1) == y).astype(jnp.float32)


@dataclasses.dataclass(frozen=True, eq=False)
class ArrayTask:
    """A classification task over arrays in memory (build it with :func:`task_from_arrays`).

    Attributes:
      name: the task's name in logs and tables.
      init_fn: ``key -> params`` (a pytree of float arrays).
      apply_fn: ``(params, x) -> logits (B, C)``.
      x: every example.
      y: its int class in ``0..num_classes-1``.
      split_rows: the row indices of the train, held-out and test splits.
      num_classes: C.
      loss_fn: ``(logits, y) -> per-row loss``.
      metric_fns: name -> ``(logits, y) -> per-row value``.
      dominant_mass: the classes covering this share of a node's shard are its groups.
      public_fraction: stratified share of the training split reserved as the public pool
        (unused when ``public_rows`` is given).
      general_pool: ``"public"`` or ``"union"`` (the public pool and every node's shard).
      public_rows: the rows of ``x`` given as public data (None: drawn from the training split).
    """

    name: str
    init_fn: Callable[[Array], PyTree]
    apply_fn: Callable[[PyTree, Array], Array]
    x: np.ndarray
    y: np.ndarray
    split_rows: tuple[np.ndarray, np.ndarray, np.ndarray]
    num_classes: int
    loss_fn: RowFn = cross_entropy
    metric_fns: Mapping[str, RowFn] = dataclasses.field(default_factory=lambda: {"accuracy": _accuracy})
    dominant_mass: float = 0.8
    public_fraction: float = DEFAULT_PUBLIC_FRACTION
    general_pool: str = "public"
    public_rows: np.ndarray | None = None
    kind = "classification"
    linearizable = True  # loss and metrics read the model through self.apply only

    def init(self, key: Array) -> PyTree:
        """Fresh parameters from ``init_fn``.

        Args:
          key: a JAX PRNG key.

        Returns:
          The parameters.
        """
        return self.init_fn(key)

    def apply(self, params: PyTree, inputs: Array, *, train: bool = False, key: Array | None = None) -> Array:
        """The logits of ``apply_fn``, floating inputs cast to the parameters' dtype.

        Args:
          params: the parameters.
          inputs: a batch of inputs.
          train: unused (the model has no training mode here).
          key: unused.

        Returns:
          (B, C) logits.
        """
        del train, key
        dtype = jax.tree.leaves(params)[0].dtype
        x = inputs.astype(dtype) if jnp.issubdtype(inputs.dtype, jnp.floating) else inputs
        return self.apply_fn(params, x)

    def loss(self, params: PyTree, batch: Batch, key: Array | None = None) -> Array:
        """Mean ``loss_fn`` (float32) over the batch rows (``batch["mask"]`` when present).

        Args:
          params: the parameters.
          batch: ``{"x", "y"}`` (``"mask"`` optional).
          key: the dropout key (training mode when given).

        Returns:
          A float32 scalar.
        """
        logits = self.apply(params, batch["x"], train=key is not None, key=key).astype(jnp.float32)
        return masked_mean(self.loss_fn(logits, batch["y"]), batch.get("mask"))

    def metrics(self, params: PyTree, batch: Batch) -> dict[str, Array]:
        """``"loss"`` and every ``metric_fns`` entry, masked means as float32 scalars.

        Args:
          params: the parameters.
          batch: ``{"x", "y"}`` (``"mask"`` optional).

        Returns:
          The metrics.
        """
        logits = self.apply(params, batch["x"]).astype(jnp.float32)
        mask = batch.get("mask")
        out = {"loss": masked_mean(self.loss_fn(logits, batch["y"]), mask)}
        for name, fn in self.metric_fns.items():
            out[name] = masked_mean(fn(logits, batch["y"]).astype(jnp.float32), mask)
        return out

    def logical_axes(self, params: PyTree) -> PyTree:
        """No named model axes: on a mesh the parameters are split over nodes only.

        Args:
          params: the parameters.

        Returns:
          A tree of all-None tuples, one entry per leaf dimension.
        """
        return jax.tree.map(lambda p: (None,) * np.ndim(p), params)

    def flip_labels(self, batch: Batch) -> Batch:
        """Label flipping attack: y -> C - 1 - y.

        Args:
          batch: a batch with labels ``"y"``.

        Returns:
          The batch with flipped labels (same dtype).
        """
        return {**batch, "y": (self.num_classes - 1 - batch["y"]).astype(batch["y"].dtype)}

    def splits(
        self,
        num_nodes: int,
        *,
        seed: int = 0,
        alpha: float = 0.5,
        process_index: int = 0,
        process_count: int = 1,
    ) -> TaskData:
        """The splits of the arrays, the training rows partitioned over the nodes.

        Args:
          num_nodes: the number of nodes over all processes.
          seed: the partition's seed.
          alpha: the Dirichlet concentration of the non-IID partition.
          process_index: this process's index.
          process_count: the number of processes.

        Returns:
          The splits for this process's hosted nodes (:func:`classification_splits`).
        """
        train, heldout, test = self.split_rows
        return classification_splits(
            self.x,
            self.y,
            train=train,
            heldout=heldout,
            test=test,
            num_nodes=num_nodes,
            num_classes=self.num_classes,
            seed=seed,
            alpha=alpha,
            dominant_mass=self.dominant_mass,
            process_index=process_index,
            process_count=process_count,
            min_size=1,
            public_fraction=self.public_fraction,
            general_pool=self.general_pool,
            public_seed=1,
            public=self.public_rows,
        )


def _model_functions(model: Any, example: np.ndarray) -> tuple[Callable, Callable]:
    """(init_fn, apply_fn) of an NNX constructor, a Linen module, or an (init, apply) pair."""
    import flax.linen as nn
    import flax.nnx as nnx

    if isinstance(model, tuple) and len(model) == 2 and all(callable(f) for f in model):
        return model
    if isinstance(model, nn.Module):

        def init_linen(key):
            return model.init(key, jnp.asarray(example[:1]))["params"]

        return init_linen, lambda params, x: model.apply({"params": params}, x)
    if isinstance(model, nnx.Module):
        raise TaskTypeError(
            "task_from_arrays: pass a constructor of the NNX module (`lambda rngs: MyModel(rngs=rngs)`), "
            "not a built module: the task must make fresh parameters from a key"
        )
    if callable(model):
        try:
            graphdef = nnx.graphdef(nnx.eval_shape(lambda: model(nnx.Rngs(0))))
        except Exception as e:  # the user's constructor
            raise TaskError(f"the model's constructor fails: {one_line(e)}") from e

        def init_nnx(key):
            return split_module(model(nnx.Rngs(params=key)))[1]

        return init_nnx, lambda params, x: nnx.merge(graphdef, params)(x)
    raise TaskTypeError(
        "task_from_arrays: model must be an NNX constructor `rngs -> nnx.Module`, a flax.linen Module, "
        f"or a pair (init_fn(key) -> params, apply_fn(params, x) -> logits); got {type(model).__name__}"
    )


def _stratified_split(
    y: np.ndarray, fractions: tuple[float, float, float], seed: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Row indices of train / held-out / test with every class split in the given fractions."""
    rng = np.random.default_rng(seed)
    parts: list[list[np.ndarray]] = [[], [], []]
    for c in np.unique(y):
        rows = rng.permutation(np.flatnonzero(y == c))
        n_test = int(round(fractions[2] * len(rows)))
        n_held = int(round(fractions[1] * len(rows)))
        parts[2].append(rows[:n_test])
        parts[1].append(rows[n_test : n_test + n_held])
        parts[0].append(rows[n_test + n_held :])
    return tuple(np.sort(np.concatenate(p)).astype(np.int64) for p in parts)  # type: ignore[return-value]


def task_from_arrays(
    model: Any,
    x: np.ndarray,
    y: np.ndarray,
    *,
    heldout: tuple[np.ndarray, np.ndarray] | None = None,
    test: tuple[np.ndarray, np.ndarray] | None = None,
    fractions: tuple[float, float, float] = (0.7, 0.1, 0.2),
    num_classes: int | None = None,
    loss: RowFn | None = None,
    metrics: Mapping[str, RowFn] | None = None,
    name: str = "custom",
    split_seed: int = 0,
    dominant_mass: float = 0.8,
    public: tuple[np.ndarray, np.ndarray] | float | None = None,
    general_pool: str = "public",
) -> ArrayTask:
    """A classification :class:`~strategies.tasks.base.Task` from a model and labelled arrays.

    Args:
      model: an NNX constructor ``rngs -> nnx.Module``, a ``flax.linen`` Module, or a pair
        ``(init_fn(key) -> params, apply_fn(params, x) -> logits)``; logits are (B, C).
      x: the training examples (N, ...). Without ``heldout`` and ``test`` they are split
        (stratified, ``fractions`` of each class, ``split_seed``) into train / held-out /
        test; otherwise all of them are training data.
      y: their int classes (N,).
      heldout: optional ``(x, y)`` of the held-out split (the coordinator's data for weights
        and gates); given together with ``test``.
      test: optional ``(x, y)`` of the test split (reported numbers only).
      fractions: train / held-out / test shares when splitting one set.
      num_classes: C, checked against the model's logit count (default: that count); every
        label must be in ``[0, C)``.
      loss: ``(logits, y) -> (B,)`` per-row loss (default cross entropy).
      metrics: name -> ``(logits, y) -> (B,)`` per-row values averaged over the rows
        (default ``{"accuracy": ...}``; the system reports "accuracy").
      name: the task's name in tables.
      split_seed: seed of the train / held-out / test split.
      dominant_mass: a node's groups are its classes covering this share of its shard.
      public: the public pool of hierarchical nodes, apart from every node's shard: ``(x, y)``
        of public examples, or the stratified share of the training split to reserve
        (default 0.1; 0 gives no public pool).
      general_pool: ``"public"`` (the public pool) or ``"union"`` (the public pool and every
        node's shard: centralised data, an upper bound for comparisons).

    Returns:
      an :class:`ArrayTask`; the node split (Dirichlet over the private training rows' classes
      with the run's alpha and seed), the general pool and the groups (the classes) follow.

    Raises:
      TaskError: (one line) for arrays of the wrong shapes, non-finite features, labels that
        are not classes in ``[0, C)``, only one of ``heldout`` and ``test``, a bad
        ``general_pool``, ``public`` or ``fractions``, or a model whose constructor or forward
        pass fails or whose logit count is not ``num_classes``.
      TaskTypeError: for a model that is none of the accepted kinds (a built NNX module
        included).
    """
    x, y = np.asarray(x), np.asarray(y)
    if x.ndim < 2 or y.ndim != 1 or len(x) != len(y):
        raise TaskError(f"task_from_arrays: x must be (N, ...) and y (N,); got {x.shape} and {y.shape}")
    if (heldout is None) != (test is None):
        raise TaskError("task_from_arrays: give both heldout and test, or neither (one set is split)")
    if general_pool not in GENERAL_POOLS:
        raise TaskError(
            f"task_from_arrays: general_pool must be one of {list(GENERAL_POOLS)}, got {general_pool!r}"
        )
    public_fraction = DEFAULT_PUBLIC_FRACTION
    public_arrays: tuple[np.ndarray, np.ndarray] | None = None
    if isinstance(public, tuple):
        public_arrays = (np.asarray(public[0]), np.asarray(public[1]))
        public_fraction = 0.0
    elif public is not None:
        public_fraction = float(public)
        if not 0.0 <= public_fraction < 1.0:
            raise TaskError(f"task_from_arrays: public must be (x, y) or a share in [0, 1), got {public!r}")
    arrays = [("x", "y", x, y)]
    if heldout is not None:
        assert test is not None  # given together with heldout, checked above
        hx, hy = (np.asarray(a) for a in heldout)
        tx, ty = (np.asarray(a) for a in test)
        arrays += [("heldout x", "heldout y", hx, hy), ("test x", "test y", tx, ty)]
    if public_arrays is not None:
        arrays.append(("public x", "public y", *public_arrays))
    if len(arrays) > 1:
        for xs, _, a, b in arrays[1:]:
            if a.shape[1:] != x.shape[1:] or np.ndim(b) != 1 or len(a) != len(b):
                raise TaskError(
                    f"task_from_arrays: {xs} must be (M, {x.shape[1:]}) with one label per row; "
                    f"got {a.shape} and {np.shape(b)}"
                )
    try:
        for xs, ys, a, b in arrays:
            check_features(a, xs)
            check_labels(b, None, ys)
    except TaskError as e:
        raise TaskError(f"task_from_arrays: {e}") from None
    public_rows = None
    if heldout is None:
        if len(fractions) != 3 or min(fractions) <= 0 or abs(sum(fractions) - 1) > 1e-6:
            raise TaskError(
                f"task_from_arrays: fractions must be three shares > 0 summing to 1, got {fractions}"
            )
        rows = _stratified_split(y, (fractions[0], fractions[1], fractions[2]), split_seed)
    else:
        n, h = len(x), len(arrays[1][2])
        t = h + len(arrays[2][2])
        rows = (np.arange(n), np.arange(n, n + h), np.arange(n + h, n + t))
    all_x = np.concatenate([a for _, _, a, _ in arrays])
    all_y = np.concatenate([b for _, _, _, b in arrays]).astype(y.dtype)
    if public_arrays is not None:
        # The public rows are appended last, after the train (and held-out, test) rows.
        public_rows = np.arange(len(all_y) - len(public_arrays[1]), len(all_y))
    try:
        init_fn, apply_fn = _model_functions(model, all_x)
        probe = ArrayTask(name, init_fn, apply_fn, all_x[:CHECK_ROWS], all_y[:CHECK_ROWS], rows, 1)
        c = logit_count(probe.init, probe.apply, x, num_classes, "x")
        # Labels the model cannot predict would train silently and count as wrong (or, past the
        # logits, be read out of range): they are refused here, naming the row.
        for _, ys, _, b in arrays:
            check_labels(b, c, ys, f", but the model gives {c} logits")
    except TaskError as e:
        message = str(e) if str(e).startswith("task_from_arrays:") else f"task_from_arrays: {e}"
        raise type(e)(message) from e.__cause__
    return ArrayTask(
        name=name,
        init_fn=init_fn,
        apply_fn=apply_fn,
        x=all_x,
        y=all_y.astype(np.int32),
        split_rows=rows,
        num_classes=c,
        loss_fn=loss or cross_entropy,
        metric_fns=dict(metrics) if metrics is not None else {"accuracy": _accuracy},
        dominant_mass=dominant_mass,
        public_fraction=public_fraction,
        general_pool=general_pool,
        public_rows=public_rows,
    )


__all__ = ["ArrayTask", "task_from_arrays"]
