"""The shape of a run config: nested frozen dataclasses and their defaults.

A config file mirrors them (top-level keys, then one table per section; see
:mod:`meta_consensus.config`). Building a :class:`Config` checks it
(:func:`meta_consensus.config.validation.validate`), so every Config in a process is valid.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

from meta_consensus.config.validation import validate
from strategies import node as node_lib
from strategies import registry as node_registry
from strategies.lora import LoraSettings


@dataclasses.dataclass(frozen=True)
class TaskConfig:
    """The model and data every node trains on.

    Attributes:
      name: a registered task ("digits", "text", ...; see ``strategies.registry.TASKS``) or an
        import path ``"package.module:factory"`` of a user's own task (a factory called with
        ``options``, or a Task object).
      alpha: Dirichlet concentration of the non-IID split over the nodes (small: skewed).
      data_seed: seed of the node split (the train / held-out / test split is fixed per task).
      options: keyword arguments of the task's factory (digits: ``hidden``, the MLP's widths).
      public_fraction: the stratified share of the training rows reserved as the public pool,
        apart from every node's shard: the general data of hierarchical nodes (None: the
        task's own, 0.1 for digits, Fashion-MNIST and array tasks; text's public pool is
        fixed by its file roles).
      general_pool: ``"public"`` (the public pool) or ``"union"`` (the public pool and every
        node's shard: centralised data, an upper bound for comparisons, refused with
        example-level DP); None: the task's own (``"public"``).
    """

    name: str = "digits"
    alpha: float = 0.5
    data_seed: int = 0
    options: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    public_fraction: float | None = None
    general_pool: Literal["public", "union"] | None = None


@dataclasses.dataclass(frozen=True)
class NodesConfig:
    """The nodes and the strategy each one trains with.

    Attributes:
      count: n, the number of nodes.
      strategies: one registered node strategy per node ("local", "hierarchical",
        "convexity", "soup", ...; see ``strategies.node.STRATEGIES``), or one name for all.
      local_steps: optimizer steps per node per round.
      batch_size: rows per step, or "auto": the largest power of two whose compiled training step
        fits 90% of one device's memory (:func:`strategies.trainer.auto_batch_size`, from the step's
        memory analysis; chosen when the fleet is built). "auto" trains the whole model with
        plain rounds: not with ``[nodes.lora]``, example-level DP or the coordinator's root-set
        update (those size their steps from the number before the fleet exists).
      learning_rate: Adam learning rate (each strategy may scale it per curriculum level).
      options: per strategy name, the keyword options of its class, for example
        ``{hierarchical = {fractions = [0.5, 0.25, 0.25]}, convexity = {mu = 0.5, radius = inf},
        soup = {snapshots = 4}}``; ``convexity = {mode = "tangent"}`` trains the model's
        first-order expansion at each round's consensus (:class:`strategies.node.Convexity`).
      sampling: client sampling (see :mod:`meta_consensus.sampling`): "full" (every node every
        round, the default), "uniform" (``per_round`` nodes drawn without replacement from the
        round key) or "poisson" (every node independently with rate ``sampling_rate``, or
        ``per_round / count`` when only ``per_round`` is given). Only the sampled nodes train
        and vote; the others keep their state on the host.
      per_round: m, the nodes of a uniform sample (Poisson: the expected count, when
        ``sampling_rate`` is not given).
      sampling_rate: q, the Poisson rate.
      optimizer: the nodes' local optimizer, "adam" (default) or "sgd" (plain SGD, no state:
        the local update of textbook FedAvg / DP-FedAvg).
      chunk: sampled nodes per vmapped fit call (0: all the round's nodes in one call); a
        Poisson sample is padded to a multiple of it (padding rows are missing answers), so
        the fit compiles once and the vote once per bucket of that size.
      public_warm_start: Adam steps (at ``batch_size`` and ``learning_rate``) the coordinator
        trains the initial consensus on the task's public (general) pool before round 1, so
        every node starts from it (:mod:`meta_consensus.warm_start`; 0: off). It replaces the
        task's random init: a run given its start (``init_from``, ``train(initial_params=...)``, a
        task's pretrained checkpoint) starts from that as is. The pool is data no node owns: it
        spends no privacy. With ``[nodes.lora]`` use its ``pretrain_steps`` (the embedded
        default's warm start is then dropped, with a note).
      lora: ``[nodes.lora]``: the nodes train LoRA adapters on a frozen base
        (:class:`strategies.lora.LoraSettings`: ``rank``, ``alpha``, ``targets`` (regular
        expressions over '/'-joined parameter paths), ``dropout``, ``freeze_a``); None (no
        table): the nodes train the whole model. See :mod:`meta_consensus.lora`, docs/lora.md.
    """

    count: int = 8
    strategies: tuple[str, ...] | str = "local"
    local_steps: int = 40
    batch_size: int | Literal["auto"] = 32
    learning_rate: float = 3e-3
    options: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    sampling: Literal["full", "uniform", "poisson"] = "full"
    per_round: int | None = None
    sampling_rate: float | None = None
    chunk: int = 0
    optimizer: Literal["adam", "sgd"] = "adam"
    public_warm_start: int = 0
    lora: LoraSettings | None = None

    @property
    def sampled(self) -> bool:
        """Whether only a sample of the nodes takes part in a round."""
        return self.sampling != "full"

    def _given_per_round(self) -> int:
        """``per_round``, which a sample without a rate needs (ValueError when it is unset)."""
        if self.per_round is None:
            raise ValueError(f"nodes.sampling = {self.sampling!r} without a rate needs nodes.per_round")
        return self.per_round

    def poisson_rate(self) -> float:
        """The inclusion probability q of Poisson sampling (1.0 under full participation or a uniform sample).

        Returns:
          ``sampling_rate`` if set, else ``per_round / count``.

        Raises:
          ValueError: Poisson sampling with neither ``sampling_rate`` nor ``per_round``.
        """
        if self.sampling != "poisson":
            return 1.0
        if self.sampling_rate is not None:
            return float(self.sampling_rate)
        return float(self._given_per_round()) / self.count

    def expected_per_round(self) -> float:
        """The expected number of nodes in a round's sample (n under full participation)."""
        if self.sampling == "uniform":
            return float(self._given_per_round())
        if self.sampling == "poisson":
            return self.poisson_rate() * self.count
        return float(self.count)

    def vote_size(self) -> int:
        """The node count the vote is checked against at load: the (expected) sample size."""
        return max(int(math.floor(self.expected_per_round())), 1) if self.sampled else self.count

    def chunk_size(self) -> int:
        """Sampled nodes per vmapped fit call (the fit's one compiled node count)."""
        if self.chunk > 0:
            return self.chunk
        return max(int(math.ceil(self.expected_per_round())), 1)

    def strategy_of(self) -> tuple[str, ...]:
        """Each node's strategy name (one name in ``strategies`` stands for every node)."""
        s = self.strategies
        return (s,) * self.count if isinstance(s, str) else tuple(s)

    def build_strategies(self) -> tuple[node_lib.NodeStrategy, ...]:
        """One strategy object per node (nodes that share a name share the object)."""
        built = {
            name: node_registry.build_strategy(name, self.options.get(name, {}))
            for name in set(self.strategy_of())
        }
        return tuple(built[name] for name in self.strategy_of())


@dataclasses.dataclass(frozen=True)
class ByzantineConfig:
    """Which nodes are Byzantine and how they attack.

    Attributes:
      nodes: indices of the Byzantine nodes.
      attack: a registered attack (a data attack, ``kind="data"`` such as "label_flip", poisons
        the Byzantine nodes' training batches; an update attack replaces the submitted update;
        see ``strategies.registry.ATTACKS``).
      label_flip: also train the Byzantine nodes on flipped labels under a model attack.
      options: keyword arguments of the attack (``z`` for ALIE, ``scale``, ``std``, ``epsilon``).
    """

    nodes: tuple[int, ...] = ()
    attack: str = "alie"
    label_flip: bool = False
    options: Mapping[str, Any] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass(frozen=True)
class VoteConfig:
    """The Byzantine-tolerant vote.

    Attributes:
      rule: a registered rule (see ``consensus.registry.RULES``).
      num_byzantine: f given directly (absolute, whatever the number of answers), or None
        to use ``fault_tolerance``.
      fault_tolerance: f as a fraction of the nodes that **answered** this round:
        ``f = floor(fault_tolerance * answered)`` (a fraction of the fleet that is present;
        when you know an absolute bound on the Byzantine nodes, set ``num_byzantine``).
        Under client sampling (``nodes.sampling``) ``answered`` counts the round's sampled
        nodes that answered; a sample may hold more Byzantine nodes than that f (the count
        is hypergeometric or binomial), and then the rule's guarantee does not hold for that
        round (choose ``fault_tolerance`` above the Byzantine fraction to cover the tail).
      options: the rule's parameters (its factory's keywords, e.g. ``clip_radius`` for
        centered clipping); registered defaults fill the required ones left out.
      pre: pre-aggregators applied before the rule, in order ("clip", "nnm", ...).
      pre_options: per pre-aggregator name, its parameters (e.g. ``{clip = {max_norm = 5}}``).
      groups: grouped vote over contiguous node groups (0 or 1: flat). The rule votes inside
        each group with f_group = floor(fault_tolerance * group size) (or
        ``num_byzantine // groups``), then ``top_rule`` votes over the group results.
      top_rule, top_num_byzantine, top_options: the rule over the group results, its f
        (groups that may be wholly Byzantine) and its parameters.
      root_size: the coordinator's root set, for the server-guided rules (``fltrust``,
        ``server_monna``) and ``server_step``; unused otherwise. An integer >= 1 is a number of
        held-out rows; a number in (0, 1) is a share of the held-out rows, rounded to the
        nearest row (halves up), so one config scales with the task's held-out split. The rows are drawn
        from ``seed`` and removed from the held-out data the quality gate, the weights and
        evaluation use (see :mod:`meta_consensus.server`).
      server_steps: the coordinator's Adam steps on the root set per round (None:
        ``nodes.local_steps``, a plain local node's budget).
      server_step: after the vote and the weights, the consensus moves by this multiple of
        the coordinator's own update on its root set (``consensus + server_step * g``, g as
        for the server-guided rules; needs the root set, with any rule). 0 (the default):
        off. The root set's data then enters the model: it assumes the coordinator's data
        is clean and like the nodes' task, as FLTrust does.
      adapter_method: LoRA runs (``[nodes.lora]``): how the nodes' adapters are merged, a name
        of ``consensus.lora.ADAPTER_METHODS`` ("fedit", "ffa" with ``nodes.lora.freeze_a``,
        "stack", "svd", "exact_residual", ...); ``rule`` is applied robustly before it unless
        it is "mean".
      adapter_space: LoRA runs: where the robust ``rule`` acts, "products" (the nodes' updates
        ``s a b``, exact) or "factors" (the flattened factors, cheap).
    """

    rule: str = "multi_krum"
    num_byzantine: int | None = None
    fault_tolerance: float = 0.25
    options: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    pre: tuple[str, ...] = ()
    pre_options: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    groups: int = 0
    top_rule: str = "median"
    top_num_byzantine: int = 0
    top_options: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    root_size: int | float = 100
    server_steps: int | None = None
    server_step: float = 0.0
    adapter_method: str = "fedit"
    adapter_space: Literal["products", "factors"] = "products"

    def f(self, answered: int) -> int:
        """The Byzantine node count f that a flat vote tolerates among ``answered`` valid candidates.

        Args:
          answered: how many nodes answered with a valid candidate this round.

        Returns:
          ``num_byzantine`` if set, else ``floor(fault_tolerance * answered)``.
        """
        if self.num_byzantine is not None:
            return self.num_byzantine
        return int(math.floor(self.fault_tolerance * answered))

    def group_f(self, group_size: int) -> int:
        """The Byzantine node count f tolerated inside each group of a grouped vote.

        Args:
          group_size: the nodes in one group.

        Returns:
          ``num_byzantine`` shared out over the groups if set, else ``floor(fault_tolerance * group_size)``.
        """
        if self.num_byzantine is not None:
            return self.num_byzantine // max(self.groups, 1)
        return int(math.floor(self.fault_tolerance * group_size))


@dataclasses.dataclass(frozen=True)
class WeightsConfig:
    """Convex merge weights over the nodes the vote accepted.

    Attributes:
      objective: a registered objective (``meta_consensus.objectives.OBJECTIVES``): "vote"
        (the vote's own output is the consensus), "uniform" (plain mean of the accepted
        nodes), "quadratic" (trust-region quadratic model of the held-out loss),
        "mixture_nll" (NLL of the mixture of the nodes' held-out predictions), "anchor"
        (closest convex combination to the vote's output).
      max_weight: cap on any node's weight (None: no cap); must be >= 1 / accepted nodes.
      lambda_reg: ridge towards uniform weights.
      on_solver_failure: "fail" the round, or fall back to "uniform" weights.
      max_examples: held-out rows the objective uses (the first ones; None: all). The
        weights need far fewer examples than evaluation: a forward pass of every node over
        them is the objective's main cost on larger models.
    """

    objective: str = "mixture_nll"
    max_weight: float | None = 0.4
    lambda_reg: float = 0.0
    on_solver_failure: Literal["fail", "uniform"] = "fail"
    max_examples: int | None = None


@dataclasses.dataclass(frozen=True)
class DPConfig:
    """Differential privacy: node-level (of the consensus update) or example-level (DP-SGD in the nodes).

    Attributes:
      enabled: add the DP step.
      level: "node" (the coordinator clips and noises the nodes' updates; the unit of privacy is a
        whole node) or "example" (every node trains with DP-SGD on its own examples; the unit is one
        training example, and the coordinator's work is post-processing; see docs/privacy.md).
      clip_norm: C, every node's update (candidate - last consensus) is clipped to C (node level),
        or every per-example gradient (example level).
      noise_multiplier: z (noise std / L2 sensitivity); None: calibrated from ``epsilon`` (example
        level: per node, from its own sampling rate and planned steps).
      epsilon: target epsilon over ``rounds`` rounds (used when noise_multiplier is None).
      microbatch: example level: per-example gradients are computed this many rows at a time
        (0: the whole padded batch at once); bounds their memory on large models.
      delta: the delta of every reported epsilon.
      accountant: "rdp" or "pld" (the ledger's; both epsilons are reported).
      budget: stop before a round would take epsilon above this (None: no budget).
      adaptive: adaptive clipping to the ``target_quantile`` of the update norms.
      target_quantile, adaptive_lr: adaptive clipping parameters (Andrew et al. 2021).
    """

    enabled: bool = False
    level: Literal["node", "example"] = "node"
    clip_norm: float = 2.0
    noise_multiplier: float | None = None
    epsilon: float | None = None
    delta: float = 1e-5
    accountant: Literal["rdp", "pld"] = "rdp"
    budget: float | None = None
    adaptive: bool = False
    target_quantile: float = 0.5
    adaptive_lr: float = 0.2
    microbatch: int = 0


@dataclasses.dataclass(frozen=True)
class FaultsConfig:
    """Simulated node failures (a failed node is a missing answer, never a crash of the run).

    Attributes:
      drop_rate: probability that a node does not answer in a round (from the round key).
      crash_nodes: nodes whose fit raises an exception every round.
      timeout_s: answers of a fit call that took longer than this are discarded (None: wait).
    """

    drop_rate: float = 0.0
    crash_nodes: tuple[int, ...] = ()
    timeout_s: float | None = None


@dataclasses.dataclass(frozen=True)
class ScheduleConfig:
    """When the coordinator merges: after every round, or whenever a buffer of updates is full.

    See :mod:`meta_consensus.async_rounds` and docs/async.md.

    Attributes:
      mode: "sync" (every round waits for its nodes; the default) or "async" (buffered
        asynchronous rounds, FedBuff: a merge whenever ``buffer`` updates have arrived; ``rounds``
        then counts applied buffers).
      buffer: K, the updates an applied buffer holds (async; 1 <= K <= nodes.count).
      staleness: the weight of an update that is tau versions old: "constant" (1),
        "polynomial" ((1 + tau)^-a, FedBuff's) or "hinge" (1 up to ``staleness_hinge``, then
        1 / (1 + a (tau - hinge))).
      staleness_exponent: a of the polynomial and the hinge's slope.
      staleness_hinge: b of the hinge: updates up to b versions old keep weight 1.
      max_staleness: updates more than this many versions old are dropped (and counted); None: none.
      speeds: the virtual clock's node speeds: "lognormal" (each node's mean fit time from a
        log-normal, the slowest ``speed_spread`` times the fastest), "constant" (every fit takes
        1) or "trace" (``speed_trace``: one line per node of fit times, used in turn).
      speed_spread: the slowest node's mean fit time over the fastest's ("lognormal").
      speed_jitter: the standard deviation of the log of one fit's time around its node's mean.
      speed_trace: the trace file ("trace").
    """

    mode: Literal["sync", "async"] = "sync"
    buffer: int = 4
    staleness: Literal["constant", "polynomial", "hinge"] = "polynomial"
    staleness_exponent: float = 0.5
    staleness_hinge: int = 4
    max_staleness: int | None = None
    speeds: Literal["lognormal", "constant", "trace"] = "lognormal"
    speed_spread: float = 4.0
    speed_jitter: float = 0.1
    speed_trace: str | None = None

    @property
    def asynchronous(self) -> bool:
        """Whether merges are buffered asynchronous rounds."""
        return self.mode == "async"


@dataclasses.dataclass(frozen=True)
class MeshSettings:
    """Device mesh of the node trainer: sizes of the ("node", "data", "model") axes (all 1: no mesh).

    Attributes:
      node: devices along the node axis (nodes are split over them).
      data: data-parallel devices inside one node (batch split).
      model: tensor-parallel devices inside one node.
    """

    node: int = 1
    data: int = 1
    model: int = 1

    @property
    def enabled(self) -> bool:
        """Whether any axis has more than one device (a mesh is built)."""
        return self.node * self.data * self.model > 1


@dataclasses.dataclass(frozen=True)
class Config:
    """A whole run.

    Attributes:
      name: run name; outputs go to ``<output_dir>/<name>/``.
      output_dir: parent directory of runs.
      seed: the root PRNG seed (node init, sampling, attacks, faults, DP noise).
      rounds: number of rounds (asynchronous rounds: of applied buffers).
      consensus_threshold: fraction of the n nodes the vote must accept for the round to count.
      min_answers: fraction of the n nodes that must answer with a valid candidate.
      quality_threshold: minimum held-out accuracy of a candidate (None: no gate).
      max_retries: how many times a failed round is retried (fresh keys) before giving up.
      on_failure: after the retries, "continue" with the previous consensus or "stop" the run.
      checkpoint_every: save a checkpoint every k rounds (0: never).
      keep_checkpoints: how many checkpoints to keep.
      baseline_fedavg: also run plain FedAvg (same nodes and attackers, uniform mean) alongside.
      eval_every: evaluate every node and the consensus on the test set (and compute the second
        accountant's epsilon) every k rounds and at the last round; other rounds log NaN there.
      heartbeat_timeout_s: multi-process runs: seconds without a heartbeat after which
        jax.distributed declares a process lost (see docs/operations.md).
      init_from: a safetensors checkpoint (file or sharded folder) to start from instead of
        the task's init; its keys, shapes and dtypes must match the task's parameters.
      plugins: modules imported before the config is checked (the current directory is
        importable); their declared rules, attacks, node strategies, weight objectives and
        tasks are then valid values (see :mod:`consensus.plugins`).
      task: the ``[task]`` section.
      nodes: the ``[nodes]`` section.
      byzantine: the ``[byzantine]`` section.
      vote: the ``[vote]`` section.
      weights: the ``[weights]`` section.
      dp: the ``[dp]`` section.
      faults: the ``[faults]`` section.
      mesh: the ``[mesh]`` section.
      schedule: the ``[schedule]`` section (synchronous or buffered asynchronous rounds).

    Raises:
      ConfigError: an invalid value (the message names the key); every Config is checked when made.
    """

    name: str = "run"
    output_dir: str = "runs"
    seed: int = 0
    rounds: int = 10
    consensus_threshold: float = 0.5
    min_answers: float = 0.5
    quality_threshold: float | None = None
    max_retries: int = 1
    on_failure: Literal["continue", "stop"] = "continue"
    checkpoint_every: int = 2
    keep_checkpoints: int = 2
    baseline_fedavg: bool = True
    eval_every: int = 1
    heartbeat_timeout_s: int = 100
    init_from: str | None = None
    plugins: tuple[str, ...] = ()
    task: TaskConfig = dataclasses.field(default_factory=TaskConfig)
    nodes: NodesConfig = dataclasses.field(default_factory=NodesConfig)
    byzantine: ByzantineConfig = dataclasses.field(default_factory=ByzantineConfig)
    vote: VoteConfig = dataclasses.field(default_factory=VoteConfig)
    weights: WeightsConfig = dataclasses.field(default_factory=WeightsConfig)
    dp: DPConfig = dataclasses.field(default_factory=DPConfig)
    faults: FaultsConfig = dataclasses.field(default_factory=FaultsConfig)
    mesh: MeshSettings = dataclasses.field(default_factory=MeshSettings)
    schedule: ScheduleConfig = dataclasses.field(default_factory=ScheduleConfig)

    def __post_init__(self):
        validate(self)

    @property
    def run_dir(self) -> Path:
        """Where the run writes its outputs: ``<output_dir>/<name>``."""
        return Path(self.output_dir) / self.name

    def replace(self, **changes: Any) -> Config:
        """A copy with ``changes`` (top-level fields), checked again.

        Args:
          **changes: new values by field name (a section takes a whole section object).

        Returns:
          The new config.

        Raises:
          ConfigError: the new config is invalid.
        """
        return dataclasses.replace(self, **changes)


def plain_fedavg(cfg: Config) -> bool:
    """Whether the merge is plain DP-FedAvg (sensitivity C / n) rather than a robust pipeline (2C).

    Read from the declarations: the vote rule's trait ``uniform_mean`` and the weight
    objective's trait ``keeps_uniform_mean`` (one group, no pre-aggregator).

    Args:
      cfg: the run config.

    Returns:
      True when the DP sensitivity is that of a plain mean.
    """
    from consensus.registry import RULES
    from meta_consensus.objectives import OBJECTIVES

    v = cfg.vote
    uniform_vote = bool(RULES[v.rule].traits.get("uniform_mean", False))
    keeps_it = bool(OBJECTIVES[cfg.weights.objective].traits.get("keeps_uniform_mean", False))
    return uniform_vote and keeps_it and v.groups <= 1 and not v.pre
