"""Name -> factory registry, for configs and benchmarks only (the library API is plain functions)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from consensus import aggregators as agg
from consensus.base import Aggregator, PreAggregator

AGGREGATORS: dict[str, Callable[..., Aggregator]] = {
    "mean": agg.mean,
    "weighted_mean": agg.weighted_mean,
    "median": agg.median,
    "trimmed_mean": agg.trimmed_mean,
    "krum": agg.krum,
    "multi_krum": agg.multi_krum,
    "bulyan": agg.bulyan,
    "geometric_median": agg.geometric_median,
    "centered_clipping": agg.centered_clipping,
}

PRE_AGGREGATORS: dict[str, Callable[..., PreAggregator]] = {
    "clip": agg.clip,
    "nnm": agg.nnm,
}

# Which keyword carries the Byzantine count for each rule that takes one.
TAKES_NUM_BYZANTINE = {"trimmed_mean", "krum", "multi_krum", "bulyan", "nnm"}


def make(name: str, **kwargs: Any) -> Aggregator | PreAggregator:
    """Build a registered rule by name; an unknown name lists the valid ones."""
    table = {**AGGREGATORS, **PRE_AGGREGATORS}
    if name not in table:
        raise ValueError(f"unknown aggregation rule {name!r}; valid choices: {sorted(table)}")
    return table[name](**kwargs)
