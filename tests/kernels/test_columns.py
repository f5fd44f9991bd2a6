"""Column-parallel dispatch of the selection kernels (issue 19): same bits on any number of threads.

Each range runs the same compiled kernel over its own columns, so a split call must equal the
single call bit for bit; the integer data make the order statistics exact, so both must also
equal numpy's float64 answer.
"""

import jax
import jax.numpy as jnp
import numpy as np
import numpy_reference as ref
import pytest
import robust_reference as rref

from kernels import columns, robust, selection, sorting


@pytest.mark.parametrize("cols", [1, 5, 7, 8, 100, 101, 4096])
@pytest.mark.parametrize("parts", [1, 2, 3, 4, 8])
def test_ranges_cover_every_column_once_with_one_width(cols, parts):
    width, plan = columns.ranges(cols, parts)
    got = np.concatenate([np.arange(start, start + width)[lo:hi] for start, lo, hi in plan])
    np.testing.assert_array_equal(got, np.arange(cols))
    assert all(start >= 0 and start + width <= cols for start, _, _ in plan)
    assert len(plan) <= parts


def test_thread_setting_is_checked(monkeypatch):
    assert columns.kernel_threads("3") == 3 and columns.kernel_threads(" 1 ") == 1
    assert 1 <= columns.kernel_threads("") <= columns.MAX_THREADS
    for bad in ("0", "-2", "two", "1.5"):
        with pytest.raises(ValueError, match="META_CONSENSUS_KERNEL_THREADS must be a positive integer"):
            columns.kernel_threads(bad)


def _case(n: int, shape: tuple[int, ...], seed: int):
    rng = np.random.default_rng(seed)
    x = rng.integers(-12, 13, (n, *shape)).astype(np.float32)
    x[1 : 1 + n // 5] = x[0]  # one vector repeated: ties
    x[3] = np.nan  # excluded below
    keep = np.ones(n, bool)
    keep[3] = False
    return x, keep, int(keep.sum())


def _split_calls(monkeypatch, threads: int) -> list:
    """Force the split on small inputs; returns the list of column starts each call ran."""
    monkeypatch.setenv(columns.ENV, str(threads))
    monkeypatch.setattr(columns, "MIN_ENTRIES", 0)
    seen = []
    real = columns.ranges

    def spy(cols, parts):
        width, plan = real(cols, parts)
        seen.append([start for start, _, _ in plan])
        return width, plan

    monkeypatch.setattr(columns, "ranges", spy)
    return seen


@pytest.mark.slow
def test_split_calls_equal_one_call_and_numpy(monkeypatch):
    n = 130  # selection (above NETWORK_MAX); 256-column blocks, so 1031 columns make 4 ranges
    x, keep, m = _case(n, (1031,), seed=0)
    f = (m - 3) // 4
    xj, kj = jnp.asarray(x), jnp.asarray(keep)
    calls = {
        "median": lambda: sorting.median(xj, kj, m=m),
        "trimmed mean": lambda: sorting.trimmed_mean(xj, f, kj, m=m),
        "order statistic": lambda: sorting.order_statistic(jnp.where(kj[:, None], xj, jnp.inf), 17),
        "Bulyan's second stage": lambda: sorting.closest_to_median_mean(xj, f, kj, m=m),
        "MeaMed": lambda: robust.meamed(xj, f, kj, m=m),
    }
    monkeypatch.setenv(columns.ENV, "1")
    single = {name: np.asarray(call()) for name, call in calls.items()}
    seen = _split_calls(monkeypatch, 3)
    split = {name: np.asarray(call()) for name, call in calls.items()}
    assert len(seen) == len(calls) and all(len(starts) == 3 for starts in seen)
    for name in calls:
        np.testing.assert_array_equal(split[name], single[name], err_msg=name)
    X = x[keep].astype(np.float64)
    np.testing.assert_array_equal(split["median"], np.median(X, axis=0))
    np.testing.assert_allclose(split["trimmed mean"], ref.trimmed_mean(X, f, np.ones(m, bool)), atol=2e-6)
    np.testing.assert_array_equal(split["order statistic"], np.sort(X, axis=0)[17])
    bulyan = ref.closest_to_median_mean(X, m - 2 * f)
    np.testing.assert_allclose(split["Bulyan's second stage"], bulyan, rtol=0, atol=2e-6)
    np.testing.assert_allclose(split["MeaMed"], rref.meamed(x.astype(np.float64), f, keep), rtol=0, atol=2e-6)


def test_split_handles_views_poison_and_leaf_shapes(monkeypatch):
    """A dense mixing view with a centre, a kept NaN with poison, an (n, a, b) leaf, numpy input."""
    n = 129
    x, keep, m = _case(n, (9, 61), seed=1)
    x[3] = x[4]  # every row finite, for the view
    x[7, 2, 5] = np.nan  # a kept NaN: that coordinate only is NaN
    rng = np.random.default_rng(2)
    mixing = np.eye(n, dtype=np.float32) + 0.01 * (rng.random((n, n)) < 0.02)
    centre = rng.integers(-3, 4, (9, 61)).astype(np.float32)
    calls = {
        "view": lambda: sorting.median(
            jnp.asarray(x), mixing=jnp.asarray(mixing), centre=jnp.asarray(centre), diagonal=False, m=n
        ),
        "poison": lambda: sorting.trimmed_mean(x, 10, m=n, poison=True),
    }
    monkeypatch.setenv(columns.ENV, "1")
    single = {name: np.asarray(call()) for name, call in calls.items()}
    seen = _split_calls(monkeypatch, 2)
    split = {name: np.asarray(call()) for name, call in calls.items()}
    assert [len(s) for s in seen] == [2, 2]
    for name in calls:
        assert split[name].shape == (9, 61)
        np.testing.assert_array_equal(split[name], single[name], err_msg=name)
    poisoned = np.isnan(split["poison"])
    assert poisoned[2, 5] and poisoned.sum() == 1


def test_no_split_under_a_trace(monkeypatch):
    """Inside the user's jit the kernel is traced once over every column (no threads, same values)."""
    seen = _split_calls(monkeypatch, 4)
    x, keep, m = _case(130, (600,), seed=3)
    x[3] = 0.0
    eager = np.asarray(selection.median(jnp.asarray(x)))
    assert len(seen) == 1
    traced = np.asarray(jax.jit(selection.median)(jnp.asarray(x)))
    assert len(seen) == 1
    np.testing.assert_array_equal(traced, eager)
