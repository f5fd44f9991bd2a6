"""Test setup: 8 simulated CPU devices and strict dtype promotion for every test."""

import atexit
import os
import shutil
import tempfile

# Must happen before jax is imported anywhere in the test session.
_flags = os.environ.get("XLA_FLAGS", "")
if "xla_force_host_platform_device_count" not in _flags:
    os.environ["XLA_FLAGS"] = (_flags + " --xla_force_host_platform_device_count=8").strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

# One persistent XLA compilation cache for the whole session, shared by the xdist workers, the
# CLI subprocesses and the notebook kernels (they inherit the environment). Many tests compile the
# same programs (the same rule at the same shapes under jit and eagerly, the same digits model in
# every `meta-consensus run` subprocess); a cache hit loads the executable instead of compiling
# it again. A fresh directory per session, so a run never sees another run's executables.
_use_cache = os.environ.get("META_CONSENSUS_TEST_JAX_CACHE", "1") == "1"
if _use_cache and "JAX_COMPILATION_CACHE_DIR" not in os.environ:
    _cache_dir = tempfile.mkdtemp(prefix="meta-consensus-tests-xla-cache-")
    os.environ["JAX_COMPILATION_CACHE_DIR"] = _cache_dir
    os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"
    os.environ["JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES"] = "0"
    _owner = os.getpid()
    atexit.register(lambda: os.getpid() == _owner and shutil.rmtree(_cache_dir, ignore_errors=True))

import jax  # noqa: E402

jax.config.update("jax_numpy_dtype_promotion", "strict")


_SLOW_IDS_FILE = os.path.join(os.path.dirname(__file__), "slow_tests.txt")


def _measured_slow_ids() -> frozenset[str]:
    with open(_SLOW_IDS_FILE) as fh:
        return frozenset(line.strip() for line in fh if line.strip() and not line.startswith("#"))


# The files with the longest wall time (measured with --durations on 2 cores: subprocess runs,
# the loopback Flower deployment, notebook kernels), longest first. ``make test`` distributes
# whole files over 2 workers in collection order (``--no-loadscope-reorder``: xdist would order
# files by their number of tests instead), so these start first and the short files fill the
# tail; collected last (tests/system sorts late), one of them ran alone for the last minutes.
_LONGEST_FIRST = (
    "tests/system/test_system_resume.py",
    "tests/system/test_flower_deployment.py",
    "tests/notebooks/test_notebooks.py",
    "tests/consensus/test_aggregator_properties.py",
    "tests/system/test_system_distributed.py",
    "tests/system/test_example_dp.py",
    "tests/strategies/test_dpsgd.py",
    "tests/bench/test_quality_benchmarks.py",
    "tests/strategies/test_tasks_text.py",
    "tests/system/test_client_sampling.py",
    "tests/system/test_flower_simulation.py",
)


def pytest_collection_modifyitems(config, items):
    """Mark the tests listed in slow_tests.txt (measured, not guessed) as ``slow``; longest files first."""
    import pytest

    slow_ids = _measured_slow_ids()
    for item in items:
        if item.nodeid in slow_ids:
            item.add_marker(pytest.mark.slow)
    rank = {path: i for i, path in enumerate(_LONGEST_FIRST)}
    # A stable sort on the file alone keeps every file's tests in their own order.
    items.sort(key=lambda item: rank.get(item.nodeid.split("::", 1)[0], len(rank)))
