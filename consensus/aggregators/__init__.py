"""Aggregation rules (n stacked trees -> one tree) and pre-aggregators (n -> n)."""

from consensus.aggregators.arc import arc
from consensus.aggregators.averaging import mean, weighted_mean
from consensus.aggregators.bucketing import bucketing
from consensus.aggregators.compose import ProcessState, chain, process
from consensus.aggregators.coordinatewise import median, trimmed_mean
from consensus.aggregators.dnc import dnc
from consensus.aggregators.filters import caf, smea
from consensus.aggregators.geometric import centered_clipping, geometric_median
from consensus.aggregators.grouped import GroupedVoteState, grouped_vote
from consensus.aggregators.krum import bulyan, krum, multi_krum
from consensus.aggregators.meamed import meamed
from consensus.aggregators.pre import ClipState, MixState, clip, nnm
from consensus.aggregators.server import fltrust, server_monna
from consensus.aggregators.signguard import signguard

__all__ = [
    "ClipState",
    "GroupedVoteState",
    "MixState",
    "ProcessState",
    "arc",
    "bucketing",
    "bulyan",
    "caf",
    "centered_clipping",
    "chain",
    "clip",
    "dnc",
    "fltrust",
    "geometric_median",
    "grouped_vote",
    "krum",
    "meamed",
    "mean",
    "median",
    "multi_krum",
    "nnm",
    "process",
    "server_monna",
    "signguard",
    "smea",
    "trimmed_mean",
    "weighted_mean",
]
