"""The run configuration: nested frozen dataclasses, loaded from TOML, checked before anything runs.

A config file mirrors the dataclasses (top-level keys, then one table per
section)::

    name = "demo"
    rounds = 10
    [nodes]
    count = 8
    strategies = ["hierarchical", "hierarchical", "convexity", "convexity", "soup", "soup", "local", "local"]
    [byzantine]
    nodes = [6, 7]
    attack = "alie"
    [vote]
    rule = "multi_krum"
    fault_tolerance = 0.25

Every key is checked: an unknown key or a value outside its choices raises
:class:`ConfigError` naming the key and listing what is valid. ``--set
section.key=value`` overrides (:func:`apply_overrides`) parse ``value`` as a
TOML value (``3``, ``0.5``, ``"alie"``, ``[6, 7]``, ``true``); a bare word is
taken as a string.
"""

from __future__ import annotations

import dataclasses
import inspect
import math
import tomllib
import types
import typing
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Literal

import tomli_w

STRATEGIES = ("local", "hierarchical", "convexity", "soup")
VOTE_RULES = (
    "mean",
    "median",
    "trimmed_mean",
    "krum",
    "multi_krum",
    "bulyan",
    "geometric_median",
    "centered_clipping",
)
PRE_RULES = ("clip", "nnm")
OBJECTIVES = ("vote", "uniform", "quadratic", "mixture_nll", "anchor")
ATTACKS = ("label_flip", "sign_flip", "gaussian", "alie", "ipm", "nonfinite", "mimic")


class ConfigError(ValueError):
    """A configuration key or value that is not valid; the message says which and what is."""


@dataclasses.dataclass(frozen=True)
class TaskConfig:
    """The model and data every node trains on.

    Attributes:
      name: "digits" (scikit-learn digits, MLP) or "text" (byte-level transformer).
      alpha: Dirichlet concentration of the non-IID split over the nodes (small: skewed).
      hidden: digits only: hidden layer widths of the MLP.
      data_seed: seed of the node split (the train / held-out / test split is fixed per task).
    """

    name: Literal["digits", "text"] = "digits"
    alpha: float = 0.5
    hidden: tuple[int, ...] = (32,)
    data_seed: int = 0


@dataclasses.dataclass(frozen=True)
class NodesConfig:
    """The nodes and the strategy each one trains with.

    Attributes:
      count: n, the number of nodes.
      strategies: one strategy per node ("local", "hierarchical", "convexity", "soup"),
        or a single name for every node.
      local_steps: optimizer steps per node per round.
      batch_size: rows per step.
      learning_rate: Adam learning rate of "local" training and of the last hierarchical level.
      hierarchical_fractions: shares of a hierarchical node's steps spent on the general pool,
        on its own groups of the general pool, and on its own shard (in that order).
      hierarchical_lr_scale: learning-rate multipliers of the three levels.
      proximal_mu: "convexity" nodes: proximal pull towards the last consensus.
      proximal_radius: "convexity" nodes: radius of the L2 ball around the last consensus
        (inf: no projection).
      soup_snapshots: "soup" nodes: checkpoints taken along the round's training; the node
        submits their greedy soup on held-out accuracy.
    """

    count: int = 8
    strategies: tuple[str, ...] | str = "local"
    local_steps: int = 40
    batch_size: int = 32
    learning_rate: float = 3e-3
    hierarchical_fractions: tuple[float, float, float] = (0.5, 0.25, 0.25)
    hierarchical_lr_scale: tuple[float, float, float] = (1.0, 1.0, 0.5)
    proximal_mu: float = 0.5
    proximal_radius: float = math.inf
    soup_snapshots: int = 4

    def strategy_of(self) -> tuple[str, ...]:
        s = self.strategies
        return (s,) * self.count if isinstance(s, str) else tuple(s)


@dataclasses.dataclass(frozen=True)
class ByzantineConfig:
    """Which nodes are Byzantine and how they attack.

    Attributes:
      nodes: indices of the Byzantine nodes.
      attack: "label_flip" (poisoned training data) or a model attack on the submitted update.
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
      rule: the aggregation rule (see :data:`VOTE_RULES`).
      num_byzantine: f given directly, or None to use ``fault_tolerance``.
      fault_tolerance: f as a fraction of n: ``f = floor(fault_tolerance * n)``.
      pre: pre-aggregators applied before the rule, in order ("clip", "nnm").
      clip_norm: radius of the "clip" pre-aggregator (around the last consensus).
      groups: hierarchical consensus: number of contiguous node groups (0 or 1: flat). The
        rule votes inside each group with f_group = floor(fault_tolerance * group size) (or
        ``num_byzantine`` // groups), then ``top_rule`` votes over the group results.
      top_rule: the rule over the group results.
      top_num_byzantine: f of the top vote (groups that may be wholly Byzantine).
    """

    rule: str = "multi_krum"
    num_byzantine: int | None = None
    fault_tolerance: float = 0.25
    pre: tuple[str, ...] = ()
    clip_norm: float = 10.0
    groups: int = 0
    top_rule: str = "median"
    top_num_byzantine: int = 0

    def f(self, n: int) -> int:
        return (
            self.num_byzantine
            if self.num_byzantine is not None
            else int(math.floor(self.fault_tolerance * n))
        )


