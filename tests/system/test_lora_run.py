"""LoRA runs of the system: the preset, config checks, rounds, bytes on the wire, resume, Flower.

* configs/lora.toml loads as documented and composes with --set; a target that matches nothing,
  a rank that is not low, FFA without the frozen a, and what a LoRA run does not combine with are
  refused in one line (exit 2 from the CLI, no file written);
* a LoRA run's nodes send and receive the adapter's bytes (plus the dense base delta of the
  methods that make one), far fewer than the model's; the parameter counts are logged;
* an interrupted LoRA run resumes bit for bit (the frozen base is checkpointed), and a failed
  round leaves the adapter and the base as they were;
* on Flower (the ServerApp's strategy and the ClientApp on :class:`InProcessGrid`), the arrays
  in the messages, counted by the grid itself, are the adapter's (and the base delta's), and the
  run ends where the in-process run ends.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import jax
import numpy as np
import pytest
from system_helpers import sets, snapshot

from meta_consensus import cli, config
from meta_consensus.config import ConfigError
from meta_consensus.coordinator import Coordinator
from meta_consensus.run import MetaConsensus

PRESET = Path(__file__).resolve().parents[2] / "configs" / "lora.toml"

# A LoRA run of the preset small enough for the tests (4 nodes, tiny text windows, 2 rounds).
TINY = [
    "rounds=2",
    "checkpoint_every=1",
    "keep_checkpoints=3",
    "task.options={context = 16, d_model = 32, d_mlp = 64, windows_per_node = 32, general_windows = 64, "
    "heldout_windows = 16, test_windows = 16}",
    "nodes.count=4",
    "nodes.strategies=['convexity', 'local', 'local', 'local']",
    "nodes.local_steps=3",
    "nodes.batch_size=4",
    "nodes.lora.pretrain_steps=3",
    "byzantine.nodes=[3]",
    "vote.num_byzantine=0",
    "vote.rule=mean",
]


def _cfg(tmp_path, *overrides):
    return config.load(PRESET, [*TINY, f"output_dir={tmp_path}", *overrides])


def test_lora_preset_loads_as_documented_and_composes_with_set():
    cfg = config.load(PRESET)
    lora = cfg.nodes.lora
    assert lora is not None and (lora.rank, lora.alpha, lora.freeze_a, lora.pretrain_steps) == (
        4,
        8.0,
        False,
        300,
    )
    assert cfg.task.name == "text" and cfg.nodes.count == 8 and cfg.byzantine.nodes == (6, 7)
    assert (cfg.vote.rule, cfg.vote.adapter_method, cfg.vote.adapter_space) == (
        "multi_krum",
        "fedit",
        "products",
    )
    ffa = config.load(PRESET, ["vote.adapter_method=ffa", "nodes.lora.freeze_a=true", "nodes.lora.rank=2"])
    assert ffa.nodes.lora is not None and ffa.nodes.lora.freeze_a and ffa.nodes.lora.rank == 2
    assert ffa.nodes.count == 8  # the rest of the preset stays
    off = config.load(PRESET, ["nodes.lora=none", "weights.objective=mixture_nll"])
    assert off.nodes.lora is None
    assert config.load(None).nodes.lora is None  # the default run is no LoRA run


@pytest.mark.parametrize(
    ("override", "message"),
    [
        (
            "nodes.lora.targets=['attn/query$', 'no_such_layer']",
            r"'no_such_layer' matches no kernel.*block_0/attn",
        ),
        ("nodes.lora.rank=64", r"rank 64 is not below min\(in, out\) = 64"),
        ("nodes.lora.rank=0", "rank must be an integer >= 1"),
        ("nodes.lora.dropout=1.0", r"dropout must be in \[0, 1\)"),
        ("vote.adapter_method=ffa", "FFA-LoRA is the method and the frozen a together"),
        (
            "vote.adapter_method=fedavg",
            r"vote.adapter_method = 'fedavg' is not valid; choose one of \['fedit'",
        ),
        ("vote.adapter_space=both", "vote.adapter_space"),
        ("dp.enabled=true", "dp.level = 'node' does not combine with nodes.lora"),
        (
            "weights.objective=mixture_nll",
            'weights.objective .* does not combine with nodes.lora.*use "uniform"',
        ),
    ],
)
def test_lora_config_mistakes_are_named(override, message):
    with pytest.raises(ConfigError, match=message):
        config.load(PRESET, [override, "dp.noise_multiplier=1.0"])


def test_cli_refuses_a_target_that_matches_nothing_in_one_line(tmp_path, capsys):
    before = snapshot(tmp_path)
    flags = sets(f"output_dir={tmp_path}", "nodes.lora.targets=['mlp/nothing']")
    rc = cli.main(["run", "--quiet", "--config", str(PRESET), *flags])
    err = capsys.readouterr().err
    assert rc == 2 and len(err.strip().splitlines()) == 1, err
    assert "'mlp/nothing' matches no kernel" in err and "block_0/attn/key" in err
    assert snapshot(tmp_path) == before


def _metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.slow
@pytest.mark.parametrize("method", ["fedit", "stack"])
def test_lora_run_sends_adapter_bytes_and_resumes_bit_for_bit(tmp_path, method):
    cfg = _cfg(tmp_path, f"vote.adapter_method={method}", "name=whole")
    whole = MetaConsensus(cfg, progress=False).train()
    assert whole.succeeded == 2
    state = whole.state
    frozen = state.frozen
    assert frozen is not None
    model = sum(math.prod(x.shape) for x in jax.tree.leaves(frozen["base"]))
    trainable = sum(math.prod(x.shape) for x in jax.tree.leaves(state.consensus))
    # 2 layers x (3 attention kernels 32 x 32 and the MLP's 32 x 64, 64 x 32) at rank 4.
    assert trainable == 2 * (3 * 4 * (32 + 32) + 2 * 4 * (32 + 64))
    assert set(state.consensus) == {
        f"block_{i}/{k}" for i in (0, 1) for k in ("attn/query", "attn/key", "attn/value", "mlp/wi", "mlp/wo")
    }
    delta = 4 * 2 * (3 * 32 * 32 + 2 * 32 * 64)  # the dense (in, out) update of every target
    for row in _metrics(cfg.run_dir):
        assert row["trainable_params"] == trainable and row["model_params"] == model
        assert row["bytes_up"] == 4 * trainable < 4 * model / 5
        assert row["bytes_down"] == 4 * trainable + (delta if method == "stack" else 0)
        assert row["adapter"]["method"] == method
        assert row["adapter"]["exactness"] == ("exact" if method == "stack" else "approximate")
    # The base moves only with the methods that fold a delta into it.
    first = Coordinator(cfg).init(cfg.seed)
    moved = any(
        not np.array_equal(a, b)
        for a, b in zip(jax.tree.leaves(first.frozen["base"]), jax.tree.leaves(frozen["base"]), strict=True)
    )
    assert moved == (method == "stack")
    # Interrupted after round 1 and resumed: the same adapter and base, bit for bit.
    part = _cfg(tmp_path, f"vote.adapter_method={method}", "name=parts")
    MetaConsensus(part, progress=False).train(max_rounds=1)
    resumed = MetaConsensus(part, progress=False).train(resume=True)
    for a, b in zip(
        jax.tree.leaves((state.consensus, frozen)),
        jax.tree.leaves((resumed.state.consensus, resumed.state.frozen)),
        strict=True,
    ):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.slow
def test_a_failed_lora_round_keeps_the_adapter_and_the_base(tmp_path):
    cfg = _cfg(tmp_path, "min_answers=1.0", "faults.crash_nodes=[0]", "baseline_fedavg=false")
    co = Coordinator(cfg)
    state = co.init(cfg.seed)
    new, info = co.round(state)
    assert not info.ok and "too few valid answers" in info.reason
    assert new.consensus is state.consensus and new.frozen is state.frozen


def _adapter_bytes(tree) -> int:
    return sum(np.asarray(x).nbytes for x in jax.tree.leaves(tree))


@pytest.mark.slow
@pytest.mark.parametrize("method", ["fedit", "stack"])
def test_flower_carries_the_adapters_only(tmp_path, method):
    from flwr.app import ArrayRecord

    from meta_consensus.flower import ConsensusStrategy, InProcessGrid, make_client_app
    from meta_consensus.flower.apps import run_strategy

    class Counting(InProcessGrid):
        """Counts the bytes of every array the messages carry, decoded (the grid's own count)."""

        def __init__(self, *a, **k):
            super().__init__(*a, **k)
            self.down: list[tuple[str, int]] = []
            self.up: list[int] = []

        def _answer(self, msg):
            if msg.metadata.message_type == "train":
                n = sum(
                    arr.numpy().nbytes
                    for rec in msg.content.values()
                    if isinstance(rec, ArrayRecord)
                    for arr in rec.values()
                )
                self.down.append((msg.metadata.group_id, n))
            reply = super()._answer(msg)
            if reply is not None and msg.metadata.message_type == "train" and not reply.has_error():
                self.up.append(sum(arr.numpy().nbytes for arr in reply.content["arrays"].values()))
            return reply

    cfg = _cfg(tmp_path, f"vote.adapter_method={method}", "byzantine.nodes=[]", "rounds=3", "name=flower")
    strategy = ConsensusStrategy(cfg, evaluate=False, wait_for_nodes_s=0)
    grid = Counting(make_client_app(), cfg.nodes.count)
    run_strategy(strategy, grid, timeout=900)
    assert [h.ok for h in strategy.history] == [True, True, True], strategy.history
    adapter = _adapter_bytes(strategy.consensus)
    model = _adapter_bytes(strategy.frozen["base"])
    delta = 4 * 2 * (3 * 32 * 32 + 2 * 32 * 64)
    assert grid.up and all(n == adapter for n in grid.up)
    for group, n in grid.down:
        with_delta = method == "stack" and group != "1"  # a delta follows each stack merge
        assert n == adapter + (delta if with_delta else 0), (group, n)
    assert adapter < model / 5
    assert all(h.bytes_up == adapter for h in strategy.history)
    # The same rounds in process: the same adapter up to float32 rounding (one node's unbatched
    # step against the fleet's vmapped one, compounded over three rounds of Adam; see test_flower).
    local = MetaConsensus(cfg.replace(name="in_process", baseline_fedavg=False), progress=False).train()
    for a, b in zip(
        jax.tree.leaves(local.consensus_params), jax.tree.leaves(strategy.consensus), strict=True
    ):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-3, atol=1e-4)
