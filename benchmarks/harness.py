"""The one harness of the benchmarks: arguments, timing, settings record, result files, shared tasks.

Every benchmark (``benchmarks/speed``, ``benchmarks/quality``, ``benchmarks/tuning``; run one with
``python -m benchmarks NAME``) follows the same conventions through this module:

* ``parser(doc, quick_help)`` gives an ``argparse`` parser with ``--quick`` (a small run that
  finishes in about a minute) and ``--out`` (the results folder, default ``benchmarks/results``);
  scripts add their own options to it.
* Timing: :func:`best_time` is the best of ``repeats`` calls after warm-up calls that compile
  (jax outputs blocked on). Speed is reported as a ratio against a floor measured in the same
  run (:func:`ratio`), never as absolute seconds alone, because the machines are shared.
* :func:`save` writes ``<out>/<name>[_quick].json`` and ``.md``; the JSON carries the command,
  ``argv``, the machine, the settings record and the results, with non-finite floats as strings
  (strict JSON). :func:`plot_path` names the PNG beside them.
* :func:`header` starts a markdown report with title, command, machine and settings.
* The quality benchmarks share the task (``--task``, :func:`make_task`), the data splits
  (:func:`shared_pool`, :func:`iid_clients`, :class:`ManyClientDigits`), training
  (:func:`trainer_for`, :func:`pretrain`) and evaluation (:func:`metrics`, :func:`class_probs`, ...).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import math
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from strategies import NodeData, NodeTrainer, TaskData
from strategies.tasks import Task, pad_index_table
from strategies.tasks.base import dominant_groups, pad_stack, with_public_pool
from strategies.tasks.digits import NUM_CLASSES, DigitsTask

PyTree = Any
Batch = Mapping[str, Any]

RESULTS = Path(__file__).resolve().parent / "results"


# ----------------------------------------------------------------------------- arguments


def parser(doc: str | None, quick_help: str = "a small run of about a minute") -> argparse.ArgumentParser:
    """An argument parser with the options every benchmark has: ``--quick`` and ``--out``."""
    p = argparse.ArgumentParser(description=doc.strip().splitlines()[0] if doc else None)
    p.add_argument("--quick", action="store_true", help=quick_help)
    p.add_argument("--out", type=Path, default=None, help="results folder (default benchmarks/results)")
    return p


_out: Path | None = None  # the --out of the script running in this process (None: RESULTS)
_script: str | None = None  # the benchmark run from the command line (None: called with an argv list)
_extra: list[str] = []  # its arguments other than --quick and --out, for the recorded command


def parse(p: argparse.ArgumentParser, argv: Sequence[str] | None = None) -> argparse.Namespace:
    """Parse the arguments; ``--out`` becomes the folder of every later :func:`save` / :func:`plot_path`.

    A script runs once per process, so its output folder is process-wide: the script bodies
    call ``save(name, quick, ...)`` without threading ``args.out`` through every function.
    The other arguments (``--task``, ...) are kept for the command :func:`command` records.
    """
    global _out, _script, _extra
    args = p.parse_args(argv)
    _out = args.out
    raw = list(sys.argv[1:] if argv is None else argv)
    if argv is None and sys.argv[0].endswith(".py"):  # python -m benchmarks.speed.NAME
        _script = Path(sys.argv[0]).stem
    elif _entry is None:
        _script = None
    _extra, skip = [], False
    for a in raw:
        if skip or a == "--quick" or a.startswith("--out="):
            skip = False
            continue
        if a == "--out":
            skip = True
            continue
        _extra.append(a)
    return args


_entry: str | None = None  # the NAME of ``python -m benchmarks NAME``, set before its main runs


def run_as(name: str | None) -> None:
    """Record that ``python -m benchmarks NAME`` runs (None: it has returned), for :func:`command`."""
    global _script, _entry
    _script = _entry = name


def results_folder(out: Path | str | None = None) -> Path:
    """``out``, else the parsed ``--out``, else ``benchmarks/results``; created."""
    folder = Path(out) if out is not None else (_out if _out is not None else RESULTS)
    folder.mkdir(parents=True, exist_ok=True)
    return folder


# ----------------------------------------------------------------------------- timing


def best_time(fn: Callable[[], Any], repeats: int = 3, warmup: int = 1) -> float:
    """Best wall time of ``fn`` in seconds (outputs blocked on), after warm-up calls that compile."""
    if repeats < 1 or warmup < 0:
        raise ValueError(f"best_time needs repeats >= 1 and warmup >= 0, got {repeats}, {warmup}")
    for _ in range(warmup):
        jax.block_until_ready(fn())
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn())
        best = min(best, time.perf_counter() - start)
    return best


def ratio(seconds: float, floor_seconds: float) -> float:
    """``seconds / floor_seconds``: a time in units of a baseline measured in the same run."""
    if not floor_seconds > 0:
        raise ValueError(f"the floor must be a positive time, got {floor_seconds}")
    return float(seconds) / float(floor_seconds)


def load_line(res: Mapping[str, Any]) -> str:
    """How shared the machine was when the run was saved (empty when the result does not say)."""
    load, m = res.get("load_average"), res.get("machine")
    if not load:
        return ""
    cpus = f" on {m['cpu_count']} CPUs" if isinstance(m, Mapping) and "cpu_count" in m else ""
    return f"Load average (1, 5, 15 min) at the end of the run: {', '.join(f'{x:g}' for x in load)}{cpus}."


def load_average() -> list[float]:
    """The 1/5/15-minute load averages (how shared the machine was), rounded."""
    return [round(x, 2) for x in os.getloadavg()]


def machine() -> dict[str, Any]:
    return {
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(),
        "python": platform.python_version(),
        "jax": jax.__version__,
        "backend": jax.default_backend(),
        "devices": [str(d) for d in jax.devices()],
    }


# ----------------------------------------------------------------------------- reporting


def record_arguments(args: Sequence[str]) -> None:
    """The arguments the recorded command shows from now on (a result combined from parts records
    the command that measures all of it, not the files it was combined from)."""
    global _extra
    _extra = list(args)


def command(name: str, quick: bool) -> str:
    """The command that ran: ``python -m benchmarks NAME`` (``name`` if unknown), --quick, other arguments."""
    import shlex

    extra = "".join(f" {shlex.quote(a)}" for a in _extra)
    return f"python -m benchmarks {_script or name}" + (" --quick" if quick else "") + extra


def stem(name: str, quick: bool) -> str:
    """The file stem of a script's results: ``<name>`` or ``<name>_quick``."""
    return f"{name}_quick" if quick else name


