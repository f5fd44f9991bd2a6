"""Merging where it matters: fine-tunes of one pretrained LM on different text domains, merged once.

Run ``python -m benchmarks domains [--quick | --cpu] [--seeds 0,1,2] [--model smollm2|FOLDER]``.
Writes benchmarks/results/domains.{json,md} (``domains_quick.*`` with --quick). Three sizes:
``--quick`` runs the headline rows in under 10 minutes on 2 CPU cores (a smoke run: a handful of
steps; :data:`QUICK` names them); ``--cpu`` is the published page's (one seed, about an hour on 2
CPU cores); the default (three seeds, longer fine-tunes at context 128) is for an accelerator.

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
* hierarchical nodes train through the strategy's levels instead (the public pool of every domain,
  then its windows of the node's own domain, then the node's documents), the same steps and rate;
  soup nodes keep snapshots and submit their greedy soup; LoRA nodes train adapters; the federated
  regime repeats rounds of local steps from the round's consensus, with plain, tangent, proximal
  and hierarchical nodes;
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

import functools
import json
import math
import os
import shutil
import sys
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
from benchmarks.harness import (
    header,
    load_line,
    markdown_table,
    parse,
    parser,
    record_arguments,
    results_folder,
    save,
)
from strategies import NodeData, NodeTrainer, TaskData
from strategies.convexity import loss_barrier
from strategies.lora import LoraSettings, LoraTask, add_base_delta, merge_adapter
from strategies.registry import build_task
from strategies.statistics import linear_input_grams, node_statistics
from strategies.tangent import linearize
from strategies.tasks.text import FAMILIES, stdlib_root

NAME = "domains"
SCALES = (0.25, 0.5, 0.75, 1.0)  # task-arithmetic lambdas: 1/D (the mean) up to the sum
REGMEAN_SCALES = (0.5, 0.9, 1.0)  # RegMean's off-diagonal scale a (1: exact least squares)
# LoRA on every projection of the blocks (PEFT's module names), rank and alpha = 2 rank.
LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# The adapter merges: (row, method of consensus.lora.merge_adapters, its options).
LORA_MERGES: tuple[tuple[str, str, dict[str, Any]], ...] = (
    ("fedit (factor mean)", "fedit", {}),
    ("exact mean (residual)", "exact_residual", {}),
    ("svd", "svd", {}),
    ("ties", "ties", {"density": 0.5}),
    ("dare+ties", "dare_ties", {"density": 0.5}),
)
SECTIONS = ("oneshot", "hierarchical", "soup", "lora", "federated")
SNAPSHOTS = 3  # a soup node's snapshots, evenly spaced over its fine-tune (the last is the latest)
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


# The sizes of a run. "quick" is a smoke run of the headline rows in under 10 minutes on 2 CPU
# cores (a handful of steps and windows: its perplexities barely move from the base's; on such a
# machine the first call of a merge over SmolLM2 spends 20-40 s compiling, one small program per
# leaf shape, and an Adam step of four nodes takes about 6 s, so it runs the rows of QUICK only);
# "cpu" is the
# published page's, the most that fits an hour of 2 CPU cores with SmolLM2-135M (about 65 training
# tokens a second); "full" is for an accelerator. general_windows is the public pool that only the
# hierarchical nodes read (its draw is independent of every other pool's: the other rows do not
# depend on it).
SIZES: dict[str, dict[str, Any]] = {
    "quick": {"context": 32, "batch": 1, "steps": 4, "lr": 1e-4, "windows_per_node": 8, "heldout_windows": 4,
              "test_windows": 8, "stat_rows": 2, "rounds": 2, "barrier_points": 0, "lora_rank": 4,
              "lora_lr": 1e-3, "general_windows": 8},
    "cpu": {"context": 48, "batch": 2, "steps": 12, "lr": 1e-4, "windows_per_node": 48, "heldout_windows": 16,
            "test_windows": 32, "stat_rows": 8, "rounds": 3, "barrier_points": 3, "lora_rank": 8,
            "lora_lr": 1e-3, "general_windows": 48},
    "full": {"context": 128, "batch": 4, "steps": 100, "lr": 5e-5, "windows_per_node": 512,
             "heldout_windows": 64, "test_windows": 128, "stat_rows": 32, "rounds": 5, "barrier_points": 5,
             "lora_rank": 8, "lora_lr": 1e-3, "general_windows": 512},
}  # fmt: skip
# --quick's rows: the one-shot merges that need nothing but the weights and held-out rows (not the
# ones that need node statistics, nor TIES and DARE, which sort every parameter), the tangent and
# hierarchical nodes, and federated FedAvg of plain and tangent nodes; no loss barriers
# (barrier_points = 0; the tests check the tangent fine-tunes' on a small model).
QUICK = {
    "sections": ("oneshot", "hierarchical", "federated"),
    "merges": ("mean", "task arithmetic", "model stock", "mixture-NLL weights", "median", "trimmed mean"),
    "federated_rows": ("mean (FedAvg)", "tangent mean"),
}
# Settings that say how a run was split or named, not what it measured (parts may differ in them).
PART_KEYS = ("sections", "federated_rows", "quick", "size", "merges")


def settings_for(size: str) -> dict[str, Any]:
    """The sizes of a run of ``size`` (one of :data:`SIZES`); --quick's also name its rows."""
    out = dict(SIZES[size])
    if size == "quick":
        out |= {"merges": list(QUICK["merges"]), "federated_rows": list(QUICK["federated_rows"])}
    return out


def union(data: TaskData) -> NodeData:
    """One node drawing from every node's valid own windows (the multitask model's data)."""
    counts = np.asarray(data.train_count)
    rows = {k: np.concatenate([v[i, : counts[i]] for i in range(len(counts))]) for k, v in data.train.items()}
    total = int(counts.sum())
    pool = {k: v[None] for k, v in rows.items()}
    return NodeData(pool, np.arange(total, dtype=np.int32)[None], np.array([total], np.int32), shared=False,
                    name="union", identity=True)  # fmt: skip


_TRAINERS: dict[tuple[int, float, int], NodeTrainer] = {}


