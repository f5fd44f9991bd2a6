"""mergekit's six example configurations run unchanged (``meta-consensus merge --mergekit-config``).

The YAML files are copied from github.com/arcee-ai/mergekit ``examples/`` (linear.yml,
bio-merge.yml, gradient-slerp.yml, orcamini-platy-44layer.yml, ties.yml, arcee_fusion.yml) with the
model names replaced by tiny Llama-shaped stand-ins written here (4 layers, 16 wide) and the
passthrough's layer ranges scaled to them. Each output is checked against mergekit's formula in
numpy float64: float16 / bfloat16 outputs are the exactly rounded float64 merge up to one ulp.
"""

from __future__ import annotations

import json

import ml_dtypes
import numpy as np
import pytest
from safetensors.numpy import save_file

from consensus import io
from meta_consensus.cli import main

LAYERS = 4
SHAPES = {
    "self_attn.q_proj.weight": (16, 16),
    "self_attn.k_proj.weight": (16, 16),
    "self_attn.v_proj.weight": (16, 16),
    "self_attn.o_proj.weight": (16, 16),
    "mlp.gate_proj.weight": (32, 16),
    "mlp.up_proj.weight": (32, 16),
    "mlp.down_proj.weight": (16, 32),
    "input_layernorm.weight": (16,),
    "post_attention_layernorm.weight": (16,),
}
CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 16,
    "intermediate_size": 32,
    "num_hidden_layers": LAYERS,
    "num_attention_heads": 2,
    "num_key_value_heads": 2,
    "vocab_size": 64,
    "max_position_embeddings": 32,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": False,
    "torch_dtype": "float32",
}
NAMES = ["orca", "platypus", "wizard", "llama2"]  # the examples' models; llama2 is the ties base


def _tree(rng, like=None):
    shapes = {"model.embed_tokens.weight": (64, 16), "model.norm.weight": (16,), "lm_head.weight": (64, 16)}
    shapes |= {f"model.layers.{i}.{k}": s for i in range(LAYERS) for k, s in SHAPES.items()}
    return {
        k: (rng.normal(size=s) * 0.2 if like is None else like[k] + 0.05 * rng.normal(size=s)).astype(
            np.float32
        )
        for k, s in shapes.items()
    }


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("mk_models")
    rng = np.random.default_rng(0)
    base = _tree(rng)
    trees = {"llama2": base} | {n: _tree(rng, base) for n in NAMES[:3]}
    for name, tree in trees.items():
        (tmp / name).mkdir()
        save_file(tree, str(tmp / name / "model.safetensors"))
        (tmp / name / "config.json").write_text(json.dumps(CONFIG))
    return tmp, {n: {k: v.astype(np.float64) for k, v in t.items()} for n, t in trees.items()}


def _run(tmp, text, out, *extra):
    cfg = tmp / f"{out}.yml"
    cfg.write_text(text)
    assert main(["merge", "--quiet", "--mergekit-config", str(cfg), "--out", str(tmp / out), *extra]) == 0
    got = io.flatten(io.load_safetensors(tmp / out))
    return got, json.loads((tmp / out / "merge_report.json").read_text())


def _within_one_ulp(got, exact, dtype):
    """Every element is the exactly rounded value or its neighbour (one ulp of ``dtype``)."""
    rounded = exact.astype(dtype).astype(np.float64)
    info = ml_dtypes.finfo(dtype)
    ulp = 2.0 ** (np.floor(np.log2(np.maximum(np.abs(rounded), float(info.smallest_normal)))) - info.nmant)
    assert np.asarray(got).dtype == np.dtype(dtype)
    assert np.all(np.abs(np.asarray(got, np.float64) - rounded) <= ulp * 1.0001)


def _t(layer):
    """mergekit's position of a layer in its slice (4 layers: 0, 1/3, 2/3, 1)."""
    return layer / (LAYERS - 1)


def _grad(values, t):
    s = t * (len(values) - 1)
    i0 = int(s)
    i1 = min(len(values) - 1, i0 + 1)
    return (1 - (s - i0)) * values[i0] + (s - i0) * values[i1]


def _layer(key):
    parts = key.split(".")
    return int(parts[2]) if key.startswith("model.layers.") else None


