"""The stages of a round, shared by the synchronous round and the asynchronous buffer.

A round is a :class:`RoundWork` passed through stage functions, each of which fills in its
part of it or returns why the round fails:

``start`` (keys, sample, budget checks) -> ``fit`` -> ``validate`` (structure, finiteness, the
quality gate, the round's :class:`~meta_consensus.coordinator.RoundInfo`) -> ``merge`` (vote ->
weights -> DP, or a LoRA run's adapter merge) -> ``accept`` (consensus threshold, finiteness)
-> ``baseline`` (plain FedAvg alongside) -> ``evaluate`` -> ``finish`` (the new state).

The synchronous round (:meth:`Coordinator.round <meta_consensus.coordinator.Coordinator.round>`)
runs all of them; an asynchronous buffer (:mod:`meta_consensus.async_rounds`) fits its nodes
on its own clock and hands the buffer to ``validate`` onwards. Optional settings are
:class:`Feature` objects that contribute to the stages they touch (example-level DP's budget
and epsilons, a LoRA run's frozen base, a pretrained task's base metrics), and the merge is
one of two :class:`Merge` objects (the pipeline's vote -> weights -> DP with the server
reference's update and the nodes' statistics as extras; or the LoRA adapter merge), so no
stage has a branch for a feature.
"""

from __future__ import annotations

import copy
import dataclasses
import math
import time
from typing import TYPE_CHECKING, Any, Literal

import jax
import jax.numpy as jnp
import numpy as np

from consensus import tree
from consensus.base import ByzantineToleranceError
from consensus.mesh import to_host
from consensus.privacy import PrivacyLedger
from meta_consensus import sampling
from meta_consensus.pipeline import RoundFailure, relative_move
from meta_consensus.sampling import ClientSample
from meta_consensus.server import SERVER_UPDATE, round_extra, server_step
from meta_consensus.statistics import round_statistics

if TYPE_CHECKING:
    from meta_consensus.coordinator import Coordinator, CoordinatorState, RoundInfo
    from meta_consensus.fleet import FleetOutput

PyTree = Any

# The metrics RoundInfo has fields of its own; the others go to its *_metrics dicts.
OWN_METRICS = ("loss", "accuracy")


@dataclasses.dataclass
class RoundWork:
    """One round (or one applied buffer) on its way through the stages.

    Attributes:
      state: the run's state before the round (never mutated).
      attempt: the attempt at the round (0 first).
      evaluate: whether the round evaluates the nodes and the consensus on the test set.
      key: the round's key; ``k_fit`` and ``k_dp`` are its two halves.
      sample: the round's slots (client sampling, or an asynchronous buffer), None: all n nodes.
      asked: the nodes the round asked (None: n), the denominator of the answer thresholds.
      secs: wall time by phase.
      out: the nodes' answers (``fit``, or the buffer).
      valid: (rows,) bool, answered with a finite candidate that passed the quality gate.
      info: the round's RoundInfo (made by ``validate``).
      merged, frozen, aggregator, ledger: the merge's results (``merge``).
      fedavg, fedavg_nodes: the baseline's params and nodes after the round.
    """

    state: CoordinatorState
    attempt: int
    evaluate: bool
    key: jax.Array
    k_fit: jax.Array
    k_dp: jax.Array
    sample: ClientSample | None
    asked: int | None
    secs: dict[str, float] = dataclasses.field(default_factory=dict)
    out: FleetOutput | None = None
    valid: np.ndarray | None = None
    info: RoundInfo | None = None
    merged: PyTree = None
    frozen: PyTree = None
    aggregator: Any = None
    ledger: PrivacyLedger | None = None
    fedavg: PyTree = None
    fedavg_nodes: Any = None


