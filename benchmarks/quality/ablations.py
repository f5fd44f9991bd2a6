"""Ablations: what each part of meta-consensus buys (node strategies, merge pipeline, baselines).

Run ``python -m benchmarks ablations [--quick] [--task digits|fashion_mnist|text] [--seeds 0,1,2]``.
Writes benchmarks/results/ablations_<task>.json, .md and .png (``ablations_<task>_quick.*`` with
--quick). Fashion-MNIST needs ``make data``; the text task reads the interpreter's stdlib.

Every system run is the task's default config (digits and Fashion-MNIST: the embedded default of
``meta-consensus run``; text: :data:`TEXT` below, 4 byte-level transformer nodes) at a small round
budget (:data:`BUDGETS`), changed only by the overrides named here, on the same node split
(``task.data_seed`` 0) with the same seeds. Three families of runs:

* **node strategies**, each compared on the same data: every node ``local`` on its private shard
  only; ``local + public warm start`` (the initial consensus first trained on the task's public pool
  for as many steps as one hierarchical node takes on it over the run, then local training: the
  baseline that sees the same data as ``hierarchical``); ``hierarchical`` (the public pool, then the
  node's groups of it, then its shard); ``convexity`` and ``soup`` from the same public warm start;
  the default mix (as ``make run`` runs it); and ``hierarchical`` on the union pool (the public pool
  and every node's shard: centralised data, an upper bound, not a strategy). Dirichlet alpha in
  {0.1, 0.5, 10} (text: its fixed split by module family); with no attacker and with the default's
  attackers. Reported: the consensus's test and held-out accuracy (text: perplexity and next-byte
  accuracy), the honest nodes' test accuracies (mean, spread), loss barriers
  (``strategies.convexity``: the held-out loss above the chord on the straight line) between every
  pair of honest nodes and between each honest node and the final consensus, on the nodes'
  parameters after the last round's training (soup nodes: their last snapshot), and for soup nodes
  the metrics on their own held-out split of the latest snapshot and of the soup they submitted.
* **merge pipeline** (default strategy mix, default alpha): plain mean, convex weights without a
  vote, the vote alone, the vote plus each weight objective, plus node-level DP (nominal noise and
  epsilon = 8), and example-level DP-SGD (``configs/private.toml`` against the same config without
  DP); the Byzantine nodes' total weight in the consensus ("byz weight") and the accuracy.
* **baselines that never see the consensus**: each node trained alone on its own shard for the
  system's whole budget (rounds x local steps, the same Adam, batch and learning rate), and
  centralised training on the public pool and the union of the (honest) nodes' shards (the
  ceiling: the same number of steps with one batch per node of the fleet in each step), and the
  barriers between the independently trained nodes and to their plain average.

The baselines are written here with the task's loss and optax (:func:`train_alone`,
:func:`centralized`), not with the system, so they share no code path with what they check.
"""

from __future__ import annotations

import functools
import json
import math
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from benchmarks import harness
from benchmarks.harness import mean_std
from benchmarks.quality.ablations_report import markdown, plot
from meta_consensus import MetaConsensus, config
from meta_consensus.fleet import make_task
from strategies.convexity import anchor_barriers, pairwise_barriers
from strategies.tasks.base import Task

NAME = "ablations"
PRIVATE_TOML = Path(__file__).resolve().parents[2] / "configs" / "private.toml"
PyTree = Any

# --task -> overrides of the embedded default. The text setting is the rounds benchmark's: 4 nodes
# (one of each strategy), one attacker, a median vote (Multi-Krum needs n > 2f + 2 = 4 nodes).
TEXT = [
    "task.name=text",
    "nodes.count=4",
    "nodes.strategies=['hierarchical', 'convexity', 'soup', 'local']",
    "nodes.options.soup.snapshots=2",
    "nodes.public_warm_start=0",  # text's own mix, as measured before the digits default changed
    "byzantine.nodes=[3]",
    "vote.rule=median",
    "weights.max_examples=32",
    # A smaller corpus sample than the task's default, so that a round costs seconds on 2 cores.
    "task.options={windows_per_node = 256, general_windows = 1024, heldout_windows = 64, test_windows = 128}",
]
TASKS: dict[str, list[str]] = {"digits": [], "fashion_mnist": ["task.name=fashion_mnist"], "text": TEXT}

# Per task: (rounds, local_steps) of every run, full and --quick; alphas; default seeds.
BUDGETS: dict[str, dict[str, Any]] = {
    "digits": {"full": (10, 20), "quick": (4, 10), "alphas": (0.1, 0.5, 10.0), "seeds": (0, 1)},
    "fashion_mnist": {"full": (10, 20), "quick": (4, 10), "alphas": (0.1, 0.5, 10.0), "seeds": (0, 1)},
    # Text is split by module family, not by Dirichlet alpha: one "alpha" (unused by the task).
    "text": {"full": (6, 10), "quick": (3, 8), "alphas": (0.5,), "seeds": (0, 1)},
}
# --quick: the merge variants that show each component once (the full mode runs every one).
QUICK_MERGES = {
    "plain mean (FedAvg)",
    "weights alone (mean vote + mixture NLL)",
    "vote alone",
    "vote + mixture NLL (default)",
    "default + node DP, z = 0.01 (nominal)",
}
QUICK_ALPHAS = (0.5,)

