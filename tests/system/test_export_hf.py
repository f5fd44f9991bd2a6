"""``meta-consensus export``: a run's consensus back to Hugging Face (a model folder, a PEFT adapter).

* a full fine-tuning consensus exports as a folder that ``AutoModelForCausalLM.from_pretrained``
  loads with logits equal to the package's own on the consensus params (Llama and GPT-2);
* a LoRA consensus exports as the merged model and as a PEFT adapter that
  ``PeftModel.from_pretrained`` puts on the source model with the same logits (GPT-2's Conv1D
  targets included, which PEFT handles with ``fan_in_fan_out``);
* the real thing: a causal_lm run (full and LoRA) on a transformers-written model, exported by the
  command (slow tier);
* mistakes are one line and exit 2, and nothing is replaced.

The fast tests build the run folder's two files by hand (``consensus.safetensors`` and
``task.json``, what a finished run leaves), so they check the exporter alone.
"""

from __future__ import annotations

import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from causal_lm_helpers import corpus, model_folder

from consensus import io
from meta_consensus import cli

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
pytest.importorskip("tokenizers")

T = 24  # tokens per test sequence (the tiny models' max_position_embeddings is 64)


def _tokens(seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 300, (2, T)).astype(np.int32)


def _torch_logits(model, tokens: np.ndarray) -> np.ndarray:
    with torch.no_grad():
        return model(torch.from_numpy(tokens.astype(np.int64))).logits.float().numpy()


def _jax_logits(folder: Path, params, tokens: np.ndarray) -> np.ndarray:
    from strategies import models

    lm, _ = models.load(folder)
    return np.asarray(lm.apply(params, jnp.asarray(tokens)))


def _perturbed(params, seed: int, scale: float = 0.05):
    leaves, treedef = jax.tree.flatten(params)
    keys = jax.random.split(jax.random.key(seed), len(leaves))
    out = [x + scale * jax.random.normal(k, x.shape, x.dtype) for k, x in zip(keys, leaves, strict=True)]
    return jax.tree.unflatten(treedef, out)


def _fake_run(run: Path, folder: Path, flat: dict, lora: dict | None = None) -> Path:
    run.mkdir(parents=True)
    tree = io.unflatten({k: np.asarray(v) for k, v in flat.items()})
    io.save_safetensors(tree, run / "consensus.safetensors")
    record = {"task": "causal_lm", "model_folder": str(folder), "lora": lora}
    (run / "task.json").write_text(json.dumps(record))
    return run


@pytest.mark.parametrize("family", ["llama", pytest.param("gpt2", marks=pytest.mark.slow)])
def test_a_full_consensus_exports_a_folder_that_transformers_loads_with_equal_logits(tmp_path, family):
    from strategies import models

    folder = model_folder(tmp_path / "base", family=family)
    _, base = models.load(folder)
    consensus = _perturbed(base, seed=1)  # a consensus that is not the base
    run = _fake_run(tmp_path / "runs" / "full", folder, io.flatten(consensus))

    assert cli.main(["export", str(run)]) == 0
    out = run / "hf"
    assert (out / "tokenizer.json").read_bytes() == (folder / "tokenizer.json").read_bytes()
    hf = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    tokens = _tokens()
    want = _jax_logits(folder, consensus, tokens)
    np.testing.assert_allclose(_torch_logits(hf, tokens), want, atol=1e-5, rtol=0)
    # and the exported weights are the consensus bit for bit
    _, back = models.load(out)
    for (k, x), (_, y) in zip(io.flatten(consensus).items(), io.flatten(back).items(), strict=True):
        assert np.array_equal(np.asarray(x), np.asarray(y)), k


