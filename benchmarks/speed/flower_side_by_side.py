"""Flower's robust strategies and this package's rules on the same replies: outputs and time.

Run ``python -m benchmarks flower_side_by_side [--quick]`` (needs the ``flower`` extra). Writes
benchmarks/results/flower_side_by_side.json and .md (``*_quick.*`` with --quick: d = 1e5
instead of 1e6).

n = 16 nodes reply with Flower ``Message`` s holding ArrayRecords of a two-leaf model (d
parameters in all); f = 3 of them are outliers (honest mean + 10, so every rule has something to
reject) and every reply says ``num-examples = 1`` (Flower's Krum, Multi-Krum and Bulyan average
weighted by it; equal weights make that the plain mean). Each Flower strategy's
``aggregate_train(1, replies)`` runs as Flower runs it (ArrayRecord -> numpy, numpy on the host)
next to the package rule with the same convention:

* FedMedian ~ ``median``; FedTrimmedAvg(beta = f / n) ~ ``trimmed_mean(f)`` (both cut
  ``floor(beta n) = f`` values from each side);
* Krum(f) ~ ``krum(f)`` and MultiKrum(f, m - f) ~ ``multi_krum(f)`` (scores: the sum of squared
  distances to the m - f - 2 nearest, as in docs/rules.md);
* Bulyan(f) ~ ``bulyan(f)``: **conventions differ**: Flower selects theta = m - 2f nodes by
  Multi-Krum scores computed once (one shot); this package by iterated Krum (El Mhamdi et al.
  2018). Both then average the beta = theta - 2f values closest to the median at every coordinate.

Outputs are compared by the largest absolute difference (float32: a few ulp where the
conventions agree). Times: the best of ``repeats`` calls; for the package both the rule alone on
a device-resident stack (eager ``update``, compiled on a warm-up call) and the whole path from
the replies (decode and check every ArrayRecord, stack, merge), with the ratio Flower / package.
The floor for the ratios is one numpy pass over the (n, d) stack in the same run: the machine is
shared, absolute times are not comparable across runs.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flwr.app import Message, MessageType, MetricRecord, RecordDict
from flwr.serverapp.strategy import Bulyan, FedMedian, FedTrimmedAvg, Krum, MultiKrum
from flwr.serverapp.strategy.bulyan import aggregate_n_closest_weights
from flwr.serverapp.strategy.multikrum import select_multikrum
from flwr.supercore.task_identity import TaskIdentity

from benchmarks.harness import best_time, header, markdown_table, parse, parser, ratio, save
from consensus import registry, tree
from consensus.base import get_info
from consensus.io.keys import flatten
from meta_consensus.flower.arrays import from_array_record, to_array_record

NAME = "flower_side_by_side"
N, F = 16, 3


def replies_of(model: dict[str, Any]) -> list[Message]:
    """One train reply per node: its row of every leaf as an ArrayRecord, num-examples = 1."""
    for name, value in (("run_id", 1), ("node_id", 0), ("task_id", 0)):
        if getattr(TaskIdentity, f"_{name}") is None:
            setattr(TaskIdentity, name, value)
    out = []
    for i in range(N):
        row = jax.tree.map(lambda v, i=i: v[i], model)
        sent = Message(RecordDict(), dst_node_id=1000 + i, message_type=MessageType.TRAIN)
        content = RecordDict({"arrays": to_array_record(row), "metrics": MetricRecord({"num-examples": 1})})
        out.append(Message(content, reply_to=sent))
    return out


def _time_flower(strategy: Any, model: dict[str, Any]) -> float:
    """One Flower aggregation on fresh replies (it consumes them); the replies are built untimed."""
    replies = replies_of(model)
    start = time.perf_counter()
    strategy.aggregate_train(1, replies)
    return time.perf_counter() - start


def bulyan_selection(model: dict[str, Any], rule: Any, stacked: Any, like: Any) -> dict[str, Any]:
    """Where the two Bulyans part: the nodes each selects, and Flower's coordinate step on ours.

    Flower's selection (Multi-Krum scores computed once) and this package's (iterated Krum) may
    pick different honest nodes; the coordinate step (the beta values closest to the median) is
    the same convention, so Flower's step run on the package's selection must give its output.
    """
    contents = [r.content for r in replies_of(model)]
    theta = N - 2 * F
    chosen = select_multikrum(contents, F, theta)
    flower_sel = sorted(next(i for i, c in enumerate(contents) if c is x) for x in chosen)
    merged, state = rule.update(stacked, rule.init(like), like)
    ours_sel = [int(i) for i in np.flatnonzero(np.asarray(get_info(state).selected))]
    keys = list(flatten(like))
    rows = [
        [np.asarray(flatten(jax.tree.map(lambda v, i=i: v[i], model))[k]) for k in keys] for i in ours_sel
    ]
    medians = [np.median(np.stack(col), axis=0) for col in zip(*rows, strict=True)]
    step = aggregate_n_closest_weights(medians, rows, theta - 2 * F)
    ours = flatten(jax.tree.map(np.asarray, merged))
    diff = max(
        float(np.max(np.abs(np.asarray(a, np.float64) - ours[k]))) for k, a in zip(keys, step, strict=True)
    )
    outliers = set(range(N - F, N))
    return {
        "flower_selected": flower_sel,
        "package_selected": ours_sel,
        "outliers_excluded_by_both": not (outliers & set(flower_sel)) and not (outliers & set(ours_sel)),
        "coordinate_step_on_package_selection_max_abs_diff": diff,
    }


def _rule_alone(rule: Any, stacked: Any, state: Any, like: Any) -> Any:
    """The rule's merge of a device-resident stack (its output only)."""
    return rule.update(stacked, state, like)[0]


