"""Example-level DP-SGD inside the node trainer (Abadi et al. 2016), on fixed shapes.

One DP-SGD step of one node, as the trainer's vmapped step runs it:

1. **Poisson sampling** (:func:`poisson_rows`): every one of the node's ``N`` rows joins the
   step's batch independently with probability ``q`` (``q = min(1, B / N)`` for an expected
   batch size ``B``, :func:`sampling_rates`). The draw ``u < q`` uses float32 uniforms, which
   take the values ``k / 2^23``: the exact inclusion probability is ``ceil(q 2^23) / 2^23``
   (:func:`effective_rate`), and that is the rate the accountant is given.
2. **Fixed shapes**: the selected rows are gathered into a padded batch of ``pad`` rows with a
   mask. When more than ``pad`` rows are selected (an *overflow*) the step keeps the first
   ``pad`` of them. That step is not the Poisson mechanism, so the overflow probability is
   counted in delta: for an accountant's (epsilon, delta_acc) and a per-step overflow
   probability p (the binomial tail P[Binomial(N + 1, q) > pad], the larger of the two
   neighbouring datasets), the truncated mechanism is (epsilon, delta_acc + (1 + e^epsilon) T p)
   DP over T steps (the two outputs differ from the untruncated ones in total variation by at
   most T p each). :func:`padded_size` picks the smallest pad that keeps this term under a
   given share of delta.
3. **Per-example clipping** (:func:`private_gradient`): every selected row's gradient clipped
   to L2 norm ``C`` (the whole tree's norm), masked, summed, plus Gaussian noise of std ``z C``
   on every coordinate, divided by the expected batch size ``q N``. The optimizer (Adam, ...)
   takes this as its gradient: everything after the noise is post-processing. Two ways to the
   clipped sum, with the same value (up to float32 rounding):

   * **fast path, ghost clipping** (:func:`ghost_clipped_sum`), when the task supplies
     :class:`DenseTaps` (``task.dp_dense_taps()`` not None: the digits and Fashion-MNIST MLPs
     without dropout). Every parameter belongs to a dense layer ``y = a W + b`` applied once
     per example, so example i's gradient of that layer is ``(a_i^T g_i, g_i)`` with ``g_i =
     dL_i/dy_i`` and its squared norm is ``(||a_i||^2 + 1) ||g_i||^2`` (the "ghost norm",
     Goodfellow 2015; Li et al. 2022). One forward pass and one backward pass to the layer
     outputs give every example's norm without any per-example gradient; a second backward
     pass of ``sum_i w_i L_i`` with ``w_i = mask_i min(1, C / norm_i)`` gives the clipped sum
     (the book-keeping of Bu et al. 2023 in its two-pass form). ``microbatch`` is ignored
     there (nothing per-example is materialized; the memory is a plain batch's).
   * **generic path** (:func:`clipped_sum`), for any other model (CNN, transformer, dropout):
     ``vmap(grad)`` of the task's loss on one-row batches (in micro-batches of ``microbatch``
     rows scanned in sequence, so the per-example gradients of only one micro-batch are
     alive at a time), each clipped, masked and summed.

Sensitivity: under add/remove-one-example adjacency the clipped sum changes by at most C in
L2, so the noise multiplier z is the noise std over the sensitivity, and each step is the
Poisson-subsampled Gaussian mechanism with rate q and multiplier z; the package's accountants
(:mod:`consensus.privacy`) compose the T steps.

Why our own clipping rather than ``optax.contrib.differentially_private_aggregate`` or
jax_privacy: optax's transform expects per-example gradients already computed and draws its
noise from a seed in its state (we need the trainer's per-node, per-step keys for bit-exact
resume and no state), and it divides by the padded batch rather than the expected Poisson
batch; jax_privacy would be a heavy dependency for twenty lines of tree arithmetic. The noise
key scheme here is part of the contract and tested: leaf j of the tree (in ``jax.tree.leaves``
order) draws ``normal(split(key, num_leaves)[j], leaf.shape)``.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from scipy import stats

PyTree = Any

# float32 uniforms in [0, 1) are multiples of 2^-23 (jax.random.uniform fills the mantissa).
_UNIFORM_GRID = 2.0**23


class ExampleDP(NamedTuple):
    """Per-node DP-SGD settings handed to :meth:`strategies.trainer.NodeTrainer.fit`.

    Attributes:
      clip_norm: (n,) or scalar C, the per-example gradient's L2 bound.
      noise_multiplier: (n,) or scalar z; the noise std on the clipped sum is z C.
      pad: padded batch size (static; see :func:`padded_size`).
      microbatch: per-example gradients are computed this many rows at a time (static; 0: all
        ``pad`` rows at once); it must divide ``pad`` (``padded_size(..., multiple=microbatch)``).
        Generic path only.
      ghost: use the fast path (ghost clipping) when the task supplies :class:`DenseTaps`
        (static; False: always the generic per-example path, e.g. as a reference).
    """

    clip_norm: Any
    noise_multiplier: Any
    pad: int
    microbatch: int = 0
    ghost: bool = True


class DenseTaps(NamedTuple):
    """A task's model seen as dense layers, for ghost clipping (:func:`ghost_clipped_sum`).

    The contract (the task vouches for it; the parameter count is checked): every parameter
    leaf is the kernel ``(in_l, out_l)`` or the bias ``(out_l,)`` of one of the layers, each
    layer computes ``y = a W + b`` once per example (no weight sharing across positions), and
    the per-example loss of a row depends only on that row.

    Attributes:
      widths: ``out_l`` of every layer, in order.
      loss: ``loss(params, batch, offsets) -> (losses (B,), inputs)``: the per-example losses
        (float32) and, per layer, its input ``a`` (B, in_l); ``offsets[l]`` (B, out_l, zeros,
        float32) is added to layer l's output ``y`` (so its cotangent is ``dL/dy``).
    """

    widths: tuple[int, ...]
    loss: Callable


def sampling_rates(counts: Any, expected_batch: int) -> np.ndarray:
    """Per-node Poisson rates ``q_i = min(1, B / N_i)`` as float32 (the values the device uses).

    Args:
      counts: (n,) rows N_i of each node's shard.
      expected_batch: B, the expected batch size.

    Returns:
      (n,) float32 rates.

    Raises:
      ValueError: for a node without rows or ``expected_batch < 1``.
    """
    c = np.asarray(counts, np.float64)
    if np.any(c < 1):
        raise ValueError(f"every node needs at least one row to sample, got counts {c.tolist()}")
    if expected_batch < 1:
        raise ValueError(f"expected batch size must be >= 1, got {expected_batch}")
    return np.minimum(1.0, expected_batch / c).astype(np.float32)


def effective_rate(q32: Any) -> np.ndarray:
    """The exact inclusion probability of ``uniform_float32 < q32``: ``ceil(q 2^23) / 2^23``, float64.

    Args:
      q32: float32 rates.

    Returns:
      float64 probabilities, at most 1.
    """
    q = np.asarray(q32, np.float32).astype(np.float64)
    return np.minimum(1.0, np.ceil(q * _UNIFORM_GRID) / _UNIFORM_GRID)


def overflow_probability(count: int, rate: float, pad: int) -> float:
    """P[Binomial(count + 1, rate) > pad]: one step's overflow probability on the larger neighbour.

    Args:
      count: the node's rows.
      rate: the sampling rate.
      pad: the padded batch size.

    Returns:
      The probability.
    """
    return float(stats.binom.sf(pad, int(count) + 1, float(rate)))


def padded_size(counts: Any, rates: Any, max_probability: float, multiple: int = 1) -> int:
    """The smallest pad (a multiple of ``multiple``) with every node's overflow probability bounded.

    The per-step overflow probability must be at most ``max_probability`` for every node
    (``counts[i]`` rows at rate ``rates[i]``).

    Args:
      counts: (n,) rows of each node.
      rates: (n,) sampling rates.
      max_probability: the bound, in (0, 1).
      multiple: the pad is rounded up to a multiple of this (the microbatch).

    Returns:
      The pad.

    Raises:
      ValueError: for ``max_probability`` outside (0, 1).
    """
    if not (0.0 < max_probability < 1.0):
        raise ValueError(f"max_probability must lie in (0, 1), got {max_probability}")
    counts = np.asarray(counts, np.int64).reshape(-1)
    rates = np.asarray(rates, np.float64).reshape(-1)
    pad = 1
    for n, q in zip(counts, rates, strict=True):
        # The tail falls faster than geometrically past the mean: start there and walk up.
        b = max(pad, int(math.floor((n + 1) * q)))
        while b < n + 1 and overflow_probability(n, q, b) > max_probability:
            b += max(1, int(math.sqrt((n + 1) * q)) // 4)
        pad = max(pad, min(b, int(n) + 1))
    return int(-(-pad // multiple) * multiple)


def poisson_rows(
    key: jax.Array, index: jax.Array | None, count: jax.Array, rate: jax.Array, pad: int, rows: int
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """One Poisson draw of a node's rows, gathered into ``pad`` slots.

    Args:
      key: the step's sampling key.
      index: (k,) the node's candidate pool rows (None: row j of the pool is candidate j).
      count: number of valid candidates (the first ``count``).
      rate: inclusion probability (float32 scalar).
      pad: slots of the padded batch (static).
      rows: number of candidates k (static).

    Returns:
      ``(pool_rows, mask, selected)``: (pad,) int32 rows, (pad,) bool mask of the filled slots,
      and the number of candidates selected (more than ``pad`` on an overflow; then the first
      ``pad`` selected candidates fill the slots).
    """
    u = jax.random.uniform(key, (rows,), jnp.float32)
    chosen = (u < rate) & (jnp.arange(rows) < count)
    selected = jnp.sum(chosen, dtype=jnp.int32)
    (pos,) = jnp.nonzero(chosen, size=pad, fill_value=0)
    mask = jnp.arange(pad) < selected
    pool_rows = pos if index is None else index[pos]
    return pool_rows.astype(jnp.int32), mask, selected


def _tree_norm(tree: PyTree) -> jax.Array:
    return jnp.sqrt(sum(jnp.sum(jnp.square(x.astype(jnp.float32))) for x in jax.tree.leaves(tree)))


def gaussian_noise(key: jax.Array, like: PyTree, std: jax.Array) -> PyTree:
    """``std * normal`` shaped like ``like``; leaf j uses ``split(key, num_leaves)[j]``.

    Args:
      key: the noise key.
      like: a tree whose leaves give the shapes.
      std: the standard deviation.

    Returns:
      float32 noise shaped like ``like``.
    """
    leaves, treedef = jax.tree.flatten(like)
    keys = jax.random.split(key, len(leaves))
    noise = [std * jax.random.normal(k, x.shape, jnp.float32) for k, x in zip(keys, leaves, strict=True)]
    return jax.tree.unflatten(treedef, noise)


def clipped_sum(
    loss_fn: Callable,
    params: PyTree,
    batch: dict,
    mask: jax.Array,
    key: jax.Array,
    clip_norm: jax.Array,
    microbatch: int = 0,
) -> tuple[PyTree, jax.Array]:
    """Sum over the masked rows of per-example gradients clipped to L2 norm ``clip_norm``.

    ``loss_fn(params, one_row_batch, key)`` is the task's loss on a batch of one row (row j's
    key is ``fold_in(key, j)``, for tasks with dropout).

    Args:
      loss_fn: ``loss_fn(params, one_row_batch, key) -> scalar``.
      params: the node's parameters.
      batch: the padded batch, ``pad`` rows per leaf.
      mask: (pad,) bool, the filled slots.
      key: the step's key.
      clip_norm: C.
      microbatch: rows per chunk of per-example gradients (0: all at once); must divide ``pad``.

    Returns:
      ``(sum, mean masked loss)``: the float32 clipped sum shaped like ``params``.

    Raises:
      ValueError: when ``microbatch`` does not divide the padded batch.
    """
    pad = mask.shape[0]
    m = pad if microbatch <= 0 or microbatch >= pad else microbatch
    if pad % m:
        raise ValueError(f"microbatch {m} must divide the padded batch {pad}")

    def one(row, k):
        single = jax.tree.map(lambda v: v[None], row)
        loss, g = jax.value_and_grad(loss_fn)(params, single, k)
        scale = jnp.minimum(1.0, clip_norm / jnp.maximum(_tree_norm(g), 1e-30))
        return loss, jax.tree.map(lambda x: (x * scale).astype(jnp.float32), g)

    keys = jax.vmap(lambda j: jax.random.fold_in(key, j))(jnp.arange(pad))

    def chunk(rows, ks, msk):
        losses, grads = jax.vmap(one)(rows, ks)
        w = msk.astype(jnp.float32)
        summed = jax.tree.map(lambda g: jnp.tensordot(w, g, axes=1), grads)
        return summed, jnp.sum(losses * w)

    if m == pad:
        total, loss_sum = chunk(batch, keys, mask)
    else:
        split = _microbatches(pad // m)
        xs = (jax.tree.map(split, batch), split(keys), split(mask))
        zero = jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), params)

        def body(carry, x):
            s, ls = chunk(*x)
            return (jax.tree.map(jnp.add, carry[0], s), carry[1] + ls), None

        (total, loss_sum), _ = jax.lax.scan(body, (zero, jnp.zeros((), jnp.float32)), xs)
    count = jnp.maximum(jnp.sum(mask, dtype=jnp.float32), 1.0)
    return total, loss_sum / count


def ghost_clipped_sum(
    taps: DenseTaps, params: PyTree, batch: dict, mask: jax.Array, clip_norm: jax.Array
) -> tuple[PyTree, jax.Array]:
    """:func:`clipped_sum` of a dense-layer model without per-example gradients (ghost clipping).

    Example i's gradient norm is ``sqrt(sum_l (||a_il||^2 + 1) ||g_il||^2)`` from the layers'
    inputs ``a`` and output cotangents ``g`` (one forward and one backward pass), then the
    clipped sum is the gradient of ``sum_i w_i L_i`` with ``w_i = mask_i min(1, C / norm_i)``
    (a second backward pass of the same forward).

    Args:
      taps: the model seen as dense layers.
      params: the node's parameters.
      batch: the padded batch.
      mask: (pad,) bool, the filled slots.
      clip_norm: C.

    Returns:
      ``(sum, mean masked loss)`` as :func:`clipped_sum` does.

    Raises:
      ValueError: when the taps' layers do not match the widths or do not hold every parameter.
    """
    pad = mask.shape[0]
    offsets = tuple(jnp.zeros((pad, int(w)), jnp.float32) for w in taps.widths)
    losses, vjp, inputs = jax.vjp(lambda p, o: taps.loss(p, batch, o), params, offsets, has_aux=True)
    losses = losses.astype(jnp.float32)
    if len(inputs) != len(offsets):
        raise ValueError(f"DenseTaps: {len(inputs)} layer inputs for {len(offsets)} widths")
    covered = sum(a.shape[-1] * o.shape[-1] + o.shape[-1] for a, o in zip(inputs, offsets, strict=True))
    total_params = sum(x.size for x in jax.tree.leaves(params))
    if covered != total_params:
        raise ValueError(
            f"DenseTaps: the layers hold {covered} parameters, the model {total_params}; ghost clipping "
            "needs every parameter in a tapped dense layer (use ExampleDP(ghost=False))"
        )
    _, g = vjp(jnp.ones_like(losses))  # dL_i / dy_i per layer; the params' part is unused
    sq = sum(
        (jnp.sum(jnp.square(a.astype(jnp.float32)), -1) + 1.0) * jnp.sum(jnp.square(gl), -1)
        for a, gl in zip(inputs, g, strict=True)
    )
    scale = jnp.minimum(1.0, clip_norm / jnp.maximum(jnp.sqrt(sq), 1e-30))
    w = jnp.where(mask, scale, 0.0).astype(jnp.float32)
    total, _ = vjp(w)
    total = jax.tree.map(lambda x: x.astype(jnp.float32), total)
    count = jnp.maximum(jnp.sum(mask, dtype=jnp.float32), 1.0)
    return total, jnp.sum(jnp.where(mask, losses, 0.0)) / count


def _microbatches(chunks: int) -> Callable[[jax.Array], jax.Array]:
    """Reshape a leading axis of ``chunks * m`` rows into ``(chunks, m, ...)`` (micro-batches)."""
    return lambda x: x.reshape(chunks, x.shape[0] // chunks, *x.shape[1:])


def private_gradient(
    loss_fn: Callable,
    params: PyTree,
    batch: dict,
    mask: jax.Array,
    key: jax.Array,
    noise_key: jax.Array,
    clip_norm: jax.Array,
    noise_multiplier: jax.Array,
    expected_batch: jax.Array,
    microbatch: int = 0,
    taps: DenseTaps | None = None,
) -> tuple[jax.Array, PyTree]:
    """The DP-SGD gradient: ``(sum_i clip_C(g_i) + N(0, (z C)^2 I)) / expected_batch``.

    With ``taps`` the clipped sum takes the fast path (:func:`ghost_clipped_sum`; ``loss_fn``,
    ``key`` and ``microbatch`` are then unused), otherwise the generic per-example path
    (:func:`clipped_sum`).

    Args:
      loss_fn: ``loss_fn(params, one_row_batch, key) -> scalar`` (generic path).
      params: the node's parameters.
      batch: the padded batch.
      mask: (pad,) bool, the filled slots.
      key: the step's key (generic path: per-row keys for dropout).
      noise_key: the key of the Gaussian noise.
      clip_norm: C.
      noise_multiplier: z.
      expected_batch: the expected Poisson batch size (the divisor).
      microbatch: rows per chunk of per-example gradients (generic path).
      taps: the model as dense layers, for the fast path.

    Returns:
      ``(mean masked loss, gradient)``; the loss is for logs on the node only (it is computed
      from private rows without noise and must not leave the node).

    Raises:
      ValueError: as :func:`clipped_sum` or :func:`ghost_clipped_sum`.
    """
    if taps is not None:
        total, loss = ghost_clipped_sum(taps, params, batch, mask, clip_norm)
    else:
        total, loss = clipped_sum(loss_fn, params, batch, mask, key, clip_norm, microbatch)
    noise = gaussian_noise(noise_key, total, noise_multiplier * clip_norm)
    grads = jax.tree.map(lambda s, z, p: ((s + z) / expected_batch).astype(p.dtype), total, noise, params)
    return loss, grads
