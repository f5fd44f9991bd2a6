"""Differentially private consensus: clipped, noised FedAvg (DP-FedAvg) and friends.

The mechanism, for one round with current global params ``p`` and node params ``x_i``:

1. *participation*: node i takes part if it was Poisson-sampled (probability q, from the
   state's key; q = 1 means every node), passes ``mask``, and holds only finite values;
2. *clipping* of the whole-tree update ``u_i = x_i - p`` to L2 norm C:
   ``u_i <- u_i * min(1, C / ||u_i||)``;
3. *sum over a fixed denominator*: ``Delta = sum_i w_i u_i`` with ``w_i = 1 / m``, m the
   expected number of participants (``expected_nodes``, default q * n) - never the
   realised count, which would leak whether a node took part;
4. *noise*: ``Delta + N(0, (z * S)^2 I)`` with ``S = C / m`` the L2 sensitivity of step 3
   to adding or removing one node (node-level add/remove adjacency), drawn on device with
   ``jax.random.normal``, one ``fold_in`` key per leaf, placed with each params leaf's
   sharding;
5. *server step*: the pseudo-gradient ``-(Delta + noise)`` goes through any optax transform
   (default ``sgd(1.0)``: ``p <- p + Delta + noise``, i.e. FedAvg).

Steps 2-4 are the sampled Gaussian mechanism with noise multiplier z, so
:mod:`consensus.privacy` turns (q, z, rounds) into (epsilon, delta). The server step and
everything after it is post-processing. The ``mask`` must be decided for each node without
looking at the other nodes' data (Poisson sampling, a node-local check): a mask that
depends on other nodes would change the sensitivity.

Weighted means: with weights capped at ``w_max`` and fixed independently of the other
nodes (not renormalised over the participants), one node changes ``sum_i w_i u_i`` by at
most ``C * w_max``; :func:`dp_weighted_mean` noises with that sensitivity. Other rules
(median, Krum, data-dependent weights) have no sensitivity worked out here
(``Aggregator.sensitivity is None``) and :func:`privatise` refuses them.

Adaptive clipping (Andrew et al. 2021): each participant also reports ``b_i = 1[||u_i|| <= C]``;
the server forms ``b = (sum_i (b_i - 1/2) + N(0, sigma_b^2)) / m + 1/2`` (the shift by 1/2
makes the count's sensitivity 1/2), clamps it to [0, 1], and sets
``C <- C * exp(-eta * (b - gamma))``: too many unclipped updates (b > gamma) shrink C. The
count and the sum are one Gaussian mechanism with multiplier z when the sum uses
``z_sum = (z^-2 - (2 sigma_b)^-2)^(-1/2)`` (their Theorem 1), so the accountant still uses z.

References:
  H. B. McMahan, D. Ramage, K. Talwar, L. Zhang. Learning Differentially Private Recurrent
  Language Models. ICLR 2018.
  G. Andrew, O. Thakkar, H. B. McMahan, S. Ramaswamy. Differentially Private Learning with
  Adaptive Clipping. NeurIPS 2021.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from consensus import tree
from consensus.base import AggregationInfo, Aggregator, empty_info
from consensus.privacy.ledger import PrivacyEvent
from kernels import rows as row_kernels

PyTree = Any

# Independent random streams derived from the round key.
_SAMPLE_STREAM, _NOISE_STREAM, _COUNT_STREAM, _NEXT_STREAM = 0, 1, 2, 3
# One shared default server optimizer, so equal configurations share one compiled round.
_DEFAULT_SERVER = optax.sgd(1.0)


class AdaptiveClipConfig(NamedTuple):
    """Adaptive clipping to a target quantile of the update norms (Andrew et al. 2021).

    Attributes:
      target_quantile: gamma in (0, 1): the fraction of updates that should be unclipped.
      learning_rate: eta > 0 of the geometric update ``C <- C exp(-eta (b - gamma))``.
      count_noise_multiplier: sigma_b, std of the noise on the count of unclipped updates
        (in counts). None: ``expected_nodes / 20``, the paper's choice. Must exceed z / 2.
    """

    target_quantile: float = 0.5
    learning_rate: float = 0.2
    count_noise_multiplier: float | None = None


@jax.tree_util.register_static
@dataclasses.dataclass(frozen=True)
class DPConfig:
    """Static configuration of a DP aggregator (no array leaves; hashable)."""

    noise_multiplier: float
    sampling_rate: float  # exactly the probability the sampler uses (a multiple of 2^-32)
    expected_nodes: float | None
    max_weight: float | None  # None: uniform 1 / expected_nodes
    adaptive: AdaptiveClipConfig | None
    name: str


class DPRoundInfo(NamedTuple):
    """DP diagnostics of the last round. Not privatised: keep them on the coordinator.

    Attributes:
      norms: (n,) float32 whole-tree update norms (0 for nodes that did not take part).
      clip_scale: (n,) float32 factor ``min(1, C / ||u_i||)`` applied to each update.
      clip_norm: the clip norm C used this round.
      noise_std: std of the Gaussian noise added to each coordinate of the merged update.
      unclipped_fraction: the noised estimate b of the unclipped fraction (adaptive), else NaN.
      participants: number of nodes that took part.
    """

    norms: jax.Array
    clip_scale: jax.Array
    clip_norm: jax.Array
    noise_std: jax.Array
    unclipped_fraction: jax.Array
    participants: jax.Array


class DPState(NamedTuple):
    """State of a DP aggregator.

    Attributes:
      key: raw uint32 PRNG key data of the *next* round (advanced every update).
      clip_norm: float32 clip norm C for the next round (changes under adaptive clipping).
      round: int32 number of rounds run.
      opt_state: the server optimizer's state.
      inner: the wrapped aggregator's state (:func:`privatise`), else None.
      info: :class:`AggregationInfo` of the last round.
      dp: :class:`DPRoundInfo` of the last round.
      config: :class:`DPConfig` (static).
    """

    key: jax.Array
    clip_norm: jax.Array
    round: jax.Array
    opt_state: Any
    inner: Any
    info: AggregationInfo
    dp: DPRoundInfo
    config: DPConfig


# --- sensitivity -----------------------------------------------------------------------


def check_dp_compatible(aggregator: Aggregator) -> None:
    """Raise ValueError unless ``aggregator`` states its L2 sensitivity (``sensitivity`` not None)."""
    if not isinstance(aggregator, Aggregator):
        raise TypeError(f"expected a consensus.base.Aggregator, got {type(aggregator).__name__}")
    if aggregator.sensitivity is None:
        raise ValueError(
            f"differential privacy cannot be combined with the rule {aggregator.name!r}: its sensitivity to "
            "adding or removing one node has not been worked out (sensitivity=None). Use dp_fedavg (uniform "
            "mean of clipped updates, sensitivity C / m) or dp_weighted_mean (weights capped at w_max, "
            "sensitivity C * w_max), or give the rule a documented `sensitivity(clip_norm, num_nodes)`."
        )


def dp_sensitivity(aggregator: Aggregator, clip_norm: float, num_nodes: float) -> float:
    """The rule's L2 sensitivity for updates clipped to ``clip_norm`` (ValueError if unknown)."""
    check_dp_compatible(aggregator)
    s = float(aggregator.sensitivity(float(clip_norm), float(num_nodes)))
    if not (math.isfinite(s) and s > 0.0):
        raise ValueError(f"rule {aggregator.name!r} reported an invalid sensitivity {s}")
    return s


