"""``meta-consensus merge`` on PEFT LoRA adapter folders, in and out.

The fast tests write adapter folders with safetensors alone (PEFT's file layout: ``adapter_config.json``,
``adapter_model.safetensors`` with ``base_model.model.<module>.lora_A.weight`` (r, in) and
``lora_B.weight`` (out, r)) and check the merge against float64 references and the one-line
errors. The slow tests build a tiny Llama in-process (2 layers, hidden 32, random weights, nothing
downloaded), make three LoRA adapters with ``peft`` (random non-zero ``lora_B``, different alphas),
and check that ``cat`` and ``svd`` give PEFT's own ``add_weighted_adapter`` updates, that the
output folder loads with ``PeftModel.from_pretrained`` and that ``--merge-into-base`` gives a folder
``AutoModelForCausalLM.from_pretrained`` loads (skipped when peft is not installed).
"""

from __future__ import annotations

import json

import jax
import lora_reference as ref
import numpy as np
import pytest

from consensus import io
from meta_consensus.cli import main

PREFIX = "base_model.model."
MODULES = {"model.layers.0.self_attn.q_proj": (16, 12), "model.layers.0.mlp.up_proj": (16, 20)}


def write_adapter(folder, factors, r, alpha, **config):
    """A PEFT-format adapter folder from Flax-layout factors {module: (a (in, r), b (r, out))}."""
    folder.mkdir(parents=True)
    tensors = {}
    for m, (a, b) in factors.items():
        tensors[f"{PREFIX}{m}.lora_A.weight"] = np.ascontiguousarray(a.T)
        tensors[f"{PREFIX}{m}.lora_B.weight"] = np.ascontiguousarray(b.T)
    writer = io.ShardedWriter(folder, {k: (v.shape, v.dtype) for k, v in tensors.items()})
    for k, v in tensors.items():
        writer.write(k, v)
    writer.close()
    (folder / "model.safetensors").rename(folder / "adapter_model.safetensors")
    cfg = {
        "peft_type": "LORA",
        "r": r,
        "lora_alpha": alpha,
        "target_modules": ["q_proj", "up_proj"],
        **config,
    }
    (folder / "adapter_config.json").write_text(json.dumps(cfg))
    return folder


def random_factors(seed, r=3, modules=MODULES):
    sizes = [(fi * r, r * fo) for fi, fo in modules.values()]
    flat = np.array(jax.random.normal(jax.random.key(seed), (sum(x + y for x, y in sizes),)))
    out, at = {}, 0
    for m, (fan_in, fan_out) in modules.items():
        a = flat[at : at + fan_in * r].reshape(fan_in, r)
        at += a.size
        b = flat[at : at + r * fan_out].reshape(r, fan_out)
        at += b.size
        out[m] = (a, b)
    return out


def read_folder(folder):
    """{module: (A (r, in), B (out, r))} and the config of an adapter folder."""
    with io.CheckpointReader(folder / "adapter_model.safetensors") as r:
        state = {k: r.get(k).astype(np.float64) for k in r.specs}
    config = json.loads((folder / "adapter_config.json").read_text())
    mods = {k.removeprefix(PREFIX).rsplit(".lora_", 1)[0] for k in state}
    return {
        m: (state[f"{PREFIX}{m}.lora_A.weight"], state[f"{PREFIX}{m}.lora_B.weight"]) for m in mods
    }, config


def delta_of(folder):
    """PEFT's update per module, (out, in): scaling * B @ A."""
    mods, config = read_folder(folder)
    scaling = config["lora_alpha"] / config["r"]
    return {m: scaling * b @ a for m, (a, b) in mods.items()}


@pytest.fixture
def three(tmp_path):
    alphas = [6.0, 3.0, 12.0]
    folders = [write_adapter(tmp_path / f"ad{i}", random_factors(i), 3, alphas[i]) for i in range(3)]
    stacked = {
        m: {
            "a": np.stack([random_factors(i)[m][0] for i in range(3)]),
            "b": np.stack([random_factors(i)[m][1] for i in range(3)]),
        }
        for m in MODULES
    }
    return folders, stacked, np.array(alphas) / 3


