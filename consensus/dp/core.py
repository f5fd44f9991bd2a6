"""The DP mechanism's jitted core: participation, clipping, noise, server step, adaptive clip.

See :mod:`consensus.dp` for the mechanism and its privacy argument.
"""

from __future__ import annotations

import functools
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from consensus import tree
from consensus.base import empty_info
from consensus.dp.state import (
    _COUNT_STREAM,
    _DEFAULT_SERVER,
    _NOISE_STREAM,
    _SAMPLE_STREAM,
    NEXT_STREAM,
    AdaptiveClipConfig,
    DPRoundInfo,
    DPState,
    MechanismSpec,
    effective_sampling_rate,
    raw_key,
    sample_participants,
)
from kernels import rows as row_kernels

PyTree = Any

# --- the mechanism -----------------------------------------------------------------------


def sum_noise_multiplier(cfg: MechanismSpec, m: float) -> float:
    """Return the sum's noise multiplier: z, or z_sum = (z^-2 - (2 sigma_b)^-2)^-1/2 under adaptive clipping.

    Args:
      cfg: The mechanism's static configuration (z, adaptive settings).
      m: The expected number of participants (sets the default count noise m / 20).

    Returns:
      The noise multiplier of the sum's release.

    Raises:
      ValueError: Under adaptive clipping with z > 0, when 2 sigma_b <= z.
    """
    z = cfg.noise_multiplier
    if cfg.adaptive is None or z == 0.0:
        return z
    sigma_b = _count_std(cfg, m)
    return (z**-2 - (2.0 * sigma_b) ** -2) ** -0.5


def _count_std(cfg: MechanismSpec, m: float) -> float:
    a = cfg.adaptive
    assert a is not None, "only adaptive clipping has a count"
    sigma_b = m / 20.0 if a.count_noise_multiplier is None else float(a.count_noise_multiplier)
    z = cfg.noise_multiplier
    if z > 0.0 and not 2.0 * sigma_b > z:
        raise ValueError(
            f"adaptive clipping: the count noise sigma_b={sigma_b} must exceed "
            f"noise_multiplier / 2 = {z / 2} "
            "(the sum's share of the budget, z_sum = (z^-2 - (2 sigma_b)^-2)^-1/2, is otherwise infinite); "
            "raise count_noise_multiplier or lower the noise multiplier"
        )
    return sigma_b


def participation(stacked, params, mask, key, clip_norm, cfg: MechanismSpec):
    """Decide the round's participants and their clip factors.

    Args:
      stacked: The stacked node trees.
      params: The current global tree (updates are x_i - params).
      mask: Optional (n,) bool of the nodes allowed to take part.
      key: The round's typed key (the Poisson sample's stream).
      clip_norm: C.
      cfg: The mechanism's static configuration.

    Returns:
      ``(valid, norms, scale)``: (n,) bool participants, (n,) update norms (0 for the others)
      and (n,) float32 clip factors ``min(1, C / ||u_i||)``.
    """
    n = tree.num_nodes(stacked)
    sq = tree.sq_norms(stacked, params)
    # A node holding NaN or Inf has a non-finite update norm, so this is tree.finite_mask
    # without a second pass over the stack. (A finite update whose squared norm overflows
    # float32, ~1e19, is excluded too: a decision on the node's own data, so DP is unaffected.)
    valid = jnp.isfinite(sq)
    if mask is not None:
        valid = valid & mask
    if cfg.sampling_rate < 1.0:
        valid = valid & sample_participants(jax.random.fold_in(key, _SAMPLE_STREAM), n, cfg.sampling_rate)
    norms = jnp.where(valid, jnp.sqrt(jnp.where(valid, sq, 0.0)), 0.0)
    # min(1, C / ||u||), written so that ||u|| = 0 gives 1 and never divides by zero.
    scale = jnp.where(norms > clip_norm, clip_norm / jnp.maximum(norms, 1e-30), 1.0)
    return valid, norms, scale.astype(jnp.float32)


