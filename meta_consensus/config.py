"""The run configuration: nested frozen dataclasses, loaded from TOML, checked before anything runs.

A config file mirrors the dataclasses (top-level keys, then one table per
section); the embedded default is ``meta_consensus/default.toml``::

    name = "demo"
    rounds = 10
    [nodes]
    count = 8
    strategies = ["hierarchical", "hierarchical", "convexity", "convexity", "soup", "soup", "local", "local"]
    [nodes.options.convexity]
    mu = 0.5
    [byzantine]
    nodes = [6, 7]
    attack = "alie"
    [vote]
    rule = "multi_krum"
    fault_tolerance = 0.25

Every key is checked: an unknown key or a value outside its choices raises
:class:`ConfigError` naming the key and listing what is valid. The choices, the
options and the preconditions are read from the declared specs (:mod:`consensus.specs`:
``RULES`` for vote rules, ``strategies.registry`` for tasks, attacks and node
strategies, :mod:`meta_consensus.objectives` for weight objectives), so a newly
declared entry is a valid value at once. The modules named by ``plugins = [...]``
(and the installed ``meta_consensus.plugins`` entry points) are imported first, so
their entries are valid too. A rule's precondition on (n, f) is checked here,
before any training. ``--set section.key=value`` overrides
(:func:`apply_overrides`) parse ``value`` as a TOML value (``3``, ``0.5``,
``"alie"``, ``[6, 7]``, ``true``); a bare word is taken as a string.
"""

from __future__ import annotations

import dataclasses
import importlib.resources
import math
import tomllib
import types
import typing
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Literal

import tomli_w

from consensus import registry as rules
from consensus.plugins import PluginError, load_entry_points, load_plugins
from consensus.registry import RegistryError
from meta_consensus.objectives import OBJECTIVES
from strategies import attacks
from strategies import node as node_lib
from strategies import registry as node_registry


class ConfigError(ValueError):
    """A configuration key or value that is not valid; the message says which and what is."""


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
    """

    name: str = "digits"
    alpha: float = 0.5
    data_seed: int = 0
    options: Mapping[str, Any] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass(frozen=True)
class NodesConfig:
    """The nodes and the strategy each one trains with.

    Attributes:
      count: n, the number of nodes.
      strategies: one registered node strategy per node ("local", "hierarchical",
        "convexity", "soup", ...; see ``strategies.node.STRATEGIES``), or one name for all.
      local_steps: optimizer steps per node per round.
      batch_size: rows per step.
      learning_rate: Adam learning rate (each strategy may scale it per curriculum level).
      options: per strategy name, the keyword options of its class, for example
        ``{hierarchical = {fractions = [0.5, 0.25, 0.25]}, convexity = {mu = 0.5, radius = inf},
        soup = {snapshots = 4}}``.
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
    """

    count: int = 8
    strategies: tuple[str, ...] | str = "local"
    local_steps: int = 40
    batch_size: int = 32
    learning_rate: float = 3e-3
    options: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    sampling: Literal["full", "uniform", "poisson"] = "full"
    per_round: int | None = None
    sampling_rate: float | None = None
    chunk: int = 0
    optimizer: Literal["adam", "sgd"] = "adam"

    @property
    def sampled(self) -> bool:
        """Whether only a sample of the nodes takes part in a round."""
        return self.sampling != "full"

    def poisson_rate(self) -> float:
        """q of Poisson sampling (1.0 under full participation or a uniform sample)."""
        if self.sampling != "poisson":
            return 1.0
        if self.sampling_rate is not None:
            return float(self.sampling_rate)
        return float(self.per_round) / self.count

    def expected_per_round(self) -> float:
        """The expected number of nodes in a round's sample (n under full participation)."""
        if self.sampling == "uniform":
            return float(self.per_round)
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
      attack: a registered attack ("label_flip" poisons training data; the others replace the
        submitted update; see ``strategies.registry.ATTACKS``).
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

    def f(self, answered: int) -> int:
        """f of a flat vote when ``answered`` nodes answered with a valid candidate."""
        if self.num_byzantine is not None:
            return self.num_byzantine
        return int(math.floor(self.fault_tolerance * answered))

    def group_f(self, group_size: int) -> int:
        """f inside each group of a grouped vote."""
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
class MeshSettings:
    """Device mesh of the node trainer: sizes of the ("node", "data", "model") axes (all 1: no mesh)."""

    node: int = 1
    data: int = 1
    model: int = 1

    @property
    def enabled(self) -> bool:
        return self.node * self.data * self.model > 1


