"""Node strategies as composable objects: what each node does between two consensus rounds.

A strategy says, for one node:

* :meth:`NodeStrategy.settings` - its per-node settings: a **data schedule** (steps and
  learning rate on each curriculum level: the general pool, its own groups of it, its own
  shard) and the parameters of the trainer's per-node **transform** (a proximal pull of
  strength ``proximal_mu`` towards the last consensus and a projection onto the L2 ball of
  ``proximal_radius`` around it, applied after the optax update: ``mu = 0, radius = inf`` is
  plain training);
* :meth:`NodeStrategy.submit` - a **submit hook**: what the node sends to the coordinator,
  from its final parameters and the snapshots taken along the round (e.g. a soup);
  ``evaluate(params) -> {"accuracy": ..., "loss": ...}`` gives a tree's metrics on the
  node's held-out data (its own held-out split when the settings keep one,
  ``own_heldout > 0``, else the coordinator's held-out split) and ``scores`` are the
  snapshots' metrics when the caller computed them in one batched call.

The trainer never branches on strategy names: every node runs the same jitted, vmapped
step with its own settings (a table of per-node numbers), so mixed strategies still train
in one call. A new strategy is a class with these two methods, declared with
``@STRATEGIES.declare("name")`` (its keyword arguments are its options); it does not edit
the trainer, and a user's module declares one the same way as a plug-in.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol

from consensus.specs import Registry, RegistryError, Spec

PyTree = Any
LEVELS = ("general", "groups", "own")

#: Node strategies by name; each class (or factory) is declared with ``@STRATEGIES.declare(name)``.
STRATEGIES: Registry[Spec] = Registry("node strategy")


@dataclasses.dataclass(frozen=True)
class NodeSettings:
    """One node's settings for the trainer (see the module docstring).

    Attributes:
      level_steps: steps on the general pool, the node's groups of it, and its own shard.
      level_lr: learning rate on each of the three levels.
      proximal_mu: strength of the proximal pull towards the last consensus (0: none).
      proximal_radius: radius of the L2 ball around the last consensus (inf: no projection).
      snapshots: how many snapshots of its parameters the node takes along the round
        (0: none; the submit hook receives them).
      own_heldout: share of the node's own shard kept out of its training, on which its
        submit hook scores trees (0: none; the hook then scores on the coordinator's
        held-out split).
      tangent: the node trains the task's first-order expansion at the last consensus
        (:mod:`strategies.tangent`) instead of the task's model.
    """

    level_steps: tuple[int, int, int]
    level_lr: tuple[float, float, float]
    proximal_mu: float = 0.0
    proximal_radius: float = math.inf
    snapshots: int = 0
    own_heldout: float = 0.0
    tangent: bool = False


class NodeStrategy(Protocol):
    """What a node strategy provides (see the module docstring)."""

    name: str

    def settings(self, local_steps: int, learning_rate: float) -> NodeSettings:
        """The node's per-node settings for a round.

        Args:
          local_steps: the round's local steps (``nodes.local_steps``).
          learning_rate: the configured learning rate (``nodes.learning_rate``).

        Returns:
          The node's settings.
        """
        ...

    def submit(
        self,
        final: PyTree,
        snapshots: Sequence[PyTree],
        evaluate: Callable[[PyTree], Mapping[str, float]],
        scores: Sequence[Mapping[str, float]] | None = None,
    ) -> PyTree:
        """What the node sends to the coordinator.

        Args:
          final: the node's parameters at the end of the round.
          snapshots: the snapshots taken along the round (the last is ``final``).
          evaluate: ``evaluate(params) -> {"accuracy": ..., "loss": ...}`` on the node's
            held-out data.
          scores: the snapshots' metrics when the caller computed them (None: not known).

        Returns:
          The submitted parameters, a tree like ``final``.
        """
        ...


class _SubmitFinal:
    def submit(self, final, snapshots, evaluate, scores=None):
        """Submit the final parameters.

        Args:
          final: the node's parameters at the end of the round.
          snapshots: unused.
          evaluate: unused.
          scores: unused.

        Returns:
          ``final``.
        """
        del snapshots, evaluate, scores
        return final


@STRATEGIES.declare("local")
@dataclasses.dataclass(frozen=True)
class Local(_SubmitFinal):
    """Plain local training on the node's own shard; submits its final parameters."""

    name: str = "local"

    def settings(self, local_steps: int, learning_rate: float) -> NodeSettings:
        """Every step on the node's own shard, at the configured learning rate.

        Args:
          local_steps: the round's local steps.
          learning_rate: the configured learning rate.

        Returns:
          The node's settings.
        """
        return NodeSettings((0, 0, local_steps), (learning_rate,) * 3)


