"""Tests of the robustness and meta-consensus benchmarks' core functions at tiny sizes.

The round loop is checked against float64 numpy references (the mean of the submitted
params, the sign-flip attack's formula, the coordinate-wise range of the honest nodes), the
summaries against numpy minima over synthetic accuracies, and Bulyan's applicability against
the library's own precondition.
"""

from __future__ import annotations

import dataclasses
import math
import re
import sys
from pathlib import Path

import jax
import numpy as np
import pytest

# The benchmarks package lives at the repository root, beside tests/; make it importable
# under any pytest invocation.
_ROOT = str(Path(__file__).resolve().parents[2])
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)

from benchmarks.harness import trainer_for  # noqa: E402
from benchmarks.quality import meta_consensus, robustness  # noqa: E402
from consensus import get_info  # noqa: E402
from meta_consensus import RoundInfo  # noqa: E402
from strategies import DigitsTask, attacks  # noqa: E402
from strategies.byzantine import honest  # noqa: E402

N = 8
SETTINGS = robustness.Settings(num_nodes=N, hidden=(8,), local_steps=3, learning_rate=0.2, batch_size=8)


def _rows(stacked) -> np.ndarray:
    """(n, d) float64: every node's params flattened (leaves in tree order)."""
    leaves = jax.tree_util.tree_leaves(stacked)
    n = leaves[0].shape[0]
    return np.concatenate([np.asarray(x, np.float64).reshape(n, -1) for x in leaves], axis=1)


def _flat(tree) -> np.ndarray:
    return np.concatenate([np.asarray(x, np.float64).ravel() for x in jax.tree_util.tree_leaves(tree)])


@pytest.fixture(scope="module")
def setup():
    task = DigitsTask(hidden=SETTINGS.hidden)
    split = task.splits(N, seed=0, alpha=1.0)
    trainer = trainer_for(task, "sgd", SETTINGS.batch_size)
    data = trainer.place(robustness.shard_pool(split))
    params = task.init(jax.random.key(0))
    return task, split, trainer, data, params


def _round(setup, rule: str, byz, key: int = 1):
    _, _, trainer, data, params = setup
    _, merge = robustness.compiled_rule(rule, N, byz.num_byzantine, SETTINGS)
    return robustness.fedavg_round(
        trainer,
        data,
        params,
        merge,
        byz,
        jax.random.key(key),
        local_steps=SETTINGS.local_steps,
        learning_rate=SETTINGS.learning_rate,
    )


def test_shard_pool_holds_each_nodes_own_rows(setup):
    _, split, _, data, _ = setup
    pool = {k: np.asarray(v) for k, v in data.pool.items()}
    index, count = np.asarray(data.index), np.asarray(data.count)
    assert pool["x"].shape[0] == int(np.sum(split.train_count)) == index.shape[1]
    for i in range(N):
        rows = index[i, : count[i]]
        np.testing.assert_array_equal(pool["x"][rows], np.asarray(split.train["x"])[i, : count[i]])
        np.testing.assert_array_equal(pool["y"][rows], np.asarray(split.train["y"])[i, : count[i]])


