"""The round: broadcast -> node fit -> validate -> vote -> weigh -> privatize -> new consensus -> evaluate.

``Coordinator(cfg).init(key) -> state`` and ``round(state) -> (state, info)``.
The state is a :class:`CoordinatorState` of arrays (and the privacy ledger);
``round`` never mutates it, so a failed round hands back the same state and a
:class:`RoundInfo` saying why. Randomness is a pure function of the root key,
the round index and the attempt: node fits, attacks, faults and DP noise of
round r, attempt a all come from ``fold_in(fold_in(key, r), a)``, which makes a
resumed run draw exactly what an uninterrupted one draws.

A round fails, keeping the previous consensus, node states and aggregator
state, when too few nodes answered with a valid candidate (``min_answers``, or
fewer than the vote's rule needs),
the vote accepted too few (``consensus_threshold``), the convex solver failed
(``weights.on_solver_failure = "fail"``) or the new consensus is not finite.
A DP step that ran is charged to the privacy ledger even when the round is
then rejected (the noised release was computed from the data); its noise key
is fresh for every attempt.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from consensus import tree
from consensus.mesh import to_host
from consensus.privacy import PrivacyLedger, calibrate_noise, pld_epsilon, rdp_epsilon
from meta_consensus import async_rounds, example_level_dp, sampling, stages
from meta_consensus import lora as lora_run
from meta_consensus.config import Config, ConfigError
from meta_consensus.fleet import Fleet
from meta_consensus.pipeline import MergePipeline, MergeReport
from meta_consensus.server import (
    SERVER_UPDATE,
    ServerReference,
    round_needs,
    split_root,
    vote_needs,
)
from meta_consensus.statistics import check_config as check_statistics_config
from strategies.tasks.base import Task
from strategies.trainer import TrainState

PyTree = Any


class CoordinatorState(NamedTuple):
    """Everything a run needs to continue (checkpointed whole).

    Attributes:
      round: rounds completed (failed rounds included).
      consensus: the consensus params tree.
      nodes: the nodes' stacked TrainState (optimizer states, keys, step counts).
      aggregator: the merge pipeline's state (DP state included).
      fedavg: the plain FedAvg baseline's params (None when disabled).
      fedavg_nodes: the baseline's nodes (None when disabled).
      ledger: the privacy ledger (None without DP); never mutated, copied when spent.
      key: the root key (raw uint32 data).
      frozen: LoRA runs: the frozen part of the model, ``{"base": the base params, "a": the
        shared a of FFA-LoRA or {}}`` (``consensus`` and the nodes' params are then adapter
        trees, see :mod:`meta_consensus.lora`); None otherwise.
      schedule: asynchronous rounds: the clock, the versions, the in-flight fits
        (:class:`meta_consensus.async_rounds.AsyncState`); None for synchronous rounds.
    """

    round: int
    consensus: PyTree
    nodes: TrainState
    aggregator: Any
    fedavg: PyTree | None
    fedavg_nodes: TrainState | None
    ledger: PrivacyLedger | None
    key: jax.Array
    frozen: PyTree | None = None
    schedule: Any = None


@dataclasses.dataclass
class RoundInfo:
    """What happened in one round (one line of metrics.jsonl).

    Per-node lists have length n; accuracies are on the shared test set. Values a round did not
    compute (no evaluation this round, no DP, a failed round) are NaN.

    Attributes:
      round: the round's index (0-based; a retried round keeps its index).
      attempt: the attempt at this round (0 first, then one per retry).
      ok: whether the round produced a new consensus; False keeps the previous one.
      reason: why the round failed ("" when ``ok``).
      answered: per node, whether it answered with a candidate.
      valid: per node, answered with a finite candidate that passed ``quality_threshold``.
      accepted: per node, whether the vote accepted its candidate.
      weights: per node, its weight in the merge (0 for those not accepted).
      errors: why a node's answer is missing or invalid, by node index (as a string).
      node_accuracy: per node, its candidate's test accuracy.
      node_loss: per node, its candidate's test loss.
      train_loss: per node, its mean training loss over the round.
      consensus_accuracy: the new consensus's test accuracy.
      consensus_loss: the new consensus's test loss.
      heldout_accuracy: the new consensus's accuracy on the server's held-out set.
      fedavg_accuracy: the plain FedAvg baseline's test accuracy (``baseline_fedavg``).
      epsilon: the privacy spent so far by the run's accountant (0 without DP; the largest node's
        under example-level DP).
      epsilon_rdp: the same under the RDP accountant (a comparison when the run's is PLD; NaN
        in rounds where that comparison is not due, see :meth:`Coordinator.second_accountant_due`).
      epsilon_pld: the same under the PLD accountant (as ``epsilon_rdp``, the other way round).
      clip_norm: the DP clipping norm.
      noise_std: the DP noise's standard deviation.
      solve_ms: the weight solver's time in milliseconds (0 without a solver).
      weight_cap: the per-node weight cap in effect.
      seconds: the round's wall time by phase (fit, validate, vote, weights, dp, baseline, evaluate).
      node_epsilon: example-level DP: every node's epsilon (the run's accountant) after this round.
      sampled: client sampling: the nodes sampled this round (empty under full participation);
        the per-node lists hold the sampled nodes' values and False / NaN / 0 for the others.
      bytes_up: bytes a node sends this round (its params, or its adapter in a LoRA run).
      bytes_down: bytes a node receives (the consensus, or the adapter plus any base delta).
      trainable_params: scalars a node trains (the adapter in a LoRA run).
      model_params: scalars of the whole model.
      adapter: LoRA runs: the adapter merge's method, exactness and ranks (consensus.lora's info).
      node_metrics: per node, its candidate's test metrics beyond loss and accuracy, by name (a
        language task's ``perplexity`` and per-domain ``perplexity/<domain>``, ...); empty when
        the task has none or the round did not evaluate.
      consensus_metrics: the same for the new consensus.
      base_metrics: a pretrained task's base model (the run's initial consensus) on the test set,
        every metric, logged with the first round; empty otherwise.
      virtual_time: the virtual clock at the end of the round (the schedule's speed model: a
        synchronous round lasts as long as its slowest node's fit, an asynchronous one ends
        when its buffer's last update arrives).
      versions: asynchronous rounds: the version each buffered update was trained from.
      staleness: asynchronous rounds: each buffered update's staleness (versions behind).
      dropped: asynchronous rounds: updates dropped for staleness while the buffer filled.
      share: per node, its share of the merge (:class:`~meta_consensus.pipeline.MergeReport`):
        a linear merge's weights summing to 1, the kept order statistics' weight averaged over
        coordinates, or NaN for a rule that weighs no node; empty in runs logged before it.
      share_kind: how to read ``share`` ("weights", "coordinates", "not a weighted rule").
      decided_by: the stage whose output is the merge ("vote" or "weights").
      stage_note: one line when the weights replaced the output of a vote that kept every node.
      server_move: ``vote.server_step``'s move of the consensus relative to the merge's own move
        from the round's start (NaN without a server step).
    """

    round: int
    attempt: int
    ok: bool
    reason: str
    answered: list[bool]
    valid: list[bool]
    accepted: list[bool]
    weights: list[float]
    errors: dict[str, str]
    node_accuracy: list[float]
    node_loss: list[float]
    train_loss: list[float]
    consensus_accuracy: float
    consensus_loss: float
    heldout_accuracy: float
    fedavg_accuracy: float
    epsilon: float
    epsilon_rdp: float
    epsilon_pld: float
    clip_norm: float
    noise_std: float
    solve_ms: float
    weight_cap: float
    seconds: dict[str, float]
    node_epsilon: list[float] = dataclasses.field(default_factory=list)
    sampled: list[int] = dataclasses.field(default_factory=list)
    bytes_up: int = 0
    bytes_down: int = 0
    trainable_params: int = 0
    model_params: int = 0
    adapter: dict[str, Any] = dataclasses.field(default_factory=dict)
    node_metrics: dict[str, list[float]] = dataclasses.field(default_factory=dict)
    consensus_metrics: dict[str, float] = dataclasses.field(default_factory=dict)
    base_metrics: dict[str, float] = dataclasses.field(default_factory=dict)
    virtual_time: float = math.nan
    versions: list[int] = dataclasses.field(default_factory=list)
    staleness: list[int] = dataclasses.field(default_factory=list)
    dropped: int = 0
    share: list[float] = dataclasses.field(default_factory=list)
    share_kind: str = ""
    decided_by: str = ""
    stage_note: str = ""
    server_move: float = math.nan

    def to_json(self) -> dict[str, Any]:
        """The info as a JSON-safe dict (non-finite floats as the strings "nan", "inf", "-inf")."""
        d = dataclasses.asdict(self)
        return {k: _json_safe(v) for k, v in d.items()}

    @staticmethod
    def from_json(d: dict[str, Any]) -> RoundInfo:
        """The info that :meth:`to_json` wrote (keys RoundInfo does not know are left out).

        Args:
          d: one line of metrics.jsonl, parsed.

        Returns:
          The RoundInfo.
        """
        names = {f.name for f in dataclasses.fields(RoundInfo)}
        return RoundInfo(**{k: _from_json(v) for k, v in d.items() if k in names})


def _json_safe(v: Any) -> Any:
    if isinstance(v, float) and not math.isfinite(v):
        return "nan" if math.isnan(v) else ("inf" if v > 0 else "-inf")
    if isinstance(v, list):
        return [_json_safe(x) for x in v]
    if isinstance(v, dict):
        return {k: _json_safe(x) for k, x in v.items()}
    return v


def _from_json(v: Any) -> Any:
    if v in ("nan", "inf", "-inf"):
        return float(v)
    if isinstance(v, list):
        return [_from_json(x) for x in v]
    if isinstance(v, dict):
        return {k: _from_json(x) for k, x in v.items()}
    return v


def _floats(x: Any) -> list[float]:
    return [float(v) for v in np.asarray(x, np.float64).reshape(-1)]


def _bools(x: Any) -> list[bool]:
    return [bool(v) for v in np.asarray(x).reshape(-1)]


_OWN_METRICS = stages.OWN_METRICS


class Coordinator:
    """The round lifecycle of a config (see the module docstring).

    Args:
      cfg: the run config.
      task: a Task object instead of the one the config names.
      process_index, process_count: this process in a ``jax.distributed`` run.
    """

    def __init__(
        self, cfg: Config, *, task: Task | None = None, process_index: int = 0, process_count: int = 1
    ):
        self.cfg = cfg
        # Asynchronous rounds fit a buffer's worth of nodes per call (the fleet's chunk).
        fleet_cfg = cfg
        if cfg.schedule.asynchronous and cfg.nodes.chunk == 0:
            fleet_cfg = cfg.replace(nodes=dataclasses.replace(cfg.nodes, chunk=cfg.schedule.buffer))
        self.fleet = Fleet(fleet_cfg, task=task, process_index=process_index, process_count=process_count)
        # LoRA runs: the nodes train adapters of the task's model (meta_consensus.lora).
        self.lora = lora_run.attach(self.fleet) if lora_run.enabled(cfg) else None
        self.server = self._server_reference(process_count)
        self.example = self._example_accountant()
        self.noise_multiplier = self._noise_multiplier()
        # Example-level DP lives in the nodes: the merge pipeline adds no node-level DP step.
        pipe_cfg = cfg.replace(dp=dataclasses.replace(cfg.dp, enabled=False)) if self.example else cfg
        self.pipeline = MergePipeline(
            pipe_cfg, self.fleet.task, self.fleet.data.heldout, self.noise_multiplier
        )
        self.aggregator = self.pipeline.aggregator
        self._eval_jit: Callable[..., Any] | None = None  # built on the first evaluated round
        self.dp = cfg.dp.enabled and self.example is None  # node-level DP (the ledger)
        # LoRA runs: the adapter merge replaces the vote, the weights and node-level DP.
        self._baseline_frozen: PyTree | None = None  # the FedAvg baseline's frozen part (LoRA)
        # A pretrained task's base model on the test set, evaluated once (the first round logs it).
        self._base_metrics: dict[str, float] | None = None
        # The optional settings' parts in the round's stages, and the round's merge.
        self.features: list[stages.Feature] = []
        if self.lora is not None:
            self.features.append(stages.FrozenBase())
        if getattr(self.fleet.task, "pretrained", False):
            self.features.append(stages.PretrainedBase())
        if self.example is not None:
            self.features.append(stages.ExampleLevelDP())
        self.merger: stages.Merge = stages.AdapterMerge() if self.lora is not None else stages.PipelineMerge()
        # The virtual clock's node speeds, and the asynchronous schedule (None: synchronous rounds).
        self.speeds = async_rounds.SpeedModel(cfg)
        self.schedule = async_rounds.AsyncSchedule(self) if cfg.schedule.asynchronous else None

    def _server_reference(self, process_count: int) -> ServerReference | None:
        """Server-guided rules: split the root set off the held-out data (before anything reads it)."""
        self.round_needs = round_needs(self.cfg)
        self.vote_needs = vote_needs(self.cfg)
        check_statistics_config(self.cfg, self.round_needs, process_count)  # fisher_merge, regmean
        if SERVER_UPDATE not in self.round_needs:
            return None
        # Every process holds the whole held-out split and the replicated consensus, so each
        # computes the same root set and the same update from the round key.
        data = self.fleet.data
        root, rest = split_root(data.heldout, self.cfg.vote.root_size, self.cfg.seed)
        self.fleet.data = dataclasses.replace(data, heldout=rest)
        # The fleet's config: nodes.batch_size = "auto" is resolved there (the root set's steps
        # use the nodes' batch size).
        return ServerReference(self.fleet.task, root, self.fleet.cfg)

    def _example_accountant(self) -> example_level_dp.ExampleAccountant | None:
        """Example-level DP-SGD: refuse leaking configs, calibrate every node, hand the fleet its settings."""
        if not example_level_dp.is_example_level(self.cfg):
            return None
        if jax.process_count() > 1:
            raise ConfigError("dp.level = 'example' runs in one process (nodes are calibrated on one host)")
        settings = list(self.fleet.settings)
        example_level_dp.check_no_leaks(self.cfg, self.fleet.task, settings)
        acc = example_level_dp.ExampleAccountant(
            self.cfg,
            self.fleet.data.train_count,
            [sum(st.level_steps) for st in settings],
            fleets=2 if self.cfg.baseline_fedavg else 1,
        )
        self.fleet.example_dp = acc.spec()
        return acc

    def example_steps(self, state: CoordinatorState) -> np.ndarray:
        """The (n,) DP-SGD steps each node's examples went through (both fleets when the baseline runs).

        Args:
          state: the run's state.

        Returns:
          An int64 array, one count per node.
        """
        steps = np.asarray(to_host(state.nodes.step), np.int64)
        if state.fedavg_nodes is not None:
            steps = steps + np.asarray(to_host(state.fedavg_nodes.step), np.int64)
        return steps

    def _example_epsilons(self, info: RoundInfo, steps: np.ndarray, pld: bool) -> None:
        assert self.example is not None  # called under example-level DP only
        nodes = self.example.nodes(steps, pld=pld)
        own = "epsilon_rdp" if self.cfg.dp.accountant == "rdp" else "epsilon_pld"
        info.node_epsilon = [getattr(p, own) for p in nodes]
        info.epsilon = max(info.node_epsilon)
        info.epsilon_rdp = max(p.epsilon_rdp for p in nodes)
        info.epsilon_pld = max(p.epsilon_pld for p in nodes) if pld or own == "epsilon_pld" else math.nan
        info.clip_norm = self.example.clip_norm

    def privacy_summary(self, state: CoordinatorState) -> dict[str, Any]:
        """What ``privacy.json`` holds: level, delta, the run's epsilon and (example level) every node's.

        Args:
          state: the run's state (its ledger, or its nodes' DP-SGD step counts).

        Returns:
          A JSON-safe dict (an infinite epsilon as the string "inf").
        """
        d = self.cfg.dp
        if self.example is not None:
            return self.example.summary(self.example_steps(state))
        if self.dp:
            eps = state.ledger.epsilon() if state.ledger is not None else 0.0
            return {
                "level": "node",
                "unit": "all of one node's data",
                "delta": d.delta,
                "epsilon": eps if math.isfinite(eps) else "inf",
                "accountant": d.accountant,
                "nodes": [],
            }
        return {"level": "off", "unit": None, "delta": None, "epsilon": "inf", "nodes": []}

    def _noise_multiplier(self) -> float | None:
        d = self.cfg.dp
        if not d.enabled or self.example is not None:
            return None
        if d.noise_multiplier is not None:
            return float(d.noise_multiplier)
        q = sampling.privacy_sampling_rate(self.cfg.nodes)
        assert d.epsilon is not None  # the config requires a target without noise_multiplier
        return calibrate_noise(d.epsilon, d.delta, q, self.cfg.rounds, d.accountant)

    # ------------------------------------------------------------------ init

    def _warm_start(self, params: PyTree, key: jax.Array) -> PyTree:
        """The initial consensus after ``nodes.public_warm_start`` steps on the public pool."""
        from meta_consensus.warm_start import public_warm_start

        nd = self.fleet.cfg.nodes  # the fleet's resolved batch size
        return public_warm_start(self.fleet.task, self.fleet.data, params, key, steps=nd.public_warm_start,
                                 learning_rate=nd.learning_rate, batch_size=nd.batch_size,  # type: ignore[arg-type]
                                 optimizer=nd.optimizer)  # fmt: skip

    def init(self, key: jax.Array | int | None = None, params: PyTree | None = None) -> CoordinatorState:
        """Initial consensus, node states and aggregator state.

        Args:
          key: root PRNG key or seed (default: the config's seed).
          params: the initial consensus, e.g. a pretrained model (default: the task's init).
            Its structure, shapes and dtypes must match the task's params.
        """
        key = jax.random.key(self.cfg.seed if key is None else key) if not isinstance(key, jax.Array) else key
        k_params, k_nodes = jax.random.split(key)
        fresh = self.fleet.initial_params(k_params)
        if params is None:  # the warm start replaces the random init; a given start is used as is
            params = self._warm_start(fresh, k_params)
        else:
            tree.check_same_structure([params], reference=fresh)
        frozen = None
        if self.lora is not None:  # params is the base model; the nodes train its adapters
            params = self.lora.pretrain(self.fleet.data, params, k_params)
            params, frozen = self.lora.start(params, k_params)
            self._baseline_frozen = frozen
        nodes = self.fleet.init(k_nodes, params)
        agg_state = self.pipeline.init(params)
        baseline = self.cfg.baseline_fedavg
        ledger = (
            PrivacyLedger(self.cfg.dp.delta, self.cfg.dp.budget, self.cfg.dp.accountant) if self.dp else None
        )
        state = CoordinatorState(
            round=0,
            consensus=params,
            nodes=nodes,
            aggregator=agg_state,
            fedavg=params if baseline else None,
            fedavg_nodes=nodes if baseline else None,
            ledger=ledger,
            key=jax.random.key_data(key),
            frozen=frozen,
        )
        return state if self.schedule is None else self.schedule.init(self, state)

    # ------------------------------------------------------------------ the round

    def round_key(self, state: CoordinatorState, attempt: int) -> jax.Array:
        """The key of ``state``'s round at ``attempt``: ``fold_in(fold_in(key, round), attempt)``.

        Args:
          state: the run's state (its root key and round).
          attempt: the attempt at the round (0 first).

        Returns:
          The round's key; node fits, attacks, faults and DP noise all derive from it.
        """
        return round_key(state.key, state.round, attempt)

    def round(
        self, state: CoordinatorState, *, attempt: int = 0, evaluate: bool | None = None
    ) -> tuple[CoordinatorState, RoundInfo]:
        """Run one round; on failure return ``state`` unchanged (round counter aside) and say why.

        The returned state's ``round`` is ``state.round + 1`` when the round succeeded;
        a failed attempt returns ``state`` itself (retry it with ``attempt + 1``, or
        :meth:`skip` it).

        Args:
          state: the run's state before the round.
          attempt: the attempt at this round (0 first); each attempt draws fresh keys.
          evaluate: evaluate the nodes and the consensus on the test set (default: every
            ``eval_every`` rounds and at the last round).

        Returns:
          The new state (or ``state`` with a DP charge, for a rejected round that released
          noise) and the round's :class:`RoundInfo`.

        Raises:
          PrivacyBudgetStop: example-level DP whose next round would go over the budget.
        """
        if self.schedule is not None:  # a buffer filled on the virtual clock, then the same stages
            return self.schedule.round(self, state, attempt=attempt, evaluate=evaluate)
        new_state, info = self._sync_round(state, attempt, evaluate)
        info.virtual_time = self.speeds.sync_clock(state.round)
        return new_state, info

    def _sync_round(
        self, state: CoordinatorState, attempt: int, evaluate: bool | None
    ) -> tuple[CoordinatorState, RoundInfo]:
        w = stages.start(self, state, attempt, evaluate)
        stages.fit(self, w)
        why = stages.validate(self, w)
        if why:
            return stages.fail(w, why)
        why = stages.merge(self, w)
        if why:
            return stages.fail(w, why)
        why = stages.accept(self, w)
        if why:
            return stages.fail(w, why, charged=True)
        stages.baseline(self, w)
        stages.evaluate(self, w)
        assert w.out is not None
        return stages.finish(self, w, w.out.state)

    def base_metrics(self, state: CoordinatorState) -> dict[str, float]:
        """The test metrics of the run's base model: the initial consensus (LoRA: ``b = 0``).

        Evaluated once per coordinator (a retried or resumed first round reuses or recomputes
        the same numbers).

        Args:
          state: a state of the first round (its consensus and frozen part are the base).

        Returns:
          Every metric of the task on the test set.
        """
        if self._base_metrics is None:
            self._base_metrics = self._evaluate_consensus(state.consensus, None, state.frozen)["test"]
        return dict(self._base_metrics)

    def second_accountant_due(self, round_index: int) -> bool:
        """Whether round ``round_index`` (0-based) logs the comparison accountant's epsilon.

        The ledger's own accountant is updated every round; the other one (PLD next to an RDP
        ledger, or RDP next to a PLD one) is recomputed from scratch over all rounds, which
        costs far more than a round's merge at small noise, so it is computed only for the
        rounds that end with a checkpoint (``checkpoint_every``) and for the last round.
        A pure function of the round index: a resumed run logs it for the same rounds.

        Args:
          round_index: the round (0-based).

        Returns:
          True for a round that ends with a checkpoint, and for the last round.
        """
        r, every = round_index + 1, self.cfg.checkpoint_every
        return r >= self.cfg.rounds or (every > 0 and r % every == 0)

    def _evaluate_consensus(
        self, merged: PyTree, fedavg: PyTree | None, frozen: PyTree | None = None
    ) -> dict[str, dict[str, float]]:
        """The consensus on test and held-out data and FedAvg on test: one jitted call, one transfer.

        ``frozen``: a LoRA run's frozen part of the consensus (the baseline's is its first one).
        """
        if self._eval_jit is None:
            task = self.fleet.task

            def evaluate(merged, fedavg, test, heldout, frozen, baseline_frozen):
                def metrics(p, batch, fz):
                    if fz is None:
                        return task.metrics(p, batch)
                    return task.metrics(p, batch, frozen=fz)  # a LoraTask

                out = {"test": metrics(merged, test, frozen), "heldout": metrics(merged, heldout, frozen)}
                if fedavg is not None:
                    out["fedavg"] = metrics(fedavg, test, baseline_frozen)
                return out

            self._eval_jit = jax.jit(evaluate)
            data = (self.fleet.data.test, self.fleet.data.heldout)
            # Without a mesh, the evaluation data moves to the device once, not every round (on a
            # mesh the jitted call places the host arrays next to the sharded consensus).
            self._eval_data = jax.device_put(data) if self.fleet.trainer.mesh is None else data
        out = to_host(self._eval_jit(merged, fedavg, *self._eval_data, frozen, self._baseline_frozen))
        return {k: {m: float(v) for m, v in d.items()} for k, d in out.items()}

    def skip(self, state: CoordinatorState) -> CoordinatorState:
        """Give up on the current round: the previous consensus carries over to the next one.

        Args:
          state: the state a failed round handed back.

        Returns:
          ``state`` with its round counter advanced.
        """
        return state._replace(round=state.round + 1)

    # ------------------------------------------------------------------ info

    def _info(self, state, attempt, n, out, valid, errors, node_test, secs) -> RoundInfo:
        if out.ids is not None:  # client sampling: rows are the sample's slots
            return _sampled_info(self, state, attempt, n, out, valid, errors, node_test, secs)
        nan = math.nan
        eps = state.ledger.epsilon() if state.ledger is not None else 0.0
        return RoundInfo(
            round=state.round,
            attempt=attempt,
            ok=True,
            reason="",
            answered=_bools(out.answered),
            valid=_bools(valid),
            accepted=[False] * n,
            weights=[0.0] * n,
            errors=errors,
            node_accuracy=_floats(node_test["accuracy"]) if node_test is not None else [nan] * n,
            node_loss=_floats(node_test["loss"]) if node_test is not None else [nan] * n,
            train_loss=_floats(out.loss),
            consensus_accuracy=nan,
            consensus_loss=nan,
            heldout_accuracy=nan,
            fedavg_accuracy=nan,
            epsilon=eps,
            epsilon_rdp=eps if self.dp else 0.0,
            epsilon_pld=eps if self.dp else 0.0,
            clip_norm=nan,
            noise_std=nan,
            solve_ms=0.0,
            weight_cap=nan,
            seconds=secs,
            node_metrics=(
                {k: _floats(v) for k, v in node_test.items() if k not in _OWN_METRICS}
                if node_test is not None
                else {}
            ),
        )

    def _merge_info(
        self, info: RoundInfo, report: MergeReport, ledger: PrivacyLedger | None, *, second_accountant: bool
    ) -> None:
        info.accepted = _bools(report.accepted)
        info.weights = _floats(report.weights)
        if info.sampled:  # slot values -> the sampled nodes' entries of the (n,) lists
            k, n = len(info.sampled), self.cfg.nodes.count
            info.accepted = _bools(sampling.place(report.accepted[:k], info.sampled, n, False))
            info.weights = _floats(sampling.place(report.weights[:k], info.sampled, n, 0.0))
        info.solve_ms, info.weight_cap = report.solve_ms, report.weight_cap
        # Each node's share of the merge, how to read it, and the stage whose output is the merge.
        info.share_kind, info.decided_by, info.stage_note = report.share_kind, report.decided_by, report.note
        info.share = _floats(report.share)
        if info.sampled:
            k, n = len(info.sampled), self.cfg.nodes.count
            info.share = _floats(sampling.place(np.asarray(report.share)[:k], info.sampled, n, 0.0))
        if ledger is not None:
            info.clip_norm, info.noise_std = report.clip_norm, report.noise_std
            rounds = ledger.rounds
            z, delta = self.noise_multiplier, self.cfg.dp.delta
            q = ledger.events[-1].sampling_rate if ledger.events else 1.0
            info.epsilon = ledger.epsilon()
            # The ledger's own accountant every round; the other one (a comparison) where due.
            own, other = (
                ("epsilon_rdp", "epsilon_pld")
                if self.cfg.dp.accountant == "rdp"
                else ("epsilon_pld", "epsilon_rdp")
            )
            setattr(info, own, info.epsilon)
            if z == 0:
                setattr(info, other, math.inf)
            elif not second_accountant:
                setattr(info, other, math.nan)
            else:
                assert z is not None  # node-level DP: the coordinator calibrated it
                if other == "epsilon_pld":
                    info.epsilon_pld = _pld(z, q, rounds, delta, info.epsilon)
                else:
                    info.epsilon_rdp = rdp_epsilon(z, q, rounds, delta)

    def _wire_info(self, info: RoundInfo, state: CoordinatorState) -> None:
        """Parameter counts, and the bytes of a whole-model round (a LoRA merge sets its own)."""
        from strategies.lora import tree_bytes, tree_size

        if state.frozen is not None:
            info.trainable_params = tree_size(state.consensus)
            info.model_params = tree_size(state.frozen["base"])
            return
        info.trainable_params = info.model_params = tree_size(state.consensus)
        info.bytes_up = info.bytes_down = tree_bytes(state.consensus)

    def _lora_info(self, info: RoundInfo, lm: Any, valid: np.ndarray) -> None:
        """A LoRA round's vote and wire: accepted nodes, weights, bytes, parameter counts, exactness."""
        n, rows = self.cfg.nodes.count, np.flatnonzero(valid)
        accepted = np.zeros((n,), bool)
        accepted[rows] = True
        selected = lm.info.get("selected")
        if selected is not None:  # a robust rule's choice among the valid nodes
            sel = np.asarray(selected)
            keep = np.zeros((len(rows),), bool)
            if sel.dtype == bool:
                keep = sel.reshape(-1)[: len(rows)]
            else:
                keep[sel.astype(np.int64)] = True
            accepted[:] = False
            accepted[rows[keep]] = True
        weights = np.zeros((n,), np.float64)
        w = lm.info.get("weights")
        if w is not None and len(w) == len(rows):
            weights[rows] = np.asarray(w, np.float64)
        else:
            weights[accepted] = 1.0 / max(int(accepted.sum()), 1)
        info.accepted, info.weights = _bools(accepted), _floats(weights)
        info.bytes_up, info.bytes_down = int(lm.info["bytes_up"]), int(lm.info["bytes_down"])
        keys = (
            "method",
            "exactness",
            "rank",
            "rank_out",
            "space",
            "relative_truncation_error",
            "relative_approximation_error",
        )
        info.adapter = {
            k: lm.info[k] for k in keys if k in lm.info and isinstance(lm.info[k], str | int | float)
        }

    @staticmethod
    def _fail(info: RoundInfo, reason: str) -> RoundInfo:
        info.ok = False
        info.reason = reason
        return info