def flower_strategies(f: int, n: int) -> dict[str, tuple[Any, str, dict[str, Any]]]:
    """Flower strategy -> (the strategy, the package rule, its options)."""
    return {
        "FedMedian": (FedMedian(), "median", {}),
        "FedTrimmedAvg": (FedTrimmedAvg(beta=f / n), "trimmed_mean", {}),
        "Krum": (Krum(num_malicious_nodes=f), "krum", {}),
        "MultiKrum": (MultiKrum(num_malicious_nodes=f, num_nodes_to_select=n - f), "multi_krum", {}),
        "Bulyan": (Bulyan(num_malicious_nodes=f), "bulyan", {}),
    }


def bulyan_lines(results: Sequence[Mapping[str, Any]]) -> list[str]:
    """Where the two Bulyans part (empty when the run has no Bulyan row)."""
    b = next((r for r in results if r["flower"] == "Bulyan" and "flower_selected" in r), None)
    if b is None:
        return []
    return [
        f"Bulyan: Flower selected {b['flower_selected']}, the package {b['package_selected']} (outliers "
        f"{'excluded by both' if b['outliers_excluded_by_both'] else 'NOT excluded by both'}); Flower's "
        f"coordinate step on the package's selection differs from the package's output by "
        f"{b['coordinate_step_on_package_selection_max_abs_diff']:.2e} (the same convention there).",
        "",
    ]


