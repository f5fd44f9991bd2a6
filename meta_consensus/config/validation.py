"""Every check of a run config: ConfigError names the key and what is valid.

The choices, options and preconditions are read from the declared specs
(:mod:`consensus.specs`), never restated here; the config's plug-ins (and the installed
entry points) are imported first, so their entries are valid values.
"""

from __future__ import annotations

import math
import typing
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from consensus import registry as rules
from consensus.plugins import PluginError, load_entry_points, load_plugins
from consensus.registry import RegistryError
from meta_consensus.config.errors import ConfigError
from meta_consensus.config.errors import check as _check
from meta_consensus.config.errors import check_choice as _choices
from meta_consensus.objectives import OBJECTIVES
from strategies import attacks
from strategies import registry as node_registry

if TYPE_CHECKING:
    from meta_consensus.config.schema import Config


_FIELD_TYPES: dict[type, dict[str, Any]] = {}


def _field_types(cls: type) -> dict[str, Any]:
    if cls not in _FIELD_TYPES:
        _FIELD_TYPES[cls] = typing.get_type_hints(cls)
    return _FIELD_TYPES[cls]


def _check_literal(section: str, obj: Any, field: str) -> None:
    """A Literal field holds one of its type's values (read from the dataclass, never restated)."""
    key = f"{section}.{field}" if section else field
    _choices(key, getattr(obj, field), typing.get_args(_field_types(type(obj))[field]))


def _registered(key: str, build: Any, hint: str = "") -> Any:
    """Run a registry build/check; its RegistryError or ValueError becomes a ConfigError naming ``key``."""
    try:
        return build()
    except (RegistryError, ValueError, TypeError) as e:
        raise ConfigError(f"{key}: {e}{hint}") from None


# What the system's round hands a rule besides the stacked candidates: the last consensus
# (the base of merge methods, the centre of the votes), a key from the round key (randomized
# rules) and the coordinator's own update on its root set (server-guided rules; see
# meta_consensus.server), and the nodes' Fisher / input Grams (fisher_merge, regmean; see
# meta_consensus.statistics).
SYSTEM_PROVIDES = frozenset({"params", "key", "server_update", "fisher", "grams"})


def _clear_hint(options_key: str) -> str:
    """How to give another choice's options, or none, from the command line."""
    return f" (replace them with --set '{options_key}={{...}}', or none with --set '{options_key}={{}}')"


def _check_rule(
    key: str, name: str, f: int, n: int, options: Mapping[str, Any], where: str, options_key: str = ""
) -> None:
    """A registered rule that takes these options and whose precondition holds on n nodes with f."""
    spec = _registered(key, lambda: rules.RULES[name])
    missing = sorted(spec.needs - SYSTEM_PROVIDES - set(options))  # e.g. weighted_mean's weights=
    if missing:
        raise ConfigError(
            f"{key} = {name!r} needs {missing}, which the system's round does not provide yet; "
            "use it through the library (consensus.registry.make) or choose another rule"
        )
    _registered(f"{key} options", lambda: spec.check_params(options), _clear_hint(options_key))
    need = spec.requirement(n, f) if spec.takes_f else spec.requirement(n, 0)
    if need is not None:
        raise ConfigError(
            f"{key} = {name!r} cannot run on {where} of {n} nodes with f = {f}: it needs {need} "
            "(lower vote.fault_tolerance / vote.num_byzantine, use fewer groups, or choose another rule)"
        )


def _check_vote(cfg: Config) -> None:
    """Check that every rule of the vote is registered, takes its options, and holds on the full fleet.

    Where only a sample of the nodes takes part in a round, the rules must hold on the expected sample.
    """
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
        _check_rule(f"vote.pre[{p}]", p, f, size, v.pre_options.get(p, {}), where, f"vote.pre_options.{p}")
    _check_rule("vote.rule", v.rule, f, size, v.options, where, "vote.options")
    if grouped:
        _choices("vote.top_rule", v.top_rule, vote_rules)
        _check_rule(
            "vote.top_rule",
            v.top_rule,
            v.top_num_byzantine,
            v.groups,
            v.top_options,
            "the group results",
            "vote.top_options",
        )


