"""The ablation benchmark's report: one renderer per section of ``ablations_<task>.md``, and the plot.

Every renderer takes the result record (``settings``, ``summary``, the runs) and returns its
section's lines; :func:`markdown` joins them in the order the committed reports have.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from benchmarks import harness
from benchmarks.harness import markdown_table

Result = Mapping[str, Any]


def _pm(ms: Sequence[float], digits: int = 3, scale: float = 1.0) -> str:
    m, s = ms
    if not math.isfinite(m):
        return "n/a"
    return f"{scale * m:.{digits}f}" if s == 0 else f"{scale * m:.{digits}f} ± {scale * s:.{digits}f}"


def _is_text(res: Result) -> bool:
    return res["settings"]["task"] == "text"


def _metric(res: Result) -> str:
    return "next-byte accuracy / perplexity" if _is_text(res) else "test accuracy"


def _per_alpha(res: Result, label: str) -> str:
    """A column label for one alpha ("" suffix on text, which has one fixed split)."""
    return "" if _is_text(res) else f" {label}"


def _accuracy_cell(res: Result, s: Mapping[str, Any]) -> str:
    cell = _pm(s["consensus_accuracy"])
    if _is_text(res):
        cell += f" / {_pm(s['consensus_perplexity'], 2)}"
    return cell


def header(res: Result) -> list[str]:
    """Title, command, machine, settings, the partial-run note and the setting of every run."""
    st = res["settings"]
    lines = harness.header(
        f"Ablations on {st['task']}: what each part of meta-consensus buys", st["name"], st["quick"], st
    )
    if "command" in st:  # the header's generic command names the result file, not this script's options
        lines = [f"Command: `{st['command']}`" if x.startswith("Command:") else x for x in lines]
    seeds = f"mean ± std over seeds {st['seeds']}" if len(st["seeds"]) > 1 else f"seed {st['seeds'][0]}"
    planned = st.get("seeds_planned", st["seeds"])
    if list(planned) != list(st["seeds"]):
        lines.append(
            f"**Partial:** seeds {st['seeds']} of {list(planned)} had finished when this was written "
            "(the files are rewritten after every seed)."
        )
        lines.append("")
    # A saved result names its machine; a fresh run renders before saving, on this machine.
    m = res.get("machine")
    cores = (m if isinstance(m, Mapping) else harness.machine()).get("cpu_count", "?")
    lines.append(
        f"Every run: {st['nodes']} nodes, {st['rounds']} rounds x {st['local_steps']} local steps, "
        f"{seeds}; 'attack' = the default's attackers (nodes {st['byzantine_nodes']}, "
        f"{st['attack']}); vote {st['vote']}, weights {st['weights']} unless the row says otherwise. "
        f"The machine was shared ({cores} cores, other jobs running): the seconds are not comparable."
    )
    lines.append("")
    return lines


def strategies_consensus(res: Result) -> list[str]:
    """The consensus's accuracy per node-strategy mix, alpha and threat."""
    st, sm = res["settings"], res["summary"]
    head = ["strategy of every node"]
    for alpha in st["alphas"]:
        for threat in st["threats"]:
            head.append(threat if _is_text(res) else f"a={alpha:g} {threat}")
    rows = []
    for mix in st["mixes"]:
        row = [mix]
        for alpha in st["alphas"]:
            for threat in st["threats"]:
                row.append(_accuracy_cell(res, sm["strategies"][f"{mix} | alpha={alpha:g} | {threat}"]))
        rows.append(row)
    return [f"## Node strategies: the consensus's {_metric(res)}", "", markdown_table(head, rows)]


def strategies_nodes(res: Result) -> list[str]:
    """The honest nodes' own accuracy (mean, spread, best) per mix and alpha, no attacker."""
    st, sm = res["settings"], res["summary"]
    lines = ["## Node strategies: the honest nodes (no attacker)", ""]
    lines.append(
        "Per alpha: the honest nodes' test accuracy after the last round's training (mean over the "
        "nodes), its spread (std over the nodes of one run) and the best node, each mean ± std over seeds."
    )
    lines.append("")
    head = ["strategy"]
    for alpha in st["alphas"]:
        a = _per_alpha(res, f"a={alpha:g}")
        head += [f"node acc{a}", f"spread{a}", f"best node{a}"]
    rows = []
    for mix in st["mixes"]:
        row = [mix]
        for alpha in st["alphas"]:
            s = sm["strategies"][f"{mix} | alpha={alpha:g} | clean"]
            row += [_pm(s[f]) for f in ("node_accuracy_mean", "node_accuracy_spread", "node_accuracy_best")]
        rows.append(row)
    lines.append(markdown_table(head, rows))
    return lines


