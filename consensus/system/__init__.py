"""The meta-consensus system: config, the coordinator's round, the run loop, checkpoints and reports.

This is the one place where the coordinator (``consensus``) and the node side
(``strategies``) are wired together; the library below it never imports
``strategies``.

* :mod:`consensus.system.config` - the run config (TOML, ``--set`` overrides, checks);
* :mod:`consensus.system.fleet` - the nodes and their strategies, trained in one jitted step;
* :mod:`consensus.system.pipeline` - vote -> convex weights -> DP as one aggregator;
* :mod:`consensus.system.coordinator` - ``init`` / ``round``, the round lifecycle and its info;
* :mod:`consensus.system.run` - :class:`MetaConsensus`: rounds, retries, logs, checkpoints;
* :mod:`consensus.system.report` - metrics.jsonl, TensorBoard, plots and the final table.
"""

from consensus.system.config import Config, ConfigError, load
from consensus.system.coordinator import Coordinator, CoordinatorState, RoundInfo
from consensus.system.run import MetaConsensus, RunResult

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