class Feature:
    """An optional setting's part in the stages; every hook does nothing unless overridden."""

    def start(self, co: Coordinator, w: RoundWork) -> None:
        """Before the round: refuse it (raise) if it may not run.

        Args:
          co: the coordinator.
          w: the round.
        """

    def before_fit(self, co: Coordinator, w: RoundWork, baseline: bool) -> None:
        """Before a fleet fit (``baseline``: the FedAvg baseline's fit).

        Args:
          co: the coordinator.
          w: the round.
          baseline: whether the fit is the baseline's.
        """

    def after_fit(self, co: Coordinator, w: RoundWork, baseline: bool) -> None:
        """After a fleet fit (see :meth:`before_fit`).

        Args:
          co: the coordinator.
          w: the round.
          baseline: whether the fit was the baseline's.
        """

    def info(self, co: Coordinator, w: RoundWork) -> None:
        """After validation: the feature's fields of the round's info.

        Args:
          co: the coordinator.
          w: the round (its ``info`` is set).
        """

    def finish(self, co: Coordinator, w: RoundWork, new_state: CoordinatorState) -> None:
        """After a successful round: the feature's fields that depend on the new state.

        Args:
          co: the coordinator.
          w: the round.
          new_state: the state the round hands back.
        """


class ExampleLevelDP(Feature):
    """Example-level DP-SGD: the budget before the round, every node's epsilon in the info."""

    def start(self, co: Coordinator, w: RoundWork) -> None:  # noqa: D102 - see Feature
        from meta_consensus.coordinator import PrivacyBudgetStop

        assert co.example is not None  # the feature is attached under example-level DP only
        why = co.example.over_budget(co.example_steps(w.state))
        if why:
            raise PrivacyBudgetStop(f"round {w.state.round}: {why}")

    def info(self, co: Coordinator, w: RoundWork) -> None:  # noqa: D102 - see Feature
        assert w.info is not None
        co._example_epsilons(w.info, co.example_steps(w.state), pld=False)

    def finish(self, co: Coordinator, w: RoundWork, new_state: CoordinatorState) -> None:  # noqa: D102
        assert w.info is not None
        due = co.second_accountant_due(w.state.round)
        co._example_epsilons(w.info, co.example_steps(new_state), pld=due)


class FrozenBase(Feature):
    """A LoRA run: the frozen base every fit reads (the baseline's own first base for its fit)."""

    def before_fit(self, co: Coordinator, w: RoundWork, baseline: bool) -> None:  # noqa: D102
        assert co.lora is not None  # the feature is attached to LoRA runs only
        co.lora.frozen = co._baseline_frozen if baseline else w.state.frozen

    def after_fit(self, co: Coordinator, w: RoundWork, baseline: bool) -> None:  # noqa: D102
        assert co.lora is not None
        co.lora.frozen = w.state.frozen


class PretrainedBase(Feature):
    """A pretrained task: the base model's test metrics, logged with the first round."""

    def info(self, co: Coordinator, w: RoundWork) -> None:  # noqa: D102 - see Feature
        assert w.info is not None
        if w.state.round == 0:
            w.info.base_metrics = co.base_metrics(w.state)


class Merge:
    """Vote -> weights -> privacy of a round's valid candidates (the round's merge family)."""

    def merge(self, co: Coordinator, w: RoundWork) -> str:
        """Set ``w.merged``, ``w.frozen``, ``w.aggregator``, ``w.ledger`` and the info's vote fields.

        Args:
          co: the coordinator.
          w: the validated round.

        Returns:
          Why the round fails ("" when it merged).
        """
        raise NotImplementedError


