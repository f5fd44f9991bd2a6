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
2. **weights** (``[weights]``): with ``objective = "vote"`` the vote's output is the
   merge. Any other objective is :func:`consensus.convex.convex_merge` with the
   objective's weigher (:mod:`meta_consensus.objectives`) and ``vote=`` the vote
   above: the weights re-weigh the nodes the vote kept, and the vote's own output
   is used only by an objective that reads it (``anchor``: the convex combination
   of the kept nodes closest to it). A rule that keeps every node (the median, the
   trimmed mean, the geometric median, ...) therefore changes nothing under a
   mask-only objective (``mixture_nll``, ``quadratic``, ``uniform``): the round's
   :class:`MergeReport` says so in one line (``note``, warned once), and the run's
   table repeats it. A cap below ``1 / accepted`` is raised to it.
3. **DP** (``[dp]``): :func:`consensus.dp.privatize` with ``project=True``: node
   updates are clipped to C around the last consensus, the merged update is
   projected onto the C-ball and Gaussian noise of std ``z * 2C`` is added
   (sensitivity 2C for any vote and weights; see ``privatize``). Plain DP-FedAvg
   (vote "mean", objective "vote" or "uniform", no groups, no pre-aggregators)
   uses :func:`consensus.dp.dp_fedavg` and its sensitivity C / n.

The coordinator's server step (``vote.server_step``) comes after all of them, as
post-processing; :func:`relative_move` measures how far it moved the consensus
relative to the merge's own move.

:class:`MergePipeline` is the system's handle on that aggregator: it injects the
round's DP key, says what the round will cost in privacy, and reads the round's
report (accepted nodes, weights, each node's share of the merge, the stage whose
output is the merge, timings, DP numbers) from the state, so the coordinator never
looks inside the states.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import warnings
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
from meta_consensus.config.codec import stage_notes
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


#: ``MergeReport.share_kind``: how to read the per-node share of the consensus.
SHARE_WEIGHTS = "weights"  # a linear merge: the consensus is sum_i share_i x_i
SHARE_COORDINATES = "coordinates"  # an order-statistic rule: node i's weight averaged over coordinates
SHARE_NONE = "not a weighted rule"  # a non-linear rule whose output is no weighting of the nodes

