"""``meta-consensus merge`` on checkpoints the test writes: equals the in-memory library merge; errors."""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import consensus
from consensus import io
from meta_consensus.cli import main

N = 5


def _models(seed: int = 0, dtype=np.float32) -> list[dict]:
    rng = np.random.default_rng(seed)
    centre = {
        "encoder": {"kernel": rng.normal(size=(6, 4)), "bias": rng.normal(size=(4,))},
        "head": {"kernel": rng.normal(size=(4, 3))},
    }
    models = []
    for i in range(N):
        spread = 10.0 if i == N - 1 else 0.1  # the last input is an outlier
        models.append(
            jax.tree.map(lambda c, s=spread: (c + s * rng.normal(size=c.shape)).astype(dtype), centre)
        )
    return models


def _write(tmp_path, models, **kw) -> list[str]:
    paths = []
    for i, m in enumerate(models):
        single = i % 2 == 0 and not kw  # files and folders (sharded ones are folders)
        target = tmp_path / (f"in{i}.safetensors" if single else f"in{i}")
        paths.append(str(io.save_safetensors(m, target, **kw)))
    return paths


def _library(rule, models, params=None) -> dict:
    stacked = consensus.stack([jax.tree.map(jnp.asarray, m) for m in models])
    merged, _ = rule.update(stacked, rule.init(stacked), params)
    return jax.tree.map(np.asarray, merged)


@pytest.mark.parametrize(
    ("argv", "rule", "tol"),
    [
        pytest.param(["--method", "median"], consensus.median(), 0, marks=pytest.mark.slow),
        (["--method", "trimmed_mean", "-f", "1"], consensus.trimmed_mean(1), 1e-6),
        pytest.param(["--method", "krum", "-f", "1"], consensus.krum(1), 1e-6, marks=pytest.mark.slow),
        (["--method", "multi_krum", "-f", "1"], consensus.multi_krum(1), 1e-6),
        (
            ["--method", "geometric_median", "--set", "method.max_iter=200"],
            consensus.geometric_median(200),
            1e-4,
        ),
    ],
    ids=["median", "trimmed_mean", "krum", "multi_krum", "geometric_median"],
)
def test_merge_equals_the_in_memory_library_merge(tmp_path, argv, rule, tol):
    models = _models()
    inputs = _write(tmp_path, models)
    out = tmp_path / "merged"
    assert main(["merge", *argv, "--quiet", "--out", str(out), *inputs]) == 0
    got = io.load_safetensors(out)
    want = _library(rule, models)
    for k, v in io.flatten(want).items():
        np.testing.assert_allclose(io.flatten(got)[k], v, rtol=tol, atol=tol, err_msg=k)
    report = json.loads((out / "merge_report.json").read_text())
    assert report["method"] == argv[1] and report["inputs"] == inputs
    assert set(report["leaves"]) == set(io.flatten(models[0]))
    if argv[1] in ("krum", "multi_krum", "geometric_median"):
        (entry,) = report["vector_rules"].values()
        assert inputs[-1] not in entry["selected"] or argv[1] == "geometric_median"
        assert entry["weights"][-1] < 0.05  # the outlier gets (almost) no weight


