"""The benchmark harness: arguments, the settings record and strict JSON result files."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # benchmarks/ beside tests/

from benchmarks import harness  # noqa: E402


def test_parser_has_quick_and_out_and_save_writes_there(tmp_path):
    args = harness.parse(harness.parser("Title line.\nMore."), ["--quick", "--out", str(tmp_path)])
    assert args.quick is True and args.out == tmp_path
    payload = {"value": float("nan"), "worst": -math.inf, "array": np.arange(3), "n": np.int32(4)}
    jpath, mpath = harness.save("demo", args.quick, payload, "# demo\n", settings={"rounds": 3})
    assert (jpath, mpath) == (tmp_path / "demo_quick.json", tmp_path / "demo_quick.md")
    assert harness.plot_path("demo", True) == tmp_path / "demo_quick.png"
    # Strict JSON: a reader that rejects NaN/Infinity tokens accepts the file.
    record = json.loads(jpath.read_text(), parse_constant=lambda c: pytest.fail(f"non-JSON token {c}"))
    assert record["command"] == "python -m benchmarks demo --quick"
    assert record["settings"] == {"rounds": 3}
    assert record["value"] == "nan" and record["worst"] == "-inf"
    assert record["array"] == [0, 1, 2] and record["n"] == 4
    assert record["machine"]["cpu_count"] >= 1 and len(record["load_average"]) == 3
    assert mpath.read_text() == "# demo\n"
    harness.parse(harness.parser(None), [])  # back to the default folder for later tests
    assert harness.results_folder() == harness.RESULTS


def test_recorded_command_keeps_the_scripts_own_arguments(tmp_path):
    p = harness.parser(None)
    p.add_argument("--rules")
    harness.parse(p, ["--rules", "a,b c", "--quick", f"--out={tmp_path}"])
    assert harness.command("demo", True) == "python -m benchmarks demo --quick --rules 'a,b c'"
    harness.parse(harness.parser(None), [])
    assert harness.command("demo", False) == "python -m benchmarks demo"


def test_best_time_is_the_minimum_and_ratio_checks_its_floor():
    calls = []
    assert harness.best_time(lambda: calls.append(1), repeats=4, warmup=2) >= 0.0
    assert len(calls) == 6  # warm-up calls are not timed but do run
    assert harness.ratio(3.0, 1.5) == 2.0
    with pytest.raises(ValueError, match="floor"):
        harness.ratio(1.0, 0.0)
    with pytest.raises(ValueError, match="repeats"):
        harness.best_time(lambda: None, repeats=0)


def test_mean_std_takes_non_finite_values():
    # An epsilon of inf (no DP) in every seed: the summary of a multi-seed run must not raise.
    assert harness.mean_std([math.inf, math.inf]) == (math.inf, 0.0)
    m, s = harness.mean_std([1.0, math.inf])
    assert m == math.inf and math.isnan(s)
    assert harness.mean_std([1.0, 3.0]) == pytest.approx((2.0, math.sqrt(2.0)))
    assert harness.mean_std([5.0]) == (5.0, 0.0)
