"""node_step benchmark: the FLOP count, the collective parser, the page, and a tiny run end to end."""

from __future__ import annotations

import json

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