class PipelineMerge(Merge):
    """The merge pipeline: the vote, the convex weights and node-level DP (with its ledger).

    The server reference's update and the nodes' statistics are the extras the vote's rules
    read; ``vote.server_step`` moves the merged model by the server's update afterwards.
    """

    def merge(self, co: Coordinator, w: RoundWork) -> str:  # noqa: D102 - see Merge
        from meta_consensus.coordinator import PrivacyBudgetStop

        assert w.out is not None and w.valid is not None and w.info is not None
        state, t = w.state, time.perf_counter()
        w.frozen = state.frozen
        # A fresh noise key for every (round, attempt): a retry never reuses noise.
        agg_state = co.pipeline.with_key(state.aggregator, w.k_dp)
        ledger = state.ledger
        event = co.pipeline.privacy_event(agg_state)
        if event is not None:
            assert ledger is not None  # an event means node-level DP, for which init made the ledger
            if not ledger.can_spend(event):
                raise PrivacyBudgetStop(
                    f"round {state.round}: epsilon would reach {ledger.epsilon_after(event):.3g}, "
                    f"over the budget {ledger.budget}"
                )
        try:
            extra = round_extra(co.round_needs, co.server, state.consensus, w.key)
            # vote.server_step's update is the round's, not the vote's, unless a rule asks for it.
            g = extra[SERVER_UPDATE] if co.cfg.vote.server_step > 0 else None
            if SERVER_UPDATE not in co.vote_needs:
                extra.pop(SERVER_UPDATE, None)
            # The nodes' Fisher / input Grams when the vote needs them (meta_consensus.statistics).
            extra.update(round_statistics(co.round_needs, co.fleet.task, co.fleet.data, w.out.submitted))
            merged, new_agg = co.pipeline.update(
                w.out.submitted, agg_state, state.consensus, w.valid, **extra
            )
            server_move = math.nan
            if g is not None:  # after the vote, the weights and the DP release (post-processing)
                moved = server_step(merged, g, float(co.cfg.vote.server_step))
                # What the server step changed: its move relative to the merge's own (the table's footer).
                server_move = relative_move(merged, moved, state.consensus)
                merged = moved
        except (RoundFailure, ByzantineToleranceError) as e:
            # Solver failure, or too few valid nodes left for the rule's precondition (Krum needs
            # m > 2f + 2 of the nodes that answered). The pipeline stopped before the noise was
            # drawn: nothing was released, nothing is charged.
            w.secs["merge"] = time.perf_counter() - t
            return str(e)
        if event is not None:
            # The DP release happened: it is charged even if the round is rejected below.
            assert ledger is not None  # checked before the merge
            ledger = copy.deepcopy(ledger)
            ledger.spend(event)
        merge = time.perf_counter() - t
        report = co.pipeline.report(new_agg)
        vote = report.seconds.get("vote", merge)
        weights = report.seconds.get("weights", 0.0)
        w.secs.update(vote=vote, weights=weights, dp=max(merge - vote - weights, 0.0))
        co._merge_info(w.info, report, ledger, second_accountant=co.second_accountant_due(state.round))
        w.info.server_move = server_move
        w.merged, w.aggregator, w.ledger = merged, new_agg, ledger
        return ""


class AdapterMerge(Merge):
    """A LoRA run: the adapter merge (:mod:`meta_consensus.lora`) replaces vote, weights and DP."""

    def merge(self, co: Coordinator, w: RoundWork) -> str:  # noqa: D102 - see Merge
        assert co.lora is not None and w.out is not None and w.valid is not None and w.info is not None
        state, t = w.state, time.perf_counter()
        assert state.frozen is not None  # a LoRA run's init made it
        w.ledger = state.ledger
        try:
            lm = co.lora.merge(state.frozen, w.out.submitted, w.valid, w.k_dp, state.consensus)
        except (ValueError, ByzantineToleranceError) as e:
            # Adapters the method refuses, or too few valid nodes for the rule: nothing released.
            w.secs["merge"] = time.perf_counter() - t
            return str(e)
        w.secs.update(vote=time.perf_counter() - t, weights=0.0, dp=0.0)
        w.merged, w.frozen, w.aggregator = lm.params, lm.frozen, state.aggregator
        co._lora_info(w.info, lm, w.valid)
        return ""


# ---------------------------------------------------------------------- the stages