def markdown(res: Mapping[str, Any]) -> str:
    """The results page of a run of this benchmark, rendered from its result file.

    Args:
        res: the result dict as saved (``settings``, ``floor_s`` and ``results``, one row per
            Flower strategy).

    Returns:
        The markdown: title, run header, the floor, the table and the notes.
    """
    st = res.get("settings", {})
    results = res["results"]
    rows = [
        [
            r["flower"],
            r["package"],
            "yes" if r["conventions_agree"] else "no (one-shot vs iterated selection)",
            f"{r['max_abs_diff']:.2e}",
            f"{r['flower_s'] * 1e3:.1f}",
            f"{r['package_rule_s'] * 1e3:.1f}",
            f"{r['package_from_replies_s'] * 1e3:.1f}",
            f"{r['speedup_rule']:.1f}x",
            f"{r['speedup_from_replies']:.1f}x",
            f"{r['flower_x_floor']:.1f}",
            f"{r['package_rule_x_floor']:.1f}",
        ]
        for r in results
    ]
    quick = bool(st.get("quick", res.get("quick", False)))  # the settings do not record it: d tells
    md = header("Flower's robust strategies next to this package's rules", NAME, quick, st)
    md += [
        f"Floor (one numpy pass over the (n, d) float32 stack): {res['floor_s'] * 1e3:.2f} ms. The machine "
        "is shared:",
        "compare the ratios within this run, not absolute times across runs ('x floor': a time in units",
        "of the floor).",
        "",
        markdown_table(
            [
                "Flower",
                "package",
                "same convention",
                "max \\|diff\\|",
                "Flower ms",
                "package rule ms",
                "package from replies ms",
                "speedup (rule)",
                "speedup (from replies)",
                "Flower x floor",
                "package rule x floor",
            ],
            rows,
        ),
        *bulyan_lines(results),
        "'from replies' includes decoding and checking every ArrayRecord and stacking, as the",
        "ConsensusStrategy does; Flower's time includes its own ArrayRecord -> numpy decoding.",
    ]
    return "\n".join(md) + "\n"


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse(parser(__doc__, "d = 1e5 instead of 1e6"), argv)
    d = 100_000 if args.quick else 1_000_000
    repeats = 3
    rng = np.random.default_rng(0)
    shapes = {"kernel": (d // 100, 99), "bias": (d - 99 * (d // 100),)}
    model = {"dense": {k: rng.standard_normal((N, *s), dtype=np.float32) for k, s in shapes.items()}}
    for v in jax.tree.leaves(model):
        v[-F:] += 10.0  # the outliers: the last f nodes
    like = jax.tree.map(lambda v: v[0], model)
    replies = replies_of(model)
    stacked = jax.tree.map(jnp.asarray, model)
    host_stack = np.concatenate([v.reshape(N, -1) for v in jax.tree.leaves(model)], 1)
    floor = best_time(lambda: host_stack.sum(axis=0), 7)

    def from_replies(rule):
        trees = [from_array_record(r.content["arrays"], like) for r in replies]
        st = tree.stack(trees)
        return rule.update(st, rule.init(like), like)[0]

    results = []
    for flower_name, (strategy, rule_name, options) in flower_strategies(F, N).items():
        rule = registry.make(rule_name, F, **options)
        state = rule.init(like)
        # Flower's strategies consume the replies (they pop the arrays): fresh replies every call.
        theirs_arrays, _ = strategy.aggregate_train(1, replies_of(model))
        theirs = {k: np.asarray(a.numpy()) for k, a in theirs_arrays.items()}
        ours = flatten(jax.tree.map(np.asarray, rule.update(stacked, state, like)[0]))
        assert sorted(ours) == sorted(theirs), (sorted(ours), sorted(theirs))
        diff = max(float(np.max(np.abs(theirs[k].astype(np.float64) - ours[k]))) for k in ours)
        extra = bulyan_selection(model, rule, stacked, like) if flower_name == "Bulyan" else {}
        t_flower = min(_time_flower(strategy, model) for _ in range(repeats))
        t_rule = best_time(functools.partial(_rule_alone, rule, stacked, state, like), repeats)
        t_path = best_time(functools.partial(from_replies, rule), repeats)
        agree = flower_name != "Bulyan"
        results.append(
            {
                "flower": flower_name,
                "package": rule_name,
                "max_abs_diff": diff,
                "conventions_agree": agree,
                "flower_s": t_flower,
                "package_rule_s": t_rule,
                "package_from_replies_s": t_path,
                "speedup_rule": t_flower / t_rule,
                "speedup_from_replies": t_flower / t_path,
                "flower_x_floor": ratio(t_flower, floor),
                "package_rule_x_floor": ratio(t_rule, floor),
                **extra,
            }
        )
        print(results[-1], flush=True)
    settings = {"n": N, "f": F, "d": d, "outliers": "last f nodes, + 10", "repeats": repeats}
    payload = {"floor_s": floor, "results": results}
    md = markdown({"settings": settings, "quick": args.quick, **payload})
    save(NAME, args.quick, payload, md, settings=settings)
    print(md)
    return payload


if __name__ == "__main__":
    main()
