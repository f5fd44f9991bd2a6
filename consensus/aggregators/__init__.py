"""Aggregation rules (n stacked trees -> one tree) and pre-aggregators (n -> n)."""

from consensus.aggregators.averaging import mean, weighted_mean
from consensus.aggregators.compose import ProcessState, chain, process
from consensus.aggregators.coordinatewise import median, trimmed_mean
from consensus.aggregators.geometric import centered_clipping, geometric_median
from consensus.aggregators.grouped import GroupedVoteState, grouped_vote
from consensus.aggregators.krum import bulyan, krum, multi_krum
from consensus.aggregators.pre import ClipState, MixState, clip, nnm

__all__ = [
    "ClipState",
    "MixState",
    "ProcessState",
    "bulyan",
    "centered_clipping",
    "chain",
    "clip",
    "geometric_median",
    "GroupedVoteState",
    "grouped_vote",
    "krum",
    "mean",
    "median",
    "multi_krum",
    "nnm",
    "process",
    "trimmed_mean",
    "weighted_mean",
]
