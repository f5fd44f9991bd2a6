"""A plug-in's vector rule meets the merge contract (its output is its reported weighting) at load time."""

from __future__ import annotations

import sys

import numpy as np
import pytest

from consensus import io, registry
from consensus.plugins import PluginError, check_vector_rule, load_plugins
from consensus.specs import RULES
from meta_consensus import cli
from meta_consensus.merge.plan import merge_methods

# A vector rule: the mean of the first two valid rows, reporting ``reported`` as its weights and
# ``linear`` as its linearity; the declaration's traits are ``traits``.
PLUGIN = '''
"""A user's vector rule."""

from typing import NamedTuple

import jax
import jax.numpy as jnp

from consensus.base import AggregationInfo, Aggregator, empty_info
from consensus.specs import RULES


class _State(NamedTuple):
    info: AggregationInfo


@RULES.declare(kind="vector", traits=TRAITS)
def NAME() -> Aggregator:
    """The mean of the first two rows."""

    def update(stacked, state, params=None, *, mask=None, **extra):
        n = jax.tree.leaves(stacked)[0].shape[0]
        valid = jnp.ones((n,), bool)
        used = jnp.zeros((n,), jnp.float32).at[:2].set(0.5)
        reported = REPORTED
        merged = jax.tree.map(lambda x: jnp.tensordot(used, x, axes=1), stacked)
        return merged, _State(AggregationInfo(valid, valid, reported, LINEAR))

    return Aggregator(lambda params=None: _State(empty_info()), update, "NAME")
'''

GOOD = {"TRAITS": "{}", "REPORTED": "used", "LINEAR": "True"}
CASES = {
    # weights that are not the ones its output uses
    "lying_weights": ({"REPORTED": "jnp.full((n,), 1.0 / n, jnp.float32)"}, "is not sum_i weights[i] x_i"),
    # an output it says is no weighting, without declaring so
    "undeclared_nonlinear": ({"LINEAR": "False"}, "says linear=False"),
}


def _source(name: str, **changes: str) -> str:
    text = PLUGIN
    for key, value in {**GOOD, **changes}.items():
        text = text.replace(key, value)
    return text.replace("NAME", name)


@pytest.fixture
def workdir(tmp_path, monkeypatch):
    """tmp_path as the current directory; afterwards the plug-ins' rules and modules are gone."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", list(sys.path))
    before, modules = set(RULES), set(sys.modules)
    try:
        yield tmp_path
    finally:
        for name in set(RULES) - before:
            RULES.unregister(name)
        for name in set(sys.modules) - modules:
            if str(tmp_path) in (getattr(sys.modules[name], "__file__", "") or ""):
                del sys.modules[name]


def _inputs(directory, k=3):
    rng = np.random.default_rng(0)
    paths = []
    for i in range(k):
        tree = {
            "w": rng.normal(size=(4, 3)).astype(np.float32),
            "b": rng.normal(size=(3,)).astype(np.float32),
        }
        paths.append(str(io.save_safetensors(tree, directory / f"in{i}.safetensors")))
    return paths


@pytest.mark.parametrize("case", sorted(CASES))
def test_a_vector_rule_breaking_the_contract_fails_its_plugins_load_in_one_line(workdir, capsys, case):
    changes, needle = CASES[case]
    (workdir / f"plugin_{case}.py").write_text(_source(f"rule_{case}", **changes))
    argv = ["merge", "--quiet", "--plugin", f"plugin_{case}", "--method", f"rule_{case}", "--out", "o"]
    try:
        rc = cli.main([*argv, *_inputs(workdir)])
    except SystemExit as e:
        rc = e.code
    err = capsys.readouterr().err.strip()
    assert rc == 2 and len(err.splitlines()) == 1, err
    assert f"plug-in 'plugin_{case}'" in err and f"vector rule 'rule_{case}'" in err and needle in err
    assert not (workdir / "o").exists()


def test_a_vector_rule_meeting_the_contract_loads_and_merges(workdir, capsys):
    (workdir / "plugin_good.py").write_text(_source("rule_good"))
    inputs = _inputs(workdir)
    argv = ["merge", "--quiet", "--plugin", "plugin_good", "--method", "rule_good", "--out", "merged"]
    assert cli.main([*argv, *inputs]) == 0, capsys.readouterr().err
    got = io.flatten(io.load_safetensors(workdir / "merged"))
    trees = [io.flatten(io.load_safetensors(p)) for p in inputs]
    for k, v in got.items():  # the mean of the first two inputs, computed in float64
        want = (trees[0][k].astype(np.float64) + trees[1][k].astype(np.float64)) / 2
        np.testing.assert_allclose(v, want, rtol=1e-5, atol=1e-6, err_msg=k)


def test_a_declared_non_linear_vector_rule_loads_as_a_vote_only(workdir):
    (workdir / "plugin_vote.py").write_text(
        _source("rule_vote", TRAITS='{"linear": False}', LINEAR="False", REPORTED="jnp.full((n,), 1.0 / n)")
    )
    load_plugins(["plugin_vote"])
    assert "rule_vote" in RULES and "rule_vote" not in merge_methods()


@pytest.mark.parametrize("name", [m for m in merge_methods() if registry.RULES[m].kind == "vector"])
def test_every_built_in_vector_merge_method_meets_the_contract(name):
    check_vector_rule(registry.RULES[name])  # raises PluginError otherwise


def test_the_contract_check_reads_the_weights_against_the_output():
    spec = registry.RULES["multi_krum"]
    mean = registry.make("mean")
    with pytest.raises(PluginError, match="not sum_i weights"):
        # Multi-Krum's declaration with a rule that reports uniform weights but returns Krum's pick.
        krum = registry.make("krum", 1)

        def update(stacked, state, params=None, **kw):
            merged, st = krum.update(stacked, state, params, **kw)
            _, mst = mean.update(stacked, mean.init(params), params, **kw)
            return merged, mst

        check_vector_rule(spec, rule=krum._replace(update=update), n=6)
