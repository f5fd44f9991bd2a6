"""The one harness of the benchmark scripts: arguments, timing, settings record, result files.

Every script in ``benchmarks/`` follows the same conventions through this module:

* ``parser(doc, quick_help)`` gives an ``argparse`` parser with ``--quick`` (a small run that
  finishes in about a minute) and ``--out`` (the results folder, default ``benchmarks/results``);
  scripts add their own options to it.
* Timing: :func:`best_time` is the best of ``repeats`` calls after warm-up calls that compile
  (jax outputs blocked on). Speed is reported as a ratio against a floor measured in the same
  run (:func:`ratio`), never as absolute seconds alone, because the machines are shared.
* :func:`save` writes ``<out>/<name>[_quick].json`` and ``.md``; the JSON carries the command,
  ``argv``, the machine, the settings record and the results, with non-finite floats as strings
  (strict JSON). :func:`plot_path` names the PNG beside them.
* :func:`header` starts a markdown report with title, command, machine and settings.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import jax
import numpy as np

RESULTS = Path(__file__).resolve().parent / "results"


# ----------------------------------------------------------------------------- arguments


def parser(doc: str | None, quick_help: str = "a small run of about a minute") -> argparse.ArgumentParser:
    """An argument parser with the options every benchmark has: ``--quick`` and ``--out``."""
    p = argparse.ArgumentParser(description=doc.strip().splitlines()[0] if doc else None)
    p.add_argument("--quick", action="store_true", help=quick_help)
    p.add_argument("--out", type=Path, default=None, help="results folder (default benchmarks/results)")
    return p


_out: Path | None = None  # the --out of the script running in this process (None: RESULTS)
_script: str | None = None  # the module run from the command line (None: called with an argv list)
_extra: list[str] = []  # its arguments other than --quick and --out, for the recorded command


def parse(p: argparse.ArgumentParser, argv: Sequence[str] | None = None) -> argparse.Namespace:
    """Parse the arguments; ``--out`` becomes the folder of every later :func:`save` / :func:`plot_path`.

    A script runs once per process, so its output folder is process-wide: the script bodies
    call ``save(name, quick, ...)`` without threading ``args.out`` through every function.
    The other arguments (``--task``, ...) are kept for the command :func:`command` records.
    """
    global _out, _script, _extra
    args = p.parse_args(argv)
    _out = args.out
    raw = list(sys.argv[1:] if argv is None else argv)
    _script = Path(sys.argv[0]).stem if argv is None and sys.argv[0].endswith(".py") else None
    _extra, skip = [], False
    for a in raw:
        if skip or a == "--quick" or a.startswith("--out="):
            skip = False
            continue
        if a == "--out":
            skip = True
            continue
        _extra.append(a)
    return args


def results_folder(out: Path | str | None = None) -> Path:
    """``out``, else the parsed ``--out``, else ``benchmarks/results``; created."""
    folder = Path(out) if out is not None else (_out if _out is not None else RESULTS)
    folder.mkdir(parents=True, exist_ok=True)
    return folder


# ----------------------------------------------------------------------------- timing


def best_time(fn: Callable[[], Any], repeats: int = 3, warmup: int = 1) -> float:
    """Best wall time of ``fn`` in seconds (outputs blocked on), after warm-up calls that compile."""
    if repeats < 1 or warmup < 0:
        raise ValueError(f"best_time needs repeats >= 1 and warmup >= 0, got {repeats}, {warmup}")
    for _ in range(warmup):
        jax.block_until_ready(fn())
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn())
        best = min(best, time.perf_counter() - start)
    return best


def ratio(seconds: float, floor_seconds: float) -> float:
    """``seconds / floor_seconds``: a time in units of a baseline measured in the same run."""
    if not floor_seconds > 0:
        raise ValueError(f"the floor must be a positive time, got {floor_seconds}")
    return float(seconds) / float(floor_seconds)


def load_average() -> list[float]:
    """The 1/5/15-minute load averages (how shared the machine was), rounded."""
    return [round(x, 2) for x in os.getloadavg()]


def machine() -> dict[str, Any]:
    return {
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(),
        "python": platform.python_version(),
        "jax": jax.__version__,
        "backend": jax.default_backend(),
        "devices": [str(d) for d in jax.devices()],
    }


# ----------------------------------------------------------------------------- reporting


def command(name: str, quick: bool) -> str:
    """The command that ran: the script's module (``name`` when unknown), --quick and its other arguments."""
    import shlex

    extra = "".join(f" {shlex.quote(a)}" for a in _extra)
    return f"python -m benchmarks.{_script or name}" + (" --quick" if quick else "") + extra


