"""Accelerator benchmark: the headline speed tables on whatever backend JAX has, as ratios to its own floor.

Run ``python -m benchmarks accelerator [--quick]``. Writes ``benchmarks/results/accelerator_<backend>.json``
and ``.md`` (``accelerator_<backend>_quick.*`` with --quick), backend = ``jax.default_backend()``.

Every time is divided by a floor measured in the same run on the same backend: one jitted pass
over the same bytes (``jnp.sum(x)``, a full reduction, best of several calls; XLA:CPU's reduction
over the node axis alone, ``jnp.sum(x, axis=0)``, took 90-180x longer at n = 16 on the reference
machine, so it is no floor). The tables:

* **rules** at n = 16 .. 1024 nodes (n * d fixed): mean, median, trimmed mean, MeaMed, Bulyan and
  Krum at f = (n - 3) // 4, called eagerly and inside the user's ``jax.jit``, on clean rows and on
  attacked rows (f rows replaced by one ALIE vector, repeated: ties). The order-statistic rules
  run in both formulations of :mod:`kernels.backend` (``network``: sorting networks and exact
  selection, shaped for XLA:CPU; ``sort``: ``jnp.sort`` over the node axis), forced in turn, so the
  default of a GPU or TPU is chosen by this table on that backend, not by the CPU's;
* **merge methods** (the methods of ``merging_speed``) at n = 16, eagerly and jitted;
* **DP-SGD**: the example-level DP-SGD trainer step against the plain step (8 digits nodes, the
  same expected batch, interleaved; ``trainers``' measurement), each step over the floor of one
  pass over the nodes' stacked params;
* **one round** of the default run (``meta-consensus run``'s config, no FedAvg baseline), after a
  warm-up round that compiles, over the floor of one pass over the nodes' stacked params.

``--quick`` (the test suite's mode, seconds on a CPU): n in {16, 64}, a small stack, one timed call,
a few DP steps and a round of the default run cut to 4 local steps.
"""

from __future__ import annotations

import contextlib
import datetime
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

import consensus
from benchmarks import harness
from benchmarks.harness import best_time, markdown_table
from benchmarks.speed import aggregators, merging_speed, rounds, trainers
from kernels import backend as kernel_backend

NAME = "accelerator"
FULL = {"nodes": (16, 64, 256, 1024), "total": 16_000_000, "repeats": 3, "merge_d": 1_000_000}
QUICK = {"nodes": (16, 64), "total": 65_536, "repeats": 1, "merge_d": 4096}
SECTIONS = ("rules", "merges", "dp", "round")
MODES = ("eager", "jit")
INPUTS = ("clean", "attacked")
# Rules whose coordinate-wise order statistics go through kernels.backend's two formulations.
SWITCHED = ("median", "trimmed_mean", "meamed", "bulyan")


def rules(n: int) -> dict[str, Any]:
    f = aggregators.byzantine_count(n)
    return {
        "mean": consensus.mean(),
        "median": consensus.median(),
        "trimmed_mean": consensus.trimmed_mean(f),
        "meamed": consensus.meamed(f),
        "bulyan": consensus.bulyan(f),
        "krum": consensus.krum(f),
    }


def floor_seconds(stack: jax.Array, repeats: int) -> float:
    """One jitted pass over the stack's bytes on this backend (a full reduction, see the docstring)."""
    one_pass = jax.jit(jnp.sum)
    return best_time(lambda: one_pass(stack), max(7, 2 * repeats), warmup=2)


def tree_floor_seconds(tree: Any, repeats: int) -> float:
    """The floor of a stacked params tree: one jitted pass over every leaf."""
    one_pass = jax.jit(lambda t: [jnp.sum(x) for x in jax.tree_util.tree_leaves(t)])
    return best_time(lambda: one_pass(tree), max(7, 2 * repeats), warmup=2)


@contextlib.contextmanager
def _impl(impl: str | None) -> Iterator[None]:
    if impl is None:
        yield
    else:
        with kernel_backend.forced_order_impl(impl):
            yield


