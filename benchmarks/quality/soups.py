"""Model soups on digits: best ingredient, uniform soup, greedy soup, convex (mixture NLL) weights.

Run ``python -m benchmarks soups [--quick]``. Writes benchmarks/results/soups.json, soups.md
and soups.png (``soups_quick.*`` with --quick).

Setting (Wortsman et al. 2022, scaled down): one MLP is pretrained with Adam on the shared
general pool (the digits training split), then k copies of it are fine-tuned on the same
pool, each with its own hyperparameters from a seeded random search (learning rate and
weight decay of AdamW, log-uniform; number of steps) and its own data order (its own PRNG
stream). All k fine-tunes run in one vmapped NodeTrainer call. Then, with the held-out
split for every choice and the test split only for the report:

* best ingredient: the fine-tune with the best held-out accuracy (ties: lower held-out loss);
* uniform soup: the mean of all k;
* greedy soup (Recipe 1): ingredients sorted by held-out accuracy, each kept iff the soup's
  held-out accuracy does not drop (so it is >= the best ingredient on held-out, by
  construction); a second variant uses the held-out loss as its metric;
* convex weights: the simplex weights minimizing the held-out NLL of the mixture of the
  ingredients' predictions (``mixture_nll_weights``), applied to the parameters; the mixture
  of predictions itself is reported beside it (an ensemble: k forward passes, not one model).

The issue's target: greedy soup at least as good as the best ingredient on *test*. The
report says for how many seeds that holds and by how much.
"""

from __future__ import annotations

import time
from typing import Any, NamedTuple

import jax
import numpy as np

from benchmarks import harness
from benchmarks.harness import (
    class_probs,
    header,
    markdown_table,
    mean_std,
    metrics,
    mixture_metrics,
    plot_path,
    pm,
    pretrain,
    pyplot,
    save,
    shared_pool,
    stacked_metrics,
    trainer_for,
    true_label_probs,
    unstack,
)
from consensus.convex import mixture_nll_weights
from strategies import DigitsTask, Schedule, TaskData
from strategies.soup import greedy_soup, uniform_soup, weighted_soup

NAME = "soups"
METHODS = (
    "best ingredient",
    "uniform soup",
    "greedy soup (held-out accuracy)",
    "greedy soup (held-out loss)",
    "convex weights (mixture NLL)",
)
ENSEMBLE = "mixture of predictions (ensemble)"


