"""Differentially private consensus: clipped, noised FedAvg (DP-FedAvg) and friends.

The mechanism, for one round with current global params ``p`` and node params ``x_i``:

1. *participation*: node i takes part if it was Poisson-sampled (probability q, from the
   state's key; q = 1 means every node), passes ``mask``, and holds only finite values;
2. *clipping* of the whole-tree update ``u_i = x_i - p`` to L2 norm C:
   ``u_i <- u_i * min(1, C / ||u_i||)``;
3. *sum over a fixed denominator*: ``Delta = sum_i w_i u_i`` with ``w_i = 1 / m``, m the
   expected number of participants (``expected_nodes``, default q * n) - never the
   realized count, which would leak whether a node took part;
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
nodes (not renormalized over the participants), one node changes ``sum_i w_i u_i`` by at
most ``C * w_max``; :func:`dp_weighted_mean` noises with that sensitivity. Other rules
(median, Krum, data-dependent weights) have no sensitivity worked out here
(``Aggregator.sensitivity is None``) and :func:`privatize` refuses them.

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

from consensus.dp.recipes import dp_fedavg, dp_weighted_mean, privatize
from consensus.dp.state import (
    AdaptiveClipConfig,
    DPRoundInfo,
    DPState,
    MechanismSpec,
    check_dp_compatible,
    dp_sensitivity,
    effective_sampling_rate,
    privacy_event,
    round_participants,
    sample_participants,
)

__all__ = [
    "AdaptiveClipConfig",
    "MechanismSpec",
    "DPRoundInfo",
    "DPState",
    "check_dp_compatible",
    "dp_fedavg",
    "dp_sensitivity",
    "dp_weighted_mean",
    "effective_sampling_rate",
    "privacy_event",
    "privatize",
    "round_participants",
    "sample_participants",
]
