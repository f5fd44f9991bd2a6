"""DP-FedAvg on digits: test accuracy against epsilon in {1, 3, 8, inf}, both accountants.

Run ``python -m benchmarks privacy_quality [--quick]``. Writes
benchmarks/results/privacy_quality.json, privacy_quality.md and privacy_quality.png
(``privacy_quality_quick.*`` with --quick).

Setting: node-level DP needs many nodes, so the digits training split (1,257 examples) is
cut into ``clients`` disjoint random shards of about 3 examples each, one simulated client
per shard; NodeTrainer trains all clients in one vmapped step. The model is softmax
regression (``DigitsTask(hidden=())``, d = 650) so the noise, whose norm grows like
sqrt(d), stays small. Each round: the DP aggregator's Poisson sample (rate q) is drawn from
its state; the round's privacy event is spent on an RDP :class:`PrivacyLedger` whose budget
is the target epsilon (it refuses a round over budget); every client starts from the global
params (re-broadcast), takes ``local_steps`` SGD steps on its own examples (all clients train
in one vmapped call, which is cheap here; ``dp_fedavg`` keeps only the sampled ones); it
clips each participant's update to C, sums over the fixed denominator m = q * clients, adds
N(0, (z C / m)^2) noise and takes a server step (SGD or SGD with momentum, learning rate eta).

For each target epsilon (delta = 1e-5) z = ``calibrate_noise`` (RDP) for (q, rounds); PLD's
epsilon for the same z is reported beside RDP's, and the z PLD would allow. epsilon = inf is
the same pipeline with z = 0 (clipping kept): the "non-private" reference of the target.
A model trained centrally on the whole training split without DP or clipping is reported
as the ceiling.

Tuning (full mode): clip norm C, server optimizer (SGD = FedAvg, momentum = FedAvgM) and its
learning rate eta on a small grid (``GRID``), chosen per epsilon by *held-out* accuracy on one
tuning seed (seed 100); the test split is used only for the final seeds. As usual in the DP
literature, the tuning runs are not charged to the privacy budget. The issue's target: within
5 points of non-private at epsilon = 8.

**Example-level DP** (``--example``; writes ``privacy_quality_example[_quick].*``): the few-silo
setting. Fashion-MNIST (digits when its files are absent), 16 nodes on a Dirichlet(alpha = 1)
split, softmax regression, the whole system (``MetaConsensus``) with a plain mean of the nodes:

* example-level DP-SGD in every node (``dp.level = "example"``) at epsilon in {1, 3, 8, inf}
  (delta = 1e-5; each node's z calibrated to its own q over the run's steps; the run's epsilon is
  the largest node's);
* node-level DP-FedAvg (``dp.level = "node"``, sensitivity C / n, all 16 nodes every round) at the
  same epsilons, side by side;
* the full meta-consensus pipeline (Multi-Krum, mixture-NLL weights) under example-level DP at
  epsilon = 3 with 2 ALIE attackers.

Clip norm and learning rate are chosen per epsilon on held-out accuracy with another seed
(``TUNING_SEED``) from ``EXAMPLE_GRID`` (full mode; ``--quick`` uses its first entry and says so).
Target: at epsilon = 3 the consensus reaches at least 80% test accuracy on Fashion-MNIST.
"""

from __future__ import annotations

import functools
import math
import time
from typing import Any, cast

import jax
import numpy as np
import optax

from benchmarks import harness
from benchmarks.harness import (
    add_task_option,
    header,
    iid_clients,
    make_task,
    markdown_table,
    mean_std,
    metrics,
    plot_path,
    pm,
    pretrain,
    pyplot,
    save,
    trainer_for,
    use_task,
)
from consensus import dp_fedavg, privacy_event
from consensus.dp import effective_sampling_rate
from consensus.privacy import PrivacyLedger, calibrate_noise, pld_epsilon, rdp_epsilon

NAME = "privacy_quality"  # privacy_quality_<task> with --task other than digits
DELTA = 1e-5
INF = math.inf
TUNING_SEED = 100  # tuning runs use their own seed (init, client split, sampling), never a reported one
GRID = [
    (0.3, "sgd", 2.0),
    (0.3, "sgd", 1.0),
    (1.0, "sgd", 1.0),
    (1.0, "sgd", 2.0),
    (0.3, "momentum", 0.3),
    (1.0, "momentum", 0.3),
]


