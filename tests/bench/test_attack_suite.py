"""benchmarks.tuning.attack_suite: its conditions and candidates are the configs they name, its summary
and selection rule are what the page says, and the shipped default and robust-noserver preset are the
candidates the selection chose."""

from __future__ import annotations

from pathlib import Path

import pytest

from benchmarks.tuning import attack_suite as suite
from meta_consensus import config

ROOT = Path(__file__).resolve().parents[2]


def test_every_condition_is_the_attack_and_strength_it_names_on_every_config():
    for name, path in suite.CONFIGS.items():
        for label, attack, _options in suite.SUITE:
            cfg = config.load(ROOT / path, suite.attack_sets(label))
            if attack == "none":
                assert len(cfg.byzantine.nodes) == 0, (name, label)
                continue
            assert cfg.byzantine.attack == attack and len(cfg.byzantine.nodes) > 0, (name, label)
            # the label names the strength when it is not the attack's default
            assert (dict(cfg.byzantine.options) == {}) == ("=" not in label and " x" not in label), label
    assert ("sign_flip", "sign_flip", "{}") in suite.SUITE  # sign flip at its default scale 1
    assert set(suite.QUICK_SUITE) <= {c[0] for c in suite.SUITE}


def _named(name: str) -> tuple[str, tuple[str, ...], str, float]:
    """(rule, pre, objective, server step) spelled by a name: pre+...+rule[+objective][+server_s]."""
    from meta_consensus.objectives import OBJECTIVES

    step = 0.0
    parts = name.split("+")
    if parts[-1].startswith("server_"):
        step = float(parts.pop()[len("server_") :])
    objective = "vote"
    if parts[-1] in OBJECTIVES.names():
        objective = parts.pop()
    return parts[-1], tuple(parts[:-1]), objective, step


@pytest.mark.parametrize("which", sorted(suite.SELECT))
def test_every_candidate_is_the_vote_weights_and_step_it_names(which):
    config_name, candidates, _ = suite.SELECT[which]
    for name, sets in candidates.items():
        cfg = config.load(ROOT / suite.CONFIGS[config_name], sets)
        got = (cfg.vote.rule, tuple(cfg.vote.pre), cfg.weights.objective, cfg.vote.server_step)
        assert got == _named(name), name
        if which == "noserver":  # no coordinator data: no held-out weights, no server step or server rule
            assert cfg.weights.objective == "vote" and cfg.vote.server_step == 0.0, name
            assert cfg.vote.rule not in ("fltrust", "server_monna"), name


def _runs(values: dict[str, tuple[float, float]]) -> dict[str, dict[str, float]]:
    return {k: {"consensus": c, "fedavg": f} for k, (c, f) in values.items()}


def test_summarize_is_the_worst_attack_its_gap_and_the_margin_over_fedavg():
    runs = _runs({"clean": (0.95, 0.96), "a": (0.90, 0.80), "b": (0.92, 0.94), "c": (0.93, 0.93)})
    s = suite.summarize(runs)
    assert s["worst_attack"] == "a" and s["worst"] == 0.90
    assert s["gap"] == pytest.approx(6.0)  # clean FedAvg 0.96 - 0.90
    assert s["margin_attack"] == "b" and s["margin"] == pytest.approx(-2.0)  # 0.92 - 0.94
    assert s["clean_gap"] == pytest.approx(1.0)


def _summary(worst: float, margin: float, clean_gap: float, gap: float = 0.0) -> dict[str, float]:
    return {"worst": worst, "margin": margin, "clean_gap": clean_gap, "gap": gap}


def test_choose_keeps_the_rule_the_page_states():
    sel = {
        "loses": {"0.3": _summary(0.95, -0.1, 0.0), "1": _summary(0.96, 1.0, 0.0)},
        "clean_cost": {"0.3": _summary(0.94, 2.0, 1.5), "1": _summary(0.95, 2.0, 0.5)},
        "ok_low": {"0.3": _summary(0.90, 0.0, 0.5), "1": _summary(0.91, 0.5, 0.2)},
        "ok_high": {"0.3": _summary(0.92, 0.3, 1.0), "1": _summary(0.93, 0.1, 0.9)},
    }
    assert suite.choose("default", sel) == "ok_high"
    # none qualifies: the best smallest margin
    del sel["ok_low"], sel["ok_high"]
    assert suite.choose("default", sel) == "clean_cost"
    noserver = {"x": {"0.3": _summary(0, 0, 0, gap=4.0)}, "y": {"0.3": _summary(0, 0, 0, gap=3.5)}}
    assert suite.choose("noserver", noserver) == "y"