def test_fedit_and_stack_of_adapter_folders_match_their_references(tmp_path, three):
    folders, stacked, s = three
    w = np.array([0.5, 0.3, 0.2])
    for method in ("fedit", "stack"):
        out = tmp_path / method
        assert (
            main(
                [
                    "merge",
                    "--method",
                    method,
                    "--weights",
                    "0.5,0.3,0.2",
                    "--quiet",
                    "--out",
                    str(out),
                    *map(str, folders),
                ]
            )
            == 0
        )
        got = delta_of(out)
        mods, config = read_folder(out)
        for m, f in ref.f64(stacked).items():
            want = ref.fedit(f, s, w) if method == "fedit" else ref.weighted_product_sum(f, s, w)
            np.testing.assert_allclose(got[m], want.T, rtol=1e-5, atol=1e-5)
        assert config["r"] == config["lora_alpha"] == (3 if method == "fedit" else 9)
        assert config["use_rslora"] is False and config["target_modules"] == ["q_proj", "up_proj"]
        report = json.loads((out / "merge_report.json").read_text())
        assert report["info"]["exactness"] == ("approximate" if method == "fedit" else "exact")


def test_robust_krum_on_the_products_keeps_the_honest_adapter(tmp_path, three):
    folders, stacked, s = three
    out = tmp_path / "krum"
    extra = [
        write_adapter(
            tmp_path / f"near{i}",
            {m: (a, b * (1 + 0.01 * i)) for m, (a, b) in random_factors(0).items()},
            3,
            6.0,
        )
        for i in (1, 2)
    ]
    inputs = [folders[0], *extra, folders[1], folders[2]]  # three close adapters, two others
    assert (
        main(["merge", "--method", "krum", "-f", "1", "--quiet", "--out", str(out), *map(str, inputs)]) == 0
    )
    report = json.loads((out / "merge_report.json").read_text())
    assert report["adapter_method"] == "stack" and report["space"] == "products"
    assert report["info"]["selected"][0] in (0, 1, 2)
    assert json.loads((out / "adapter_config.json").read_text())["r"] == 3


def test_a_coordinatewise_rule_on_the_factors_and_on_the_products(tmp_path, three):
    folders, stacked, s = three
    on_factors, on_products = tmp_path / "factors", tmp_path / "products"
    argv = ["merge", "--method", "median", "--quiet"]
    assert main([*argv, "--space", "factors", "--out", str(on_factors), *map(str, folders)]) == 0
    assert main([*argv, "--out", str(on_products), *map(str, folders)]) == 0  # then svd to rank r
    products = delta_of(on_products)
    for m, f in ref.f64(stacked).items():
        best, _ = ref.truncated(np.median(ref.products(f, s), axis=0), 3)
        np.testing.assert_allclose(products[m], best.T, rtol=1e-4, atol=1e-5)
    mods, _ = read_folder(on_factors)
    for m, f in ref.f64(stacked).items():
        fold = s[:, None, None] / s[0]  # each input's scale folded into its b, the first input's scale kept
        a, b = np.median(f["a"], axis=0), np.median(fold * f["b"], axis=0)
        np.testing.assert_allclose(delta_of(on_factors)[m], (s[0] * a @ b).T, rtol=1e-5, atol=1e-5)
        assert mods[m][0].shape == (3, MODULES[m][0])
    report = json.loads((on_factors / "merge_report.json").read_text())
    assert report["space"] == "factors" and report["adapter_method"] == "fedit"
    report = json.loads((on_products / "merge_report.json").read_text())
    assert report["space"] == "products" and report["adapter_method"] == "svd"
    assert report["info"]["relative_truncation_error"] > 0


def test_a_toml_plan_names_the_space_and_the_adapter_method(tmp_path, three):
    folders, _, _ = three
    plan = tmp_path / "merge.toml"
    inputs = ", ".join(json.dumps(str(f)) for f in folders)
    out = json.dumps(str(tmp_path / "out"))
    plan.write_text(
        f'method = "median"\nspace = "factors"\nadapter_method = "fedit"\ninputs = [{inputs}]\nout = {out}\n'
    )
    assert main(["merge", "--config", str(plan), "--quiet"]) == 0
    report = json.loads((tmp_path / "out" / "merge_report.json").read_text())
    assert (report["space"], report["adapter_method"], report["rule"]["method"]) == (
        "factors",
        "fedit",
        "median",
    )


