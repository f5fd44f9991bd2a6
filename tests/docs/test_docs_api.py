"""Every public name of ``consensus``, ``strategies`` and ``meta_consensus`` is in the API reference.

So is every name of the submodules a user imports from directly (``consensus.io``,
``consensus.lora``, ``strategies.tasks``, ``strategies.models``, ``meta_consensus.flower``,
``meta_consensus.export``, ...): listed with its dotted name, or under the package's flat name when
the package exports the same object. A submodule without ``__all__`` exports the functions and
classes it defines whose names do not start with an underscore.

The reference pages (docs/api/<package>.md) list names in autosummary blocks, grouped by topic;
autosummary generates one page per name from its docstring when the site is built
(``make docs``, warnings as errors). A name added to a package's ``__all__`` without a place in
its page fails here, and so does a page entry that is no longer public.
"""

from __future__ import annotations

import importlib
import inspect
import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
# The packages of this checkout, before tests/ (whose tests/consensus would shadow them here).
sys.path.insert(0, str(ROOT))
DOCS = ROOT / "docs"
PACKAGES = ("consensus", "strategies", "meta_consensus")
SUBMODULES = {
    "consensus": ("consensus.io", "consensus.lora"),
    "strategies": ("strategies.tasks", "strategies.models", "strategies.models.hub"),
    "meta_consensus": ("meta_consensus.flower", "meta_consensus.merge", "meta_consensus.export"),
}


def listed(package: str) -> list[str]:
    """The names of the autosummary blocks of docs/api/<package>.md, in order."""
    text = (DOCS / "api" / f"{package}.md").read_text(encoding="utf-8")
    assert f".. currentmodule:: {package}\n" in text
    names = []
    # A block under ``.. currentmodule:: package.sub`` lists names of that submodule: dotted here.
    for module, block in re.findall(
        r"(?:\.\. currentmodule:: ([\w.]+)\n\n)?\.\. autosummary::\n((?:   .*\n|\n)*)", text
    ):
        prefix = f"{module}." if module and module != package else ""
        entries = [line.strip() for line in block.splitlines()]
        names += [prefix + e for e in entries if e and not e.startswith(":")]
    # Constants whose type's docstring would stand in for theirs are listed as py:data.
    names += re.findall(r"^\.\. py:data:: ([\w.]+)$", text, flags=re.MULTILINE)
    return names


def public(package: str) -> list[str]:
    module = importlib.import_module(package)
    if not hasattr(module, "__all__"):
        # A module without __all__: the functions and classes it defines, less the private ones.
        return [
            n
            for n, obj in vars(module).items()
            if not n.startswith("_")
            and (inspect.isclass(obj) or inspect.isfunction(obj))
            and obj.__module__ == package
        ]
    return [n for n in module.__all__ if not (n.startswith("__") and n.endswith("__"))]


@pytest.mark.parametrize("package", PACKAGES)
def test_every_public_name_is_in_the_reference(package):
    missing = sorted(set(public(package)) - set(listed(package)))
    assert not missing, f"docs/api/{package}.md lacks {missing}"


@pytest.mark.parametrize("package", PACKAGES)
def test_every_submodule_name_is_in_the_reference(package):
    names = set(listed(package))
    top = importlib.import_module(package)
    missing = []
    for module_name in SUBMODULES[package]:
        module = importlib.import_module(module_name)
        for name in public(module_name):
            flat = name in names and getattr(top, name, None) is getattr(module, name)
            if f"{module_name}.{name}" not in names and not flat:
                missing.append(f"{module_name}.{name}")
    assert not missing, f"docs/api/{package}.md lacks {missing}"


@pytest.mark.parametrize("package", PACKAGES)
def test_the_reference_lists_only_public_names_once(package):
    names = listed(package)
    assert len(names) == len(set(names)), "a name listed twice"
    dotted = {f"{m}.{n}" for m in SUBMODULES[package] for n in public(m)}
    stale = sorted(set(names) - set(public(package)) - dotted)
    assert not stale, f"docs/api/{package}.md lists {stale}, public in neither {package} nor its submodules"


def test_the_reference_pages_are_in_the_site():
    index = (DOCS / "index.md").read_text(encoding="utf-8")
    for package in PACKAGES:
        assert f"api/{package}\n" in index


def test_every_public_name_has_a_docstring():
    # autodoc renders the docstring; an object without one would be a page without text.
    bare = [
        f"{package}.{name}"
        for package in PACKAGES
        for name in public(package)
        if not (getattr(importlib.import_module(package), name).__doc__ or "").strip()
    ]
    assert not bare, bare


# A Google-style section that names the arguments (napoleon renders it as a parameter list).
ARGS_SECTION = re.compile(r"^(Args|Attributes):[ \t]*$", flags=re.MULTILINE)


def public_callables() -> dict[str, object]:
    """Every public function and class of the packages and their listed submodules, once each."""
    found: dict[str, object] = {}
    seen: set[int] = set()
    for package in PACKAGES:
        for module_name in (package, *SUBMODULES[package]):
            module = importlib.import_module(module_name)
            for name in public(module_name):
                obj = getattr(module, name)
                # jax.jit wraps a function; unwrap reaches it. Type aliases (GenericAlias) are not API.
                if not (inspect.isclass(obj) or inspect.isfunction(inspect.unwrap(obj))):
                    continue
                if id(obj) not in seen:
                    seen.add(id(obj))
                    found[f"{module_name}.{name}"] = obj
    return found


def arguments(obj: object) -> list[str] | None:
    """The parameter names of ``obj``'s signature less self/cls; None where it cannot be read."""
    try:
        signature = inspect.signature(obj)  # type: ignore[arg-type]
    except (TypeError, ValueError):  # e.g. an exception class without its own __init__
        return None
    return [p for p in signature.parameters if p not in ("self", "cls")]


def test_the_section_pattern_tells_documented_from_bare():
    def documented(x: int) -> int:
        """Double.

        Args:
          x: a number.
        """
        return 2 * x

    def bare(x: int) -> int:
        """Double ``x`` (Args: in the text is not a section)."""
        return 2 * x

    assert ARGS_SECTION.search(inspect.getdoc(documented) or "")
    assert not ARGS_SECTION.search(inspect.getdoc(bare) or "")
    assert arguments(documented) == ["x"] and arguments(ValueError) is None


def test_every_public_callable_documents_its_arguments():
    # The API reference is built from the docstrings with napoleon: a public function or class
    # that takes arguments names them in an Args: section (Attributes: for dataclasses and
    # protocols), or its page says nothing about what to pass.
    found = public_callables()
    assert len(found) > 100, "too few public names found: the walk over __all__ is broken"
    bare = sorted(
        name
        for name, obj in found.items()
        if arguments(obj) and not ARGS_SECTION.search(inspect.getdoc(obj) or "")
    )
    assert not bare, f"public names whose docstring has no Args:/Attributes: section: {bare}"