def markdown_table(headers: list[str], rows: list[list[Any]]) -> str:
    def fmt(v):
        if isinstance(v, float):
            return f"{v:.3g}" if abs(v) < 1000 else f"{v:.0f}"
        return str(v)

    out = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    out += ["| " + " | ".join(fmt(v) for v in r) + " |" for r in rows]
    return "\n".join(out) + "\n"


def mean_std(values: Sequence[float]) -> tuple[float, float]:
    """Mean and sample standard deviation (0 for a single value).

    Non-finite values (an epsilon of inf without DP, a perplexity that overflowed): the mean is
    ``fmean``'s (inf, or nan for inf and -inf), the std 0 when every value is the same and nan
    otherwise (``statistics.stdev`` raises on inf).
    """
    vals = [float(v) for v in values]
    if len(vals) < 2:
        return statistics.fmean(vals), 0.0
    if not all(math.isfinite(v) for v in vals):
        return statistics.fmean(vals), (0.0 if len(set(vals)) == 1 else math.nan)
    return statistics.fmean(vals), statistics.stdev(vals)


def pm(values: Sequence[float], digits: int = 3) -> str:
    """``mean ± std`` over seeds (just the value for one seed)."""
    m, s = mean_std(values)
    return f"{m:.{digits}f}" if len(values) == 1 else f"{m:.{digits}f} ± {s:.{digits}f}"