def test_the_shipped_default_and_presets_are_the_chosen_candidates():
    for which, chosen, path in (
        ("default", suite.DEFAULT_CHOSEN, "meta_consensus/default.toml"),
        ("noserver", suite.NOSERVER_CHOSEN, "meta_consensus/presets/robust-noserver.toml"),
        ("private", suite.PRIVATE_CHOSEN, "meta_consensus/presets/private.toml"),
    ):
        config_name, candidates, _ = suite.SELECT[which]
        shipped = config.load(ROOT / path)
        same = config.load(ROOT / path, candidates[chosen])
        assert (same.vote, same.weights) == (shipped.vote, shipped.weights), which
    preset = config.load(ROOT / "configs" / "robust-noserver.toml")
    assert preset.weights.objective == "vote" and preset.vote.server_step == 0.0
    assert (preset.nodes.count, len(preset.byzantine.nodes), preset.task.alpha) == (16, 4, 0.3)
    assert "robust-noserver" in config.preset_names()


def test_quick_report_and_selection_run_every_condition_and_render(monkeypatch, tmp_path):
    calls: list[tuple[str, list[str]]] = []

    def fake(path, sets):
        calls.append((path, list(sets)))
        attacked = any(s.startswith("byzantine.attack=") for s in sets)
        return {"consensus": 0.9 if attacked else 0.95, "fedavg": 0.85 if attacked else 0.96, "seconds": 0.0}

    monkeypatch.setattr(suite, "run_once", fake)
    res = suite.main(["--quick", "--out", str(tmp_path)])
    assert len(calls) == len(suite.QUICK_SUITE)  # the default, one seed, one alpha
    assert set(res["report"]) == {"default"} and set(res["report"]["default"]) == {"0.3"}
    md = (tmp_path / "attack_suite_quick.md").read_text()
    assert "| default | 0.3 | 0.950 ± 0.000 | 0.900 ± 0.000 |" in md and "6.00 (max 6.00)" in md
    assert md == suite.markdown({**res, "settings": __import__("json").loads(
        (tmp_path / "attack_suite_quick.json").read_text())["settings"]})  # fmt: skip

    calls.clear()
    res = suite.main(["--quick", "--select", "noserver", "--out", str(tmp_path)])
    assert len(calls) == len(suite.QUICK_SUITE) * len(suite.NOSERVER_CANDIDATES)
    assert all("seed=100" in s and "task.data_seed=100" in s for _, s in calls)
    assert res["chosen"] in suite.NOSERVER_CANDIDATES
    assert "Chosen: **" in (tmp_path / "attack_suite_select_noserver_quick.md").read_text()


def test_bad_options_are_one_line_errors(capsys):
    for argv, why in ((["--configs", "nope"], "--configs: unknown"), (["--seeds", "0,x"], "comma-separated")):
        with pytest.raises(SystemExit) as e:
            suite.main(argv)
        assert e.value.code == 2 and why in capsys.readouterr().err


