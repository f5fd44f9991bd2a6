"""Buffered asynchronous rounds: staleness weights, the buffer's merge, versions, resume, DP, bad input."""

from __future__ import annotations

import math

import dp_accounting
import jax
import numpy as np
import pytest

from consensus.privacy import rdp_epsilon
from consensus.privacy.rdp import DEFAULT_ORDERS
from meta_consensus import MetaConsensus, cli, config
from meta_consensus.async_rounds import AsyncState, SpeedModel, lognormal_means, staleness, staleness_weight
from meta_consensus.coordinator import Coordinator

# 6 digits nodes, local training only, a buffer of 3, node speeds 4x apart.
TINY = [
    "rounds=3",
    "seed=2",
    "checkpoint_every=2",
    "keep_checkpoints=5",
    "baseline_fedavg=false",
    "task.options.hidden=[8]",
    "nodes.count=6",
    "nodes.strategies=local",
    "nodes.local_steps=3",
    "nodes.batch_size=16",
    "byzantine.nodes=[]",
    "vote.rule=mean",
    "vote.num_byzantine=0",
    "weights.objective=uniform",
    "vote.server_step=0",  # FedBuff's update alone (the float64 references below)
    "schedule.mode=async",
    "schedule.buffer=3",
    "schedule.speed_spread=4.0",
]


def tiny(tmp_path, *overrides: str) -> config.Config:
    return config.load(None, [*TINY, f"output_dir={tmp_path}", "name=tiny", *overrides])


def _leaves(tree) -> list[np.ndarray]:
    return [np.asarray(x) for x in jax.tree.leaves(tree)]


@pytest.mark.parametrize(
    ("kind", "want"),
    [
        ("constant", lambda t: np.ones_like(t)),
        ("polynomial", lambda t: (1.0 + t) ** -0.7),
        ("hinge", lambda t: np.where(t <= 2, 1.0, 1.0 / (1.0 + 0.7 * (t - 2)))),
    ],
)
def test_staleness_weights_match_their_closed_forms(kind, want):
    s = config.ScheduleConfig(staleness=kind, staleness_exponent=0.7, staleness_hinge=2)
    tau = np.arange(0, 12, dtype=np.float64)
    np.testing.assert_allclose(staleness_weight(s, tau), want(tau), rtol=0, atol=1e-15)
    assert staleness_weight(config.ScheduleConfig(), [3])[0] == pytest.approx(0.5)  # FedBuff: a = 0.5
    with pytest.raises(ValueError, match="staleness"):
        staleness_weight(s, [-1])


def test_lognormal_speeds_span_the_spread_and_a_trace_is_used_in_turn(tmp_path):
    m = lognormal_means(8, 4.0, seed=3)
    assert m.max() / m.min() == pytest.approx(4.0, rel=1e-12)
    assert float(np.exp(np.mean(np.log(m)))) == pytest.approx(1.0, rel=1e-12)
    trace = tmp_path / "trace.txt"
    trace.write_text("".join(f"{i + 1} {i + 2}\n" for i in range(6)))
    speeds = SpeedModel(tiny(tmp_path, "schedule.speeds=trace", f"schedule.speed_trace={trace}"))
    assert [speeds.duration(2, k) for k in range(3)] == [3.0, 4.0, 3.0]
    # a synchronous round waits for its slowest node: node 5's 6, 7, 6
    assert speeds.sync_clock(2) == pytest.approx(19.0)


def test_staleness_comes_from_the_version_sent_never_from_the_node():
    sent = np.asarray([0, 3, 5], np.int64)
    # node 0 trained from version 0 and claims version 5 (the current one): it gains nothing
    assert staleness(sent, 5, 0, reported=5) == staleness(sent, 5, 0) == 5
    assert staleness(sent, 5, 1, reported=-7) == 2
    with pytest.raises(ValueError, match="was not sent"):
        staleness(np.asarray([-1, 0]), 5, 0)


def test_an_applied_buffer_is_the_consensus_plus_the_discounted_mean_delta(tmp_path):
    # rounds with stale updates (a 4x speed spread): the merge against a float64 reference
    cfg = tiny(tmp_path, "schedule.staleness=polynomial", "schedule.staleness_exponent=0.5")
    co = Coordinator(cfg)
    state = co.init()
    stale_seen = False
    for _ in range(4):
        before = state
        state, info = co.round(before)
        assert info.ok, info.reason
        s = state.schedule
        assert isinstance(s, AsyncState)
        ids = np.asarray(info.sampled)
        tau = np.asarray(info.staleness, np.float64)
        assert len(ids) == 3 and len(set(ids.tolist())) == 3
        stale_seen |= bool((tau > 0).any())
        # the versions are the coordinator's record: the version at the send, the current one minus tau
        assert info.versions == [before.schedule.version - t for t in info.staleness]
        w = (1.0 + tau) ** -0.5 / len(ids)  # the mean of the discounted deltas: weights sum to 1
        # the buffer's deltas stay in the state until its nodes are sent the next version
        for c0, c1, d in zip(
            _leaves(before.consensus), _leaves(state.consensus), _leaves(s.deltas), strict=True
        ):
            want = c0.astype(np.float64) + np.tensordot(w, d[ids].astype(np.float64), axes=1)
            np.testing.assert_allclose(c1, want, rtol=0, atol=2e-6)
        np.testing.assert_allclose(info.weights, [1 / 3 if i in ids else 0.0 for i in range(6)], atol=1e-6)
        assert info.virtual_time == s.clock and info.virtual_time > 0
        assert s.version == before.schedule.version + 1
    assert stale_seen


