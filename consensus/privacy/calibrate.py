"""Calibration: the smallest noise multiplier that meets a target (epsilon, delta).

Epsilon is decreasing in the noise multiplier z for fixed q, rounds and delta, so the
smallest admissible z is found by bracketing and bisection on log z. The returned z always
meets the target (it is the upper end of the final bracket), and ``z * (1 - rtol)`` does not.
"""

from __future__ import annotations

import math
from collections.abc import Callable

from consensus.privacy._checks import check_delta, check_epsilon, check_rounds, check_sampling_rate
from consensus.privacy.pld import DEFAULT_DISCRETISATION, pld_epsilon
from consensus.privacy.rdp import rdp_epsilon

ACCOUNTANTS = ("rdp", "pld")


def epsilon_fn(accountant: str, discretization: float = DEFAULT_DISCRETISATION) -> Callable[..., float]:
    """Return ``f(noise_multiplier, sampling_rate, rounds, delta) -> epsilon`` for an accountant name.

    Args:
      accountant: ``"rdp"`` or ``"pld"``.
      discretization: The PLD grid step (PLD only).

    Returns:
      The epsilon function.

    Raises:
      ValueError: If the accountant is unknown.
    """
    if accountant == "rdp":
        return rdp_epsilon
    if accountant == "pld":
        return lambda z, q, rounds, delta: pld_epsilon(z, q, rounds, delta, discretization)
    raise ValueError(f"unknown accountant {accountant!r}; choose one of {ACCOUNTANTS}")


def calibrate_noise(
    target_epsilon: float,
    delta: float,
    sampling_rate: float,
    rounds: int,
    accountant: str = "rdp",
    *,
    rtol: float = 1e-3,
    discretization: float = DEFAULT_DISCRETISATION,
    max_noise_multiplier: float = 1e4,
) -> float:
    """Smallest noise multiplier z (to relative tolerance ``rtol``) with epsilon(z) <= target.

    Args:
      target_epsilon: epsilon budget > 0.
      delta: delta in (0, 1).
      sampling_rate: Poisson sampling rate q in (0, 1].
      rounds: number of rounds (>= 1).
      accountant: "rdp" (fast, slightly loose) or "pld" (tight, slower).
      rtol: relative width of the final bracket.
      discretization: PLD grid step (PLD only).
      max_noise_multiplier: give up (ValueError) if even this much noise misses the target.

    Returns:
      z such that ``epsilon(z) <= target_epsilon`` and ``epsilon(z / (1 + rtol)) > target_epsilon``
      (epsilon is decreasing in z). When even z ~ 1e-6 meets the target (a huge budget), that
      tiny z is returned without refining further.

    Raises:
      ValueError: If an argument is out of range (``rounds`` < 1, ``rtol`` outside (0, 1), an
        infinite target, an unknown accountant), or even ``max_noise_multiplier`` misses the
        target.

    Example:
      >>> z = calibrate_noise(3.0, 1e-5, 0.01, 1000)
      >>> rdp_epsilon(z, 0.01, 1000, 1e-5) <= 3.0
      True
    """
    target = check_epsilon(target_epsilon, "target_epsilon")
    delta = check_delta(delta)
    q = check_sampling_rate(sampling_rate)
    rounds = check_rounds(rounds)
    if rounds == 0:
        raise ValueError("rounds must be >= 1 to calibrate noise (zero rounds spend no privacy)")
    if not (0.0 < rtol < 1.0):
        raise ValueError(f"rtol must lie in (0, 1), got {rtol}")
    if math.isinf(target):
        raise ValueError("target_epsilon is infinite: no noise is needed (use noise_multiplier=0)")
    eps = epsilon_fn(accountant, discretization)
    log_target = math.log(target)

    def gap(z: float) -> float:
        # log(eps) - log(target): smooth in log z, so the root search converges in a few steps.
        e = eps(z, q, rounds, delta)
        return math.inf if math.isinf(e) else (math.log(e) - log_target if e > 0 else -math.inf)

    # Bracket lo < hi with gap(lo) > 0 >= gap(hi). The RDP bound is never below the PLD one,
    # so the RDP answer is a good first guess for hi whatever the accountant.
    hi = 1.0
    if accountant != "rdp":
        hi = calibrate_noise(
            target, delta, q, rounds, "rdp", rtol=0.05, max_noise_multiplier=max_noise_multiplier
        )
    f_hi = gap(hi)
    if f_hi <= 0:
        lo, f_lo = hi / 2.0, gap(hi / 2.0)
        while f_lo <= 0:
            hi, f_hi = lo, f_lo
            if hi < 1e-6:
                return hi  # any noise this small meets the target; no need to go further
            lo, f_lo = lo / 2.0, gap(lo / 2.0)
    else:
        lo, f_lo = hi, f_hi
        hi, f_hi = 2.0 * hi, gap(2.0 * hi)
        while f_hi > 0:
            if hi > max_noise_multiplier:
                raise ValueError(
                    f"no noise multiplier up to {max_noise_multiplier} reaches epsilon={target} at "
                    f"delta={delta}, q={q}, rounds={rounds} with the {accountant} accountant"
                )
            lo, f_lo = hi, f_hi
            hi, f_hi = 2.0 * hi, gap(2.0 * hi)
    # Illinois regula falsi on log z, keeping the bracket (the answer is its upper end).
    a, fa, b, fb = math.log(lo), f_lo, math.log(hi), f_hi
    side = 0
    while b - a > math.log1p(rtol):
        if math.isfinite(fa) and math.isfinite(fb) and fa != fb:
            c = b - fb * (b - a) / (fb - fa)
            # Stay strictly inside, and fall back to bisection when the secant hugs an end.
            width = b - a
            c = min(max(c, a + 0.05 * width), b - 0.05 * width)
        else:
            c = 0.5 * (a + b)
        fc = gap(math.exp(c))
        if fc > 0:
            a, fa = c, fc
            if side == -1:
                fb *= 0.5
            side = -1
        else:
            b, fb = c, fc
            if side == 1:
                fa *= 0.5
            side = 1
    return math.exp(b)
