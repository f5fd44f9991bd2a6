"""The robust preset's vote and weights, chosen through the system itself (``configs/robust.toml``).

Run ``python -m benchmarks robust_preset [--quick] [--task fashion_mnist] [--alpha A] [--seeds 0,1]``. Writes
benchmarks/results/robust_preset.json and robust_preset.md (``robust_preset_quick.*`` with
``--quick``: four candidates, one reported seed). With ``--task fashion_mnist`` nothing is selected:
the preset as shipped (``PRESET_CANDIDATE``), plain FedAvg, the vote-only DnC and the oracle are
reported on Fashion-MNIST (``robust_preset_fashion_mnist.*``); with ``--alpha A``, the same at another
Dirichlet alpha (``robust_preset_alpha<A>.*``).

``benchmarks.quality.robustness`` compares the rules inside its own FedAvg loop (plain SGD nodes). The
preset, however, runs through ``meta-consensus run`` (Adam nodes, the system's round), where a rule
can behave differently: FLTrust, the benchmark's choice, rescales every update to the server's
norm, which costs several points even without attackers in the system. So the preset is chosen
here, through :class:`meta_consensus.MetaConsensus` with the preset's config and only the vote
and the weights changed: every candidate (a vote alone, or a vote followed by convex weights on
the coordinator's held-out data) under every attack at alpha = 0.3, f = 4 of 16 on seed 100, by
its worst-case *held-out* accuracy over the attacks (on the held-out rows outside the root set,
the same rows for every candidate); the choice (and plain FedAvg, the benchmark's
choice FLTrust, the vote-only DnC and NNM + centered clipping) are then reported on seeds 0, 1, 2,
which the selection does not use. Target (issue 17): within 3 points of clean FedAvg under every
attack. The reference row "oracle" is the plain mean of the 12 honest nodes (the 4 Byzantine
nodes send NaN, which the mean drops): what a rule that removed exactly the attackers would
score, i.e. the price of losing the attackers' data.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from benchmarks import harness
from benchmarks.harness import add_task_option, markdown_table, use_task
from meta_consensus import config

PRESET = "configs/robust.toml"
ATTACKS = [
    "sign_flip",
    "gaussian",
    "alie",
    "ipm",
    "mimic",
    "label_flip",
    "min_max",
    "min_sum",
    "fltrust_aware",
]
_CC = "{clip_radius = 1.0, iterations = 3}"


def _vote(rule: str, pre: str = "", options: str = "{}", f: str = "4") -> list[str]:
    """The --set overrides of the preset's vote (``f="none"`` where the rule takes no f), no weights."""
    pre_list = f'["{pre}"]' if pre else "[]"
    return [
        f"vote.rule={rule}", f"vote.pre={pre_list}", f"vote.options={options}", f"vote.num_byzantine={f}",
        "weights.objective=vote", "weights.max_weight=none", "weights.lambda_reg=0.0", "vote.server_step=0",
    ]  # fmt: skip


# Convex weights on the coordinator's held-out data over the nodes the vote accepted: the
# trust-region quadratic model of the held-out loss, no cap, a ridge towards uniform (so that
# honest nodes the held-out set cannot tell apart keep equal shares).
_QUADRATIC = ["weights.objective=quadratic", "weights.max_weight=none", "weights.lambda_reg=0.1"]
_MIXTURE = ["weights.objective=mixture_nll", "weights.max_weight=0.4", "weights.lambda_reg=0.0"]


def _weighted(vote: list[str], weights: list[str]) -> list[str]:
    return [s for s in vote if not s.startswith("weights.")] + weights


