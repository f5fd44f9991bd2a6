"""This package's merge on Flower's deployment engine (the ``flower`` extra: ``flwr>=1.21,<2``).

* :class:`~meta_consensus.flower.strategy.ConsensusStrategy`: a Flower strategy (Message
  API) whose ``aggregate_train`` is the config's merge pipeline, with the coordinator's
  round rules and a privacy ledger kept across rounds;
* :func:`~meta_consensus.flower.node.make_client_app`: a ClientApp that runs node
  ``partition-id`` of the config (its task, its strategy, its own shard);
* :mod:`meta_consensus.flower.apps`: ``server_app`` and ``client_app`` for ``flwr run``;
* :class:`~meta_consensus.flower.local.InProcessGrid`: every node in this process (tests,
  notebooks) without a SuperLink;
* :class:`~meta_consensus.flower.buffered.BufferedRun`: buffered asynchronous rounds
  (``[schedule] mode = "async"``) through the Message API;
* :class:`~meta_consensus.flower.replies.RoundGrid`: a round's replies without waiting for nodes
  the SuperLink no longer lists (a workaround for flwr 1.42, see docs/flower.md).

It lives in the system layer, not in ``consensus``: it needs the system's config and
pipeline, and the library never imports the system (see docs/flower.md).
"""

from meta_consensus.flower.arrays import ArrayRecordMismatch, from_array_record, to_array_record
from meta_consensus.flower.buffered import BufferedRun
from meta_consensus.flower.local import InProcessGrid
from meta_consensus.flower.node import FlowerNode, check_flower_config, make_client_app
from meta_consensus.flower.replies import RoundGrid
from meta_consensus.flower.strategy import ConsensusStrategy, FlowerRound

__all__ = [
    "ArrayRecordMismatch",
    "BufferedRun",
    "ConsensusStrategy",
    "FlowerNode",
    "FlowerRound",
    "InProcessGrid",
    "RoundGrid",
    "check_flower_config",
    "from_array_record",
    "make_client_app",
    "to_array_record",
]
