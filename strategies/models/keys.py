"""The table between parameter tree paths and Hugging Face tensor names, and the per-key transform.

The tree's module names are Hugging Face's, so the table is mechanical (no per-family code):

* the path's parts joined with dots; the leaf ``kernel`` / ``embedding`` / ``scale`` is
  Hugging Face's ``weight`` and ``bias`` stays ``bias``
  (``model/layers/0/self_attn/q_proj/kernel`` <-> ``model.layers.0.self_attn.q_proj.weight``);
* back from a name, ``weight`` is an ``embedding`` under ``embed_tokens`` / ``wte`` / ``wpe``, a
  ``scale`` under a norm (a name holding ``norm`` or starting ``ln_``), else a ``kernel``;
* a ``kernel`` is stored transposed by PyTorch's ``nn.Linear`` (``(out, in)``), except GPT-2's
  ``Conv1D`` modules (``c_attn``, ``c_proj``, ``c_fc``, ``q_attn``), which store ``(in, out)``.

Layer indices are ints in the tree (``nnx.List``) and decimal strings in names.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from strategies.models.config import ModelError

EMBEDDING_MODULES = ("embed_tokens", "wte", "wpe")
CONV1D_MODULES = ("c_attn", "c_proj", "c_fc", "q_attn")
_LEAF_TO_HF = {"kernel": "weight", "embedding": "weight", "scale": "weight", "bias": "bias"}

Path = tuple[str | int, ...]


def _parts(path: str | Sequence[Any]) -> Path:
    """A path as a tuple of str / int parts, from "a/b/0/c", a tuple, or a ``jax.tree_util`` key path."""
    if isinstance(path, str):
        raw: list[Any] = path.split("/")
    else:
        raw = []
        for k in path:
            for attr in ("key", "idx", "name"):
                if hasattr(k, attr):
                    k = getattr(k, attr)
                    break
            raw.append(k)
    out: list[str | int] = []
    for p in raw:
        if isinstance(p, int) or (isinstance(p, str) and p.isdigit()):
            out.append(int(p))
        else:
            out.append(str(p))
    if not out or out[-1] not in _LEAF_TO_HF:
        raise ModelError(f"tree path {path!r} does not end in one of {', '.join(_LEAF_TO_HF)}")
    return tuple(out)


def hf_key(path: str | Sequence[Any]) -> str:
    """The Hugging Face tensor name of a parameter's tree path.

    Args:
      path: "model/layers/0/self_attn/q_proj/kernel", a tuple of parts, or a ``jax.tree_util`` key path.

    Returns:
      The dotted name, e.g. "model.layers.0.self_attn.q_proj.weight".

    Raises:
      ModelError: for a path whose leaf is not kernel, bias, embedding or scale.

    Example:
      >>> hf_key("model/layers/0/self_attn/q_proj/kernel")
      'model.layers.0.self_attn.q_proj.weight'
      >>> hf_key(("transformer", "ln_f", "scale"))
      'transformer.ln_f.weight'
    """
    parts = _parts(path)
    return ".".join([str(p) for p in parts[:-1]] + [_LEAF_TO_HF[str(parts[-1])]])


def hf_module(path: str | Sequence[Any]) -> str:
    """The Hugging Face module name owning a parameter (its name without ``.weight`` / ``.bias``).

    PEFT names LoRA targets and adapter tensors by this name
    (``base_model.model.<module>.lora_A.weight``).

    Args:
      path: a tree path (see :func:`hf_key`).

    Returns:
      E.g. "model.layers.0.self_attn.q_proj".

    Raises:
      ModelError: for a path whose leaf is not kernel, bias, embedding or scale.
    """
    return hf_key(path).rsplit(".", 1)[0]


def tree_path(name: str) -> Path:
    """The tree path of a Hugging Face tensor name (the inverse of :func:`hf_key`).

    Args:
      name: e.g. "model.layers.0.self_attn.q_proj.weight".

    Returns:
      E.g. ("model", "layers", 0, "self_attn", "q_proj", "kernel").

    Raises:
      ModelError: for a name that does not end in ``.weight`` or ``.bias``.

    Example:
      >>> tree_path("model.layers.3.post_attention_layernorm.weight")
      ('model', 'layers', 3, 'post_attention_layernorm', 'scale')
    """
    parts = name.split(".")
    if len(parts) < 2 or parts[-1] not in ("weight", "bias"):
        raise ModelError(f"tensor name {name!r} does not end in .weight or .bias")
    module = parts[-2]
    if parts[-1] == "bias":
        leaf = "bias"
    elif module in EMBEDDING_MODULES:
        leaf = "embedding"
    elif "norm" in module or module.startswith("ln_"):
        leaf = "scale"
    else:
        leaf = "kernel"
    return tuple(int(p) if p.isdigit() else p for p in parts[:-1]) + (leaf,)


def path_string(path: str | Sequence[Any]) -> str:
    """A tree path as "/"-joined text (``strategies.lora.path_name``'s spelling).

    Args:
      path: a tree path (see :func:`hf_key`).

    Returns:
      E.g. "model/layers/0/self_attn/q_proj/kernel".
    """
    return "/".join(str(p) for p in _parts(path))


def transposes(path: str | Sequence[Any]) -> bool:
    """Whether the parameter is stored transposed in Hugging Face files (``nn.Linear`` kernels).

    Args:
      path: a tree path (see :func:`hf_key`).

    Returns:
      True for a ``kernel`` of any module but GPT-2's Conv1D ones.
    """
    parts = _parts(path)
    return parts[-1] == "kernel" and not (len(parts) > 1 and parts[-2] in CONV1D_MODULES)


def to_hf(path: str | Sequence[Any], array: Any) -> np.ndarray:
    """A parameter as Hugging Face stores it (transposed, contiguous, for a Linear kernel).

    Args:
      path: its tree path.
      array: its value (numpy or jax).

    Returns:
      The numpy array to store under :func:`hf_key`.
    """
    array = np.asarray(array)
    return np.ascontiguousarray(array.T) if transposes(path) else array


def from_hf(name: str, array: Any) -> np.ndarray:
    """A stored Hugging Face tensor as the tree holds it (the inverse of :func:`to_hf`).

    Args:
      name: its Hugging Face name.
      array: the stored array.

    Returns:
      The numpy array for :func:`tree_path` ``(name)``.
    """
    array = np.asarray(array)
    return np.ascontiguousarray(array.T) if transposes(tree_path(name)) else array


def hf_shape(path: str | Sequence[Any], shape: Sequence[int]) -> tuple[int, ...]:
    """The stored shape of a parameter of tree shape ``shape``.

    Args:
      path: its tree path.
      shape: its shape in the tree.

    Returns:
      The shape in the Hugging Face file.
    """
    return tuple(reversed(tuple(shape))) if transposes(path) else tuple(shape)
