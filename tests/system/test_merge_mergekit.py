"""``meta-consensus merge`` with per-input weights, the DARE merges and mergekit's YAML configs, against
mergekit's formulas written in numpy float64 (mergekit itself is not a dependency); every method
``--method`` offers runs."""

from __future__ import annotations

import json

import numpy as np
import pytest
from safetensors.numpy import save_file

from consensus import io
from consensus.registry import RULES
from meta_consensus.cli import main
from meta_consensus.merge.plan import merge_methods

W = [0.5, 0.3, 0.2]
KEYS = ("model.layers.0.self_attn.q_proj.weight", "model.layers.0.mlp.up_proj.weight", "lm_head.weight")


def _tree(rng, scale=1.0, like=None):
    out = {}
    for i, k in enumerate(KEYS):
        shape = (6, 5) if i < 2 else (4, 6)
        v = rng.normal(size=shape) * scale
        out[k] = (v if like is None else like[k] + v).astype(np.float32)
    return out


@pytest.fixture
def ckpts(tmp_path):
    rng = np.random.default_rng(0)
    base = _tree(rng)
    models = [_tree(rng, 0.5, base) for _ in range(3)]
    save_file(base, str(tmp_path / "base.safetensors"))  # Hugging Face's dotted names, as written
    paths = []
    for i, m in enumerate(models):
        save_file(m, str(tmp_path / f"m{i}.safetensors"))
        paths.append(str(tmp_path / f"m{i}.safetensors"))
    f64 = {k: v.astype(np.float64) for k, v in base.items()}
    return (
        tmp_path,
        str(tmp_path / "base.safetensors"),
        paths,
        f64,
        [{k: v.astype(np.float64) for k, v in m.items()} for m in models],
    )


def _load(out):
    return {k: np.asarray(v, np.float64) for k, v in io.flatten(io.load_safetensors(out)).items()}


def _trim(delta, density):
    if density >= 1:
        return delta
    flat = delta.reshape(-1)
    keep = np.zeros_like(flat)
    keep[np.argsort(-np.abs(flat), kind="stable")[: int(density * flat.size)]] = 1
    return (flat * keep).reshape(delta.shape)


def _ties(base, xs, w, density, normalize=True):
    w = np.asarray(w)[:, None, None]
    weighted = w * np.stack([_trim(x - base, density) for x in xs])
    mask = np.sign(weighted) == np.where(weighted.sum(0) >= 0, 1.0, -1.0)
    mixed = (weighted * mask).sum(0)
    if normalize:
        div = (w * mask).sum(0)
        mixed = mixed / np.where(div == 0, 1.0, div)
    return base + mixed


def _slerp(t, v0, v1):
    a, b = v0.reshape(-1), v1.reshape(-1)
    dot = np.sum(a / np.linalg.norm(a) * b / np.linalg.norm(b))
    if abs(dot) > 0.9995:
        return (1 - t) * v0 + t * v1
    th = np.arccos(dot)
    return (np.sin((1 - t) * th) * v0 + np.sin(t * th) * v1) / np.sin(th)


def _stock(base, xs):
    ds = [(x - base).reshape(-1) for x in xs]
    cos = [
        ds[i] @ ds[j] / np.linalg.norm(ds[i]) / np.linalg.norm(ds[j])
        for i in range(len(ds))
        for j in range(i + 1, len(ds))
    ]
    c, m = np.mean(cos), len(ds)
    t = m * c / (1 + (m - 1) * c)
    return t * np.mean(xs, axis=0) + (1 - t) * base


def _close(got, want, tol=2e-5):
    for k in KEYS:
        np.testing.assert_allclose(got[k], want[k], rtol=tol, atol=tol, err_msg=k)


