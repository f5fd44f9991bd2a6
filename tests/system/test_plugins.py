"""Plug-ins: a user's module outside the package declares a rule, an attack, a node strategy, a
weight objective, a task and a merge method, which then run from the CLI and from Python.

Each test writes its plug-in into ``tmp_path`` and runs from there, the way a user does: the
current directory is importable without ``PYTHONPATH``. A plug-in's entries leave a line in a
marks file when the system builds or calls them, so the tests see that the run used them.
In-process tests remove what they declared afterwards (the ``workdir`` fixture).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import tomllib
from pathlib import Path

import jax
import numpy as np
import pytest

from consensus import io
from consensus.specs import RULES
from meta_consensus import MetaConsensus, cli, config
from meta_consensus.config import ConfigError
from meta_consensus.objectives import OBJECTIVES
from strategies.registry import ATTACKS, STRATEGIES, TASKS, resolve_task

REPO = Path(__file__).resolve().parents[2]
REGISTRIES = (RULES, ATTACKS, STRATEGIES, TASKS, OBJECTIVES)

# One entry per family, each named with TAG so that in-process tests never collide.
PLUGIN = '''
"""A user's plug-in: one declared entry per family; each marks marks_TAG.txt when used."""

import dataclasses
import os
from typing import NamedTuple

import flax.nnx as nnx
import jax
import jax.numpy as jnp
import numpy as np

from consensus.base import AggregationInfo, Aggregator, empty_info
from consensus.specs import RULES
from meta_consensus.objectives import OBJECTIVES
from strategies.attacks import ATTACKS
from strategies.node import STRATEGIES, NodeSettings
from strategies.tasks import task_from_arrays
from strategies.tasks.base import TASKS

MARKS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "marks_TAG.txt")


def _mark(what):
    with open(MARKS, "a") as fh:
        fh.write(what + "\\n")


class _State(NamedTuple):
    info: AggregationInfo


def _valid(stacked, mask):
    leaves = jax.tree.leaves(stacked)
    n = leaves[0].shape[0]
    valid = jnp.ones((n,), bool) if mask is None else jnp.asarray(mask, bool)
    for x in leaves:
        valid = valid & jnp.all(jnp.isfinite(x.reshape(n, -1)), axis=1)
    return valid, valid.astype(jnp.float32) / jnp.maximum(valid.sum(), 1).astype(jnp.float32)


def _mean(stacked, w, valid):
    def leaf(x):
        rows = jnp.where(valid.reshape((-1,) + (1,) * (x.ndim - 1)), x.astype(jnp.float32), 0.0)
        return jnp.tensordot(w, rows, axes=1).astype(x.dtype)

    return jax.tree.map(leaf, stacked)


@RULES.declare(kind="coordinatewise")
def rule_TAG() -> Aggregator:
    """The mean of the finite nodes (a plug-in's rule)."""
    _mark("rule")

    def update(stacked, state, params=None, *, mask=None, **extra):
        valid, w = _valid(stacked, mask)
        return _mean(stacked, w, valid), _State(AggregationInfo(valid, valid, w, True))

    return Aggregator(lambda params=None: _State(empty_info()), update, "rule_TAG")


@RULES.declare(kind="merge", needs=("params",))
def merge_TAG(scale: float = 1.0) -> Aggregator:
    """The base plus ``scale`` times the mean task vector (a plug-in's merge method)."""

    def update(stacked, state, params=None, *, mask=None, **extra):
        valid, w = _valid(stacked, mask)
        deltas = jax.tree.map(lambda x, p: x - p[None], stacked, params)
        mean = _mean(deltas, w, valid)
        merged = jax.tree.map(lambda p, d: p + scale * d, params, mean)
        return merged, _State(AggregationInfo(valid, valid, w, True))

    return Aggregator(lambda params=None: _State(empty_info()), update, "merge_TAG")


@ATTACKS.declare(kind="update")
def attack_TAG(key, honest, num_byzantine, scale: float = 1.0, num_nodes=None):
    """Every Byzantine node sends minus ``scale`` times the first honest update (a plug-in's attack)."""
    _mark(f"attack num_nodes={num_nodes} scale={scale}")
    return jax.tree.map(lambda x: jnp.broadcast_to(-scale * x[0], (num_byzantine, *x.shape[1:])), honest)


