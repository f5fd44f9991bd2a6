"""The round and the run: end to end, determinism, failures that keep the consensus, and the merge math."""

from __future__ import annotations

import json
import math

import jax
import numpy as np
import pytest
from system_helpers import small_config

from consensus.privacy import pld_epsilon, rdp_epsilon
from meta_consensus import Coordinator, MetaConsensus, cli
from meta_consensus.checkpoint import load_history
from meta_consensus.config import ConfigError
from strategies.trainer import NodeTrainer


def _leaves(tree):
    return [np.asarray(x) for x in jax.tree.leaves(tree)]


def _submitted(co, state, attempt=0):
    """The candidates the round of ``state`` receives (the fit is a pure function of the round key)."""
    k_fit, _ = jax.random.split(co.round_key(state, attempt))
    return co.fleet.fit(state.nodes, state.consensus, k_fit)


@pytest.fixture(scope="module")
def small_run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("run")
    cfg = small_config(tmp)
    return cfg, MetaConsensus(cfg, progress=False).train()


@pytest.mark.slow
def test_end_to_end_run_writes_every_output(small_run):
    cfg, result = small_run
    run = cfg.run_dir
    assert [h.round for h in result.history] == [0, 1, 2] and all(h.ok for h in result.history)
    for name in ("config.toml", "metrics.jsonl", "accuracy.png", "weights.png", "table.txt"):
        assert (run / name).is_file(), name
    assert any(p.name.startswith("events.out.tfevents") for p in (run / "tensorboard").iterdir())
    assert sorted(int(p.name) for p in (run / "checkpoints").iterdir() if p.name.isdigit()) == [1, 2, 3]
    logged = load_history(run / "metrics.jsonl")
    assert [h.to_json() for h in logged] == [json.loads(json.dumps(h.to_json())) for h in result.history]
    last = result.history[-1]
    # weights: on the simplex, zero outside the accepted set, the cap respected
    w = np.asarray(last.weights)
    assert abs(w.sum() - 1) < 1e-5 and np.all(w[~np.asarray(last.accepted)] == 0) and w.max() <= 0.5 + 1e-6
    # training helped (the untrained model is at chance, 0.1); the consensus carries heavy DP noise here
    assert last.fedavg_accuracy > 0.3 and all(0 <= a <= 1 for a in last.node_accuracy)
    assert 0 <= last.consensus_accuracy <= 1
    assert all(np.isfinite(x).all() for x in _leaves(result.consensus_params))


def test_epsilon_is_the_accountants_for_the_rounds_run(small_run):
    cfg, result = small_run
    for r, h in enumerate(result.history, start=1):
        ref = rdp_epsilon(0.5, 1.0, r, cfg.dp.delta)
        assert h.epsilon == pytest.approx(ref, rel=1e-9) and h.epsilon_rdp == pytest.approx(ref, rel=1e-9)
        # PLD (the comparison accountant) is computed at checkpoints and at the last round only
        if r % cfg.checkpoint_every == 0 or r == cfg.rounds:
            assert h.epsilon_pld == pytest.approx(pld_epsilon(0.5, 1.0, r, cfg.dp.delta), rel=1e-9)
            assert h.epsilon_pld < h.epsilon_rdp  # PLD is the tighter accountant
        else:
            assert math.isnan(h.epsilon_pld)
        # robust pipeline: sensitivity 2C, so the noise std is z * 2C
        assert h.noise_std == pytest.approx(0.5 * 2 * cfg.dp.clip_norm, rel=1e-6)
    assert result.history[-1].epsilon_pld == pytest.approx(
        pld_epsilon(0.5, 1.0, cfg.rounds, cfg.dp.delta), rel=1e-9
    )


def test_same_seed_gives_bit_identical_results(tmp_path, small_run):
    cfg, first = small_run
    again = MetaConsensus(cfg.replace(output_dir=str(tmp_path)), write=False, progress=False).train()
    for a, b in zip(_leaves(first.consensus_params), _leaves(again.consensus_params), strict=True):
        np.testing.assert_array_equal(a, b)
    assert [h.weights for h in again.history] == [h.weights for h in first.history]
    one = MetaConsensus(cfg, write=False, progress=False).train(max_rounds=1)
    other = MetaConsensus(cfg.replace(seed=4), write=False, progress=False).train(max_rounds=1)
    assert one.history[0].weights == first.history[0].weights  # the seed fixes round 1
    assert not all(
        np.array_equal(a, b)
        for a, b in zip(_leaves(one.consensus_params), _leaves(other.consensus_params), strict=True)
    )


def test_failed_round_keeps_the_previous_state(tmp_path):
    cfg = small_config(tmp_path, "faults.crash_nodes=[0, 1, 2, 3]", "min_answers=0.5")
    co = Coordinator(cfg)
    state = co.init(cfg.seed)
    new, info = co.round(state)
    assert not info.ok and "too few valid answers: 2 of 6, need 3" in info.reason
    assert info.errors["0"] == "fit raised RuntimeError: simulated crash"
    assert new.round == state.round and new.consensus is state.consensus and new.nodes is state.nodes
    assert new.ledger.rounds == 0  # no DP release happened