# The vote (and weights) of each candidate as --set overrides of the preset.
CANDIDATES: dict[str, list[str]] = {
    "mean": _vote("mean", f="none"),
    "median": _vote("median"),
    "trimmed_mean": _vote("trimmed_mean"),
    "multi_krum": _vote("multi_krum"),
    "geometric_median": _vote("geometric_median", f="none"),
    "centered_clipping": _vote("centered_clipping", options=_CC, f="none"),
    "nnm+centered_clipping": _vote("centered_clipping", pre="nnm", options=_CC),
    "nnm+trimmed_mean": _vote("trimmed_mean", pre="nnm"),
    "fltrust": _vote("fltrust", f="none"),
    "server_monna": _vote("server_monna"),
    "signguard": _vote("signguard"),
    "dnc": _vote("dnc"),
    "caf": _vote("caf"),
    "meamed": _vote("meamed"),
    # The same votes followed by held-out weights (coordinate-wise votes accept every node, so
    # "mean" stands for all of them there).
    "mean+quadratic": _weighted(_vote("mean", f="none"), _QUADRATIC),
    "multi_krum+quadratic": _weighted(_vote("multi_krum"), _QUADRATIC),
    "signguard+quadratic": _weighted(_vote("signguard"), _QUADRATIC),
    "dnc+quadratic": _weighted(_vote("dnc"), _QUADRATIC),
    "caf+quadratic": _weighted(_vote("caf"), _QUADRATIC),
    "dnc+mixture_nll": _weighted(_vote("dnc"), _MIXTURE),
    # The coordinator's own update on its root set added after the merge (vote.server_step):
    # its clean data fills what the merge of the honest nodes lacks (the attackers' shards).
    **{
        f"dnc+quadratic+server_{step}": [*_weighted(_vote("dnc"), _QUADRATIC), f"vote.server_step={step}"]
        for step in (0.25, 0.5, 0.75)
    },
    "dnc+server_0.5": [*_vote("dnc"), "vote.server_step=0.5"],
}
QUICK_CANDIDATES = ("mean", "nnm+centered_clipping", "dnc", "dnc+quadratic+server_0.25")
PRESET_CANDIDATE = "dnc+quadratic+server_0.25"  # what configs/robust.toml ships (a test checks they agree)
SELECTION_SEED = 100


def run_once(sets: list[str]) -> tuple[float, float]:
    """(test accuracy, held-out accuracy) of the consensus after the preset's last round.

    The held-out accuracy is on the same rows for every candidate: the held-out split less
    the root set that ``vote.root_size`` draws from the seed, which the candidates with a
    server (FLTrust, server MoNNA, ``vote.server_step``) train on and the others do not use.
    """
    import jax
    import jax.numpy as jnp

    from meta_consensus import MetaConsensus, config
    from meta_consensus.server import split_root

    cfg = config.load(PRESET, ["checkpoint_every=0", "baseline_fedavg=false", *sets])
    run = MetaConsensus(cfg, write=False, progress=False)
    result = run.train()
    last = [h for h in result.history if h.ok][-1]
    co = run.coordinator
    heldout = co.fleet.data.heldout  # already without the root set when the run has a server
    if co.server is None:
        heldout = split_root(heldout, cfg.vote.root_size, cfg.seed)[1]
    batch = {k: jnp.asarray(v) for k, v in heldout.items()}
    common = jax.jit(co.fleet.task.metrics)(result.consensus_params, batch)["accuracy"]
    return float(last.consensus_accuracy), float(common)


def extra_rounds(rounds: int | None) -> list[str]:
    return [] if rounds is None else [f"rounds={rounds}"]


