"""Speed and memory of every aggregation rule against the memory-bandwidth floor.

For each (n, d) the script times, in one run on one stack:
  * the floor: one numpy pass that sums the (n, d) float32 stack over the node axis;
  * numpy baselines: ``np.mean(x, 0)``, ``np.median(x, 0)`` and a plain numpy Krum
    (pairwise squared distances from ``x @ x.T``, scores, argmin);
  * every rule of the package in three ways a user calls it, each reported as time / floor:
    ``eager`` (``agg.update(stacked, state, params)``, params = the global params, so Gram
    statistics are centred on them), ``jit`` (the same call inside the user's own
    ``jax.jit``) and ``jit, no params`` (``jax.jit(lambda s, st: agg.update(s, st))``);
  * on two inputs: ``clean`` (honest nodes only) and ``alie`` (f rows replaced by one ALIE
    vector, repeated: the ties of issue 17).
Extra memory is XLA's own account of the jitted update (temporaries plus the
output) divided by the size of the stack. ``clip`` alone is an n -> n map that
writes a clipped copy of the stack; inside a pipeline (``clip+mean``, as DP and
robust pipelines use it) it stays a lazy view and writes nothing.

    python -m benchmarks aggregators            # n in {8, 16, 32}, d in {1e5, 1e6, 1e7}
    python -m benchmarks aggregators --quick    # n = 16, d in {1e6, 1e7}
    python -m benchmarks aggregators --nodes 16 --sizes 1e7   # the README's table
    python -m benchmarks aggregators --n-sweep  # n in 8..1024 at n * d = 6.4e7 (--quick: 4e6)
"""

from __future__ import annotations

import gc
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

import consensus
from benchmarks import harness
from benchmarks.harness import best_time, machine, markdown_table

# Targets from the issue, as multiples of the floor, at n = 16, d = 1e7.
TARGETS = {
    "mean": 2.0,
    "median": 2.0,
    "trimmed_mean": 2.0,
    "clip+mean": 2.0,
    "krum": 3.0,
    "multi_krum": 3.0,
    "bulyan": 4.0,
}
# Targets under an outer jit (issue 13), as multiples of the floor at n = 16, d = 1e7, in both
# jit columns; every other rule: within 10% of its eager time.
JIT_TARGETS = {"median": 1.0, "trimmed_mean": 1.0, "krum": 2.5, "multi_krum": 2.5, "bulyan": 3.0}
MODES = ("eager", "jit", "jit, no params")
GM_ITERS = 10
TARGET_SIZE = (16, 10_000_000)