@pytest.mark.slow
def test_round_with_mean_and_no_attack_is_the_numpy_mean_of_the_submitted_params(setup):
    params = setup[4]
    merged, state, submitted = _round(setup, "mean", honest(N))
    x = _rows(submitted)
    # The nodes trained: they moved away from the broadcast and from each other.
    assert np.min(np.linalg.norm(x - _flat(params)[None], axis=1)) > 1e-3
    assert np.min(np.linalg.norm(x - x[0][None], axis=1)[1:]) > 1e-4
    np.testing.assert_allclose(_flat(merged), x.mean(axis=0), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(np.asarray(get_info(state).weights), np.full(N, 1.0 / N), rtol=1e-6)


@pytest.mark.slow
def test_sign_flip_rows_are_minus_the_honest_mean_update(setup):
    params = setup[4]
    f = 2
    byz = robustness.byzantine_config(N, f, "sign_flip")
    _, _, submitted = _round(setup, "mean", byz)
    x, g = _rows(submitted), _flat(params)
    expected = g - (x[: N - f] - g[None]).mean(axis=0)
    for row in x[N - f :]:
        np.testing.assert_allclose(row, expected, rtol=1e-5, atol=1e-6)


@pytest.mark.slow
def test_attack_moves_fedavg_but_median_stays_inside_the_honest_nodes(setup):
    f = 2
    clean, _, clean_sub = _round(setup, "mean", honest(N))
    byz = robustness.byzantine_config(N, f, "gaussian")
    attacked, _, sub = _round(setup, "mean", byz)
    # The same key: the honest nodes trained exactly as in the clean round.
    np.testing.assert_allclose(_rows(sub)[: N - f], _rows(clean_sub)[: N - f], rtol=1e-6, atol=1e-7)
    _, merge_median = robustness.compiled_rule("median", N, f, SETTINGS)
    median, _ = merge_median(sub, setup[4])
    honest_rows = _rows(sub)[: N - f]
    spread = np.linalg.norm(honest_rows - honest_rows.mean(0)[None], axis=1).max()
    fedavg_shift = np.linalg.norm(_flat(attacked) - _flat(clean))
    median_shift = np.linalg.norm(_flat(median) - honest_rows.mean(0))
    assert fedavg_shift > 5 * spread  # N(0, 1) in every coordinate drags the mean far away
    assert median_shift < spread
    m = _flat(median)
    assert np.all(m >= honest_rows.min(0) - 1e-6) and np.all(m <= honest_rows.max(0) + 1e-6)


def test_worst_case_is_the_minimum_over_attacks():
    rng = np.random.default_rng(0)
    attacks = list(robustness.ATTACKS)
    for _ in range(5):
        acc = dict(zip(attacks, rng.uniform(0.1, 1.0, len(attacks)), strict=True))
        attack, value = robustness.worst_case(acc)
        assert attack == attacks[int(np.argmin(list(acc.values())))]
        assert value == min(acc.values())
    with pytest.raises(ValueError):
        robustness.worst_case({})


def test_summary_averages_seeds_then_takes_the_worst_attack():
    rng = np.random.default_rng(1)
    st = robustness.Settings(alphas=(0.3, 10.0), byzantine=(0, 4), rules=("mean", "median", "bulyan"))
    runs, acc = [], {}
    for seed in (0, 1, 2):
        for alpha in st.alphas:
            for f in st.byzantine:
                for attack in st.attacks if f else ("none",):
                    for rule in st.rules:
                        rec = {"seed": seed, "alpha": alpha, "f": f, "attack": attack, "rule": rule}
                        if rule == "bulyan" and f == 4:
                            runs.append({**rec, "applicable": False, "reason": "n < 4f + 3"})
                            continue
                        t, h = rng.uniform(0.3, 1.0, 2)
                        acc.setdefault((alpha, f, rule, attack), []).append((t, h))
                        runs.append({**rec, "applicable": True, "test_acc": t, "heldout_acc": h})
                        runs[-1]["byzantine_weight"] = 0.0
    cells = robustness.summarize(runs, st)["cells"]
    for alpha in st.alphas:
        for f in st.byzantine:
            for rule in st.rules:
                cell = cells[str(alpha)][str(f)][rule]
                if rule == "bulyan" and f == 4:
                    assert not cell["applicable"]
                    continue
                attacks = st.attacks if f else ("none",)
                means = np.array([np.mean([t for t, _ in acc[(alpha, f, rule, a)]]) for a in attacks])
                assert cell["worst_test"] == pytest.approx(means.min())
                assert cell["worst_attack"] == attacks[int(np.argmin(means))]
                held = np.array([np.mean([h for _, h in acc[(alpha, f, rule, a)]]) for a in attacks])
                assert cell["worst_heldout"] == pytest.approx(held.min())
    # The best pipeline is chosen on held-out accuracy among applicable robust rules: never the
    # plain mean, never Bulyan (not applicable at f = 4).
    assert robustness.best_pipeline({"cells": cells}, st) == "median"


@pytest.mark.slow
def test_bulyan_at_f4_of_16_is_reported_not_applicable():
    st = robustness.Settings(
        alphas=(1.0,), byzantine=(2, 4), attacks=("sign_flip",), rules=("bulyan",), seeds=(0,), rounds=1
    )
    reason = robustness.not_applicable("bulyan", 16, 4, st)
    assert reason is not None and "bulyan" in reason
    assert robustness.not_applicable("bulyan", 19, 4, st) is None  # n >= 4f + 3
    assert robustness.not_applicable("bulyan", 16, 2, st) is None
    assert robustness.not_applicable("nnm+krum", 16, 4, st) is None
    # The benchmark records f = 4 as not applicable instead of dropping it.
    st4 = robustness.Settings(
        alphas=(1.0,), byzantine=(4,), attacks=("sign_flip",), rules=("bulyan",), seeds=(0,), rounds=1
    )
    runs = robustness.run_all(st4, log=lambda _: None)
    assert len(runs) == 1 and runs[0]["applicable"] is False and runs[0]["reason"] == reason
    cell = robustness.summarize(runs, st4)["cells"]["1.0"]["4"]["bulyan"]
    assert cell == {"applicable": False, "reason": reason}


# ----------------------------------------------------------------------------- meta-consensus


def test_meta_scenarios_build_valid_configs_whose_options_fit_their_attack():
    rng = np.random.default_rng(2)
    honest_updates = {"w": rng.normal(size=(6, 5)).astype(np.float32)}
    mean = honest_updates["w"].astype(np.float64).mean(0)
    default = meta_consensus.config.load(None)
    for sc in meta_consensus.SCENARIOS:
        for variant in meta_consensus.VARIANTS:
            cfg = meta_consensus.build_config(sc, variant, seed=3)
            assert cfg.seed == 3 and cfg.dp.enabled == (variant != "no_dp")
            # Everything else is the default config (which its owners may retune).
            assert cfg.vote == default.vote and cfg.weights == default.weights and cfg.nodes == default.nodes
            if variant == "full":
                assert cfg.dp.level == "node" and cfg.dp.noise_multiplier == 0.01 and not default.dp.enabled
            if variant == "dp_eps8":
                assert cfg.dp.noise_multiplier is None and cfg.dp.epsilon == 8.0
            if sc == "clean":
                assert cfg.byzantine.nodes == ()
                continue
            assert cfg.byzantine.nodes == default.byzantine.nodes and cfg.byzantine.attack == sc
            if sc == "alie":
                assert cfg.byzantine == default.byzantine
            # The options must be the attack's own keywords (the default's z belongs to ALIE only).
            out = np.asarray(
                attacks.get_attack(cfg.byzantine.attack)(
                    jax.random.key(0), honest_updates, 2, **cfg.byzantine.options
                )["w"],
                np.float64,
            )
            if sc == "ipm":
                np.testing.assert_allclose(out, np.broadcast_to(-2.0 * mean, out.shape), rtol=1e-5)
            if sc == "sign_flip":
                np.testing.assert_allclose(out, np.broadcast_to(-mean, out.shape), rtol=1e-5)
    cfg = meta_consensus.build_config("clean", "full", seed=0, rounds=2)
    assert cfg.rounds == 2


def _info(round_: int, ok: bool, consensus: float, node_acc: list[float], weights: list[float]) -> RoundInfo:
    n = len(node_acc)
    nan = math.nan
    return RoundInfo(
        round=round_,
        attempt=0,
        ok=ok,
        reason="" if ok else "failed",
        answered=[True] * n,
        valid=[True] * n,
        accepted=[w > 0 for w in weights],
        weights=weights,
        errors={},
        node_accuracy=node_acc,
        node_loss=[nan] * n,
        train_loss=[nan] * n,
        consensus_accuracy=consensus if ok else nan,
        consensus_loss=nan,
        heldout_accuracy=nan,
        fedavg_accuracy=consensus - 0.1,
        epsilon=0.0,
        epsilon_rdp=0.0,
        epsilon_pld=0.0,
        clip_norm=nan,
        noise_std=nan,
        solve_ms=0.0,
        weight_cap=nan,
        seconds={},
    )


def test_meta_curves_take_the_last_attempt_and_carry_a_failed_round_over():
    rng = np.random.default_rng(3)
    cfg = meta_consensus.build_config("alie", "full", seed=0)
    n = cfg.nodes.count
    acc = rng.uniform(0.5, 0.9, 4)
    w = rng.dirichlet(np.ones(n), 4)
    nodes = rng.uniform(0.3, 0.8, (4, n))
    nodes[-1, 6] = 0.99  # a Byzantine node's (submitted) accuracy must not count as the best node
    history = [
        _info(0, True, acc[0], list(nodes[0]), list(w[0])),
        _info(1, False, 0.0, list(nodes[1]), [0.0] * n),  # attempt 0 failed ...
        dataclasses.replace(_info(1, True, acc[1], list(nodes[1]), list(w[1])), attempt=1),  # ... retried
        _info(2, False, 0.0, list(nodes[2]), [0.0] * n),  # failed for good
        _info(3, True, acc[3], list(nodes[3]), list(w[3])),
    ]
    assert [i.round for i in meta_consensus.final_rounds(history)] == [0, 1, 2, 3]
    np.testing.assert_allclose(
        meta_consensus.curve(history, "consensus_accuracy"), [acc[0], acc[1], acc[1], acc[3]]
    )
    honest_mask = np.ones(n, bool)
    honest_mask[[6, 7]] = False
    assert meta_consensus.best_single_node(history, cfg) == pytest.approx(nodes[-1][honest_mask].max())
    expected = np.mean([w[r][~honest_mask].sum() for r in (0, 1, 3)])
    assert meta_consensus.byzantine_weight(history, cfg) == pytest.approx(expected)
    clean = meta_consensus.build_config("clean", "full", seed=0)
    assert meta_consensus.best_single_node(history, clean) == pytest.approx(nodes[-1].max())
    assert meta_consensus.byzantine_weight(history, clean) == 0.0


def test_meta_summary_pairs_methods_with_their_runs():
    rng = np.random.default_rng(4)
    runs = []
    for seed in (2, 0, 1):  # out of order on purpose
        for variant in ("full", "no_dp"):
            r = {"scenario": "alie", "variant": variant, "seed": seed}
            r.update(
                {
                    k: float(v)
                    for k, v in zip(
                        ("consensus", "best_node", "byzantine_weight"), rng.uniform(size=3), strict=True
                    )
                }
            )
            r.update(fedavg=0.5 + seed / 10, failed_rounds=0, epsilon=1.0 if variant == "full" else math.inf)
            r.update(epsilon_rdp=r["epsilon"], epsilon_pld=r["epsilon"])
            runs.append(r)
    s = meta_consensus.summarize(runs, ["alie"])["alie"]
    by = {(r["variant"], r["seed"]): r for r in runs}
    assert s["values"]["full pipeline"] == [by[("full", i)]["consensus"] for i in (0, 1, 2)]
    assert s["values"]["without DP"] == [by[("no_dp", i)]["consensus"] for i in (0, 1, 2)]
    assert s["values"]["best single node"] == [by[("no_dp", i)]["best_node"] for i in (0, 1, 2)]
    assert s["mean_std"]["plain FedAvg"][0] == pytest.approx(0.6)
    assert "DP at epsilon = 8" not in s["values"]  # that variant did not run
    assert s["fedavg_same_in_every_variant"] and s["epsilon"] == {"full": 1.0, "no_dp": math.inf}
    runs[0]["fedavg"] += 0.01
    assert not meta_consensus.summarize(runs, ["alie"])["alie"]["fedavg_same_in_every_variant"]


def test_rules_and_attacks_options_pick_a_subset_in_table_order(capsys):
    rules = robustness.subset("median, nnm+krum", tuple(robustness.RULES), "rules", always=("mean",))
    assert rules == tuple(r for r in robustness.RULES if r in ("mean", "median", "nnm+krum"))
    assert robustness.subset(None, ("a", "b"), "attacks") == ("a", "b")
    with pytest.raises(ValueError, match=r"--attacks: unknown \['nope'\]; valid: sign_flip"):
        robustness.subset("alie,nope", tuple(robustness.ATTACKS), "attacks")
    with pytest.raises(SystemExit) as e:  # argparse's one-line error, before any run
        robustness.main(["--quick", "--rules", "krumm"])
    assert e.value.code == 2
    assert "--rules: unknown ['krumm']" in capsys.readouterr().err


def test_robust_preset_candidates_are_valid_configs_of_the_preset():
    """Every candidate of the preset's selection loads on configs/robust.toml and is the vote
    ("pre+rule"), the weights ("+objective", none: the vote's output) and the server step
    ("+server_<step>", none: 0) it names."""
    from benchmarks.tuning import robust_preset
    from meta_consensus import config
    from meta_consensus.objectives import OBJECTIVES

    preset = Path(__file__).resolve().parents[2] / robust_preset.PRESET
    for name, sets in robust_preset.CANDIDATES.items():
        cfg = config.load(preset, sets)
        step = 0.0
        suffix = re.fullmatch(r"(.+)\+server_([0-9.]+)", name)
        if suffix:
            name, step = suffix[1], float(suffix[2])
        assert cfg.vote.server_step == step, name
        *parts, last = name.split("+")
        objective = last if last in OBJECTIVES.names() else "vote"
        *pre, rule = parts if objective != "vote" else [*parts, last]
        got = (cfg.vote.rule, tuple(cfg.vote.pre), cfg.weights.objective)
        assert got == (rule, tuple(pre), objective), name
    assert set(robust_preset.QUICK_CANDIDATES) <= set(robust_preset.CANDIDATES)
    # The candidate the other tasks report is the preset as shipped: its overrides change nothing.
    shipped = config.load(preset)
    same = config.load(preset, robust_preset.CANDIDATES[robust_preset.PRESET_CANDIDATE])
    assert (same.vote, same.weights) == (shipped.vote, shipped.weights)


def test_robust_preset_on_another_task_reports_the_shipped_preset_without_selection(monkeypatch, tmp_path):
    """--task fashion_mnist: no selection runs; the shipped preset, FedAvg, DnC and the oracle run on
    that task (every run gets task.name), and the results go to robust_preset_fashion_mnist_quick.*."""
    from benchmarks import harness
    from benchmarks.tuning import robust_preset

    calls = []

    def fake_run(sets):
        calls.append(sets)
        attacked = any(s.startswith("byzantine.attack=") for s in sets)
        return (0.80 if attacked else 0.90), 0.85

    monkeypatch.setattr(robust_preset, "run_once", fake_run)
    monkeypatch.setattr(harness, "_task_name", "digits")  # use_task sets it; put it back after
    res = robust_preset.main(["--quick", "--task", "fashion_mnist", "--out", str(tmp_path)])
    assert res["selection"] == {} and res["chosen"] == robust_preset.PRESET_CANDIDATE
    assert set(res["report"]) == {robust_preset.PRESET_CANDIDATE, "mean", "dnc"}
    assert all("task.name=fashion_mnist" in sets for sets in calls)
    assert not any(f"seed={robust_preset.SELECTION_SEED}" in sets for sets in calls)
    assert len(calls) == 3 * (1 + len(robust_preset.ATTACKS)) + 1  # three merges, one seed, the oracle
    md = (tmp_path / "robust_preset_fashion_mnist_quick.md").read_text()
    assert f"The preset: **{robust_preset.PRESET_CANDIDATE}**" in md and "gap (points)" in md


def test_robust_preset_seeds_option_refuses_the_selection_seed_and_non_integers(capsys):
    from benchmarks.tuning import robust_preset

    for bad, why in (("100", "the selection seed"), ("0,x", "comma-separated integers")):
        with pytest.raises(SystemExit) as e:  # argparse's one-line error, before any run
            robust_preset.main(["--seeds", bad])
        assert e.value.code == 2
        assert why in capsys.readouterr().err


def test_robust_preset_at_another_alpha_reports_the_shipped_preset_there(monkeypatch, tmp_path):
    from benchmarks import harness
    from benchmarks.tuning import robust_preset

    calls = []

    def fake_run(sets):
        calls.append(sets)
        return 0.9, 0.85

    monkeypatch.setattr(robust_preset, "run_once", fake_run)
    monkeypatch.setattr(harness, "_task_name", "digits")
    res = robust_preset.main(["--quick", "--alpha", "0.1", "--out", str(tmp_path)])
    assert res["selection"] == {} and res["chosen"] == robust_preset.PRESET_CANDIDATE
    assert calls and all("task.alpha=0.1" in sets for sets in calls)
    assert "alpha = 0.1" in (tmp_path / "robust_preset_alpha0.1_quick.md").read_text()
