"""Node trainer throughput: n vmapped nodes against hand-written single-model Flax + optax loops.

Run ``python -m benchmarks trainers [--quick]``. Writes benchmarks/results/trainers.json
and trainers.md (``trainers_quick.*`` with ``--quick``, fewer steps, under a minute).

For each task (digits MLP, byte-level text transformer), all in one process:

* ``hand loop``: one model trained without the trainer: the task's Flax NNX
  model (params from ``nnx.split``, ``nnx.merge`` inside the loss) +
  ``optax.adam``, ``value_and_grad`` with the loss kept per step, one
  ``jax.jit`` step per Python loop iteration, minibatch indices drawn on
  device: the idiomatic loop;
* ``hand scan``: the same step under ``lax.scan`` (many steps per dispatch),
  the fastest single-model loop we know how to write, and the fair baseline of
  the trainer, which also scans;
* ``trainer n``: :class:`strategies.trainer.NodeTrainer` with n = 1, 4, 8
  vmapped nodes, each with its own data, key and learning rate.

Reported: samples per second (n x batch x steps / time, best of repeats),
the n = 1 trainer against both baselines (target: within 10% of the hand
scan), n vmapped nodes against n sequential hand-written runs (the hand
scan's time x n; target: ratio >= 1), and the bytes of the stacked state
(params + optimizer state) for n nodes.

**DP-SGD** (``--dp-only`` runs just this part): 8 nodes, the non-private trainer step against the
example-level DP-SGD step (:mod:`strategies.dpsgd`: Poisson sampling at q = batch / rows into a
padded batch with overflow probability <= 1e-12 per step, per-example clipping, noise; the MLPs
take the fast ghost-clipping path, with no per-example gradient materialized)
at the same expected batch, timed in the same run (interleaved); target: DP time / plain time <= 2
for the digits MLP and the Fashion-MNIST MLP at batch 64, with the Fashion-MNIST MLP also at
batch 256, the example-level privacy benchmark's (digits' only when the Fashion-MNIST files are
absent; ``META_CONSENSUS_FASHION_MNIST=folder`` points at other IDX files, and the table names
the folder: the timing does not depend on the pixels). For the text transformer (generic path)
it states the memory of the per-example gradients (pad x params x 4 bytes, per node) and times DP-SGD with
micro-batches of 4 rows (accumulated in a scan). A third timing, interleaved with the two, draws the DP
step's Gaussian noise alone (one threefry normal per parameter per node per step): a DP step cannot
take less than a plain step plus that, which the table reports as a lower bound on DP / plain.
"""

from __future__ import annotations

import os
import time
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from benchmarks import harness
from benchmarks.harness import machine, markdown_table
from strategies import dpsgd
from strategies.tasks.digits import DigitsTask
from strategies.trainer import NodeTrainer


def _interleaved_best(runners: dict[str, Any], repeats: int) -> dict[str, float]:
    """Best wall time of each runner; runners take turns so a burst of machine load hits all alike."""
    for fn in runners.values():
        jax.block_until_ready(fn())  # compile and warm up
    best = dict.fromkeys(runners, float("inf"))
    for _ in range(repeats):
        for name, fn in runners.items():
            t0 = time.perf_counter()
            jax.block_until_ready(fn())
            best[name] = min(best[name], time.perf_counter() - t0)
    return best


def _tree_bytes(tree: Any) -> int:
    return int(sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(tree)))


