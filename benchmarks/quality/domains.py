"""Merging where it matters: fine-tunes of one pretrained LM on different text domains, merged once.

Run ``python -m benchmarks domains [--quick] [--seeds 0,1,2] [--model smollm2|FOLDER]``. Writes
benchmarks/results/domains.{json,md} (``domains_quick.*`` with --quick).

Protocol (the one-shot regime of the merging literature, FusionBench-style, on text):

* the base is a pretrained causal LM (SmolLM2-135M by default, `meta-consensus models fetch
  smollm2`); the domains are offline text: three code domains, the standard library's module
  families of :data:`strategies.tasks.text.FAMILIES` (net, concurrency, runtime), and one prose
  domain, the interpreter's own documentation topics (``pydoc_data.topics``, written as JSONL);
* one node per domain fine-tunes the whole model from the base on its own documents
  (``causal_lm``'s split: node i on domain i, disjoint documents, the test and held-out windows
  from documents no node trains on); the *multitask* model trains on the union of the nodes'
  windows for the same steps with a batch as large as all nodes' together (the upper bound a
  merge is measured against);
* tangent-space nodes (:func:`strategies.tangent.linearize`) fine-tune the base's first-order
  Taylor expansion instead, with the same data, steps and learning rate; their merges are
  evaluated as linearised models at the base, as Ortiz-Jimenez et al. (2023) do;
* every merge of the specialists with the base as ``params``: the mean, task arithmetic with its
  scale tuned on the held-out windows, TIES and DARE+TIES (scale tuned), Model Stock, diagonal
  Fisher merging, mixture-NLL convex weights over the held-out tokens, and the robust rules
  (coordinate-wise median and trimmed mean) clean and with one node poisoned (its task vector
  sign-flipped and tripled), beside the mean under the same poisoning;
* loss barriers on the held-out windows between every pair of specialists and from each
  specialist to the mean (linear and tangent fine-tunes).

Reported: per-domain test perplexity of every row, the mean over domains, and each domain's
distance from the multitask model.
"""

from __future__ import annotations

import json
import tempfile
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

import consensus
from benchmarks.harness import header, markdown_table, parse, parser, save
from strategies import NodeData, NodeTrainer, TaskData
from strategies.convexity import loss_barrier
from strategies.registry import build_task
from strategies.statistics import node_statistics
from strategies.tangent import linearize
from strategies.tasks.text import FAMILIES, stdlib_root

NAME = "domains"
SCALES = (0.25, 0.4, 0.6, 0.8, 1.0)  # task-arithmetic lambdas: 1/D (the mean) up to the sum
POISONED = 0  # the node whose task vector is sign-flipped and tripled in the robust rows
PROSE = "prose"


def prose_jsonl(folder: Path) -> Path:
    """The prose domain: every ``pydoc_data.topics`` entry as one JSONL document."""
    import pydoc_data.topics as topics

    path = folder / "pydoc_topics.jsonl"
    with path.open("w", encoding="utf-8") as fh:
        for name in sorted(topics.topics):
            fh.write(json.dumps({"text": topics.topics[name]}) + "\n")
    return path


def domains(folder: Path) -> dict[str, list[str]]:
    """The benchmark's domains: the code families (globs into the standard library) and prose."""
    root = stdlib_root()
    out = {name: [f"{root}/{pkg}/**/*.py" for pkg in pkgs] for name, pkgs in FAMILIES}
    out[PROSE] = [str(prose_jsonl(folder))]
    return out


def settings_for(quick: bool) -> dict[str, Any]:
    """Sizes of a run (quick: 12 steps at context 48; with SmolLM2-135M on 2 CPU cores still far
    longer than the harness's quick runs, the fine-tunes and evaluations of four 135M models)."""
    if quick:
        return {"context": 48, "batch": 2, "steps": 12, "lr": 1e-4, "windows_per_node": 48,
                "heldout_windows": 16, "test_windows": 32, "fisher_rows": 4}  # fmt: skip
    return {"context": 128, "batch": 4, "steps": 100, "lr": 5e-5, "windows_per_node": 512,
            "heldout_windows": 64, "test_windows": 128, "fisher_rows": 16}  # fmt: skip


def union(data: TaskData) -> NodeData:
    """One node drawing from every node's valid own windows (the multitask model's data)."""
    counts = np.asarray(data.train_count)
    rows = {k: np.concatenate([v[i, : counts[i]] for i in range(len(counts))]) for k, v in data.train.items()}
    total = int(counts.sum())
    pool = {k: v[None] for k, v in rows.items()}
    return NodeData(pool, np.arange(total, dtype=np.int32)[None], np.array([total], np.int32), shared=False,
                    name="union", identity=True)  # fmt: skip


