"""LoRA consensus on a byte-level language model: adapter merge methods, attacks, DP-SGD, bytes and memory.

Run ``python -m benchmarks lora [--quick]``. Writes benchmarks/results/lora.json and lora.md
(``lora_quick.*`` with --quick).

Setting. The byte-level transformer of :mod:`strategies.tasks.text` (context 32, 2 layers,
d_model 64: about 0.13 M parameters; a few-million-parameter model does not fit the CPU
budget of this benchmark) over eight *kinds* of standard-library source, one per node (mail
handling, web protocols, XML, asyncio, multiprocessing, import machinery, codec tables, GUI
code): node i trains on files of kind i only (non-IID). The base is pretrained briefly on the
shared general pool (20% of the files of every kind, no node's own files), then:

* ``local``: every node fine-tunes LoRA adapters alone for the same number of steps; the
  reported perplexity is the mean over the nodes of their own model's;
* ``full_fedavg``: full fine-tuning, the uniform mean of the nodes' models every round;
* ``fedit``, ``stack``, ``svd``, ``exact_residual``: LoRA (rank 4, alpha 8, attention
  query/key/value and MLP kernels), one of :mod:`consensus.lora`'s methods every round;
  ``ffa``: FFA-LoRA (``a`` shared and frozen, nodes train ``b``);
* attacks: nodes 6 and 7 send ALIE (z = 10) on their adapter tree; FedIT's plain mean against
  robust rules in the space of the products and of the factors;
* example-level DP-SGD at epsilon 8 (delta 1e-5, RDP, clip 1 on the adapter gradients): FFA-LoRA
  against FedIT.

Every run's metric is the perplexity of the final consensus on the shared test windows (every
kind, files no node trained on). ``deviation`` is the measured distance of each round's merged
update from the exact mean of the nodes' updates, relative to the round's update (0: exact).
Bytes per round are per node, up (what a node sends) and down (what it receives: the adapter
and any base delta); memory per node counts the arrays a node holds while training (the
frozen base, and params + gradient + Adam's two moments of what it trains).
"""

from __future__ import annotations

import dataclasses
import functools
import math
import time
from collections.abc import Sequence
from typing import Any, cast

import jax
import jax.numpy as jnp
import numpy as np
import optax

from benchmarks.harness import markdown_table, mean_std, parse, parser, pm, save
from consensus import registry
from strategies import byzantine as byz_lib
from strategies.lora import LoraSettings, LoraTask, merge_round, tree_bytes
from strategies.tasks.base import NodeData
from strategies.tasks.text import TextTask
from strategies.trainer import NodeTrainer

NAME = "lora"

#: Eight kinds of text, one per node.
KINDS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("mail", ("email",)),
    ("web", ("http", "urllib", "html", "xmlrpc", "wsgiref", "json")),
    ("xml", ("xml",)),
    ("asyncio", ("asyncio",)),
    ("processes", ("multiprocessing", "concurrent")),
    ("imports", ("importlib", "unittest")),
    ("codecs", ("encodings",)),
    ("gui", ("tkinter", "turtledemo", "idlelib")),
)

METHODS = ("fedit", "stack", "svd", "exact_residual", "ffa")


@dataclasses.dataclass(frozen=True)
class Settings:
    """The sizes of a run (full or --quick)."""

    seeds: int = 3
    nodes: int = 8
    rounds: int = 6
    local_steps: int = 12
    batch_size: int = 16
    pretrain_steps: int = 300
    lora_lr: float = 1e-2
    full_lr: float = 1e-3
    rank: int = 4
    alpha: float = 8.0
    context: int = 32
    windows_per_node: int = 256
    general_windows: int = 2048
    test_windows: int = 256
    byzantine: tuple[int, ...] = (6, 7)
    alie_z: float = 10.0
    epsilon: float = 8.0
    delta: float = 1e-5
    clip_norm: float = 1.0
    # (name, adapter method, robust rule, space); the rule's f is len(byzantine)
    robust: tuple[tuple[str, str, str, str], ...] = (
        ("multi_krum on products", "fedit", "multi_krum", "products"),
        ("multi_krum on factors", "fedit", "multi_krum", "factors"),
        ("median on products", "exact_residual", "median", "products"),
    )


