"""Byzantine robustness with client sampling: 25% of the clients Byzantine, m = 50 sampled per round.

Run ``python -m benchmarks robustness_sampled [--quick]``. Writes
benchmarks/results/robustness_sampled.json and .md (``robustness_sampled_quick.*`` with --quick).

The whole system (``MetaConsensus``) on N = 200 digits clients (IID shards of about 6 examples,
``benchmarks.harness.ManyClientDigits``, an MLP with 32 hidden units), every 4th client
Byzantine (50 of 200), ``nodes.sampling = "uniform"`` with m = 50 per round. The vote's f is
``floor(fault_tolerance * answered)`` over the sample: ``fault_tolerance = 0.3`` gives f = 15 of 50,
above the expected 12.5 Byzantine clients of a sample, since the count is hypergeometric (sd about
2.7) and ``0.25`` would leave about half the rounds with more Byzantine clients than f; the report
gives the share of rounds whose sample held more than f. ``weights.objective = "vote"`` (the
rule's output is the consensus) so the rule alone is measured.

Attacks at the robustness benchmark's strengths (ALIE z = 1.5, IPM epsilon = 2, sign flip,
Gaussian, label flipping); a rule's worst case is its lowest final test accuracy over them,
next to clean FedAvg (no Byzantine client, the mean) of the same sampling.
"""

from __future__ import annotations

import math
import tempfile
import time
from typing import Any, cast

import numpy as np

from benchmarks import harness
from benchmarks.harness import ManyClientDigits, markdown_table
from meta_consensus import MetaConsensus, config

N, M, BYZANTINE_EVERY, FAULT_TOLERANCE = 200, 50, 4, 0.3
ATTACKS: dict[str, tuple[str, dict[str, float]]] = {
    "alie": ("alie", {"z": 1.5}),
    "ipm": ("ipm", {"epsilon": 2.0}),
    "sign_flip": ("sign_flip", {}),
    "gaussian": ("gaussian", {}),
    "label_flip": ("label_flip", {}),
}
RULES = ("mean", "median", "trimmed_mean", "multi_krum", "geometric_median")


def _options(opts: dict[str, float]) -> str:
    return "{" + ", ".join(f"{k} = {v}" for k, v in opts.items()) + "}"


def run(rule: str, attack: str | None, rounds: int, seed: int, out: str) -> dict[str, Any]:
    byz = list(range(0, N, BYZANTINE_EVERY)) if attack is not None else []
    sets = [
        f"name={rule}_{attack}_{seed}",
        f"output_dir={out}",
        f"seed={seed}",
        f"rounds={rounds}",
        f"task.data_seed={seed}",
        "task.options.hidden=[32]",
        f"nodes.count={N}",
        "nodes.strategies=local",
        "nodes.local_steps=10",
        "nodes.batch_size=8",
        "nodes.sampling=uniform",
        f"nodes.per_round={M}",
        f"nodes.chunk={M}",
        f"byzantine.nodes={byz}",
        f"vote.rule={rule}",
        f"vote.fault_tolerance={FAULT_TOLERANCE}",
        "weights.objective=vote",
        "baseline_fedavg=false",
        "checkpoint_every=0",
        f"eval_every={rounds}",
        "min_answers=0.5",
        "consensus_threshold=0.1",
        "max_retries=0",
    ]
    if attack is not None:
        name, opts = ATTACKS[attack]
        sets += [f"byzantine.attack={name}", f"byzantine.options={_options(opts)}"]
    cfg = config.load(None, sets)
    t0 = time.perf_counter()
    task = cast(Any, ManyClientDigits(hidden=(32,)))  # a DigitsTask; its name is a read-only property
    result = MetaConsensus(cfg, task=task, write=False, progress=False).train()
    is_byz = set(byz)
    f = math.floor(FAULT_TOLERANCE * M)
    in_sample = [sum(i in is_byz for i in h.sampled) for h in result.history]
    return {
        "rule": rule,
        "attack": attack or "none",
        "seed": seed,
        "test_acc": result.history[-1].consensus_accuracy,
        "failed_rounds": sum(not h.ok for h in result.history),
        "byzantine_in_sample_mean": float(np.mean(in_sample)),
        "byzantine_in_sample_max": int(np.max(in_sample)),
        "rounds_over_f": float(np.mean([b > f for b in in_sample])),
        "seconds": time.perf_counter() - t0,
    }


