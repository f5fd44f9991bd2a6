"""The attack suite: the default, each preset and plain FedAvg under every attack, two alphas, three seeds.

Run ``python -m benchmarks attack_suite [--quick]`` (the report) or ``python -m benchmarks attack_suite
--select default`` / ``noserver`` / ``private`` (the selection of ``meta_consensus/default.toml``'s,
``configs/robust-noserver.toml``'s or ``configs/private.toml``'s vote, weights and server step).
Writes benchmarks/results/attack_suite.json and .md (``attack_suite_select_<which>.*`` for a
selection; ``_quick`` with ``--quick``).

Every run goes through :class:`meta_consensus.MetaConsensus` with the config's own file and
``--set`` overrides: the attack (``byzantine.attack`` and its options; clean is
``byzantine.nodes=[]``), the Dirichlet alpha, the seed. Every run has ``baseline_fedavg = true``:
plain FedAvg runs alongside on the same nodes, shards and keys, under the same attack, so each run
gives the consensus and FedAvg side by side. "Clean FedAvg" is FedAvg in the clean run of the same
config, alpha and seed. The suite: clean, mimic, ALIE (its z_max, and z = 10), IPM (epsilon 0.1
and 2), sign flip (scale 1 and 4), label flip, min-max, min-sum, Gaussian (std 1 and 0.1).

Compiled functions are reused across the runs of one process (the same config shapes hit jax's
caches), which is what keeps the suite within its CPU budget. The selection runs on seed 100 with
``task.data_seed = 100`` (another node split), which the reported runs (seeds 0-2, data_seed 0)
do not use.
"""

from __future__ import annotations

import json
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks import harness
from benchmarks.harness import add_task_option, markdown_table, use_task

# (label, attack, options as an inline TOML table). The first strength of an attack is its default.
SUITE: list[tuple[str, str, str]] = [
    ("clean", "none", "{}"),
    ("mimic", "mimic", "{}"),
    ("alie", "alie", "{}"),
    ("alie z=10", "alie", "{z = 10.0}"),
    ("ipm", "ipm", "{}"),
    ("ipm eps=2", "ipm", "{epsilon = 2.0}"),
    ("sign_flip", "sign_flip", "{}"),
    ("sign_flip x4", "sign_flip", "{scale = 4.0}"),
    ("label_flip", "label_flip", "{}"),
    ("min_max", "min_max", "{}"),
    ("min_sum", "min_sum", "{}"),
    ("gaussian", "gaussian", "{}"),
    ("gaussian std=0.1", "gaussian", "{std = 0.1}"),
]
QUICK_SUITE = ("clean", "alie z=10", "sign_flip", "ipm eps=2")

CONFIGS: dict[str, str] = {
    "default": "meta_consensus/default.toml",
    "robust": "configs/robust.toml",
    "robust-noserver": "configs/robust-noserver.toml",
    "private": "configs/private.toml",
}
ALPHAS = (0.3, 1.0)
SELECTION_SEED = 100


def vote_alone(rule: str, pre: Sequence[str] = (), options: str = "{}", f: str = "none") -> list[str]:
    """The --set overrides of a vote alone: its output is the merge (no weights, no server step)."""
    pre_list = "[" + ", ".join(f'"{p}"' for p in pre) + "]"
    return [
        f"vote.rule={rule}", f"vote.pre={pre_list}", f"vote.options={options}", f"vote.num_byzantine={f}",
        "weights.objective=vote", "weights.max_weight=none", "weights.lambda_reg=0.0", "vote.server_step=0",
    ]  # fmt: skip


_CC = "{clip_radius = 1.0, iterations = 3}"
_MIXTURE = ["weights.objective=mixture_nll", "weights.max_weight=0.4", "weights.lambda_reg=0.0"]
_QUADRATIC = ["weights.objective=quadratic", "weights.max_weight=none", "weights.lambda_reg=0.1"]
_SERVER = ["vote.server_step=0.25", "vote.root_size=0.556"]