def trainer_for(task: Any, lr: float, batch: int) -> NodeTrainer:
    """One trainer per (task, learning rate, batch): a new trainer would compile its step again."""
    k = (id(task), lr, batch)
    if k not in _TRAINERS:
        _TRAINERS[k] = NodeTrainer(task, optax.adam, {"learning_rate": lr}, batch_size=batch, donate=True)
    return _TRAINERS[k]


def fine_tune(task: Any, base: Any, data: NodeData, n: int, steps: int, lr: float, seed: int,
              batch: int, timed: bool = True, **fit: Any) -> tuple[Any, float]:  # fmt: skip
    """n copies of ``base`` trained on ``data`` for ``steps`` Adam steps: (stacked params, seconds a step).

    With ``timed``, the first three steps run one at a time (the first compiles; the best of the
    other two is the step time, so linear and tangent fine-tuning are compared in the same run at
    the same shapes), the rest in one call. The state is donated: one copy of the nodes' params
    and Adam state.
    """
    trainer = trainer_for(task, lr, batch)
    state = trainer.init(jax.random.key(seed), base, n)
    times = [math.nan, math.nan]
    done = 0
    while timed and done < min(3, steps):
        start = time.perf_counter()
        state, _ = trainer.fit(state, data, 1, **fit)
        jax.block_until_ready(state.params)
        times.append(time.perf_counter() - start)
        done += 1
    if steps > done:
        state, _ = trainer.fit(state, data, steps - done, **fit)
    return state.params, min(times[-2:]) if timed else math.nan


def _node(stacked: Any, i: int) -> Any:
    return jax.tree.map(lambda v: v[i], stacked)


_START = time.perf_counter()


def log(message: str) -> None:
    """Progress on stderr (a SmolLM2 run on a CPU takes long enough to want it)."""
    print(f"[domains {time.perf_counter() - _START:7.0f} s] {message}", file=sys.stderr, flush=True)


def _example_loss(task: Any, params: Any, example: Any) -> Any:
    return task.loss(params, jax.tree.map(lambda a: a[None], example))


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

    def metrics(
        self, params: Any, batch: Mapping[str, Any], tangent: bool = False, anchor: Any = None
    ) -> dict[str, float]:
        if tangent:
            out = self._tangent(params, batch, self.base if anchor is None else anchor)
        else:
            out = self._linear(params, batch)
        return {k: float(v) for k, v in out.items()}

    def row(self, params: Any, tangent: bool = False, anchor: Any = None) -> dict[str, float]:
        """Per-domain test perplexity (and overall), the number every table row reports (tangent:
        the model linearised at ``anchor``, default the base)."""
        m = self.metrics(params, self.test, tangent, anchor)
        return {k.split("/", 1)[1]: v for k, v in m.items() if k.startswith("perplexity/")} | {
            "all": m["perplexity"]
        }

    def heldout_loss(self, params: Any, tangent: bool = False) -> float:
        return self.metrics(params, self.heldout, tangent)["loss"]

    def target_probs(self, params: Any) -> np.ndarray:
        return np.asarray(self._probs(params, self.heldout), np.float64)


def merges(
    ev: Evaluator,
    base: Any,
    stacked: Any,
    stats: Any,
    grams: Any,
    tangent: bool,
    robust: bool,
    short: bool | None = None,
    only: Sequence[str] | None = None,
) -> Iterator[tuple[str, Any, float | list[float] | None]]:
    """Every merge method's params, one at a time (a merged model is as large as the base), with
    its tuned scale (task arithmetic, TIES, DARE+TIES, RegMean's a, on the held-out windows) or
    weights; ``only``: these rows (and their poisoned runs) alone."""
    key = jax.random.key(0)

    def wanted(row: str) -> bool:
        return only is None or row in only

    def upd(agg: Any, nodes: Any = stacked, **kw: Any) -> Any:
        return agg.update(nodes, agg.init(base), base, **kw)[0]

    def tuned(make: Callable[[float], Any], **kw: Any) -> tuple[Any, float]:
        losses = {sc: ev.heldout_loss(upd(make(sc), **kw), tangent) for sc in SCALES}
        best = min(losses, key=lambda sc: losses[sc])
        return upd(make(best), **kw), best

    if wanted("mean"):
        yield "mean", upd(consensus.mean()), None
    if wanted("task arithmetic"):
        yield "task arithmetic", *tuned(lambda sc: consensus.task_arithmetic(sc))
    if tangent if short is None else short:  # the mean and task arithmetic only
        return
    if wanted("ties"):
        yield "ties", *tuned(lambda sc: consensus.ties(0.2, scale=sc))
    if wanted("dare+ties"):
        dare = consensus.dare(0.5)
        yield (
            "dare+ties",
            *tuned(lambda sc: consensus.process(consensus.ties(0.2, scale=sc), pre=[dare]), key=key),
        )
    if wanted("model stock"):
        yield "model stock", upd(consensus.model_stock()), None
    if wanted("fisher"):
        yield "fisher", upd(consensus.fisher_merge(), fisher=stats), None
    if wanted("regmean"):
        losses = {a: ev.heldout_loss(upd(consensus.regmean(a), grams=grams)) for a in REGMEAN_SCALES}
        a_best = min(losses, key=lambda a: losses[a])
        yield "regmean", upd(consensus.regmean(a_best), grams=grams), a_best
    if wanted("layer-wise weights (per module)"):
        model_fn = functools.partial(_heldout_model, ev)
        lw = consensus.layerwise_weights(model_fn, groups="module", reference="mean")
        merged, lw_state = lw.update(stacked, lw.init(base), base)
        yield "layer-wise weights (per module)", merged, [round(float(x), 4) for x in lw_state.info.weights]
        del merged
    if wanted("mixture-NLL weights"):
        n = consensus.num_nodes(stacked)
        probs = np.stack([ev.target_probs(_node(stacked, i)) for i in range(n)])
        w = consensus.mixture_nll_weights(probs)
        weights = [round(float(x), 4) for x in w.weights]
        yield (
            "mixture-NLL weights",
            consensus.weighted_sum(stacked, jnp.asarray(w.weights, jnp.float32)),
            weights,
        )
    if wanted("median"):
        yield "median", upd(consensus.median()), None
    if wanted("trimmed mean"):
        yield "trimmed mean", upd(consensus.trimmed_mean(1)), None
    if robust:
        poisoned = jax.tree.map(lambda b, v: v.at[POISONED].set(b - 3.0 * (v[POISONED] - b)), base, stacked)
        for row, agg in (("mean", consensus.mean), ("median", consensus.median),
                         ("trimmed mean", lambda: consensus.trimmed_mean(1))):  # fmt: skip
            if wanted(row):
                yield f"{row}, 1 poisoned", upd(agg(), nodes=poisoned), None


