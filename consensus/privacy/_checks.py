"""Argument checks shared by the accountants (clear errors for bad privacy parameters)."""

from __future__ import annotations

import math
import numbers


def check_noise_multiplier(z: float) -> float:
    """Return ``z`` as a float, or raise ValueError unless it is finite and > 0."""
    if isinstance(z, bool) or not isinstance(z, numbers.Real):
        raise TypeError(f"noise_multiplier must be a real number, got {type(z).__name__}")
    z = float(z)
    if not (math.isfinite(z) and z > 0.0):
        raise ValueError(f"noise_multiplier must be finite and > 0, got {z}")
    return z


def check_sampling_rate(q: float) -> float:
    """Return ``q`` as a float, or raise ValueError unless 0 < q <= 1."""
    if isinstance(q, bool) or not isinstance(q, numbers.Real):
        raise TypeError(f"sampling_rate must be a real number, got {type(q).__name__}")
    q = float(q)
    if not (0.0 < q <= 1.0):
        raise ValueError(f"sampling_rate must lie in (0, 1], got {q}")
    return q


def check_delta(delta: float) -> float:
    """Return ``delta`` as a float, or raise ValueError unless 0 < delta < 1."""
    if isinstance(delta, bool) or not isinstance(delta, numbers.Real):
        raise TypeError(f"delta must be a real number, got {type(delta).__name__}")
    delta = float(delta)
    if not (0.0 < delta < 1.0):
        raise ValueError(f"delta must lie in (0, 1), got {delta}")
    return delta


def check_epsilon(epsilon: float, name: str = "epsilon") -> float:
    """Return ``epsilon`` as a float, or raise ValueError unless it is > 0 (inf allowed)."""
    if isinstance(epsilon, bool) or not isinstance(epsilon, numbers.Real):
        raise TypeError(f"{name} must be a real number, got {type(epsilon).__name__}")
    epsilon = float(epsilon)
    if not epsilon > 0.0:  # also rejects NaN
        raise ValueError(f"{name} must be > 0, got {epsilon}")
    return epsilon


def check_rounds(rounds: int) -> int:
    """Return ``rounds`` as an int, or raise unless it is a non-negative integer."""
    if isinstance(rounds, bool) or not isinstance(rounds, numbers.Integral):
        if isinstance(rounds, numbers.Real) and float(rounds).is_integer():
            rounds = int(rounds)
        else:
            raise TypeError(f"rounds must be a non-negative integer, got {rounds!r}")
    rounds = int(rounds)
    if rounds < 0:
        raise ValueError(f"rounds must be >= 0, got {rounds}")
    return rounds
