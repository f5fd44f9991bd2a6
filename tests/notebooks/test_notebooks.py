"""The notebooks run top to bottom in a fresh kernel; their sources are clean jupytext files.

The source of every notebook is a jupytext percent-format script ``notebooks/NN_name.py``
(``# %% [markdown]`` and ``# %%`` cells); no ``.ipynb`` is committed. Every ``notebooks/[0-9]*.py``
is picked up here automatically, so a new notebook is tested as soon as it exists.

Each notebook is read with jupytext and executed with ``nbclient`` in a new ``python3`` kernel
(this venv's python: the kernel inherits this process's environment, set below) with
``META_CONSENSUS_SMALL=1``, so it picks its small settings, and ``MPLBACKEND=Agg``. A cell error
fails the test; every notebook ends with its own assertions (robust rules beat the mean under
attack, sharded == unsharded, ...) and prints "all checks passed", so executing it checks
behaviour, not just that it runs.

A kernel spends its time importing jax and compiling, on one core; the selected notebooks are
therefore executed two kernels at a time (``META_CONSENSUS_NOTEBOOK_WORKERS``, default 2) as soon
as the module starts, and each parametrized test waits for its own notebook's result.
"""

from __future__ import annotations

import os
import pathlib
import re
import sys
from concurrent.futures import Future, ThreadPoolExecutor

import jupytext
import nbformat
import pytest
from nbclient import NotebookClient

pytestmark = pytest.mark.notebooks

NOTEBOOK_DIR = pathlib.Path(__file__).resolve().parents[2] / "notebooks"
STORED_DIR = NOTEBOOK_DIR.parent / "build" / "notebooks"  # executed copies for the docs site
NOTEBOOKS = sorted(p.stem for p in NOTEBOOK_DIR.glob("[0-9]*.py"))
CELL_TIMEOUT_S = 600  # per cell; a healthy small run of a whole notebook takes 10-20 s on 2 cores
SMALL_SWITCH = 'SMALL = os.environ.get("META_CONSENSUS_SMALL") == "1"'
WORKERS = int(os.environ.get("META_CONSENSUS_NOTEBOOK_WORKERS", "2"))
# Notebooks whose small run is dominated by running compiled code, not by compiling it: they keep
# XLA's full optimization (07's CNN: 17 s at full optimization, 48 s at level 0 on 2 cores).
FULL_OPTIMIZATION = frozenset({"07_bring_your_own_model"})
# The two longest kernels (30-40 s each on 2 cores) run in the slow tier (make test-slow, CI), so
# make test stays within its time; the other notebooks run in make test.
SLOW_NOTEBOOKS = frozenset({"06_meshes", "07_bring_your_own_model"})
EXECUTED = [pytest.param(s, marks=pytest.mark.slow) if s in SLOW_NOTEBOOKS else s for s in NOTEBOOKS]


def _read(stem: str) -> nbformat.NotebookNode:
    return jupytext.read(NOTEBOOK_DIR / f"{stem}.py", fmt="py:percent")


def _set_kernel_env(mp: pytest.MonkeyPatch) -> None:
    """The environment every kernel inherits: small settings, no display, a plain jax start-up."""
    mp.setenv("META_CONSENSUS_SMALL", "1")
    mp.setenv("MPLBACKEND", "Agg")
    mp.setenv("JAX_PLATFORMS", "cpu")
    # conftest.py gives this process 8 simulated devices; a notebook starts like a user's fresh
    # process (one device) unless it asks for more itself (06_meshes does). Compilation dominates
    # the run time of these tiny models, and XLA's LLVM optimization level 0 roughly halves it.
    mp.setenv("XLA_FLAGS", "--xla_backend_optimization_level=0")
    # Keep the kernel's dtype promotion at jax's default, as a user's would be.
    mp.delenv("JAX_NUMPY_DTYPE_PROMOTION", raising=False)


@pytest.fixture
def kernel_env(monkeypatch):
    _set_kernel_env(monkeypatch)


@pytest.fixture(scope="module")
def executions(request) -> dict[str, Future]:
    """Start executing every selected notebook, ``WORKERS`` kernels at a time; stem -> Future."""
    selected = {
        item.callspec.params["stem"]
        for item in request.session.items
        if getattr(item, "originalname", None) == "test_notebook_executes"
    }
    with pytest.MonkeyPatch.context() as mp:
        _set_kernel_env(mp)  # kernels start in the workers while this context is open
        pool = ThreadPoolExecutor(max_workers=max(WORKERS, 1))
        try:
            yield {
                stem: pool.submit(_execute, _read(stem), _kernel_environment(stem))
                for stem in NOTEBOOKS
                if stem in selected
            }
        finally:
            pool.shutdown(wait=True, cancel_futures=True)  # after -x: do not start the rest


