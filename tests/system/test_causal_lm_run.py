"""``meta-consensus run`` with ``task.name = "causal_lm"`` on tiny models written by transformers.

* a full fine-tuning run (hierarchical, convexity, local and soup nodes, a label-flipping node,
  the median vote and the chunked mixture-NLL weights) and a LoRA run (targets named as PEFT names
  them) end to end: the table prints the perplexity of the base, the nodes and the consensus per
  domain, metrics.jsonl holds them, task.json records what an export needs;
* an interrupted LoRA run resumes to the uninterrupted run's consensus bit for bit;
* the smollm2 preset's shape on a tiny model (fast), and on SmolLM2 itself when it is cached (slow);
* a user's mistakes with the model, the tokenizer, the text or the LoRA targets: one line, exit 2,
  nothing written.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import numpy as np
import pytest
from causal_lm_helpers import corpus, model_folder
from system_helpers import snapshot

from meta_consensus import cli, config
from meta_consensus.run import MetaConsensus

pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("tokenizers")

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return model_folder(tmp_path_factory.mktemp("tiny_llama"))


@pytest.fixture(scope="module")
def text(tmp_path_factory):
    return corpus(tmp_path_factory.mktemp("corpus"))


def _options(folder, text, **changes) -> str:
    opts = dict(
        model=str(folder), text=text, context=16, windows_per_node=12, general_windows=8,
        heldout_windows=4, test_windows=8,
    )  # fmt: skip
    opts.update(changes)
    return "task.options=" + _toml(opts)


def _toml(value) -> str:
    """A TOML inline value (tables with bare keys)."""
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k} = {_toml(v)}" for k, v in value.items()) + "}"
    if isinstance(value, list):
        return "[" + ", ".join(_toml(v) for v in value) + "]"
    return json.dumps(value)


def _sets(*items: str) -> list[str]:
    out = []
    for item in items:
        out += ["--set", item]
    return out


COMMON = [
    "task.name=causal_lm",
    "rounds=1",
    "nodes.count=4",
    "nodes.local_steps=2",
    "nodes.batch_size=2",
    "nodes.learning_rate=0.001",
    "baseline_fedavg=false",
    "dp.enabled=false",
]
LORA = [
    "vote.server_step=0",  # LoRA runs merge adapters only (the default's server step is refused)
    "nodes.strategies=local",
    "nodes.lora={rank = 2, alpha = 4.0, targets = ['q_proj', 'v_proj']}",
    "byzantine.nodes=[]",
    "vote.rule=multi_krum",
    "vote.num_byzantine=0",
    "weights.objective=uniform",
]


def _run(tmp_path, capsys, *overrides: str) -> tuple[int, str, str]:
    code = cli.main(["run", "--quiet", *_sets(f"output_dir={tmp_path}", *COMMON, *overrides)])
    out = capsys.readouterr()
    return code, out.out, out.err


@pytest.mark.slow
def test_full_and_lora_runs_print_the_perplexity_per_domain_and_record_the_model(
    tmp_path, capsys, folder, text
):
    full = [
        "name=full",
        _options(folder, text),
        "nodes.strategies=['hierarchical', 'convexity', 'local', 'soup']",
        "nodes.local_steps=4",
        "byzantine.nodes=[3]",
        "byzantine.attack=label_flip",
        "vote.rule=median",
        "weights.objective=mixture_nll",
    ]
    code, out, err = _run(tmp_path, capsys, *full)
    assert code == 0, err
    assert "test ppl" in out and "base model (before round 1)" in out
    for row in ("test perplexity by domain", "base model", "node 3 (soup + label_flip", "meta-consensus"):
        assert row in out
    line = json.loads((tmp_path / "full" / "metrics.jsonl").read_text().splitlines()[0])
    assert line["ok"] and set(line["base_metrics"]) >= {"perplexity", "perplexity/code", "perplexity/prose"}
    assert len(line["node_metrics"]["perplexity/prose"]) == 4
    m = line["consensus_metrics"]
    assert m["perplexity"] == pytest.approx(np.exp(line["consensus_loss"]), rel=1e-5)
    # The attacked node's own domain (code, i % 2 == 1 -> prose) is where flipping hurts it most.
    assert line["node_metrics"]["perplexity/prose"][3] > line["base_metrics"]["perplexity/prose"]
    record = json.loads((tmp_path / "full" / "task.json").read_text())
    assert record["model_folder"] == str(folder) and record["domains"] == ["code", "prose"]
    assert record["model_type"] == "llama" and record["lora"] is None

    code, out, err = _run(tmp_path, capsys, "name=lora", _options(folder, text), *LORA)
    assert code == 0, err
    assert "test perplexity by domain" in out
    lora = json.loads((tmp_path / "lora" / "task.json").read_text())["lora"]
    assert lora["target_modules"] == ["q_proj", "v_proj"] and lora["rank"] == 2
    assert sorted(lora["target_paths"]) == [
        f"model/layers/{i}/self_attn/{m}_proj/kernel" for i in range(2) for m in ("q", "v")
    ]
    from consensus.io import load_safetensors

    saved = load_safetensors(tmp_path / "lora" / "consensus.safetensors")
    assert set(saved) == set(lora["target_paths"])  # the consensus of a LoRA run is the adapter


@pytest.mark.slow
def test_an_interrupted_lora_run_resumes_bit_for_bit(tmp_path, folder, text):
    flags = [
        *COMMON,
        *LORA,
        _options(folder, text),
        "rounds=2",
        "checkpoint_every=1",
        "nodes.strategies=['hierarchical', 'local', 'local', 'local']",
    ]
    whole = MetaConsensus(
        config.load(None, [*flags, f"output_dir={tmp_path}", "name=whole"]), progress=False
    ).train()
    cfg = config.load(None, [*flags, f"output_dir={tmp_path}", "name=cut"])
    MetaConsensus(cfg, progress=False).train(max_rounds=1)
    resumed = MetaConsensus(cfg, progress=False).train(resume=True)
    import jax

    for a, b in zip(
        jax.tree.leaves(whole.consensus_params), jax.tree.leaves(resumed.consensus_params), strict=True
    ):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert resumed.history[-1].consensus_metrics == whole.history[-1].consensus_metrics
    assert resumed.history[0].base_metrics == whole.history[0].base_metrics != {}


def test_the_smollm2_preset_is_four_honest_lora_nodes_with_multi_krum(tmp_path):
    cfg = config.load(preset="smollm2")
    assert config.load(ROOT / "configs" / "smollm2.toml") == cfg
    assert cfg.task.name == "causal_lm" and cfg.task.options["model"] == "smollm2"
    assert cfg.nodes.count == 4 and cfg.byzantine.nodes == () and cfg.vote.rule == "multi_krum"
    lora = cfg.nodes.lora
    assert lora is not None and lora.targets == ("q_proj", "v_proj") and lora.pretrain_steps == 0


@pytest.mark.slow
def test_the_smollm2_preset_shape_runs_on_a_tiny_model(tmp_path, capsys, folder, text):
    sets = [
        f"output_dir={tmp_path}",
        "rounds=1",
        "checkpoint_every=1",
        "nodes.local_steps=2",
        _options(folder, text),
    ]
    assert cli.main(["run", "--quiet", "--preset", "smollm2", *_sets(*sets)]) == 0
    out = capsys.readouterr().out
    assert "test perplexity by domain" in out and "node 3 (local)" in out


@pytest.mark.slow
def test_the_smollm2_preset_on_the_real_model(tmp_path, capsys):
    from strategies.models import hub

    if hub.cached("smollm2") is None:
        if os.environ.get("CI"):
            pytest.fail("CI must fetch smollm2 first (meta-consensus models fetch smollm2)")
        pytest.skip("smollm2 is not cached (meta-consensus models fetch smollm2)")
    sets = [f"output_dir={tmp_path}", "rounds=1", "nodes.local_steps=2", "checkpoint_every=0"]
    assert cli.main(["run", "--quiet", "--preset", "smollm2", *_sets(*sets)]) == 0
    out = capsys.readouterr().out
    assert "test perplexity by domain" in out and "concurrency" in out
    line = json.loads((tmp_path / "smollm2" / "metrics.jsonl").read_text().splitlines()[0])
    # A pretrained model predicts code far better than chance (perplexity << the 49,152 vocabulary).
    assert line["base_metrics"]["perplexity"] < 100
    assert line["consensus_metrics"]["perplexity"] < line["base_metrics"]["perplexity"] * 1.05


def _sharded(folder: Path, dest: Path) -> Path:
    """``folder``'s model saved in several safetensors shards with their index."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(folder)
    model.save_pretrained(dest, max_shard_size="40KB")
    shutil.copy(folder / "tokenizer.json", dest / "tokenizer.json")
    return dest


