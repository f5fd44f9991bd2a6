"""Render the results pages of the documentation and the README's numbers from the benchmark data.

``python -m benchmarks publish`` reads every ``benchmarks/results/*.json`` (the ``_quick`` ones
aside) and writes:

* ``docs/results/<stem>.md``: a header with the command, the machine, the date and the settings
  of the run (all read from the JSON), the tables rendered by the benchmark's own renderer (its
  ``markdown(res)``) from the JSON, and the run's plots (``<stem>*.png`` beside the JSON);
* ``docs/results/index.md``: every page, by purpose;
* the blocks of ``README.md`` between ``<!-- publish: NAME ... -->`` and ``<!-- /publish -->``: the
  table of ``make run`` (from ``make_run.json``, re-rendered by ``meta_consensus.report.table``) and
  the headline results (each read from its JSON, linking to its page);
* the blocks of ``docs/results.md`` between ``<!-- publish: finding NAME -->`` and
  ``<!-- /publish -->``: the measured sentences and tables of the results discussion, each
  computed by ``benchmarks.findings.FINDINGS[NAME]`` from the result files (an unknown name is an
  error). The prose around them carries no measured number.

``python -m benchmarks publish --check`` writes nothing and exits 1, naming the files, when a
committed page, README block or finding block differs from what publish renders (``tests/docs`` runs it).
``python -m benchmarks publish --record-run runs/default`` stores a finished ``make run`` as
``make_run.json`` (its config, every round's metrics, the machine and the date).

A benchmark without a renderer that accepts its JSON (its markdown is written inside ``main``) is
published from the ``<stem>.md`` its run wrote beside the JSON, below the same header; the index
says which pages those are. New result files are picked up by their name alone.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import importlib
import json
import re
import sys
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from benchmarks.__main__ import discover

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
PAGES = ROOT / "docs" / "results"
README = ROOT / "README.md"
RESULTS_MD = ROOT / "docs" / "results.md"  # the results discussion, whose numbers are findings
MAKE_RUN = "make_run"

# Renderers whose signature is not ``markdown(res)``: the benchmark's name -> a call on its JSON.
ADAPTERS: dict[str, Callable[[Any, Mapping[str, Any]], str]] = {
    "accelerator": lambda m, d: m.markdown(d, bool(d.get("settings", {}).get("quick", False))),
    "merging": lambda m, d: m.report(d["runs"], d["settings"], d["command"], d.get("total_s", 0.0)),
    "privacy": lambda m, d: m._markdown(d),
    "ablations": lambda m, d: importlib.import_module("benchmarks.quality.ablations_report").markdown(d),
}


@dataclasses.dataclass(frozen=True)
class Page:
    stem: str  # the JSON's file stem, e.g. robustness_fashion_mnist
    benchmark: str | None  # the benchmark that wrote it (longest name that prefixes the stem)
    purpose: str  # speed, quality, tuning, or "system" for make_run
    rendered: bool  # tables rendered from the JSON (False: the run's own markdown, carried)
    text: str


# ----------------------------------------------------------------------------- reading


def _floats(x: Any) -> Any:
    """The inverse of the harness's strict JSON: "inf", "-inf" and "nan" strings are floats again."""
    if isinstance(x, dict):
        return {k: _floats(v) for k, v in x.items()}
    if isinstance(x, list):
        return [_floats(v) for v in x]
    if x in ("inf", "-inf", "nan"):
        return float(x)
    return x


def load(path: Path) -> dict[str, Any]:
    """A result file as the benchmark held it (non-finite floats restored)."""
    return _floats(json.loads(path.read_text(encoding="utf-8")))


def result_files(results: Path = RESULTS) -> list[Path]:
    """Every published JSON: not ``_quick`` (a --quick run) and not the ``make run`` record."""
    return [p for p in sorted(results.glob("*.json")) if not p.stem.endswith("_quick") and p.stem != MAKE_RUN]


def owner(stem: str, names: Sequence[str]) -> str | None:
    """The benchmark whose results ``stem`` holds: the longest name equal to it or prefixing ``name_``."""
    hits = [n for n in names if stem == n or stem.startswith(n + "_")]
    return max(hits, key=len) if hits else None


def run_date(data: Mapping[str, Any]) -> str:
    return str(data.get("date") or "not recorded")