# Every run: no FedAvg twin (the merge ablation has the plain mean as a variant of its own), no
# checkpoints, evaluation only after the last round.
COMMON = ["baseline_fedavg=false", "checkpoint_every=0"]

# Mix -> (the strategy of every node (a name, or a TOML list of one per node), None: the config's
# own mix; start from the public warm start (None: as the config does); extra overrides). The warm
# start (``nodes.public_warm_start``, :func:`public_steps` steps) gives every strategy that cannot
# draw the public pool itself the same public rows the hierarchical nodes draw, so each row
# compares strategies on the same data.
UNION = "hierarchical, union pool (centralised)"
SAME_DATA = "local + public warm start"
TANGENT = "convexity (tangent) + public warm start"
FORMER = "former default mix (2 hierarchical, 2 convexity, 2 soup, 2 local)"
FORMER_MIX = "['hierarchical', 'hierarchical', 'convexity', 'convexity', 'soup', 'soup', 'local', 'local']"
MIXES: dict[str, tuple[str | None, bool | None, tuple[str, ...]]] = {
    "local": ("local", False, ()),
    SAME_DATA: ("local", True, ()),
    "hierarchical": ("hierarchical", False, ()),
    "convexity + public warm start": ("convexity", True, ()),
    "soup + public warm start": ("soup", True, ()),
    TANGENT: ("convexity", True, ("nodes.options.convexity={mode = 'tangent'}",)),
    "default mix": (None, None, ()),
    FORMER: (FORMER_MIX, False, ()),
    UNION: ("hierarchical", False, ("task.general_pool=union",)),
}
STRATEGY_MIXES = tuple(MIXES)
# Text's general pool is fixed by its file roles: no union row there; its 4 nodes have their own mix.
TEXT_MIXES = tuple(m for m in MIXES if m not in (UNION, FORMER))
THREATS: dict[str, list[str]] = {"clean": ["byzantine.nodes=[]"], "attack": []}

# Merge variant -> overrides of the default config (the vote rule stays the task's own).
MERGES: dict[str, list[str]] = {
    "plain mean (FedAvg)": ["vote.rule=mean", "weights.objective=vote"],
    "weights alone (mean vote + mixture NLL)": ["vote.rule=mean", "weights.objective=mixture_nll"],
    "vote alone": ["weights.objective=vote"],
    "vote + uniform": ["weights.objective=uniform"],
    "vote + quadratic": ["weights.objective=quadratic"],
    "vote + anchor": ["weights.objective=anchor"],
    "vote + mixture NLL (default)": ["weights.objective=mixture_nll"],
    "default + node DP, z = 0.01 (nominal)": [
        "dp.enabled=true",
        "dp.clip_norm=1.0",
        "dp.noise_multiplier=0.01",
    ],
    "default + node DP, epsilon = 8": [
        "dp.enabled=true",
        "dp.clip_norm=1.0",
        "dp.noise_multiplier=none",
        "dp.epsilon=8.0",
    ],
}
# Objectives that need a classification task (per-class logits): left out on text.
CLASSIFICATION_ONLY = {"vote + quadratic"}
# Example-level DP-SGD: configs/private.toml against the same file with DP off. Digits and
# Fashion-MNIST only.
EXAMPLE_DP: dict[str, list[str]] = {
    "private.toml without DP": ["dp.enabled=false"],
    "private.toml, example-level DP-SGD, epsilon = 8": [],
}


# ----------------------------------------------------------------------------- configs


def strategy_overrides(mix: str, base: config.Config) -> list[str]:
    """Every node on one strategy, or the task's default mix (and the mix's own overrides)."""
    if mix not in MIXES:
        raise ValueError(f"unknown strategy mix {mix!r}; valid: {list(MIXES)}")
    strategy, warm, extra = MIXES[mix]
    out = list(extra)
    if warm is not None:  # None: the config's own warm start (build_config scales it to the budget)
        out.append(f"nodes.public_warm_start={public_steps(base) if warm else 0}")
    if strategy is None:
        return out
    out = [f"nodes.strategies={strategy}", *out]
    if strategy == "soup" and base.nodes.options.get("soup"):
        out.append(f"nodes.options.soup.snapshots={base.nodes.options['soup']['snapshots']}")
    return out


def public_steps(cfg: config.Config) -> int:
    """The steps one hierarchical node of ``cfg`` takes on the public pool over the run."""
    from strategies.node import build_strategy

    h = build_strategy("hierarchical", cfg.nodes.options.get("hierarchical", {}))
    general, groups, _ = h.settings(cfg.nodes.local_steps, cfg.nodes.learning_rate).level_steps
    return int(cfg.rounds * (general + groups))


