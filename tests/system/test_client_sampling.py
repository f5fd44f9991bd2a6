"""Client sampling (nodes.sampling): the draw, only the sampled nodes train, resume, and DP accounting."""

from __future__ import annotations

import math

import jax
import numpy as np
import pytest
from scipy import stats

from consensus.dp import effective_sampling_rate
from consensus.privacy import rdp_epsilon
from meta_consensus import MetaConsensus, config, sampling
from meta_consensus.config import ConfigError
from meta_consensus.coordinator import round_key

# A tiny fleet: 12 digits nodes, 4 per round, one fit call of 4 nodes.
TINY = [
    "rounds=3",
    "seed=5",
    "checkpoint_every=1",
    "keep_checkpoints=5",
    "eval_every=3",
    "task.options.hidden=[8]",
    "nodes.count=12",
    "nodes.strategies=local",
    "nodes.local_steps=3",
    "nodes.batch_size=16",
    "vote.rule=mean",
    "vote.num_byzantine=0",
    "weights.objective=vote",
    "byzantine.nodes=[]",
    "min_answers=0.5",
    "consensus_threshold=0.5",
]


def tiny(tmp_path, *overrides: str) -> config.Config:
    return config.load(None, [*TINY, f"output_dir={tmp_path}", "name=tiny", *overrides])


def nodes_cfg(**kw) -> config.NodesConfig:
    return config.NodesConfig(**kw)


def _key(r: int, a: int = 0) -> jax.Array:
    return round_key(jax.random.key_data(jax.random.key(0)), r, a)


def test_uniform_sample_is_reproducible_distinct_and_each_node_has_rate_m_over_n():
    nodes = nodes_cfg(count=20, sampling="uniform", per_round=5, chunk=5)
    draws = [sampling.draw(nodes, _key(r)) for r in range(150)]
    again = sampling.draw(nodes, _key(7))
    np.testing.assert_array_equal(again.ids, draws[7].ids)  # a pure function of the round key
    assert not np.array_equal(draws[0].ids, draws[1].ids)
    assert not np.array_equal(sampling.draw(nodes, _key(7, 1)).ids, draws[7].ids)  # a retry redraws
    for d in draws:
        assert d.ids.shape == (5,) and d.count == 5 and len(set(d.ids.tolist())) == 5
        assert np.all(np.diff(d.ids) > 0) and d.ids.min() >= 0 and d.ids.max() < 20
    # every node is in a sample with probability m / n = 0.25: a chi-square test of the counts
    counts = np.bincount(np.concatenate([d.ids for d in draws]), minlength=20)
    assert stats.chisquare(counts).pvalue > 1e-3
    assert counts.sum() == 150 * 5


def test_poisson_sample_has_rate_q_and_pads_to_the_chunk():
    nodes = nodes_cfg(count=50, sampling="poisson", sampling_rate=0.1, chunk=4)
    draws = [sampling.draw(nodes, _key(r)) for r in range(150)]
    sizes = np.array([d.count for d in draws])
    # the count is Binomial(50, 0.1): its mean within 5 standard errors, its variance near n q (1 - q)
    assert abs(sizes.mean() - 5.0) < 5 * math.sqrt(50 * 0.1 * 0.9 / 150)
    assert 0.6 * 4.5 < sizes.var() < 1.4 * 4.5
    members = np.zeros(50)
    for d in draws:
        assert len(d.ids) % 4 == 0 and len(d.ids) >= max(d.count, 1)
        assert np.all(d.ids[: d.count] >= 0) and np.all(d.ids[d.count :] == -1)  # padding at the end
        members[d.ids[d.real]] += 1
    # every node independently with q: each node's count is Binomial(150, 0.1)
    assert stats.binomtest(int(members.sum()), 150 * 50, 0.1).pvalue > 1e-3
    assert members.min() > 3 and members.max() < 30
    # q from per_round when the rate is not given
    assert nodes_cfg(count=50, sampling="poisson", per_round=5).poisson_rate() == 0.1


@pytest.mark.parametrize(
    ("overrides", "key"),
    [
        (["nodes.per_round=4"], "nodes.per_round"),
        (["nodes.sampling=uniform"], "nodes.per_round"),
        (["nodes.sampling=uniform", "nodes.per_round=40"], "nodes.per_round"),
        (["nodes.sampling=poisson", "nodes.per_round=4", "nodes.sampling_rate=0.3"], "nodes.sampling_rate"),
        (["nodes.sampling=poisson", "nodes.sampling_rate=1.5"], "nodes.sampling_rate"),
        (["nodes.sampling=bernoulli"], "nodes.sampling"),
        (
            [
                "nodes.sampling=uniform",
                "nodes.per_round=4",
                "dp.enabled=true",
                "dp.level=example",
                "dp.noise_multiplier=1.0",
            ],
            "dp.level",
        ),
    ],
)
def test_bad_sampling_settings_name_the_key(tmp_path, overrides, key):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        tiny(tmp_path, *overrides)


