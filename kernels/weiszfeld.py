"""Vector-wise rules solved in Gram space: geometric median and centered clipping.

With deltas D (rows d_i = x_i - c) and G = D D^T, any point z = c + D^T a has
``||x_i - z||^2 = G_ii - 2 (G a)_i + a^T G a``. So iterations that only need
distances from the nodes to the current estimate run on n x n data; the
parameters are read once for G and once for the final weighted sum.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from kernels.compile_options import kernel_jit


def _dists_to_combination(g: jax.Array, a: jax.Array) -> jax.Array:
    ga = g @ a
    d2 = jnp.diagonal(g) - 2.0 * ga + a @ ga
    return jnp.sqrt(jnp.maximum(d2, 0.0))


@kernel_jit(static_argnames=("max_iter",))
def geometric_median_weights(
    g: jax.Array,
    valid: jax.Array,
    node_weights: jax.Array | None = None,
    *,
    max_iter: int = 100,
    eps: float = 1e-8,
    tol: float = 1e-6,
) -> tuple[jax.Array, jax.Array]:
    """Weiszfeld's algorithm for argmin_z sum_i alpha_i ||x_i - z|| in Gram space.

    Smoothed as in Pillutla et al. 2022 (RFA): w_i ∝ alpha_i / max(||x_i - z||, eps),
    which keeps the iteration defined when z lands on a node. Starts from the
    (alpha-weighted) mean; stops after ``max_iter`` iterations or when no
    weight moves by more than ``tol`` in one iteration.

    Args:
      g: (n, n) Gram matrix of centred node vectors.
      valid: (n,) bool; invalid nodes get weight 0.
      node_weights: optional (n,) alpha_i >= 0 (default uniform).
      max_iter: the most iterations run (static).
      eps: the floor of the distances in the weights (the smoothing).
      tol: stop once no weight moves by more than this in one iteration.

    Returns:
      (weights (n,) summing to 1, number of iterations run).

    References:
      Pillutla, Kakade and Harchaoui, "Robust Aggregation for Federated Learning", IEEE
      Transactions on Signal Processing, 2022.
    """
    alpha = valid.astype(jnp.float32) if node_weights is None else jnp.where(valid, node_weights, 0.0)
    alpha = alpha / jnp.sum(alpha)
    g = jnp.where(valid[:, None] & valid[None, :], g, 0.0)

    def cond(carry):
        _, it, change = carry
        return (it < max_iter) & (change > tol)

    def body(carry):
        a, it, _ = carry
        inv = alpha / jnp.maximum(_dists_to_combination(g, a), eps)
        a_new = inv / jnp.sum(inv)
        return a_new, it + 1, jnp.max(jnp.abs(a_new - a))

    a, it, _ = jax.lax.while_loop(cond, body, (alpha, jnp.int32(0), jnp.float32(jnp.inf)))
    return a, it


@kernel_jit(static_argnames=("iterations",))
def centered_clipping_coefficients(
    g: jax.Array, valid: jax.Array, tau: float, *, iterations: int = 1
) -> jax.Array:
    """Centered clipping (Karimireddy, He and Jaggi 2021) in Gram space.

    v_{l+1} = v_l + (1/m) sum_i clip_tau(x_i - v_l), clip_tau(u) = u min(1, tau/||u||),
    starting from the centre v_0 = c (the point G is centred on). Writing
    v_l = c + D^T a_l, each step is a_{l+1} = a_l (1 - mean(s)) + s/m with
    s_i = min(1, tau / ||x_i - v_l||).

    Args:
      g: (n, n) Gram matrix of the node vectors centred on c.
      valid: (n,) bool; invalid nodes get coefficient 0.
      tau: the clipping radius.
      iterations: the number of clipping steps l (static).

    Returns:
      (n,) coefficients a (not summing to 1: the rest, 1 - sum(a), stays on c).

    References:
      Karimireddy, He and Jaggi, "Learning from History for Byzantine Robust Optimization",
      ICML 2021.
    """
    m = jnp.sum(valid.astype(jnp.float32))
    g = jnp.where(valid[:, None] & valid[None, :], g, 0.0)
    n = g.shape[0]

    def step(_, a):
        dist = _dists_to_combination(g, a)
        s = jnp.where(valid, jnp.minimum(1.0, tau / jnp.maximum(dist, 1e-30)), 0.0)
        return a * (1.0 - jnp.sum(s) / m) + s / m

    return jax.lax.fori_loop(0, iterations, step, jnp.zeros(n, jnp.float32))


@kernel_jit
def clip_factors(sq_norms: jax.Array, max_norm: float) -> jax.Array:
    """Clipping factors min(1, C / ||u_i||) per row from squared norms (1 for zero rows).

    Args:
      sq_norms: (n,) squared norms ||u_i||^2.
      max_norm: the clipping norm C.

    Returns:
      (n,) factors in (0, 1].
    """
    norms = jnp.sqrt(jnp.maximum(sq_norms, 0.0))
    return jnp.where(norms > max_norm, max_norm / jnp.maximum(norms, 1e-30), 1.0)


@kernel_jit(static_argnames=("f",))
def nnm_matrix(d2: jax.Array, f: int, valid: jax.Array) -> jax.Array:
    """Nearest-neighbour mixing matrix (Allouah et al. 2023, "Fixing by Mixing").

    Row i averages the m - f valid nodes nearest to node i, node i itself
    included (distance 0), ties to the lower index. Rows of invalid nodes are 0.

    Args:
      d2: (n, n) squared distances.
      f: the number of Byzantine nodes tolerated (static).
      valid: (n,) bool.

    Returns:
      (n, n) float32 row-stochastic mixing matrix over the valid nodes.

    References:
      Allouah, Farhadkhani, Guerraoui, Gupta, Pinot and Stephan, "Fixing by Mixing: A Recipe for
      Optimal Byzantine ML under Heterogeneity", AISTATS 2023.
    """
    n = d2.shape[0]
    m = jnp.sum(valid.astype(jnp.int32))
    k = m - f
    d = jnp.where(valid[None, :], d2, jnp.inf)
    d = jnp.where(jnp.eye(n, dtype=bool), -1.0, d)  # self first, always
    order = jnp.argsort(d, axis=1, stable=True)
    ranks = jnp.argsort(order, axis=1, stable=True)
    mix = (ranks < k).astype(jnp.float32) / jnp.maximum(k, 1).astype(jnp.float32)
    return jnp.where(valid[:, None] & valid[None, :], mix, 0.0)
