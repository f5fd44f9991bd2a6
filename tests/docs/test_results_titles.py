"""The results index: one title per page, each naming what its page measured."""

from __future__ import annotations

import re
from pathlib import Path

from benchmarks.quality.robustness import task_of

ROOT = Path(__file__).resolve().parents[2]


def test_every_page_of_the_results_index_has_its_own_title():
    index = (ROOT / "docs" / "results" / "index.md").read_text(encoding="utf-8")
    titles = re.findall(r"^- \[(.*)\]\(", index, flags=re.MULTILINE)
    assert len(titles) > 10 and len(set(titles)) == len(titles), sorted(titles)


def test_a_robustness_page_is_titled_by_its_runs_task():
    assert task_of({"settings": {}, "argv": ["robustness.py", "--task", "fashion_mnist"]}) == "fashion_mnist"
    assert task_of({"settings": {}, "argv": ["robustness.py", "--task=fashion_mnist"]}) == "fashion_mnist"
    assert task_of({"settings": {}, "argv": ["robustness.py", "--quick"]}) == "digits"
    page = (ROOT / "docs" / "results" / "robustness_fashion_mnist.md").read_text(encoding="utf-8")
    assert page.splitlines()[0] == "# Byzantine robustness on Fashion-MNIST"
