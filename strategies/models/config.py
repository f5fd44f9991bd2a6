"""Hugging Face ``config.json`` -> :class:`ModelConfig`, one frozen record for every supported family.

Both spellings of the rotary settings are read: transformers 4's top-level ``rope_theta`` and
``rope_scaling`` (``{"type" | "rope_type": ..., "factor": ...}``), and transformers 5's
``rope_parameters`` (``{"rope_type": ..., "rope_theta": ..., ...}``). GPT-2's own names
(``n_embd``, ``n_layer``, ``n_head``, ``n_inner``, ``n_positions``) are read as the common fields.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

SUPPORTED_TYPES = ("llama", "mistral", "qwen2", "gpt2")
LLAMA_LIKE = ("llama", "mistral", "qwen2")
ROPE_TYPES = ("default", "linear", "llama3")
# hidden_act / activation_function -> the activation's name in strategies.models.layers.
ACTIVATIONS = {
    "silu": "silu",
    "swish": "silu",
    "gelu": "gelu",
    "gelu_new": "gelu_tanh",
    "gelu_pytorch_tanh": "gelu_tanh",
    "gelu_fast": "gelu_tanh",
    "relu": "relu",
}


class ModelError(ValueError):
    """A model folder, config or parameter tree that cannot be used (the message names the problem)."""


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """The architecture of one causal LM, read from a Hugging Face ``config.json``.

    Attributes:
      family: the ``model_type`` (one of :data:`SUPPORTED_TYPES`).
      vocab_size: tokens in the vocabulary.
      hidden_size: the residual width.
      num_layers: transformer blocks.
      num_heads: query heads.
      num_kv_heads: key/value heads (grouped-query attention when fewer than ``num_heads``).
      head_dim: width of one head.
      intermediate_size: the MLP's hidden width.
      max_position_embeddings: the longest sequence (GPT-2: the learned positions).
      norm_eps: epsilon of the RMSNorm / LayerNorm.
      tie_word_embeddings: the output head is the token embedding (no ``lm_head`` parameter).
      activation: the MLP activation ("silu", "gelu", "gelu_tanh" or "relu").
      rope_theta: the rotary base (llama-like families).
      rope_type: "default", "linear" or "llama3".
      rope_scaling: the scaling parameters as sorted (name, value) pairs (empty for "default").
      attention_bias: q/k/v projections have biases.
      attention_out_bias: the output projection has a bias.
      mlp_bias: the MLP projections have biases.
      sliding_window: per layer, the number of keys a query sees (None: plain causal attention).
      scale_attn_weights: GPT-2: divide attention logits by sqrt(head_dim).
      scale_attn_by_inverse_layer_idx: GPT-2: also divide them by the layer's index plus one.
      initializer_range: the standard deviation of :meth:`CausalLM.init`'s normal weights.
      hf_config: the parsed ``config.json`` (not part of equality or hashing).
    """

    family: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    max_position_embeddings: int
    norm_eps: float
    tie_word_embeddings: bool
    activation: str
    rope_theta: float = 10000.0
    rope_type: str = "default"
    rope_scaling: tuple[tuple[str, Any], ...] = ()
    attention_bias: bool = False
    attention_out_bias: bool = False
    mlp_bias: bool = False
    sliding_window: tuple[int | None, ...] = ()
    scale_attn_weights: bool = True
    scale_attn_by_inverse_layer_idx: bool = False
    initializer_range: float = 0.02
    hf_config: Mapping[str, Any] = dataclasses.field(default_factory=dict, compare=False, hash=False)

    @property
    def rope_parameters(self) -> dict[str, Any]:
        """The rotary scaling parameters as a dict (empty for the default rotary embedding)."""
        return dict(self.rope_scaling)

    @classmethod
    def from_hf(cls, hf_config: Mapping[str, Any]) -> ModelConfig:
        """Parse a Hugging Face config dict.

        Args:
          hf_config: the contents of ``config.json``.

        Returns:
          The config.

        Raises:
          ModelError: for an unsupported ``model_type``, rotary scaling type or activation, or a
            missing or inconsistent size.
        """
        return parse_config(hf_config)


def read_config(path: str | os.PathLike) -> dict[str, Any]:
    """Read ``config.json`` of a Hugging Face model folder.

    Args:
      path: the folder (or the ``config.json`` file itself).

    Returns:
      The parsed dict.

    Raises:
      ModelError: if the folder or its ``config.json`` is missing or not a JSON object.
    """
    path = Path(path)
    file = path if path.is_file() else path / "config.json"
    if not path.exists():
        raise ModelError(f"model folder {path} not found")
    if not file.is_file():
        raise ModelError(f"{path} has no config.json: not a Hugging Face model folder")
    try:
        config = json.loads(file.read_text())
    except ValueError as e:
        raise ModelError(f"{file}: not valid JSON ({e})") from None
    if not isinstance(config, dict):
        raise ModelError(f"{file}: expected a JSON object")
    return config


def _need(config: Mapping[str, Any], *names: str, default: Any = None) -> Any:
    for name in names:
        if config.get(name) is not None:
            return config[name]
    if default is not None:
        return default
    raise ModelError(f"config.json has no {' or '.join(repr(n) for n in names)}")


def _positive_int(config: Mapping[str, Any], *names: str, default: Any = None) -> int:
    value = _need(config, *names, default=default)
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ModelError(f"config.json: {names[0]} must be a positive integer, got {value!r}")
    return value


def _rope(config: Mapping[str, Any]) -> tuple[float, str, tuple[tuple[str, Any], ...]]:
    """(rope_theta, rope_type, scaling pairs) from either spelling of the rotary settings."""
    params = config.get("rope_parameters")
    if isinstance(params, Mapping) and "rope_theta" not in params and params:
        # Per-layer-type rotary settings (Gemma-style): not a family of this package.
        raise ModelError("config.json: per-layer rope_parameters are not supported")
    scaling = dict(config.get("rope_scaling") or {})
    merged: dict[str, Any] = {**scaling, **dict(params or {})}
    theta = float(merged.pop("rope_theta", config.get("rope_theta", 10000.0)))
    rope_type = str(merged.pop("rope_type", merged.pop("type", "default")))
    merged.pop("type", None)
    if rope_type not in ROPE_TYPES:
        raise ModelError(
            f"unsupported rope_scaling type {rope_type!r}: meta-consensus runs {', '.join(ROPE_TYPES)}"
        )
    if rope_type == "default":
        return theta, rope_type, ()
    if "factor" not in merged:
        raise ModelError(f"rope_scaling of type {rope_type!r} needs a 'factor'")
    if rope_type == "llama3":
        for name in ("low_freq_factor", "high_freq_factor", "original_max_position_embeddings"):
            if name not in merged:
                raise ModelError(f"rope_scaling of type 'llama3' needs {name!r}")
    # Only scalars matter for the supported types; lists (longrope factors) never reach here.
    pairs = tuple(sorted((str(k), v) for k, v in merged.items() if not isinstance(v, list | dict)))
    return theta, rope_type, pairs


def _activation(name: Any) -> str:
    if name not in ACTIVATIONS:
        raise ModelError(f"unsupported activation {name!r}: meta-consensus runs {', '.join(ACTIVATIONS)}")
    return ACTIVATIONS[name]


def _sliding_windows(config: Mapping[str, Any], family: str, num_layers: int) -> tuple[int | None, ...]:
    """The key window of every layer: Mistral's applies to all layers, Qwen2's to its sliding layers."""
    window = config.get("sliding_window")
    if family == "mistral":
        return (int(window) if window else None,) * num_layers
    if family == "qwen2":
        if not config.get("use_sliding_window") or not window:
            return (None,) * num_layers
        types = config.get("layer_types")
        if not types:
            start = int(config.get("max_window_layers", num_layers))
            types = ["sliding_attention" if i >= start else "full_attention" for i in range(num_layers)]
        if len(types) != num_layers:
            raise ModelError(f"config.json: layer_types has {len(types)} entries for {num_layers} layers")
        return tuple(int(window) if t == "sliding_attention" else None for t in types)
    return (None,) * num_layers


def parse_config(hf_config: Mapping[str, Any]) -> ModelConfig:
    """Parse a Hugging Face config dict into a :class:`ModelConfig`.

    Args:
      hf_config: the contents of ``config.json``.

    Returns:
      The config.

    Raises:
      ModelError: for an unsupported ``model_type``, rotary scaling type or activation, or a
        missing or inconsistent size.
    """
    if not isinstance(hf_config, Mapping):
        raise ModelError(f"a model config must be a dict (config.json), got {type(hf_config).__name__}")
    c = dict(hf_config)
    family = c.get("model_type")
    if family not in SUPPORTED_TYPES:
        raise ModelError(
            f"unsupported model_type {family!r}: meta-consensus runs {', '.join(SUPPORTED_TYPES)}"
        )
    if family == "gpt2":
        hidden = _positive_int(c, "n_embd", "hidden_size")
        heads = _positive_int(c, "n_head", "num_attention_heads")
        if hidden % heads:
            raise ModelError(f"config.json: n_embd={hidden} is not a multiple of n_head={heads}")
        layers = _positive_int(c, "n_layer", "num_hidden_layers")
        return ModelConfig(
            family=family,
            vocab_size=_positive_int(c, "vocab_size"),
            hidden_size=hidden,
            num_layers=layers,
            num_heads=heads,
            num_kv_heads=heads,
            head_dim=hidden // heads,
            intermediate_size=_positive_int(c, "n_inner", default=4 * hidden),
            max_position_embeddings=_positive_int(c, "n_positions", "max_position_embeddings"),
            norm_eps=float(c.get("layer_norm_epsilon", 1e-5)),
            tie_word_embeddings=bool(c.get("tie_word_embeddings", True)),
            activation=_activation(c.get("activation_function", "gelu_new")),
            attention_bias=True,
            attention_out_bias=True,
            mlp_bias=True,
            sliding_window=(None,) * layers,
            scale_attn_weights=bool(c.get("scale_attn_weights", True)),
            scale_attn_by_inverse_layer_idx=bool(c.get("scale_attn_by_inverse_layer_idx", False)),
            initializer_range=float(c.get("initializer_range", 0.02)),
            hf_config=c,
        )
    hidden = _positive_int(c, "hidden_size")
    heads = _positive_int(c, "num_attention_heads")
    kv_heads = _positive_int(c, "num_key_value_heads", default=heads)
    if heads % kv_heads:
        raise ModelError(
            f"config.json: num_attention_heads={heads} is not a multiple of num_key_value_heads={kv_heads}"
        )
    head_dim = c.get("head_dim") or hidden // heads
    if c.get("head_dim") is None and hidden % heads:
        raise ModelError(
            f"config.json: hidden_size={hidden} is not a multiple of num_attention_heads={heads}"
        )
    if float(c.get("partial_rotary_factor", 1.0)) != 1.0:
        raise ModelError("config.json: partial_rotary_factor other than 1.0 is not supported")
    if int(c.get("pretraining_tp", 1) or 1) != 1:
        raise ModelError("config.json: pretraining_tp other than 1 is not supported")
    theta, rope_type, scaling = _rope(c)
    layers = _positive_int(c, "num_hidden_layers")
    qwen = family == "qwen2"
    llama = family == "llama"
    return ModelConfig(
        family=family,
        vocab_size=_positive_int(c, "vocab_size"),
        hidden_size=hidden,
        num_layers=layers,
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=int(head_dim),
        intermediate_size=_positive_int(c, "intermediate_size"),
        max_position_embeddings=_positive_int(c, "max_position_embeddings", default=2048),
        norm_eps=float(c.get("rms_norm_eps", 1e-6)),
        tie_word_embeddings=bool(c.get("tie_word_embeddings", False)),
        activation=_activation(c.get("hidden_act", "silu")),
        rope_theta=theta,
        rope_type=rope_type,
        rope_scaling=scaling,
        # Qwen2 always has q/k/v biases and no output bias; Llama's attention_bias covers all four;
        # Mistral's projections have none.
        attention_bias=qwen or (llama and bool(c.get("attention_bias", False))),
        attention_out_bias=llama and bool(c.get("attention_bias", False)),
        mlp_bias=llama and bool(c.get("mlp_bias", False)),
        sliding_window=_sliding_windows(c, family, layers),
        initializer_range=float(c.get("initializer_range", 0.02)),
        hf_config=c,
    )