def _lora_factors(targets: dict[str, tuple[int, int]], rank: int, seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    flat = {}
    for path, (fan_in, fan_out) in targets.items():
        flat[f"{path}.a"] = (rng.standard_normal((fan_in, rank)) / np.sqrt(fan_in)).astype(np.float32)
        flat[f"{path}.b"] = (0.1 * rng.standard_normal((rank, fan_out))).astype(np.float32)
    return flat


@pytest.mark.parametrize(
    ("family", "modules"),
    [("llama", ("q_proj", "v_proj", "down_proj")), ("gpt2", ("c_attn", "c_fc"))],
)
def test_a_lora_consensus_exports_a_peft_adapter_and_the_merged_model(tmp_path, family, modules):
    peft = pytest.importorskip("peft")
    from strategies import models

    folder = model_folder(tmp_path / "base", family=family)
    _, base = models.load(folder)
    flat_base = io.flatten(base)
    targets = {
        k.replace(".", "/"): tuple(np.shape(v))
        for k, v in flat_base.items()
        if k.endswith(".kernel") and k.split(".")[-2] in modules
    }
    assert len(targets) == 2 * len(modules)
    rank, alpha = 2, 6.0
    flat = _lora_factors(targets, rank, seed=3)
    lora = {"rank": rank, "alpha": alpha, "dropout": 0.0, "adapter_method": "fedit"}
    run = _fake_run(tmp_path / "runs" / "lora", folder, flat, lora)

    assert cli.main(["export", str(run)]) == 0
    # The reference: W + (alpha / r) a b in float64 on every target, the package's forward pass.
    merged = {k: np.asarray(v, np.float64) for k, v in flat_base.items()}
    for path in targets:
        key = path.replace("/", ".")
        merged[key] = merged[key] + (alpha / rank) * (
            flat[f"{path}.a"].astype(np.float64) @ flat[f"{path}.b"].astype(np.float64)
        )
    want = _jax_logits(folder, io.unflatten({k: v.astype(np.float32) for k, v in merged.items()}), _tokens())

    hf = transformers.AutoModelForCausalLM.from_pretrained(run / "hf", dtype=torch.float32).eval()
    np.testing.assert_allclose(_torch_logits(hf, _tokens()), want, atol=1e-5, rtol=0)

    config = json.loads((run / "adapter" / "adapter_config.json").read_text())
    assert sorted(config["target_modules"]) == sorted(modules)
    assert (config["r"], config["lora_alpha"]) == (rank, alpha)
    source = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    adapted = peft.PeftModel.from_pretrained(source, run / "adapter").eval()
    np.testing.assert_allclose(_torch_logits(adapted, _tokens()), want, atol=1e-5, rtol=0)


def test_export_mistakes_are_one_line_and_replace_nothing(tmp_path, capsys):
    from strategies import models

    # not a run folder / a run of another task / an unfinished run
    assert cli.main(["export", str(tmp_path / "nothing")]) == 2
    assert "no such run folder" in capsys.readouterr().err
    other = tmp_path / "digits_run"
    other.mkdir()
    (other / "consensus.safetensors").write_bytes(b"")
    assert cli.main(["export", str(other)]) == 2
    err = capsys.readouterr().err
    assert "only runs of a Hugging Face model" in err and len(err.strip().splitlines()) == 1

    folder = model_folder(tmp_path / "base")
    _, base = models.load(folder)
    unfinished = tmp_path / "unfinished"
    unfinished.mkdir()
    (unfinished / "task.json").write_text(json.dumps({"model_folder": str(folder), "lora": None}))
    assert cli.main(["export", str(unfinished)]) == 2
    assert "has not finished" in capsys.readouterr().err

    run = _fake_run(tmp_path / "runs" / "done", folder, io.flatten(base))
    (run / "hf").mkdir()
    (run / "hf" / "mine.txt").write_text("keep me")
    assert cli.main(["export", str(run)]) == 2
    err = capsys.readouterr().err
    assert "never replaces" in err and len(err.strip().splitlines()) == 1
    assert (run / "hf" / "mine.txt").read_text() == "keep me"
    # another --out works
    assert cli.main(["export", str(run), "--out", str(tmp_path / "elsewhere")]) == 0
    assert (tmp_path / "elsewhere" / "hf" / "config.json").is_file()


@pytest.mark.slow
def test_runs_of_the_causal_lm_task_export_what_transformers_and_peft_load(tmp_path, capsys):
    """End to end: full and LoRA causal_lm runs on a tiny Llama, exported by the command."""
    peft = pytest.importorskip("peft")
    from strategies import models

    folder = model_folder(tmp_path / "base")
    text = corpus(tmp_path / "corpus")
    opts = (
        "task.options={model = " + json.dumps(str(folder)) + ", text = {code = " + json.dumps(text["code"])
        + ", prose = " + json.dumps(text["prose"]) + "}, context = 16, windows_per_node = 12, "
        "general_windows = 8, heldout_windows = 4, test_windows = 8}"
    )  # fmt: skip
    common = [
        f"output_dir={tmp_path / 'runs'}", "task.name=causal_lm", opts, "rounds=1", "nodes.count=2",
        "nodes.strategies=local", "nodes.local_steps=2", "nodes.batch_size=2", "nodes.learning_rate=0.01",
        "baseline_fedavg=false", "byzantine.nodes=[]", "vote.rule=mean", "weights.objective=uniform",
        "vote.server_step=0",
    ]  # fmt: skip
    lora = ["nodes.lora={rank = 2, alpha = 4.0, targets = ['q_proj', 'v_proj']}"]
    tokens = _tokens()
    for name, extra in (("full", []), ("lora", lora)):
        argv = ["run", "--quiet"]
        for item in [*common, f"name={name}", *extra]:
            argv += ["--set", item]
        assert cli.main(argv) == 0, capsys.readouterr().err
        run = tmp_path / "runs" / name
        assert cli.main(["export", str(run)]) == 0
        printed = capsys.readouterr().out.strip().splitlines()
        assert printed[-1] == str(run / ("adapter" if name == "lora" else "hf"))
        hf = transformers.AutoModelForCausalLM.from_pretrained(run / "hf", dtype=torch.float32).eval()
        _, exported = models.load(run / "hf")
        np.testing.assert_allclose(
            _torch_logits(hf, tokens), _jax_logits(folder, exported, tokens), atol=1e-5, rtol=0
        )
        if name == "full":
            flat = io.flatten(io.load_safetensors(run / "consensus.safetensors"))
            for k, v in io.flatten(exported).items():
                assert np.array_equal(np.asarray(v), flat[k]), k
        else:
            source = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
            adapted = peft.PeftModel.from_pretrained(source, run / "adapter").eval()
            np.testing.assert_allclose(_torch_logits(adapted, tokens), _torch_logits(hf, tokens), atol=1e-5)
            # the run trained something: the merged model is not the source
            # The tiny random model's logits barely react to its attention weights, so check the
            # weights: every target moved by exactly (alpha / r) a b of the run's consensus adapter.
            _, src = models.load(folder)
            src_flat, out_flat = io.flatten(src), io.flatten(exported)
            adapter = io.flatten(io.load_safetensors(run / "consensus.safetensors"))
            targets = sorted({k.rsplit(".", 1)[0] for k in adapter})
            assert len(targets) == 4
            for path in targets:
                key = path.replace("/", ".")
                a, b = (adapter[f"{path}.{f}"].astype(np.float64) for f in "ab")
                delta = 2.0 * a @ b
                moved = np.asarray(out_flat[key], np.float64) - np.asarray(src_flat[key], np.float64)
                assert np.abs(delta).max() > 1e-3
                np.testing.assert_allclose(moved, delta, atol=1e-7, rtol=0)
            untouched = [k for k in src_flat if k not in {p.replace("/", ".") for p in targets}]
            assert all(np.array_equal(np.asarray(src_flat[k]), np.asarray(out_flat[k])) for k in untouched)