def _with(vote: list[str], extra: list[str]) -> list[str]:
    keys = {s.split("=", 1)[0] for s in extra}
    return [s for s in vote if s.split("=", 1)[0] not in keys] + extra


# The default's candidates (8 nodes, f = 2 of the default's fault_tolerance 0.25): its shipped
# Multi-Krum + mixture-NLL weights, votes alone, and held-out weights or a server step after a vote.
DEFAULT_CANDIDATES: dict[str, list[str]] = {
    "multi_krum+mixture_nll": _with(vote_alone("multi_krum"), _MIXTURE),
    "multi_krum": vote_alone("multi_krum"),
    "median": vote_alone("median"),
    "trimmed_mean": vote_alone("trimmed_mean"),
    "nnm+trimmed_mean": vote_alone("trimmed_mean", pre=["nnm"]),
    # The coordinator's held-out rows as a root set (the robust preset's server step): the vote's
    # merge moved by a quarter of the coordinator's own update on 100 of digits' 180 held-out rows.
    "trimmed_mean+server_0.25": _with(vote_alone("trimmed_mean"), _SERVER),
    "dnc+quadratic+server_0.25": _with(vote_alone("dnc", f="2"), [*_QUADRATIC, *_SERVER]),
}
# No coordinator data: votes alone (no held-out weights, no server step), f = 4 of 16: NNM +
# centered clipping (the heterogeneity-aware rule the issue measured), the same behind ARC, and the
# no-server vote that did best in results/robust_preset.md's selection at alpha 0.3 (SignGuard).
NOSERVER_CANDIDATES: dict[str, list[str]] = {
    "nnm+centered_clipping": vote_alone("centered_clipping", pre=["nnm"], options=_CC, f="4"),
    "arc+nnm+centered_clipping": vote_alone("centered_clipping", pre=["arc", "nnm"], options=_CC, f="4"),
    "signguard": vote_alone("signguard", f="4"),
}
# The private preset's candidates (8 DP-SGD nodes, f = 2): its Multi-Krum + mixture-NLL weights, and
# the trimmed mean alone and with the server step (the coordinator's held-out rows are public data,
# so the step spends no privacy). DP noise in every node favours rules that average more nodes.
PRIVATE_CANDIDATES: dict[str, list[str]] = {
    "multi_krum+mixture_nll": _with(vote_alone("multi_krum"), _MIXTURE),
    "trimmed_mean": vote_alone("trimmed_mean"),
    "trimmed_mean+server_0.25": _with(vote_alone("trimmed_mean"), _SERVER),
}
# What meta_consensus/default.toml and the robust-noserver and private presets ship (a test checks).
DEFAULT_CHOSEN = "trimmed_mean+server_0.25"
NOSERVER_CHOSEN = "signguard"
PRIVATE_CHOSEN = "trimmed_mean+server_0.25"
SELECT = {
    "default": ("default", DEFAULT_CANDIDATES, (0.5,)),
    "noserver": ("robust-noserver", NOSERVER_CANDIDATES, (0.3,)),
    "private": ("private", PRIVATE_CANDIDATES, (1.0,)),
}


def attack_sets(label: str) -> list[str]:
    """The --set overrides of one condition of the suite (``"clean"``: no Byzantine nodes)."""
    _, attack, options = next(c for c in SUITE if c[0] == label)
    if attack == "none":
        return ["byzantine.nodes=[]", "byzantine.options={}"]
    return [f"byzantine.attack={attack}", f"byzantine.options={options}"]


def run_once(path: str, sets: Sequence[str]) -> dict[str, float]:
    """The consensus's and plain FedAvg's test accuracy after the last round of one run.

    Args:
        path: the config file.
        sets: ``--set`` overrides.

    Returns:
        ``{"consensus": ..., "fedavg": ..., "seconds": ...}``.
    """
    from meta_consensus import MetaConsensus, config

    t0 = time.perf_counter()
    cfg = config.load(path, ["checkpoint_every=0", "baseline_fedavg=true", *sets])
    result = MetaConsensus(cfg, write=False, progress=False).train()
    last = [h for h in result.history if h.ok][-1]
    return {
        "consensus": float(last.consensus_accuracy),
        "fedavg": float(last.fedavg_accuracy),
        "seconds": time.perf_counter() - t0,
    }


