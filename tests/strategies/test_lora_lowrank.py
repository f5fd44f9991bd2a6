"""LoRA beside the frozen kernels (LowRankKernel): the same model and gradients as merging, and no
gradient of the frozen kernels in the compiled step.

References: the merged kernel W + s a b (merge_adapter) in float64 for the model and for the
adapter gradients (dL/da = s G b^T, dL/db = s a^T G with G = dL/dW of the merged model), and
the compiled gradient's HLO, which must hold no matmul with a frozen kernel's (in, out) shape.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from strategies.lora import LoraSettings, LoraTask, low_rank_params, merge_adapter, path_name
from strategies.models import from_config
from strategies.models.layers import LowRankKernel

TINY = {
    "model_type": "llama", "vocab_size": 96, "hidden_size": 48, "intermediate_size": 80,
    "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 12,
    "hidden_act": "silu", "rms_norm_eps": 1e-5, "max_position_embeddings": 64, "tie_word_embeddings": True,
}  # fmt: skip
TARGETS = ("q_proj", "v_proj", "up_proj", "down_proj")


class TinyLM:
    """Next-token cross entropy of the tiny Llama (low_rank_kernels as CausalLMTask declares)."""

    low_rank_kernels: ClassVar[bool] = True
    name = "tiny_lm"

    def __init__(self) -> None:
        self.lm = from_config(TINY)

    def init(self, key: Any) -> Any:
        return self.lm.init(key)

    def apply(self, params: Any, inputs: Any, *, train: bool = False, key: Any = None) -> Any:
        return self.lm.apply(params, inputs)

    def loss(self, params: Any, batch: Mapping[str, Any], key: Any = None) -> Any:
        logp = jax.nn.log_softmax(self.lm.apply(params, batch["x"]).astype(jnp.float32), axis=-1)
        return -jnp.mean(jnp.take_along_axis(logp, batch["y"][..., None], axis=-1))


class MergingLM(TinyLM):
    low_rank_kernels: ClassVar[bool] = False


def _setup(base_task: Any):
    base = base_task.init(jax.random.key(0))
    task = LoraTask(base_task, LoraSettings(rank=4, alpha=8.0, targets=TARGETS), base, jax.random.key(1))
    adapter = task.init(jax.random.key(2))
    # b = 0 at init: draw it so the adapter changes the model.
    adapter = {p: {"a": v["a"], "b": 0.1 * jax.random.normal(jax.random.key(3), v["b"].shape)}
               for p, v in adapter.items()}  # fmt: skip
    toks = jax.random.randint(jax.random.key(4), (2, 9), 0, TINY["vocab_size"])
    return task, base, adapter, {"x": toks[:, :-1], "y": toks[:, 1:]}


def test_low_rank_kernels_wrap_the_targets_and_equal_the_merged_model():
    task, base, adapter, batch = _setup(TinyLM())
    wrapped = low_rank_params(base, adapter, task.scale)
    merged = merge_adapter(base, adapter, task.scale)
    kinds = jax.tree_util.tree_leaves_with_path(wrapped, is_leaf=lambda x: isinstance(x, LowRankKernel))
    low = {path_name(p) for p, x in kinds if isinstance(x, LowRankKernel)}
    assert low == set(adapter) and len(low) == 4 * TINY["num_hidden_layers"]
    for p, x in kinds:
        if isinstance(x, LowRankKernel):
            np.testing.assert_allclose(x.dense(), _find(merged, path_name(p)), rtol=1e-6, atol=1e-7)
    lm = task.base_task.lm
    np.testing.assert_allclose(
        lm.apply(wrapped, batch["x"]), lm.apply(merged, batch["x"]), rtol=1e-5, atol=1e-5
    )


def test_the_adapter_gradient_is_the_chain_rule_of_the_merged_models():
    """dL/da = s G b^T and dL/db = s a^T G, G = dL/dW of the merged model (float64 products)."""
    task, base, adapter, batch = _setup(TinyLM())
    got = jax.grad(lambda ad: task.loss(ad, batch))(adapter)
    merged = merge_adapter(base, adapter, task.scale)
    g_merged = jax.grad(lambda p: task.base_task.loss(p, batch))(merged)
    for path, v in adapter.items():
        g = np.asarray(_find(g_merged, path), np.float64)
        a, b = np.asarray(v["a"], np.float64), np.asarray(v["b"], np.float64)
        np.testing.assert_allclose(got[path]["a"], task.scale * g @ b.T, rtol=2e-4, atol=1e-6)
        np.testing.assert_allclose(got[path]["b"], task.scale * a.T @ g, rtol=2e-4, atol=1e-6)
    # And the merging path (a task that does not take LowRankKernels) gives the same gradient.
    task_m, _, _, _ = _setup(MergingLM())
    ref = jax.grad(lambda ad: task_m.loss(ad, batch))(adapter)
    for path in adapter:
        for k in ("a", "b"):
            np.testing.assert_allclose(got[path][k], ref[path][k], rtol=2e-4, atol=1e-6)


def _find(tree: Any, name: str) -> Any:
    for p, x in jax.tree_util.tree_leaves_with_path(tree):
        if path_name(p) == name:
            return x
    raise KeyError(name)


_DOT = re.compile(r"=\s*f32\[([0-9,]+)\]\{[^}]*\}\s+dot\(")


@pytest.mark.parametrize("base_task", [TinyLM, MergingLM], ids=["beside", "merged"])
def test_the_compiled_lora_gradient_has_no_frozen_kernel_gradient(base_task):
    """The gradient of a LoRA step: no dot whose output is a target kernel's (in, out) shape.

    Merging W + s a b first makes autodiff form dL/dW (an (in, out) dot) and project it; beside
    the kernel the step never forms it. The merged variant is checked to have them, so the
    pattern finds what it looks for.
    """
    task, base, adapter, batch = _setup(base_task())
    hlo = (
        jax.jit(jax.grad(lambda ad, fr: task.loss(ad, batch, frozen=fr)))
        .lower(adapter, task.initial_frozen())
        .compile()
        .as_text()
    )
    kernel_shapes = {tuple(_find(base, p).shape) for p in adapter}
    dots = {tuple(int(d) for d in m.split(",")) for m in _DOT.findall(hlo)}
    hits = kernel_shapes & dots
    if base_task is TinyLM:
        assert not hits, f"dense kernel gradients in the LoRA step: {sorted(hits)}"
    else:
        assert hits, "the merged step's (in, out) dots were not found: the HLO pattern is stale"