@STRATEGIES.declare("hierarchical")
@dataclasses.dataclass(frozen=True)
class Hierarchical(_SubmitFinal):
    """A curriculum: the general pool, then the node's own groups of it, then its own shard.

    The general pool is the task's public pool, apart from every node's shard (unless the
    task's ``general_pool`` is ``"union"``, centralised data).

    Args:
      fractions: shares of the round's steps on the three levels (sum 1); the remainder
        of the rounding goes to the own shard.
      lr_scale: learning-rate multipliers of the three levels.

    Raises:
      ValueError: for fractions that are not three shares >= 0 summing to 1, or multipliers
        that are not three numbers > 0.
    """

    fractions: tuple[float, float, float] = (0.5, 0.25, 0.25)
    lr_scale: tuple[float, float, float] = (1.0, 1.0, 0.5)
    name: str = "hierarchical"

    def __post_init__(self):
        fr = tuple(self.fractions)
        if len(fr) != 3 or any(x < 0 for x in fr) or abs(sum(fr) - 1.0) > 1e-6:
            raise ValueError(f"hierarchical: fractions must be three shares >= 0 that sum to 1, got {fr}")
        if len(self.lr_scale) != 3 or any(x <= 0 for x in self.lr_scale):
            raise ValueError(f"hierarchical: lr_scale must be three multipliers > 0, got {self.lr_scale}")

    def settings(self, local_steps: int, learning_rate: float) -> NodeSettings:
        """The round's steps split over the three levels by ``fractions``, rates scaled by ``lr_scale``.

        Args:
          local_steps: the round's local steps.
          learning_rate: the configured learning rate.

        Returns:
          The node's settings.
        """
        general, groups = (int(math.floor(f * local_steps)) for f in self.fractions[:2])
        steps = (general, groups, local_steps - general - groups)
        s0, s1, s2 = self.lr_scale  # three multipliers, checked in __post_init__
        return NodeSettings(steps, (learning_rate * s0, learning_rate * s1, learning_rate * s2))