def build_config(
    task: str, budget: tuple[int, int], seed: int, extra: Sequence[str], *, path: Path | None = None
) -> config.Config:
    """The task's default (or the file at ``path``) at the budget, with ``extra`` overrides."""
    rounds, steps = budget
    task_ov = TASKS[task] if path is None else ([] if task == "digits" else ["task.name=fashion_mnist"])
    overrides = [
        *COMMON,
        *task_ov,
        f"seed={seed}",
        f"rounds={rounds}",
        f"eval_every={rounds}",
        f"nodes.local_steps={steps}",
        *extra,
    ]
    cfg = config.load(path, overrides)
    if cfg.nodes.public_warm_start > 0 and not any(o.startswith("nodes.public_warm_start=") for o in extra):
        # The default's warm start is one hierarchical node's public-pool steps over its run: the
        # same rule at this budget.
        cfg = config.load(path, [*overrides, f"nodes.public_warm_start={public_steps(cfg)}"])
    return cfg


# ----------------------------------------------------------------------------- barriers


@functools.cache
def barrier_loss(task: Task):
    """``loss(params, batch)`` of ``task`` as one function object per task, so the barrier kernels'
    compiled code (keyed on the loss function) is reused across runs."""

    def loss(params: PyTree, batch: Mapping[str, Any]) -> jax.Array:
        return task.loss(params, batch)

    return loss


def take_rows(stacked: PyTree, rows: np.ndarray) -> PyTree:
    return jax.tree.map(lambda x: x[jnp.asarray(rows)], stacked)


def barriers(
    task: Task, stacked: PyTree, consensus: PyTree, batch: Mapping[str, Any], num_points: int = 9
) -> dict[str, Any]:
    """Loss barriers on ``batch`` between k stacked nodes and from the consensus to each node.

    Returns host arrays ``pairwise`` (k, k) and ``to_consensus`` (k,) (the barrier: the largest
    loss above the chord, >= 0), their means (over distinct pairs), the mean **midpoint gap** of
    each (the loss at alpha = 1/2 minus the chord's: negative when the average of the two is
    better than their mean loss, i.e. merging gains) and the mean pairwise L2 distance.
    """
    if num_points % 2 != 1:
        raise ValueError(f"barriers: num_points must be odd (a point at alpha = 1/2), got {num_points}")
    loss = barrier_loss(task)
    pair_report = pairwise_barriers(loss, stacked, batch, num_points)
    anchor_report = anchor_barriers(loss, stacked, consensus, batch, num_points)
    pair = np.asarray(pair_report.barrier, np.float64)
    anchor = np.asarray(anchor_report.barrier, np.float64)
    mid = num_points // 2
    pair_mid = np.asarray(pair_report.gaps, np.float64)[..., mid]
    k = pair.shape[0]
    off = ~np.eye(k, dtype=bool)
    flat = np.concatenate([np.asarray(x, np.float64).reshape(k, -1) for x in jax.tree.leaves(stacked)], 1)
    dist = np.sqrt(np.maximum(((flat[:, None, :] - flat[None, :, :]) ** 2).sum(-1), 0.0))
    return {
        "pairwise": pair,
        "to_consensus": anchor,
        "pairwise_mean": float(pair[off].mean()) if k > 1 else 0.0,
        "to_consensus_mean": float(anchor.mean()),
        "pairwise_midpoint_gap": float(pair_mid[off].mean()) if k > 1 else 0.0,
        "to_consensus_midpoint_gap": float(np.asarray(anchor_report.gaps, np.float64)[:, mid].mean()),
        "pairwise_distance": float(dist[off].mean()) if k > 1 else 0.0,
    }


# ----------------------------------------------------------------------------- baselines


@functools.partial(jax.jit, static_argnames=("task", "steps", "batch_size", "learning_rate"))
def _train_stacked(task, params, data, counts, keys, *, steps, batch_size, learning_rate):
    tx = optax.adam(learning_rate)

    def one(rows: Mapping[str, jax.Array], count: jax.Array, key: jax.Array) -> PyTree:
        def step(carry, s):
            p, opt = carry
            # Uniform rows of this shard's valid prefix: the padding is never drawn.
            idx = jax.random.randint(jax.random.fold_in(key, s), (batch_size,), 0, count)
            grads = jax.grad(task.loss)(p, {k: v[idx] for k, v in rows.items()})
            # optax mixes Python floats with int32 step counts (Adam's bias correction); the tests run
            # under strict promotion, as the package's trainer does for its own optax calls.
            with jax.numpy_dtype_promotion("standard"):
                updates, opt = tx.update(grads, opt, p)
            return (optax.apply_updates(p, updates), opt), None

        with jax.numpy_dtype_promotion("standard"):
            opt0 = tx.init(params)
        (p, _), _ = jax.lax.scan(step, (params, opt0), jnp.arange(steps))
        return p

    return jax.vmap(one)(data, counts, keys)


