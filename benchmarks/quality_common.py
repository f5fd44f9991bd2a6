"""Shared helpers of the quality benchmarks (soups, convex_quality, privacy_quality, robustness).

Training n nodes from one global tree, evaluating single and stacked params trees on a
batch, and the predictive probabilities the convex weights need. Arguments, timing and
result files (``<name>[_quick].json`` / ``.md`` / ``.png``) are :mod:`benchmarks.harness`'s,
re-exported here for the scripts that import them from this module.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from benchmarks.harness import command, header, mean_std, plot_path, pm, pyplot, save, stem
from strategies import NodeData, NodeTrainer, TaskData
from strategies.tasks import Task, pad_index_table

PyTree = Any
Batch = Mapping[str, Any]

# ----------------------------------------------------------------------------- the task (--task)

QUALITY_TASKS = ("digits", "fashion_mnist")
_task_name = "digits"  # the --task of the script running in this process (one script per process)


def add_task_option(parser: Any) -> None:
    """``--task digits|fashion_mnist`` (Fashion-MNIST reads the IDX files of ``make data``)."""
    parser.add_argument(
        "--task", default="digits", choices=QUALITY_TASKS, help="dataset (fashion_mnist needs `make data`)"
    )


def use_task(name: str, result_name: str) -> str:
    """Select the task :func:`make_task` builds; the results' name (``result_name[_<task>]``)."""
    global _task_name
    if name not in QUALITY_TASKS:
        raise ValueError(f"--task must be one of {QUALITY_TASKS}, got {name!r}")
    _task_name = name
    return result_name if name == "digits" else f"{result_name}_{name}"


def make_task(**options: Any) -> Task:
    """The selected task with the script's model options (``hidden`` = the MLP's hidden widths)."""
    from strategies.registry import resolve_task

    if _task_name == "digits":
        from strategies import DigitsTask

        return DigitsTask(**options)
    return resolve_task(_task_name, options)


# ----------------------------------------------------------------------------- data


def shared_pool(data: TaskData, num_nodes: int) -> NodeData:
    """Every one of ``num_nodes`` nodes draws from the whole general (training) pool.

    ``TaskData.everything`` has one row per *hosted* node of the split; this gives any
    node count, for fine-tuning many copies of one model on the same data.
    """
    n_g = len(data.general_groups)
    index = np.broadcast_to(np.arange(n_g, dtype=np.int32), (num_nodes, n_g)).copy()
    return NodeData(dict(data.general), index, np.full((num_nodes,), n_g, np.int32), shared=True)


def iid_clients(data: TaskData, num_clients: int, rng: np.random.Generator) -> NodeData:
    """The general pool cut into ``num_clients`` disjoint random shards of (almost) equal size.

    Each client may only draw its own rows (a shared pool plus an index table, so the
    pixels are stored once however many clients there are).
    """
    n_g = len(data.general_groups)
    if num_clients > n_g:
        raise ValueError(f"{num_clients} clients but only {n_g} training examples")
    parts = np.array_split(rng.permutation(n_g), num_clients)
    index, count = pad_index_table(parts)
    return NodeData(dict(data.general), index, count, shared=True, name="clients")


def subset(batch: Batch, rows: np.ndarray) -> dict[str, np.ndarray]:
    return {k: np.asarray(v)[rows] for k, v in batch.items()}


# ----------------------------------------------------------------------------- training


@functools.lru_cache(maxsize=16)
def trainer_for(task: Task, optimizer: str, batch_size: int, **defaults: float) -> NodeTrainer:
    """One NodeTrainer per (task, optimizer, batch size), so repeated runs reuse its compiled steps.

    ``optimizer`` names an optax factory ("adam", "adamw", "sgd"); hyperparameters that vary
    between runs go to ``fit(..., hyperparams=...)`` (they are arguments, not constants).
    """
    return NodeTrainer(task, getattr(optax, optimizer), dict(defaults) or {"learning_rate": 1e-3}, batch_size)