@STRATEGIES.declare("convexity")
@dataclasses.dataclass(frozen=True)
class Convexity(_SubmitFinal):
    """Training that keeps the node mergeable with the consensus: proximal or tangent-space.

    ``mode = "proximal"`` (FedProx): after every optimizer update a pull of strength ``mu``
    towards the last consensus, and a projection onto the L2 ball of ``radius`` around it.

    ``mode = "tangent"`` (Ortiz-Jimenez et al., NeurIPS 2023, "Task arithmetic in the tangent
    space"): the node trains the first-order expansion of the model at the round's consensus,
    ``f(x; c) + J f(x; c) (theta - c)``, through ``jax.jvp`` (:mod:`strategies.tangent`). Its
    outputs are affine in theta, so a loss convex in the outputs (cross entropy) is convex in
    theta: the average of the round's tangent nodes is no worse than their average loss, on
    the expansion. The node submits theta and the coordinator reads it through the model
    itself, which agrees with the expansion to first order in the round's move; the next
    round expands again at the new consensus. One step costs the forward pass, its jvp and
    their backward pass; the task must declare ``linearizable = True`` (digits,
    Fashion-MNIST, text, causal LM, array tasks), and LoRA and example-level DP-SGD are
    refused. ``mu`` and ``radius`` still apply in this mode (default ``mu`` 0 there).

    Args:
      mu: proximal pull towards the last consensus (FedProx's mu; default 0.5 in the
        proximal mode, 0 in the tangent mode).
      radius: the node stays in the L2 ball of this radius around the last consensus.
      mode: ``"proximal"`` or ``"tangent"``.

    Raises:
      ValueError: for ``mu < 0``, ``radius <= 0`` or an unknown ``mode``.
    """

    mu: float | None = None
    radius: float = math.inf
    mode: str = "proximal"
    name: str = "convexity"

    def __post_init__(self):
        if self.mode not in ("proximal", "tangent"):
            raise ValueError(f"convexity: mode must be 'proximal' or 'tangent', got {self.mode!r}")
        if self.mu is None:
            object.__setattr__(self, "mu", 0.5 if self.mode == "proximal" else 0.0)
        if not self.mu >= 0:
            raise ValueError(f"convexity: mu must be >= 0, got {self.mu}")
        if not self.radius > 0:
            raise ValueError(f"convexity: radius must be > 0, got {self.radius}")

    def settings(self, local_steps: int, learning_rate: float) -> NodeSettings:
        """Every step on the node's own shard, with the pull and the ball (and the expansion).

        Args:
          local_steps: the round's local steps.
          learning_rate: the configured learning rate.

        Returns:
          The node's settings.
        """
        mu = float(self.mu)  # type: ignore[arg-type]  # resolved in __post_init__
        return NodeSettings(
            (0, 0, local_steps), (learning_rate,) * 3, mu, self.radius, tangent=self.mode == "tangent"
        )