def _sampled_info(co, state, attempt, n, out, valid, errors, node_test, secs) -> RoundInfo:
    """The RoundInfo of a client-sampled round: slot values placed at their nodes (lists of n)."""
    ids, real = out.ids, out.ids >= 0
    k = int(real.sum())
    nodes = ids[:k]  # real slots come first, in node order

    def at(values, fill):
        return sampling.place(np.asarray(values)[:k], nodes, n, fill)

    full = dataclasses.replace(out, answered=at(out.answered, False), loss=at(out.loss, np.nan), ids=None)
    test = None if node_test is None else {m: at(v, np.nan) for m, v in node_test.items()}
    named = {str(int(ids[int(j)])): e for j, e in errors.items() if real[int(j)]}
    info = co._info(state, attempt, n, full, at(valid, False), named, test, secs)
    info.sampled = [int(i) for i in nodes]
    return info


def _pld(z: float, q: float, rounds: int, delta: float, eps_rdp: float) -> float:
    """PLD epsilon on a grid scaled to the epsilon (RDP's, an upper bound) so it costs milliseconds.

    The grid step bounds PLD's discretization error; 1e-4 is the default, but at tiny noise
    multipliers (epsilon in the thousands) that grid needs millions of points per round.
    """
    h = min(1.0, max(1e-4, eps_rdp / 1e5)) if math.isfinite(eps_rdp) else 1.0
    for step in (h, 1.0):
        try:
            return pld_epsilon(z, q, rounds, delta, discretization=step)
        except ValueError:
            continue
    return math.nan