@ATTACKS.declare(kind="data")
def data_TAG(task, batch, label: int = 0):
    """Every label set to ``label`` (a plug-in's data attack); marks once per trace."""
    _mark(f"data attack label={label}")
    return {**batch, "y": jnp.full_like(batch["y"], label)}


@STRATEGIES.declare("strategy_TAG")
@dataclasses.dataclass(frozen=True)
class ScaledLocal:
    """Local training at a scaled learning rate (a plug-in's node strategy)."""

    lr_scale: float = 0.5
    name: str = "strategy_TAG"

    def settings(self, local_steps, learning_rate):
        _mark(f"strategy lr_scale={self.lr_scale}")
        return NodeSettings((0, 0, local_steps), (learning_rate * self.lr_scale,) * 3)

    def submit(self, final, snapshots, evaluate, scores=None):
        return final


@OBJECTIVES.declare("objective_TAG")
def objective_TAG(cfg, task, heldout):
    """Keep the vote's own output (a plug-in's weight objective)."""
    _mark("objective")
    return None


class TinyMLP(nnx.Module):
    def __init__(self, rngs, width):
        self.hidden = nnx.Linear(4, width, rngs=rngs)
        self.out = nnx.Linear(width, 3, rngs=rngs)

    def __call__(self, x):
        return self.out(nnx.relu(self.hidden(x)))


def make_blobs(width: int = 8):
    rng = np.random.default_rng(0)
    centres = rng.normal(scale=3.0, size=(3, 4))
    y = rng.integers(0, 3, size=240)
    x = (centres[y] + rng.normal(size=(240, 4))).astype(np.float32)
    return task_from_arrays(lambda rngs: TinyMLP(rngs, width), x, y.astype(np.int32), name="blobs_TAG")


@TASKS.declare("task_TAG")
def task_TAG(width: int = 8):
    """Gaussian blobs and a tiny MLP (a plug-in's task)."""
    _mark(f"task width={width}")
    return make_blobs(width)