QUICK = Settings(
    seeds=1,
    rounds=2,
    local_steps=3,
    batch_size=8,
    pretrain_steps=20,
    windows_per_node=64,
    general_windows=256,
    test_windows=64,
    robust=(("multi_krum on products", "fedit", "multi_krum", "products"),),
)


@functools.lru_cache(maxsize=4)
def make_task(s: Settings) -> TextTask:
    """The text task of the benchmark: one kind of text per node (one object per settings, so
    every seed shares the compiled steps)."""
    return TextTask(
        context=s.context,
        windows_per_node=s.windows_per_node,
        general_windows=s.general_windows,
        heldout_windows=64,
        test_windows=s.test_windows,
        families=KINDS[: s.nodes] if s.nodes <= len(KINDS) else KINDS,
    )


@functools.lru_cache(maxsize=8)
def _trainer(task: Any, lr: float, batch: int) -> NodeTrainer:
    return NodeTrainer(task, optax.adam, {"learning_rate": lr}, batch_size=batch)


@functools.lru_cache(maxsize=8)
def _metrics(task: Any):
    return jax.jit(task.metrics)


def _broadcast(tree: Any, n: int) -> Any:
    return jax.tree.map(lambda x: jnp.broadcast_to(x, (n, *x.shape)), tree)


def perplexity(task: Any, params: Any, batch: Any, frozen: Any = None) -> float:
    """Test perplexity of one model (a LoRA task's adapter on ``frozen``, or full params)."""
    if frozen is None:
        return float(_metrics(task)(params, batch)["perplexity"])
    return float(_metrics(task)(params, batch, frozen=frozen)["perplexity"])


@dataclasses.dataclass
class Setup:
    """One seed's data, base model and LoRA tasks."""

    s: Settings
    seed: int
    task: TextTask
    data: Any
    base: Any
    lora: LoraTask
    ffa: LoraTask


def pretrain(task: TextTask, data: Any, key: jax.Array, s: Settings) -> Any:
    """The shared base: a fresh model trained on the general pool only (one node)."""
    g = data.everything()
    one = NodeData(g.pool, g.index[:1], g.count[:1], True, "general")
    trainer = _trainer(task, 3e-3, 32)
    k_init, k_train = jax.random.split(key)
    state = trainer.init(k_train, task.init(k_init), 1)
    state, _ = trainer.fit(state, one, s.pretrain_steps)
    return jax.tree.map(lambda x: x[0], state.params)


_LORA: dict[tuple[Any, ...], LoraTask] = {}


def lora_tasks(task: TextTask, base: Any, s: Settings) -> tuple[LoraTask, LoraTask]:
    """The LoRA task (full adapters) and the FFA-LoRA task, one object each for every seed.

    The seed's base is passed to every call as ``frozen``, so the compiled steps are shared.
    """
    out = []
    for freeze_a in (False, True):
        k = (id(task), freeze_a)
        if k not in _LORA:
            settings = LoraSettings(rank=s.rank, alpha=s.alpha, freeze_a=freeze_a)
            # (cast: TextTask's name is a read-only property where the Task protocol has a field.)
            _LORA[k] = LoraTask(cast(Any, task), settings, base, jax.random.key(0))
        out.append(_LORA[k])
    return out[0], out[1]


def example_dp(s: Settings, counts: np.ndarray) -> tuple[Any, Any]:
    """Example-level DP-SGD of the nodes at the target epsilon: the trainer's spec and its accountant.

    The system's own accountant (:class:`meta_consensus.example_level_dp.ExampleAccountant`),
    calibrated over every node's planned steps, as a run with ``dp.level = "example"`` does.
    """
    from meta_consensus.config import Config, DPConfig, NodesConfig
    from meta_consensus.example_level_dp import ExampleAccountant

    cfg = Config(
        rounds=s.rounds,
        nodes=NodesConfig(count=s.nodes, batch_size=s.batch_size, local_steps=s.local_steps),
        dp=DPConfig(enabled=True, level="example", epsilon=s.epsilon, delta=s.delta, clip_norm=s.clip_norm),
        vote=dataclasses.replace(Config().vote, rule="mean"),
        baseline_fedavg=False,
    )
    acc = ExampleAccountant(cfg, counts, [s.local_steps] * s.nodes, fleets=1)
    return acc.spec(), acc