def _kernel_environment(stem: str) -> dict[str, str]:
    """The kernel's environment: this process's (set by ``_set_kernel_env``), per notebook."""
    env = dict(os.environ)
    if stem in FULL_OPTIMIZATION:
        env.pop("XLA_FLAGS", None)
    return env


def _execute(nb: nbformat.NotebookNode, env: dict[str, str] | None = None) -> nbformat.NotebookNode:
    client = NotebookClient(
        nb,
        timeout=CELL_TIMEOUT_S,
        kernel_name="python3",
        resources={"metadata": {"path": str(NOTEBOOK_DIR)}},
        shutdown_kernel="immediate",  # the run is over; a graceful shutdown only waits on jax's exit
    )
    # Raises CellExecutionError (with the cell and traceback) on any error.
    return client.execute(env=dict(os.environ) if env is None else env)


def _stream_text(cell: nbformat.NotebookNode) -> str:
    return "".join(o.get("text", "") for o in cell.get("outputs", []) if o.get("output_type") == "stream")


@pytest.mark.parametrize("stem", EXECUTED)
def test_notebook_executes(stem, executions):
    nb = executions[stem].result()  # re-raises the notebook's CellExecutionError, if any
    code = [c for c in nb.cells if c.cell_type == "code"]
    assert code and all(c.execution_count is not None for c in code), "some cells did not run"
    # Every notebook ends by asserting its results; reaching the print means they held.
    assert "all checks passed" in _stream_text(code[-1])
    _store(stem, nb)


def _store(stem: str, nb: nbformat.NotebookNode) -> None:
    """Keep the executed notebook for the documentation site (``make docs`` renders its outputs).

    Written atomically to ``build/notebooks/<stem>.ipynb``; the site uses it only while its cells
    are the script's cells (docs/_notebooks.py).
    """
    STORED_DIR.mkdir(parents=True, exist_ok=True)
    tmp = STORED_DIR / f".{stem}.ipynb.tmp"
    nbformat.write(nb, tmp)
    tmp.replace(STORED_DIR / f"{stem}.ipynb")


def test_kernel_is_this_venvs_python(kernel_env):
    """nbclient's "python3" kernel runs this interpreter (jupyter_client maps "python" to sys.executable)."""
    nb = nbformat.v4.new_notebook()
    nb.cells.append(nbformat.v4.new_code_cell("import sys\nprint(sys.executable)\nprint(sys.prefix)"))
    executable, prefix = _stream_text(_execute(nb).cells[0]).split()
    assert os.path.normpath(executable) == os.path.normpath(sys.executable)
    assert os.path.normpath(prefix) == os.path.normpath(sys.prefix)


def test_notebooks_are_found():
    # The six notebooks of the first release at least; later ones join by their file name alone.
    first = {"01_quickstart", "02_byzantine", "03_convex_weights", "04_dp_fedavg", "05_soups", "06_meshes"}
    assert first <= set(NOTEBOOKS), NOTEBOOKS
    assert all(re.fullmatch(r"\d\d_[a-z0-9_]+", stem) for stem in NOTEBOOKS), NOTEBOOKS


@pytest.mark.parametrize("stem", NOTEBOOKS)
def test_notebook_source_is_well_formed(stem):
    text = (NOTEBOOK_DIR / f"{stem}.py").read_text()
    # Every line belongs to a cell: the jupytext header, then "# %%" / "# %% [markdown]" markers.
    assert text.startswith("# ---\n# jupyter:\n"), "the file must start with jupytext's header"
    nb = _read(stem)
    nbformat.validate(nb)
    assert nb.metadata["kernelspec"]["name"] == "python3"
    assert nb.cells[0].cell_type == "markdown"  # an introduction says what the notebook shows
    assert nb.cells[0].source.startswith("# "), "the introduction starts with the notebook's title"
    markers = re.findall(r"^# %%.*$", text, flags=re.MULTILINE)
    assert len(markers) == len(nb.cells), "a cell marker jupytext did not read as a cell"
    assert set(markers) <= {"# %%", "# %% [markdown]"}, set(markers)
    code = [c for c in nb.cells if c.cell_type == "code"]
    assert SMALL_SWITCH in code[0].source, "the first code cell must read the size switch"
    assert not any(c.source.strip() == "" for c in nb.cells), "an empty cell"
    if "xla_force_host_platform_device_count" in text:
        # The device count only takes effect if it is set before jax's first import.
        source = "\n".join(c.source for c in code)
        assert source.index("xla_force_host_platform_device_count") < source.index("import jax")
