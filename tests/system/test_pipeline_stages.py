"""The merge pipeline's stages: what changing the vote does, each node's share, the deciding stage."""

from __future__ import annotations

import math
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from numpy_reference import flatten_stacked, flatten_tree, krum_scores
from system_helpers import small_config

from meta_consensus.fleet import Fleet
from meta_consensus.pipeline import (
    SHARE_COORDINATES,
    SHARE_NONE,
    SHARE_WEIGHTS,
    STAGE_VOTE,
    STAGE_WEIGHTS,
    MergePipeline,
    coordinate_share,
    relative_move,
)

N = 6


@pytest.fixture(scope="module")
def setting(tmp_path_factory):
    """A digits task, its held-out split, a start and 6 candidates around it (node 5 far off)."""
    tmp = tmp_path_factory.mktemp("pipe")
    fleet = Fleet(small_config(tmp, "dp.enabled=false"))
    params = fleet.initial_params(jax.random.key(0))
    rng = np.random.default_rng(0)
    leaves, treedef = jax.tree.flatten(params)
    stacked_leaves = []
    for x in leaves:
        noise = rng.normal(scale=0.05, size=(N, *x.shape))
        noise[5] *= 40.0  # one candidate far from the others
        stacked_leaves.append(jnp.asarray(np.asarray(x, np.float64)[None] + noise, jnp.float32))
    stacked = jax.tree.unflatten(treedef, stacked_leaves)
    return tmp, fleet, params, stacked


def _merge(setting, *overrides):
    tmp, fleet, params, stacked = setting
    cfg = small_config(tmp, "dp.enabled=false", *overrides)
    pipe = MergePipeline(cfg, fleet.task, fleet.data.heldout, None)
    valid = np.ones((N,), bool)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        merged, state = pipe.update(stacked, pipe.init(params), params, valid)
        report = pipe.report(state)
    return flatten_tree(merged), report, [str(w.message) for w in caught]


def test_changing_the_vote_changes_the_consensus_when_its_output_is_the_merge(setting):
    outs = {r: _merge(setting, f"vote.rule={r}", "weights.objective=vote")[0] for r in ("mean", "median")}
    outs["multi_krum"] = _merge(setting, "vote.rule=multi_krum", "weights.objective=vote")[0]
    assert not np.allclose(outs["mean"], outs["median"])
    assert not np.allclose(outs["mean"], outs["multi_krum"])
    assert not np.allclose(outs["median"], outs["multi_krum"])


def test_a_vote_that_keeps_every_node_under_mask_only_weights_says_so_in_one_line(setting):
    median, rep, caught = _merge(setting, "vote.rule=median", "weights.objective=mixture_nll")
    mean, rep_mean, _ = _merge(setting, "vote.rule=mean", "weights.objective=mixture_nll")
    # The median's output is not used: the weights over all nodes are the merge either way...
    np.testing.assert_array_equal(median, mean)
    # ... and the report says so in one line, naming the way to the rule's own output.
    assert rep.decided_by == STAGE_WEIGHTS
    assert "\n" not in rep.note and "'median'" in rep.note and "weights.objective = 'vote'" in rep.note
    assert not caught  # the config's note said it before the run (see the last test)
    assert rep_mean.note == ""  # the plain mean under weights is "weights alone", as asked
    # A rule that selects keeps the weigher to its nodes: no note, and a different consensus.
    krum, rep_krum, caught_krum = _merge(setting, "vote.rule=multi_krum", "weights.objective=mixture_nll")
    assert rep_krum.note == "" and not caught_krum and not np.allclose(krum, mean)
    # A rule that keeps every node and averages them uniformly (Multi-Krum at f = 0) is what the
    # weights re-weigh; one that computes something else (the geometric median's weights) is replaced.
    f0 = ("vote.rule=multi_krum", "vote.num_byzantine=0", "weights.objective=uniform")
    _, rep_f0, _ = _merge(setting, *f0)
    assert rep_f0.note == ""
    _, rep_gm, caught_gm = _merge(setting, "vote.rule=geometric_median", "weights.objective=uniform")
    assert "'geometric_median'" in rep_gm.note and caught_gm == [rep_gm.note]  # known at run time only
    # Weights that read the vote's output shape the merge towards it: no note either.
    _, rep_anchor, _ = _merge(setting, "vote.rule=median", "weights.objective=anchor")
    assert rep_anchor.note == "" and rep_anchor.decided_by == STAGE_WEIGHTS