def run_lora(
    setup: Setup,
    method: str,
    *,
    ffa: bool = False,
    rule: str | None = None,
    space: str = "products",
    attack: bool = False,
    dp: bool = False,
    merge: bool = True,
    rows: Sequence[int] | None = None,
) -> dict[str, Any]:
    """One LoRA run of ``rounds`` rounds; its test perplexity, bytes and merge diagnostics.

    ``rows``: merge only these nodes' adapters (the honest nodes: the reference a robust rule
    that drops exactly the attackers would reach); None: every node's.
    """
    s = setup.s
    lt = setup.ffa if ffa else setup.lora
    key = jax.random.fold_in(jax.random.key(setup.seed), 1)
    k_a, k_init, k_nodes, k_rounds = jax.random.split(key, 4)
    frozen = lt.initial_frozen(setup.base, k_a)
    params = lt.init(k_init)
    trainer = _trainer(lt, s.lora_lr, s.batch_size)
    state = trainer.init(k_nodes, params, s.nodes)
    own = setup.data.own()
    byz = byz_lib.Byzantine(
        mask=np.isin(np.arange(s.nodes), s.byzantine) if attack else np.zeros(s.nodes, bool),
        attack="alie",
        kwargs={"z": s.alie_z},
    )
    spec, acc = example_dp(s, setup.data.train_count) if dp else (None, None)
    f = len(s.byzantine)
    aggregator = None if rule is None else registry.make(rule, f)
    deviations, ups, downs, exactness, ranks = [], [], [], set(), []
    t0 = time.perf_counter()
    for r in range(s.rounds):
        k_att, k_merge = jax.random.split(jax.random.fold_in(k_rounds, r))
        if merge:
            state = state._replace(params=_broadcast(params, s.nodes))
        state, _ = trainer.fit(state, own, s.local_steps, frozen=frozen, dp=spec)
        if not merge:
            continue
        sent = byz_lib.submit(byz, k_att, state.params, params)
        if rows is not None:
            sent = jax.tree.map(lambda x: x[np.asarray(rows)], sent)
        out = merge_round(
            lt,
            frozen,
            sent,
            method=method,
            rule=aggregator,
            space=space,
            key=k_merge,
            measure=rule is None and not attack,
            start=params,
        )
        params, frozen = out.params, out.frozen
        ups.append(out.info["bytes_up"])
        downs.append(out.info["bytes_down"])
        exactness.add(out.info.get("exactness", "?"))
        ranks.append(out.info["rank_out"])
        if "deviation" in out.info:
            deviations.append(out.info["deviation"])
    seconds = time.perf_counter() - t0
    test = setup.data.test
    if merge:
        ppl = perplexity(lt, params, test, frozen)
    else:
        one = [jax.tree.map(lambda x, i=i: x[i], state.params) for i in range(s.nodes)]
        ppl = float(np.mean([perplexity(lt, p, test, frozen) for p in one]))
    out_d: dict[str, Any] = {
        "perplexity": ppl,
        "seconds": seconds,
        "bytes_up": float(np.mean(ups)) if ups else 0.0,
        "bytes_down": float(np.mean(downs)) if downs else 0.0,
        "exactness": "/".join(sorted(exactness)) if exactness else "-",
        "deviation": float(np.max(deviations)) if deviations else math.nan,
        "rank_out": max(ranks) if ranks else s.rank,
    }
    if acc is not None:
        steps = np.asarray(state.step)
        out_d["epsilon"] = max(p.epsilon_rdp for p in acc.nodes(steps, pld=False))
        out_d["noise_multiplier"] = float(acc.z[0])
    return out_d


def run_full_fedavg(setup: Setup) -> dict[str, Any]:
    """Full fine-tuning with FedAvg (uniform mean of the whole models every round)."""
    s = setup.s
    trainer = _trainer(setup.task, s.full_lr, s.batch_size)
    key = jax.random.fold_in(jax.random.key(setup.seed), 2)
    params = setup.base
    state = trainer.init(key, params, s.nodes)
    own = setup.data.own()
    t0 = time.perf_counter()
    for _ in range(s.rounds):
        state = state._replace(params=_broadcast(params, s.nodes))
        state, _ = trainer.fit(state, own, s.local_steps)
        params = jax.tree.map(lambda x: jnp.mean(x, 0), state.params)
    b = tree_bytes(params)
    return {
        "perplexity": perplexity(setup.task, params, setup.data.test),
        "seconds": time.perf_counter() - t0,
        "bytes_up": float(b),
        "bytes_down": float(b),
        "exactness": "exact",
        "deviation": 0.0,
        "rank_out": 0,
    }