def train_alone(
    task: Task,
    params: PyTree,
    data: Mapping[str, np.ndarray],
    counts: np.ndarray,
    key: jax.Array,
    *,
    steps: int,
    batch_size: int,
    learning_rate: float,
) -> PyTree:
    """Each of n shards trains its own copy of ``params`` with Adam, never communicating.

    Args:
      data: dict of (n, m, ...) arrays, shard i's valid rows first (zero padded after ``counts[i]``).
      counts: (n,) valid rows per shard (>= 1).
      key: one key; shard i draws its step-s batch from ``fold_in(fold_in(key, i), s)``.
    Returns:
      The n trained trees, stacked on a leading axis.
    """
    counts = np.asarray(counts)
    n = counts.shape[0]
    if any(np.shape(v)[0] != n for v in data.values()):
        raise ValueError(f"train_alone: every data array needs {n} shards on its leading axis")
    if counts.min(initial=1) < 1:
        raise ValueError(f"train_alone: every shard needs at least one row, got counts {counts.tolist()}")
    if steps < 1 or batch_size < 1:
        raise ValueError(f"train_alone: steps and batch_size must be >= 1, got {steps}, {batch_size}")
    keys = jax.vmap(lambda i: jax.random.fold_in(key, i))(jnp.arange(n))
    return _train_stacked(
        task,
        params,
        {k: jnp.asarray(v) for k, v in data.items()},
        jnp.asarray(counts, jnp.int32),
        keys,
        steps=int(steps),
        batch_size=int(batch_size),
        learning_rate=float(learning_rate),
    )


def union_of_shards(data: Mapping[str, np.ndarray], counts: np.ndarray, nodes: Sequence[int]):
    """The valid rows of the chosen shards, concatenated in node order: a (1, m, ...) data dict and count."""
    rows = {k: np.concatenate([v[i, : counts[i]] for i in nodes], 0)[None] for k, v in data.items()}
    return rows, np.asarray([sum(int(counts[i]) for i in nodes)])


def centralized(
    task: Task,
    params: PyTree,
    data: Mapping[str, np.ndarray],
    counts: np.ndarray,
    nodes: Sequence[int],
    key: jax.Array,
    *,
    steps: int,
    batch_size: int,
    learning_rate: float,
    public: Mapping[str, np.ndarray] | None = None,
) -> PyTree:
    """One model trained on the union of the chosen shards (the ceiling of the merged models).

    ``public``: rows every node could also draw (the task's public pool), added to the union.
    """
    if not len(nodes):
        raise ValueError("centralized: needs at least one node's shard")
    rows, count = union_of_shards(data, counts, nodes)
    if public is not None:
        extra = len(next(iter(public.values())))
        rows = {k: np.concatenate([v[0], np.asarray(public[k])], 0)[None] for k, v in rows.items()}
        count = count + extra
    stacked = train_alone(
        task, params, rows, count, key, steps=steps, batch_size=batch_size, learning_rate=learning_rate
    )
    return take_rows(stacked, np.asarray([0]))


@functools.cache
def _metrics(task: Task):
    return jax.jit(jax.vmap(task.metrics, in_axes=(0, None)))


def evaluate_stacked(task: Task, stacked: PyTree, batch: Mapping[str, Any]) -> dict[str, np.ndarray]:
    """Each stacked tree's metrics on ``batch`` (host float64 arrays)."""
    return {k: np.asarray(v, np.float64) for k, v in _metrics(task)(stacked, batch).items()}


# ----------------------------------------------------------------------------- runs


def honest(cfg: config.Config) -> np.ndarray:
    """Indices of the nodes that are not Byzantine."""
    return np.setdiff1d(np.arange(cfg.nodes.count), np.asarray(cfg.byzantine.nodes, np.int64))


def system_run(cfg: config.Config, *, with_barriers: bool, barrier_rows: int) -> dict[str, Any]:
    """Train one config; the consensus's and the honest nodes' test numbers (and barriers)."""
    t0 = time.perf_counter()
    mc = MetaConsensus(cfg, write=False, progress=False)
    result = mc.train()
    ok = [i for i in result.history if i.ok]
    last = result.history[-1]
    fleet = mc.coordinator.fleet
    good = honest(cfg)
    bad = np.setdiff1d(np.arange(cfg.nodes.count), good)
    task = fleet.task
    test = evaluate_stacked(task, jax.tree.map(lambda x: x[None], result.consensus_params), fleet.data.test)
    nodes = evaluate_stacked(task, take_rows(result.state.nodes.params, good), fleet.data.test)
    held_out = evaluate_stacked(
        task, jax.tree.map(lambda x: x[None], result.consensus_params), fleet.data.heldout
    )
    # Soup nodes, last round: their own held-out split's metrics of the latest snapshot and the soup.
    soups = fleet.soup_log[-1] if fleet.soup_log else {}
    honest_soups = {i: v for i, v in soups.items() if i in set(good.tolist())}
    out: dict[str, Any] = {
        "consensus_accuracy": float(test["accuracy"][0]),
        "consensus_loss": float(test["loss"][0]),
        "consensus_heldout_accuracy": float(held_out["accuracy"][0]),
        "soup_latest_accuracy": [v["latest"]["accuracy"] for v in honest_soups.values()],
        "soup_accuracy": [v["soup"]["accuracy"] for v in honest_soups.values()],
        "soup_latest_loss": [v["latest"]["loss"] for v in honest_soups.values()],
        "soup_loss": [v["soup"]["loss"] for v in honest_soups.values()],
        # Every round and soup node: the soup's own held-out accuracy minus the latest snapshot's.
        "soup_gain_min": min(
            (v["soup"]["accuracy"] - v["latest"]["accuracy"] for log in fleet.soup_log for v in log.values()),
            default=math.nan,
        ),
        "node_accuracy": nodes["accuracy"].tolist(),
        "node_loss": nodes["loss"].tolist(),
        "node_strategies": [cfg.nodes.strategy_of()[i] for i in good],
        "byzantine_weight": (
            float(np.mean([np.sum(np.asarray(i.weights)[bad]) for i in ok])) if len(bad) and ok else 0.0
        ),
        "failed_rounds": int(sum(not i.ok for i in result.history)),
        "last_round_ok": bool(last.ok),
        "epsilon": float(last.epsilon) if cfg.dp.enabled else math.inf,
    }
    if with_barriers:
        held = {k: v[:barrier_rows] for k, v in fleet.data.heldout.items()}
        b = barriers(task, take_rows(result.state.nodes.params, good), result.consensus_params, held)
        out.update(
            pairwise_barrier=b["pairwise"].tolist(),
            to_consensus_barrier=b["to_consensus"].tolist(),
            pairwise_barrier_mean=b["pairwise_mean"],
            to_consensus_barrier_mean=b["to_consensus_mean"],
            pairwise_midpoint_gap=b["pairwise_midpoint_gap"],
            to_consensus_midpoint_gap=b["to_consensus_midpoint_gap"],
            pairwise_distance=b["pairwise_distance"],
        )
    out["seconds"] = time.perf_counter() - t0
    return out


