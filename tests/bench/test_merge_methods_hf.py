"""The merge-methods benchmark on transformers checkpoints: its quick mode runs and writes its table."""

from __future__ import annotations

import importlib.util
import json
import math
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # benchmarks/ beside tests/

# Looked up, not imported: importing transformers and torch at collection costs every worker seconds,
# even when this slow test is deselected.
if importlib.util.find_spec("transformers") is None or importlib.util.find_spec("torch") is None:
    pytest.skip("transformers and torch are not installed", allow_module_level=True)


@pytest.mark.slow
def test_quick_mode_writes_time_and_rss_per_method(tmp_path):
    from benchmarks import harness
    from benchmarks.speed import merge_methods_hf

    try:
        args = [
            "--quick",
            "--methods",
            "ties,median",
            "--mergekit-methods",
            "nearswap",
            "--out",
            str(tmp_path),
        ]
        merge_methods_hf.main([*args, "--workdir", str(tmp_path / "work")])
    finally:
        harness.parse(harness.parser(None), [])  # back to the default results folder
    record = json.loads((tmp_path / "merge_methods_hf_quick.json").read_text())
    assert record["command"].startswith("python -m benchmarks merge_methods_hf --quick")
    assert record["settings"]["fine_tunes"] == 5 and record["settings"]["parameters"] > 0
    assert set(record["floor"]) == {"inputs", "inputs + base"}
    assert set(record["results"]) == {"ties", "median", "mergekit:nearswap"}
    for method, r in record["results"].items():
        assert r["ok"], (method, r.get("error"))
        assert r["wall_s"] > 0 and r["peak_rss_gb"] > 0 and math.isfinite(r["ratio_to_floor"])
        assert r["mergekit"]
    assert record["results"]["ties"]["base"] and not record["results"]["median"]["base"]
    assert record["rss_reference"]["name"] == "median rule"
    assert record["results"]["median"]["rss_ratio_to_reference"] == 1.0
    md = (tmp_path / "merge_methods_hf_quick.md").read_text()
    assert "| ties |" in md and "read-once floor" in md