def noise_for(epsilon: float, q: float, rounds: int) -> dict[str, float]:
    """z calibrated with RDP for the target, and what both accountants say about it."""
    if epsilon == INF:
        return {"z": 0.0, "rdp_epsilon": INF, "pld_epsilon": INF, "z_pld": 0.0}
    z = calibrate_noise(epsilon, DELTA, q, rounds, "rdp")
    return {
        "z": z,
        "rdp_epsilon": rdp_epsilon(z, q, rounds, DELTA),
        "pld_epsilon": pld_epsilon(z, q, rounds, DELTA),
        "z_pld": calibrate_noise(epsilon, DELTA, q, rounds, "pld"),
    }


@functools.lru_cache(maxsize=16)
def server_optimizer(name: str, learning_rate: float) -> optax.GradientTransformation:
    """The server step on the noised pseudo-gradient: "sgd" (FedAvg) or "momentum" (FedAvgM, 0.9).

    Cached so equal configurations share one object (and one compiled DP round).
    """
    if name == "sgd":
        return optax.sgd(learning_rate)
    if name == "momentum":
        return optax.sgd(learning_rate, momentum=0.9)
    raise ValueError(f"unknown server optimizer {name!r}")


def train_dp(
    epsilon: float,
    z: float,
    seed: int,
    *,
    clients: int,
    q: float,
    rounds: int,
    clip: float,
    server: str,
    server_lr: float,
    local_steps: int,
    local_lr: float,
    hidden: tuple[int, ...] = (),
) -> dict[str, Any]:
    """One DP-FedAvg run; held-out and test metrics of the final global params."""
    task = make_task(hidden=hidden)
    data = task.splits(1, seed=seed)
    pool = iid_clients(data, clients, np.random.default_rng(seed))
    trainer = trainer_for(cast(Any, task), "sgd", int(pool.count.max()))  # (cast: a hashable dataclass)
    pool = trainer.place(pool)
    key = jax.random.key(seed)
    k_init, k_local = jax.random.split(key)
    params = task.init(k_init)
    agg = dp_fedavg(clip, z, sampling_rate=q, server_optimizer=server_optimizer(server, server_lr), key=seed)
    state = agg.init(params)
    ledger = PrivacyLedger(DELTA, budget=None if epsilon == INF else epsilon)
    t0 = time.perf_counter()
    unclipped = []
    for r in range(rounds):
        # Spend before the round runs: the ledger raises PrivacyBudgetExceeded instead of overspending.
        ledger.spend(privacy_event(state))
        nodes = trainer.init(jax.random.fold_in(k_local, r), params, clients)
        nodes, _ = trainer.fit(nodes, pool, local_steps, hyperparams={"learning_rate": local_lr})
        params, state = agg.update(nodes.params, state, params)
        part = np.asarray(state.dp.norms) > 0
        unclipped.append(float(np.mean(np.asarray(state.dp.clip_scale)[part] >= 1.0)) if part.any() else 1.0)
    seconds = time.perf_counter() - t0
    h, t = metrics(task, params, data.heldout), metrics(task, params, data.test)
    return {
        "epsilon_target": epsilon,
        "z": z,
        "seed": seed,
        "clip": clip,
        "server": server,
        "server_lr": server_lr,
        "heldout_acc": h["accuracy"],
        "test_acc": t["accuracy"],
        "test_loss": t["loss"],
        "ledger_epsilon": ledger.epsilon(),
        "ledger_rounds": ledger.rounds,
        "unclipped_fraction": float(np.mean(unclipped)),
        "seconds": seconds,
    }


def central_reference(seed: int, steps: int, hidden: tuple[int, ...] = ()) -> dict[str, float]:
    """The same model trained on the whole training split, no DP and no clipping (Adam)."""
    task = make_task(hidden=hidden)
    data = task.splits(1, seed=seed)
    params = pretrain(task, data.everything(), jax.random.key(seed), steps, 1e-2)
    t = metrics(task, params, data.test)
    return {"test_acc": t["accuracy"], "heldout_acc": metrics(task, params, data.heldout)["accuracy"]}


