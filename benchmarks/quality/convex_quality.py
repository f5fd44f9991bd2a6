"""Convex merge weights on non-IID digits nodes: merged-model quality of every objective.

Run ``python -m benchmarks convex_quality [--quick]``. Writes
benchmarks/results/convex_quality.json, convex_quality.md and convex_quality.png
(``convex_quality_quick.*`` with --quick).

Setting: a warm start (an MLP trained with Adam on a small public subset of the training
split) is copied to n nodes; node i fine-tunes it on its own Dirichlet(alpha) label-skew
shard (``DigitsTask.splits``), all nodes in one vmapped NodeTrainer call. The n nodes are
then merged once, ``sum_i w_i x_i``, with weights from each objective, fitted on the
held-out split:

* uniform averaging (w = 1/n);
* quadratic: a quadratic model of the held-out loss around the uniform mean (diagonal
  Gauss-Newton curvature, ``softmax_gauss_newton``), ``quadratic_weights``;
* trust-region quadratic: the same model, its ridge grown until the true held-out loss of
  the merge agrees (``trust_region_quadratic_weights``); never worse than uniform on held-out;
* mixture NLL: the held-out NLL of the mixture of the nodes' predictions
  (``mixture_nll_weights``), applied to the parameters; the mixture of predictions itself
  (what the objective optimizes: an ensemble, n forward passes) is reported beside it;
* anchor: the merge closest to the coordinate-wise median of the nodes (``anchor_weights``),

each without and with a cap ``w_i <= 2/n``. The table gives the held-out loss (the data
the weights were fitted on, so in-sample for the weights), the test loss and accuracy, and
the time: ``solve`` is cvxpy/Clarabel alone, ``total`` the whole weigher call with its
statistics (curvature, Gram matrices, probabilities), both after one untimed warm-up call
in the process (jit compilation, cvxpy build), so they are re-solve times.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks import harness
from benchmarks.harness import (
    add_task_option,
    class_probs,
    header,
    make_task,
    markdown_table,
    metrics,
    mixture_metrics,
    plot_path,
    pm,
    pretrain,
    pyplot,
    save,
    single_logits,
    stacked_metrics,
    trainer_for,
    true_label_probs,
    use_task,
)
from consensus import median, tree
from consensus.convex import (
    ConvexWeights,
    anchor_weights,
    mixture_nll_weights,
    quadratic_weights,
    softmax_gauss_newton,
    trust_region_quadratic_weights,
)
from strategies import DigitsTask, NodeData, TaskData

NAME = "convex_quality"  # convex_quality_<task> with --task other than digits
OBJECTIVES = ("uniform", "quadratic", "trust-region quadratic", "mixture NLL", "anchor (median)")
ENSEMBLE = "mixture NLL: mixture of predictions"
BEST = "best single node (held-out)"


def train_nodes(
    task: DigitsTask, n: int, alpha: float, seed: int, *, warm_steps: int, local_steps: int, public: int
) -> tuple[TaskData, Any, np.ndarray]:
    """(data, stacked params of the n fine-tuned nodes, shard sizes)."""
    data = task.splits(n, seed=seed, alpha=alpha)
    rng = np.random.default_rng(seed)
    rows = np.sort(rng.choice(len(data.general_groups), public, replace=False)).astype(np.int32)
    warm_data = NodeData(
        dict(data.general), rows[None], np.array([public], np.int32), shared=True, name="public"
    )
    k_warm, k_nodes = jax.random.split(jax.random.key(seed))
    warm = pretrain(task, warm_data, k_warm, warm_steps, 3e-3)
    trainer = trainer_for(task, "adam", 32)
    state = trainer.init(k_nodes, warm, n)
    state, _ = trainer.fit(state, data.own(), local_steps)
    return data, state.params, np.asarray(data.train_count)


def weighers(task: DigitsTask, stacked: Any, data: Any) -> dict[str, Callable[[float | None], ConvexWeights]]:
    """objective -> ``fn(cap) -> ConvexWeights`` (statistics computed inside, so they are timed)."""
    n = tree.num_nodes(stacked)
    x_h, y_h = jnp.asarray(data.heldout["x"]), jnp.asarray(data.heldout["y"])
    logits_fn = single_logits(task)

    def quadratic(cap, trust: bool):
        ref = tree.weighted_sum(stacked, jnp.full((n,), 1.0 / n, jnp.float32))
        model = softmax_gauss_newton(logits_fn, ref, x_h, y_h)
        args = (stacked, ref, model.grad, model.curvature)
        if not trust:
            return quadratic_weights(*args, loss=float(model.loss), max_weight=cap)

        def loss_at(p):
            return metrics(task, p, data.heldout)["loss"]

        return trust_region_quadratic_weights(*args, loss_at, loss=float(model.loss), max_weight=cap)

    def mixture(cap):
        probs = true_label_probs(class_probs(task, stacked, data.heldout["x"]), data.heldout["y"])
        return mixture_nll_weights(probs, max_weight=cap)

    def anchor(cap):
        rule = median()
        med, _ = rule.update(stacked, rule.init(None))
        return anchor_weights(stacked, med, max_weight=cap)

    return {
        "quadratic": lambda cap: quadratic(cap, False),
        "trust-region quadratic": lambda cap: quadratic(cap, True),
        "mixture NLL": mixture,
        "anchor (median)": anchor,
    }


def merge_rows(
    task: DigitsTask, data: TaskData, stacked: Any, cap_factor: float, *, warm: bool = False
) -> dict[str, dict[str, Any]]:
    """Weigh the nodes with every objective (no cap and cap ``cap_factor / n``), evaluate the merges.

    ``warm``: run each weigher once untimed first, so the reported times exclude jit compilation
    and the cvxpy build (the problems are cached and re-solved after that).
    """
    n = tree.num_nodes(stacked)
    cap = cap_factor / n

    def evaluate(w: np.ndarray) -> dict[str, float]:
        merged = tree.weighted_sum(stacked, jnp.asarray(w, jnp.float32))
        h, t = metrics(task, merged, data.heldout), metrics(task, merged, data.test)
        return {
            "heldout_loss": h["loss"],
            "heldout_acc": h["accuracy"],
            "test_loss": t["loss"],
            "test_acc": t["accuracy"],
        }

    rows: dict[str, dict[str, Any]] = {}
    uniform = np.full(n, 1.0 / n)
    rows["uniform"] = {**evaluate(uniform), "weights": uniform.tolist(), "solve_s": 0.0, "total_s": 0.0}
    best = int(np.argmin(stacked_metrics(task, stacked, data.heldout)["loss"]))
    rows[BEST] = {**evaluate(np.eye(n)[best]), "weights": np.eye(n)[best].tolist()}
    ph = class_probs(task, stacked, data.heldout["x"])
    pt = class_probs(task, stacked, data.test["x"])
    for name, fn in weighers(task, stacked, data).items():
        for capped in (False, True):
            if warm:
                fn(cap if capped else None)  # compile the curvature and build the cvxpy problem, untimed
            t0 = time.perf_counter()
            res = fn(cap if capped else None)
            total = time.perf_counter() - t0
            w = np.asarray(res.weights, np.float64)
            label = f"{name}, cap {cap_factor:g}/n" if capped else name
            rows[label] = {
                **evaluate(w),
                "weights": w.tolist(),
                "solve_s": res.solve_time,
                "total_s": total,
                "status": res.status,
                "fallback": res.fallback,
                "message": res.message,
            }
            if name == "mixture NLL":
                mh, mt = mixture_metrics(w, ph, data.heldout["y"]), mixture_metrics(w, pt, data.test["y"])
                rows[label.replace("mixture NLL", ENSEMBLE)] = {
                    "heldout_loss": mh["loss"],
                    "heldout_acc": mh["accuracy"],
                    "test_loss": mt["loss"],
                    "test_acc": mt["accuracy"],
                    "weights": w.tolist(),
                }
    return rows


def run_one(
    alpha: float,
    seed: int,
    *,
    n: int,
    warm_steps: int,
    local_steps: int,
    public: int,
    cap_factor: float,
    warm: bool = False,
) -> dict[str, Any]:
    """Train the nodes of one (alpha, seed) and evaluate every merge of them."""
    task = make_task()
    data, stacked, sizes = train_nodes(
        task, n, alpha, seed, warm_steps=warm_steps, local_steps=local_steps, public=public
    )
    rows = merge_rows(task, data, stacked, cap_factor, warm=warm)
    return {
        "alpha": alpha,
        "seed": seed,
        "n": n,
        "cap": cap_factor / n,
        "shard_sizes": sizes.tolist(),
        "rows": rows,
    }


def row_names(cap_factor: float) -> list[str]:
    out = [BEST, "uniform"]
    for name in OBJECTIVES[1:]:
        out.append(name)
        out.append(f"{name}, cap {cap_factor:g}/n")
        if name == "mixture NLL":
            out += [ENSEMBLE, f"{ENSEMBLE}, cap {cap_factor:g}/n"]
    return out


def plot(runs: list[dict[str, Any]], settings: dict[str, Any]) -> str:
    plt = pyplot()
    names = [r for r in row_names(settings["cap_factor"]) if not r.startswith(ENSEMBLE) and r != BEST]
    alphas = settings["alphas"]
    fig, axes = plt.subplots(1, 2, figsize=(13, 4.5))
    width = 0.8 / len(alphas)
    for metric, ax in zip(("test_acc", "heldout_loss"), axes, strict=True):
        for j, alpha in enumerate(alphas):
            vals = [[r["rows"][m][metric] for r in runs if r["alpha"] == alpha] for m in names]
            ax.bar(
                np.arange(len(names)) + (j - (len(alphas) - 1) / 2) * width,
                [np.mean(v) for v in vals],
                width,
                yerr=[np.std(v) for v in vals],
                label=f"alpha = {alpha:g}",
                capsize=2,
            )
        ax.set_xticks(np.arange(len(names)), [m.replace(", ", "\n") for m in names], fontsize=7, rotation=30)
        ax.set_ylabel("test accuracy" if metric == "test_acc" else "held-out loss (fitted on)")
        ax.legend(fontsize=7)
    lo = min(r["rows"][m]["test_acc"] for r in runs for m in names)
    axes[0].set_ylim(max(0.0, lo - 0.05), 1.0)
    fig.suptitle(f"merged model of n = {settings['n']} non-IID nodes, mean ± std over seeds")
    fig.tight_layout()
    path = plot_path(NAME, settings["quick"])
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path.name


def markdown(res: dict[str, Any]) -> str:
    st, runs = res["settings"], res["runs"]
    lines = header("Convex merge weights: quality of the merged model", NAME, st["quick"], st)
    lines.append(
        f"Mean ± std over seeds {st['seeds']}. Held-out loss is in-sample for the weights; test is not. "
        "Times: median over the runs, re-solves (compilation and cvxpy build excluded)."
    )
    lines.append("")
    for alpha in st["alphas"]:
        sub = [r for r in runs if r["alpha"] == alpha]
        lines.append(f"## alpha = {alpha:g} (shard sizes, seed {sub[0]['seed']}: {sub[0]['shard_sizes']})")
        lines.append("")
        table = []
        for m in row_names(st["cap_factor"]):
            rs = [r["rows"][m] for r in sub]
            t = [x for x in (r.get("total_s") for r in rs) if x is not None]
            s = [x for x in (r.get("solve_s") for r in rs) if x is not None]
            maxw = [max(r["weights"]) for r in rs]
            table.append(
                [
                    m,
                    pm([r["heldout_loss"] for r in rs]),
                    pm([r["test_loss"] for r in rs]),
                    pm([r["test_acc"] for r in rs]),
                    f"{np.mean(maxw):.2f}",
                    f"{1e3 * statistics.median(s):.1f}" if s else "-",
                    f"{1e3 * statistics.median(t):.0f}" if t else "-",
                ]
            )
        lines.append(
            markdown_table(
                ["merge", "held-out loss", "test loss", "test acc", "max w", "solve ms", "total ms"], table
            )
        )
    fb = [(r["alpha"], r["seed"], m) for r in runs for m, v in r["rows"].items() if v.get("fallback")]
    lines.append(f"Solver fallbacks to uniform weights: {fb if fb else 'none'}.")
    lines.append("")
    lines.append(f"Plot: `{res['plot']}`. Total time {res['total_s']:.0f} s.")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> dict[str, Any]:
    global NAME
    parser = harness.parser(__doc__, "one seed, fewer local steps")
    add_task_option(parser)
    args = harness.parse(parser, argv)
    NAME = use_task(args.task, "convex_quality")
    settings = dict(
        task=args.task,
        quick=args.quick,
        alphas=[0.1, 0.5, 10.0],
        seeds=[0] if args.quick else [0, 1, 2],
        n=10,
        warm_steps=100,
        public=100,
        local_steps=100 if args.quick else 200,
        cap_factor=2.0,
        model="DigitsTask MLP 64-128-10" if args.task == "digits" else f"{args.task} default MLP",
        node_optimizer="Adam lr 1e-3, batch 32",
    )
    t0 = time.perf_counter()
    runs = []
    for alpha in settings["alphas"]:
        for seed in settings["seeds"]:
            runs.append(
                run_one(
                    alpha,
                    seed,
                    n=settings["n"],
                    warm_steps=settings["warm_steps"],
                    local_steps=settings["local_steps"],
                    public=settings["public"],
                    cap_factor=settings["cap_factor"],
                    warm=not runs,
                )
            )
            r = runs[-1]["rows"]
            print(
                f"alpha {alpha:g} seed {seed}: "
                + "  ".join(f"{m} {r[m]['test_acc']:.3f}" for m in ("uniform", *OBJECTIVES[1:])),
                flush=True,
            )
    res: dict[str, Any] = {"settings": settings, "runs": runs}
    res["plot"] = plot(runs, settings)
    res["total_s"] = time.perf_counter() - t0
    md = markdown(res)
    save(NAME, args.quick, res, md)
    print(md)
    return res


if __name__ == "__main__":
    main()