def baseline_runs(
    task_name: str, budget: tuple[int, int], seed: int, alpha: float, barrier_rows: int
) -> dict[str, Any]:
    """Independently trained nodes (their accuracies, and the barriers between them and to their
    plain average) and centralised training, for one alpha and seed."""
    t0 = time.perf_counter()
    cfg = build_config(task_name, budget, seed, [f"task.alpha={alpha}"])
    task = make_task(cfg)
    data = task.splits(cfg.nodes.count, seed=cfg.task.data_seed, alpha=cfg.task.alpha)
    rounds, steps = budget
    total = rounds * steps
    # The system's initial consensus: the first half of the root key (Coordinator.init).
    params = task.init(jax.random.split(jax.random.key(seed))[0])
    key = jax.random.fold_in(jax.random.key(seed), 7)
    n = cfg.nodes.count
    lr, bs = cfg.nodes.learning_rate, cfg.nodes.batch_size
    alone = train_alone(
        task, params, data.train, data.train_count, key, steps=total, batch_size=bs, learning_rate=lr
    )
    alone_acc = evaluate_stacked(task, alone, data.test)
    attacked = honest(build_config(task_name, budget, seed, []))
    out: dict[str, Any] = {
        "alpha": alpha,
        "seed": seed,
        "alone_accuracy": alone_acc["accuracy"].tolist(),
        "alone_loss": alone_acc["loss"].tolist(),
        "steps": total,
    }
    held = {k: v[:barrier_rows] for k, v in data.heldout.items()}
    average = jax.tree.map(lambda x: jnp.mean(x, 0), alone)
    b = barriers(task, alone, average, held)
    averaged = evaluate_stacked(task, jax.tree.map(lambda x: x[None], average), data.test)
    out["alone_average_accuracy"] = float(averaged["accuracy"][0])
    out.update({f"alone_{k}": v for k, v in b.items() if not isinstance(v, np.ndarray)})
    # One batch per node of the whole fleet in every step (the same compiled program for both unions).
    for label, nodes in (("all", np.arange(n)), ("honest", attacked)):
        central = centralized(
            task,
            params,
            data.train,
            data.train_count,
            nodes.tolist(),
            key,
            steps=total,
            batch_size=bs * n,
            learning_rate=lr,
            public=data.general if data.general_pool == "public" and len(data.general_groups) else None,
        )
        m = evaluate_stacked(task, central, data.test)
        out[f"central_{label}_accuracy"] = float(m["accuracy"][0])
        out[f"central_{label}_loss"] = float(m["loss"][0])
    out["seconds"] = time.perf_counter() - t0
    return out


# ----------------------------------------------------------------------------- summaries


def _values(runs: Sequence[Mapping[str, Any]], field: str, **where: Any) -> list[float]:
    """``field`` of the runs matching ``where``, in seed order."""
    chosen = [r for r in runs if all(r.get(k) == v for k, v in where.items())]
    return [float(r[field]) for r in sorted(chosen, key=lambda r: r["seed"])]


def perplexity(loss: float) -> float:
    return float(math.exp(loss)) if loss < 700 else math.inf


