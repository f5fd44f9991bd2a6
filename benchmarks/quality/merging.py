"""Multi-task model merging: every merge method on 8 fine-tunes of one base, clean and with 2 poisoned.

Run ``python -m benchmarks merging [--quick] [--task digits|fashion_mnist] [--limit N]``. Writes
benchmarks/results/merging.{json,md,png} for digits, ``merging_<task>.*`` for another task
(``..._quick.*`` with --quick). ``--report-from benchmarks/results/merging.json`` rewrites the
markdown and PNG beside a results JSON from its stored runs, without training.

Protocol, in the spirit of the 8-task CLIP ViT-B/32 benchmark of task arithmetic / TIES /
AdaMerging, small enough for 2 CPU cores:

* a base MLP is trained on half of the task's training set (all classes);
* 8 tasks are built from the other half, each with its own test and held-out rows
  (the task's test/held-out splits, transformed the same way): classes 0-4, classes 5-9, even
  classes, odd classes, mirrored images, inverted intensities, labels shifted by one
  (a relabelling that conflicts with the others), images shifted by one pixel;
  one shared 10-way head;
* each task is fine-tuned from the base (full-batch Adam), then every method merges the 8
  fine-tunes with ``params`` = the base. The score of a merge on a task is its test accuracy
  divided by that task's own fine-tune's (normalized accuracy); the table reports each task
  and the average.

Scales (task arithmetic, TIES, DARE+TIES, and the scaled convex rows) are tuned on the
held-out rows of all 8 tasks (grid 0.03 ... 1.5), as the papers tune lambda on validation
data. Convex weights (task-wise and layer-wise, :func:`consensus.layerwise_weights`) minimize a
Gauss-Newton quadratic model of the held-out cross-entropy around the mean of the fine-tunes.
Fisher merging and RegMean use :func:`strategies.statistics.node_statistics` on each task's
training rows.

Robust merging: the same with 2 of the 8 fine-tunes replaced by poisoned ones (task vector
sign-flipped and scaled by 3), the votes composed with the methods (nnm, trimmed mean, TIES
with the "count" election, convex weights capped at 1/6). Normalized accuracies there are
against the honest fine-tunes of all 8 tasks; the average over the 6 honest tasks is reported too.
"""

from __future__ import annotations

import functools
import json
import time
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

import consensus
from benchmarks.harness import header, markdown_table, parse, parser, plot_path, pyplot, save
from consensus.convex.curvature import softmax_gauss_newton
from strategies.registry import resolve_task
from strategies.statistics import mlp_layer_inputs, node_statistics
from strategies.tasks.fashion_mnist import PIXEL_MEAN, PIXEL_STD

NAME = "merging"
TASK_NAMES = ["classes 0-4", "classes 5-9", "even", "odd", "mirror", "invert", "label+1", "shift"]
# The lower end reaches below 1/8 (the plain average of 8 task vectors): 0.1 was the grid's edge
# and the choice in every seed when the grid started there.
SCALES = [0.03, 0.05, 0.07, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.8, 1.0, 1.2, 1.5]
POISONED = (6, 7)
BASE_ROW = "base (no merge)"  # the common base itself: the bar a merge must clear
CURVATURE_ROWS = 500  # held-out rows per task for the convex weights' Gauss-Newton model
# Published 8-task CLIP ViT-B/32 average accuracies (%), as quoted in issue 15 (task arithmetic,
# TIES and AdaMerging papers' tables): the ordering this benchmark is compared with.
PUBLISHED = {
    "average": 66.5,
    "task arithmetic": 68.0,
    "ties": 72.2,
    "regmean": 82.4,
    "layer-wise convex": 82.6,
}


# ----------------------------------------------------------------------------- data and tasks


def _image_side(d: int) -> int | None:
    side = int(round(d**0.5))
    return side if side * side == d else None