def fine_tune(task: Any, base: Any, data: NodeData, n: int, s: Mapping[str, Any], seed: int,
              batch: int, **fit: Any) -> tuple[Any, float]:  # fmt: skip
    """n copies of ``base`` trained on ``data`` for the run's steps: (stacked params, seconds a step).

    The first three steps run one at a time (the first compiles; the best of the other two is the
    step time, so linear and tangent fine-tuning are compared in the same run at the same shapes),
    the rest in one call. The state is donated: one copy of the nodes' params and Adam state.
    """
    trainer = NodeTrainer(task, optax.adam, {"learning_rate": s["lr"]}, batch_size=batch, donate=True)
    state = trainer.init(jax.random.key(seed), base, n)
    times = []
    for _ in range(3):
        start = time.perf_counter()
        state, _ = trainer.fit(state, data, 1, **fit)
        jax.block_until_ready(state.params)
        times.append(time.perf_counter() - start)
    if s["steps"] > 3:
        state, _ = trainer.fit(state, data, s["steps"] - 3, **fit)
    return state.params, min(times[1:])


def _node(stacked: Any, i: int) -> Any:
    return jax.tree.map(lambda v: v[i], stacked)


class Evaluator:
    """Per-domain perplexity and held-out loss of single trees, linear or tangent at the base."""

    def __init__(self, task: Any, base: Any, data: TaskData):
        self.task, self.base = task, base
        self.tangent = linearize(task, base)
        self.test = {k: jnp.asarray(v) for k, v in data.test.items()}
        self.heldout = {k: jnp.asarray(v) for k, v in data.heldout.items()}
        self._linear = jax.jit(task.metrics)
        self._tangent = jax.jit(lambda p, b, a: self.tangent.metrics(p, b, frozen=a))
        self._probs = jax.jit(task.target_probs)

    def metrics(self, params: Any, batch: Mapping[str, Any], tangent: bool = False) -> dict[str, float]:
        out = self._tangent(params, batch, self.base) if tangent else self._linear(params, batch)
        return {k: float(v) for k, v in out.items()}

    def row(self, params: Any, tangent: bool = False) -> dict[str, float]:
        """Per-domain test perplexity (and overall), the number every table row reports."""
        m = self.metrics(params, self.test, tangent)
        return {k.split("/", 1)[1]: v for k, v in m.items() if k.startswith("perplexity/")} | {
            "all": m["perplexity"]
        }

    def heldout_loss(self, params: Any, tangent: bool = False) -> float:
        return self.metrics(params, self.heldout, tangent)["loss"]

    def target_probs(self, params: Any) -> np.ndarray:
        return np.asarray(self._probs(params, self.heldout), np.float64)


def merges(
    ev: Evaluator, base: Any, stacked: Any, stats: Any, tangent: bool, robust: bool
) -> Iterator[tuple[str, Any, float | list[float] | None]]:
    """Every merge method's params, one at a time (a merged model is as large as the base), with
    its tuned scale (task arithmetic, TIES, DARE+TIES, on the held-out windows) or weights."""
    key = jax.random.key(0)

    def upd(agg: Any, nodes: Any = stacked, **kw: Any) -> Any:
        return agg.update(nodes, agg.init(base), base, **kw)[0]

    def tuned(make: Callable[[float], Any], **kw: Any) -> tuple[Any, float]:
        losses = {sc: ev.heldout_loss(upd(make(sc), **kw), tangent) for sc in SCALES}
        best = min(losses, key=lambda sc: losses[sc])
        return upd(make(best), **kw), best

    yield "mean", upd(consensus.mean()), None
    yield "task arithmetic", *tuned(lambda sc: consensus.task_arithmetic(sc))
    if tangent:
        return
    yield "ties", *tuned(lambda sc: consensus.ties(0.2, scale=sc))
    yield (
        "dare+ties",
        *tuned(
            lambda sc: consensus.process(consensus.ties(0.2, scale=sc), pre=[consensus.dare(0.5)]), key=key
        ),
    )
    yield "model stock", upd(consensus.model_stock()), None
    yield "fisher", upd(consensus.fisher_merge(), fisher=stats), None
    n = consensus.num_nodes(stacked)
    probs = np.stack([ev.target_probs(_node(stacked, i)) for i in range(n)])
    w = consensus.mixture_nll_weights(probs)
    weights = [round(float(x), 4) for x in w.weights]
    yield "mixture-NLL weights", consensus.weighted_sum(stacked, jnp.asarray(w.weights, jnp.float32)), weights
    yield "median", upd(consensus.median()), None
    yield "trimmed mean", upd(consensus.trimmed_mean(1)), None
    if robust:
        poisoned = jax.tree.map(lambda b, v: v.at[POISONED].set(b - 3.0 * (v[POISONED] - b)), base, stacked)
        yield "mean, 1 poisoned", upd(consensus.mean(), nodes=poisoned), None
        yield "median, 1 poisoned", upd(consensus.median(), nodes=poisoned), None
        yield "trimmed mean, 1 poisoned", upd(consensus.trimmed_mean(1), nodes=poisoned), None


