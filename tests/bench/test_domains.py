"""benchmarks.quality.domains on a tiny Llama written by transformers: every row the page names, the
multitask model's data is every node's windows once, the tangent fine-tunes have no loss barrier,
and the page is rendered from the results."""

from __future__ import annotations

import json

import numpy as np
import pytest

from benchmarks.quality import domains

pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("tokenizers")

TINY = {"context": 16, "batch": 2, "steps": 3, "lr": 1e-3, "windows_per_node": 8, "heldout_windows": 8,
        "test_windows": 8, "stat_rows": 2, "rounds": 2,
        "lora_rank": 2, "lora_lr": 1e-2, "barrier_points": 3, "general_windows": 8}  # fmt: skip


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    from causal_lm_helpers import model_folder

    folder = model_folder(tmp_path_factory.mktemp("tiny_llama"))
    return domains.one_seed(str(folder), 0, TINY, tmp_path_factory.mktemp("corpus"))


def test_the_domains_are_the_code_families_and_the_interpreters_documentation(tmp_path):
    import pydoc_data.topics as topics

    d = domains.domains(tmp_path)
    assert list(d) == ["net", "concurrency", "runtime", "prose"]
    lines = (tmp_path / "pydoc_topics.jsonl").read_text(encoding="utf-8").splitlines()
    assert sorted(json.loads(line)["text"] for line in lines) == sorted(topics.topics.values())


@pytest.mark.slow
def test_every_row_and_barrier_the_page_names(run):
    doms = run["domains"]
    assert doms == ["net", "concurrency", "runtime", "prose"]
    want = {"base", "multitask", "mean", "task arithmetic", "ties", "dare+ties", "model stock", "fisher",
            "regmean", "layer-wise weights (per module)", "mixture-NLL weights", "median", "trimmed mean",
            "mean, 1 poisoned", "median, 1 poisoned", "trimmed mean, 1 poisoned", "tangent mean",
            "tangent task arithmetic"}  # fmt: skip
    want |= {f"specialist: {d}" for d in doms} | {f"tangent specialist: {d}" for d in doms}
    want |= {f"LoRA specialist: {d}" for d in doms} | {f"LoRA {row}" for row, _, _ in domains.LORA_MERGES}
    want |= {f"soup specialist: {d}" for d in doms} | {"soup mean", "soup task arithmetic"}
    want |= {f"hierarchical specialist: {d}" for d in doms}
    want |= {"hierarchical mean", "hierarchical task arithmetic"}
    want |= {f"federated {row}" for row, _, _ in domains.FEDERATED}
    assert set(run["rows"]) == want
    for row in run["rows"].values():
        assert set(row) == {*doms, "all"} and all(np.isfinite(v) and v > 1 for v in row.values())
    assert run["scales"]["task arithmetic"] in domains.SCALES
    assert run["scales"]["regmean"] in domains.REGMEAN_SCALES
    assert all(1 <= k <= domains.SNAPSHOTS for k in run["scales"]["soup snapshots kept"])
    # the hierarchical strategy's default split of the steps: half general, a quarter each after
    assert run["scales"]["hierarchical steps per level"] == [1, 0, 2]  # floor(0.5 * 3), floor(0.25 * 3)
    assert run["rows"]["hierarchical specialist: net"] != run["rows"]["specialist: net"]
    assert sum(run["scales"]["layer-wise weights (per module)"]) == pytest.approx(1.0, abs=1e-3)
    assert run["seconds"]["step s"] > 0 and run["seconds"]["tangent step s"] > 0
    assert sum(run["scales"]["mixture-NLL weights"]) == pytest.approx(1.0, abs=1e-3)
    # fine-tuning moved the specialists: each is better than the base on its own domain
    for d in doms:
        assert run["rows"][f"specialist: {d}"][d] < run["rows"]["base"][d]
    # linearised fine-tunes: the loss is convex in theta, so no barrier (float32 slack)
    assert run["barriers"]["tangent"]["pairwise max"] <= 1e-5
    assert run["barriers"]["tangent"]["to mean max"] <= 1e-5
    res = {"runs": [run], "total_s": 1.0, "settings": {"quick": True, "model": "tiny", "seeds": [0], **TINY}}
    md = domains.markdown(res)
    assert md.startswith("# ") and "| tangent task arithmetic |" in md and "## Findings" in md
    assert "| federated tangent mean |" in md and "| LoRA ties |" in md
    assert "| hierarchical task arithmetic |" in md and "| federated hierarchical mean |" in md
    # a part run with other sections of the same seed combines into the same page
    part = {
        "runs": [{**run, "sections": ["oneshot"]}],
        "total_s": 1.0,
        "settings": {**res["settings"], "sections": ["oneshot"]},
    }
    extra = {"domains": run["domains"], "sections": ["lora"], "rows": {"extra": run["rows"]["base"]}}
    other = {"runs": [extra], "total_s": 2.0, "settings": {**res["settings"], "sections": ["lora"]}}
    both = domains.combine_parts([part, other])
    assert both["runs"][0]["rows"]["extra"] == run["rows"]["base"] and both["total_s"] == 3.0
    assert both["runs"][0]["sections"] == ["oneshot", "lora"]