def _strip_header(md: str) -> tuple[str | None, str]:
    """The title and the body of a benchmark's markdown, without the header it wrote itself.

    Its own header (harness.header) names the machine that *rendered* it; the published header
    is read from the JSON instead, so the page is the same wherever publish runs.
    """
    lines = md.strip("\n").splitlines()
    title = None
    if lines and lines[0].startswith("# "):
        title, lines = lines[0][2:].strip(), lines[1:]
    out: list[str] = []
    in_header = True
    for line in lines:
        if in_header and (line.strip() == "" or re.match(r"(Command|Machine|Settings|Date)\b.*:", line)):
            continue
        in_header = False
        out.append(line)
    return title, "\n".join(out).strip("\n")


def _value(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:g}"
    if isinstance(v, list):
        return "[" + ", ".join(_value(x) for x in v) + "]"
    return str(v)


def header(title: str, data: Mapping[str, Any]) -> list[str]:
    """Title, command, machine, date and settings, all from the result file."""
    m = data.get("machine") or {}
    lines = [f"# {title}", ""]
    lines.append(f"- **Command:** `{data.get('command', 'not recorded')}`")
    if isinstance(m, str):
        lines.append(f"- **Machine:** {m}")
    elif m:
        lines.append(
            f"- **Machine:** {m.get('processor', '?')}, {m.get('cpu_count', '?')} cores, "
            f"{m.get('platform', '?')}, python {m.get('python', '?')}, jax {m.get('jax', '?')} "
            f"({m.get('backend', '?')})"
        )
    else:
        lines.append("- **Machine:** not recorded")
    lines.append(f"- **Date:** {run_date(data)}")
    settings = data.get("settings")
    if isinstance(settings, Mapping) and settings:
        lines.append("- **Settings:** " + "; ".join(f"{k} = {_value(v)}" for k, v in settings.items()))
    else:
        lines.append("- **Settings:** not recorded")
    return lines + [""]


def plots(stem: str, all_stems: Sequence[str], results: Path = RESULTS) -> list[Path]:
    """The PNGs of ``stem``: ``<stem>.png`` and ``<stem>_<suffix>.png`` not owned by a longer stem."""
    found = []
    for png in sorted(results.glob(f"{stem}*.png")):
        if png.stem.endswith("_quick"):
            continue
        if owner(png.stem, all_stems) == stem:
            found.append(png)
    return found


def render_page(path: Path, names: Mapping[str, str], all_stems: Sequence[str]) -> Page:
    """The page of one result file (``names``: benchmark name -> module)."""
    data = load(path)
    stem = path.stem
    bench = owner(stem, list(names))
    purpose = names[bench].split(".")[1] if bench else "other"
    body, title, rendered = None, None, False
    if bench is not None:
        module = importlib.import_module(names[bench])
        render: Callable[..., str] | None = ADAPTERS.get(bench) or getattr(module, "markdown", None)
        if render is not None:
            try:
                md = ADAPTERS[bench](module, data) if bench in ADAPTERS else render(data)
                title, body = _strip_header(md)
                rendered = True
            except (KeyError, TypeError, ValueError, AttributeError, IndexError):
                body = None  # a renderer of a newer or older layout of the results: carried below
    if body is None:
        own = path.with_suffix(".md")
        title, body = _strip_header(own.read_text(encoding="utf-8")) if own.is_file() else (None, "")
    lines = header(title or stem.replace("_", " "), data)
    if not rendered:
        lines += ["(The tables below are the markdown this run wrote beside its JSON.)", ""]
    lines += [_demote(body), ""]
    pngs = plots(stem, all_stems, path.parent)
    if pngs:
        lines += ["## Plots", ""]
        for png in pngs:
            lines += [f"![{png.stem}](../../benchmarks/results/{png.name})", ""]
    text = "\n".join(lines).rstrip("\n") + "\n"
    return Page(stem, bench, purpose, rendered, text)


def _demote(body: str) -> str:
    """A second ``# `` title inside the body becomes a ``## `` section (one title per page)."""
    out, fence = [], False
    for line in body.splitlines():
        if line.startswith("```"):
            fence = not fence
        out.append("#" + line if not fence and line.startswith("# ") else line)
    return "\n".join(out)


