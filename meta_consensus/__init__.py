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

import importlib
from typing import TYPE_CHECKING, Any

from meta_consensus._version import __version__

if TYPE_CHECKING:
    from meta_consensus.config import Config, ConfigError, load
    from meta_consensus.coordinator import Coordinator, CoordinatorState, RoundInfo
    from meta_consensus.run import MetaConsensus, RunResult

# The names below are imported on first use (PEP 562): ``meta-consensus merge`` and ``report``
# import their own modules, not the node side (flax, optax, scipy.stats) that the run needs.
_LAZY = {
    "Config": "meta_consensus.config",
    "ConfigError": "meta_consensus.config",
    "load": "meta_consensus.config",
    "Coordinator": "meta_consensus.coordinator",
    "CoordinatorState": "meta_consensus.coordinator",
    "RoundInfo": "meta_consensus.coordinator",
    "MetaConsensus": "meta_consensus.run",
    "RunResult": "meta_consensus.run",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'meta_consensus' has no attribute {name!r}")


__all__ = [
    "Config",
    "ConfigError",
    "Coordinator",
    "CoordinatorState",
    "MetaConsensus",
    "RoundInfo",
    "RunResult",
    "__version__",
    "load",
]
