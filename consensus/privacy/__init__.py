"""Privacy accounting for DP consensus: RDP and PLD accountants, calibration, a budget ledger.

Everything here is numpy/scipy on the host; the mechanism itself (clipping and noising on
device) lives in :mod:`consensus.dp`.

* :func:`rdp_epsilon` - Renyi DP of the Poisson-subsampled Gaussian (Mironov et al. 2019),
  converted with Balle et al. (2020), Theorem 21.
* :func:`pld_epsilon` - pessimistic privacy loss distributions composed by FFT.
* :func:`calibrate_noise` - the smallest noise multiplier meeting a target (epsilon, delta).
* :class:`PrivacyLedger` - per-round events, epsilon spent, and a budget the coordinator
  refuses to exceed (:class:`PrivacyBudgetExceeded`).
"""

from consensus.privacy.calibrate import calibrate_noise
from consensus.privacy.ledger import PrivacyBudgetExceeded, PrivacyEvent, PrivacyLedger
from consensus.privacy.pld import DiscretePld, PldAccountant, pld_epsilon, sampled_gaussian_pld
from consensus.privacy.rdp import DEFAULT_ORDERS, RdpAccountant, compute_rdp, rdp_epsilon, rdp_to_epsilon

__all__ = [
    "DEFAULT_ORDERS",
    "DiscretePld",
    "PldAccountant",
    "PrivacyBudgetExceeded",
    "PrivacyEvent",
    "PrivacyLedger",
    "RdpAccountant",
    "calibrate_noise",
    "compute_rdp",
    "pld_epsilon",
    "rdp_epsilon",
    "rdp_to_epsilon",
    "sampled_gaussian_pld",
]