def _hand_written(task, pool: dict[str, np.ndarray], count: int, batch: int, lr: float):
    """A single model trained by hand: returns (init state, jitted step, jitted scan of k steps)."""
    params = task.init(jax.random.key(0))
    tx = optax.adam(lr)
    with jax.numpy_dtype_promotion("standard"):
        opt = tx.init(params)
    on_device = {k: jnp.asarray(v) for k, v in pool.items()}

    def step(carry, _=None):
        params, opt, key = carry
        key, k_sample = jax.random.split(key)
        rows = jax.random.randint(k_sample, (batch,), 0, count)
        b = {k: v[rows] for k, v in on_device.items()}
        # The loss is kept (as any training loop that logs it would); the trainer reports it too.
        loss, grads = jax.value_and_grad(task.loss)(params, b)
        with jax.numpy_dtype_promotion("standard"):
            upd, opt = tx.update(grads, opt, params)
        return (optax.apply_updates(params, upd), opt, key), loss

    one = jax.jit(step)
    many = jax.jit(lambda c, steps: jax.lax.scan(step, c, length=steps), static_argnums=1)
    return (params, opt, jax.random.key(1)), one, many


def bench_task(task, data, *, batch: int, steps: int, repeats: int, nodes: tuple[int, ...], lr: float):
    own = data.own()
    pool0 = {k: np.asarray(v[0]) for k, v in own.pool.items()}
    count0 = int(own.count[0])
    carry, one, many = _hand_written(task, pool0, count0, batch, lr)

    def loop():
        c = carry
        losses = []
        for _ in range(steps):
            c, loss = one(c)
            losses.append(loss)
        return c, losses

    runners: dict[str, Any] = {"loop": loop, "scan": lambda: many(carry, steps)}
    init = task.init(jax.random.key(0))
    states = {}
    for n in nodes:
        # Node i uses node (i mod n_data)'s shard: the data exist for max(nodes) nodes.
        node_data = own.select_nodes(np.arange(n) % own.num_nodes)
        trainer = NodeTrainer(
            task, optax.adam, {"learning_rate": np.full(n, lr, np.float32)}, batch_size=batch
        )
        state = trainer.init(jax.random.key(0), init, n)
        placed = trainer.place(node_data)
        states[n] = state
        runners[f"trainer{n}"] = lambda tr=trainer, s=state, d=placed: tr.fit(s, d, steps)
    best = _interleaved_best(runners, repeats)
    t_loop, t_scan = best["loop"], best["scan"]
    rows: list[dict[str, Any]] = [
        {"runner": "hand loop", "nodes": 1, "seconds": t_loop, "samples_per_s": batch * steps / t_loop},
        {"runner": "hand scan", "nodes": 1, "seconds": t_scan, "samples_per_s": batch * steps / t_scan},
    ]
    for n in nodes:
        t, state = best[f"trainer{n}"], states[n]
        rows.append(
            {
                "runner": "trainer",
                "nodes": n,
                "seconds": t,
                "samples_per_s": n * batch * steps / t,
                "state_bytes": _tree_bytes((state.params, state.opt_state)),
                "params_bytes": _tree_bytes(state.params),
                # n nodes here vs n sequential hand-written runs of one node.
                "vs_n_sequential_hand_scan": (n * t_scan) / t,
                "vs_n_sequential_hand_loop": (n * t_loop) / t,
            }
        )
    t1 = next(r for r in rows if r["runner"] == "trainer" and r["nodes"] == 1)
    summary = {
        "trainer1_over_hand_scan_throughput": t1["samples_per_s"] / rows[1]["samples_per_s"],
        "trainer1_over_hand_loop_throughput": t1["samples_per_s"] / rows[0]["samples_per_s"],
        "params_count": int(sum(x.size for x in jax.tree.leaves(init))),
    }
    return rows, summary


