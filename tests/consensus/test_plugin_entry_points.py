"""Installed plug-ins: a distribution that lists a module or a callable under the entry-point group
``meta_consensus.plugins`` declares its entries once per process; a broken one is one clear error."""

from __future__ import annotations

import sys
import textwrap

import pytest

from consensus import plugins
from consensus.registry import RULES

RULE_MODULE = '''
from consensus import aggregators
from consensus.specs import RULES


@RULES.declare("{rule}", kind="coordinatewise")
def {rule}():
    """An installed plug-in's rule: the mean."""
    return aggregators.mean()


def register():
    RULES.declare("{rule}_by_call", kind="coordinatewise")(lambda: aggregators.mean())
'''


def _install(tmp_path, monkeypatch, name: str, entry_points: str, module: str) -> None:
    """A module and a dist-info folder on sys.path: what pip leaves behind for an installed package."""
    (tmp_path / f"{name}.py").write_text(module)
    dist = tmp_path / f"{name}-1.0.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name.replace('_', '-')}\nVersion: 1.0\n")
    (dist / "entry_points.txt").write_text(f"[{plugins.ENTRY_POINT_GROUP}]\n{entry_points}\n")
    monkeypatch.syspath_prepend(str(tmp_path))


@pytest.fixture
def clean(monkeypatch):
    names: list[str] = []
    monkeypatch.setattr(plugins, "_loaded_entry_points", set())
    yield names
    for name in names:
        if name in RULES:
            RULES.unregister(name)
    for module in [m for m in sys.modules if m.startswith("ep_plugin_")]:
        del sys.modules[module]


def test_an_installed_module_and_callable_declare_their_rules_once(tmp_path, monkeypatch, clean):
    clean += ["ep_rule", "ep_rule_by_call"]
    module = textwrap.dedent(RULE_MODULE.format(rule="ep_rule"))
    entries = "rules = ep_plugin_one\nlate = ep_plugin_one:register"
    _install(tmp_path, monkeypatch, "ep_plugin_one", entries, module)
    assert "ep_rule" not in RULES

    loaded = plugins.load_entry_points()

    assert sorted(loaded) == ["late", "rules"]
    assert RULES["ep_rule"].module == "ep_plugin_one"
    assert "ep_rule_by_call" in RULES  # the callable was called
    assert plugins.load_entry_points() == []  # once per process: a second call declares nothing twice


def test_a_broken_installed_plugin_is_one_line_naming_it(tmp_path, monkeypatch, clean):
    _install(tmp_path, monkeypatch, "ep_plugin_two", "broken = ep_plugin_two", "raise RuntimeError('boom')\n")

    with pytest.raises(plugins.PluginError) as err:
        plugins.load_entry_points()

    message = str(err.value)
    assert "\n" not in message
    assert "installed plug-in 'broken' (ep_plugin_two)" in message
    assert "ep_plugin_two.py:1" in message and "RuntimeError: boom" in message