SAME_DATA = "local + public warm start"


def same_data(res: Result) -> list[str]:
    """Every mix against local training that sees the same public rows, per alpha (no attacker)."""
    st, sm = res["settings"], res["summary"]
    if SAME_DATA not in st["mixes"]:
        return []
    lines = [f"## Each strategy against local training on the same data (no attacker, vs '{SAME_DATA}')", ""]
    lines.append(
        f"'{SAME_DATA}': the initial consensus trained on the task's public pool for "
        f"{st.get('public_warm_start_steps', '?')} steps (the public-pool steps of one hierarchical node "
        "over the run), then every node local on its own shard: the same rows a hierarchical node "
        "draws. Per alpha: the consensus's held-out accuracy, and the consensus's test accuracy and the "
        "honest nodes' mean test accuracy minus the reference's (points, mean over seeds). 'local' sees "
        "no public row; the union row is centralised data (an upper bound, not a strategy)."
    )
    lines.append("")
    head = ["strategy"]
    for alpha in st["alphas"]:
        a = _per_alpha(res, f"a={alpha:g}")
        head += [f"held-out acc{a}", f"Δ consensus{a}", f"Δ nodes{a}"]
    rows = []
    for mix in st["mixes"]:
        row = [mix]
        for alpha in st["alphas"]:
            s = sm["strategies"][f"{mix} | alpha={alpha:g} | clean"]
            r = sm["strategies"][f"{SAME_DATA} | alpha={alpha:g} | clean"]
            row.append(_pm(s["consensus_heldout_accuracy"]))
            for f in ("consensus_accuracy", "node_accuracy_mean"):
                row.append("ref." if mix == SAME_DATA else f"{100 * (s[f][0] - r[f][0]):+.1f}")
        rows.append(row)
    lines.append(markdown_table(head, rows))
    return lines


def soups(res: Result) -> list[str]:
    """Soup nodes: their own held-out split's accuracy, latest snapshot against the soup submitted."""
    st, sm = res["settings"], res["summary"]
    mixes = [
        m
        for m in st["mixes"]
        if any(
            # (runs recorded before the soup measures hold none: no section)
            math.isfinite(
                sm["strategies"][f"{m} | alpha={a:g} | clean"].get("soup_accuracy_mean", [math.nan])[0]
            )
            for a in st["alphas"]
        )
    ]
    if not mixes:
        return []
    lines = ["## Soups: the node's own held-out split (no attacker)", ""]
    lines.append(
        "A soup node holds out a share of its own shard (never trained on) and submits the greedy "
        "soup of its snapshots that starts from the latest and keeps a snapshot only if the held-out "
        "accuracy (ties: the loss) is not worse. 'latest' and 'soup': the honest soup nodes' accuracy "
        "on that split in the last round (mean over nodes, mean ± std over seeds); 'min gain': the "
        "smallest soup - latest over every round and soup node (never below 0 by construction)."
    )
    lines.append("")
    head = ["mix"]
    for alpha in st["alphas"]:
        a = _per_alpha(res, f"a={alpha:g}")
        head += [f"latest{a}", f"soup{a}", f"min gain{a}"]
    rows = []
    for mix in mixes:
        row = [mix]
        for alpha in st["alphas"]:
            s = sm["strategies"][f"{mix} | alpha={alpha:g} | clean"]
            row += [_pm(s["soup_latest_accuracy_mean"]), _pm(s["soup_accuracy_mean"])]
            row.append(f"{s['soup_gain_min'][0]:+.3f}" if math.isfinite(s["soup_gain_min"][0]) else "n/a")
        rows.append(row)
    lines.append(markdown_table(head, rows))
    return lines


