"""The commands the documentation tells a user to type exist where it says they do.

Every ``.venv/bin/NAME`` in the README, the notebooks' README, the docs pages and the Makefile is
installed in this environment (the ``dev`` extra, ``docs`` for the site); the Python example of
docs/flower.md runs as written (slow: three Flower rounds in process).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PAGES = [
    ROOT / "README.md",
    ROOT / "notebooks" / "README.md",
    ROOT / "Makefile",
    *sorted((ROOT / "docs").glob("*.md")),
]


def test_every_venv_command_is_installed():
    bin_dir = Path(sys.executable).parent
    named = {m for page in PAGES for m in re.findall(r"\.venv/bin/([A-Za-z0-9_.-]+)", page.read_text())}
    assert named, "no .venv/bin command found: the pattern broke"
    missing = sorted(name for name in named if not (bin_dir / name).exists())
    assert not missing, f"documented but not installed by the dev extra: {missing}"


def test_no_page_executes_notebooks_with_jupytext():
    # `jupytext --execute` needs nbconvert, which the dev extra does not install (jupyter-execute does it).
    for page in PAGES:
        assert not re.search(r"jupytext[^\n]*--execute", page.read_text()), page


@pytest.mark.slow
def test_flower_page_python_example_runs(tmp_path):
    text = (ROOT / "docs" / "flower.md").read_text()
    code = re.search(r"```python\n(from meta_consensus import config\n.*?)```", text, flags=re.DOTALL)
    assert code, "docs/flower.md lost its Python example"
    env = dict(os.environ, PYTHONPATH=str(ROOT), JAX_PLATFORMS="cpu")
    env.pop("XLA_FLAGS", None)
    out = subprocess.run(
        [sys.executable, "-c", code.group(1)],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip().splitlines()[-1] == "[True, True, True] 0.0"
