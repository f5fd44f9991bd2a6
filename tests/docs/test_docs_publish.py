"""The results pages and the README's numbers are what ``python -m benchmarks publish`` renders.

A committed page that differs from its JSON (a benchmark rerun without publishing, a page edited
by hand) fails here; so does a headline number of the README. The renderers themselves are
checked against the data they read: a headline's numbers are recomputed here from the JSON.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))  # benchmarks/ beside tests/

import pytest  # noqa: E402

from benchmarks import publish  # noqa: E402


@pytest.mark.slow  # imports every benchmark module (about 5 s)
def test_committed_pages_and_readme_equal_publish():
    files = publish.render_all()
    stale = [
        str(p.relative_to(ROOT)) for p, text in files.items() if not p.is_file() or p.read_text() != text
    ]
    extra = sorted(str(p.relative_to(ROOT)) for p in set(publish.PAGES.glob("*.md")) - set(files))
    assert not stale and not extra, (
        f"run `python -m benchmarks publish`: differs {stale}, no result file for {extra}"
    )


def test_every_result_file_has_a_page_with_its_provenance():
    for path in publish.result_files():
        page = (publish.PAGES / f"{path.stem}.md").read_text()
        data = json.loads(path.read_text())
        for field in ("Command", "Machine", "Date", "Settings"):
            assert f"- **{field}:**" in page, (path.stem, field)
        if "command" in data:
            assert f"`{data['command']}`" in page
        assert page.count("\n# ") == 0 and page.startswith("# "), "one title per page"


def test_new_result_files_are_picked_up(tmp_path):
    # A result file nobody registered (a benchmark landing later) gets a page and an index entry.
    (tmp_path / "brand_new_bench.json").write_text(
        json.dumps({"command": "python -m benchmarks brand_new_bench", "date": "2030-01-01", "x": 1})
    )
    (tmp_path / "brand_new_bench.md").write_text("# A new benchmark\n\nCommand: `x`\n\n| a |\n|---|\n| 1 |\n")
    names = {name: b.module for name, b in publish.discover().items()}
    page = publish.render_page(tmp_path / "brand_new_bench.json", names, ["brand_new_bench"])
    assert page.text.startswith("# A new benchmark\n")
    assert "- **Date:** 2030-01-01" in page.text and "| 1 |" in page.text
    assert not page.rendered  # no renderer: the run's own tables, said so on the page
    assert "[A new benchmark](brand_new_bench.md)" in publish.index([page])


def test_headline_numbers_are_the_json_numbers():
    readme = (ROOT / "README.md").read_text()
    results = publish.RESULTS
    privacy = json.loads((results / "privacy_quality.json").read_text())["target"]
    assert f"reaches {privacy['eps8']:.3f} test accuracy" in readme
    assert f"{100 * (privacy['nonprivate'] - privacy['eps8']):.1f} points below" in readme
    system = json.loads((results / "meta_consensus.json").read_text())["summary"]["alie"]["values"]
    full = system["full pipeline"]
    assert f"pipeline reaches {sum(full) / len(full):.3f}" in readme
    flower = json.loads((results / "flower_side_by_side.json").read_text())["results"]
    median = next(r for r in flower if r["package"] == "median")
    assert f"runs {median['flower_s'] / median['package_rule_s']:.0f}x faster" in readme
    # Every headline links to its page, and the page exists.
    for stem in re.findall(r"\(docs/results/([a-z0-9_.]+)\.md\)", readme):
        assert (publish.PAGES / f"{stem}.md").is_file(), stem


def test_make_run_table_is_the_recorded_run():
    record = json.loads((publish.RESULTS / "make_run.json").read_text())
    last = json.loads(record["metrics_jsonl"][-1])
    readme = (ROOT / "README.md").read_text()
    block = readme.split("<!-- publish: make-run")[1].split("<!-- /publish -->")[0]
    rows = {line.split()[0]: line.split() for line in block.splitlines() if line.strip()}
    assert rows["meta-consensus"][1] == f"{last['consensus_accuracy']:.3f}"
    assert rows["plain"][2] == f"{last['fedavg_accuracy']:.3f}"
    for i, acc in enumerate(last["node_accuracy"]):
        assert f"{acc:.3f}" in rows[str(i)], (i, rows[str(i)])