def barriers(res: Result) -> list[str]:
    """Loss barriers between honest nodes and to the consensus, per mix and for the nodes alone."""
    st, sm = res["settings"], res["summary"]
    lines = ["## Mergeability: loss barriers (no attacker)", ""]
    lines.append(
        "On held-out data (nats; `strategies.convexity.pairwise_barriers` / `anchor_barriers`, 9 points "
        "per line): 'barrier' is the largest loss above the chord (0 when the loss is convex along the "
        "line), mean over pairs of honest nodes; 'midpoint' the loss at the midpoint minus the chord's "
        "(negative: the average of two nodes beats their mean loss); 'dist' the mean L2 distance between "
        "two nodes; 'to consensus' the barrier on the line from the final consensus to each node. "
        "'nodes alone' are the independently trained nodes of the baselines (to consensus: to their "
        "plain average)."
    )
    lines.append("")
    head = ["strategy"]
    for alpha in st["alphas"]:
        a = _per_alpha(res, f"a={alpha:g}")
        head += [f"barrier{a}", f"midpoint{a}", f"dist{a}", f"to consensus{a}"]
    fields = (
        "pairwise_barrier_mean",
        "pairwise_midpoint_gap",
        "pairwise_distance",
        "to_consensus_barrier_mean",
    )
    rows = []
    for mix in st["mixes"]:
        row = [mix]
        for alpha in st["alphas"]:
            s = sm["strategies"][f"{mix} | alpha={alpha:g} | clean"]
            row += [_pm(s[f], 2 if f == "pairwise_distance" else 4) for f in fields]
        rows.append(row)
    if sm["baselines"]:
        row = ["nodes alone (no rounds)"]
        for alpha in st["alphas"]:
            s = sm["baselines"][f"alpha={alpha:g}"]
            row += [
                _pm(s["pairwise_mean"], 4),
                _pm(s["pairwise_midpoint_gap"], 4),
                _pm(s["pairwise_distance"], 2),
                _pm(s["to_consensus_mean"], 4),
            ]
        rows.append(row)
    lines.append(markdown_table(head, rows))
    return lines


def barriers_by_node_strategy(res: Result) -> list[str]:
    """Within the default mix: each node strategy's barrier to the consensus and its accuracy."""
    st, sm = res["settings"], res["summary"]
    if "default mix" not in st["mixes"]:
        return []
    lines = [
        "Within the default mix (no attacker): each strategy's nodes, barrier to the consensus / "
        "test accuracy:",
        "",
    ]
    strategies = sorted(
        {s for r in res["strategy_runs"] if r["mix"] == "default mix" for s in r["node_strategies"]}
    )
    rows = []
    for alpha in st["alphas"]:
        d = sm["by_node_strategy"][f"alpha={alpha:g} | clean"]
        rows.append(
            [f"alpha = {alpha:g}"]
            + [f"{_pm(d[s], 4)} / {_pm(d[f'{s} accuracy'])}" if s in d else "" for s in strategies]
        )
    lines.append(markdown_table(["setting", *strategies], rows))
    return lines


def merge_pipeline(res: Result) -> list[str]:
    """Every merge variant at the default mix: accuracy clean and attacked, byz weight, epsilon."""
    st, sm = res["settings"], res["summary"]
    if not st["merges"]:
        return [
            "## Merge pipeline",
            "",
            "Not run here (`--no-merges`): this file holds the node-strategy rows and the baselines only.",
            "",
        ]
    metric = _metric(res)
    lines = [
        "## Merge pipeline (default strategy mix"
        + ("" if _is_text(res) else f", alpha = {st['default_alpha']:g}")
        + ")",
        "",
    ]
    head = [
        "merge",
        f"{metric} clean",
        f"{metric} attack",
        "byz weight (attack)",
        "vs default, clean (points)",
        "epsilon",
        "failed rounds",
    ]
    ref = (
        sm["merges"]
        .get("vote + mixture NLL (default) | clean", {})
        .get("consensus_accuracy", (math.nan, 0))[0]
    )
    rows = []
    for merge in st["merges"]:
        c, a = sm["merges"][f"{merge} | clean"], sm["merges"][f"{merge} | attack"]
        eps = c["epsilon"][0]
        rows.append(
            [
                merge,
                _accuracy_cell(res, c),
                _accuracy_cell(res, a),
                _pm(a["byzantine_weight"], 3),
                f"{100 * (c['consensus_accuracy'][0] - ref):+.1f}",
                "∞" if not math.isfinite(eps) else f"{eps:.3g}",
                c["failed_rounds"] + a["failed_rounds"],
            ]
        )
    lines.append(markdown_table(head, rows))
    lines.append(
        "'byz weight': the attackers' total weight in the consensus, mean over rounds and seeds (a plain "
        f"mean gives them {len(st['byzantine_nodes'])}/{st['nodes']}). 'failed rounds': rounds that failed "
        "after their retries (the consensus carried over), summed over seeds and both threats. The "
        "private.toml rows run that file (its own strategies, batch, learning rate and alpha) at this "
        "budget: compare them with each other, not with the rows above."
    )
    lines.append("")
    return lines