def index(pages: Sequence[Page]) -> str:
    lines = [
        "# Benchmark results",
        "",
        "Every page is rendered by `python -m benchmarks publish` from `benchmarks/results/<name>.json`",
        "and names the command, the machine, the date and the settings of its run. Rerun a benchmark",
        "(`python -m benchmarks NAME`), then `python -m benchmarks publish`; a test fails while a page",
        "differs from its data. [Results](../results.md) discusses them.",
        "",
    ]
    titles = {p.stem: p.text.splitlines()[0].removeprefix("# ") for p in pages}
    repeated = {t for t in titles.values() if list(titles.values()).count(t) > 1}
    for purpose in ("quality", "speed", "tuning", "other"):
        group = [p for p in pages if p.purpose == purpose]
        if not group:
            continue
        lines += [f"## {purpose.capitalize()}", ""]
        for p in group:
            note = "" if p.rendered else "; tables as the run wrote them"
            title = titles[p.stem]
            if title in repeated:  # pages of one benchmark under other settings: say which
                variant = p.stem.removeprefix(p.benchmark or "").strip("_").replace("_", " ")
                title = f"{title} ({variant})" if variant else title
            lines.append(f"- [{title}]({p.stem}.md) (`{p.stem}`{note})")
        lines.append("")
    hidden = "\n".join(p.stem for p in pages)
    lines += ["```{toctree}", ":hidden:", "", hidden, "```", ""]
    return "\n".join(lines)


# ----------------------------------------------------------------------------- README blocks


def make_run_table(record: Mapping[str, Any]) -> str:
    """The table that ended the recorded ``make run``, redrawn from its config and metrics."""
    import tempfile

    from meta_consensus import config, report
    from meta_consensus.checkpoint import load_history

    with tempfile.TemporaryDirectory() as tmp:
        cfg_path, metrics = Path(tmp) / "config.toml", Path(tmp) / "metrics.jsonl"
        cfg_path.write_text(record["config_toml"], encoding="utf-8")
        metrics.write_text("".join(line + "\n" for line in record["metrics_jsonl"]), encoding="utf-8")
        cfg, history = config.load(cfg_path), load_history(metrics)
    lines = report.table(cfg, history).splitlines()
    # The first line names the run, the time line depends on the machine's load: the README shows
    # the table itself.
    kept = [line for line in lines[1:] if not line.startswith("time:")]
    return "```\n" + "\n".join(kept) + "\n```"


def _pct(x: float) -> str:
    return f"{x:.3f}"


def headline_robustness(d: Mapping[str, Any]) -> str:
    s = d["settings"]
    t = d["targets"]["1.0"]
    f = max(s["byzantine"])
    n_attacks = len(s["attacks"])
    rule, best = d["best"], t["best_worst"]  # the rule chosen on held-out data, not on the test
    return (
        f"**Robustness**: with {f} of {s['num_nodes']} digits nodes Byzantine (Dirichlet alpha = 1), "
        f"{rule}'s worst case over {n_attacks} attacks is {_pct(best)} test accuracy against "
        f"{_pct(t['clean_fedavg'])} for clean FedAvg, while FedAvg under attack falls to "
        f"{_pct(t['fedavg_worst'])}"
    )


def headline_system(d: Mapping[str, Any]) -> str:
    s = d["settings"]
    ms = d["summary"]["alie"]["mean_std"]
    default, fedavg = ms["without DP"], ms["plain FedAvg"]
    stages = [f"{s['vote'].split(',')[0]} vote"]
    if s["weights"].split(",")[0] != "vote":
        stages.append(f"{s['weights'].split(',')[0]} weights")
    if s.get("server_step"):
        stages.append(f"server step {s['server_step']:g}")
    return (
        f"**The whole system**: under ALIE ({len(s['byzantine_nodes'])} of {s['nodes']} nodes), the "
        f"pipeline it measured ({', '.join(stages)}) "
        f"reaches {default[0]:.3f} ± {default[1]:.3f} over {len(s['seeds'])} seeds, "
        f"plain FedAvg {fedavg[0]:.3f} ± {fedavg[1]:.3f}"
    )


def headline_privacy(d: Mapping[str, Any]) -> str:
    t = d["target"]
    return (
        f"**Privacy**: node-level DP-FedAvg over {d['settings']['clients']} clients at epsilon = 8 reaches "
        f"{t['eps8']:.3f} test accuracy, {100 * t['gap']:.1f} points below non-private training "
        f"({t['nonprivate']:.3f})"
    )


def headline_flower(d: Mapping[str, Any]) -> str:
    s = d["settings"]
    row = next(r for r in d["results"] if r["package"] == "median")
    same = "equals" if row["conventions_agree"] and row["max_abs_diff"] == 0 else "matches"
    return (
        f"**Flower**: on the same {s['n']} replies of {s['d'] / 1e6:g}M parameters, the median {same} "
        f"Flower's {row['flower']} and runs {row['speedup_rule']:.0f}x faster"
    )


