"""The rule registry: every aggregation rule, pre-aggregator and merge method, by name.

Each rule is declared once, beside its factory, with ``@RULES.declare(...)``
(:mod:`consensus.specs`): its kind, whether it takes f, its precondition on
(n, f), its DP sensitivity, what the caller must pass, its defaults and its
capabilities. This module only gathers them: importing it imports the modules
that declare the built-in rules (``consensus.aggregators``, ``consensus.merging``)
and offers the registry's views that configs, the merge command, benchmarks,
tests and ``docs/rules.md`` read.

The library API stays plain functions (``consensus.krum(2)``); a name is the
edge of the library: ``make("krum", 2)`` is ``consensus.krum(2)``.

The rules table of ``docs/rules.md`` is :func:`markdown_table`; rewrite it with::

    python -m consensus.registry --write-docs
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import pkgutil
import re
import sys
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, Literal

import consensus.aggregators
import consensus.merging  # noqa: F401  (importing the modules declares the built-in rules)
from consensus.base import Aggregator, PreAggregator
from consensus.specs import DEFAULT_SENSITIVITY, RULES, Registry, RegistryError, Spec, at_least

__all__ = [
    "DOCS_COMMAND",
    "RULES",
    "Registry",
    "RegistryError",
    "RuleSpec",
    "Spec",
    "make",
    "markdown_table",
    "pre_aggregators",
    "register",
    "vote_rules",
    "write_docs",
]

Kind = Literal["coordinatewise", "vector", "pre", "merge"]
RuleSpec = Spec  # the rule family's specs are plain specs


def _declare_builtins() -> None:
    """Import every module of the rule packages, so a new rule module needs no import line elsewhere.

    The packages' ``__init__`` imports come first, so the classic rules keep their order and a
    module found here only adds its own declarations after them.
    """
    for package in (consensus.aggregators, consensus.merging):
        for info in pkgutil.iter_modules(package.__path__, f"{package.__name__}."):
            importlib.import_module(info.name)


_declare_builtins()

#: The command that rewrites the rules table of docs/rules.md from the declarations.
DOCS_COMMAND = "python -m consensus.registry --write-docs"
DOCS_PAGE = Path(__file__).resolve().parents[1] / "docs" / "rules.md"
TABLE_BEGIN = f"<!-- rules table: generated from the declarations by `{DOCS_COMMAND}` -->"
TABLE_END = "<!-- end of rules table -->"
KIND_ORDER = ("coordinatewise", "vector", "pre", "merge")


def register(
    name: str,
    factory: Callable[..., Aggregator | PreAggregator],
    kind: Kind,
    *,
    takes_f: bool = False,
    precondition: Callable[[int, int], str | None] | None = None,
    sensitivity: str | None = None,
    needs: tuple[str, ...] = (),
    summary: str = "",
    defaults: Mapping[str, Any] | None = None,
    order_matters: bool = False,
    elementwise: bool = False,
    replace: bool = False,
) -> Spec:
    """Register an existing factory under ``name``; prefer ``@RULES.declare`` beside the factory.

    The factory's results are not stamped with the spec, so a pipeline treats them as
    hand-built (no capabilities): declare the factory to give it any.

    Args:
      name: The rule's name.
      factory: Returns an Aggregator or PreAggregator.
      kind: ``"coordinatewise"``, ``"vector"``, ``"pre"`` or ``"merge"``.
      takes_f: The factory's first argument is ``num_byzantine``.
      precondition: ``(n, f) -> str | None``; default at least 1 valid node.
      sensitivity: The DP sensitivity in words (default: not worked out).
      needs: What ``update`` needs besides the stack (``"params"``, ``"key"``, ...).
      summary: One line for docs; default the factory docstring's first line.
      defaults: Values for required parameters that configs may leave unset.
      order_matters: The output depends on the nodes' order.
      elementwise: Output coordinate k depends only on coordinate k of the inputs.
      replace: Replace an existing rule of that name.

    Returns:
      The registered :class:`~consensus.specs.Spec`.

    Raises:
      RegistryError: If the name is taken and ``replace`` is False.
    """
    spec = Spec(
        name=name,
        family=RULES.family,
        factory=factory,
        kind=kind,
        takes_f=takes_f,
        precondition=precondition or at_least(1),
        sensitivity=sensitivity or DEFAULT_SENSITIVITY,
        needs=frozenset(needs),
        summary=summary or (inspect.getdoc(factory) or "").split("\n", 1)[0],
        defaults=dict(defaults or {}),
        order_matters=order_matters,
        elementwise=elementwise,
        module=getattr(factory, "__module__", ""),
    )
    return RULES.register(name, spec, replace=replace)


def _kind_rank(spec: Spec) -> int:
    return KIND_ORDER.index(spec.kind) if spec.kind in KIND_ORDER else len(KIND_ORDER)


def by_kind() -> list[tuple[str, Spec]]:
    """Return the declared rules grouped by kind (KIND_ORDER), in declaration order within a kind.

    Configs' "choose one of" lists and the docs table read this order, so it does not
    depend on which rule module happens to be imported first within the package.

    Returns:
      ``(name, spec)`` pairs.
    """
    return sorted(RULES.items(), key=lambda item: _kind_rank(item[1]))


def vote_rules() -> list[str]:
    """Return the names of the registered n -> 1 rules (everything but pre-aggregators), grouped by kind."""
    return [name for name, spec in by_kind() if spec.kind != "pre"]


def pre_aggregators() -> list[str]:
    """Return the names of the registered pre-aggregators (n -> n)."""
    return [name for name, spec in by_kind() if spec.kind == "pre"]


def make(name: str, f: int | None = None, **params: Any) -> Aggregator | PreAggregator:
    """Build a registered rule by name; errors list the valid choices.

    Args:
      name: A registered rule's name.
      f: The number of Byzantine nodes, for the rules that take one.
      **params: The factory's other parameters.

    Returns:
      The Aggregator or PreAggregator.

    Raises:
      RegistryError: If the name or a parameter is unknown, or f is missing for a rule that
        takes one.

    Example:
      >>> make("krum", 1).name
      'krum'
    """
    return RULES[name].build(f, **params)


def precondition_text(spec: Spec) -> str:
    """Return the precondition as the docs show it: the declared formula, else the requirement at n = f = 1.

    Args:
      spec: A rule's spec.

    Returns:
      The precondition in words, without its value at n = 1 (``"n > 2f + 2"``).
    """
    if spec.formula:
        return spec.formula
    # At f = 1 even for a rule not told f: configs check its precondition against their f.
    need = spec.requirement(1, 1) or "n >= 1"
    return re.sub(r" = -?\d+(\.\d+)?$", "", need)  # "n > 2f + 2 = 4" -> "n > 2f + 2"


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def markdown_table() -> str:
    """Render the registry as the markdown table of ``docs/rules.md``, by kind, in declaration order.

    Returns:
      The table, one row per rule, ending in a newline.
    """
    header = ["name", "kind", "takes f", "precondition (n valid nodes)", "DP sensitivity", "needs"]
    header += ["parameters", "module"]
    rows = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for name, spec in by_kind():
        params = ", ".join(
            k if p.default is inspect.Parameter.empty else f"{k}={p.default!r}"
            for k, p in spec.params.items()
        )
        cells = [
            f"`{name}`",
            spec.kind,
            "yes" if spec.takes_f else "no",
            _cell(precondition_text(spec)),
            _cell(spec.sensitivity),
            ", ".join(sorted(spec.needs)) or "-",
            params or "-",
            f"`{spec.module}`",
        ]
        rows.append("| " + " | ".join(cells) + " |")
    return "\n".join(rows) + "\n"


def render_page(page: str) -> str:
    """Return ``page`` with the text between the table markers replaced by :func:`markdown_table`.

    Args:
      page: The page's text.

    Returns:
      The new text.

    Raises:
      ValueError: If the page lacks the table markers.
    """
    if TABLE_BEGIN not in page or TABLE_END not in page:
        raise ValueError(f"the page has no rules-table markers ({TABLE_BEGIN!r} ... {TABLE_END!r})")
    head, rest = page.split(TABLE_BEGIN, 1)
    _, tail = rest.split(TABLE_END, 1)
    return f"{head}{TABLE_BEGIN}\n{markdown_table()}{TABLE_END}{tail}"


def write_docs(path: Path = DOCS_PAGE) -> bool:
    """Rewrite the rules table of ``path`` from the declarations.

    Args:
      path: The page (default ``docs/rules.md``).

    Returns:
      True when the file changed.

    Raises:
      ValueError: If the page lacks the table markers.
    """
    page = path.read_text()
    new = render_page(page)
    if new != page:
        path.write_text(new)
    return new != page


def main(argv: Sequence[str] | None = None) -> int:
    """Print the rules table, or with ``--write-docs`` rewrite it in ``docs/rules.md``.

    Args:
      argv: The command-line arguments, or None for ``sys.argv[1:]``.

    Returns:
      The exit status (0).
    """
    parser = argparse.ArgumentParser(
        prog="python -m consensus.registry", description="The rule registry as a markdown table."
    )
    parser.add_argument(
        "--write-docs", action="store_true", help=f"rewrite the rules table of {DOCS_PAGE.name} in place"
    )
    args = parser.parse_args(argv)
    if args.write_docs:
        changed = write_docs()
        print(f"{DOCS_PAGE}: {'rewritten' if changed else 'already up to date'}")
    else:
        sys.stdout.write(markdown_table())
    return 0


if __name__ == "__main__":
    sys.exit(main())
