"""Node-side statistics for the merge methods that need more than the parameters.

* the diagonal empirical Fisher (Fisher merging, :func:`consensus.fisher_merge`):
  ``F = mean over the node's examples of (grad of the example's loss)^2``;
* the input Gram matrices ``G = X^T X`` of the Dense layers (RegMean,
  :func:`consensus.regmean`), X the rows fed into each layer.

Both come from one jitted call over the node's batch. The system's round does
not send them yet (the coordinator wiring is pending); benchmarks and
notebooks call :func:`node_statistics` per node and stack the results.

What they reveal: the Gram matrices are second moments of the node's inputs
(see :func:`consensus.regmean`); the Fisher is a mean of squared gradients.
Neither is differentially private.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from consensus import tree

PyTree = Any
Array = jax.Array

_DENSE = re.compile(r"^dense_(\d+)$")


class NodeStatistics(NamedTuple):
    """One node's statistics.

    Attributes:
      fisher: tree like the params, the diagonal empirical Fisher (float32).
      grams: {leaf path of a Dense kernel: (d_in, d_in) float32 X^T X}, paths as
        :func:`consensus.tree.leaf_paths` writes them (what ``regmean(grams=...)`` reads).
      count: number of examples used.
    """

    fisher: PyTree
    grams: dict[str, Array]
    count: int  # type: ignore[assignment]  # a NamedTuple field named like tuple.count


def mlp_layer_inputs(params: PyTree, inputs: Array) -> dict[str, Array]:
    """Inputs of every Dense layer of a ReLU MLP with params ``{"dense_i": {"kernel", "bias"}}``.

    The architecture of :class:`strategies.tasks.digits.MLP` (and the
    Fashion-MNIST MLP): ``x_{i+1} = relu(x_i W_i + b_i)``, no activation after
    the last layer. Tasks with other models pass their own ``layer_inputs`` to
    :func:`node_statistics`.

    Args:
      params: the MLP's parameters, keys ``dense_0`` ... ``dense_(L-1)`` only.
      inputs: (B, d) inputs of the first layer.

    Returns:
      {leaf path of dense_i's kernel: (B, d_in) x_i}, float32.

    Raises:
      TypeError: when ``params`` is not a dict.
      ValueError: when its keys are not exactly ``dense_0`` ... ``dense_(L-1)``.
    """
    if not isinstance(params, Mapping):
        raise TypeError(
            f"mlp_layer_inputs: params must be a dict of dense_i layers, got {type(params).__name__}"
        )
    layers = sorted((int(m.group(1)), k) for k in params if (m := _DENSE.match(str(k))))
    if not layers or [i for i, _ in layers] != list(range(len(layers))) or len(layers) != len(params):
        raise ValueError(
            f"mlp_layer_inputs: expected params with keys dense_0 ... dense_(L-1) only, "
            f"got {sorted(params)}; pass layer_inputs= for other models"
        )
    out = {}
    x = inputs
    for i, name in layers:
        layer = params[name]
        out[f"[{name!r}]['kernel']"] = x.astype(jnp.float32)
        x = x.astype(layer["kernel"].dtype) @ layer["kernel"] + layer["bias"]
        if i < len(layers) - 1:
            x = jax.nn.relu(x)
    return out


@functools.partial(jax.jit, static_argnames=("loss_fn", "layer_inputs", "chunk_size"))
def _statistics(params, batch, loss_fn, layer_inputs, chunk_size):
    num = jax.tree_util.tree_leaves(batch)[0].shape[0]

    def example_sq_grad(example):
        one = jax.tree.map(lambda a: a[None], example)
        g = jax.grad(lambda p: loss_fn(p, one))(params)
        return jax.tree.map(lambda v: jnp.square(v.astype(jnp.float32)), g)

    # Chunks of examples under lax.map keep the per-example gradients' memory at chunk_size copies.
    pad = (-num) % chunk_size
    padded = jax.tree.map(lambda a: jnp.concatenate([a, jnp.repeat(a[:1], pad, axis=0)]) if pad else a, batch)
    weights = jnp.concatenate([jnp.ones((num,), jnp.float32), jnp.zeros((pad,), jnp.float32)])
    chunks = jax.tree.map(lambda a: a.reshape((-1, chunk_size) + a.shape[1:]), padded)
    wchunks = weights.reshape(-1, chunk_size)

    def chunk_sum(args):
        ex, w = args
        sq = jax.vmap(example_sq_grad)(ex)
        return jax.tree.map(lambda s: jnp.tensordot(w, s, axes=1), sq)

    sums = jax.lax.map(chunk_sum, (chunks, wchunks))
    fisher = jax.tree.map(lambda s: jnp.sum(s, axis=0) / num, sums)
    x = batch["x"]
    grams = {
        k: jnp.dot(v.T, v, precision=jax.lax.Precision.HIGHEST) for k, v in layer_inputs(params, x).items()
    }
    return fisher, grams


def node_statistics(
    loss_fn: Callable[[PyTree, Mapping[str, Array]], Array],
    params: PyTree,
    batch: Mapping[str, Any],
    *,
    layer_inputs: Callable[[PyTree, Array], dict[str, Array]] = mlp_layer_inputs,
    chunk_size: int = 64,
) -> NodeStatistics:
    """The diagonal empirical Fisher and the Dense layers' input Grams of one node, in one jitted call.

    Args:
      loss_fn: ``loss_fn(params, batch) -> scalar`` mean loss (e.g. ``task.loss``), called on
        one-example batches for the per-example gradients.
      params: the node's parameters (its fine-tuned model).
      batch: the node's examples, a dict with ``"x"`` (inputs) and the labels; every leaf has the
        example axis first. Padding rows must be removed beforehand.
      layer_inputs: ``(params, x) -> {kernel leaf path: (B, d_in)}``, default
        :func:`mlp_layer_inputs` (the digits / Fashion-MNIST MLP).
      chunk_size: examples per vmapped chunk of per-example gradients.

    Returns:
      :class:`NodeStatistics`; the Gram keys are checked against the params' leaf paths.

    Raises:
      ValueError: for a batch without ``"x"`` or without an example, ``chunk_size < 1``, or
        Gram keys that are not leaf paths of ``params``.
    """
    if "x" not in batch:
        raise ValueError(f"node_statistics: batch needs an 'x' entry, got keys {sorted(batch)}")
    num = jax.tree_util.tree_leaves(batch)[0].shape[0]
    if num < 1:
        raise ValueError("node_statistics: the batch has no example")
    if chunk_size < 1:
        raise ValueError(f"node_statistics: chunk_size must be >= 1, got {chunk_size}")
    chunk = min(int(chunk_size), int(num))
    fisher, grams = _statistics(params, dict(batch), loss_fn, layer_inputs, chunk)
    unknown = sorted(set(grams) - set(tree.leaf_paths(params)))
    if unknown:
        raise ValueError(f"node_statistics: layer_inputs returned unknown leaf paths {unknown}")
    return NodeStatistics(fisher, dict(grams), int(num))


def _is_linear_kernel(path: str, leaf: Any) -> bool:
    return path.endswith("['kernel']") and getattr(leaf, "ndim", 0) == 2


@functools.partial(jax.jit, static_argnames=("loss_fn", "paths"))
def _linear_grams(params, batch, loss_fn, paths):
    from strategies.models.layers import GramKernel

    flat, treedef = jax.tree_util.tree_flatten_with_path(params)
    names = [jax.tree_util.keystr(p) for p, _ in flat]
    probes = {
        name: jnp.zeros((leaf.shape[0], leaf.shape[0]), jnp.float32)
        for name, (_, leaf) in zip(names, flat, strict=True)
        if name in paths
    }

    def loss(probes):
        leaves = [GramKernel(leaf, probes[name]) if name in probes else leaf
                  for name, (_, leaf) in zip(names, flat, strict=True)]  # fmt: skip
        return loss_fn(jax.tree_util.tree_unflatten(treedef, leaves), batch)

    return jax.grad(loss)(probes)


def linear_input_grams(
    loss_fn: Callable[[PyTree, Mapping[str, Array]], Array],
    params: PyTree,
    batch: Mapping[str, Any],
    *,
    select: Callable[[str, Any], bool] = _is_linear_kernel,
    chunk_size: int = 8,
) -> dict[str, Array]:
    """The input Gram matrices ``X^T X`` of every linear layer of a :mod:`strategies.models` model.

    RegMean's statistics (:func:`consensus.regmean`) for the Hugging Face families (Llama,
    Qwen2, GPT-2), whose layers call ``x @ kernel`` through :class:`strategies.models.layers.Linear`:
    every selected kernel is swapped for a :class:`~strategies.models.layers.GramKernel`, whose
    probe's gradient is the Gram matrix of the rows the layer received, so one backward pass of
    ``loss_fn`` collects all of them (scanned blocks included) without a model hook. ``X`` holds
    every position of every example (a causal LM's tokens), float32; summed, not averaged.

    Args:
      loss_fn: ``loss_fn(params, batch) -> scalar`` (e.g. ``task.loss``); only its forward pass
        matters (the Grams do not depend on the loss's value).
      params: the node's model.
      batch: the node's examples (example axis first).
      select: ``select(path, leaf)``: which leaves are linear kernels ``(in, out)`` read as
        ``x @ kernel`` (default: 2-D leaves named ``kernel``).
      chunk_size: examples per backward pass (memory: one chunk's activations).

    Returns:
      ``{leaf path (consensus.tree.leaf_paths): (in, in) float32}``.

    Raises:
      ValueError: when ``select`` picks no leaf, the batch is empty or ``chunk_size < 1``.
    """
    flat, _ = jax.tree_util.tree_flatten_with_path(params)
    paths = tuple(jax.tree_util.keystr(p) for p, leaf in flat if select(jax.tree_util.keystr(p), leaf))
    if not paths:
        raise ValueError("linear_input_grams: no leaf is a linear kernel; pass select=")
    num = jax.tree_util.tree_leaves(batch)[0].shape[0]
    if num < 1:
        raise ValueError("linear_input_grams: the batch has no example")
    if chunk_size < 1:
        raise ValueError(f"linear_input_grams: chunk_size must be >= 1, got {chunk_size}")
    total: dict[str, Array] | None = None
    for start in range(0, num, chunk_size):
        part = {k: v[start : start + chunk_size] for k, v in batch.items()}
        grams = _linear_grams(params, part, loss_fn, paths)
        total = grams if total is None else jax.tree.map(jnp.add, total, grams)
    assert total is not None
    return dict(total)
