"""The accelerator benchmark's quick mode on this machine's backend: the JSON's structure and its ratios."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import jax
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # benchmarks/ beside tests/

from benchmarks import __main__ as entry  # noqa: E402
from benchmarks.speed import accelerator  # noqa: E402
from kernels import backend  # noqa: E402


def _run(tmp_path: Path, *args: str) -> dict:
    entry.run("accelerator", ["--quick", *args, "--out", str(tmp_path)])
    name = f"accelerator_{jax.default_backend()}_quick"
    assert (
        (tmp_path / f"{name}.md")
        .read_text()
        .startswith(f"# Accelerator benchmark on {jax.default_backend()}")
    )
    return json.loads((tmp_path / f"{name}.json").read_text())


def _check_ratios(res: dict) -> None:
    values = accelerator.ratios(res)
    assert values and all(math.isfinite(v) and v > 0 for v in values)


@pytest.mark.slow
def test_quick_rules_time_both_formulations_eagerly_and_jitted_on_clean_and_attacked_rows(tmp_path):
    res = _run(tmp_path, "--nodes", "8", "--sections", "rules")
    assert res["command"] == "python -m benchmarks accelerator --quick --nodes 8 --sections rules"
    assert res["backend"] == jax.default_backend() and res["settings"]["nodes"] == [8]
    assert res["merges"] is None and res["dp"] is None and res["round"] is None
    cells = {(r["rule"], r["impl"], r["mode"], r["input"]) for r in res["rules"] if r["rule"] != "floor"}
    for rule in accelerator.rules(8):
        impls = backend.ORDER_IMPLS if rule in accelerator.SWITCHED else ("-",)
        for impl in impls:
            for mode in accelerator.MODES:
                for inp in accelerator.INPUTS:
                    assert (rule, impl, mode, inp) in cells
    floors = [r for r in res["rules"] if r["rule"] == "floor"]
    assert len(floors) == 1 and floors[0]["seconds"] > 0
    assert set(res["order_impl_faster"]) == {f"{r} n=8" for r in accelerator.SWITCHED}
    assert set(res["order_impl_faster"].values()) <= set(backend.ORDER_IMPLS)
    assert res["order_impl_default"] == backend.DEFAULT_ORDER_IMPL[jax.default_backend()]
    _check_ratios(res)


@pytest.mark.slow
def test_quick_mode_with_every_section(tmp_path):
    res = _run(tmp_path)
    assert res["settings"]["sections"] == list(accelerator.SECTIONS)
    assert {r["method"] for r in res["merges"]} >= {"floor", "task_arithmetic", "ties"}
    assert res["dp"]["dp_over_plain"] > 0 and res["dp"]["nodes"] == 8
    assert res["round"]["nodes"] >= 1 and res["round"]["seconds"] > 0
    _check_ratios(res)