def finish_release(
    delta, params, opt_state, key, clip_norm, valid, norms, scale, shardings, cfg, optimizer, m, unit
):
    """Add the noise, take the server step and update the adaptive clip norm.

    Args:
      delta: The merged clipped update, a tree like ``params``.
      params: The current global tree.
      opt_state: The server optimizer's state.
      key: The round's typed key.
      clip_norm: C this round.
      valid: (n,) bool participants.
      norms: (n,) update norms.
      scale: (n,) clip factors.
      shardings: Each params leaf's sharding or None (see :func:`shardings_of`).
      cfg: The mechanism's static configuration.
      optimizer: The server optimizer (optax).
      m: The denominator (expected participants).
      unit: The release's L2 sensitivity per unit of C.

    Returns:
      ``(new_params, opt_state, new_clip_norm, DPRoundInfo)``.
    """
    z_sum = sum_noise_multiplier(cfg, m)
    noise_std = jnp.float32(z_sum * unit) * clip_norm
    noise_key = jax.random.fold_in(key, _NOISE_STREAM)
    p_leaves, treedef = jax.tree_util.tree_flatten(params)
    d_leaves = treedef.flatten_up_to(delta)
    grads = []
    for i, (p, d, sh) in enumerate(zip(p_leaves, d_leaves, shardings, strict=True)):
        g = -d.astype(jnp.float32)
        if z_sum > 0.0:  # static: z = 0 (clipping only, epsilon = inf) draws no noise
            noise = jax.random.normal(jax.random.fold_in(noise_key, i), jnp.shape(p), jnp.float32)
            if sh is not None:
                noise = jax.lax.with_sharding_constraint(noise, sh)
            g = g - noise_std * noise
        grads.append(g.astype(jnp.result_type(p)))
    grads = treedef.unflatten(grads)
    updates, opt_state = optimizer.update(grads, opt_state, params)
    new_params = optax.apply_updates(params, updates)
    if any(sh is not None for sh in shardings):
        new_leaves = [
            x if sh is None else jax.lax.with_sharding_constraint(x, sh)
            for x, sh in zip(jax.tree_util.tree_leaves(new_params), shardings, strict=True)
        ]
        new_params = treedef.unflatten(new_leaves)
    new_clip = clip_norm
    frac = jnp.float32(jnp.nan)
    if cfg.adaptive is not None:
        a = cfg.adaptive
        unclipped = (valid & (norms <= clip_norm)).astype(jnp.float32)
        # Shift by 1/2 so that one node moves the count by at most 1/2 (TF-Privacy's
        # QuantileEstimatorQuery); the fixed denominator m keeps the sensitivity fixed.
        shifted = jnp.sum(jnp.where(valid, unclipped - 0.5, 0.0))
        count_noise = jnp.float32(_count_std(cfg, m)) * jax.random.normal(
            jax.random.fold_in(key, _COUNT_STREAM), (), jnp.float32
        )
        frac = jnp.clip((shifted + count_noise) / jnp.float32(m) + 0.5, 0.0, 1.0)
        new_clip = clip_norm * jnp.exp(
            -jnp.float32(a.learning_rate) * (frac - jnp.float32(a.target_quantile))
        )
    dp = DPRoundInfo(
        norms=norms,
        clip_scale=jnp.where(valid, scale, 0.0),
        clip_norm=clip_norm,
        noise_std=noise_std,
        unclipped_fraction=frac,
        participants=jnp.sum(valid.astype(jnp.int32)),
    )
    return new_params, opt_state, new_clip, dp


def shardings_of(params: PyTree) -> tuple:
    """Return each params leaf's sharding when it is a concrete array spread over several devices.

    Args:
      params: The global tree.

    Returns:
      One entry per leaf: its sharding, or None (a tracer, or one device).
    """
    out = []
    for p in jax.tree_util.tree_leaves(params):
        sh = (
            getattr(p, "sharding", None)
            if isinstance(p, jax.Array) and not isinstance(p, jax.core.Tracer)
            else None
        )
        out.append(sh if sh is not None and len(sh.device_set) > 1 else None)
    return tuple(out)


