"""The README is the front door: short, its quickstarts run as written, its links lead somewhere.

The quickstarts are the README's ```python blocks (marked ``<!-- quickstart-library -->`` and
``<!-- quickstart-system -->``); each runs in a fresh interpreter in an empty folder, as a user
would paste it. Its numbers are checked by tests/docs/test_docs_publish.py (rendered from the
benchmark results by ``python -m benchmarks publish``).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
README = (ROOT / "README.md").read_text(encoding="utf-8")


def python_blocks(text: str) -> dict[str, str]:
    """The ```python blocks of ``text`` by the ``<!-- NAME -->`` marker above each."""
    found = re.findall(r"<!-- ([a-z-]+) -->\n```python\n(.*?)\n```", text, flags=re.DOTALL)
    return dict(found)


def run_block(code: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ)
    env.pop("XLA_FLAGS", None)  # a user's fresh process: one CPU device, not the suite's eight
    env["JAX_PLATFORMS"] = "cpu"
    env["PYTHONPATH"] = str(ROOT)
    return subprocess.run(
        [sys.executable, "-c", code], cwd=cwd, env=env, capture_output=True, text=True, timeout=600
    )


def test_readme_is_short():
    assert len(README.splitlines()) <= 200


def test_every_python_block_is_a_tested_quickstart():
    # A new python block in the README must be one of the quickstarts this file runs.
    assert README.count("```python") == 2
    assert set(python_blocks(README)) == {"quickstart-library", "quickstart-system"}


def test_quickstart_library_runs(tmp_path):
    out = run_block(python_blocks(README)["quickstart-library"], tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    # It prints the selection mask: Multi-Krum keeps n - f = 6 of 8 nodes, never the attacker (7).
    mask = re.match(r"\[([^\]]*)\]", out.stdout)
    assert mask, out.stdout
    selected = [word == "True" for word in mask.group(1).split()]
    assert len(selected) == 8 and sum(selected) == 6 and not selected[7], out.stdout


@pytest.mark.slow
def test_quickstart_system_runs(tmp_path):
    out = run_block(python_blocks(README)["quickstart-system"], tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    accuracy = float(out.stdout.strip().splitlines()[-1])
    assert 0.5 < accuracy <= 1.0  # 3 classes: far above chance after 5 rounds
    assert (tmp_path / "runs" / "my_model" / "metrics.jsonl").is_file()
    # Pasted again in the same folder it runs again: the earlier run is moved aside, not in the way.
    again = run_block(python_blocks(README)["quickstart-system"], tmp_path)
    assert again.returncode == 0, again.stderr[-3000:]
    assert (tmp_path / "runs" / "my_model.old-1" / "metrics.jsonl").is_file()


def test_readme_links_lead_to_files():
    for target in re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", README):
        if target.startswith(("http://", "https://")):
            continue
        assert (ROOT / target).exists(), f"README links to {target}, which does not exist"


def test_readme_says_no_history():
    # The README describes the package, not how it came about.
    for pattern in (r"\bissue \d+", r"#\d{2,}\b", r"target met", r"\bnot met\b"):
        assert not re.search(pattern, README, flags=re.IGNORECASE), pattern