def stem(name: str, quick: bool) -> str:
    """The file stem of a script's results: ``<name>`` or ``<name>_quick``."""
    return f"{name}_quick" if quick else name


def markdown_table(headers: list[str], rows: list[list[Any]]) -> str:
    def fmt(v):
        if isinstance(v, float):
            return f"{v:.3g}" if abs(v) < 1000 else f"{v:.0f}"
        return str(v)

    out = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    out += ["| " + " | ".join(fmt(v) for v in r) + " |" for r in rows]
    return "\n".join(out) + "\n"


def mean_std(values: Sequence[float]) -> tuple[float, float]:
    """Mean and sample standard deviation (0 for a single value).

    Non-finite values (an epsilon of inf without DP, a perplexity that overflowed): the mean is
    ``fmean``'s (inf, or nan for inf and -inf), the std 0 when every value is the same and nan
    otherwise (``statistics.stdev`` raises on inf).
    """
    vals = [float(v) for v in values]
    if len(vals) < 2:
        return statistics.fmean(vals), 0.0
    if not all(math.isfinite(v) for v in vals):
        return statistics.fmean(vals), (0.0 if len(set(vals)) == 1 else math.nan)
    return statistics.fmean(vals), statistics.stdev(vals)


def pm(values: Sequence[float], digits: int = 3) -> str:
    """``mean ± std`` over seeds (just the value for one seed)."""
    m, s = mean_std(values)
    return f"{m:.{digits}f}" if len(values) == 1 else f"{m:.{digits}f} ± {s:.{digits}f}"


def header(title: str, name: str, quick: bool, settings: Mapping[str, Any]) -> list[str]:
    """Top of a result markdown: title, command, machine and settings."""
    m = machine()
    lines = [f"# {title}", "", f"Command: `{command(name, quick)}`", ""]
    lines.append(
        f"Machine: {m['processor']}, {m['cpu_count']} cores, {m['platform']}, python {m['python']}, "
        f"jax {m['jax']} ({m['backend']})."
    )
    lines.append("")
    lines.append("Settings: " + "; ".join(f"{k} = {v}" for k, v in settings.items()) + ".")
    lines.append("")
    return lines


def write_results(
    name: str, payload: dict[str, Any], markdown: str, out: Path | str | None = None
) -> tuple[Path, Path]:
    """Write ``<out>/<name>.json`` (atomically, strict JSON) and ``<out>/<name>.md``."""
    folder = results_folder(out)
    jpath = folder / f"{name}.json"
    mpath = folder / f"{name}.md"
    tmp = jpath.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(_strict_json(payload), indent=2, default=float))
    tmp.replace(jpath)
    mpath.write_text(markdown)
    return jpath, mpath


def save(
    name: str,
    quick: bool,
    payload: dict[str, Any],
    markdown: str,
    *,
    out: Path | str | None = None,
    settings: Mapping[str, Any] | None = None,
) -> tuple[Path, Path]:
    """Write ``<name>[_quick].json`` / ``.md`` with the command, machine and settings record added."""
    record: dict[str, Any] = {"command": command(name, quick), "argv": sys.argv, "machine": machine()}
    record["load_average"] = load_average()
    if settings is not None:
        record["settings"] = dict(settings)
    return write_results(stem(name, quick), {**record, **payload}, markdown, out)


def _strict_json(x: Any) -> Any:
    """Non-finite floats as the strings "inf", "-inf", "nan": json.dumps would write Infinity/NaN,
    which is not JSON and which strict readers (jq, JavaScript) reject."""
    if isinstance(x, Mapping):
        return {str(k): _strict_json(v) for k, v in x.items()}
    if isinstance(x, list | tuple):
        return [_strict_json(v) for v in x]
    if isinstance(x, Path):
        return str(x)
    if isinstance(x, np.ndarray):
        return _strict_json(x.tolist())
    if isinstance(x, np.integer):
        return int(x)
    if isinstance(x, float | np.floating):
        return float(x) if np.isfinite(x) else str(float(x))
    return x


def pyplot():
    """matplotlib's pyplot on the Agg backend (no display on the benchmark machines)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_path(name: str, quick: bool, suffix: str = "", out: Path | str | None = None) -> Path:
    """``<out>/<name>[_quick]<suffix>.png``, the folder created."""
    return results_folder(out) / f"{stem(name, quick)}{suffix}.png"