def test_centered_clipping_around_a_base_and_per_leaf_override(tmp_path):
    models = _models(1)
    base = jax.tree.map(lambda x: np.mean([x] * 1, axis=0).astype(np.float32), models[0])
    inputs = _write(tmp_path, models)
    base_path = str(io.save_safetensors(base, tmp_path / "base.safetensors"))
    out = tmp_path / "merged"
    argv = ["merge", "--method", "centered_clipping", "--set", "method.clip_radius=0.5", "--base", base_path]
    argv += ["--override", r"^head\.=median", "--quiet", "--out", str(out), *inputs]
    assert main(argv) == 0
    got = io.load_safetensors(out)
    # Centered clipping's whole-model statistics cover the keys it merges (the encoder slice only).
    encoder = [{"encoder": m["encoder"]} for m in models]
    want = _library(
        consensus.centered_clipping(0.5), encoder, {"encoder": jax.tree.map(jnp.asarray, base["encoder"])}
    )
    for k in ("kernel", "bias"):
        np.testing.assert_allclose(got["encoder"][k], want["encoder"][k], rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(
        got["head"]["kernel"], np.median(np.stack([m["head"]["kernel"] for m in models]), 0)
    )
    report = json.loads((out / "merge_report.json").read_text())
    assert report["leaves"]["head.kernel"]["method"] == "median"


def test_toml_config_sharded_output_and_dtype(tmp_path):
    models = _models(2, dtype=ml_dtypes.bfloat16)
    inputs = _write(tmp_path, models, shard_size=30)  # sharded inputs (80 bytes each)
    out = tmp_path / "merged"
    cfg = tmp_path / "merge.toml"
    cfg.write_text(
        'method = "trimmed_mean"\nnum_byzantine = 1\nshard_size = 40\n'
        f"inputs = {json.dumps(inputs)}\nout = {json.dumps(str(out))}\n"
    )
    assert main(["merge", "--config", str(cfg), "--quiet"]) == 0
    assert (out / "model.safetensors.index.json").is_file()
    got = io.load_safetensors(out)
    f32 = [jax.tree.map(lambda x: x.astype(np.float32), m) for m in models]
    want = _library(consensus.trimmed_mean(1), f32)
    for k, v in io.flatten(want).items():
        g = io.flatten(got)[k]
        assert g.dtype == ml_dtypes.bfloat16  # the inputs' dtype is kept
        np.testing.assert_array_equal(g, v.astype(ml_dtypes.bfloat16))
    out32 = tmp_path / "merged32"
    assert main(["merge", "--config", str(cfg), "--dtype", "float32", "--out", str(out32), "--quiet"]) == 0
    assert io.load_safetensors(out32)["head"]["kernel"].dtype == np.float32


def _one_line_error(capsys, argv, pattern, tmp_path, before):
    try:
        code = main(argv)
    except SystemExit as e:  # argparse's own errors exit from inside the parser (one line, code 2)
        code = e.code
    assert code == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "Traceback" not in err, err
    assert pattern in err, err
    assert sorted(p.name for p in tmp_path.iterdir()) == before  # no output, no temporary left behind


def test_user_errors_are_one_line_exit_2_and_write_nothing(tmp_path, capsys):
    models = _models(3)
    inputs = _write(tmp_path, models)
    odd = jax.tree.map(lambda x: x, models[0])
    odd["head"]["kernel"] = np.zeros((4, 2), np.float32)
    io.save_safetensors(odd, tmp_path / "odd.safetensors")
    extra = dict(models[0], more={"w": np.zeros(2, np.float32)})
    io.save_safetensors(extra, tmp_path / "extra.safetensors")
    wrong_dtype = jax.tree.map(lambda x: x.astype(np.float16), models[0])
    io.save_safetensors(wrong_dtype, tmp_path / "f16.safetensors")
    (tmp_path / "exists").mkdir()
    before = sorted(p.name for p in tmp_path.iterdir())
    out = ["--quiet", "--out", str(tmp_path / "new")]
    cases = [
        (["--method", "nope", *out, *inputs], "unknown method 'nope'; valid methods"),
        (
            ["--method", "median", "--set", "method.beta=1", *out, *inputs],
            "median takes no parameter(s) ['beta']",
        ),
        (
            ["--method", "krum", "-f", "2", *out, *inputs],
            "krum: cannot tolerate f=2 Byzantine nodes with n=5",
        ),
        (["--method", "trimmed_mean", *out, *inputs], "needs --num-byzantine F"),
        (["--method", "clip", *out, *inputs], "is a 'pre' rule"),
        (
            ["--method", "median", *out, *inputs[:2], str(tmp_path / "odd.safetensors")],
            "'head.kernel' is float32[4, 2]",
        ),
        (["--method", "median", *out, *inputs[:2], str(tmp_path / "f16.safetensors")], "float16"),
        (
            ["--method", "median", *out, inputs[0], str(tmp_path / "extra.safetensors")],
            "has extra ['more.w']",
        ),
        (["--method", "median", "--quiet", "--out", str(tmp_path / "exists"), *inputs], "exists"),
        (["--method", "median", *out, *inputs, str(tmp_path / "missing.safetensors")], "not found"),
        (["--method", "median", "--override", "^zzz=mean", *out, *inputs], "match no key"),
        (["--method", "bulyan", "-f", "1", *out, *inputs], "bulyan: cannot tolerate f=1"),
        (["--method", "median", "--set", "beta", *out, *inputs], "expected method.PARAM=VALUE"),
        (["--method", "median", "--bogus", *out, *inputs], "unrecognized arguments: --bogus"),
    ]
    for argv, pattern in cases:
        _one_line_error(capsys, ["merge", *argv], pattern, tmp_path, before)


def test_parse_helpers():
    from meta_consensus import merge

    assert merge.parse_sets(["method.a=3", "method.b=0.5", "method.c=true", "method.d=word"]) == {
        "a": 3,
        "b": 0.5,
        "c": True,
        "d": "word",
    }
    o = merge.parse_override(r"^head\.=trimmed_mean,num_byzantine=1")
    assert (o.pattern, o.method, o.num_byzantine, dict(o.params)) == (r"^head\.", "trimmed_mean", 1, {})


def _ties_reference(models: list[dict], base: dict, density: float) -> dict:
    """TIES in float64 numpy, leaf by leaf (Yadav et al. 2023; the tie rule of ``consensus.ties``)."""
    out = {}
    for key, b in io.flatten(base).items():
        b = b.astype(np.float64)
        deltas = np.stack([io.flatten(m)[key].astype(np.float64) - b for m in models]).reshape(
            len(models), -1
        )
        k = max(1, int(density * deltas.shape[1]))
        kth = -np.sort(-np.abs(deltas), axis=1)[:, k - 1 : k]  # each node's k-th largest magnitude
        trimmed = np.where(np.abs(deltas) >= kth, deltas, 0.0)
        elected = np.where(trimmed.sum(0) >= 0, 1.0, -1.0)
        kept = np.where(np.sign(trimmed) == elected, trimmed, 0.0)
        count = (kept != 0).sum(0)
        out[key] = b + (kept.sum(0) / np.where(count == 0, 1, count)).reshape(b.shape)
    return out


@pytest.mark.parametrize("method", ["task_arithmetic", pytest.param("ties", marks=pytest.mark.slow)])
def test_task_vector_merges_over_a_base_equal_the_library_and_float64(tmp_path, method):
    models = _models(3)
    rng = np.random.default_rng(7)
    base = jax.tree.map(lambda x: (x + 0.05 * rng.normal(size=x.shape)).astype(np.float32), models[0])
    inputs = _write(tmp_path, models)
    base_path = str(io.save_safetensors(base, tmp_path / "base.safetensors"))
    out = tmp_path / "merged"
    if method == "task_arithmetic":
        sets, rule = ["--set", "method.scale=0.3"], consensus.task_arithmetic(0.3)
        f64 = {
            k: b.astype(np.float64)
            + 0.3 * sum(io.flatten(m)[k].astype(np.float64) - b.astype(np.float64) for m in models)
            for k, b in io.flatten(base).items()
        }
    else:
        sets, rule = ["--set", "method.density=0.5"], consensus.ties(0.5)
        f64 = _ties_reference(models, base, 0.5)
    argv = ["merge", "--method", method, *sets, "--base", base_path, "--quiet", "--out", str(out), *inputs]
    assert main(argv) == 0
    got = io.flatten(io.load_safetensors(out))
    want = io.flatten(_library(rule, models, jax.tree.map(jnp.asarray, base)))
    assert set(got) == set(want) == set(f64)
    for k in want:
        assert got[k].dtype == np.float32, k
        np.testing.assert_allclose(got[k], want[k], rtol=1e-6, atol=1e-6, err_msg=k)
        np.testing.assert_allclose(got[k], f64[k], rtol=1e-5, atol=1e-5, err_msg=k)
    report = json.loads((out / "merge_report.json").read_text())
    assert report["method"] == method and report["base"] == base_path


def test_task_vector_merge_without_a_base_is_one_line_exit_2(tmp_path, capsys):
    inputs = _write(tmp_path, _models(4))
    out = tmp_path / "merged"
    assert main(["merge", "--method", "ties", "--quiet", "--out", str(out), *inputs]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--base" in err[0], err
    assert not out.exists()