def check_update_args(stacked, params, mask, name: str):
    """Check a DP update's arguments.

    Args:
      stacked: The stacked node trees.
      params: The current global tree (required).
      mask: Optional (n,) bool mask.
      name: The aggregator's name, for messages.

    Returns:
      ``(n, mask)`` with the mask as a jax array (or None).

    Raises:
      ValueError: If ``params`` is None, does not match the stack, or the mask's shape is wrong.
      TypeError: If the mask is not boolean.
    """
    if params is None:
        raise ValueError(f"{name}: the current global params are required (updates are clipped around them)")
    tree.check_stacked_against(stacked, params)
    n = tree.num_nodes(stacked)
    if mask is not None:
        mask = jnp.asarray(mask)
        if mask.shape != (n,):
            raise ValueError(f"{name}: mask must have shape ({n},), got {mask.shape}")
        if mask.dtype != jnp.bool_:
            raise TypeError(f"{name}: mask must be boolean, got {mask.dtype}")
    return n, mask


def check_common_args(clip_norm, noise_multiplier, sampling_rate, expected_nodes, adaptive, server_optimizer):
    """Check the arguments every DP recipe shares.

    Args:
      clip_norm: C, finite and > 0.
      noise_multiplier: z, finite and >= 0.
      sampling_rate: q in (0, 1].
      expected_nodes: m, finite and > 0, or None.
      adaptive: An :class:`AdaptiveClipConfig` or None.
      server_optimizer: An optax transform, or None for ``optax.sgd(1.0)``.

    Returns:
      ``(C, z, q, m, optimizer)`` with q the exact sampling probability.

    Raises:
      ValueError: If a number is out of range.
      TypeError: If ``adaptive`` or ``server_optimizer`` has the wrong type.
    """
    c = float(clip_norm)
    if not (math.isfinite(c) and c > 0.0):
        raise ValueError(f"clip_norm must be finite and > 0, got {clip_norm}")
    z = float(noise_multiplier)
    if not (math.isfinite(z) and z >= 0.0):
        raise ValueError(f"noise_multiplier must be finite and >= 0 (0: no noise, epsilon = inf), got {z}")
    q = effective_sampling_rate(sampling_rate)
    if expected_nodes is not None:
        expected_nodes = float(expected_nodes)
        if not (math.isfinite(expected_nodes) and expected_nodes > 0.0):
            raise ValueError(f"expected_nodes must be finite and > 0, got {expected_nodes}")
    if adaptive is not None:
        if not isinstance(adaptive, AdaptiveClipConfig):
            raise TypeError(f"adaptive must be an AdaptiveClipConfig or None, got {type(adaptive).__name__}")
        if not 0.0 < adaptive.target_quantile < 1.0:
            raise ValueError(f"adaptive.target_quantile must lie in (0, 1), got {adaptive.target_quantile}")
        if not adaptive.learning_rate > 0.0:
            raise ValueError(f"adaptive.learning_rate must be > 0, got {adaptive.learning_rate}")
        sb = adaptive.count_noise_multiplier
        if sb is not None and not (math.isfinite(sb) and sb > 0.0):
            raise ValueError(f"adaptive.count_noise_multiplier must be finite and > 0, got {sb}")
    optimizer = _DEFAULT_SERVER if server_optimizer is None else server_optimizer
    if not hasattr(optimizer, "init") or not hasattr(optimizer, "update"):
        raise TypeError("server_optimizer must be an optax GradientTransformation")
    return c, z, q, expected_nodes, optimizer


