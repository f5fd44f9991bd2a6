"""Hugging Face causal LMs (Llama, Mistral, SmolLM2, Qwen2, GPT-2) in flax.nnx, from and to HF folders.

::

    import strategies.models as models
    model, params = models.load("SmolLM2-135M")           # float32 params, a nested dict
    logits = jax.jit(model.apply)(params, tokens)          # (B, T) int -> (B, T, vocab)
    models.save("out", params, like="SmolLM2-135M")        # loads with AutoModelForCausalLM

The params' tree uses Hugging Face's module names (``model/layers/0/self_attn/q_proj/kernel``,
``transformer/h/0/attn/c_attn/kernel``), so a LoRA target named as PEFT names it is a path
component and :func:`hf_key` / :func:`tree_path` map tree paths to tensor names and back.
Every kernel is 2-D ``(in, out)``; every dimension has a logical axis name for the mesh rules.
"""

from strategies.models.config import SUPPORTED_TYPES, ModelConfig, ModelError, parse_config, read_config
from strategies.models.hf_io import TOKENIZER_FILES, load, save, tokenizer_files
from strategies.models.keys import (
    from_hf,
    hf_key,
    hf_module,
    hf_shape,
    path_string,
    to_hf,
    transposes,
    tree_path,
)
from strategies.models.model import CausalLM, floating_dtype, from_config

__all__ = [
    "SUPPORTED_TYPES",
    "TOKENIZER_FILES",
    "CausalLM",
    "ModelConfig",
    "ModelError",
    "floating_dtype",
    "from_config",
    "from_hf",
    "hf_key",
    "hf_module",
    "hf_shape",
    "load",
    "parse_config",
    "path_string",
    "read_config",
    "save",
    "to_hf",
    "tokenizer_files",
    "transposes",
    "tree_path",
]
