"""``nodes.public_warm_start``: the coordinator trains the initial consensus on the public pool.

With 0 the initial consensus is the task's init; with k steps it is that init after k Adam steps
on the public (general) pool at the nodes' batch size and learning rate, the same on every call
(the run's key), lower in the pool's loss than the init, and the same in process as on Flower's
server; bad settings are one-line config errors.
"""

from __future__ import annotations

import jax
import numpy as np
import optax
import pytest
from system_helpers import SMALL

from meta_consensus import config
from meta_consensus.coordinator import Coordinator
from strategies.tasks.base import NodeData
from strategies.trainer import NodeTrainer

BASE = [*SMALL, "rounds=1", "nodes.count=4", "nodes.strategies=local", "byzantine.nodes=[]",
        "vote.rule=mean", "vote.num_byzantine=0", "weights.objective=uniform", "dp.enabled=false",
        "baseline_fedavg=false", "nodes.batch_size=16"]  # fmt: skip
STEPS = 25


def _start(tmp_path, steps: int):
    cfg = config.load(None, [*BASE, f"output_dir={tmp_path}", f"nodes.public_warm_start={steps}"])
    co = Coordinator(cfg)
    return co, co.init(cfg.seed).consensus


def _pool_loss(co, params) -> float:
    general = co.fleet.data.general
    return float(co.fleet.task.loss(params, {k: np.asarray(v) for k, v in general.items()}))


def _bits(tree) -> list[bytes]:
    return [np.asarray(x).tobytes() for x in jax.tree.leaves(tree)]


def test_the_warm_start_is_adam_on_the_public_pool_from_the_tasks_init(tmp_path):
    co, cold = _start(tmp_path, 0)
    k_params, _ = jax.random.split(jax.random.key(co.cfg.seed))
    init = co.fleet.task.init(k_params)
    assert _bits(cold) == _bits(init)  # 0: off

    co, warm = _start(tmp_path, STEPS)
    assert _bits(warm) == _bits(_start(tmp_path, STEPS)[1])  # the run's key: the same start
    # the reference: one node's Adam on the pool alone (trainer built here, not the fleet's cache)
    general = co.fleet.data.everything()
    one = NodeData(general.pool, general.index[:1], general.count[:1], True, "general")
    trainer = NodeTrainer(
        co.fleet.task, optax.adam, {"learning_rate": co.cfg.nodes.learning_rate}, batch_size=16
    )
    state = trainer.init(jax.random.fold_in(k_params, 0xBA5E), init, 1)
    state, _ = trainer.fit(state, one, STEPS)
    ref = jax.tree.map(lambda x: x[0], state.params)
    for a, b in zip(jax.tree.leaves(warm), jax.tree.leaves(ref), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=1e-6)
    assert _pool_loss(co, warm) < 0.8 * _pool_loss(co, init)


def test_the_flower_server_starts_from_the_same_consensus(tmp_path):
    pytest.importorskip("flwr")
    from meta_consensus.flower.strategy import ConsensusStrategy

    cfg = config.load(None, [*BASE, f"output_dir={tmp_path}", f"nodes.public_warm_start={STEPS}"])
    _, warm = _start(tmp_path, STEPS)
    strategy = ConsensusStrategy(cfg)
    for a, b in zip(jax.tree.leaves(strategy.consensus), jax.tree.leaves(warm), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("nodes.public_warm_start=-1", "need >= 0 steps"),
        ("nodes.lora={rank = 2}", "nodes.lora.pretrain_steps"),
    ],
)
def test_bad_warm_starts_are_config_errors(tmp_path, override, message):
    extra = ["nodes.public_warm_start=5"] if "lora" in override else []
    with pytest.raises(config.ConfigError, match=message):
        config.load(None, [*BASE, f"output_dir={tmp_path}", *extra, override])


def test_the_defaults_warm_start_gives_way_to_lora_pretraining_with_a_note(tmp_path):
    lora = ["nodes.lora={rank = 2, alpha = 4.0, targets = ['dense_0']}", "vote.server_step=0"]
    assert config.load(None).nodes.public_warm_start > 0  # the embedded default warm-starts
    cfg, notes = config.load_with_notes(None, [*BASE, f"output_dir={tmp_path}", *lora])
    assert cfg.nodes.public_warm_start == 0 and cfg.nodes.lora is not None
    assert any("dropped the default's nodes.public_warm_start = " in n for n in notes), notes
    with pytest.raises(config.ConfigError, match="nodes.lora.pretrain_steps"):  # the user's own: refused
        config.load(None, [*BASE, f"output_dir={tmp_path}", *lora, "nodes.public_warm_start=600"])


def test_a_pretrained_tasks_checkpoint_is_used_as_is(caplog):
    from meta_consensus.warm_start import public_warm_start

    class Pretrained:  # nothing but the flag: the data is never read
        name, pretrained = "checkpoint", True

    params = {"w": np.arange(3.0)}
    with caplog.at_level("WARNING"):
        out = public_warm_start(Pretrained(), None, params, jax.random.key(0), steps=600,
                                learning_rate=1e-3, batch_size=8)  # fmt: skip
    assert out is params
    note = "'checkpoint' starts from a pretrained model; nodes.public_warm_start = 600 is not applied"
    assert note in caplog.text


def test_every_default_a_lora_run_refuses_gives_way_and_the_users_own_is_refused():
    lora = "nodes.lora={rank = 2, alpha = 4.0, targets = ['dense_0']}"
    cfg, notes = config.load_with_notes(None, [lora])
    default = config.load(None)
    assert default.vote.server_step > 0 and default.weights.objective != "uniform"
    assert (cfg.nodes.public_warm_start, cfg.vote.server_step, cfg.weights.objective) == (0, 0.0, "uniform")
    for key in ("nodes.public_warm_start", "vote.server_step", "weights.objective"):
        assert sum(f"dropped the default's {key} = " in n for n in notes) == 1, (key, notes)
    # everything else is the default's
    assert cfg.vote.rule == default.vote.rule and cfg.nodes.count == default.nodes.count
    with pytest.raises(config.ConfigError, match="vote.server_step = 0.25 does not combine with nodes.lora"):
        config.load(None, [lora, "vote.server_step=0.25"])
    with pytest.raises(config.ConfigError, match="weights.objective = 'vote' does not combine"):
        config.load(None, [lora, "weights.objective=vote"])
