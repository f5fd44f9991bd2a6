"""The ablation benchmark's helpers at a tiny size: barriers, nodes alone, centralised training, configs."""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # benchmarks/ beside tests/

from benchmarks.quality import ablations  # noqa: E402


@dataclasses.dataclass(frozen=True)
class SoftmaxRegression:
    """A tiny task with just what the helpers use: loss and metrics of a softmax regression."""

    def loss(self, params, batch, key=None):
        logits = batch["x"] @ params["w"] + params["b"]
        logp = jax.nn.log_softmax(logits, axis=-1)
        return -jnp.mean(jnp.take_along_axis(logp, batch["y"][:, None], axis=-1))

    def metrics(self, params, batch):
        logits = batch["x"] @ params["w"] + params["b"]
        return {"loss": self.loss(params, batch), "accuracy": jnp.mean(jnp.argmax(logits, -1) == batch["y"])}


def _numpy_loss(w: np.ndarray, b: np.ndarray, x: np.ndarray, y: np.ndarray) -> float:
    z = x @ w + b
    z = z - z.max(axis=1, keepdims=True)
    logp = z - np.log(np.exp(z).sum(axis=1, keepdims=True))
    return float(-logp[np.arange(len(y)), y].mean())


def _data(seed: int = 0, rows: int = 40, d: int = 5, c: int = 3):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(rows, d)).astype(np.float32)
    y = rng.integers(0, c, size=rows).astype(np.int32)
    return {"x": x, "y": y}


def _stacked(seed: int, k: int, d: int = 5, c: int = 3, scale: float = 3.0):
    rng = np.random.default_rng(seed)
    return {
        "w": jnp.asarray(scale * rng.normal(size=(k, d, c)), jnp.float32),
        "b": jnp.asarray(rng.normal(size=(k, c)), jnp.float32),
    }


@pytest.mark.slow  # compiles small jitted programs: seconds each on a shared machine
def test_barrier_of_a_node_with_itself_is_zero_and_pairs_match_a_float64_reference():
    task, batch = SoftmaxRegression(), _data()
    nodes = _stacked(1, 3)
    same = jax.tree.map(lambda x: jnp.stack([x[0], x[0]]), nodes)
    one = jax.tree.map(lambda x: x[0], nodes)
    b = ablations.barriers(task, same, one, batch)
    np.testing.assert_allclose(b["pairwise"], 0.0, atol=1e-6)
    np.testing.assert_allclose(b["to_consensus"], 0.0, atol=1e-6)
    assert b["pairwise_distance"] == 0.0 and abs(b["pairwise_midpoint_gap"]) < 1e-6

    # Three distinct nodes: barrier, midpoint gap and distance against numpy in float64.
    b = ablations.barriers(task, nodes, one, batch, num_points=9)
    w, bias = np.asarray(nodes["w"], np.float64), np.asarray(nodes["b"], np.float64)
    x, y = batch["x"].astype(np.float64), batch["y"]
    alphas = np.linspace(0.0, 1.0, 9)
    bars, mids, dists = [], [], []
    for i in range(3):
        for j in range(3):
            if i == j:
                continue
            path = [
                _numpy_loss((1 - a) * w[i] + a * w[j], (1 - a) * bias[i] + a * bias[j], x, y) for a in alphas
            ]
            gaps = np.asarray(path) - ((1 - alphas) * path[0] + alphas * path[-1])
            bars.append(gaps.max())
            mids.append(gaps[4])
            dists.append(np.sqrt(((w[i] - w[j]) ** 2).sum() + ((bias[i] - bias[j]) ** 2).sum()))
    assert b["pairwise_mean"] == pytest.approx(np.mean(bars), abs=1e-4)
    assert b["pairwise_midpoint_gap"] == pytest.approx(np.mean(mids), abs=1e-4)
    assert b["pairwise_distance"] == pytest.approx(np.mean(dists), rel=1e-5)
    assert b["to_consensus"][0] == pytest.approx(0.0, abs=1e-6)  # node 0 is the anchor
    with pytest.raises(ValueError, match="odd"):
        ablations.barriers(task, nodes, one, batch, num_points=4)