def sweep(
    path: str, sets: Sequence[str], labels: Sequence[str], alpha: float, seed: int, extra: Sequence[str] = ()
) -> dict[str, dict[str, float]]:
    """Every condition of ``labels`` for one config, alpha and seed."""
    base = [f"seed={seed}", f"task.alpha={alpha:g}", *extra, *sets]
    out = {}
    for label in labels:
        out[label] = run_once(path, [*base, *attack_sets(label)])
        print(f"  {path} alpha {alpha:g} seed {seed} {label}: {out[label]}", flush=True)
    return out


def summarize(runs: Mapping[str, Mapping[str, float]]) -> dict[str, Any]:
    """One sweep's numbers: the worst attack, its gap to clean FedAvg, the margin over FedAvg.

    Args:
        runs: condition label -> ``{"consensus", "fedavg"}`` (with ``"clean"`` among them).

    Returns:
        ``worst`` (the lowest consensus accuracy under an attack), ``worst_attack``, ``gap`` (clean
        FedAvg minus ``worst``, in points), ``margin`` (the smallest consensus minus FedAvg under the
        same attack, in points; negative: it lost to FedAvg there), ``margin_attack``, ``clean_gap``
        (clean FedAvg minus the clean consensus, in points).
    """
    clean_fedavg = runs["clean"]["fedavg"]
    attacks = [a for a in runs if a != "clean"]
    worst_attack = min(attacks, key=lambda a: runs[a]["consensus"])
    margin_attack = min(attacks, key=lambda a: runs[a]["consensus"] - runs[a]["fedavg"])
    return {
        "worst": runs[worst_attack]["consensus"],
        "worst_attack": worst_attack,
        "gap": 100 * (clean_fedavg - runs[worst_attack]["consensus"]),
        "margin": 100 * (runs[margin_attack]["consensus"] - runs[margin_attack]["fedavg"]),
        "margin_attack": margin_attack,
        "clean_gap": 100 * (clean_fedavg - runs["clean"]["consensus"]),
    }


def _select(
    which: str,
    labels: Sequence[str],
    rounds: int | None,
    t0: float,
    names: Sequence[str] | None = None,
    alphas: Sequence[float] | None = None,
    seeds: Sequence[int] = (SELECTION_SEED,),
) -> dict[str, Any]:
    config_name, candidates, shipped_alphas = SELECT[which]
    alphas = shipped_alphas if alphas is None else alphas
    if names is not None:
        candidates = {k: candidates[k] for k in names}
    path = CONFIGS[config_name]
    out: dict[str, Any] = {}
    for name, sets in candidates.items():
        per_alpha = {}
        for alpha in alphas:
            per_seed = {}
            for seed in seeds:
                # Each selection seed draws its own node split too (task.data_seed), apart from the reports'.
                extra = [f"task.data_seed={seed}", *([] if rounds is None else [f"rounds={rounds}"])]
                runs = sweep(path, sets, labels, alpha, seed, extra)
                per_seed[str(seed)] = {"runs": runs, **summarize(runs)}
            per_alpha[f"{alpha:g}"] = over_seeds(per_seed)
        out[name] = per_alpha
        s = " ".join(
            f"a={a}: gap {v['gap']:.1f} margin {v['margin']:.1f} clean {v['clean_gap']:.1f}"
            for a, v in per_alpha.items()
        )
        print(f"{name:28s} {s} ({time.perf_counter() - t0:.0f} s)", flush=True)
    return out


