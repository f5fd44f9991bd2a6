"""ConsensusStrategy: a Flower strategy (Message API) whose aggregation is this package's merge.

``aggregate_train(server_round, replies)`` runs the round the in-process
:class:`~meta_consensus.coordinator.Coordinator` runs after its nodes answered, with the
same config sections and the same rules:

1. **answers.** Node i is the SuperNode whose node config says ``partition-id = i``; its
   reply carries that id, the round it answers and its candidate as an ArrayRecord
   (:mod:`meta_consensus.flower.arrays`). A reply that carries an error, answers another
   round (too late), repeats a partition, does not match the consensus's keys, shapes or
   dtypes, or is not finite is a **missing answer** with its reason; a node that did not
   reply before the round's timeout, or whose SuperNode died, is missing too. Each missing
   answer is filed under its partition (the strategy asks a node it has not seen yet which
   partition it serves with one small ``query`` message) with Flower's reason (the error
   reply's text and code, or ``no reply: node went offline``), in :attr:`history`, in the
   round's MetricRecord (``missing``: the partitions) and in one log line.
   The replies are gathered by :class:`~meta_consensus.flower.replies.RoundGrid`, which
   stops waiting for a node the SuperLink no longer lists: with flwr 1.42 a SuperNode that
   dies while it uploads its reply would otherwise hold every reply of the round for 180 s
   (see that module).
2. **the round's rules**, shared with the coordinator
   (:func:`~meta_consensus.coordinator.too_few_answers`,
   :func:`~meta_consensus.coordinator.too_few_accepted`): fewer valid answers than
   ``min_answers``, a vote that accepts fewer than ``consensus_threshold``, a solver failure
   or a non-finite consensus fail the round, and the previous consensus stays.
3. **the merge**: :class:`~meta_consensus.pipeline.MergePipeline` of the config (vote with
   pre-aggregators, convex weights, DP), with the round's DP key from
   :func:`~meta_consensus.coordinator.round_key` (``fold_in(fold_in(key(seed), r), 0)``,
   the in-process run's first attempt of round r) and one
   :class:`~consensus.privacy.PrivacyLedger` kept across rounds: a DP release is charged
   even when the round is then rejected; a round that would go over ``dp.budget`` is not
   run, and the strategy sends no more work.

A Flower round is one attempt: a failed round is skipped (the in-process run with
``max_retries = 0``). The strategy holds the consensus itself; the ``arrays`` Flower
passes back in are checked against it, never trusted.

The returned MetricRecord holds the round's info (``ok``, ``answered``, ``valid``, ``missing``,
``accepted`` (0/1 per node), ``weights`` (per node), ``epsilon``, ``noise_std``, the
consensus's test and held-out accuracy, and the node-weighted mean training loss);
reasons and per-node errors, which a MetricRecord cannot hold, are in :attr:`history`.
Evaluation replies are aggregated as Flower's FedAvg does (means weighted by
``num-examples``).

LoRA runs (``[nodes.lora]``): the strategy holds the frozen base and the adapter; the messages
carry the adapter's trainable arrays (and, after a merge that produced one, the dense base delta
with the base's version and SHA-256; see :mod:`meta_consensus.flower.node`), and the merge is
:meth:`meta_consensus.lora.LoraRound.merge` (``vote.adapter_method``, ``vote.rule`` robustly in
``vote.adapter_space``). Every round records the bytes of the arrays each node received and
sent (:attr:`FlowerRound.bytes_down`, :attr:`FlowerRound.bytes_up`: the mean over the nodes).

This module lives in the system layer (``meta_consensus.flower``), not in ``consensus``:
it needs the system's config and pipeline, and the library never imports the system.
"""

from __future__ import annotations

import copy
import dataclasses
import logging
import math
import time
from collections.abc import Callable, Iterable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flwr.app import ArrayRecord, ConfigRecord, Message, MessageType, MetricRecord, RecordDict
from flwr.serverapp import Grid
from flwr.serverapp.strategy import Result, Strategy
from flwr.serverapp.strategy.strategy_utils import aggregate_metricrecords