def header(title: str, name: str, quick: bool, settings: Mapping[str, Any]) -> list[str]:
    """Top of a result markdown: title, command, machine and settings."""
    m = machine()
    lines = [f"# {title}", "", f"Command: `{command(name, quick)}`", ""]
    lines.append(
        f"Machine: {m['processor']}, {m['cpu_count']} cores, {m['platform']}, python {m['python']}, "
        f"jax {m['jax']} ({m['backend']})."
    )
    lines.append("")
    lines.append("Settings: " + "; ".join(f"{k} = {v}" for k, v in settings.items()) + ".")
    lines.append("")
    return lines


def write_results(
    name: str, payload: dict[str, Any], markdown: str, out: Path | str | None = None
) -> tuple[Path, Path]:
    """Write ``<out>/<name>.json`` (atomically, strict JSON) and ``<out>/<name>.md``."""
    folder = results_folder(out)
    jpath = folder / f"{name}.json"
    mpath = folder / f"{name}.md"
    tmp = jpath.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(_strict_json(payload), indent=2, default=float))
    tmp.replace(jpath)
    mpath.write_text(markdown)
    return jpath, mpath


def save(
    name: str,
    quick: bool,
    payload: dict[str, Any],
    markdown: str,
    *,
    out: Path | str | None = None,
    settings: Mapping[str, Any] | None = None,
    benchmark: str | None = None,
) -> tuple[Path, Path]:
    """Write ``<name>[_quick].json`` / ``.md`` with the command, machine and settings record added.

    ``benchmark``: the benchmark's name where the results' name differs (for the command).
    """
    cmd = command(benchmark or name, quick)
    record: dict[str, Any] = {"command": cmd, "argv": sys.argv, "machine": machine()}
    record["date"] = time.strftime("%Y-%m-%d", time.gmtime())  # UTC; the published pages show it
    record["load_average"] = load_average()
    if settings is not None:
        record["settings"] = dict(settings)
    return write_results(stem(name, quick), {**record, **payload}, markdown, out)


def _strict_json(x: Any) -> Any:
    """Non-finite floats as the strings "inf", "-inf", "nan": json.dumps would write Infinity/NaN,
    which is not JSON and which strict readers (jq, JavaScript) reject."""
    if isinstance(x, Mapping):
        return {str(k): _strict_json(v) for k, v in x.items()}
    if isinstance(x, list | tuple):
        return [_strict_json(v) for v in x]
    if isinstance(x, Path):
        return str(x)
    if isinstance(x, np.ndarray):
        return _strict_json(x.tolist())
    if isinstance(x, np.integer):
        return int(x)
    if isinstance(x, float | np.floating):
        return float(x) if np.isfinite(x) else str(float(x))
    return x


def pyplot():
    """matplotlib's pyplot on the Agg backend (no display on the benchmark machines)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_path(name: str, quick: bool, suffix: str = "", out: Path | str | None = None) -> Path:
    """``<out>/<name>[_quick]<suffix>.png``, the folder created."""
    return results_folder(out) / f"{stem(name, quick)}{suffix}.png"


# ----------------------------------------------------------------------------- the task (--task)

QUALITY_TASKS = ("digits", "fashion_mnist")
_task_name = "digits"  # the --task of the script running in this process (one script per process)


def add_task_option(parser: Any) -> None:
    """``--task digits|fashion_mnist`` (Fashion-MNIST reads the IDX files of ``make data``)."""
    parser.add_argument(
        "--task", default="digits", choices=QUALITY_TASKS, help="dataset (fashion_mnist needs `make data`)"
    )


def use_task(name: str, result_name: str) -> str:
    """Select the task :func:`make_task` builds; the results' name (``result_name[_<task>]``)."""
    global _task_name
    if name not in QUALITY_TASKS:
        raise ValueError(f"--task must be one of {QUALITY_TASKS}, got {name!r}")
    _task_name = name
    return result_name if name == "digits" else f"{result_name}_{name}"


def make_task(**options: Any) -> Task:
    """The selected task with the script's model options (``hidden`` = the MLP's hidden widths)."""
    from strategies.registry import resolve_task

    task = DigitsTask(**options) if _task_name == "digits" else resolve_task(_task_name, options)
    # These scripts read the general pool as the whole training split and cut their own nodes
    # from it: no public pool apart, the general pool every training row.
    return with_public_pool(task, 0.0, "union")


