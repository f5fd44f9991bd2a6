"""The user guide says what every weight objective does and how the merge's stages compose."""

from __future__ import annotations

from pathlib import Path

from meta_consensus.objectives import OBJECTIVES

DOCS = Path(__file__).resolve().parents[2] / "docs"


def test_convex_page_describes_every_registered_objective():
    text = (DOCS / "convex.md").read_text(encoding="utf-8")
    missing = [name for name in OBJECTIVES.names() if f'"{name}"' not in text]
    assert not missing, f"docs/convex.md does not describe the objectives {missing}"


def test_round_page_says_how_the_stages_compose():
    text = (DOCS / "round.md").read_text(encoding="utf-8")
    assert "## How the stages compose" in text
    for needle in ('weights.objective = "vote"', "server step", "decided by", "share of\nthe consensus"):
        assert needle in text, needle
