"""meta-consensus: model merging by consensus on JAX (coordinator side).

One flat namespace over small private modules, in the style of optax::

    import consensus
    stacked = consensus.stack(node_params)            # leading node axis
    agg = consensus.chain(consensus.nnm(2), consensus.krum(2))
    state = agg.init(global_params)
    merged, state = agg.update(stacked, state, global_params)
    consensus.get_info(state).selected                # which nodes were kept
"""

from consensus.aggregators import (
    ClipState,
    MixState,
    ProcessState,
    bulyan,
    centered_clipping,
    chain,
    clip,
    geometric_median,
    krum,
    mean,
    median,
    multi_krum,
    nnm,
    process,
    trimmed_mean,
    weighted_mean,
)
from consensus.base import (
    AggregationInfo,
    Aggregator,
    ByzantineToleranceError,
    PreAggregator,
    get_info,
)
from consensus.tree import (
    NonFiniteError,
    TreeMismatchError,
    broadcast,
    check_finite,
    check_same_structure,
    combine,
    finite_mask,
    gram,
    nonfinite_report,
    num_nodes,
    sq_norms,
    stack,
    unstack,
    weighted_sum,
)

__all__ = [
    "AggregationInfo",
    "Aggregator",
    "ByzantineToleranceError",
    "ClipState",
    "MixState",
    "NonFiniteError",
    "PreAggregator",
    "ProcessState",
    "TreeMismatchError",
    "broadcast",
    "bulyan",
    "centered_clipping",
    "chain",
    "check_finite",
    "check_same_structure",
    "clip",
    "combine",
    "finite_mask",
    "geometric_median",
    "get_info",
    "gram",
    "krum",
    "mean",
    "median",
    "multi_krum",
    "nnm",
    "nonfinite_report",
    "num_nodes",
    "process",
    "sq_norms",
    "stack",
    "trimmed_mean",
    "unstack",
    "weighted_mean",
    "weighted_sum",
]