def _check_sampling(cfg: Config) -> None:
    """Client sampling: a size or rate that fits the fleet, and the features it does not combine with."""
    nd, n = cfg.nodes, cfg.nodes.count
    _check_literal("nodes", nd, "sampling")
    _check_literal("nodes", nd, "optimizer")
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


def _check_lora(cfg: Config) -> None:
    """Check a LoRA run: its settings, adapter method and space, and what they do not combine with.

    For a registered task, the targets and rank are also checked against the model's shapes.
    """
    from meta_consensus import lora

    lora.check_config(cfg)
    if lora.enabled(cfg) and ":" not in cfg.task.name:
        assert cfg.nodes.lora is not None
        task = node_registry.resolve_task(cfg.task.name, cfg.task.options)
        lora.check_targets(cfg.nodes.lora, task)


_entry_points_loaded = False


def load_config_plugins(cfg: Config) -> None:
    """Import the installed plug-ins (once per process) and the config's ``plugins``.

    Every process that builds a config from its text (a resumed run, a Flower ClientApp,
    each jax.distributed process) reaches this before the names are checked, so the
    entries the plug-ins declare are valid there too.

    Args:
      cfg: the config whose ``plugins`` to import.

    Raises:
      ConfigError: ``plugins`` is not a list of module names, or a plug-in fails to import.
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


def _check_schedule(cfg: Config) -> None:
    """The ``[schedule]`` section; in async mode the vote's precondition on a buffer of K updates."""
    s, n = cfg.schedule, cfg.nodes.count
    _check_literal("schedule", s, "mode")
    _check_literal("schedule", s, "staleness")
    _check_literal("schedule", s, "speeds")
    _check(s.staleness_exponent >= 0, "schedule.staleness_exponent", s.staleness_exponent, "need >= 0")
    _check(s.staleness_hinge >= 0, "schedule.staleness_hinge", s.staleness_hinge, "need >= 0")
    if s.max_staleness is not None:
        _check(s.max_staleness >= 0, "schedule.max_staleness", s.max_staleness, "need >= 0 (or none)")
    _check(s.speed_spread >= 1, "schedule.speed_spread", s.speed_spread, "need >= 1")
    _check(s.speed_jitter >= 0, "schedule.speed_jitter", s.speed_jitter, "need >= 0")
    has_trace = s.speeds != "trace" or bool(s.speed_trace)
    _check(has_trace, "schedule.speed_trace", s.speed_trace, "a file for speeds = 'trace'")
    if not s.asynchronous:
        return
    _check(1 <= s.buffer <= n, "schedule.buffer", s.buffer, f"need 1 <= buffer <= nodes.count = {n}")
    sync_only = {
        "nodes.sampling": (cfg.nodes.sampled, cfg.nodes.sampling),
        "vote.groups": (cfg.vote.groups > 1, cfg.vote.groups),
        "nodes.lora": (cfg.nodes.lora is not None, "a [nodes.lora] table"),
        "dp.level": (cfg.dp.enabled and cfg.dp.level == "example", cfg.dp.level),
        "baseline_fedavg": (cfg.baseline_fedavg, cfg.baseline_fedavg),
    }
    for key, (on, value) in sync_only.items():
        _check(not on, key, value, "runs with synchronous rounds only (schedule.mode = 'sync')")
    v = cfg.vote
    f = v.f(s.buffer)
    try:
        for p in v.pre:
            options = v.pre_options.get(p, {})
            _check_rule(f"vote.pre[{p}]", p, f, s.buffer, options, "a buffer", "vote.pre_options")
        _check_rule("vote.rule", v.rule, f, s.buffer, v.options, "a buffer", "vote.options")
    except ConfigError as e:  # the vote runs on each buffer: a larger one is the other way out
        raise ConfigError(f"{e}; or raise schedule.buffer (the vote's n in async mode)") from None