@dataclasses.dataclass(frozen=True)
class Config:
    """A whole run.

    Attributes:
      name: run name; outputs go to ``<output_dir>/<name>/``.
      output_dir: parent directory of runs.
      seed: the root PRNG seed (node init, sampling, attacks, faults, DP noise).
      rounds: number of rounds.
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

    def __post_init__(self):
        validate(self)

    @property
    def run_dir(self) -> Path:
        return Path(self.output_dir) / self.name

    def replace(self, **changes: Any) -> Config:
        return dataclasses.replace(self, **changes)


DEFAULT_FILE = "default.toml"  # package data of meta_consensus: the embedded default of `meta-consensus run`


def default_text() -> str:
    """The TOML text of the embedded default config."""
    return importlib.resources.files("meta_consensus").joinpath(DEFAULT_FILE).read_text()


def plain_fedavg(cfg: Config) -> bool:
    """Whether the merge is plain DP-FedAvg (sensitivity C / n) rather than a robust pipeline (2C)."""
    v = cfg.vote
    return v.rule == "mean" and cfg.weights.objective in ("vote", "uniform") and v.groups <= 1 and not v.pre


# ----------------------------------------------------------------------------- validation


def _choices(key: str, value: Any, valid: Sequence[str]) -> None:
    if value not in valid:
        raise ConfigError(f"{key} = {value!r} is not valid; choose one of {list(valid)}")


def _check(cond: bool, key: str, value: Any, need: str) -> None:
    if not cond:
        raise ConfigError(f"{key} = {value!r} is not valid: {need}")


def _registered(key: str, build: Any) -> Any:
    """Run a registry build/check; its RegistryError or ValueError becomes a ConfigError naming ``key``."""
    try:
        return build()
    except (RegistryError, ValueError, TypeError) as e:
        raise ConfigError(f"{key}: {e}") from None


# What the system's round hands a rule besides the stacked candidates: the last consensus
# (the base of merge methods, the centre of the votes), a key from the round key (randomized
# rules) and the coordinator's own update on its root set (server-guided rules; see
# meta_consensus.server), and the nodes' Fisher / input Grams (fisher_merge, regmean; see
# meta_consensus.statistics).
SYSTEM_PROVIDES = frozenset({"params", "key", "server_update", "fisher", "grams"})


def _check_rule(key: str, name: str, f: int, n: int, options: Mapping[str, Any], where: str) -> None:
    """A registered rule that takes these options and whose precondition holds on n nodes with f."""
    spec = _registered(key, lambda: rules.RULES[name])
    missing = sorted(spec.needs - SYSTEM_PROVIDES - set(options))  # e.g. weighted_mean's weights=
    if missing:
        raise ConfigError(
            f"{key} = {name!r} needs {missing}, which the system's round does not provide yet; "
            "use it through the library (consensus.registry.make) or choose another rule"
        )
    _registered(f"{key} options", lambda: spec.check_params(options))
    need = spec.requirement(n, f) if spec.takes_f else spec.requirement(n, 0)
    if need is not None:
        raise ConfigError(
            f"{key} = {name!r} cannot run on {where} of {n} nodes with f = {f}: it needs {need} "
            "(lower vote.fault_tolerance / vote.num_byzantine, use fewer groups, or choose another rule)"
        )


def _check_vote(cfg: Config) -> None:
    """Every rule of the vote is registered, takes its options, and holds on the full fleet
    (on the expected sample when only a sample of the nodes takes part in a round)."""
    v, n = cfg.vote, cfg.nodes.vote_size()
    _check(0.0 <= v.fault_tolerance < 0.5, "vote.fault_tolerance", v.fault_tolerance, "need [0, 0.5)")
    if v.num_byzantine is not None:
        _check(0 <= v.num_byzantine < n, "vote.num_byzantine", v.num_byzantine, f"need 0 <= f < n = {n}")
    _check(
        v.groups >= 0 and (v.groups <= 1 or n % v.groups == 0),
        "vote.groups",
        v.groups,
        f"0, 1 or a divisor of nodes.count = {n}",
    )
    _check(v.top_num_byzantine >= 0, "vote.top_num_byzantine", v.top_num_byzantine, "need >= 0")
    _check(
        v.root_size >= 1 if isinstance(v.root_size, int) else 0.0 < v.root_size < 1.0,
        "vote.root_size",
        v.root_size,
        "an integer >= 1 (held-out rows) or a share of the held-out rows in (0, 1)",
    )
    _check(v.server_steps is None or v.server_steps >= 1, "vote.server_steps", v.server_steps, "need >= 1")
    _check(
        isinstance(v.server_step, int | float)
        and not isinstance(v.server_step, bool)
        and math.isfinite(v.server_step)
        and v.server_step >= 0,
        "vote.server_step",
        v.server_step,
        "need a finite number >= 0 (0: off)",
    )
    vote_rules = rules.vote_rules()
    _choices("vote.rule", v.rule, vote_rules)
    unknown_pre = sorted(set(v.pre_options) - set(v.pre))
    if unknown_pre:
        raise ConfigError(
            f"vote.pre_options {unknown_pre} name pre-aggregators not in vote.pre = {list(v.pre)}"
        )
    grouped = v.groups > 1
    size = n // v.groups if grouped else n
    f = v.group_f(size) if grouped else v.f(n)
    where = f"each of the {v.groups} groups" if grouped else "all"
    for p in v.pre:
        _choices("vote.pre", p, rules.pre_aggregators())
        _check_rule(f"vote.pre[{p}]", p, f, size, v.pre_options.get(p, {}), where)
    _check_rule("vote.rule", v.rule, f, size, v.options, where)
    if grouped:
        _choices("vote.top_rule", v.top_rule, vote_rules)
        _check_rule(
            "vote.top_rule", v.top_rule, v.top_num_byzantine, v.groups, v.top_options, "the group results"
        )


def _check_sampling(cfg: Config) -> None:
    """Client sampling: a size or rate that fits the fleet, and the features it does not combine with."""
    nd, n = cfg.nodes, cfg.nodes.count
    _choices("nodes.sampling", nd.sampling, ("full", "uniform", "poisson"))
    _choices("nodes.optimizer", nd.optimizer, ("adam", "sgd"))
    _check(nd.chunk >= 0, "nodes.chunk", nd.chunk, "need >= 0 (0: all the round's nodes in one fit call)")
    if not nd.sampled:
        for key, value in (("per_round", nd.per_round), ("sampling_rate", nd.sampling_rate)):
            _check(value is None, f"nodes.{key}", value, 'only with nodes.sampling = "uniform" or "poisson"')
        return
    if nd.sampling == "uniform":
        _check(nd.per_round is not None, "nodes.per_round", nd.per_round, "give the sample size m")
        _check(nd.sampling_rate is None, "nodes.sampling_rate", nd.sampling_rate, "Poisson sampling only")
    else:
        _check(
            (nd.per_round is None) != (nd.sampling_rate is None),
            "nodes.sampling_rate",
            nd.sampling_rate,
            "give exactly one of nodes.sampling_rate (q) and nodes.per_round (expected count q * n)",
        )
        if nd.sampling_rate is not None:
            _check(0 < nd.sampling_rate <= 1, "nodes.sampling_rate", nd.sampling_rate, "need (0, 1]")
    if nd.per_round is not None:
        _check(2 <= nd.per_round <= n, "nodes.per_round", nd.per_round, f"need 2 <= m <= nodes.count = {n}")
    _check(
        nd.expected_per_round() >= 1,
        "nodes.sampling_rate",
        nd.sampling_rate,
        f"q * nodes.count must be at least 1 (count = {n})",
    )
    _check(nd.chunk_size() % cfg.mesh.node == 0, "nodes.chunk", nd.chunk, "a multiple of mesh.node")
    _check(cfg.vote.groups <= 1, "vote.groups", cfg.vote.groups, "a grouped vote needs full participation")
    _check(
        not (cfg.dp.enabled and cfg.dp.level == "example"),
        "dp.level",
        cfg.dp.level,
        'client sampling runs node-level DP only (dp.level = "node")',
    )


_entry_points_loaded = False


def load_config_plugins(cfg: Config) -> None:
    """Import the installed plug-ins (once per process) and the config's ``plugins``.

    Every process that builds a config from its text (a resumed run, a Flower ClientApp,
    each jax.distributed process) reaches this before the names are checked, so the
    entries the plug-ins declare are valid there too.
    """
    global _entry_points_loaded
    _check(
        isinstance(cfg.plugins, tuple | list) and all(isinstance(m, str) and m.strip() for m in cfg.plugins),
        "plugins",
        cfg.plugins,
        "a list of module names",
    )
    try:
        if not _entry_points_loaded:
            load_entry_points()
            _entry_points_loaded = True
        load_plugins(cfg.plugins)
    except PluginError as e:
        raise ConfigError(f"plugins: {e}") from None


def validate(cfg: Config) -> None:
    """Check every value of a config (ConfigError names the key and what is valid)."""
    load_config_plugins(cfg)
    n = cfg.nodes.count
    _check(
        isinstance(cfg.name, str) and cfg.name.strip() != "" and "/" not in cfg.name,
        "name",
        cfg.name,
        "a non-empty name without '/'",
    )
    _check(cfg.rounds >= 1, "rounds", cfg.rounds, "need >= 1")
    _check(
        0.0 < cfg.consensus_threshold <= 1.0, "consensus_threshold", cfg.consensus_threshold, "need (0, 1]"
    )
    _check(0.0 < cfg.min_answers <= 1.0, "min_answers", cfg.min_answers, "need (0, 1]")
    _check(cfg.max_retries >= 0, "max_retries", cfg.max_retries, "need >= 0")
    _check(cfg.checkpoint_every >= 0, "checkpoint_every", cfg.checkpoint_every, "need >= 0")
    _check(cfg.eval_every >= 1, "eval_every", cfg.eval_every, "need >= 1")
    _check(cfg.keep_checkpoints >= 1, "keep_checkpoints", cfg.keep_checkpoints, "need >= 1")
    _check(cfg.heartbeat_timeout_s >= 1, "heartbeat_timeout_s", cfg.heartbeat_timeout_s, "need >= 1")
    _choices("on_failure", cfg.on_failure, ("continue", "stop"))
    if cfg.init_from is not None:
        _check(
            isinstance(cfg.init_from, str) and cfg.init_from.strip() != "",
            "init_from",
            cfg.init_from,
            "a path to a safetensors file or folder",
        )
    if cfg.quality_threshold is not None:
        _check(0.0 <= cfg.quality_threshold <= 1.0, "quality_threshold", cfg.quality_threshold, "need [0, 1]")
    # task: a registered name (its options checked against its factory) or an import path,
    # which is resolved when the run starts (importing a user's module is not a config check).
    t = cfg.task
    if ":" not in t.name:
        _choices("task.name", t.name, node_registry.TASKS.names())
        spec = node_registry.TASKS[t.name]
        unknown = sorted(set(t.options) - set(spec.params))
        if unknown and not spec.takes_any_option:
            raise ConfigError(
                f"task.options {unknown} are not options of the {t.name!r} task; "
                f"valid options: {list(spec.params)}"
            )
    _check(t.alpha > 0, "task.alpha", t.alpha, "need > 0")
    # nodes
    _check(n >= 2, "nodes.count", n, "need at least 2 nodes")
    strategies = cfg.nodes.strategy_of()
    _check(
        len(strategies) == n,
        "nodes.strategies",
        cfg.nodes.strategies,
        f"one name or {n} names (one per node)",
    )
    for s in strategies:
        _choices("nodes.strategies", s, node_registry.STRATEGIES.names())
    _check(cfg.nodes.local_steps >= 1, "nodes.local_steps", cfg.nodes.local_steps, "need >= 1")
    _check(cfg.nodes.batch_size >= 1, "nodes.batch_size", cfg.nodes.batch_size, "need >= 1")
    _check(cfg.nodes.learning_rate > 0, "nodes.learning_rate", cfg.nodes.learning_rate, "need > 0")
    _check_sampling(cfg)
    for name, opts in cfg.nodes.options.items():
        _choices("nodes.options", name, node_registry.STRATEGIES.names())
        _check(isinstance(opts, Mapping), f"nodes.options.{name}", opts, "a table of the strategy's options")
    built = _registered("nodes.options", cfg.nodes.build_strategies)
    for s in {s.name: s for s in built}.values():
        _registered(f"nodes.options.{s.name}", lambda s=s: s.settings(cfg.nodes.local_steps, 1.0))
    # byzantine
    byz = cfg.byzantine
    _choices("byzantine.attack", byz.attack, node_registry.ATTACKS.names())
    _registered("byzantine.options", lambda: attacks.check_options(byz.attack, byz.options))
    _check(
        all(0 <= i < n for i in byz.nodes) and len(set(byz.nodes)) == len(byz.nodes),
        "byzantine.nodes",
        byz.nodes,
        f"distinct node indices in 0..{n - 1}",
    )
    _check(len(byz.nodes) < n, "byzantine.nodes", byz.nodes, "at least one honest node")
    _check_vote(cfg)
    # weights
    w = cfg.weights
    _choices("weights.objective", w.objective, OBJECTIVES.names())
    if w.max_weight is not None:
        _check(0.0 < w.max_weight <= 1.0, "weights.max_weight", w.max_weight, "need (0, 1]")
    _check(w.lambda_reg >= 0, "weights.lambda_reg", w.lambda_reg, "need >= 0")
    _choices("weights.on_solver_failure", w.on_solver_failure, ("fail", "uniform"))
    if w.max_examples is not None:
        _check(w.max_examples >= 1, "weights.max_examples", w.max_examples, "need >= 1 (or none: all)")
    # dp
    d = cfg.dp
    _choices("dp.accountant", d.accountant, ("rdp", "pld"))
    _choices("dp.level", d.level, ("node", "example"))
    _check(d.microbatch >= 0, "dp.microbatch", d.microbatch, "need >= 0 (0: the whole batch)")
    if d.enabled and d.level == "example":
        _check(not d.adaptive, "dp.adaptive", d.adaptive, "adaptive clipping is node-level only")
    if d.enabled:
        _check(d.clip_norm > 0, "dp.clip_norm", d.clip_norm, "need > 0")
        _check(
            d.noise_multiplier is not None or d.epsilon is not None,
            "dp.noise_multiplier",
            d.noise_multiplier,
            "give dp.noise_multiplier or a target dp.epsilon",
        )
        if d.noise_multiplier is not None:
            _check(d.noise_multiplier >= 0, "dp.noise_multiplier", d.noise_multiplier, "need >= 0")
        if d.epsilon is not None:
            _check(d.epsilon > 0, "dp.epsilon", d.epsilon, "need > 0")
        _check(0 < d.delta < 1, "dp.delta", d.delta, "need (0, 1)")
        if d.budget is not None:
            _check(d.budget > 0, "dp.budget", d.budget, "need > 0")
        _check(0 < d.target_quantile < 1, "dp.target_quantile", d.target_quantile, "need (0, 1)")
        _check(d.adaptive_lr > 0, "dp.adaptive_lr", d.adaptive_lr, "need > 0")
    # faults
    f = cfg.faults
    _check(0.0 <= f.drop_rate < 1.0, "faults.drop_rate", f.drop_rate, "need [0, 1)")
    _check(
        all(0 <= i < n for i in f.crash_nodes), "faults.crash_nodes", f.crash_nodes, f"indices in 0..{n - 1}"
    )
    if f.timeout_s is not None:
        _check(f.timeout_s > 0, "faults.timeout_s", f.timeout_s, "need > 0")
    # mesh
    m = cfg.mesh
    _check(min(m.node, m.data, m.model) >= 1, "mesh", m, "axis sizes >= 1")
    _check(n % m.node == 0, "mesh.node", m.node, f"a divisor of nodes.count = {n}")


# ----------------------------------------------------------------------------- loading


def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _convert(key: str, value: Any, hint: Any) -> Any:
    """Coerce a TOML value to the field's type, or raise ConfigError naming the key."""
    origin = typing.get_origin(hint)
    args = typing.get_args(hint)
    if dataclasses.is_dataclass(hint):
        if not isinstance(value, Mapping):
            raise ConfigError(f"[{key}] must be a table, got {value!r}")
        return _build(hint, value, key)
    if origin in (types.UnionType, typing.Union):
        if type(None) in args and (value is None or (isinstance(value, str) and value.lower() == "none")):
            return None
        errors = []
        for a in args:
            if a is type(None):
                continue
            try:
                return _convert(key, value, a)
            except ConfigError as e:
                errors.append(str(e))
        raise ConfigError(f"{key} = {value!r}: " + "; ".join(errors))
    if origin is Literal:
        _choices(key, value, args)
        return value
    if origin is tuple:
        if isinstance(value, str | bytes) or not isinstance(value, Sequence):
            raise ConfigError(f"{key} = {value!r} must be a list")
        item = args[0]
        if len(args) == 2 and args[1] is Ellipsis:
            return tuple(_convert(f"{key}[{i}]", v, item) for i, v in enumerate(value))
        if len(value) != len(args):
            raise ConfigError(f"{key} = {value!r} must have {len(args)} entries")
        return tuple(_convert(f"{key}[{i}]", v, a) for i, (v, a) in enumerate(zip(value, args, strict=True)))
    if origin is Mapping or hint is Mapping:
        if not isinstance(value, Mapping):
            raise ConfigError(f"{key} = {value!r} must be a table")
        return dict(value)
    if hint is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{key} = {value!r} must be true or false")
        return value
    if hint is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{key} = {value!r} must be an integer")
        return value
    if hint is float:
        if isinstance(value, str) and value.lower() in ("inf", "+inf", "infinity"):
            return math.inf
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise ConfigError(f"{key} = {value!r} must be a number")
        return float(value)
    if hint is str:
        if not isinstance(value, str):
            raise ConfigError(f"{key} = {value!r} must be a string")
        return value
    return value