def test_an_exception_in_the_fit_is_a_missing_answer(tmp_path, monkeypatch):
    cfg = small_config(tmp_path)
    co = Coordinator(cfg)
    state = co.init(cfg.seed)

    def boom(*args, **kwargs):
        raise RuntimeError("device lost")

    monkeypatch.setattr(NodeTrainer, "fit", boom)
    new, info = co.round(state)
    assert not info.ok and info.answered == [False] * 6
    assert info.errors["3"] == "fit raised RuntimeError: device lost"
    assert new.consensus is state.consensus


def test_run_retries_then_continues_or_stops(tmp_path):
    crash = ["faults.crash_nodes=[0, 1, 2, 3, 4]", "max_retries=2", "rounds=2", "dp.enabled=false"]
    cfg = small_config(tmp_path, *crash, "on_failure=continue")
    system = MetaConsensus(cfg, write=False, progress=False)
    init = system.coordinator.init(cfg.seed).consensus
    result = system.train()
    assert [(h.round, h.attempt, h.ok) for h in result.history] == [
        (0, 0, False),
        (0, 1, False),
        (0, 2, False),
        (1, 0, False),
        (1, 1, False),
        (1, 2, False),
    ]
    for a, b in zip(_leaves(init), _leaves(result.consensus_params), strict=True):
        np.testing.assert_array_equal(a, b)
    stopped = MetaConsensus(cfg.replace(on_failure="stop"), write=False, progress=False).train()
    assert len(stopped.history) == 3 and "round 1 failed after 2 retries" in stopped.stopped


def test_consensus_threshold_and_quality_gate(tmp_path):
    cfg = small_config(tmp_path, "consensus_threshold=1.0", "dp.enabled=false")
    co = Coordinator(cfg)
    state = co.init(cfg.seed)
    new, info = co.round(state)
    # Multi-Krum keeps n - f = 5 of 6 nodes
    assert not info.ok and info.reason == "the vote accepted 5 of 6 nodes, consensus_threshold needs 6"
    assert new.consensus is state.consensus
    gated = Coordinator(small_config(tmp_path, "quality_threshold=0.999"))
    s = gated.init(cfg.seed)
    _, info = gated.round(s)
    assert not info.ok and "too few valid answers: 0 of 6" in info.reason
    assert "below quality_threshold" in info.errors["0"]


def test_uniform_weights_are_the_mean_of_the_accepted_nodes(tmp_path):
    cfg = small_config(
        tmp_path,
        "weights.objective=uniform",
        "vote.server_step=0",  # the weights' merge alone
        "dp.enabled=false",
        "byzantine.attack=sign_flip",
        "byzantine.options={scale = 4.0}",
    )
    co = Coordinator(cfg)
    state = co.init(cfg.seed)
    out = _submitted(co, state)
    new, info = co.round(state)
    acc = np.asarray(info.accepted)
    assert acc.sum() == 5 and not acc[5]  # Multi-Krum drops the sign-flipped node
    assert info.consensus_accuracy > 0.2  # one round of 12 steps: learning (chance is 0.1)
    for x, c in zip(_leaves(out.submitted), _leaves(new.consensus), strict=True):
        ref = x.astype(np.float64)[acc].mean(0)
        np.testing.assert_allclose(c, ref, rtol=1e-5, atol=1e-6)


@pytest.mark.slow
def test_grouped_vote_is_the_top_rule_over_group_votes(tmp_path):
    cfg = small_config(
        tmp_path,
        "vote.rule=median",
        "vote.groups=2",
        "vote.top_rule=mean",
        "weights.objective=vote",
        "vote.server_step=0",  # the grouped vote's output alone
        "dp.enabled=false",
    )
    co = Coordinator(cfg)
    state = co.init(cfg.seed)
    out = _submitted(co, state)
    new, info = co.round(state)
    assert info.ok
    for x, c in zip(_leaves(out.submitted), _leaves(new.consensus), strict=True):
        x = x.astype(np.float64)
        ref = (np.median(x[:3], 0) + np.median(x[3:], 0)) / 2
        np.testing.assert_allclose(c, ref, rtol=1e-5, atol=1e-6)


@pytest.mark.slow
def test_plain_dp_fedavg_uses_sensitivity_c_over_n(tmp_path):
    cfg = small_config(
        tmp_path,
        "vote.rule=mean",
        "weights.objective=uniform",
        "dp.noise_multiplier=1.0",
        "byzantine.nodes=[]",
    )
    co = Coordinator(cfg)
    _, info = co.round(co.init(cfg.seed))
    assert info.ok and info.noise_std == pytest.approx(1.0 * cfg.dp.clip_norm / 6, rel=1e-6)


def test_privacy_budget_stops_the_run(tmp_path):
    budget = rdp_epsilon(0.5, 1.0, 2, 1e-5) * 1.001  # room for two rounds, not three
    cfg = small_config(tmp_path, f"dp.budget={budget}")
    result = MetaConsensus(cfg, write=False, progress=False).train()
    assert len(result.history) == 2 and "privacy budget" in result.stopped
    assert result.state.ledger.epsilon() <= budget