def _heldout_model(ev: Evaluator, ref: Any) -> Any:
    """The held-out loss's gradient and diagonal empirical Fisher at ``ref`` (the quadratic model
    the layer-wise weights minimise), over the held-out windows one at a time."""
    return consensus.empirical_fisher(
        functools.partial(_example_loss, ev.task), ref, ev.heldout, chunk_size=2
    )


def barriers(ev: Evaluator, stacked: Any, mean: Any, tangent: bool, points: int = 5) -> dict[str, float]:
    """Held-out loss barriers: every pair of specialists, and each specialist to the mean."""
    # The tangent model's anchor travels with the data, as an argument: captured by the loss it
    # would be a constant of the compiled barrier (a second copy of the model, constant-folded).
    held: Any = (ev.heldout, ev.base) if tangent else (ev.heldout, None)

    def loss(p: Any, batch: Any) -> Any:
        rows, anchor = batch
        return ev.tangent.loss(p, rows, frozen=anchor) if tangent else ev.task.loss(p, rows)

    n = consensus.num_nodes(stacked)
    pairs, to_mean = [], []
    for i in range(n):
        a = _node(stacked, i)
        to_mean.append(float(loss_barrier(loss, a, mean, held, num_points=points).barrier))
        for j in range(i + 1, n):
            pairs.append(float(loss_barrier(loss, a, _node(stacked, j), held, num_points=points).barrier))
    return {"pairwise max": max(pairs), "pairwise mean": float(np.mean(pairs)),
            "to mean max": max(to_mean), "to mean mean": float(np.mean(to_mean))}  # fmt: skip


def _no_layers(params: Any, x: Any) -> dict[str, Any]:
    return {}  # the Grams come from linear_input_grams (one module-level function: one compile)


def _stats(task: Any, special: Any, data: TaskData, s: Mapping[str, Any]) -> tuple[Any, Any]:
    """Every node's diagonal Fisher and linear layers' input Grams on its first own windows."""
    fisher, grams = [], []
    for i in range(consensus.num_nodes(special)):
        rows = {k: jnp.asarray(v[i, : s["stat_rows"]]) for k, v in data.train.items() if k in ("x", "y")}
        node = _node(special, i)
        fisher.append(node_statistics(task.loss, node, rows, layer_inputs=_no_layers, chunk_size=1).fisher)
        grams.append(linear_input_grams(task.loss, node, rows, chunk_size=4))
    return consensus.stack(fisher), consensus.stack(grams)


def oneshot(task: Any, base: Any, data: TaskData, ev: Evaluator, s: Mapping[str, Any], seed: int,
            out: dict[str, Any]) -> None:  # fmt: skip
    """The one-shot regime with full fine-tuning: specialists, multitask, every merge, barriers,
    and the same with tangent-space fine-tuning."""
    rows, times = out["rows"], out["seconds"]
    n = len(task.domains)
    t0 = time.perf_counter()
    special, times["step s"] = fine_tune(task, base, data.own(), n, s["steps"], s["lr"], seed, s["batch"])
    times["fine-tune"] = time.perf_counter() - t0
    log(f"specialists trained ({times['fine-tune']:.0f} s)")
    for i, name in enumerate(task.domains):
        rows[f"specialist: {name}"] = ev.row(_node(special, i))
    t0 = time.perf_counter()
    multi, _ = fine_tune(task, base, union(data), 1, s["steps"], s["lr"], seed, s["batch"] * n, timed=False)
    times["multitask"] = time.perf_counter() - t0
    rows["multitask"] = ev.row(_node(multi, 0))
    del multi
    log("multitask trained")
    only = s.get("merges")
    stats, grams = None, None
    if only is None or {"fisher", "regmean"} & set(only):
        stats, grams = _stats(task, special, data, s)
        log("node statistics")
    for name, p, scale in merges(ev, base, special, stats, grams, tangent=False, robust=True, only=only):
        rows[name] = ev.row(p)
        if scale is not None:
            out["scales"][name] = scale
        log(f"merge: {name}")
    del stats, grams
    if s["barrier_points"]:
        mean = jax.tree.map(lambda v: jnp.mean(v, axis=0), special)
        out["barriers"]["linear"] = barriers(ev, special, mean, tangent=False, points=s["barrier_points"])
        del mean
        log("barriers")
    del special

    t0 = time.perf_counter()
    tangent_nodes, times["tangent step s"] = fine_tune(
        ev.tangent, base, data.own(), n, s["steps"], s["lr"], seed, s["batch"], frozen=base
    )
    times["tangent fine-tune"] = time.perf_counter() - t0
    log(f"tangent specialists trained ({times['tangent fine-tune']:.0f} s)")
    for i, name in enumerate(task.domains):
        rows[f"tangent specialist: {name}"] = ev.row(_node(tangent_nodes, i), tangent=True)
    for name, p, scale in merges(ev, base, tangent_nodes, None, None, tangent=True, robust=False):
        rows[f"tangent {name}"] = ev.row(p, tangent=True)
        if scale is not None:
            out["tangent_scales"][name] = scale
    if s["barrier_points"]:
        mean = jax.tree.map(lambda v: jnp.mean(v, axis=0), tangent_nodes)
        out["barriers"]["tangent"] = barriers(
            ev, tangent_nodes, mean, tangent=True, points=s["barrier_points"]
        )
        del mean
    del tangent_nodes
    log("tangent merges" + (" and barriers" if s["barrier_points"] else ""))


