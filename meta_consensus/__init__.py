"""The meta-consensus system: config, the coordinator's round, the run loop, checkpoints and reports.

This is the one place where the coordinator (``consensus``) and the node side
(``strategies``) are wired together; the library below it never imports
``strategies``.

* :mod:`meta_consensus.config` - the run config (TOML, ``--set`` overrides, checks);
* :mod:`meta_consensus.fleet` - the nodes and their strategies, trained in one jitted step;
* :mod:`meta_consensus.pipeline` - vote -> convex weights -> DP as one aggregator;
* :mod:`meta_consensus.coordinator` - ``init`` / ``round``, the round lifecycle and its info;
* :mod:`meta_consensus.run` - :class:`MetaConsensus`: rounds, retries, logs, checkpoints;
* :mod:`meta_consensus.report` - metrics.jsonl, TensorBoard, plots and the final table.
"""

from meta_consensus.config import Config, ConfigError, load
from meta_consensus.coordinator import Coordinator, CoordinatorState, RoundInfo
from meta_consensus.run import MetaConsensus, RunResult

__all__ = [
    "Config",
    "ConfigError",
    "Coordinator",
    "CoordinatorState",
    "MetaConsensus",
    "RoundInfo",
    "RunResult",
    "load",
]