def sweep(
    name: str, seed: int, rounds: int | None, task_sets: Sequence[str] = ()
) -> dict[str, tuple[float, float]]:
    """Clean ('none') and every attack, one candidate, one seed."""
    extra = [*extra_rounds(rounds), *task_sets]
    out = {}
    for attack in ["none", *ATTACKS]:
        byz = ["byzantine.nodes=[]"] if attack == "none" else [f"byzantine.attack={attack}"]
        out[attack] = run_once([f"seed={seed}", *CANDIDATES[name], *byz, *extra])
    return out


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = harness.parser(__doc__, "four candidates, one reported seed, 8 rounds")
    add_task_option(parser)
    parser.add_argument(
        "--seeds", default=None, help="the reported seeds, comma-separated (default 0,1,2; --quick: 0)"
    )
    parser.add_argument(
        "--alpha", type=float, default=None,
        help="report the shipped preset at this Dirichlet alpha (no selection; default: the preset's 0.3)",
    )  # fmt: skip
    args = harness.parse(parser, argv)
    name_of_results = use_task(args.task, "robust_preset")
    task_sets = [] if args.task == "digits" else [f"task.name={args.task}"]
    if args.alpha is not None:
        if not args.alpha > 0:
            parser.error(f"--alpha: need > 0, got {args.alpha}")
        task_sets.append(f"task.alpha={args.alpha:g}")
        name_of_results += f"_alpha{args.alpha:g}"
    names = list(QUICK_CANDIDATES if args.quick else CANDIDATES)
    if args.seeds is not None:
        try:
            seeds = [int(v) for v in args.seeds.split(",")]
        except ValueError:
            parser.error(f"--seeds: comma-separated integers, got {args.seeds!r}")
        if SELECTION_SEED in seeds:
            parser.error(f"--seeds: {SELECTION_SEED} is the selection seed; report on others")
    else:
        seeds = [0] if args.quick else [0, 1, 2]
    rounds = 8 if args.quick else None
    t0 = time.perf_counter()
    selection = {}
    if task_sets:  # another task or alpha: the preset as shipped, no selection
        chosen = PRESET_CANDIDATE
        shown = [chosen, "mean", "dnc"]
    else:
        for name in names:
            runs = sweep(name, SELECTION_SEED, rounds)
            worst = min(runs[a][1] for a in ATTACKS)
            mean = float(np.mean([runs[a][1] for a in ATTACKS]))
            selection[name] = {
                "worst_heldout": worst, "mean_heldout": mean, "clean_heldout": runs["none"][1], "runs": runs,
            }  # fmt: skip
            print(f"{name:24s} worst held-out {worst:.3f} ({time.perf_counter() - t0:.0f} s)", flush=True)
        # The best worst case; ties (the held-out set has a few dozen rows) go to the best mean
        # over the attacks, then to the first candidate.
        chosen = max(selection, key=lambda k: (selection[k]["worst_heldout"], selection[k]["mean_heldout"]))
        shown = list(
            dict.fromkeys([chosen, "mean", "fltrust", "dnc", "dnc+quadratic", "nnm+centered_clipping"])
        )
        shown = [s for s in shown if s in names]
    report = {name: {str(s): sweep(name, s, rounds, task_sets) for s in seeds} for name in shown}
    oracle = {
        str(s): run_once(
            [
                f"seed={s}",
                *CANDIDATES["mean"],
                "byzantine.attack=nonfinite",
                *extra_rounds(rounds),
                *task_sets,
            ]
        )[0]
        for s in seeds
    }
    # What the page says about the runs: the preset's nodes, attackers and alpha as this run loaded them.
    cfg = config.load(PRESET, task_sets)
    settings: dict[str, Any] = {
        "quick": args.quick,
        "seeds": seeds,
        "task": args.task,
        "alpha": cfg.task.alpha,
        "nodes": cfg.nodes.count,
        "byzantine": len(cfg.byzantine.nodes),
    }
    if selection:
        settings["selection_seed"] = SELECTION_SEED
    res = {
        "selection": selection, "chosen": chosen, "sets": CANDIDATES[chosen], "report": report,
        "oracle": oracle, "seeds": seeds, "rounds": rounds, "total_s": time.perf_counter() - t0,
    }  # fmt: skip
    md = markdown({**res, "settings": settings})
    harness.save(name_of_results, args.quick, res, md, settings=settings)
    print(md)
    return res


def _alpha(res: Mapping[str, Any]) -> float | None:
    """The Dirichlet alpha of the run: recorded in its settings, else its ``--alpha`` (None: unknown)."""
    st = res.get("settings", {})
    if "alpha" in st:
        return float(st["alpha"])
    argv = [str(a) for a in res.get("argv", [])]
    for i, a in enumerate(argv):
        if a == "--alpha" and i + 1 < len(argv):
            return float(argv[i + 1])
        if a.startswith("--alpha="):
            return float(a.split("=", 1)[1])
    return None