def test_linear_example(models):
    tmp, m = models
    text = f"""models:
  - model: {tmp}/orca
    parameters:
      weight: 1.0
  - model: {tmp}/wizard
    parameters:
      weight: 0.3
  - model: {tmp}/platypus
    parameters:
      weight: 0.5
merge_method: linear
dtype: float16
"""
    got, _ = _run(tmp, text, "linear")
    for k, v in got.items():
        exact = (m["orca"][k] + 0.3 * m["wizard"][k] + 0.5 * m["platypus"][k]) / 1.8
        _within_one_ulp(v, exact, np.float16)


def _trim(d, density):
    if density >= 1:
        return d
    keep = np.zeros(d.size)
    keep[np.argsort(-np.abs(d).reshape(-1), kind="stable")[: max(1, int(density * d.size))]] = 1
    return d * keep.reshape(d.shape)


def _ties(base, xs, w, dens, normalize):
    wv = np.asarray(w).reshape((-1,) + (1,) * base.ndim)
    D = np.stack([_trim(x - base, d) for x, d in zip(xs, dens, strict=True)]) * wv
    mask = np.sign(D) == np.where(D.sum(0) >= 0, 1.0, -1.0)
    mixed = (D * mask).sum(0)
    if normalize:
        div = (wv * mask).sum(0)
        mixed = mixed / np.where(div == 0, 1.0, div)
    return base + mixed


def test_bio_merge_example_records_int8_mask(models):
    tmp, m = models
    text = f"""models:
  - model: {tmp}/orca
    parameters:
      density: 0.5
      weight: 0.5
  - model: {tmp}/platypus
    parameters:
      density: 0.5
      weight: 0.5
merge_method: ties
base_model: {tmp}/llama2
parameters:
  normalize: false
  int8_mask: true
dtype: float16
"""
    got, report = _run(tmp, text, "bio")
    for k, v in got.items():
        exact = _ties(m["llama2"][k], [m["orca"][k], m["platypus"][k]], [0.5, 0.5], [0.5, 0.5], False)
        _within_one_ulp(v, exact, np.float16)
    assert "parameters.int8_mask" in report["mergekit"]["keys_read"]
    assert "same" in report["mergekit"]["no_effect"]["parameters.int8_mask"]


def test_ties_example_gradients_and_per_model_densities(models):
    tmp, m = models
    text = f"""models:
  - model: {tmp}/orca
    parameters:
      density: [1, 0.7, 0.1] # density gradient
      weight: 1.0
  - model: {tmp}/platypus
    parameters:
      density: 0.5
      weight: [0, 0.3, 0.7, 1] # weight gradient
  - model: {tmp}/wizard
    parameters:
      density: 0.33
      weight:
        - filter: mlp
          value: 0.5
        - value: 0
merge_method: ties
base_model: {tmp}/llama2
parameters:
  normalize: true
  int8_mask: true
dtype: float16
"""
    got, report = _run(tmp, text, "ties")
    for k, v in got.items():
        layer = _layer(k)
        t = 0.0 if layer is None else _t(layer)
        dens = [_grad([1, 0.7, 0.1], t), 0.5, 0.33]
        w = [1.0, _grad([0, 0.3, 0.7, 1], t), 0.5 if "mlp" in k else 0.0]
        exact = _ties(m["llama2"][k], [m[n][k] for n in ("orca", "platypus", "wizard")], w, dens, True)
        _within_one_ulp(v, exact, np.float16)
    assert report["leaves"]["model.layers.1.mlp.up_proj.weight"]["params"]["density"] == pytest.approx(
        [0.8, 0.5, 0.33]
    )
    assert "parameters.int8_mask" in report["no_effect"]


def _slerp(t, a, b):
    ua, ub = a.reshape(-1) / np.linalg.norm(a), b.reshape(-1) / np.linalg.norm(b)
    dot = np.sum(ua * ub)
    if abs(dot) > 0.9995:
        return (1 - t) * a + t * b
    th = np.arccos(dot)
    return (np.sin((1 - t) * th) * a + np.sin(t * th) * b) / np.sin(th)