def over_seeds(per_seed: Mapping[str, Mapping[str, Any]]) -> dict[str, Any]:
    """One candidate at one alpha over its selection seeds: :func:`summarize` of the seeds' mean runs.

    Each condition's consensus and FedAvg accuracies are averaged over the seeds first (one seed
    moves an accuracy by a test example, 0.28 points on digits' 360), then summarized; the
    smallest single seed's margin is kept beside (``margin_min_seed``).

    Args:
        per_seed: seed -> ``{"runs": ..., **summarize(runs)}``.

    Returns:
        ``{"seeds": per_seed, **summarize(mean runs), "margin_min_seed": ...}``.
    """
    if len(per_seed) == 1:  # one seed: its own summary
        only = next(iter(per_seed.values()))
        summary = {k: v for k, v in only.items() if k not in ("runs", "seeds", "margin_min_seed")}
        return {"seeds": dict(per_seed), **summary, "margin_min_seed": only["margin"]}
    labels = list(next(iter(per_seed.values()))["runs"])
    mean = {
        lab: {
            k: float(np.mean([s["runs"][lab][k] for s in per_seed.values()])) for k in ("consensus", "fedavg")
        }
        for lab in labels
    }
    return {
        "seeds": dict(per_seed),
        **summarize(mean),
        "margin_min_seed": min(s["margin"] for s in per_seed.values()),
    }


def _with_seeds(entry: Mapping[str, Any], seed: Any) -> dict[str, Any]:
    """A selection entry in the per-seed layout (results saved before it: one seed, given)."""
    if "seeds" in entry:
        return dict(entry)
    return over_seeds({str(seed): {k: v for k, v in entry.items()}})


def choose(which: str, selection: Mapping[str, Mapping[str, Mapping[str, Any]]]) -> str:
    """The selection's rule.

    ``default`` and ``private``: among the candidates that never lose to FedAvg under an attack
    (margin >= 0 at every alpha, on the accuracies averaged over the selection seeds) and are
    within 1 point of clean FedAvg clean, the best worst-case accuracy (mean over alphas); if none
    qualifies, the best smallest margin. ``noserver``: the smallest largest gap to clean FedAvg
    over the alphas.

    Args:
        which: ``"default"`` or ``"noserver"``.
        selection: candidate -> alpha -> :func:`summarize`'s fields.

    Returns:
        The chosen candidate's name.
    """
    if which == "noserver":
        return min(selection, key=lambda k: max(v["gap"] for v in selection[k].values()))
    ok = [
        k
        for k, per in selection.items()
        if all(v["margin"] >= 0 and v["clean_gap"] <= 1.0 for v in per.values())
    ]
    if ok:
        return max(ok, key=lambda k: float(np.mean([v["worst"] for v in selection[k].values()])))
    return max(selection, key=lambda k: min(v["margin"] for v in selection[k].values()))


def combine(parts: Sequence[Mapping[str, Any]]) -> tuple[dict[str, Any], dict[str, Any]]:
    """One result from parts run apart in parallel: reports of disjoint (config, alpha, seed) runs, or
    selections of disjoint candidates (chosen again over all of them).

    Args:
        parts: the saved result dicts of ``--configs`` / ``--seeds`` / ``--alphas`` runs, or of
            ``--select W --candidates ...`` runs.

    Returns:
        ``(result, settings)``; total_s is the sum of the parts' (runs in parallel: their total
        work, not the wall time).

    Raises:
        ValueError: if the parts mix kinds, differ in conditions, rounds, task or selection, or two
            parts hold the same run or candidate.
    """
    kinds = {p.get("kind") for p in parts}
    if len(kinds) != 1:
        raise ValueError(f"--combine: the parts mix kinds {sorted(map(str, kinds))}")
    kind = kinds.pop()
    same = ("conditions", "rounds", "task", "select")
    first = parts[0]["settings"]
    merged: dict[str, Any] = {}
    for part in parts:
        st = part["settings"]
        differ = [k for k in same if st.get(k) != first.get(k)]
        if differ:
            raise ValueError(f"--combine: the parts differ in {differ}")
        if kind == "selection":
            # A candidate may come in several parts, each with other alphas or other seeds.
            for cand, per_alpha in part["selection"].items():
                into = merged.setdefault(cand, {})
                for a, entry in per_alpha.items():
                    seeds = _with_seeds(entry, st.get("seed", SELECTION_SEED))["seeds"]
                    have = into.setdefault(a, {})
                    # The same run twice (runs are deterministic: equal accuracies) counts once.
                    twice = [
                        s for s in set(have) & set(seeds) if _accuracies(have[s]) != _accuracies(seeds[s])
                    ]
                    if twice:
                        raise ValueError(
                            f"--combine: {cand} alpha {a} seed {sorted(twice)} reported twice, with other "
                            "results"
                        )
                    have.update(seeds)
            continue
        for c, per_alpha in part["report"].items():
            for a, per_seed in per_alpha.items():
                into = merged.setdefault(c, {}).setdefault(a, {})
                twice = set(into) & set(per_seed)
                if twice:
                    raise ValueError(f"--combine: {c} alpha {a} seeds {sorted(twice)} reported twice")
                into.update(per_seed)
    total = sum(p["total_s"] for p in parts)
    if kind == "selection":
        merged = {c: {a: over_seeds(seeds) for a, seeds in per.items()} for c, per in merged.items()}
        which = parts[0]["which"]
        chosen = choose(which, merged)
        sets = SELECT[which][1][chosen]
        res = {"kind": kind, "which": which, "selection": merged, "chosen": chosen, "sets": sets}
        alphas = sorted({float(a) for per_alpha in merged.values() for a in per_alpha})
        sel_seeds = sorted({int(s) for per in merged.values() for e in per.values() for s in e["seeds"]})
        return {**res, "total_s": total}, {**first, "alphas": alphas, "seeds": sel_seeds}
    seeds = sorted({int(s) for per_alpha in merged.values() for per in per_alpha.values() for s in per})
    alphas = sorted({float(a) for per_alpha in merged.values() for a in per_alpha})
    settings = {**first, "configs": list(merged), "seeds": seeds, "alphas": alphas}
    return {"kind": kind, "report": merged, "total_s": total}, settings