def bench_dp(task, data, *, batch: int, steps: int, repeats: int, n: int, lr: float, microbatch: int = 0):
    """Non-private vs DP-SGD trainer steps of n nodes at the same expected batch (same run)."""
    own = data.own().select_nodes(np.arange(n) % data.own().num_nodes)
    counts = np.asarray(own.count)
    rate = dpsgd.effective_rate(dpsgd.sampling_rates(counts, batch))
    pad = dpsgd.padded_size(counts, rate, 1e-12, multiple=max(1, microbatch))
    trainer = NodeTrainer(task, optax.adam, {"learning_rate": np.full(n, lr, np.float32)}, batch_size=batch)
    init = task.init(jax.random.key(0))
    state = trainer.init(jax.random.key(0), init, n)
    placed = trainer.place(own)
    dp = dpsgd.ExampleDP(1.0, 1.0, pad, microbatch)
    noise = _noise_loop(init, n, steps)
    best = _interleaved_best(
        {
            "plain": lambda: trainer.fit(state, placed, steps),
            "dp": lambda: trainer.fit(state, placed, steps, dp=dp),
            "noise": lambda: noise(jax.random.key(1)),
        },
        repeats,
    )
    params_bytes = _tree_bytes(init)
    ghost = getattr(task, "dp_dense_taps", lambda: None)() is not None
    per_example = 0 if ghost else (microbatch or pad) * params_bytes
    return {
        # fast path (ghost clipping, nothing per-example materialized) or the generic vmap path
        "path": "ghost" if ghost else "per-example vmap",
        "nodes": n,
        "expected_batch": batch,
        "padded_batch": pad,
        "microbatch": microbatch,
        "rows_per_node": [int(c) for c in counts],
        "plain_ms_per_step": best["plain"] / steps * 1e3,
        "dp_ms_per_step": best["dp"] / steps * 1e3,
        "dp_over_plain": best["dp"] / best["plain"],
        # The Gaussian noise alone (n x params threefry normals per step, added to a running
        # sum as the DP step adds them to the clipped gradient): a DP step costs at least a
        # plain step plus this, whatever the clipping does.
        "noise_ms_per_step": best["noise"] / steps * 1e3,
        "dp_over_plain_lower_bound": 1.0 + best["noise"] / best["plain"],
        "params_bytes": params_bytes,
        # Per node: the per-example gradients alive at once (the padded batch, or one micro-batch).
        "per_example_grad_bytes": per_example,
        "per_example_grad_bytes_whole_pad": 0 if ghost else pad * params_bytes,
    }


def _noise_loop(params: Any, n: int, steps: int) -> Any:
    """A jitted loop of ``steps`` DP-SGD noise draws for n nodes (:func:`strategies.dpsgd.gaussian_noise`).

    Every draw is added to a params-shaped accumulator per node, as the DP step adds it to the
    clipped sum, so no normal can be skipped by the compiler.
    """
    zeros = jax.tree.map(lambda x: jnp.zeros((n, *x.shape), jnp.float32), params)

    @jax.jit
    def run(key: jax.Array) -> Any:
        def body(i, acc):
            keys = jax.random.split(jax.random.fold_in(key, i), n)
            noise = jax.vmap(lambda k: dpsgd.gaussian_noise(k, params, jnp.float32(1.0)))(keys)
            return jax.tree.map(jnp.add, acc, noise)

        return jax.lax.fori_loop(0, steps, body, zeros)

    return lambda key: jax.block_until_ready(run(key))


def _dp_tasks(quick: bool, text: bool) -> list[tuple[str, Any, dict]]:
    out: list[tuple[str, Any, dict]] = [
        ("digits MLP", DigitsTask(), {"batch": 64, "steps": 50 if quick else 200})
    ]
    try:
        from strategies.tasks import fashion_mnist
        from strategies.tasks.fashion_mnist import FashionMNISTTask

        fm = FashionMNISTTask()
        fm.splits(2, seed=0)  # raises when the IDX files are absent
        folder = os.environ.get(fashion_mnist.ENV_VAR)
        label = "Fashion-MNIST MLP" + (f" (files from {folder})" if folder else "")
        out.append((label, fm, {"batch": 64, "steps": 20 if quick else 100}))
        # The batch the example-level privacy benchmark trains with (DP-SGD wants large batches:
        # the noise per step is fixed, the signal grows with the batch).
        out.append((label + ", batch 256", fm, {"batch": 256, "steps": 10 if quick else 50}))
    except (ImportError, FileNotFoundError) as e:
        print(f"Fashion-MNIST skipped: {e}", flush=True)
    if text:
        from strategies.tasks.text import TextTask

        tt = TextTask(windows_per_node=128, general_windows=64, heldout_windows=16, test_windows=16)
        out.append(("text transformer", tt, {"batch": 8, "steps": 3 if quick else 10, "microbatch": 4}))
    return out


