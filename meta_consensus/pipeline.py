"""The coordinator's merge: Byzantine vote -> convex weights -> (optional) DP step, as one Aggregator.

The merge of a round is composed from the library's own combinators, each config
section building its part:

1. **vote** (``[vote]``): any registered rule of :data:`consensus.registry.RULES`
   after optional pre-aggregators (:func:`consensus.process`), on the nodes that
   answered with a valid candidate; with ``vote.groups = G`` a
   :func:`consensus.grouped_vote` over G contiguous node groups (for example the
   nodes of one host). f is ``floor(fault_tolerance * answered)`` or the absolute
   ``num_byzantine`` (see :class:`~meta_consensus.config.VoteConfig`), so the vote is
   built for the round's f (and cached per f).
2. **weights** (``[weights]``): :func:`consensus.convex.convex_merge` with the
   objective's weigher (:mod:`meta_consensus.objectives`) and ``vote=`` the vote
   above: only the nodes the vote accepted may get weight. ``objective = "vote"``
   keeps the vote's output. A cap below ``1 / accepted`` is raised to it.
3. **DP** (``[dp]``): :func:`consensus.dp.privatize` with ``project=True``: node
   updates are clipped to C around the last consensus, the merged update is
   projected onto the C-ball and Gaussian noise of std ``z * 2C`` is added
   (sensitivity 2C for any vote and weights; see ``privatize``). Plain DP-FedAvg
   (vote "mean", objective "vote" or "uniform", no groups, no pre-aggregators)
   uses :func:`consensus.dp.dp_fedavg` and its sensitivity C / n.

:class:`MergePipeline` is the system's handle on that aggregator: it injects the
round's DP key, says what the round will cost in privacy, and reads the round's
report (accepted nodes, weights, timings, DP numbers) from the state, so the
coordinator never looks inside the states.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any, Literal, cast

import jax
import jax.numpy as jnp
import numpy as np

from consensus import registry
from consensus.aggregators import grouped_vote, process
from consensus.base import Aggregator, PreAggregator, get_info
from consensus.convex.merge import SolverFailure, convex_merge
from consensus.dp import AdaptiveClipConfig, dp_fedavg, privacy_event, privatize
from consensus.mesh import to_host
from consensus.privacy import PrivacyEvent
from meta_consensus.config import Config, ConfigError, plain_fedavg
from meta_consensus.objectives import OBJECTIVES, needs_classification
from meta_consensus.sampling import privacy_sampling_rate as sampling_rate
from strategies.tasks.base import Task

PyTree = Any

RoundFailure = SolverFailure  # the round cannot produce a consensus; the previous consensus stays


def vote_f(cfg: Config, answered: int) -> int:
    """The vote's f (per group when grouped) in a round in which ``answered`` nodes answered.

    Args:
      cfg: the run config.
      answered: the number of nodes that gave a valid candidate.

    Returns:
      The number of Byzantine nodes the vote tolerates.
    """
    v = cfg.vote
    return v.group_f(cfg.nodes.count // v.groups) if v.groups > 1 else v.f(answered)


def build_vote(cfg: Config, answered: int | None = None) -> Aggregator:
    """The vote of a config for a round in which ``answered`` nodes answered (default: all).

    Args:
      cfg: the run config (``[vote]``).
      answered: the number of nodes that gave a valid candidate (default: every node).

    Returns:
      The vote aggregator: the rule after its pre-aggregators, grouped under the top rule when
      ``vote.groups > 1``.
    """
    v = cfg.vote
    f = vote_f(cfg, cfg.nodes.count if answered is None else answered)
    # The config's validation checked the kinds: vote.pre names pre-aggregators, vote.rule and
    # vote.top_rule vote rules (registry.make returns either kind).
    pre = [cast(PreAggregator, registry.make(p, f, **v.pre_options.get(p, {}))) for p in v.pre]
    inner = cast(Aggregator, registry.make(v.rule, f, **v.options))
    inner = process(inner, pre=pre) if pre else inner
    if v.groups <= 1:
        return inner
    top = cast(Aggregator, registry.make(v.top_rule, v.top_num_byzantine, **v.top_options))
    return grouped_vote(inner, top, v.groups)


@dataclasses.dataclass
class MergeReport:
    """What the merge did in one round, read from its state (host values).

    Attributes:
      accepted: (n,) bool, the nodes the vote accepted (and valid).
      weights: (n,) float64 merge weights.
      seconds: the merge's timings by phase.
      solve_ms: the weight solver's time (0 without a solver).
      weight_cap: the weight cap in effect, ``max(max_weight, 1 / accepted)`` (NaN without one).
      clip_norm: the DP clipping norm (NaN without DP).
      noise_std: the DP noise standard deviation (NaN without DP).
    """

    accepted: np.ndarray
    weights: np.ndarray
    seconds: dict[str, float]
    solve_ms: float = 0.0
    weight_cap: float = math.nan
    clip_norm: float = math.nan
    noise_std: float = math.nan


class MergePipeline:
    """Builds the vote -> weights -> DP aggregator of a config (see the module docstring).

    Args:
      cfg: the run config.
      task: the task (the weight objective's model and loss).
      heldout: the coordinator's held-out split (the first ``weights.max_examples`` rows are used).
      noise_multiplier: the DP noise multiplier the coordinator calibrated (None without DP).

    Raises:
      ConfigError: when the weight objective needs a classification task and the task is not one.
    """

    def __init__(
        self, cfg: Config, task: Task, heldout: Mapping[str, np.ndarray], noise_multiplier: float | None
    ):
        self.cfg = cfg
        self.task = task
        k = cfg.weights.max_examples
        self.heldout = heldout if k is None else {name: v[:k] for name, v in heldout.items()}
        spec = OBJECTIVES[cfg.weights.objective]
        if needs_classification(spec) and getattr(task, "kind", "classification") != "classification":
            usable = [name for name in OBJECTIVES.names() if not needs_classification(OBJECTIVES[name])]
            raise ConfigError(
                f"weights.objective = {spec.name!r} needs a classification task, not {cfg.task.name!r}; "
                f"objectives for it: {usable}"
            )
        self._weigher = spec.factory(cfg.weights, task, self.heldout)
        self.noise_multiplier = noise_multiplier
        self.plain_fedavg = plain_fedavg(cfg)
        self._by_f: dict[int, Aggregator] = {}
        self.vote = build_vote(cfg)
        self.aggregator = self.for_answered(cfg.nodes.vote_size())

    # ---------------------------------------------------------------- composition

    def for_answered(self, answered: int) -> Aggregator:
        """The merge aggregator of a round in which ``answered`` nodes gave a valid candidate.

        Every f shares one state layout (the rules' states do not depend on f), so a
        state carries over from a round with one f to a round with another.

        Args:
          answered: the number of nodes that gave a valid candidate.

        Returns:
          The aggregator (built once per f).
        """
        f = vote_f(self.cfg, answered)
        if f not in self._by_f:
            self._by_f[f] = self._compose(build_vote(self.cfg, answered))
        return self._by_f[f]

    def _compose(self, vote: Aggregator) -> Aggregator:
        cfg = self.cfg
        if self._weigher is None:
            merge = vote
        else:
            on_fallback: Literal["use", "raise"] = (
                "raise" if cfg.weights.on_solver_failure == "fail" else "use"
            )
            merge = convex_merge(
                self._weigher, vote=vote, on_fallback=on_fallback, name=f"{vote.name}+{cfg.weights.objective}"
            )
        d = cfg.dp
        if not d.enabled:
            return merge
        z = self.noise_multiplier
        assert z is not None, "DP is enabled, so the coordinator calibrated a noise multiplier"
        adaptive = AdaptiveClipConfig(d.target_quantile, d.adaptive_lr) if d.adaptive else None
        # Client sampling: the system draws the sample (the aggregator's own sampling stays off,
        # rate 1) and the fixed denominator / expected count is the sample's expected size.
        expected = cfg.nodes.expected_per_round() if cfg.nodes.sampled else None
        if self.plain_fedavg:
            return dp_fedavg(d.clip_norm, z, expected_nodes=expected, adaptive=adaptive, key=0)
        return privatize(
            merge,
            d.clip_norm,
            z,
            expected_nodes=cfg.nodes.count if expected is None else expected,
            adaptive=adaptive,
            key=0,
            project=True,
        )

    # ---------------------------------------------------------------- the round

    def init(self, params: PyTree) -> Any:
        """The merge aggregator's initial state.

        Args:
          params: the initial consensus.

        Returns:
          The state.
        """
        return self.aggregator.init(params)

    def with_key(self, state: Any, key: jax.Array) -> Any:
        """The state with the round's DP noise key (a retry never reuses noise); as is without DP.

        Args:
          state: the merge state.
          key: the round's noise key.

        Returns:
          The state.
        """
        return state._replace(key=jax.random.key_data(key)) if self.cfg.dp.enabled else state

    def privacy_event(self, state: Any) -> PrivacyEvent | None:
        """What the next update will cost in privacy (None without DP).

        Under Poisson client sampling the event is the Poisson-subsampled Gaussian with the
        sampling rate q (amplified); a uniform sample of m is charged at rate 1 (the accountants
        have no fixed-size sampling event; see :mod:`meta_consensus.sampling`).

        Args:
          state: the merge state before the update.

        Returns:
          The event, or None without DP.
        """
        if not self.cfg.dp.enabled:
            return None
        event = privacy_event(state)
        q = sampling_rate(self.cfg.nodes)
        return event if q == 1.0 else dataclasses.replace(event, sampling_rate=q)

    def update(
        self, stacked: PyTree, state: Any, params: PyTree, valid: np.ndarray, **extra: Any
    ) -> tuple[PyTree, Any]:
        """Merge the valid candidates.

        Args:
          stacked: the nodes' stacked candidates.
          state: the merge state.
          params: the round's starting consensus.
          valid: (n,) bool, the nodes with a valid candidate.
          **extra: what the vote's rules need from the round (``key``, ``server_update``; see
            :func:`meta_consensus.server.round_extra`), passed through to them.

        Returns:
          ``(merged, state)``, the merged params ready on device.

        Raises:
          RoundFailure: when the solver fails or the vote is empty.
          consensus.base.ByzantineToleranceError: when the rule's precondition fails for this round.
        """
        agg = self.for_answered(int(np.sum(valid)))
        merged, state = agg.update(stacked, state, params, mask=jnp.asarray(valid), **extra)
        return jax.block_until_ready(merged), state

    def report(self, state: Any) -> MergeReport:
        """The round's accepted nodes, weights, timings and DP numbers, read from the state.

        Args:
          state: the merge state after the update.

        Returns:
          The report, host values.
        """
        info = get_info(state)
        dp = self.cfg.dp.enabled
        merge_state = state.inner if dp and not self.plain_fedavg else state
        result = getattr(merge_state, "result", None)
        rep = MergeReport(
            accepted=np.asarray(to_host(info.selected & info.valid), bool),
            weights=np.asarray(to_host(info.weights), np.float64),
            seconds=dict(getattr(merge_state, "seconds", {})),
        )
        if result is not None:
            rep.solve_ms = 1e3 * result.solve_time
            k = int(rep.accepted.sum())
            cap = self.cfg.weights.max_weight
            rep.weight_cap = math.nan if cap is None or k == 0 else max(cap, 1.0 / k)
        if dp:
            rep.clip_norm = float(state.dp.clip_norm)
            rep.noise_std = float(state.dp.noise_std)
        return rep