def _numbers(parser: Any, flag: str, text: str, kind: type = float) -> list[Any]:
    try:
        return [kind(v) for v in text.split(",")]
    except ValueError:
        parser.error(f"{flag}: comma-separated {'integers' if kind is int else 'numbers'}, got {text!r}")
        raise  # parser.error exits; this keeps the type checker's flow


def _accuracies(entry: Mapping[str, Any]) -> Any:
    """What a selection entry measured (its runs' accuracies; the summary when it kept no runs)."""
    if "runs" not in entry:
        return {k: v for k, v in entry.items() if k != "seeds"}
    return {lab: (r["consensus"], r["fedavg"]) for lab, r in entry["runs"].items()}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = harness.parser(__doc__, f"{len(QUICK_SUITE)} conditions, the default only, one seed, alpha 0.3")
    parser.add_argument("--select", choices=sorted(SELECT), default=None, help="run a selection instead")
    parser.add_argument("--candidates", default=None, help="with --select: these candidates only")
    parser.add_argument("--configs", default=None, help="the reported configs, comma-separated (default all)")
    parser.add_argument(
        "--seeds", default=None, help="the seeds, comma-separated (default 0,1,2; a selection: 100)"
    )
    parser.add_argument(
        "--alphas", default=None, help="the alphas, comma-separated (default 0.3,1; a selection: its own)"
    )
    parser.add_argument("--rounds", type=int, default=None, help="override every config's rounds")
    parser.add_argument(
        "--combine", nargs="+", type=Path, default=None,
        help="write one report from reports of disjoint configs (run in parallel with --configs and --out)",
    )  # fmt: skip
    add_task_option(parser)
    args = harness.parse(parser, argv)
    results_name = use_task(args.task, "attack_suite")
    task_sets = [] if args.task == "digits" else [f"task.name={args.task}"]
    labels = [c[0] for c in SUITE if not args.quick or c[0] in QUICK_SUITE]
    t0 = time.perf_counter()
    res: dict[str, Any]
    settings: dict[str, Any]
    if args.combine is not None:
        res, settings = combine([json.loads(p.read_text(encoding="utf-8")) for p in args.combine])
        name = f"attack_suite_select_{res['which']}" if res["kind"] == "selection" else results_name
    elif args.select is not None:
        if task_sets:
            parser.error("--select runs on digits (the defaults' own task); drop --task")
        names = None if args.candidates is None else [c.strip() for c in args.candidates.split(",")]
        unknown = [c for c in names or [] if c not in SELECT[args.select][1]]
        if unknown:
            parser.error(f"--candidates: unknown {unknown}; valid: {list(SELECT[args.select][1])}")
        alphas = SELECT[args.select][2] if args.alphas is None else _numbers(parser, "--alphas", args.alphas)
        sel_seeds = [SELECTION_SEED] if args.seeds is None else _numbers(parser, "--seeds", args.seeds, int)
        if set(sel_seeds) & {0, 1, 2}:
            parser.error("--seeds of a selection: not the reported seeds 0, 1, 2")
        selection = _select(args.select, labels, args.rounds, t0, names, alphas, sel_seeds)
        chosen = choose(args.select, selection)
        config_name, candidates, _ = SELECT[args.select]
        settings = {"quick": args.quick, "select": args.select, "config": CONFIGS[config_name],
                    "alphas": list(alphas), "seeds": sel_seeds,
                    "rounds": args.rounds, "conditions": labels}  # fmt: skip
        res = {
            "kind": "selection", "which": args.select, "selection": selection, "chosen": chosen,
            "sets": candidates[chosen], "total_s": time.perf_counter() - t0,
        }  # fmt: skip
        name = f"attack_suite_select_{args.select}"
    else:
        configs = ["default"] if args.quick else list(CONFIGS)
        if args.configs is not None:
            configs = [c.strip() for c in args.configs.split(",")]
            unknown = [c for c in configs if c not in CONFIGS]
            if unknown:
                parser.error(f"--configs: unknown {unknown}; valid: {list(CONFIGS)}")
        seeds = [0] if args.quick else [0, 1, 2]
        if args.seeds is not None:
            seeds = _numbers(parser, "--seeds", args.seeds, int)
        report_alphas: Sequence[float] = (0.3,) if args.quick else ALPHAS
        if args.alphas is not None:
            report_alphas = _numbers(parser, "--alphas", args.alphas)
        extra = [*task_sets, *([] if args.rounds is None else [f"rounds={args.rounds}"])]
        report: dict[str, Any] = {}
        for c in configs:
            report[c] = {}
            for alpha in report_alphas:
                report[c][f"{alpha:g}"] = {
                    str(s): sweep(CONFIGS[c], [], labels, alpha, s, extra) for s in seeds
                }
                print(f"{c} alpha {alpha:g} done ({time.perf_counter() - t0:.0f} s)", flush=True)
        settings = {"quick": args.quick, "task": args.task, "configs": configs, "alphas": list(report_alphas),
                    "seeds": seeds, "rounds": args.rounds, "conditions": labels}  # fmt: skip
        res = {"kind": "report", "report": report, "total_s": time.perf_counter() - t0}
        name = results_name
    md = markdown({**res, "settings": settings})
    harness.save(name, args.quick, res, md, settings=settings, benchmark="attack_suite")
    print(md)
    return res