def start(
    co: Coordinator,
    state: CoordinatorState,
    attempt: int,
    evaluate: bool | None,
    sample: ClientSample | None | Literal["draw"] = "draw",
) -> RoundWork:
    """The round's keys, sample and evaluation flag; the features' checks before the round.

    Args:
      co: the coordinator.
      state: the state before the round.
      attempt: the attempt at the round.
      evaluate: evaluate this round (None: every ``eval_every`` rounds and at the last round).
      sample: the round's slots; "draw" draws the config's client sample from the round key.

    Returns:
      The round, ready for ``fit``.

    Raises:
      PrivacyBudgetStop: a feature's budget would be exceeded by the round.
    """
    if evaluate is None:  # every eval_every rounds, and the last one
        evaluate = state.round + 1 >= co.cfg.rounds or (state.round + 1) % co.cfg.eval_every == 0
    key = co.round_key(state, attempt)
    k_fit, k_dp = jax.random.split(key)
    # Client sampling: the round's nodes (None: all); only they train, vote and are charged.
    if sample == "draw":
        sample = sampling.draw(co.cfg.nodes, key)
    assert not isinstance(sample, str)
    asked = None if sample is None else max(sample.count, 1)
    w = RoundWork(state, attempt, evaluate, key, k_fit, k_dp, sample, asked)
    for f in co.features:
        f.start(co, w)
    return w


def fit(co: Coordinator, w: RoundWork) -> None:
    """Broadcast + node fit: each node with its strategy; Byzantine nodes attack.

    Args:
      co: the coordinator.
      w: the round.
    """
    for f in co.features:
        f.before_fit(co, w, baseline=False)
    w.out = co.fleet.fit(w.state.nodes, w.state.consensus, w.k_fit, w.sample)
    w.secs["fit"] = w.out.seconds


def validate(co: Coordinator, w: RoundWork) -> str:
    """Structure and dtype, finiteness, the quality gate; the round's info.

    Args:
      co: the coordinator.
      w: the round with its answers (``w.out``).

    Returns:
      Why the round fails before the merge (too few valid answers), or "".
    """
    from meta_consensus.coordinator import too_few_answers

    assert w.out is not None
    out, state, cfg = w.out, w.state, co.cfg
    t = time.perf_counter()
    tree.check_stacked_against(out.submitted, state.consensus)
    finite = np.asarray(to_host(tree.finite_mask(out.submitted)), bool)
    valid = out.answered & finite
    errors = {str(i): e for i, e in out.errors.items()}
    for i in np.flatnonzero(out.answered & ~finite):
        errors[str(i)] = "non-finite candidate"
    node_test = co.fleet.evaluate_nodes(out.submitted, "test") if w.evaluate else None
    if cfg.quality_threshold is not None:
        held = co.fleet.evaluate_nodes(out.submitted, "heldout")["accuracy"]
        low = valid & ~(held >= cfg.quality_threshold)
        for i in np.flatnonzero(low):
            errors[str(i)] = f"held-out accuracy {held[i]:.3f} below quality_threshold"
        valid &= ~low
    w.secs["validate"] = time.perf_counter() - t
    w.valid = valid
    w.info = co._info(state, w.attempt, cfg.nodes.count, out, valid, errors, node_test, w.secs)
    co._wire_info(w.info, state)
    for f in co.features:
        f.info(co, w)
    return too_few_answers(cfg, valid, w.asked)


def merge(co: Coordinator, w: RoundWork) -> str:
    """Vote -> weights -> privacy (the coordinator's :class:`Merge`).

    Args:
      co: the coordinator.
      w: the validated round.

    Returns:
      Why the round fails, or "".
    """
    return co.merger.merge(co, w)