def test_mistakes_with_the_model_or_the_text_are_one_line_and_leave_nothing(tmp_path, capsys, folder, text):
    bad = tmp_path / "bad"
    bad.mkdir()
    odd = shutil.copytree(folder, bad / "odd")
    (odd / "config.json").write_text(
        json.dumps({**json.loads((odd / "config.json").read_text()), "model_type": "rwkv"})
    )
    no_config = shutil.copytree(folder, bad / "no_config")
    (no_config / "config.json").unlink()
    no_tokenizer = shutil.copytree(folder, bad / "no_tokenizer")
    (no_tokenizer / "tokenizer.json").unlink()
    shards = _sharded(folder, bad / "shards")
    index = json.loads((shards / "model.safetensors.index.json").read_text())
    missing = sorted(set(index["weight_map"].values()))[-1]
    (shards / missing).unlink()
    (bad / "empty.txt").write_text("")
    out_dir = tmp_path / "runs"
    cases = [
        (_options(odd, text), "rwkv"),
        (_options(no_config, text), "has no config.json"),
        (_options(shards, text), missing),
        (_options(no_tokenizer, text), "has no tokenizer.json"),
        (_options(folder, {"a": [str(bad / "missing.txt")]}), "missing.txt' does not exist"),
        (_options(folder, [str(bad / "empty.txt")]), "empty.txt' is empty"),
        (
            _options(folder, text, context=65),
            "context=65 is longer than the model's max_position_embeddings=64",
        ),
    ]
    lora_cases = [
        ("nodes.lora={targets = ['x_proj']}", "target 'x_proj' matches no kernel"),
        ("nodes.lora={targets = ['q_proj'], pretrain_steps = 5}", "starts from a pretrained model; use 0"),
    ]
    capsys.readouterr()  # transformers' progress bars while the shards were written
    before = snapshot(tmp_path)
    for option, message in cases + [(_options(folder, text), m) for _, m in lora_cases]:
        extra = [o for o, m in lora_cases if m == message]
        flags = [option, "nodes.strategies=local", "byzantine.nodes=[]", "weights.objective=uniform"]
        lora = ["vote.rule=multi_krum", "vote.num_byzantine=0", "vote.server_step=0"]
        flags += [extra[0], *lora] if extra else ["vote.rule=median"]
        code, _, err = _run(out_dir, capsys, *flags)
        assert code == 2, (message, err)
        assert message in err and len(err.strip().splitlines()) == 1, err
    code, _, err = _run(
        out_dir,
        capsys,
        _options(folder, text),
        "weights.objective=quadratic",
        "nodes.strategies=local",
        "byzantine.nodes=[]",
        "vote.rule=median",
    )
    assert code == 2 and "objectives for it: [" in err and "'mixture_nll'" in err
    assert snapshot(tmp_path) == before and not out_dir.exists()
