"""Client sampling: which of the n nodes take part in a round, drawn from the round's key.

``nodes.sampling`` chooses the draw (see :class:`~meta_consensus.config.NodesConfig`):

* ``"full"`` (the default): every node, every round; no sample is drawn and the round is
  bit for bit what it was before sampling existed.
* ``"uniform"``: ``per_round`` = m distinct nodes, uniformly without replacement.
* ``"poisson"``: every node independently with probability q (``sampling_rate``, or
  ``per_round / count``), so the count varies from round to round.

The key is ``fold_in(round_key, SAMPLE_STREAM)``: the fit, attack, fault and DP keys of the
round (``split(round_key)``) are unchanged, a resumed run draws the same samples, and a retried
attempt (a fresh round key) draws a fresh sample.

Static shapes: the sampled nodes train ``nodes.chunk`` at a time in one vmapped program
(compiled once for that node count). A sample is padded with ``-1`` slots up to a multiple of
the chunk; the padding trains a copy of a sampled node and is then a missing answer (masked out
of the vote), so a Poisson round compiles the vote once per bucket of ``chunk`` slots and a
uniform round (m a multiple of the chunk) never pads.

Privacy (node-level DP; docs/privacy.md): a Poisson sample is the *Poisson-subsampled Gaussian*
the RDP and PLD accountants analyze, charged with ``sampling_rate = q`` (amplified); the
DP-FedAvg denominator is the expected count q n. The accountants have no event for sampling
a fixed number without replacement, so a uniform sample is charged as an unsampled round
(``sampling_rate = 1``, no amplification): a valid upper bound, loose by the amplification
it leaves out. Amplification also assumes the sample stays secret from the adversary: the
sampled ids are in the run's own logs (``RoundInfo.sampled``), not in the released model.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import numpy as np

from consensus.dp import effective_sampling_rate, sample_participants
from meta_consensus.config import NodesConfig

# fold_in constant of the sample's key: a stream of its own next to split(round_key).
SAMPLE_STREAM = 0x5A3F1E


@dataclasses.dataclass(frozen=True)
class ClientSample:
    """The nodes of one round, in slots.

    Attributes:
      ids: (slots,) int64 node ids in increasing order, then ``-1`` on padding slots.
      num_nodes: n, the size of the fleet it was drawn from.
    """

    ids: np.ndarray
    num_nodes: int

    @property
    def real(self) -> np.ndarray:
        """(slots,) bool: slots that hold a sampled node (False on padding)."""
        return self.ids >= 0

    @property
    def count(self) -> int:
        """How many nodes were sampled."""
        return int(np.sum(self.real))

    @property
    def rows(self) -> np.ndarray:
        """(slots,) node ids with padding replaced by the first sampled node (a row to compute on)."""
        fill = int(self.ids[0]) if self.count else 0
        return np.where(self.real, self.ids, fill)

    def to_nodes(self, values: np.ndarray, fill: float | bool) -> np.ndarray:
        """Per-slot ``values`` placed at their nodes, ``fill`` elsewhere.

        Args:
          values: (slots,) one value per slot (padding slots are ignored).
          fill: the value of the nodes not sampled.

        Returns:
          (n,) array.
        """
        values = np.asarray(values)
        out = np.full((self.num_nodes,), fill, dtype=np.result_type(values.dtype, np.asarray(fill).dtype))
        out[self.ids[self.real]] = values[self.real]
        return out


def place(values: np.ndarray, nodes: list[int] | np.ndarray, n: int, fill: float | bool) -> np.ndarray:
    """An (n,) array with ``values[j]`` at node ``nodes[j]`` and ``fill`` at every other node.

    Args:
      values: one value per listed node.
      nodes: the node ids.
      n: the fleet size.
      fill: the value of every other node.

    Returns:
      (n,) array of the common dtype of ``values`` and ``fill``.
    """
    values = np.asarray(values)
    out = np.full((n,), fill, dtype=np.result_type(values.dtype, np.asarray(fill).dtype))
    out[np.asarray(nodes, np.int64)] = values
    return out


def sample_key(round_key: jax.Array) -> jax.Array:
    """The sample's key of a round key (its own stream; the round's other keys are unchanged).

    Args:
      round_key: the round's key.

    Returns:
      ``fold_in(round_key, SAMPLE_STREAM)``.
    """
    return jax.random.fold_in(round_key, SAMPLE_STREAM)


def draw(nodes: NodesConfig, round_key: jax.Array) -> ClientSample | None:
    """The round's sample (None under full participation), padded to a multiple of the chunk.

    Args:
      nodes: the ``[nodes]`` config (``sampling``, ``per_round`` or the Poisson rate, the chunk).
      round_key: the round's key.

    Returns:
      The sample, or None when every node takes part.
    """
    if not nodes.sampled:
        return None
    n, key = nodes.count, sample_key(round_key)
    if nodes.sampling == "uniform":
        assert nodes.per_round is not None  # the config requires it for uniform sampling
        ids = np.asarray(jax.random.choice(key, n, (int(nodes.per_round),), replace=False))
    else:
        # Independent Bernoulli(q) per node: the sample the accountants' amplification assumes,
        # drawn by the DP library's sampler (its probability is exactly effective_sampling_rate(q)).
        ids = np.flatnonzero(np.asarray(sample_participants(key, n, nodes.poisson_rate())))
    ids = np.sort(ids.astype(np.int64))
    chunk = nodes.chunk_size()
    slots = max(math.ceil(len(ids) / chunk), 1) * chunk
    return ClientSample(np.concatenate([ids, np.full((slots - len(ids),), -1, np.int64)]), n)


def privacy_sampling_rate(nodes: NodesConfig) -> float:
    """The ``sampling_rate`` a node-level DP round is charged with (see the module docstring).

    Poisson: the sampler's exact probability (q rounded to a multiple of 2^-32), as
    :func:`consensus.dp.effective_sampling_rate` gives it; 1.0 otherwise.

    Args:
      nodes: the ``[nodes]`` config.

    Returns:
      The sampling rate.
    """
    q = nodes.poisson_rate()
    return effective_sampling_rate(q) if nodes.sampling == "poisson" else 1.0