def baselines(res: Result) -> list[str]:
    """Nodes alone, centralised training and the system side by side, per alpha."""
    st, sm = res["settings"], res["summary"]
    text = _is_text(res)
    if "default mix" not in st["mixes"] or not sm["baselines"]:
        return []
    lines = ["## Baselines that never train from the consensus", ""]
    head = [
        "setting",
        "nodes alone: mean",
        "alone: best honest",
        "alone, averaged",
        "centralised: all nodes",
        "centralised: honest nodes",
        "system: default mix, clean",
        "system: default mix, attack",
        "system: best node (clean)",
    ]
    rows = []
    for alpha in st["alphas"]:
        b = sm["baselines"][f"alpha={alpha:g}"]
        c = sm["strategies"][f"default mix | alpha={alpha:g} | clean"]
        a = sm["strategies"][f"default mix | alpha={alpha:g} | attack"]
        rows.append(
            [
                "text" if text else f"alpha = {alpha:g}",
                _pm(b["alone_mean"]),
                _pm(b["alone_honest_best"]),
                _pm(b["alone_average"]),
                _pm(b["central_all"]),
                _pm(b["central_honest"]),
                _pm(c["consensus_accuracy"]),
                _pm(a["consensus_accuracy"]),
                _pm(c["node_accuracy_best"]),
            ]
        )
    lines.append(markdown_table(head, rows))
    # Runs on the splits with a public pool record its warm start; older runs had no public pool.
    pool = "public pool and the " if "public_warm_start_steps" in st else ""
    lines.append(
        f"Each node alone: Adam on its own shard for {st['rounds']} x {st['local_steps']} steps, the "
        "system's whole budget, from the system's initial model; centralised: the same steps on the "
        f"{pool}union of the shards with a batch of n x the nodes' batch in each step (the "
        "honest nodes of the attack setting, or all); 'alone, averaged': the plain average of the "
        "independently trained "
        "nodes' parameters (one merge at the end, no rounds). The system's best node is trained "
        "from the consensus in the last round, so it inherits it: the comparison that separates "
        "them is 'nodes alone'."
    )
    if text:
        lines.append("")
        b = sm["baselines"]["alpha=0.5"]
        lines.append(
            f"Text perplexity: nodes alone {_pm(b['alone_mean_perplexity'], 2)} (mean over nodes), "
            f"centralised {_pm(b['central_all_perplexity'], 2)}."
        )
    lines.append("")
    return lines


def footer(res: Result) -> list[str]:
    """The parts of a ``--combine``, the plot and the total time."""
    st = res["settings"]
    lines = []
    if st.get("parts"):
        lines.append(
            "Combined (`--combine`) from runs in separate processes: "
            + "; ".join(f"`{p['command']}` (seeds {p['seeds']}, {p['total_s']:.0f} s)" for p in st["parts"])
            + "."
        )
        lines.append("")
    lines.append(f"Plot: `{res['plot']}`. Total time {res['total_s']:.0f} s.")
    return lines


SECTIONS = (
    header,
    strategies_consensus,
    strategies_nodes,
    same_data,
    soups,
    barriers,
    barriers_by_node_strategy,
    merge_pipeline,
    baselines,
    footer,
)


def markdown(res: Result) -> str:
    """The whole report: every section of :data:`SECTIONS`, in order."""
    return "\n".join(line for section in SECTIONS for line in section(res)) + "\n"


def plot(res: Result) -> str:
    """Consensus accuracy and pairwise barrier per strategy mix over alpha; the merge variants."""
    plt = harness.pyplot()
    st, sm = res["settings"], res["summary"]
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    x = np.arange(len(st["alphas"]))
    for mix in st["mixes"]:
        for threat, style in (("clean", "-"), ("attack", "--")):
            if threat not in st["threats"]:
                continue
            m = [
                sm["strategies"][f"{mix} | alpha={a:g} | {threat}"]["consensus_accuracy"][0]
                for a in st["alphas"]
            ]
            axes[0].plot(x, m, style, marker="o", label=f"{mix} ({threat})")
        b = [
            sm["strategies"][f"{mix} | alpha={a:g} | clean"]["pairwise_barrier_mean"][0] for a in st["alphas"]
        ]
        axes[1].plot(x, b, marker="o", label=mix)
    for ax, title in ((axes[0], "consensus test accuracy"), (axes[1], "mean pairwise loss barrier (clean)")):
        ax.set_xticks(x, [f"alpha={a:g}" for a in st["alphas"]])
        ax.set_title(title, fontsize=10)
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=6)
    axes[1].legend(fontsize=7)
    merges = st["merges"]
    if not merges:
        axes[2].set_axis_off()
    y = np.arange(len(merges))
    for k, threat in enumerate(("clean", "attack")):
        v = [sm["merges"][f"{m} | {threat}"]["consensus_accuracy"][0] for m in merges]
        axes[2].barh(y + 0.4 * k, v, height=0.4, label=threat)
    axes[2].set_yticks(y + 0.2, merges, fontsize=6)
    axes[2].set_title("merge pipeline: consensus test accuracy", fontsize=10)
    axes[2].legend(fontsize=7)
    fig.tight_layout()
    path = harness.plot_path(st["name"], st["quick"])
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path.name
