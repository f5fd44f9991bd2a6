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


@pytest.mark.slow  # imports every benchmark module (about 5 s)
def test_every_committed_page_is_rendered_from_its_json():
    # A page "carried" from the markdown a run wrote would hold numbers no renderer checked: every
    # committed result file has a renderer that accepts it (the fallback is for new benchmarks).
    names = {name: b.module for name, b in publish.discover().items()}
    files = publish.result_files()
    stems = [p.stem for p in files]
    carried = [p.stem for p in files if not publish.render_page(p, names, stems).rendered]
    assert not carried, f"pages not rendered from their JSON: {carried}"


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
    default = system["without DP"]  # the default config ships without DP
    assert f") reaches {sum(default) / len(default):.3f} ± " in readme
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


# ----------------------------------------------------------------------------- docs/results.md

RESULTS_MD = ROOT / "docs" / "results.md"
FINDING = re.compile(r"<!-- publish: finding ([a-z0-9_]+) -->\n(.*?)\n<!-- /publish -->", re.DOTALL)


def _results_page() -> str:
    return RESULTS_MD.read_text(encoding="utf-8")


def _block(name: str) -> str:
    return dict(FINDING.findall(_results_page()))[name]


@pytest.mark.slow  # the findings import the package's defaults (jax) and read every result file
def test_results_page_is_what_publish_renders():
    text = _results_page()
    assert publish.results_page(text) == text, "run `python -m benchmarks publish`: docs/results.md differs"
    assert publish.RESULTS_MD in publish.render_all()  # --check and the full publish cover it


def test_results_page_has_no_hand_copied_number():
    # Outside the finding blocks, the code spans and the link targets, the prose carries no decimal
    # number: a measurement copied by hand cannot come back.
    prose = FINDING.sub("", _results_page())
    prose = re.sub(r"`[^`]*`", "", prose)
    prose = re.sub(r"\]\([^)]*\)", "]", prose)
    assert not re.findall(r".{0,30}\d\.\d.{0,30}", prose)
    assert len(FINDING.findall(_results_page())) >= 15


def test_results_page_links_exist():
    links = re.findall(r"\]\((results/[a-z0-9_.]+\.md)\)", _results_page())
    assert len(links) >= 20
    for link in links:
        assert (ROOT / "docs" / link).is_file(), link
    stems = {p.stem for p in publish.result_files()}
    for link in links:
        stem = Path(link).stem
        assert stem == "index" or stem in stems, f"{link}: no result file behind it"


def _json(stem: str) -> dict:
    return publish.load(publish.RESULTS / f"{stem}.json")


def test_robust_preset_finding_is_the_json():
    # The preset's largest gap to clean FedAvg over the seeds, recomputed from the raw report.
    d = _json("robust_preset")
    rep, chosen = d["report"], d["chosen"]
    gaps, worsts, cleans = [], [], []
    for seed in map(str, d["seeds"]):
        clean = rep["mean"][seed]["none"][0]
        worst = min(v[0] for attack, v in rep[chosen][seed].items() if attack != "none")
        gaps.append(100 * (clean - worst))
        worsts.append(worst)
        cleans.append(clean)
    row = (
        f"| {d['settings']['task']}, alpha = 0.3 | {sum(cleans) / len(cleans):.3f} | "
        f"{sum(worsts) / len(worsts):.3f} | {max(gaps):.1f} |"
    )
    assert row in _block("robust_preset")


def test_merge_pipeline_finding_is_the_json():
    # Mixture-NLL weights against the vote alone, recomputed from the runs (not the summary).
    d = _json("ablations_digits")

    def mean_acc(merge: str) -> float:
        accs = [
            r["consensus_accuracy"] for r in d["merge_runs"] if r["merge"] == merge and r["threat"] == "clean"
        ]
        assert len(accs) == len(d["settings"]["seeds"]), merge
        return sum(accs) / len(accs)

    diff = mean_acc("vote + mixture NLL (default)") - mean_acc("vote alone")
    side = "above" if diff > 0.0005 else "below" if diff < -0.0005 else "level with"
    assert f"are {abs(100 * diff):.1f} points {side} the vote alone clean" in _block("merge_pipeline_digits")


def test_system_finding_is_the_json():
    # The default's margin over plain FedAvg under attack, from the per-seed values.
    d = _json("meta_consensus")
    diffs = []
    for scenario in d["settings"]["scenarios"]:
        if scenario == "clean":
            continue
        v = d["summary"][scenario]["values"]
        ours, fedavg = v["without DP"], v["plain FedAvg"]
        diffs.append(100 * (sum(ours) / len(ours) - sum(fedavg) / len(fedavg)))
    assert f"the default is {min(diffs):+.1f} to {max(diffs):+.1f} points against plain FedAvg" in _block(
        "system"
    )


def test_unknown_finding_and_foreign_blocks_are_refused(tmp_path):
    with pytest.raises(ValueError, match="unknown finding 'no_such_finding'"):
        publish.results_page("<!-- publish: finding no_such_finding -->\n<!-- /publish -->\n", tmp_path)
    with pytest.raises(ValueError, match="only `<!-- publish: finding NAME -->` blocks"):
        publish.results_page("<!-- publish: headlines -->\n<!-- /publish -->\n", tmp_path)


def test_empty_blocks_are_filled_in_place(tmp_path):
    # A new block has no body; filling it must not swallow the prose up to the next block.
    (tmp_path / "trainers.json").write_text(
        json.dumps({"tasks": {"digits": {"summary": {"trainer1_over_hand_scan_throughput": 0.5}}}})
    )
    (tmp_path / "trainers_dp.json").write_text(
        json.dumps({"dp": {"MLP": {"dp_over_plain": 3.0, "dp_over_plain_lower_bound": 2.0}}})
    )
    empty = "<!-- publish: finding trainers -->\n<!-- /publish -->"
    text = f"a\n{empty}\nprose\n{empty}\n"
    out = publish.results_page(text, tmp_path)
    body = (
        "One node's throughput over a hand-written scan loop: digits 0.50x. A DP-SGD step over the plain "
        "step, 8 nodes: MLP: 3.00x (noise alone puts the floor at 2.00x)."
    )
    block = f"<!-- publish: finding trainers -->\n{body}\n<!-- /publish -->"
    assert out == f"a\n{block}\nprose\n{block}\n"
    assert publish.results_page(out, tmp_path) == out
