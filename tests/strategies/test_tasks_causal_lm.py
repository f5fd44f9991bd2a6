"""The causal_lm task on tiny models written by transformers, against independent recomputations.

* windows: every node's windows are its own documents' tokens (re-tokenized here with the
  ``tokenizers`` package from the files and JSONL lines), node i on domain i % D, no document of
  one node in another node's or a shared pool;
* metrics: loss, perplexity and accuracy, overall and per domain, equal a float64 recomputation
  from the transformers model's logits, chunked or not, with masked rows left out; the mixture
  objective's target probabilities too;
* LoRA: bare targets select the kernels PEFT wraps for the same target_modules;
* mistakes in the model folder, the tokenizer or the text are one-line TaskErrors.
"""

from __future__ import annotations

import functools
import json
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from causal_lm_helpers import EOS, corpus, model_folder, task_options

from strategies.lora import select_targets
from strategies.registry import build_task
from strategies.tasks import causal_lm as clm
from strategies.tasks.checks import TaskError

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
pytest.importorskip("tokenizers")


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return model_folder(tmp_path_factory.mktemp("tiny_llama"))


@pytest.fixture(scope="module")
def text(tmp_path_factory):
    return corpus(tmp_path_factory.mktemp("corpus"))


@pytest.fixture(scope="module")
def task(folder, text):
    return build_task("causal_lm", task_options(folder, text))


def _doc_text(name: str) -> str:
    """A document's text read here: ``path`` (a whole file) or ``path:line`` (a JSONL record)."""
    if ".jsonl:" in name:
        path, line = name.rsplit(":", 1)
        with open(path, encoding="utf-8") as fh:
            return json.loads(fh.readlines()[int(line) - 1])["text"]
    with open(name, "rb") as fh:
        return fh.read().decode("utf-8", errors="replace")


def test_windows_are_the_nodes_own_documents_retokenized(task, folder):
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(folder / "tokenizer.json"))
    data = task.splits(4, seed=3)
    names = data.meta["documents"]
    assert data.group_names == ("code", "prose") and task.eos_token_id == EOS
    for i in range(4):
        docs = data.meta["node_docs"][i]
        assert {task.documents[j].domain for j in docs} == {i % 2}
        assert {task.documents[j].role for j in docs} == {"private"}
        assert (data.train["domain"][i] == i % 2).all() and data.node_groups[i].tolist() == [
            i % 2 == 0,
            i % 2,
        ]
        # The node's stream, recomputed: every document's tokens then <eos>, in document order.
        pieces = [tok.encode(_doc_text(names[j]), add_special_tokens=False).ids + [EOS] for j in docs]
        starts = np.cumsum([0] + [len(p) for p in pieces])[:-1]
        stream = np.concatenate(pieces)
        for r, wid in enumerate(data.meta["example_ids"][i]):
            doc, off = int(wid) >> 32, int(wid) & 0xFFFFFFFF
            at = starts[list(docs).index(doc)] + off
            window = stream[at : at + task.context + 1]
            np.testing.assert_array_equal(data.train["x"][i, r], window[:-1])
            np.testing.assert_array_equal(data.train["y"][i, r], window[1:])
    # The test pool: an equal share of windows per domain.
    assert np.bincount(data.test["domain"]).tolist() == [5, 5]
    assert np.bincount(data.general_groups).tolist() == [4, 4]


def test_no_node_sees_another_nodes_documents(task):
    data = task.splits(4, seed=0)
    owned = [set(d.tolist()) for d in data.meta["node_docs"]]
    for a in range(4):
        for b in range(a + 1, 4):
            assert not owned[a] & owned[b]
    general_docs = {int(g) >> 32 for g in data.meta["general_ids"]}
    assert general_docs and not general_docs & set().union(*owned)
    assert {task.documents[j].role for j in general_docs} == {"general"}
    # A fit phase draws only the node's own rows, or the public pool's.
    for ids, own in zip(data.drawn_ids(data.own()), owned, strict=True):
        assert {int(x) >> 32 for x in ids} <= own
    # A process hosting nodes 2 and 3 reads the same windows for them (a node's data is its own).
    part = task.splits(4, seed=0, process_index=1, process_count=2)
    np.testing.assert_array_equal(part.train["x"], data.train["x"][2:])
    assert [d.tolist() for d in part.meta["node_docs"]] == [d.tolist() for d in data.meta["node_docs"][2:]]


