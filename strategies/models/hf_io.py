"""Hugging Face model folders in and out: ``config.json``, safetensors weights (single or sharded), tokenizer.

Loading reads one tensor at a time (:class:`consensus.io.CheckpointReader`'s positional reads)
and places it at once: on the default device, or straight into its ``NamedSharding`` on a mesh
(``jax.make_array_from_callback``), so the host never holds the whole model, let alone twice.
Saving writes tensor by tensor too (:class:`consensus.io.ShardedWriter`, ``"format": "pt"``
metadata, Hugging Face's shard names and index) into a temporary folder renamed into place.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from consensus.io import CheckpointError, CheckpointReader, ShardedWriter, atomic_directory, parse_size
from consensus.mesh import DEFAULT_RULES, to_host
from strategies.models.config import ModelConfig, ModelError, parse_config, read_config
from strategies.models.keys import hf_key, hf_shape, to_hf, transposes
from strategies.models.model import CausalLM, floating_dtype

PyTree = Any
DEFAULT_SHARD_SIZE = "5GB"  # transformers' own default for save_pretrained
# Files copied from the source folder: the tokenizer's, and the generation defaults.
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "merges.txt",
    "vocab.txt",
    "tokenizer.model",
    "chat_template.jinja",
    "chat_template.json",
)
EXTRA_FILES = ("generation_config.json",)
# Stored tensors that are not parameters: GPT-2's causal-mask buffers, old rotary caches.
_BUFFERS = re.compile(r"(\.attn\.(masked_)?bias|rotary_emb\.inv_freq)$")


def tokenizer_files(folder: str | os.PathLike, *, required: bool = False) -> list[Path]:
    """The tokenizer files of a model folder (:data:`TOKENIZER_FILES` that exist).

    Args:
      folder: the model folder.
      required: raise when the folder holds no tokenizer (tokenizer.json, tokenizer.model, or
        vocab.json with merges.txt).

    Returns:
      The existing files.

    Raises:
      ModelError: when ``required`` and the folder has no tokenizer.
    """
    folder = Path(folder)
    found = [folder / n for n in TOKENIZER_FILES if (folder / n).is_file()]
    names = {p.name for p in found}
    has = "tokenizer.json" in names or "tokenizer.model" in names or {"vocab.json", "merges.txt"} <= names
    if required and not has:
        raise ModelError(
            f"{folder} has no tokenizer files (tokenizer.json, tokenizer.model or vocab.json + merges.txt)"
        )
    return found


def _dtype(dtype: Any) -> np.dtype | None:
    return None if dtype is None else np.dtype(jnp.dtype(dtype))


def _open(path: Path) -> CheckpointReader:
    if (
        path.is_dir()
        and not any(path.glob("*.safetensors"))
        and not any(path.glob("*.safetensors.index.json"))
    ):
        torch_files = sorted(p.name for p in path.glob("*.bin")) + sorted(p.name for p in path.glob("*.pt"))
        hint = (
            f" (it holds {torch_files[0]}: meta-consensus reads safetensors only, never pickle; "
            "re-save it with save_pretrained(..., safe_serialization=True))"
            if torch_files
            else ""
        )
        raise ModelError(f"{path} has no model.safetensors{hint}")
    try:
        return CheckpointReader(path)
    except CheckpointError as e:
        raise ModelError(str(e)) from None


def _stored_name(name: str, stored: Mapping[str, Any], family: str) -> str | None:
    if name in stored:
        return name
    # The original GPT-2 checkpoints store the transformer's tensors without the "transformer." prefix.
    if family == "gpt2" and name.startswith("transformer.") and name[len("transformer.") :] in stored:
        return name[len("transformer.") :]
    return None


def load(
    path: str | os.PathLike,
    *,
    dtype: Any = jnp.float32,
    mesh: Mesh | None = None,
    rules: Any = None,
    remat: bool = False,
) -> tuple[CausalLM, PyTree]:
    """Load a Hugging Face model folder: the model and its params.

    Args:
      path: a folder with ``config.json`` and ``model.safetensors`` (or shards and their index).
      dtype: the params' dtype (float32 by default whatever the files hold); None keeps each
        tensor's stored dtype (a bfloat16 folder loads as bfloat16, bit for bit).
      mesh: place every tensor straight into its NamedSharding on this mesh (None: the default
        device).
      rules: logical axis rules for ``mesh`` (pairs, dict or MeshConfig; None: the default rules).
      remat: recompute each block's activations in the backward pass.

    Returns:
      ``(model, params)``: a :class:`CausalLM` and a nested dict of jax arrays.

    Raises:
      ModelError: for a folder without ``config.json`` or weights, an unsupported model, a shard
        named in the index but missing, or a tensor missing, unexpected or of the wrong shape.
    """
    path = Path(path)
    model = CausalLM(parse_config(read_config(path)), remat=remat)
    target = _dtype(dtype)
    shapes = model.shapes()
    flat, treedef = jax.tree_util.tree_flatten_with_path(shapes)
    shardings = (
        jax.tree_util.tree_leaves(model.shardings(mesh, DEFAULT_RULES if rules is None else rules))
        if mesh is not None
        else [None] * len(flat)
    )
    family = model.config.family
    with _open(path) as reader:
        names = [hf_key(p) for p, _ in flat]
        sources: list[str] = []
        for (p, leaf), name in zip(flat, names, strict=True):
            src = _stored_name(name, reader.specs, family)
            if src is None:
                raise ModelError(f"{path}: tensor {name!r} is missing (config.json says {family})")
            want = hf_shape(p, leaf.shape)
            if reader.specs[src][0] != want:
                raise ModelError(
                    f"{path}: tensor {src!r} has shape {reader.specs[src][0]}, config.json implies {want}"
                )
            sources.append(src)
        used = set(sources)
        tied_head = "lm_head.weight" if model.config.tie_word_embeddings else None
        extra = [k for k in reader.specs if k not in used and k != tied_head and not _BUFFERS.search(k)]
        if extra:
            raise ModelError(f"{path}: unexpected tensors for a {family} model: {extra[:5]}")
        leaves = []
        for (p, _), src, sharding in zip(flat, sources, shardings, strict=True):
            array = reader.get(src)
            if transposes(p):
                array = np.ascontiguousarray(array.T)
            if target is not None and array.dtype != target:
                array = array.astype(target)
            leaves.append(_place(array, sharding))
            del array  # one tensor on the host at a time
    return model, jax.tree_util.tree_unflatten(treedef, leaves)


def _place(array: np.ndarray, sharding: Any) -> jax.Array:
    if sharding is None:
        return jnp.asarray(array)
    # Each device (of this process) gets only its own block, copied from the host tensor.
    return jax.make_array_from_callback(array.shape, sharding, lambda index: array[index])


def _check_tree(params: PyTree, model: CausalLM) -> list[tuple[Any, Any]]:
    """The params' (path, leaf) pairs, checked against the model's structure and shapes."""
    want = {
        jax.tree_util.keystr(p): s.shape for p, s in jax.tree_util.tree_flatten_with_path(model.shapes())[0]
    }
    got = jax.tree_util.tree_flatten_with_path(_int_keys_tree(params))[0]
    have = {jax.tree_util.keystr(p): tuple(np.shape(x)) for p, x in got}
    missing = [k for k in want if k not in have]
    extra = [k for k in have if k not in want]
    if missing or extra:
        raise ModelError(
            f"params do not match the {model.config.family} config: "
            f"missing {missing[:5]}, unexpected {extra[:5]}"
        )
    for k, shape in want.items():
        if have[k] != tuple(shape):
            raise ModelError(f"params: {k} has shape {have[k]}, the config implies {tuple(shape)}")
    return got


def _int_keys_tree(tree: Any) -> Any:
    if isinstance(tree, Mapping):
        return {
            (int(k) if isinstance(k, str) and k.isdigit() else k): _int_keys_tree(v) for k, v in tree.items()
        }
    return tree


_DTYPE_NAMES = {
    np.dtype(np.float32): "float32",
    np.dtype(np.float16): "float16",
    np.dtype(np.float64): "float64",
}


def _dtype_name(dtype: np.dtype) -> str:
    return _DTYPE_NAMES.get(dtype, "bfloat16" if dtype == np.dtype(jnp.bfloat16) else str(dtype))


def save(
    path: str | os.PathLike,
    params: PyTree,
    *,
    like: str | os.PathLike | None = None,
    config: Mapping[str, Any] | ModelConfig | None = None,
    dtype: Any = None,
    overwrite: bool = False,
    shard_size: int | str | None = DEFAULT_SHARD_SIZE,
    tokenizer: bool | None = None,
) -> Path:
    """Write params as a Hugging Face model folder that ``AutoModelForCausalLM.from_pretrained`` loads.

    Args:
      path: the folder to create.
      params: the parameter tree (as :func:`load` or :meth:`CausalLM.init` give it).
      like: a source model folder: its ``config.json`` (unless ``config`` is given), tokenizer
        files and ``generation_config.json`` are copied.
      config: the model config (a ``config.json`` dict or a :class:`ModelConfig`).
      dtype: store every tensor in this dtype (None: each leaf's own); recorded in config.json
        as ``torch_dtype`` and ``dtype``.
      overwrite: replace an existing folder.
      shard_size: bytes (or "2GB") per weight shard; above it Hugging Face's sharded layout
        and index are written. None: one file.
      tokenizer: True requires tokenizer files in ``like``, False copies none, None copies
        those present.

    Returns:
      The folder written.

    Raises:
      ModelError: with neither ``like`` nor ``config``, params that do not fit the config, an
        existing ``path`` without ``overwrite``, or tokenizer files missing when required.
    """
    path = Path(path)
    if config is None and like is None:
        raise ModelError(
            "save needs like= (a source model folder) or config= (its config.json) to describe params"
        )
    if isinstance(config, ModelConfig):
        hf_config = dict(config.hf_config)
        if not hf_config:
            raise ModelError("save: this ModelConfig carries no hf_config; pass config.json's dict instead")
    elif config is not None:
        hf_config = dict(config)
    else:
        assert like is not None
        hf_config = read_config(like)
    model = CausalLM(parse_config(hf_config))
    copies: list[Path] = []
    if like is not None and tokenizer is not False:
        copies = tokenizer_files(like, required=bool(tokenizer))
    if like is not None:
        copies += [Path(like) / n for n in EXTRA_FILES if (Path(like) / n).is_file()]
    items = _check_tree(params, model)
    target = _dtype(dtype)
    specs = {
        hf_key(p): (hf_shape(p, np.shape(x)), target if target is not None else np.dtype(x.dtype))
        for p, x in items
    }
    stored = target if target is not None else np.dtype(floating_dtype(params))
    hf_config["torch_dtype"] = hf_config["dtype"] = _dtype_name(stored)
    try:
        with atomic_directory(path, overwrite=overwrite) as tmp:
            writer = ShardedWriter(tmp, specs, shard_size=parse_size(shard_size))
            try:
                for (p, x), name in zip(items, specs, strict=True):
                    array = np.asarray(to_host(x))
                    if target is not None and array.dtype != target:
                        array = array.astype(target)
                    writer.write(name, to_hf(p, array))
            finally:
                writer.abort()
            writer.close()
            (tmp / "config.json").write_text(json.dumps(hf_config, indent=2, sort_keys=True) + "\n")
            for f in copies:
                shutil.copy2(f, tmp / f.name)
    except CheckpointError as e:
        raise ModelError(str(e)) from None
    return path