def barriers(ev: Evaluator, stacked: Any, mean: Any, tangent: bool) -> dict[str, float]:
    """Held-out loss barriers: every pair of specialists, and each specialist to the mean."""
    task = ev.tangent if tangent else ev.task

    def loss(p: Any, batch: Any) -> Any:
        return task.loss(p, batch)

    n = consensus.num_nodes(stacked)
    pairs, to_mean = [], []
    for i in range(n):
        a = _node(stacked, i)
        to_mean.append(float(loss_barrier(loss, a, mean, ev.heldout, num_points=5).barrier))
        for j in range(i + 1, n):
            pairs.append(float(loss_barrier(loss, a, _node(stacked, j), ev.heldout, num_points=5).barrier))
    return {"pairwise max": max(pairs), "pairwise mean": float(np.mean(pairs)),
            "to mean max": max(to_mean), "to mean mean": float(np.mean(to_mean))}  # fmt: skip


def one_seed(model: str, seed: int, s: Mapping[str, Any], folder: Path) -> dict[str, Any]:
    """Every row of one seed (the node split and the training keys from ``seed``)."""
    text = domains(folder)
    task: Any = build_task("causal_lm", {
        "model": model, "text": text, "context": s["context"], "windows_per_node": s["windows_per_node"],
        "general_windows": 8, "heldout_windows": s["heldout_windows"], "test_windows": s["test_windows"],
        "split_seed": seed,
    })  # fmt: skip
    n = len(text)
    data = task.splits(n, seed=seed)
    base = task.init(jax.random.key(0))
    ev = Evaluator(task, base, data)
    times: dict[str, float] = {}
    rows: dict[str, dict[str, float]] = {"base": ev.row(base)}

    t0 = time.perf_counter()
    special, times["step s"] = fine_tune(task, base, data.own(), n, s, seed, s["batch"])
    times["fine-tune"] = time.perf_counter() - t0
    for i, name in enumerate(task.domains):
        rows[f"specialist: {name}"] = ev.row(_node(special, i))
    t0 = time.perf_counter()
    multi, _ = fine_tune(task, base, union(data), 1, s, seed, s["batch"] * n)
    times["multitask"] = time.perf_counter() - t0
    rows["multitask"] = ev.row(_node(multi, 0))
    del multi

    fisher = []
    for i in range(n):
        rows_i = {k: jnp.asarray(v[i, : s["fisher_rows"]]) for k, v in data.train.items() if k in ("x", "y")}
        fisher.append(node_statistics(task.loss, _node(special, i), rows_i, layer_inputs=lambda p, x: {},
                                      chunk_size=1).fisher)  # fmt: skip
    stats = consensus.stack(fisher)
    del fisher
    scales: dict[str, Any] = {}
    for name, p, scale in merges(ev, base, special, stats, tangent=False, robust=True):
        rows[name] = ev.row(p)
        if scale is not None:
            scales[name] = scale
    del stats
    mean = jax.tree.map(lambda v: jnp.mean(v, axis=0), special)
    bar = {"linear": barriers(ev, special, mean, tangent=False)}
    del mean, special

    t0 = time.perf_counter()
    tangent_nodes, times["tangent step s"] = fine_tune(
        ev.tangent, base, data.own(), n, s, seed, s["batch"], frozen=base
    )
    times["tangent fine-tune"] = time.perf_counter() - t0
    for i, name in enumerate(task.domains):
        rows[f"tangent specialist: {name}"] = ev.row(_node(tangent_nodes, i), tangent=True)
    t_scales: dict[str, Any] = {}
    for name, p, scale in merges(ev, base, tangent_nodes, None, tangent=True, robust=False):
        rows[f"tangent {name}"] = ev.row(p, tangent=True)
        if scale is not None:
            t_scales[name] = scale
    mean = jax.tree.map(lambda v: jnp.mean(v, axis=0), tangent_nodes)
    bar["tangent"] = barriers(ev, tangent_nodes, mean, tangent=True)
    return {
        "domains": list(task.domains), "rows": rows, "scales": scales,
        "tangent_scales": t_scales, "barriers": bar, "seconds": times,
    }  # fmt: skip


