"""Smoke and sanity tests of the quality benchmarks' core functions at tiny sizes.

Each benchmark's numbers are checked against independent references: a float64 numpy forward
pass of the digits MLP (for merged models), float64 numpy objectives (mixture NLL, distance
to the coordinate-wise median) evaluated at feasible competitors, and the accountants
themselves (for the ledger and the calibration).
"""

from __future__ import annotations

import math
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

from benchmarks import harness  # noqa: E402
from benchmarks.quality import convex_quality, privacy_quality, soups  # noqa: E402
from consensus.dp import effective_sampling_rate  # noqa: E402
from consensus.privacy import PrivacyBudgetExceeded, rdp_epsilon  # noqa: E402
from strategies import DigitsTask  # noqa: E402
from strategies.tasks.base import with_public_pool  # noqa: E402

# ----------------------------------------------------------------------------- numpy references


def _np_tree(params) -> dict:
    return jax.tree.map(lambda x: np.asarray(x, np.float64), params)


def _np_logits(params: dict, x: np.ndarray) -> np.ndarray:
    """Float64 forward pass of the digits MLP (dense_0 ... dense_L, ReLU between)."""
    h = np.asarray(x, np.float64)
    layers = sorted(params, key=lambda k: int(k.split("_")[1]))
    for i, name in enumerate(layers):
        h = h @ params[name]["kernel"] + params[name]["bias"]
        if i < len(layers) - 1:
            h = np.maximum(h, 0.0)
    return h


def _np_probs(params: dict, x: np.ndarray) -> np.ndarray:
    z = _np_logits(params, x)
    z = z - z.max(-1, keepdims=True)
    e = np.exp(z)
    return e / e.sum(-1, keepdims=True)


def _np_metrics(params: dict, batch: dict) -> tuple[float, float]:
    """(mean cross entropy, accuracy) in float64."""
    p, y = _np_probs(params, batch["x"]), np.asarray(batch["y"])
    return float(-np.mean(np.log(p[np.arange(len(y)), y]))), float(np.mean(p.argmax(-1) == y))


def _np_nodes(stacked) -> list[dict]:
    return [_np_tree(p) for p in harness.unstack(stacked)]


def _np_merge(nodes: list[dict], w: np.ndarray) -> dict:
    return jax.tree.map(lambda *xs: sum(wi * xi for wi, xi in zip(w, xs, strict=True)), *nodes)


def _mixture_nll(nodes: list[dict], w: np.ndarray, batch: dict) -> float:
    y = np.asarray(batch["y"])
    mix = sum(wi * _np_probs(p, batch["x"]) for wi, p in zip(w, nodes, strict=True))
    return float(-np.mean(np.log(mix[np.arange(len(y)), y])))


def _flat(tree: dict) -> np.ndarray:
    return np.concatenate([np.ravel(x) for x in jax.tree_util.tree_leaves(tree)])


# ----------------------------------------------------------------------------- soups


