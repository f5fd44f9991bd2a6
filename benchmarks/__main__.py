"""The one entry point of the benchmarks: ``python -m benchmarks [NAME [--quick] [ARGS...]]``.

* ``python -m benchmarks``: every benchmark, by purpose, with the first line of its docstring.
* ``python -m benchmarks NAME [--quick] [ARGS...]``: run one; the arguments go to its own parser
  (``python -m benchmarks NAME --help`` lists them).
* ``python -m benchmarks all [--quick]``: every benchmark in turn, each in a fresh process (what
  ``make bench`` and ``make bench-quick`` run), stopping at the first that fails.
* ``python -m benchmarks --names``: the names alone, one a line.
* ``python -m benchmarks publish [--check]``: render the documentation's results pages and the
  README's numbers from ``benchmarks/results/*.json`` (``benchmarks/publish.py``).

A benchmark is any module of ``benchmarks/speed``, ``benchmarks/quality`` or
``benchmarks/tuning`` that defines ``main(argv)``; its name is the module's. They are found by
reading the sources (``ast``), not by importing them, so the listing is instant and a new
benchmark is listed without being registered anywhere.
"""

from __future__ import annotations

import ast
import dataclasses
import importlib
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

PURPOSES = ("speed", "quality", "tuning")
_HERE = Path(__file__).resolve().parent


@dataclasses.dataclass(frozen=True)
class Benchmark:
    name: str
    purpose: str  # the package: speed, quality or tuning
    module: str  # e.g. benchmarks.speed.aggregators
    summary: str  # the first line of the module's docstring


def _defines_main(tree: ast.Module) -> bool:
    return any(isinstance(node, ast.FunctionDef) and node.name == "main" for node in tree.body)


def discover(root: Path = _HERE) -> dict[str, Benchmark]:
    """Every benchmark under ``root``, by name, in purpose then name order."""
    found: dict[str, Benchmark] = {}
    for purpose in PURPOSES:
        for path in sorted((root / purpose).glob("*.py")):
            if path.name.startswith("_"):
                continue
            tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
            if not _defines_main(tree):
                continue  # a helper of its package (e.g. a report's renderers)
            name = path.stem
            if name in found:
                raise RuntimeError(f"two benchmarks named {name!r}: {found[name].module}, {purpose}/{name}")
            doc = (ast.get_docstring(tree) or "").strip().splitlines()
            found[name] = Benchmark(name, purpose, f"benchmarks.{purpose}.{name}", doc[0] if doc else "")
    return found


def listing(benchmarks: dict[str, Benchmark]) -> str:
    width = max(len(name) for name in benchmarks)
    lines = ["usage: python -m benchmarks NAME [--quick] [ARGS...]   (or: all [--quick], publish [--check])"]
    for purpose in PURPOSES:
        group = [b for b in benchmarks.values() if b.purpose == purpose]
        if group:
            lines += ["", f"{purpose}:"]
            lines += [f"  {b.name:<{width}}  {b.summary}" for b in group]
    return "\n".join(lines)


def run(name: str, argv: Sequence[str]) -> object:
    """Run one benchmark in this process: its ``main(argv)``'s return value."""
    benchmarks = discover()
    if name not in benchmarks:
        raise SystemExit(f"no benchmark {name!r}; `python -m benchmarks` lists them")
    from benchmarks import harness

    module = importlib.import_module(benchmarks[name].module)
    saved = sys.argv
    sys.argv = [f"python -m benchmarks {name}", *argv]  # argparse's prog, for --help and errors
    harness.run_as(name)  # the command recorded in its results is `python -m benchmarks NAME ...`
    try:
        return module.main(list(argv))
    finally:
        harness.run_as(None)
        sys.argv = saved


def run_all(argv: Sequence[str]) -> int:
    """Every benchmark in turn, each in a fresh process; the exit status of the first that fails."""
    for name in discover():
        print(f"== python -m benchmarks {name} {' '.join(argv)}".rstrip(), flush=True)
        start = time.perf_counter()
        code = subprocess.call([sys.executable, "-m", "benchmarks", name, *argv])
        print(f"== {name}: exit {code} after {time.perf_counter() - start:.0f} s", flush=True)
        if code != 0:
            return code
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help", "--list"):
        print(listing(discover()))
        return 0
    if args[0] == "--names":
        print("\n".join(discover()))
        return 0
    if args[0] == "all":
        return run_all(args[1:])
    if args[0] == "publish":
        from benchmarks import publish

        return publish.main(args[1:])
    run(args[0], args[1:])
    return 0


if __name__ == "__main__":
    sys.exit(main())