def plot(res: dict[str, Any]) -> str:
    plt = pyplot()
    st, summary = res["settings"], res["summary"]
    finite = [e for e in st["epsilons"] if e != INF]
    xs = {e: (e if e != INF else 2.5 * max(finite)) for e in st["epsilons"]}
    fig, ax = plt.subplots(figsize=(6.5, 4.2))
    means = [summary[str(e)]["test_acc"][0] for e in st["epsilons"]]
    stds = [summary[str(e)]["test_acc"][1] for e in st["epsilons"]]
    ax.errorbar([xs[e] for e in st["epsilons"]], means, yerr=stds, marker="o", capsize=3, label="DP-FedAvg")
    nonpriv = summary[str(INF)]["test_acc"][0]
    ax.axhline(nonpriv - 0.05, color="r", ls=":", lw=1, label="target: non-private - 5 points")
    ax.axhline(res["central"]["test_acc"][0], color="k", ls="--", lw=1, label="central training, no DP")
    ax.set_xscale("log")
    ax.set_xticks(
        [xs[e] for e in st["epsilons"]], [("inf" if e == INF else f"{e:g}") for e in st["epsilons"]]
    )
    ax.set_xlabel(f"epsilon (delta = {DELTA:g}, RDP)")
    ax.set_ylabel("test accuracy")
    ax.set_title(f"{st['clients']} clients, q = {st['q']:.3g}, {st['rounds']} rounds, mean ± std over seeds")
    ax.legend(fontsize=8)
    fig.tight_layout()
    path = plot_path(NAME, st["quick"])
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path.name


def markdown(res: dict[str, Any]) -> str:
    """The results page of a run, rendered from its result dict (as saved in the JSON).

    Args:
        res: what :func:`main` saves: node-level DP-FedAvg against epsilon (``summary``, ``noise``,
            ``tuning``, ``central``, ``target``), or the example-level layout of ``--example``
            (``rows``; rendered by :func:`example_markdown`).

    Returns:
        The markdown: title, the tables and the target's verdict.
    """
    if "summary" not in res and "rows" in res:
        return example_markdown(res)
    st, summary = res["settings"], res["summary"]
    lines = header("DP-FedAvg: accuracy against epsilon", NAME, st["quick"], st)
    lines.append(
        f"Test accuracy over seeds {st['seeds']} (mean ± std). z from RDP calibration; 'PLD eps' is PLD's "
        "epsilon for the same z, 'z (PLD)' the z a PLD calibration would allow; 'ledger eps' is what the "
        "round-by-round RDP ledger spent."
    )
    lines.append("")
    rows = []
    for e in st["epsilons"]:
        s, nz = summary[str(e)], res["noise"][str(e)]
        fmt = "inf" if e == INF else f"{e:g}"
        rows.append(
            [
                fmt,
                f"{nz['z']:.3f}",
                f"{nz['rdp_epsilon']:.3f}",
                f"{nz['pld_epsilon']:.3f}",
                f"{nz['z_pld']:.3f}",
                f"{s['ledger_epsilon']:.3f}",
                f"C = {s['clip']:g}, {s['server']} eta = {s['server_lr']:g}",
                f"{s['unclipped_fraction']:.2f}",
                pm(s["values"]["heldout_acc"]),
                pm(s["values"]["test_acc"]),
            ]
        )
    lines.append(
        markdown_table(
            [
                "target eps",
                "z",
                "RDP eps",
                "PLD eps",
                "z (PLD)",
                "ledger eps",
                "chosen",
                "unclipped",
                "held-out acc",
                "test acc",
            ],
            rows,
        )
    )
    c = res["central"]
    lines.append(
        f"Central training (no DP, no clipping, Adam, whole training split): test accuracy "
        f"{c['test_acc'][0]:.3f} ± {c['test_acc'][1]:.3f}."
    )
    lines.append("")
    t = res["target"]
    lines.append(
        f"Target (epsilon = 8 within 5 points of non-private): **{'met' if t['met'] else 'not met'}** - "
        f"{t['eps8']:.3f} vs {t['nonprivate']:.3f} ({100 * t['gap']:.1f} points below; "
        f"{100 * t['gap_central']:.1f} points below central training)."
    )
    lines.append("")
    if res["tuning"]:
        seeds = sorted({r["seed"] for r in res["tuning"]})
        lines.append(f"Tuning grid (held-out accuracy, seed {', '.join(map(str, seeds))}; test not used):")
        lines.append("")
        lines.append(
            markdown_table(
                ["target eps", "C", "server", "eta", "held-out acc"],
                [
                    [
                        "inf" if r["epsilon_target"] == INF else f"{r['epsilon_target']:g}",
                        r["clip"],
                        r["server"],
                        r["server_lr"],
                        f"{r['heldout_acc']:.3f}",
                    ]
                    for r in res["tuning"]
                ],
            )
        )
    lines.append(f"Plot: `{res['plot']}`. Total time {res['total_s']:.0f} s.")
    return "\n".join(lines) + "\n"


