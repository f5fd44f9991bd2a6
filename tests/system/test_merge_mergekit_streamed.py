"""The mergekit methods that need whole-tensor statistics run in passes over chunks and give the formula.

``meta-consensus merge --mergekit-config`` reads SLERP, NuSLERP, Multi-SLERP, SCE, Arcee Fusion and
RAM+ chunk by chunk (:mod:`consensus.merging.streamed`); here the chunk is 37 entries, so every
tensor is split into several chunks that cut its rows, and each output tensor is compared with
the whole-tensor formula of :mod:`consensus.merging.spherical` / ``generalized`` applied to the
inputs as written: the same bits where the statistics are exact (Arcee Fusion, RAM+), else within
float32 rounding of the tensor's scale.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
from safetensors.numpy import save_file

from consensus import io
from consensus.merging import generalized, spherical
from meta_consensus.cli import main

SHAPES = {"model.layers.0.mlp.weight": (20, 9), "model.layers.0.norm.weight": (9,), "lm_head.weight": (31, 9)}


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("streamed")
    rng = np.random.default_rng(7)
    base = {k: rng.normal(size=s).astype(np.float32) for k, s in SHAPES.items()}
    trees = {"base": base}
    for i in range(3):
        trees[f"m{i}"] = {k: (v + 0.2 * rng.normal(size=v.shape)).astype(np.float32) for k, v in base.items()}
    trees["m0"]["lm_head.weight"][0, :4] = base["lm_head.weight"][0, :4]  # unchanged entries
    for name, tree in trees.items():
        save_file(tree, str(tmp / f"{name}.safetensors"))
    return tmp, trees


def _run(tmp, doc, name, monkeypatch):
    from meta_consensus.merge import mergekit_exec

    monkeypatch.setattr(mergekit_exec, "CHUNK", 37)
    calls = []
    streamed = mergekit_exec._stats_streamed
    monkeypatch.setattr(
        mergekit_exec, "_stats_streamed", lambda *a, **k: calls.append(a[1].name) or streamed(*a, **k)
    )
    cfg = tmp / f"{name}.yml"
    cfg.write_text(json.dumps(doc))
    assert (
        main(["merge", "--quiet", "--mergekit-config", str(cfg), "--out", str(tmp / name), "--seed", "3"])
        == 0
    )
    report = json.loads((tmp / name / "merge_report.json").read_text())
    assert sorted(calls) == sorted(SHAPES)  # every tensor went through the chunked passes
    return io.flatten(io.load_safetensors(tmp / name)), report


def _close(got, want, exact=False):
    got, want = np.asarray(got), np.asarray(want, np.float32)
    if exact:
        np.testing.assert_array_equal(got, want)
        return
    step = np.finfo(np.float32).eps * float(np.max(np.abs(want)))
    assert np.max(np.abs(got.astype(np.float64) - want)) <= 2 * step


def _models(tmp, names, per=None):
    return [
        {"model": str(tmp / f"{n}.safetensors"), **({"parameters": per[i]} if per else {})}
        for i, n in enumerate(names)
    ]


@pytest.mark.parametrize(
    ("method", "params", "per"),
    [
        ("slerp", {"t": [0.2, 0.9]}, None),
        ("nuslerp", {}, [{"weight": 1.0}, {"weight": 0.6}]),
        ("nuslerp", {"nuslerp_flatten": False, "nuslerp_row_wise": True}, [{"weight": 1.0}, {"weight": 0.6}]),
        ("nuslerp", {"nuslerp_flatten": False}, [{"weight": 1.0}, {"weight": 0.6}]),
        ("multislerp", {}, [{"weight": 0.5}, {"weight": 1.0}, {"weight": 0.3}]),
        ("sce", {"select_topk": 0.4}, None),
        ("arcee_fusion", {}, None),
        ("ramplus_tl", {"epsilon": 0.15}, None),
    ],
)
def test_chunked_passes_equal_the_whole_tensor_formula(models, monkeypatch, method, params, per):
    tmp, trees = models
    one = method in ("slerp", "arcee_fusion")
    names = ["m0"] if one else ["m0", "m1"] if method == "nuslerp" else ["m0", "m1", "m2"]
    doc = {"merge_method": method, "base_model": str(tmp / "base.safetensors"), "parameters": params}
    doc["models"] = _models(tmp, names, per)
    got, report = _run(tmp, doc, f"{method}_{len(params)}", monkeypatch)
    for k in SHAPES:
        b, xs = trees["base"][k], [trees[n][k] for n in names]
        if method == "slerp":
            t = report["leaves"][k]["params"]["t"]  # the gradient at the tensor's layer
            assert 0.2 <= t <= 0.9
            want = spherical.slerp(t, b, xs[0])
        elif method == "nuslerp":
            row_wise, flatten = params.get("nuslerp_row_wise", False), params.get("nuslerp_flatten", True)
            d = spherical.nuslerp(0.6 / 1.6, xs[0] - b, xs[1] - b, row_wise=row_wise, flatten=flatten)
            want = b + d
        elif method == "multislerp":
            want = spherical.multislerp(xs, [0.5, 1.0, 0.3], b)
        elif method == "sce":
            want = generalized.sce(b, xs, 0.4)
        elif method == "arcee_fusion":
            want = spherical.arcee_fusion(b, xs[0])
        else:
            want = generalized.ram(b, xs, 0.15, plus=True)
        _close(got[k], want, exact=method in ("arcee_fusion", "ramplus_tl"))