'''


def plugin_source(tag: str) -> str:
    return textwrap.dedent(PLUGIN).replace("TAG", tag)


def tiny(tag: str) -> list[str]:
    """One round of 4 nodes, every family from the plug-in, an attacker on node 3."""
    return [
        "rounds=1",
        "checkpoint_every=1",
        "baseline_fedavg=false",
        f"task.name=task_{tag}",
        "task.options.width=6",
        "task.alpha=5.0",
        "nodes.count=4",
        f"nodes.strategies=strategy_{tag}",
        f"nodes.options.strategy_{tag}.lr_scale=0.25",
        "nodes.local_steps=2",
        "byzantine.nodes=[3]",
        f"byzantine.attack=attack_{tag}",
        "byzantine.options={scale = 2.0}",
        f"vote.rule=rule_{tag}",
        f"weights.objective=objective_{tag}",
        "dp.enabled=false",
    ]


def marks(directory: Path, tag: str) -> list[str]:
    return (directory / f"marks_{tag}.txt").read_text().splitlines()


def assert_every_family_ran(directory: Path, tag: str) -> None:
    got = set(marks(directory, tag))
    # num_nodes is filled in because the attack declares it among its parameters.
    want = {"rule", "objective", "task width=6", "strategy lr_scale=0.25", "attack num_nodes=4 scale=2.0"}
    assert want <= got, got


@pytest.fixture
def workdir(tmp_path, monkeypatch):
    """tmp_path as the current directory; afterwards the plug-ins' entries and modules are gone."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", list(sys.path))  # make_cwd_importable adds tmp_path
    before = {id(r): set(r) for r in REGISTRIES}
    modules = set(sys.modules)
    try:
        yield tmp_path
    finally:
        for r in REGISTRIES:
            for name in set(r) - before[id(r)]:
                r.unregister(name)
        for name in set(sys.modules) - modules:
            if getattr(sys.modules[name], "__file__", "") and str(tmp_path) in sys.modules[name].__file__:
                del sys.modules[name]


@pytest.mark.slow
def test_cli_runs_every_family_of_a_plugin_from_the_current_directory(tmp_path):
    (tmp_path / "my_plugin.py").write_text(plugin_source("cli"))
    sets = [*tiny("cli"), "output_dir=runs", "name=plugged"]
    argv = [sys.executable, "-m", "meta_consensus", "run", "--quiet", "--plugin", "my_plugin"]
    argv += sum((["--set", s] for s in sets), [])
    # The package is importable through PYTHONPATH; the plug-in only through the current directory.
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.run(argv, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert_every_family_ran(tmp_path, "cli")
    run_dir = tmp_path / "runs" / "plugged"
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 1 and rows[0]["ok"]
    assert rows[0]["accepted"] == [True, True, True, True]  # the plug-in's rule keeps every finite node
    # The run's config lists the plug-in, so repeating or resuming from it loads it again.
    assert tomllib.loads((run_dir / "config.toml").read_text())["plugins"] == ["my_plugin"]


@pytest.mark.slow
def test_python_api_runs_a_plugin_and_the_written_config_loads_it(workdir):
    (workdir / "plugin_api.py").write_text(plugin_source("api"))
    with pytest.raises(ConfigError, match="vote.rule = 'rule_api' is not valid"):
        config.load(None, ["vote.rule=rule_api"])  # not declared before the plug-in is loaded
    sets = [*tiny("api"), "checkpoint_every=0", "output_dir=runs", "name=api"]
    cfg = config.load(None, sets, plugins=["plugin_api"])
    assert cfg.plugins == ("plugin_api",)
    result = MetaConsensus(cfg, progress=False).train()
    assert result.succeeded == 1
    assert_every_family_ran(workdir, "api")
    again = config.load(workdir / "runs" / "api" / "config.toml")
    assert again == cfg and again.plugins == ("plugin_api",)
    # --plugin and the config's list together name each module once.
    assert config.load(None, [*tiny("api"), "plugins=['plugin_api']"], plugins=["plugin_api"]).plugins == (
        "plugin_api",
    )


def test_a_task_import_path_is_found_in_the_current_directory(workdir):
    (workdir / "cwd_tasks.py").write_text(plugin_source("cwd"))
    assert str(workdir) not in sys.path
    task = resolve_task("cwd_tasks:make_blobs", {"width": 5})
    assert task.name == "blobs_cwd"
    assert jax.tree.leaves(task.init(jax.random.key(0)))[0].shape[-1] in (3, 5)


def test_merge_with_a_plugin_merge_method(workdir, capsys):
    (workdir / "plugin_merge.py").write_text(plugin_source("merge"))
    rng = np.random.default_rng(0)
    base = {"w": rng.normal(size=(3, 4)).astype(np.float32), "b": rng.normal(size=(4,)).astype(np.float32)}
    models = [jax.tree.map(lambda v: (v + 0.1 * rng.normal(size=v.shape)).astype(np.float32), base)]
    models += [jax.tree.map(lambda v: (v + 0.1 * rng.normal(size=v.shape)).astype(np.float32), base)]
    inputs = [str(io.save_safetensors(m, workdir / f"in{i}.safetensors")) for i, m in enumerate(models)]
    base_path = str(io.save_safetensors(base, workdir / "base.safetensors"))
    argv = ["merge", "--plugin", "plugin_merge", "--method", "merge_merge", "--set", "method.scale=0.5"]
    argv += ["--quiet", "--base", base_path, "--out", "merged", *inputs]
    assert cli.main(argv) == 0, capsys.readouterr().err
    got = io.flatten(io.load_safetensors(workdir / "merged"))
    for k, b in io.flatten(base).items():
        want = b + 0.5 * np.mean([io.flatten(m)[k] - b for m in models], axis=0)
        np.testing.assert_allclose(got[k], want, rtol=1e-6, atol=1e-6, err_msg=k)


def test_merge_config_names_its_plugins(workdir, capsys):
    (workdir / "plugin_toml.py").write_text(plugin_source("toml"))
    rng = np.random.default_rng(1)
    base = {"w": rng.normal(size=(3, 4)).astype(np.float32)}
    models = [{"w": (base["w"] + 0.1 * rng.normal(size=(3, 4))).astype(np.float32)} for _ in range(2)]
    inputs = [str(io.save_safetensors(m, workdir / f"in{i}.safetensors")) for i, m in enumerate(models)]
    io.save_safetensors(base, workdir / "base.safetensors")
    plan = textwrap.dedent(
        f"""
        plugins = ["plugin_toml"]
        method = "merge_toml"
        inputs = {json.dumps(inputs)}
        base = "base.safetensors"
        out = "merged"
        [params]
        scale = 0.5
        """
    )
    (workdir / "plan.toml").write_text(plan)
    assert "merge_toml" not in RULES  # declared only once the plan's plug-in is imported
    assert cli.main(["merge", "--quiet", "--config", "plan.toml"]) == 0, capsys.readouterr().err
    got = io.flatten(io.load_safetensors(workdir / "merged"))["w"]
    want = base["w"] + 0.5 * np.mean([m["w"] - base["w"] for m in models], axis=0)
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)
    report = json.loads((workdir / "merged" / "merge_report.json").read_text())
    assert report["plugins"] == ["plugin_toml"] and report["method"] == "merge_toml"
    # A missing module in the file is one line, exit 2, and nothing is written.
    (workdir / "missing.toml").write_text(
        plan.replace("plugin_toml", "no_such_module").replace("merged", "o")
    )
    err = _one_line_exit_2(["merge", "--quiet", "--config", "missing.toml"], capsys)
    assert "'no_such_module'" in err and "no module named" in err
    (workdir / "bad.toml").write_text(plan.replace('["plugin_toml"]', '"plugin_toml"').replace("merged", "o"))
    err = _one_line_exit_2(["merge", "--quiet", "--config", "bad.toml"], capsys)
    assert "plugins must be a list of module names" in err
    assert not (workdir / "o").exists()


def _one_line_exit_2(argv: list[str], capsys) -> str:
    try:
        rc = cli.main(argv)
    except SystemExit as e:
        rc = e.code
    err = capsys.readouterr().err.strip()
    assert rc == 2, err
    assert len(err.splitlines()) == 1, err
    return err


@pytest.mark.parametrize("command", ["run", "merge"])
def test_a_missing_or_raising_plugin_is_one_line_and_exit_2(workdir, capsys, command):
    (workdir / "raising_plugin.py").write_text('"""Fails while declaring."""\n\nraise RuntimeError("boom")\n')
    tail = (
        ["--set", "output_dir=runs"] if command == "run" else ["--method", "median", "--out", "o", "a", "b"]
    )
    err = _one_line_exit_2([command, "--plugin", "no_such_plugin", *tail], capsys)
    assert "'no_such_plugin'" in err and "no module named" in err
    err = _one_line_exit_2([command, "--plugin", "raising_plugin", *tail], capsys)
    assert f"{workdir / 'raising_plugin.py'}:3" in err and "RuntimeError: boom" in err
    assert not (workdir / "runs").exists() and not (workdir / "o").exists()


@pytest.mark.slow  # trains nodes with and without the plug-in's data attack (about 3 s)
def test_a_plugin_data_attack_poisons_what_the_byzantine_nodes_train_on(workdir):
    from meta_consensus.fleet import Fleet

    (workdir / "plugin_data.py").write_text(plugin_source("data"))
    with pytest.raises(ConfigError, match="byzantine.options") as e:
        config.load(
            None,
            [*tiny("data"), "byzantine.attack=data_data", "byzantine.options={scale = 2.0}"],
            plugins=["plugin_data"],
        )
    assert "label" in str(e.value) and len(str(e.value).splitlines()) == 1
    with pytest.raises(ConfigError, match="byzantine.options: the options of the data attack 'data_data'"):
        config.load(
            None, [*tiny("data"), "byzantine.attack=data_data", "byzantine.options={label = {a = 1}}"]
        )
    sets = [*tiny("data"), "byzantine.attack=data_data", "byzantine.options={label = 2}", "output_dir=runs"]
    cfg = config.load(None, sets, plugins=["plugin_data"])
    fleet = Fleet(cfg)
    assert fleet.byzantine.data_attack is not None and fleet.byzantine.data_attack.options == (("label", 2),)
    np.testing.assert_array_equal(fleet.byzantine.poisoned, [False, False, False, True])
    params = fleet.initial_params(jax.random.key(0))
    out = fleet.fit(fleet.init(jax.random.key(1), params), params, jax.random.key(2))
    assert out.answered.all(), out.errors
    assert "data attack label=2" in marks(workdir, "data")  # the declared attack ran in the training step