from consensus import tree
from consensus.base import ByzantineToleranceError
from consensus.mesh import to_host
from consensus.privacy import PrivacyLedger, calibrate_noise
from meta_consensus import config as config_lib
from meta_consensus import lora as lora_run
from meta_consensus.config import Config
from meta_consensus.coordinator import round_key, too_few_accepted, too_few_answers
from meta_consensus.fleet import make_task
from meta_consensus.flower.arrays import ArrayRecordMismatch, from_array_record, to_array_record
from meta_consensus.flower.node import (
    BASE_DELTA,
    BASE_DIGEST_KEY,
    BASE_VERSION_KEY,
    CONFIG_KEY,
    EXAMPLES_KEY,
    PARTITION_KEY,
    ROUND_KEY,
    check_flower_config,
)
from meta_consensus.flower.replies import RoundGrid
from meta_consensus.pipeline import MergePipeline, RoundFailure
from meta_consensus.server import SERVER_UPDATE, ServerReference, round_extra, server_step, split_root
from strategies.registry import check_task
from strategies.tasks.base import Task

PyTree = Any
log = logging.getLogger(__name__)


@dataclasses.dataclass
class FlowerRound:
    """What happened in one Flower round (the strategy's :attr:`~ConsensusStrategy.history`).

    Attributes:
      server_round: Flower's round number (1-based).
      ok: whether the round produced a new consensus; False keeps the previous one.
      reason: why the round failed ("" when ``ok``).
      answered: per partition, whether its node's reply arrived and decoded as a candidate.
      valid: per partition, answered with a finite candidate above ``quality_threshold``.
      accepted: per partition, whether the vote accepted its candidate.
      weights: per partition, its weight in the consensus (0 for those not accepted).
      errors: the missing answers' reasons by partition (``"node <id>"`` for a node that
        never said which partition it serves).
      epsilon: the privacy ledger's epsilon after the round (0 without DP).
      noise_std: the DP noise's standard deviation (NaN without DP or when no merge ran).
      consensus_accuracy: the new consensus's test accuracy (NaN for a failed round).
      heldout_accuracy: the new consensus's held-out accuracy (NaN for a failed round).
      seconds: the wall time of the round's aggregation on the server.
      bytes_down: bytes of the arrays each node received with its train message.
      bytes_up: bytes of the arrays a node sent back, mean over the replies that arrived.
      buffer: asynchronous rounds (:mod:`meta_consensus.flower.buffered`): the partitions whose
        updates the applied buffer held, in arrival order (empty in synchronous rounds).
      versions: the consensus version the strategy sent each of them (its own record).
      staleness: each update's staleness, the current version minus the version it was sent.
      dropped: updates dropped since the last buffer for exceeding ``schedule.max_staleness``.
    """

    server_round: int
    ok: bool
    reason: str
    answered: list[bool]
    valid: list[bool]
    accepted: list[bool]
    weights: list[float]
    errors: dict[str, str]
    epsilon: float
    noise_std: float = math.nan
    consensus_accuracy: float = math.nan
    heldout_accuracy: float = math.nan
    seconds: float = 0.0
    # Bytes of the arrays in the round's messages, mean per node: received (train) and sent.
    bytes_down: float = 0.0
    bytes_up: float = 0.0
    buffer: list[int] = dataclasses.field(default_factory=list)
    versions: list[int] = dataclasses.field(default_factory=list)
    staleness: list[int] = dataclasses.field(default_factory=list)
    dropped: int = 0


