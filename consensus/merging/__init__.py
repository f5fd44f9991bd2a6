"""Model-merging methods over task vectors (``params`` = the common base), one module per family.

Each is an :class:`~consensus.base.Aggregator` (DARE a
:class:`~consensus.base.PreAggregator`) of the usual optax shape, so it composes
with the votes: ``process(ties(0.2), pre=[nnm(f)])``.
"""

from consensus.merging.arithmetic import linear, task_arithmetic
from consensus.merging.dare import DareState, dare, dare_linear, dare_ties
from consensus.merging.fisher import fisher_merge
from consensus.merging.layerwise import LayerwiseState, LayerwiseWeights, layerwise_weights, solve_layerwise
from consensus.merging.regmean import regmean
from consensus.merging.slerp import SphereState, karcher_mean, slerp
from consensus.merging.stock import StockState, model_stock
from consensus.merging.ties import ties

__all__ = [
    "DareState",
    "LayerwiseState",
    "LayerwiseWeights",
    "SphereState",
    "StockState",
    "dare",
    "dare_linear",
    "dare_ties",
    "fisher_merge",
    "karcher_mean",
    "layerwise_weights",
    "linear",
    "model_stock",
    "regmean",
    "slerp",
    "solve_layerwise",
    "task_arithmetic",
    "ties",
]