@pytest.mark.slow
def test_soups_greedy_is_at_least_the_best_ingredient_on_heldout_and_convex_weights_are_optimal():
    k, steps = 4, 16
    ing = soups.finetune(
        0, ingredients=k, pretrain_steps=20, finetune_steps=steps, hidden=(16,), batch_size=16
    )
    # Every ingredient trained exactly its own drawn number of steps (inactive afterwards).
    np.testing.assert_array_equal(ing.steps, ing.hyperparams["steps"])
    assert set(ing.steps.tolist()) <= {steps // 4, steps // 2, steps}
    rows = soups.soup_rows(ing)
    nodes = _np_nodes(ing.stacked)
    one_example = 1.0 / len(ing.data.test["y"])  # float32 and float64 argmax may split a near-tie

    # Best ingredient: the highest held-out accuracy (float64 reference).
    held = [_np_metrics(p, ing.data.heldout) for p in nodes]
    (best,) = rows["best ingredient"]["kept"]
    assert held[best][1] == pytest.approx(max(h[1] for h in held), abs=one_example)

    # Uniform soup: the float64 mean of the ingredients, evaluated by the numpy forward pass.
    loss_u, acc_u = _np_metrics(_np_merge(nodes, np.full(k, 1.0 / k)), ing.data.test)
    assert rows["uniform soup"]["test_loss"] == pytest.approx(loss_u, rel=1e-4)
    assert rows["uniform soup"]["test_acc"] == pytest.approx(acc_u, abs=one_example)

    # Greedy soups start from the best ingredient and never get worse on held-out (by construction,
    # in the benchmark's own metric).
    own = harness.stacked_metrics(ing.task, ing.stacked, ing.data.heldout)
    assert rows["greedy soup (held-out accuracy)"]["heldout_acc"] >= own["accuracy"].max() - 1e-7
    assert rows["greedy soup (held-out loss)"]["heldout_loss"] <= own["loss"].min() + 1e-6
    greedy = rows["greedy soup (held-out accuracy)"]["kept"]
    ref = _np_metrics(
        _np_merge([nodes[i] for i in greedy], np.full(len(greedy), 1.0 / len(greedy))), ing.data.test
    )
    assert rows["greedy soup (held-out accuracy)"]["test_loss"] == pytest.approx(ref[0], rel=1e-4)

    # Mixture-NLL weights: on the simplex, and no feasible competitor (uniform, each vertex)
    # has a lower held-out mixture NLL (float64 reference).
    w = np.asarray(rows["convex weights (mixture NLL)"]["weights"])
    assert w.shape == (k,) and np.all(w >= -1e-9) and w.sum() == pytest.approx(1.0, abs=1e-6)
    at_w = _mixture_nll(nodes, w, ing.data.heldout)
    assert rows[soups.ENSEMBLE]["heldout_loss"] == pytest.approx(at_w, rel=1e-4)
    for competitor in [np.full(k, 1.0 / k), *np.eye(k)]:
        assert at_w <= _mixture_nll(nodes, competitor, ing.data.heldout) + 1e-6


def test_soups_summary_counts_seeds_where_greedy_meets_the_best_ingredient():
    def run(seed, greedy, best):
        methods = {
            m: dict(heldout_acc=0.9, heldout_loss=0.3, test_acc=0.9, test_loss=0.3, kept=[0])
            for m in (*soups.METHODS, soups.ENSEMBLE)
        }
        methods["greedy soup (held-out accuracy)"]["test_acc"] = greedy
        methods["best ingredient"]["test_acc"] = best
        return {"seed": seed, "methods": methods, "greedy_minus_best_test": greedy - best}

    s = soups.summarize([run(0, 0.95, 0.94), run(1, 0.93, 0.94), run(2, 0.96, 0.96)])
    assert s["target"]["seeds_met"] == 2 and s["target"]["seeds"] == 3
    assert s["target"]["mean_diff"][0] == pytest.approx((0.01 - 0.01 + 0.0) / 3)


# ----------------------------------------------------------------------------- convex weights


@pytest.mark.slow
def test_convex_quality_rows_respect_caps_and_each_objective_beats_its_feasible_competitors():
    n, cap_factor = 4, 2.0
    # convex_quality cuts its nodes from the whole training split (harness.make_task: the union pool)
    task = with_public_pool(DigitsTask(hidden=(16,)), 0.0, "union")
    data, stacked, sizes = convex_quality.train_nodes(
        task, n, 0.5, 0, warm_steps=10, local_steps=10, public=50
    )
    assert sizes.sum() == len(data.general_groups) and sizes.min() >= 8  # a partition of the training split
    rows = convex_quality.merge_rows(task, data, stacked, cap_factor)
    assert set(rows) == set(convex_quality.row_names(cap_factor))
    nodes = _np_nodes(stacked)
    uniform = np.full(n, 1.0 / n)

    assert rows["uniform"]["weights"] == [1.0 / n] * n
    loss_u, acc_u = _np_metrics(_np_merge(nodes, uniform), data.test)
    assert rows["uniform"]["test_loss"] == pytest.approx(loss_u, rel=1e-4)
    assert rows["uniform"]["test_acc"] == pytest.approx(acc_u, abs=1.0 / len(data.test["y"]))
    for name, row in rows.items():
        w = np.asarray(row["weights"])
        assert np.all(w >= -1e-9) and w.sum() == pytest.approx(1.0, abs=1e-6), name
        if "cap" in name:
            assert w.max() <= cap_factor / n + 1e-6, name
        if name in ("uniform", convex_quality.BEST) or name.startswith(convex_quality.ENSEMBLE):
            continue
        assert not row["fallback"], (name, row["message"])
        # The reported merge is the weighted mean of the nodes (float64 reference).
        assert row["test_loss"] == pytest.approx(_np_metrics(_np_merge(nodes, w), data.test)[0], rel=1e-4), (
            name
        )

    # Trust region: never above the uniform merge on held-out (its guarantee).
    for name in ("trust-region quadratic", f"trust-region quadratic, cap {cap_factor:g}/n"):
        assert rows[name]["heldout_loss"] <= rows["uniform"]["heldout_loss"] + 1e-6
    # Mixture NLL: its weights minimize the held-out NLL of the mixture (uniform is feasible for both).
    for name in ("mixture NLL", f"mixture NLL, cap {cap_factor:g}/n"):
        at_w = _mixture_nll(nodes, np.asarray(rows[name]["weights"]), data.heldout)
        assert at_w <= _mixture_nll(nodes, uniform, data.heldout) + 1e-6
        assert rows[name.replace("mixture NLL", convex_quality.ENSEMBLE)]["heldout_loss"] == pytest.approx(
            at_w, rel=1e-4
        )
    # Anchor: the merge is at least as close to the coordinate-wise median as the uniform merge.
    med = np.median(np.stack([_flat(p) for p in nodes]), axis=0)
    for name in ("anchor (median)", f"anchor (median), cap {cap_factor:g}/n"):
        dist = np.sum((_flat(_np_merge(nodes, np.asarray(rows[name]["weights"]))) - med) ** 2)
        assert dist <= np.sum((_flat(_np_merge(nodes, uniform)) - med) ** 2) * (1 + 1e-5) + 1e-9


# ----------------------------------------------------------------------------- privacy


@pytest.mark.slow
def test_noise_calibration_and_the_two_accountants():
    q, rounds = effective_sampling_rate(0.1), 50
    nz = privacy_quality.noise_for(8.0, q, rounds)
    # RDP calibration is tight (rtol 1e-3 on z) and never over budget.
    assert 8.0 * 0.99 <= nz["rdp_epsilon"] <= 8.0
    assert nz["rdp_epsilon"] == pytest.approx(rdp_epsilon(nz["z"], q, rounds, 1e-5), rel=1e-12)
    # PLD is the tighter accountant: same z, smaller epsilon, but within 20 % of RDP here;
    # so PLD allows a smaller z for the same target.
    assert 0.8 * nz["rdp_epsilon"] <= nz["pld_epsilon"] <= nz["rdp_epsilon"] * (1 + 1e-3)
    assert nz["z_pld"] <= nz["z"]
    assert privacy_quality.noise_for(math.inf, q, rounds)["z"] == 0.0


def test_iid_clients_partition_the_training_split():
    data = DigitsTask(hidden=()).splits(1, seed=0)
    pool = harness.iid_clients(data, 37, np.random.default_rng(3))
    rows = np.concatenate([pool.index[i, : pool.count[i]] for i in range(37)])
    assert np.array_equal(np.sort(rows), np.arange(len(data.general_groups)))  # disjoint and covering
    assert pool.count.max() - pool.count.min() <= 1


@pytest.mark.slow
def test_dp_round_loop_spends_exactly_the_calibrated_budget_and_refuses_one_more_round():
    q, rounds = effective_sampling_rate(0.5), 4
    z = privacy_quality.noise_for(8.0, q, rounds)["z"]
    kw = dict(clients=40, q=q, clip=1.0, server="sgd", server_lr=1.0, local_steps=3, local_lr=0.3)
    out = privacy_quality.train_dp(8.0, z, 0, rounds=rounds, **kw)
    assert out["ledger_rounds"] == rounds
    assert out["ledger_epsilon"] == pytest.approx(rdp_epsilon(z, q, rounds, 1e-5), rel=1e-9)
    assert out["ledger_epsilon"] <= 8.0
    with pytest.raises(PrivacyBudgetExceeded):
        privacy_quality.train_dp(8.0, z, 0, rounds=rounds + 1, **kw)


@pytest.mark.slow
def test_non_private_fedavg_loop_learns_digits():
    out = privacy_quality.train_dp(
        math.inf,
        0.0,
        0,
        clients=40,
        q=1.0,
        rounds=5,
        clip=1.0,
        server="sgd",
        server_lr=1.0,
        local_steps=3,
        local_lr=0.3,
    )
    assert math.isinf(out["ledger_epsilon"])
    assert out["test_acc"] > 0.6  # chance is 0.1; the benchmark's loop trains the model
