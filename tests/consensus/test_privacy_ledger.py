"""Noise calibration and the privacy ledger / budget."""

import json
import math

import pytest
from scipy import optimize, stats

from consensus.privacy import (
    PrivacyBudgetExceeded,
    PrivacyEvent,
    PrivacyLedger,
    calibrate_noise,
    compute_rdp,
    pld_epsilon,
    rdp_epsilon,
    rdp_to_epsilon,
)

DELTA = 1e-5


@pytest.mark.parametrize("target,q,rounds", [(3.0, 0.01, 1000), (1.0, 0.1, 100), (8.0, 1.0, 10)])
def test_calibrated_noise_meets_target_and_is_minimal(target, q, rounds):
    z = calibrate_noise(target, DELTA, q, rounds, rtol=1e-3)
    assert rdp_epsilon(z, q, rounds, DELTA) <= target
    assert rdp_epsilon(z / 1.001, q, rounds, DELTA) > target


def test_pld_calibration_matches_analytic_gaussian():
    # q = 1, k rounds = one Gaussian with sigma = z / sqrt(k): solve Balle & Wang for sigma.
    target, k = 2.0, 4

    def gap(sigma):
        e = target
        d = stats.norm.cdf(-e * sigma + 1 / (2 * sigma)) - math.exp(e) * stats.norm.cdf(
            -e * sigma - 1 / (2 * sigma)
        )
        return d - DELTA

    sigma = optimize.brentq(gap, 0.1, 100, xtol=1e-12)
    z = calibrate_noise(target, DELTA, 1.0, k, "pld", rtol=1e-4, discretization=1e-3)
    assert sigma * math.sqrt(k) <= z * (1 + 1e-9)
    assert z <= sigma * math.sqrt(k) * (1 + 2e-4)
    assert pld_epsilon(z, 1.0, k, DELTA, 1e-3) <= target
    # PLD is tighter than RDP, so it needs less noise for the same target.
    assert z < calibrate_noise(target, DELTA, 1.0, k, "rdp")


def test_calibration_bad_arguments():
    with pytest.raises(ValueError, match="target_epsilon"):
        calibrate_noise(0.0, DELTA, 0.1, 10)
    with pytest.raises(ValueError, match="accountant"):
        calibrate_noise(1.0, DELTA, 0.1, 10, accountant="moments")
    with pytest.raises(ValueError, match="rounds"):
        calibrate_noise(1.0, DELTA, 0.1, 0)
    with pytest.raises(ValueError, match="sampling_rate"):
        calibrate_noise(1.0, DELTA, 0.0, 10)
    with pytest.raises(ValueError, match="delta"):
        calibrate_noise(1.0, 2.0, 0.1, 10)


def test_ledger_tracks_epsilon_and_refuses_the_round_over_budget():
    budget = 1.5
    ledger = PrivacyLedger(DELTA, budget)
    event = PrivacyEvent(noise_multiplier=1.0, sampling_rate=0.02, clip_norm=0.5)
    spent = []
    with pytest.raises(PrivacyBudgetExceeded, match=r"budget 1\.5.*not run") as err:
        for _ in range(10_000):
            spent.append(ledger.spend(event))
    n = len(spent)
    assert n > 0 and ledger.rounds == n and len(ledger.entries) == n
    # Independent check of the stopping point: n rounds fit, n + 1 do not.
    assert rdp_epsilon(1.0, 0.02, n, DELTA) <= budget < rdp_epsilon(1.0, 0.02, n + 1, DELTA)
    assert ledger.epsilon() == pytest.approx(rdp_epsilon(1.0, 0.02, n, DELTA), rel=1e-12)
    assert spent == sorted(spent)
    assert f"round {n + 1} " in str(err.value)
    # Refusal leaves the ledger untouched.
    assert ledger.rounds == n and not ledger.can_spend(event)
    assert ledger.can_spend(PrivacyEvent(1.0, 0.02, rounds=0))