def make_init(clip_norm: float, cfg: MechanismSpec, optimizer, key, inner_init=None):
    """Build a DP aggregator's ``init``.

    Args:
      clip_norm: The initial C.
      cfg: The mechanism's static configuration.
      optimizer: The server optimizer (optax).
      key: A jax.random key (typed or raw uint32 data) or an int seed.
      inner_init: The wrapped rule's ``init`` (:func:`privatize`), or None.

    Returns:
      ``init(params) -> DPState``.

    Raises:
      ValueError: If the key is not a key or raw uint32 data of shape (2,).
    """
    key = raw_key(jax.random.key(key) if isinstance(key, int | np.integer) else key)
    if key.shape != (2,) or key.dtype != jnp.uint32:
        raise ValueError(
            f"key must be a jax.random key or raw uint32 key data of shape (2,), got {key.shape}"
        )

    def init(params: PyTree) -> DPState:
        nan = jnp.float32(jnp.nan)
        return DPState(
            key=key,
            clip_norm=jnp.float32(clip_norm),
            round=jnp.int32(0),
            opt_state=optimizer.init(params),
            inner=None if inner_init is None else inner_init(params),
            info=empty_info(),
            dp=DPRoundInfo(
                jnp.zeros((0,), jnp.float32), jnp.zeros((0,), jnp.float32), nan, nan, nan, jnp.int32(0)
            ),
            config=cfg,
        )

    return init


def denominator_of(cfg: MechanismSpec, n: int) -> float:
    """Return the fixed denominator m: ``expected_nodes``, else ``sampling_rate * n``.

    Args:
      cfg: The mechanism's static configuration.
      n: The length of the node axis.

    Returns:
      m.
    """
    return cfg.expected_nodes if cfg.expected_nodes is not None else cfg.sampling_rate * n


@functools.partial(jax.jit, static_argnames=("cfg", "optimizer", "shardings"))
def linear_core(stacked, params, mask, weights, key, clip_norm, opt_state, *, cfg, optimizer, shardings):
    """Run one jitted round of :func:`dp_fedavg` / :func:`dp_weighted_mean` (shared across instances).

    Args:
      stacked: The stacked node trees.
      params: The current global tree.
      mask: Optional (n,) bool mask.
      weights: (n,) node weights (dp_weighted_mean), or None.
      key: Raw uint32 key data of this round.
      clip_norm: C this round.
      opt_state: The server optimizer's state.
      cfg: The mechanism's static configuration.
      optimizer: The server optimizer.
      shardings: Each params leaf's sharding or None.

    Returns:
      ``(new_params, opt_state, new_clip_norm, next_key, valid, shown_weights, DPRoundInfo)``.
    """
    n = tree.num_nodes(stacked)
    m = denominator_of(cfg, n)
    k = jax.random.wrap_key_data(key)
    valid, norms, scale = participation(stacked, params, mask, k, clip_norm, cfg)
    if cfg.max_weight is None:
        base, unit = jnp.full((n,), 1.0 / m, jnp.float32), 1.0 / m
    else:
        base, unit = jnp.minimum(weights, jnp.float32(cfg.max_weight)), cfg.max_weight
    w = jnp.where(valid, base * scale, 0.0)
    # sum_i w_i (x_i - p) = sum_i w_i x_i - (sum_i w_i) p: one streaming pass per leaf
    # (kernels.rows.weighted_sum; zero-weight rows, NaN ones included, contribute nothing).
    # Its float32 rounding is of the order of ulp(|p|), the rounding of p + Delta itself.
    w_total = jnp.sum(w)
    delta = jax.tree.map(
        lambda x, p: row_kernels.weighted_sum(x, w) - w_total * p.astype(jnp.float32),
        stacked,
        params,
    )
    new_params, opt_state, new_clip, dp = finish_release(
        delta, params, opt_state, k, clip_norm, valid, norms, scale, shardings, cfg, optimizer, m, unit
    )
    shown = jnp.where(valid, base, 0.0)
    shown = shown / jnp.maximum(jnp.sum(shown), jnp.float32(1e-30))
    next_key = jax.random.key_data(jax.random.fold_in(k, NEXT_STREAM))
    return new_params, opt_state, new_clip, next_key, valid, shown, dp