def _forced(fn: Callable[[], Any], impl: str | None) -> Callable[[], Any]:
    """``fn`` run with the order-statistic formulation forced (eager calls dispatch at every call,
    the user's jit when it traces, which is its first call: both inside the context)."""

    def call():
        with _impl(impl):
            return fn()

    return call


# ----------------------------------------------------------------------------- the tables


def _calls(agg: Any, params: Any) -> dict[str, Callable[[Any], Any]]:
    """The ways a user calls one update, as functions of the stacked rows: eagerly and in their jit.

    One jit per (rule, formulation), shared by the clean and the attacked rows (same shapes, so
    it compiles once), as ``aggregators.timed_call`` calls them.
    """
    state = agg.init(params)
    jitted = jax.jit(lambda s, st, p: agg.update(s, st, p)[0])
    return {
        "eager": lambda stacked: agg.update(stacked, state, params)[0],
        "jit": lambda stacked: jitted(stacked, state, params),
    }


def bench_rules(
    nodes: Sequence[int], total: int, repeats: int, impls: Sequence[str] = kernel_backend.ORDER_IMPLS
) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    for n in nodes:
        d = max(total // n, 1)
        f = aggregators.byzantine_count(n)
        rng = np.random.default_rng(0)
        params_np = rng.standard_normal(d, dtype=np.float32)
        x_np = params_np + 0.01 * rng.standard_normal((n, d), dtype=np.float32)
        attacked = aggregators.attacked_stack(x_np, params_np, f)
        stacks = {"clean": {"w": jnp.asarray(x_np)}, "attacked": {"w": jnp.asarray(attacked)}}
        params = {"w": jnp.asarray(params_np)}
        floor = floor_seconds(stacks["clean"]["w"], repeats)
        rows.append({"n": n, "d": d, "f": f, "rule": "floor", "seconds": floor})
        for name, agg in rules(n).items():
            for impl in impls if name in SWITCHED else (None,):
                for mode, fn in _calls(agg, params).items():
                    for inp, stacked in stacks.items():
                        t = best_time(_forced(lambda fn=fn, stacked=stacked: fn(stacked), impl), repeats)
                        row = {"n": n, "d": d, "f": f, "rule": name, "impl": impl or "-", "input": inp}
                        rows.append({**row, "mode": mode, "seconds": t, "ratio": t / floor})
            print(f"n={n} {name} done", flush=True)
    return rows


def bench_merges(d: int, repeats: int) -> list[dict[str, Any]]:
    n = 16
    rng = np.random.default_rng(0)
    base_np = rng.standard_normal(d, dtype=np.float32)
    x_np = base_np[None] + 0.01 * rng.standard_normal((n, d), dtype=np.float32)
    params, stacked, key = {"w": jnp.asarray(base_np)}, {"w": jnp.asarray(x_np)}, jax.random.key(0)
    floor = floor_seconds(stacked["w"], repeats)
    rows: list[dict[str, Any]] = [{"method": "floor", "n": n, "d": d, "seconds": floor}]
    for name, rule in merging_speed.methods().items():
        state = rule.init(params)
        jitted = jax.jit(lambda s, p, k, rule=rule, state=state: rule.update(s, state, p, key=k)[0])
        calls = {
            "eager": lambda rule=rule, state=state: rule.update(stacked, state, params, key=key)[0],
            "jit": lambda jitted=jitted: jitted(stacked, params, key),
        }
        for mode, call in calls.items():
            t = best_time(call, repeats)
            rows.append({"method": name, "n": n, "d": d, "mode": mode, "seconds": t, "ratio": t / floor})
    return rows


def bench_dp(quick: bool, repeats: int) -> dict[str, Any]:
    from strategies.tasks.digits import DigitsTask

    task, n = DigitsTask(), 8
    r = trainers.bench_dp(
        task, task.splits(n, seed=0), batch=64, steps=5 if quick else 100, repeats=repeats + 1, n=n, lr=1e-3
    )
    stacked = jax.tree.map(lambda v: jnp.broadcast_to(v, (n, *v.shape)), task.init(jax.random.key(0)))
    floor = tree_floor_seconds(stacked, repeats)
    return {
        "nodes": n,
        "expected_batch": r["expected_batch"],
        "path": r["path"],
        "floor_s": floor,
        "plain_s_per_step": r["plain_ms_per_step"] / 1e3,
        "dp_s_per_step": r["dp_ms_per_step"] / 1e3,
        "plain_ratio": r["plain_ms_per_step"] / 1e3 / floor,
        "dp_ratio": r["dp_ms_per_step"] / 1e3 / floor,
        "dp_over_plain": r["dp_over_plain"],
        "dp_over_plain_lower_bound": r["dp_over_plain_lower_bound"],
    }


def bench_round(quick: bool, repeats: int) -> dict[str, Any]:
    from meta_consensus import config
    from strategies.registry import resolve_task

    overrides = ["baseline_fedavg=false"] + (["nodes.local_steps=4"] if quick else [])
    with tempfile.TemporaryDirectory() as tmp:
        r = rounds.measure(overrides, rounds=1, warmup=1, out_dir=Path(tmp))
    cfg = config.load(None, overrides)
    task = resolve_task(cfg.task.name, dict(cfg.task.options))
    n = cfg.nodes.count
    stacked = jax.tree.map(lambda v: jnp.broadcast_to(v, (n, *v.shape)), task.init(jax.random.key(0)))
    floor = tree_floor_seconds(stacked, repeats)
    seconds = r["ms"]["total"] / 1e3
    return {
        "overrides": overrides,
        "nodes": n,
        "local_steps": cfg.nodes.local_steps,
        "floor_s": floor,
        "seconds": seconds,
        "ratio": seconds / floor,
        "phases_s": {k: v / 1e3 for k, v in r["ms"].items()},
    }


# ----------------------------------------------------------------------------- the report


def _rule_table(rows: list[dict[str, Any]]) -> str:
    """One line per (n, rule, impl): eager and jit ratios on clean and attacked rows."""
    cells: dict[tuple, dict[str, float]] = {}
    for r in rows:
        if r["rule"] != "floor":
            key = (r["n"], r["d"], r["rule"], r["impl"])
            cells.setdefault(key, {})[f"{r['mode']} {r['input']}"] = r["ratio"]
    cols = [f"{m} {i}" for i in INPUTS for m in MODES]
    table = [[n, f"{d:.1e}", rule, impl, *(v[c] for c in cols)] for (n, d, rule, impl), v in cells.items()]
    return markdown_table(["n", "d", "rule", "impl", *cols], table)


def worst_by_row(rows: list[dict[str, Any]]) -> dict[str, dict[str, float]]:
    """Per row ``"rule n=N"`` of the order-statistic rules: each formulation's worst ratio."""
    out: dict[str, dict[str, float]] = {}
    for r in rows:
        if r["rule"] in SWITCHED:
            w = out.setdefault(f"{r['rule']} n={r['n']}", {})
            w[r["impl"]] = max(w.get(r["impl"], 0.0), r["ratio"])
    return out


def _choice_table(rows: list[dict[str, Any]]) -> tuple[str, dict[str, Any]]:
    """Per (n, rule): the worst ratio of each formulation over modes and inputs, and the faster one."""
    worst: dict[tuple, dict[str, float]] = {}
    for r in rows:
        if r["rule"] in SWITCHED:
            w = worst.setdefault((r["n"], r["rule"]), {})
            w[r["impl"]] = max(w.get(r["impl"], 0.0), r["ratio"])
    table, faster = [], {}
    timed = [i for i in kernel_backend.ORDER_IMPLS if any(i in w for w in worst.values())]
    for (n, rule), w in worst.items():
        best = min(w, key=w.get)
        faster[f"{rule} n={n}"] = best
        table.append([n, rule, *(w.get(i, "-") for i in timed), best])
    return markdown_table(["n", "rule", *(f"{i} (worst)" for i in timed), "faster"], table), faster


def markdown(res: dict[str, Any], quick: bool) -> str:
    st = res["settings"]
    backend = res["backend"]
    lines = harness.header(f"Accelerator benchmark on {backend}", NAME, quick, st)
    lines.append(
        "Every number is time / floor, the floor being one jitted pass over the same bytes on this "
        f"backend (`jnp.sum(x)`), measured in the same run; best of {st['repeats']} calls after "
        "a warm-up call that compiles. Load averages when written: "
        f"{res['load_average']} (1/5/15 min)."
    )
    lines.append(f"Date: {res['date']}.")
    if res.get("note"):
        lines += ["", res["note"]]
    lines.append("")
    if res["rules"] is not None:
        lines += _rules_section(res)
    if res["merges"] is not None:
        lines += _merges_section(res)
    if res["dp"] is not None:
        lines += _dp_section(res)
    if res["round"] is not None:
        lines += _round_section(res)
    lines.append(f"Total time {res['total_s']:.0f} s.")
    return "\n".join(lines) + "\n"


def _rules_section(res: dict[str, Any]) -> list[str]:
    st, backend = res["settings"], res["backend"]
    choice, _ = _choice_table(res["rules"])
    return [
        f"## Rules (n * d = {st['total']:.2e}; f = (n - 3) // 4)",
        "",
        _rule_table(res["rules"]),
        "## Order statistics: which formulation (worst ratio over eager/jit and clean/attacked)",
        "",
        choice,
        f"Default on {backend}: `{res['order_impl_default']}` "
        f"(`kernels.backend.DEFAULT_ORDER_IMPL`). {res['order_impl_remark']}",
        "",
    ]


def _merges_section(res: dict[str, Any]) -> list[str]:
    return [
        f"## Merge methods (n = 16, d = {res['settings']['merge_d']:.1e})",
        "",
        markdown_table(
            ["method", "mode", "time / floor"],
            [[r["method"], r["mode"], r["ratio"]] for r in res["merges"] if r["method"] != "floor"],
        ),
    ]


def _dp_section(res: dict[str, Any]) -> list[str]:
    dp = res["dp"]
    return [
        f"## DP-SGD step against the plain step ({dp['nodes']} digits nodes, expected batch "
        f"{dp['expected_batch']}, {dp['path']})",
        "",
        markdown_table(
            ["step", "time / floor (stacked params)", "DP / plain", "lower bound (plain + noise)"],
            [
                ["plain", dp["plain_ratio"], "", ""],
                ["DP-SGD", dp["dp_ratio"], dp["dp_over_plain"], dp["dp_over_plain_lower_bound"]],
            ],
        ),
    ]


def _round_section(res: dict[str, Any]) -> list[str]:
    rd = res["round"]
    return [
        f"## One round of the default run ({rd['nodes']} nodes, {rd['local_steps']} local steps, "
        f"overrides {rd['overrides']})",
        "",
        f"{rd['seconds']:.3g} s, {rd['ratio']:.4g}x one pass over the nodes' stacked params "
        f"({1e6 * rd['floor_s']:.3g} us): a round is node training and evaluation, not a memory "
        "pass, so this ratio is large by nature; its phases (s): "
        + ", ".join(f"{k} {v:.3g}" for k, v in rd["phases_s"].items())
        + ".",
        "",
    ]


# Two formulations whose worst ratios differ by less than this are a tie: the eager calls'
# dispatch time varies by about this much between runs of the same code path.
TIE_FACTOR = 1.5


def remark(backend: str, faster: dict[str, str], worst: dict[str, dict[str, float]] | None = None) -> str:
    """What the timing of every formulation says about the default of this backend.

    ``worst``: per row (``"rule n=N"``), the worst ratio of each formulation; with it, rows where
    the default is within ``TIE_FACTOR`` of the fastest count as ties.
    """
    default = kernel_backend.DEFAULT_ORDER_IMPL.get(backend, kernel_backend.FALLBACK_ORDER_IMPL)
    against = sorted(k for k, v in faster.items() if v != default)
    if worst is not None:
        against = [
            k
            for k in against
            if default not in worst[k] or worst[k][default] > TIE_FACTOR * min(worst[k].values())
        ]
    if not against:
        tie = f"within {TIE_FACTOR}x of it"
        return f"`{default}` was the fastest formulation, or {tie}, in every row of this run."
    return (
        f"Another formulation than `{default}` was more than {TIE_FACTOR}x faster in {len(against)} of "
        f"{len(faster)} rows ({', '.join(against)})."
    )


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = harness.parser(__doc__, "n in {16, 64}, small stacks, one timed call (seconds on a CPU)")
    p.add_argument("--nodes", type=str, default=None, help="comma list of n (default 16,64,256,1024)")
    p.add_argument("--total", type=float, default=None, help="n * d of the rules' stacks (default 1.6e7)")
    p.add_argument("--repeats", type=int, default=None, help="best of this many timed calls (default 3)")
    p.add_argument("--note", type=str, default="", help="a sentence for the report (e.g. a shared machine)")
    p.add_argument(
        "--sections", type=str, default=",".join(SECTIONS), help="comma list of " + ", ".join(SECTIONS)
    )
    p.add_argument(
        "--impls",
        type=str,
        default=",".join(kernel_backend.ORDER_IMPLS),
        help="comma list of the order-statistic formulations to time (default: all)",
    )
    args = harness.parse(p, argv)
    base = QUICK if args.quick else FULL
    nodes = tuple(int(v) for v in args.nodes.split(",")) if args.nodes else base["nodes"]
    total = int(args.total) if args.total else base["total"]
    repeats = args.repeats or base["repeats"]
    sections = [v for v in args.sections.split(",") if v]
    impls = [v for v in args.impls.split(",") if v]
    if set(impls) - set(kernel_backend.ORDER_IMPLS):
        p.error(f"--impls: unknown {sorted(set(impls) - set(kernel_backend.ORDER_IMPLS))}")
    if set(sections) - set(SECTIONS):
        p.error(f"--sections: unknown {sorted(set(sections) - set(SECTIONS))}; choose from {SECTIONS}")
    backend = jax.default_backend()
    settings = {
        "sections": sections,
        "nodes": list(nodes),
        "total": total,
        "repeats": repeats,
        "merge_d": base["merge_d"],
        "impls": impls,
    }
    settings["quick"] = args.quick
    t0 = time.perf_counter()
    res: dict[str, Any] = {"backend": backend, "devices": [str(d) for d in jax.devices()], "note": args.note}
    res["rules"] = bench_rules(nodes, total, repeats, impls) if "rules" in sections else None
    res["merges"] = bench_merges(base["merge_d"], repeats) if "merges" in sections else None
    res["dp"] = bench_dp(args.quick, repeats) if "dp" in sections else None
    res["round"] = bench_round(args.quick, repeats) if "round" in sections else None
    _, faster = _choice_table(res["rules"] or [])
    res["order_impl_default"] = kernel_backend.order_impl(backend=backend)
    res["order_impl_faster"] = faster
    res["order_impl_remark"] = remark(backend, faster, worst_by_row(res["rules"] or []))
    res["total_s"] = time.perf_counter() - t0
    res["load_average"] = harness.load_average()
    res["date"] = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
    res["settings"] = settings
    md = markdown(res, args.quick)
    harness.save(f"{NAME}_{backend}", args.quick, res, md, settings=settings, benchmark=NAME)
    print(md)
    return res


def ratios(res: dict[str, Any]) -> list[float]:
    """Every time / floor ratio of a result (for checks: all must be positive and finite)."""
    out = [r["ratio"] for r in (res["rules"] or []) + (res["merges"] or []) if "ratio" in r]
    if res["dp"] is not None:
        out += [res["dp"]["plain_ratio"], res["dp"]["dp_ratio"], res["dp"]["dp_over_plain"]]
    if res["round"] is not None:
        out.append(res["round"]["ratio"])
    return [float(v) for v in out]


if __name__ == "__main__":
    main()