def _build(cls: type, data: Mapping[str, Any], prefix: str = "") -> Any:
    hints = _hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    unknown = sorted(set(data) - set(names))
    if unknown:
        where = f"[{prefix}]" if prefix else "the top level"
        raise ConfigError(f"unknown key(s) {unknown} in {where}; valid keys: {names}")
    kwargs = {}
    for k, v in data.items():
        kwargs[k] = _convert(f"{prefix}.{k}" if prefix else k, v, hints[k])
    return cls(**kwargs)


def with_plugins(data: Mapping[str, Any], plugins: Sequence[str]) -> dict[str, Any]:
    """``data`` with ``plugins`` appended to its ``plugins`` list (each module once, in order)."""
    out = dict(data)
    if plugins:
        listed = out.get("plugins", [])
        listed = list(listed) if isinstance(listed, list | tuple) else [listed]
        out["plugins"] = listed + [m for m in plugins if m not in listed]
    return out


def from_dict(data: Mapping[str, Any], plugins: Sequence[str] = ()) -> Config:
    """A validated :class:`Config` from nested dicts (TOML tables); ``plugins`` adds plug-in modules.

    The plug-ins are imported before any name is checked and stay listed in the config, so
    its TOML text (:func:`dumps`) loads them again wherever it is read.
    """
    return _build(Config, with_plugins(data, plugins))