def byzantine_count(n: int) -> int:
    """The largest f that every rule (Bulyan: n >= 4f + 3) accepts."""
    return max((n - 3) // 4, 0)


def rules(n: int) -> dict[str, consensus.Aggregator | consensus.PreAggregator]:
    f = byzantine_count(n)
    return {
        "mean": consensus.mean(),
        "median": consensus.median(),
        "trimmed_mean": consensus.trimmed_mean(f),
        "clip": consensus.clip(1.0),
        "clip+mean": consensus.process(consensus.mean(), pre=[consensus.clip(1.0)]),
        "krum": consensus.krum(f),
        "multi_krum": consensus.multi_krum(f, n - f),
        "bulyan": consensus.bulyan(f),
        "geometric_median": consensus.geometric_median(max_iter=GM_ITERS, tol=0.0),
        "centered_clipping": consensus.centered_clipping(1.0, iterations=3),
        "nnm+krum": consensus.chain(consensus.nnm(f), consensus.krum(f)),
    }


def numpy_krum(x: np.ndarray, f: int) -> np.ndarray:
    sq = np.einsum("ij,ij->i", x, x)
    d2 = sq[:, None] + sq[None, :] - 2.0 * (x @ x.T)
    n = x.shape[0]
    k = n - f - 2
    scores = [np.sort(np.delete(d2[i], i))[:k].sum() for i in range(n)]
    return x[int(np.argmin(scores))]


def extra_memory_ratio(agg, stacked, params) -> float | None:
    """XLA's temporaries + output of the jitted update, as a fraction of the stack's bytes."""
    try:
        state = agg.init(params)
        compiled = jax.jit(lambda s, st, p: agg.update(s, st, p)).lower(stacked, state, params).compile()
        mem = compiled.memory_analysis()
        if mem is None:
            return None
        stack_bytes = sum(x.nbytes for x in jax.tree_util.tree_leaves(stacked))
        return (mem.temp_size_in_bytes + mem.output_size_in_bytes) / stack_bytes
    except Exception:  # noqa: BLE001 - memory analysis is best effort across backends
        return None


def attacked_stack(x_np: np.ndarray, params_np: np.ndarray, f: int) -> np.ndarray:
    """f rows replaced by one ALIE vector (the same vector f times, as the attack sends it)."""
    from strategies import attacks

    n = x_np.shape[0]
    byz = np.zeros(n, bool)
    byz[np.linspace(0, n - 1, f).astype(int)] = True
    out = attacks.apply_attack("alie", jax.random.key(0), {"w": jnp.asarray(x_np)}, byz, {"w": params_np})
    return np.asarray(out["w"])


def timed_call(agg, mode: str, stacked, params):
    """A no-argument function that runs one update the way ``mode`` says a user would."""
    state = agg.init(params)
    if mode == "eager":
        return lambda: agg.update(stacked, state, params)[0]
    if mode == "jit":
        fn = jax.jit(lambda s, st, p: agg.update(s, st, p)[0])
        return lambda: fn(stacked, state, params)
    fn = jax.jit(lambda s, st: agg.update(s, st)[0])
    return lambda: fn(stacked, state)


def bench_one(
    n: int,
    d: int,
    repeats: int,
    with_memory: bool,
    numpy_baselines: bool,
    inputs: tuple[str, ...] = ("clean", "alie"),
    only: set[str] | None = None,
) -> list[dict]:
    rng = np.random.default_rng(0)
    params_np = rng.standard_normal(d, dtype=np.float32)
    x_np = params_np + 0.01 * rng.standard_normal((n, d), dtype=np.float32)
    params = {"w": jnp.asarray(params_np)}
    f = byzantine_count(n)
    # The floor is the yardstick of every ratio: measure it with more repeats.
    floor = best_time(lambda: x_np.sum(axis=0), max(7, repeats))
    base: dict[str, Any] = dict(n=n, d=d, f=f)
    rows = [dict(base, rule="floor (numpy sum)", seconds=floor, ratio=1.0)]
    if numpy_baselines:
        for name, fn in [
            ("numpy mean", lambda: np.mean(x_np, axis=0)),
            ("numpy median", lambda: np.median(x_np, axis=0)),
            ("numpy krum", lambda: numpy_krum(x_np, f)),
        ]:
            t = best_time(fn, max(1, repeats - 1))
            rows.append(dict(base, rule=name, seconds=t, ratio=t / floor))
    for input_name in inputs:
        stacked = {"w": jnp.asarray(x_np if input_name == "clean" else attacked_stack(x_np, params_np, f))}
        for name, agg in rules(n).items():
            if only is not None and name not in only:
                continue
            row = dict(base, rule=name, input=input_name)
            for mode in MODES:
                t = best_time(timed_call(agg, mode, stacked, params), repeats)
                row[mode] = t / floor
                gc.collect()
            row["seconds"], row["ratio"] = row["eager"] * floor, row["eager"]
            # The targets are stated for n = 16, d = 1e7; at small d fixed per-call costs dominate.
            if (n, d) == TARGET_SIZE:
                if name in TARGETS:
                    row["target"] = TARGETS[name]
                if name == "geometric_median":
                    row["target"] = GM_ITERS + 2.0
                row["jit target"] = JIT_TARGETS.get(name, round(1.1 * row["eager"], 2))
            if with_memory and input_name == "clean":
                row["extra_memory"] = extra_memory_ratio(agg, stacked, params)
            rows.append(row)
            gc.collect()
    return rows


# Issue 19: n from 8 to 1024 at a fixed n * d.
SWEEP_NODES = (8, 16, 32, 64, 128, 256, 512, 1024)
SWEEP_RULES = ("median", "trimmed_mean", "bulyan", "krum", "geometric_median")


def numpy_matmul_gflops(x_np: np.ndarray, repeats: int) -> float:
    """The machine's float32 ``x @ x.T`` throughput in GFLOP/s (2 n^2 d flops), numpy in this run."""
    n, d = x_np.shape
    return 2.0 * n * n * d / best_time(lambda: x_np @ x_np.T, repeats) / 1e9


def sweep_one(n: int, d: int, repeats: int) -> list[dict]:
    """One n of the sweep: floor, numpy baselines, the Gram kernel and every sweep rule, eager and jit."""
    from kernels import gram as gram_kernels

    rng = np.random.default_rng(0)
    params_np = rng.standard_normal(d, dtype=np.float32)
    x_np = params_np + 0.01 * rng.standard_normal((n, d), dtype=np.float32)
    f = byzantine_count(n)
    floor = best_time(lambda: x_np.sum(axis=0), max(7, repeats))
    base: dict[str, Any] = dict(n=n, d=d, f=f)
    out = [dict(base, rule="floor (numpy sum)", seconds=floor, eager=1.0)]
    t_med = best_time(lambda: np.median(x_np, axis=0), repeats)
    out.append(dict(base, rule="numpy median", seconds=t_med, eager=t_med / floor))
    kth = sorted({f, n - f - 1})
    t_part = best_time(lambda: np.partition(x_np, kth, axis=0), repeats)
    out.append(dict(base, rule="numpy partition", seconds=t_part, eager=t_part / floor))
    peak = numpy_matmul_gflops(x_np, repeats)
    out.append(dict(base, rule="numpy x @ x.T", gflops=peak, seconds=2.0 * n * n * d / peak / 1e9))
    x = jnp.asarray(x_np)
    ref = jnp.asarray(params_np)
    t_gram = best_time(lambda: gram_kernels.gram(x, ref), repeats)
    gflops = 2.0 * n * n * d / t_gram / 1e9
    out.append(
        dict(
            base,
            rule="gram kernel",
            seconds=t_gram,
            eager=t_gram / floor,
            gflops=gflops,
            matmul_fraction=gflops / peak,
        )
    )
    stacked, params = {"w": x}, {"w": ref}
    numpy_ref = {"median": t_med, "trimmed_mean": t_part, "bulyan": t_part}
    for name in SWEEP_RULES:
        agg = rules(n)[name]
        row = dict(base, rule=name)
        for mode in ("eager", "jit"):
            t = best_time(timed_call(agg, mode, stacked, params), repeats)
            row[mode] = t / floor
            if name in numpy_ref:
                row[f"numpy / {mode}"] = numpy_ref[name] / t
            gc.collect()
        row["seconds"] = row["eager"] * floor
        out.append(row)
    out.append(bulyan_second_stage(x_np, x, f, floor, repeats))
    return out


def bulyan_second_stage(x_np: np.ndarray, x: jax.Array, f: int, floor: float, repeats: int) -> dict:
    """Bulyan's second stage alone, on the theta = n - 2f rows its Krum stage keeps (here the first).

    Its numpy reference is ``np.partition`` of those rows at the window's ends (f and
    theta - f - 1); the ratio is still to the floor of the whole stack.
    """
    from kernels import sorting

    n, d = x_np.shape
    theta = n - 2 * f
    rows_np, rows = np.ascontiguousarray(x_np[:theta]), jnp.asarray(x_np[:theta])
    t_part = best_time(lambda: np.partition(rows_np, sorted({f, theta - f - 1}), axis=0), repeats)
    row: dict[str, Any] = dict(n=n, d=d, f=f, rule="bulyan second stage")
    jitted = jax.jit(lambda r: sorting.closest_to_median_mean(r, f))
    calls = {"eager": lambda: sorting.closest_to_median_mean(rows, f), "jit": lambda: jitted(rows)}
    for mode, fn in calls.items():
        t = best_time(fn, repeats)
        row[mode], row[f"numpy / {mode}"] = t / floor, t_part / t
    row["seconds"] = row["eager"] * floor
    return row


def n_sweep(args, argv: list[str]) -> dict:
    total = 4_000_000 if args.quick else 64_000_000
    nodes = [int(v) for v in args.nodes.split(",")] if args.nodes else list(SWEEP_NODES)
    repeats = args.repeats or (1 if args.quick else 2)
    results: list[dict] = []
    command = "python -m benchmarks aggregators" + (" " + " ".join(argv) if argv else "")
    name = args.name or ("aggregators_nsweep" + ("_quick" if args.quick else ""))
    md = ""
    for n in nodes:
        results += sweep_one(n, total // n, repeats)
        print(f"done n={n}", flush=True)
        # Written after every n: the large-n rows take longest, the small-n ones survive an interrupt.
        md = _write(name, args, command, results)
    print(md)
    return {"results": results}


def _write(name: str, args, command: str, results: list[dict]) -> str:
    """``<name>.json`` / ``.md`` (the machine, its load averages, the command, the settings); the markdown."""
    settings = {k: v for k, v in vars(args).items() if k != "out"}
    payload = {
        "machine": machine(),
        "load_average": harness.load_average(),
        "command": command,
        "settings": settings,
        "results": results,
    }
    md = markdown(payload)
    harness.write_results(name, payload, md)
    return md


# ----------------------------------------------------------------------------- the page


def _load_note(res: Mapping[str, Any]) -> list[str]:
    if "load_average" not in res:
        return []
    return [f"Load averages when written: {res['load_average']} (1/5/15 min); the machine is shared.", ""]


def _blank(v: Any) -> Any:
    return "" if v is None else v


def markdown(res: Mapping[str, Any]) -> str:
    """The page of one result file: the n-sweep's table, or the (n, d) grid's.

    Args:
        res: the result file as written (``results``: one dict per row; ``settings`` and
            ``load_average`` where the run recorded them).

    Returns:
        The markdown: a title, notes on the method, the table and what it shows against the targets.
    """
    rows = res["results"]
    if (res.get("settings") or {}).get("n_sweep") or any("gflops" in r for r in rows):
        return _sweep_markdown(res)
    return _grid_markdown(res)


def _sweep_markdown(res: Mapping[str, Any]) -> str:
    rows = res["results"]
    nodes = sorted({r["n"] for r in rows})
    total = max(r["n"] * r["d"] for r in rows)  # d = total // n: exact at an n that divides it
    headers = ["n", "d", "f", "rule", "eager", "jit", "numpy ref / eager", "numpy ref / jit"]
    headers += ["GFLOP/s", "of numpy matmul"]
    table = [
        [
            r["n"],
            f"{r['d']:.1e}",
            r["f"],
            r["rule"],
            _blank(r.get("eager")),
            _blank(r.get("jit")),
            _blank(r.get("numpy / eager")),
            _blank(r.get("numpy / jit")),
            _blank(r.get("gflops")),
            _blank(r.get("matmul_fraction")),
        ]
        for r in rows
    ]
    lines = [
        f"# Aggregators from {nodes[0]} to {nodes[-1]} nodes at a fixed n * d "
        "(time / one numpy pass over the stack)",
        "",
        f"n * d = {total:.1e}. eager / jit: time / floor (params given), the floor being one numpy pass "
        "that sums the (n, d) float32 stack, measured in the same run. numpy ref / mode: numpy's time over "
        "the rule's (np.median for the median, np.partition at f and n - f - 1 for trimmed mean and "
        "Bulyan, at f and theta - f - 1 of the theta = n - 2f rows that Bulyan's second stage reads for "
        "that stage alone); above 1 the rule is faster. GFLOP/s: the Gram's 2 n^2 d flops over its time; "
        "'of numpy matmul': that over numpy's x @ x.T in the same run.",
        "",
        *_load_note(res),
        markdown_table(headers, table).rstrip("\n"),
    ]
    lines += _sweep_summary(rows, nodes)
    return "\n".join(lines).rstrip("\n") + "\n"


def _sweep_summary(rows: list[dict], nodes: list[int]) -> list[str]:
    """Per rule, the n at which it is slowest against the floor (eager), read from the rows."""
    out = []
    for name in SWEEP_RULES:
        mine = sorted((r for r in rows if r["rule"] == name and "eager" in r), key=lambda r: r["n"])
        if len(mine) < 2:
            continue
        lo, hi = mine[0], mine[-1]
        worst = max(mine, key=lambda r: r["eager"])
        slowest = (
            "" if worst is hi or worst is lo else f"; slowest at n = {worst['n']} ({_num(worst['eager'])}x)"
        )
        out.append(
            f"- {name}: {_num(lo['eager'])}x the floor at n = {lo['n']}, {_num(hi['eager'])}x "
            f"at n = {hi['n']}{slowest}."
        )
    if not out:
        return []
    return ["", f"Eager time / floor from n = {nodes[0]} to n = {nodes[-1]}:", "", *out]


def _num(v: float) -> str:
    """A number as ``markdown_table`` prints it (three significant digits below 1000)."""
    return f"{v:.3g}" if abs(v) < 1000 else f"{v:.0f}"


def _grid_markdown(res: Mapping[str, Any]) -> str:
    rows = res["results"]
    modes = any("input" in r for r in rows)  # runs before the jit columns: one eager ratio per rule
    if modes:
        headers = ["n", "d", "f", "rule", "input", "eager ms", "eager", "jit", "jit, no params"]
        headers += ["target (eager)", "target (jit)", "extra mem (x stack)"]
    else:
        headers = ["n", "d", "f", "rule", "ms", "x floor", "target", "extra mem (x stack)"]
    table = []
    for r in rows:
        cells = [r["n"], f"{r['d']:.0e}", r["f"], r["rule"]]
        if modes:
            cells += [r.get("input", ""), 1e3 * r["seconds"], r["ratio"]]
            cells += [
                r.get("jit", ""),
                r.get("jit, no params", ""),
                r.get("target", ""),
                r.get("jit target", ""),
            ]
        else:
            cells += [1e3 * r["seconds"], r["ratio"], r.get("target", "")]
        cells.append("" if r.get("extra_memory") is None else round(r["extra_memory"], 2))
        table.append(cells)
    columns = "Columns eager / jit / jit, no params" if modes else "x floor"
    lines = [
        "# Aggregator speed (time / one numpy pass over the stack)",
        "",
        f"{columns}: time / floor, the floor being one numpy pass that sums the (n, d) float32 "
        "stack, measured in the same run. "
        + (
            "eager: `agg.update(stacked, state, params)`; jit: the same call inside the user's own "
            "`jax.jit`; jit, no params: `jax.jit(lambda s, st: agg.update(s, st))`. Inputs: clean (honest "
            "nodes only) and alie (f rows replaced by one ALIE vector, repeated). "
            if modes
            else ""
        )
        + "Extra memory: XLA's temporaries plus the output of the jitted update, over the stack's size "
        "(at the largest d); clip alone writes a clipped copy of the stack, while inside a pipeline "
        "(clip+mean) it stays a lazy view. Targets are stated for n = 16, d = 1e7 only"
        + (
            "; target (jit) bounds both jit columns, and where no bound is set it is 1.1 x the eager ratio."
            if modes
            else "."
        ),
        "",
        *_load_note(res),
        markdown_table(headers, table).rstrip("\n"),
    ]
    lines += _target_summary(rows)
    return "\n".join(lines).rstrip("\n") + "\n"


def _target_summary(rows: list[dict]) -> list[str]:
    """How many rows meet their targets, and which miss, from the rows' own ratios and targets."""
    out = []
    eager = [r for r in rows if "target" in r]
    if eager:
        missed = [r for r in eager if r["ratio"] > r["target"]]
        out.append(
            f"- eager: {len(eager) - len(missed)} of {len(eager)} rows with a target meet it"
            + (
                ""
                if not missed
                else "; above it: " + ", ".join(_miss(r, r["ratio"], r["target"]) for r in missed)
            )
            + "."
        )
    jit = [r for r in rows if "jit target" in r]
    if jit:
        worst = {id(r): max(r["jit"], r["jit, no params"]) for r in jit}
        missed = [r for r in jit if worst[id(r)] > r["jit target"]]
        out.append(
            f"- jit (the slower of the two jit columns): {len(jit) - len(missed)} of {len(jit)} rows meet "
            "their target"
            + (
                ""
                if not missed
                else "; above it: " + ", ".join(_miss(r, worst[id(r)], r["jit target"]) for r in missed)
            )
            + "."
        )
    return ["", "Against the targets:", "", *out] if out else []


def _miss(r: Mapping[str, Any], value: float, target: float) -> str:
    where = f"{r['rule']}" + (f" ({r['input']})" if "input" in r else "")
    return f"{where} {_num(value)}x against {_num(float(target))}x"


def main(argv: list[str] | None = None) -> dict:
    import sys

    argv = sys.argv[1:] if argv is None else argv
    parser = harness.parser(__doc__, "a subset that runs in a few minutes")
    parser.add_argument("--sizes", type=str, default=None, help="comma list of d, e.g. 1e5,1e6")
    parser.add_argument("--nodes", type=str, default=None, help="comma list of n, e.g. 8,16")
    parser.add_argument("--repeats", type=int, default=None, help="best of this many timed calls")
    parser.add_argument("--rules", type=str, default=None, help="comma list of rule names (default: all)")
    parser.add_argument("--name", type=str, default=None, help="results file name (default: aggregators)")
    parser.add_argument("--n-sweep", action="store_true", help="n from 8 to 1024 at fixed n * d (issue 19)")
    args = harness.parse(parser, argv)
    if args.n_sweep:
        return n_sweep(args, argv)
    if args.quick:
        nodes, sizes, repeats = [16], [1_000_000, 10_000_000], 2
    else:
        nodes, sizes, repeats = [8, 16, 32], [100_000, 1_000_000, 10_000_000], 5
    if args.nodes:
        nodes = [int(v) for v in args.nodes.split(",")]
    if args.sizes:
        sizes = [int(float(v)) for v in args.sizes.split(",")]
    if args.repeats:
        repeats = args.repeats
    only = None if not args.rules else set(args.rules.split(","))
    results = []
    for n in nodes:
        for d in sizes:
            # Memory analysis compiles every rule once more: only at the largest size.
            memory = d == max(sizes)
            results += bench_one(n, d, repeats, with_memory=memory, numpy_baselines=True, only=only)
            print(f"done n={n} d={d:.0e}", flush=True)
    command = "python -m benchmarks aggregators" + (" " + " ".join(argv) if argv else "")
    name = args.name or ("aggregators" + ("_quick" if args.quick else ""))
    print(_write(name, args, command, results))
    return {"results": results}


if __name__ == "__main__":
    main()