# (clip norm C, learning rate) of the example-level runs; --quick uses the first only.
EXAMPLE_GRID = [(1.0, 0.01), (0.5, 0.02), (2.0, 0.005)]
EXAMPLE_BASE = [
    "task.options.hidden=[]",
    "task.alpha=1.0",
    "nodes.count=16",
    "nodes.strategies=local",
    "byzantine.nodes=[]",
    "vote.rule=mean",
    "weights.objective=uniform",
    "baseline_fedavg=false",
    "checkpoint_every=0",
    "nodes.batch_size=256",
]


def _example_task() -> str:
    try:
        from strategies.tasks.fashion_mnist import FashionMNISTTask

        FashionMNISTTask().splits(2, seed=0)
        return "fashion_mnist"
    except (ImportError, FileNotFoundError) as e:
        print(f"Fashion-MNIST absent ({e}); example-level runs use digits", flush=True)
        return "digits"


def _system_run(overrides: list[str]) -> dict[str, Any]:
    from meta_consensus import MetaConsensus, config

    cfg = config.load(None, overrides)
    t0 = time.perf_counter()
    result = MetaConsensus(cfg, write=False, progress=False).train()
    last = [h for h in result.history if h.ok][-1]
    return {
        "overrides": overrides,
        "test_acc": last.consensus_accuracy,
        "heldout_acc": last.heldout_accuracy,
        "epsilon": last.epsilon,
        "epsilon_rdp": last.epsilon_rdp,
        "epsilon_pld": last.epsilon_pld,
        "rounds_ok": result.succeeded,
        "stopped": result.stopped,
        "seconds": time.perf_counter() - t0,
    }


def example_level(quick: bool) -> dict[str, Any]:
    task = _example_task()
    rounds, steps = (10, 20) if quick else (20, 20)
    base = [*EXAMPLE_BASE, f"task.name={task}", f"rounds={rounds}", f"nodes.local_steps={steps}"]
    grid = EXAMPLE_GRID[:1] if quick else EXAMPLE_GRID
    seeds = [0] if quick else [0, 1]

    def dp_sets(level: str, eps: float, clip: float) -> list[str]:
        if eps == INF:
            return ["dp.enabled=false"]
        return [
            "dp.enabled=true",
            f"dp.level={level}",
            "dp.noise_multiplier=none",
            f"dp.epsilon={eps}",
            f"dp.clip_norm={clip}",
            f"dp.delta={DELTA}",
        ]

    def tuned(level: str, eps: float, extra: list[str]) -> tuple[float, float]:
        if len(grid) == 1:
            return grid[0]
        runs = [
            (
                _system_run(
                    [
                        *base,
                        *extra,
                        f"seed={TUNING_SEED}",
                        f"nodes.learning_rate={lr}",
                        *dp_sets(level, eps, c),
                    ]
                ),
                (c, lr),
            )
            for c, lr in grid
        ]
        return max(runs, key=lambda r: r[0]["heldout_acc"])[1]

    rows: list[dict[str, Any]] = []
    cases: list[tuple[str, float, list[str]]] = [("example", e, []) for e in (1.0, 3.0, 8.0, INF)]
    cases += [("node", e, []) for e in (1.0, 3.0, 8.0)]
    pipeline = [
        "byzantine.nodes=[14, 15]",
        "byzantine.attack=alie",
        "byzantine.options={z = 10.0}",
        "vote.rule=multi_krum",
        "vote.fault_tolerance=0.125",
        "weights.objective=mixture_nll",
        "weights.max_weight=0.4",
    ]
    cases.append(("example (pipeline, 2 ALIE)", 3.0, pipeline))
    for label, eps, extra in cases:
        level = "node" if label == "node" else "example"
        c, lr = tuned(level, eps, extra)
        runs = [
            _system_run([*base, *extra, f"seed={s}", f"nodes.learning_rate={lr}", *dp_sets(level, eps, c)])
            for s in seeds
        ]
        row = {
            "level": label,
            "target_epsilon": eps,
            "clip": c,
            "learning_rate": lr,
            "test_acc": mean_std([r["test_acc"] for r in runs]),
            "epsilon_rdp": runs[0]["epsilon_rdp"],
            "epsilon_pld": runs[0]["epsilon_pld"],
            "runs": runs,
        }
        rows.append(row)
        print(
            f"{label} eps {eps:g}: test {pm([r['test_acc'] for r in runs])} ({runs[0]['seconds']:.0f} s)",
            flush=True,
        )
    at3 = next(r for r in rows if r["level"] == "example" and r["target_epsilon"] == 3.0)["test_acc"][0]
    return {
        "settings": {
            "task": task,
            "rounds": rounds,
            "local_steps": steps,
            "base": base,
            "grid": grid,
            "seeds": seeds,
            "tuned": len(grid) > 1,
            "tuning_seed": TUNING_SEED,
            "quick": quick,
        },
        "rows": rows,
        "target": {"eps3": at3, "met": bool(task == "fashion_mnist" and at3 >= 0.80)},
    }


