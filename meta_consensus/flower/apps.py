"""The Flower app of this package: ``server_app`` and ``client_app`` for ``flwr run`` and SuperNodes.

A Flower app's ``pyproject.toml`` names them (see docs/flower.md)::

    [tool.flwr.app.components]
    serverapp = "meta_consensus.flower.apps:server_app"
    clientapp = "meta_consensus.flower.apps:client_app"

    [tool.flwr.app.config]
    config = "configs/flower.toml"   # this package's run config (server side); "" = the default
    overrides = "rounds=3;nodes.count=2"  # optional key=value overrides, ';'-separated
    plugins = "my_rules"              # optional plug-in modules, ';'-separated (added to the config's)
    round-timeout = 600.0             # seconds a round waits for its replies
    evaluate = true                   # federated evaluation of the consensus on the nodes' shards
    wait-for-nodes = 120.0            # seconds the first round waits for all nodes.count SuperNodes

The server reads the config, runs :class:`~meta_consensus.flower.strategy.ConsensusStrategy`
for ``rounds`` rounds (with ``[schedule] mode = "async"``: ``rounds`` buffered asynchronous
merges, :mod:`meta_consensus.flower.buffered`) and writes ``<output_dir>/<name>/consensus.safetensors`` and
``flower_rounds.jsonl`` (one :class:`~meta_consensus.flower.strategy.FlowerRound` a line).
The nodes get the config from the server with every train message; each SuperNode says
which node it is with ``--node-config "partition-id=<i> num-partitions=<n>"``. The config
text lists its plug-ins, which every ClientApp imports before checking it, so a plug-in's
module must be importable on the SuperNodes too (their current directory is).
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

from flwr.app import Context
from flwr.serverapp import Grid, ServerApp
from flwr.serverapp.strategy import Result

from meta_consensus import config as config_lib
from meta_consensus.config import Config
from meta_consensus.flower.buffered import BufferedRun
from meta_consensus.flower.node import make_client_app
from meta_consensus.flower.replies import RoundGrid
from meta_consensus.flower.strategy import ConsensusStrategy

HISTORY_FILE = "flower_rounds.jsonl"


def config_from_run_config(run_config: dict[str, Any]) -> Config:
    """The package config that a Flower run config names (``config`` path, ``overrides``, ``plugins``).

    Args:
      run_config: Flower's run config (``[tool.flwr.app.config]``, see the module docstring).

    Returns:
      The validated config.

    Raises:
      ConfigError: a config file, override or plug-in that does not load or validate.
    """
    path = str(run_config.get("config", "") or "") or None
    overrides = [o.strip() for o in str(run_config.get("overrides", "") or "").split(";") if o.strip()]
    plugins = [m.strip() for m in str(run_config.get("plugins", "") or "").split(";") if m.strip()]
    return config_lib.load(path, overrides, plugins=plugins)


def run_strategy(strategy: ConsensusStrategy, grid: Grid, *, timeout: float = 600.0) -> Result:
    """All the config's rounds on ``grid``; writes the consensus and the round history to the run dir.

    Args:
      strategy: the strategy, with the config whose ``rounds`` and ``run_dir`` are used.
      grid: the Grid to run on (Flower's, or :class:`~meta_consensus.flower.local.InProcessGrid`).
      timeout: seconds each round waits for its replies.

    Returns:
      Flower's :class:`~flwr.serverapp.strategy.Result` (the aggregated metrics of every round;
      empty in async mode); the strategy's :attr:`~ConsensusStrategy.history` has the rounds'
      (or applied buffers') reasons and errors.
    """
    from meta_consensus.run import save_consensus

    if strategy.cfg.schedule.asynchronous:
        # Buffered asynchronous rounds (meta_consensus.flower.buffered): rounds = applied buffers.
        strategy._timeout = float(timeout)
        if not isinstance(grid, RoundGrid):
            grid = RoundGrid(grid, poll_s=strategy.poll_s, dst_of=strategy._dst_of)
        run = BufferedRun(strategy, grid, timeout_s=timeout, poll_s=min(strategy.poll_s, 0.5))
        run.run(strategy.cfg.rounds)
        result = Result()
    else:
        result = strategy.start(
            grid, strategy.initial_arrays(), num_rounds=strategy.cfg.rounds, timeout=timeout
        )
    run_dir = Path(strategy.cfg.run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    save_consensus(run_dir, strategy.consensus, {"rounds": str(strategy.rounds_done), "front_end": "flower"})
    with open(run_dir / HISTORY_FILE, "w") as fh:
        for r in strategy.history:
            fh.write(json.dumps(dataclasses.asdict(r), allow_nan=True) + "\n")
    return result


server_app = ServerApp()


@server_app.main()
def main(grid: Grid, context: Context) -> None:
    """The ServerApp: the run config's strategy for all its rounds (see the module docstring).

    Args:
      grid: the Grid Flower gives the ServerApp.
      context: the ServerApp's context, whose ``run_config`` names the config and the settings.
    """
    rc = dict(context.run_config)
    strategy = ConsensusStrategy(
        config_from_run_config(rc),
        evaluate=bool(rc.get("evaluate", True)),
        wait_for_nodes_s=float(rc.get("wait-for-nodes", 120.0)),
    )
    run_strategy(strategy, grid, timeout=float(rc.get("round-timeout", 600.0)))


client_app = make_client_app()