def test_weights_option_for_linear_task_arithmetic_and_ties(ckpts):
    tmp, base, paths, b, xs = ckpts
    w = np.array(W)
    argv = ["merge", "--quiet", "--weights", ",".join(map(str, W))]
    assert main([*argv, "--method", "linear", "--out", str(tmp / "lin"), *paths]) == 0
    _close(
        _load(tmp / "lin"), {k: sum(wi * x[k] for wi, x in zip(w, xs, strict=True)) / w.sum() for k in KEYS}
    )
    assert main([*argv, "--method", "task_arithmetic", "--base", base, "--out", str(tmp / "ta"), *paths]) == 0
    _close(
        _load(tmp / "ta"),
        {k: b[k] + sum(wi * (x[k] - b[k]) for wi, x in zip(w, xs, strict=True)) for k in KEYS},
    )
    tie = [*argv, "--method", "ties", "--set", "method.density=0.4", "--base", base]
    assert main([*tie, "--out", str(tmp / "ties"), *paths]) == 0
    _close(_load(tmp / "ties"), {k: _ties(b[k], [x[k] for x in xs], W, 0.4) for k in KEYS})
    report = json.loads((tmp / "ties" / "merge_report.json").read_text())
    assert report["params"]["weights"] == W


def test_wrong_weights_are_one_line_errors(ckpts, capsys):
    tmp, base, paths, _, _ = ckpts
    cases = [
        (["--method", "linear", "--weights", "1,2"], "2 weights for 3 inputs"),
        (["--method", "median", "--weights", "1,2,3"], "takes no per-input weights"),
        (["--method", "linear", "--weights", "1,x,3"], "expected numbers"),
        (["--method", "weighted_mean"], "needs per-input weights"),
        (["--method", "dare"], "not a merge"),
        (["--method", "slerp"], "slerp needs exactly 2 inputs; 3 given"),
    ]
    for argv, message in cases:
        capsys.readouterr()
        assert main(["merge", "--quiet", *argv, "--out", str(tmp / "x"), *paths]) == 2
        err = capsys.readouterr().err.strip()
        assert message in err and "\n" not in err and "Byzantine" not in err, (argv, err)
    assert not (tmp / "x").exists()


def _yaml(tmp, text, name="merge.yml"):
    p = tmp / name
    p.write_text(text)
    return str(p)


def _mk(tmp, cfg, out="out", *extra):
    assert main(["merge", "--quiet", "--mergekit-config", cfg, "--out", str(tmp / out), *extra]) == 0
    return _load(tmp / out)


def test_mergekit_linear_ties_and_task_arithmetic(ckpts):
    tmp, base, paths, b, xs = ckpts
    models = "".join(
        f"  - model: {p}\n    parameters:\n      weight: {w}\n" for p, w in zip(paths, W, strict=True)
    )
    got = _mk(tmp, _yaml(tmp, f"merge_method: linear\nmodels:\n{models}dtype: float32\n"), "lin")
    w = np.array(W)
    _close(got, {k: sum(wi * x[k] for wi, x in zip(w, xs, strict=True)) / w.sum() for k in KEYS})

    models_d = "".join(
        f"  - model: {p}\n    parameters:\n      weight: {w}\n      density: 0.5\n"
        for p, w in zip(paths, W, strict=True)
    )
    cfg = f"merge_method: ties\nbase_model: {base}\nmodels:\n  - model: {base}\n{models_d}"
    cfg += "parameters:\n  normalize: true\n"
    want = {k: _ties(b[k], [x[k] for x in xs], W, 0.5) for k in KEYS}
    _close(_mk(tmp, _yaml(tmp, cfg), "ties"), want)

    cfg = f"merge_method: task_arithmetic\nbase_model: {base}\nmodels:\n{models}parameters:\n  lambda: 0.5\n"
    want = {k: b[k] + 0.5 * sum(wi * (x[k] - b[k]) for wi, x in zip(w, xs, strict=True)) for k in KEYS}
    _close(_mk(tmp, _yaml(tmp, cfg), "ta"), want)