def _shards():
    """Three shards of 7, 12 and 3 valid rows, zero padded to 12."""
    full = _data(seed=2, rows=22)
    counts = np.asarray([7, 12, 3])
    cuts = np.cumsum([0, *counts])
    padded = {
        k: np.stack(
            [
                np.pad(v[a:e], [(0, 12 - (e - a))] + [(0, 0)] * (v.ndim - 1))
                for a, e in zip(cuts, cuts[1:], strict=False)
            ]
        )
        for k, v in full.items()
    }
    return full, padded, counts


@pytest.mark.slow  # compiles small jitted programs: seconds each on a shared machine
def test_nodes_alone_ignore_padding_and_each_other():
    task = SoftmaxRegression()
    _, padded, counts = _shards()
    init = jax.tree.map(lambda x: x[0], _stacked(3, 1, scale=0.1))
    key = jax.random.key(5)
    kw = {"steps": 6, "batch_size": 4, "learning_rate": 0.05}
    together = ablations.train_alone(task, init, padded, counts, key, **kw)
    for i, count in enumerate(counts):
        # The documented contract, written out step by step on node i's valid rows only (no padding,
        # no vmap, no scan): step s draws from fold_in(fold_in(key, i), s).
        rows = {k: jnp.asarray(v[i, :count]) for k, v in padded.items()}
        tx = optax.adam(kw["learning_rate"])
        p = init
        with jax.numpy_dtype_promotion("standard"):
            opt = tx.init(p)
            for s in range(kw["steps"]):
                idx = jax.random.randint(jax.random.fold_in(jax.random.fold_in(key, i), s), (4,), 0, count)
                grads = jax.grad(task.loss)(p, {k: v[idx] for k, v in rows.items()})
                updates, opt = tx.update(grads, opt, p)
                p = optax.apply_updates(p, updates)
        for a, b in zip(jax.tree.leaves(together), jax.tree.leaves(p), strict=True):
            np.testing.assert_allclose(np.asarray(a[i]), np.asarray(b), rtol=1e-5, atol=1e-6)
    assert not np.allclose(np.asarray(together["w"][0]), np.asarray(together["w"][1]))
    with pytest.raises(ValueError, match="at least one row"):
        ablations.train_alone(task, init, padded, np.asarray([7, 0, 3]), key, **kw)


