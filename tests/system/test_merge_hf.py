"""``meta-consensus merge`` on Hugging Face model folders, checked with the real readers.

Tiny models built from configs (random weights, nothing downloaded): a GPT-2 with a tied head
(fp32, one input storing the tied head explicitly) and a Llama in bf16 (with one fp32 input
cast by ``--dtype``), saved sharded by ``save_pretrained``, merged, and loaded back with
``AutoModelForCausalLM.from_pretrained`` from the output folder alone; its forward pass
equals that of a model built from a numpy float64 merge of the inputs, cast. These tests
need ``torch`` and ``transformers`` (the ``hf`` extra) and are skipped without them. The
command's other checks on such folders (interrupts, non-finite inputs, refusals, the
report's defaults) need neither and always run.
"""

from __future__ import annotations

import json
import os
import signal
import struct

import ml_dtypes
import numpy as np
import pytest

from consensus import io
from meta_consensus.cli import main
from meta_consensus.merge import engine as merge_engine


def _hf():
    torch = pytest.importorskip("torch", reason="the hf extra (torch) is not installed")
    transformers = pytest.importorskip("transformers", reason="the hf extra (transformers) is not installed")
    return torch, transformers


def _header_metadata(path) -> dict:
    with open(path, "rb") as f:
        (size,) = struct.unpack("<Q", f.read(8))
        return json.loads(f.read(size)).get("__metadata__", {})


def _state(folder) -> dict[str, np.ndarray]:
    """The flat checkpoint (transformers' dotted keys, as stored)."""
    with io.CheckpointReader(folder) as r:
        return {k: r.get(k) for k in r.specs}


def _fine_tunes(torch, model_cls, config, seeds, dtype, tmp_path, prefix):
    folders = []
    for seed in seeds:
        torch.manual_seed(seed)
        model = model_cls(config).to(dtype).eval()
        folder = tmp_path / f"{prefix}{seed}"
        model.save_pretrained(folder, max_shard_size="40KB", safe_serialization=True)
        folders.append(folder)
    return folders


def _forward(torch, model, ids):
    with torch.no_grad():
        return model(ids).logits.float().numpy()