def markdown(res: dict[str, Any]) -> str:
    """The results page of a run, rendered from its result dict (as saved in the JSON).

    Args:
        res: the dict :func:`main` returns and saves: ``settings``, the ``clean`` run and the
            attacked ``runs``.

    Returns:
        The markdown: title, the setting, the table of final test accuracies per rule and attack
        (worst case and drop from clean FedAvg) and the Byzantine share of the samples.
    """
    s, clean, runs = res["settings"], res["clean"], res["runs"]
    rules, attacks, m = s["rules"], s["attacks"], s["m"]
    f = math.floor(s["fault_tolerance"] * m)
    every = s.get("byzantine_every")  # recorded since; older runs did not say which clients
    table = []
    for rule in rules:
        mine = {r["attack"]: r for r in runs if r["rule"] == rule}
        worst = min(mine.values(), key=lambda r: r["test_acc"])
        table.append(
            [rule]
            + [f"{mine[a]['test_acc']:.3f}" + ("" if not mine[a]["failed_rounds"] else "*") for a in attacks]
            + [
                f"{worst['test_acc']:.3f} ({worst['attack']})",
                f"{clean['test_acc'] - worst['test_acc']:+.3f}",
            ]
        )
    over = float(np.mean([r["rounds_over_f"] for r in runs]))
    byz_mean = float(np.mean([r["byzantine_in_sample_mean"] for r in runs]))
    byz_max = max(r["byzantine_in_sample_max"] for r in runs)
    share = f"{1 / every:.0%} Byzantine clients" if every else "Byzantine clients"
    nth = {1: "", 2: "2nd", 3: "3rd"}.get(every, f"{every}th") if every else ""
    which = (
        f"every {nth} Byzantine".replace("every  ", "every ") if every else "a fixed set of them Byzantine"
    )
    return "\n".join(
        [
            f"# Robustness with client sampling: {share}, m = {m} per round",
            "",
            f"N = {s['N']} digits clients (IID shards), {which},",
            f"m = {m} sampled uniformly per round, f = floor({s['fault_tolerance']} x answered) = {f};",
            f"{s['rounds']} rounds, seed {clean['seed']}; final test accuracy of the consensus "
            "(the rule's output).",
            "'*': some rounds failed (the previous consensus was kept).",
            "",
            markdown_table(["rule", *attacks, "worst case (attack)", "drop from clean"], table),
            "",
            f"Clean FedAvg (no Byzantine client, same sampling): {clean['test_acc']:.3f}.",
            f"Byzantine clients per sample: mean {byz_mean:.1f}, max {byz_max}; share of rounds whose sample",
            f"held more than f: {over:.1%} (the rule's guarantee does not hold in those rounds). The",
            "sample depends on the seed and round only, so every run of the table sees the same samples.",
            "",
        ]
    )


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = harness.parse(harness.parser(__doc__, "8 rounds, three rules, three attacks"), argv)
    rounds = 8 if args.quick else 20
    rules = ("mean", "median", "multi_krum") if args.quick else RULES
    attacks = ("alie", "ipm", "sign_flip") if args.quick else tuple(ATTACKS)
    seed = 0
    runs = []
    with tempfile.TemporaryDirectory() as tmp:
        clean = run("mean", None, rounds, seed, tmp)
        print(f"clean mean: {clean['test_acc']:.3f}", flush=True)
        for rule in rules:
            for attack in attacks:
                runs.append(run(rule, attack, rounds, seed, tmp))
                r = runs[-1]
                print(f"{rule} / {attack}: {r['test_acc']:.3f} ({r['failed_rounds']} failed)", flush=True)
    res: dict[str, Any] = {
        "settings": {
            "quick": args.quick,
            "N": N,
            "m": M,
            "rounds": rounds,
            "rules": list(rules),
            "attacks": list(attacks),
            "fault_tolerance": FAULT_TOLERANCE,
            "byzantine_every": BYZANTINE_EVERY,
        },
        "clean": clean,
        "runs": runs,
    }
    md = markdown(res)
    harness.save("robustness_sampled", args.quick, res, md, settings=res["settings"])
    print(md)
    return res


if __name__ == "__main__":
    main()