def write_base(folder, modules, transposed, seed=9):
    """A Hugging Face-style model folder: config.json and one float32 weight per module (+ one other)."""
    rng = np.random.default_rng(seed)
    state = {
        f"{m}.weight": rng.standard_normal((fi, fo) if transposed else (fo, fi)).astype(np.float32)
        for m, (fi, fo) in modules.items()
    }
    state["model.norm.weight"] = rng.standard_normal(4).astype(np.float32)
    folder.mkdir()
    writer = io.ShardedWriter(folder, {k: (v.shape, v.dtype) for k, v in state.items()})
    for k, v in state.items():
        writer.write(k, v)
    writer.close()
    (folder / "config.json").write_text(json.dumps({"model_type": "llama", "torch_dtype": "float32"}))
    return {k: v.astype(np.float64) for k, v in state.items()}


@pytest.mark.parametrize("transposed", [False, True])
def test_merge_into_base_adds_the_exact_update_in_the_weights_layout(tmp_path, transposed):
    """exact_residual (a dense residual) added to a base: W + delta^T (Linear), W + delta (fan_in_fan_out)."""
    alphas = [6.0, 3.0, 12.0]
    folders = [
        write_adapter(tmp_path / f"ad{i}", random_factors(i), 3, alphas[i], fan_in_fan_out=transposed)
        for i in range(3)
    ]
    base = write_base(tmp_path / "base", MODULES, transposed)
    out = tmp_path / "full"
    argv = [
        "merge",
        "--method",
        "exact_residual",
        "--weights",
        "1,2,1",
        "--merge-into-base",
        str(tmp_path / "base"),
    ]
    assert main([*argv, "--quiet", "--out", str(out), *map(str, folders)]) == 0
    with io.CheckpointReader(out) as r:
        got = {k: r.get(k).astype(np.float64) for k in r.specs}
    w = np.array([0.25, 0.5, 0.25])
    s = np.array(alphas) / 3
    assert sorted(got) == sorted(base)
    np.testing.assert_array_equal(got["model.norm.weight"], base["model.norm.weight"])
    for m in MODULES:
        f = {
            "a": np.stack([random_factors(i)[m][0] for i in range(3)]),
            "b": np.stack([random_factors(i)[m][1] for i in range(3)]),
        }
        delta = ref.weighted_product_sum(ref.f64({m: f})[m], s, w)  # (in, out)
        want = base[f"{m}.weight"] + (delta if transposed else delta.T)
        np.testing.assert_allclose(got[f"{m}.weight"], want, rtol=1e-5, atol=1e-5)
    assert json.loads((out / "config.json").read_text())["model_type"] == "llama"
    assert json.loads((out / "merge_report.json").read_text())["info"]["exactness"] == "exact"


def test_user_errors_are_one_line(tmp_path, three, capsys):
    folders, _, _ = three
    low = write_adapter(tmp_path / "low", random_factors(5, r=2), 2, 4.0)
    lacking = write_adapter(
        tmp_path / "lacking", {k: v for k, v in random_factors(6).items() if "q_proj" in k}, 3, 6.0
    )
    bad = random_factors(7)
    bad["model.layers.0.mlp.up_proj"][1][0, 0] = np.nan
    nan = write_adapter(tmp_path / "nan", bad, 3, 6.0)
    other_base = tmp_path / "other_base"
    write_base(other_base, {"model.layers.9.mlp.up_proj": (16, 20)}, False)
    ckpt = tmp_path / "ckpt.safetensors"
    io.save_safetensors({"w": np.zeros(3, np.float32)}, ckpt)
    out = str(tmp_path / "out")
    cases = [
        (["--method", "fedit", *folders[:2], low], "rank mismatch"),
        (["--method", "fedit", *folders[:2], lacking], "lacks target(s) ['model.layers.0.mlp.up_proj']"),
        (["--method", "exact_residual", *folders], "give --merge-into-base BASE"),
        (["--method", "ffa", *folders], "ffa: the nodes' a differ"),
        (["--method", "krum", "-f", "1", *folders], "krum"),
        (
            ["--method", "median", "--adapter-method", "stack", *folders],
            "stack combines the nodes with weights",
        ),
        (["--method", "fedit", *folders[:2], ckpt], "is not a PEFT adapter folder"),
        (["--method", "nope", *folders], "unknown method 'nope' for adapters"),
        (["--method", "ties", *folders], "ties needs parameter(s) ['density']"),
        (
            ["--method", "fedit", *folders[:2], nan],
            f"non-finite values (NaN or Inf) in factor 'b' of target 'model.layers.0.mlp.up_proj', {nan}",
        ),
        (["--method", "fedit", "--merge-into-base", tmp_path / "nobase", *folders], "no config.json there"),
        (
            ["--method", "fedit", "--merge-into-base", other_base, *folders],
            "no tensor 'model.layers.0.mlp.up_proj.weight'",
        ),
        (
            ["--method", "median", "--merge-into-base", tmp_path / "base", ckpt, ckpt],
            "for PEFT adapter inputs",
        ),
    ]
    for args, pattern in cases:
        assert main(["merge", "--quiet", "--out", out, *map(str, args)]) == 2, pattern
        err = capsys.readouterr().err.strip()
        assert "\n" not in err and pattern in err, err
    assert not (tmp_path / "out").exists()


