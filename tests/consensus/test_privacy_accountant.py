"""RDP and PLD accountants against closed forms and independent numerical references.

References used here are written from the definitions, with scipy: numerical integration
of the Renyi moment and of the hockey-stick divergence, the analytic Gaussian mechanism of
Balle & Wang (2018), and a continuous minimization of the RDP-to-DP conversion.
"""

import math
import warnings

import numpy as np
import pytest
from scipy import integrate, optimize, stats

from consensus.privacy import pld as pld_mod
from consensus.privacy.pld import PldAccountant, pld_epsilon, sampled_gaussian_pld
from consensus.privacy.rdp import DEFAULT_ORDERS, RdpAccountant, compute_rdp, rdp_epsilon, rdp_to_epsilon

DELTA = 1e-5


# --- independent references ----------------------------------------------------------------


def ref_rdp(q: float, z: float, alpha: float) -> float:
    """D_alpha(A || B) for A = (1-q) N(0,z^2) + q N(1,z^2), B = N(0,z^2), by quadrature.

    E_B[(A/B)^alpha] is integrated rescaled by its integrand's peak; when the divergence is
    tiny, E_B[(A/B)^alpha - 1] is integrated instead so that log1p keeps the precision.
    """

    def log_ratio(x):
        return np.logaddexp(np.log1p(-q), np.log(q) + (2 * x - 1) / (2 * z * z))

    def log_integrand(x):
        return alpha * log_ratio(x) + stats.norm.logpdf(x, scale=z)

    xs = np.linspace(-12 * z, 12 * z + alpha + 2, 4001)
    peak = float(xs[np.argmax(log_integrand(xs))])
    top = float(log_integrand(peak))
    lo, hi = peak - 40 * z - 1, peak + 40 * z + 1
    opts = dict(points=[0.5, peak], limit=2000, epsabs=1e-300, epsrel=1e-12)
    val, _ = integrate.quad(lambda x: np.exp(log_integrand(x) - top), lo, hi, **opts)
    log_a = top + math.log(val)
    if log_a < 1e-3:
        with warnings.catch_warnings():
            # quad warns that it cannot certify 1e-12 on these tiny integrands; the
            # comparison below checks the agreement independently.
            warnings.simplefilter("ignore", integrate.IntegrationWarning)
            small, _ = integrate.quad(
                lambda x: np.expm1(alpha * log_ratio(x)) * stats.norm.pdf(x, scale=z), lo, hi, **opts
            )
        log_a = math.log1p(small)
    return log_a / (alpha - 1)


def pair_densities(q: float, z: float, direction: str):
    mix = lambda x: (1 - q) * stats.norm.pdf(x, scale=z) + q * stats.norm.pdf(x, loc=1, scale=z)  # noqa: E731
    gauss = lambda x: stats.norm.pdf(x, scale=z)  # noqa: E731
    return (mix, gauss) if direction == "remove" else (gauss, mix)


def ref_delta_quad(eps: float, q: float, z: float, direction: str) -> float:
    """Hockey-stick divergence int (A - e^eps B)_+ by quadrature, split where A = e^eps B."""
    a, b = pair_densities(q, z, direction)
    f = lambda x: a(x) - math.exp(eps) * b(x)  # noqa: E731
    # A / B is monotone in x: find the crossing, integrate the positive side only.
    grid = np.linspace(-30 * z - 5, 30 * z + 5, 20001)
    vals = f(grid)
    pos = vals > 0
    if not pos.any():
        return 0.0
    if pos.all():
        return float(1 - math.exp(eps))
    k = int(np.flatnonzero(np.diff(pos.astype(int)))[0])
    root = optimize.brentq(f, grid[k], grid[k + 1], xtol=1e-14)
    lo, hi = (root, np.inf) if pos[-1] else (-np.inf, root)
    val, _ = integrate.quad(f, lo, hi, epsabs=1e-300, epsrel=1e-12, limit=500)
    return max(val, 0.0)


def ref_delta_closed(eps: np.ndarray, q: float, z: float) -> np.ndarray:
    """Remove-direction hockey stick in closed form (textbook, via scipy.stats.norm), any real eps."""
    eps = np.asarray(eps, dtype=np.float64)
    out = 1 - np.exp(eps)
    live = eps > np.log1p(-q) if q < 1 else np.ones_like(eps, bool)
    e = eps[live]
    x = z * z * np.log((np.exp(e) - (1 - q)) / q) + 0.5
    a_tail = (1 - q) * stats.norm.sf(x / z) + q * stats.norm.sf((x - 1) / z)
    out[live] = a_tail - np.exp(e) * stats.norm.sf(x / z)
    return out