def headline_checkpoints(d: Mapping[str, Any]) -> str:
    s = d["settings"]
    ties = d["results"]["ties"]
    return (
        f"**Checkpoints**: merging {s['fine_tunes']} GPT-2-shaped checkpoints "
        f"({s['parameters'] / 1e6:.0f}M parameters, {s['model_mb'] / 1000:.2f} GB each) with TIES "
        f"peaks at {ties['peak_rss_gb']:.2f} GB of memory and takes {ties['wall_s']:.1f} s"
    )


def headline_lora(d: Mapping[str, Any]) -> str:
    s, summary, lora = d["settings"], d["summary"], d["sizes"]["lora"]
    best = d["winner_clean"]
    full, won = summary["full fine-tuning, FedAvg"], summary[best]
    return (
        f"**LoRA**: {s['nodes']} nodes fine-tune rank-{s['rank']} adapters "
        f"({100 * lora['adapter_params'] / lora['model_params']:.1f}% of the parameters); merged by "
        f"`{best}`, they reach test perplexity {won['perplexity_mean']:.2f} against "
        f"{full['perplexity_mean']:.2f} for full fine-tuning with FedAvg, moving "
        f"{won['bytes_up'] / 1024:.0f} KB up and {won['bytes_down'] / 1024:.0f} KB down per node and "
        f"round instead of {full['bytes_up'] / 1024:.0f} KB each way"
    )


def headline_attack_suite(d: Mapping[str, Any]) -> str:
    from benchmarks.tuning.attack_suite import summarize

    rep, st = d["report"], d["settings"]

    def worst(config: str, key: str, pick: Callable[..., float]) -> float:
        return pick(summarize(runs)[key] for per_seed in rep[config].values() for runs in per_seed.values())

    margin = worst("default", "margin", min)
    out = (
        f"**Attack suite**: over {len(st['conditions']) - 1} attacks (two strengths where an attack "
        f"has a scale) at alphas {', '.join(f'{a:g}' for a in st['alphas'])}, the default's consensus is "
        + (
            f"at worst {-margin:.1f} points below plain FedAvg under the same attack"
            if margin < 0
            else "never below plain FedAvg under the same attack"
        )
    )
    clean_gap = worst("default", "clean_gap", max)
    out += f", clean {clean_gap:.1f} points below it" if clean_gap > 0 else ", clean not below it"
    if "robust-noserver" in rep and "0.3" in rep["robust-noserver"]:
        gaps = [summarize(r)["gap"] for r in rep["robust-noserver"]["0.3"].values()]
        out += (
            "; without coordinator data (`--preset robust-noserver`, 4 of 16 nodes Byzantine, alpha = 0.3) "
            f"the worst attack is {sum(gaps) / len(gaps):.1f} points below clean FedAvg on average over seeds"
        )
    if "private" in rep:
        sums = [summarize(r) for per_seed in rep["private"].values() for r in per_seed.values()]
        clean = [r["clean"]["consensus"] for per_seed in rep["private"].values() for r in per_seed.values()]
        fedavg = [r["clean"]["fedavg"] for per_seed in rep["private"].values() for r in per_seed.values()]
        low = min(s["margin"] for s in sums)
        out += (
            "; with example-level DP-SGD in every node (`--preset private`) the clean consensus is "
            f"{sum(clean) / len(clean):.3f} against {sum(fedavg) / len(fedavg):.3f} for plain FedAvg of the "
            "same nodes, "
            + (
                f"and at worst {-low:.1f} points below it under attack"
                if low < 0
                else "and never below it under attack"
            )
        )
    return out


# The README's headline results: the result file each reads and how it says it.
HEADLINES: tuple[tuple[str, Callable[[Mapping[str, Any]], str]], ...] = (
    ("robustness", headline_robustness),
    ("attack_suite", headline_attack_suite),
    ("meta_consensus", headline_system),
    ("privacy_quality", headline_privacy),
    ("flower_side_by_side", headline_flower),
    ("merge_methods_hf", headline_checkpoints),
    ("lora", headline_lora),
)


def headlines(results: Path = RESULTS) -> str:
    lines = []
    for stem, say in HEADLINES:
        path = results / f"{stem}.json"
        if path.is_file():
            lines.append(f"- {say(load(path))} ([results](docs/results/{stem}.md)).")
    return "\n".join(lines)


BLOCK = re.compile(
    r"(<!-- publish: (?P<name>[a-z-]+)[^>]*-->\n)(?P<body>.*?)(\n<!-- /publish -->)", re.DOTALL
)