@pytest.mark.parametrize(
    ("overrides", "decided"),
    [
        (("vote.rule=multi_krum", "weights.objective=vote"), STAGE_VOTE),
        (("vote.rule=mean", "weights.objective=vote"), STAGE_VOTE),
        (("vote.rule=multi_krum", "weights.objective=mixture_nll"), STAGE_WEIGHTS),
        (("vote.rule=geometric_median", "weights.objective=vote"), STAGE_VOTE),
    ],
)
def test_linear_shares_sum_to_one_and_rebuild_the_consensus(setting, overrides, decided):
    _, _, params, stacked = setting
    merged, rep, _ = _merge(setting, *overrides)
    assert rep.share_kind == SHARE_WEIGHTS and rep.decided_by == decided
    assert rep.share.dtype == np.float64 and abs(rep.share.sum() - 1.0) < 1e-12
    # The consensus is the shares' weighted sum of the candidates, recomputed in float64.
    X = flatten_stacked(stacked)
    np.testing.assert_allclose(merged, rep.share @ X, rtol=1e-5, atol=1e-5)
    if overrides[0] == "vote.rule=multi_krum":
        f = 1  # the small config's vote.num_byzantine
        chosen = np.argsort(krum_scores(X, f, np.ones(N, bool)), kind="stable")[: N - f]
        kept = np.zeros(N, bool)
        kept[chosen] = True
        np.testing.assert_array_equal(rep.accepted, kept)
        assert not (rep.share[~kept] > 0).any()  # only the kept nodes carry the merge
        if decided == STAGE_VOTE:
            np.testing.assert_array_equal(rep.share, np.where(kept, 1.0 / (N - f), 0.0))


def _rank_reference(X, lo, hi):
    """Per column, the weight 1 / (hi - lo + 1) of the rows at ranks lo..hi (ties by row), averaged."""
    W = np.zeros_like(X)
    for k in range(X.shape[1]):
        order = np.argsort(X[:, k], kind="stable")
        W[order[lo : hi + 1], k] = 1.0 / (hi - lo + 1)
    return W.mean(axis=1)


@pytest.mark.parametrize(("rule", "lo", "hi"), [("median", 2, 3), ("trimmed_mean", 1, 4)])
def test_order_statistic_shares_are_the_kept_ranks_per_coordinate(setting, rule, lo, hi):
    _, _, _, stacked = setting
    merged, rep, _ = _merge(setting, f"vote.rule={rule}", "weights.objective=vote")
    assert rep.share_kind == SHARE_COORDINATES and rep.decided_by == STAGE_VOTE
    X = flatten_stacked(stacked)
    np.testing.assert_allclose(rep.share, _rank_reference(X, lo, hi), rtol=1e-6, atol=1e-9)
    assert abs(rep.share.sum() - 1.0) < 1e-9
    assert rep.share[5] < 1.0 / N / 4  # the far candidate is an extreme order statistic almost everywhere


def test_coordinate_share_reads_a_stride_of_large_models(monkeypatch):
    import meta_consensus.pipeline as pipeline

    rng = np.random.default_rng(1)
    x = rng.normal(size=(5, 1000))
    monkeypatch.setattr(pipeline, "MAX_SHARE_COORDINATES", 100)
    got = coordinate_share({"w": jnp.asarray(x, jnp.float32)}, np.ones(5, bool), 2, 2)
    np.testing.assert_allclose(got, _rank_reference(x[:, ::10], 2, 2), atol=1e-9)


def test_a_non_linear_rule_is_labelled_not_weighted(setting):
    _, rep, _ = _merge(setting, "vote.rule=meamed", "weights.objective=vote")
    assert rep.share_kind == SHARE_NONE and np.isnan(rep.share).all()