def test_mergekit_per_tensor_filters(ckpts):
    """mergekit's conditional values: the first filter that is a substring of the tensor's name wins."""
    tmp, base, paths, b, xs = ckpts
    weight = "      weight:\n        - filter: self_attn\n          value: {a}\n        - value: {c}\n"
    models = "".join(
        f"  - model: {p}\n    parameters:\n" + weight.format(a=a, c=c)
        for p, a, c in zip(paths, [1.0, 0.0, 0.0], [0.2, 0.3, 0.5], strict=True)
    )
    cfg = f"merge_method: task_arithmetic\nbase_model: {base}\nmodels:\n{models}"
    got = _mk(tmp, _yaml(tmp, cfg))
    for k in KEYS:
        w = [1.0, 0.0, 0.0] if "self_attn" in k else [0.2, 0.3, 0.5]
        want = b[k] + sum(wi * (x[k] - b[k]) for wi, x in zip(w, xs, strict=True))
        np.testing.assert_allclose(got[k], want, rtol=2e-5, atol=2e-5, err_msg=k)


@pytest.mark.slow
def test_mergekit_slerp_model_stock_and_karcher(ckpts):
    tmp, base, paths, b, xs = ckpts
    cfg = f"merge_method: slerp\nbase_model: {base}\nmodels:\n  - model: {base}\n  - model: {paths[0]}\n"
    cfg += "parameters:\n  t:\n    - filter: mlp\n      value: 0.3\n    - value: 0.6\n"
    got = _mk(tmp, _yaml(tmp, cfg), "slerp")
    _close(got, {k: _slerp(0.3 if "mlp" in k else 0.6, b[k], xs[0][k]) for k in KEYS})

    cfg = f"merge_method: model_stock\nbase_model: {base}\nmodels:\n" + "".join(
        f"  - model: {p}\n" for p in paths
    )
    _close(_mk(tmp, _yaml(tmp, cfg), "stock"), {k: _stock(b[k], [x[k] for x in xs]) for k in KEYS})

    cfg = "merge_method: karcher\nmodels:\n" + "".join(f"  - model: {p}\n" for p in paths)
    cfg += "parameters:\n  max_iter: 50\n  tol: 1.0e-7\n"
    got = _mk(tmp, _yaml(tmp, cfg), "karcher")
    # two nearly equal-norm directions: the Karcher mean is close to the normalised mean direction
    for k in KEYS:
        v = np.stack([x[k].reshape(-1) for x in xs])
        norms = np.linalg.norm(v, axis=1)
        u = v / norms[:, None]
        mu = u.mean(0)
        for _ in range(50):
            cos = np.clip(u @ mu / np.linalg.norm(mu), -1, 1)
            mu = mu / np.linalg.norm(mu)
            th = np.arccos(cos)
            t = ((th / np.sin(th))[:, None] * (u - cos[:, None] * mu)).mean(0)
            nt = np.linalg.norm(t)
            if nt < 1e-12:
                break
            mu = np.cos(nt) * mu + np.sin(nt) * t / nt
        want = (mu / np.linalg.norm(mu) * norms.mean()).reshape(got[k].shape)
        np.testing.assert_allclose(got[k], want, rtol=1e-4, atol=1e-4, err_msg=k)