def _seeds_text(report: Mapping[str, Any]) -> str:
    """Which seeds ran, per config and alpha where they differ."""
    runs = {
        (c, a): sorted(per_seed, key=int)
        for c, per_alpha in report.items()
        for a, per_seed in per_alpha.items()
    }
    kinds = sorted({tuple(v) for v in runs.values()})
    if len(kinds) == 1:
        return "seeds " + ", ".join(kinds[0])
    return "seeds " + "; ".join(f"{c} at alpha {a}: {', '.join(v)}" for (c, a), v in runs.items())


def _report_rows(report: Mapping[str, Any]) -> list[list[Any]]:
    rows: list[list[Any]] = []
    for c, per_alpha in report.items():
        for alpha, per_seed in per_alpha.items():
            seeds = list(per_seed)
            sums = [summarize(per_seed[s]) for s in seeds]
            clean_fedavg = np.array([per_seed[s]["clean"]["fedavg"] for s in seeds])
            attacks = [a for a in per_seed[seeds[0]] if a != "clean"]
            # FedAvg's own worst attack, same seeds: the baseline row of this config's setting.
            fed_worst = np.array([min(per_seed[s][a]["fedavg"] for a in attacks) for s in seeds])
            fed_worst_attack = min(attacks, key=lambda a: np.mean([per_seed[s][a]["fedavg"] for s in seeds]))
            worst = np.array([v["worst"] for v in sums])
            gap = np.array([v["gap"] for v in sums])
            margin = np.array([v["margin"] for v in sums])
            clean = np.array([per_seed[s]["clean"]["consensus"] for s in seeds])
            worst_attack = min(attacks, key=lambda a: np.mean([per_seed[s][a]["consensus"] for s in seeds]))
            rows.append([
                c, alpha, f"{np.mean(clean):.3f} ± {np.std(clean):.3f}",
                f"{np.mean(worst):.3f} ± {np.std(worst):.3f}", worst_attack,
                f"{np.mean(gap):.2f} (max {np.max(gap):.2f})",
                f"{np.mean(margin):.2f} (min {np.min(margin):.2f})",
                f"{np.mean(clean_fedavg):.3f} ± {np.std(clean_fedavg):.3f}",
                f"{np.mean(fed_worst):.3f} ± {np.std(fed_worst):.3f}", fed_worst_attack,
            ])  # fmt: skip
    return rows