def eps_from_delta_fn(delta_fn, delta: float) -> float:
    if delta_fn(0.0) <= delta:
        return 0.0
    return optimize.brentq(lambda e: delta_fn(e) - delta, 0.0, 200.0, xtol=1e-13, rtol=1e-13)


def analytic_gaussian_delta(eps: float, sigma: float) -> float:
    """Balle & Wang (2018), sensitivity 1, std sigma."""
    return stats.norm.cdf(-eps * sigma + 1 / (2 * sigma)) - math.exp(eps) * stats.norm.cdf(
        -eps * sigma - 1 / (2 * sigma)
    )


def analytic_gaussian_epsilon(sigma: float, delta: float) -> float:
    return eps_from_delta_fn(lambda e: analytic_gaussian_delta(e, sigma), delta)


# --- RDP -----------------------------------------------------------------------------------


@pytest.mark.parametrize("z", [0.3, 1.0, 4.0])
def test_rdp_full_sampling_is_alpha_over_two_z_squared(z):
    orders = np.array([1.001, 1.5, 2.0, 3.0, 7.25, 64.0, 1024.0])
    got = compute_rdp(z, 1.0, 1, orders)
    np.testing.assert_array_equal(got, orders / (2 * z * z))
    np.testing.assert_allclose(compute_rdp(z, 1.0, 7, orders), 7 * orders / (2 * z * z), rtol=1e-15)


@pytest.mark.parametrize(
    "q,z", [(0.01, 1.0), (0.1, 0.7), (0.5, 2.0), (0.01, 0.5), (0.9, 1.0), (0.05, 0.3), (0.001, 3.0)]
)
def test_rdp_sampled_gaussian_matches_quadrature(q, z):
    # Integer orders use the binomial expansion, fractional ones the two alternating series.
    orders = [1.01, 1.5, 2.0, 3.0, 7.5, 20.0, 32.5]
    got = compute_rdp(z, q, 1, orders)
    want = np.array([ref_rdp(q, z, a) for a in orders])
    # atol: log A_alpha is a log of a sum near 1, so float64 fixes it to ~1e-16 absolute.
    np.testing.assert_allclose(got, want, rtol=1e-7, atol=1e-13)


def test_rdp_is_monotone_in_order_and_parameters():
    r = compute_rdp(1.0, 0.05, 1)
    assert np.all(np.diff(r) >= -1e-15)  # RDP is non-decreasing in alpha
    assert np.all(compute_rdp(2.0, 0.05, 1) <= r)
    assert np.all(compute_rdp(1.0, 0.1, 1) >= r)


def test_balle_conversion_matches_continuous_minimization():
    # q = 1, k rounds: rdp(alpha) = k alpha / (2 z^2) exactly, so the best epsilon over all
    # alpha > 1 is a 1-d minimization of Balle et al.'s Theorem 21 expression.
    for z, k in [(1.0, 1), (2.0, 50), (0.8, 10)]:

        def eps_of(alpha, z=z, k=k):
            return (
                k * alpha / (2 * z * z)
                + math.log((alpha - 1) / alpha)
                - (math.log(DELTA) + math.log(alpha)) / (alpha - 1)
            )

        best = optimize.minimize_scalar(
            eps_of, bounds=(1.0001, 1000), method="bounded", options={"xatol": 1e-10}
        )
        got = rdp_epsilon(z, 1.0, k, DELTA)
        assert best.fun - 1e-9 <= got <= best.fun * 1.01
        # and it is a valid upper bound on the exact Gaussian epsilon
        assert got >= analytic_gaussian_epsilon(z / math.sqrt(k), DELTA)


def test_rdp_to_epsilon_returns_best_order():
    orders = np.array([2.0, 4.0, 8.0])
    rdp = np.array([1.0, 3.0, 10.0])
    eps, alpha = rdp_to_epsilon(rdp, DELTA, orders)
    cand = rdp + np.log((orders - 1) / orders) - (np.log(DELTA) + np.log(orders)) / (orders - 1)
    assert eps == pytest.approx(max(0.0, cand.min()), rel=1e-14)
    assert alpha == orders[np.argmin(cand)]


