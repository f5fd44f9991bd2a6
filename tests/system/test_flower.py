"""The Flower front end in one process: ArrayRecords, the node, the strategy's rounds and its rules.

The strategy and the ClientApp run on :class:`~meta_consensus.flower.InProcessGrid` (Flower's
Grid interface, every node in this process). The reference is the in-process system
(:class:`~meta_consensus.MetaConsensus` / :class:`~meta_consensus.coordinator.Coordinator`)
on the same config and seed. The deployment over a real SuperLink is in
``test_flower_deployment.py``.
"""

from __future__ import annotations

import threading
import time

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from flower_helpers import flower_config
from flwr.app import Array, ArrayRecord, Error, Message, MetricRecord, RecordDict

from meta_consensus import MetaConsensus
from meta_consensus.config import ConfigError
from meta_consensus.coordinator import Coordinator, too_few_answers
from meta_consensus.flower import (
    ArrayRecordMismatch,
    ConsensusStrategy,
    FlowerNode,
    InProcessGrid,
    from_array_record,
    make_client_app,
    to_array_record,
)
from meta_consensus.flower.apps import run_strategy
from meta_consensus.flower.node import node_for


def _max_abs(a, b) -> float:
    return max(
        float(np.max(np.abs(np.asarray(x, np.float64) - np.asarray(y, np.float64))))
        for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True)
    )


def _bit_equal(a, b) -> bool:
    return all(
        np.array_equal(np.asarray(x), np.asarray(y))
        for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True)
    )


# ------------------------------------------------------------------ ArrayRecord


def test_array_record_round_trip_is_lossless_and_keyed_by_dotted_paths():
    rng = np.random.default_rng(0)
    tree = {
        "dense": {
            "kernel": rng.normal(size=(3, 4)).astype(np.float32),
            "bias": np.float32([np.nan, -0.0, 1e-45]),
        },
        "emb": jnp.asarray(rng.normal(size=(5,)), jnp.bfloat16),
        "count": np.arange(4, dtype=np.int32),
    }
    rec = to_array_record(tree)
    assert sorted(rec.keys()) == ["count", "dense.bias", "dense.kernel", "emb"]
    assert rec["emb"].dtype == "bfloat16"
    back = from_array_record(rec, tree)
    for key in ("kernel", "bias"):
        # Bit for bit, NaN, signed zero and subnormals included.
        assert back["dense"][key].tobytes() == tree["dense"][key].tobytes()
    assert back["emb"].dtype == ml_dtypes.bfloat16
    assert back["emb"].tobytes() == np.asarray(tree["emb"]).tobytes()
    assert np.array_equal(back["count"], tree["count"])


@pytest.mark.parametrize(
    "change, message",
    [
        (lambda r: r.pop("b"), "missing keys ['b']"),
        (lambda r: r.__setitem__("c", Array(np.zeros(2, np.float32))), "unexpected keys ['c']"),
        (lambda r: r.__setitem__("b", Array(np.zeros((3, 2), np.float32))), "'b' has shape (3, 2)"),
        (lambda r: r.__setitem__("b", Array(np.zeros((2, 3), np.float64))), "'b' has dtype float64"),
    ],
)
def test_array_record_mismatch_names_the_problem(change, message):
    like = {"a": np.zeros((4,), np.float32), "b": np.zeros((2, 3), np.float32)}
    rec = to_array_record(like)
    change(rec)
    with pytest.raises(ArrayRecordMismatch) as e:
        from_array_record(rec, like, "node 3's candidate")
    assert message in str(e.value) and "node 3's candidate" in str(e.value)


def test_array_record_whose_bytes_lie_about_their_shape_is_refused():
    like = {"a": np.zeros((4,), np.float32)}
    honest = Array(np.zeros((2,), np.float32))
    rec = ArrayRecord({"a": Array(dtype="float32", shape=(4,), stype=honest.stype, data=honest.data)})
    with pytest.raises(ArrayRecordMismatch, match=r"declared shape \(4,\), its bytes hold \(2,\)"):
        from_array_record(rec, like)


