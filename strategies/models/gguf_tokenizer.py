"""A GGUF file's tokenizer metadata -> Hugging Face tokenizer files (``tokenizer.json`` and its configs).

A GGUF carries no ``tokenizer.json``: llama.cpp stores the vocabulary (``tokenizer.ggml.tokens``),
the BPE merges, a type per token (1 normal, 3 control, 4 user-defined), the special ids and the
name of its pre-tokenizer (``tokenizer.ggml.pre``), whose regexes live in llama.cpp's C++ code.
This module rebuilds the ``tokenizers`` pipeline those names stand for. Only byte-level BPE
vocabularies (``tokenizer.ggml.model == "gpt2"``) with a pre-tokenizer of :data:`PRE_TOKENIZERS`
are built; anything else is an error rather than a tokenizer that silently splits text otherwise.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from typing import Any


class GGUFTokenizerError(ValueError):
    """GGUF tokenizer metadata this module does not rebuild (another model type or pre-tokenizer)."""


CONTROL, USER_DEFINED = 3, 4  # llama.cpp's token types (gguf.TokenType)


def _digits_then_byte_level() -> Any:
    from tokenizers import pre_tokenizers

    # StarCoder's and SmolLM's: every digit alone, then GPT-2's regex and byte spelling. llama.cpp
    # writes the same as the regexes "\p{N}" then GPT-2's; the original tokenizer.json files say this.
    return pre_tokenizers.Sequence(
        [
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ]
    )


def _byte_level() -> Any:
    from tokenizers import pre_tokenizers

    return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)


# tokenizer.ggml.pre -> the pre-tokenizer of the original tokenizer.json.
PRE_TOKENIZERS: dict[str, Callable[[], Any]] = {
    "gpt-2": _byte_level,
    "smollm": _digits_then_byte_level,
    "starcoder": _digits_then_byte_level,
    "refact": _digits_then_byte_level,
}


def build_tokenizer(
    tokens: list[str],
    merges: list[str],
    token_types: list[int] | None,
    *,
    pre: str,
    add_bos: int | None = None,
    add_eos: int | None = None,
) -> Any:
    """Build a byte-level BPE ``tokenizers.Tokenizer`` from llama.cpp's tokenizer metadata.

    Args:
      tokens: The vocabulary in id order, in GPT-2's byte-to-unicode spelling (``"Ġthe"``).
      merges: The BPE merges, best first, each ``"left right"``.
      token_types: A llama.cpp token type per token, or None: control tokens (3) become special
        added tokens, user-defined ones (4) plain added tokens, both matched whole in the text.
      pre: ``tokenizer.ggml.pre``, a key of :data:`PRE_TOKENIZERS`.
      add_bos: The id to put before every encoded text, or None.
      add_eos: The id to put after every encoded text, or None.

    Returns:
      The tokenizer.

    Raises:
      GGUFTokenizerError: If ``pre`` is unknown, a merge is not two tokens, or the types do not
        match the vocabulary.
    """
    from tokenizers import AddedToken, Tokenizer, decoders, models, processors

    if pre not in PRE_TOKENIZERS:
        raise GGUFTokenizerError(
            f"pre-tokenizer {pre!r} (tokenizer.ggml.pre) is not rebuilt; known: {sorted(PRE_TOKENIZERS)}"
        )
    if token_types is not None and len(token_types) != len(tokens):
        raise GGUFTokenizerError(f"{len(token_types)} token types for {len(tokens)} tokens")
    vocab = {token: i for i, token in enumerate(tokens)}
    if len(vocab) != len(tokens):
        raise GGUFTokenizerError(f"the vocabulary repeats {len(tokens) - len(vocab)} tokens")
    pairs = []
    for merge in merges:
        # Byte-level spelling has no raw space (a space byte is "Ġ"), so a space always separates.
        parts = merge.split(" ")
        if len(parts) != 2 or parts[0] + parts[1] not in vocab:
            raise GGUFTokenizerError(f"merge {merge!r} is not two tokens whose join is in the vocabulary")
        pairs.append((parts[0], parts[1]))
    tok = Tokenizer(models.BPE(vocab=vocab, merges=pairs, fuse_unk=False, byte_fallback=False))
    tok.pre_tokenizer = PRE_TOKENIZERS[pre]()
    tok.decoder = decoders.ByteLevel()
    if add_bos is None and add_eos is None:
        tok.post_processor = processors.ByteLevel(trim_offsets=False)
    else:
        bos = [(tokens[add_bos], add_bos)] if add_bos is not None else []
        eos = [(tokens[add_eos], add_eos)] if add_eos is not None else []
        b, e = [t for t, _ in bos], [t for t, _ in eos]
        tok.post_processor = processors.TemplateProcessing(
            single=[*b, "$A", *e], pair=[*b, "$A", *e, *b, "$B", *e], special_tokens=bos + eos
        )
    added = [
        AddedToken(token, special=kind == CONTROL, normalized=False)
        for token, kind in zip(tokens, token_types or (), strict=False)
        if kind in (CONTROL, USER_DEFINED)
    ]
    tok.add_special_tokens([a for a in added if a.special])
    tok.add_tokens([a for a in added if not a.special])
    return tok


def _field(fields: Mapping[str, Any], key: str) -> Any:
    if key not in fields:
        raise GGUFTokenizerError(f"the GGUF metadata lacks {key!r}")
    return fields[key].contents()


def hf_tokenizer_files(fields: Mapping[str, Any], meta: Mapping[str, Any]) -> dict[str, Any]:
    """Return the tokenizer files of a GGUF: ``tokenizer.json`` (text) and its two configs (dicts).

    Args:
      fields: ``gguf.GGUFReader.fields`` (the per-token arrays are read from here).
      meta: The file's scalar metadata (special ids, ``tokenizer.ggml.pre``, chat template, flags).

    Returns:
      File name -> contents: ``tokenizer.json`` (str), ``tokenizer_config.json`` and
      ``special_tokens_map.json`` (JSON-able dicts).

    Raises:
      GGUFTokenizerError: If the tokenizer is not a byte-level BPE (``tokenizer.ggml.model`` "gpt2")
        this module rebuilds, or its metadata is incomplete.
    """
    kind = meta.get("tokenizer.ggml.model")
    if kind != "gpt2":
        raise GGUFTokenizerError(f"tokenizer model {kind!r} is not rebuilt (only byte-level BPE, 'gpt2')")
    tokens = _field(fields, "tokenizer.ggml.tokens")
    types = (
        [int(t) for t in _field(fields, "tokenizer.ggml.token_type")]
        if "tokenizer.ggml.token_type" in fields
        else None
    )
    ids = {
        name: meta.get(f"tokenizer.ggml.{key}_token_id")
        for name, key in (("bos", "bos"), ("eos", "eos"), ("unk", "unknown"), ("pad", "padding"))
    }
    for name, i in ids.items():
        if i is not None and not 0 <= int(i) < len(tokens):
            raise GGUFTokenizerError(f"{name} token id {i} is outside the vocabulary of {len(tokens)}")
    add_bos = bool(meta.get("tokenizer.ggml.add_bos_token", False))
    add_eos = bool(meta.get("tokenizer.ggml.add_eos_token", False))
    if add_bos and ids["bos"] is None or add_eos and ids["eos"] is None:
        raise GGUFTokenizerError("the GGUF asks for a bos/eos token on every text but names none")
    tok = build_tokenizer(
        tokens,
        _field(fields, "tokenizer.ggml.merges"),
        types,
        pre=str(meta.get("tokenizer.ggml.pre", "gpt-2")),
        add_bos=int(ids["bos"]) if add_bos and ids["bos"] is not None else None,
        add_eos=int(ids["eos"]) if add_eos and ids["eos"] is not None else None,
    )
    special = {f"{name}_token": tokens[int(i)] for name, i in ids.items() if i is not None}
    named = set(special.values())
    extra = [t for t, k in zip(tokens, types or (), strict=False) if k == CONTROL and t not in named]
    special_map: dict[str, Any] = dict(special)
    if extra:
        special_map["additional_special_tokens"] = extra
    config: dict[str, Any] = {
        # The generic fast class: transformers 4.x and 5.x both load tokenizer.json as written.
        "tokenizer_class": "PreTrainedTokenizerFast",
        **special_map,
        "add_bos_token": add_bos,
        "add_eos_token": add_eos,
        "clean_up_tokenization_spaces": False,
        "model_max_length": int(meta.get(f"{meta.get('general.architecture')}.context_length", 2048)),
    }
    if "tokenizer.chat_template" in meta:
        config["chat_template"] = str(meta["tokenizer.chat_template"])
    return {
        "tokenizer.json": json.dumps(json.loads(tok.to_str()), indent=2, ensure_ascii=False) + "\n",
        "tokenizer_config.json": config,
        "special_tokens_map.json": special_map,
    }