def test_the_multitask_data_is_every_nodes_windows_once():
    train = {"x": np.arange(3 * 4 * 2).reshape(3, 4, 2), "y": np.arange(3 * 4 * 2).reshape(3, 4, 2) + 100}

    class Data:
        pass

    data = Data()
    data.train = train
    data.train_count = np.array([4, 2, 3])
    u = domains.union(data)
    want = np.concatenate([train["x"][0, :4], train["x"][1, :2], train["x"][2, :3]])
    np.testing.assert_array_equal(u.pool["x"][0], want)
    np.testing.assert_array_equal(u.pool["y"][0], want + 100)
    assert u.count.tolist() == [9] and u.index.tolist() == [list(range(9))]


def test_the_recommendation_is_the_best_row_of_what_the_coordinator_has():
    rows = {"mean": 20.3, "median": 20.2, "model stock": 24.0, "task arithmetic": 20.3, "dare+ties": 20.1,
            "mixture-NLL weights": 20.25, "fisher": 20.4, "regmean": 20.0, "mean, 1 poisoned": 28.4,
            "median, 1 poisoned": 21.8, "trimmed mean, 1 poisoned": 21.9}  # fmt: skip
    summary = {r: {"all": [v, 0.0]} for r, v in rows.items()}
    (line,) = domains.recommendation(summary)
    assert "the weights alone: **median** (20.20)" in line
    assert "held-out rows at the coordinator: **dare+ties** (20.10)" in line
    assert "(not private): **regmean** (20.00)" in line
    assert "the median (21.80 with one poisoned node, against the mean's 28.40)" in line
    assert domains.recommendation({"base": {"all": [25.0, 0.0]}}) == []


def _part(sections, general_windows, **extra):
    run = {"domains": ["a"], "sections": sections, "rows": {f"row {sections[0]}": {"a": 2.0, "all": 2.0}}}
    settings = {"quick": False, "size": "cpu", "model": "m", "seeds": [0], "sections": sections,
                "context": 48, "general_windows": general_windows, **extra}  # fmt: skip
    return {"runs": [run], "total_s": 1.0, "settings": settings}


def test_parts_combine_when_they_measured_the_same_thing():
    # the public pool's size matters only to the parts that read it (the hierarchical rows)
    both = domains.combine_parts([_part(["oneshot"], 8), _part(["hierarchical"], 48)])
    assert both["settings"]["general_windows"] == 48
    assert both["settings"]["sections"] == ["oneshot", "hierarchical"]
    assert set(both["runs"][0]["rows"]) == {"row oneshot", "row hierarchical"}
    with pytest.raises(ValueError, match="general_windows differ"):
        domains.combine_parts([_part(["hierarchical"], 8), _part(["federated"], 48)])
    # the federated part without its hierarchical row does not read the pool
    rows = [r for r, _, _ in domains.FEDERATED if r != "hierarchical mean"]
    domains.combine_parts([_part(["hierarchical"], 8), _part(["federated"], 48, federated_rows=rows)])
    with pytest.raises(ValueError, match="settings differ"):
        domains.combine_parts([_part(["oneshot"], 8), _part(["soup"], 8, context=32)])
    # results written before the sizes had names: --quick then is "cpu" now
    legacy = _part(["lora"], 8)
    legacy["settings"] = {k: v for k, v in legacy["settings"].items() if k not in ("size", "general_windows")}
    legacy["settings"]["quick"] = True
    assert domains.combine_parts([legacy, _part(["soup"], 8)])["settings"]["size"] == "cpu"