# ------------------------------------------------------------------ the node


@pytest.mark.slow
def test_flower_node_is_the_in_process_fleets_node(tmp_path):
    cfg = flower_config(tmp_path)
    co = Coordinator(cfg)
    state = co.init(cfg.seed)
    for i in range(cfg.nodes.count):
        node = FlowerNode(cfg, i)
        own = node.init_state(state.consensus)
        # Its key stream is row i of the fleet's, and it holds exactly its own shard.
        assert np.array_equal(jax.random.key_data(own.key)[0], jax.random.key_data(state.nodes.key)[i])
        k = int(co.fleet.data.train_count[i])
        assert node.num_examples == k
        for name, v in node.data.train.items():
            assert np.array_equal(v[0, :k], co.fleet.data.train[name][i, :k])


def test_flower_config_refuses_what_flower_does_not_carry(tmp_path):
    with pytest.raises(ConfigError, match="byzantine.nodes is not supported on Flower"):
        ConsensusStrategy(flower_config(tmp_path, "byzantine.nodes=[4]", "byzantine.attack=alie"))
    with pytest.raises(ConfigError, match="simulated faults"):
        FlowerNode(flower_config(tmp_path, "faults.crash_nodes=[1]"), 0)
    with pytest.raises(ValueError, match=r"partition-id must be an int in \[0, 5\)"):
        FlowerNode(flower_config(tmp_path), 5)
    # a rule that reads the coordinator's update (the server step itself runs on Flower)
    with pytest.raises(ConfigError, match=r"vote.rule = 'fltrust' needs \['server_update'\]"):
        FlowerNode(flower_config(tmp_path, "vote.rule=fltrust", "vote.num_byzantine=none"), 0)


