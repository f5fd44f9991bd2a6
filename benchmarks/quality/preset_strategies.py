"""The presets' node strategies: each preset's shipped mix against every node on one strategy.

Run ``python -m benchmarks preset_strategies [--quick] [--presets private,lora] [--seeds 0,1,2]``.
Writes benchmarks/results/preset_strategies.{json,md} (``preset_strategies_quick.*`` with --quick).

A preset is a setting of its own (example-level DP-SGD on digits; LoRA adapters of a small text
transformer), so the node strategies are measured there, not borrowed from the default's
ablations. Every run is the preset as it ships, changed only by ``nodes.strategies`` (and by
``byzantine.nodes = []`` in the clean scenario, and the seed). Mixes: :data:`MIXES` (the shipped
one is read from the preset). Reported per preset and mix: the consensus's test accuracy after
the last round (digits: classification accuracy; text: next-byte accuracy), clean and with the
preset's attackers, mean ± std over seeds, and each mix minus all-local per seed (paired: the same
seeds, node split and attackers).

``--quick``: one seed and a quarter of each preset's rounds (a check that it runs).
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from benchmarks.harness import header, markdown_table, parse, parser, save
from benchmarks.quality.meta_consensus import curve
from meta_consensus import MetaConsensus, config

NAME = "preset_strategies"
# The mixes beside the shipped one: every node on one strategy (the soup nodes keep the preset's
# soup options; hierarchical nodes need a public pool, which only the private preset's task has).
MIXES: dict[str, tuple[str, ...]] = {
    "private": ("local", "convexity", "soup"),
    "lora": ("local", "convexity"),
}
SCENARIOS: dict[str, list[str]] = {"clean": ["byzantine.nodes=[]"], "attacked": []}
SHIPPED = "shipped"


def shipped_strategies(preset: str) -> list[str]:
    """The preset's ``nodes.strategies`` as it ships (a list, one per node)."""
    cfg = config.load(preset=preset)
    return list(cfg.nodes.strategy_of())


def build(preset: str, mix: str, scenario: str, seed: int, rounds: int | None) -> config.Config:
    """The preset with ``mix``'s strategies, the scenario's attackers, the seed and rounds."""
    overrides = [f"seed={seed}", *SCENARIOS[scenario]]
    if mix != SHIPPED:
        overrides.append(f"nodes.strategies={mix!r}")
    if rounds is not None:
        overrides.append(f"rounds={rounds}")
    return config.load(None, overrides, preset=preset)


