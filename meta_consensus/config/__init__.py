"""The run configuration: nested frozen dataclasses, loaded from TOML, checked before anything runs.

Three modules, one job each: :mod:`~meta_consensus.config.schema` (the dataclasses and
their defaults), :mod:`~meta_consensus.config.codec` (TOML text and nested dicts to a
config and back, ``--set`` overrides) and :mod:`~meta_consensus.config.validation` (every
check, plug-ins imported first); this package re-exports their names.

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
their entries are valid too. A rule's precondition on (n, f) is checked when the
config is built, before any training. ``--set section.key=value`` overrides
(:func:`apply_overrides`) parse ``value`` as a TOML value (``3``, ``0.5``,
``"alie"``, ``[6, 7]``, ``true``); a bare word is taken as a string. A whole options table is
replaced with ``--set 'byzantine.options={scale = 3.0}'`` (``{}``: none). Changing an option's
owner (``byzantine.attack``, ``vote.rule``, ``vote.top_rule``) drops the options of the default
or preset that the new choice does not take, with a note; options the user gave are checked.
The presets shipped with the package (:func:`preset_names`) load with ``load(preset=NAME)``.
"""

from __future__ import annotations

from meta_consensus.config.codec import (
    DEFAULT_FILE,
    OWNED_OPTIONS,
    apply_overrides,
    default_text,
    dumps,
    from_dict,
    load,
    load_with_notes,
    preset_names,
    preset_text,
    to_dict,
    with_plugins,
)
from meta_consensus.config.errors import ConfigError
from meta_consensus.config.schema import (
    ByzantineConfig,
    Config,
    DPConfig,
    FaultsConfig,
    MeshSettings,
    NodesConfig,
    ScheduleConfig,
    TaskConfig,
    VoteConfig,
    WeightsConfig,
    plain_fedavg,
)
from meta_consensus.config.validation import SYSTEM_PROVIDES, load_config_plugins, validate

__all__ = [
    "DEFAULT_FILE",
    "OWNED_OPTIONS",
    "SYSTEM_PROVIDES",
    "ByzantineConfig",
    "Config",
    "ConfigError",
    "DPConfig",
    "FaultsConfig",
    "MeshSettings",
    "NodesConfig",
    "ScheduleConfig",
    "TaskConfig",
    "VoteConfig",
    "WeightsConfig",
    "apply_overrides",
    "default_text",
    "dumps",
    "from_dict",
    "load",
    "load_config_plugins",
    "load_with_notes",
    "plain_fedavg",
    "preset_names",
    "preset_text",
    "to_dict",
    "validate",
    "with_plugins",
]