def lora(task: Any, base: Any, data: TaskData, ev: Evaluator, s: Mapping[str, Any], seed: int,
         out: dict[str, Any]) -> None:  # fmt: skip
    """The one-shot regime with LoRA specialists (every block projection, rank ``lora_rank``):
    each adapter on its own, and the adapter merges of :mod:`consensus.lora`, evaluated with the
    merged update added to the base (so every method is compared as one dense model)."""
    from consensus import lora as lora_lib

    rows, n = out["rows"], len(task.domains)
    rank = int(s["lora_rank"])
    settings = LoraSettings(rank=rank, alpha=2.0 * rank, targets=LORA_TARGETS)
    lt = LoraTask(task, settings, base, jax.random.key(0))
    k_a, k_init, k_merge = jax.random.split(jax.random.fold_in(jax.random.key(seed), 7), 3)
    frozen = lt.initial_frozen(base, k_a)
    t0 = time.perf_counter()
    adapters, out["seconds"]["lora step s"] = fine_tune(
        lt, lt.init(k_init), data.own(), n, s["steps"], s["lora_lr"], seed, s["batch"], frozen=frozen
    )
    out["seconds"]["lora fine-tune"] = time.perf_counter() - t0
    log("LoRA specialists trained")
    full = lt.full_adapter(adapters, frozen)
    for i, name in enumerate(task.domains):
        one = {p: {"a": v["a"][i], "b": v["b"][i]} for p, v in full.items()}
        rows[f"LoRA specialist: {name}"] = ev.row(merge_adapter(base, one, lt.scale))
    for row, method, options in LORA_MERGES:
        m = lora_lib.merge_adapters(method, full, scale=lt.scale, key=k_merge, **options)
        rows[f"LoRA {row}"] = ev.row(add_base_delta(base, {p: m.delta(p) for p in m.adapter}))
        log(f"LoRA merge: {row}")


def hierarchical_fit(task: Any, params: Any, data: TaskData, n: int, steps: int, lr: float, seed: int,
                     batch: int) -> tuple[Any, list[int]]:  # fmt: skip
    """n copies of ``params`` trained through the hierarchical strategy's levels (its default
    options: half the steps on the public pool, a quarter on the public windows of the node's own
    domain, a quarter at half the rate on its own shard), one Adam state across the levels: (stacked
    params, steps per level)."""
    from strategies.hierarchical import Level, fit_hierarchical
    from strategies.node import build_strategy

    st = build_strategy("hierarchical", {}).settings(steps, lr)
    levels = [Level(d, k, r) for d, k, r in zip(("general", "groups", "own"), st.level_steps, st.level_lr,
                                                   strict=True)]  # fmt: skip
    trainer = trainer_for(task, lr, batch)
    state, _, _ = fit_hierarchical(trainer, trainer.init(jax.random.key(seed), params, n), data, levels)
    return state.params, list(st.level_steps)


def hierarchical(task: Any, base: Any, data: TaskData, ev: Evaluator, s: Mapping[str, Any], seed: int,
                 out: dict[str, Any]) -> None:  # fmt: skip
    """Hierarchical nodes in the one-shot regime: general -> the node's domain -> its own shard
    (the public pool of every domain, the public windows of its own domain, its documents), the
    same steps as the full fine-tunes; merged by the mean and tuned task arithmetic. They read the
    public pool besides their own data; the plain specialists do not."""
    rows, n = out["rows"], len(task.domains)
    nodes, out["scales"]["hierarchical steps per level"] = hierarchical_fit(
        task, base, data, n, int(s["steps"]), s["lr"], seed, s["batch"]
    )
    log("hierarchical specialists trained")
    for i, name in enumerate(task.domains):
        rows[f"hierarchical specialist: {name}"] = ev.row(_node(nodes, i))
    for name, p, scale in merges(ev, base, nodes, None, None, tangent=False, robust=False, short=True):
        rows[f"hierarchical {name}"] = ev.row(p)
        if scale is not None:
            out["scales"][f"hierarchical {name}"] = scale
    log("hierarchical merges")


def soup(task: Any, base: Any, data: TaskData, ev: Evaluator, s: Mapping[str, Any], seed: int,
         out: dict[str, Any]) -> None:  # fmt: skip
    """Soup nodes in the one-shot regime: each node keeps snapshots of its fine-tune and submits
    the greedy soup of them (:func:`strategies.soup.greedy_soup`, from the latest, a snapshot kept
    only if the held-out loss on the node's own domain does not rise); the soups merged by the
    mean and by tuned task arithmetic."""
    from strategies.soup import greedy_soup

    rows, n = out["rows"], len(task.domains)
    trainer = trainer_for(task, s["lr"], s["batch"])
    state = trainer.init(jax.random.key(seed), base, n)
    snaps, done = [], 0
    for k in range(1, SNAPSHOTS + 1):
        upto = round(k * int(s["steps"]) / SNAPSHOTS)
        state, _ = trainer.fit(state, data.own(), upto - done)
        done = upto
        snaps.append(jax.tree.map(jnp.copy, state.params))  # the state is donated to the next fit
    del state
    log("soup snapshots trained")
    soups, kept = [], []
    for i, name in enumerate(task.domains):

        def own_loss(p: Any, name: str = name) -> float:
            return float(np.log(ev.metrics(p, ev.heldout)[f"perplexity/{name}"]))

        st = greedy_soup(
            [_node(sn, i) for sn in snaps], own_loss, higher_is_better=False, first=SNAPSHOTS - 1
        )
        soups.append(st.params)
        kept.append(int(st.count))
        rows[f"soup specialist: {name}"] = ev.row(st.params)
    out["scales"]["soup snapshots kept"] = kept
    stacked = consensus.stack(soups)
    del soups, snaps
    for name, p, scale in merges(ev, base, stacked, None, None, tangent=False, robust=False, short=True):
        rows[f"soup {name}"] = ev.row(p)
        if scale is not None:
            out["scales"][f"soup {name}"] = scale
    log("soups merged")