def test_gradient_slerp_example(models):
    tmp, m = models
    text = f"""slices:
  - sources:
      - model: {tmp}/orca
        layer_range: [0, {LAYERS}]
      - model: {tmp}/platypus
        layer_range: [0, {LAYERS}]
# or, the equivalent models: syntax:
# models:
#   - model: psmathur/orca_mini_v3_13b
#   - model: garage-bAInd/Platypus2-13B
merge_method: slerp
base_model: {tmp}/orca
parameters:
  t:
    - filter: self_attn
      value: [0, 0.5, 0.3, 0.7, 1]
    - filter: mlp
      value: [1, 0.5, 0.7, 0.3, 0]
    - value: 0.5 # fallback for rest of tensors
dtype: float16
"""
    got, _ = _run(tmp, text, "gslerp")
    for k, v in got.items():
        layer = _layer(k)
        tt = 0.0 if layer is None else _t(layer)
        t = (
            _grad([0, 0.5, 0.3, 0.7, 1], tt)
            if "self_attn" in k
            else _grad([1, 0.5, 0.7, 0.3, 0], tt)
            if "mlp" in k
            else 0.5
        )
        _within_one_ulp(v, _slerp(t, m["orca"][k], m["platypus"][k]), np.float16)


def test_passthrough_example_stacks_layers_bit_for_bit(models):
    tmp, m = models
    # orcamini-platy-44layer.yml: [0, 24] of 40 and [20, 40] of 40, here [0, 3] and [1, 4] of 4
    text = f"""slices:
  - sources:
    - model: {tmp}/orca
      layer_range: [0, 3]
  - sources:
    - model: {tmp}/platypus
      layer_range: [1, 4]
merge_method: passthrough
dtype: float16
"""
    got, report = _run(tmp, text, "frank")
    sources = [("orca", 0), ("orca", 1), ("orca", 2), ("platypus", 1), ("platypus", 2), ("platypus", 3)]
    assert report["layers"] == 6
    for out_layer, (name, layer) in enumerate(sources):
        for k in SHAPES:
            want = m[name][f"model.layers.{layer}.{k}"].astype(np.float16)
            np.testing.assert_array_equal(got[f"model.layers.{out_layer}.{k}"], want)
    np.testing.assert_array_equal(
        got["model.embed_tokens.weight"], m["orca"]["model.embed_tokens.weight"].astype(np.float16)
    )
    np.testing.assert_array_equal(got["lm_head.weight"], m["platypus"]["lm_head.weight"].astype(np.float16))
    assert not any(k.startswith("model.layers.6.") for k in got)
    config = json.loads((tmp / "frank" / "config.json").read_text())
    assert config["num_hidden_layers"] == 6 and config["torch_dtype"] == "float16"


@pytest.mark.slow
def test_passthrough_output_loads_in_transformers(models):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    tmp, m = models
    text = f"""slices:
  - sources:
    - model: {tmp}/orca
      layer_range: [0, 3]
  - sources:
    - model: {tmp}/platypus
      layer_range: [1, 4]
      parameters:
        scale:
          - filter: o_proj
            value: 0.5
          - value: 1.0
merge_method: passthrough
dtype: float32
"""
    _run(tmp, text, "frank32")
    model = transformers.AutoModelForCausalLM.from_pretrained(str(tmp / "frank32"))
    assert model.config.num_hidden_layers == 6 and len(model.model.layers) == 6
    state = model.state_dict()
    o = state["model.layers.4.self_attn.o_proj.weight"].numpy()
    np.testing.assert_array_equal(
        o, (m["platypus"]["model.layers.2.self_attn.o_proj.weight"].astype(np.float32) * np.float32(0.5))
    )
    q = state["model.layers.3.self_attn.q_proj.weight"].numpy()
    np.testing.assert_array_equal(
        q, m["platypus"]["model.layers.1.self_attn.q_proj.weight"].astype(np.float32)
    )
    with torch.no_grad():
        logits = model(torch.tensor([[1, 2, 3]])).logits
    assert logits.shape == (1, 3, 64) and torch.isfinite(logits).all()


def test_arcee_fusion_example(models):
    tmp, m = models
    text = f"""models:
  - model: {tmp}/llama2
  - model: {tmp}/orca
merge_method: arcee_fusion
base_model: {tmp}/llama2
dtype: bfloat16
"""
    got, _ = _run(tmp, text, "fusion")

    def sm(v):
        e = np.exp(v - v.max(-1, keepdims=True))
        return e / e.sum(-1, keepdims=True)

    for k, v in got.items():
        b, x = m["llama2"][k], m["orca"][k]
        p, q = sm(x) + 1e-8, sm(b) + 1e-8
        imp = np.abs(x - b) * (p * np.log(p / q)).sum(-1, keepdims=True)
        s = np.sort(imp.reshape(-1))
        q1, med, q3 = (s[int(np.floor(f * (s.size - 1)))] for f in (0.25, 0.5, 0.75))
        exact = b + (x - b) * (imp >= med + 1.5 * (q3 - q1))
        _within_one_ulp(v, exact, ml_dtypes.bfloat16)


