"""meta-consensus: model merging by consensus on JAX (coordinator side).

One flat namespace over small private modules, in the style of optax::

    import consensus
    stacked = consensus.stack(node_params)            # leading node axis
    agg = consensus.chain(consensus.nnm(2), consensus.krum(2))
    state = agg.init(global_params)
    merged, state = agg.update(stacked, state, global_params)
    consensus.get_info(state).selected                # which nodes were kept
"""

from consensus import dp, privacy
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
from consensus.dp import (
    AdaptiveClipConfig,
    check_dp_compatible,
    dp_fedavg,
    dp_sensitivity,
    dp_weighted_mean,
    privacy_event,
    privatise,
    round_participants,
    sample_participants,
)
from consensus.privacy import PrivacyBudgetExceeded, PrivacyEvent, PrivacyLedger, calibrate_noise
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
    "AdaptiveClipConfig",
    "AggregationInfo",
    "Aggregator",
    "ByzantineToleranceError",
    "ClipState",
    "MixState",
    "NonFiniteError",
    "PreAggregator",
    "PrivacyBudgetExceeded",
    "PrivacyEvent",
    "PrivacyLedger",
    "ProcessState",
    "TreeMismatchError",
    "broadcast",
    "bulyan",
    "calibrate_noise",
    "check_dp_compatible",
    "centered_clipping",
    "chain",
    "check_finite",
    "check_same_structure",
    "clip",
    "combine",
    "dp",
    "dp_fedavg",
    "dp_sensitivity",
    "dp_weighted_mean",
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
    "privacy",
    "privacy_event",
    "privatise",
    "process",
    "round_participants",
    "sample_participants",
    "sq_norms",
    "stack",
    "trimmed_mean",
    "unstack",
    "weighted_mean",
    "weighted_sum",
]