def test_rdp_accountant_composes_additively():
    acc = RdpAccountant()
    acc.compose(1.0, 0.01, 30)
    acc.compose(2.0, 0.1, 20)
    want = compute_rdp(1.0, 0.01, 30) + compute_rdp(2.0, 0.1, 20)
    np.testing.assert_allclose(acc.rdp, want, rtol=1e-14)
    assert acc.epsilon(DELTA) == pytest.approx(rdp_to_epsilon(want, DELTA)[0], rel=1e-14)
    assert RdpAccountant().epsilon(DELTA) == 0.0
    assert rdp_epsilon(1.0, 0.5, 0, DELTA) == 0.0


# --- PLD -----------------------------------------------------------------------------------


@pytest.mark.parametrize("z", [0.5, 1.0, 2.0, 5.0])
def test_pld_one_round_matches_analytic_gaussian(z):
    want = analytic_gaussian_epsilon(z, DELTA)
    got = pld_epsilon(z, 1.0, 1, DELTA, 1e-4)
    assert want - 1e-9 <= got <= want + 1e-6


@pytest.mark.parametrize("z,k", [(1.0, 10), (2.0, 100), (3.0, 64)])
def test_pld_composition_at_full_sampling_is_gaussian_with_z_over_sqrt_k(z, k):
    want = analytic_gaussian_epsilon(z / math.sqrt(k), DELTA)
    got = pld_epsilon(z, 1.0, k, DELTA, 1e-3)
    assert want - 1e-9 <= got <= want * (1 + 1e-4)


def test_hockey_stick_closed_form_reference_agrees_with_quadrature():
    # Guards the reference used below (both are test code, written independently).
    for q, z in [(0.1, 0.7), (0.3, 1.5)]:
        for eps in [-0.5, 0.1, 1.0, 3.0]:
            assert ref_delta_closed(np.array([eps]), q, z)[0] == pytest.approx(
                ref_delta_quad(eps, q, z, "remove"), rel=1e-7, abs=1e-14
            )


@pytest.mark.parametrize("q,z", [(0.1, 0.7), (0.01, 0.5), (0.5, 1.0), (0.05, 2.0)])
def test_pld_one_round_subsampled_matches_hockey_stick_quadrature(q, z):
    # The true epsilon is the larger of the two directions' (add and remove) epsilons.
    want = max(
        eps_from_delta_fn(lambda e: ref_delta_quad(e, q, z, "remove"), DELTA),
        eps_from_delta_fn(lambda e: ref_delta_quad(e, q, z, "add"), DELTA),
    )
    got = pld_epsilon(z, q, 1, DELTA, 1e-4)
    assert want - 1e-7 <= got <= want + 1e-5


def test_pld_delta_curve_dominates_exact_and_is_tight_on_the_grid():
    q, z, h = 0.2, 0.8, 1e-2
    rem, add = sampled_gaussian_pld(z, q, h)
    for eps in [0.0, 0.105, 0.5, 1.337, 2.0]:
        exact_rem = ref_delta_quad(eps, q, z, "remove")
        exact_add = ref_delta_quad(eps, q, z, "add")
        assert rem.delta(eps) >= exact_rem - 1e-12
        assert add.delta(eps) >= exact_add - 1e-12
        if abs(eps / h - round(eps / h)) < 1e-9:  # connect-the-dots is exact at grid points
            assert rem.delta(eps) == pytest.approx(exact_rem, rel=1e-6, abs=1e-13)


def test_pld_two_rounds_subsampled_matches_nested_integral():
    # delta_2(eps) = E_{x ~ A}[delta_1(eps - L(x))] for the remove direction.
    q, z = 0.2, 0.8

    def delta2(eps):
        def inner(x):
            loss = np.logaddexp(np.log1p(-q), np.log(q) + (2 * x - 1) / (2 * z * z))
            a = (1 - q) * stats.norm.pdf(x, scale=z) + q * stats.norm.pdf(x, loc=1, scale=z)
            return a * ref_delta_closed(np.array([eps - loss]), q, z)[0]

        val, _ = integrate.quad(inner, -12 * z, 1 + 12 * z, limit=500, epsabs=1e-15, epsrel=1e-11)
        return val

    rem, _ = sampled_gaussian_pld(z, q, 1e-4)
    two = rem.self_compose(2)
    for eps in [0.5, 1.5, 3.0]:
        want = delta2(eps)
        assert two.delta(eps) >= want - 1e-12
        assert two.delta(eps) == pytest.approx(want, rel=1e-3, abs=1e-12)