def summarize(runs: Sequence[Mapping[str, Any]]) -> dict[str, dict[str, list[float]]]:
    """Per row and domain: [mean, std] over seeds of the test perplexity."""
    out: dict[str, dict[str, list[float]]] = {}
    for row in runs[0]["rows"]:
        out[row] = {}
        for d in runs[0]["rows"][row]:
            v = [r["rows"][row][d] for r in runs]
            out[row][d] = [float(np.mean(v)), float(np.std(v))]
    return out


def markdown(res: Mapping[str, Any]) -> str:
    """The results page, rendered from the results JSON."""
    settings = res["settings"]
    lines = header(
        "Merging fine-tunes of a pretrained LM across text domains", NAME, settings["quick"], settings
    )
    runs = res["runs"]
    doms = [*runs[0]["domains"], "all"]
    summary = summarize(runs)
    lines.append(
        f"{len(runs)} seed(s); test perplexity per domain (mean ± std over seeds; lower is better). "
        "Specialists are evaluated on every domain; merges use the base as their reference; "
        "tangent rows are linearised models at the base. Sources: the standard library's packages "
        "(code domains) and `pydoc_data.topics` (prose)."
    )
    lines.append("")
    table = []
    for row, per in summary.items():
        table.append([row, *[f"{per[d][0]:.2f} ± {per[d][1]:.2f}" for d in doms]])
    lines.append(markdown_table(["row", *doms], table))
    lines.append("")
    multi = summary["multitask"]
    merge_rows = [
        r for r in summary if not r.startswith(("specialist", "tangent specialist", "base", "multitask"))
    ]
    clean = [r for r in merge_rows if "poisoned" not in r]
    best = min(clean, key=lambda r: summary[r]["all"][0])
    lines.append(
        f"Best clean merge over all domains: **{best}** ({summary[best]['all'][0]:.2f}, the multitask model "
        f"{multi['all'][0]:.2f}, the base {summary['base']['all'][0]:.2f}); its distance from the multitask "
        "model per domain: "
        + ", ".join(f"{d} {summary[best][d][0] - multi[d][0]:+.2f}" for d in runs[0]["domains"])
        + "."
    )
    lines.append("")
    keys = list(runs[0]["barriers"]["linear"])
    bars = [
        [kind, *[f"{np.mean([r['barriers'][kind][k] for r in runs]):.4f}" for k in keys]]
        for kind in runs[0]["barriers"]
    ]
    lines.append("Held-out loss barriers (nats; max over the path of the loss minus the chord):")
    lines.append("")
    lines.append(markdown_table(["fine-tuning", *runs[0]["barriers"]["linear"]], bars))
    lines.append("")
    ratio = [r["seconds"]["tangent step s"] / r["seconds"]["step s"] for r in runs]
    lines.append(
        f"A tangent-space step costs {np.mean(ratio):.2f}x a plain fine-tuning step (the {len(runs)} "
        "seed(s)' mean; one step of every node, best of two after compiling, same run and shapes)."
    )
    lines.append("")
    lines.append(f"Total time {res['total_s']:.0f} s.")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = parser(__doc__, "short fine-tunes at context 48, one seed")
    p.add_argument("--seeds", default=None, help="comma-separated seeds (default 0,1,2; --quick: 0)")
    p.add_argument("--model", default="smollm2", help="a Hugging Face folder or a cached model name")
    args = parse(p, argv)
    seeds = [0] if args.quick else [0, 1, 2]
    if args.seeds is not None:
        seeds = [int(x) for x in args.seeds.split(",")]
    s = settings_for(args.quick)
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="meta-consensus-domains-") as tmp:
        runs = [one_seed(args.model, seed, s, Path(tmp)) for seed in seeds]
    settings = {"quick": args.quick, "model": args.model, "seeds": seeds, **s}
    res = {"runs": runs, "total_s": time.perf_counter() - t0}
    md = markdown({**res, "settings": settings})
    save(NAME, args.quick, res, md, settings=settings, out=args.out)
    print(md)
    return res
