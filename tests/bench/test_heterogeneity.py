"""heterogeneity benchmark: the (G, B) fit, the breakdown point and a recorded run."""

from __future__ import annotations

import json

import numpy as np
import pytest

from benchmarks.quality import heterogeneity as het


def test_spread_and_signal_match_the_variance_identity():
    rng = np.random.default_rng(0)
    v = rng.normal(size=(12, 50)) + 0.3
    h, s = het.spread_and_signal(v)
    # mean_i ||v_i - v_bar||^2 = mean_i ||v_i||^2 - ||v_bar||^2 (another route to the same number)
    assert h == pytest.approx(np.mean(np.sum(v * v, axis=1)) - s, rel=1e-12)
    assert s == pytest.approx(float(np.sum(v.mean(axis=0) ** 2)), rel=1e-12)


def test_fit_g2_is_the_smallest_g2_that_fits_every_round():
    rng = np.random.default_rng(1)
    h, s = rng.uniform(1, 5, 20).tolist(), rng.uniform(0.1, 3, 20).tolist()
    for b2 in (0.0, 0.7, 1.9):
        g2 = het.fit_g2(h, s, b2)
        slack = [g2 + b2 * st - ht for ht, st in zip(h, s, strict=True)]
        assert min(slack) == pytest.approx(0.0, abs=1e-12) and all(x >= -1e-12 for x in slack)
    # A B^2 so large that every round fits with G = 0.
    assert het.fit_g2(h, s, max(a / b for a, b in zip(h, s, strict=True))) == 0.0


def test_bound_scale_and_the_breakdown_point():
    # f / n = 1/4: the breakdown is B^2 = n / f - 2 = 2.
    assert het.bound_scale(16, 4, 0.0, 3.0) == pytest.approx(4 / 8 * 3.0)
    assert het.bound_scale(16, 4, 1.0, 3.0) == pytest.approx(4 / 4 * 3.0)
    assert het.bound_scale(16, 4, 2.0, 3.0) == float("inf")
    sm = het.summarize([2.0, 1.0], [1.0, 0.5], 16, 4)
    assert sm["b2_breakdown"] == 2.0 and [x["b2"] for x in sm["fits"]] == [0.0, 0.5, 1.0, 1.5, 1.9]
    assert sm["b2_with_g0"] == 2.0 and sm["signal_median"] == 0.75
    first = sm["fits"][0]
    assert first["g2"] == 2.0 and first["bound_over_signal"] == pytest.approx(0.5 * 2.0 / 0.75)


@pytest.mark.slow  # a 2-round and a 5-round run of 16 digits nodes: ~40 s on 2 cores
def test_the_first_rounds_gradient_spread_equals_a_recomputation(tmp_path):
    """Round 0 starts from the initial consensus: its honest nodes' shard gradients, recomputed apart."""
    import jax

    from meta_consensus import config
    from meta_consensus.coordinator import Coordinator

    path = "configs/robust-noserver.toml"
    pairs, meta = het.record_run(path, ["rounds=2", "seed=0"])
    assert meta == {"n": 16, "f": 4, "honest": 12, "rounds": 2}
    assert len(pairs["gradient"]) == len(pairs["update"]) == 2
    assert all(h > 0 and s > 0 for ps in pairs.values() for h, s in ps)

    cfg = config.load(path, ["checkpoint_every=0", "byzantine.nodes=[]", "rounds=2", "seed=0"])
    co = Coordinator(cfg)
    theta = co.init(jax.random.key(cfg.seed)).consensus
    data = co.fleet.data
    rows = []
    for i in range(12):  # the preset's honest nodes: 0-11 (12-15 are Byzantine in its attacked runs)
        c = int(data.train_count[i])
        g = jax.grad(co.fleet.task.loss)(theta, {k: v[i, :c] for k, v in data.train.items()})
        rows.append(np.concatenate([np.asarray(x, np.float64).ravel() for x in jax.tree.leaves(g)]))
    v = np.stack(rows)
    mean = v.mean(axis=0)
    h = float(np.mean([np.sum((r - mean) ** 2) for r in v]))
    assert pairs["gradient"][0] == pytest.approx((h, float(mean @ mean)), rel=1e-4)

    res = het.main(["--quick", "--out", str(tmp_path)])
    saved = json.loads((tmp_path / "heterogeneity_quick.json").read_text())
    got = saved["runs"]["robust-noserver@0.3"]["seeds"]["0"]
    assert res["runs"].keys() == {"robust-noserver@0.3"} and len(got["gradient"]["h"]) == 5
    assert "B^2 breakdown" in (tmp_path / "heterogeneity_quick.md").read_text()
