"""The benchmarks' one entry point: every benchmark listed, names unique, runs by name."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))  # benchmarks/ beside tests/

from benchmarks import __main__ as entry  # noqa: E402


def test_every_module_with_a_main_is_listed_once_and_nothing_is_left_at_the_top():
    found = entry.discover()
    with_main = {
        p.stem
        for purpose in entry.PURPOSES
        for p in (ROOT / "benchmarks" / purpose).glob("*.py")
        if any(isinstance(n, ast.FunctionDef) and n.name == "main" for n in ast.parse(p.read_text()).body)
    }
    assert set(found) == with_main
    assert {"aggregators", "ablations", "robust_preset", "accelerator"} <= set(found)
    assert all(b.summary and not b.summary.startswith('"') for b in found.values())
    # Only the tooling lives at the top (harness, entry point, publish and the findings it renders):
    # every benchmark is in a purpose package.
    top = {p.name for p in (ROOT / "benchmarks").glob("*.py")}
    assert top == {"__init__.py", "__main__.py", "harness.py", "publish.py", "findings.py"}


def test_listing_and_names_from_the_command_line():
    out = subprocess.run(
        [sys.executable, "-m", "benchmarks"], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout
    for name, bench in entry.discover().items():
        assert f"  {name} " in out and bench.summary in out
    names = subprocess.run(
        [sys.executable, "-m", "benchmarks", "--names"], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout.split()
    assert names == list(entry.discover())


def test_an_unknown_name_is_refused():
    with pytest.raises(SystemExit, match="no benchmark 'nope'"):
        entry.main(["nope"])