def summarize(res: Mapping[str, Any]) -> dict[str, Any]:
    """Per setting: every reported number over seeds (values, mean, std)."""
    st = res["settings"]
    runs = res["strategy_runs"]
    out: dict[str, Any] = {"strategies": {}, "merges": {}, "baselines": {}, "by_node_strategy": {}}
    fields = (
        "consensus_accuracy",
        "consensus_heldout_accuracy",
        "soup_latest_accuracy_mean",
        "soup_accuracy_mean",
        "soup_latest_loss_mean",
        "soup_loss_mean",
        "soup_gain_min",
        "consensus_perplexity",
        "node_accuracy_mean",
        "node_accuracy_spread",
        "node_accuracy_best",
        "pairwise_barrier_mean",
        "to_consensus_barrier_mean",
        "pairwise_midpoint_gap",
        "to_consensus_midpoint_gap",
        "pairwise_distance",
        "byzantine_weight",
    )
    for mix in st["mixes"]:
        for alpha in st["alphas"]:
            for threat in st["threats"]:
                key = f"{mix} | alpha={alpha:g} | {threat}"
                out["strategies"][key] = {
                    f: mean_std(_values(runs, f, mix=mix, alpha=alpha, threat=threat)) for f in fields
                }
    # Within the default mix: each strategy's barrier to the consensus (every honest node of it).
    for alpha in st["alphas"]:
        for threat in st["threats"]:
            per: dict[str, list[float]] = {}
            for r in runs:
                if (r["mix"], r["alpha"], r["threat"]) == ("default mix", alpha, threat):
                    for s, b, a in zip(
                        r["node_strategies"], r["to_consensus_barrier"], r["node_accuracy"], strict=True
                    ):
                        per.setdefault(s, []).append(b)
                        per.setdefault(f"{s} accuracy", []).append(a)
            out["by_node_strategy"][f"alpha={alpha:g} | {threat}"] = {s: mean_std(v) for s, v in per.items()}
    for merge in st["merges"]:
        for threat in st["threats"]:
            vals = {
                f: mean_std(_values(res["merge_runs"], f, merge=merge, threat=threat))
                for f in ("consensus_accuracy", "consensus_perplexity", "byzantine_weight", "epsilon")
            }
            vals["failed_rounds"] = sum(
                r["failed_rounds"] for r in res["merge_runs"] if (r["merge"], r["threat"]) == (merge, threat)
            )
            out["merges"][f"{merge} | {threat}"] = vals
    for alpha in st["alphas"]:
        b = [r for r in res["baseline_runs"] if r["alpha"] == alpha]
        if not b:  # a part run with --no-baselines
            continue
        attacked = st["honest_under_attack"]
        out["baselines"][f"alpha={alpha:g}"] = {
            "alone_mean": mean_std([float(np.mean(r["alone_accuracy"])) for r in b]),
            "alone_best": mean_std([float(np.max(r["alone_accuracy"])) for r in b]),
            "alone_honest_best": mean_std(
                [float(np.max(np.asarray(r["alone_accuracy"])[attacked])) for r in b]
            ),
            "alone_mean_perplexity": mean_std([float(np.mean(np.exp(r["alone_loss"]))) for r in b]),
            "central_all": mean_std([r["central_all_accuracy"] for r in b]),
            "central_honest": mean_std([r["central_honest_accuracy"] for r in b]),
            "central_all_perplexity": mean_std([perplexity(r["central_all_loss"]) for r in b]),
            "alone_average": mean_std([r["alone_average_accuracy"] for r in b]),
            **{
                f: mean_std([r[f"alone_{f}"] for r in b])
                for f in ("pairwise_mean", "pairwise_midpoint_gap", "to_consensus_mean", "pairwise_distance")
            },
        }
    return out