def test_the_combined_page_records_the_command_that_measures_it_all():
    assert domains.size_arguments("cpu", [0]) == ["--cpu"]
    assert domains.size_arguments("full", [0, 1, 2]) == []
    assert domains.size_arguments("full", [3]) == ["--seeds", "3"]
    assert domains.settings_for("quick")["steps"] < domains.settings_for("cpu")["steps"]
    with pytest.raises(SystemExit) as e:
        domains.main(["--quick", "--cpu"])
    assert e.value.code == 2


def test_each_strategy_is_reported_against_local_fine_tuning():
    doms = ["a", "b"]

    def row(a, b, all_):
        return {"a": [a, 0.0], "b": [b, 0.0], "all": [all_, 0.0]}

    summary = {"mean": row(9, 9, 10.0), "specialist: a": row(4, 20, 12), "specialist: b": row(20, 6, 13),
               "hierarchical mean": row(9, 9, 9.5), "hierarchical specialist: a": row(5, 20, 12),
               "hierarchical specialist: b": row(20, 8, 13), "federated mean (FedAvg)": row(8, 8, 8.0),
               "federated hierarchical mean": row(8, 8, 8.25)}  # fmt: skip
    (line,) = domains.strategies_against_local(summary, doms)
    # own-domain specialists: mean(5, 8) - mean(4, 6) = 1.5
    assert "hierarchical one-shot mean -0.50, own-domain specialists +1.50, federated +0.25" in line
    assert "tangent" not in line and "soup" not in line  # no rows, no claim
    assert domains.strategies_against_local({"mean": row(1, 1, 1)}, doms) == []


def _fake_sections(monkeypatch, fail=None):
    """subprocess.run as a section's process: writes that section's part where --out says."""
    import subprocess
    import types

    calls = []

    def run(cmd, **kw):
        calls.append((cmd, kw["env"]))
        sec, out = cmd[cmd.index("--sections") + 1], cmd[cmd.index("--out") + 1]
        if sec == fail:
            return types.SimpleNamespace(returncode=1)
        part = _part([sec], 8)
        part["settings"] |= {"size": "quick", "quick": True}
        folder = __import__("pathlib").Path(out)
        folder.mkdir(parents=True)
        (folder / "domains_quick.json").write_text(json.dumps(part))
        return types.SimpleNamespace(returncode=0)

    monkeypatch.setattr(subprocess, "run", run)
    return calls


def test_each_section_runs_in_a_process_of_its_own(monkeypatch, tmp_path):
    import argparse

    calls = _fake_sections(monkeypatch)
    args = argparse.Namespace(out=tmp_path, model="smollm2", federated_rows=None)
    res = domains.sections_apart(args, "quick", [0], ["oneshot", "federated"])
    assert [c[c.index("--sections") + 1] for c, _ in calls] == ["oneshot", "federated"]
    assert all("--quick" in c and c[c.index("--seeds") + 1] == "0" for c, _ in calls)
    # the sections share one compilation cache; the parts folder is gone once combined
    assert len({env["JAX_COMPILATION_CACHE_DIR"] for _, env in calls}) == 1
    assert list(tmp_path.iterdir()) == []
    assert set(res["runs"][0]["rows"]) == {"row oneshot", "row federated"}


def test_a_failed_section_keeps_the_finished_ones_and_names_them(monkeypatch, tmp_path):
    import argparse

    _fake_sections(monkeypatch, fail="federated")
    args = argparse.Namespace(out=tmp_path, model="smollm2", federated_rows=None)
    with pytest.raises(SystemExit, match="section 'federated' failed") as e:
        domains.sections_apart(args, "quick", [0], ["oneshot", "federated"])
    (kept,) = tmp_path.iterdir()
    assert str(kept) in str(e.value) and (kept / "oneshot" / "domains_quick.json").is_file()
