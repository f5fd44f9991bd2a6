"""The notebooks run top to bottom in a fresh kernel, and are committed clean.

Each notebook is executed with ``nbclient`` in a new ``python3`` kernel (this venv's python: the
kernel inherits this process's environment, set below) with ``META_CONSENSUS_SMALL=1``, so it
picks its small settings, and ``MPLBACKEND=Agg``. A cell error fails the test; every notebook ends
with its own assertions (robust rules beat the mean under attack, sharded == unsharded, ...), so
executing it checks behaviour, not just that it runs.

A kernel spends its time importing jax and compiling, on one core; the selected notebooks are
therefore executed two kernels at a time (``META_CONSENSUS_NOTEBOOK_WORKERS``, default 2) as soon
as the module starts, and each parametrized test waits for its own notebook's result.
"""

from __future__ import annotations

import importlib.util
import os
import pathlib
import sys
from concurrent.futures import Future, ThreadPoolExecutor

import nbformat
import pytest
from nbclient import NotebookClient

NOTEBOOK_DIR = pathlib.Path(__file__).resolve().parents[2] / "notebooks"
NOTEBOOKS = [
    "01_quickstart",
    "02_byzantine",
    "03_convex_weights",
    "04_dp_fedavg",
    "05_soups",
    "06_meshes",
]
CELL_TIMEOUT_S = 600  # per cell; a healthy small run of a whole notebook takes 10-20 s on 2 cores
SMALL_SWITCH = 'SMALL = os.environ.get("META_CONSENSUS_SMALL") == "1"'
WORKERS = int(os.environ.get("META_CONSENSUS_NOTEBOOK_WORKERS", "2"))


def _read(stem: str) -> nbformat.NotebookNode:
    return nbformat.read(NOTEBOOK_DIR / f"{stem}.ipynb", as_version=4)


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
            yield {stem: pool.submit(_execute, _read(stem)) for stem in NOTEBOOKS if stem in selected}
        finally:
            pool.shutdown(wait=True, cancel_futures=True)  # after -x: do not start the rest


def _execute(nb: nbformat.NotebookNode) -> nbformat.NotebookNode:
    client = NotebookClient(
        nb,
        timeout=CELL_TIMEOUT_S,
        kernel_name="python3",
        resources={"metadata": {"path": str(NOTEBOOK_DIR)}},
        shutdown_kernel="immediate",  # the run is over; a graceful shutdown only waits on jax's exit
    )
    return client.execute()  # raises CellExecutionError (with the cell and traceback) on any error


def _stream_text(cell: nbformat.NotebookNode) -> str:
    return "".join(o.get("text", "") for o in cell.get("outputs", []) if o.get("output_type") == "stream")


@pytest.mark.parametrize("stem", NOTEBOOKS)
def test_notebook_executes(stem, executions):
    nb = executions[stem].result()  # re-raises the notebook's CellExecutionError, if any
    code = [c for c in nb.cells if c.cell_type == "code"]
    assert code and all(c.execution_count is not None for c in code), "some cells did not run"
    # Every notebook ends by asserting its results; reaching the print means they held.
    assert "all checks passed" in _stream_text(code[-1])


def test_kernel_is_this_venvs_python(kernel_env):
    """nbclient's "python3" kernel runs this interpreter (jupyter_client maps "python" to sys.executable)."""
    nb = nbformat.v4.new_notebook()
    nb.cells.append(nbformat.v4.new_code_cell("import sys\nprint(sys.executable)\nprint(sys.prefix)"))
    executable, prefix = _stream_text(_execute(nb).cells[0]).split()
    assert os.path.normpath(executable) == os.path.normpath(sys.executable)
    assert os.path.normpath(prefix) == os.path.normpath(sys.prefix)


def test_every_notebook_is_listed():
    assert sorted(p.stem for p in NOTEBOOK_DIR.glob("*.ipynb")) == NOTEBOOKS


@pytest.mark.parametrize("stem", NOTEBOOKS)
def test_notebook_is_committed_clean(stem):
    nb = _read(stem)
    nbformat.validate(nb)
    assert nb.metadata["kernelspec"]["name"] == "python3"
    assert nb.cells[0].cell_type == "markdown"  # an introduction says what the notebook shows
    code = [c for c in nb.cells if c.cell_type == "code"]
    for i, cell in enumerate(code):
        assert cell.outputs == [], f"code cell {i} has outputs committed"
        assert cell.execution_count is None, f"code cell {i} has an execution count committed"
    assert SMALL_SWITCH in code[0].source, "the first code cell must read the size switch"
    if stem == "06_meshes":
        # The device count only takes effect if it is set before jax's first import.
        source = "\n".join(c.source for c in code)
        assert source.index("xla_force_host_platform_device_count=8") < source.index("import jax")


def test_notebooks_match_their_generator():
    """notebooks/_build.py is the source of the notebooks; a hand edit that it would undo fails here."""
    spec = importlib.util.spec_from_file_location("notebooks_build", NOTEBOOK_DIR / "_build.py")
    assert spec is not None and spec.loader is not None
    build = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(build)
    assert list(build.NOTEBOOKS) == NOTEBOOKS
    for stem in NOTEBOOKS:
        on_disk = (NOTEBOOK_DIR / f"{stem}.ipynb").read_text()
        assert on_disk == build.render(stem), f"{stem}.ipynb is stale: run python notebooks/_build.py"
