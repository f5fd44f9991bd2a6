"""A user's own model, data and task, and the library's aggregators, used wrongly: a table of mistakes.

Every case ends in one line (on stderr with exit 2 from the CLI, or one exception message from
the Python API) naming what is wrong, before any training, and changes no file: the output
directory of the run is snapshot before and after and no run folder appears. The task
factories below are named by import path (``test_user_mistakes_model_data:labels_past_logits``),
as a user's ``my_tasks.py`` would be.
"""

from __future__ import annotations

import sys
from pathlib import Path

import flax.nnx as nnx
import jax.numpy as jnp
import numpy as np
import pytest
from system_helpers import sets, snapshot

import consensus
from consensus.base import ByzantineToleranceError
from consensus.tree import TreeMismatchError
from meta_consensus import MetaConsensus, cli, config
from strategies.registry import resolve_task
from strategies.tasks import ArrayTask, task_from_arrays
from strategies.tasks.checks import TaskError, check_task_data

THIS = Path(__file__).name
MODULE = Path(__file__).stem
CLASSES, FEATURES, ROWS = 3, 5, 120

# The cheapest valid run: the mistakes are found before the first round.
TINY = [
    "rounds=1",
    "nodes.count=4",
    "nodes.strategies=local",
    "nodes.local_steps=2",
    "byzantine.nodes=[]",
    "vote.rule=median",
    "weights.objective=uniform",
    "dp.enabled=false",
    "baseline_fedavg=false",
    "task.alpha=5.0",
]


class MLP(nnx.Module):
    def __init__(self, rngs: nnx.Rngs, features: int = FEATURES, classes: int = CLASSES):
        self.hidden = nnx.Linear(features, 8, rngs=rngs)
        self.out = nnx.Linear(8, classes, rngs=rngs)

    def __call__(self, x):
        return self.out(nnx.relu(self.hidden(x)))


class Flat(MLP):
    def __call__(self, x):
        return super().__call__(x).sum(-1)  # (B,), not (B, C) logits


class Broken(MLP):
    def __call__(self, x):
        raise RuntimeError("the forward pass of the user's model breaks")


def data(rows: int = ROWS) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(0)
    y = np.arange(rows) % CLASSES
    return rng.normal(size=(rows, FEATURES)).astype(np.float32) + y[:, None], y.astype(np.int32)


def mlp(features: int = FEATURES, classes: int = CLASSES):
    return lambda rngs: MLP(rngs, features, classes)


# --------------------------------------------------------------- factories named by import path


def good():
    return task_from_arrays(mlp(), *data())


def labels_past_logits():
    x, y = data()
    y[7] = 7  # label 7, three logits
    return task_from_arrays(mlp(), x, y)


def nan_features():
    x, y = data()
    x[12, 3] = np.nan
    return task_from_arrays(mlp(), x, y)


def inf_features():
    x, y = data()
    x[40, 0] = -np.inf
    return task_from_arrays(mlp(), x, y)


def two_logits_three_classes():
    return task_from_arrays(mlp(classes=2), *data())


def wrong_input_width():
    return task_from_arrays(mlp(features=20), *data())


def num_classes_mismatch():
    return task_from_arrays(mlp(), *data(), num_classes=4)


def negative_labels():
    x, y = data()
    y[3] = -1
    return task_from_arrays(mlp(), x, y)


def float_labels():
    x, y = data()
    return task_from_arrays(mlp(), x, y.astype(np.float32))


def ragged_arrays():
    x, y = data()
    return task_from_arrays(mlp(), x, y[:-1])


def factory_raises():
    raise FileNotFoundError("my_data.csv")


def constructor_raises():
    def make(rngs):
        raise ValueError("the user's constructor breaks")

    return task_from_arrays(make, *data())


def forward_raises():
    return task_from_arrays(lambda rngs: Broken(rngs), *data())


def not_logits():
    return task_from_arrays(lambda rngs: Flat(rngs), *data())


def _unchecked(x: np.ndarray, y: np.ndarray) -> ArrayTask:
    """A Task object built without task_from_arrays' checks (as a user's own Task class would be)."""
    checked = good()
    rows = tuple(np.asarray(r) for r in checked.split_rows)
    return ArrayTask("unchecked", checked.init_fn, checked.apply_fn, x, y, rows, CLASSES)  # type: ignore[arg-type]


def own_task_labels_past_logits():
    x, y = data()
    y[100] = 5
    return _unchecked(x, y)


def own_task_nan_features():
    x, y = data()
    x[:, 2] = np.nan
    return _unchecked(x, y)


not_a_task = object()


# --------------------------------------------------------------------------------- helpers


def _one_line(text: str) -> str:
    lines = text.strip().splitlines()
    assert len(lines) == 1, text
    assert "Traceback" not in text
    return lines[0]


