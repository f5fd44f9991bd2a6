"""A small config of the whole system for the tests: 6 digits nodes, every strategy, one ALIE attacker."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

from meta_consensus import config

SMALL = [
    "rounds=3",
    "seed=3",
    "checkpoint_every=1",
    "keep_checkpoints=5",
    "task.options.hidden=[16]",
    "nodes.count=6",
    "nodes.strategies=['hierarchical', 'convexity', 'soup', 'local', 'local', 'local']",
    "nodes.local_steps=12",
    "nodes.learning_rate=0.01",
    "nodes.options.soup.snapshots=2",
    "byzantine.nodes=[5]",
    "byzantine.attack=alie",
    "byzantine.options={z = 3.0}",
    "vote.rule=multi_krum",
    "vote.num_byzantine=1",
    "weights.objective=mixture_nll",
    "weights.max_weight=0.5",
    "dp.enabled=true",
    "dp.clip_norm=1.0",
    "dp.noise_multiplier=0.5",
]


def small_config(tmp_path, *overrides: str) -> config.Config:
    return config.load(None, [*SMALL, f"output_dir={tmp_path}", "name=small", *overrides])


def snapshot(root: Path) -> dict[str, str]:
    """Every file under ``root`` with a hash of its bytes (directories as entries too)."""
    out = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for d in dirnames:
            out[os.path.relpath(os.path.join(dirpath, d), root)] = "dir"
        for f in filenames:
            p = os.path.join(dirpath, f)
            out[os.path.relpath(p, root)] = hashlib.sha256(Path(p).read_bytes()).hexdigest()
    return out


def sets(*items: str) -> list[str]:
    """``--set`` flags for each override."""
    return [a for s in items for a in ("--set", s)]