def memory(setup: Setup) -> dict[str, dict[str, int]]:
    """Bytes a node holds while training: the frozen base, and params + gradient + Adam moments
    (4 copies) of what it trains."""
    sizes = setup.lora.sizes()
    ffa = setup.ffa.sizes()
    model = sizes["model_bytes"]
    return {
        "full": {"frozen": 0, "trained": 4 * model, "total": 4 * model},
        "lora": {
            "frozen": model,
            "trained": 4 * sizes["trainable_bytes"],
            "total": model + 4 * sizes["trainable_bytes"],
        },
        "ffa": {
            "frozen": model + ffa["adapter_bytes"] - ffa["trainable_bytes"],
            "trained": 4 * ffa["trainable_bytes"],
            "total": model + ffa["adapter_bytes"] - ffa["trainable_bytes"] + 4 * ffa["trainable_bytes"],
        },
    }


def run_seed(s: Settings, seed: int) -> dict[str, dict[str, Any]]:
    """Every configuration of one seed."""
    task = make_task(s)
    data = task.splits(s.nodes, seed=seed)
    base = pretrain(task, data, jax.random.key(1000 + seed), s)
    lora, ffa = lora_tasks(task, base, s)
    setup = Setup(s, seed, task, data, base, lora, ffa)
    out: dict[str, dict[str, Any]] = {}
    out["base (no fine-tuning)"] = {"perplexity": perplexity(task, base, data.test)}
    out["local (each node alone)"] = run_lora(setup, "fedit", merge=False)
    out["full fine-tuning, FedAvg"] = run_full_fedavg(setup)
    for m in METHODS:
        out[m] = run_lora(setup, m, ffa=m == "ffa")
    honest = [i for i in range(s.nodes) if i not in s.byzantine]
    out["fedit, honest nodes only"] = run_lora(setup, "fedit", rows=honest)
    out["fedit, clean, multi_krum on products"] = run_lora(setup, "fedit", rule="multi_krum")
    out["fedit, attacked, mean"] = run_lora(setup, "fedit", attack=True)
    for name, method, rule, space in s.robust:
        out[f"{method}, attacked, {name}"] = run_lora(setup, method, rule=rule, space=space, attack=True)
    out["fedit, DP-SGD"] = run_lora(setup, "fedit", dp=True)
    out["ffa, DP-SGD"] = run_lora(setup, "ffa", ffa=True, dp=True)
    out["_memory"] = memory(setup)
    out["_sizes"] = {"lora": lora.sizes(), "ffa": ffa.sizes()}
    return out


def _col(runs: Sequence[dict[str, Any]], key: str) -> list[float]:
    return [float(r[key]) for r in runs if key in r]


def summarize(per_seed: list[dict[str, dict[str, Any]]]) -> dict[str, dict[str, Any]]:
    """Every configuration's perplexity over the seeds (values, mean, std) and its other measures
    (bytes, exactness, deviation, rank, epsilon, seconds: the largest over the seeds)."""
    names = [k for k in per_seed[0] if not k.startswith("_")]
    summary: dict[str, dict[str, Any]] = {}
    for k in names:
        runs = [seed[k] for seed in per_seed]
        ppl = _col(runs, "perplexity")
        m, sd = mean_std(ppl)
        row: dict[str, Any] = {"perplexity": ppl, "perplexity_mean": m, "perplexity_std": sd}
        for extra in ("bytes_up", "bytes_down", "exactness", "deviation", "rank_out", "epsilon", "seconds"):
            if extra in runs[0]:
                vals = [r[extra] for r in runs]
                row[extra] = vals[0] if isinstance(vals[0], str) else float(np.max(vals))
        summary[k] = row
    return summary