def one_run(preset: str, mix: str, scenario: str, seed: int, quick: bool) -> dict[str, Any]:
    base = config.load(preset=preset)
    rounds = max(2, base.rounds // 4) if quick else None
    cfg = build(preset, mix, scenario, seed, rounds)
    t0 = time.perf_counter()
    result = MetaConsensus(cfg, write=False, progress=False).train()
    # the last successful round's accuracy (a failed round keeps the previous consensus)
    accuracy = curve(result.history, "consensus_accuracy")[-1]
    return {"preset": preset, "mix": mix, "scenario": scenario, "seed": seed, "rounds": cfg.rounds,
            "accuracy": accuracy, "seconds": time.perf_counter() - t0}  # fmt: skip


def summarize(runs: Sequence[Mapping[str, Any]]) -> dict[str, dict[str, dict[str, Any]]]:
    """preset -> mix -> scenario -> {mean, std, minus local (mean, min over seeds)}."""
    out: dict[str, dict[str, dict[str, Any]]] = {}
    for r in runs:
        out.setdefault(r["preset"], {}).setdefault(r["mix"], {}).setdefault(r["scenario"], {})[r["seed"]] = r[
            "accuracy"
        ]
    summary: dict[str, dict[str, dict[str, Any]]] = {}
    for preset, mixes in out.items():
        summary[preset] = {}
        for mix, scen in mixes.items():
            summary[preset][mix] = {}
            for scenario, by_seed in scen.items():
                acc = np.array(list(by_seed.values()), np.float64)
                cell: dict[str, Any] = {"mean": float(acc.mean()), "std": float(acc.std()), "n": len(acc)}
                local = mixes.get("local", {}).get(scenario)
                if local is not None and mix != "local":
                    d = np.array([by_seed[s] - local[s] for s in by_seed if s in local], np.float64)
                    cell["minus_local"] = [float(d.mean()), float(d.min())] if len(d) else None
                summary[preset][mix][scenario] = cell
    return summary


def best_mix(cells: Mapping[str, Mapping[str, Any]]) -> str:
    """The mix with the highest accuracy averaged over the scenarios (ties: the simpler, local)."""
    order = sorted(cells, key=lambda m: (-np.mean([c["mean"] for c in cells[m].values()]), m != "local"))
    return order[0]


def findings(res: Mapping[str, Any]) -> list[str]:
    """Per preset: the best mix, and every other mix against all-local (clean; attacked)."""
    out = []
    for preset, cells in summarize(res["runs"]).items():
        best = best_mix(cells)
        others = []
        for mix, cell in cells.items():
            if mix == "local":
                continue
            diffs = [cell[s].get("minus_local") for s in SCENARIOS if s in cell]
            if all(d is not None for d in diffs):
                others.append(f"{mix} {'; '.join(f'{100 * d[0]:+.1f}' for d in diffs)}")
        local = cells.get("local", {})
        ref = ", ".join(f"{s} {local[s]['mean']:.3f}" for s in SCENARIOS if s in local)
        shipped = ", ".join(res["shipped"].get(preset, [])) or "?"
        out.append(
            f"- **{preset}** (its mix when measured: {shipped}): best **{best}**; all-local {ref}; "
            f"the others minus all-local in points (clean; attacked): {', '.join(others)}."
        )
    return out


def markdown(res: Mapping[str, Any]) -> str:
    settings = res["settings"]
    lines = header(
        "The presets' node strategies, each measured in its own setting", NAME, settings["quick"], settings
    )
    summary = summarize(res["runs"])
    lines += [
        "Each preset as it shipped when measured ('shipped': its own mix), changed only by its nodes' "
        "strategies; the consensus's test accuracy "
        "after the last round (digits: accuracy; text: next-byte accuracy), mean ± std over seeds, "
        "clean and with the preset's attackers; 'minus local': the mix minus all-local on the same "
        "seed, in points (mean; worst seed).",
        "",
        "## Findings",
        "",
    ]
    lines += [*findings(res), ""]
    for preset, cells in summary.items():
        lines += [f"## {preset}", ""]
        table = []
        scenarios = [s for s in SCENARIOS if any(s in c for c in cells.values())]
        for mix, cell in cells.items():
            row: list[Any] = [mix]
            for s in scenarios:
                c = cell.get(s)
                if c is None:
                    row += ["", ""]
                    continue
                row.append(f"{c['mean']:.3f} ± {c['std']:.3f}")
                ml = c.get("minus_local")
                row.append(f"{100 * ml[0]:+.1f}; {100 * ml[1]:+.1f}" if ml else "")
            table.append(row)
        heads = ["mix"] + [h for s in scenarios for h in (s, f"{s}, minus local")]
        lines += [markdown_table(heads, table), ""]
    lines.append(f"Total time {res['total_s']:.0f} s.")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = parser(__doc__, "one seed, a quarter of each preset's rounds")
    p.add_argument("--presets", default=",".join(MIXES), help=f"comma-separated, of {list(MIXES)}")
    p.add_argument("--seeds", default=None, help="comma-separated seeds (default 0,1,2; --quick: 0)")
    args = parse(p, argv)
    presets = [x.strip() for x in args.presets.split(",") if x.strip()]
    unknown = [x for x in presets if x not in MIXES]
    if unknown or not presets:
        p.error(f"--presets: unknown {unknown}; valid: {list(MIXES)}")
    seeds = [0] if args.quick else [0, 1, 2]
    if args.seeds is not None:
        seeds = [int(x) for x in args.seeds.split(",")]
    t0 = time.perf_counter()
    runs = []
    shipped = {}
    for preset in presets:
        shipped[preset] = shipped_strategies(preset)
        # A preset whose nodes all run one of the mixes' strategies is that mix: not run twice.
        uniform = len(set(shipped[preset])) == 1 and shipped[preset][0] in MIXES[preset]
        for mix in (*([] if uniform else [SHIPPED]), *MIXES[preset]):
            for scenario in SCENARIOS:
                for seed in seeds:
                    runs.append(one_run(preset, mix, scenario, seed, args.quick))
                    print(f"{preset} {mix} {scenario} seed {seed}: {runs[-1]['accuracy']:.4f} "
                          f"({runs[-1]['seconds']:.0f} s)", flush=True)  # fmt: skip
    mixes = {k: list(MIXES[k]) for k in presets}
    settings = {"quick": args.quick, "presets": presets, "seeds": seeds, "mixes": mixes}
    res = {"runs": runs, "shipped": shipped, "total_s": time.perf_counter() - t0}
    md = markdown({**res, "settings": settings})
    save(NAME, args.quick, res, md, settings=settings, out=args.out)
    print(md)
    return res