def transform(name: str, x: np.ndarray, y: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The rows of task ``name`` (subset, input transform or relabelling) from (x, y)."""
    side = _image_side(x.shape[1])
    if name == "classes 0-4":
        keep = y < 5
    elif name == "classes 5-9":
        keep = y >= 5
    elif name == "even":
        keep = y % 2 == 0
    elif name == "odd":
        keep = y % 2 == 1
    else:
        keep = np.ones_like(y, bool)
    x, y = x[keep], y[keep]
    if name == "mirror":
        x = x.reshape(-1, side, side)[:, :, ::-1].reshape(len(x), -1) if side else x[:, ::-1]
    elif name == "invert":
        x = x.max() - x
    elif name == "label+1":
        y = (y + 1) % 10
    elif name == "shift":
        x = (
            np.roll(x.reshape(-1, side, side), 1, axis=2).reshape(len(x), -1)
            if side
            else np.roll(x, 1, axis=1)
        )
    return np.ascontiguousarray(x, np.float32), y.astype(np.int32)


def task_options(task_name: str, limit: int | None) -> dict[str, Any] | None:
    """The task's options here: a 64-unit MLP for both; Fashion-MNIST cut to ``limit`` images."""
    if task_name == "digits":
        return {"hidden": [64]}
    if task_name == "fashion_mnist":
        return {"hidden": [64], "limit": limit}
    return None


def as_float(x: Any) -> np.ndarray:
    """float32 rows in [0, 1] for integer (uint8) images, as the tasks' ``apply`` scales them."""
    x = np.asarray(x)
    return x.astype(np.float32) / 255.0 if np.issubdtype(x.dtype, np.integer) else x.astype(np.float32)


def load(task_name: str, seed: int, limit: int | None = None):
    task = resolve_task(task_name, task_options(task_name, limit))
    data = task.splits(1, seed=seed)
    m = int(np.asarray(data.train_count)[0])
    x = as_float(data.train["x"][0][:m]).reshape(m, -1)
    y = np.asarray(data.train["y"][0][:m], np.int32)
    rng = np.random.default_rng(seed)
    order = rng.permutation(m)
    half = m // 2
    sets = {
        "base": (x[order[:half]], y[order[:half]]),
        "tasks": (x[order[half:]], y[order[half:]]),
        "heldout": (
            as_float(data.heldout["x"]).reshape(len(data.heldout["y"]), -1),
            np.asarray(data.heldout["y"], np.int32),
        ),
        "test": (
            as_float(data.test["x"]).reshape(len(data.test["y"]), -1),
            np.asarray(data.test["y"], np.int32),
        ),
    }
    return task, sets


def one_example_logits(task, params, x):
    """(C,) logits of ONE flat input row (the convex weights' curvature model takes single examples)."""
    return task.apply(params, x[None])[0]


def fashion_layer_inputs(params, x):
    """The Fashion-MNIST MLP's Dense inputs: it standardizes the [0, 1] pixels before its first layer."""
    return mlp_layer_inputs(params, (x - PIXEL_MEAN) / PIXEL_STD)


def padded(x: np.ndarray, y: np.ndarray, size: int) -> dict[str, jax.Array]:
    pad = size - len(y)
    return {
        "x": jnp.asarray(np.concatenate([x, np.zeros((pad, x.shape[1]), np.float32)])),
        "y": jnp.asarray(np.concatenate([y, np.zeros(pad, np.int32)])),
        "mask": jnp.asarray(np.concatenate([np.ones(len(y), bool), np.zeros(pad, bool)])),
    }


def make_trainer(task, steps: int, lr: float):
    opt = optax.adam(lr)

    @jax.jit
    def train(params, batch):
        def step(carry, _):
            p, s = carry
            g = jax.grad(task.loss)(p, batch)
            u, s = opt.update(g, s, p)
            return (optax.apply_updates(p, u), s), None

        (p, _), _ = jax.lax.scan(step, (params, opt.init(params)), None, length=steps)
        return p

    return train


def accuracy_fn(task):
    @jax.jit
    def acc(params, x, y):
        return jnp.mean(jnp.argmax(task.apply(params, x), -1) == y)

    return acc


# ----------------------------------------------------------------------------- methods


def leafwise(base, stacked, fn):
    return jax.tree.map(fn, base, stacked)


def run_methods(task, base, stacked, stats, heldout, score_heldout, robust: bool) -> dict[str, Any]:
    """Every method's merged params (scales tuned on the held-out rows by ``score_heldout``)."""
    n = consensus.num_nodes(stacked)
    key = jax.random.key(0)
    out: dict[str, Any] = {}

    def upd(agg, **kw):
        return agg.update(stacked, agg.init(base), base, **kw)[0]

    def tuned(make, **kw):
        best = max(SCALES, key=lambda s: score_heldout(upd(make(s), **kw)))
        return upd(make(best), **kw), best

    scales = {}
    out["average"] = upd(consensus.mean())
    out["task arithmetic"], scales["task arithmetic"] = tuned(lambda s: consensus.task_arithmetic(s))
    out["ties"], scales["ties"] = tuned(lambda s: consensus.ties(0.2, scale=s))
    out["ties (count)"], scales["ties (count)"] = tuned(lambda s: consensus.ties(0.2, "count", scale=s))
    out["dare+ties"], scales["dare+ties"] = tuned(
        lambda s: consensus.process(consensus.ties(0.2, scale=s), pre=[consensus.dare(0.5)]), key=key
    )
    out["model stock"] = upd(consensus.model_stock())
    out["fisher"] = upd(consensus.fisher_merge(), fisher=stats["fisher"])
    out["regmean"] = upd(consensus.regmean(off_diagonal_scale=0.9), grams=stats["grams"])

    hx, hy = heldout
    logits = functools.partial(one_example_logits, task)  # one object: the estimator's static argument

    def model_fn(p, **extra):
        return softmax_gauss_newton(logits, p, hx, hy)

    cap = 1.0 / (n - len(POISONED)) if robust else None
    ref = consensus.weighted_sum(stacked, jnp.full((n,), 1.0 / n, jnp.float32))
    lm = model_fn(ref)
    tw = consensus.quadratic_weights(stacked, ref, lm.grad, lm.curvature, max_weight=cap)
    out["task-wise convex"] = consensus.weighted_sum(stacked, jnp.asarray(tw.weights, jnp.float32))
    lw = consensus.layerwise_weights(model_fn, max_weight=cap)
    out["layer-wise convex"], lw_state = lw.update(stacked, lw.init(base), base)

    def rescaled(merged):
        def make(s):
            return jax.tree.map(lambda b, m: b + s * (m - b), base, merged)

        best = max([*SCALES, 2.0, 3.0, 4.0], key=lambda s: score_heldout(make(s)))
        return make(best), best

    out["layer-wise convex (scaled)"], scales["layer-wise convex (scaled)"] = rescaled(
        out["layer-wise convex"]
    )
    if robust:
        f = len(POISONED)
        out["nnm+task arithmetic"], scales["nnm+task arithmetic"] = tuned(
            lambda s: consensus.process(consensus.task_arithmetic(s), pre=[consensus.nnm(f)])
        )
        out["nnm+ties (count)"], scales["nnm+ties (count)"] = tuned(
            lambda s: consensus.process(consensus.ties(0.2, "count", scale=s), pre=[consensus.nnm(f)])
        )
        out["trimmed mean"] = upd(consensus.trimmed_mean(f))
        out["trimmed mean (scaled)"], scales["trimmed mean (scaled)"] = rescaled(out["trimmed mean"])
        out["median"] = upd(consensus.median())
    return {"merged": out, "scales": scales, "layerwise_groups": len(lw_state.result.groups)}


# ----------------------------------------------------------------------------- one seed


def one_seed(task_name: str, seed: int, quick: bool, limit: int | None = None) -> dict[str, Any]:
    task, sets = load(task_name, seed, limit)
    base_steps, ft_steps = (300, 150) if quick else (800, 400)
    acc = accuracy_fn(task)
    bx, by = sets["base"]
    base = make_trainer(task, base_steps, 3e-3)(task.init(jax.random.key(seed)), padded(bx, by, len(by)))
    tasks = [transform(t, *sets["tasks"]) for t in TASK_NAMES]
    tests = [transform(t, *sets["test"]) for t in TASK_NAMES]
    helds = [transform(t, *sets["heldout"]) for t in TASK_NAMES]
    size = max(len(y) for _, y in tasks)
    train = make_trainer(task, ft_steps, 3e-3)
    fine = [train(base, padded(x, y, size)) for x, y in tasks]
    layer_inputs = fashion_layer_inputs if task_name == "fashion_mnist" else mlp_layer_inputs
    stats = [
        node_statistics(task.loss, p, {"x": jnp.asarray(x), "y": jnp.asarray(y)}, layer_inputs=layer_inputs)
        for p, (x, y) in zip(fine, tasks, strict=True)
    ]
    own_test = np.array([float(acc(p, *t)) for p, t in zip(fine, tests, strict=True)])
    own_held = np.array([float(acc(p, *h)) for p, h in zip(fine, helds, strict=True)])
    hx = jnp.asarray(np.concatenate([h[0][:CURVATURE_ROWS] for h in helds]))
    hy = jnp.asarray(np.concatenate([h[1][:CURVATURE_ROWS] for h in helds]))

    def score_heldout(params):
        return float(np.mean([float(acc(params, *h)) for h in helds] / own_held))

    def normalized(params):
        return [float(acc(params, *t)) / o for t, o in zip(tests, own_test, strict=True)]

    result: dict[str, Any] = {
        "own_test_accuracy": own_test.tolist(),
        "base_normalized": normalized(base),
    }
    for robust in (False, True):
        nodes = list(fine)
        if robust:
            for i in POISONED:
                nodes[i] = jax.tree.map(lambda b, p: b - 3.0 * (p - b), base, fine[i])
        stacked = consensus.stack(nodes)
        st = {
            "fisher": consensus.stack([s.fisher for s in stats]),
            "grams": {k: jnp.stack([s.grams[k] for s in stats]) for k in stats[0].grams},
        }
        methods = run_methods(task, base, stacked, st, (hx, hy), score_heldout, robust)
        scores = {name: normalized(p) for name, p in methods["merged"].items()}
        result["robust" if robust else "clean"] = {"normalized": scores, "scales": methods["scales"]}
    return result


# ----------------------------------------------------------------------------- report


def summarize(runs: list[dict[str, Any]], setting: str) -> dict[str, dict[str, Any]]:
    names = [*runs[0][setting]["normalized"], BASE_ROW]
    honest = [i for i in range(8) if i not in POISONED]
    out = {}
    for name in names:
        per_task = np.array(  # (seeds, 8)
            [r["base_normalized"] if name == BASE_ROW else r[setting]["normalized"][name] for r in runs]
        )
        out[name] = {
            "per_task": per_task.mean(0).tolist(),
            "average": float(per_task.mean()),
            "average_std": float(per_task.mean(1).std()),
            "honest_average": float(per_task[:, honest].mean()),
        }
    return out


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = parser(__doc__, "1 seed, shorter training (under 2 minutes)")
    p.add_argument("--task", default="digits", help="a registered classification task (default digits)")
    p.add_argument("--seeds", type=int, default=None, help="number of seeds (default 1 quick, 3 full)")
    p.add_argument(
        "--limit",
        type=int,
        default=30000,
        help="Fashion-MNIST: the first LIMIT training and test images (default 30000; 2-core sizing)",
    )
    p.add_argument(
        "--report-from",
        default=None,
        metavar="JSON",
        help="rewrite the markdown and PNG beside a results JSON of this script from its runs (no training)",
    )
    args = parse(p, argv)
    if args.report_from is not None:
        path = Path(args.report_from)
        res = json.loads(path.read_text())
        settings = res["settings"]
        md = report(res["runs"], settings, res["command"], res["total_s"])
        path.with_suffix(".md").write_text(md)
        plot(summarize(res["runs"], "clean"), summarize(res["runs"], "robust"), path.with_suffix(".png"))
        print(md)
        return res
    seeds = args.seeds or (1 if args.quick else 3)
    t0 = time.perf_counter()
    runs = [one_seed(args.task, s, args.quick, args.limit) for s in range(seeds)]
    settings = {
        "task": args.task,
        "seeds": seeds,
        "tasks": 8,
        "poisoned": list(POISONED),
        "quick": args.quick,
        "limit": args.limit if args.task == "fashion_mnist" else None,
    }
    total = time.perf_counter() - t0
    clean, robust = summarize(runs, "clean"), summarize(runs, "robust")
    name = NAME if args.task == "digits" else f"{NAME}_{args.task}"
    cmd = "python -m benchmarks merging" + (" --quick" if args.quick else "")
    if args.task != "digits":
        cmd += f" --task {args.task}" + (f" --limit {args.limit}" if args.task == "fashion_mnist" else "")
    if args.seeds is not None:
        cmd += f" --seeds {args.seeds}"
    # "command" over save()'s, which knows only the file name.
    res = {"clean": clean, "robust": robust, "runs": runs, "total_s": total, "command": cmd}
    md = report(runs, settings, cmd, total)
    save(name, args.quick, res, md, settings=settings)
    plot(clean, robust, plot_path(name, args.quick))
    print(md)
    return res


def report(runs: list[dict[str, Any]], settings: dict[str, Any], cmd: str, total_s: float) -> str:
    """The markdown report of the runs (tables sorted by average normalized accuracy)."""
    clean, robust = summarize(runs, "clean"), summarize(runs, "robust")
    seeds = len(runs)

    def table(summary, robust_cols=False):
        head = ["method", *TASK_NAMES, "average"] + (["avg over 6 honest"] if robust_cols else [])
        rows = []
        for name, s in sorted(summary.items(), key=lambda kv: -kv[1]["average"]):
            avg = f"{s['average']:.3f}" + (f" ± {s['average_std']:.3f}" if seeds > 1 else "")
            row = [f"*{name}*" if name == BASE_ROW else name, *[f"{v:.2f}" for v in s["per_task"]], avg]
            if robust_cols:
                row.append(f"{s['honest_average']:.3f}")
            rows.append(row)
        return markdown_table(head, rows)

    own = np.mean([r["own_test_accuracy"] for r in runs], 0)
    order = list(PUBLISHED)
    ours = " < ".join(
        f"{k} {clean[k]['average']:.3f}" for k in sorted(order, key=lambda k: clean[k]["average"])
    )
    theirs = " < ".join(f"{k} {PUBLISHED[k]}" for k in sorted(order, key=lambda k: PUBLISHED[k]))
    lines = header("Multi-task merging: 8 fine-tunes of one base", NAME, bool(settings["quick"]), settings)
    lines[2] = f"Command: `{cmd}` ({total_s / 60:.1f} min)"
    lines += [
        "Normalized accuracy = a merge's test accuracy on a task / that task's own fine-tune's "
        "(mean over seeds; ± the standard deviation of the average over seeds). Fine-tunes' own "
        "test accuracies: "
        + ", ".join(f"{t} {a:.2f}" for t, a in zip(TASK_NAMES, own, strict=True))
        + f". *{BASE_ROW}* is the common base itself, the bar a merge has to clear.",
        "",
        "## Clean: the 8 fine-tunes",
        "",
        table(clean),
        "",
        f"Ordering here (average normalized accuracy): {ours}; {BASE_ROW} {clean[BASE_ROW]['average']:.3f}.",
        "",
        "Published ordering on 8-task CLIP ViT-B/32 (absolute accuracy, %; layer-wise = AdaMerging): "
        f"{theirs}.",
        "",
        "## Robust: 2 of the 8 fine-tunes poisoned (tasks "
        + ", ".join(TASK_NAMES[i] for i in POISONED)
        + ": task vector x -3)",
        "",
        table(robust, robust_cols=True),
        "",
        "Scales tuned on held-out data (first seed): clean "
        + ", ".join(f"{k} {v}" for k, v in runs[0]["clean"]["scales"].items())
        + "; robust "
        + ", ".join(f"{k} {v}" for k, v in runs[0]["robust"]["scales"].items())
        + ".",
    ]
    return "\n".join(lines) + "\n"


def plot(clean, robust, path: Path) -> None:
    plt = pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(13, 4.8))
    for ax, summary, title in ((axes[0], clean, "clean"), (axes[1], robust, "2 of 8 poisoned")):
        names = sorted(summary, key=lambda k: summary[k]["average"])
        vals = [summary[k]["average"] for k in names]
        ax.barh(names, vals, color="tab:blue")
        ax.axvline(1.0, color="gray", lw=0.8, ls="--")
        ax.set_xlabel("average normalized accuracy")
        ax.set_title(f"8-task merging, {title}")
        ax.set_xlim(min(0.0, min(vals)), max(1.05, max(vals) + 0.05))
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    main()