@pytest.fixture
def out(tmp_path: Path, monkeypatch) -> Path:
    """An output directory (a fresh run folder would go under it) and a user's source folder as cwd."""
    runs, src = tmp_path / "runs", tmp_path / "src"
    runs.mkdir()
    src.mkdir()
    (src / "imports_badly.py").write_text("import os\n\nvalue = undefined_name + 1\n")
    (src / "declares_badly.py").write_text(
        "from strategies.tasks.base import TASKS\n\n\n"
        "@TASKS.declare('user_mistakes_declared')\n"
        "def declared():\n"
        "    raise RuntimeError('the declared factory breaks')\n"
    )
    monkeypatch.chdir(src)
    monkeypatch.setattr(sys, "dont_write_bytecode", True)
    return runs


# ------------------------------------------------------------------------- the CLI table

# (extra argv after `run --quiet` and the tiny settings, phrases the one line must contain)
CLI_CASES = [
    (sets(f"task.name={MODULE}:labels_past_logits"), ["y[7] = 7", "3 logits", "[0, 3)"]),
    (sets(f"task.name={MODULE}:nan_features"), ["x[12, 3] is nan", "finite"]),
    (sets(f"task.name={MODULE}:inf_features"), ["x[40, 0] is -inf", "finite"]),
    (sets(f"task.name={MODULE}:two_logits_three_classes"), ["= 2", "2 logits", "[0, 2)"]),
    (sets(f"task.name={MODULE}:wrong_input_width"), ["input width 20", "5 features", "(120, 5)"]),
    (sets(f"task.name={MODULE}:num_classes_mismatch"), ["3 logits", "num_classes = 4"]),
    (sets(f"task.name={MODULE}:negative_labels"), ["y[3] = -1", "non-negative"]),
    (sets(f"task.name={MODULE}:float_labels"), ["integer classes", "float32"]),
    (sets(f"task.name={MODULE}:ragged_arrays"), ["x must be (N, ...) and y (N,)"]),
    (sets(f"task.name={MODULE}:not_a_task"), ["is not a Task", "init, apply"]),
    (sets(f"task.name={MODULE}:factory_raises"), ["FileNotFoundError", "my_data.csv", f"{THIS}:"]),
    (sets(f"task.name={MODULE}:constructor_raises"), ["constructor fails", "ValueError", f"{THIS}:"]),
    (sets(f"task.name={MODULE}:forward_raises"), ["forward pass fails", "RuntimeError", f"{THIS}:"]),
    (sets(f"task.name={MODULE}:not_logits"), ["returns shape (8,)", "logits"]),
    (sets(f"task.name={MODULE}:own_task_labels_past_logits"), ["heldout y[", "= 5", "[0, 3)"]),
    (sets(f"task.name={MODULE}:own_task_nan_features"), ["is nan", "finite"]),
    (sets(f"task.name={MODULE}:good", "task.options.width=3"), ["calling good", "width"]),
    (sets(f"task.name={MODULE}:no_such_factory"), ["has no attribute 'no_such_factory'"]),
    (sets("task.name=no_such_user_module:make"), ["cannot import module 'no_such_user_module'"]),
    (sets("task.name=imports_badly:make"), ["NameError", "undefined_name", "imports_badly.py:3"]),
    (
        ["--plugin", "declares_badly", *sets("task.name=user_mistakes_declared")],
        ["its factory failed", "RuntimeError", "declares_badly.py:6"],
    ),
]


def _run(out: Path, extra: list[str], capsys) -> tuple[int | str | None, str]:
    argv = ["run", "--quiet", *sets(*TINY, f"output_dir={out}", "name=fresh"), *extra]
    rc: int | str | None
    try:
        rc = cli.main(argv)
    except SystemExit as e:
        rc = e.code
    return rc, capsys.readouterr().err


@pytest.mark.parametrize(("extra", "phrases"), CLI_CASES, ids=[" ".join(c[0])[-50:] for c in CLI_CASES])
def test_cli_mistake_is_one_line_exit_2_and_changes_nothing(out, capsys, extra, phrases):
    before = snapshot(out)
    rc, err = _run(out, extra, capsys)
    assert rc == 2, err
    line = _one_line(err)
    for phrase in phrases:
        assert phrase in line, line
    assert snapshot(out) == before
    assert not (out / "fresh").exists()


def test_cli_debug_adds_the_traceback_and_still_exits_2(out, capsys):
    rc, err = _run(out, ["--debug", *sets(f"task.name={MODULE}:factory_raises")], capsys)
    assert rc == 2
    assert "Traceback" in err and "FileNotFoundError" in err
    assert err.strip().splitlines()[-1].startswith("meta-consensus: task")
    assert not (out / "fresh").exists()


# ------------------------------------------------------------------ the Python API table


