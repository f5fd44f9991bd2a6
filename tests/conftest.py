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


# The files with the longest wall time (measured with --durations on 2 cores: subprocess runs,
# the loopback Flower deployment, notebook kernels), longest first. ``make test`` distributes
# whole files over 2 workers in collection order (``--no-loadscope-reorder``: xdist would order
# files by their number of tests instead), so these start first and the short files fill the
# tail; collected last (tests/system sorts late), one of them ran alone for the last minutes.
_LONGEST_FIRST = (
    "tests/system/test_system_resume.py",
    "tests/system/test_flower_deployment.py",
    "tests/notebooks/test_notebooks.py",
    "tests/consensus/test_rule_properties.py",
    "tests/system/test_system_distributed.py",
    "tests/system/test_example_dp.py",
    "tests/strategies/test_dpsgd.py",
    "tests/bench/test_quality_benchmarks.py",
    "tests/strategies/test_tasks_text.py",
    "tests/system/test_client_sampling.py",
    "tests/system/test_flower_simulation.py",
)


def pytest_collection_modifyitems(config, items):
    """Longest files first. (``slow`` markers live in the test files themselves.)"""
    rank = {path: i for i, path in enumerate(_LONGEST_FIRST)}
    # A stable sort on the file alone keeps every file's tests in their own order.
    items.sort(key=lambda item: rank.get(item.nodeid.split("::", 1)[0], len(rank)))


# ----------------------------------------------------------------------------- shared test data
# The parameter trees, node stacks and small configs that the rule tests share (the property table
# in tests/consensus/test_rule_properties.py and the rule-specific files beside it). Fixtures that
# return builders, so that one test can draw several seeds and sizes.

import numpy as np  # noqa: E402
import pytest  # noqa: E402

F = 2  # Byzantine nodes tolerated in the small configs
N = 11  # nodes in the small configs
KEY = jax.random.key(42)  # the key of the randomized rules (their float64 references replay it)


def params_tree(seed: int = 0) -> dict:
    """A small parameter tree of three leaves (a dense kernel (7, 5), its bias, a scalar): 41 coordinates."""
    rng = np.random.default_rng(seed)
    return {
        "dense": {
            "w": rng.standard_normal((7, 5)).astype(np.float32),
            "b": rng.standard_normal(5).astype(np.float32),
        },
        "scale": np.float32(rng.standard_normal()),
    }


def node_stack(params, n: int = N, seed: int = 1, spread: float = 0.3, drift: float = 0.2):
    """Honest nodes: params + a common drift + independent noise (fine-tunes of one init), stacked."""
    import consensus

    rng = np.random.default_rng(seed)
    drift_tree = jax.tree.map(lambda p: drift * rng.standard_normal(np.shape(p)).astype(np.float32), params)
    nodes = [
        jax.tree.map(
            lambda p, d: (p + d + spread * rng.standard_normal(np.shape(p))).astype(np.float32),
            params,
            drift_tree,
        )
        for _ in range(n)
    ]
    return consensus.stack(nodes)


def server_update_tree(params, seed: int = 99, scale: float = 0.4):
    """A server's update (FLTrust, server MoNNA): a random tree shaped like params."""
    rng = np.random.default_rng(seed)
    return jax.tree.map(lambda p: (scale * rng.standard_normal(np.shape(p))).astype(np.float32), params)


@pytest.fixture
def make_params():
    """``make_params(seed)``: :func:`params_tree`."""
    return params_tree


@pytest.fixture
def make_nodes():
    """``make_nodes(params, n=N, seed=1, spread=0.3, drift=0.2)``: :func:`node_stack`."""
    return node_stack


@pytest.fixture
def make_server_update():
    """``make_server_update(params, seed=99, scale=0.4)``: :func:`server_update_tree`."""
    return server_update_tree


@pytest.fixture
def node_mesh():
    """The 8 simulated CPU devices as a 1-D ``("node",)`` mesh."""
    from jax.sharding import Mesh

    devices = np.array(jax.devices()[:8])
    assert len(devices) == 8, "conftest must give 8 CPU devices"
    return Mesh(devices, ("node",))