def test_ledger_heterogeneous_events_match_summed_rdp():
    ledger = PrivacyLedger(DELTA)
    events = [
        PrivacyEvent(1.0, 0.01, 1.0, rounds=50),
        PrivacyEvent(2.0, 0.1, 0.3),
        PrivacyEvent(0.8, 1.0, 2.0, 3),
    ]
    for e in events:
        ledger.spend(e)
    rdp = sum(compute_rdp(e.noise_multiplier, e.sampling_rate, e.rounds) for e in events)
    assert ledger.epsilon() == pytest.approx(rdp_to_epsilon(rdp, DELTA)[0], rel=1e-12)
    assert [e["epsilon"] for e in ledger.entries] == sorted(e["epsilon"] for e in ledger.entries)


def test_ledger_pld_accountant_matches_pld_epsilon():
    ledger = PrivacyLedger(DELTA, accountant="pld", discretization=1e-3)
    for _ in range(5):
        ledger.spend(PrivacyEvent(1.0, 0.1))
    want = pld_epsilon(1.0, 0.1, 5, DELTA, 1e-3)
    # Sequential composition truncates at other places than binary powers: both are upper bounds.
    assert ledger.epsilon() == pytest.approx(want, rel=1e-6)
    assert ledger.epsilon() <= rdp_epsilon(1.0, 0.1, 5, DELTA)


def test_ledger_json_round_trip_without_pickle():
    ledger = PrivacyLedger(DELTA, 10.0, "pld", discretization=1e-3)
    for z, q in [(1.0, 0.1), (1.0, 0.1), (2.0, 0.5)]:
        ledger.spend(PrivacyEvent(z, q, clip_norm=1.0))
    text = ledger.to_json()
    data = json.loads(text)
    assert isinstance(data, dict) and isinstance(data["entries"], list)
    back = PrivacyLedger.from_json(text)
    assert back.entries == ledger.entries
    assert back.events == ledger.events
    assert back.epsilon() == pytest.approx(ledger.epsilon(), rel=1e-6)
    assert back.budget == 10.0 and back.accountant == "pld"
    # The rebuilt ledger keeps enforcing the budget.
    assert back.epsilon_after(PrivacyEvent(1.0, 0.1)) == pytest.approx(
        ledger.epsilon_after(PrivacyEvent(1.0, 0.1))
    )
    with pytest.raises(ValueError, match="format"):
        PrivacyLedger.from_dict({"entries": []})


def test_noiseless_event_is_infinite_epsilon():
    ledger = PrivacyLedger(DELTA, budget=100.0)
    with pytest.raises(PrivacyBudgetExceeded):
        ledger.spend(PrivacyEvent(0.0, 1.0))
    free = PrivacyLedger(DELTA)
    free.spend(PrivacyEvent(0.0, 1.0))
    assert math.isinf(free.epsilon())
    assert math.isinf(PrivacyLedger.from_json(free.to_json()).epsilon())


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(noise_multiplier=-1.0), "noise_multiplier"),
        (dict(noise_multiplier=1.0, sampling_rate=0.0), "sampling_rate"),
        (dict(noise_multiplier=1.0, clip_norm=0.0), "clip_norm"),
        (dict(noise_multiplier=1.0, rounds=-2), "rounds"),
    ],
)
def test_bad_events(kwargs, match):
    with pytest.raises(ValueError, match=match):
        PrivacyEvent(**kwargs)


def test_bad_ledger_arguments():
    with pytest.raises(ValueError, match="delta"):
        PrivacyLedger(0.0)
    with pytest.raises(ValueError, match="budget"):
        PrivacyLedger(DELTA, budget=-1.0)
    with pytest.raises(ValueError, match="accountant"):
        PrivacyLedger(DELTA, accountant="gdp")
    with pytest.raises(TypeError, match="PrivacyEvent"):
        PrivacyLedger(DELTA).spend((1.0, 0.1))