def test_mergekit_dare_with_seed(ckpts):
    tmp, base, paths, b, xs = ckpts
    models = "".join(
        f"  - model: {p}\n    parameters:\n      weight: {w}\n      density: {d}\n"
        for p, w in zip(paths, W, strict=True)
        for d in [1.0]
    )
    cfg = f"merge_method: dare_linear\nbase_model: {base}\nmodels:\n{models}"
    got = _mk(tmp, _yaml(tmp, cfg), "dl", "--seed", "7")  # density 1: nothing dropped, task arithmetic
    _close(got, {k: b[k] + sum(wi * (x[k] - b[k]) for wi, x in zip(W, xs, strict=True)) for k in KEYS})
    report = json.loads((tmp / "dl" / "merge_report.json").read_text())
    assert report["seed"] == 7 and report["method"] == "dare_linear"
    cfg = cfg.replace("density: 1.0", "density: 0.5").replace("dare_linear", "dare_ties")
    one = _mk(tmp, _yaml(tmp, cfg), "dt1", "--seed", "1")
    again = _mk(tmp, _yaml(tmp, cfg), "dt2", "--seed", "1")
    other = _mk(tmp, _yaml(tmp, cfg), "dt3", "--seed", "2")
    k = KEYS[0]
    np.testing.assert_array_equal(one[k], again[k])
    assert not np.array_equal(one[k], other[k])


@pytest.mark.parametrize(
    ("text", "message"),
    [
        (
            "merge_method: frankenmerge\nmodels:\n  - model: {m}\n",
            "'frankenmerge' is not one of mergekit 0.1.5",
        ),
        ("merge_method: linear\nslices:\n  - sources: []\n", "slices[0]: expected {sources:"),
        (
            "merge_method: model_stock\nbase_model: {b}\nslices:\n  - sources:\n      - model: {m}\n"
            "        layer_range: [0, 1]\n",
            "model_stock runs with models:",
        ),
        (
            "merge_method: ties\nbase_model: {b}\nmodels:\n  - model: {m}\n    parameters:\n      weight: 1\n"
            "parameters:\n  density: {{a: 1}}\n",
            "density: expected a value or a list of {filter, value}",
        ),
        ("merge_method: linear\nmodules:\n  x: 1\n", "modules: modules are not supported"),
        (
            "merge_method: della\nbase_model: {b}\nmodels:\n  - model: {m}\n    parameters:\n"
            "      weight: 1\n      density: 0.9\n      epsilon: 0.2\n",
            "density +/- epsilon must be inside (0, 1)",
        ),
        (
            "merge_method: linear\nmodels:\n  - model: {m}\n",
            "models[0].parameters.weight: linear needs a weight",
        ),
        (
            "merge_method: linear\nmodels:\n  - model: {m}\n    parameters:\n      weight: 1\nfoo: 1\n",
            "foo: not a key",
        ),
        (
            "merge_method: ties\nmodels:\n  - model: {m}\n    parameters:\n      weight: 1\n",
            "base_model: ties needs",
        ),
    ],
)
def test_mergekit_config_refusals_are_one_line(ckpts, capsys, text, message):
    tmp, base, paths, _, _ = ckpts
    cfg = _yaml(tmp, text.format(m=paths[0], b=base))
    assert main(["merge", "--quiet", "--mergekit-config", cfg, "--out", str(tmp / "x")]) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and "\n" not in err, err


@pytest.mark.slow
def test_every_offered_method_runs(ckpts):
    """Each name ``--method`` offers merges two or three tiny inputs (with --seed where randomized)."""
    tmp, base, paths, _, _ = ckpts
    offered = merge_methods()
    assert {"linear", "dare_linear", "dare_ties", "ties", "signguard"} <= set(offered)
    assert not {"dare", "clip", "nnm", "arc", "bulyan"} & set(offered)
    for name in offered:
        spec = RULES[name]
        n = next(m for m in (2, 3) if spec.requirement(m, 0) is None)
        argv = ["--method", name, "--quiet", "--out", str(tmp / f"o_{name}")]
        argv += ["-f", "0"] if spec.takes_f else []
        argv += ["--base", base] if spec.needs_base else []
        argv += ["--seed", "3"] if spec.randomized else []
        argv += ["--weights", ",".join(["1"] * n)] if "weights" in spec.needs else []
        assert main(["merge", *argv, *paths[:n]]) == 0, name
        if spec.randomized:
            assert json.loads((tmp / f"o_{name}" / "merge_report.json").read_text())["seed"] == 3
