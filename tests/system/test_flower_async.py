"""Buffered asynchronous rounds on Flower's Message API (meta_consensus.flower.buffered), in this process.

The grid is :class:`InProcessGrid` whose replies come after a set number of pulls per
partition (one never replies), so buffers fill in a known order with known staleness. The
consensus after every applied buffer is checked against a float64 numpy reference of
FedBuff's update, ``x + mean_i s(tau_i) (c_i - a_i)`` (vote.rule = mean, no weights, no DP),
built from the candidates the nodes sent; the deployment test with a slow SuperNode is
test_flower_async_deployment.py.
"""

from __future__ import annotations

import jax
import numpy as np
import pytest
from flower_helpers import flower_config

from meta_consensus.flower import ConsensusStrategy, InProcessGrid, from_array_record, make_client_app
from meta_consensus.flower.apps import run_strategy
from meta_consensus.flower.buffered import BufferedRun
from meta_consensus.flower.node import PARTITION_KEY, ROUND_KEY

NODES = 4
NEVER = 3  # this partition's replies never come
DELAY = {0: 0, 1: 0, 2: 3}  # pulls after its push before a partition's reply is there


def _config(tmp_path, *extra):
    return flower_config(
        tmp_path,
        f"nodes.count={NODES}",
        "nodes.strategies=local",
        "vote.rule=mean",
        "vote.num_byzantine=0",
        "weights.objective=vote",
        "vote.server_step=0",  # FedBuff's update alone (the float64 reference below)
        "dp.enabled=false",
        "schedule.mode=async",
        "schedule.buffer=2",
        "rounds=4",
        *extra,
    )


class _Delayed(InProcessGrid):
    """Replies wait DELAY[partition] pulls; partition NEVER's never come. Records what each sent."""

    def __init__(self, *args, lie=False, **kwargs):
        super().__init__(*args, **kwargs)
        self.tick = 0
        self.due: dict[str, float] = {}
        self.sent: dict[tuple[int, int], tuple] = {}  # (partition, version) -> (anchor, candidate)
        self.lie = lie

    def push_messages(self, messages):
        messages = list(messages)
        ids = super().push_messages(messages)
        for msg, mid in zip(messages, ids, strict=True):
            if msg.metadata.message_type != "train":
                continue
            pid = msg.metadata.dst_node_id - 1000
            self.due[mid] = np.inf if pid == NEVER else self.tick + DELAY[pid]
            reply = self._replies.get(mid)
            if reply is not None and not reply.has_error():
                version = int(msg.content["config"][ROUND_KEY])
                self.sent[(pid, version)] = (msg.content["arrays"], reply.content["arrays"])
                if self.lie and pid == 2:
                    reply.content["metrics"][ROUND_KEY] = 10**6  # "I trained from the newest version"
        return ids

    def pull_messages(self, message_ids):
        self.tick += 1
        ready = [m for m in message_ids if self.due.get(m, 0) <= self.tick]
        return super().pull_messages(ready)


def _run(tmp_path, **grid_kwargs):
    cfg = _config(tmp_path)
    strategy = ConsensusStrategy(cfg, wait_for_nodes_s=0.0, poll_s=0.0)
    grid = _Delayed(make_client_app(), NODES, **grid_kwargs)
    consensus = [strategy.consensus]
    run_strategy(strategy, grid, timeout=60)
    return strategy, grid, consensus


def _flat(t):
    return np.concatenate([np.asarray(x, np.float64).ravel() for x in jax.tree.leaves(t)])


# Each test runs the strategy and the ClientApp in this process (compiling both): 10-30 s on 2 cores.
@pytest.mark.slow
def test_buffers_merge_without_the_silent_node_and_match_fedbuffs_update(tmp_path):
    strategy, grid, _ = _run(tmp_path / "a")
    hist = strategy.history
    assert len(hist) == strategy.cfg.rounds and all(h.ok for h in hist)
    assert all(NEVER not in h.buffer and len(h.buffer) == 2 for h in hist)
    # The delayed partition's update lands in a later buffer, stale by the versions applied meanwhile.
    late = [(h.buffer, h.staleness) for h in hist if 2 in h.buffer]
    assert late and max(t for _, ts in late for t in ts) >= 1
    for h in hist:
        assert h.staleness == [
            len([g for g in hist if g.server_round < h.server_round]) - v for v in h.versions
        ]
    # float64 reference: x_{b+1} = x_b + mean_i (1 + tau_i)^-1/2 (c_i - a_i), a_i the version sent.
    template = strategy.consensus
    x = None
    for h in hist:
        steps = []
        for pid, version, tau in zip(h.buffer, h.versions, h.staleness, strict=True):
            anchor, cand = (from_array_record(r, template, "") for r in grid.sent[(pid, version)])
            if x is None:
                x = _flat(anchor) if version == 0 else None
            steps.append((1.0 + tau) ** -0.5 * (_flat(cand) - _flat(anchor)))
        assert x is not None
        x = x + np.mean(steps, axis=0)
        w = np.asarray(h.weights)
        np.testing.assert_allclose(w[h.buffer], 0.5, atol=1e-7)
    np.testing.assert_allclose(_flat(strategy.consensus), x, rtol=0, atol=2e-6)


@pytest.mark.slow
def test_a_node_that_claims_a_fresh_version_gains_nothing(tmp_path):
    honest, _, _ = _run(tmp_path / "honest")
    liar, grid, _ = _run(tmp_path / "liar", lie=True)
    assert any(2 in h.buffer for h in liar.history)
    assert [h.staleness for h in liar.history] == [h.staleness for h in honest.history]
    assert [h.weights for h in liar.history] == [h.weights for h in honest.history]
    for a, b in zip(jax.tree.leaves(liar.consensus), jax.tree.leaves(honest.consensus), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.slow
def test_max_staleness_drops_and_counts(tmp_path):
    cfg = _config(tmp_path, "schedule.max_staleness=0")
    strategy = ConsensusStrategy(cfg, wait_for_nodes_s=0.0, poll_s=0.0)
    run_strategy(strategy, _Delayed(make_client_app(), NODES), timeout=60)
    hist = strategy.history
    assert all(2 not in h.buffer and max(h.staleness) == 0 for h in hist)
    assert sum(h.dropped for h in hist) >= 1
    assert any("dropped: " in e for h in hist for e in h.errors.values())


@pytest.mark.slow
def test_the_partition_a_reply_names_must_be_the_nodes(tmp_path):
    """A reply that names another partition is a missing answer, not an update of that partition."""

    class _Impostor(_Delayed):
        def push_messages(self, messages):
            messages = list(messages)
            ids = super().push_messages(messages)
            for msg, mid in zip(messages, ids, strict=True):
                reply = self._replies.get(mid)
                if msg.metadata.message_type == "train" and msg.metadata.dst_node_id == 1001:
                    reply.content["metrics"][PARTITION_KEY] = 0
            return ids

    cfg = _config(tmp_path)
    strategy = ConsensusStrategy(cfg, wait_for_nodes_s=0.0, poll_s=0.0)
    run_strategy(strategy, _Impostor(make_client_app(), NODES), timeout=60)
    assert all(1 not in h.buffer for h in strategy.history)
    assert any("says partition 0" in e for h in strategy.history for e in h.errors.values())


def test_buffered_run_needs_async_mode(tmp_path):
    cfg = flower_config(tmp_path, "dp.enabled=false")
    with pytest.raises(ValueError, match="schedule.mode = 'async'"):
        BufferedRun(ConsensusStrategy(cfg), InProcessGrid(make_client_app(), cfg.nodes.count))
