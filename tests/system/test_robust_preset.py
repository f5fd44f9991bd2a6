"""configs/robust.toml: the robust preset loads, is what its header says, and composes with --set."""

from __future__ import annotations

from pathlib import Path

import pytest

from consensus import registry
from meta_consensus import config
from meta_consensus.config import ConfigError
from meta_consensus.server import root_rows
from strategies.tasks.digits import DigitsTask
from strategies.tasks.fashion_mnist import FashionMNISTTask

PRESET = Path(__file__).resolve().parents[2] / "configs" / "robust.toml"


def test_robust_preset_loads_as_documented():
    cfg = config.load(PRESET)
    assert cfg.nodes.count == 16 and cfg.task.alpha == 0.3
    assert cfg.byzantine.nodes == (12, 13, 14, 15)
    assert cfg.vote.rule == "dnc" and cfg.vote.pre == () and cfg.vote.f(cfg.nodes.count) == 4
    assert cfg.weights.objective == "quadratic" and cfg.weights.max_weight is None
    assert cfg.weights.lambda_reg == 0.1 and cfg.baseline_fedavg
    assert cfg.vote.server_step == 0.25 and cfg.vote.root_size == 0.556  # a share of the held-out rows
    # ...which keeps the 100 root rows of the digits selection and scales on Fashion-MNIST (5,000 held out).
    digits_heldout = len(DigitsTask().splits(16, seed=0, alpha=0.3).heldout["y"])
    assert root_rows(cfg.vote.root_size, digits_heldout) == 100
    assert root_rows(cfg.vote.root_size, FashionMNISTTask().heldout_size) == 2780
    assert cfg.weights.max_examples == 500
    # Every rule of the vote holds at n = 16, f = 4 (the registry's static preconditions).
    for name in (*cfg.vote.pre, cfg.vote.rule):
        spec = registry.RULES[name]
        assert spec.requirement(16, 4 if spec.takes_f else 0) is None


def test_robust_preset_composes_with_set():
    cfg = config.load(PRESET, ["byzantine.attack=min_max", "rounds=3", "vote.num_byzantine=3"])
    assert cfg.byzantine.attack == "min_max" and cfg.rounds == 3 and cfg.vote.f(16) == 3
    assert cfg.vote.rule == "dnc" and cfg.nodes.count == 16  # the rest of the preset stays
    # Overrides that do not fit the preset are refused with the reason: options the rule does not
    # take, and Bulyan's n >= 4f + 3 at f = 4 of 16.
    with pytest.raises(ConfigError, match=r"dnc takes no parameter\(s\) \['clip_radius'\]; valid parameters"):
        config.load(PRESET, ["vote.options={clip_radius = 0.5}"])
    with pytest.raises(ConfigError, match="vote.rule = 'bulyan' cannot run .* n >= 4f \\+ 3"):
        config.load(PRESET, ["vote.rule=bulyan", "vote.num_byzantine=4"])
