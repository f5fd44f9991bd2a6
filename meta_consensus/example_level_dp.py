"""Example-level DP (``dp.level = "example"``): the nodes' DP-SGD settings, its accounting, the leak checks.

The unit of privacy is one training example of one node. Every node trains with DP-SGD
(:mod:`strategies.dpsgd`) on its own shard; the coordinator sees only the nodes' DP-trained
parameters and uses no private data of its own (its held-out and test splits are not node
data and are treated as public), so the vote, the convex weights, the quality gate, soups'
snapshot selection and the consensus are post-processing. Each example belongs to exactly one
node, so the run's guarantee is the maximum of the nodes' epsilons (parallel composition).

Accounting (:class:`ExampleAccountant`): node i takes T_i DP-SGD steps, each the
Poisson-subsampled Gaussian mechanism with rate q_i (its exact float32 inclusion probability,
:func:`strategies.dpsgd.effective_rate`) and multiplier z_i; epsilon_i comes from the RDP and
the PLD accountant of :mod:`consensus.privacy` at ``delta_acc = (1 - OVERFLOW_SHARE) delta``.
The remaining ``OVERFLOW_SHARE * delta`` covers padded-batch overflows: the pad is the
smallest with ``(1 + e^eps_i) T_i P[overflow] <= OVERFLOW_SHARE * delta`` at the run's most
steps (see :mod:`strategies.dpsgd`). T_i counts the steps in the committed node states (the
meta-consensus nodes plus the plain-FedAvg baseline's nodes, which train on the same examples
and are charged too). A failed or retried round re-runs the nodes from the same state with the
same keys: it recomputes the release already made, which costs nothing more.

Public data: the task's public pool (``task.general_pool = "public"``, the default: rows apart
from every node's shard) is assumed public, like the coordinator's held-out and test splits, so
the "general" level of hierarchical nodes may train on it. Its steps are DP-SGD steps like the
others and are charged as if they touched the node's own rows (an upper bound: the accountant
covers the private shards and counts every step).

What is refused (:func:`check_no_leaks`): a general pool that holds node data
(``task.general_pool = "union"``); the "groups" level, which picks public rows by the node's
dominant classes, a function of its private class histogram; soups that score snapshots on a
held-out split of the node's own shard (``heldout = "own"``: that choice reads private rows
without noise). What is withheld: the nodes' training losses (computed on private rows without
noise) are not reported to the coordinator (NaN in metrics.jsonl).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any

import numpy as np

from consensus.privacy import calibrate_noise, pld_epsilon, rdp_epsilon
from meta_consensus.config import Config, ConfigError
from strategies import dpsgd
from strategies.node import NodeSettings

# Share of delta that pays for padded-batch overflows; the accountants get the rest.
OVERFLOW_SHARE = 1e-2
# Past this epsilon the guarantee is void anyway; the pad then only keeps overflows below 1e-12.
_EPSILON_MEANINGFUL = 30.0


def is_example_level(cfg: Config) -> bool:
    """Whether the run applies example-level DP (DP-SGD in every node).

    Args:
      cfg: the run config.

    Returns:
      True when ``dp.enabled`` and ``dp.level == "example"``.
    """
    return cfg.dp.enabled and cfg.dp.level == "example"


def check_no_leaks(cfg: Config, task: Any, settings: list[NodeSettings]) -> None:
    """Refuse a config whose nodes' private data would reach the consensus other than by DP-SGD.

    Args:
      cfg: the run config.
      task: the run's task; its general pool is public when ``task.general_pool == "public"``
        (or, for a task of its own, ``task.public_general = True``).
      settings: every node's settings.

    Raises:
      ConfigError: naming the part that leaks and the setting that stops it.
    """
    if not is_example_level(cfg):
        return
    strategy = cfg.nodes.strategy_of()
    public = getattr(task, "general_pool", None) == "public" or bool(getattr(task, "public_general", False))
    general = [i for i, st in enumerate(settings) if st.level_steps[0] > 0 or st.level_steps[1] > 0]
    if general and not public:
        names = sorted({strategy[i] for i in general})
        raise ConfigError(
            f"dp.level = 'example' leaks through nodes.strategies {names} (nodes {general}): they train on "
            f"task {getattr(task, 'name', '?')!r}'s general pool without DP accounting, and that pool holds "
            "node data (task.general_pool = 'union' is every node's shard). Use the public pool "
            "(task.general_pool = 'public', the default), or train those nodes with another strategy"
        )
    groups = [i for i, st in enumerate(settings) if st.level_steps[1] > 0]
    if groups:
        names = sorted({strategy[i] for i in groups})
        raise ConfigError(
            f"dp.level = 'example' leaks through nodes.strategies {names} (nodes {groups}): their 'groups' "
            "level picks public rows by the node's dominant classes, read from its private shard without "
            "noise. Give that level no steps, e.g. nodes.options.hierarchical.fractions = [0.75, 0.0, 0.25]"
        )
    own = [i for i, st in enumerate(settings) if st.own_heldout > 0]
    if own:
        names = sorted({strategy[i] for i in own})
        raise ConfigError(
            f"dp.level = 'example' leaks through nodes.strategies {names} (nodes {own}): they score "
            "their snapshots on a held-out split of their own shard, private rows read without noise. "
            "Score on the coordinator's held-out split: nodes.options.soup.heldout = 'shared'"
        )


@dataclasses.dataclass(frozen=True)
class NodePrivacy:
    """One node's example-level guarantee.

    Attributes:
      node: the node's index.
      sampling_rate: q, the Poisson sampling rate of its DP-SGD batches.
      noise_multiplier: z, the noise standard deviation over the clipping norm.
      steps: the DP-SGD steps taken.
      epsilon_rdp: epsilon by the RDP accountant.
      epsilon_pld: epsilon by the PLD accountant (NaN when not computed).
    """

    node: int
    sampling_rate: float
    noise_multiplier: float
    steps: int
    epsilon_rdp: float
    epsilon_pld: float


class ExampleAccountant:
    """Per-node DP-SGD settings and epsilons of a run (see the module docstring).

    Args:
      cfg: the run config (``dp.level = "example"``).
      counts: (n,) rows of each node's own shard.
      steps_per_round: (n,) DP-SGD steps each node takes per round (per fleet).
      fleets: 2 when the plain-FedAvg baseline trains a second set of nodes on the same data.
    """

    def __init__(self, cfg: Config, counts: Any, steps_per_round: Any, fleets: int):
        d = cfg.dp
        self.delta = float(d.delta)
        self.delta_acc = self.delta * (1.0 - OVERFLOW_SHARE)
        self.accountant = d.accountant
        self.counts = np.asarray(counts, np.int64)
        self.n = len(self.counts)
        self.rate32 = dpsgd.sampling_rates(self.counts, int(cfg.nodes.batch_size))  # never "auto" here
        self.rate = dpsgd.effective_rate(self.rate32)
        self.per_round = np.asarray(steps_per_round, np.int64) * int(fleets)
        self.planned = self.per_round * int(cfg.rounds)
        if d.noise_multiplier is not None:
            self.z = np.full((self.n,), float(d.noise_multiplier))
        else:
            # Each node's own z for the target over its planned steps (same q and T: same z).
            assert d.epsilon is not None  # the config requires a target without noise_multiplier
            self.z = np.asarray(
                [
                    _calibrate(float(d.epsilon), self.delta_acc, float(q), int(t), d.accountant)
                    for q, t in zip(self.rate, self.planned, strict=True)
                ]
            )
        # The target epsilon is also the budget when none is given: the run stops before it.
        self.budget = d.budget if d.budget is not None else d.epsilon
        self.clip_norm = float(d.clip_norm)
        self.microbatch = int(d.microbatch)
        self.overflow_probability, self.pad = self._pad()

    def _pad(self) -> tuple[float, int]:
        """The per-step overflow probability bound and the pad that meets it on every node."""
        p = 1e-12
        for q, z, t in zip(self.rate, self.z, self.planned, strict=True):
            eps = self.epsilon(int(t), float(q), float(z), "rdp")
            if eps <= _EPSILON_MEANINGFUL and t > 0:
                p = min(p, OVERFLOW_SHARE * self.delta / ((1.0 + math.exp(eps)) * t))
        pad = dpsgd.padded_size(self.counts, self.rate, p, multiple=max(1, self.microbatch))
        return p, pad

    def spec(self) -> dpsgd.ExampleDP:
        """What the node trainer needs: ``ExampleDP(C, z per node, pad, microbatch)``.

        Returns:
          The node trainer's DP-SGD settings.
        """
        return dpsgd.ExampleDP(
            np.full((self.n,), self.clip_norm, np.float32),
            self.z.astype(np.float32),
            self.pad,
            self.microbatch,
        )

    def epsilon(self, steps: int, q: float, z: float, accountant: str) -> float:
        """One node's epsilon at the accountants' delta after ``steps`` DP-SGD steps.

        Args:
          steps: the DP-SGD steps taken.
          q: the sampling rate.
          z: the noise multiplier.
          accountant: ``"rdp"``, else PLD.

        Returns:
          Epsilon: 0 after no step, inf without noise.
        """
        if steps == 0:
            return 0.0
        if z == 0:
            return math.inf
        if accountant == "rdp":
            return _rdp(z, q, steps, self.delta_acc)
        return _pld(z, q, steps, self.delta_acc)

    def nodes(self, steps: Any, *, pld: bool = True) -> list[NodePrivacy]:
        """Every node's epsilons after ``steps[i]`` DP-SGD steps (PLD NaN when ``pld`` is False).

        Args:
          steps: (n,) DP-SGD steps each node has taken.
          pld: also compute the PLD epsilon (the slower accountant).

        Returns:
          One :class:`NodePrivacy` per node.
        """
        out = []
        for i, (q, z, t) in enumerate(zip(self.rate, self.z, np.asarray(steps, np.int64), strict=True)):
            e_rdp = self.epsilon(int(t), float(q), float(z), "rdp")
            e_pld = self.epsilon(int(t), float(q), float(z), "pld") if pld else math.nan
            out.append(NodePrivacy(i, float(q), float(z), int(t), e_rdp, e_pld))
        return out

    def run_epsilon(self, nodes: list[NodePrivacy]) -> float:
        """The run's epsilon in the configured accountant: the maximum over the nodes.

        Args:
          nodes: the nodes' guarantees (:meth:`nodes`).

        Returns:
          The largest epsilon.
        """
        attr = "epsilon_rdp" if self.accountant == "rdp" else "epsilon_pld"
        return max(getattr(p, attr) for p in nodes)

    def over_budget(self, steps: Any) -> str:
        """Why one more round would exceed the budget ('' when it would not).

        Args:
          steps: (n,) DP-SGD steps each node has taken so far.

        Returns:
          A sentence naming the node, its epsilon and the budget, or ''.
        """
        if self.budget is None:
            return ""
        after = np.asarray(steps, np.int64) + self.per_round
        eps = [
            self.epsilon(int(t), float(q), float(z), self.accountant)
            for q, z, t in zip(self.rate, self.z, after, strict=True)
        ]
        worst = int(np.argmax(eps))
        if eps[worst] > self.budget * (1 + 1e-9):
            return (
                f"node {worst}'s epsilon would reach {eps[worst]:.4g} after {int(after[worst])} steps, "
                f"over the budget {self.budget:g}"
            )
        return ""

    def summary(self, steps: Any) -> dict[str, Any]:
        """The content of ``privacy.json``.

        Args:
          steps: (n,) DP-SGD steps each node has taken.

        Returns:
          A JSON-ready dict (non-finite numbers as strings).
        """
        nodes = self.nodes(steps)
        return {
            "level": "example",
            "unit": "one training example of one node",
            "delta": self.delta,
            "epsilon": _finite_or_str(self.run_epsilon(nodes)),
            "accountant": self.accountant,
            "clip_norm": self.clip_norm,
            "padded_batch": self.pad,
            "overflow_probability_per_step": self.overflow_probability,
            "delta_accountant": self.delta_acc,
            "nodes": [{k: _finite_or_str(v) for k, v in dataclasses.asdict(p).items()} for p in nodes],
        }


def _finite_or_str(v: Any) -> Any:
    if isinstance(v, float) and not math.isfinite(v):
        return "nan" if math.isnan(v) else "inf"
    return v


@functools.lru_cache(maxsize=256)
def _calibrate(epsilon: float, delta: float, q: float, steps: int, accountant: str) -> float:
    return calibrate_noise(epsilon, delta, q, steps, accountant)


@functools.lru_cache(maxsize=4096)
def _rdp(z: float, q: float, steps: int, delta: float) -> float:
    return rdp_epsilon(z, q, steps, delta)


@functools.lru_cache(maxsize=4096)
def _pld(z: float, q: float, steps: int, delta: float) -> float:
    """PLD epsilon on a grid scaled to RDP's epsilon (an upper bound either way; pessimistic PLD)."""
    e = _rdp(z, q, steps, delta)
    h = min(1.0, max(1e-3, e / 1e4)) if math.isfinite(e) else 1.0
    for step in (h, 1.0):
        try:
            return pld_epsilon(z, q, steps, delta, discretization=step)
        except ValueError:
            continue
    return math.nan
