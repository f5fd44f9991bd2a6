"""strategies.models against Hugging Face transformers: logits, folders in and out, sharded loads, bad inputs.

Every model is a tiny random config written by transformers in the test itself (nothing is
downloaded), with weights redrawn so that norms, biases and every projection matter, compared
in float32 on 256-token sequences (position 0 is the identity rotation: short prompts hide
rotary bugs) with ``attn_implementation="eager"``.
"""

from __future__ import annotations

import json
import shutil
import struct

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import strategies.models as models
from consensus import io
from consensus.mesh import FSDP_RULES, MeshConfig, make_mesh

T = 256  # tokens per test sequence
VOCAB = 256


def _hf():
    torch = pytest.importorskip("torch", reason="the hf extra (torch) is not installed")
    transformers = pytest.importorskip("transformers", reason="the hf extra (transformers) is not installed")
    return torch, transformers


def _randomize(torch, model, seed: int) -> None:
    """Redraw every weight: matrices N(0, 0.08^2)-ish, norm scales around 1, biases around 0."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            z = torch.randn(p.shape, generator=gen, dtype=torch.float32)
            if p.ndim == 1 and ("norm" in name or ".ln_" in name):
                value = 1.0 + 0.2 * z if name.endswith("weight") else 0.1 * z
            elif p.ndim == 1:
                value = 0.1 * z
            else:
                value = z / np.sqrt(p.shape[-1] if "wpe" not in name else 8.0) * 0.9
            p.copy_(value.to(p.dtype))


def _write(tmp_path, name, config_cls, model_cls, seed=0, dtype=None, shard=None, **kw):
    """A random transformers model saved as a safetensors folder; returns (folder, model in float32)."""
    torch, transformers = _hf()
    torch.manual_seed(seed)
    config = config_cls(attn_implementation="eager", **kw)
    model = model_cls(config).eval()
    _randomize(torch, model, seed)
    if dtype is not None:
        model = model.to(dtype)
    folder = tmp_path / name
    extra = {"max_shard_size": shard} if shard else {}
    model.save_pretrained(folder, safe_serialization=True, **extra)
    if dtype is not None:
        # The float32 reference reads the stored (rounded) weights, as a float32 load does; a model
        # cast back with .float() would keep its bf16-rounded rotary frequencies.
        model = transformers.AutoModelForCausalLM.from_pretrained(
            folder, attn_implementation="eager", dtype=torch.float32
        )
    return folder, model.eval()


def _llama(tmp_path, name="llama", **kw):
    _, transformers = _hf()
    base = dict(
        vocab_size=VOCAB,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=96,
        max_position_embeddings=512,
        rms_norm_eps=1e-5,
    )
    return _write(tmp_path, name, transformers.LlamaConfig, transformers.LlamaForCausalLM, **{**base, **kw})


def _gpt2(tmp_path, name="gpt2", **kw):
    _, transformers = _hf()
    base = dict(
        vocab_size=VOCAB, n_embd=64, n_layer=2, n_head=4, n_positions=T, bos_token_id=0, eos_token_id=0
    )
    return _write(tmp_path, name, transformers.GPT2Config, transformers.GPT2LMHeadModel, **{**base, **kw})


def _tokens(seed=0, batch=2, length=T):
    return np.random.default_rng(seed).integers(0, VOCAB, (batch, length)).astype(np.int32)


def _reference(model, ids) -> np.ndarray:
    torch, _ = _hf()
    with torch.no_grad():
        return model(torch.tensor(ids, dtype=torch.long)).logits.float().numpy()


def _logits(model, params, ids) -> np.ndarray:
    return np.asarray(jax.jit(model.apply)(params, jnp.asarray(ids)), np.float32)


def _assert_matches(folder, hf_model, ids=None, **load_kw):
    model, params = models.load(folder, **load_kw)
    ids = _tokens() if ids is None else ids
    ref = _reference(hf_model, ids)
    out = _logits(model, params, ids)
    assert out.shape == ref.shape == (*ids.shape, model.config.vocab_size)
    assert np.abs(ref).max() > 1.0  # the weights are large enough that every term counts
    np.testing.assert_allclose(out, ref, atol=1e-5, rtol=0)
    return model, params


def _state(folder) -> dict[str, np.ndarray]:
    with io.CheckpointReader(folder) as r:
        return {k: r.get(k) for k in r.specs}


# ----------------------------------------------------------------------------- logits vs transformers


def test_llama_grouped_query_untied_head_matches_transformers(tmp_path):
    folder, hf_model = _llama(tmp_path, tie_word_embeddings=False)
    model, params = _assert_matches(folder, hf_model)
    c = model.config
    assert (c.family, c.num_heads, c.num_kv_heads, c.head_dim, c.tie_word_embeddings) == (
        "llama",
        4,
        2,
        16,
        False,
    )
    layer = params["model"]["layers"][0]
    assert layer["self_attn"]["k_proj"]["kernel"].shape == (64, 32)  # (in, out), 2 kv heads of 16
    assert params["lm_head"]["kernel"].shape == (64, VOCAB)
    assert model.num_params(params) == sum(p.numel() for p in hf_model.parameters())


def test_llama_tied_head_biases_and_explicit_head_dim_match_transformers(tmp_path):
    folder, hf_model = _llama(
        tmp_path,
        tie_word_embeddings=True,
        attention_bias=True,
        mlp_bias=True,
        head_dim=24,
        num_key_value_heads=1,
    )
    model, params = _assert_matches(folder, hf_model)
    assert "lm_head" not in params and model.config.head_dim == 24
    attn = params["model"]["layers"][1]["self_attn"]
    assert attn["q_proj"]["kernel"].shape == (64, 96) and attn["o_proj"]["bias"].shape == (64,)
    assert params["model"]["layers"][0]["mlp"]["down_proj"]["bias"].shape == (64,)


@pytest.mark.parametrize(
    "scaling",
    [
        {"rope_type": "linear", "factor": 4.0},
        {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        },
    ],
    ids=["linear", "llama3"],
)
def test_llama_rope_scaling_matches_transformers(tmp_path, scaling):
    folder, hf_model = _llama(tmp_path, rope_scaling=dict(scaling), rope_theta=500.0, num_key_value_heads=4)
    model, _ = _assert_matches(folder, hf_model)
    assert model.config.rope_type == scaling["rope_type"] and model.config.rope_theta == 500.0
    # The scaling changes the logits: the same weights without it give others (so the test can fail).
    plain = dict(model.hf_config)
    plain.pop("rope_scaling", None)
    plain["rope_parameters"] = {"rope_type": "default", "rope_theta": 500.0}
    _, params = models.load(folder)
    ids = _tokens()
    diff = np.abs(_logits(models.from_config(plain), params, ids) - _reference(hf_model, ids)).max()
    assert diff > 1e-3


def test_mistral_sliding_window_matches_transformers(tmp_path):
    _, transformers = _hf()
    folder, hf_model = _write(
        tmp_path,
        "mistral",
        transformers.MistralConfig,
        transformers.MistralForCausalLM,
        vocab_size=VOCAB,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=96,
        sliding_window=48,
        rms_norm_eps=1e-5,
    )
    model, _ = _assert_matches(folder, hf_model)
    assert model.config.sliding_window == (48, 48)


@pytest.mark.parametrize("sliding", [False, True], ids=["full", "sliding-top-layer"])
def test_qwen2_with_qkv_biases_matches_transformers(tmp_path, sliding):
    _, transformers = _hf()
    # With use_sliding_window, layers from max_window_layers on see only the last sliding_window keys.
    window = dict(use_sliding_window=True, sliding_window=40, max_window_layers=1) if sliding else {}
    folder, hf_model = _write(
        tmp_path,
        "qwen2",
        transformers.Qwen2Config,
        transformers.Qwen2ForCausalLM,
        vocab_size=VOCAB,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=96,
        tie_word_embeddings=True,
        rms_norm_eps=1e-5,
        **window,
    )
    model, params = _assert_matches(folder, hf_model)
    assert model.config.sliding_window == ((None, 40) if sliding else (None, None))
    attn = params["model"]["layers"][0]["self_attn"]
    assert attn["q_proj"]["bias"].shape == (64,) and attn["k_proj"]["bias"].shape == (32,)
    assert "bias" not in attn["o_proj"]


def test_gpt2_conv1d_tied_head_and_layer_scaled_attention_match_transformers(tmp_path):
    folder, hf_model = _gpt2(tmp_path, scale_attn_by_inverse_layer_idx=True)
    model, params = _assert_matches(folder, hf_model)
    block = params["transformer"]["h"][1]
    assert block["attn"]["c_attn"]["kernel"].shape == (64, 192)  # Conv1D: (in, out) as stored
    assert block["mlp"]["c_fc"]["kernel"].shape == (64, 256)  # n_inner default 4 * n_embd
    assert "lm_head" not in params
    with pytest.raises(models.ModelError, match="n_positions"):
        model.apply(params, jnp.zeros((1, T + 1), jnp.int32))


# ----------------------------------------------------------------------------- folders in and out


@pytest.mark.slow  # a bfloat16 program besides the float32 one, and transformers' from_pretrained
def test_sharded_bf16_folder_loads_as_float32_and_as_stored(tmp_path):
    torch, _ = _hf()
    folder, hf_model = _llama(tmp_path, dtype=torch.bfloat16, shard="60KB")
    assert (folder / "model.safetensors.index.json").is_file()
    # hf_model holds the bf16 weights widened to float32 exactly: the reference for a float32 load.
    model, params = _assert_matches(folder, hf_model)
    assert all(x.dtype == jnp.float32 for x in jax.tree.leaves(params))
    _, stored = models.load(folder, dtype=None)
    assert all(x.dtype == jnp.bfloat16 for x in jax.tree.leaves(stored))
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a, np.float32), b), stored, params)
    out16 = jax.jit(model.apply)(stored, jnp.asarray(_tokens(batch=1)))
    assert out16.dtype == jnp.bfloat16
    ref = _reference(hf_model, _tokens(batch=1))
    assert np.abs(np.asarray(out16, np.float32) - ref).max() < 0.1 * np.abs(ref).max()


def _header_metadata(path) -> dict:
    with open(path, "rb") as f:
        (size,) = struct.unpack("<Q", f.read(8))
        return json.loads(f.read(size)).get("__metadata__", {})


def test_load_save_load_is_bit_exact_and_copies_the_tokenizer(tmp_path):
    torch, _ = _hf()
    folder, _ = _llama(tmp_path, dtype=torch.bfloat16, shard="60KB", tie_word_embeddings=True)
    (folder / "tokenizer.json").write_text('{"model": {"type": "BPE"}}')
    (folder / "tokenizer_config.json").write_text('{"model_max_length": 512}')
    model, params = models.load(folder, dtype=None)
    out = models.save(tmp_path / "out", params, like=folder, shard_size="60KB")
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        assert (out / name).read_bytes() == (folder / name).read_bytes()
    config = json.loads((out / "config.json").read_text())
    assert config["torch_dtype"] == config["dtype"] == "bfloat16" and config["model_type"] == "llama"
    assert (out / "model.safetensors.index.json").is_file()
    assert _header_metadata(next(out.glob("model-0000*.safetensors"))) == {"format": "pt"}
    # Tensor for tensor, the saved folder holds what transformers wrote (names, layouts, bytes).
    src, dst = _state(folder), _state(out)
    assert sorted(src) == sorted(dst)
    for k in src:
        assert src[k].dtype == dst[k].dtype == ml_dtypes.bfloat16
        np.testing.assert_array_equal(src[k].view(np.uint16), dst[k].view(np.uint16))
    _, again = models.load(out, dtype=None)
    jax.tree.map(
        lambda a, b: np.testing.assert_array_equal(
            np.asarray(a).view(np.uint16), np.asarray(b).view(np.uint16)
        ),
        params,
        again,
    )
    with pytest.raises(models.ModelError, match="exists"):
        models.save(out, params, like=folder)
    # A tied model whose writer stored the head explicitly loads the same params.
    explicit = tmp_path / "explicit"
    io.save_safetensors(io.unflatten({**src, "lm_head.weight": src["model.embed_tokens.weight"]}), explicit)
    shutil.copy(folder / "config.json", explicit / "config.json")
    jax.tree.map(np.testing.assert_array_equal, models.load(explicit, dtype=None)[1], params)
    models.save(out, params, like=folder, overwrite=True, dtype=jnp.float32)
    assert json.loads((out / "config.json").read_text())["torch_dtype"] == "float32"


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_saved_folder_loads_in_transformers_with_the_same_logits(tmp_path, family):
    torch, transformers = _hf()
    folder, _ = _llama(tmp_path) if family == "llama" else _gpt2(tmp_path)
    model, params = models.load(folder)
    # Changed weights (a node's fine-tune), so the output is not the input copied.
    changed = jax.tree.map(lambda x: x * jnp.float32(1.05) + jnp.float32(0.01), params)
    out = models.save(tmp_path / "saved", changed, config=model.hf_config)
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(
        out, attn_implementation="eager", dtype=torch.float32
    ).eval()
    ids = _tokens(seed=3)
    np.testing.assert_allclose(_logits(model, changed, ids), _reference(hf_model, ids), atol=1e-5, rtol=0)


def test_sharded_load_on_an_fsdp_mesh_gives_the_unsharded_logits(tmp_path):
    folder, hf_model = _llama(tmp_path, tie_word_embeddings=False)
    mesh = make_mesh(MeshConfig(node=1, data=4, model=2, fsdp=True))
    model, params = models.load(folder, mesh=mesh, rules=FSDP_RULES)
    q = params["model"]["layers"][0]["self_attn"]["q_proj"]["kernel"]
    assert tuple(q.sharding.spec) == ("data", "model")  # ("embed", "heads"): FSDP and tensor parallel
    emb = params["model"]["embed_tokens"]["embedding"]
    assert tuple(emb.sharding.spec) == ("model", "data")  # ("vocab", "embed")
    assert q.addressable_shards[0].data.shape == (16, 32)
    _, plain = models.load(folder)
    ids = _tokens(seed=1)
    np.testing.assert_allclose(_logits(model, params, ids), _logits(model, plain, ids), atol=1e-5, rtol=0)
    np.testing.assert_allclose(_logits(model, params, ids), _reference(hf_model, ids), atol=1e-5, rtol=0)


@pytest.mark.slow  # one random-number program per leaf to compile
def test_init_on_a_mesh_draws_each_leaf_into_its_sharding():
    model = models.from_config(
        {
            "model_type": "qwen2",
            "vocab_size": 64,
            "hidden_size": 32,
            "num_hidden_layers": 1,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "intermediate_size": 64,
        }
    )
    mesh = make_mesh(MeshConfig(node=2, data=2, model=2, fsdp=True))
    params = model.init(jax.random.key(0), mesh=mesh, rules=FSDP_RULES)
    gate = params["model"]["layers"][0]["mlp"]["gate_proj"]["kernel"]
    assert tuple(gate.sharding.spec) == ("data", "model") and gate.addressable_shards[0].data.shape == (
        16,
        32,
    )
    assert 0.015 < float(jnp.std(gate)) < 0.025
    np.testing.assert_array_equal(params["model"]["layers"][0]["self_attn"]["k_proj"]["bias"], np.zeros(16))
    assert jax.tree.structure(params) == jax.tree.structure(model.init(jax.random.key(0)))


# ----------------------------------------------------------------------------- the tree and its keys


def test_tree_paths_keys_axes_and_init():
    from strategies.lora import kernel_paths, path_name

    model = models.from_config(
        {
            "model_type": "llama",
            "vocab_size": 128,
            "hidden_size": 32,
            "num_hidden_layers": 3,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "intermediate_size": 48,
        }
    )
    params = model.init(jax.random.key(0))
    flat, _ = jax.tree_util.tree_flatten_with_path(params)
    names = [path_name(p) for p, _ in flat]
    assert "model/layers/0/self_attn/q_proj/kernel" in names and "lm_head/kernel" in names
    assert names.index("model/layers/2/mlp/up_proj/kernel") > names.index("model/layers/1/mlp/up_proj/kernel")
    for p, _ in flat:
        key = models.hf_key(p)
        assert models.tree_path(key) == tuple(getattr(e, "key", None) for e in p)
        assert models.hf_key(path_name(p)) == key
    assert models.hf_key("model/layers/0/self_attn/q_proj/kernel") == "model.layers.0.self_attn.q_proj.weight"
    assert (
        models.hf_module(("model", "layers", 1, "mlp", "down_proj", "kernel"))
        == "model.layers.1.mlp.down_proj"
    )
    assert models.transposes("lm_head/kernel") and not models.transposes("transformer/h/0/attn/c_attn/kernel")
    assert not models.transposes("model/embed_tokens/embedding")
    # Every kernel is 2-D (in, out), as strategies.lora views it.
    assert all(len(s) == 2 for s in kernel_paths(params).values())
    # Dotted checkpoint keys round-trip, and a tree rebuilt without a template still applies.
    flat_keys = io.flatten(params)
    assert "model.layers.2.self_attn.o_proj.kernel" in flat_keys
    rebuilt = io.unflatten(flat_keys)
    ids = jnp.asarray(_tokens(length=16)) % 128
    apply = jax.jit(model.apply)
    np.testing.assert_array_equal(apply(rebuilt, ids), apply(params, ids))
    jax.tree.map(np.testing.assert_array_equal, io.unflatten(flat_keys, params), params)
    # One logical name per dimension, from the mesh rules' vocabulary.
    axes = model.logical_axes()
    allowed = {"vocab", "embed", "heads", "kv_heads", "mlp", "norm", "length"}
    jax.tree.map(
        lambda x, a: (len(a) == x.ndim and set(a) <= allowed) or pytest.fail(f"{a} for {x.shape}"),
        params,
        axes,
        is_leaf=lambda a: isinstance(a, tuple),
    )
    # init: N(0, 0.02) weights, unit norm scales.
    q = np.asarray(params["model"]["layers"][0]["self_attn"]["q_proj"]["kernel"])
    assert 0.015 < q.std() < 0.025 and abs(q.mean()) < 0.005
    np.testing.assert_array_equal(params["model"]["norm"]["scale"], np.ones(32, np.float32))
    assert model.num_params() == model.num_params(params) == sum(x.size for x in jax.tree.leaves(params))


@pytest.mark.slow  # two gradient programs to compile: over 5 s on 2 busy cores
def test_remat_gives_the_same_logits_and_gradients():
    config = {
        "model_type": "gpt2",
        "vocab_size": 64,
        "n_embd": 32,
        "n_layer": 2,
        "n_head": 2,
        "n_positions": 32,
    }
    plain, remat = models.from_config(config), models.from_config(config, remat=True)
    params = plain.init(jax.random.key(1))
    ids = jnp.asarray(_tokens(length=32)) % 64

    def loss(model):
        return lambda p: jnp.mean(jax.nn.log_softmax(model.apply(p, ids))[..., 0])

    g1 = jax.jit(jax.grad(loss(plain)))(params)
    g2 = jax.jit(jax.grad(loss(remat)))(params)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, atol=1e-6, rtol=1e-5), g1, g2)
    assert float(jnp.abs(g1["transformer"]["h"][0]["attn"]["c_attn"]["kernel"]).max()) > 0


# ----------------------------------------------------------------------------- bad inputs


def test_bad_folders_and_configs_are_named_in_one_line(tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(models.ModelError, match="no config.json"):
        models.load(empty)
    with pytest.raises(models.ModelError, match="not found"):
        models.load(tmp_path / "nowhere")
    with pytest.raises(models.ModelError, match="unsupported model_type 'bert'.*llama, mistral, qwen2, gpt2"):
        models.from_config({"model_type": "bert", "hidden_size": 8})
    (empty / "config.json").write_text(json.dumps({"model_type": "bert"}))
    with pytest.raises(models.ModelError, match="unsupported model_type 'bert'"):
        models.load(empty)
    llama = {
        "model_type": "llama",
        "vocab_size": 64,
        "hidden_size": 32,
        "num_hidden_layers": 1,
        "num_attention_heads": 4,
        "intermediate_size": 48,
    }
    with pytest.raises(models.ModelError, match="unsupported rope_scaling type 'yarn'"):
        models.from_config({**llama, "rope_scaling": {"rope_type": "yarn", "factor": 2.0}})
    with pytest.raises(models.ModelError, match="unsupported rope_scaling type 'dynamic'"):
        models.from_config({**llama, "rope_scaling": {"type": "dynamic", "factor": 2.0}})
    with pytest.raises(models.ModelError, match="needs 'low_freq_factor'"):
        models.from_config({**llama, "rope_scaling": {"rope_type": "llama3", "factor": 2.0}})
    with pytest.raises(models.ModelError, match="num_key_value_heads"):
        models.from_config({**llama, "num_key_value_heads": 3})
    with pytest.raises(models.ModelError, match="'intermediate_size'"):
        models.from_config({k: v for k, v in llama.items() if k != "intermediate_size"})
    with pytest.raises(models.ModelError, match="unsupported activation 'tanh'"):
        models.from_config({**llama, "hidden_act": "tanh"})
    (empty / "config.json").write_text(json.dumps(llama))
    (empty / "pytorch_model.bin").write_bytes(b"")
    with pytest.raises(models.ModelError, match="pytorch_model.bin.*safetensors only"):
        models.load(empty)
    with pytest.raises(models.ModelError, match="needs like="):
        models.save(tmp_path / "x", {})
    for err in (models.ModelError("x"),):
        assert isinstance(err, ValueError)


def test_bad_checkpoints_are_named(tmp_path):
    folder, _ = _llama(tmp_path, shard="60KB")
    state = _state(folder)
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    # A shard named in the index but missing.
    broken = tmp_path / "broken"
    shutil.copytree(folder, broken)
    gone = index["weight_map"]["model.norm.weight"]
    (broken / gone).unlink()
    with pytest.raises(models.ModelError, match=f"names shard {gone}, which does not exist"):
        models.load(broken)
    # A tensor missing.
    missing = tmp_path / "missing"
    io.save_safetensors(io.unflatten({k: v for k, v in state.items() if k != "model.norm.weight"}), missing)
    shutil.copy(folder / "config.json", missing / "config.json")
    with pytest.raises(models.ModelError, match="'model.norm.weight' is missing"):
        models.load(missing)
    # A tensor of the wrong shape (config.json says a wider MLP).
    config = json.loads((folder / "config.json").read_text())
    (missing / "config.json").write_text(json.dumps({**config, "intermediate_size": 128}))
    io.save_safetensors(io.unflatten(state), missing, overwrite=True)
    (missing / "config.json").write_text(json.dumps({**config, "intermediate_size": 128}))
    with pytest.raises(
        models.ModelError,
        match=r"mlp.down_proj.weight' has shape \(64, 96\), config.json implies \(64, 128\)",
    ):
        models.load(missing)
    # An unexpected tensor.
    (missing / "config.json").write_text(json.dumps(config))
    io.save_safetensors(
        io.unflatten({**state, "score.weight": state["lm_head.weight"]}), missing, overwrite=True
    )
    (missing / "config.json").write_text(json.dumps(config))
    with pytest.raises(models.ModelError, match="unexpected tensors.*score.weight"):
        models.load(missing)
    # Tokenizer files asked for but absent; params that do not fit the config.
    model, params = models.load(folder)
    with pytest.raises(models.ModelError, match="no tokenizer files"):
        models.save(tmp_path / "out", params, like=folder, tokenizer=True)
    del params["model"]["norm"]
    with pytest.raises(models.ModelError, match="missing.*norm"):
        models.save(tmp_path / "out", params, config=model.hf_config)
    assert not (tmp_path / "out").exists()