def test_a_buffer_of_every_node_votes_as_the_synchronous_round(tmp_path):
    # equal speeds and K = n: one buffer holds the round's n updates, all from version 0
    sets = [
        "byzantine.nodes=[5]",
        "byzantine.attack=alie",
        "byzantine.options={z = 3.0}",
        "vote.rule=multi_krum",
        "vote.num_byzantine=1",
        "weights.objective=vote",
        "schedule.speeds=constant",
        "schedule.buffer=6",
    ]
    a_co = Coordinator(tiny(tmp_path, *sets))
    s_co = Coordinator(tiny(tmp_path, *sets, "schedule.mode=sync"))
    a_state, a_info = a_co.round(a_co.init())
    s_state, s_info = s_co.round(s_co.init())
    assert a_info.ok and s_info.ok
    assert a_info.sampled == list(range(6)) and a_info.staleness == [0] * 6
    assert a_info.accepted == s_info.accepted and not a_info.accepted[5]
    np.testing.assert_allclose(a_info.weights, s_info.weights, atol=1e-6)
    for x, y in zip(_leaves(a_state.consensus), _leaves(s_state.consensus), strict=True):
        np.testing.assert_allclose(x, y, rtol=0, atol=1e-5)
    assert a_info.virtual_time == s_info.virtual_time == 1.0


def test_max_staleness_drops_and_counts_old_updates(tmp_path):
    co = Coordinator(
        tiny(tmp_path, "schedule.max_staleness=0", "schedule.buffer=2", "schedule.speed_spread=8")
    )
    state = co.init()
    dropped = 0
    for _ in range(4):
        state, info = co.round(state)
        assert info.ok and all(t == 0 for t in info.staleness)
        dropped += info.dropped
        assert sum("dropped" in e for e in info.errors.values()) == info.dropped
    assert dropped > 0 and state.schedule.dropped == dropped


@pytest.mark.slow
def test_resume_between_buffers_is_bit_exact(tmp_path):
    # the checkpoint of round 2 holds in-flight fits (their deltas, versions, arrival times)
    full = MetaConsensus(tiny(tmp_path, "rounds=4", "name=full"), progress=False).train()
    cut_cfg = tiny(tmp_path, "rounds=4", "name=cut")
    first = MetaConsensus(cut_cfg, progress=False).train(max_rounds=2)
    assert first.state.round == 2 and np.isfinite(first.state.schedule.arrival).sum() > 0
    resumed = MetaConsensus(cut_cfg, progress=False).train(resume=True)
    a, b = full.state, resumed.state
    for x, y in zip(_leaves(a.consensus), _leaves(b.consensus), strict=True):
        np.testing.assert_array_equal(x, y)
    for x, y in zip(_leaves(a.nodes), _leaves(b.nodes), strict=True):
        np.testing.assert_array_equal(x, y)
    assert a.schedule.meta() == b.schedule.meta()
    for x, y in zip(_leaves(a.schedule.deltas), _leaves(b.schedule.deltas), strict=True):
        np.testing.assert_array_equal(x, y)
    keys = ("sampled", "staleness", "versions", "virtual_time", "consensus_accuracy")
    assert [[getattr(h, k) for k in keys] for h in full.history] == [
        [getattr(h, k) for k in keys] for h in resumed.history
    ]


def test_node_level_dp_charges_one_event_per_applied_buffer(tmp_path):
    """Every applied buffer is one full-participation Gaussian release, as dp_accounting counts it."""
    z, delta = 1.3, 1e-5
    sets = ["dp.enabled=true", "dp.clip_norm=1.0", f"dp.noise_multiplier={z}", f"dp.delta={delta}"]
    sets.append("weights.objective=vote")  # plain DP-FedAvg on each buffer
    co = Coordinator(tiny(tmp_path, *sets))
    state = co.init()
    for r in range(1, 4):
        state, info = co.round(state)
        assert info.ok, info.reason
        assert state.ledger.rounds == r
        assert info.epsilon == pytest.approx(rdp_epsilon(z, 1.0, r, delta), rel=1e-12)
        reference = dp_accounting.rdp.RdpAccountant(list(DEFAULT_ORDERS))
        reference.compose(dp_accounting.GaussianDpEvent(z), r)
        assert info.epsilon == pytest.approx(reference.get_epsilon(delta), rel=1e-9)
        assert math.isfinite(info.noise_std) and info.noise_std > 0


@pytest.mark.parametrize(
    ("sets", "phrase"),
    [
        (["schedule.buffer=7"], "schedule.buffer"),
        (["schedule.staleness=linear"], "schedule.staleness"),
        (["vote.rule=multi_krum", "vote.num_byzantine=1"], "raise schedule.buffer"),
        (["baseline_fedavg=true"], "baseline_fedavg"),
    ],
)
def test_bad_async_settings_are_one_line_and_exit_2(tmp_path, capsys, sets, phrase):
    argv = ["run", "--quiet"]
    for s in [*TINY, f"output_dir={tmp_path}", *sets]:
        argv += ["--set", s]
    assert cli.main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and phrase in err[0], err
    assert not (tmp_path / "run").exists() and not (tmp_path / "tiny").exists()


def test_a_crashed_node_never_blocks_a_merge(tmp_path):
    co = Coordinator(tiny(tmp_path, "faults.crash_nodes=[0]", "schedule.speed_spread=1.5"))
    state = co.init()
    crashes = 0
    for _ in range(3):
        state, info = co.round(state)
        assert info.ok, info.reason
        assert 0 not in info.sampled and len(info.sampled) == 3
        crashes += "simulated crash" in info.errors.get("0", "")
    assert crashes > 0  # its failed fits arrived, and the merges went on without it