# ----------------------------------------------------------------------------- data


def shared_pool(data: TaskData, num_nodes: int) -> NodeData:
    """Every one of ``num_nodes`` nodes draws from the whole general (training) pool.

    ``TaskData.everything`` has one row per *hosted* node of the split; this gives any
    node count, for fine-tuning many copies of one model on the same data.
    """
    n_g = len(data.general_groups)
    index = np.broadcast_to(np.arange(n_g, dtype=np.int32), (num_nodes, n_g)).copy()
    return NodeData(dict(data.general), index, np.full((num_nodes,), n_g, np.int32), shared=True)


def iid_clients(data: TaskData, num_clients: int, rng: np.random.Generator) -> NodeData:
    """The general pool cut into ``num_clients`` disjoint random shards of (almost) equal size.

    Each client may only draw its own rows (a shared pool plus an index table, so the
    pixels are stored once however many clients there are).
    """
    n_g = len(data.general_groups)
    if num_clients > n_g:
        raise ValueError(f"{num_clients} clients but only {n_g} training examples")
    parts = np.array_split(rng.permutation(n_g), num_clients)
    index, count = pad_index_table(parts)
    return NodeData(dict(data.general), index, count, shared=True, name="clients")


def subset(batch: Batch, rows: np.ndarray) -> dict[str, np.ndarray]:
    return {k: np.asarray(v)[rows] for k, v in batch.items()}


# ----------------------------------------------------------------------------- training


@functools.lru_cache(maxsize=16)
def trainer_for(task: Task, optimizer: str, batch_size: int, **defaults: float) -> NodeTrainer:
    """One NodeTrainer per (task, optimizer, batch size), so repeated runs reuse its compiled steps.

    ``optimizer`` names an optax factory ("adam", "adamw", "sgd"); hyperparameters that vary
    between runs go to ``fit(..., hyperparams=...)`` (they are arguments, not constants).
    """
    return NodeTrainer(task, getattr(optax, optimizer), dict(defaults) or {"learning_rate": 1e-3}, batch_size)


def pretrain(
    task: Task, data: NodeData, key: jax.Array, steps: int, learning_rate: float, batch_size: int = 32
) -> PyTree:
    """One model trained from a fresh init with Adam on ``data`` (a one-node NodeData)."""
    trainer = trainer_for(task, "adam", batch_size)
    k_init, k_train = jax.random.split(key)
    state = trainer.init(k_train, task.init(k_init), 1)
    state, _ = trainer.fit(state, data, steps, hyperparams={"learning_rate": learning_rate})
    return unstack(state.params)[0]


def unstack(stacked: PyTree) -> list[PyTree]:
    """The n single trees of a stacked tree."""
    n = int(jax.tree_util.tree_leaves(stacked)[0].shape[0])
    return [jax.tree.map(lambda x, i=i: x[i], stacked) for i in range(n)]


# ----------------------------------------------------------------------------- evaluation


@functools.lru_cache(maxsize=16)
def _metrics_jit(task: Task):
    return jax.jit(task.metrics)


def metrics(task: Task, params: PyTree, batch: Batch) -> dict[str, float]:
    """``task.metrics`` of one params tree on one batch, as Python floats."""
    out = _metrics_jit(task)(params, {k: jnp.asarray(v) for k, v in batch.items()})
    return {k: float(v) for k, v in out.items()}


@functools.lru_cache(maxsize=16)
def _stacked_metrics_jit(task: Task):
    return jax.jit(jax.vmap(task.metrics, in_axes=(0, None)))


def stacked_metrics(task: Task, stacked: PyTree, batch: Batch) -> dict[str, np.ndarray]:
    """``task.metrics`` of every node of a stacked tree on one batch: ``{metric: (n,) float64}``."""
    out = _stacked_metrics_jit(task)(stacked, {k: jnp.asarray(v) for k, v in batch.items()})
    return {k: np.asarray(v, np.float64) for k, v in out.items()}