class ConsensusStrategy(Strategy):
    """This package's merge as a Flower strategy (see the module docstring).

    Args:
      cfg: the run config (the same file the in-process run takes; see
        :func:`~meta_consensus.flower.node.check_flower_config` for what Flower does not carry).
      task: a Task object instead of the one the config names.
      initial_params: the first consensus (default: the task's init from ``cfg.seed``, as in-process).
      wait_for_nodes_s: how long the first round waits for all ``nodes.count`` SuperNodes to
        connect before it starts with those that did.
      evaluate: send the consensus to the nodes for evaluation on their own shards after
        every round (Flower's federated evaluation); False skips it.
      poll_s: seconds between two pulls of a node's reply and between two checks of which
        nodes the SuperLink lists (:class:`~meta_consensus.flower.replies.RoundGrid`).
    """

    def __init__(
        self,
        cfg: Config,
        *,
        task: Task | None = None,
        initial_params: PyTree | None = None,
        wait_for_nodes_s: float = 120.0,
        evaluate: bool = True,
        poll_s: float = 1.0,
    ):
        self.cfg = check_flower_config(cfg)
        n = cfg.nodes.count
        self.n = n
        self.task = make_task(cfg) if task is None else check_task(task, "the task object")
        # The server holds the shared held-out and test sets (the weights objective and the
        # evaluation need them); splits(..., process_count=n) loads one node's shard with them.
        data = self.task.splits(
            n, seed=cfg.task.data_seed, alpha=cfg.task.alpha, process_index=0, process_count=n
        )
        self.heldout, self.test = data.heldout, data.test
        # vote.server_step: the root set is split off the held-out rows as the in-process
        # coordinator splits it (before anything reads them), and the update is computed here.
        self.server: ServerReference | None = None
        if cfg.vote.server_step > 0:
            root_set, self.heldout = split_root(self.heldout, cfg.vote.root_size, cfg.seed)
            self.server = ServerReference(self.task, root_set, cfg)
        d = cfg.dp
        self.noise_multiplier: float | None = None
        if d.enabled:
            if d.noise_multiplier is not None:
                self.noise_multiplier = float(d.noise_multiplier)
            else:
                assert d.epsilon is not None  # the config requires a target without noise_multiplier
                self.noise_multiplier = calibrate_noise(d.epsilon, d.delta, 1.0, cfg.rounds, d.accountant)
        self.pipeline = MergePipeline(cfg, self.task, self.heldout, self.noise_multiplier)
        root = jax.random.key(cfg.seed)
        self.key_data = jax.random.key_data(root)
        k_params, _ = jax.random.split(root)
        fresh = self.task.init(k_params)
        given = initial_params is not None
        if initial_params is None:
            initial_params = fresh
        else:
            tree.check_same_structure([initial_params], reference=fresh)
        if cfg.nodes.public_warm_start > 0 and not given:  # the coordinator's warm start, as in process
            from meta_consensus.warm_start import public_warm_start

            nd = cfg.nodes
            initial_params = public_warm_start(self.task, data, initial_params, k_params,
                                               steps=nd.public_warm_start, learning_rate=nd.learning_rate,
                                               batch_size=nd.batch_size,  # type: ignore[arg-type]
                                               optimizer=nd.optimizer)  # fmt: skip
        # LoRA runs: initial_params is the base; the consensus is the adapter's trainable part.
        self.lora: lora_run.LoraRound | None = None
        self.frozen: PyTree | None = None
        self.base_version = 0
        self._base_delta: dict[str, Any] | None = None  # the last merge's, sent with the next messages
        if lora_run.enabled(cfg):
            self.lora = lora_run.LoraRound(cfg, lora_run.wrap_task(cfg, self.task))
            base = self.lora.pretrain(data, initial_params, k_params)
            initial_params, self.frozen = self.lora.start(base, k_params)
            self._digest = lora_run.base_digest(self.frozen)
        self.consensus = jax.tree.map(jnp.asarray, initial_params)
        self.agg_state = self.pipeline.init(self.consensus)
        self.ledger = PrivacyLedger(d.delta, d.budget, d.accountant) if d.enabled else None
        self.rounds_done = 0  # rounds run, failed ones included (the coordinator's state.round)
        self.stopped = ""  # why the strategy sends no more work ("" while it runs)
        self.history: list[FlowerRound] = []
        self.wait_for_nodes_s = float(wait_for_nodes_s)
        self.evaluate = bool(evaluate)
        self.config_text = config_lib.dumps(cfg)
        self._partition_of: dict[int, int] = {}  # Flower node id -> partition id (queries, replies)
        self._sent: list[Message] = []  # this round's messages (error replies name them)
        self._dst_of: dict[str, int] = {}  # message id -> destination node id (RoundGrid fills it)
        self.poll_s = float(poll_s)
        self._timeout = 3600.0  # the round timeout start() was given
        self._metrics: Any = jax.jit(self.task.metrics)
        self._node_metrics: Any = jax.jit(jax.vmap(self.task.metrics, in_axes=(0, None)))
        if self.lora is not None:
            metrics = lora_run.lora_metrics(self.lora.task)
            node_metrics = jax.jit(
                jax.vmap(
                    lambda p, b, fz: self.lora.task.metrics(p, b, frozen=fz),  # type: ignore[union-attr]
                    in_axes=(0, None, None),
                )
            )
            self._metrics = lambda p, b: metrics(p, b, self.frozen)
            self._node_metrics = lambda p, b: node_metrics(p, b, self.frozen)

    # ------------------------------------------------------------------ Flower's interface

    def start(
        self,
        grid: Grid,
        initial_arrays: ArrayRecord,
        num_rounds: int = 3,
        timeout: float = 3600,
        train_config: ConfigRecord | None = None,
        evaluate_config: ConfigRecord | None = None,
        evaluate_fn: Callable[[int, ArrayRecord], MetricRecord | None] | None = None,
    ) -> Result:
        """Flower's rounds on ``grid`` wrapped in :class:`RoundGrid` (no waiting for nodes that are gone).

        Args:
          grid: the Grid Flower gives the ServerApp (wrapped unless it is a RoundGrid already).
          initial_arrays: the first round's arrays (:meth:`initial_arrays`).
          num_rounds: how many rounds to run.
          timeout: seconds each round waits for its replies.
          train_config: Flower's train config, sent to the nodes with every round.
          evaluate_config: Flower's evaluate config.
          evaluate_fn: Flower's server-side evaluation, called after each round.

        Returns:
          Flower's Result: the aggregated metrics of every round.
        """
        self._timeout = float(timeout)
        if not isinstance(grid, RoundGrid):
            grid = RoundGrid(grid, poll_s=self.poll_s, dst_of=self._dst_of)
        return super().start(
            grid, initial_arrays, num_rounds, timeout, train_config, evaluate_config, evaluate_fn
        )

    def initial_arrays(self) -> ArrayRecord:
        """The current consensus as an ArrayRecord (what ``start`` sends in round 1)."""
        return to_array_record(self.consensus)

    def summary(self) -> None:
        """Log one line: the node count, the vote, the weights objective and the DP noise."""
        v = self.cfg.vote
        log.info(
            "ConsensusStrategy: %d nodes, vote %s%s, weights %s, dp %s",
            self.n,
            v.rule,
            f" after {list(v.pre)}" if v.pre else "",
            self.cfg.weights.objective,
            f"z = {self.noise_multiplier:.3g}" if self.cfg.dp.enabled else "off",
        )

    def _node_ids(self, grid: Grid, first: bool) -> list[int]:
        ids = sorted(grid.get_node_ids())
        deadline = time.monotonic() + (self.wait_for_nodes_s if first else 0.0)
        while len(ids) < self.n and time.monotonic() < deadline:
            time.sleep(0.5)
            ids = sorted(grid.get_node_ids())
        return ids

    def _messages(self, server_round: int, grid: Grid, kind: str, config: ConfigRecord) -> list[Message]:
        if self.stopped:
            return []
        config = ConfigRecord(dict(config))
        config[ROUND_KEY] = server_round
        config[CONFIG_KEY] = self.config_text
        records: dict[str, Any] = {"arrays": to_array_record(self.consensus), "config": config}
        if self.lora is not None:
            config[BASE_VERSION_KEY] = self.base_version
            config[BASE_DIGEST_KEY] = self._digest
            if self._base_delta is not None:
                records[BASE_DELTA] = to_array_record(self._base_delta)
        content = RecordDict(records)
        ids = self._node_ids(grid, first=server_round == 1 and kind == MessageType.TRAIN)
        self._learn_partitions(server_round, grid, ids)
        self._sent = [Message(content, dst, kind, group_id=str(server_round)) for dst in ids]
        if kind == MessageType.TRAIN:
            self._bytes_down = record_bytes(content)
        return self._sent

    def _learn_partitions(self, server_round: int, grid: Grid, ids: list[int]) -> None:
        """Ask every node not seen yet which partition it serves (a ``query`` message, no arrays)."""
        new = [i for i in ids if i not in self._partition_of]
        if not new:
            return
        content = RecordDict({"config": ConfigRecord({ROUND_KEY: server_round})})
        asks = [Message(content, dst, MessageType.QUERY, group_id=str(server_round)) for dst in new]
        for reply in grid.send_and_receive(asks, timeout=self._timeout):
            if reply.has_error():
                continue  # the node is filed by its node id if it never says which partition it is
            try:
                pid = int(reply.content["metrics"][PARTITION_KEY])  # type: ignore[arg-type]
            except (KeyError, TypeError, ValueError):
                continue
            if 0 <= pid < self.n:
                self._partition_of[reply.metadata.src_node_id] = pid

    def configure_train(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        """One train message per connected node: the consensus, the round and the config text.

        The first round waits up to ``wait_for_nodes_s`` for all ``nodes.count`` nodes. A LoRA
        run's messages also carry the base's version and digest, and the last merge's base delta.

        Args:
          server_round: Flower's round number.
          arrays: what Flower passes back from the last round; checked against the consensus.
          config: Flower's train config, sent on with the round and the run config added.
          grid: the Grid whose node ids get the messages.

        Returns:
          The messages (none once the strategy has stopped, e.g. on the privacy budget).

        Raises:
          ValueError: ``arrays`` is not the strategy's own consensus.
        """
        self._check_arrays(arrays)
        return self._messages(server_round, grid, MessageType.TRAIN, config)

    def configure_evaluate(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        """One evaluate message per connected node with the consensus (none if ``evaluate`` is off).

        Args:
          server_round: Flower's round number.
          arrays: unused: the strategy sends its own consensus.
          config: Flower's evaluate config, sent on with the round and the run config added.
          grid: the Grid whose node ids get the messages.

        Returns:
          The messages.
        """
        if not self.evaluate:
            return []
        return self._messages(server_round, grid, MessageType.EVALUATE, config)

    def aggregate_evaluate(self, server_round: int, replies: Iterable[Message]) -> MetricRecord | None:
        """The nodes' evaluation metrics averaged as FedAvg does (weighted by ``num-examples``).

        Args:
          server_round: Flower's round number; replies for another round are left out.
          replies: the evaluate replies; error replies are left out.

        Returns:
          The weighted means, or None when no reply is usable.
        """
        good = [
            m.content
            for m in replies
            # flwr types a record value as any record's value; the nodes send ROUND_KEY as an int.
            if not m.has_error() and int(m.content["metrics"].get(ROUND_KEY, -1)) == server_round  # type: ignore[arg-type]
        ]
        return node_weighted_mean(good) if good else None

    def _check_arrays(self, arrays: ArrayRecord) -> None:
        # Flower hands back what aggregate_train returned; the strategy's own consensus is the truth.
        got = from_array_record(arrays, self.consensus, "the ArrayRecord Flower passed back")
        if not all(
            np.array_equal(a, np.asarray(b))
            for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(self.consensus), strict=True)
        ):
            raise ValueError("the arrays Flower passed to configure_train are not the strategy's consensus")

    # ------------------------------------------------------------------ the round

    def collect(self, server_round: int, replies: Iterable[Message]) -> tuple[Any, ...]:
        """Sort a round's replies into candidates by partition and reasons for the missing ones.

        Args:
          server_round: the round the replies must answer (a reply for another is too late).
          replies: the train replies, error replies included.

        Returns:
          ``(stacked, answered, valid, errors, records)``: the candidates stacked on a leading
          ``(n,)`` axis (a missing one holds the consensus), ``(n,)`` bool arrays of those that
          answered and of those valid for the merge, the reasons by partition, and the
          contents of the replies that answered.
        """
        n = self.n
        candidates: list[PyTree | None] = [None] * n
        errors: dict[str, str] = {}
        failed: dict[str, str] = {}  # error replies by partition (or node id), filed after the answers
        records = []
        up: list[int] = []
        for msg in replies:
            src = msg.metadata.src_node_id
            if msg.has_error():
                # An error the SuperLink writes for a lost node does not come from that node: the
                # message it answers names the node.
                src = self._destination(msg.metadata.reply_to_message_id, src)
                who = self._partition_of.get(src)
                key = str(who) if who is not None else f"node {src}"
                failed[key] = error_text(msg)
                continue
            try:
                metrics = msg.content["metrics"]
                # flwr types these as any record's value: one that is no number raises, caught below.
                pid, answered_round = int(metrics[PARTITION_KEY]), int(metrics[ROUND_KEY])  # type: ignore[arg-type]
            except (KeyError, TypeError, ValueError) as e:
                errors[f"node {src}"] = f"reply without {PARTITION_KEY!r} and {ROUND_KEY!r} metrics ({e})"
                continue
            if not 0 <= pid < n:
                errors[f"node {src}"] = f"partition-id {pid} is not in [0, {n})"
                continue
            if answered_round != server_round:
                errors[str(pid)] = f"too late: answers round {answered_round}, this is round {server_round}"
                continue
            if candidates[pid] is not None:
                errors[str(pid)] = f"partition {pid} answered twice (node {src} and another)"
                candidates[pid] = None
                continue
            self._partition_of[src] = pid
            try:
                candidates[pid] = from_array_record(
                    msg.content["arrays"], self.consensus, f"node {pid}'s candidate"
                )
            except (ArrayRecordMismatch, KeyError) as e:
                errors[str(pid)] = str(e)
                continue
            records.append(msg.content)
            up.append(record_bytes(msg.content))
        self._bytes_up = float(np.mean(up)) if up else 0.0
        answered = np.array([c is not None for c in candidates], bool)
        for key, why in failed.items():
            if not (key.isdigit() and answered[int(key)]):  # another node of that partition answered
                errors.setdefault(key, why)
        sent_to = {self._partition_of.get(m.metadata.dst_node_id) for m in self._sent}
        for i in np.flatnonzero(~answered):
            errors.setdefault(
                str(i),
                "no reply before the round's timeout"
                if int(i) in sent_to
                else "no answer: no SuperNode of this partition was online when the round was sent",
            )
        # Missing answers hold the consensus (masked out of the merge), as the fleet's placeholder does.
        stacked = tree.stack([self.consensus if c is None else c for c in candidates])
        finite = np.asarray(to_host(tree.finite_mask(stacked)), bool)
        for i in np.flatnonzero(answered & ~finite):
            errors[str(i)] = "non-finite candidate"
        valid = answered & finite
        if self.cfg.quality_threshold is not None:
            held = np.asarray(to_host(self._node_metrics(stacked, self.heldout))["accuracy"], np.float64)
            low = valid & ~(held >= self.cfg.quality_threshold)
            for i in np.flatnonzero(low):
                errors[str(i)] = f"held-out accuracy {held[i]:.3f} below quality_threshold"
            valid &= ~low
        return stacked, answered, valid, errors, records

    def _merge_adapters(
        self, stacked: PyTree, valid: np.ndarray, info: FlowerRound, key: jax.Array
    ) -> tuple[PyTree | None, str]:
        """A LoRA round's merge (as the coordinator's); the new base waits for the next messages."""
        assert self.lora is not None and self.frozen is not None
        try:
            lm = self.lora.merge(self.frozen, stacked, valid, key, self.consensus)
        except (ValueError, ByzantineToleranceError) as e:
            return None, str(e)
        rows = np.flatnonzero(valid)
        accepted = np.zeros((self.n,), bool)
        accepted[rows] = True
        info.accepted = accepted.tolist()
        info.weights = [1.0 / len(rows) if a else 0.0 for a in accepted]
        why = too_few_accepted(self.cfg, accepted)
        if why:
            return None, why
        finite = tree.finite_mask(tree.stack([lm.params]))
        if not bool(np.all(to_host(finite))) or not bool(to_host(tree.is_finite(lm.frozen))):
            return None, "the new consensus is not finite"
        self.frozen = lm.frozen
        self._base_delta = lm.base_delta
        if lm.base_delta is not None:
            self.base_version += 1
            self._digest = lora_run.base_digest(self.frozen)
        return lm.params, ""

    def _destination(self, message_id: str, default: int) -> int:
        """The node a sent message went to (``default`` for an unknown id)."""
        if not message_id:
            return default
        if message_id in self._dst_of:
            return self._dst_of[message_id]
        return next(
            (m.metadata.dst_node_id for m in self._sent if m.metadata.message_id == message_id), default
        )

    def aggregate_train(
        self, server_round: int, replies: Iterable[Message]
    ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        """Run the round's merge on the replies, as the in-process coordinator does.

        A round with too few valid answers, too few accepted, a failed solver, a non-finite
        consensus or no privacy budget left fails and keeps the previous consensus; the round
        goes to :attr:`history` either way.

        Args:
          server_round: Flower's round number.
          replies: the train replies, error replies included.

        Returns:
          The consensus after the round as an ArrayRecord, and the round's MetricRecord (see the
          module docstring).
        """
        t0 = time.perf_counter()
        n = self.n
        stacked, answered, valid, errors, records = self.collect(server_round, list(replies))
        eps = self.ledger.epsilon() if self.ledger is not None else 0.0
        info = FlowerRound(
            server_round, True, "", answered.tolist(), valid.tolist(), [False] * n, [0.0] * n, errors, eps
        )
        info.bytes_down, info.bytes_up = float(getattr(self, "_bytes_down", 0)), self._bytes_up
        if errors:
            log.warning(
                "round %d: %d of %d valid answers; %s",
                server_round,
                int(valid.sum()),
                n,
                "; ".join(
                    f"partition {k}: {v}" if k.isdigit() else f"{k}: {v}" for k, v in sorted(errors.items())
                ),
            )
        merged = None
        why = self.stopped or too_few_answers(self.cfg, valid)
        if not why:
            merged, why = self._merge(stacked, valid, info)
        if why:
            info.ok, info.reason = False, why
            log.warning("round %d failed: %s (the previous consensus stays)", server_round, why)
        else:
            self.consensus = merged
            ev = to_host(self._metrics(merged, self.test))
            info.consensus_accuracy = float(ev["accuracy"])
            info.heldout_accuracy = float(to_host(self._metrics(merged, self.heldout))["accuracy"])
        self.rounds_done += 1
        info.seconds = time.perf_counter() - t0
        self.history.append(info)
        return self.initial_arrays(), self._round_metrics(info, records)

    def _merge(
        self, stacked: PyTree, valid: np.ndarray, info: FlowerRound, asked: int | None = None
    ) -> tuple[PyTree | None, str]:
        """Vote -> weights -> DP as the coordinator runs it; (new consensus, "") or (None, why).

        ``asked``: the rows the merge's rules count (a buffer's K; default the n nodes).
        """
        key = round_key(self.key_data, self.rounds_done, 0)
        _, k_dp = jax.random.split(key)
        if self.lora is not None:
            return self._merge_adapters(stacked, valid, info, k_dp)
        agg_state = self.pipeline.with_key(self.agg_state, k_dp)
        event = self.pipeline.privacy_event(agg_state)
        if event is not None:
            assert self.ledger is not None  # an event means DP, for which __init__ made the ledger
            if not self.ledger.can_spend(event):
                self.stopped = (
                    f"privacy budget: epsilon would reach {self.ledger.epsilon_after(event):.3g}, "
                    f"over the budget {self.ledger.budget}"
                )
                return None, self.stopped
        try:
            merged, new_agg = self.pipeline.update(stacked, agg_state, self.consensus, valid)
            if self.server is not None:  # after the vote, the weights and DP, as in-process
                g = round_extra(frozenset({SERVER_UPDATE}), self.server, self.consensus, key)[SERVER_UPDATE]
                merged = server_step(merged, g, float(self.cfg.vote.server_step))
        except (RoundFailure, ByzantineToleranceError) as e:
            return None, str(e)  # nothing was released, nothing is charged
        if event is not None:
            assert self.ledger is not None  # checked before the merge
            self.ledger = copy.deepcopy(self.ledger)
            self.ledger.spend(event)  # charged even if the round is rejected below
            info.epsilon = self.ledger.epsilon()
        report = self.pipeline.report(new_agg)
        info.accepted = [bool(a) for a in report.accepted]
        info.weights = [float(w) for w in report.weights]
        info.noise_std = report.noise_std
        why = too_few_accepted(self.cfg, report.accepted, asked)
        if why:
            return None, why
        if not bool(np.all(to_host(tree.finite_mask(tree.stack([merged]))))):
            return None, "the new consensus is not finite"
        self.agg_state = new_agg
        return jax.tree.map(lambda a, p: a.astype(p.dtype), merged, self.consensus), ""

    def _round_metrics(self, info: FlowerRound, records: list[RecordDict]) -> MetricRecord:
        """The round's info as a MetricRecord, with the node-weighted mean training loss."""
        out: dict[str, Any] = {
            "ok": int(info.ok),
            "answered": int(sum(info.answered)),
            "valid": int(sum(info.valid)),
            "missing": [i for i, a in enumerate(info.answered) if not a],
            "accepted": [int(a) for a in info.accepted],
            "weights": [float(w) for w in info.weights],
            "epsilon": float(info.epsilon),
            "noise_std": float(info.noise_std),
            "consensus_accuracy": float(info.consensus_accuracy),
            "heldout_accuracy": float(info.heldout_accuracy),
        }
        if records:
            # Flower's convention: node metrics averaged with weights num-examples.
            # flwr types a MetricRecord value as a number or a list; train_loss is a number.
            out["train_loss"] = float(node_weighted_mean(records)["train_loss"])  # type: ignore[arg-type]
        return MetricRecord(out)


def error_text(msg: Message) -> str:
    """An error reply's reason with its Flower error code.

    Args:
      msg: an error reply.

    Returns:
      One line for the round's errors.
    """
    reason, code = msg.error.reason or "", msg.error.code
    if not reason.startswith(("no reply", "not sent")):
        reason = f"error reply: {reason}"
    return f"{reason} (flwr error code {code})"


def node_weighted_mean(contents: list[RecordDict]) -> MetricRecord:
    """Flower's aggregation of node metrics (means weighted by ``num-examples``), ids and rounds left out.

    Args:
      contents: the replies' contents, each with a ``metrics`` MetricRecord.

    Returns:
      The weighted means.
    """
    keep = []
    for content in contents:
        m: MetricRecord = content["metrics"]  # type: ignore[assignment]  # flwr: any record; the nodes send a MetricRecord
        keep.append(
            RecordDict(
                {"metrics": MetricRecord({k: v for k, v in m.items() if k not in (PARTITION_KEY, ROUND_KEY)})}
            )
        )
    return aggregate_metricrecords(keep, EXAMPLES_KEY)


def record_bytes(content: RecordDict) -> int:
    """Bytes of the arrays a message carries: every ArrayRecord's arrays, shape times item size.

    This is the payload; each array's ``.npy`` header adds about a hundred bytes on the wire.

    Args:
      content: a message's content.

    Returns:
      The byte count.
    """
    total = 0
    for rec in content.values():
        if isinstance(rec, ArrayRecord):
            total += sum(math.prod(arr.shape) * np.dtype(arr.dtype).itemsize for arr in rec.values())
    return total