def _api_task_from_arrays(kind: str):
    x, y = data()
    if kind == "heldout nan":
        hx, hy = data(30)
        hx[4, 1] = np.nan
        return task_from_arrays(mlp(), x, y, heldout=(hx, hy), test=data(30))
    if kind == "test labels":
        tx, ty = data(30)
        ty[9] = 3
        return task_from_arrays(mlp(), x, y, heldout=data(30), test=(tx, ty))
    if kind == "built module":
        return task_from_arrays(MLP(nnx.Rngs(0)), x, y)
    raise AssertionError(kind)


API_CASES = [
    (labels_past_logits, TaskError, ["task_from_arrays: y[7] = 7", "3 logits"]),
    (nan_features, TaskError, ["task_from_arrays: x[12, 3] is nan"]),
    (two_logits_three_classes, TaskError, ["2 logits", "[0, 2)"]),
    (wrong_input_width, TaskError, ["input width 20", "5 features"]),
    (lambda: _api_task_from_arrays("heldout nan"), TaskError, ["heldout x[4, 1] is nan"]),
    (lambda: _api_task_from_arrays("test labels"), TaskError, ["test y[9] = 3", "[0, 3)"]),
    (lambda: _api_task_from_arrays("built module"), TypeError, ["constructor of the NNX module"]),
    (lambda: resolve_task(f"{MODULE}:factory_raises"), TaskError, ["FileNotFoundError", f"{THIS}:"]),
    (lambda: resolve_task(f"{MODULE}:not_a_task"), TypeError, ["is not a Task"]),
]


@pytest.mark.parametrize(("call", "error", "phrases"), API_CASES, ids=[p[0] for _, _, p in API_CASES])
def test_api_mistake_is_one_line(out, call, error, phrases):
    before = snapshot(out)
    with pytest.raises(error) as info:
        call()
    line = _one_line(str(info.value))
    for phrase in phrases:
        assert phrase in line, line
    assert snapshot(out) == before


@pytest.mark.parametrize(
    ("task", "phrase"),
    [
        (own_task_labels_past_logits, "labels must be integers in [0, 3)"),
        (lambda: not_a_task, "is not a Task"),
    ],
    ids=["labels past the logits", "not a task"],
)
def test_api_system_refuses_a_bad_task_object_before_training(out, task, phrase):
    cfg = config.load(None, [*TINY, f"output_dir={out}", "name=fresh"])
    with pytest.raises(TaskError) as info:
        MetaConsensus(cfg, task=task(), progress=False).train()
    assert phrase in _one_line(str(info.value))
    assert not (out / "fresh").exists()


def test_a_good_task_passes_its_checks():
    task = resolve_task(f"{MODULE}:good")
    check_task_data(task, task.splits(4, seed=0, alpha=5.0))


# --------------------------------------------------------------------- library misuse


def _trees(n: int = 5, nan: bool = False) -> list[dict]:
    value = jnp.nan if nan else 1.0
    return [{"w": jnp.full((4,), value * i), "b": jnp.full((4,), value)} for i in range(n)]


def _update(agg, stacked):
    return agg.update(stacked, agg.init(None))


LIBRARY_CASES = [
    (lambda: _update(consensus.median(), _trees()), TreeMismatchError,
     ["got a list of 5 trees", "consensus.stack"]),
    (lambda: _update(consensus.krum(num_byzantine=1), tuple(_trees())), TreeMismatchError,
     ["got a tuple of 5 trees"]),
    (lambda: _update(consensus.median(), {"w": jnp.ones((5, 2)), "b": jnp.ones((4,))}), TreeMismatchError,
     ["leaves disagree on the node axis size", "same size n"]),
    (lambda: _update(consensus.median(), consensus.stack(_trees(nan=True))), ByzantineToleranceError,
     ["n=0 valid nodes", "All 5 nodes hold NaN or Inf"]),
    (lambda: _update(consensus.mean(), consensus.stack(_trees(nan=True))), ByzantineToleranceError,
     ["All 5 nodes hold NaN or Inf"]),
    (lambda: _update(consensus.trimmed_mean(num_byzantine=1), consensus.stack(_trees(nan=True))),
     ByzantineToleranceError, ["All 5 nodes hold NaN or Inf"]),
]  # fmt: skip


@pytest.mark.parametrize(("call", "error", "phrases"), LIBRARY_CASES, ids=[p[0] for _, _, p in LIBRARY_CASES])
def test_library_misuse_is_named_in_one_line(call, error, phrases):
    with pytest.raises(error) as info:
        call()
    line = _one_line(str(info.value))
    for phrase in phrases:
        assert phrase in line, line


def test_case_count():
    assert len(CLI_CASES) + 1 + len(API_CASES) + 2 + len(LIBRARY_CASES) >= 22