#: ``MergeReport.decided_by``: the stage whose output is the merge.
STAGE_VOTE, STAGE_WEIGHTS, STAGE_SERVER = "vote", "weights", "server step"


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
      share: (n,) float64, the share of the merge each node carried (see ``share_kind``); 0 for
        the nodes left out, NaN everywhere for a rule that weighs no node (:data:`SHARE_NONE`).
        Under DP, the shares of the merge of the clipped updates, before the noise.
      share_kind: :data:`SHARE_WEIGHTS` (a linear merge, ``merged = sum_i share_i x_i`` with the
        shares summing to 1), :data:`SHARE_COORDINATES` (the coordinate-wise median or trimmed
        mean: per coordinate, each kept order statistic has weight ``1 / kept``; the share is
        node i's weight averaged over the coordinates, summing to 1) or :data:`SHARE_NONE`.
      decided_by: the stage whose output is the merge: :data:`STAGE_VOTE` (``weights.objective
        = "vote"``) or :data:`STAGE_WEIGHTS` (the weights re-weighed the nodes the vote kept).
      note: one line when the vote kept every valid node and the weights replaced its output
        (the rule changed nothing but the names in the table), else "".
    """

    accepted: np.ndarray
    weights: np.ndarray
    seconds: dict[str, float]
    solve_ms: float = 0.0
    weight_cap: float = math.nan
    clip_norm: float = math.nan
    noise_std: float = math.nan
    share: np.ndarray = dataclasses.field(default_factory=lambda: np.zeros((0,)))
    share_kind: str = SHARE_WEIGHTS
    decided_by: str = STAGE_VOTE
    note: str = ""


def linear_share(weights: np.ndarray, valid: np.ndarray) -> np.ndarray:
    """The shares of a linear merge: its weights over the valid nodes, normalized to sum to 1.

    Args:
      weights: (n,) the merge's node weights (``AggregationInfo.weights``).
      valid: (n,) bool, the nodes that took part.

    Returns:
      (n,) float64 shares, 0 outside ``valid``, summing to 1 (all 0 when no weight is positive).
    """
    w = np.where(valid, np.abs(np.asarray(weights, np.float64)), 0.0)
    total = w.sum()
    return w / total if total > 0 else w


def kept_ranks(rule: str, m: int, f: int) -> tuple[int, int] | None:
    """The order statistics an order-statistic rule keeps at every coordinate, or None for other rules.

    Args:
      rule: the vote's rule.
      m: the number of valid nodes.
      f: the vote's f.

    Returns:
      ``(lo, hi)``, the ranks kept (0-based, inclusive): the middle one or two for ``median``,
      ``f .. m - f - 1`` for ``trimmed_mean``; None for any other rule.
    """
    if rule == "median":
        return ((m - 1) // 2, m // 2) if m > 0 else None
    if rule == "trimmed_mean":
        return (f, m - f - 1) if m > 2 * f else None
    return None


# Order-statistic shares read at most this many coordinates (an even stride over each leaf): the
# share is an average over coordinates, and ranking a billion coordinates every round would cost
# more than the merge.
MAX_SHARE_COORDINATES = 1 << 20


@functools.partial(jax.jit, static_argnames=("lo", "hi"))
def _rank_share(x: jax.Array, lo: int, hi: int) -> jax.Array:
    """(m,) each row's weight ``1 / (hi - lo + 1)`` where its rank is kept, summed over x's columns."""
    m = x.shape[0]
    idx = jnp.arange(m)[:, None]

    def count(j, rank):
        xj = x[j][None]
        return rank + ((xj < x) | ((xj == x) & (j < idx))).astype(jnp.int32)  # ties: lower index first

    rank = jax.lax.fori_loop(0, m, count, jnp.zeros(x.shape, jnp.int32))
    kept = (rank >= lo) & (rank <= hi)
    return kept.sum(axis=1).astype(jnp.float32) / (hi - lo + 1)


def coordinate_share(stacked: PyTree, valid: np.ndarray, lo: int, hi: int) -> np.ndarray:
    """Each node's weight in an order-statistic merge, averaged over the coordinates.

    At every coordinate the valid nodes' values are ranked (ties by node index) and the ranks
    ``lo..hi`` carry weight ``1 / (hi - lo + 1)`` each (the median's middle value or two, the
    trimmed mean's kept values). Large models are read at an even stride of at most
    :data:`MAX_SHARE_COORDINATES` coordinates.

    Args:
      stacked: the nodes' stacked candidates.
      valid: (n,) bool, the nodes that took part.
      lo: the lowest kept rank.
      hi: the highest kept rank.

    Returns:
      (n,) float64 shares, 0 outside ``valid``, summing to 1.
    """
    rows = np.flatnonzero(valid)
    leaves = jax.tree.leaves(stacked)
    total = sum(int(np.prod(x.shape[1:])) for x in leaves)
    stride = max(1, math.ceil(total / MAX_SHARE_COORDINATES))
    sums, count = np.zeros((len(rows),), np.float64), 0
    for leaf in leaves:
        x = jnp.reshape(jnp.asarray(leaf)[rows], (len(rows), -1))[:, ::stride]
        sums += np.asarray(to_host(_rank_share(x, lo, hi)), np.float64)
        count += x.shape[1]
    out = np.zeros(np.shape(valid), np.float64)
    out[rows] = sums / max(count, 1)
    return out


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
        self._coordinate_share: tuple[Any, np.ndarray] | None = None  # (state, shares) of the last update
        # The note of a vote whose output the weights replaced, warned once (not at all when the
        # config's own note said it before the run: config.stage_notes).
        self._warned = bool(stage_notes(cfg))
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
        answered = int(np.sum(valid))
        agg = self.for_answered(answered)
        merged, state = agg.update(stacked, state, params, mask=jnp.asarray(valid), **extra)
        merged = jax.block_until_ready(merged)
        self._coordinate_share = None
        ranks = self._order_statistics(answered)
        if ranks is not None:
            vote_valid = np.asarray(to_host(get_info(state).valid), bool)
            self._coordinate_share = (state, coordinate_share(stacked, vote_valid, *ranks))
        return merged, state

    def _order_statistics(self, answered: int) -> tuple[int, int] | None:
        """The ranks the vote keeps when its output is the merge and it is an order-statistic rule."""
        cfg, v = self.cfg, self.cfg.vote
        # Clipping (DP) changes the nodes' ranks, pre-aggregators and groups mix the nodes: their
        # outputs are no order statistic of the candidates.
        if self._weigher is not None or cfg.dp.enabled or v.pre or v.groups > 1:
            return None
        return kept_ranks(v.rule, answered, vote_f(cfg, answered))

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
        self._shares(rep, state, merge_state, info)
        if result is not None:
            rep.solve_ms = 1e3 * result.solve_time
            k = int(rep.accepted.sum())
            cap = self.cfg.weights.max_weight
            rep.weight_cap = math.nan if cap is None or k == 0 else max(cap, 1.0 / k)
        if dp:
            rep.clip_norm = float(state.dp.clip_norm)
            rep.noise_std = float(state.dp.noise_std)
        return rep

    def _shares(self, rep: MergeReport, state: Any, merge_state: Any, info: Any) -> None:
        """Fill the report's shares, deciding stage and note (see :class:`MergeReport`)."""
        # Under DP the shares are the merge's before the noise (of the clipped updates): the inner
        # merge's info, or plain DP-FedAvg's uniform weights (the DP state says linear = False,
        # for the noise).
        inner = get_info(merge_state) if merge_state is not state else info
        valid = np.asarray(to_host(inner.valid), bool)
        cached = getattr(self, "_coordinate_share", None)
        if cached is not None and cached[0] is state:
            rep.share, rep.share_kind = cached[1], SHARE_COORDINATES
        elif inner.linear or (self.cfg.dp.enabled and self.plain_fedavg):
            rep.share = linear_share(np.asarray(to_host(inner.weights), np.float64), valid)
        else:
            rep.share, rep.share_kind = np.full(valid.shape, math.nan), SHARE_NONE
        vote_state = getattr(merge_state, "vote", None)
        if self._weigher is None or vote_state is None:
            return  # the vote's output is the merge (plain DP-FedAvg: the uniform mean, noised)
        rep.decided_by = STAGE_WEIGHTS
        vinfo = get_info(vote_state)
        kept = np.asarray(to_host(vinfo.selected & vinfo.valid), bool)
        spec = OBJECTIVES[self.cfg.weights.objective]
        if spec.traits.get("reads_vote_output", False):
            return  # the weights lean on the vote's output
        vote_valid = np.asarray(to_host(vinfo.valid), bool)
        k = int(vote_valid.sum())
        vote_w = np.asarray(to_host(vinfo.weights), np.float64)[vote_valid]
        # A vote that kept every node and merged them uniformly (the mean; Multi-Krum at f = 0) is
        # what the weights re-weigh; one that computed anything else (a median, a geometric
        # median's weights) had its output replaced.
        uniform = vinfo.linear and k > 0 and bool(np.all(np.abs(vote_w - 1.0 / k) <= 1e-6))
        if kept.sum() == k and not uniform:
            rule = self.cfg.vote.rule
            rep.note = (
                f"vote.rule = {rule!r} kept every valid node, so weights.objective = {spec.name!r} "
                f"re-weighed all of them and the rule's own output was not used (weights.objective = "
                f"'vote' merges with it, 'anchor' weighs the nodes towards it)"
            )
            if not self._warned:
                self._warned = True
                warnings.warn(rep.note, stacklevel=2)


def relative_move(before: PyTree, after: PyTree, params: PyTree) -> float:
    """How far a stage moved the consensus relative to the merge's own move from the round's start.

    ``|after - before| / |before - params|`` over all leaves.

    The server step logs it: 0.5 means it moved the consensus half as far as the nodes' merge did.

    Args:
      before: the consensus before the stage (the merge).
      after: the consensus after it.
      params: the round's starting consensus.

    Returns:
      The ratio of the two Euclidean norms over all leaves (inf when the merge did not move).
    """

    def sq(a: PyTree, b: PyTree) -> float:
        def one(x: jax.Array, y: jax.Array) -> jax.Array:
            return jnp.sum(jnp.square(x.astype(jnp.float32) - y.astype(jnp.float32)))

        parts = jax.tree.map(one, a, b)
        return float(sum(np.asarray(to_host(v), np.float64) for v in jax.tree.leaves(parts)))

    moved, merge = math.sqrt(sq(after, before)), math.sqrt(sq(before, params))
    return moved / merge if merge > 0 else (0.0 if moved == 0 else math.inf)