def test_compute_dtype_config_rounds_like_mergekit(models):
    """float32 (default): the float16 output is the exactly rounded merge; ``--compute-dtype config``:
    mergekit's, from the inputs rounded to float16 first (linear then accumulates in float32)."""
    tmp, m = models
    text = f"""models:
  - model: {tmp}/orca
    parameters:
      weight: 1.0
  - model: {tmp}/wizard
    parameters:
      weight: 0.3
merge_method: linear
parameters:
  normalize: [1, 1]
dtype: float16
"""
    ours, report = _run(tmp, text, "lin32")
    theirs, report16 = _run(tmp, text, "lin16", "--compute-dtype", "config")
    assert report["compute_dtype"] == "float32" and report16["compute_dtype"] == "float16"
    exact_equal, theirs_equal, differ = [], [], 0
    for k in ours:
        exact = (m["orca"][k] + 0.3 * m["wizard"][k]) / 1.3
        _within_one_ulp(ours[k], exact, np.float16)
        exact_equal.append(np.mean(ours[k] == exact.astype(np.float16)))
        theirs_equal.append(np.mean(theirs[k] == exact.astype(np.float16)))
        h = [m[n][k].astype(np.float16).astype(np.float64) for n in ("orca", "wizard")]
        _within_one_ulp(theirs[k], (h[0] + 0.3 * h[1]) / 1.3, np.float16)
        differ += int(np.sum(theirs[k] != ours[k]))
    # float32 then one cast: the exactly rounded merge but for double-rounding cases; mergekit's way
    # rounds the inputs first and is further from it
    assert np.mean(exact_equal) > 0.99 and np.mean(exact_equal) > np.mean(theirs_equal) + 0.05
    assert differ > 0  # rounding the inputs first changes some elements


@pytest.mark.slow
def test_mergekit_multi_stages(models):
    tmp, m = models
    text = f"""name: first-merge
merge_method: linear
models:
  - model: {tmp}/orca
  - model: {tmp}/platypus
parameters:
  weight: 0.5
---
merge_method: slerp
base_model: first-merge
models:
  - model: {tmp}/wizard
parameters:
  t: 0.25
"""
    got, report = _run(tmp, text, "multi")
    stage = io.flatten(io.load_safetensors(tmp / "multi.stages" / "first-merge"))
    for k in ("model.layers.0.mlp.up_proj.weight", "lm_head.weight"):
        np.testing.assert_allclose(stage[k], (m["orca"][k] + m["platypus"][k]) / 2, rtol=1e-6, atol=1e-7)
        want = _slerp(0.25, np.asarray(stage[k], np.float64), m["wizard"][k])
        np.testing.assert_allclose(got[k], want, rtol=1e-6, atol=1e-7)
    assert len(report["stages"]) == 1


def test_chunked_passes_equal_whole_tensors(models, monkeypatch):
    """The two-pass task-vector merge and the element-wise methods read in chunks (here 37 entries,
    so chunks cut rows): the same bits as one chunk per tensor."""
    from meta_consensus.merge import mergekit_exec

    tmp, _ = models
    text = f"""models:
  - model: {tmp}/orca
    parameters: {{weight: [0.2, 1.0], density: [0.9, 0.3]}}
  - model: {tmp}/platypus
    parameters: {{weight: 0.5, density: 0.5, gamma: 0.05}}
merge_method: breadcrumbs_ties
base_model: {tmp}/llama2
"""
    swap = f"merge_method: nearswap\nbase_model: {tmp}/llama2\nmodels:\n  - model: {tmp}/orca\n"
    swap += "parameters:\n  t: 0.01\n"
    whole, _ = _run(tmp, text, "bc_whole")
    whole_swap, _ = _run(tmp, swap, "swap_whole")
    monkeypatch.setattr(mergekit_exec, "CHUNK", 37)
    chunked, _ = _run(tmp, text, "bc_chunked")
    chunked_swap, _ = _run(tmp, swap, "swap_chunked")
    for k in whole:
        np.testing.assert_array_equal(whole[k], chunked[k])
        np.testing.assert_array_equal(whole_swap[k], chunked_swap[k])
