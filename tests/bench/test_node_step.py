"""node_step benchmark: the FLOP count, the collective parser, the page, and a tiny run end to end."""

from __future__ import annotations

import json

import jax
import pytest

from benchmarks.speed import node_step
from strategies.models import from_config


def test_flops_per_token_is_six_n_plus_attention():
    lm = from_config(node_step.SMOLLM2)
    n = lm.num_params()
    assert n == 134_515_008  # SmolLM2-135M's count (tied head)
    t = 512
    expected = 6 * n + 12 * 30 * 9 * 64 * t
    assert node_step.flops_per_token(lm.config, n, t) == expected


def test_collective_bytes_reads_the_output_shapes():
    hlo = (
        "  %all-gather.1 = f32[8,576]{1,0} all-gather(f32[1,576]{1,0} %p), dimensions={0}\n"
        "  %rs = bf16[4,3]{1,0} reduce-scatter(bf16[32,3]{1,0} %x), dimensions={0}\n"
        "  %ar = (f32[10]{0}, f32[2,2]{1,0}) all-reduce(f32[10]{0} %a, f32[2,2]{1,0} %b)\n"
        "  %ags = f32[16]{0} all-gather-start(f32[2]{0} %c)\n"
    )
    got = node_step.collective_bytes(hlo)
    assert got == {"all-gather": 8 * 576 * 4 + 16 * 4, "reduce-scatter": 4 * 3 * 2, "all-reduce": 14 * 4}


def test_datasheet_peaks_are_dense_bf16():
    assert node_step.datasheet_peak("NVIDIA H200", "bfloat16") == 989e12
    assert node_step.datasheet_peak("NVIDIA H100 80GB HBM3", "bfloat16") == 989e12
    assert node_step.datasheet_peak("cpu", "bfloat16") is None


@pytest.mark.slow
def test_tiny_quick_run_writes_the_page(tmp_path):
    res = node_step.main(["--quick", "--tiny", "--out", str(tmp_path), "--note", "test"])
    saved = json.loads((tmp_path / "node_step_quick.json").read_text())
    assert {r["mode"] for r in saved["rows"]} == {"full", "lora"}
    page = (tmp_path / "node_step_quick.md").read_text()
    assert "| smollm2-135m | full | float32 |" in page and "MFU" in page
    for r in res["rows"]:
        assert r["compiled_bytes"] > 0 and r["tokens_per_s"] > 0
        assert r["trained_params"] <= r["params"]
    lora = next(r for r in res["rows"] if r["mode"] == "lora")
    # Rank 8 on every projection of the tiny Llama (width 64, 2 KV heads of 16, MLP 128, 2 layers):
    # r x (in + out) per matrix, the base frozen.
    hidden, kv, mlp, r = 64, 2 * 16, 128, 8
    per_layer = r * (2 * (hidden + hidden) + 2 * (hidden + kv) + 3 * (hidden + mlp))
    assert lora["trained_params"] == 2 * per_layer < lora["params"]


@pytest.mark.parametrize("model", ["smollm2-135m", "gpt2-124m"])
def test_the_step_matmuls_carry_the_model_flops(model):
    """The matmul list that bounds the step: its FLOPs are the model FLOPs less the norms' parameters.

    6 N counts every parameter's three products (forward, dX, dW) and 12 L H Q T attention's, so the
    listed matmuls' FLOPs equal flops_per_token x tokens once the parameters no matmul uses
    (norms' scales and biases, GPT-2's position table and linear biases) are taken out of N.
    """
    import numpy as np

    lm = from_config(node_step.MODELS[model])
    c = lm.config
    batch, t = 2, 512
    mats = node_step.step_matmuls(c, batch, t)
    got = sum(2.0 * count * m * k * n for _, count, m, k, n in mats)
    shapes = jax.eval_shape(lm.init, jax.random.key(0))
    in_matmuls = sum(
        int(np.prod(x.shape))
        for path, x in jax.tree_util.tree_leaves_with_path(shapes)
        if x.ndim == 2 and "wpe" not in jax.tree_util.keystr(path)  # GPT-2's position table: a lookup
    )
    expected = (6.0 * in_matmuls + 12.0 * c.num_layers * c.num_heads * c.head_dim * t) * batch * t
    assert got == pytest.approx(expected, rel=1e-12)
    # And the whole model's count differs from it only by those few parameters.
    full = node_step.flops_per_token(c, lm.num_params(), t) * batch * t
    assert 0.97 < got / full <= 1.0


def test_replaying_collectives_times_each_kind_on_the_devices():
    devices = jax.devices()[:2]
    assert node_step.replay_collectives({"all-reduce": 4096}, devices[:1], repeats=1) == 0.0
    t = node_step.replay_collectives(
        {"all-gather": 8192, "all-reduce": 4096, "reduce-scatter": 2048, "all-to-all": 64}, devices, repeats=1
    )
    assert 0.0 < t < 10.0


@pytest.mark.slow  # two compiled tiny steps on simulated devices: ~20 s
def test_the_mesh_child_shards_params_and_counts_collectives():
    rows = node_step.mesh_child(
        node_step.tiny(node_step.SMOLLM2), [["fsdp", 1], ["fsdp", 2], ["tp", 2]], 4, 16
    )
    one, fsdp, tp = rows
    assert one["collectives"] == {} and one["collective_s"] == 0.0
    # FSDP over 2 devices: each holds about half of the params and Adam's moments (norm scales replicated).
    whole = one["param_bytes"] + one["opt_bytes"]
    assert 0.5 <= (fsdp["param_bytes"] + fsdp["opt_bytes"]) / whole < 0.6
    assert fsdp["collectives"] and all(r["step_s"] > 0 for r in rows)
    assert (tp["param_bytes"] + tp["opt_bytes"]) / whole < 0.6 and tp["layout"] == "tp"
