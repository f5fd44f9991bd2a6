"""The measured sentences and tables of docs/results.md, each computed from the benchmark data.

docs/results.md discusses the benchmarks in prose that carries no measured number: every number
sits in a block ``<!-- publish: finding NAME -->`` ... ``<!-- /publish -->`` that
``python -m benchmarks publish`` fills with ``FINDINGS[NAME](results)``. A finding reads one or
more ``benchmarks/results/<stem>.json`` (with :func:`benchmarks.publish.load`) and returns a
markdown sentence or a small table, with the comparative words ("above", "below", which rule is
best) computed from the same data, so a rerun and a publish keep the discussion true.
"""

from __future__ import annotations

import json
import math
import re
import tomllib
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from benchmarks.publish import ROOT, load

Finding = Callable[[Path], str]
FINDINGS: dict[str, Finding] = {}


def finding(fn: Finding) -> Finding:
    """Register ``fn`` under its name in :data:`FINDINGS`."""
    FINDINGS[fn.__name__] = fn
    return fn


def render(name: str, results: Path) -> str:
    """The markdown of the finding ``name`` from the result files in ``results``.

    Args:
      name: a key of :data:`FINDINGS`.
      results: the folder of the result files.

    Returns:
      The finding's markdown (no leading or trailing newline).

    Raises:
      ValueError: ``name`` is not a finding.
    """
    if name not in FINDINGS:
        raise ValueError(f"docs/results.md: unknown finding {name!r} (known: {', '.join(sorted(FINDINGS))})")
    return FINDINGS[name](results).strip("\n")


# ----------------------------------------------------------------------------- helpers


def _data(results: Path, stem: str) -> dict[str, Any]:
    return load(results / f"{stem}.json")


def _a(x: float) -> str:
    """An accuracy (or any value in [0, 1]) to three decimals."""
    return f"{x:.3f}"


def _pm(ms: Sequence[float], digits: int = 3) -> str:
    m, s = ms
    return f"{m:.{digits}f} ± {s:.{digits}f}"


def _pts(x: float) -> str:
    """A difference of accuracies in points (unsigned)."""
    return f"{abs(100 * x):.1f}"


def _spts(x: float) -> str:
    """A difference of accuracies in points, signed."""
    return f"{100 * x:+.1f}"


def _side(diff: float, above: str = "above", below: str = "below", tol: float = 0.0005) -> str:
    """``above`` / ``below`` / "level with" for a difference of accuracies."""
    return above if diff > tol else below if diff < -tol else "level with"


def _vs(diff: float, what: str) -> str:
    """ "N points above / below ``what``", or "level with ``what``"."""
    side = _side(diff)
    return f"level with {what}" if side == "level with" else f"{_pts(diff)} points {side} {what}"


def _x(r: float) -> str:
    """A ratio to a floor."""
    return f"{r:.2f}x"


