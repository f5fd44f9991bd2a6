"""Both formulations of the order-statistic kernels (networks/selection and jnp.sort) against numpy float64.

Each path is forced (``impl=`` and the context of :mod:`kernels.backend`), on clean rows and on
rows where the attacker sends one vector several times (ties), with masks whose kept count is
static or traced, at sizes that take the sorting network and exact selection.
"""

import jax
import jax.numpy as jnp
import numpy as np
import numpy_reference as ref
import pytest
import robust_reference as rref

from kernels import backend, robust, sorting

IMPLS = backend.ORDER_IMPLS
# 9 and 16: sorting networks; 33: the window rules' selection; 150: every rule's selection.
SIZES = (9, 16, 33, 150)


def _stack(n: int, attacked: bool, d: int = 96, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """(n, d) float32 rows and a keep mask; attacked: f = n // 5 rows are one repeated vector."""
    rng = np.random.default_rng(seed + n)
    x = rng.standard_normal((n, d)).astype(np.float32)
    if attacked:
        x[: max(n // 5, 1)] = np.sort(x, axis=0)[n // 2]  # copies of a value at the median: ties
    keep = np.ones(n, bool)
    keep[[1, n - 2]] = False
    x[n - 2] = np.nan  # garbage in an excluded row must not leak
    return x, keep


def _cases():
    for impl in IMPLS:
        for n in SIZES:
            for attacked in (False, True):
                # The network formulation at 150 rows runs exact selection, which
                # test_large_n_selection covers fast at 65 rows: this size joins the full suite.
                marks = [pytest.mark.slow] if (impl == "network" and n == 150) else []
                yield pytest.param(
                    impl, n, attacked, id=f"{impl}-n{n}-{'ties' if attacked else 'clean'}", marks=marks
                )


@pytest.mark.parametrize("impl,n,attacked", list(_cases()))
@pytest.mark.parametrize("static", [True, False])
def test_every_rule_matches_numpy_float64(impl, n, attacked, static):
    x, keep = _stack(n, attacked)
    m = int(keep.sum())
    f = (m - 3) // 4  # Bulyan's window needs m > 2f; meamed m > f
    xj, kj, mm = jnp.asarray(x), jnp.asarray(keep), (m if static else None)
    x64 = x.astype(np.float64)
    tol = {"rtol": 1e-5, "atol": 1e-6}
    np.testing.assert_allclose(
        np.asarray(sorting.median(xj, kj, m=mm, impl=impl)), ref.median(x64, keep), **tol
    )
    np.testing.assert_allclose(
        np.asarray(sorting.trimmed_mean(xj, f, kj, m=mm, impl=impl)), ref.trimmed_mean(x64, f, keep), **tol
    )
    np.testing.assert_allclose(
        np.asarray(sorting.closest_to_median_mean(xj, f, kj, m=mm, impl=impl)),
        ref.closest_to_median_mean(x64[keep], m - 2 * f),
        **tol,
    )
    np.testing.assert_allclose(
        np.asarray(robust.meamed(xj, f, kj, m=mm, impl=impl)), rref.meamed(x64, f, keep), **tol
    )
    k = m // 3
    np.testing.assert_array_equal(
        np.asarray(sorting.order_statistic(xj, k, kj, impl=impl)), np.sort(x64[keep], axis=0)[k]
    )


@pytest.mark.parametrize("impl", IMPLS)
def test_traced_count_inside_the_users_jit_and_a_diagonal_view(impl):
    n, f = 12, 2
    x, keep = _stack(n, attacked=True)
    scale = np.linspace(0.5, 1.5, n).astype(np.float32)
    centre = np.random.default_rng(1).standard_normal(x.shape[1]).astype(np.float32)
    view = centre + scale[:, None] * (x - centre)  # the rows c + A (x - c) for a diagonal A

    @jax.jit
    def rules(x, keep, mixing, centre):
        kw = {"mixing": mixing, "centre": centre, "impl": impl}
        return sorting.median(x, keep, **kw), sorting.trimmed_mean(x, f, keep, **kw)

    med, tm = rules(jnp.asarray(x), jnp.asarray(keep), jnp.diag(jnp.asarray(scale)), jnp.asarray(centre))
    v64 = view.astype(np.float64)
    np.testing.assert_allclose(np.asarray(med), ref.median(v64, keep), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(np.asarray(tm), ref.trimmed_mean(v64, f, keep), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("n", [8, 150])
def test_nan_and_poison_semantics_are_the_same(impl, n):
    x = np.random.default_rng(n).standard_normal((n, 8)).astype(np.float32)
    x[3, 2] = np.nan  # a kept NaN: that coordinate is NaN
    x[5, 4] = np.inf  # a kept Inf: NaN with poison only
    keep = np.ones(n, bool)
    plain = np.asarray(sorting.median(jnp.asarray(x), impl=impl))
    poisoned = np.asarray(sorting.median(jnp.asarray(x), jnp.asarray(keep), poison=True, impl=impl))
    assert np.isnan(plain[2]) and np.isfinite(plain[4]) and np.isfinite(np.delete(plain, 2)).all()
    assert np.isnan(poisoned[[2, 4]]).all() and np.isfinite(np.delete(poisoned, [2, 4])).all()
    np.testing.assert_array_equal(
        np.asarray(sorting.median(jnp.asarray(x), impl="network")),
        np.asarray(sorting.median(jnp.asarray(x), impl="sort")),
    )


def test_default_on_cpu_is_the_network_and_overrides_take_effect(monkeypatch):
    monkeypatch.delenv(backend.ORDER_IMPL_ENV, raising=False)
    assert backend.order_impl(backend="cpu") == "network"
    assert set(backend.DEFAULT_ORDER_IMPL.values()) <= set(IMPLS)
    if jax.default_backend() == "cpu":
        assert backend.order_impl() == "network"
    with backend.forced_order_impl("sort"):
        assert backend.order_impl() == "sort"
        assert backend.order_impl("network") == "network"  # the argument is strongest
    monkeypatch.setenv(backend.ORDER_IMPL_ENV, "sort")
    assert backend.order_impl(backend="cpu") == "sort"
    with backend.forced_order_impl("network"):
        assert backend.order_impl() == "network"  # the context beats the environment
    monkeypatch.setenv(backend.ORDER_IMPL_ENV, "bitonic")
    with pytest.raises(ValueError, match=backend.ORDER_IMPL_ENV):
        backend.order_impl()
    with pytest.raises(ValueError, match="impl"):
        sorting.median(jnp.zeros((3, 2)), impl="bitonic")


def test_the_context_reaches_the_kernels():
    """Forcing "sort" runs kernels.stack_sort: same values as the default network on CPU."""
    x = jnp.asarray(np.random.default_rng(0).standard_normal((16, 64)).astype(np.float32))
    want = np.asarray(sorting.trimmed_mean(x, 3, impl="network"))
    with backend.forced_order_impl("sort"):
        got = np.asarray(sorting.trimmed_mean(x, 3))
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)


def test_forcing_sort_calls_the_stack_sort_kernels(monkeypatch):
    """Every public order-statistic kernel hands over to kernels.stack_sort when "sort" is chosen."""
    from kernels import stack_sort

    called = []
    for name in ("median", "trimmed_mean", "order_statistic", "nearest_to_median_mean"):
        real = getattr(stack_sort, name)
        monkeypatch.setattr(
            stack_sort, name, lambda *a, real=real, name=name, **k: called.append(name) or real(*a, **k)
        )
    x = jnp.asarray(np.random.default_rng(0).standard_normal((9, 8)).astype(np.float32))
    with backend.forced_order_impl("sort"):
        sorting.median(x), sorting.trimmed_mean(x, 1), sorting.order_statistic(x, 2)
        sorting.closest_to_median_mean(x, 1), robust.meamed(x, 1)
    # Bulyan's window and MeaMed share one kernel (trim = 2f and trim = f).
    assert called == [
        "median",
        "trimmed_mean",
        "order_statistic",
        "nearest_to_median_mean",
        "nearest_to_median_mean",
    ]
    called.clear()
    sorting.median(x), sorting.closest_to_median_mean(x, 1), robust.meamed(x, 1)  # the CPU default
    assert called == [] or jax.default_backend() != "cpu"