@pytest.mark.slow  # torch and transformers imports and three tiny GPT-2 models: several seconds
def test_gpt2_with_a_tied_head_merged_sharded_and_loaded_by_transformers(tmp_path):
    torch, transformers = _hf()
    config = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=96, n_positions=16)
    assert config.tie_word_embeddings
    folders = _fine_tunes(
        torch, transformers.GPT2LMHeadModel, config, [0, 1, 2], torch.float32, tmp_path, "gpt"
    )
    assert (folders[0] / "model.safetensors.index.json").is_file()  # sharded by save_pretrained
    # The last input stores the tied head explicitly (as some writers do), in one file.
    explicit = tmp_path / "gpt_explicit"
    explicit.mkdir()
    state = _state(folders[2])
    assert "lm_head.weight" not in state
    with_head = {**state, "lm_head.weight": state["transformer.wte.weight"]}
    io.save_safetensors(io.unflatten(with_head), explicit / "model.safetensors")
    (explicit / "config.json").write_text((folders[2] / "config.json").read_text())
    inputs = [folders[0], folders[1], explicit]

    out = tmp_path / "merged"
    argv = ["merge", "--method", "median", "--shard-size", "40KB", "--quiet", "--out", str(out)]
    assert main([*argv, *map(str, inputs)]) == 0

    # transformers' layout: the index, its shard names, "format": "pt" in every shard, a config
    index = json.loads((out / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert shards == [f"model-{i:05d}-of-{len(shards):05d}.safetensors" for i in range(1, len(shards) + 1)]
    assert index["metadata"]["total_size"] == sum(v.nbytes for v in _state(out).values())
    for shard in shards:
        assert _header_metadata(out / shard)["format"] == "pt"
    assert "lm_head.weight" not in index["weight_map"]  # the first input's convention: tied, not stored
    assert json.loads((out / "config.json").read_text())["torch_dtype"] == "float32"

    states = [_state(f) for f in folders]
    reference = {
        k: np.median(np.stack([s[k].astype(np.float64) for s in states]), axis=0).astype(np.float32)
        for k in states[0]
    }
    merged = _state(out)
    for k, v in reference.items():
        np.testing.assert_array_equal(merged[k], v, err_msg=k)

    loaded = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    assert loaded.lm_head.weight.data_ptr() == loaded.transformer.wte.weight.data_ptr()  # still tied
    want = transformers.GPT2LMHeadModel(config).eval()
    want.load_state_dict({k: torch.from_numpy(v) for k, v in reference.items()}, strict=False)
    want.tie_weights()
    ids = torch.arange(12).reshape(2, 6) % config.vocab_size
    np.testing.assert_array_equal(_forward(torch, loaded, ids), _forward(torch, want, ids))


@pytest.mark.slow  # as above, with a bf16 Llama
def test_llama_bf16_with_an_fp32_input_cast_by_dtype_loads_as_bf16(tmp_path):
    torch, transformers = _hf()
    config = transformers.LlamaConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=96,
        max_position_embeddings=32,
    )
    bf16 = _fine_tunes(
        torch, transformers.LlamaForCausalLM, config, [3, 4], torch.bfloat16, tmp_path, "llama"
    )
    fp32 = _fine_tunes(torch, transformers.LlamaForCausalLM, config, [5], torch.float32, tmp_path, "llama")
    assert (bf16[0] / "generation_config.json").is_file()  # save_pretrained writes one
    inputs = [*bf16, *fp32]
    out = tmp_path / "merged"
    argv = ["merge", "--method", "mean", "--quiet", "--out", str(out), *map(str, inputs)]
    assert main([*argv, "--out", str(tmp_path / "refused")]) == 2  # fp32 and bf16: --dtype says which
    assert main([*argv, "--dtype", "bfloat16"]) == 0

    assert (out / "generation_config.json").is_file()
    assert json.loads((out / "config.json").read_text())["torch_dtype"] == "bfloat16"
    assert _header_metadata(out / "model.safetensors")["format"] == "pt"
    states = [_state(f) for f in inputs]
    reference = {
        k: np.mean(np.stack([s[k].astype(np.float64) for s in states]), axis=0).astype(ml_dtypes.bfloat16)
        for k in states[0]
    }
    merged = _state(out)
    for k, v in reference.items():
        assert merged[k].dtype == ml_dtypes.bfloat16, k
        # float32 accumulation, then bf16: within one bf16 step of the float64 reference
        np.testing.assert_allclose(merged[k].astype(np.float32), v.astype(np.float32), rtol=2**-7, atol=1e-6)

    loaded = transformers.AutoModelForCausalLM.from_pretrained(out, torch_dtype="auto").eval()
    assert loaded.dtype == torch.bfloat16
    want = transformers.LlamaForCausalLM(config).to(torch.bfloat16).eval()
    want.load_state_dict({k: torch.from_numpy(merged[k].view(np.int16)).view(torch.bfloat16) for k in merged})
    ids = torch.arange(12).reshape(2, 6) % config.vocab_size
    np.testing.assert_array_equal(_forward(torch, loaded, ids), _forward(torch, want, ids))
    want_ref = transformers.LlamaForCausalLM(config).to(torch.bfloat16).eval()
    want_ref.load_state_dict(
        {k: torch.from_numpy(v.view(np.int16)).view(torch.bfloat16) for k, v in reference.items()}
    )
    np.testing.assert_allclose(_forward(torch, loaded, ids), _forward(torch, want_ref, ids), atol=0.05)


# ----------------------------------------------------------------------------- without torch


def _write_inputs(tmp_path, n=3, nan_in=None):
    rng = np.random.default_rng(0)
    paths = []
    for i in range(n):
        tree = {
            "a": rng.normal(size=(4, 8)).astype(np.float32),
            "b": rng.normal(size=(8,)).astype(np.float32),
        }
        if i == nan_in:
            tree["b"][3] = np.nan
        folder = tmp_path / f"in{i}"
        io.save_safetensors(tree, folder)
        (folder / "config.json").write_text(json.dumps({"model_type": "toy", "torch_dtype": "float32"}))
        paths.append(str(folder))
    return paths


def test_nonfinite_inputs_are_named_on_stderr_and_strict_refuses_them(tmp_path, capsys):
    inputs = _write_inputs(tmp_path, nan_in=1)
    out = tmp_path / "merged"
    assert main(["merge", "--method", "median", "--quiet", "--out", str(out), *inputs]) == 0
    captured = capsys.readouterr()
    assert f"{inputs[1]} holds NaN or Inf in 1 tensor(s) (b)" in captured.err
    assert "3 inputs (1 with NaN or Inf" in captured.out
    report = json.loads((out / "merge_report.json").read_text())
    assert report["nonfinite"] == {inputs[1]: ["b"]} and report["strict"] is False
    # every parameter with its default, and which were given
    assert report["params_given"] == [] and "params" in report
    strict = tmp_path / "strict"
    assert main(["merge", "--method", "median", "--strict", "--quiet", "--out", str(strict), *inputs]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "--strict: 'b' holds NaN or Inf in " + inputs[1] in err
    assert not strict.exists() and not [p for p in tmp_path.iterdir() if p.name.startswith(".")]


def test_report_records_the_defaults_of_the_rule(tmp_path):
    inputs = _write_inputs(tmp_path)
    out = tmp_path / "merged"
    assert (
        main(
            [
                "merge",
                "--method",
                "geometric_median",
                "--set",
                "method.max_iter=7",
                "--quiet",
                "--out",
                str(out),
                *inputs,
            ]
        )
        == 0
    )
    report = json.loads((out / "merge_report.json").read_text())
    assert report["params"]["max_iter"] == 7 and report["params_given"] == ["max_iter"]
    assert len(report["params"]) > 1  # the defaults beside it
    assert json.loads((out / "config.json").read_text())["torch_dtype"] == "float32"


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_an_interrupt_removes_the_partial_output_and_says_so(tmp_path, capsys, monkeypatch, signum):
    inputs = _write_inputs(tmp_path)
    out = tmp_path / "merged"
    real = merge_engine._Run.merge_pass

    def interrupted(self, *args, **kw):
        os.kill(os.getpid(), signum)  # arrives in the middle of the pass, as from another process
        return real(self, *args, **kw)

    monkeypatch.setattr(merge_engine._Run, "merge_pass", interrupted)
    before = sorted(p.name for p in tmp_path.iterdir())
    code = main(["merge", "--method", "median", "--quiet", "--out", str(out), *inputs])
    assert code == 128 + signum
    err = capsys.readouterr().err
    assert f"stopped by {signal.Signals(signum).name}; the partial output was removed" in err
    assert "--resume" not in err
    assert sorted(p.name for p in tmp_path.iterdir()) == before  # no hidden temporary folder left


def test_pickles_a_single_input_and_mismatched_dtypes_are_refused_in_one_line(tmp_path, capsys):
    inputs = _write_inputs(tmp_path)
    out = str(tmp_path / "merged")
    bin_dir = tmp_path / "torch_model"
    bin_dir.mkdir()
    (bin_dir / "pytorch_model.bin").write_bytes(b"\x80\x02")
    cases = [
        ([*inputs, str(bin_dir)], "pytorch_model.bin is a PyTorch pickle"),
        ([*inputs, str(bin_dir / "pytorch_model.bin")], "pytorch_model.bin is a PyTorch pickle"),
        (inputs[:1], "a merge needs at least 2"),
    ]
    for given, pattern in cases:
        assert main(["merge", "--method", "mean", "--quiet", "--out", out, *given]) == 2
        err = capsys.readouterr().err.strip()
        assert "\n" not in err and pattern in err, err
        words = err.replace(":", " ").split()
        assert all(a != b for a, b in zip(words, words[1:], strict=False)), err  # no word said twice
    half = tmp_path / "half"
    io.save_safetensors(
        {k: v.astype(ml_dtypes.bfloat16) for k, v in io.flatten(io.load_safetensors(inputs[0])).items()}, half
    )
    assert main(["merge", "--method", "mean", "--quiet", "--out", out, *inputs[1:], str(half)]) == 2
    assert "give --dtype" in capsys.readouterr().err
    assert (
        main(
            [
                "merge",
                "--method",
                "mean",
                "--dtype",
                "float32",
                "--quiet",
                "--out",
                out,
                *inputs[1:],
                str(half),
            ]
        )
        == 0
    )


def test_config_from_gives_the_model_files_of_another_folder(tmp_path):
    inputs = _write_inputs(tmp_path)
    src = tmp_path / "model_files"
    src.mkdir()
    (src / "config.json").write_text(json.dumps({"model_type": "toy", "dtype": "float32"}))
    (src / "tokenizer.json").write_text("{}")
    out = tmp_path / "merged"
    argv = ["merge", "--method", "mean", "--dtype", "bfloat16", "--config-from", str(src), "--quiet"]
    assert main([*argv, "--out", str(out), *inputs]) == 0
    config = json.loads((out / "config.json").read_text())
    assert config["dtype"] == config["torch_dtype"] == "bfloat16"
    assert (out / "tokenizer.json").read_text() == "{}"


def test_a_tied_copy_stored_by_the_first_input_only_is_read_from_its_source_elsewhere(tmp_path):
    rng = np.random.default_rng(1)
    trees = [
        {"emb": rng.normal(size=(6, 4)).astype(np.float32), "b": np.ones(4, np.float32)} for _ in range(3)
    ]
    trees[0]["head"] = trees[0]["emb"].copy()  # the first input stores its tied head
    inputs = [str(io.save_safetensors(t, tmp_path / f"t{i}.safetensors")) for i, t in enumerate(trees)]
    out = tmp_path / "merged"
    assert main(["merge", "--method", "median", "--quiet", "--out", str(out), *inputs]) == 0
    got = io.load_safetensors(out)
    want = np.median(np.stack([t["emb"] for t in trees]), axis=0)
    np.testing.assert_array_equal(got["head"], want)  # the first input's convention, still tied
    np.testing.assert_array_equal(got["emb"], want)
    trees[1]["other"] = trees[1]["b"] + 1  # not a copy of anything: refused by name
    io.save_safetensors(trees[1], tmp_path / "t1.safetensors", overwrite=True)
    assert main(["merge", "--method", "median", "--quiet", "--out", str(tmp_path / "m2"), *inputs]) == 2