def markdown(res: Mapping[str, Any]) -> str:
    """The results page of a run of this benchmark, rendered from its result file.

    Both layouts: with the selection on digits (``robust_preset.json``) and the shipped preset
    reported without one (another task or alpha: ``selection`` is empty). Settings that older
    result files did not record (alpha, the numbers of nodes and attackers, the selection seed,
    the total time) are named without a number there.

    Args:
        res: the result dict as saved (``selection``, ``chosen``, ``report``, ``oracle``,
            ``seeds``, ``settings``).

    Returns:
        The markdown: title, run header, the selection table (if any), the test accuracy of
        the reported merges under every attack and clean FedAvg.
    """
    st = res.get("settings", {})
    seeds = [str(s) for s in res["seeds"]]
    report, selection, chosen = res["report"], res["selection"], res["chosen"]
    attacks = [a for a in report[chosen][seeds[0]] if a != "none"]
    clean = np.array([report["mean"][s]["none"][0] for s in seeds])
    rows = []
    for name in report:
        worst = np.array([min(report[name][s][a][0] for a in attacks) for s in seeds])
        gap = (clean - worst) * 100
        per_attack = [np.mean([report[name][s][a][0] for s in seeds]) for a in attacks]
        rows.append(
            [name + (" (chosen)" if name == chosen else ""), float(np.mean(worst)), float(np.max(gap))]
            + [float(v) for v in per_attack]
        )
    nodes, byz = st.get("nodes"), st.get("byzantine")
    honest = (
        f"the {nodes - byz} honest nodes" if nodes is not None and byz is not None else "the honest nodes"
    )
    oracle_acc = np.array([res["oracle"][s] for s in seeds])
    rows.append(
        [f"oracle: mean of {honest}", float(np.mean(oracle_acc)), float(np.max((clean - oracle_acc) * 100))]
        + ["-"] * len(attacks)
    )
    alpha = _alpha(res)
    task = st.get("task", "digits")
    sel_seed = st.get("selection_seed")
    lines = harness.header(
        "The robust preset's vote and weights, chosen through the system",
        "robust_preset",
        bool(st.get("quick", False)),
        st,
    )
    who = (f"{nodes} " if nodes is not None else "") + f"{task} nodes"
    lines += [
        f"`{PRESET}` with only the vote and the weights changed: {who}, "
        + (f"alpha = {alpha:g}" if alpha is not None else "the preset's Dirichlet alpha")
        + ", "
        + (f"{byz} Byzantine" if byz is not None else "the preset's Byzantine nodes")
        + f"; {len(attacks)} attacks ({', '.join(attacks)}); reported on seeds {res['seeds']}. "
        + (
            "Selection on "
            + (f"seed {sel_seed}" if sel_seed is not None else "a seed apart from these")
            + " by worst-case held-out accuracy:"
            if selection
            else "No selection on this task: the preset as shipped (its vote, weights and step chosen on "
            "digits, its root-set share of the held-out rows on Fashion-MNIST seed 100; see "
            "configs/robust.toml)."
        ),
        "",
    ]
    if selection:
        lines.append(
            markdown_table(
                [
                    "candidate",
                    f"worst held-out (seed {sel_seed})" if sel_seed is not None else "worst held-out",
                    "mean over attacks",
                    "clean held-out",
                ],
                [
                    [k, v["worst_heldout"], v["mean_heldout"], v["clean_heldout"]]
                    for k, v in selection.items()
                ],
            )
        )
    lines += [
        ("Chosen" if selection else "The preset")
        + f": **{chosen}**. Test accuracy on the reported seeds (mean over seeds; gap = the largest "
        "drop over seeds of the worst attack below clean FedAvg of the same seed, in points; target 3):",
        "",
        markdown_table(["vote", "worst (mean)", "gap (points)", *attacks], rows),
        f"Clean FedAvg (the plain mean without attackers): {np.mean(clean):.3f}."
        + (f" Total time {res['total_s']:.0f} s." if "total_s" in res else ""),
    ]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
