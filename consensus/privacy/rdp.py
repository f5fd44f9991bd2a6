"""Renyi DP of the Poisson-subsampled Gaussian mechanism, and its conversion to (epsilon, delta).

One round of DP-FedAvg releases ``sum of clipped updates + N(0, (z C)^2)`` over the nodes
that a Poisson sample with rate q selected. Scaled by the sensitivity C this is the
*sampled Gaussian mechanism* with noise multiplier z. Under add/remove adjacency its Renyi
divergence of order alpha is ``log(A_alpha) / (alpha - 1)`` with (Mironov, Talwar & Zhang 2019)

    A_alpha = E_{x ~ N(0, z^2)} [ ((1 - q) + q * exp((2x - 1) / (2 z^2)))^alpha ].

For integer alpha the binomial expansion gives

    A_alpha = sum_{i=0}^{alpha} C(alpha, i) q^i (1 - q)^(alpha - i) exp((i^2 - i) / (2 z^2)),

and for fractional alpha the integral splits at ``x0 = z^2 log(1/q - 1) + 1/2`` into two
convergent alternating series (their Section 3.3; the same series as TF-Privacy's and
Opacus' ``_compute_log_a_frac``). Both are evaluated in log space with signed
log-sum-exp. With q = 1 the mechanism is the plain Gaussian and RDP is exactly
``alpha / (2 z^2)``. Mironov et al. (Theorem 5) show that the mixture-versus-Gaussian
order computed here dominates the reverse order, so the bound covers both add and remove.

RDP composes by addition over rounds; the conversion to (epsilon, delta) is Theorem 21
of Balle et al. (2020),

    epsilon = rdp(alpha) + log((alpha - 1) / alpha) - (log delta + log alpha) / (alpha - 1),

minimized over a grid of orders.

References:
  I. Mironov, K. Talwar, L. Zhang. Renyi Differential Privacy of the Sampled Gaussian
  Mechanism. arXiv:1908.10530, 2019.
  B. Balle, G. Barthe, M. Gaboardi, J. Hsu, T. Sato. Hypothesis Testing Interpretations and
  Renyi Differential Privacy. AISTATS 2020.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from scipy import special

from consensus.privacy._checks import check_delta, check_noise_multiplier, check_rounds, check_sampling_rate

# Orders: a fine grid near 1 (large epsilons, many rounds at q = 1 want alpha -> 1+), quarter
# steps to 10, integers to 64, then a geometric tail (tiny epsilons want large alpha).
DEFAULT_ORDERS: tuple[float, ...] = tuple(
    float(a)
    for a in np.unique(
        np.concatenate(
            [
                1.0 + np.geomspace(1e-3, 0.2, 24),
                np.arange(1.25, 10.0, 0.25),
                np.arange(10.0, 64.0),
                [64.0, 80.0, 96.0, 128.0, 160.0, 192.0, 256.0, 384.0, 512.0, 768.0, 1024.0],
            ]
        )
    )
)

# The fractional series alternates in sign once i > alpha and its terms then decay only
# polynomially (~ i^-(alpha+2)): summing them to 1e-16 would take ~1e5 terms near alpha = 1.
# Instead the first ceil(alpha) + _HEAD terms are summed exactly and the smooth alternating
# tail is summed by the Euler (van Wijngaarden) transform of _TAIL partial sums, which
# removes the truncation error to far below float64 rounding.
_HEAD = 64
_TAIL = 48


def _check_orders(orders: Sequence[float] | np.ndarray | None) -> np.ndarray:
    a = np.asarray(DEFAULT_ORDERS if orders is None else orders, dtype=np.float64).reshape(-1)
    if a.size == 0:
        raise ValueError("orders must not be empty")
    if not np.all(np.isfinite(a)) or np.any(a <= 1.0):
        raise ValueError(f"every RDP order must be finite and > 1, got {a[(~np.isfinite(a)) | (a <= 1.0)]}")
    return a


def _log_a_int(q: float, z: float, alpha: int) -> float:
    """Compute log A_alpha for integer alpha >= 2 by the binomial expansion (all terms positive)."""
    i = np.arange(alpha + 1, dtype=np.float64)
    log_binom = special.gammaln(alpha + 1.0) - special.gammaln(i + 1.0) - special.gammaln(alpha - i + 1.0)
    log_terms = log_binom + i * np.log(q) + (alpha - i) * np.log1p(-q) + (i * i - i) / (2.0 * z * z)
    return float(special.logsumexp(log_terms))


def _log_a_frac(q: float, z: float, alpha: float) -> float:
    """Compute log A_alpha for fractional alpha > 1 by the two alternating series of Mironov et al."""
    x0 = z * z * np.log(1.0 / q - 1.0) + 0.5
    n_head = int(np.ceil(alpha)) + _HEAD
    i = np.arange(n_head + _TAIL, dtype=np.float64)
    j = alpha - i
    # |C(alpha, i)| = Gamma(alpha+1) / (Gamma(i+1) |Gamma(alpha-i+1)|); the sign is that of
    # Gamma(alpha - i + 1), alternating once i > alpha.
    log_binom = special.gammaln(alpha + 1.0) - special.gammaln(i + 1.0) - special.gammaln(j + 1.0)
    sign = special.gammasgn(j + 1.0)
    # First series: the part of the integral with x <= x0, weight Phi((x0 - i) / z);
    # second series: x > x0, weight Phi((j - x0) / z).
    log_q, log_1mq, two_var = np.log(q), np.log1p(-q), 2.0 * z * z
    log_s0 = log_binom + i * log_q + j * log_1mq + (i * i - i) / two_var + special.log_ndtr((x0 - i) / z)
    log_s1 = log_binom + j * log_q + i * log_1mq + (j * j - j) / two_var + special.log_ndtr((j - x0) / z)
    # Both series share the sign of C(alpha, i): add them per i, in units of the largest term.
    log_t = np.logaddexp(log_s0, log_s1)
    scale = float(np.max(log_t))
    t = sign * np.exp(log_t - scale)
    head = float(np.sum(t[:n_head]))
    # Euler transform: repeatedly average neighbouring partial sums of the alternating tail.
    partial = np.cumsum(t[n_head:])
    for _ in range(_TAIL - 1):
        partial = 0.5 * (partial[1:] + partial[:-1])
    total = head + float(partial[0])
    if not total > 0.0:
        raise FloatingPointError(f"RDP series for alpha={alpha}, q={q}, z={z} lost all precision")
    return scale + float(np.log(total))


def compute_rdp(
    noise_multiplier: float,
    sampling_rate: float,
    rounds: int = 1,
    orders: Sequence[float] | np.ndarray | None = None,
) -> np.ndarray:
    """RDP of ``rounds`` compositions of the Poisson-subsampled Gaussian mechanism.

    ``rdp[k] = rounds * log(A_{alpha_k}) / (alpha_k - 1)`` (see the module docstring).

    Args:
      noise_multiplier: z > 0, the noise std divided by the L2 sensitivity.
      sampling_rate: q in (0, 1], the Poisson sampling probability of each node.
      rounds: number of rounds composed (>= 0).
      orders: Renyi orders alpha > 1 (default :data:`DEFAULT_ORDERS`).

    Returns:
      float64 array of RDP values, one per order.

    Raises:
      ValueError: If z, q or rounds is out of range, or an order is not finite and > 1.

    Example:
      >>> compute_rdp(2.0, 1.0, 1, orders=[2.0, 3.0])   # alpha / (2 z^2)
      array([0.25 , 0.375])
    """
    z = check_noise_multiplier(noise_multiplier)
    q = check_sampling_rate(sampling_rate)
    rounds = check_rounds(rounds)
    alphas = _check_orders(orders)
    if q == 1.0:
        return rounds * alphas / (2.0 * z * z)
    out = np.empty_like(alphas)
    for k, alpha in enumerate(alphas):
        integer = float(alpha).is_integer()
        log_a = _log_a_int(q, z, int(alpha)) if integer else _log_a_frac(q, z, float(alpha))
        out[k] = log_a / (alpha - 1.0)
    # Rounding in the series can leave a tiny negative value where the divergence is ~0.
    return rounds * np.maximum(out, 0.0)


def rdp_to_epsilon(
    rdp: np.ndarray, delta: float, orders: Sequence[float] | np.ndarray | None = None
) -> tuple[float, float]:
    """Convert RDP values to (epsilon, delta)-DP with Balle et al. (2020), Theorem 21.

    ``epsilon = min_alpha rdp(alpha) + log((alpha-1)/alpha) - (log delta + log alpha)/(alpha-1)``,
    clamped at 0.

    Args:
      rdp: RDP value per order (as from :func:`compute_rdp`).
      delta: target delta in (0, 1).
      orders: the orders ``rdp`` was computed at (default :data:`DEFAULT_ORDERS`).

    Returns:
      ``(epsilon, best_order)``.

    Raises:
      ValueError: If delta is outside (0, 1) or ``rdp`` and ``orders`` differ in length.

    References:
      Balle, Barthe, Gaboardi, Hsu and Sato 2020, AISTATS, "Hypothesis Testing
      Interpretations and Renyi Differential Privacy", Theorem 21.
    """
    delta = check_delta(delta)
    alphas = _check_orders(orders)
    rdp = np.asarray(rdp, dtype=np.float64).reshape(-1)
    if rdp.shape != alphas.shape:
        raise ValueError(f"rdp has {rdp.size} values but there are {alphas.size} orders")
    eps = rdp + np.log1p(-1.0 / alphas) - (np.log(delta) + np.log(alphas)) / (alphas - 1.0)
    eps = np.where(np.isnan(eps), np.inf, eps)
    k = int(np.argmin(eps))
    return max(0.0, float(eps[k])), float(alphas[k])


def rdp_epsilon(
    noise_multiplier: float,
    sampling_rate: float,
    rounds: int,
    delta: float,
    *,
    orders: Sequence[float] | None = None,
) -> float:
    """Epsilon of ``rounds`` Poisson-subsampled Gaussian rounds at the given delta (RDP accountant).

    Args:
      noise_multiplier: z > 0 (noise std / L2 sensitivity).
      sampling_rate: q in (0, 1].
      rounds: number of rounds (>= 0; 0 rounds cost epsilon 0).
      delta: target delta in (0, 1).
      orders: Renyi orders to optimize over (default :data:`DEFAULT_ORDERS`).

    Returns:
      epsilon (float, >= 0).

    Raises:
      ValueError: If an argument is out of range.

    Example:
      >>> round(rdp_epsilon(1.0, 0.01, 1000, 1e-5), 2)
      2.1

    References:
      Mironov, Talwar & Zhang (2019); Balle et al. (2020), Theorem 21.
    """
    delta = check_delta(delta)
    rounds = check_rounds(rounds)
    rdp = compute_rdp(noise_multiplier, sampling_rate, rounds, orders)
    if rounds == 0:
        return 0.0
    return rdp_to_epsilon(rdp, delta, orders)[0]


class RdpAccountant:
    """Running RDP of a sequence of (possibly different) sampled Gaussian rounds.

    RDP adds up over rounds order by order, so composing is one vector addition.

    Example:
      >>> acc = RdpAccountant()
      >>> acc.compose(1.0, 0.01, rounds=100)
      >>> round(acc.epsilon(1e-5), 2)  # PldAccountant's is 0.72
      1.22
    """

    def __init__(self, orders: Sequence[float] | np.ndarray | None = None):
        self.orders = _check_orders(orders)
        self.rdp = np.zeros_like(self.orders)
        # One round's RDP per (z, q): a ledger composes the same event round after round.
        self._cache: dict[tuple[float, float], np.ndarray] = {}

    def compose(self, noise_multiplier: float, sampling_rate: float, rounds: int = 1) -> None:
        """Add ``rounds`` rounds with noise multiplier z and sampling rate q.

        Args:
          noise_multiplier: z > 0.
          sampling_rate: q in (0, 1].
          rounds: The number of rounds (>= 0).

        Raises:
          ValueError: If an argument is out of range.
        """
        z, q = check_noise_multiplier(noise_multiplier), check_sampling_rate(sampling_rate)
        rounds = check_rounds(rounds)
        if (z, q) not in self._cache:
            self._cache[(z, q)] = compute_rdp(z, q, 1, self.orders)
        self.rdp = self.rdp + rounds * self._cache[(z, q)]

    def epsilon(self, delta: float) -> float:
        """Return the epsilon spent so far at the given delta (0 before any round).

        Args:
          delta: Target delta in (0, 1).

        Returns:
          Epsilon (float, >= 0).

        Raises:
          ValueError: If delta is outside (0, 1).
        """
        delta = check_delta(delta)
        if not np.any(self.rdp > 0):
            return 0.0
        return rdp_to_epsilon(self.rdp, delta, self.orders)[0]

    def copy(self) -> RdpAccountant:
        """Return an independent accountant with the same history."""
        out = RdpAccountant(self.orders)
        out.rdp, out._cache = self.rdp.copy(), self._cache
        return out
