"""GGUF (llama.cpp) files -> Hugging Face model folders, dequantised to float32.

::

    from strategies.models.gguf import convert_gguf
    folder = convert_gguf("SmolLM2-135M-Instruct.Q4_1.gguf", "smollm2-135m-instruct")
    # folder: config.json, model.safetensors (float32), tokenizer.json, tokenizer_config.json,
    # special_tokens_map.json, generation_config.json, README.md

The file is read with the ``gguf`` package's memory-mapped reader and written tensor by tensor
(:class:`consensus.io.ShardedWriter`), so memory holds one dequantised tensor at a time. Names are a
table (llama.cpp -> Hugging Face). One transform is not a rename: llama.cpp's converter permutes
the rows of every q and k projection, head by head, from Hugging Face's rotate-half rotary layout
to its interleaved one; :func:`unpermute_rows` undoes it, so the folder is in Hugging Face's layout
and a model built from it needs no special rotary code. The folder appears atomically.

Only the ``llama`` architecture is converted (Llama, SmolLM2, Mistral-style dense models). The
dequantised weights hold the quantised values exactly: they are not the original release's.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from consensus.io import CheckpointError, ShardedWriter, atomic_directory
from strategies.models.gguf_tokenizer import GGUFTokenizerError, hf_tokenizer_files


class GGUFError(ValueError):
    """A GGUF file that cannot be converted: unreadable, another architecture, unknown tensors or types."""


# llama.cpp tensor name -> Hugging Face name; ``{n}`` is the layer index.
LAYER_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}
TOP_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER = re.compile(r"blk\.(\d+)\.(\w+)\.weight")


@dataclass(frozen=True)
class LlamaShape:
    """The sizes of a Llama model, as the GGUF metadata gives them.

    Args:
      layers: Decoder blocks.
      heads: Query heads.
      kv_heads: Key/value heads (fewer than ``heads`` for grouped-query attention).
      hidden: Model width.
    """

    layers: int
    heads: int
    kv_heads: int
    hidden: int


def hf_name(gguf_name: str) -> str:
    """Return the Hugging Face name of a llama.cpp tensor name.

    Args:
      gguf_name: e.g. ``"blk.3.attn_q.weight"``.

    Returns:
      e.g. ``"model.layers.3.self_attn.q_proj.weight"``.

    Raises:
      GGUFError: If the name is not one of a Llama model's tensors.
    """
    if gguf_name in TOP_NAMES:
        return TOP_NAMES[gguf_name]
    m = _LAYER.fullmatch(gguf_name)
    if m is None or m[2] not in LAYER_NAMES:
        raise GGUFError(
            f"tensor {gguf_name!r} has no Hugging Face Llama name (biases, rope_freqs and other "
            "architectures' tensors are not converted)"
        )
    return f"model.layers.{m[1]}.{LAYER_NAMES[m[2]]}.weight"


def unpermute_rows(weight: np.ndarray, heads: int) -> np.ndarray:
    """Undo llama.cpp's rotary permutation of a q or k projection's rows (its output dimension).

    llama.cpp's ``convert_hf_to_gguf.py`` stores each head's rows reordered from rotate-half
    (first half of the head's dimensions paired with the second half) to interleaved pairs:
    ``w.reshape(heads, 2, d // 2, ...).swapaxes(1, 2)``. This is the inverse (transformers'
    ``reverse_permute_weights`` does the same).

    Args:
      weight: ``(heads * head_dim, ...)``, rows in llama.cpp's order.
      heads: The heads the rows hold (the key/value heads for k).

    Returns:
      The same values, rows in Hugging Face's order.

    Raises:
      GGUFError: If the rows do not split into ``heads`` heads of an even size.
    """
    rows = weight.shape[0]
    if rows % (2 * heads):
        raise GGUFError(f"a q/k projection of {rows} rows does not split into {heads} heads of even size")
    half = rows // heads // 2
    return weight.reshape(heads, half, 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)


def _reader(path: Path) -> Any:
    import gguf

    if not path.is_file():
        raise GGUFError(f"{path}: no such file")
    try:
        return gguf.GGUFReader(path)
    except Exception as e:  # noqa: BLE001 - the reader raises ValueError, struct.error, IndexError, ...
        raise GGUFError(f"{path}: not a readable GGUF file ({type(e).__name__}: {e})") from e


# Per-token arrays, read by the tokenizer builder straight from the reader's fields.
LONG_ARRAYS = (
    "tokenizer.ggml.tokens",
    "tokenizer.ggml.merges",
    "tokenizer.ggml.token_type",
    "tokenizer.ggml.scores",
    "tokenizer.ggml.precompiled_charsmap",
)


def metadata(reader: Any, *, skip: tuple[str, ...] = LONG_ARRAYS) -> dict[str, Any]:
    """Return a GGUF reader's key/value metadata as Python values.

    Args:
      reader: A ``gguf.GGUFReader``.
      skip: Key prefixes left out (by default the tokenizer's per-token arrays).

    Returns:
      Key -> value (str, int, float, bool or list).
    """
    out = {}
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or key.startswith(skip):
            continue
        value = field.contents()
        out[key] = value.item() if isinstance(value, np.generic) else value
    return out


def _need(meta: Mapping[str, Any], key: str) -> Any:
    if key not in meta:
        raise GGUFError(f"the GGUF metadata lacks {key!r}")
    return meta[key]


def _shortest(value: float) -> float:
    # GGUF stores these as float32: 1e-5 reads back as 9.9999997e-06. The shortest decimal that
    # rounds to the same float32 is the value the model was configured with.
    return float(str(np.float32(value)))


def llama_config(meta: Mapping[str, Any], tensors: Mapping[str, tuple[int, ...]]) -> dict[str, Any]:
    """Return the ``config.json`` of a Llama GGUF (``LlamaConfig`` fields).

    Args:
      meta: The file's metadata (:func:`metadata`; the tokenizer's special ids are read too).
      tensors: llama.cpp tensor name -> shape in Hugging Face's (numpy) order.

    Returns:
      The config, ``torch_dtype`` float32.

    Raises:
      GGUFError: If the architecture is not ``llama``, a needed key is missing or the rotary
        settings are not the plain ones (scaled or partial rotary embeddings).
    """
    arch = meta.get("general.architecture")
    if arch != "llama":
        raise GGUFError(f"architecture {arch!r} is not converted (only 'llama')")
    hidden = int(_need(meta, "llama.embedding_length"))
    heads = int(_need(meta, "llama.attention.head_count"))
    head_dim = int(meta.get("llama.attention.key_length", hidden // heads))
    rope_dim = int(meta.get("llama.rope.dimension_count", head_dim))
    if rope_dim != head_dim:
        raise GGUFError(f"partial rotary embeddings ({rope_dim} of {head_dim} dimensions) are not converted")
    scaling = meta.get("llama.rope.scaling.type", "none")
    if scaling not in ("none", ""):
        raise GGUFError(f"rope scaling {scaling!r} is not converted")
    vocab = tensors["token_embd.weight"][0]
    config: dict[str, Any] = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": int(meta.get("llama.vocab_size", vocab)),
        "hidden_size": hidden,
        "intermediate_size": int(_need(meta, "llama.feed_forward_length")),
        "num_hidden_layers": int(_need(meta, "llama.block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(meta.get("llama.attention.head_count_kv", heads)),
        "head_dim": head_dim,
        "hidden_act": "silu",
        "rope_theta": _shortest(meta.get("llama.rope.freq_base", 10000.0)),
        "rms_norm_eps": _shortest(_need(meta, "llama.attention.layer_norm_rms_epsilon")),
        "max_position_embeddings": int(meta.get("llama.context_length", 2048)),
        "tie_word_embeddings": "output.weight" not in tensors,
        "attention_bias": False,
        "mlp_bias": False,
        "torch_dtype": "float32",
    }
    for name in ("bos", "eos", "padding"):
        key = f"tokenizer.ggml.{name}_token_id"
        if key in meta:
            config[f"{'pad' if name == 'padding' else name}_token_id"] = int(meta[key])
    if config["vocab_size"] != vocab:
        raise GGUFError(f"llama.vocab_size {config['vocab_size']} but token_embd has {vocab} rows")
    return config


def _shapes(reader: Any) -> dict[str, tuple[int, ...]]:
    # GGUF lists dimensions innermost first; numpy (and Hugging Face's (out, in)) order is the reverse.
    return {t.name: tuple(int(d) for d in reversed(t.shape.tolist())) for t in reader.tensors}


def _check_shapes(shapes: Mapping[str, tuple[int, ...]], config: Mapping[str, Any]) -> LlamaShape:
    dims = LlamaShape(
        layers=config["num_hidden_layers"],
        heads=config["num_attention_heads"],
        kv_heads=config["num_key_value_heads"],
        hidden=config["hidden_size"],
    )
    expected = {"token_embd.weight", "output_norm.weight"} | {
        f"blk.{i}.{part}.weight" for i in range(dims.layers) for part in LAYER_NAMES
    }
    missing = sorted(expected - set(shapes))
    if missing:
        raise GGUFError(f"the GGUF lacks {len(missing)} Llama tensors, e.g. {missing[0]!r}")
    head_dim = config["head_dim"]
    for name, heads in (("attn_q", dims.heads), ("attn_k", dims.kv_heads)):
        got = shapes[f"blk.0.{name}.weight"]
        if got != (heads * head_dim, dims.hidden):
            raise GGUFError(f"blk.0.{name}.weight is {list(got)}, expected {[heads * head_dim, dims.hidden]}")
    return dims


def _dequantized(tensor: Any, shape: tuple[int, ...]) -> np.ndarray:
    import gguf

    try:
        values = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
    except NotImplementedError as e:
        raise GGUFError(f"{tensor.name}: quantisation {tensor.tensor_type.name} cannot be read ({e})") from e
    return np.ascontiguousarray(values, dtype=np.float32).reshape(shape)


def _readme(
    meta: Mapping[str, Any], types: Mapping[str, int], source: str, provenance: str | None, title: str | None
) -> str:
    name = meta.get("general.name") or meta.get("general.basename") or "a Llama model"
    license_ = meta.get("general.license", "not stated in the GGUF metadata")
    quant = ", ".join(f"{count} {kind}" for kind, count in sorted(types.items(), key=lambda kv: -kv[1]))
    lines = [
        f"# {title or f'{name} (dequantised from GGUF)'}",
        "",
        f"These are the weights of the GGUF file `{source}`, dequantised to float32 and renamed to",
        "Hugging Face's Llama layout (q/k rows un-permuted to the rotate-half rotary layout). Quantised",
        f"tensors hold exactly the quantised values ({quant} tensors): this is not the original",
        "float release, and its outputs differ slightly from it.",
        "",
        f"License: {license_} (from the GGUF metadata).",
    ]
    if provenance:
        lines += ["", provenance.strip()]
    lines += [
        "",
        "Written by meta-consensus (`strategies.models.gguf.convert_gguf`): config.json, model.safetensors,",
        "tokenizer.json (byte-level BPE rebuilt from the GGUF vocabulary and merges), tokenizer_config.json,",
        "special_tokens_map.json, generation_config.json.",
    ]
    return "\n".join(lines) + "\n"


def _write_json(path: Path, value: Any) -> None:
    path.write_text(json.dumps(value, indent=2, ensure_ascii=False) + "\n")


def convert_gguf(
    gguf_path: str | os.PathLike,
    out_dir: str | os.PathLike,
    *,
    overwrite: bool = False,
    provenance: str | None = None,
    title: str | None = None,
    keep_gguf: bool = False,
) -> Path:
    """Convert a Llama GGUF file into a Hugging Face model folder (float32 safetensors + tokenizer).

    Args:
      gguf_path: The ``.gguf`` file.
      out_dir: The folder to create (it appears atomically, complete or not at all).
      overwrite: Replace an existing ``out_dir``.
      provenance: A paragraph for the folder's README.md (where the file came from, its license).
      title: The README's heading (default: the GGUF's ``general.name``).
      keep_gguf: Also copy the GGUF into the folder under its own name (for comparisons with
        loaders that read GGUF files).

    Returns:
      ``out_dir``.

    Raises:
      GGUFError: If the file is not a readable GGUF of the ``llama`` architecture with a byte-level
        BPE tokenizer, or holds tensors this converter does not know.
      consensus.io.CheckpointError: If ``out_dir`` exists and ``overwrite`` is False.
    """
    import shutil

    path, out = Path(gguf_path), Path(out_dir)
    if out.exists() and not overwrite:
        raise CheckpointError(f"{out} exists; choose another folder or pass overwrite=True")
    reader = _reader(path)
    meta = metadata(reader)
    shapes = _shapes(reader)
    config = llama_config(meta, shapes)
    dims = _check_shapes(shapes, config)
    for name in shapes:
        hf_name(name)  # every tensor must have a name before anything is written
    try:
        tokenizer = hf_tokenizer_files(reader.fields, meta)
    except GGUFTokenizerError as e:
        raise GGUFError(f"{path}: {e}") from e

    def order(name: str) -> tuple[int, int, str]:
        m = _LAYER.fullmatch(name)
        if m:
            return (1, int(m[1]), hf_name(name))
        return (0 if name == "token_embd.weight" else 2, 0, name)

    tensors = sorted(reader.tensors, key=lambda t: order(t.name))
    specs = {hf_name(t.name): (shapes[t.name], np.float32) for t in tensors}
    types: dict[str, int] = {}
    with atomic_directory(out, overwrite=overwrite) as tmp:
        writer = ShardedWriter(tmp, specs, metadata={"source": "gguf"})
        try:
            for t in tensors:
                types[t.tensor_type.name] = types.get(t.tensor_type.name, 0) + 1
                w = _dequantized(t, shapes[t.name])
                part = _LAYER.fullmatch(t.name)
                if part and part[2] == "attn_q":
                    w = unpermute_rows(w, dims.heads)
                elif part and part[2] == "attn_k":
                    w = unpermute_rows(w, dims.kv_heads)
                writer.write(hf_name(t.name), w)
        finally:
            writer.abort()
        writer.close()
        _write_json(tmp / "config.json", config)
        generation = {k: config[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id") if k in config}
        _write_json(tmp / "generation_config.json", generation)
        for name, value in tokenizer.items():
            if isinstance(value, str):
                (tmp / name).write_text(value)
            else:
                _write_json(tmp / name, value)
        (tmp / "README.md").write_text(_readme(meta, types, path.name, provenance, title))
        if keep_gguf:
            shutil.copyfile(path, tmp / path.name)
    return out