@dataclasses.dataclass(frozen=True)
class WeightsConfig:
    """Convex merge weights over the nodes the vote accepted.

    Attributes:
      objective: "vote" (the vote's own output is the consensus), "uniform" (plain mean of
        the accepted nodes), "quadratic" (trust-region quadratic model of the held-out loss),
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
    """Node-level differential privacy of the consensus update.

    Attributes:
      enabled: add the DP step.
      clip_norm: C, every node's update (candidate - last consensus) is clipped to C.
      noise_multiplier: z (noise std / L2 sensitivity); None: calibrated from ``epsilon``.
      epsilon: target epsilon over ``rounds`` rounds (used when noise_multiplier is None).
      delta: the delta of every reported epsilon.
      accountant: "rdp" or "pld" (the ledger's; both epsilons are reported).
      budget: stop before a round would take epsilon above this (None: no budget).
      adaptive: adaptive clipping to the ``target_quantile`` of the update norms.
      target_quantile, adaptive_lr: adaptive clipping parameters (Andrew et al. 2021).
    """

    enabled: bool = False
    clip_norm: float = 2.0
    noise_multiplier: float | None = None
    epsilon: float | None = None
    delta: float = 1e-5
    accountant: Literal["rdp", "pld"] = "rdp"
    budget: float | None = None
    adaptive: bool = False
    target_quantile: float = 0.5
    adaptive_lr: float = 0.2


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


# The embedded default of `meta-consensus run`: the whole idea in well under two minutes on two cores.
# ALIE's shift is mu - z sigma per coordinate; the stealthy z_max for n = 8, f = 2 (0.32) does no
# measurable harm to FedAvg on digits in 20 rounds, z = 10 breaks it, and the pipeline still holds.
# The DP noise is small: node-level DP over 8 nodes is nominal at any useful accuracy (the table says
# so); benchmarks/privacy_quality.py shows epsilon <= 8 with 400 clients.
DEFAULT = {
    "name": "default",
    "rounds": 20,
    "seed": 0,
    "checkpoint_every": 5,
    "nodes": {
        "count": 8,
        "strategies": [
            "hierarchical",
            "hierarchical",
            "convexity",
            "convexity",
            "soup",
            "soup",
            "local",
            "local",
        ],
        "local_steps": 40,
    },
    "byzantine": {"nodes": [6, 7], "attack": "alie", "options": {"z": 10.0}},
    "vote": {"rule": "multi_krum", "fault_tolerance": 0.25},
    "weights": {"objective": "mixture_nll", "max_weight": 0.4},
    "dp": {"enabled": True, "clip_norm": 1.0, "noise_multiplier": 0.01},
}


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


def _check_attack_options(attack: str, options: Mapping[str, Any]) -> None:
    """The attack's keyword arguments must be ones its function takes (checked before any round runs)."""
    if attack == "label_flip":
        valid: list[str] = []
    else:
        from strategies.attacks import ATTACKS as FUNCTIONS

        params = list(inspect.signature(FUNCTIONS[attack]).parameters)[3:]  # after key, honest, f
        valid = [p for p in params if p != "num_nodes"]  # the system passes n itself
    unknown = sorted(set(options) - set(valid))
    if unknown:
        raise ConfigError(
            f"byzantine.options {unknown} are not options of the {attack!r} attack; valid options: {valid} "
            "(set byzantine.options={} to use its defaults)"
        )


def validate(cfg: Config) -> None:
    """Check every value of a config (ConfigError names the key and what is valid)."""
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
    _choices("on_failure", cfg.on_failure, ("continue", "stop"))
    if cfg.quality_threshold is not None:
        _check(0.0 <= cfg.quality_threshold <= 1.0, "quality_threshold", cfg.quality_threshold, "need [0, 1]")
    # task
    _choices("task.name", cfg.task.name, ("digits", "text"))
    _check(cfg.task.alpha > 0, "task.alpha", cfg.task.alpha, "need > 0")
    _check(all(h >= 1 for h in cfg.task.hidden), "task.hidden", cfg.task.hidden, "positive widths")
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
        _choices("nodes.strategies", s, STRATEGIES)
    _check(cfg.nodes.local_steps >= 1, "nodes.local_steps", cfg.nodes.local_steps, "need >= 1")
    _check(cfg.nodes.batch_size >= 1, "nodes.batch_size", cfg.nodes.batch_size, "need >= 1")
    _check(cfg.nodes.learning_rate > 0, "nodes.learning_rate", cfg.nodes.learning_rate, "need > 0")
    fr = cfg.nodes.hierarchical_fractions
    _check(
        len(fr) == 3 and all(x >= 0 for x in fr) and abs(sum(fr) - 1) < 1e-6,
        "nodes.hierarchical_fractions",
        fr,
        "three shares >= 0 that sum to 1 (general, groups, own)",
    )
    _check(
        len(cfg.nodes.hierarchical_lr_scale) == 3 and all(x > 0 for x in cfg.nodes.hierarchical_lr_scale),
        "nodes.hierarchical_lr_scale",
        cfg.nodes.hierarchical_lr_scale,
        "three multipliers > 0",
    )
    _check(cfg.nodes.proximal_mu >= 0, "nodes.proximal_mu", cfg.nodes.proximal_mu, "need >= 0")
    _check(cfg.nodes.proximal_radius > 0, "nodes.proximal_radius", cfg.nodes.proximal_radius, "need > 0")
    _check(
        1 <= cfg.nodes.soup_snapshots <= cfg.nodes.local_steps,
        "nodes.soup_snapshots",
        cfg.nodes.soup_snapshots,
        "need 1 <= soup_snapshots <= local_steps",
    )
    # byzantine
    byz = cfg.byzantine
    _choices("byzantine.attack", byz.attack, ATTACKS)
    _check_attack_options(byz.attack, byz.options)
    _check(
        all(0 <= i < n for i in byz.nodes) and len(set(byz.nodes)) == len(byz.nodes),
        "byzantine.nodes",
        byz.nodes,
        f"distinct node indices in 0..{n - 1}",
    )
    _check(len(byz.nodes) < n, "byzantine.nodes", byz.nodes, "at least one honest node")
    # vote
    v = cfg.vote
    _choices("vote.rule", v.rule, VOTE_RULES)
    _choices("vote.top_rule", v.top_rule, VOTE_RULES)
    for p in v.pre:
        _choices("vote.pre", p, PRE_RULES)
    _check(0.0 <= v.fault_tolerance < 0.5, "vote.fault_tolerance", v.fault_tolerance, "need [0, 0.5)")
    if v.num_byzantine is not None:
        _check(0 <= v.num_byzantine < n, "vote.num_byzantine", v.num_byzantine, f"need 0 <= f < n = {n}")
    _check(v.clip_norm > 0, "vote.clip_norm", v.clip_norm, "need > 0")
    _check(
        v.groups >= 0 and (v.groups <= 1 or n % v.groups == 0),
        "vote.groups",
        v.groups,
        f"0, 1 or a divisor of nodes.count = {n}",
    )
    _check(v.top_num_byzantine >= 0, "vote.top_num_byzantine", v.top_num_byzantine, "need >= 0")
    # weights
    w = cfg.weights
    _choices("weights.objective", w.objective, OBJECTIVES)
    if w.max_weight is not None:
        _check(0.0 < w.max_weight <= 1.0, "weights.max_weight", w.max_weight, "need (0, 1]")
    _check(w.lambda_reg >= 0, "weights.lambda_reg", w.lambda_reg, "need >= 0")
    _choices("weights.on_solver_failure", w.on_solver_failure, ("fail", "uniform"))
    if w.max_examples is not None:
        _check(w.max_examples >= 1, "weights.max_examples", w.max_examples, "need >= 1 (or none: all)")
    # dp
    d = cfg.dp
    _choices("dp.accountant", d.accountant, ("rdp", "pld"))
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


def from_dict(data: Mapping[str, Any]) -> Config:
    """A validated :class:`Config` from nested dicts (TOML tables)."""
    return _build(Config, data)


def load(path: str | Path | None = None, overrides: Sequence[str] = ()) -> Config:
    """The config of a file (None: the embedded default) with ``key=value`` overrides applied."""
    if path is None:
        data = _deep_copy(DEFAULT)
    else:
        p = Path(path)
        if not p.is_file():
            raise ConfigError(f"config file {str(p)!r} does not exist")
        try:
            data = tomllib.loads(p.read_text())
        except tomllib.TOMLDecodeError as e:
            raise ConfigError(f"config file {str(p)!r} is not valid TOML: {e}") from e
    return from_dict(apply_overrides(data, overrides))


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
        if isinstance(x, float) and math.isinf(x):
            return "inf"
        return x

    return clean(dataclasses.asdict(cfg))


def dumps(cfg: Config) -> str:
    """TOML text of a config; :func:`load` of it gives back an equal config."""
    return tomli_w.dumps(to_dict(cfg))