# ----------------------------------------------------------------------------- with peft and transformers


def _peft():
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    peft = pytest.importorskip("peft")
    return torch, transformers, peft


@pytest.fixture(scope="module")
def peft_adapters(tmp_path_factory):
    """A tiny Llama saved with save_pretrained and three PEFT LoRA adapters of it (r = 4, alphas 8, 4, 16)."""
    torch, transformers, peft = _peft()
    root = tmp_path_factory.mktemp("peft")
    config = transformers.LlamaConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=64,
        max_position_embeddings=32,
    )
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(config).eval().save_pretrained(root / "base")
    folders = []
    for i, alpha in enumerate([8, 4, 16]):
        torch.manual_seed(10 + i)
        base = transformers.AutoModelForCausalLM.from_pretrained(root / "base")
        lc = peft.LoraConfig(r=4, lora_alpha=alpha, target_modules=["q_proj", "v_proj"], lora_dropout=0.0)
        model = peft.get_peft_model(base, lc)
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "lora_B" in name:
                    p.normal_(0.0, 0.2)  # PEFT starts B at 0: a trained adapter has B != 0
        model.save_pretrained(root / f"adapter{i}")
        folders.append(root / f"adapter{i}")
    return root / "base", folders


def peft_weighted(torch, transformers, peft, base_dir, folders, weights, combination, **kw):
    """PEFT's own add_weighted_adapter over the folders: the model with the merged adapter active."""
    base = transformers.AutoModelForCausalLM.from_pretrained(base_dir).eval()
    model = peft.PeftModel.from_pretrained(base, folders[0], adapter_name="a0")
    for i, f in enumerate(folders[1:], start=1):
        model.load_adapter(f, adapter_name=f"a{i}")
    names = [f"a{i}" for i in range(len(folders))]
    model.add_weighted_adapter(names, weights, "merged", combination_type=combination, **kw)
    model.set_adapter("merged")
    deltas = {}
    for name, module in model.named_modules():
        if hasattr(module, "get_delta_weight") and "merged" in getattr(module, "lora_A", {}):
            deltas[name.removeprefix("base_model.model.")] = (
                module.get_delta_weight("merged").detach().double().numpy()
            )
    return model.eval(), deltas