def pretrain(
    task: Task, data: NodeData, key: jax.Array, steps: int, learning_rate: float, batch_size: int = 32
) -> PyTree:
    """One model trained from a fresh init with Adam on ``data`` (a one-node NodeData)."""
    trainer = trainer_for(task, "adam", batch_size)
    k_init, k_train = jax.random.split(key)
    state = trainer.init(k_train, task.init(k_init), 1)
    state, _ = trainer.fit(state, data, steps, hyperparams={"learning_rate": learning_rate})
    return unstack(state.params)[0]


def unstack(stacked: PyTree) -> list[PyTree]:
    """The n single trees of a stacked tree."""
    n = int(jax.tree_util.tree_leaves(stacked)[0].shape[0])
    return [jax.tree.map(lambda x, i=i: x[i], stacked) for i in range(n)]


# ----------------------------------------------------------------------------- evaluation


@functools.lru_cache(maxsize=16)
def _metrics_jit(task: Task):
    return jax.jit(task.metrics)


def metrics(task: Task, params: PyTree, batch: Batch) -> dict[str, float]:
    """``task.metrics`` of one params tree on one batch, as Python floats."""
    out = _metrics_jit(task)(params, {k: jnp.asarray(v) for k, v in batch.items()})
    return {k: float(v) for k, v in out.items()}


@functools.lru_cache(maxsize=16)
def _stacked_metrics_jit(task: Task):
    return jax.jit(jax.vmap(task.metrics, in_axes=(0, None)))


def stacked_metrics(task: Task, stacked: PyTree, batch: Batch) -> dict[str, np.ndarray]:
    """``task.metrics`` of every node of a stacked tree on one batch: ``{metric: (n,) float64}``."""
    out = _stacked_metrics_jit(task)(stacked, {k: jnp.asarray(v) for k, v in batch.items()})
    return {k: np.asarray(v, np.float64) for k, v in out.items()}


@functools.lru_cache(maxsize=16)
def _class_probs_jit(task: Task):
    def probs(stacked, x):
        return jax.vmap(lambda p: jax.nn.softmax(task.apply(p, x).astype(jnp.float32), axis=-1))(stacked)

    return jax.jit(probs)


def class_probs(task: Task, stacked: PyTree, x: Any) -> np.ndarray:
    """(n, m, C) float64 predictive distribution of every node on the inputs ``x``."""
    return np.asarray(_class_probs_jit(task)(stacked, jnp.asarray(x)), np.float64)


def true_label_probs(probs: np.ndarray, y: Any) -> np.ndarray:
    """(n, m): each node's probability of the true label (the mixture-NLL weights' input)."""
    y = np.asarray(y)
    return probs[:, np.arange(len(y)), y]


def mixture_metrics(weights: np.ndarray, probs: np.ndarray, y: Any) -> dict[str, float]:
    """Loss and accuracy of the mixture of the nodes' predictions, ``sum_i w_i p_i(. | x)``."""
    y = np.asarray(y)
    mix = np.tensordot(np.asarray(weights, np.float64), probs, axes=1)
    loss = -np.mean(np.log(np.maximum(mix[np.arange(len(y)), y], 1e-12)))
    return {"loss": float(loss), "accuracy": float(np.mean(mix.argmax(-1) == y))}


@functools.lru_cache(maxsize=16)
def single_logits(task: Task):
    """``logits_fn(params, x) -> (C,)`` for one input, one object per task (a static jit argument)."""

    def logits_fn(params, x):
        return task.apply(params, x[None])[0]

    return logits_fn


# ----------------------------------------------------------------------------- reporting

# The result-file conventions are the harness's; re-exported for the quality scripts.
__all__ = [
    "class_probs",
    "command",
    "header",
    "iid_clients",
    "mean_std",
    "metrics",
    "mixture_metrics",
    "plot_path",
    "pm",
    "pretrain",
    "pyplot",
    "save",
    "shared_pool",
    "single_logits",
    "stacked_metrics",
    "stem",
    "subset",
    "trainer_for",
    "true_label_probs",
    "unstack",
]