def run_dp(quick: bool, text: bool) -> dict[str, Any]:
    """The DP-SGD comparison of every task: task label -> :func:`bench_dp`'s row."""
    rows = {}
    for name, task, cfg in _dp_tasks(quick, text):
        data = task.splits(8, seed=0)
        r = bench_dp(
            task,
            data,
            batch=cfg["batch"],
            steps=cfg["steps"],
            repeats=3 if quick else 5,
            n=8,
            lr=1e-3,
            microbatch=cfg.get("microbatch", 0),
        )
        rows[name] = r
        print(name, {k: v for k, v in r.items() if k != "rows_per_node"}, flush=True)
    return rows


def _dp_markdown(dp: Mapping[str, Mapping[str, Any]]) -> list[str]:
    """The DP-SGD section: one row per task; the noise-alone columns where the run timed them."""
    noise = all("noise_ms_per_step" in r for r in dp.values())
    nodes = sorted({r["nodes"] for r in dp.values()})
    table = []
    for name, r in dp.items():
        row = [
            name,
            r["path"],
            r["expected_batch"],
            r["padded_batch"],
            r["microbatch"] or "-",
            r["plain_ms_per_step"],
            r["dp_ms_per_step"],
            r["dp_over_plain"],
        ]
        if noise:
            row += [r["noise_ms_per_step"], r["dp_over_plain_lower_bound"]]
        row += [r["per_example_grad_bytes"] / 2**20, r["per_example_grad_bytes_whole_pad"] / 2**20]
        table.append(row)
    headers = [
        "task",
        "clipping path",
        "batch",
        "pad",
        "micro-batch",
        "plain ms/step",
        "DP ms/step",
        "DP / plain",
        *(["noise alone ms/step", "DP / plain lower bound (1 + noise / plain)"] if noise else []),
        "per-example grads MiB/node",
        "MiB/node without micro-batches",
    ]
    out = [
        f"## DP-SGD step vs the non-private step ({', '.join(map(str, nodes))} nodes, same expected batch, "
        "same run)",
        "",
        "Example-level DP-SGD (Poisson sampling into a padded batch, per-example clipping, noise) against",
        "the non-private trainer step at the same expected batch, timed interleaved. 'clipping path':",
        "ghost clipping (no per-example gradient materialized) or per-example gradients by vmap, whose",
        "memory per node the last two columns give (with and without micro-batches).",
        "",
        markdown_table(headers, table),
        "Target: DP / plain <= 2 for the MLPs.",
    ]
    if noise:
        out[-1] += (
            " 'noise alone' times the Gaussian noise of the DP step by itself (one threefry normal per "
            "parameter per node per step, accumulated as the step adds it): no clipping method brings a DP "
            "step under 1 + noise / plain."
        )
    return out