def load(
    path: str | Path | None = None, overrides: Sequence[str] = (), plugins: Sequence[str] = ()
) -> Config:
    """The config of a file (None: the embedded default) with ``key=value`` overrides and plug-ins."""
    if path is None:
        data = tomllib.loads(default_text())
    else:
        p = Path(path)
        if not p.is_file():
            raise ConfigError(f"config file {str(p)!r} does not exist")
        try:
            data = tomllib.loads(p.read_text())
        except tomllib.TOMLDecodeError as e:
            raise ConfigError(f"config file {str(p)!r} is not valid TOML: {e}") from e
    return from_dict(apply_overrides(data, overrides), plugins)


def _deep_copy(d: Any) -> Any:
    if isinstance(d, Mapping):
        return {k: _deep_copy(v) for k, v in d.items()}
    if isinstance(d, list | tuple):
        return [_deep_copy(v) for v in d]
    return d


def _parse_value(text: str) -> Any:
    try:
        return tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        if text.lower() in ("none", "null"):
            return None
        return text  # a bare word: a string


def apply_overrides(data: Mapping[str, Any], overrides: Sequence[str]) -> dict[str, Any]:
    """Apply ``section.key=value`` overrides to nested dicts (``value`` parsed as TOML)."""
    out = _deep_copy(dict(data))
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"override {item!r} must look like section.key=value")
        path, text = item.split("=", 1)
        keys = path.strip().split(".")
        node = out
        for k in keys[:-1]:
            node = node.setdefault(k, {})
            if not isinstance(node, dict):
                raise ConfigError(f"override {item!r}: {k!r} is not a table")
        value = _parse_value(text.strip())
        if value is None:
            node.pop(keys[-1], None)
            node[keys[-1]] = None
        else:
            node[keys[-1]] = value
    return out


def to_dict(cfg: Config) -> dict[str, Any]:
    """Plain nested dicts of a config (tuples as lists; TOML has no null, so None is "none")."""

    def clean(x: Any) -> Any:
        if x is None:
            return "none"
        if isinstance(x, Mapping):
            return {k: clean(v) for k, v in x.items()}
        if isinstance(x, list | tuple):
            return [clean(v) for v in x]
        return x  # TOML writes inf and nan itself

    return clean(dataclasses.asdict(cfg))


def dumps(cfg: Config) -> str:
    """TOML text of a config; :func:`load` of it gives back an equal config."""
    return tomli_w.dumps(to_dict(cfg))