def _override(overrides: list[str], key: str) -> str | None:
    """The value ``key=value`` sets in a run's overrides (the last one wins), None if unset."""
    found = [o.split("=", 1)[1] for o in overrides if o.startswith(key + "=")]
    return found[-1] if found else None


def example_markdown(res: dict[str, Any]) -> str:
    """The page of ``--example`` (example-level DP-SGD against node-level DP-FedAvg), from its result dict.

    The setting (nodes, Dirichlet alpha, model, batch, delta) is read from the runs' recorded
    config overrides.

    Args:
        res: what :func:`example_level` returns (``settings``, ``rows``, ``target``).

    Returns:
        The markdown: title, setting, the table of test accuracy per DP level and epsilon and the
        target's verdict.
    """
    st = res["settings"]
    base = list(st["base"])
    setting = [st["task"]]
    nodes, alpha = _override(base, "nodes.count"), _override(base, "task.alpha")
    if nodes is not None:
        setting.append(f"{nodes} nodes")
    if alpha is not None:
        setting.append(f"Dirichlet alpha = {float(alpha):g}")
    if _override(base, "task.options.hidden") == "[]":
        setting.append("softmax regression")
    setting.append(f"{st['rounds']} rounds x {st['local_steps']} local steps")
    batch = _override(base, "nodes.batch_size")
    if batch is not None:
        setting.append(f"batch {batch} (expected)")
    overrides = [run["overrides"] for r in rows_of(res) for run in r["runs"]]
    deltas = sorted({d for o in overrides if (d := _override(o, "dp.delta")) is not None})
    if len(deltas) == 1:  # the runs without DP set none
        setting.append(f"delta = {float(deltas[0]):g}")
    setting.append(f"seeds {st['seeds']}")
    seed = st.get("tuning_seed")  # recorded since; older runs did not name it
    tuned = (
        f"Clip norm and learning rate tuned on held-out accuracy with seed {seed}."
        if seed is not None
        else "Clip norm and learning rate tuned on held-out accuracy with a seed of their own."
    )
    lines = [
        "# Example-level DP-SGD vs node-level DP-FedAvg\n\n",
        f"`python -m benchmarks privacy_quality --example{' --quick' if st['quick'] else ''}`: "
        + ", ".join(setting)
        + ". "
        + (tuned if st["tuned"] else f"Not tuned (quick): clip norm and learning rate {st['grid'][0]}.")
        + "\n\n",
    ]
    table = [
        [
            r["level"],
            _eps(r["target_epsilon"]),
            _eps(r["epsilon_rdp"]) if r["target_epsilon"] != INF else "inf",
            r["clip"],
            r["learning_rate"],
            pm([x["test_acc"] for x in r["runs"]]),
        ]
        for r in rows_of(res)
    ]
    lines.append(
        markdown_table(["DP", "target epsilon", "RDP epsilon (run)", "clip", "lr", "test accuracy"], table)
    )
    t = res["target"]
    lines.append(
        f"\nTarget (example-level, epsilon = 3, >= 0.80 on Fashion-MNIST): {t['eps3']:.3f}, "
        f"**{'met' if t['met'] else 'not met'}**.\n"
    )
    return "".join(lines)


