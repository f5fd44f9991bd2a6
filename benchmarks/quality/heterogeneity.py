"""How dissimilar the honest nodes' updates are: (G, B) and the breakdown point of Allouah et al. 2023.

Run ``python -m benchmarks heterogeneity [--quick]``. Writes benchmarks/results/heterogeneity.json
and .md (``_quick``: one seed, alpha 0.3, 5 rounds).

Allouah et al. 2023 (Robust distributed learning: tight error bounds and breakdown point under
data heterogeneity, NeurIPS) describe heterogeneity by (G, B)-dissimilarity: for every model
theta, the honest nodes' vectors v_i(theta) satisfy

    (1 / |H|) sum_i ||v_i - v_bar||^2  <=  G^2 + B^2 ||v_bar||^2,

and prove that no aggregation rule is robust once f / n >= 1 / (2 + B^2), and that below it every
rule can be made to err by Omega(f / (n - (2 + B^2) f) * G^2) on some problem of the class. Their
vectors are gradients; here both the nodes' full-shard gradients and their round updates (the model
each node returns less the consensus it started from, after its local steps: what the vote sees).

The measurement: a config's own run, clean (``byzantine.nodes = []``), its vote replaced by the
plain mean (FedAvg's trajectory, which no rule bends), recording every round's vectors. Over the
nodes that are honest in the config's attacked runs (its ``byzantine.nodes`` left out), each round
t gives the spread h_t = mean_i ||v_i - v_bar||^2 and the signal s_t = ||v_bar||^2. Every (G, B)
with G^2 >= max_t (h_t - B^2 s_t) fits the run; the page reports, for B^2 from 0 up to the largest
B^2 at which f / n is still below the breakdown point, the smallest G^2 that fits, and the bound's
error scale f / (n - (2 + B^2) f) G^2 in units of the median round's signal s_t: above 1, the
worst case the bound allows is an error as large as the honest mean update itself.
"""

from __future__ import annotations

import re
import time
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from benchmarks import harness
from benchmarks.tuning import attack_suite

CONFIGS = {"robust-noserver": "configs/robust-noserver.toml", "default": "meta_consensus/default.toml"}
ALPHAS = (0.3, 1.0)
# The plain mean alone: no weights, no server step (the attack suite's spelling of a vote alone).
MEAN_VOTE = attack_suite.vote_alone("mean")


def flat_rows(stacked: Any) -> np.ndarray:
    """(n, P) float64: each node's parameters as one row."""
    import jax

    leaves = jax.tree.leaves(stacked)
    n = leaves[0].shape[0]
    return np.concatenate([np.asarray(x, np.float64).reshape(n, -1) for x in leaves], axis=1)


def flat(tree: Any) -> np.ndarray:
    """(P,) float64: one tree's parameters as one row."""
    import jax

    return flat_rows(jax.tree.map(lambda x: x[None], tree))[0]


def spread_and_signal(updates: np.ndarray) -> tuple[float, float]:
    """(h, s): the mean squared distance of the rows to their mean, and the mean's squared norm."""
    mean = updates.mean(axis=0)
    return float(np.mean(np.sum((updates - mean) ** 2, axis=1))), float(mean @ mean)


def fit_g2(h: Sequence[float], s: Sequence[float], b2: float) -> float:
    """The smallest G^2 with h_t <= G^2 + B^2 s_t for every round t."""
    return float(max(0.0, max(ht - b2 * st for ht, st in zip(h, s, strict=True))))


def bound_scale(n: int, f: int, b2: float, g2: float) -> float:
    """f / (n - (2 + B^2) f) * G^2, or inf at or past the breakdown point f / n >= 1 / (2 + B^2)."""
    denom = n - (2.0 + b2) * f
    return float("inf") if denom <= 0 else f / denom * g2