@STRATEGIES.declare("soup")
@dataclasses.dataclass(frozen=True)
class Soup:
    """Incremental soup: snapshots along the round, submits their soup (Wortsman et al. 2022).

    ``greedy`` (the default) starts from the latest snapshot (the round's final parameters)
    and adds each other snapshot, best first, only if the soup with it is not worse on the
    held-out split (accuracy, ties broken by the loss), so the soup is never worse there than
    the latest snapshot. ``uniform`` averages every snapshot; ``weighted`` weighs them by a
    softmax of their held-out accuracy.

    Args:
      snapshots: checkpoints taken at evenly spaced steps of the round (the last at its end).
      mode: ``"greedy"``, ``"uniform"`` or ``"weighted"``.
      heldout: ``"own"``: a held-out split of the node's own shard (``heldout_fraction`` of
        it, kept out of its training); ``"shared"``: the coordinator's held-out split (public
        data; the choice under example-level DP, where the node's own rows may only reach the
        consensus through DP-SGD).
      heldout_fraction: the share of the node's shard held out with ``heldout = "own"``.
      temperature: softmax temperature of ``weighted`` (on accuracy, in [0, 1]).

    Raises:
      ValueError: for a non-positive ``snapshots``, an unknown ``mode`` or ``heldout``, a
        ``heldout_fraction`` outside (0, 1), or a ``temperature`` <= 0.

    References:
      Wortsman et al. 2022, "Model soups: averaging weights of multiple fine-tuned models
      improves accuracy without increasing inference time", ICML (greedy soup: Recipe 1).
    """

    snapshots: int = 4
    mode: str = "greedy"
    heldout: str = "own"
    heldout_fraction: float = 0.1
    temperature: float = 0.05
    name: str = "soup"

    def __post_init__(self):
        if not (isinstance(self.snapshots, int) and self.snapshots >= 1):
            raise ValueError(f"soup: snapshots must be a positive int, got {self.snapshots!r}")
        if self.mode not in ("greedy", "uniform", "weighted"):
            raise ValueError(f"soup: mode must be 'greedy', 'uniform' or 'weighted', got {self.mode!r}")
        if self.heldout not in ("own", "shared"):
            raise ValueError(f"soup: heldout must be 'own' or 'shared', got {self.heldout!r}")
        if not 0.0 < self.heldout_fraction < 1.0:
            raise ValueError(f"soup: heldout_fraction must be in (0, 1), got {self.heldout_fraction}")
        if not self.temperature > 0:
            raise ValueError(f"soup: temperature must be > 0, got {self.temperature}")

    def settings(self, local_steps: int, learning_rate: float) -> NodeSettings:
        """Every step on the node's own shard, ``snapshots`` snapshots along it.

        Args:
          local_steps: the round's local steps.
          learning_rate: the configured learning rate.

        Returns:
          The node's settings.

        Raises:
          ValueError: when there are fewer local steps than snapshots.
        """
        if self.snapshots > local_steps:
            raise ValueError(
                f"soup: {self.snapshots} snapshots need at least as many local steps ({local_steps})"
            )
        own = self.heldout_fraction if self.heldout == "own" else 0.0
        return NodeSettings(
            (0, 0, local_steps), (learning_rate,) * 3, snapshots=self.snapshots, own_heldout=own
        )

    def submit(self, final, snapshots, evaluate, scores=None):
        """The soup of the snapshots on the held-out metrics of ``evaluate`` (``scores``: theirs if known).

        Args:
          final: unused (the last snapshot is the final parameters).
          snapshots: the snapshots taken along the round.
          evaluate: ``evaluate(params) -> {"accuracy": ..., "loss": ...}`` on the held-out split.
          scores: the snapshots' metrics (or accuracies) when known.

        Returns:
          The soup's parameters.
        """
        from strategies.soup import greedy_soup, score_weights, uniform_soup, weighted_soup

        del final  # the last snapshot is the final parameters
        snaps = list(snapshots)
        if self.mode == "uniform":
            return uniform_soup(snaps)
        scores = [evaluate(p) for p in snaps] if scores is None else list(scores)
        # A caller that scores by accuracy alone (a number per tree) gets the accuracy rule.
        full = all(isinstance(s, Mapping) for s in scores)
        if self.mode == "weighted":
            acc = [float(s["accuracy"]) if full else float(s) for s in scores]
            return weighted_soup(
                snaps, score_weights(acc, higher_is_better=True, temperature=self.temperature)
            )
        metric = ("accuracy", "loss") if full else "accuracy"
        return greedy_soup(snaps, evaluate, metric=metric, scores=scores, first=len(snaps) - 1).params


# ----------------------------------------------------------------------------- building


def strategy_options(spec: Spec) -> list[str]:
    """A strategy's options: its factory's parameters less ``name`` (the strategy's own label).

    Args:
      spec: an entry of :data:`STRATEGIES`.

    Returns:
      The option names.
    """
    return [k for k in spec.params if k != "name"]


def build_strategy(name: str, options: Mapping[str, Any] | None = None) -> NodeStrategy:
    """The strategy ``name`` built with ``options``.

    Args:
      name: a name in :data:`STRATEGIES`.
      options: its keyword options (TOML lists become tuples).

    Returns:
      The strategy.

    Raises:
      RegistryError: for an unknown name or option.
      ValueError: for an invalid option value (the strategy's own check).
    """
    spec = STRATEGIES[name]
    options = dict(options or {})
    unknown = sorted(set(options) - set(strategy_options(spec)))
    if unknown and not spec.takes_any_option:
        raise RegistryError(
            f"node strategy {name!r} takes no option(s) {unknown}; valid options: {strategy_options(spec)}"
        )
    # TOML lists arrive as lists; the strategies are frozen (hashable) dataclasses of tuples.
    return spec.factory(**{k: tuple(v) if isinstance(v, list) else v for k, v in options.items()})