# ------------------------------------------------------------------ the rounds


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The same config in process and on Flower (every node in this process)."""
    cfg = flower_config(tmp_path_factory.mktemp("flower"))
    ref = MetaConsensus(cfg, write=False, progress=False).train()
    strategy = ConsensusStrategy(cfg)
    result = run_strategy(strategy, InProcessGrid(make_client_app(), cfg.nodes.count), timeout=60)
    return cfg, ref, strategy, result


@pytest.mark.slow  # an in-process run next to the Flower one: ~15-40 s on 2 cores
def test_flower_rounds_match_the_in_process_run(runs):
    cfg, ref, strategy, result = runs
    assert [h.ok for h in ref.history] == [h.ok for h in strategy.history] == [True, True]
    for mine, theirs in zip(strategy.history, ref.history, strict=True):
        assert mine.accepted == theirs.accepted
        # The ledger is the same computation on the same events: equal to the last bit.
        assert mine.epsilon == theirs.epsilon
        np.testing.assert_allclose(mine.weights, theirs.weights, atol=1e-4)
    # Not bit-exact: a node trains alone (a vmapped batch of 1) where the fleet trains all n in one
    # vmapped batch, and XLA rounds the batched matmuls differently (a few ulp per round); the wire
    # is lossless (see test_array_record_round_trip_is_lossless_and_keyed_by_dotted_paths).
    assert 0 <= _max_abs(strategy.consensus, ref.consensus_params) < 1e-5
    # The round's info is in the returned metrics.
    last = result.train_metrics_clientapp[cfg.rounds]
    assert last["ok"] == 1 and last["valid"] == cfg.nodes.count
    assert list(last["accepted"]) == [int(a) for a in strategy.history[-1].accepted]
    assert list(last["weights"]) == pytest.approx(strategy.history[-1].weights)
    assert last["epsilon"] == strategy.history[-1].epsilon


@pytest.mark.slow  # an in-process run next to the Flower one: ~15-40 s on 2 cores
def test_flower_evaluation_is_the_example_weighted_mean_of_the_nodes(runs):
    cfg, _, strategy, result = runs
    per_node = [node_for(cfg, i) for i in range(cfg.nodes.count)]
    counts = np.array([n.num_examples for n in per_node], np.float64)
    acc = np.array([n.evaluate(strategy.consensus)["accuracy"] for n in per_node])
    got = result.evaluate_metrics_clientapp[cfg.rounds]["eval_accuracy"]
    assert got == pytest.approx(float(np.sum(acc * counts) / counts.sum()), rel=1e-9)


class _Recording(ConsensusStrategy):
    """Keeps the consensus after every round (for the test's replay)."""

    def aggregate_train(self, server_round, replies):
        out = super().aggregate_train(server_round, replies)
        self.after = [*getattr(self, "after", []), self.consensus]
        return out


def _sabotaging_app(bad_round: int):
    """A ClientApp whose partitions 0-2 misbehave in ``bad_round``: late, wrong shape, raising."""
    honest = make_client_app()

    def app(msg: Message, context) -> Message:
        pid = int(context.node_config["partition-id"])
        server_round = int(msg.content["config"]["server-round"])
        if server_round == bad_round and pid == 2 and msg.metadata.message_type == "train":
            raise RuntimeError("disk full")
        reply = honest(msg, context)
        if server_round != bad_round or msg.metadata.message_type != "train":
            return reply
        metrics = dict(reply.content["metrics"])
        arrays = reply.content["arrays"]
        if pid == 0:
            metrics["server-round"] = server_round - 1  # an answer to an earlier round
        if pid == 1:
            key = next(iter(arrays.keys()))
            arrays[key] = Array(np.zeros((7,), np.float32))
        return Message(RecordDict({"arrays": arrays, "metrics": MetricRecord(metrics)}), reply_to=msg)

    return app


@pytest.mark.slow
def test_bad_and_missing_answers_fail_the_round_under_the_coordinators_rule_then_the_run_goes_on(tmp_path):
    cfg = flower_config(tmp_path, "rounds=3", "vote.rule=median", "weights.objective=uniform")
    strategy = _Recording(cfg, evaluate=False, wait_for_nodes_s=0.0)
    grid = InProcessGrid(_sabotaging_app(bad_round=2), cfg.nodes.count)
    grid.kill(3)  # its SuperNode is gone from the start
    run_strategy(strategy, grid, timeout=60)
    first, second, third = strategy.history
    # Round 1 goes on without the dead node.
    assert first.ok and first.valid == [True, True, True, False, True]
    assert first.errors["3"].startswith("no answer: no SuperNode of this partition was online")
    # Round 2: a late answer, a wrong shape, an error reply and the dead node are missing answers.
    assert not second.ok and second.valid == [False, False, False, False, True]
    assert (
        second.reason
        == too_few_answers(cfg, np.array(second.valid))
        == "too few valid answers: 1 of 5, need 3"
    )
    assert second.errors["0"] == "too late: answers round 1, this is round 2"
    assert "has shape (7,)" in second.errors["1"]
    assert "RuntimeError: disk full" in second.errors["2"]
    assert second.epsilon == first.epsilon > 0  # nothing was released in round 2, nothing charged
    assert _bit_equal(strategy.after[1], strategy.after[0])  # the failed round kept the consensus
    # Round 3 goes on from it.
    assert third.ok and third.valid == first.valid and third.epsilon > first.epsilon
    assert not _bit_equal(strategy.after[2], strategy.after[1])


@pytest.mark.slow  # an in-process run next to the Flower one: ~15-40 s on 2 cores
def test_a_vote_below_consensus_threshold_keeps_the_consensus_and_charges_the_ledger(tmp_path):
    # Multi-Krum with f = 1 keeps n - f = 4 of 5: a threshold of 1.0 rejects every round.
    cfg = flower_config(tmp_path, "rounds=1", "consensus_threshold=1.0")
    ref = MetaConsensus(cfg, write=False, progress=False).train()
    strategy = ConsensusStrategy(cfg)
    initial = strategy.consensus
    run_strategy(strategy, InProcessGrid(make_client_app(), cfg.nodes.count), timeout=60)
    (mine,), (theirs,) = strategy.history, ref.history
    assert not mine.ok and not theirs.ok
    assert mine.reason == theirs.reason == "the vote accepted 4 of 5 nodes, consensus_threshold needs 5"
    assert mine.epsilon == theirs.epsilon > 0  # the DP release happened: it is charged
    assert _bit_equal(strategy.consensus, initial)


@pytest.mark.slow
def test_the_privacy_budget_stops_the_work(tmp_path):
    cfg = flower_config(tmp_path, "rounds=3", "dp.budget=8.0")
    strategy = ConsensusStrategy(cfg, evaluate=False)
    grid = InProcessGrid(make_client_app(), cfg.nodes.count)
    run_strategy(strategy, grid, timeout=60)
    ok = [h.ok for h in strategy.history]
    assert ok[0] and not any(ok[1:])
    assert strategy.history[1].reason.startswith("privacy budget: epsilon would reach")
    assert strategy.history[-1].epsilon <= 8.0
    # Once stopped, no round sends work.
    assert strategy.configure_train(4, strategy.initial_arrays(), None, grid) == []


# ------------------------------------------------------------------ missing replies (flwr 1.42)


class _DiesWhileUploading(InProcessGrid):
    """A fake SuperLink: node ``partition``'s SuperNode dies while it uploads its round-1 train reply.

    Its reply message reached the SuperLink but its arrays never will: ``pull_messages`` of it
    blocks, as flwr 1.42's ``HttpGrid.pull_messages`` blocks in ``pull_objects`` until the
    object-push session expires (180 s), and the SuperLink stops listing the node ``gone_after``
    seconds later (its heartbeat lapsed). Partition ``superlink_error`` gets the SuperLink's own
    error reply ("Node Unavailable", code 5, from the SuperLink's node id) instead of its answer.
    """

    def __init__(self, app, n, *, partition, gone_after, superlink_error=None):
        super().__init__(app, n)
        self.stuck_node, self.gone_after = 1000 + partition, gone_after
        self.error_node = None if superlink_error is None else 1000 + superlink_error
        self.stuck: set[str] = set()
        self.unavailable: dict[str, Message] = {}
        self.gone_at: float | None = None
        self.release = threading.Event()  # set at the end of the test: the stuck pull returns
        self.stuck_s = 600.0  # how long the stuck pull blocks (Flower: until the 180 s push session expires)

    def push_messages(self, messages):
        messages = list(messages)
        ids = list(super().push_messages(messages))
        for msg, mid in zip(messages, ids, strict=True):
            if msg.metadata.message_type != "train":
                continue
            if msg.metadata.dst_node_id == self.stuck_node:
                self.stuck.add(mid)
                self.gone_at = time.monotonic() + self.gone_after
            if msg.metadata.dst_node_id == self.error_node:
                self._replies.pop(mid, None)
                err = Message(Error(code=5, reason="Error: Node Unavailable - no heartbeat"), reply_to=msg)
                err.metadata.__dict__["_src_node_id"] = 1  # written by the SuperLink, not by the node
                self.unavailable[mid] = err
        return ids

    def pull_messages(self, message_ids):
        message_ids = list(message_ids)
        if self.stuck.intersection(message_ids):
            self.release.wait(self.stuck_s)  # flwr 1.42: pull_objects on a reply whose arrays never arrive
            return []
        out = [self.unavailable.pop(m) for m in message_ids if m in self.unavailable]
        return out + list(super().pull_messages(message_ids))

    def send_and_receive(self, messages, *, timeout=None):
        """flwr 1.42's Grid.send_and_receive (http_grid.py:384): all pending ids in one pull, every 3 s."""
        pending, replies = set(self.push_messages(messages)), []
        end = time.time() + (timeout or 0.0)
        while timeout is None or time.time() < end:
            got = list(self.pull_messages(pending))
            replies += got
            pending -= {m.metadata.reply_to_message_id for m in got}
            if not pending:
                break
            time.sleep(3)
        return replies

    def get_node_ids(self):
        gone = self.gone_at is not None and time.monotonic() >= self.gone_at
        return [i for i in super().get_node_ids() if not (gone and i == self.stuck_node)]


class _Timed(ConsensusStrategy):
    def aggregate_train(self, server_round, replies):
        self.aggregated_at = time.monotonic()
        return super().aggregate_train(server_round, replies)


@pytest.mark.slow  # two rounds with a node process killed mid-upload (about 11 s)
def test_a_node_that_dies_while_uploading_costs_its_own_answer_not_the_rounds_timeout(tmp_path, caplog):
    cfg = flower_config(tmp_path, "rounds=1", "vote.rule=median", "weights.objective=uniform")
    strategy = _Timed(cfg, evaluate=False, wait_for_nodes_s=0.0, poll_s=0.1)
    grid = _DiesWhileUploading(make_client_app(), cfg.nodes.count, partition=3, gone_after=0.5)
    timeout = 60.0
    try:
        result = run_strategy(strategy, grid, timeout=timeout)
    finally:
        grid.release.set()
    # The round went on once the node was known gone (the nodes' training, before, is not counted).
    assert grid.gone_at is not None
    waited = strategy.aggregated_at - grid.gone_at
    assert waited < timeout / 6, waited
    (info,) = strategy.history
    assert info.ok and info.answered == [True, True, True, False, True] == info.valid
    assert info.errors == {
        "3": "no reply: node went offline (the SuperLink no longer lists it) (flwr error code 5)"
    }
    metrics = result.train_metrics_clientapp[1]
    assert metrics["answered"] == 4 and list(metrics["missing"]) == [3]
    assert "round 1: 4 of 5 valid answers; partition 3: no reply: node went offline" in caplog.text


@pytest.mark.slow  # replies from real ClientApp failures through the in-process grid (about 7 s)
def test_error_replies_are_filed_under_the_partition_with_flowers_reason(tmp_path):
    # Partition 2's ClientApp raises from round 1 on: it never answers a round, yet it is filed
    # under its partition (the strategy asked it which partition it serves). Partition 4 gets the
    # SuperLink's "Node Unavailable" error reply, which names the SuperLink as its source.
    cfg = flower_config(tmp_path, "rounds=1", "vote.rule=median", "weights.objective=uniform")
    strategy = ConsensusStrategy(cfg, evaluate=False, wait_for_nodes_s=0.0, poll_s=0.1)
    grid = _DiesWhileUploading(
        _sabotaging_app(bad_round=1), cfg.nodes.count, partition=0, gone_after=0.0, superlink_error=4
    )
    grid.stuck_node = -1  # nobody is stuck in this test
    try:
        run_strategy(strategy, grid, timeout=60)
    finally:
        grid.release.set()
    (info,) = strategy.history
    assert info.answered == [False, False, False, True, False]
    assert info.errors["2"] == "error reply: RuntimeError: disk full (flwr error code 0)"
    assert info.errors["4"] == "error reply: Error: Node Unavailable - no heartbeat (flwr error code 5)"
    assert info.errors["0"] == "too late: answers round 0, this is round 1"
    assert not info.ok and info.reason == "too few valid answers: 1 of 5, need 3"


def test_round_grid_files_every_message_once_refused_pushes_and_the_timeout_included():
    from meta_consensus.flower.replies import RoundGrid

    class Silent(InProcessGrid):
        """Node 0 never answers and stays listed; pushes to node 1 are refused by the SuperLink."""

        def push_messages(self, messages):
            messages = list(messages)
            ids = list(super().push_messages(messages))
            return ["" if m.metadata.dst_node_id == 1001 else i for m, i in zip(messages, ids, strict=True)]

        def pull_messages(self, message_ids):
            return []

    grid = RoundGrid(Silent(make_client_app(), 2), poll_s=0.05)
    sent = [Message(RecordDict(), dst, "query", group_id="1") for dst in (1000, 1001)]
    t0 = time.monotonic()
    replies = grid.send_and_receive(sent, timeout=0.5)
    assert 0.5 <= time.monotonic() - t0 < 5
    reasons = {r.metadata.src_node_id: r.error.reason for r in replies}
    assert reasons == {
        1000: "no reply before the round's timeout",
        1001: "not sent: the SuperLink refused the message (Flower's log says why)",
    }
