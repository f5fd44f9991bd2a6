"""Named DP recipes: DP-FedAvg, DP weighted mean with capped weights, and privatize(rule).

See :mod:`consensus.dp` for the mechanism and its privacy argument.
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp
import optax

from consensus.base import AggregationInfo, Aggregator
from consensus.dp.core import (
    check_common_args,
    check_update_args,
    denominator_of,
    finish_release,
    linear_core,
    make_init,
    participation,
    shardings_of,
    sum_noise_multiplier,
)
from consensus.dp.state import (
    NEXT_STREAM,
    AdaptiveClipConfig,
    DPState,
    MechanismSpec,
    check_dp_compatible,
    dp_sensitivity,
)

PyTree = Any


def _linear_dp(
    clip_norm: float,
    noise_multiplier: float,
    *,
    max_weight: float | None,
    expected_nodes: float | None,
    sampling_rate: float,
    adaptive: AdaptiveClipConfig | None,
    server_optimizer: optax.GradientTransformation | None,
    key: jax.Array | int,
    name: str,
) -> Aggregator:
    """Shared body of :func:`dp_fedavg` (uniform 1/m) and :func:`dp_weighted_mean` (capped weights)."""
    c, z, q, m_fixed, optimizer = check_common_args(
        clip_norm, noise_multiplier, sampling_rate, expected_nodes, adaptive, server_optimizer
    )
    cfg = MechanismSpec(z, q, m_fixed, max_weight, adaptive, name)

    def update(stacked, state: DPState, params=None, *, mask=None, weights=None, **extra):
        n, mask = check_update_args(stacked, params, mask, name)
        m = denominator_of(cfg, n)
        sum_noise_multiplier(cfg, m)  # fail early on an infeasible noise split
        if max_weight is None:
            if weights is not None:
                raise ValueError(f"{name}: takes no weights (uniform 1/m); use dp_weighted_mean for weights")
            weights = jnp.zeros((n,), jnp.float32)
        else:
            if weights is None:
                raise ValueError(f"{name}: weights=(n,) non-negative node weights are required")
            weights = jnp.asarray(weights)
            if weights.shape != (n,):
                raise ValueError(f"{name}: weights must have shape ({n},), got {weights.shape}")
            weights = weights.astype(jnp.float32)
            if not isinstance(weights, jax.core.Tracer) and bool(jnp.any(~(weights >= 0.0))):
                raise ValueError(f"{name}: weights must be finite and >= 0")
        new_params, opt_state, new_clip, next_key, valid, shown, dp = linear_core(
            stacked,
            params,
            mask,
            weights,
            state.key,
            state.clip_norm,
            state.opt_state,
            cfg=cfg,
            optimizer=optimizer,
            shardings=shardings_of(params),
        )
        info = AggregationInfo(valid=valid, selected=valid, weights=shown, linear=False)
        return new_params, DPState(next_key, new_clip, state.round + 1, opt_state, None, info, dp, cfg)

    return Aggregator(
        init=make_init(c, cfg, optimizer, key),
        update=update,
        name=name,
        sensitivity=(
            (lambda clip, n_nodes: clip / (m_fixed if m_fixed is not None else q * n_nodes))
            if max_weight is None
            else (lambda clip, n_nodes: clip * max_weight)
        ),
    )


def dp_fedavg(
    clip_norm: float,
    noise_multiplier: float,
    *,
    expected_nodes: float | None = None,
    sampling_rate: float = 1.0,
    adaptive: AdaptiveClipConfig | None = None,
    server_optimizer: optax.GradientTransformation | None = None,
    key: jax.Array | int = 0,
) -> Aggregator:
    """DP-FedAvg: uniform mean of clipped updates over a fixed denominator, plus Gaussian noise.

    ``p <- server_step(p, sum_{i participating} clip_C(x_i - p) / m + N(0, (z C / m)^2 I))``.
    L2 sensitivity to adding or removing one node: ``C / m`` (so the noise multiplier of
    the release is exactly z). See the module docstring for the whole mechanism.

    Args:
      clip_norm: C > 0, the whole-tree L2 clip norm (the initial one under adaptive clipping).
      noise_multiplier: z >= 0; the accountant's noise multiplier. 0 adds no noise (epsilon = inf).
      expected_nodes: m, the fixed denominator. Default ``sampling_rate * n`` with n the
        length of the node axis.
      sampling_rate: q in (0, 1]. Below 1, ``update`` Poisson-samples the participants from
        the state's key (the same sample as :func:`round_participants`).
      adaptive: :class:`AdaptiveClipConfig` to track a quantile of the update norms.
      server_optimizer: optax transform of the pseudo-gradient ``-(noised mean update)``;
        default ``optax.sgd(1.0)``.
      key: jax.random key (typed or raw) or an int seed.

    Returns:
      An :class:`~consensus.base.Aggregator` whose ``update(stacked, state, params, *, mask=None)``
      returns ``(new_params, state)``; ``params`` is required.

    Raises:
      ValueError: If ``clip_norm`` is not finite and > 0, ``noise_multiplier`` not finite and
        >= 0, ``sampling_rate`` outside (0, 1], the adaptive settings out of range, or the key
        malformed; from ``update``, when ``params`` is missing or the mask has the wrong shape.
      TypeError: If ``adaptive`` is not an AdaptiveClipConfig or ``server_optimizer`` not an
        optax transform.

    Example:
      >>> from consensus import PrivacyLedger, privacy_event, round_participants
      >>> n, params = 20, {"w": jnp.zeros(3)}
      >>> stacked = {"w": jnp.ones((n, 3))}               # every node's new parameters
      >>> ledger = PrivacyLedger(delta=1e-5, budget=3.0)
      >>> agg = dp_fedavg(clip_norm=1.0, noise_multiplier=1.1, sampling_rate=0.1, key=0)
      >>> state = agg.init(params)
      >>> train = round_participants(state, n)           # the nodes to train this round
      >>> eps = ledger.spend(privacy_event(state))        # refuses a round over budget
      >>> params, state = agg.update(stacked, state, params)
      >>> params["w"].shape
      (3,)

    References:
      McMahan, Ramage, Talwar and Zhang 2018, ICLR, "Learning Differentially Private
      Recurrent Language Models"; Andrew, Thakkar, McMahan and Ramaswamy 2021, NeurIPS,
      "Differentially Private Learning with Adaptive Clipping" for ``adaptive``.
    """
    return _linear_dp(
        clip_norm,
        noise_multiplier,
        max_weight=None,
        expected_nodes=expected_nodes,
        sampling_rate=sampling_rate,
        adaptive=adaptive,
        server_optimizer=server_optimizer,
        key=key,
        name="dp_fedavg",
    )


def dp_weighted_mean(
    clip_norm: float,
    noise_multiplier: float,
    max_weight: float,
    *,
    sampling_rate: float = 1.0,
    adaptive: AdaptiveClipConfig | None = None,
    server_optimizer: optax.GradientTransformation | None = None,
    key: jax.Array | int = 0,
) -> Aggregator:
    """DP weighted sum of clipped updates with weights capped at ``max_weight``.

    ``p <- server_step(p, sum_i min(w_i, w_max) clip_C(x_i - p) + N(0, (z C w_max)^2 I))``.
    One node changes the sum by at most ``C * w_max`` (L2), the sensitivity, *provided each
    node's weight does not depend on the other nodes' data*: pass weights fixed in advance
    (for example ``n_i / N_expected`` from public dataset sizes) and do not renormalize them
    over the participants, which is why the cap is applied here and the sum is not divided.

    Args:
      clip_norm: C > 0 (initial value under adaptive clipping).
      noise_multiplier: z >= 0.
      max_weight: w_max > 0; weights above it are capped to it.
      sampling_rate: q in (0, 1] (Poisson sampling from the state's key, as in :func:`dp_fedavg`).
      adaptive: :class:`AdaptiveClipConfig`; the count uses the denominator ``1 / w_max``.
      server_optimizer: optax transform of the pseudo-gradient (default ``sgd(1.0)``).
      key: jax.random key or int seed.

    Returns:
      An Aggregator with ``update(stacked, state, params, *, weights, mask=None)``.

    Raises:
      ValueError: If ``clip_norm`` is not finite and > 0, ``noise_multiplier`` not finite and
        >= 0, ``sampling_rate`` outside (0, 1], the adaptive settings out of range, or the key
        malformed, or ``max_weight`` not finite and > 0; from ``update``, when ``params`` or
        valid (n,) non-negative ``weights`` are missing, or the mask has the wrong shape.
      TypeError: If ``adaptive`` is not an AdaptiveClipConfig or ``server_optimizer`` not an
        optax transform.
    """
    w = float(max_weight)
    if not (math.isfinite(w) and w > 0.0):
        raise ValueError(f"max_weight must be finite and > 0, got {max_weight}")
    return _linear_dp(
        clip_norm,
        noise_multiplier,
        max_weight=w,
        expected_nodes=1.0 / w,
        sampling_rate=sampling_rate,
        adaptive=adaptive,
        server_optimizer=server_optimizer,
        key=key,
        name="dp_weighted_mean",
    )


def _projected_sensitivity(clip_norm: float, num_nodes: float) -> float:
    del num_nodes
    return 2.0 * float(clip_norm)


@jax.jit
def _project_to_ball(delta: PyTree, radius: jax.Array) -> PyTree:
    """``delta * min(1, radius / ||delta||)`` over the whole tree (float32)."""
    sq = sum(jnp.sum(jnp.square(d)) for d in jax.tree.leaves(delta))
    scale = jnp.minimum(1.0, radius / jnp.maximum(jnp.sqrt(sq), 1e-30))
    return jax.tree.map(lambda d: scale * d, delta)


def privatize(
    aggregator: Aggregator,
    clip_norm: float,
    noise_multiplier: float,
    *,
    expected_nodes: float,
    sampling_rate: float = 1.0,
    adaptive: AdaptiveClipConfig | None = None,
    server_optimizer: optax.GradientTransformation | None = None,
    key: jax.Array | int = 0,
    project: bool = False,
) -> Aggregator:
    """Make any rule differentially private: with its stated sensitivity, or by projection (2C).

    The nodes' updates are clipped to C around the global params, ``aggregator`` merges the
    clipped nodes, and Gaussian noise with std ``z * s`` is added to the merged update before
    the server step, where s is the rule's L2 sensitivity:

    * ``project=False``: ``s = aggregator.sensitivity(C, m)``. Rules with ``sensitivity=None``
      (median, Krum, data-dependent weights, ...) raise ValueError here.
    * ``project=True``: the merged update is first projected onto the C-ball
      (``u <- u * min(1, C / ||u||)``, a no-op for convex combinations of clipped updates),
      so ``s = 2C`` **for any rule**: every output lies in the C-ball, and two points of a
      ball of radius C are at most 2C apart, whatever the rule does with the data when one
      node is added, removed or replaced. This is the bound for robust votes and
      data-dependent convex weights, where no smaller one holds; it does not shrink with m.

    Args:
      aggregator: the rule to privatize; with ``project=False`` its
        ``sensitivity(clip_norm, num_nodes)`` must hold for updates clipped to ``clip_norm``
        under add/remove of one node.
      clip_norm: C > 0, the whole-tree L2 clip norm (as in :func:`dp_fedavg`).
      noise_multiplier: z >= 0; the noise std is ``z * s``.
      expected_nodes: m, passed to the rule's sensitivity and used by adaptive clipping.
      sampling_rate: q in (0, 1] (Poisson sampling from the state's key).
      adaptive: :class:`AdaptiveClipConfig`, or None for a fixed C.
      server_optimizer: optax transform of the pseudo-gradient (default ``sgd(1.0)``).
      key: jax.random key or int seed.
      project: project the merged update onto the C-ball and use sensitivity 2C (see above).

    Returns:
      An Aggregator (``update(stacked, state, params, *, mask=None, **extra)``; extra
      arguments go to the wrapped rule).

    Raises:
      ValueError: If ``project=False`` and the rule states no sensitivity, or
        ``clip_norm`` is not finite and > 0, ``noise_multiplier`` not finite and >= 0,
        ``sampling_rate`` outside (0, 1], the adaptive settings out of range or the key
        malformed; from ``update``, when ``params`` is missing or the mask has the wrong shape.
      TypeError: If ``aggregator`` is not an Aggregator, ``adaptive`` not an
        AdaptiveClipConfig or ``server_optimizer`` not an optax transform.
    """
    if project:
        aggregator = aggregator._replace(sensitivity=_projected_sensitivity)
    check_dp_compatible(aggregator)
    c, z, q, m, optimizer = check_common_args(
        clip_norm, noise_multiplier, sampling_rate, expected_nodes, adaptive, server_optimizer
    )
    cfg = MechanismSpec(z, q, m, None, adaptive, f"dp({aggregator.name})")

    @jax.jit
    def clip(stacked, params, mask, key, clip_norm):
        k = jax.random.wrap_key_data(key)
        valid, norms, scale = participation(stacked, params, mask, k, clip_norm, cfg)
        s = jnp.where(valid, scale, 0.0)

        def leaf(x, p):
            d = x.astype(jnp.float32) - p.astype(jnp.float32)[None]
            d = jnp.where(valid.reshape((-1,) + (1,) * (x.ndim - 1)), d, 0.0)
            return (p.astype(jnp.float32)[None] + s.reshape((-1,) + (1,) * (x.ndim - 1)) * d).astype(x.dtype)

        return jax.tree.map(leaf, stacked, params), valid, norms, scale

    def finish(delta, params, opt_state, key, clip_norm, valid, norms, scale, shardings, unit):
        k = jax.random.wrap_key_data(key)
        out = finish_release(
            delta, params, opt_state, k, clip_norm, valid, norms, scale, shardings, cfg, optimizer, m, unit
        )
        return *out, jax.random.key_data(jax.random.fold_in(k, NEXT_STREAM))

    finish_jit = jax.jit(finish, static_argnames=("shardings", "unit"))

    def update(stacked, state: DPState, params=None, *, mask=None, **extra):
        _, mask = check_update_args(stacked, params, mask, cfg.name)
        sum_noise_multiplier(cfg, m)
        unit = dp_sensitivity(aggregator, 1.0, m)
        clipped, valid, norms, scale = clip(stacked, params, mask, state.key, state.clip_norm)
        merged, inner = aggregator.update(clipped, state.inner, params, mask=valid, **extra)
        delta = jax.tree.map(lambda a, p: a.astype(jnp.float32) - p.astype(jnp.float32), merged, params)
        if project:
            delta = _project_to_ball(delta, state.clip_norm)
        new_params, opt_state, new_clip, dp, next_key = finish_jit(
            delta,
            params,
            state.opt_state,
            state.key,
            state.clip_norm,
            valid,
            norms,
            scale,
            shardings_of(params),
            unit,
        )
        info = getattr(inner, "info", None)
        if not isinstance(info, AggregationInfo):
            info = AggregationInfo(
                valid,
                valid,
                valid.astype(jnp.float32) / jnp.maximum(jnp.sum(valid), 1).astype(jnp.float32),
                False,
            )
        info = info._replace(linear=False)
        return new_params, DPState(next_key, new_clip, state.round + 1, opt_state, inner, info, dp, cfg)

    return Aggregator(
        init=make_init(c, cfg, optimizer, key, aggregator.init),
        update=update,
        name=cfg.name,
        sensitivity=aggregator.sensitivity,
    )