def record_run(path: str, sets: Sequence[str]) -> tuple[dict[str, list[tuple[float, float]]], dict[str, Any]]:
    """One clean FedAvg-trajectory run of a config: (h_t, s_t) per round over its honest nodes.

    Two kinds of vectors per round t, both at the round's starting consensus theta_t: ``gradient``,
    each honest node's full-shard loss gradient (the definition's vectors: no sampling noise), and
    ``update``, the model it returned less theta_t (what the vote sees: heterogeneity plus the
    noise of its local steps).
    """
    import jax
    import jax.numpy as jnp

    from meta_consensus import config, stages
    from meta_consensus.coordinator import Coordinator

    shipped = config.load(path, [])
    honest_of = [i for i in range(shipped.nodes.count) if i not in set(shipped.byzantine.nodes)]
    cfg = config.load(
        path, ["checkpoint_every=0", "baseline_fedavg=false", "byzantine.nodes=[]", *MEAN_VOTE, *sets]
    )
    pairs: dict[str, list[tuple[float, float]]] = {"gradient": [], "update": []}
    co = Coordinator(cfg)
    data, task = co.fleet.data, co.fleet.task
    grad = jax.jit(jax.grad(lambda p, b: task.loss(p, b)))

    def shard(i: int) -> dict[str, Any]:
        c = int(data.train_count[i])
        return {k: jnp.asarray(v[i, :c]) for k, v in data.train.items()}

    shards = [shard(i) for i in honest_of]

    class Recording(stages.PipelineMerge):
        def merge(self, co: Any, w: Any) -> str:
            theta = w.state.consensus
            base = flat(theta)
            pairs["update"].append(spread_and_signal(flat_rows(w.out.submitted)[honest_of] - base))
            g = np.stack([flat(grad(theta, b)) for b in shards])
            pairs["gradient"].append(spread_and_signal(g))
            return super().merge(co, w)

    co.merger = Recording()
    state = co.init(jax.random.key(cfg.seed))
    for _ in range(cfg.rounds):
        state, info = co.round(state)
        if not info.ok:
            raise RuntimeError(f"{path}: round failed: {info.reason}")
    meta = {"n": shipped.nodes.count, "f": len(shipped.byzantine.nodes), "honest": len(honest_of),
            "rounds": cfg.rounds}  # fmt: skip
    return pairs, meta


def summarize(h: Sequence[float], s: Sequence[float], n: int, f: int) -> dict[str, Any]:
    """G^2 fits over a grid of B^2 below the breakdown point, and the bound's scale in signal units."""
    b2_max = n / f - 2.0  # f / n < 1 / (2 + B^2)  <=>  B^2 < n / f - 2
    s_med = float(np.median(s))
    grid = [b for b in (0.0, 0.5, 1.0, 1.5, 1.9) if b < b2_max] if b2_max > 0 else []
    fits = []
    for b2 in grid:
        g2 = fit_g2(h, s, b2)
        scale = bound_scale(n, f, b2, g2)
        fits.append({"b2": b2, "g2": g2, "bound": scale, "bound_over_signal": scale / s_med})
    ratio = [ht / st for ht, st in zip(h, s, strict=True)]
    return {
        "b2_breakdown": b2_max,
        "b2_with_g0": float(max(ratio)),  # the B^2 that fits every round with G = 0
        "ratio_median": float(np.median(ratio)),
        "ratio_last": float(ratio[-1]),
        "signal_median": s_med,
        "fits": fits,
    }


KINDS = ("gradient", "update")
TITLE = "Heterogeneity: (G, B) and the breakdown point"
EXPLAIN = re.sub(
    r"\s+",
    " ",
    """
    Clean runs of each config with its vote replaced by the plain mean (FedAvg's trajectory). Per
    round, over the nodes honest in its attacked runs, at the round's starting consensus: the vectors
    are each node's full-shard loss gradient (gradient: the definition's, no sampling noise) or the
    model it returned less the consensus (update: what the vote sees, heterogeneity plus the noise of
    its local steps); h = mean ||v_i - v_bar||^2 (their spread), s = ||v_bar||^2 (the signal). B^2
    breakdown = n / f - 2: no rule is robust once B^2 reaches it (f / n >= 1 / (2 + B^2)). B^2 (G = 0)
    = max_t h_t / s_t: the B^2 that fits every round without G. For each B^2 in 0, 0.5, 1, 1.5, 1.9
    below the breakdown, G^2 = max_t (h_t - B^2 s_t); the bound's error scale f / (n - (2 + B^2) f) G^2
    over the median s_t, its weakest (smallest) value over those B^2 in the last column: above 1, some
    problem with this (G, B) lets f attackers move any rule's output by as much as the honest mean
    vector itself.
    """,
).strip()