@pytest.mark.slow  # torch, transformers and peft: a tiny Llama, three adapters, PEFT's own merges
@pytest.mark.parametrize("combination", ["cat", "svd"])
def test_cat_and_svd_agree_with_pefts_add_weighted_adapter(tmp_path, peft_adapters, combination):
    torch, transformers, peft = _peft()
    base_dir, folders = peft_adapters
    weights = [0.6, 0.3, 0.4]  # PEFT uses them as given (a weighted sum, not a mean)
    out = tmp_path / combination
    argv = ["merge", "--method", combination, "--weights", "0.6,0.3,0.4", "--quiet", "--out", str(out)]
    assert main([*argv, *map(str, folders)]) == 0
    model, want = peft_weighted(torch, transformers, peft, base_dir, folders, weights, combination)
    got = delta_of(out)
    assert sorted(got) == sorted(want) and len(got) == 4  # q_proj, v_proj of 2 layers
    for m, d in want.items():
        # float32 factors on both sides; svd: torch's float32 SVD of the dense sum vs ours of its QR factors
        np.testing.assert_allclose(got[m], d, rtol=1e-4, atol=1e-5 * np.abs(d).max(), err_msg=m)
    config = json.loads((out / "adapter_config.json").read_text())
    assert config["r"] == (12 if combination == "cat" else 4)

    # (b) PEFT loads the folder, and its forward is PEFT's own merged adapter's
    base = transformers.AutoModelForCausalLM.from_pretrained(base_dir).eval()
    loaded = peft.PeftModel.from_pretrained(base, out).eval()
    ids = torch.arange(16).reshape(2, 8) % 64
    with torch.no_grad():
        ours, theirs = loaded(ids).logits.numpy(), model(ids).logits.numpy()
    np.testing.assert_allclose(ours, theirs, rtol=1e-4, atol=1e-5)


@pytest.mark.slow  # as above
def test_merge_into_base_writes_base_plus_delta_that_transformers_loads(tmp_path, peft_adapters):
    torch, transformers, peft = _peft()
    base_dir, folders = peft_adapters
    out = tmp_path / "full"
    argv = [
        "merge",
        "--method",
        "exact_residual",
        "--merge-into-base",
        str(base_dir),
        "--quiet",
        "--out",
        str(out),
    ]
    assert main([*argv, *map(str, folders)]) == 0
    loaded = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    with io.CheckpointReader(base_dir) as r:
        base = {k: r.get(k).astype(np.float64) for k in r.specs}
    deltas = [delta_of(f) for f in folders]
    state = {k: v.detach().double().numpy() for k, v in loaded.state_dict().items()}
    touched = 0
    for k, w in base.items():
        module = k.removesuffix(".weight")
        want = w + (np.mean([d[module] for d in deltas], axis=0) if module in deltas[0] else 0.0)
        touched += module in deltas[0]
        np.testing.assert_allclose(state[k], want, rtol=1e-5, atol=1e-6, err_msg=k)
    assert touched == 4
    assert json.loads((out / "merge_report.json").read_text())["info"]["exactness"] == "exact"


@pytest.mark.slow  # torch, transformers and peft: a tiny GPT-2 and two adapters
def test_gpt2_conv1d_adapters_merged_into_the_base_equal_pefts_merge_and_unload(tmp_path):
    """GPT-2's Conv1D stores (in, out) weights (PEFT's fan_in_fan_out): the update goes in untransposed."""
    torch, transformers, peft = _peft()
    config = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=64, n_positions=16)
    torch.manual_seed(0)
    transformers.GPT2LMHeadModel(config).eval().save_pretrained(tmp_path / "base")
    folders = []
    for i in range(2):
        torch.manual_seed(5 + i)
        base = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "base")
        lc = peft.LoraConfig(
            r=2, lora_alpha=4, target_modules=["c_attn"], lora_dropout=0.0, fan_in_fan_out=True
        )
        model = peft.get_peft_model(base, lc)
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "lora_B" in name:
                    p.normal_(0.0, 0.3)
        model.save_pretrained(tmp_path / f"adapter{i}")
        folders.append(tmp_path / f"adapter{i}")
    out = tmp_path / "full"
    argv = [
        "merge",
        "--method",
        "stack",
        "--merge-into-base",
        str(tmp_path / "base"),
        "--quiet",
        "--out",
        str(out),
    ]
    assert main([*argv, *map(str, folders)]) == 0
    model, _ = peft_weighted(torch, transformers, peft, tmp_path / "base", folders, [0.5, 0.5], "cat")
    want = model.merge_and_unload().eval()
    got = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    plain = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "base").eval()
    ids = torch.arange(12).reshape(2, 6)
    with torch.no_grad():
        ours, theirs, before = (m(ids).logits.numpy() for m in (got, want, plain))
    assert np.abs(theirs - before).max() > 1e-2  # the adapters change the model
    np.testing.assert_allclose(ours, theirs, rtol=1e-5, atol=1e-5)