@functools.cache
def _hf_model(folder):
    return transformers.AutoModelForCausalLM.from_pretrained(folder, torch_dtype=torch.float32).eval()


def _reference(folder, batch):
    """Per-token NLL and correctness in float64 from the transformers model's logits."""
    model = _hf_model(folder)
    with torch.no_grad():
        logits = model(torch.as_tensor(np.asarray(batch["x"]), dtype=torch.long)).logits.double().numpy()
    top = logits.max(-1, keepdims=True)
    logp = logits - top - np.log(np.exp(logits - top).sum(-1, keepdims=True))
    y = np.asarray(batch["y"])
    nll = -np.take_along_axis(logp, y[..., None], -1)[..., 0]
    correct = logits.argmax(-1) == y
    return nll, correct


@pytest.mark.parametrize("chunk_rows", [pytest.param(None, marks=pytest.mark.slow), 3])
def test_metrics_equal_a_float64_recomputation_per_domain(task, folder, monkeypatch, chunk_rows):
    if chunk_rows is not None:  # chunks of 3 rows: 10 test rows give a padded last chunk
        monkeypatch.setattr(clm, "METRICS_LOGITS", chunk_rows * task.context * task.vocab_size)
        assert task.chunk_rows() == 3
    data = task.splits(4, seed=0)
    batch = dict(data.test)
    batch["mask"] = np.ones(len(batch["x"]), bool)
    batch["mask"][[1, 7]] = False  # masked rows count in no metric
    got = {k: float(v) for k, v in jax.jit(task.metrics)(task.init(None), batch).items()}
    nll, correct = _reference(folder, batch)
    keep = batch["mask"]
    for name, rows in (
        ("", keep),
        *((f"/{d}", keep & (batch["domain"] == k)) for k, d in enumerate(task.domains)),
    ):
        loss = nll[rows].mean()
        assert got[f"loss{name}"] == pytest.approx(loss, rel=1e-5)
        assert got[f"perplexity{name}"] == pytest.approx(np.exp(loss), rel=1e-5)
        assert got[f"accuracy{name}"] == pytest.approx(correct[rows].mean(), abs=1e-6)
    loss = float(task.loss(task.init(None), batch))
    assert loss == pytest.approx(nll[keep].mean(), rel=1e-5)
    # The mixture objective's probabilities: p(y_t) of every token of every row.
    probs = np.asarray(task.target_probs(task.init(None), data.heldout))
    ref, _ = _reference(folder, data.heldout)
    np.testing.assert_allclose(probs, np.exp(-ref).reshape(-1), rtol=1e-5)


def test_a_domain_without_rows_has_nan_metrics_and_flip_labels_reverses_the_vocab(task):
    data = task.splits(4, seed=0)
    only_code = {k: v[data.test["domain"] == 0] for k, v in data.test.items()}
    got = task.metrics(task.init(None), only_code)
    assert np.isfinite(float(got["perplexity/code"])) and np.isnan(float(got["perplexity/prose"]))
    flipped = task.flip_labels(only_code)
    np.testing.assert_array_equal(np.asarray(flipped["y"]), task.vocab_size - 1 - only_code["y"])


def test_init_is_the_checkpoint_and_the_axes_follow_the_params(task, folder):
    params = task.init(jax.random.key(5))
    ref = transformers.AutoModelForCausalLM.from_pretrained(folder).state_dict()
    np.testing.assert_array_equal(
        np.asarray(params["model"]["layers"]["1"]["self_attn"]["q_proj"]["kernel"]),
        ref["model.layers.1.self_attn.q_proj.weight"].numpy().T,
    )
    axes = task.logical_axes()
    assert jax.tree.structure(jax.tree.map(np.ndim, params)) == jax.tree.structure(
        jax.tree.map(len, axes, is_leaf=lambda a: isinstance(a, tuple))
    )