@pytest.mark.slow
@pytest.mark.parametrize("mesh", [[], ["mesh.node=2"]], ids=["no_mesh", "node_mesh_2"])
def test_only_the_sampled_nodes_train_and_the_vote_uses_the_sample(tmp_path, mesh):
    cfg = tiny(
        tmp_path, "rounds=1", "nodes.sampling=uniform", "nodes.per_round=4", "baseline_fedavg=false", *mesh
    )
    co = MetaConsensus(cfg, write=False, progress=False).coordinator
    state = co.init()
    new, info = co.round(state)
    assert info.ok, info.reason
    sampled = np.array(info.sampled)
    np.testing.assert_array_equal(sampled, sampling.draw(cfg.nodes, co.round_key(state, 0)).ids)
    steps = np.asarray(new.nodes.step)
    assert isinstance(new.nodes.step, np.ndarray)  # the n nodes' state lives on the host
    np.testing.assert_array_equal(steps[sampled], 3)
    np.testing.assert_array_equal(np.delete(steps, sampled), 0)
    for old, now in zip(
        jax.tree.leaves(state.nodes.opt_state), jax.tree.leaves(new.nodes.opt_state), strict=True
    ):
        np.testing.assert_array_equal(
            np.delete(np.asarray(now), sampled, 0), np.delete(np.asarray(old), sampled, 0)
        )
    assert len(info.answered) == 12 and sum(info.answered) == 4 and sum(info.accepted) == 4
    # the mean of the sampled candidates (weights 1/4 on the sampled nodes, 0 elsewhere)
    w = np.array(info.weights)
    np.testing.assert_allclose(w[sampled], 0.25, rtol=1e-6)
    assert np.all(np.delete(w, sampled) == 0)


@pytest.mark.slow
def test_resume_with_sampling_is_bit_exact(tmp_path):
    # eval_every=1: the first part's run (2 rounds) writes its plots from evaluated rounds
    sets = ["nodes.sampling=poisson", "nodes.sampling_rate=0.34", "nodes.chunk=2", "eval_every=1"]
    full = MetaConsensus(tiny(tmp_path, *sets, "name=full"), progress=False).train()
    cut_cfg = tiny(tmp_path, *sets, "name=cut")
    first = MetaConsensus(cut_cfg, progress=False).train(max_rounds=2)
    assert first.state.round == 2
    resumed = MetaConsensus(cut_cfg, progress=False).train(resume=True)
    assert resumed.state.round == 3
    a, b = full.state, resumed.state
    for x, y in zip(jax.tree.leaves(a.consensus), jax.tree.leaves(b.consensus), strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    for sa, sb in ((a.nodes, b.nodes), (a.fedavg_nodes, b.fedavg_nodes)):
        for x, y in zip(jax.tree.leaves(sa), jax.tree.leaves(sb), strict=True):
            np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    assert [h.sampled for h in full.history] == [h.sampled for h in resumed.history]
    assert len({len(h.sampled) for h in full.history} | {0}) > 1  # rounds sampled someone


@pytest.mark.slow
@pytest.mark.parametrize(
    ("sampling_set", "q"),
    [
        (("nodes.sampling=poisson", "nodes.sampling_rate=0.25"), 0.25),
        (("nodes.sampling=uniform", "nodes.per_round=4"), 1.0),
    ],
)
def test_dp_epsilon_is_the_accountants_for_the_sampling_used(tmp_path, sampling_set, q):
    z, clip, rounds = 1.3, 0.5, 2
    cfg = tiny(
        tmp_path,
        *sampling_set,
        f"rounds={rounds}",
        "baseline_fedavg=false",
        "checkpoint_every=0",
        "dp.enabled=true",
        f"dp.noise_multiplier={z}",
        f"dp.clip_norm={clip}",
        "dp.delta=1e-5",
    )
    result = MetaConsensus(cfg, write=False, progress=False).train()
    assert all(h.ok for h in result.history)
    # Poisson: the subsampled Gaussian at q; uniform: no amplification (q = 1), per docs/privacy.md
    q = effective_sampling_rate(q)  # the sampler's exact probability (1.0 stays 1.0)
    assert [e.sampling_rate for e in result.state.ledger.events] == [q] * rounds
    assert result.history[-1].epsilon == pytest.approx(rdp_epsilon(z, q, rounds, 1e-5), rel=1e-12)
    # DP-FedAvg's fixed denominator is the expected sample size: noise std z C / (q n) or z C / m
    expected = 0.25 * 12 if q < 1 else 4
    assert result.history[-1].noise_std == pytest.approx(z * clip / expected, rel=1e-6)