def accept(co: Coordinator, w: RoundWork) -> str:
    """Whether the vote accepted enough nodes and the new consensus is finite.

    Args:
      co: the coordinator.
      w: the merged round.

    Returns:
      Why the round is rejected (its DP charge stays), or "".
    """
    from meta_consensus.coordinator import too_few_accepted

    assert w.info is not None
    why = too_few_accepted(co.cfg, np.asarray(w.info.accepted, bool), w.asked)
    if why:
        return why
    if not bool(to_host(tree.is_finite(w.merged))) or (
        w.frozen is not None
        and w.frozen is not w.state.frozen
        and not bool(to_host(tree.is_finite(w.frozen)))
    ):
        return "the new consensus is not finite"
    return ""


def baseline(co: Coordinator, w: RoundWork) -> None:
    """The plain FedAvg baseline: same nodes, same keys, the uniform mean of its valid answers.

    Args:
      co: the coordinator.
      w: the accepted round.
    """
    state = w.state
    w.fedavg, w.fedavg_nodes = state.fedavg, state.fedavg_nodes
    if state.fedavg is None:
        return
    t = time.perf_counter()
    assert state.fedavg_nodes is not None  # the baseline's params and nodes are set together
    for f in co.features:
        f.before_fit(co, w, baseline=True)
    b = co.fleet.fit(state.fedavg_nodes, state.fedavg, w.k_fit, w.sample)
    for f in co.features:
        f.after_fit(co, w, baseline=True)
    ok = b.answered & np.asarray(to_host(tree.finite_mask(b.submitted)), bool)
    if ok.any():
        fedavg = tree.weighted_sum(b.submitted, jnp.asarray(ok / ok.sum(), jnp.float32))
        w.fedavg = jax.tree.map(lambda a, p: a.astype(p.dtype), fedavg, state.fedavg)
    w.fedavg_nodes = b.state
    w.secs["baseline"] = time.perf_counter() - t


def evaluate(co: Coordinator, w: RoundWork) -> None:
    """The new consensus (and the baseline) on the test and held-out sets, when the round evaluates.

    Args:
      co: the coordinator.
      w: the accepted round.
    """
    if not w.evaluate:
        return
    assert w.info is not None
    info, t = w.info, time.perf_counter()
    ev = co._evaluate_consensus(w.merged, w.fedavg, w.frozen)
    info.consensus_accuracy, info.consensus_loss = ev["test"]["accuracy"], ev["test"]["loss"]
    info.heldout_accuracy = ev["heldout"]["accuracy"]
    info.consensus_metrics = {k: v for k, v in ev["test"].items() if k not in OWN_METRICS}
    if w.fedavg is not None:
        info.fedavg_accuracy = ev["fedavg"]["accuracy"]
    w.secs["evaluate"] = time.perf_counter() - t


def finish(co: Coordinator, w: RoundWork, nodes: Any) -> tuple[CoordinatorState, RoundInfo]:
    """Bookkeeping: the new state (consensus in the old dtypes, round + 1) and the features' fields.

    Args:
      co: the coordinator.
      w: the evaluated round.
      nodes: the nodes' state after the round.

    Returns:
      The new state and the round's info.
    """
    from meta_consensus.coordinator import CoordinatorState

    assert w.info is not None
    state = w.state
    merged = jax.tree.map(lambda a, p: a.astype(p.dtype), w.merged, state.consensus)
    new_state = CoordinatorState(
        state.round + 1,
        merged,
        nodes,
        w.aggregator,
        w.fedavg,
        w.fedavg_nodes,
        w.ledger,
        state.key,
        w.frozen,
    )
    for f in co.features:
        f.finish(co, w, new_state)
    return new_state, w.info


def fail(w: RoundWork, reason: str, charged: bool = False) -> tuple[CoordinatorState, RoundInfo]:
    """A failed round: the state it started from (with the DP charge when one was made) and why.

    Args:
      w: the round.
      reason: why it failed.
      charged: whether the merge released noise (its ledger charge stays).

    Returns:
      The state and the round's info (``ok`` False).
    """
    assert w.info is not None
    w.info.ok, w.info.reason = False, reason
    return (w.state._replace(ledger=w.ledger) if charged else w.state), w.info