def test_pld_moments_reproduce_rdp():
    # RDP of the remove pair is (1 / (alpha-1)) log E_A[exp((alpha-1) L)]: the two accountants
    # describe one distribution and must agree on its moments.
    q, z = 0.1, 1.0
    rem, _ = sampled_gaussian_pld(z, q, 1e-4)
    for alpha in [2.0, 3.0, 4.5]:
        mgf = np.sum(rem.pmf * np.exp((alpha - 1) * rem.losses()))
        got = math.log(mgf) / (alpha - 1)
        assert got == pytest.approx(compute_rdp(z, q, 1, [alpha])[0], rel=2e-3)


@pytest.mark.parametrize("q", [0.01, 0.1, 1.0])
@pytest.mark.parametrize("z", [0.7, 1.0, 2.0])
def test_pld_never_above_rdp(q, z):
    for k in [1, 10, 100]:
        p = pld_epsilon(z, q, k, DELTA, 1e-3)
        r = rdp_epsilon(z, q, k, DELTA)
        assert 0.0 < p <= r + 1e-6, (q, z, k, p, r)


def test_pld_refines_towards_the_limit_from_above():
    q, z, k = 0.05, 1.0, 50
    eps = [pld_epsilon(z, q, k, DELTA, h) for h in (1e-2, 1e-3, 1e-4)]
    assert eps[0] >= eps[1] - 1e-9 >= eps[2] - 2e-9
    assert eps[0] - eps[2] < 0.02


def test_pld_accountant_heterogeneous_composition_and_zero_rounds():
    acc = PldAccountant(1e-3)
    assert acc.epsilon(DELTA) == 0.0
    acc.compose(1.0, 1.0, 3)
    acc.compose(2.0, 1.0, 4)
    acc.compose(1.0, 1.0, 0)
    # Gaussians compose to one Gaussian: 1 / sigma^2 = 3 / 1 + 4 / 4.
    want = analytic_gaussian_epsilon(1 / math.sqrt(3 + 1), DELTA)
    assert want - 1e-9 <= acc.epsilon(DELTA) <= want * (1 + 1e-4)
    assert acc.delta(acc.epsilon(DELTA)) == pytest.approx(DELTA, rel=1e-6)


def test_pld_grid_guard_and_discretization_errors():
    with pytest.raises(ValueError, match="coarser discretization"):
        pld_epsilon(0.01, 1.0, 1, DELTA, 1e-4, max_points=10_000)
    with pytest.raises(ValueError, match="discretization"):
        pld_epsilon(1.0, 0.1, 1, DELTA, 0.0)
    with pytest.raises(ValueError, match="different grids"):
        pld_mod.DiscretePld.identity(1e-3).compose(pld_mod.DiscretePld.identity(1e-4))


# --- bad parameters -------------------------------------------------------------------------


@pytest.mark.parametrize("fn", [rdp_epsilon, pld_epsilon])
@pytest.mark.parametrize(
    "args,match",
    [
        ((1.0, 0.0, 10, DELTA), "sampling_rate"),
        ((1.0, 1.5, 10, DELTA), "sampling_rate"),
        ((1.0, -0.1, 10, DELTA), "sampling_rate"),
        ((0.0, 0.1, 10, DELTA), "noise_multiplier"),
        ((-1.0, 0.1, 10, DELTA), "noise_multiplier"),
        ((float("nan"), 0.1, 10, DELTA), "noise_multiplier"),
        ((1.0, 0.1, -1, DELTA), "rounds"),
        ((1.0, 0.1, 10, 0.0), "delta"),
        ((1.0, 0.1, 10, 1.0), "delta"),
    ],
)
def test_bad_parameters_raise_clear_errors(fn, args, match):
    with pytest.raises(ValueError, match=match):
        fn(*args)


def test_non_integer_rounds_and_bad_orders_rejected():
    with pytest.raises(TypeError, match="rounds"):
        rdp_epsilon(1.0, 0.1, 2.5, DELTA)
    with pytest.raises(ValueError, match="order"):
        compute_rdp(1.0, 0.1, 1, [0.5, 2.0])
    assert len(DEFAULT_ORDERS) > 50 and min(DEFAULT_ORDERS) > 1.0