def markdown(res: Mapping[str, Any]) -> str:
    rows = []
    for key, run in res["runs"].items():
        name, alpha = key.rsplit("@", 1)
        for seed, r in run["seeds"].items():
            for kind in KINDS:
                sm = r[kind]["summary"]
                best = min(sm["fits"], key=lambda x: x["bound_over_signal"]) if sm["fits"] else None
                rows.append([
                    name, alpha, seed, kind, f"{r['meta']['f']} of {r['meta']['n']}",
                    f"{sm['b2_breakdown']:.2f}",
                    f"{sm['ratio_median']:.2f}", f"{sm['ratio_last']:.2f}", f"{sm['b2_with_g0']:.2f}",
                    "-" if best is None else f"{best['b2']:.1f}",
                    "-" if best is None else f"{best['bound_over_signal']:.2f}",
                ])  # fmt: skip
    table = harness.markdown_table(
        ["config", "alpha", "seed", "vectors", "f of n", "B^2 breakdown", "h/s median", "h/s last",
         "B^2 (G = 0)", "B^2 of the weakest bound", "weakest bound / signal"], rows)  # fmt: skip
    lines = [
        f"# {TITLE}",
        "",
        EXPLAIN,
        "",
        table,
    ]
    lines += ["", *findings(res)]
    return "\n".join(lines) + "\n"


def findings(res: Mapping[str, Any]) -> list[str]:
    out = []
    for key, run in res["runs"].items():
        name, alpha = key.rsplit("@", 1)
        for kind in KINDS:
            sms = [r[kind]["summary"] for r in run["seeds"].values()]
            g0 = [sm["b2_with_g0"] for sm in sms]
            med = [sm["ratio_median"] for sm in sms]
            brk = sms[0]["b2_breakdown"]
            weakest = [min((x["bound_over_signal"] for x in sm["fits"]), default=float("inf")) for sm in sms]
            out.append(
                f"- {name}, alpha {alpha}, {kind}s: spread / signal {min(med):.2f} to {max(med):.2f} in the "
                f"median round, {min(g0):.2f} to {max(g0):.2f} at the worst (B^2 with G = 0; breakdown "
                f"B^2 = {brk:.2f}, {sum(b >= brk for b in g0)} of {len(g0)} seeds at or past it); below the "
                f"breakdown, the bound's error scale is at least {min(weakest):.2f} to {max(weakest):.2f} "
                "times the median signal."
            )
    return out


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = harness.parser(__doc__, "robust-noserver only, alpha 0.3, seed 0, 5 rounds")
    p.add_argument("--seeds", default="0,1,2", help="comma-separated seeds")
    args = harness.parse(p, argv)
    seeds = [0] if args.quick else [int(v) for v in args.seeds.split(",")]
    configs = {"robust-noserver": CONFIGS["robust-noserver"]} if args.quick else CONFIGS
    alphas = (0.3,) if args.quick else ALPHAS
    extra = ["rounds=5"] if args.quick else []
    t0 = time.perf_counter()
    runs: dict[str, Any] = {}
    for name, path in configs.items():
        for alpha in alphas:
            key = f"{name}@{alpha:g}"
            runs[key] = {"seeds": {}}
            for seed in seeds:
                pairs, meta = record_run(path, [f"seed={seed}", f"task.alpha={alpha:g}", *extra])
                runs[key]["seeds"][str(seed)] = {"meta": meta} | {
                    kind: {"h": [x[0] for x in ps], "s": [x[1] for x in ps],
                           "summary": summarize([x[0] for x in ps], [x[1] for x in ps], meta["n"], meta["f"])}
                    for kind, ps in pairs.items()
                }  # fmt: skip
                print(
                    f"{key} seed {seed}: {runs[key]['seeds'][str(seed)]['gradient']['summary']}", flush=True
                )
    settings = {"quick": args.quick, "configs": list(configs), "alphas": list(alphas), "seeds": seeds}
    res = {"runs": runs, "total_s": time.perf_counter() - t0}
    md = markdown(res)
    harness.save("heterogeneity", args.quick, res, md, settings=settings)
    print(md)
    return res