@pytest.mark.slow  # compiles small jitted programs: seconds each on a shared machine
def test_centralized_on_the_union_is_training_on_the_concatenated_rows():
    task = SoftmaxRegression()
    full, padded, counts = _shards()
    init = jax.tree.map(lambda x: x[0], _stacked(4, 1, scale=0.1))
    key = jax.random.key(9)
    kw = {"steps": 5, "batch_size": 6, "learning_rate": 0.05}
    central = ablations.centralized(task, init, padded, counts, [0, 2], key, **kw)
    # Shards 0 and 2 are rows 0:7 and 19:22 of the full data, in node order.
    union = {k: np.concatenate([v[:7], v[19:22]])[None] for k, v in full.items()}
    direct = ablations.train_alone(task, init, union, np.asarray([10]), key, **kw)
    for a, b in zip(jax.tree.leaves(central), jax.tree.leaves(direct), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    with pytest.raises(ValueError, match="at least one node"):
        ablations.centralized(task, init, padded, counts, [], key, **kw)
    # Public rows join the union (after the shards' rows).
    public = {k: v[15:19] for k, v in full.items()}
    central = ablations.centralized(task, init, padded, counts, [0, 2], key, public=public, **kw)
    union = {k: np.concatenate([v[:7], v[19:22], v[15:19]])[None] for k, v in full.items()}
    direct = ablations.train_alone(task, init, union, np.asarray([14]), key, **kw)
    for a, b in zip(jax.tree.leaves(central), jax.tree.leaves(direct), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.parametrize("task", list(ablations.TASKS))
def test_every_ablation_is_a_config_change_of_the_default(task):
    budget = ablations.BUDGETS[task]["quick"]
    base = ablations.build_config(task, budget, 0, [])
    assert (base.rounds, base.nodes.local_steps, base.eval_every) == (*budget, budget[0])
    mixes = ablations.TEXT_MIXES if task == "text" else ablations.STRATEGY_MIXES
    assert ablations.SAME_DATA in mixes and "local" in mixes
    for mix in mixes:
        cfg = ablations.build_config(task, budget, 3, ablations.strategy_overrides(mix, base))
        if mix == "default mix":
            expected = base.nodes.strategy_of()
        elif mix == ablations.FORMER:
            expected = ("hierarchical",) * 2 + ("convexity",) * 2 + ("soup",) * 2 + ("local",) * 2
        else:
            expected = (mix.split(" ")[0].rstrip(","),) * base.nodes.count
        assert cfg.nodes.strategy_of() == expected and cfg.seed == 3
        # Only the union row trains on every node's shard; the warm-start rows say so in their name
        # (the default mix starts as the default does: digits' warm start, scaled to the budget).
        assert (cfg.task.general_pool == "union") == (mix == ablations.UNION)
        warm = mix.endswith("public warm start") or (mix == "default mix" and task != "text")
        assert cfg.nodes.public_warm_start == (ablations.public_steps(base) if warm else 0), mix
    # The warm start's steps: one hierarchical node's general + groups steps over the run.
    frac = base.nodes.options.get("hierarchical", {}).get("fractions", (0.5, 0.25, 0.25))
    steps = base.rounds * sum(int(np.floor(f * base.nodes.local_steps)) for f in frac[:2])
    assert ablations.public_steps(base) == steps
    for merge, overrides in ablations.MERGES.items():
        if task == "text" and merge in ablations.CLASSIFICATION_ONLY:
            continue
        cfg = ablations.build_config(task, budget, 0, [*overrides, *ablations.THREATS["clean"]])
        assert cfg.byzantine.nodes == () and cfg.nodes.strategy_of() == base.nodes.strategy_of()
    with pytest.raises(ValueError, match="unknown strategy mix"):
        ablations.strategy_overrides("greedy", base)


def _part(seeds, mixes, baselines=True, **settings):
    """A result file's skeleton: its settings and one run per (seed, mix) and per seed's baseline."""
    st = {"task": "digits", "quick": False, "rounds": 10, "seeds": seeds, "mixes": mixes, "merges": [],
          "baselines": baselines, "command": "x", **settings}  # fmt: skip
    return {
        "settings": st,
        "strategy_runs": [
            {"seed": s, "alpha": 0.5, "mix": m, "threat": "clean"} for s in seeds for m in mixes
        ],
        "merge_runs": [],
        "baseline_runs": [{"seed": s, "alpha": 0.5} for s in seeds] if baselines else [],
    }


def test_combined_parts_are_other_seeds_or_other_rows_and_never_the_same_run_twice():
    tangent, local = ablations.TANGENT, ablations.SAME_DATA
    # other seeds of the same rows
    st = ablations.unite([_part([0], [local]), _part([1, 2], [local])], ["a", "b"])
    assert st["seeds"] == [0, 1, 2] and st["mixes"] == [local] and st["baselines"]
    # another row of the same seeds, in the benchmark's row order whatever the parts' order
    st = ablations.unite([_part([0, 1], [tangent], baselines=False), _part([0, 1], [local])], ["a", "b"])
    assert st["seeds"] == [0, 1] and st["mixes"] == [local, tangent] and st["baselines"]
    with pytest.raises(ValueError, match=r"b and a both ran strategy \(0, 0.5"):
        ablations.unite([_part([0], [local]), _part([0], [local])], ["a", "b"])
    with pytest.raises(ValueError, match=r"both ran baseline \(0, 0.5\)"):
        ablations.unite([_part([0], [local]), _part([0], [tangent])], ["a", "b"])
    with pytest.raises(ValueError, match=r"b has other settings than a: \['rounds'\]"):
        ablations.unite([_part([0], [local]), _part([1], [local], rounds=5)], ["a", "b"])