@pytest.mark.parametrize(
    ("overrides", "needle"),
    [
        (["vote.rule=krum", "vote.num_byzantine=2"], "'krum' cannot run on all of 6 nodes with f = 2"),
        (
            ["vote.groups=2", "vote.num_byzantine=none", "vote.fault_tolerance=0.4"],
            "each of the 2 groups of 3 nodes with f = 1",
        ),
        (["vote.pre=['nnm']", "vote.rule=median", "vote.num_byzantine=3"], "vote.pre[nnm] = 'nnm'"),
        (["vote.groups=2", "vote.top_rule=krum", "vote.rule=median"], "vote.top_rule = 'krum'"),
    ],
)
def test_too_many_byzantine_nodes_for_the_rule_fail_at_load(tmp_path, overrides, needle):
    # Checked from the registry's static precondition when the config loads, before any training.
    with pytest.raises(ConfigError) as e:
        small_config(tmp_path, *overrides)
    assert needle in str(e.value) and "needs" in str(e.value)


def test_report_redraws_the_table_and_plots(small_run, capsys):
    cfg, _ = small_run
    run = cfg.run_dir
    before = (run / "table.txt").read_text()
    (run / "accuracy.png").unlink()
    assert cli.main(["report", str(run)]) == 0
    assert (run / "accuracy.png").is_file()
    printed = capsys.readouterr().out
    assert before.strip().splitlines()[1:] == (run / "table.txt").read_text().strip().splitlines()[1:]
    assert "meta-consensus" in printed and "plain FedAvg" in printed


def test_cli_reports_bad_configs(capsys, tmp_path):
    assert cli.main(["run", "--set", "vote.rule=kruum", "--set", f"output_dir={tmp_path}"]) == 2
    assert "vote.rule = 'kruum' is not valid" in capsys.readouterr().err
    assert cli.main(["report", str(tmp_path / "missing")]) == 2
    assert math.isfinite(1.0)


def test_a_rejected_round_after_the_dp_release_is_still_charged(tmp_path):
    cfg = small_config(tmp_path, "consensus_threshold=1.0")
    co = Coordinator(cfg)
    state = co.init(cfg.seed)
    new, info = co.round(state)
    assert not info.ok and "consensus_threshold" in info.reason
    assert new.consensus is state.consensus and new.round == state.round
    assert state.ledger.rounds == 0 and new.ledger.rounds == 1  # the caller's ledger is not mutated
    assert new.ledger.epsilon() == pytest.approx(rdp_epsilon(0.5, 1.0, 1, cfg.dp.delta), rel=1e-9)


def test_initial_params_are_checked_and_used(tmp_path):
    cfg = small_config(tmp_path, "dp.enabled=false")
    co = Coordinator(cfg)
    fresh = co.init(cfg.seed).consensus
    start = jax.tree.map(lambda x: x + 1.0, fresh)
    state = co.init(cfg.seed, start)
    for a, b in zip(_leaves(state.consensus), _leaves(start), strict=True):
        np.testing.assert_array_equal(a, b)
    np.testing.assert_array_equal(_leaves(state.nodes.params)[0][2], _leaves(start)[0])
    bad = dict(fresh)
    bad.pop(sorted(bad)[0])
    with pytest.raises(Exception, match="structure"):
        co.init(cfg.seed, bad)


def test_too_few_answers_for_the_rule_fail_the_round_not_the_run(tmp_path):
    # Multi-Krum with f = 1 needs m > 4 valid nodes; 2 crashed nodes leave 4 (min_answers allows it).
    cfg = small_config(tmp_path, "faults.crash_nodes=[0, 1]", "min_answers=0.5")
    co = Coordinator(cfg)
    state = co.init(cfg.seed)
    new, info = co.round(state)
    assert not info.ok
    assert info.reason.startswith("multi_krum: cannot tolerate f=1 Byzantine nodes with n=4 valid")
    assert new.consensus is state.consensus and new.ledger.rounds == 0


def test_fault_tolerance_is_a_fraction_of_the_nodes_that_answered(tmp_path):
    # The same 2 crashes with f as a fraction: f = floor(0.2 * 4 answered) = 0, so Multi-Krum runs on
    # the 4 answers (an absolute num_byzantine = 1 fails, as above).
    from meta_consensus.pipeline import vote_f

    cfg = small_config(
        tmp_path,
        "faults.crash_nodes=[0, 1]",
        "min_answers=0.5",
        "vote.num_byzantine=none",
        "vote.fault_tolerance=0.2",
    )
    assert [vote_f(cfg, m) for m in (6, 5, 4)] == [1, 1, 0]
    co = Coordinator(cfg)
    state = co.init(cfg.seed)
    new, info = co.round(state)
    assert info.ok, info.reason
    assert info.accepted[:2] == [False, False] and sum(info.accepted) == 4 - 0  # m - f of the 4 answers
    absolute = small_config(tmp_path, "vote.num_byzantine=1")
    assert [vote_f(absolute, m) for m in (6, 4, 2)] == [1, 1, 1]