def draw_hyperparams(rng: np.random.Generator, k: int, steps: int) -> dict[str, np.ndarray]:
    """A random search as in Wortsman et al.: log-uniform lr and weight decay, a few step counts."""
    return {
        "learning_rate": np.exp(rng.uniform(np.log(1e-4), np.log(3e-2), k)).astype(np.float32),
        "weight_decay": np.exp(rng.uniform(np.log(1e-5), np.log(1e-1), k)).astype(np.float32),
        "steps": rng.choice(np.array([steps // 4, steps // 2, steps]), k),
    }


class Ingredients(NamedTuple):
    """The fine-tunes of one seed and what produced them."""

    task: DigitsTask
    data: TaskData
    base: Any  # the pretrained params tree every fine-tune starts from
    stacked: Any  # stacked params of the k fine-tunes
    steps: np.ndarray  # (k,) steps each fine-tune trained (from the trainer's state)
    hyperparams: dict[str, np.ndarray]
    seconds: float


def finetune(
    seed: int,
    *,
    ingredients: int,
    pretrain_steps: int,
    finetune_steps: int,
    hidden: tuple[int, ...] = (128,),
    batch_size: int = 32,
) -> Ingredients:
    """Pretrain one model on the general pool, then fine-tune k copies with random hyperparameters."""
    # The whole training split is the general pool here (no public pool apart): every row pretrains.
    task = DigitsTask(hidden=hidden, public_fraction=0.0, general_pool="union")
    data = task.splits(1, seed=seed)
    k_pre, k_ft = jax.random.split(jax.random.key(seed))
    base = pretrain(task, data.everything(), k_pre, pretrain_steps, 1e-3, batch_size)
    hp = draw_hyperparams(np.random.default_rng(seed), ingredients, finetune_steps)
    # Different step counts in one vmapped call: a node is inactive after its own last step.
    active = np.arange(finetune_steps)[None, :] < hp["steps"][:, None]
    trainer = trainer_for(task, "adamw", batch_size, learning_rate=1e-3, weight_decay=1e-4)
    state = trainer.init(k_ft, base, ingredients)
    t0 = time.perf_counter()
    state, _ = trainer.fit(
        state,
        shared_pool(data, ingredients),
        finetune_steps,
        schedule=Schedule(np.zeros(active.shape, np.int32), active),
        hyperparams={"learning_rate": hp["learning_rate"], "weight_decay": hp["weight_decay"]},
    )
    jax.block_until_ready(state.params)
    return Ingredients(task, data, base, state.params, np.asarray(state.step), hp, time.perf_counter() - t0)


def soup_rows(ing: Ingredients) -> dict[str, dict[str, Any]]:
    """Held-out and test metrics of every method (``METHODS`` and the ensemble) on the fine-tunes."""
    task, data, stacked = ing.task, ing.data, ing.stacked
    k = int(ing.steps.shape[0])
    ings = unstack(stacked)
    held = {m: np.asarray(v) for m, v in stacked_metrics(task, stacked, data.heldout).items()}

    def row(params) -> dict[str, float]:
        h, t = metrics(task, params, data.heldout), metrics(task, params, data.test)
        return {
            "heldout_acc": h["accuracy"],
            "heldout_loss": h["loss"],
            "test_acc": t["accuracy"],
            "test_loss": t["loss"],
        }

    def evaluate(p):
        return metrics(task, p, data.heldout)

    rows: dict[str, dict[str, Any]] = {}
    # Best single: held-out accuracy, ties broken by held-out loss (lexicographic).
    best = int(np.lexsort((held["loss"], -held["accuracy"]))[0])
    rows["best ingredient"] = {**row(ings[best]), "kept": [best]}
    rows["uniform soup"] = {**row(uniform_soup(ings)), "kept": list(range(k))}
    t0 = time.perf_counter()
    g_acc = greedy_soup(ings, evaluate, metric="accuracy", scores=list(held["accuracy"]))
    rows["greedy soup (held-out accuracy)"] = {
        **row(g_acc.params),
        "kept": list(g_acc.kept),
        "seconds": time.perf_counter() - t0,
    }
    g_loss = greedy_soup(ings, evaluate, metric="loss", scores=list(held["loss"]))
    rows["greedy soup (held-out loss)"] = {**row(g_loss.params), "kept": list(g_loss.kept)}

    p_held = class_probs(task, stacked, data.heldout["x"])
    res = mixture_nll_weights(true_label_probs(p_held, data.heldout["y"]))
    w = np.asarray(res.weights, np.float64)
    kept = np.flatnonzero(w > 1e-6).tolist()
    rows["convex weights (mixture NLL)"] = {
        **row(weighted_soup(ings, w)),
        "kept": kept,
        "weights": w.tolist(),
        "status": res.status,
    }
    p_test = class_probs(task, stacked, data.test["x"])
    mh, mt = mixture_metrics(w, p_held, data.heldout["y"]), mixture_metrics(w, p_test, data.test["y"])
    rows[ENSEMBLE] = {
        "heldout_acc": mh["accuracy"],
        "heldout_loss": mh["loss"],
        "test_acc": mt["accuracy"],
        "test_loss": mt["loss"],
        "kept": kept,
        "weights": w.tolist(),
    }
    return rows


def run_seed(seed: int, **kwargs: Any) -> dict[str, Any]:
    """One pretrain -> k fine-tunes -> soups experiment; every number of one seed."""
    ing = finetune(seed, **kwargs)
    rows = soup_rows(ing)
    test = stacked_metrics(ing.task, ing.stacked, ing.data.test)
    held = stacked_metrics(ing.task, ing.stacked, ing.data.heldout)
    base_h, base_t = metrics(ing.task, ing.base, ing.data.heldout), metrics(ing.task, ing.base, ing.data.test)
    return {
        "seed": seed,
        "pretrained": {
            "heldout_acc": base_h["accuracy"],
            "test_acc": base_t["accuracy"],
            "test_loss": base_t["loss"],
        },
        "ingredients": {
            "learning_rate": ing.hyperparams["learning_rate"].tolist(),
            "weight_decay": ing.hyperparams["weight_decay"].tolist(),
            "steps": ing.steps.tolist(),
            "heldout_acc": held["accuracy"].tolist(),
            "test_acc": test["accuracy"].tolist(),
        },
        "methods": rows,
        "greedy_minus_best_test": rows["greedy soup (held-out accuracy)"]["test_acc"]
        - rows["best ingredient"]["test_acc"],
        "finetune_s": ing.seconds,
    }


def _target(diffs: list[float]) -> dict[str, Any]:
    """How often (and by how much) a soup's test accuracy is >= the best ingredient's."""
    return {
        "seeds_met": int(sum(d >= 0 for d in diffs)),
        "seeds": len(diffs),
        "mean_diff": mean_std(diffs),
        "met_on_mean": bool(np.mean(diffs) >= 0),
    }


def summarize(runs: list[dict[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for m in (*METHODS, ENSEMBLE):
        out[m] = {
            f: mean_std([r["methods"][m][f] for r in runs])
            for f in ("heldout_acc", "heldout_loss", "test_acc", "test_loss")
        }
        out[m]["kept"] = mean_std([len(r["methods"][m]["kept"]) for r in runs])
    out["target"] = _target([r["greedy_minus_best_test"] for r in runs])
    out["target_loss_variant"] = _target(
        [
            r["methods"]["greedy soup (held-out loss)"]["test_acc"]
            - r["methods"]["best ingredient"]["test_acc"]
            for r in runs
        ]
    )
    return out


def plot(runs: list[dict[str, Any]], quick: bool) -> str:
    plt = pyplot()
    fig, (a, b) = plt.subplots(1, 2, figsize=(12, 4.2))
    names = (*METHODS, ENSEMBLE)
    for s, r in enumerate(runs):
        accs = [r["methods"][m]["test_acc"] for m in names]
        a.scatter(np.arange(len(names)) + 0.06 * (s - len(runs) / 2), accs, s=14, label=f"seed {r['seed']}")
    means = [np.mean([r["methods"][m]["test_acc"] for r in runs]) for m in names]
    a.bar(np.arange(len(names)), means, color="lightgrey", zorder=0)
    a.set_xticks(np.arange(len(names)), [n.replace(" (", "\n(") for n in names], fontsize=7, rotation=20)
    a.set_ylim(min(min(r["ingredients"]["test_acc"]) for r in runs) - 0.01, 1.0)
    a.set_ylabel("test accuracy")
    a.set_title("test accuracy per seed (bars: mean)")
    a.legend(fontsize=7)
    r0 = runs[0]
    ing = r0["ingredients"]
    b.scatter(
        ing["learning_rate"], ing["test_acc"], c=np.log2(ing["steps"]), cmap="viridis", label="ingredients"
    )
    for m, style in (
        ("uniform soup", "--"),
        ("greedy soup (held-out accuracy)", "-"),
        ("best ingredient", ":"),
    ):
        b.axhline(r0["methods"][m]["test_acc"], ls=style, color="k", lw=1, label=m)
    b.set_xscale("log")
    b.set_xlabel("fine-tuning learning rate (colour: log2 steps)")
    b.set_ylabel("test accuracy")
    b.set_title(f"seed {r0['seed']}: ingredients and soups")
    b.legend(fontsize=7)
    fig.tight_layout()
    path = plot_path(NAME, quick)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path.name


def markdown(res: dict[str, Any]) -> str:
    s, quick = res["summary"], res["settings"]["quick"]
    lines = header("Model soups on digits", NAME, quick, res["settings"])
    lines.append(
        f"Over {len(res['runs'])} seed(s), mean ± std; 'kept' is the number of ingredients in the soup."
    )
    lines.append("")
    rows = [
        [
            m,
            pm([r["methods"][m]["heldout_acc"] for r in res["runs"]]),
            pm([r["methods"][m]["test_acc"] for r in res["runs"]]),
            pm([r["methods"][m]["test_loss"] for r in res["runs"]]),
            f"{s[m]['kept'][0]:.1f}",
        ]
        for m in (*METHODS, ENSEMBLE)
    ]
    pre = [r["pretrained"] for r in res["runs"]]
    rows.insert(
        0,
        [
            "pretrained (before fine-tuning)",
            pm([p["heldout_acc"] for p in pre]),
            pm([p["test_acc"] for p in pre]),
            pm([p["test_loss"] for p in pre]),
            "-",
        ],
    )
    lines.append(markdown_table(["method", "held-out acc", "test acc", "test loss", "kept"], rows))
    t, tl = s["target"], s["target_loss_variant"]
    verdict = "met" if t["seeds_met"] == t["seeds"] else ("met on average" if t["met_on_mean"] else "not met")
    lines.append(
        f"Target (greedy soup >= best ingredient on test): **{verdict}** - greedy (held-out accuracy, "
        f"Wortsman's recipe) >= best on {t['seeds_met']} of {t['seeds']} seeds; greedy - best test accuracy "
        f"{t['mean_diff'][0]:+.4f} ± {t['mean_diff'][1]:.4f} (one test example is "
        f"{1 / res['test_size']:.4f}). With the held-out *loss* as the greedy metric: >= best on "
        f"{tl['seeds_met']} of {tl['seeds']} seeds, {tl['mean_diff'][0]:+.4f} ± {tl['mean_diff'][1]:.4f}."
    )
    lines.append("")
    lines.append("Per seed (test accuracy):")
    lines.append("")
    lines.append(
        markdown_table(
            [
                "seed",
                "best ingredient",
                "uniform",
                "greedy (acc)",
                "greedy (loss)",
                "mixture-NLL weights",
                "greedy kept",
            ],
            [
                [
                    r["seed"],
                    *(f"{r['methods'][m]['test_acc']:.4f}" for m in METHODS),
                    str(r["methods"]["greedy soup (held-out accuracy)"]["kept"]),
                ]
                for r in res["runs"]
            ],
        )
    )
    lines.append(f"Plot: `{res['plot']}`. Total time {res['total_s']:.0f} s.")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = harness.parser(__doc__, "fewer seeds, ingredients and steps")
    args = harness.parse(parser, argv)
    settings = dict(
        quick=args.quick,
        seeds=[0, 1] if args.quick else list(range(8)),
        ingredients=8 if args.quick else 12,
        pretrain_steps=100 if args.quick else 150,
        finetune_steps=200 if args.quick else 400,
        hidden=(128,),
        batch_size=32,
        search="lr ~ logU(1e-4, 3e-2), weight decay ~ logU(1e-5, 1e-1), steps in {T/4, T/2, T}, AdamW",
    )
    t0 = time.perf_counter()
    runs = []
    for seed in settings["seeds"]:
        runs.append(
            run_seed(
                seed,
                ingredients=settings["ingredients"],
                pretrain_steps=settings["pretrain_steps"],
                finetune_steps=settings["finetune_steps"],
                hidden=settings["hidden"],
                batch_size=settings["batch_size"],
            )
        )
        g = runs[-1]["methods"]
        print(
            f"seed {seed}: best {g['best ingredient']['test_acc']:.4f}  "
            f"uniform {g['uniform soup']['test_acc']:.4f}  "
            f"greedy {g['greedy soup (held-out accuracy)']['test_acc']:.4f}",
            flush=True,
        )
    res: dict[str, Any] = {"settings": settings, "runs": runs, "summary": summarize(runs)}
    res["test_size"] = len(DigitsTask().splits(1).test["y"])
    res["plot"] = plot(runs, args.quick)
    res["total_s"] = time.perf_counter() - t0
    md = markdown(res)
    save(NAME, args.quick, res, md)
    print(md)
    return res


if __name__ == "__main__":
    main()
