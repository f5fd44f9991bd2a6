"""Speed of the server-guided and adaptive robust rules against the memory-bandwidth floor.

Run ``python -m benchmarks robust_speed [--quick]``. Writes benchmarks/results/robust_speed.json and
robust_speed.md (``robust_speed_quick.*`` with --quick: d = 1e6 instead of 1e7).

The floor is one numpy pass over the (n, d) float32 stack (``x.sum(axis=0)``), measured in the
same run, so the ratios hold on a machine shared with other work while the absolute times do not.
Every rule runs eagerly (``update`` on a concrete stack, as a user calls it) and inside one outer
``jax.jit``, both on a one-leaf tree of n = 16 nodes, with params as the centre, the server's
update (FLTrust, server MoNNA) and a key (DnC, SignGuard, bucketing), on a clean stack and on an
attacked one (the last f rows one repeated vector, as ALIE and IPM send: ties in every order
statistic). Targets (issue 17): every rule at most 3x the floor, DnC at most 4x.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.harness import best_time, load_average, markdown_table, parse, parser, save
from consensus import aggregators as agg
from consensus import process

NAME = "robust_speed"
TARGET = 3.0
TARGETS = {"dnc": 4.0}
F = 4


def rules(f: int) -> dict[str, Any]:
    return {
        "fltrust": agg.fltrust(),
        "server_monna": agg.server_monna(f),
        "arc+meamed": process(agg.meamed(f), pre=[agg.arc(f)]),
        "dnc": agg.dnc(f),
        "signguard": agg.signguard(),
        "caf": agg.caf(f),
        "smea": agg.smea(f),
        "meamed": agg.meamed(f),
        "bucketing (f=2)": agg.bucketing(2),
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse(parser(__doc__, "d = 1e6 instead of 1e7"), argv)
    n, d = 16, (1_000_000 if args.quick else 10_000_000)
    repeats = 3
    rng = np.random.default_rng(0)
    x_np = rng.standard_normal((n, d), dtype=np.float32)
    params = {"w": jnp.asarray(rng.standard_normal(d, dtype=np.float32))}
    stacked = {"w": jnp.asarray(x_np)}
    # ALIE-like: f copies of mean - 1.5 std, per coordinate.
    honest = x_np[: n - F]
    attacker = honest.mean(0) - 1.5 * honest.std(0)
    attacked = {"w": jnp.asarray(np.concatenate([honest, np.broadcast_to(attacker, (F, d))]))}
    del honest, attacker
    server = {"w": jnp.asarray(0.1 * rng.standard_normal(d, dtype=np.float32))}
    key = jax.random.key(0)
    t0 = time.perf_counter()
    floor = best_time(lambda: x_np.sum(axis=0), 7)
    rows: list[dict[str, Any]] = []
    for name, rule in rules(F).items():
        kw = {"key": key, "server_update": server}
        state = rule.init(params)

        def eager(rule=rule, state=state, kw=kw):
            return rule.update(stacked, state, params, **kw)[0]

        jitted = jax.jit(
            lambda s, p, g, k, rule=rule, state=state: rule.update(s, state, p, key=k, server_update=g)[0]
        )

        def eager_attacked(rule=rule, state=state, kw=kw):
            return rule.update(attacked, state, params, **kw)[0]

        te = best_time(eager, repeats)
        tj = best_time(functools.partial(jitted, stacked, params, server, key), repeats)
        ta = best_time(eager_attacked, repeats)
        tja = best_time(functools.partial(jitted, attacked, params, server, key), repeats)
        target = TARGETS.get(name, TARGET)
        rows.append(
            {
                "rule": name,
                "eager_s": te,
                "jit_s": tj,
                "attacked_eager_s": ta,
                "attacked_jit_s": tja,
                "eager_ratio": te / floor,
                "jit_ratio": tj / floor,
                "attacked_eager_ratio": ta / floor,
                "attacked_jit_ratio": tja / floor,
                "target": target,
                "met": bool(max(te, tj, ta, tja) / floor <= target),
            }
        )
        print(
            f"{name}: eager {te / floor:.2f}x, jit {tj / floor:.2f}x of the floor; "
            f"attacked {ta / floor:.2f}x / {tja / floor:.2f}x",
            flush=True,
        )
    res = {"n": n, "d": d, "floor_s": floor, "rows": rows, "total_s": time.perf_counter() - t0}
    res["load_average"] = load_average()  # the record's own (save keeps it), shown on the page
    settings = {"n": n, "d": d, "f": F, "quick": args.quick}
    md = markdown({**res, "settings": settings})
    save(NAME, args.quick, res, md, settings=settings)
    print(md)
    return res


def markdown(res: Mapping[str, Any]) -> str:
    """The page of one result file: every rule's time over the floor, clean and attacked, and its target.

    Args:
        res: the result file as written (``n``, ``d``, ``floor_s``, ``rows``; ``settings`` with ``f``).

    Returns:
        The markdown: a title, the method, the table and which rules miss their target.
    """
    rows = res["rows"]
    f = (res.get("settings") or {}).get("f", F)
    targets: dict[float, list[str]] = {}
    for r in rows:
        targets.setdefault(r["target"], []).append(r["rule"])
    usual = max(targets, key=lambda t: len(targets[t]))
    others = "; ".join(f"{', '.join(names)} {t:g}x" for t, names in targets.items() if t != usual)
    lines = [
        f"# Robust rules: speed against the floor (n = {res['n']}, d = {res['d']:.0e})",
        "",
        f"Floor: one numpy pass over the float32 stack, {1e3 * res['floor_s']:.1f} ms in this run. "
        "Ratios = time / floor, best of 3; the machine is shared, so absolute times are noisy and "
        f"only the ratios are reported as results. Targets: {usual:g}x"
        + (f" ({others})" if others else "")
        + ", eager and under an outer jit, "
        f"clean and attacked (the last {f} rows one repeated ALIE-like vector).",
        "",
    ]
    if "load_average" in res:
        lines += [f"Load averages when written: {res['load_average']} (1/5/15 min).", ""]
    lines.append(
        markdown_table(
            ["rule", "eager / floor", "jit / floor", "attacked: eager / jit", "target", "met"],
            [
                [
                    r["rule"],
                    f"{r['eager_ratio']:.2f}",
                    f"{r['jit_ratio']:.2f}",
                    f"{r['attacked_eager_ratio']:.2f} / {r['attacked_jit_ratio']:.2f}",
                    f"{r['target']:g}x",
                    "yes" if r["met"] else "**no**",
                ]
                for r in rows
            ],
        ).rstrip("\n")
    )
    missed = [r["rule"] for r in rows if not r["met"]]
    slowest = max(rows, key=_worst)
    lines += [
        "",
        (
            "Every rule meets its target in all four columns"
            if not missed
            else f"{len(missed)} of {len(rows)} rules miss their target: {', '.join(missed)}"
        )
        + f"; the slowest column of any rule is {slowest['rule']}'s, at {_worst(slowest):.2f}x the floor.",
    ]
    return "\n".join(lines) + "\n"


def _worst(r: Mapping[str, Any]) -> float:
    return max(r[k] for k in ("eager_ratio", "jit_ratio", "attacked_eager_ratio", "attacked_jit_ratio"))


if __name__ == "__main__":
    main()