def rows_of(res: dict[str, Any]) -> list[dict[str, Any]]:
    return res["rows"]


def _eps(e: float) -> str:
    return "inf" if e == INF else f"{e:.3g}"


def main(argv: list[str] | None = None) -> dict[str, Any]:
    global NAME
    parser = harness.parser(__doc__, "fewer rounds, one seed, no tuning")
    add_task_option(parser)
    parser.add_argument("--example", action="store_true", help="example-level DP-SGD vs node-level DP-FedAvg")
    args = harness.parse(parser, argv)
    if args.example:
        ex = example_level(args.quick)
        jpath, mpath = harness.save(
            "privacy_quality_example", args.quick, ex, markdown(ex), settings=ex["settings"]
        )
        print(f"wrote {jpath} and {mpath}")
        return ex
    NAME = use_task(args.task, "privacy_quality")
    q_nominal = 0.1
    settings = dict(
        task=args.task,
        quick=args.quick,
        epsilons=[1.0, 3.0, 8.0, INF],
        delta=DELTA,
        clients=400,
        q=effective_sampling_rate(q_nominal),
        rounds=100 if args.quick else 200,
        local_steps=10,
        local_lr=0.3,
        seeds=[0] if args.quick else [0, 1, 2],
        # (clip norm C, server optimizer, server learning rate eta); quick mode runs the first only.
        grid=GRID[:1] if args.quick else GRID,
        model="softmax regression (DigitsTask(hidden=())), d = 650"
        if args.task == "digits"
        else f"softmax regression ({args.task}, hidden=())",
        local_optimizer="SGD, batch = a client's shard size (drawn with replacement)",
    )
    common = {k: settings[k] for k in ("clients", "q", "rounds", "local_steps", "local_lr")}
    t0 = time.perf_counter()
    noise = {str(e): noise_for(e, settings["q"], settings["rounds"]) for e in settings["epsilons"]}
    tuning, chosen = [], {}
    grid = settings["grid"]
    for e in settings["epsilons"]:
        z = noise[str(e)]["z"]
        if len(grid) == 1:
            chosen[str(e)] = grid[0]
            continue
        runs = [train_dp(e, z, TUNING_SEED, clip=c, server=o, server_lr=lr, **common) for c, o, lr in grid]
        tuning += runs
        best = max(runs, key=lambda r: r["heldout_acc"])
        chosen[str(e)] = (best["clip"], best["server"], best["server_lr"])
        print(f"tuned eps {e:g}: {chosen[str(e)]}", flush=True)
    summary: dict[str, Any] = {}
    for e in settings["epsilons"]:
        c, o, lr = chosen[str(e)]
        z = noise[str(e)]["z"]
        runs = [train_dp(e, z, s, clip=c, server=o, server_lr=lr, **common) for s in settings["seeds"]]
        summary[str(e)] = {
            "clip": c,
            "server": o,
            "server_lr": lr,
            "test_acc": mean_std([r["test_acc"] for r in runs]),
            "ledger_epsilon": runs[0]["ledger_epsilon"],
            "unclipped_fraction": float(np.mean([r["unclipped_fraction"] for r in runs])),
            "values": {k: [r[k] for r in runs] for k in ("heldout_acc", "test_acc", "test_loss", "seconds")},
            "runs": runs,
        }
        print(f"eps {e:g}: test {pm(summary[str(e)]['values']['test_acc'])}", flush=True)
    central = [central_reference(s, 1000 if not args.quick else 500) for s in settings["seeds"]]
    eps8, nonpriv = summary[str(8.0)]["test_acc"][0], summary[str(INF)]["test_acc"][0]
    res: dict[str, Any] = {
        "settings": settings,
        "noise": noise,
        "tuning": tuning,
        "summary": summary,
        "central": {"test_acc": mean_std([c["test_acc"] for c in central])},
    }
    res["target"] = {
        "eps8": eps8,
        "nonprivate": nonpriv,
        "gap": nonpriv - eps8,
        "gap_central": res["central"]["test_acc"][0] - eps8,
        "met": bool(nonpriv - eps8 <= 0.05),
    }
    res["plot"] = plot(res)
    res["total_s"] = time.perf_counter() - t0
    md = markdown(res)
    save(NAME, args.quick, res, md)
    print(md)
    return res


if __name__ == "__main__":
    main()