def _per_attack_rows(report: Mapping[str, Any]) -> tuple[list[str], list[list[Any]]]:
    labels: list[str] = []
    rows: list[list[Any]] = []
    for c, per_alpha in report.items():
        for alpha, per_seed in per_alpha.items():
            seeds = list(per_seed)
            labels = list(per_seed[seeds[0]])
            for who in ("consensus", "fedavg"):
                rows.append(
                    [c if who == "consensus" else f"{c}: plain FedAvg", alpha]
                    + [float(np.mean([per_seed[s][a][who] for s in seeds])) for a in labels]
                )
    return labels, rows


_SELECTION_TITLES = {"default": "the default", "noserver": "robust-noserver", "private": "the private preset"}


def markdown(res: Mapping[str, Any]) -> str:
    """The results page of a run of this benchmark (a report or a selection), rendered from its result file.

    Args:
        res: the result dict as saved (``kind``, ``report`` or ``selection``, ``settings``).

    Returns:
        The markdown page.
    """
    st = res.get("settings", {})
    if res.get("kind") == "selection":
        which = res["which"]
        lines = harness.header(
            f"Attack suite: the selection of {_SELECTION_TITLES[which]}",
            "attack_suite",
            bool(st.get("quick", False)),
            st,
        )
        seeds = st.get("seeds") or [st.get("seed", SELECTION_SEED)]
        lines += [
            f"`{st.get('config')}` with only the vote, the weights and the server step changed; seeds "
            f"{seeds}, each with its own node split (task.data_seed = the seed), which the reported runs "
            f"do not use; {len(st.get('conditions', []))} conditions; alphas {st.get('alphas')}. Each "
            "condition's accuracies are averaged over the seeds a candidate ran, then: gap = clean FedAvg "
            "minus the worst attack's consensus; margin = the smallest consensus minus plain FedAvg under "
            "the same attack (negative: it lost to FedAvg there; beside it the smallest single seed's); "
            "clean gap = clean FedAvg minus the clean consensus (all in points). "
            + (
                "Rule: never below FedAvg under an attack and within 1 point clean, at every alpha; "
                "among those, the best worst-case accuracy."
                if which != "noserver"
                else "Rule: the smallest largest gap over the alphas (target: 3 points)."
            ),
            "",
        ]
        rows = []
        for k, per in res["selection"].items():
            for a, v in per.items():
                v = _with_seeds(v, seeds[0])
                rows.append(
                    [k + (" (chosen)" if k == res["chosen"] else ""), a, len(v["seeds"]), v["worst"],
                     v["worst_attack"], v["gap"], v["margin"], v["margin_attack"], v["margin_min_seed"],
                     v["clean_gap"]]
                )  # fmt: skip
        lines.append(
            markdown_table(
                [
                    "candidate",
                    "alpha",
                    "seeds",
                    "worst",
                    "worst attack",
                    "gap",
                    "margin",
                    "margin attack",
                    "margin, smallest seed",
                    "clean gap",
                ],
                rows,
            )
        )
        lines.append(f"Chosen: **{res['chosen']}**. Total time {res.get('total_s', 0):.0f} s.")
        return "\n".join(lines) + "\n"
    lines = harness.header(
        "Attack suite: the default, the presets and plain FedAvg", "attack_suite", bool(st.get("quick")), st
    )
    rounds = st.get("rounds")
    lines += [
        "Every config as shipped (" + ", ".join(f"`{CONFIGS[c]}`" for c in res["report"]) + ") under "
        f"{len(st.get('conditions', [])) - 1} attacks and clean, Dirichlet alphas {st.get('alphas')}, "
        + _seeds_text(res["report"])
        + (f", {rounds} rounds" if rounds else ", each config's own rounds")
        + ". Plain FedAvg runs alongside every run on the same nodes, shards and keys "
        "(baseline_fedavg). Per config and alpha, mean ± spread (std) over seeds: the clean consensus, "
        "the worst attack's consensus and which attack (worst on average), its gap to clean FedAvg "
        "(points; mean and the largest over seeds), the margin over FedAvg under the same attack "
        "(points; the smallest over attacks, mean over seeds and the smallest seed; negative: it "
        "lost to FedAvg), then clean FedAvg and FedAvg's own worst attack.",
        "",
        markdown_table(
            [
                "config",
                "alpha",
                "clean",
                "worst",
                "worst attack",
                "gap to clean FedAvg",
                "margin over FedAvg",
                "clean FedAvg",
                "FedAvg worst",
                "FedAvg worst attack",
            ],
            _report_rows(res["report"]),
        ),  # fmt: skip
        "Per attack (test accuracy, mean over seeds):",
        "",
    ]
    labels, rows = _per_attack_rows(res["report"])
    lines.append(markdown_table(["config", "alpha", *labels], rows))
    missing = [c for c in CONFIGS if c not in res["report"]]
    if missing:
        lines += [
            "",
            "Not in this run (CPU budget): "
            + ", ".join(f"`{CONFIGS[c]}`" for c in missing)
            + (
                "; the robust preset's own suite (9 attacks at their default strengths, alpha 0.3, seeds "
                "0-2) is results/robust_preset.md"
                if "robust" in missing
                else ""
            )
            + ".",
        ]
    if "robust-noserver" in res["report"]:
        lines += [
            "",
            "**robust-noserver and the 3-point target** (alpha 0.3, 4 of 16 Byzantine, no coordinator "
            "data): the gap column of its alpha-0.3 row against 3. Losing the 4 attackers' shards alone "
            "costs 0.4 to 1.1 points at this alpha (the oracle row of results/robust_preset.md: the plain "
            "mean of the 12 honest nodes); the rest is the rule's error. The lower bound of Allouah et al. "
            "2023 (Robust distributed learning: tight error bounds and breakdown point under data "
            "heterogeneity) under (G, B)-gradient dissimilarity says no rule can do better than "
            "Omega(f / (n - (2 + B^2) f) * G^2) and none is robust at all once f / n >= 1 / (2 + B^2): at "
            "f / n = 1/4, once B^2 >= 2. G and B of these shards are measured in results/heterogeneity.md "
            "(`python -m benchmarks heterogeneity`, along FedAvg's clean trajectory, the honest nodes' "
            "full-shard gradients and round updates): at both alphas the spread needs B^2 past 2 to fit with "
            "G = 0, and below B^2 = 2 the bound's worst-case error is several times the honest mean "
            "gradient itself. So the bound gives no rule a guarantee here, at alpha 1 as at 0.3, and does "
            "not tell the alphas apart: it neither explains the gap at alpha 0.3 nor forbids the target, "
            "which is a worst case over every problem with that (G, B), not this one. The page reports how "
            "far the measured rules are from the target, and which attack stops them, in the tables above.",
        ]
    lines.append(f"Total time {res.get('total_s', 0):.0f} s.")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
