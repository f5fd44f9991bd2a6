"""The LoRA benchmark (``python -m benchmarks lora --quick``) runs and its numbers hold real properties.

* the exact methods (stack, FedEx-LoRA's residual, FFA-LoRA) move the model by the mean of the
  nodes' updates (measured deviation ~ float32 rounding), FedIT and truncated SVD do not;
* stack and exact_residual give the same consensus update from the same adapters;
* bytes per round: the adapter's, the model's for full fine-tuning, their ratio the parameter
  ratio (2 r (in + out) per target against in x out), FFA-LoRA half of it; the methods that fold
  into the base also send the dense delta;
* memory per node: the LoRA node's trained state is the adapter's, a fraction of full
  fine-tuning's;
* DP-SGD reaches its target epsilon (8) and not beyond; every perplexity is finite.
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import jax
import numpy as np
import pytest

_ROOT = str(Path(__file__).resolve().parents[2])
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)

from benchmarks.quality import lora as bench  # noqa: E402
from strategies.lora import LoraSettings, LoraTask, merge_round  # noqa: E402


@pytest.mark.slow
def test_lora_benchmark_quick_runs_and_its_numbers_hold(tmp_path):
    payload = bench.main(["--quick", "--out", str(tmp_path)])
    saved = json.loads((tmp_path / "lora_quick.json").read_text())
    assert (tmp_path / "lora_quick.md").read_text().count("| fedit |") == 1
    s = saved["summary"]
    assert payload["winner_clean"] in bench.METHODS
    for name, row in s.items():
        assert math.isfinite(row["perplexity_mean"]) and row["perplexity_mean"] > 1.0, name
    for exact in ("stack", "exact_residual", "ffa"):
        assert s[exact]["exactness"] == "exact" and s[exact]["deviation"] < 1e-5, exact
    for approx in ("fedit", "svd"):
        assert s[approx]["exactness"] == "approximate" and s[approx]["deviation"] > 1e-3, approx
    sizes = saved["sizes"]["lora"]
    model, adapter = sizes["model_bytes"], sizes["adapter_bytes"]
    # rank 4 of 2 layers x (3 attention kernels 64 x 64, MLP 64 x 256 and 256 x 64), float32
    assert adapter == 4 * 2 * (3 * 4 * (64 + 64) + 2 * 4 * (64 + 256))
    assert s["fedit"]["bytes_up"] == s["fedit"]["bytes_down"] == adapter
    assert s["full fine-tuning, FedAvg"]["bytes_up"] == model
    assert s["ffa"]["bytes_up"] * 2 == adapter
    delta = 4 * 2 * (3 * 64 * 64 + 2 * 64 * 256)
    for folded in ("stack", "exact_residual"):
        assert s[folded]["bytes_down"] == adapter + delta
    mem = saved["memory"]
    assert mem["lora"]["trained"] == 4 * adapter and mem["full"]["trained"] == 4 * model
    assert mem["lora"]["total"] < mem["full"]["total"] / 2
    for dp in ("fedit, DP-SGD", "ffa, DP-SGD"):
        assert 7.0 < s[dp]["epsilon"] <= 8.0 + 1e-6


@pytest.mark.slow
def test_stack_and_exact_residual_give_the_same_consensus_update():
    task = bench.make_task(bench.QUICK)
    base = jax.eval_shape(task.init, jax.random.key(0))
    base = jax.tree.map(lambda x: np.zeros(x.shape, x.dtype), base)
    lt = LoraTask(task, LoraSettings(rank=2, alpha=4.0), base, jax.random.key(1))
    frozen = lt.initial_frozen(base)
    rng = np.random.default_rng(0)
    stacked = {
        p: {
            "a": rng.normal(size=(5, shape[0], 2)).astype(np.float32),
            "b": rng.normal(size=(5, 2, math.prod(shape[1:]))).astype(np.float32),
        }
        for p, shape in lt.targets.items()
    }
    updates = []
    for method in ("stack", "exact_residual"):
        out = merge_round(lt, frozen, stacked, method=method, key=jax.random.key(0))
        full = lt.full_adapter(out.params, out.frozen)
        update = {}
        for p, shape in lt.targets.items():
            delta = np.asarray(out.base_delta[p], np.float64).reshape(shape[0], -1)
            f = full[p]
            update[p] = delta + lt.scale * np.asarray(f["a"], np.float64) @ np.asarray(f["b"], np.float64)
        updates.append(update)
    for p in lt.targets:
        want = lt.scale * np.einsum("nir,nro->io", stacked[p]["a"].astype(np.float64), stacked[p]["b"]) / 5
        np.testing.assert_allclose(updates[0][p], want, rtol=1e-4, atol=1e-4)
        np.testing.assert_allclose(updates[0][p], updates[1][p], rtol=1e-4, atol=1e-4)
