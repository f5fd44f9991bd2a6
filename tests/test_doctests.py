"""Every ``>>>`` example in the library's docstrings runs and prints what it shows.

The library packages are ``kernels``, ``consensus`` and ``strategies``; the system package
``meta_consensus`` is deliberately not imported here (its examples are prose). Each module is one
test: its docstrings are collected with :class:`doctest.DocTestFinder` and run with the module's
globals, under this suite's conftest (8 simulated CPU devices, strict dtype promotion), with
``ELLIPSIS`` and ``NORMALIZE_WHITESPACE`` so that examples can elide long float tails.

An example that would need a trained model or files is written as a ``::`` code block instead,
which is documentation only; ``test_every_prompt_is_collected`` makes sure no ``>>>`` line hides
where doctest would not find it (a comment, a nested function), so none is silently skipped.
"""

from __future__ import annotations

import doctest
import importlib
import pathlib
import pkgutil
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
LIBRARY = ("kernels", "consensus", "strategies")
FLAGS = doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE


def _library_modules() -> list[str]:
    names = []
    for package in LIBRARY:
        names.append(package)
        for info in pkgutil.walk_packages([str(ROOT / package)], prefix=f"{package}."):
            names.append(info.name)
    return sorted(names)


def _source_of(module_name: str) -> pathlib.Path:
    relative = pathlib.Path(*module_name.split("."))
    package_init = ROOT / relative / "__init__.py"
    return package_init if package_init.exists() else ROOT / relative.with_suffix(".py")


MODULES = _library_modules()
WITH_EXAMPLES = [m for m in MODULES if ">>>" in _source_of(m).read_text()]


def _doctests(module_name: str) -> list[doctest.DocTest]:
    module = importlib.import_module(module_name)
    finder = doctest.DocTestFinder(exclude_empty=True)
    # Objects re-exported from another module are that module's tests, not this one's.
    return [t for t in finder.find(module, module_name) if t.examples and _defined_here(t, module_name)]


def _defined_here(test: doctest.DocTest, module_name: str) -> bool:
    if test.filename is None:
        return False
    return pathlib.Path(test.filename).resolve() == _source_of(module_name).resolve()


def test_library_modules_are_found():
    expected = {"consensus", "strategies", "kernels", "consensus.privacy.rdp", "strategies.trainer"}
    assert expected <= set(MODULES)
    assert not any(m.startswith("meta_consensus") for m in MODULES)
    assert len(WITH_EXAMPLES) >= 10, WITH_EXAMPLES


@pytest.mark.parametrize("module_name", WITH_EXAMPLES)
def test_every_prompt_is_collected(module_name):
    """As many examples are collected as there are ``>>>`` prompts in the source."""
    prompts = len(re.findall(r"^\s*>>>", _source_of(module_name).read_text(), flags=re.MULTILINE))
    collected = sum(len(t.examples) for t in _doctests(module_name))
    assert collected == prompts, f"{prompts - collected} '>>>' lines of {module_name} are not doctests"


@pytest.mark.parametrize(
    "module_name",
    [pytest.param(m, marks=pytest.mark.slow) if m == "strategies.tasks.digits" else m for m in WITH_EXAMPLES],
)
def test_docstring_examples_run(module_name):
    runner = doctest.DocTestRunner(optionflags=FLAGS)
    failures = []
    for test in _doctests(module_name):
        report: list[str] = []
        result = runner.run(test, out=report.append, clear_globs=True)
        if result.failed:
            failures.append("".join(report))
    assert not failures, "\n".join(failures)