def test_relative_move_is_the_ratio_of_the_two_moves():
    p = {"a": jnp.zeros(3), "b": jnp.zeros(2)}
    before = {"a": jnp.array([3.0, 0.0, 0.0]), "b": jnp.array([0.0, 4.0])}  # |before - p| = 5
    after = {"a": jnp.array([3.0, 1.0, 0.0]), "b": jnp.array([0.0, 4.0])}  # |after - before| = 1
    assert relative_move(before, after, p) == pytest.approx(0.2)


@pytest.mark.slow  # one round of the small config (about 10 s on 2 cores)
def test_a_round_logs_shares_the_deciding_stage_and_the_server_steps_move(tmp_path):
    from meta_consensus import Coordinator, report

    cfg = small_config(
        tmp_path, "dp.enabled=false", "vote.rule=median", "weights.objective=vote", "vote.server_step=0.5"
    )
    co = Coordinator(cfg)
    state = co.init(cfg.seed)
    _, info = co.round(state)
    assert info.ok and info.share_kind == SHARE_COORDINATES and info.decided_by == STAGE_VOTE
    assert abs(sum(info.share) - 1.0) < 1e-9 and info.stage_note == ""
    assert 0.0 < info.server_move < math.inf
    back = type(info).from_json(info.to_json())  # metrics.jsonl keeps them
    assert back.share == info.share and back.server_move == info.server_move
    footer = next(line for line in report.table(cfg, [info]).splitlines() if line.startswith("decided by:"))
    assert "the vote (vote.rule = 'median'" in footer and "server step" in footer


@pytest.mark.parametrize(
    ("overrides", "noted"),
    [
        (["vote.rule=median", "weights.objective=mixture_nll"], True),
        (["vote.rule=trimmed_mean", "weights.objective=uniform"], True),
        (["vote.rule=median", "weights.objective=vote"], False),
        (["vote.rule=median", "weights.objective=anchor"], False),
        (["vote.rule=mean", "weights.objective=mixture_nll"], False),
        (["vote.rule=multi_krum", "weights.objective=mixture_nll"], False),
    ],
)
def test_the_config_says_in_one_line_when_the_weights_will_replace_the_vote(overrides, noted):
    from meta_consensus import config

    _, notes = config.load_with_notes(None, overrides)
    ours = [n for n in notes if "keeps every node" in n]
    assert len(ours) == int(noted) and all("\n" not in n for n in ours)
    if noted:
        assert "weights.objective = 'vote'" in ours[0] and overrides[0].split("=")[1] in ours[0]


def test_plain_dp_fedavg_reports_the_vote_as_deciding(setting):
    tmp, fleet, params, stacked = setting
    cfg = small_config(tmp, "vote.rule=mean", "weights.objective=uniform", "vote.num_byzantine=0")
    assert cfg.dp.enabled  # the small config's node-level DP: plain DP-FedAvg with these settings
    pipe = MergePipeline(cfg, fleet.task, fleet.data.heldout, 0.5)
    state = pipe.with_key(pipe.init(params), jax.random.key(1))
    _, state = pipe.update(stacked, state, params, np.ones((N,), bool))
    rep = pipe.report(state)
    assert rep.decided_by == STAGE_VOTE and rep.note == ""
    assert rep.share_kind == SHARE_WEIGHTS and abs(rep.share.sum() - 1.0) < 1e-9


def test_under_dp_the_shares_are_the_merges_before_the_noise(setting):
    tmp, fleet, params, stacked = setting
    cfg = small_config(tmp)  # Multi-Krum, mixture-NLL weights, node-level DP
    pipe = MergePipeline(cfg, fleet.task, fleet.data.heldout, 0.5)
    state = pipe.with_key(pipe.init(params), jax.random.key(1))
    _, state = pipe.update(stacked, state, params, np.ones((N,), bool))
    rep = pipe.report(state)
    assert rep.decided_by == STAGE_WEIGHTS and rep.share_kind == SHARE_WEIGHTS
    assert abs(rep.share.sum() - 1.0) < 1e-9 and not (rep.share[~rep.accepted] > 0).any()
    np.testing.assert_allclose(rep.share, rep.weights / rep.weights.sum(), atol=1e-7)
