"""DP state, configuration, sensitivity checks and Poisson node sampling.

See :mod:`consensus.dp` for the mechanism these serve.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from consensus.base import AggregationInfo, Aggregator
from consensus.privacy.ledger import PrivacyEvent

PyTree = Any

# Independent random streams derived from the round key.
_SAMPLE_STREAM, _NOISE_STREAM, _COUNT_STREAM, NEXT_STREAM = 0, 1, 2, 3
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
class MechanismSpec:
    """Static configuration of a DP aggregator (no array leaves; hashable).

    Attributes:
      noise_multiplier: z.
      sampling_rate: q, exactly the probability the sampler uses (a multiple of 2^-32).
      expected_nodes: m, the fixed denominator, or None for ``sampling_rate * n``.
      max_weight: w_max of :func:`dp_weighted_mean`; None for the uniform 1 / m.
      adaptive: The adaptive clipping settings, or None.
      name: The aggregator's name.
    """

    noise_multiplier: float
    sampling_rate: float
    expected_nodes: float | None
    max_weight: float | None
    adaptive: AdaptiveClipConfig | None
    name: str


class DPRoundInfo(NamedTuple):
    """DP diagnostics of the last round. Not privatized: keep them on the coordinator.

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
      inner: the wrapped aggregator's state (:func:`privatize`), else None.
      info: :class:`AggregationInfo` of the last round.
      dp: :class:`DPRoundInfo` of the last round.
      config: :class:`MechanismSpec` (static).
    """

    key: jax.Array
    clip_norm: jax.Array
    round: jax.Array
    opt_state: Any
    inner: Any
    info: AggregationInfo
    dp: DPRoundInfo
    config: MechanismSpec


# --- sensitivity -----------------------------------------------------------------------


def check_dp_compatible(aggregator: Aggregator) -> None:
    """Raise ValueError unless ``aggregator`` states its L2 sensitivity (``sensitivity`` not None).

    Args:
      aggregator: The rule to check.

    Raises:
      TypeError: If ``aggregator`` is not an :class:`~consensus.base.Aggregator`.
      ValueError: If its sensitivity to adding or removing one node has not been worked out.
    """
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
    """Return the rule's L2 sensitivity for updates clipped to ``clip_norm``.

    The sensitivity is to adding or removing one node whose update is clipped to
    ``clip_norm`` (e.g. C / n for the uniform mean).

    Args:
      aggregator: The rule.
      clip_norm: C.
      num_nodes: n (or the expected number of participants).

    Returns:
      The sensitivity, finite and > 0.

    Raises:
      TypeError: If ``aggregator`` is not an Aggregator.
      ValueError: If the rule states no sensitivity or reports an invalid one.
    """
    check_dp_compatible(aggregator)
    assert aggregator.sensitivity is not None  # check_dp_compatible raised otherwise
    s = float(aggregator.sensitivity(float(clip_norm), float(num_nodes)))
    if not (math.isfinite(s) and s > 0.0):
        raise ValueError(f"rule {aggregator.name!r} reported an invalid sensitivity {s}")
    return s


# --- sampling ----------------------------------------------------------------------------


def _threshold(q: float) -> int:
    """Integer threshold T with P(uint32 bits < T) = T / 2^32 ~ q (T = 2^32 means always)."""
    return min(1 << 32, max(1, int(round(q * 2.0**32))))


def effective_sampling_rate(sampling_rate: float) -> float:
    """Return the exact probability :func:`sample_participants` uses for ``sampling_rate``.

    Args:
      sampling_rate: q in (0, 1].

    Returns:
      q rounded to a multiple of 2^-32 (the q to give the accountant).

    Raises:
      ValueError: If ``sampling_rate`` is outside (0, 1].
    """
    q = float(sampling_rate)
    if not (0.0 < q <= 1.0):
        raise ValueError(f"sampling_rate must lie in (0, 1], got {sampling_rate}")
    return _threshold(q) / 2.0**32


def sample_participants(key: jax.Array, num_nodes: int, sampling_rate: float) -> jax.Array:
    """Draw a Poisson sample of the nodes: each independently with probability ``sampling_rate``.

    Compares uniform uint32 bits with an integer threshold, so the probability is exactly
    :func:`effective_sampling_rate` - the q to give the accountant.

    Args:
      key: A jax.random key (typed or raw uint32 data).
      num_nodes: n.
      sampling_rate: q in (0, 1].

    Returns:
      (n,) bool, the sampled nodes.

    Raises:
      ValueError: If ``sampling_rate`` is outside (0, 1].
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

    Args:
      state: The DP aggregator's state.
      num_nodes: n.

    Returns:
      (n,) bool, the nodes sampled for the coming round.
    """
    return sample_participants(
        jax.random.fold_in(_as_key(state.key), _SAMPLE_STREAM), num_nodes, state.config.sampling_rate
    )


def privacy_event(state: DPState) -> PrivacyEvent:
    """Return the :class:`PrivacyEvent` of the coming round (q, z, C), for a ledger's ``spend``.

    Args:
      state: The DP aggregator's state.

    Returns:
      The event with the configured z and q and the state's current C.
    """
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


def raw_key(key: jax.Array) -> jax.Array:
    """Return raw uint32 key data for a typed key or raw data alike.

    Args:
      key: A typed jax.random key or raw uint32 key data.

    Returns:
      The raw uint32 key data.
    """
    return jax.random.key_data(key) if _is_typed(key) else jnp.asarray(key, jnp.uint32)
