"""The robust preset's vote and weights, chosen through the system itself (``configs/robust.toml``).

Run ``python -m benchmarks.robust_preset [--quick] [--task fashion_mnist]``. Writes
benchmarks/results/robust_preset.json and robust_preset.md (``robust_preset_quick.*`` with
``--quick``: four candidates, one reported seed). With ``--task fashion_mnist`` nothing is selected:
the preset as shipped (``PRESET_CANDIDATE``), plain FedAvg, the vote-only DnC and the oracle are
reported on Fashion-MNIST (``robust_preset_fashion_mnist.*``).

``benchmarks.robustness`` compares the rules inside its own FedAvg loop (plain SGD nodes). The
preset, however, runs through ``meta-consensus run`` (Adam nodes, the system's round), where a rule
can behave differently: FLTrust, the benchmark's choice, rescales every update to the server's
norm, which costs several points even without attackers in the system. So the preset is chosen
here, through :class:`meta_consensus.MetaConsensus` with the preset's config and only the vote
and the weights changed: every candidate (a vote alone, or a vote followed by convex weights on
the coordinator's held-out data) under every attack at alpha = 0.3, f = 4 of 16 on seed 100, by
its worst-case *held-out* accuracy over the attacks; the choice (and plain FedAvg, the benchmark's
choice FLTrust, the vote-only DnC and NNM + centered clipping) are then reported on seeds 0, 1, 2,
which the selection does not use. Target (issue 17): within 3 points of clean FedAvg under every
attack. The reference row "oracle" is the plain mean of the 12 honest nodes (the 4 Byzantine
nodes send NaN, which the mean drops): what a rule that removed exactly the attackers would
score, i.e. the price of losing the attackers' data.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import numpy as np

from benchmarks import harness
from benchmarks.harness import markdown_table
from benchmarks.quality_common import add_task_option, use_task

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
        "weights.objective=vote", "weights.max_weight=none", "weights.lambda_reg=0.0",
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
}
QUICK_CANDIDATES = ("mean", "nnm+centered_clipping", "dnc", "dnc+quadratic")
PRESET_CANDIDATE = "dnc+quadratic"  # what configs/robust.toml ships (a test checks they agree)
SELECTION_SEED = 100


def run_once(sets: list[str]) -> tuple[float, float]:
    """(test accuracy, held-out accuracy) of the consensus after the preset's last round."""
    from meta_consensus import MetaConsensus, config

    cfg = config.load(PRESET, ["checkpoint_every=0", "baseline_fedavg=false", *sets])
    result = MetaConsensus(cfg, write=False, progress=False).train()
    last = [h for h in result.history if h.ok][-1]
    return float(last.consensus_accuracy), float(last.heldout_accuracy)


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
    args = harness.parse(parser, argv)
    name_of_results = use_task(args.task, "robust_preset")
    task_sets = [] if args.task == "digits" else [f"task.name={args.task}"]
    names = list(QUICK_CANDIDATES if args.quick else CANDIDATES)
    seeds = [0] if args.quick else [0, 1, 2]
    rounds = 8 if args.quick else None
    t0 = time.perf_counter()
    selection = {}
    if task_sets:  # another task: the preset as shipped, no selection
        chosen = PRESET_CANDIDATE
        shown = [chosen, "mean", "dnc"]
    else:
        for name in names:
            runs = sweep(name, SELECTION_SEED, rounds)
            worst = min(runs[a][1] for a in ATTACKS)
            selection[name] = {"worst_heldout": worst, "clean_heldout": runs["none"][1], "runs": runs}
            print(f"{name:24s} worst held-out {worst:.3f} ({time.perf_counter() - t0:.0f} s)", flush=True)
        chosen = max(selection, key=lambda k: selection[k]["worst_heldout"])  # first on ties
        shown = list(dict.fromkeys([chosen, "mean", "fltrust", "dnc", "nnm+centered_clipping"]))
        shown = [s for s in shown if s in names]
    report = {name: {str(s): sweep(name, s, rounds, task_sets) for s in seeds} for name in shown}
    clean = np.array([report["mean"][str(s)]["none"][0] for s in seeds])
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
    rows = []
    for name in shown:
        worst = np.array([min(report[name][str(s)][a][0] for a in ATTACKS) for s in seeds])
        gap = (clean - worst) * 100
        per_attack = [np.mean([report[name][str(s)][a][0] for s in seeds]) for a in ATTACKS]
        rows.append(
            [name + (" (chosen)" if name == chosen else ""), float(np.mean(worst)), float(np.max(gap))]
            + [float(v) for v in per_attack]
        )
    oracle_acc = np.array([oracle[str(s)] for s in seeds])
    rows.append(
        [
            "oracle: mean of the 12 honest nodes",
            float(np.mean(oracle_acc)),
            float(np.max((clean - oracle_acc) * 100)),
        ]
        + ["-"] * len(ATTACKS)
    )
    mach = harness.machine()
    md = [
        "# The robust preset's vote and weights, chosen through the system\n\n",
        f"Command: `{harness.command('robust_preset', args.quick)}`. "
        f"Machine: {mach['processor']}, {mach['cpu_count']} CPUs, jax {mach['jax']}.\n\n",
        f"`{PRESET}` with only the vote and the weights changed: 16 {args.task} nodes, alpha = 0.3, "
        f"4 Byzantine; {len(ATTACKS)} attacks ({', '.join(ATTACKS)}); reported on seeds {seeds}. "
        + (
            f"Selection on seed {SELECTION_SEED} by worst-case held-out accuracy:\n\n"
            if selection
            else "No selection on this task: the preset as shipped (chosen on digits).\n\n"
        ),
        markdown_table(
            ["candidate", "worst held-out (seed 100)", "clean held-out"],
            [[k, v["worst_heldout"], v["clean_heldout"]] for k, v in selection.items()],
        )
        if selection
        else "",
        "\n"
        + ("Chosen" if selection else "The preset")
        + f": **{chosen}**. Test accuracy on the reported seeds (mean over seeds; gap = the largest "
        "drop over seeds of the worst attack below clean FedAvg of the same seed, in points; target 3):\n\n",
        markdown_table(["vote", "worst (mean)", "gap (points)", *ATTACKS], rows),
        f"\nClean FedAvg (the plain mean without attackers): {np.mean(clean):.3f}. "
        f"Total time {time.perf_counter() - t0:.0f} s.\n",
    ]
    res = {
        "selection": selection, "chosen": chosen, "sets": CANDIDATES[chosen], "report": report,
        "oracle": oracle, "seeds": seeds, "rounds": rounds,
    }  # fmt: skip
    harness.save(
        name_of_results,
        args.quick,
        res,
        "".join(md),
        settings={"quick": args.quick, "seeds": seeds, "task": args.task},
    )
    print("".join(md))
    return res


if __name__ == "__main__":
    main()