@functools.lru_cache(maxsize=16)
def _class_probs_jit(task: Task):
    def probs(stacked, x):
        return jax.vmap(lambda p: jax.nn.softmax(task.apply(p, x).astype(jnp.float32), axis=-1))(stacked)

    return jax.jit(probs)


def class_probs(task: Task, stacked: PyTree, x: Any) -> np.ndarray:
    """(n, m, C) float64 predictive distribution of every node on the inputs ``x``."""
    return np.asarray(_class_probs_jit(task)(stacked, jnp.asarray(x)), np.float64)


def true_label_probs(probs: np.ndarray, y: Any) -> np.ndarray:
    """(n, m): each node's probability of the true label (the mixture-NLL weights' input)."""
    y = np.asarray(y)
    return probs[:, np.arange(len(y)), y]


def mixture_metrics(weights: np.ndarray, probs: np.ndarray, y: Any) -> dict[str, float]:
    """Loss and accuracy of the mixture of the nodes' predictions, ``sum_i w_i p_i(. | x)``."""
    y = np.asarray(y)
    mix = np.tensordot(np.asarray(weights, np.float64), probs, axes=1)
    loss = -np.mean(np.log(np.maximum(mix[np.arange(len(y)), y], 1e-12)))
    return {"loss": float(loss), "accuracy": float(np.mean(mix.argmax(-1) == y))}


@functools.lru_cache(maxsize=16)
def single_logits(task: Task):
    """``logits_fn(params, x) -> (C,)`` for one input, one object per task (a static jit argument)."""

    def logits_fn(params, x):
        return task.apply(params, x[None])[0]

    return logits_fn


# ----------------------------------------------------------------------------- cross-device clients

# The digits task's own split gives every node a Dirichlet shard of at least 8 examples, so it
# cannot make more than ~150 nodes out of its 1,257 training examples; the client-sampling
# benchmarks (rounds --cross-device, privacy_sampled, robustness_sampled) need thousands of
# clients of a few examples, as the privacy benchmark's 400 clients (:func:`iid_clients`), as a
# task the system trains on (``MetaConsensus(cfg, task=ManyClientDigits(...))``).


@dataclasses.dataclass(frozen=True)
class ManyClientDigits(DigitsTask):
    """Digits cut into ``num_nodes`` disjoint IID random shards of the private training rows
    (about 1131 / n examples each, at least one; ``seed`` draws the shards); the general pool is
    the task's public pool, apart from every shard."""

    name: str = "digits_many_clients"

    def splits(
        self,
        num_nodes: int,
        *,
        seed: int = 0,
        alpha: float = 0.5,
        process_index: int = 0,
        process_count: int = 1,
    ) -> TaskData:
        del alpha  # IID shards: the client's few examples are a random draw of the training split
        if process_count != 1:
            raise ValueError("ManyClientDigits runs in one process")
        whole = DigitsTask.splits(self, 1, seed=seed)
        rows = int(whole.train_count[0])  # one node: every private training row
        x, y = whole.train["x"][0, :rows], whole.train["y"][0, :rows]
        if num_nodes > len(y):
            raise ValueError(f"{num_nodes} clients but only {len(y)} training examples")
        parts = np.array_split(np.random.default_rng(seed).permutation(len(y)), num_nodes)
        size = max(len(p) for p in parts)
        counts = np.array([len(p) for p in parts], np.int32)
        train_groups = pad_stack([y[p].astype(np.int32) for p in parts], size)
        for i, c in enumerate(counts):
            train_groups[i, c:] = -1
        groups = np.stack([dominant_groups(y[p], NUM_CLASSES, mass=self.dominant_mass) for p in parts])
        return dataclasses.replace(
            whole,
            num_nodes=num_nodes,
            node_ids=np.arange(num_nodes),
            train={"x": pad_stack([x[p] for p in parts], size), "y": pad_stack([y[p] for p in parts], size)},
            train_count=counts,
            train_groups=train_groups,
            node_groups=groups,
            meta={},
        )