def _table(head: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    lines = ["| " + " | ".join(head) + " |", "|" + "|".join("---" for _ in head) + "|"]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def _mean(xs: Sequence[float]) -> float:
    return sum(xs) / len(xs)


def _std(xs: Sequence[float]) -> float:
    m = _mean(xs)
    return math.sqrt(sum((x - m) ** 2 for x in xs) / len(xs))


def _alpha(x: float) -> str:
    return f"{x:g}"


# ----------------------------------------------------------------------------- robustness

ROBUST_RULES = (
    "trimmed_mean",
    "geometric_median",
    "centered_clipping",
    "nnm+centered_clipping",
    "signguard",
    "dnc",
    "server_monna",
    "fltrust",
)
SERVER_RULES = ("fltrust", "server_monna")  # the rules that train on the coordinator's own data


def _cells(d: Mapping[str, Any], f: int) -> dict[float, Mapping[str, Any]]:
    """alpha -> rule -> cell at ``f`` Byzantine nodes."""
    return {float(a): byf[str(f)] for a, byf in d["summary"]["cells"].items()}


def _worst(cell: Mapping[str, Any]) -> float | None:
    return float(cell["worst_test"]) if cell.get("applicable", True) else None


def _robustness_table(
    d: Mapping[str, Any], rules: Sequence[str]
) -> tuple[str, dict[float, dict[str, float]]]:
    s = d["settings"]
    f = max(s["byzantine"])
    cells = _cells(d, f)
    alphas = sorted(cells)
    head = [f"rule, f = {f} of {s['num_nodes']}", *(f"alpha = {_alpha(a)}" for a in alphas)]
    rows: list[list[Any]] = [
        ["clean FedAvg (no attacker)", *(_a(d["targets"][str(a)]["clean_fedavg"]) for a in alphas)]
    ]
    worst: dict[float, dict[str, float]] = {a: {} for a in alphas}
    for rule in ["mean", *[r for r in rules if r in s["rules"]]]:
        row: list[Any] = ["mean (FedAvg)" if rule == "mean" else rule]
        for a in alphas:
            w = _worst(cells[a][rule])
            row.append("n/a" if w is None else _a(w))
            if w is not None:
                worst[a][rule] = w
        rows.append(row)
    return _table(head, rows), worst


@finding
def robustness_rules(results: Path) -> str:
    """Worst case over the attacks per rule and alpha; the best rule with and without server data."""
    d = _data(results, "robustness")
    s = d["settings"]
    table, worst = _robustness_table(d, ROBUST_RULES)
    f = max(s["byzantine"])
    parts = []
    for a, by_rule in worst.items():
        clean = d["targets"][str(a)]["clean_fedavg"]
        updates_only = {r: w for r, w in by_rule.items() if r not in SERVER_RULES and r != "mean"}
        best_u = max(updates_only, key=lambda r: updates_only[r])
        best = max((r for r in by_rule if r != "mean"), key=lambda r: by_rule[r])
        parts.append(
            f"at alpha = {_alpha(a)} the best rule is {best} ({_a(by_rule[best])}, "
            f"{_vs(by_rule[best] - clean, 'clean FedAvg')}), the best that sees only the updates "
            f"{best_u} ({_vs(updates_only[best_u] - clean, 'it')})"
        )
    t = d["targets"]
    gaps = " / ".join(f"{100 * t[str(a)]['max_gap']:.1f}" for a in worst)
    alphas = " / ".join(_alpha(a) for a in worst)
    return (
        f"Digits, {s['num_nodes']} nodes, {f} Byzantine, worst test accuracy over {len(s['attacks'])} "
        f"attacks (mean over {len(s['seeds'])} seeds), {len(s['rules'])} rules run, a selection shown:\n\n"
        f"{table}\n\n"
        + "; ".join(parts)[0].upper()
        + "; ".join(parts)[1:]
        + f". The rule chosen on held-out data, {d['best']}, is at most {gaps} points below clean FedAvg "
        f"under any attack at alpha = {alphas}."
        + (
            " " + robustness_fashion_mnist(results)
            if (results / "robustness_fashion_mnist.json").is_file()
            else ""
        )
    )


@finding
def robustness_fashion_mnist(results: Path) -> str:
    """On Fashion-MNIST: FedAvg's and the best rule's worst case per alpha."""
    d = _data(results, "robustness_fashion_mnist")
    s = d["settings"]
    _, worst = _robustness_table(d, s["rules"])
    parts = []
    for a, w in worst.items():
        clean = d["targets"][str(a)]["clean_fedavg"]
        best = max((r for r in w if r != "mean"), key=lambda r: w[r])
        parts.append(
            f"at alpha = {_alpha(a)} clean FedAvg {_a(clean)}, FedAvg under attack {_a(w['mean'])}, "
            f"the best of {len(w) - 1} rules {best} {_a(w[best])}"
        )
    seeds = len(s["seeds"])
    return (
        f"On Fashion-MNIST ({len(s['attacks'])} attacks, {max(s['byzantine'])} of {s['num_nodes']} "
        "Byzantine, "
        f"{seeds} seed{'s' if seeds > 1 else ''}, update-only rules), worst case: " + "; ".join(parts) + "."
    )


PRESET_STEMS = ("robust_preset", "robust_preset_alpha0.1", "robust_preset_fashion_mnist")


def _preset_alpha(d: Mapping[str, Any]) -> float:
    argv = list(d.get("argv", []))
    if "--alpha" in argv:
        return float(argv[argv.index("--alpha") + 1])
    preset = tomllib.loads((ROOT / "meta_consensus" / "presets" / "robust.toml").read_text(encoding="utf-8"))
    return float(preset["task"]["alpha"])


def _preset_worst(report: Mapping[str, Any], name: str, seed: str) -> float:
    return min(v[0] for a, v in report[name][seed].items() if a != "none")


@finding
def robust_preset(results: Path) -> str:
    """How the preset was chosen, then the preset against FedAvg, DnC alone and the honest-only bound."""
    head = [
        "setting",
        "clean FedAvg",
        "preset: worst attack",
        "largest gap to clean FedAvg (points)",
        "preset, no attacker",
        "DnC alone: worst",
        "plain mean: worst",
        "mean of the honest nodes",
    ]
    rows = []
    for stem in PRESET_STEMS:
        if not (results / f"{stem}.json").is_file():
            continue
        d = _data(results, stem)
        rep, seeds, chosen = d["report"], [str(s) for s in d["seeds"]], d["chosen"]
        clean = [rep["mean"][s]["none"][0] for s in seeds]
        preset = [_preset_worst(rep, chosen, s) for s in seeds]
        gap = max(c - w for c, w in zip(clean, preset, strict=True))
        rows.append(
            [
                f"{d['settings']['task']}, alpha = {_alpha(_preset_alpha(d))}",
                _a(_mean(clean)),
                _a(_mean(preset)),
                f"{100 * gap:.1f}",
                _a(_mean([rep[chosen][s]["none"][0] for s in seeds])),
                _a(_mean([_preset_worst(rep, "dnc", s) for s in seeds])),
                _a(_mean([_preset_worst(rep, "mean", s) for s in seeds])),
                _a(_mean([d["oracle"][s] for s in seeds])),
            ]
        )
    d0 = _data(results, PRESET_STEMS[0])
    sel, chosen = d0["selection"], d0["chosen"]
    plain = {k: v for k, v in sel.items() if "+" not in k or k.startswith("nnm+")}
    best_plain = max(plain, key=lambda k: plain[k]["worst_heldout"])
    n_attacks = len([a for a in next(iter(d0["report"][chosen].values())) if a != "none"])
    return (
        f"Chosen among {len(sel)} candidates by the worst held-out accuracy over the attacks on the "
        f"selection seed: `{chosen}` ({_a(sel[chosen]['worst_heldout'])}; the best vote without weights or "
        f"a server step, {best_plain}, {_a(sel[best_plain]['worst_heldout'])}). Test accuracy through the "
        f"system, mean over seeds {d0['seeds']}, worst of {n_attacks} attacks per seed (a negative gap: "
        f"above clean FedAvg on every seed):\n\n{_table(head, rows)}"
    )


# ----------------------------------------------------------------------------- the whole system


@finding
def system(results: Path) -> str:
    """The default config against plain FedAvg and the best honest node; the recorded make run."""
    d = _data(results, "meta_consensus")
    s = d["settings"]
    cols = (
        ("without DP", "the default (no DP)"),
        ("full pipeline", f"with node-level DP, {s['dp']}"),
        ("plain FedAvg", "plain FedAvg"),
        ("best single node", "best honest node"),
    )
    rows, vs_fedavg, vs_node = [], [], []
    for sc in s["scenarios"]:
        ms = d["summary"][sc]["mean_std"]
        rows.append([sc.replace("_", " "), *(_pm(ms[k]) for k, _ in cols)])
        if sc != "clean":
            vs_fedavg.append(ms["without DP"][0] - ms["plain FedAvg"][0])
            vs_node.append(ms["without DP"][0] - ms["best single node"][0])
    clean = d["summary"]["clean"]["mean_std"]
    diff = clean["without DP"][0] - clean["plain FedAvg"][0]
    out = (
        f"{s['nodes']} nodes, {s['vote']}, {s['weights']}, {s['rounds']} rounds, test accuracy mean ± std "
        f"over {len(s['seeds'])} seeds:\n\n{_table(['scenario', *(c for _, c in cols)], rows)}\n\n"
        f"Under attack the default is {_spts(min(vs_fedavg))} to {_spts(max(vs_fedavg))} points against "
        f"plain FedAvg and {_spts(min(vs_node))} to {_spts(max(vs_node))} against the best honest node; "
        f"without attackers it is {_vs(diff, 'plain FedAvg')}."
    )
    if (results / "make_run.json").is_file():
        out += " " + make_run(results)
    return out


@finding
def make_run(results: Path) -> str:
    """The recorded ``make run``: its last round's consensus, FedAvg and best node."""
    d = _data(results, "make_run")
    last = json.loads(d["metrics_jsonl"][-1])
    cfg = tomllib.loads(d["config_toml"])
    byz = set(cfg.get("byzantine", {}).get("nodes", []))
    attack = cfg.get("byzantine", {}).get("attack", "no attack") if byz else "no attack"
    honest = [a for i, a in enumerate(last["node_accuracy"]) if i not in byz]
    c, f = last["consensus_accuracy"], last["fedavg_accuracy"]
    return (
        f"The recorded `make run` ({d['date']}; nodes {sorted(byz)} run {attack}) ends round "
        f"{last['round'] + 1} with the consensus at {_a(c)}, "
        f"{_vs(c - f, f'plain FedAvg on the same nodes ({_a(f)})')} "
        f"and {_vs(c - max(honest), f'its best honest node ({_a(max(honest))})')}."
    )


# ----------------------------------------------------------------------------- node strategies

REFERENCE = "local + public warm start"
UNION = "hierarchical, union pool (centralised)"


FORMER_MIX = ["hierarchical", "hierarchical", "convexity", "convexity", "soup", "soup", "local", "local"]


def _mix_label(d: Mapping[str, Any], mix: str) -> str:
    """A mix's row: "default mix" of a run made while the former mix was the default is that mix."""
    from benchmarks.quality.ablations import FORMER

    if mix == "default mix" and list(d["settings"].get("default_strategies", [])) == FORMER_MIX:
        return FORMER
    return mix


def _strategies(d: Mapping[str, Any], threat: str = "clean") -> dict[str, dict[float, Sequence[float]]]:
    st, sm = d["settings"], d["summary"]["strategies"]
    return {
        _mix_label(d, mix): {
            float(a): sm[f"{mix} | alpha={a:g} | {threat}"]["consensus_accuracy"] for a in st["alphas"]
        }
        for mix in st["mixes"]
    }


def _strategy_deltas(d: Mapping[str, Any]) -> str:
    st = d["settings"]
    clean = _strategies(d)
    ref = clean[REFERENCE]
    alphas = [float(x) for x in st["alphas"]]
    deltas = "; ".join(
        f"{m} " + " / ".join(_spts(clean[m][a][0] - ref[a][0]) for a in alphas)
        for m in clean
        if m != REFERENCE
    )
    best = ", ".join(
        max((m for m in clean if m != UNION), key=lambda m: clean[m][a][0]) + f" at alpha = {a:g}"
        for a in alphas
    )
    return (
        f"{st['task']}: best (the union pool aside) {best}; against {REFERENCE}, points at alpha = "
        f"{' / '.join(f'{a:g}' for a in alphas)}: {deltas}."
    )


@finding
def strategies(results: Path) -> str:
    """Node strategies on digits and Fashion-MNIST, each against local training from the same warm start."""
    ds = [_data(results, stem) for stem in ("ablations_digits", "ablations_fashion_mnist")]
    head, cols = ["strategy of every node"], []
    for d in ds:
        clean = _strategies(d)
        for a in d["settings"]["alphas"]:
            head.append(f"{d['settings']['task']}, alpha = {a:g}")
            cols.append({m: clean[m][float(a)] for m in clean})
    rows = [[m, *(_pm(c[m]) if m in c else "-" for c in cols)] for m in ds[0]["settings"]["mixes"]]
    st = ds[0]["settings"]
    return (
        f"Consensus test accuracy without attackers, {st['nodes']} nodes, {st['rounds']} rounds x "
        f"{st['local_steps']} local steps, mean ± std over seeds {st['seeds']}:\n\n{_table(head, rows)}\n\n"
        + " ".join(_strategy_deltas(d) for d in ds)
        + "\n\n"
        + consensus_vs_alone(results)
        + " "
        + barriers(results)
    )


@finding
def strategies_text(results: Path) -> str:
    """On text every variant lies within the seeds' spread; only DP separates."""
    d = _data(results, "ablations_text")
    sm = d["summary"]
    runs = {**{k: v for k, v in sm["strategies"].items()}, **sm["merges"]}
    dp = [k for k in runs if "DP" in k]
    rest = {k: v["consensus_accuracy"] for k, v in runs.items() if k not in dp}
    means = [v[0] for v in rest.values()]
    spread = max(v[1] for v in rest.values())
    nominal = [k for k in dp if "nominal" in k and k.endswith("clean")][0]
    eps8 = [k for k in dp if "epsilon = 8" in k and k.endswith("clean")][0]
    default = sm["merges"]["vote + mixture NLL (default) | clean"]
    b = next(iter(sm["baselines"].values()))
    return (
        f"Text ({d['settings']['nodes']} byte-level transformer nodes, {d['settings']['rounds']} rounds x "
        f"{d['settings']['local_steps']} local steps, seeds {d['settings']['seeds']}): the consensus's "
        f"next-byte accuracy over {len(rest)} strategy and merge variants, clean and attacked, ranges "
        f"from {_a(min(means))} to {_a(max(means))}, against a seed-to-seed std of up to {_a(spread)}; "
        f"nodes trained alone reach {_pm(b['alone_mean'])} and centralised training {_pm(b['central_all'])}. "
        f"Node-level DP at z = 0.01 gives {_pm(runs[nominal]['consensus_accuracy'])} (perplexity "
        f"{runs[nominal]['consensus_perplexity'][0]:.1f} against {default['consensus_perplexity'][0]:.1f}), "
        f"at epsilon = 8 {_pm(runs[eps8]['consensus_accuracy'])}."
    )


@finding
def barriers(results: Path) -> str:
    """Loss barriers between nodes in the system and between nodes trained alone; the convexity pull."""
    out = []
    for stem in ("ablations_digits", "ablations_fashion_mnist", "ablations_text"):
        if not (results / f"{stem}.json").is_file():
            continue
        d = _data(results, stem)
        sm = d["summary"]
        system_max = max(
            max(v["pairwise_barrier_mean"][0], v["to_consensus_barrier_mean"][0])
            for v in sm["strategies"].values()
        )
        alone_max = max(b["pairwise_mean"][0] for b in sm["baselines"].values())
        dist_sys = _mean(
            [v["pairwise_distance"][0] for v in sm["strategies"].values() if "pairwise_distance" in v]
        )
        dist_alone = _mean([b["pairwise_distance"][0] for b in sm["baselines"].values()])
        out.append(
            f"{d['settings']['task']} {system_max:.4f} in the system, {alone_max:.4f} between nodes "
            "trained alone "
            f"(mean distance between two nodes {dist_sys:.2f} and {dist_alone:.2f})"
        )
    return (
        "Largest loss barrier on held-out data (nats above the chord, 9 points per line): "
        + "; ".join(out)
        + ". "
        + convexity_pull(results)
    )


@finding
def convexity_pull(results: Path) -> str:
    """Why the convexity strategy's default pull changes nothing at the ablations' budget."""
    from meta_consensus.config.schema import NodesConfig
    from strategies.node import Convexity

    mu, lr = Convexity().mu, NodesConfig().learning_rate
    d = _data(results, "ablations_digits")
    steps = d["settings"]["local_steps"]
    per_step = 1 - 1 / (1 + lr * mu)
    per_round = 1 - (1 / (1 + lr * mu)) ** steps
    deltas: dict[str, list[str]] = {"proximal": [], "tangent": []}
    rows = {"proximal": "convexity + public warm start", "tangent": "convexity (tangent) + public warm start"}
    for stem in ("ablations_digits", "ablations_fashion_mnist"):
        if (results / f"{stem}.json").is_file():
            c = _strategies(_data(results, stem))
            for mode, row in rows.items():
                if row not in c:  # a page measured before the mode existed
                    continue
                diffs = ", ".join(
                    f"{_spts(c[row][a][0] - c[REFERENCE][a][0])} at alpha = {a:g}" for a in c[REFERENCE]
                )
                deltas[mode].append(f"{_data(results, stem)['settings']['task']} {diffs}")
    tangent = (
        f" Tangent-space convexity nodes (the model's first-order expansion at each round's consensus) "
        f"against the same: {'; '.join(deltas['tangent'])}."
        if deltas["tangent"]
        else ""
    )
    return (
        f"The proximal step shrinks the distance to the consensus by 1 / (1 + lr mu) per step: with the "
        f"default mu = {mu:g} and Adam's lr = {lr:g}, {100 * per_step:.2f}% a step, {100 * per_round:.1f}% "
        f"over the {steps} local steps of a round. Convexity against local training from the same warm "
        f"start, consensus test accuracy (points): {'; '.join(deltas['proximal'])}.{tangent}"
    )


@finding
def merge_pipeline_digits(results: Path) -> str:
    """The merge pipeline on digits: vote, weights, DP, with and without attackers."""
    d = _data(results, "ablations_digits")
    mg = d["summary"]["merges"]
    names = [k[: -len(" | clean")] for k in mg if k.endswith(" | clean")]
    rows = []
    for n in names:
        c, a = mg[f"{n} | clean"], mg[f"{n} | attack"]
        rows.append(
            [n, _pm(c["consensus_accuracy"]), _pm(a["consensus_accuracy"]), f"{a['byzantine_weight'][0]:.3f}"]
        )
    plain = [n for n in names if "DP" not in n and "private" not in n]
    best_c = max(plain, key=lambda n: mg[f"{n} | clean"]["consensus_accuracy"][0])
    best_a = max(plain, key=lambda n: mg[f"{n} | attack"]["consensus_accuracy"][0])
    acc = {n: mg[f"{n} | clean"]["consensus_accuracy"][0] for n in names}
    atk = {n: mg[f"{n} | attack"]["consensus_accuracy"][0] for n in names}
    nll, vote = "vote + mixture NLL (default)", "vote alone"
    dp8 = [n for n in names if "epsilon = 8" in n and "node DP" in n][0]
    nominal = [n for n in names if "nominal" in n][0]
    p_dp = [n for n in names if n.startswith("private.toml") and "DP-SGD" in n][0]
    p_no = [n for n in names if n.startswith("private.toml") and "without DP" in n][0]
    return (
        f"Digits, default strategy mix, alpha = {d['settings']['default_alpha']:g}, mean ± std over seeds "
        f"{d['settings']['seeds']}; 'byz weight' is the attackers' total weight in the consensus (a plain "
        f"mean gives them {len(d['settings']['byzantine_nodes'])}/{d['settings']['nodes']}):\n\n"
        f"{_table(['merge', 'clean', 'attack', 'byz weight'], rows)}\n\n"
        f"Best without attackers: {best_c}; under attack: {best_a}. The mixture-NLL weights on top of the "
        f"vote are {_pts(acc[nll] - acc[vote])} points {_side(acc[nll] - acc[vote])} the vote alone clean "
        "and "
        f"{_pts(atk[nll] - atk[vote])} {_side(atk[nll] - atk[vote])} it under attack. Node-level DP costs "
        f"{_pts(acc[nll] - acc[nominal])} points at the nominal z = 0.01 and leaves {_a(acc[dp8])} at "
        "epsilon = 8; "
        f"example-level DP-SGD in `configs/private.toml` costs {_pts(acc[p_no] - acc[p_dp])} points at "
        f"epsilon = 8 ({_a(acc[p_dp])} against {_a(acc[p_no])} without DP)."
    )


@finding
def consensus_vs_alone(results: Path) -> str:
    """The consensus against the best node trained alone and centralised training."""
    out = []
    for stem in ("ablations_digits", "ablations_fashion_mnist"):
        d = _data(results, stem)
        alone, central = [], []
        for key, b in d["summary"]["baselines"].items():
            a = float(key.split("=")[1])
            cons = d["summary"]["strategies"][f"default mix | alpha={a:g} | clean"]["consensus_accuracy"][0]
            alone.append(_spts(cons - b["alone_honest_best"][0]))
            central.append(_spts(cons - b["central_all"][0]))
        alphas = " / ".join(k.split("=")[1] for k in d["summary"]["baselines"])
        which = "" if _mix_label(d, "default mix") == "default mix" else ", the former default mix"
        out.append(
            f"{d['settings']['task']} (alpha = {alphas}{which}): {' / '.join(alone)} points against the best "
            "honest node "
            f"trained alone, {' / '.join(central)} against centralised training"
        )
    return (
        "The default's consensus, clean, every baseline with the system's whole step budget: "
        + "; ".join(out)
        + "."
    )


# ----------------------------------------------------------------------------- soups


@finding
def soups(results: Path) -> str:
    """Greedy soups against the best ingredient; soup nodes against local nodes in the system."""
    d = _data(results, "soups")
    sm = d["summary"]
    t, tl = sm["target"], sm["target_loss_variant"]
    acc = {m: sm[m]["test_acc"] for m in sm if not m.startswith("target")}
    listing = ", ".join(f"{m} {_pm(v)}" for m, v in acc.items())
    return (
        f"Test accuracy over {len(d['settings']['seeds'])} seeds: {listing}. The accuracy-greedy soup is at "
        f"least the best ingredient on {t['seeds_met']} of {t['seeds']} seeds ({_spts(t['mean_diff'][0])} "
        f"points on average), the loss-greedy soup on {tl['seeds_met']} of {tl['seeds']} "
        f"({_spts(tl['mean_diff'][0])}). " + soup_strategy(results)
    )


@finding
def soup_strategy(results: Path) -> str:
    """The soup node strategy against local training from the same warm start."""
    out = []
    for stem in ("ablations_digits", "ablations_fashion_mnist"):
        d = _data(results, stem)
        c = _strategies(d)
        diffs = ", ".join(
            f"{_spts(c['soup + public warm start'][a][0] - c[REFERENCE][a][0])} at alpha = {a:g}"
            for a in c[REFERENCE]
        )
        out.append(f"{d['settings']['task']} {diffs}")
    return (
        "Soup nodes against local nodes from the same warm start, consensus test accuracy (points): "
        + "; ".join(out)
        + "."
    )


# ----------------------------------------------------------------------------- convex weights

CONVEX_ROWS = (
    "best single node (held-out)",
    "uniform",
    "quadratic",
    "trust-region quadratic",
    "mixture NLL",
    "mixture NLL, cap 2/n",
    "anchor (median)",
)


@finding
def convex_quality(results: Path) -> str:
    """Convex weights per objective and alpha (test accuracy of the merged model)."""
    d = _data(results, "convex_quality")
    alphas = d["settings"]["alphas"]
    rows = []
    for name in CONVEX_ROWS:
        row = [name]
        for a in alphas:
            accs = [r["rows"][name]["test_acc"] for r in d["runs"] if r["alpha"] == a and name in r["rows"]]
            row.append(_pm((_mean(accs), _std(accs))) if accs else "n/a")
        rows.append(row)
    s = d["settings"]
    return (
        f"{s['n']} digits nodes on Dirichlet shards, {len(s['seeds'])} seeds, test accuracy of the merged "
        f"model (mean ± std):\n\n{_table(['merge', *(f'alpha = {a:g}' for a in alphas)], rows)}"
    )


# ----------------------------------------------------------------------------- privacy


@finding
def privacy_node(results: Path) -> str:
    """Node-level DP-FedAvg over many sampled clients, per epsilon."""
    d = _data(results, "privacy_quality")
    s = d["settings"]
    per = ", ".join(
        f"{'no noise' if eps == 'inf' else 'epsilon = ' + format(float(eps), 'g')} "
        f"{_pm(d['summary'][eps]['test_acc'])}"
        for eps in d["noise"]
    )
    t = d["target"]
    return (
        f"Node-level, {s['clients']} digits clients, q = {s['q']:.1f}, {s['rounds']} rounds, softmax "
        f"regression, {len(s['seeds'])} seeds: {per}; at epsilon = 8, {_pts(t['gap'])} points below training "
        f"without noise and {_pts(t['gap_central'])} below central training "
        f"({_a(d['central']['test_acc'][0])})."
    )


@finding
def privacy_example(results: Path) -> str:
    """Example-level DP-SGD in every node against node-level DP over the same 16 nodes."""
    d = _data(results, "privacy_quality_example")
    s = d["settings"]
    levels: dict[str, dict[str, Sequence[float]]] = {}
    for r in d["rows"]:
        levels.setdefault(r["level"], {})[f"{r['target_epsilon']:g}"] = r["test_acc"]
    ex, node = levels["example"], levels["node"]
    eps = [e for e in sorted(ex, key=float) if e in node]
    per = ", ".join(f"epsilon = {e}: {_a(ex[e][0])} against {_a(node[e][0])}" for e in eps)
    non = ex["inf"][0]
    return (
        f"Example-level against node-level DP, {s['task']}, 16 nodes, seeds {s['seeds']}, test accuracy "
        f"(without DP {_a(non)}): {per}; at epsilon = 3 example-level DP costs {_pts(non - ex['3'][0])} "
        "points, "
        f"node-level DP {_pts(non - node['3'][0])}."
    )


@finding
def privacy(results: Path) -> str:
    """Node-level DP-FedAvg over many clients, example-level DP-SGD, and DP-FedAvg with sampling."""
    return "\n\n".join(f(results) for f in (privacy_node, privacy_example, privacy_sampled))


@finding
def privacy_sampled(results: Path) -> str:
    """DP-FedAvg through the system with Poisson client sampling, against the standalone loop."""
    d = _data(results, "privacy_sampled")
    s = d["settings"]
    st, sy = d["standalone"]["test_acc"], d["system"]["test_acc"]
    return (
        f"{s['clients']} clients, q = {s['q']:.1f}, {s['rounds']} rounds, epsilon = {s['epsilon']:g}: the "
        f'system with `nodes.sampling = "poisson"` reaches {_pm(sy)}, the standalone `dp_fedavg` loop on '
        f"the same shards {_pm(st)} ({_pts(sy[0] - st[0])} points {_side(sy[0] - st[0])}); both ledgers "
        f"spend epsilon = {d['accountant_epsilon']:.4f}."
    )


@finding
def privacy_in_system(results: Path) -> str:
    """Node-level DP at epsilon 8 over the default's 8 nodes."""
    d = _data(results, "meta_consensus")
    ms = d["summary"]["clean"]["mean_std"]
    eps = d["summary"]["clean"]["epsilon"]
    full_eps = eps["full"] if isinstance(eps, Mapping) else eps
    return (
        f"Over the default's {d['settings']['nodes']} nodes (every node in every round), node-level DP "
        f"calibrated to epsilon = 8 leaves the consensus at {_pm(ms['DP at epsilon = 8'])} test accuracy "
        f"(without DP {_pm(ms['without DP'])}); the nominal noise multiplier 0.01 spends epsilon "
        f"{float(full_eps):.3g}."
    )


# ----------------------------------------------------------------------------- merging methods


BASE = "base (no merge)"
MERGING_ROWS = (
    BASE,
    "average",
    "task arithmetic",
    "ties",
    "ties (count)",
    "model stock",
    "regmean",
    "fisher",
    "layer-wise convex",
    "layer-wise convex (scaled)",
    "trimmed mean (scaled)",
    "nnm+ties (count)",
)


def _merging_averages(d: Mapping[str, Any], part: str) -> dict[str, float]:
    """Method -> average normalized accuracy; the base's from the runs where the summary lacks it."""
    out = {k: float(v["average"]) for k, v in d[part].items()}
    if BASE not in out:
        out[BASE] = _mean([_mean(r["base_normalized"]) for r in d["runs"]])
    return out


@finding
def merging(results: Path) -> str:
    """Normalized accuracy of the merge methods, clean and with 2 of 8 fine-tunes poisoned; the ordering."""
    dg, fm = _data(results, "merging"), _data(results, "merging_fashion_mnist")
    cols = [_merging_averages(dg, "clean"), _merging_averages(dg, "robust")]
    cols += [_merging_averages(fm, "clean"), _merging_averages(fm, "robust")]
    names = sorted((n for n in cols[1] if n in MERGING_ROWS), key=lambda n: -cols[0].get(n, cols[1][n]))
    rows = [[f"*{n}*" if n == BASE else n, *(f"{c[n]:.3f}" if n in c else "-" for c in cols)] for n in names]
    head = ["method", "digits", "digits, 2 poisoned", "Fashion-MNIST", "Fashion-MNIST, 2 poisoned"]
    return (
        "Average normalized accuracy over the 8 tasks (a task's accuracy over its own fine-tune's), "
        f"mean over {dg['settings']['seeds']} seeds:\n\n{_table(head, rows)}\n\n" + merging_order(results)
    )


@finding
def merging_order(results: Path) -> str:
    """Whether the published ordering (average < task arithmetic < TIES) holds, and what beats the base."""
    out = []
    for stem in ("merging", "merging_fashion_mnist"):
        d = _data(results, stem)
        c = _merging_averages(d, "clean")
        base = c[BASE]
        holds = c["average"] < c["task arithmetic"] < c["ties"]
        above = [k for k, v in c.items() if v > base + 0.005 and k != BASE]
        best = max((k for k in c if k != BASE), key=lambda k: c[k])
        clears = (
            f"{len(above)} of {len(c) - 1} methods clear it by half a point ({', '.join(above)})"
            if above
            else "no method clears it by half a point"
        )
        out.append(
            f"{d['settings']['task']}: average {_a(c['average'])}, task arithmetic "
            f"{_a(c['task arithmetic'])}, "
            f"TIES {_a(c['ties'])}, so the published ordering {'holds' if holds else 'does not hold'}; the "
            "best "
            f"method is {best} ({_a(c[best])}); the base alone scores {_a(base)} and {clears}"
        )
    return "; ".join(out) + "."


# ----------------------------------------------------------------------------- LoRA


@finding
def lora(results: Path) -> str:
    """LoRA merges against full fine-tuning: perplexity and bytes per round."""
    d = _data(results, "lora")
    sm, lo, s = d["summary"], d["sizes"]["lora"], d["settings"]

    def ppl(k: str) -> str:
        return f"{sm[k]['perplexity_mean']:.2f}"

    full, best = sm["full fine-tuning, FedAvg"], sm[d["winner_clean"]]
    return (
        f"Rank-{s['rank']} adapters ({100 * lo['adapter_params'] / lo['model_params']:.1f}% of the "
        "parameters), "
        f"{s['nodes']} nodes, {s['seeds']} seeds, test perplexity: the base "
        f"{ppl('base (no fine-tuning)')}, each "
        f"node alone {ppl('local (each node alone)')}, full fine-tuning with FedAvg "
        f"{ppl('full fine-tuning, FedAvg')}; "
        f"adapters merged by "
        + ", ".join(f"`{k}` {ppl(k)}" for k in ("fedit", "stack", "svd", "exact_residual", "ffa") if k in sm)
        + f", the best `{d['winner_clean']}` sending {best['bytes_up'] / 1024:.0f} KB up and "
        f"{best['bytes_down'] / 1024:.0f} KB down per node and round against {full['bytes_up'] / 1024:.0f} "
        "KB "
        f"each way. Under 2 of 8 attackers: FedIT's mean {ppl('fedit, attacked, mean')}, "
        f"`{d['best_robust']}` "
        f"{ppl(d['best_robust'])}, FedIT over the honest nodes alone {ppl('fedit, honest nodes only')}. "
        f"DP-SGD at epsilon 8: FedIT {ppl('fedit, DP-SGD')}, FFA-LoRA {ppl('ffa, DP-SGD')}."
    )


# ----------------------------------------------------------------------------- client sampling


@finding
def cross_device(results: Path) -> str:
    """Round time and memory as the number of sampled clients grows; robust rules with sampling."""
    d = _data(results, "rounds_cross_device")
    by: dict[str, dict[int, Mapping[str, Any]]] = {}
    for k, v in d["results"].items():
        merge, m = k.rsplit(", m = ", 1)
        by.setdefault(merge, {})[int(m)] = v
    parts = []
    for merge, runs in by.items():
        lo, hi = min(runs), max(runs)
        parts.append(
            f"{merge}: {runs[lo]['ms']['total']:.0f} ms a round at m = {lo}, {runs[hi]['ms']['total']:.0f} "
            "ms at "
            f"m = {hi} (weights {runs[hi]['ms']['weights']:.0f} ms), peak memory "
            f"{runs[hi]['peak_rss_mb'] - runs[hi]['rss_after_init_mb']:.0f} MB above init"
        )
    return f"N = {d['settings']['N']} clients: " + "; ".join(parts) + ". " + robustness_sampled(results)


@finding
def robustness_sampled(results: Path) -> str:
    """Robust rules with client sampling: the worst case over attacks."""
    d = _data(results, "robustness_sampled")
    s = d["settings"]
    worst: dict[str, tuple[float, str]] = {}
    for r in d["runs"]:
        worst[r["rule"]] = min(worst.get(r["rule"], (math.inf, "")), (r["test_acc"], r["attack"]))
    best = max((r for r in worst if r != "mean"), key=lambda r: worst[r][0])
    over = max(r["rounds_over_f"] for r in d["runs"])
    listing = ", ".join(f"{r} {_a(w)} ({a})" for r, (w, a) in worst.items())
    return (
        f"With sampling (N = {s['N']}, m = {s['m']}, every 4th client Byzantine, one seed), worst case over "
        f"{len(s['attacks'])} attacks: {listing}; clean FedAvg {_a(d['clean']['test_acc'])}; best {best}. In "
        f"{100 * over:.0f}% of the rounds a sample held more Byzantine clients than the rule tolerates."
    )


# ----------------------------------------------------------------------------- speed


SPEED_RULES = (
    "mean",
    "median",
    "trimmed_mean",
    "clip",
    "krum",
    "multi_krum",
    "geometric_median",
    "centered_clipping",
)


@finding
def aggregator_speed(results: Path) -> str:
    """The rules' time over one numpy pass at n = 16, d = 1e7; the order statistics up to 1024 nodes."""
    d = _data(results, "aggregators_jit")
    r0 = d["results"][0]
    rules = ", ".join(
        f"{r['rule']} {_x(r['eager'])} / {_x(r['jit'])} / {_x(r['jit, no params'])}"
        for r in d["results"]
        if r.get("input") == "clean" and r["rule"] in SPEED_RULES
    )
    return (
        f"At n = {r0['n']}, d = {r0['d']:.0e}, eager / inside your jit / inside your jit without params: "
        f"{rules}. " + nsweep(results)
    )


@finding
def nsweep(results: Path) -> str:
    """The order statistics from 8 to 1024 nodes, over one numpy pass and against numpy's own."""
    d = _data(results, "aggregators_nsweep")
    by_n: dict[int, dict[str, Mapping[str, Any]]] = {}
    for r in d["results"]:
        by_n.setdefault(int(r["n"]), {})[r["rule"]] = r
    lo, hi = min(by_n), max(by_n)
    parts = []
    for rule in ("median", "trimmed_mean", "bulyan second stage"):
        a, b = by_n[lo].get(rule), by_n[hi].get(rule)
        if a and b:
            parts.append(
                f"{rule} {a['eager']:.1f}x / {a['jit']:.1f}x at n = {lo}, {b['eager']:.1f}x / "
                f"{b['jit']:.1f}x at n = {hi}"
            )
    med = by_n[hi]["median"]
    return (
        "From few to many nodes (n x d fixed), eager / inside your jit: "
        + "; ".join(parts)
        + f"; at n = {hi} the median is {med['numpy / eager']:.1f}x / {med['numpy / jit']:.1f}x "
        "faster than np.median."
    )


def _ratio_rows(d: Mapping[str, Any], key: str) -> list[list[Any]]:
    return [[r[key], _x(r["eager_ratio"]), _x(r["jit_ratio"])] for r in d["rows"]]


@finding
def robust_speed(results: Path) -> str:
    """The server-guided and adaptive rules' and the merge methods' time over one numpy pass."""
    d = _data(results, "robust_speed")
    m = _data(results, "merging_speed")
    dg = m["diagnostics"]
    rules = ", ".join(f"{r['rule']} {_x(r['eager_ratio'])} / {_x(r['jit_ratio'])}" for r in d["rows"])
    methods = ", ".join(f"{r['method']} {_x(r['eager_ratio'])} / {_x(r['jit_ratio'])}" for r in m["rows"])
    return (
        f"n = {d['n']}, d = {d['d']:.0e}, eager / inside your jit. Rules: {rules}. Merge methods: {methods}; "
        f"a scaled copy of the stack alone takes {_x(dg['xla_copy_ratio'])} in XLA and "
        f"{_x(dg['numpy_copy_ratio'])} in numpy."
    )


@finding
def merge_io(results: Path) -> str:
    """Merging checkpoints out of core: time over reading every input once, and peak memory."""
    d = _data(results, "merge_io")
    s = d["settings"]
    runs = ", ".join(
        f"{re.sub(r' [(].*[)]$', '', k.removeprefix('merge '))} {_x(v['ratio_to_floor'])} "
        f"({_x(v['ratio_without_jax_startup'])} without jax's "
        f"start-up), {v['peak_rss_gb']:.2f} GB"
        for k, v in d["results"].items()
        if not k.startswith("I/O floor")
    )
    h = _data(results, "merge_methods_hf")
    hs = h["settings"]
    hf = ", ".join(
        f"{k} {_x(v['ratio_to_floor'])}, {v['peak_rss_gb']:.2f} GB" for k, v in h["results"].items()
    )
    return (
        f"{s['models']} checkpoints of {s['model_gb']:.1f} GB, time over reading them once and peak "
        f"memory: {runs}. "
        f"{hs['fine_tunes']} GPT-2-shaped checkpoints of {hs['model_mb'] / 1000:.2f} GB: {hf}."
    )


@finding
def trainers(results: Path) -> str:
    """The node trainer against a hand-written Flax + optax scan loop, and DP-SGD's cost."""
    t = _data(results, "trainers")["tasks"]
    dp = _data(results, "trainers_dp")["dp"]
    tp = ", ".join(f"{k} {v['summary']['trainer1_over_hand_scan_throughput']:.2f}x" for k, v in t.items())
    dps = "; ".join(
        f"{k}: {_x(v['dp_over_plain'])} (noise alone puts the floor at {_x(v['dp_over_plain_lower_bound'])})"
        for k, v in dp.items()
    )
    return (
        f"One node's throughput over a hand-written scan loop: {tp}. A DP-SGD step over the plain step, "
        f"8 nodes: {dps}."
    )


@finding
def privacy_accountants(results: Path) -> str:
    """The accountants' time."""
    d = _data(results, "privacy")["speed"]
    rows = {r["rounds"]: r for r in d["rows"]}
    last = max(rows)
    return (
        f"Accountants at q = {d['q']:g}, z = {d['z']:g}: RDP for 1,000 rounds in "
        f"{1000 * rows[1000]['rdp_s']:.0f} ms, "
        f"PLD for {last:,} rounds in {rows[last]['pld_s']:.2f} s; PLD's epsilon is "
        f"{min(r['pld_eps'] / r['rdp_eps'] for r in d['rows']):.2f} to "
        f"{max(r['pld_eps'] / r['rdp_eps'] for r in d['rows']):.2f} of RDP's."
    )


@finding
def convex_speed(results: Path) -> str:
    """The convex-weight solvers' time: a fresh build and solve against a re-solve of the cached problem."""
    d = _data(results, "convex")
    n = max(int(r["n"]) for r in d["timing"])
    parts = ", ".join(
        f"{r['objective']} ({r['method']}{'' if r['m'] is None else ', m = ' + format(r['m'], ',')}) "
        f"{r['fresh_ms']:.0f} / {r['resolve_ms']:.1f}"
        for r in d["timing"]
        if int(r["n"]) == n
    )
    gap = max(abs(float(r["objective_gap_vs_scipy"])) for r in d["timing"])
    return (
        f"Convex weights at n = {n}, ms fresh build and solve / re-solve: {parts}; every objective agrees "
        "with "
        f"scipy's SLSQP to {gap:.0e} or better."
    )


@finding
def accelerator_gpu(results: Path) -> str:
    """Which order-statistic formulation is fastest on the GPU, and the default's margin."""
    d = _data(results, "accelerator_gpu")
    default = d["order_impl_default"]
    counts: dict[str, int] = {}
    for impl in d["order_impl_faster"].values():
        counts[impl] = counts.get(impl, 0) + 1
    dp = d["dp"]
    fastest = ", ".join(f"{k} {v}" for k, v in sorted(counts.items()))
    return (
        f"{d['note'].split('(')[0].strip()}: fastest formulation per rule and n: {fastest} (of "
        f"{len(d['order_impl_faster'])}); the default there is `{default}`. A DP-SGD step costs "
        f"{_x(dp['dp_over_plain'])} the plain step there (lower bound {_x(dp['dp_over_plain_lower_bound'])})."
    )


@finding
def rounds(results: Path) -> str:
    """Where a round's time goes; the accountants; the convex-weight solvers."""
    d = _data(results, "rounds")
    parts = ", ".join(
        f"{k} {v['ms']['total']:.0f} ms a round, the coordinator's share {100 * v['coordinator_share']:.1f}%"
        for k, v in d["results"].items()
    )
    return f"Rounds: {parts}. " + privacy_accountants(results) + " " + convex_speed(results)


@finding
def domains(results: Path) -> str:
    """Merging fine-tunes of SmolLM2 across text domains: the best merge per regime, the tangent
    claim, the robust rows; the rows beside the multitask model."""
    from benchmarks.quality import domains as dom

    stem = "domains" if (results / "domains.json").is_file() else "domains_quick"
    if not (results / f"{stem}.json").is_file():
        return "Not measured on this machine yet: `python -m benchmarks domains --cpu` writes its results."
    d = _data(results, stem)
    runs = d["runs"]
    doms = list(runs[0]["domains"])
    summary = dom.summarize(runs)
    s = d["settings"]
    head = (
        f"{s['model']}, {len(doms)} domains ({', '.join(doms)}), one node per domain, {s['steps']} steps "
        f"of batch {s['batch']} at context {s['context']}, {len(runs)} seed(s); per-domain test perplexity "
        f"(lower is better; every row: [{stem}](results/{stem}.md)):"
    )
    lines = dom.findings(summary, doms)
    return head + "\n\n" + "\n".join(lines)


@finding
def preset_strategies(results: Path) -> str:
    """Each preset's node strategies against one strategy per node, in the preset's own setting."""
    from benchmarks.quality import preset_strategies as ps

    if not (results / "preset_strategies.json").is_file():
        return (
            "Not measured on this machine yet: `python -m benchmarks preset_strategies` writes its results."
        )
    d = _data(results, "preset_strategies")
    head = (
        f"{len(d['settings']['seeds'])} seed(s), the consensus's test accuracy after the last round "
        "(every row: [preset_strategies](results/preset_strategies.md)):"
    )
    return head + "\n\n" + "\n".join(ps.findings(d))


def names_in(text: str) -> list[str]:
    """The finding names used by ``<!-- publish: finding NAME -->`` blocks in ``text``."""
    return re.findall(r"<!-- publish: finding ([a-z0-9_]+) -->", text)
