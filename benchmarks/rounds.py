"""Where a round's time goes: node fit against the coordinator's own work.

Run ``python -m benchmarks.rounds [--quick]``. Writes benchmarks/results/rounds.json and
rounds.md (``rounds_quick.*`` with --quick).

For each setting, one round of the system is split into:

* **fit**: the nodes' training with their strategies (hierarchical schedules, proximal
  steps, soups of snapshots, attacks) - the work the nodes do, not the coordinator;
* **validate**: structure and finiteness checks of the candidates, and their test
  metrics for the history;
* **vote**, **weights** (the convex solve and the merge pass), **dp** (clipping, noise,
  server step; with DP off: what remains of the merge);
* **bookkeeping**: evaluation of the new consensus (one jitted call for the consensus on
  test and held-out data), the metrics.jsonl / TensorBoard line and, every
  ``checkpoint_every`` rounds (5, the default), the start of the asynchronous orbax
  checkpoint (its files are written while the next rounds run). The wait for the last
  save, which a run pays once at exit, is reported on its own (``exit wait``), not per round;
* **other**: the rest (host copies of the round's info, the ledger's RDP epsilon every
  round, the PLD comparison epsilon at checkpoint rounds and the last).

The coordinator's share is everything but fit, over the whole round. Settings: the
embedded default (digits, 8 nodes, Multi-Krum, mixture-NLL weights, DP) and the text task
(byte-level transformer) with the same pipeline. The FedAvg baseline that the default
runs alongside is switched off here: it is a second fleet, not part of the round.
Warm-up rounds (compilation) are excluded; the remaining rounds are averaged.
"""

from __future__ import annotations

import statistics
import tempfile
import time
from pathlib import Path

from benchmarks import harness
from benchmarks.harness import machine, markdown_table
from meta_consensus import config
from meta_consensus.checkpoint import RunCheckpoints
from meta_consensus.coordinator import Coordinator
from meta_consensus.report import RunLog

PHASES = ("fit", "validate", "vote", "weights", "dp", "bookkeeping", "other")
# The coordinator's share of a round that issue 13 asks for, per setting.
TARGET_SHARE = {"digits (default)": 0.25, "text": 0.08}

SETTINGS = {
    "digits (default)": ["baseline_fedavg=false"],
    "text": [
        "baseline_fedavg=false",
        "task.name=text",
        "nodes.count=4",
        "nodes.strategies=['hierarchical', 'convexity', 'soup', 'local']",
        "nodes.local_steps=20",
        "nodes.options.soup.snapshots=2",
        "byzantine.nodes=[3]",
        "vote.rule=median",
        "vote.fault_tolerance=0.25",
        "weights.max_examples=32",
        "eval_every=5",
    ],
}


def measure(overrides: list[str], rounds: int, warmup: int, out_dir: Path) -> dict:
    cfg = config.load(None, [*overrides, f"rounds={rounds + warmup}", f"output_dir={out_dir}"])
    co = Coordinator(cfg)
    state = co.init(cfg.seed)
    log = RunLog(cfg.run_dir)
    ckpt = RunCheckpoints(cfg.run_dir, cfg)
    rows, history = [], []
    for r in range(rounds + warmup):
        t0 = time.perf_counter()
        state, info = co.round(state)
        t1 = time.perf_counter()
        history.append(info)
        log.log(info)
        if state.round % cfg.checkpoint_every == 0:
            ckpt.save(state, history)
        t2 = time.perf_counter()
        if not info.ok:
            raise RuntimeError(f"round {r} failed: {info.reason}")
        s = info.seconds
        row = {k: s.get(k, 0.0) for k in ("fit", "validate", "vote", "weights", "dp")}
        # Evaluation of the new consensus, the log line and the (amortized) checkpoint.
        row["bookkeeping"] = s.get("evaluate", 0.0) + (t2 - t1)
        row["total"] = (t1 - t0) + (t2 - t1)
        # The rest of the round: host transfers of the round's info, the accountants' epsilons.
        row["other"] = row["total"] - sum(row[k] for k in PHASES if k != "other")
        if r >= warmup:
            rows.append(row)
    t = time.perf_counter()
    ckpt.wait()  # the last asynchronous save, paid once per run at exit
    exit_wait = time.perf_counter() - t
    log.close()
    ckpt.close()
    mean = {k: statistics.fmean(r[k] for r in rows) for k in (*PHASES, "total")}
    coord = mean["total"] - mean["fit"]
    merge = mean["vote"] + mean["weights"] + mean["dp"]
    return {
        "overrides": overrides,
        "rounds_timed": rounds,
        "warmup": warmup,
        "ms": {k: 1e3 * v for k, v in mean.items()},
        "exit_wait_ms": 1e3 * exit_wait,
        "coordinator_share": coord / mean["total"],
        "merge_share": merge / mean["total"],
        "consensus_accuracy": history[-1].consensus_accuracy,
        "solve_ms": history[-1].solve_ms,
    }


def _machine_line() -> str:
    m = machine()
    return f"{m['processor']}, {m['cpu_count']} cores, jax {m['jax']} ({m['backend']})"


def main(argv: list[str] | None = None) -> None:
    ap = harness.parser(__doc__, "fewer rounds")
    args = harness.parse(ap, argv)
    rounds, warmup = (3, 2) if args.quick else (8, 2)
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, overrides in SETTINGS.items():
            results[name] = measure(overrides, rounds, warmup, Path(tmp) / name.split()[0])
            r = results[name]
            print(f"{name}: round {r['ms']['total']:.0f} ms, coordinator share {r['coordinator_share']:.1%}")
    rows = []
    for name, r in results.items():
        ms = r["ms"]
        rows.append(
            [name, f"{ms['total']:.0f}"]
            + [f"{ms[p]:.1f}" for p in PHASES]
            + [f"{r['exit_wait_ms']:.0f}", f"{r['merge_share']:.1%}", f"{r['coordinator_share']:.1%}"]
            + [f"{TARGET_SHARE[name]:.0%}"]
            + ["yes" if r["coordinator_share"] <= TARGET_SHARE[name] else "**no**"]
        )
    cmd = "python -m benchmarks.rounds" + (" --quick" if args.quick else "")
    md = "\n".join(
        [
            "# Where a round's time goes",
            "",
            f"Command: `{cmd}`. Machine: {_machine_line()}. Mean of {rounds} rounds after {warmup} warm-up",
            "rounds; milliseconds per round. The coordinator's share is everything but the nodes' fit;",
            "the merge share is vote + weights + DP alone.",
            "",
            markdown_table(
                [
                    "setting",
                    "round ms",
                    *[f"{p} ms" for p in PHASES],
                    "exit wait ms (once)",
                    "merge share",
                    "coordinator share",
                    "target",
                    "met",
                ],
                rows,
            ),
            "",
        ]
    )
    settings = {"quick": args.quick, "rounds": rounds, "warmup": warmup, "settings": list(SETTINGS)}
    harness.save("rounds", args.quick, {"results": results}, md, settings=settings)
    print(md)


if __name__ == "__main__":
    main()