# --- sampling ----------------------------------------------------------------------------


def _threshold(q: float) -> int:
    """Integer threshold T with P(uint32 bits < T) = T / 2^32 ~ q (T = 2^32 means always)."""
    return min(1 << 32, max(1, int(round(q * 2.0**32))))


def effective_sampling_rate(sampling_rate: float) -> float:
    """The exact probability :func:`sample_participants` uses for ``sampling_rate`` (a multiple of 2^-32)."""
    q = float(sampling_rate)
    if not (0.0 < q <= 1.0):
        raise ValueError(f"sampling_rate must lie in (0, 1], got {sampling_rate}")
    return _threshold(q) / 2.0**32


def sample_participants(key: jax.Array, num_nodes: int, sampling_rate: float) -> jax.Array:
    """(n,) bool Poisson sample: each node independently with probability ``sampling_rate``.

    Compares uniform uint32 bits with an integer threshold, so the probability is exactly
    :func:`effective_sampling_rate` - the q to give the accountant.
    """
    q = effective_sampling_rate(sampling_rate)
    if q == 1.0:
        return jnp.ones((num_nodes,), bool)
    bits = jax.random.bits(_as_key(key), (num_nodes,), jnp.uint32)
    return bits < jnp.uint32(_threshold(q))


def round_participants(state: DPState, num_nodes: int) -> jax.Array:
    """The Poisson sample of the coming round, from the state's key: the nodes to train.

    ``update`` draws the same sample from the same key and drops everyone else, so the
    rate the accountant sees (:func:`privacy_event`) is the rate actually used.
    """
    return sample_participants(
        jax.random.fold_in(_as_key(state.key), _SAMPLE_STREAM), num_nodes, state.config.sampling_rate
    )


def privacy_event(state: DPState) -> PrivacyEvent:
    """The :class:`PrivacyEvent` of the coming round (q, z, C), for a ledger's ``spend``."""
    cfg = state.config
    return PrivacyEvent(
        noise_multiplier=cfg.noise_multiplier,
        sampling_rate=cfg.sampling_rate,
        clip_norm=float(state.clip_norm),
    )


