"""The end-of-run table and plots: each node's share, the deciding stage, attackers let through."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from meta_consensus import config, report
from meta_consensus.coordinator import RoundInfo

N = 8  # the default config: 8 nodes, nodes 6 and 7 Byzantine


def _cfg(*overrides: str) -> config.Config:
    # Every setting the table reads is given here, so the embedded default may change.
    base = [
        "rounds=3",
        "nodes.count=8",
        "nodes.strategies=local",
        "byzantine.nodes=[6, 7]",
        "byzantine.attack=alie",
        "vote.rule=multi_krum",
        "vote.server_step=0",
        "weights.objective=mixture_nll",
        "dp.enabled=false",
    ]
    return config.load(None, [*base, *overrides])


def _info(r: int, accepted, weights, **logged) -> RoundInfo:
    nan = math.nan
    info = RoundInfo(
        round=r, attempt=0, ok=True, reason="", answered=[True] * N, valid=[True] * N,
        accepted=list(accepted), weights=list(weights), errors={}, node_accuracy=[0.5] * N,
        node_loss=[1.0] * N, train_loss=[1.0] * N, consensus_accuracy=0.9, consensus_loss=0.3,
        heldout_accuracy=0.9, fedavg_accuracy=0.8, epsilon=0.0, epsilon_rdp=0.0, epsilon_pld=0.0,
        clip_norm=nan, noise_std=nan, solve_ms=0.0, weight_cap=nan, seconds={"fit": 1.0},
    )  # fmt: skip
    for k, v in logged.items():  # the stage fields (absent from runs logged before them)
        setattr(info, k, v)
    return info


def _history(rng, kind="weights", decided="weights", moves=(math.nan,) * 3, through=False):
    out = []
    for r in range(3):
        accepted = np.array([True] * 6 + [through and r < 2, False])
        w = np.where(accepted, rng.uniform(0.1, 1.0, N), 0.0)
        w /= w.sum()
        out.append(
            _info(r, accepted, w, share=list(w), share_kind=kind, decided_by=decided, server_move=moves[r])
        )
    return out


def _rows(text: str) -> dict[int, list[str]]:
    rows = {}
    for line in text.splitlines():
        parts = line.split()
        if parts and parts[0].isdigit() and len(parts) > 4:
            rows[int(parts[0])] = parts
    return rows


def test_the_share_column_is_the_mean_share_and_sums_to_one():
    rng = np.random.default_rng(0)
    history = _history(rng)
    text = report.table(_cfg(), history)
    expected = np.mean([h.share for h in history], axis=0)  # float64 recomputation
    shown = np.array([float(_rows(text)[i][-1]) for i in range(N)])
    np.testing.assert_allclose(shown, expected, atol=5e-4)
    assert abs(shown.sum() - 1.0) < N * 5e-4
    assert "share: each node's weight in the merge" in text


@pytest.mark.parametrize(
    ("overrides", "decided", "moves", "needle"),
    [
        (
            ["weights.objective=vote"],
            "vote",
            (math.nan,) * 3,
            "the vote (vote.rule = 'multi_krum'",
        ),
        ([], "weights", (math.nan,) * 3, "decided by: the weights (weights.objective = 'mixture_nll'"),
        (["vote.server_step=0.5"], "weights", (0.2, 0.3, 0.4), "then the server step moved it 0.30x"),
        (
            ["vote.server_step=2.0"],
            "weights",
            (1.5, 2.0, 2.5),
            "by: the server step (vote.server_step = 2",
        ),
    ],
)
def test_the_footer_names_the_deciding_stage(overrides, decided, moves, needle):
    text = report.table(_cfg(*overrides), _history(np.random.default_rng(1), decided=decided, moves=moves))
    footer = [line for line in text.splitlines() if line.startswith("decided by:")]
    assert len(footer) == 1 and needle in footer[0], text


def test_attackers_the_vote_let_through_are_flagged():
    text = report.table(_cfg(), _history(np.random.default_rng(2), through=True))
    rows = _rows(text)
    assert "let" in rows[6] and "let" not in rows[7] and "let" not in rows[0]
    assert "attackers the vote let through: node 6 in 67% of rounds" in text


def test_an_attacker_a_coordinate_wise_vote_kept_but_trimmed_everywhere_is_not_flagged():
    # The trimmed mean accepts every node; node 6 carried nothing in any round, node 7 a full share.
    history = []
    for r in range(3):
        share = np.full(N, 1 / (N - 1))
        share[6] = 0.0
        history.append(_info(r, [True] * N, share, share=list(share), share_kind="coordinates"))
    cfg = _cfg("vote.rule=trimmed_mean", "weights.objective=vote")
    assert report.let_through(cfg, history) == {7: 1.0}
    text = report.table(cfg, history)
    rows = _rows(text)
    assert "let" not in rows[6] and "let" in rows[7]
    assert "attackers the vote let through: node 7 in 100% of rounds" in text


def test_a_run_logged_before_shares_still_reports(tmp_path):
    # A metrics.jsonl line of an older run: no share, share_kind, decided_by, server_move, stage_note.
    old = _info(0, [True] * 6 + [False] * 2, [1 / 6] * 6 + [0.0] * 2).to_json()
    for key in ("share", "share_kind", "decided_by", "server_move", "stage_note"):
        old.pop(key, None)
    info = RoundInfo.from_json(json.loads(json.dumps(old)))
    text = report.table(_cfg(), [info])
    assert "mean weight" in text and "decided by: the weights" in text
    assert report.plot(_cfg(), [info], tmp_path)


def test_the_stage_note_is_repeated_once_with_its_rounds():
    history = _history(np.random.default_rng(3))
    for h in history[:2]:
        h.stage_note = "vote.rule = 'median' kept every valid node"
    text = report.table(_cfg(), history)
    assert text.count("note (2 of 3 rounds): vote.rule = 'median' kept every valid node") == 1


@pytest.mark.parametrize("n", [8, 16, 24, 60, 70])
def test_node_colours_are_distinct(n):
    colours = report.node_colours(n)
    assert len(colours) == n and len({tuple(np.round(c, 4)) for c in colours}) == n


def test_plots_draw_shares_and_a_text_tasks_perplexity(tmp_path):
    history = _history(np.random.default_rng(4), through=True)
    for h in history:
        h.consensus_metrics = {"perplexity": 12.0 - h.round}
        h.node_metrics = {"perplexity": [15.0] * N}
    paths = report.plot(_cfg(), history, tmp_path)
    assert [p.name for p in paths] == ["accuracy.png", "weights.png", "perplexity.png"]
    assert all(p.stat().st_size > 1000 for p in paths)
