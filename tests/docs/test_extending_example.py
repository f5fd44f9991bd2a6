"""docs/extending.md's complete rule runs as written: a plug-in that meets the merge contract."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest

from consensus.plugins import load_plugins
from consensus.specs import RULES
from meta_consensus.merge.plan import merge_methods

ROOT = Path(__file__).resolve().parents[2]
MODULE = "extending_doc_rules"  # a name no other test imports


@pytest.fixture
def rule(tmp_path, monkeypatch):
    text = (ROOT / "docs" / "extending.md").read_text(encoding="utf-8")
    block = re.search(r"<!-- extending-rule -->\n```python\n(.*?)\n```", text, flags=re.DOTALL)
    assert block, "docs/extending.md lost its complete rule"
    (tmp_path / f"{MODULE}.py").write_text(block.group(1) + "\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", list(sys.path))
    try:
        load_plugins([MODULE])  # imports it and checks its vector rule against the merge contract
        yield RULES["closest_mean"]
    finally:
        if "closest_mean" in RULES:
            RULES.unregister("closest_mean")
        sys.modules.pop(MODULE, None)


def test_the_documented_rule_is_the_mean_of_the_closest_valid_nodes(rule):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(7, 5))
    x[3] *= 50.0  # far from the model
    x[5, 2] = np.nan  # not finite: never kept
    params = rng.normal(size=(5,))
    mask = np.array([True] * 6 + [False])  # node 6 did not answer
    agg = rule.build(1)
    merged, state = agg.update(
        {"w": jnp.asarray(x, jnp.float32)}, agg.init(None), {"w": jnp.asarray(params, jnp.float32)}, mask=mask
    )
    valid = mask & np.isfinite(x).all(axis=1)
    dist = np.where(valid, ((x - params) ** 2).sum(axis=1), np.inf)
    keep = np.argsort(dist)[: valid.sum() - 1]
    np.testing.assert_allclose(np.asarray(merged["w"]), x[keep].mean(axis=0), rtol=1e-5, atol=1e-6)
    assert sorted(np.flatnonzero(np.asarray(state.info.selected))) == sorted(keep)
    assert 3 not in keep and "closest_mean" in merge_methods()