def _as_key(key: jax.Array) -> jax.Array:
    """Accept typed keys and raw uint32 key data alike; return a typed key."""
    return key if _is_typed(key) else jax.random.wrap_key_data(jnp.asarray(key, jnp.uint32))


def _is_typed(key: Any) -> bool:
    return hasattr(key, "dtype") and jnp.issubdtype(key.dtype, jax.dtypes.prng_key)


def _raw(key: jax.Array) -> jax.Array:
    return jax.random.key_data(key) if _is_typed(key) else jnp.asarray(key, jnp.uint32)


# --- the mechanism -----------------------------------------------------------------------


def _sum_noise_multiplier(cfg: DPConfig, m: float) -> float:
    """z for the sum: z itself, or z_sum = (z^-2 - (2 sigma_b)^-2)^-1/2 under adaptive clipping."""
    z = cfg.noise_multiplier
    if cfg.adaptive is None or z == 0.0:
        return z
    sigma_b = _count_std(cfg, m)
    return (z**-2 - (2.0 * sigma_b) ** -2) ** -0.5


def _count_std(cfg: DPConfig, m: float) -> float:
    a = cfg.adaptive
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


def _participation(stacked, params, mask, key, clip_norm, cfg: DPConfig):
    """valid (n,), norms (n,), clip scale (n,)."""
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


def _finish(
    delta, params, opt_state, key, clip_norm, valid, norms, scale, shardings, cfg, optimizer, m, unit
):
    """Noise, server step and adaptive clip update. ``unit``: sensitivity per unit of C."""
    z_sum = _sum_noise_multiplier(cfg, m)
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


def _shardings(params: PyTree) -> tuple:
    """Each params leaf's sharding when it is a concrete array spread over several devices."""
    out = []
    for p in jax.tree_util.tree_leaves(params):
        sh = (
            getattr(p, "sharding", None)
            if isinstance(p, jax.Array) and not isinstance(p, jax.core.Tracer)
            else None
        )
        out.append(sh if sh is not None and len(sh.device_set) > 1 else None)
    return tuple(out)


def _check_update_args(stacked, params, mask, name: str):
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


def _check_common(clip_norm, noise_multiplier, sampling_rate, expected_nodes, adaptive, server_optimizer):
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


def _make_init(clip_norm: float, cfg: DPConfig, optimizer, key, inner_init=None):
    key = _raw(jax.random.key(key) if isinstance(key, int | np.integer) else key)
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


def _denominator(cfg: DPConfig, n: int) -> float:
    return cfg.expected_nodes if cfg.expected_nodes is not None else cfg.sampling_rate * n