# The federated regime's merges: (row, aggregator, how the nodes train: "plain", "tangent" or
# "proximal" (the convexity strategy with its default options, pulled to the round's consensus) or
# "hierarchical" (the strategy's levels inside each round's local steps)).
FEDERATED: tuple[tuple[str, Callable[[], Any], str], ...] = (
    ("mean (FedAvg)", consensus.mean, "plain"),
    ("ties", lambda: consensus.ties(0.2, scale=1.0), "plain"),
    ("median", consensus.median, "plain"),
    ("trimmed mean", lambda: consensus.trimmed_mean(1), "plain"),
    ("tangent mean", consensus.mean, "tangent"),
    ("proximal (convexity) mean", consensus.mean, "proximal"),
    ("hierarchical mean", consensus.mean, "hierarchical"),
)


def federated(task: Any, base: Any, data: TaskData, ev: Evaluator, s: Mapping[str, Any], seed: int,
              out: dict[str, Any]) -> None:  # fmt: skip
    """The federated regime: ``rounds`` rounds of ``steps / rounds`` local steps from the round's
    consensus (a fresh Adam each round), merged each round; the same total steps as one-shot.
    Tangent nodes linearise at the round's consensus (the anchor moves), and the final consensus
    is evaluated linearised at the last round's anchor."""
    rows, n = out["rows"], len(task.domains)
    rounds = int(s["rounds"])
    local = max(1, int(s["steps"]) // rounds)
    from strategies.node import build_strategy
    from strategies.trainer import Proximal

    convexity = build_strategy("convexity", {})
    only = s.get("federated_rows")
    for row, make, mode in FEDERATED:
        if only and row not in only:
            continue
        params, anchor = base, base
        for r in range(rounds):
            anchor = params
            key = seed + 1000 * r
            if mode == "tangent":
                nodes, _ = fine_tune(ev.tangent, params, data.own(), n, local, s["lr"], key, s["batch"],
                                     timed=False, frozen=anchor)  # fmt: skip
            elif mode == "hierarchical":
                nodes, _ = hierarchical_fit(task, params, data, n, local, s["lr"], key, s["batch"])
            elif mode == "proximal":
                prox = Proximal(
                    anchor, np.full(n, convexity.mu, np.float32), np.full(n, convexity.radius, np.float32)
                )
                nodes, _ = fine_tune(task, params, data.own(), n, local, s["lr"], key, s["batch"],
                                     timed=False, proximal=prox)  # fmt: skip
            else:
                nodes, _ = fine_tune(
                    task, params, data.own(), n, local, s["lr"], key, s["batch"], timed=False
                )
            agg = make()
            params = agg.update(nodes, agg.init(params), params)[0]
            del nodes
        rows[f"federated {row}"] = ev.row(params, tangent=mode == "tangent", anchor=anchor)
        log(f"federated: {row}")


def one_seed(model: str, seed: int, s: Mapping[str, Any], folder: Path, sections: Sequence[str] = SECTIONS,
             done: Callable[[dict[str, Any]], None] | None = None) -> dict[str, Any]:  # fmt: skip
    """Every row of one seed's ``sections`` (the node split and the training keys from ``seed``)."""
    text = domains(folder)
    task: Any = build_task("causal_lm", {
        "model": model, "text": text, "context": s["context"], "windows_per_node": s["windows_per_node"],
        "general_windows": s.get("general_windows", 8), "heldout_windows": s["heldout_windows"],
        "test_windows": s["test_windows"], "split_seed": seed,
    })  # fmt: skip
    data = task.splits(len(text), seed=seed)
    base = task.init(jax.random.key(0))
    ev = Evaluator(task, base, data)
    out: dict[str, Any] = {
        "domains": list(task.domains), "sections": list(sections), "rows": {"base": ev.row(base)},
        "scales": {}, "tangent_scales": {}, "barriers": {}, "seconds": {},
    }  # fmt: skip
    log(f"seed {seed}: base evaluated")
    for name in sections:
        parts = {"oneshot": oneshot, "hierarchical": hierarchical, "soup": soup, "lora": lora,
                 "federated": federated}  # fmt: skip
        parts[name](task, base, data, ev, s, seed, out)
        out["sections_done"] = [*out.get("sections_done", []), name]
        if done is not None:  # a long run keeps what it measured if it dies later
            done(out)
    return out


def summarize(runs: Sequence[Mapping[str, Any]]) -> dict[str, dict[str, list[float]]]:
    """Per row and domain: [mean, std] over seeds of the test perplexity."""
    out: dict[str, dict[str, list[float]]] = {}
    for row in runs[0]["rows"]:
        out[row] = {}
        for d in runs[0]["rows"][row]:
            v = [r["rows"][row][d] for r in runs]
            out[row][d] = [float(np.mean(v)), float(np.std(v))]
    return out


GROUPS = (
    ("One-shot, full fine-tuning", ""),
    ("One-shot, tangent-space fine-tuning (linearised at the base)", "tangent "),
    (
        "One-shot, hierarchical nodes (the public pool, then its windows of the node's domain, then own)",
        "hierarchical ",
    ),
    ("One-shot, soup nodes (each a greedy soup of its snapshots)", "soup "),
    ("One-shot, LoRA fine-tuning (merged updates added to the base)", "LoRA "),
    ("Federated: rounds of local steps from the round's consensus, the same total steps", "federated "),
)
REFERENCE_ROWS = ("base", "multitask")


def group_of(row: str) -> str:
    """The page section of a row (by its prefix; reference rows are shown in every section)."""
    for _, prefix in GROUPS[1:]:
        if row.startswith(prefix):
            return prefix
    return ""


def is_merge(row: str) -> bool:
    """A clean merge row (not a specialist, a reference or a poisoned run)."""
    return not ("specialist" in row or row in REFERENCE_ROWS or "poisoned" in row)


# What a one-shot merge of full fine-tunes needs besides the nodes' weights, for the recommendation:
# nothing more; held-out rows at the coordinator (tuned scales, fitted weights); or the nodes' own data
# statistics (Fisher diagonals, input Grams), which are not private.
NEEDS = {
    "the weights alone": ("mean", "median", "trimmed mean", "model stock"),
    "held-out rows at the coordinator": ("task arithmetic", "ties", "dare+ties", "mixture-NLL weights",
                                         "layer-wise weights (per module)"),
    "the nodes' data statistics (not private)": ("fisher", "regmean"),
}  # fmt: skip


def recommendation(summary: Mapping[str, Mapping[str, list[float]]]) -> list[str]:
    """The merge to use for one-shot full fine-tunes, by what the coordinator may have, from the rows."""
    best = {}
    for need, rows in NEEDS.items():
        have = [r for r in rows if r in summary]
        if have:
            best[need] = min(have, key=lambda r: summary[r]["all"][0])
    if not best:
        return []
    parts = [f"with {need}: **{r}** ({summary[r]['all'][0]:.2f})" for need, r in best.items()]
    head = "- Recommendation for one-shot merges of full fine-tunes, by what the coordinator has: "
    line = head + "; ".join(parts)
    robust = [r for r in ("median, 1 poisoned", "trimmed mean, 1 poisoned") if r in summary]
    if robust and "mean, 1 poisoned" in summary:
        r = min(robust, key=lambda r: summary[r]["all"][0])
        line += (
            f". Where a node may be Byzantine, the {r.split(',')[0]} ({summary[r]['all'][0]:.2f} with one "
            f"poisoned node, against the mean's {summary['mean, 1 poisoned']['all'][0]:.2f})"
        )
    return [line + "."]


def findings(summary: Mapping[str, Mapping[str, list[float]]], doms: Sequence[str]) -> list[str]:
    """Per section: the best clean merge, its gap to the best single merge of the others, and its
    distance from the multitask model per domain; the tangent claim; the robust rows."""
    out = []
    multi = summary.get("multitask")
    for title, prefix in GROUPS:
        rows = [r for r in summary if group_of(r) == prefix and is_merge(r)]
        if not rows:
            continue
        ranked = sorted(rows, key=lambda r: summary[r]["all"][0])
        best = ranked[0]
        line = f"- **{title}**: best merge **{best}** ({summary[best]['all'][0]:.2f}"
        if len(ranked) > 1:
            line += f"; next {ranked[1]} {summary[ranked[1]]['all'][0]:.2f}"
        mean_row = f"{prefix}mean" if prefix != "federated " else "federated mean (FedAvg)"
        if mean_row in summary and mean_row not in ranked[:2]:
            line += f"; the plain mean {summary[mean_row]['all'][0]:.2f}"
        line += ")"
        if multi is not None:
            line += "; minus the multitask model per domain: " + ", ".join(
                f"{d} {summary[best][d][0] - multi[d][0]:+.2f}" for d in doms
            )
        out.append(line + ".")
    if {"mean", "task arithmetic", "tangent mean", "tangent task arithmetic"} <= set(summary):
        gain = summary["mean"]["all"][0] - summary["task arithmetic"]["all"][0]
        t_gain = summary["tangent mean"]["all"][0] - summary["tangent task arithmetic"]["all"][0]
        holds = "holds" if t_gain > gain else "does not hold"
        out.append(
            f"- Tangent space: task arithmetic lowers the mean's perplexity by {gain:.2f} for full "
            f"fine-tunes and by {t_gain:.2f} for tangent fine-tunes (Ortiz-Jimenez et al.'s claim that "
            f"task arithmetic gains most in the tangent space {holds} here); tangent task arithmetic "
            f"{summary['tangent task arithmetic']['all'][0]:.2f} against full task arithmetic "
            f"{summary['task arithmetic']['all'][0]:.2f}."
        )
    if {"mean, 1 poisoned", "median, 1 poisoned", "trimmed mean, 1 poisoned"} <= set(summary):
        out.append(
            "- One node poisoned (its task vector sign-flipped and tripled): the mean "
            f"{summary['mean, 1 poisoned']['all'][0]:.2f}, "
            f"the median {summary['median, 1 poisoned']['all'][0]:.2f}, "
            f"the trimmed mean {summary['trimmed mean, 1 poisoned']['all'][0]:.2f} (clean: "
            f"{summary['mean']['all'][0]:.2f}, {summary['median']['all'][0]:.2f}, "
            f"{summary['trimmed mean']['all'][0]:.2f})."
        )
    return out + strategies_against_local(summary, doms) + recommendation(summary)


# The node strategies' rows, each against local fine-tuning from the same start (same data, steps
# and rate): (strategy, its one-shot prefix, its federated row).
STRATEGY_ROWS = (
    ("convexity (tangent)", "tangent ", "federated tangent mean"),
    ("convexity (proximal)", None, "federated proximal (convexity) mean"),
    ("hierarchical", "hierarchical ", "federated hierarchical mean"),
    ("soup", "soup ", None),
)


def strategies_against_local(
    summary: Mapping[str, Mapping[str, list[float]]], doms: Sequence[str]
) -> list[str]:
    """Each node strategy against local fine-tuning: one-shot, its specialists on their own domain
    and its nodes' mean; federated, its FedAvg after the same rounds (perplexity differences, lower
    is better)."""

    def own(prefix: str) -> float | None:
        rows = [f"{prefix}specialist: {d}" for d in doms]
        return (
            float(np.mean([summary[r][d][0] for r, d in zip(rows, doms, strict=True)]))
            if all(r in summary for r in rows)
            else None
        )

    local_own = own("")
    parts = []
    for name, prefix, fed in STRATEGY_ROWS:
        bits = []
        if prefix is not None and f"{prefix}mean" in summary and "mean" in summary:
            d = summary[f"{prefix}mean"]["all"][0] - summary["mean"]["all"][0]
            bits.append(f"one-shot mean {d:+.2f}")
            mine = own(prefix)
            if mine is not None and local_own is not None:
                bits.append(f"own-domain specialists {mine - local_own:+.2f}")
        if fed is not None and fed in summary and "federated mean (FedAvg)" in summary:
            d = summary[fed]["all"][0] - summary["federated mean (FedAvg)"]["all"][0]
            bits.append(f"federated {d:+.2f}")
        if bits:
            parts.append(f"{name} " + ", ".join(bits))
    if not parts:
        return []
    return [
        "- Node strategies against local fine-tuning from the same start (perplexity minus local's, "
        "negative is better; the merges over all domains, the specialists each on its own domain): "
        + "; ".join(parts)
        + "."
    ]


def markdown(res: Mapping[str, Any]) -> str:
    """The results page, rendered from the results JSON."""
    settings = res["settings"]
    lines = header(
        "Merging fine-tunes of a pretrained LM across text domains", NAME, settings["quick"], settings
    )
    runs = res["runs"]
    doms = list(runs[0]["domains"])
    cols = [*doms, "all"]
    summary = summarize(runs)
    lines.append(
        f"{len(runs)} seed(s); test perplexity per domain (mean ± std over seeds; lower is better). "
        "One node per domain fine-tunes the same pretrained base; specialists are evaluated on every "
        "domain; merges use the base as their reference; the multitask model trains on the union of "
        "the nodes' windows (the upper bound). Sources: the standard library's packages (code "
        "domains) and `pydoc_data.topics` (prose)."
    )
    lines.append("")
    lines.append("## Findings")
    lines.append("")
    lines.extend(findings(summary, doms))
    lines.append("")
    for title, prefix in GROUPS:
        rows = [r for r in summary if group_of(r) == prefix]
        if not rows:
            continue
        lines.append(f"## {title}")
        lines.append("")
        shown = [*(r for r in REFERENCE_ROWS if r in summary and prefix), *rows]
        table = [[r, *[f"{summary[r][d][0]:.2f} ± {summary[r][d][1]:.2f}" for d in cols]] for r in shown]
        lines.append(markdown_table(["row", *cols], table))
        lines.append("")
    scales = {
        **runs[0].get("scales", {}),
        **{f"tangent {k}": v for k, v in runs[0].get("tangent_scales", {}).items()},
    }
    if scales:
        lines.append(
            "Tuned on the held-out windows (first seed): "
            + "; ".join(f"{k} {v}" for k, v in scales.items())
            + ". Task arithmetic's, TIES's and DARE+TIES's scale is the sum's multiplier (1/4 is the "
            "mean's); RegMean's is the off-diagonal scale a; the weights are the nodes' (mixture NLL) "
            "or their mean over modules (layer-wise)."
        )
        lines.append("")
    if any(r.get("barriers") for r in runs):
        kinds = list(runs[0]["barriers"])
        keys = list(runs[0]["barriers"][kinds[0]])
        bars = [
            [kind, *[f"{np.mean([r['barriers'][kind][k] for r in runs]):.4f}" for k in keys]]
            for kind in kinds
        ]
        lines.append("Held-out loss barriers (nats; max over the path of the loss minus the chord):")
        lines.append("")
        lines.append(markdown_table(["fine-tuning", *keys], bars))
        lines.append("")
    costs = []
    for key, what in (("tangent step s", "a tangent-space step"), ("lora step s", "a LoRA step")):
        ratio = [
            r["seconds"][key] / r["seconds"]["step s"]
            for r in runs
            if key in r["seconds"] and "step s" in r["seconds"]
        ]
        if ratio:
            costs.append(f"{what} costs {np.mean(ratio):.2f}x a full fine-tuning step")
    if costs:
        lines.append(
            "Cost: " + "; ".join(costs) + f" (the {len(runs)} seed(s)' mean; one step of every node, best of "
            "two after compiling, same run and shapes). " + load_line(res)
        )
        lines.append("")
    lines.append(f"Total time {res['total_s']:.0f} s.")
    return "\n".join(lines) + "\n"


def _size(settings: Mapping[str, Any]) -> str:
    """A part's size (results written before sizes had names: --quick was today's "cpu")."""
    return str(settings.get("size", "cpu" if settings.get("quick") else "full"))


def _reads_public_pool(settings: Mapping[str, Any]) -> bool:
    """Whether a part ran a row that reads the public pool (the hierarchical nodes)."""
    fed = "federated" in settings["sections"] and "hierarchical mean" in (
        settings.get("federated_rows") or [r for r, _, _ in FEDERATED]
    )
    return "hierarchical" in settings["sections"] or fed


def combine_parts(parts: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """One result from parts that ran other sections of the same seeds (their rows united).

    The parts must agree on every setting that changes a measurement; ``general_windows`` only
    among the parts that read the public pool (no other row depends on it).
    """

    def measured(p: Mapping[str, Any]) -> dict[str, Any]:
        out = {k: v for k, v in p["settings"].items() if k not in (*PART_KEYS, "general_windows")}
        return {**out, "size": _size(p["settings"])}

    first = parts[0]
    seeds = first["settings"]["seeds"]
    for p in parts[1:]:
        if measured(p) != measured(first):
            raise ValueError(f"the parts' settings differ: {measured(p)} vs {measured(first)}")
    # (results written before the hierarchical rows had no general_windows, and no row that read it)
    pools = {p["settings"].get("general_windows") for p in parts if _reads_public_pool(p["settings"])} - {
        None
    }
    if len(pools) > 1:
        raise ValueError(f"the hierarchical parts' general_windows differ: {sorted(pools)}")
    runs = []
    for i in range(len(seeds)):
        run: dict[str, Any] = {"domains": first["runs"][i]["domains"], "sections": []}
        for key in ("rows", "scales", "tangent_scales", "barriers", "seconds"):
            run[key] = {}
            for p in parts:
                run[key].update(p["runs"][i].get(key, {}))
        for p in parts:
            run["sections"] += [x for x in p["runs"][i]["sections"] if x not in run["sections"]]
        runs.append(run)
    size = _size(first["settings"])
    settings = {k: v for k, v in first["settings"].items() if k != "federated_rows"}
    sections = [x for r in runs[:1] for x in r["sections"]]
    settings |= {"size": size, "quick": size == "quick", "sections": sections}
    if pools:
        settings["general_windows"] = pools.pop()
    return {"runs": runs, "total_s": sum(p["total_s"] for p in parts), "settings": settings,
            "load_average": first.get("load_average")}  # fmt: skip


def size_arguments(size: str, seeds: Sequence[int]) -> list[str]:
    """The arguments that run ``size`` with ``seeds`` (what a combined page records as its command)."""
    args = {"quick": [], "cpu": ["--cpu"], "full": []}[size]
    default = [0, 1, 2] if size == "full" else [0]
    return args if list(seeds) == default else [*args, "--seeds", ",".join(map(str, seeds))]


def sections_apart(args: Any, size: str, seeds: Sequence[int], sections: Sequence[str]) -> dict[str, Any]:
    """Every section in a process of its own, their results combined.

    One process holding every section's compiled programs and models outgrows a 23 GB machine
    (SmolLM2's one-shot section alone peaks near 21 GB); a process per section returns its memory.
    The parts are written to a new folder beside the results, removed once combined and kept (and
    named) when a section fails, for ``--combine``; so is the sections' shared compilation cache.
    """
    import subprocess

    folder = Path(tempfile.mkdtemp(prefix=f"{NAME}_parts_", dir=results_folder(args.out)))
    stem = f"{NAME}_quick" if size == "quick" else NAME
    # The sections share programs (the training step, the evaluation): compiled once, on disk, they
    # are read back by the next section's process instead of compiled again (20-40 s each on 2 cores).
    env = dict(os.environ)
    env.setdefault("JAX_COMPILATION_CACHE_DIR", str(folder / "compiled"))
    # Every program: most are small ones of eager tree operations, one per leaf shape, which add up.
    env.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
    parts = []
    for sec in sections:
        size_flag = {"quick": ["--quick"], "cpu": ["--cpu"], "full": []}[size]
        cmd = [sys.executable, "-m", "benchmarks", NAME, *size_flag, "--seeds", ",".join(map(str, seeds)),
               "--model", args.model, "--sections", sec, "--out", str(folder / sec)]  # fmt: skip
        if args.federated_rows:
            cmd += ["--federated-rows", args.federated_rows]
        log(f"section {sec}: in a process of its own")
        root = Path(__file__).resolve().parents[2]
        done = subprocess.run(cmd, cwd=root, env=env, stdout=subprocess.DEVNULL, check=False)
        if done.returncode != 0:
            raise SystemExit(
                f"domains: section {sec!r} failed (exit {done.returncode}); the finished sections are in "
                f"{folder} (python -m benchmarks domains --combine FILES)"
            )
        parts.append(json.loads((folder / sec / f"{stem}.json").read_text()))
    res = combine_parts(parts)
    shutil.rmtree(folder)
    return res


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = parser(__doc__, "the headline rows in under 10 minutes on 2 CPU cores: a handful of steps, one seed")
    p.add_argument(
        "--cpu", action="store_true",
        help="the published page's sizes (context 48, 12 steps; about an hour on 2 CPU cores), one seed",
    )  # fmt: skip
    p.add_argument("--seeds", default=None, help="comma-separated seeds (default 0,1,2; --quick, --cpu: 0)")
    p.add_argument("--model", default="smollm2", help="a Hugging Face folder or a cached model name")
    p.add_argument(
        "--sections", default=None,
        help=f"comma-separated parts, of {list(SECTIONS)} (default all; --quick: {list(QUICK['sections'])})",
    )  # fmt: skip
    p.add_argument(
        "--combine", nargs="+", type=Path, default=None, metavar="JSON",
        help="train nothing: report these result files together (other sections of the same seeds)",
    )  # fmt: skip
    p.add_argument(
        "--federated-rows", default=None,
        help=f"';'-separated rows of the federated regime (default all: {[r for r, _, _ in FEDERATED]})",
    )  # fmt: skip
    args = parse(p, argv)
    if args.quick and args.cpu:
        p.error("--quick and --cpu are two sizes: give one")
    if args.combine:
        try:
            parts = [json.loads(f.read_text()) for f in args.combine]
            res = combine_parts(parts)
        except (OSError, ValueError, KeyError) as e:
            p.error(f"--combine: {e}")
        # The page records the command that measures all of it, not the files it was combined from.
        record_arguments(size_arguments(res["settings"]["size"], res["settings"]["seeds"]))
        md = markdown(res)
        save(NAME, res["settings"]["quick"], {"runs": res["runs"], "total_s": res["total_s"]}, md,
             settings=res["settings"], out=args.out)  # fmt: skip
        print(md)
        return res
    size = "quick" if args.quick else "cpu" if args.cpu else "full"
    given = args.sections or ",".join(QUICK["sections"] if size == "quick" else SECTIONS)
    sections = [x.strip() for x in given.split(",") if x.strip()]
    unknown = [x for x in sections if x not in SECTIONS]
    if unknown or not sections:
        p.error(f"--sections: unknown {unknown}; valid: {list(SECTIONS)}")
    seeds = [0, 1, 2] if size == "full" else [0]
    if args.seeds is not None:
        seeds = [int(x) for x in args.seeds.split(",")]
    s = settings_for(size)
    if args.federated_rows:
        s["federated_rows"] = [x.strip() for x in args.federated_rows.split(";") if x.strip()]
        unknown = [x for x in s["federated_rows"] if x not in {r for r, _, _ in FEDERATED}]
        if unknown:
            p.error(f"--federated-rows: unknown {unknown}; valid: {[r for r, _, _ in FEDERATED]}")
    t0 = time.perf_counter()
    if len(sections) > 1:
        res = sections_apart(args, size, seeds, sections)
        res["total_s"] = time.perf_counter() - t0
        md = markdown(res)
        save(NAME, args.quick, {"runs": res["runs"], "total_s": res["total_s"]}, md,
             settings=res["settings"], out=args.out)  # fmt: skip
        print(md)
        return res
    runs: list[dict[str, Any]] = []
    partial = results_folder(args.out) / f"{NAME}{'_quick' if args.quick else ''}.partial.json"

    def keep(run: dict[str, Any]) -> None:
        tmp_path = partial.with_suffix(".tmp")
        tmp_path.write_text(
            json.dumps({"settings": {"seeds": seeds, **s}, "runs": [*runs, run]}, default=float)
        )
        tmp_path.replace(partial)

    with tempfile.TemporaryDirectory(prefix="meta-consensus-domains-") as tmp:
        for seed in seeds:
            runs.append(one_seed(args.model, seed, s, Path(tmp), sections, keep))
    settings = {"quick": args.quick, "size": size, "model": args.model, "seeds": seeds, "sections": sections}
    settings |= s
    res = {"runs": runs, "total_s": time.perf_counter() - t0}
    from benchmarks.harness import load_average

    md = markdown({**res, "settings": settings, "load_average": load_average()})
    save(NAME, args.quick, res, md, settings=settings, out=args.out)
    partial.unlink(missing_ok=True)
    print(md)
    return res