def test_combine_merges_parts_run_in_parallel_and_refuses_overlaps():
    runs = _runs({"clean": (0.95, 0.96), "a": (0.90, 0.80)})
    st = {"conditions": ["clean", "a"], "alphas": [0.3], "seeds": [0], "rounds": None, "task": "digits"}
    one = {"kind": "report", "report": {"default": {"0.3": {"0": runs}}}, "settings": st, "total_s": 10.0}
    two = {"kind": "report", "report": {"robust": {"0.3": {"0": runs}}}, "settings": st, "total_s": 5.0}
    seed1 = {"kind": "report", "report": {"default": {"1": {"1": runs}}}, "settings": st, "total_s": 1.0}
    res, settings = suite.combine([one, two, seed1])
    assert res["report"]["default"] == {"0.3": {"0": runs}, "1": {"1": runs}} and res["total_s"] == 16.0
    assert (settings["configs"], settings["seeds"], settings["alphas"]) == (
        ["default", "robust"],
        [0, 1],
        [0.3, 1.0],
    )
    with pytest.raises(ValueError, match=r"default alpha 0.3 seeds \['0'\] reported twice"):
        suite.combine([one, one])
    with pytest.raises(ValueError, match=r"differ in \['rounds'\]"):
        suite.combine([one, {**two, "settings": {**st, "rounds": 5}}])
    # selections of disjoint candidates: chosen again over all of them
    ok = {"0.5": {"worst": 0.9, "margin": 0.5, "clean_gap": 0.2, "gap": 5.0}}
    bad = {"0.5": {"worst": 0.95, "margin": -1.0, "clean_gap": 0.2, "gap": 2.0}}
    sel = {"kind": "selection", "which": "default", "settings": st, "total_s": 1.0}
    res, _ = suite.combine([{**sel, "selection": {"median": ok}}, {**sel, "selection": {"multi_krum": bad}}])
    assert res["chosen"] == "median" and res["sets"] == suite.DEFAULT_CANDIDATES["median"]
    with pytest.raises(ValueError, match="mix kinds"):
        suite.combine([one, {**sel, "selection": {}}])
    # one candidate in two parts with other alphas: merged per alpha, chosen over both
    at03 = {"0.3": {"worst": 0.97, "margin": -0.5, "clean_gap": 0.0, "gap": 1.0}}
    res, settings = suite.combine(
        [{**sel, "selection": {"median": ok, "multi_krum": ok}}, {**sel, "selection": {"median": at03}}]
    )
    got = res["selection"]["median"]
    assert {a: {k: got[a][k] for k in ok["0.5"]} for a in got} == {**ok, **at03} and settings["alphas"] == [
        0.3,
        0.5,
    ]
    assert res["chosen"] == "multi_krum"  # median lost to FedAvg at alpha 0.3
    res, _ = suite.combine([{**sel, "selection": {"median": ok}}, {**sel, "selection": {"median": ok}}])
    assert list(res["selection"]["median"]["0.5"]["seeds"]) == ["100"]  # the same run twice counts once
    with pytest.raises(ValueError, match=r"median alpha 0.5 seed \['100'\] reported twice, with other"):
        suite.combine([{**sel, "selection": {"median": ok}}, {**sel, "selection": {"median": bad}}])


def test_a_selection_over_seeds_summarizes_the_seeds_mean_accuracies():
    one = _runs({"clean": (0.95, 0.95), "a": (0.90, 0.92), "b": (0.93, 0.93)})  # loses under a by 2
    two = _runs({"clean": (0.97, 0.95), "a": (0.94, 0.90), "b": (0.91, 0.93)})  # wins a by 4, loses b by 2
    got = suite.over_seeds(
        {"100": {"runs": one, **suite.summarize(one)}, "101": {"runs": two, **suite.summarize(two)}}
    )
    mean = _runs({"clean": (0.96, 0.95), "a": (0.92, 0.91), "b": (0.92, 0.93)})
    want = suite.summarize(mean)
    for k in ("worst", "worst_attack", "gap", "margin", "margin_attack", "clean_gap"):
        assert got[k] == pytest.approx(want[k]), k
    assert got["margin"] == pytest.approx(-1.0) and got["margin_min_seed"] == pytest.approx(-2.0)
    # parts of one candidate with other seeds combine into the same mean
    st = {"conditions": ["clean", "a", "b"], "rounds": None, "task": None, "select": "default"}

    def part(seed, runs):
        entry = {"median": {"0.5": {"runs": runs, **suite.summarize(runs)}}}
        return {"kind": "selection", "which": "default", "settings": {**st, "seed": seed}, "total_s": 1.0,
                "selection": entry}  # fmt: skip

    res, settings = suite.combine([part(100, one), part(101, two)])
    assert res["selection"]["median"]["0.5"]["margin"] == pytest.approx(-1.0) and settings["seeds"] == [
        100,
        101,
    ]


def test_readme_headline_says_the_defaults_smallest_margin_and_the_noserver_gap():
    from benchmarks import publish

    lose = _runs({"clean": (0.95, 0.96), "a": (0.90, 0.92)})  # margin -2, clean 1 point below
    win = _runs({"clean": (0.96, 0.96), "a": (0.94, 0.80)})  # the noserver gap: 0.96 - 0.94
    st = {"conditions": ["clean", "a"], "alphas": [0.3], "seeds": [0, 1]}
    d = {
        "settings": st,
        "report": {"default": {"0.3": {"0": lose, "1": win}}, "robust-noserver": {"0.3": {"0": win}}},
    }
    text = publish.headline_attack_suite(d)
    assert "at worst 2.0 points below plain FedAvg" in text and "clean 1.0 points below it" in text
    assert "the worst attack is 2.0 points below clean FedAvg" in text
    d["report"] = {"default": {"0.3": {"0": win}}}
    text = publish.headline_attack_suite(d)
    assert "never below plain FedAvg" in text and "clean not below it" in text and "noserver" not in text