@functools.partial(jax.jit, static_argnames=("cfg", "optimizer", "shardings"))
def _linear_core(stacked, params, mask, weights, key, clip_norm, opt_state, *, cfg, optimizer, shardings):
    """One jitted round of :func:`dp_fedavg` / :func:`dp_weighted_mean` (shared across instances)."""
    n = tree.num_nodes(stacked)
    m = _denominator(cfg, n)
    k = jax.random.wrap_key_data(key)
    valid, norms, scale = _participation(stacked, params, mask, k, clip_norm, cfg)
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
    new_params, opt_state, new_clip, dp = _finish(
        delta, params, opt_state, k, clip_norm, valid, norms, scale, shardings, cfg, optimizer, m, unit
    )
    shown = jnp.where(valid, base, 0.0)
    shown = shown / jnp.maximum(jnp.sum(shown), jnp.float32(1e-30))
    next_key = jax.random.key_data(jax.random.fold_in(k, _NEXT_STREAM))
    return new_params, opt_state, new_clip, next_key, valid, shown, dp


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
    c, z, q, m_fixed, optimizer = _check_common(
        clip_norm, noise_multiplier, sampling_rate, expected_nodes, adaptive, server_optimizer
    )
    cfg = DPConfig(z, q, m_fixed, max_weight, adaptive, name)

    def update(stacked, state: DPState, params=None, *, mask=None, weights=None, **extra):
        n, mask = _check_update_args(stacked, params, mask, name)
        m = _denominator(cfg, n)
        _sum_noise_multiplier(cfg, m)  # fail early on an infeasible noise split
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
        new_params, opt_state, new_clip, next_key, valid, shown, dp = _linear_core(
            stacked,
            params,
            mask,
            weights,
            state.key,
            state.clip_norm,
            state.opt_state,
            cfg=cfg,
            optimizer=optimizer,
            shardings=_shardings(params),
        )
        info = AggregationInfo(valid=valid, selected=valid, weights=shown, linear=False)
        return new_params, DPState(next_key, new_clip, state.round + 1, opt_state, None, info, dp, cfg)

    return Aggregator(
        init=_make_init(c, cfg, optimizer, key),
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

    Example:
      >>> agg = dp_fedavg(clip_norm=1.0, noise_multiplier=1.1, sampling_rate=0.1, key=0)
      >>> state = agg.init(params)
      >>> train = round_participants(state, n)           # the nodes to train this round
      >>> ledger.spend(privacy_event(state))              # refuses a round over budget
      >>> params, state = agg.update(stacked, state, params)

    References:
      McMahan et al. (2018); Andrew et al. (2021) for ``adaptive``.
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
    (for example ``n_i / N_expected`` from public dataset sizes) and do not renormalise them
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


def privatise(
    aggregator: Aggregator,
    clip_norm: float,
    noise_multiplier: float,
    *,
    expected_nodes: float,
    sampling_rate: float = 1.0,
    adaptive: AdaptiveClipConfig | None = None,
    server_optimizer: optax.GradientTransformation | None = None,
    key: jax.Array | int = 0,
) -> Aggregator:
    """Make any rule with a stated sensitivity differentially private.

    The nodes' updates are clipped to C around the global params, ``aggregator`` merges the
    clipped nodes, and Gaussian noise with std ``z * aggregator.sensitivity(C, m)`` is added
    to the merged update before the server step. Rules with ``sensitivity=None`` (median,
    Krum, data-dependent weights, ...) raise ValueError here.

    Args:
      aggregator: the rule to privatise; its ``sensitivity(clip_norm, num_nodes)`` must hold
        for updates clipped to ``clip_norm`` under add/remove of one node.
      clip_norm, noise_multiplier, sampling_rate, adaptive, server_optimizer, key: as in
        :func:`dp_fedavg`.
      expected_nodes: m, passed to the rule's sensitivity and used by adaptive clipping.

    Returns:
      An Aggregator (``update(stacked, state, params, *, mask=None, **extra)``; extra
      arguments go to the wrapped rule).
    """
    check_dp_compatible(aggregator)
    c, z, q, m, optimizer = _check_common(
        clip_norm, noise_multiplier, sampling_rate, expected_nodes, adaptive, server_optimizer
    )
    cfg = DPConfig(z, q, m, None, adaptive, f"dp({aggregator.name})")

    @jax.jit
    def clip(stacked, params, mask, key, clip_norm):
        k = jax.random.wrap_key_data(key)
        valid, norms, scale = _participation(stacked, params, mask, k, clip_norm, cfg)
        s = jnp.where(valid, scale, 0.0)

        def leaf(x, p):
            d = x.astype(jnp.float32) - p.astype(jnp.float32)[None]
            d = jnp.where(valid.reshape((-1,) + (1,) * (x.ndim - 1)), d, 0.0)
            return (p.astype(jnp.float32)[None] + s.reshape((-1,) + (1,) * (x.ndim - 1)) * d).astype(x.dtype)

        return jax.tree.map(leaf, stacked, params), valid, norms, scale

    def finish(delta, params, opt_state, key, clip_norm, valid, norms, scale, shardings, unit):
        k = jax.random.wrap_key_data(key)
        out = _finish(
            delta, params, opt_state, k, clip_norm, valid, norms, scale, shardings, cfg, optimizer, m, unit
        )
        return *out, jax.random.key_data(jax.random.fold_in(k, _NEXT_STREAM))

    finish_jit = jax.jit(finish, static_argnames=("shardings", "unit"))

    def update(stacked, state: DPState, params=None, *, mask=None, **extra):
        _, mask = _check_update_args(stacked, params, mask, cfg.name)
        _sum_noise_multiplier(cfg, m)
        unit = dp_sensitivity(aggregator, 1.0, m)
        clipped, valid, norms, scale = clip(stacked, params, mask, state.key, state.clip_norm)
        merged, inner = aggregator.update(clipped, state.inner, params, mask=valid, **extra)
        delta = jax.tree.map(lambda a, p: a.astype(jnp.float32) - p.astype(jnp.float32), merged, params)
        new_params, opt_state, new_clip, dp, next_key = finish_jit(
            delta,
            params,
            state.opt_state,
            state.key,
            state.clip_norm,
            valid,
            norms,
            scale,
            _shardings(params),
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
        init=_make_init(c, cfg, optimizer, key, aggregator.init),
        update=update,
        name=cfg.name,
        sensitivity=aggregator.sensitivity,
    )


__all__ = [
    "AdaptiveClipConfig",
    "DPConfig",
    "DPRoundInfo",
    "DPState",
    "check_dp_compatible",
    "dp_fedavg",
    "dp_sensitivity",
    "dp_weighted_mean",
    "effective_sampling_rate",
    "privacy_event",
    "privatise",
    "round_participants",
    "sample_participants",
]
