"""The system reads capabilities from declarations, never from a rule's or objective's name."""

from __future__ import annotations

import pytest

from consensus import aggregators
from consensus.registry import RULES
from meta_consensus import config


def _cfg(*overrides: str) -> config.Config:
    return config.load(None, ["baseline_fedavg=false", *overrides])


@pytest.mark.parametrize(
    ("overrides", "plain"),
    [
        (["vote.rule=mean", "weights.objective=vote"], True),
        (["vote.rule=mean", "weights.objective=uniform"], True),
        (["vote.rule=mean", "weights.objective=mixture_nll"], False),
        (["vote.rule=median", "weights.objective=vote"], False),
        (["vote.rule=mean", "weights.objective=vote", "vote.pre=['clip']"], False),
    ],
)
def test_plain_dp_fedavg_is_read_from_the_declared_traits(overrides, plain):
    assert config.plain_fedavg(_cfg("byzantine.nodes=[]", *overrides)) is plain


def test_a_rule_declared_as_a_uniform_mean_gets_the_c_over_n_sensitivity_under_another_name():
    declared = RULES.declare("uniform_mean_alias", kind="coordinatewise", traits={"uniform_mean": True})
    declared(lambda: aggregators.mean())
    try:
        cfg = _cfg("byzantine.nodes=[]", "vote.rule=uniform_mean_alias", "weights.objective=vote")
        assert config.plain_fedavg(cfg)
    finally:
        RULES.unregister("uniform_mean_alias")