# The round's rules, shared with every front end that runs rounds (the Flower strategy too).


def round_key(key_data: jax.Array, round_index: int, attempt: int) -> jax.Array:
    """The key of round ``round_index``, attempt ``attempt``: ``fold_in(fold_in(root, r), a)``.

    Args:
      key_data: the root key's raw data (:attr:`CoordinatorState.key`).
      round_index: the round (0-based).
      attempt: the attempt at the round (0 first).

    Returns:
      A typed PRNG key.
    """
    # One compiled call, since eager fold_ins dispatch op by op every round; the same bits as eagerly.
    return _round_key(jnp.asarray(key_data), jnp.uint32(round_index), jnp.uint32(attempt))


@jax.jit
def _round_key(key_data: jax.Array, round_index: jax.Array, attempt: jax.Array) -> jax.Array:
    root = jax.random.wrap_key_data(key_data)
    return jax.random.fold_in(jax.random.fold_in(root, round_index), attempt)


def too_few_answers(cfg: Config, valid: np.ndarray, asked: int | None = None) -> str:
    """Why the round fails before the merge (fewer valid answers than ``min_answers``), or "".

    Args:
      cfg: the run config (``min_answers``, ``nodes.count``).
      valid: (n,) bool, the nodes that answered with a valid candidate.
      asked: the nodes the round asked (the sample's size under client sampling; default n).

    Returns:
      The reason, or "" when there are enough.
    """
    n, got = cfg.nodes.count if asked is None else asked, int(np.sum(valid))
    need = math.ceil(cfg.min_answers * n)
    return f"too few valid answers: {got} of {n}, need {need}" if got < need else ""


def too_few_accepted(cfg: Config, accepted: np.ndarray, asked: int | None = None) -> str:
    """Why the round fails after the vote (fewer accepted than ``consensus_threshold``), or "".

    Args:
      cfg: the run config (``consensus_threshold``, ``nodes.count``).
      accepted: (n,) bool, the nodes the vote accepted.
      asked: the nodes the round asked (the sample's size under client sampling; default n).

    Returns:
      The reason, or "" when there are enough.
    """
    n, got = cfg.nodes.count if asked is None else asked, int(np.sum(accepted))
    need = math.ceil(cfg.consensus_threshold * n)
    return f"the vote accepted {got} of {n} nodes, consensus_threshold needs {need}" if got < need else ""


class PrivacyBudgetStop(RuntimeError):
    """The next round would exceed the privacy budget: the run stops with the consensus it has."""