def validate(cfg: Config) -> None:
    """Check every value of a config (ConfigError names the key and what is valid).

    Args:
      cfg: the config (its plug-ins are imported first, so their names are valid).

    Raises:
      ConfigError: the first invalid value.
    """
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
    _check_literal("", cfg, "on_failure")
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
    if t.public_fraction is not None:
        _check(0.0 <= t.public_fraction < 1.0, "task.public_fraction", t.public_fraction, "need [0, 1)")
    if t.general_pool is not None:
        _choices("task.general_pool", t.general_pool, ("public", "union"))
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
    _check_batch_size(cfg)
    _check(cfg.nodes.learning_rate > 0, "nodes.learning_rate", cfg.nodes.learning_rate, "need > 0")
    warm = cfg.nodes.public_warm_start
    _check(warm >= 0, "nodes.public_warm_start", warm, "need >= 0 steps (0: off)")
    _check(
        warm == 0 or cfg.nodes.lora is None,
        "nodes.public_warm_start",
        warm,
        "with [nodes.lora] the base is trained on the public pool by nodes.lora.pretrain_steps",
    )
    _check_sampling(cfg)
    for name, opts in cfg.nodes.options.items():
        _choices("nodes.options", name, node_registry.STRATEGIES.names())
        _check(isinstance(opts, Mapping), f"nodes.options.{name}", opts, "a table of the strategy's options")
    built = _registered("nodes.options", cfg.nodes.build_strategies)
    for s in {s.name: s for s in built}.values():
        settings = _registered(f"nodes.options.{s.name}", lambda s=s: s.settings(cfg.nodes.local_steps, 1.0))
        if getattr(settings, "tangent", False):  # the trainer's own refusals, named by the config key
            where = f"nodes.options.{s.name}"
            _check(cfg.nodes.lora is None, where, dict(cfg.nodes.options.get(s.name, {})),
                   "tangent nodes train the whole model; not with [nodes.lora]")  # fmt: skip
            _check(not (cfg.dp.enabled and cfg.dp.level == "example"), where,
                   dict(cfg.nodes.options.get(s.name, {})),
                   "tangent nodes do not combine with dp.level = 'example'")  # fmt: skip
    # byzantine
    byz = cfg.byzantine
    _choices("byzantine.attack", byz.attack, node_registry.ATTACKS.names())
    _registered(
        "byzantine.options",
        lambda: attacks.check_options(byz.attack, byz.options),
        _clear_hint("byzantine.options"),
    )
    if node_registry.ATTACKS[byz.attack].kind == "data":  # bound once per run: its options must hash
        _registered("byzantine.options", lambda: attacks.data_attack(byz.attack, byz.options))
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
    if w.objective in ("none", "off"):
        raise ConfigError(
            f"weights.objective = {w.objective!r} is not valid; choose one of {OBJECTIVES.names()} "
            "('vote': no weights, the vote's output is the merge)"
        )
    _choices("weights.objective", w.objective, OBJECTIVES.names())
    if w.max_weight is not None:
        _check(0.0 < w.max_weight <= 1.0, "weights.max_weight", w.max_weight, "need (0, 1]")
    _check(w.lambda_reg >= 0, "weights.lambda_reg", w.lambda_reg, "need >= 0")
    _check_literal("weights", w, "on_solver_failure")
    if w.max_examples is not None:
        _check(w.max_examples >= 1, "weights.max_examples", w.max_examples, "need >= 1 (or none: all)")
    # dp
    d = cfg.dp
    _check_literal("dp", d, "accountant")
    _check_literal("dp", d, "level")
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
    _check_lora(cfg)
    _check_schedule(cfg)
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


def _check_batch_size(cfg: Config) -> None:
    """``nodes.batch_size``: an integer >= 1, or "auto" where nothing reads the number before the fleet."""
    b = cfg.nodes.batch_size
    if b != "auto":
        _check(b >= 1, "nodes.batch_size", b, 'need >= 1 or "auto"')
        return
    clash = (
        "[nodes.lora]"
        if cfg.nodes.lora is not None
        else "dp.level = 'example'"
        if cfg.dp.enabled and cfg.dp.level == "example"
        else None
    )
    _check(
        clash is None,
        "nodes.batch_size",
        b,
        f"an integer: {clash} needs the batch size before the fleet is built",
    )