def readme(text: str, results: Path = RESULTS) -> str:
    """``text`` (the README) with every publish block re-rendered."""

    def fill(m: re.Match[str]) -> str:
        name = m.group("name")
        if name == "headlines":
            body = headlines(results)
        elif name == "make-run":
            record = results / f"{MAKE_RUN}.json"
            body = make_run_table(load(record)) if record.is_file() else m.group("body")
        else:
            raise ValueError(f"README: unknown publish block {name!r}")
        return m.group(1) + body + m.group(4)

    return BLOCK.sub(fill, text)


# ----------------------------------------------------------------------------- docs/results.md

# The body may be empty (a new block): the newlines around it belong to the body, not to the markers.
FINDING_BLOCK = re.compile(
    r"(<!-- publish: finding (?P<name>[a-z0-9_]+) -->)(?P<body>.*?)(<!-- /publish -->)", re.DOTALL
)


def results_page(text: str, results: Path = RESULTS) -> str:
    """``text`` (docs/results.md) with every finding block re-rendered from the result files.

    A block's body is the finding on the lines between the two comments (MyST and CommonMark end a
    paragraph or a table at an HTML comment, which stays a comment).

    Args:
      text: the page as committed.
      results: the folder of the result files.

    Returns:
      The page with each ``<!-- publish: finding NAME -->`` block filled by ``findings.render``.

    Raises:
      ValueError: a publish block that is not a finding, or a finding name that is not registered.
    """
    from benchmarks import findings

    for opening in re.findall(r"<!-- publish:[^>]*-->", text):
        if not FINDING_BLOCK.match(opening + "<!-- /publish -->"):
            raise ValueError(
                f"docs/results.md: only `<!-- publish: finding NAME -->` blocks, got {opening!r}"
            )

    def fill(m: re.Match[str]) -> str:
        return m.group(1) + "\n" + findings.render(m.group("name"), results) + "\n" + m.group(4)

    return FINDING_BLOCK.sub(fill, text)


# ----------------------------------------------------------------------------- make run's record


def record_run(run_dir: Path, results: Path = RESULTS) -> Path:
    """Store a finished ``meta-consensus run`` as ``make_run.json``: config, metrics, machine, date."""
    from benchmarks import harness

    config_toml = (run_dir / "config.toml").read_text(encoding="utf-8")
    metrics = [line for line in (run_dir / "metrics.jsonl").read_text(encoding="utf-8").splitlines() if line]
    payload = {
        "command": "make run",
        "run_dir": f"runs/{run_dir.name}",
        "machine": harness.machine(),
        "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d"),
        "settings": {"config": "the embedded default (meta_consensus/default.toml)"},
        "config_toml": config_toml,
        "metrics_jsonl": metrics,
    }
    path = results / f"{MAKE_RUN}.json"
    path.write_text(json.dumps(harness._strict_json(payload), indent=2) + "\n", encoding="utf-8")
    return path


# ----------------------------------------------------------------------------- main


def render_all(results: Path = RESULTS) -> dict[Path, str]:
    """Every file publish writes, path -> content."""
    names = {name: b.module for name, b in discover().items()}
    files = result_files(results)
    stems = [p.stem for p in files]
    pages = [render_page(p, names, stems) for p in files]
    out = {PAGES / f"{p.stem}.md": p.text for p in pages}
    out[PAGES / "index.md"] = index(pages)
    out[README] = readme(README.read_text(encoding="utf-8"), results)
    out[RESULTS_MD] = results_page(RESULTS_MD.read_text(encoding="utf-8"), results)
    return out


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks publish", description=__doc__.splitlines()[0])
    p.add_argument("--check", action="store_true", help="write nothing; exit 1 if a file differs")
    p.add_argument(
        "--record-run", type=Path, default=None, help="store a finished run as make_run.json first"
    )
    args = p.parse_args(argv)
    if args.record_run is not None:
        print(f"recorded {record_run(args.record_run)}")
    files = render_all()
    stale = [path for path, text in files.items() if not path.is_file() or path.read_text() != text]
    extra = sorted(set(PAGES.glob("*.md")) - set(files))
    if args.check:
        for path in [*stale, *extra]:
            print(f"differs from `python -m benchmarks publish`: {path.relative_to(ROOT)}", file=sys.stderr)
        return 1 if stale or extra else 0
    PAGES.mkdir(parents=True, exist_ok=True)
    for path in stale:
        path.write_text(files[path], encoding="utf-8")
        print(f"wrote {path.relative_to(ROOT)}")
    for path in extra:
        path.unlink()
        print(f"removed {path.relative_to(ROOT)} (no result file)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