def findings(summary: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """The winners and ratios the report states, computed from the summary.

    Returns:
        ``winner_clean`` (the adapter method of lowest perplexity), ``winner_dp`` (FedIT or
        FFA-LoRA under DP-SGD), ``best_robust`` (the attacked robust configuration of lowest
        perplexity, None without one) and its ratios to clean FedIT over all nodes
        (``robust_ratio``), over the honest nodes (``robust_ratio_honest``) and to the same rule
        without attackers (``robust_ratio_same_rule``).
    """
    clean = summary["fedit"]["perplexity_mean"]
    attacked = {k: v for k, v in summary.items() if "attacked" in k and not k.endswith(", mean")}
    best = min(attacked, key=lambda k: attacked[k]["perplexity_mean"]) if attacked else None
    at_best = attacked[best]["perplexity_mean"] if best else math.nan
    # Each node holds its own kind of text: a rule that drops the attackers drops their kinds,
    # so the reference it can reach is FedIT over the honest nodes (no attack), not over all.
    honest_ref = summary["fedit, honest nodes only"]["perplexity_mean"]
    same_rule = summary["fedit, clean, multi_krum on products"]["perplexity_mean"]
    methods = [k for k in METHODS if k in summary]
    return {
        "winner_clean": min(methods, key=lambda k: summary[k]["perplexity_mean"]),
        "winner_dp": min(("fedit, DP-SGD", "ffa, DP-SGD"), key=lambda k: summary[k]["perplexity_mean"]),
        "best_robust": best,
        "robust_ratio": at_best / clean,
        "robust_ratio_honest": at_best / honest_ref,
        "robust_ratio_same_rule": at_best / same_rule,
    }


def markdown(res: dict[str, Any]) -> str:
    """The results page of a run, rendered from its result dict (as saved in the JSON).

    Args:
        res: the payload :func:`report` returns (``settings``, ``summary``, ``per_seed``,
            ``memory``, ``sizes``).

    Returns:
        The markdown: title, model and adapter sizes, the table of every configuration, memory per
        node and the findings, each computed from the summary.
    """
    s, summary, mem, sizes = res["settings"], res["summary"], res["memory"], res["sizes"]
    n_seeds = len(res["per_seed"])
    found = findings(summary)
    winner, dp_winner, best = found["winner_clean"], found["winner_dp"], found["best_robust"]
    ratio, ratio_honest, ratio_rule = (
        found["robust_ratio"],
        found["robust_ratio_honest"],
        found["robust_ratio_same_rule"],
    )
    clean = summary["fedit"]["perplexity_mean"]
    honest_ref = summary["fedit, honest nodes only"]["perplexity_mean"]
    same_rule = summary["fedit, clean, multi_krum on products"]["perplexity_mean"]
    method_rows = {k: summary[k]["perplexity_mean"] for k in METHODS if k in summary}
    runner_up = min((k for k in method_rows if k != winner), key=lambda k: method_rows[k])
    dp_loser = "ffa, DP-SGD" if dp_winner == "fedit, DP-SGD" else "fedit, DP-SGD"
    n_byz = len(s["byzantine"])

    def mean(k: str) -> float:
        return float(summary[k]["perplexity_mean"])

    def seeds_won(a: str, b: str) -> int:
        """On how many seeds configuration ``a`` has the lower perplexity than ``b`` (paired)."""
        return sum(x < y for x, y in zip(summary[a]["perplexity"], summary[b]["perplexity"], strict=True))

    lines = [
        "# LoRA consensus on a byte-level language model",
        "",
        f"Model: {sizes['lora']['model_params']:,} parameters "
        f"({sizes['lora']['model_bytes']:,} bytes float32); "
        f"LoRA adapters: {sizes['lora']['adapter_params']:,} parameters "
        f"({100 * sizes['lora']['adapter_params'] / sizes['lora']['model_params']:.1f}% of the model), "
        f"FFA-LoRA trains {sizes['ffa']['trainable_params']:,}.",
        "",
        f"Test perplexity (mean ± std over {n_seeds} seed(s); lower is better). "
        "Bytes are per node per round; deviation is the largest relative distance of a round's "
        "merged update from the exact mean of the nodes' updates (measured; 0 = exact).",
        "",
    ]
    rows = []
    for k, r in summary.items():
        rows.append(
            [
                k,
                pm(r["perplexity"]),
                r.get("exactness", "-"),
                "-" if math.isnan(r.get("deviation", math.nan)) else f"{r['deviation']:.2e}",
                f"{int(r['bytes_up']):,}" if "bytes_up" in r else "-",
                f"{int(r['bytes_down']):,}" if "bytes_down" in r else "-",
                f"{r['epsilon']:.2f}" if "epsilon" in r else "-",
            ]
        )
    lines.append(
        markdown_table(
            ["configuration", "perplexity", "exactness", "deviation", "bytes up", "bytes down", "epsilon"],
            rows,
        )
    )
    robust = (
        f"best robust rule: **{best}** ({mean(best):.3f}): "
        f"{100 * (ratio_honest - 1):+.1f}% against clean FedIT over the {s['nodes'] - n_byz} honest "
        f"nodes ({honest_ref:.3f}, the reference a rule that drops exactly the attackers can reach): "
        f"{'within' if ratio_honest <= 1.05 else 'NOT within'} 5%; {100 * (ratio_rule - 1):+.1f}% against "
        f"the same rule without attackers ({same_rule:.3f}); {100 * (ratio - 1):+.1f}% against clean FedIT "
        f"over all {s['nodes']} nodes ({clean:.3f}), which also learns the attackers' {n_byz} kinds of text "
        "(each node holds its own kind, so no rule that drops them can recover those)."
        if best is not None
        else "no robust rule was run."
    )
    lines += [
        "",
        "Memory per node while training (bytes; trained = params + gradient + Adam's two moments):",
        "",
        markdown_table(
            ["", "frozen", "trained", "total"],
            [[k, f"{v['frozen']:,}", f"{v['trained']:,}", f"{v['total']:,}"] for k, v in mem.items()],
        ),
        "",
        "Findings:",
        "",
        f"* Best adapter method (clean): **{winner}** ({method_rows[winner]:.3f}; lower than the "
        f"runner-up {runner_up} on {seeds_won(winner, runner_up)} of {n_seeds} seeds); "
        f"full fine-tuning with FedAvg {mean('full fine-tuning, FedAvg'):.3f}; "
        f"each node alone {mean('local (each node alone)'):.3f}; the base "
        f"{mean('base (no fine-tuning)'):.3f}.",
        f"* Under {n_byz} of {s['nodes']} attackers (ALIE z = {s['alie_z']:g} on the adapter trees): "
        f"FedIT's plain mean {mean('fedit, attacked, mean'):.3f}; {robust}",
        f"* DP-SGD at epsilon {s['epsilon']:g}: FedIT {mean('fedit, DP-SGD'):.3f}, "
        f"FFA-LoRA {mean('ffa, DP-SGD'):.3f}: **{dp_winner.split(',')[0]}** is lower "
        f"on average and on {seeds_won(dp_winner, dp_loser)} of {n_seeds} seeds (paired); a difference "
        f"of {abs(mean(dp_winner) - mean(dp_loser)):.3f} against "
        f"a spread over seeds of {summary[dp_winner]['perplexity_std']:.3f}.",
        f"* Bytes per round per node: LoRA {int(summary['fedit']['bytes_up']):,} up (FFA-LoRA "
        f"{int(summary['ffa']['bytes_up']):,}), full fine-tuning "
        f"{int(summary['full fine-tuning, FedAvg']['bytes_up']):,}: the adapters' share "
        f"{summary['fedit']['bytes_up'] / summary['full fine-tuning, FedAvg']['bytes_up']:.3f}. Methods "
        "that fold into the base (stack, exact_residual) also send the dense base delta down.",
        "",
    ]
    return "\n".join(lines)


def report(s: Settings, per_seed: list[dict[str, dict[str, Any]]]) -> tuple[dict[str, Any], str]:
    """The JSON payload and the markdown report (rendered from the payload by :func:`markdown`)."""
    summary = summarize(per_seed)
    payload = {
        "settings": dataclasses.asdict(s),
        "summary": summary,
        "per_seed": per_seed,
        **findings(summary),
        "memory": per_seed[0]["_memory"],
        "sizes": per_seed[0]["_sizes"],
    }
    return payload, markdown(payload)


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    """Run the benchmark and write its results."""
    p = parser(__doc__, "one seed, 2 rounds of 3 steps, a tiny corpus (well under a minute)")
    p.add_argument("--seeds", type=int, default=None, help="number of seeds (default 3, --quick 1)")
    args = parse(p, argv)
    s = QUICK if args.quick else Settings()
    if args.seeds is not None:
        s = dataclasses.replace(s, seeds=args.seeds)
    per_seed = []
    for seed in range(s.seeds):
        t = time.perf_counter()
        per_seed.append(run_seed(s, seed))
        print(f"seed {seed}: {time.perf_counter() - t:.0f} s", flush=True)
    payload, md = report(s, per_seed)
    save(NAME, args.quick, payload, md, settings=payload["settings"])
    print(md)
    return payload