def test_bare_lora_targets_select_what_peft_wraps(task, folder):
    peft = pytest.importorskip("peft")
    model = transformers.AutoModelForCausalLM.from_pretrained(folder)
    wrapped = peft.get_peft_model(model, peft.LoraConfig(r=2, target_modules=["q_proj", "v_proj"]))
    names = {
        n.removeprefix("base_model.model.").replace(".", "/") + "/kernel"
        for n, m in wrapped.named_modules()
        if isinstance(m, peft.tuners.lora.LoraLayer)
    }
    assert set(select_targets(task.init(None), ["q_proj", "v_proj"])) == names
    dotted = select_targets(task.init(None), ["self_attn.q_proj"])
    assert set(dotted) == {p for p in names if "q_proj" in p}
    assert len(select_targets(task.init(None), [r"layers/0/.*proj/kernel$"])) == 7  # a regex still works


@pytest.mark.slow
@pytest.mark.parametrize("family", ["gpt2"])
def test_gpt2_folders_load_and_their_metrics_match(tmp_path, text, family):
    folder = model_folder(tmp_path / family, family=family)
    task = build_task("causal_lm", task_options(folder, text))
    data = task.splits(2, seed=0)
    nll, _ = _reference(folder, data.test)
    assert float(task.metrics(task.init(None), data.test)["loss"]) == pytest.approx(nll.mean(), rel=1e-5)


def test_mistakes_are_one_line_task_errors(tmp_path, folder, text):
    def fails(match, **changes):
        options = {**task_options(folder, text), **changes}
        with pytest.raises(TaskError, match=match) as e:
            build_task("causal_lm", options)
        assert "\n" not in str(e.value)

    fails("context=65 is longer than the model's max_position_embeddings=64", context=65)
    fails("does not exist", text={"a": [str(tmp_path / "missing.txt")]})
    fails("matches no file", text=[str(tmp_path / "nothing" / "*.txt")])
    (tmp_path / "empty.txt").write_text("")
    fails("is empty", text=[str(tmp_path / "empty.txt")])
    (tmp_path / "bad.jsonl").write_text('{"text": "fine"}\n{"body": "no text"}\n')
    fails(r'bad.jsonl:2 has no string "text" field', text=[str(tmp_path / "bad.jsonl")])
    few = tmp_path / "few.jsonl"
    few.write_text('{"text": "one"}\n{"text": "two"}\n')
    fails("domain 'few' has 2 non-empty document", text=[str(few)])
    fails("fewer than the 2 domains", test_windows=1)
    fails("not a folder", model=str(tmp_path / "no" / "such"))
    no_tok = tmp_path / "no_tok"
    shutil.copytree(folder, no_tok)
    (no_tok / "tokenizer.json").unlink()
    fails("has no tokenizer.json", model=str(no_tok))
    no_cfg = tmp_path / "no_cfg"
    shutil.copytree(folder, no_cfg)
    (no_cfg / "config.json").unlink()
    fails("has no config.json", model=str(no_cfg))
    odd = tmp_path / "odd"
    shutil.copytree(folder, odd)
    cfg = json.loads((odd / "config.json").read_text())
    (odd / "config.json").write_text(json.dumps({**cfg, "model_type": "mamba"}))
    fails("mamba", model=str(odd))
    task = build_task("causal_lm", task_options(folder, text))
    with pytest.raises(TaskError, match="domain 'code' has 2 private documents for its 3 nodes"):
        task.splits(6, seed=0)


def test_apply_refuses_more_tokens_than_the_context(task):
    with pytest.raises(ValueError, match="more than context=16"):
        task.apply(task.init(None), jnp.zeros((1, 17), jnp.int32))