def markdown(res: Mapping[str, Any]) -> str:
    """The results page of a run of this benchmark, rendered from its result file.

    Both layouts: the whole benchmark (``tasks`` and ``dp``, ``trainers.json``) and ``--dp-only``
    (``dp`` alone, ``trainers_dp.json``).

    Args:
        res: the result dict as saved.

    Returns:
        The markdown: title, run header, one table per task and the DP-SGD table.
    """
    st = res.get("settings", {})
    quick = bool(st.get("quick", res.get("quick", False)))
    load = harness.load_line(res)
    if "tasks" not in res:
        lines = harness.header("DP-SGD throughput", "trainers", quick, st)
        if load:
            lines += [load, ""]
        return "\n".join(lines + _dp_markdown(res["dp"])) + "\n"
    lines = harness.header("Node trainer throughput", "trainers", quick, st)
    lines += [
        "Samples/s = nodes x batch x steps / best wall time. `vs n seq` = time of n sequential",
        "hand-written single-model runs / time of the n-node trainer (>= 1: vmapping pays)."
        + (f" {load}" if load else ""),
        "",
    ]
    for name, t in res["tasks"].items():
        cfg, rows, summary = t["config"], t["rows"], t["summary"]
        table = [
            [
                r["runner"],
                r["nodes"],
                r["samples_per_s"],
                r["seconds"] * 1e3,
                r.get("vs_n_sequential_hand_scan", ""),
                r.get("vs_n_sequential_hand_loop", ""),
                r.get("state_bytes", ""),
            ]
            for r in rows
        ]
        lines += [
            f"## {name} ({summary['params_count']} params, batch {cfg['batch']}, {cfg['steps']} steps)",
            "",
            markdown_table(
                ["runner", "n", "samples/s", "ms", "vs n seq (scan)", "vs n seq (loop)", "state bytes"], table
            ),
            f"trainer n=1 / hand scan throughput: {summary['trainer1_over_hand_scan_throughput']:.3f}; "
            f"/ hand loop: {summary['trainer1_over_hand_loop_throughput']:.3f}."
            + (f" ({t['seconds']:.1f} s)" if "seconds" in t else ""),
            "",
        ]
    if res.get("dp"):
        lines += _dp_markdown(res["dp"])
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    parser = harness.parser(__doc__, "fewer steps and repeats (under a minute)")
    parser.add_argument("--no-text", action="store_true", help="skip the text task")
    parser.add_argument("--dp-only", action="store_true", help="only the DP-SGD vs non-private comparison")
    args = harness.parse(parser, argv)
    if args.dp_only:
        settings = {"quick": args.quick, "dp_only": True, "text": not args.no_text}
        out = {"machine": machine(), "quick": args.quick, "dp": run_dp(args.quick, not args.no_text)}
        shown = {**out, "settings": settings, "load_average": harness.load_average()}
        jpath, mpath = harness.save("trainers_dp", args.quick, out, markdown(shown), settings=settings)
        print(f"wrote {jpath} and {mpath}")
        return
    repeats = 3 if args.quick else 10
    nodes = (1, 4, 8)
    tasks: list[tuple[str, Any, dict]] = [
        ("digits", DigitsTask(), {"batch": 64, "steps": 100 if args.quick else 500, "lr": 3e-3}),
    ]
    if not args.no_text:
        try:
            from strategies.tasks.text import TextTask
        except ImportError:  # the text task is optional for this benchmark
            pass
        else:
            text = TextTask(windows_per_node=128, general_windows=64, heldout_windows=16, test_windows=16)
            tasks.append(("text", text, {"batch": 8, "steps": 10 if args.quick else 50, "lr": 1e-3}))
    results: dict[str, Any] = {"machine": machine(), "quick": args.quick, "tasks": {}}
    for name, task, cfg in tasks:
        start = time.perf_counter()
        data = task.splits(max(nodes), seed=0)
        rows, summary = bench_task(
            task, data, batch=cfg["batch"], steps=cfg["steps"], repeats=repeats, nodes=nodes, lr=cfg["lr"]
        )
        # seconds: the task's whole measurement (data, compilation, every repeat).
        results["tasks"][name] = {
            "config": cfg,
            "rows": rows,
            "summary": summary,
            "seconds": time.perf_counter() - start,
        }
        print(name, summary, flush=True)
        for r in rows:
            print("  ", {k: (round(v, 4) if isinstance(v, float) else v) for k, v in r.items()}, flush=True)
    results["dp"] = run_dp(args.quick, not args.no_text)
    settings = {"quick": args.quick, "repeats": repeats, "nodes": nodes, "text": not args.no_text}
    shown = {**results, "settings": settings, "load_average": harness.load_average()}
    jpath, mpath = harness.save("trainers", args.quick, results, markdown(shown), settings=settings)
    print(f"wrote {jpath} and {mpath}")


if __name__ == "__main__":
    main()