# ----------------------------------------------------------------------------- main


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = harness.parser(__doc__, "one seed, alpha 0.5 only, a few rounds (under two minutes on digits)")
    parser.add_argument(
        "--task", default="digits", choices=list(TASKS), help="fashion_mnist needs `make data`"
    )
    parser.add_argument("--seeds", default=None, help="comma-separated root seeds (default: the task's)")
    parser.add_argument(
        "--mixes",
        default=None,
        help="';'-separated strategy mixes to run (default: all of the task's; see MIXES)",
    )
    parser.add_argument(
        "--no-merges",
        action="store_true",
        help="skip the merge-pipeline runs (strategy rows and baselines only)",
    )
    parser.add_argument(
        "--no-baselines",
        action="store_true",
        help="skip the baselines that never see the consensus (e.g. one new strategy row, --combine'd "
        "with a full run of the same seeds)",
    )
    parser.add_argument(
        "--alphas", default=None, help="comma-separated Dirichlet alphas (default: the task's)"
    )
    parser.add_argument(
        "--threats",
        default=None,
        help=f"comma-separated threats of the strategy rows (default: {list(THREATS)})",
    )
    parser.add_argument(
        "--combine",
        nargs="+",
        type=Path,
        default=None,
        metavar="JSON",
        help="train nothing: report the runs of these result files together (the same --task and "
        "--quick, other seeds each, e.g. seeds run in parallel processes with their own --out), "
        "written as this --task's result files",
    )
    args = harness.parse(parser, argv)
    if args.combine:
        return combine(args.combine, args.task, args.quick, parser)
    budget_cfg = BUDGETS[args.task]
    budget = budget_cfg["quick" if args.quick else "full"]
    try:
        seeds = (
            [int(s) for s in args.seeds.split(",")]
            if args.seeds
            else [0]
            if args.quick
            else list(budget_cfg["seeds"])
        )
    except ValueError:
        parser.error(f"--seeds must be comma-separated integers, got {args.seeds!r}")
    text = args.task == "text"
    mixes = list(TEXT_MIXES if text else STRATEGY_MIXES)
    if args.mixes:
        mixes = [m.strip() for m in args.mixes.split(";")]
        unknown = [m for m in mixes if m not in MIXES]
        if unknown:
            parser.error(f"--mixes: unknown {unknown}; valid: {list(MIXES)}")
    alphas = list(budget_cfg["alphas"] if not args.quick or text else QUICK_ALPHAS)
    threats = dict(THREATS)
    try:
        if args.alphas:
            alphas = [float(a) for a in args.alphas.split(",")]
    except ValueError:
        parser.error(f"--alphas must be comma-separated numbers, got {args.alphas!r}")
    if args.threats:
        threats = {t: THREATS[t] for t in args.threats.split(",") if t in THREATS}
        if len(threats) != len(args.threats.split(",")):
            parser.error(f"--threats: choose from {list(THREATS)}, got {args.threats!r}")
    base = build_config(args.task, budget, 0, [])
    merges = [
        m for m in MERGES if not (text and m in CLASSIFICATION_ONLY) and (not args.quick or m in QUICK_MERGES)
    ]
    example = not text and not args.quick  # DP-SGD rows: the full mode of the image tasks
    name = f"{NAME}_{args.task}"
    settings = {
        "name": name,
        "command": " ".join(["python -m benchmarks ablations", *(sys.argv[1:] if argv is None else argv)]),
        "task": args.task,
        "quick": args.quick,
        "seeds": seeds,
        "rounds": budget[0],
        "local_steps": budget[1],
        "alphas": alphas,
        "default_alpha": base.task.alpha,
        "nodes": base.nodes.count,
        "default_strategies": list(base.nodes.strategy_of()),
        "byzantine_nodes": list(base.byzantine.nodes),
        "attack": f"{base.byzantine.attack} {dict(base.byzantine.options)}",
        "vote": f"{base.vote.rule}, f = {base.vote.f(base.nodes.count)}",
        "weights": f"{base.weights.objective}, max_weight = {base.weights.max_weight}",
        "mixes": mixes,
        "public_warm_start_steps": public_steps(base),
        "threats": list(threats),
        "merges": [] if args.no_merges else merges + (list(EXAMPLE_DP) if example else []),
        "baselines": not args.no_baselines,
        "honest_under_attack": honest(base).tolist(),
        "overrides": {"task": TASKS[args.task], "common": COMMON, "threats": THREATS, "merges": MERGES},
    }
    t0 = time.perf_counter()
    strategy_runs, merge_runs, baseline_list, done = [], [], [], []
    rows = max(8, 64 if text else 512)
    for seed in seeds:
        for alpha in alphas:
            for mix in mixes:
                for threat, tov in threats.items():
                    extra = [f"task.alpha={alpha}", *strategy_overrides(mix, base), *tov]
                    r = system_run(
                        build_config(args.task, budget, seed, extra),
                        with_barriers=True,
                        barrier_rows=rows,
                    )
                    r.update(seed=seed, alpha=alpha, mix=mix, threat=threat)
                    strategy_runs.append(r)
                    print(
                        f"seed {seed} alpha {alpha:g} {mix:12s} {threat:6s}: "
                        f"consensus {r['consensus_accuracy']:.3f} "
                        f"nodes {np.mean(r['node_accuracy']):.3f} barrier {r['pairwise_barrier_mean']:.4f} "
                        f"({r['seconds']:.1f} s)",
                        flush=True,
                    )
        for merge in settings["merges"]:
            for threat, tov in THREATS.items():
                if merge in EXAMPLE_DP:
                    cfg = build_config(args.task, budget, seed, [*tov, *EXAMPLE_DP[merge]], path=PRIVATE_TOML)
                else:
                    cfg = build_config(args.task, budget, seed, [*MERGES[merge], *tov])
                r = system_run(cfg, with_barriers=False, barrier_rows=rows)
                r.update(seed=seed, merge=merge, threat=threat)
                merge_runs.append(r)
                print(
                    f"seed {seed} {merge:45s} {threat:6s}: consensus {r['consensus_accuracy']:.3f} "
                    f"byz weight {r['byzantine_weight']:.3f} ({r['seconds']:.1f} s)",
                    flush=True,
                )
        for alpha in [] if args.no_baselines else alphas:
            r = baseline_runs(args.task, budget, seed, alpha, rows)
            baseline_list.append(r)
            print(
                f"seed {seed} alpha {alpha:g} baselines: alone {np.mean(r['alone_accuracy']):.3f} "
                f"central {r['central_all_accuracy']:.3f} ({r['seconds']:.1f} s)",
                flush=True,
            )
        done.append(seed)
        # The result files after every seed: a run cut short keeps the seeds it finished.
        res = report(
            {**settings, "seeds": list(done), "seeds_planned": seeds},
            strategy_runs,
            merge_runs,
            baseline_list,
            time.perf_counter() - t0,
        )
    print(res["markdown"])
    return res


def _decode(x: Any) -> Any:
    """The result JSON's non-finite floats ("inf", "-inf", "nan" strings) back to floats."""
    if isinstance(x, dict):
        return {k: _decode(v) for k, v in x.items()}
    if isinstance(x, list):
        return [_decode(v) for v in x]
    return float(x) if x in ("inf", "-inf", "nan") else x


# Settings that may differ between the parts of a --combine (everything else must match); parts
# may also run other strategy mixes, merges or baselines (PER_ROWS) of the same seeds.
PER_PART = ("seeds", "seeds_planned", "command", "parts")
PER_ROWS = ("mixes", "merges", "baselines")


