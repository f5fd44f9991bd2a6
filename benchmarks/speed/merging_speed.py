"""Speed of the merge methods (consensus.merging) against the memory-bandwidth floor.

Run ``python -m benchmarks merging_speed [--quick]``. Writes benchmarks/results/merging_speed.json
and merging_speed.md (``merging_speed_quick.*`` with --quick: d = 1e6 instead of 1e7).

The floor is one numpy pass over the (n, d) float32 stack (``x.sum(axis=0)``), measured in the
same run, so the ratios hold on a machine shared with other work while the absolute times do
not. Every method runs eagerly (``update`` on a concrete stack) and inside one outer
``jax.jit``, on a one-leaf tree of n = 16 nodes with params = the base. Targets (issue 15):
task arithmetic and Model Stock at most 2x the floor, TIES at most 4x, DARE at most 2x (alone,
DARE writes its n rows, and a copy of the stack costs about 2x: the row "dare+task_arithmetic",
mergekit's dare_linear, is DARE inside a merge, where its rows stay lazy). The
TIES thresholds alone (the exact per-node k-th magnitude, no sort) are timed as a diagnostic,
next to ``jnp.sort`` of the same magnitudes for scale.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

import consensus
from benchmarks.harness import best_time, load_average, markdown_table, parse, parser, save
from consensus.merging.ties import trim_thresholds

NAME = "merging_speed"
TARGETS = {
    "task_arithmetic": 2.0, "model_stock": 2.0, "ties": 4.0, "ties (count)": 4.0, "dare": 2.0,
    "dare+task_arithmetic": 2.0,
}  # fmt: skip
DENSITY = 0.2


def methods() -> dict[str, Any]:
    return {
        "task_arithmetic": consensus.task_arithmetic(0.3),
        "model_stock": consensus.model_stock(),
        "ties": consensus.ties(DENSITY),
        "ties (count)": consensus.ties(DENSITY, "count"),
        "dare": consensus.dare(0.5),
        # mergekit's dare_linear: DARE's rows stay lazy, the drop is fused into the sum.
        "dare+task_arithmetic": consensus.process(consensus.task_arithmetic(0.3), pre=[consensus.dare(0.5)]),
        "dare+ties": consensus.process(consensus.ties(DENSITY), pre=[consensus.dare(0.5)]),
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse(parser(__doc__, "d = 1e6 instead of 1e7"), argv)
    n, d = 16, (1_000_000 if args.quick else 10_000_000)
    repeats = 3
    rng = np.random.default_rng(0)
    base_np = rng.standard_normal(d, dtype=np.float32)
    x_np = base_np[None] + 0.01 * rng.standard_normal((n, d), dtype=np.float32)
    params = {"w": jnp.asarray(base_np)}
    stacked = {"w": jnp.asarray(x_np)}
    key = jax.random.key(0)
    t0 = time.perf_counter()
    floor = best_time(lambda: x_np.sum(axis=0), 7)
    rows: list[dict[str, Any]] = []
    for name, rule in methods().items():
        state = rule.init(params)

        def eager(rule=rule, state=state):
            return rule.update(stacked, state, params, key=key)[0]

        jitted = jax.jit(lambda s, p, k, rule=rule, state=state: rule.update(s, state, p, key=k)[0])
        te = best_time(eager, repeats)
        tj = best_time(functools.partial(jitted, stacked, params, key), repeats)
        target = TARGETS.get(name)
        rows.append(
            {
                "method": name,
                "eager_s": te,
                "jit_s": tj,
                "eager_ratio": te / floor,
                "jit_ratio": tj / floor,
                "target": target,
                "met": None if target is None else bool(max(te, tj) / floor <= target),
            }
        )
        print(f"{name}: eager {te / floor:.2f}x, jit {tj / floor:.2f}x of the floor", flush=True)
    valid = jnp.ones((n,), bool)
    tt = best_time(lambda: trim_thresholds(stacked["w"], params["w"], DENSITY, valid), repeats)
    sort = jax.jit(lambda x, b: jnp.sort(jnp.abs(x - b[None]), axis=1))
    ts = best_time(lambda: sort(stacked["w"], params["w"]), 1)
    # DARE writes a new (n, d) stack: its lower bound is a copy into fresh memory, in XLA and numpy.
    copy = jax.jit(lambda x: x * 1.0001)
    tc = best_time(lambda: copy(stacked["w"]), repeats)
    tn = best_time(lambda: np.multiply(x_np, np.float32(1.0001)), repeats)
    diagnostics = {
        "ties_thresholds_ratio": tt / floor,
        "jnp_sort_ratio": ts / floor,
        "xla_copy_ratio": tc / floor,
        "numpy_copy_ratio": tn / floor,
    }
    print(
        f"TIES thresholds alone: {tt / floor:.2f}x; jnp.sort of |deltas|: {ts / floor:.2f}x; "
        f"a scaled copy of the stack: XLA {tc / floor:.2f}x, numpy {tn / floor:.2f}x",
        flush=True,
    )
    res = {"n": n, "d": d, "floor_s": floor, "rows": rows, "diagnostics": diagnostics}
    res["total_s"] = time.perf_counter() - t0
    res["load_average"] = load_average()  # the record's own (save keeps it), shown on the page
    md = markdown(res)
    save(NAME, args.quick, res, md, settings={"n": n, "d": d, "density": DENSITY, "quick": args.quick})
    print(md)
    return res


def markdown(res: Mapping[str, Any]) -> str:
    """The page of one result file: every method's time over the floor, its target and the diagnostics.

    Args:
        res: the result file as written (``n``, ``d``, ``floor_s``, ``rows``, ``diagnostics``).

    Returns:
        The markdown: a title, the method, the table, which methods miss their target, the diagnostics.
    """
    rows = res["rows"]
    targets: dict[float, list[str]] = {}
    for r in rows:
        if r["target"] is not None:
            targets.setdefault(r["target"], []).append(r["method"])
    stated = "; ".join(f"{t:g}x for {', '.join(names)}" for t, names in sorted(targets.items()))
    lines = [
        f"# Merge methods: speed against the floor (n = {res['n']}, d = {res['d']:.0e})",
        "",
        f"Floor: one numpy pass over the float32 stack, {1e3 * res['floor_s']:.1f} ms in this run. "
        "Ratios = time / floor, best of 3; the machine is shared, so absolute times are noisy and "
        f"only the ratios are reported as results. Targets: {stated}; eager and under an outer jit.",
        "",
    ]
    if "load_average" in res:
        lines += [f"Load averages when written: {res['load_average']} (1/5/15 min).", ""]
    lines.append(
        markdown_table(
            ["method", "eager / floor", "jit / floor", "target", "met"],
            [
                [
                    r["method"],
                    f"{r['eager_ratio']:.2f}",
                    f"{r['jit_ratio']:.2f}",
                    "-" if r["target"] is None else f"{r['target']:g}x",
                    "-" if r["met"] is None else ("yes" if r["met"] else "**no**"),
                ]
                for r in rows
            ],
        ).rstrip("\n")
    )
    judged = [r for r in rows if r["met"] is not None]
    missed = [r for r in judged if not r["met"]]
    lines += ["", f"{len(judged) - len(missed)} of {len(judged)} methods with a target meet it"]
    if missed:
        lines[-1] += "; above it: " + ", ".join(
            f"{r['method']} ({max(r['eager_ratio'], r['jit_ratio']):.2f}x against {r['target']:g}x)"
            for r in missed
        )
    lines[-1] += "."
    g = res["diagnostics"]
    lines += [
        "",
        f"Diagnostics: the exact TIES thresholds alone (counting passes on the bit pattern) "
        f"{g['ties_thresholds_ratio']:.2f}x; `jnp.sort` of the |deltas| "
        f"{g['jnp_sort_ratio']:.2f}x. A scaled copy of the stack into fresh memory (what "
        f"any pre-aggregator that writes its n rows costs at least, DARE included): XLA "
        f"{g['xla_copy_ratio']:.2f}x, numpy {g['numpy_copy_ratio']:.2f}x.",
    ]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
