"""Tiny Hugging Face model folders and text domains for the causal_lm tests (written by transformers).

``model_folder(path)`` saves a random 2-layer model with transformers and a byte-level BPE
tokenizer trained here with the ``tokenizers`` package (300 tokens, ``<eos>`` = 0) as
``tokenizer.json``; ``corpus(path)`` writes two domains: "code" (stdlib files, given by a glob)
and "prose" (a JSONL file of text records).
"""

from __future__ import annotations

import glob
import json
import os
import sysconfig
from pathlib import Path

STDLIB = sysconfig.get_paths()["stdlib"]
CODE_GLOB = os.path.join(STDLIB, "json", "*.py")
PROSE_SOURCES = sorted(glob.glob(os.path.join(STDLIB, "email", "*.py")))[:6]
VOCAB = 300
EOS = 0


def train_tokenizer(path: Path) -> None:
    """A byte-level BPE of VOCAB tokens trained on the corpus' files, saved as ``path``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB,
        special_tokens=["<eos>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train(sorted(glob.glob(CODE_GLOB)) + PROSE_SOURCES, trainer)
    tok.save(str(path))


def model_folder(path: Path, *, family: str = "llama", max_positions: int = 64, seed: int = 0) -> Path:
    """A tiny random model of ``family`` ("llama" or "gpt2") with tokenizer.json, saved at ``path``."""
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    if family == "gpt2":
        cfg = GPT2Config(
            vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, n_positions=max_positions,
            eos_token_id=EOS, bos_token_id=EOS,
        )  # fmt: skip
        model = GPT2LMHeadModel(cfg)
    else:
        cfg = LlamaConfig(
            vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=max_positions,
            eos_token_id=EOS, bos_token_id=EOS, tie_word_embeddings=False,
        )  # fmt: skip
        model = LlamaForCausalLM(cfg)
    model.save_pretrained(path)
    train_tokenizer(Path(path) / "tokenizer.json")
    return Path(path)


def corpus(path: Path) -> dict[str, list[str]]:
    """Two domains: "code" (a glob of stdlib files) and "prose" (a JSONL file written at ``path``).

    Returns:
      The ``text`` option: ``{"code": [glob], "prose": [jsonl]}``.
    """
    path.mkdir(parents=True, exist_ok=True)
    records = []
    for src in PROSE_SOURCES:
        text = Path(src).read_text(encoding="utf-8")
        records += [text[i : i + 700] for i in range(0, min(len(text), 2800), 700)]
    jsonl = path / "prose.jsonl"
    with open(jsonl, "w", encoding="utf-8") as fh:
        for k, r in enumerate(records):
            fh.write(json.dumps({"text": r, "id": k}) + "\n")
            if k == 3:
                fh.write("\n")  # a blank line is no document
    return {"code": [CODE_GLOB], "prose": [str(jsonl)]}


def task_options(model: Path, text: dict[str, list[str]], **changes) -> dict:
    """Small causal_lm options for the tests."""
    options = dict(
        model=str(model), text=text, context=16, windows_per_node=12, general_windows=8,
        heldout_windows=4, test_windows=10,
    )  # fmt: skip
    options.update(changes)
    return options