def _run_key(kind: str, r: dict[str, Any]) -> tuple[Any, ...]:
    """What identifies a run of ``kind``: two parts may not both have it."""
    fields = {"strategy_runs": ("seed", "alpha", "mix", "threat"), "merge_runs": ("seed", "merge", "threat"),
              "baseline_runs": ("seed", "alpha")}[kind]  # fmt: skip
    return tuple(r[f] for f in fields)


def unite(parts: Sequence[Mapping[str, Any]], names: Sequence[str]) -> dict[str, Any]:
    """The settings of one report from result parts (``names`` name them in errors).

    The parts are other seeds of the same rows, or other rows (strategy mixes, merges,
    baselines) of the same seeds: everything but :data:`PER_PART` and :data:`PER_ROWS` must
    match, and a run that two parts both have is refused.

    Raises:
      ValueError: naming the part whose settings differ, or the run two parts share.
    """
    ref = {k: v for k, v in parts[0]["settings"].items() if k not in PER_PART + PER_ROWS}
    seen: dict[tuple[Any, ...], str] = {}
    for name, part in zip(names, parts, strict=True):
        other = {k: v for k, v in part["settings"].items() if k not in PER_PART + PER_ROWS}
        if other != ref:
            diff = sorted(k for k in ref.keys() | other.keys() if ref.get(k) != other.get(k))
            raise ValueError(f"{name} has other settings than {names[0]}: {diff}")
        for kind in ("strategy_runs", "merge_runs", "baseline_runs"):
            for r in part[kind]:
                key = (kind, *_run_key(kind, r))
                if key in seen:
                    raise ValueError(f"{name} and {seen[key]} both ran {kind[:-5]} {key[1:]}")
                seen[key] = name
    ran = {k: {x for part in parts for x in part["settings"][k]} for k in ("mixes", "merges")}
    return {
        **ref,
        "mixes": [m for m in MIXES if m in ran["mixes"]],
        "merges": [m for m in [*MERGES, *EXAMPLE_DP] if m in ran["merges"]],
        "baselines": any(part["settings"].get("baselines", True) for part in parts),
        "seeds": sorted({s for part in parts for s in part["settings"]["seeds"]}),
    }


def combine(paths: Sequence[Path], task: str, quick: bool, parser: Any) -> dict[str, Any]:
    """One report from the runs of several result files of the same task (see :func:`unite`)."""
    parts = [_decode(json.loads(Path(p).read_text())) for p in paths]
    first = parts[0]["settings"]
    if first.get("task") != task or first.get("quick") != quick:
        parser.error(f"--combine: {paths[0]} is task {first.get('task')!r} quick={first.get('quick')}")
    try:
        united = unite(parts, [str(p) for p in paths])
    except ValueError as e:
        parser.error(f"--combine: {e}")
    pieces = [
        {
            "command": part["settings"].get("command", "?"),
            "seeds": part["settings"]["seeds"],
            "total_s": part["total_s"],
        }
        for part in parts
    ]
    settings = {**united, "parts": pieces}
    settings["command"] = " ".join(["python -m benchmarks ablations", *sys.argv[1:]])
    res = report(
        settings,
        [r for part in parts for r in part["strategy_runs"]],
        [r for part in parts for r in part["merge_runs"]],
        [r for part in parts for r in part["baseline_runs"]],
        sum(part["total_s"] for part in parts),
    )
    print(res["markdown"])
    return res


def derived(r: dict[str, Any]) -> dict[str, Any]:
    """A system run's perplexity and node-accuracy summary (mean, spread over the nodes, best)."""
    r["consensus_perplexity"] = perplexity(r["consensus_loss"])
    for f in ("soup_latest_accuracy", "soup_accuracy", "soup_latest_loss", "soup_loss"):
        v = r.get(f) or []
        r[f"{f}_mean"] = float(np.mean(v)) if len(v) else math.nan
    r.setdefault("consensus_heldout_accuracy", math.nan)
    r.setdefault("soup_gain_min", math.nan)
    acc = np.asarray(r["node_accuracy"])
    r["node_accuracy_mean"], r["node_accuracy_spread"] = float(acc.mean()), float(acc.std())
    r["node_accuracy_best"] = float(acc.max())
    return r


def report(
    settings: Mapping[str, Any],
    strategy_runs: list[dict[str, Any]],
    merge_runs: list[dict[str, Any]],
    baseline_runs_: list[dict[str, Any]],
    total_s: float,
) -> dict[str, Any]:
    """Summary, plot, markdown and the result files of the runs so far (``settings["seeds"]``)."""
    res: dict[str, Any] = {
        "settings": dict(settings),
        "strategy_runs": [derived(r) for r in strategy_runs],
        "merge_runs": [derived(r) for r in merge_runs],
        "baseline_runs": baseline_runs_,
    }
    res["summary"] = summarize(res)
    res["plot"] = plot(res)
    res["total_s"] = total_s
    md = markdown(res)
    harness.save(settings["name"], settings["quick"], res, md)
    res["markdown"] = md
    return res


if __name__ == "__main__":
    main()
