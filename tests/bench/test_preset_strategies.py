"""benchmarks.quality.preset_strategies: each run is the preset changed only by its nodes'
strategies (and the clean scenario's attackers), and the page's per-seed differences against
all-local are the runs' own numbers, paired by seed."""

from __future__ import annotations

import pytest

from benchmarks.quality import preset_strategies as ps
from meta_consensus import config


@pytest.mark.parametrize("preset", sorted(ps.MIXES))
def test_a_run_is_the_preset_changed_only_by_its_strategies(preset):
    shipped = config.load(preset=preset)
    for mix in ps.MIXES[preset]:
        cfg = ps.build(preset, mix, "attacked", 3, None)
        assert cfg.nodes.strategy_of() == (mix,) * shipped.nodes.count
        assert cfg.seed == 3 and cfg.rounds == shipped.rounds
        assert cfg.byzantine == shipped.byzantine and cfg.vote == shipped.vote and cfg.task == shipped.task
        assert cfg.nodes.local_steps == shipped.nodes.local_steps and cfg.dp == shipped.dp
    clean = ps.build(preset, ps.SHIPPED, "clean", 0, 2)
    assert clean.byzantine.nodes == () or list(clean.byzantine.nodes) == []
    assert clean.nodes.strategy_of() == shipped.nodes.strategy_of() and clean.rounds == 2
    assert list(ps.shipped_strategies(preset)) == list(shipped.nodes.strategy_of())


def _runs():
    acc = {("local", 0): 0.90, ("local", 1): 0.80, ("soup", 0): 0.93, ("soup", 1): 0.79,
           ("shipped", 0): 0.85, ("shipped", 1): 0.86}  # fmt: skip
    return [
        {
            "preset": "private",
            "mix": m,
            "scenario": sc,
            "seed": s,
            "accuracy": a - (0.1 if sc == "attacked" else 0),
        }
        for (m, s), a in acc.items()
        for sc in ("clean", "attacked")
    ]


def test_differences_against_local_are_paired_by_seed():
    cells = ps.summarize(_runs())["private"]
    soup = cells["soup"]["clean"]
    assert soup["mean"] == pytest.approx(0.86) and soup["std"] == pytest.approx(0.07)
    assert soup["minus_local"] == pytest.approx([0.01, -0.01])  # seed 0: +0.03, seed 1: -0.01
    assert cells["shipped"]["attacked"]["minus_local"] == pytest.approx([0.005, -0.05])
    assert "minus_local" not in cells["local"]["clean"]
    assert ps.best_mix(cells) == "soup"  # mean 0.86 against 0.855 (shipped) and 0.85 (local)
    md = ps.markdown({"runs": _runs(), "shipped": {"private": ["soup", "local"]}, "total_s": 1.0,
                      "settings": {"quick": True, "presets": ["private"], "seeds": [0, 1]}})  # fmt: skip
    assert "best **soup**" in md and "| soup | 0.860 ± 0.070 | +1.0; -1.0 |" in md
    # the others against all-local, clean then attacked (every attacked run is 0.1 below its clean one)
    assert "all-local clean 0.850, attacked 0.750" in md and "soup +1.0; +1.0" in md


def test_a_tie_goes_to_local():
    runs = [
        {"preset": "p", "mix": m, "scenario": "clean", "seed": 0, "accuracy": 0.5} for m in ("soup", "local")
    ]
    assert ps.best_mix(ps.summarize(runs)["p"]) == "local"


def test_a_preset_whose_nodes_all_run_one_mix_is_not_run_twice(monkeypatch, tmp_path):
    calls = []

    def one_run(preset, mix, scenario, seed, quick):
        calls.append((preset, mix, scenario))
        return {
            "preset": preset,
            "mix": mix,
            "scenario": scenario,
            "seed": seed,
            "accuracy": 0.5,
            "seconds": 0.0,
        }

    monkeypatch.setattr(ps, "one_run", one_run)
    monkeypatch.setattr(
        ps, "shipped_strategies", lambda p: ["local"] * 8 if p == "private" else ["convexity", "local"]
    )
    ps.main(["--quick", "--out", str(tmp_path)])
    private = {m for p, m, _ in calls if p == "private"}
    assert private == set(ps.MIXES["private"])  # all-local is the "local" mix itself
    assert {m for p, m, _ in calls if p == "lora"} == {ps.SHIPPED, *ps.MIXES["lora"]}
    assert (tmp_path / "preset_strategies_quick.json").is_file()
