r"""Held-out loss, gradient and diagonal curvature at a reference point, as trees.

The quadratic model behind :func:`consensus.convex.weights.quadratic_weights`
needs, at a reference point theta_0 and on a held-out batch of m examples,

.. math:: L_0 = \frac1m \sum_j \ell_j(\theta_0),\quad
          g = \nabla L_0,\quad h \approx \mathrm{diag}\,\nabla^2 L_0,\ h \ge 0.

Two PSD diagonal curvatures are provided:

* :func:`empirical_fisher`: ``h = (1/m) sum_j (grad l_j)^2`` for any per-example
  loss (per-example gradients with ``jax.vmap``);
* :func:`softmax_gauss_newton`: the exact diagonal of the generalized
  Gauss-Newton matrix of the softmax cross-entropy,
  ``h = (1/m) sum_j [sum_c p_c (dz_c)^2 - (sum_c p_c dz_c)^2]``, with z the
  logits and dz_c their gradients; for softmax cross-entropy it equals the
  diagonal of the (true) Fisher information.

Examples are processed in chunks of ``chunk_size`` under ``lax.scan`` so memory
is ``chunk_size`` per-example gradients, not m. Both functions are jitted once
per (loss function, shapes).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

PyTree = Any


class LossModel(NamedTuple):
    """Held-out loss, gradient and diagonal curvature at a reference point.

    Attributes:
      loss: scalar float32, mean held-out loss.
      grad: tree like the params, gradient of the mean loss.
      curvature: tree like the params, diagonal curvature (>= 0).
    """

    loss: jax.Array
    grad: PyTree
    curvature: PyTree


def _num_examples(batch: PyTree) -> int:
    leaves = jax.tree_util.tree_leaves(batch)
    if not leaves:
        raise ValueError("held-out batch has no arrays")
    sizes = {jnp.shape(x)[0] if jnp.ndim(x) else None for x in leaves}
    if len(sizes) != 1 or None in sizes:
        raise ValueError(f"held-out batch arrays disagree on the leading example axis: sizes {sizes}")
    m = sizes.pop()
    assert m is not None  # checked just above
    if m < 1:
        raise ValueError("held-out batch is empty")
    return m


def _chunked_mean(per_example: Callable[[PyTree], PyTree], batch: PyTree, chunk_size: int) -> PyTree:
    """Mean over examples of ``per_example(example)``, in chunks (inside jit)."""
    m = jax.tree_util.tree_leaves(batch)[0].shape[0]
    chunk = min(chunk_size, m)
    k = -(-m // chunk)
    pad = k * chunk - m

    def padded(a):
        a = jnp.concatenate([a, jnp.zeros((pad, *a.shape[1:]), a.dtype)]) if pad else a
        return a.reshape(k, chunk, *a.shape[1:])

    chunks = jax.tree.map(padded, batch)
    valid = (jnp.arange(k * chunk) < m).reshape(k, chunk)
    example0 = jax.tree.map(lambda a: a[0], batch)
    shapes = jax.eval_shape(per_example, example0)
    zeros = jax.tree.map(lambda s: jnp.zeros(s.shape, jnp.float32), shapes)

    def body(acc, xs):
        ex, ok = xs
        stats = jax.vmap(per_example)(ex)
        # Padded examples are zeros; where() (not a multiply) keeps any NaN they
        # produce out of the sum.
        summed = jax.tree.map(
            lambda s: jnp.sum(
                jnp.where(ok.reshape(-1, *([1] * (s.ndim - 1))), s.astype(jnp.float32), 0.0), axis=0
            ),
            stats,
        )
        return jax.tree.map(jnp.add, acc, summed), None

    total, _ = jax.lax.scan(body, zeros, (chunks, valid))
    return jax.tree.map(lambda t: t / jnp.float32(m), total)


def _cast_like(t: PyTree, like: PyTree) -> PyTree:
    return jax.tree.map(lambda a, p: a.astype(jnp.result_type(p)), t, like)


@functools.partial(jax.jit, static_argnums=(0, 3))
def _empirical_fisher(example_loss, params, batch, chunk_size):
    def per_example(ex):
        loss, g = jax.value_and_grad(example_loss)(params, ex)
        g32 = jax.tree.map(lambda a: a.astype(jnp.float32), g)
        return loss.astype(jnp.float32), g32, jax.tree.map(jnp.square, g32)

    loss, g, h = _chunked_mean(per_example, batch, chunk_size)
    return LossModel(loss, _cast_like(g, params), _cast_like(h, params))


def empirical_fisher(
    example_loss: Callable[[PyTree, PyTree], jax.Array],
    params: PyTree,
    batch: PyTree,
    *,
    chunk_size: int = 256,
) -> LossModel:
    r"""Held-out loss, gradient and diagonal empirical Fisher at ``params``.

    .. math:: h = \frac1m \sum_j (\nabla \ell_j(\theta_0))^{\odot 2}

    Args:
      example_loss: ``example_loss(params, example) -> scalar`` for ONE example
        (a slice of ``batch`` along its leading axis). Must be hashable (a
        module-level function or a fixed ``functools.partial``): it is a static
        argument of the jitted estimator.
      params: the reference point theta_0.
      batch: held-out examples, a tree of arrays with a leading axis of size m.
      chunk_size: examples per vmapped chunk.

    Returns:
      :class:`LossModel` with float32 loss and trees in the params' dtypes.

    Example:
      >>> import optax
      >>> def example_loss(p, ex): return optax.softmax_cross_entropy_with_integer_labels(
      ...     ex["x"] @ p["w"] + p["b"], ex["y"])
      >>> ref = {"w": jnp.zeros((3, 2)), "b": jnp.zeros(2)}
      >>> x_val, y_val = jnp.ones((4, 3)), jnp.array([0, 1, 1, 0])
      >>> model = empirical_fisher(example_loss, ref, {"x": x_val, "y": y_val})
      >>> round(float(model.loss), 4)  # log 2: both classes at probability 1/2
      0.6931
      >>> model.curvature["b"]  # every example's bias gradient is +-1/2
      Array([0.25, 0.25], dtype=float32)

    Raises:
      ValueError: If ``chunk_size`` < 1 or the batch is empty or its arrays disagree on the
        number of examples.

    References:
      Kunstner, Balles & Hennig, "Limitations of the empirical Fisher approximation", NeurIPS 2019
      (why :func:`softmax_gauss_newton` is preferred where it applies).
    """
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    _num_examples(batch)
    return _empirical_fisher(example_loss, params, batch, int(chunk_size))


@functools.partial(jax.jit, static_argnums=(0, 4))
def _softmax_gauss_newton(logits_fn, params, inputs, labels, chunk_size):
    def per_example(ex):
        x, y = ex
        z, vjp = jax.vjp(lambda p: logits_fn(p, x).astype(jnp.float32), params)
        if z.ndim != 1:
            raise ValueError(
                f"logits_fn must return a (num_classes,) vector per example, got shape {z.shape}"
            )
        c = z.shape[0]
        p = jax.nn.softmax(z)
        loss = jax.nn.logsumexp(z) - z[y]
        # Gradients of every logit: C vector-Jacobian products, (C, *leaf).
        (dz,) = jax.vmap(vjp)(jnp.eye(c, dtype=jnp.float32))
        dz = jax.tree.map(lambda a: a.astype(jnp.float32), dz)

        def contract(v, a):
            return jnp.tensordot(v, a, axes=1, precision=jax.lax.Precision.HIGHEST)

        mean_dz = jax.tree.map(lambda a: contract(p, a), dz)
        onehot = jax.nn.one_hot(y, c, dtype=jnp.float32)
        grad = jax.tree.map(lambda a: contract(p - onehot, a), dz)
        # Var_p(dz) >= 0 in exact arithmetic; clip the rounding.
        gn = jax.tree.map(
            lambda a, mu: jnp.maximum(contract(p, jnp.square(a)) - jnp.square(mu), 0.0), dz, mean_dz
        )
        return loss, grad, gn

    loss, g, h = _chunked_mean(per_example, (inputs, labels), chunk_size)
    return LossModel(loss, _cast_like(g, params), _cast_like(h, params))


def softmax_gauss_newton(
    logits_fn: Callable[[PyTree, jax.Array], jax.Array],
    params: PyTree,
    inputs: jax.Array,
    labels: jax.Array,
    *,
    chunk_size: int = 128,
) -> LossModel:
    """Mean cross-entropy, its gradient and the diagonal Gauss-Newton (= Fisher) curvature.

    For logits z(theta) of one example and p = softmax(z), the Gauss-Newton
    matrix of the cross-entropy is ``J^T (diag p - p p^T) J`` with J = dz/dtheta;
    its diagonal is ``sum_c p_c J_c^2 - (sum_c p_c J_c)^2`` (a variance, so
    >= 0). Computed with one vjp per class and example.

    Args:
      logits_fn: ``logits_fn(params, x) -> (C,) logits`` for ONE input x.
        Static argument of the jitted estimator (must be hashable).
      params: the reference point theta_0.
      inputs: (m, ...) held-out inputs.
      labels: (m,) integer labels in [0, C).
      chunk_size: examples per vmapped chunk (memory: chunk * C * params).

    Returns:
      :class:`LossModel`.

    Example:
      >>> def logits_fn(p, x): return x @ p["w"] + p["b"]
      >>> ref = {"w": jnp.zeros((3, 2)), "b": jnp.zeros(2)}
      >>> x_val, y_val = jnp.ones((4, 3)), jnp.array([0, 1, 1, 0])
      >>> model = softmax_gauss_newton(logits_fn, ref, x_val, y_val)
      >>> model.curvature["b"]  # p_c - p_c^2 at p = (1/2, 1/2)
      Array([0.25, 0.25], dtype=float32)

    Raises:
      ValueError: If ``chunk_size`` < 1, the inputs are empty or disagree with the labels on
        the number of examples, or ``logits_fn`` does not return a (num_classes,) vector.
      TypeError: If ``labels`` is not a 1-D integer array.

    References:
      Martens, "New insights and perspectives on the natural gradient method", JMLR 2020;
      Schraudolph, "Fast curvature matrix-vector products", 2002.
    """
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    m = _num_examples((inputs, labels))
    if jnp.ndim(labels) != 1 or not jnp.issubdtype(jnp.result_type(labels), jnp.integer):
        raise TypeError(
            f"labels must be a 1-D integer array of length {m}, got {jnp.result_type(labels)} "
            f"with shape {jnp.shape(labels)}"
        )
    return _softmax_gauss_newton(logits_fn, params, inputs, labels, int(chunk_size))
