"""What a run writes and shows: metrics.jsonl, TensorBoard events, PNG plots and the final table.

Everything here reads a history (a list of :class:`RoundInfo`), so
``meta-consensus report runs/<name>`` redraws the table and the plots from the
files of a finished (or interrupted) run exactly as the run drew them.
"""

from __future__ import annotations

import concurrent.futures
import json
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from meta_consensus.config import Config, plain_fedavg
from meta_consensus.coordinator import RoundInfo


def _last_ok(history: Sequence[RoundInfo]) -> RoundInfo | None:
    for h in reversed(history):
        if h.ok and not math.isnan(h.consensus_accuracy):
            return h
    return None


def roles(cfg: Config) -> list[str]:
    """Each node's strategy, and its attack when Byzantine.

    Args:
      cfg: the run config.

    Returns:
      One label per node: ``"<strategy>"``, or ``"<strategy> + <attack> (Byzantine)"``.
    """
    strategies = cfg.nodes.strategy_of()
    byz = set(cfg.byzantine.nodes)
    return [f"{s} + {cfg.byzantine.attack} (Byzantine)" if i in byz else s for i, s in enumerate(strategies)]


# The share labels of the table and the plot, by MergeReport.share_kind (pipeline.SHARE_*).
_SHARE_LABELS = {
    "weights": ("share", "share: each node's weight in the merge, mean over rounds"),
    "coordinates": (
        "coord share",
        "coord share: each node's weight per coordinate (kept order statistics), mean over coordinates",
    ),
    "not a weighted rule": ("share", "share: n/a, the vote's rule is not a weighted rule"),
    "logged weights": ("mean weight", "mean weight: the merge weights as logged"),
}


def shares(history: Sequence[RoundInfo]) -> tuple[np.ndarray, str]:
    """Each node's share of the consensus per successful round, and how to read it.

    Runs from before shares were logged read their merge weights instead (``"logged weights"``).

    Args:
      history: the rounds logged.

    Returns:
      ``(shares, kind)``: (rounds, n) float64 (NaN where a round's rule weighs no node) and the
      kind of the last successful round (``"weights"``, ``"coordinates"``, ``"not a weighted
      rule"`` or ``"logged weights"``).
    """
    done = [h for h in history if h.ok]
    if not done:
        return np.zeros((0, 0)), "weights"
    rows, kind = [], "weights"
    for h in done:
        share = getattr(h, "share", None)
        if share:
            rows.append(share)
            kind = getattr(h, "share_kind", "") or "weights"
        else:
            rows.append(h.weights)
            kind = "logged weights"
    return np.array(rows, np.float64), kind


def let_through(cfg: Config, history: Sequence[RoundInfo]) -> dict[int, float]:
    """The Byzantine nodes the vote let into the consensus, with the share of rounds it did.

    A node is let through in a round when the vote accepted it and, where the round logged shares,
    it carried at least a tenth of a uniform share (``0.1 / n``). A coordinate-wise rule such as the
    trimmed mean keeps every node, yet an attacker whose values it trimmed in every coordinate
    carried nothing: it was accepted, not let through.

    Args:
      cfg: the run config (``byzantine.nodes``).
      history: the rounds logged.

    Returns:
      Node index -> fraction of successful rounds in which it was let through (only those above 0).
    """
    done = [h for h in history if h.ok]
    if not done:
        return {}
    through = np.array([h.accepted for h in done], bool)
    share, _ = shares(history)
    if share.size:
        carried = np.where(np.isnan(share), np.inf, share) >= 0.1 / share.shape[1]
        through &= carried
    return {i: float(through[:, i].mean()) for i in cfg.byzantine.nodes if through[:, i].any()}


def deciding_stage(cfg: Config, history: Sequence[RoundInfo]) -> str:
    """One line: which stage decided the consensus in this run (the vote, the weights, the server step).

    The merge is the vote's output when ``weights.objective = "vote"``, else the weights' (they
    re-weigh the nodes the vote kept). The server step then moves the merge by ``vote.server_step``
    times the coordinator's own update; when that move is at least as long as the merge's own
    move from the round's start (mean over rounds), the server step decided the result.

    Args:
      cfg: the run config.
      history: the rounds logged.

    Returns:
      The footer line.
    """
    done = [h for h in history if h.ok]
    rule, objective = cfg.vote.rule, cfg.weights.objective
    logged = [getattr(h, "decided_by", "") for h in done]
    merge_stage = next((d for d in reversed(logged) if d), "vote" if objective == "vote" else "weights")
    if merge_stage == "vote":
        merge = f"the vote (vote.rule = {rule!r}; its output is the merge, weights.objective = 'vote')"
    else:
        merge = (
            f"the weights (weights.objective = {objective!r} re-weighed the nodes vote.rule = {rule!r} kept)"
        )
    moves = [getattr(h, "server_move", math.nan) for h in done]
    moves = [m for m in moves if isinstance(m, float) and math.isfinite(m)]
    step = cfg.vote.server_step
    if step <= 0:
        server = ""
    elif not moves:
        server = f"; then the server step (vote.server_step = {step:g}; its move was not logged)"
    else:
        ratio = float(np.mean(moves))
        if ratio >= 1.0:
            return (
                f"decided by: the server step (vote.server_step = {step:g} moved the consensus {ratio:.2f}x "
                f"as far as the merge did, mean over rounds); before it, {merge}"
            )
        server = f"; then the server step moved it {ratio:.2f}x as far as the merge did (mean over rounds)"
    dp = "; DP noise on the merge" if cfg.dp.enabled and cfg.dp.level == "node" else ""
    return f"decided by: {merge}{server}{dp}"


def _stage_notes(history: Sequence[RoundInfo]) -> list[str]:
    """The pipeline's notes (a vote whose output the weights replaced), once each, with their rounds."""
    done = [h for h in history if h.ok]
    notes: dict[str, int] = {}
    for h in done:
        note = getattr(h, "stage_note", "")
        if note:
            notes[note] = notes.get(note, 0) + 1
    return [f"note ({k} of {len(done)} rounds): {note}" for note, k in notes.items()]


def table(cfg: Config, history: Sequence[RoundInfo], seconds: float | None = None) -> str:
    """The end-of-run table: every node, plain FedAvg and the consensus, epsilon and time.

    Per node: the share of rounds its candidate was accepted by the vote and its share of the
    consensus (:func:`shares`); Byzantine nodes the vote let through are flagged. The footer
    names the stage that decided the result (:func:`deciding_stage`).

    Args:
      cfg: the run config.
      history: the rounds logged (failed attempts included).
      seconds: the run's wall time (default: the sum of the rounds' timings).

    Returns:
      The table as text, one line per row.
    """
    last = _last_ok(history)
    lines = []
    ok = sum(h.ok for h in history)
    lines.append(f"run {cfg.name!r}: {len(history)} rounds logged, {ok} succeeded")
    if last is None:
        lines.append("no successful round: nothing to report")
        return "\n".join(lines)
    share, kind = shares(history)
    label, legend = _SHARE_LABELS.get(kind, _SHARE_LABELS["weights"])
    accepted = np.array([h.accepted for h in history if h.ok], bool)
    through = let_through(cfg, history)
    # A language task's perplexity goes beside the accuracy (the base model's too, when pretrained).
    ppl = "perplexity" in last.consensus_metrics
    base = next((h.base_metrics for h in history if h.base_metrics), {})
    w = f"{'node':>6}  {'strategy':<34}{'test acc':>9}" + (f"{'test ppl':>10}" if ppl else "")
    w += f"{'accepted':>10}{label:>13}"
    lines += [w, "-" * len(w)]
    for i, role in enumerate(roles(cfg)):
        node_ppl = f"{_at(last.node_metrics.get('perplexity'), i):>10.3f}" if ppl else ""
        mean = _finite_mean(share[:, i])
        mean_share = f"{mean:>13.3f}" if math.isfinite(mean) else f"{'n/a':>13}"
        flag = "  <- attacker let through" if i in through else ""
        lines.append(
            f"{i:>6}  {role:<34}{last.node_accuracy[i]:>9.3f}{node_ppl}{accepted[:, i].mean():>10.0%}"
            f"{mean_share}{flag}"
        )
    lines.append("-" * len(w))
    if base and ppl:
        lines.append(
            f"{'':>6}  {'base model (before round 1)':<34}{base.get('accuracy', math.nan):>9.3f}"
            f"{base.get('perplexity', math.nan):>10.3f}"
        )
    if not math.isnan(last.fedavg_accuracy):
        lines.append(f"{'':>6}  {'plain FedAvg':<34}{last.fedavg_accuracy:>9.3f}")
    consensus_ppl = f"{last.consensus_metrics['perplexity']:>10.3f}" if ppl else ""
    lines.append(f"{'':>6}  {'meta-consensus':<34}{last.consensus_accuracy:>9.3f}{consensus_ppl}")
    lines += _per_domain(cfg, last, base)
    lines.append(f"accepted: share of rounds the vote kept the node; {legend}")
    lines.append(deciding_stage(cfg, history))
    if through:
        carried = {i: _finite_mean(share[:, i]) for i in through}
        lines.append(
            "attackers the vote let through: "
            + ", ".join(f"node {i} in {f:.0%} of rounds (share {carried[i]:.3f})" for i, f in through.items())
        )
    lines += _stage_notes(history)
    if cfg.dp.enabled and cfg.dp.level == "example":
        # The same numbers as privacy.json and metrics.jsonl (the last round's node epsilons).
        lines.append(
            f"privacy: example-level DP-SGD in every node, epsilon = {last.epsilon:.4g} (max over nodes) at "
            f"delta = {cfg.dp.delta:g} ({cfg.dp.accountant}); {_both_accountants(history, last)}"
        )
        lines.append(
            "         node epsilons: " + "  ".join(f"{i}: {e:.3g}" for i, e in enumerate(last.node_epsilon))
        )
    elif cfg.dp.enabled:
        lines.append(
            f"privacy: epsilon = {last.epsilon:.4g} at delta = {cfg.dp.delta:g} ({cfg.dp.accountant}); "
            f"{_both_accountants(history, last)}; node-level, sensitivity "
            f"{'C / n (DP-FedAvg)' if plain_fedavg(cfg) else '2C'}"
        )
        if last.epsilon > 100:
            lines.append(
                "         (nominal: node-level DP over this few nodes needs far more noise for a useful"
                " epsilon; see benchmarks/privacy_quality.md)"
            )
    else:
        lines.append("privacy: no DP step (example-level DP-SGD: --preset private)")
    total = sum(sum(h.seconds.values()) for h in history) if seconds is None else seconds
    fails = [h for h in history if not h.ok]
    lines.append(f"time: {total:.1f} s; test accuracy after round {last.round + 1}")
    for h in fails[-3:]:
        lines.append(f"round {h.round + 1} (attempt {h.attempt}) failed: {h.reason}")
    return "\n".join(lines)


def _finite_mean(values: np.ndarray) -> float:
    finite = values[np.isfinite(values)]
    return float(finite.mean()) if finite.size else math.nan


def _at(values: Sequence[float] | None, i: int) -> float:
    return float(values[i]) if values is not None and i < len(values) else math.nan


def _per_domain(cfg: Config, last: RoundInfo, base: dict[str, float]) -> list[str]:
    """The test perplexity per domain (``perplexity/<domain>`` metrics): base, every node, consensus."""
    domains = [k.split("/", 1)[1] for k in last.consensus_metrics if k.startswith("perplexity/")]
    if not domains:
        return []
    width = max(10, *(len(d) + 2 for d in domains))
    head = f"{'test perplexity by domain':<42}" + "".join(f"{d:>{width}}" for d in domains)
    rows = [head, "-" * len(head)]

    def row(label: str, value: Any) -> str:
        return f"{label:<42}" + "".join(f"{value(d):>{width}.3f}" for d in domains)

    if base:
        rows.append(row("base model", lambda d: base.get(f"perplexity/{d}", math.nan)))
    for i, role in enumerate(roles(cfg)):
        rows.append(
            row(f"node {i} ({role})"[:41], lambda d, i=i: _at(last.node_metrics.get(f"perplexity/{d}"), i))
        )
    rows.append(row("meta-consensus", lambda d: last.consensus_metrics[f"perplexity/{d}"]))
    return rows


def _both_accountants(history: Sequence[RoundInfo], last: RoundInfo) -> str:
    """``RDP x, PLD y`` of ``last``.

    The comparison accountant is logged only at checkpoints and at the last round, so when
    ``last`` lacks it the newest round that has it is named.
    """
    text = []
    for name, attr in (("RDP", "epsilon_rdp"), ("PLD", "epsilon_pld")):
        value = getattr(last, attr)
        if math.isnan(value):
            earlier = [
                h for h in history if h.ok and h.round <= last.round and not math.isnan(getattr(h, attr))
            ]
            if earlier:
                text.append(f"{name} {getattr(earlier[-1], attr):.4g} (after round {earlier[-1].round + 1})")
                continue
        text.append(f"{name} {value:.4g}")
    return ", ".join(text)


def plot(cfg: Config, history: Sequence[RoundInfo], run_dir: Path) -> list[Path]:
    """Write accuracy.png, weights.png (each node's share of the consensus per round) and perplexity.png.

    weights.png stacks each node's share (:func:`shares`), one distinct colour per node
    (:func:`node_colours`), Byzantine nodes hatched and those the vote let through outlined.
    perplexity.png is written for language tasks only.

    Args:
      cfg: the run config.
      history: the rounds logged.
      run_dir: the folder the plots are written to.

    Returns:
      The paths written.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    run_dir = Path(run_dir)
    done = [h for h in history if h.ok]
    if not done:
        return []
    evaluated = [h for h in done if not math.isnan(h.consensus_accuracy)]  # eval_every > 1 skips rounds
    rounds = np.array([h.round + 1 for h in evaluated])
    node_acc = np.array([h.node_accuracy for h in evaluated])
    byz = set(cfg.byzantine.nodes)
    labels = roles(cfg)
    fig, ax = plt.subplots(figsize=(7, 4.2))
    for i in range(node_acc.shape[1]):
        style: dict[str, Any] = {"color": "tab:red", "ls": ":"} if i in byz else {"color": "0.6", "ls": "-"}
        ax.plot(rounds, node_acc[:, i], lw=0.9, alpha=0.8, label="nodes" if i == 0 else None, **style)
    if byz:
        ax.plot([], [], color="tab:red", ls=":", label="Byzantine nodes (submitted)")
    fedavg = np.array([h.fedavg_accuracy for h in evaluated])
    if not np.all(np.isnan(fedavg)):
        ax.plot(rounds, fedavg, color="tab:orange", lw=2, label="plain FedAvg")
    consensus = [h.consensus_accuracy for h in evaluated]
    ax.plot(rounds, consensus, color="tab:blue", lw=2.5, label="meta-consensus")
    ax.set(xlabel="round", ylabel="test accuracy", title=f"{cfg.name}: test accuracy per round", ylim=(0, 1))
    ax.grid(alpha=0.3)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.legend(loc="lower right", fontsize=8)
    fig.tight_layout()
    paths = [run_dir / "accuracy.png"]
    fig.savefig(paths[0], dpi=110)
    plt.close(fig)

    share, kind = shares(history)
    rounds = np.array([h.round + 1 for h in done])
    through = let_through(cfg, history)
    colours = node_colours(share.shape[1])
    fig, ax = plt.subplots(figsize=(7, 4.2))
    bottom = np.zeros(len(done))
    drawn = np.nan_to_num(share, nan=0.0)  # a round whose rule weighs no node draws no bar
    for i in range(share.shape[1]):
        flag = f", let through in {through[i]:.0%} of rounds" if i in through else ""
        ax.bar(
            rounds,
            drawn[:, i],
            bottom=bottom,
            color=colours[i],
            label=f"{i}: {labels[i]}{flag}",
            hatch="//" if i in byz else None,
            edgecolor="black" if i in through else "white",
            lw=0.8 if i in through else 0.3,
        )
        bottom += drawn[:, i]
    titles = {
        "coordinates": "share of each node per round (kept order statistics, mean over coordinates)",
        "logged weights": "weight of each node per round",
    }
    ax.set(
        xlabel="round",
        ylabel="share of the consensus",
        title=titles.get(kind, "share of the consensus of each node per round"),
        ylim=(0, 1.05),
    )
    if kind == "not a weighted rule":
        ax.text(0.5, 0.5, f"{cfg.vote.rule}: not a weighted rule", ha="center", transform=ax.transAxes)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.legend(fontsize=6.5, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    fig.tight_layout()
    paths.append(run_dir / "weights.png")
    fig.savefig(paths[1], dpi=110)
    plt.close(fig)
    if any("perplexity" in h.consensus_metrics for h in evaluated):
        paths.append(_perplexity_plot(cfg, evaluated, run_dir / "perplexity.png"))
    return paths


def node_colours(n: int) -> list[tuple[float, ...]]:
    """One colour per node, distinct up to 60 nodes (tab10; tab20 + tab20b + tab20c), hues beyond.

    Args:
      n: the number of nodes.

    Returns:
      One RGBA tuple per node.
    """
    import matplotlib

    # The qualitative maps have 10 or 20 entries: sampling entry i of map m at (i + 0.5) / size.
    if n <= 10:
        return [tuple(matplotlib.colormaps["tab10"]((i + 0.5) / 10)) for i in range(n)]
    if n <= 60:
        names = ("tab20", "tab20b", "tab20c")
        return [tuple(matplotlib.colormaps[names[i // 20]]((i % 20 + 0.5) / 20)) for i in range(n)]
    hsv = matplotlib.colormaps["hsv"]
    return [tuple(hsv(i / n)) for i in range(n)]


def _perplexity_plot(cfg: Config, evaluated: Sequence[RoundInfo], path: Path) -> Path:
    """perplexity.png: a language task's test perplexity per round (nodes, consensus), log scale."""
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    rounds = np.array([h.round + 1 for h in evaluated])
    byz = set(cfg.byzantine.nodes)
    fig, ax = plt.subplots(figsize=(7, 4.2))
    nodes = np.array([h.node_metrics.get("perplexity", [math.nan] * cfg.nodes.count) for h in evaluated])
    for i in range(nodes.shape[1]):
        style: dict[str, Any] = {"color": "tab:red", "ls": ":"} if i in byz else {"color": "0.6", "ls": "-"}
        ax.plot(rounds, nodes[:, i], lw=0.9, alpha=0.8, label="nodes" if i == 0 else None, **style)
    consensus = [h.consensus_metrics.get("perplexity", math.nan) for h in evaluated]
    ax.plot(rounds, consensus, color="tab:blue", lw=2.5, label="meta-consensus")
    ax.set(xlabel="round", ylabel="test perplexity", title=f"{cfg.name}: test perplexity per round")
    ax.set_yscale("log")
    ax.grid(alpha=0.3)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.legend(loc="upper right", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


class RunLog:
    """Appends rounds to metrics.jsonl and TensorBoard; writes nothing when ``enabled`` is False.

    Args:
      run_dir: the run folder (created when enabled).
      enabled: whether to write (False: a process other than the first, or a run without files).
    """

    def __init__(self, run_dir: Path, enabled: bool = True):
        self.run_dir = Path(run_dir)
        self.enabled = enabled
        self._tb = None
        # TensorBoard's scalars (protobufs for ~20 values) are a visible share of a digits
        # round: they are written on one worker thread, in order; close() waits for them and
        # re-raises the first failure. metrics.jsonl is still written before log() returns.
        self._tb_worker: concurrent.futures.ThreadPoolExecutor | None = None
        self._tb_writes: list[concurrent.futures.Future] = []
        if enabled:
            self.run_dir.mkdir(parents=True, exist_ok=True)

    def restart(self, history: Sequence[RoundInfo]) -> None:
        """Rewrite metrics.jsonl to exactly ``history`` (rounds logged after the checkpoint are dropped).

        Args:
          history: the rounds of the checkpoint the run resumes from.
        """
        if not self.enabled:
            return
        tmp = self.run_dir / "metrics.jsonl.tmp"
        tmp.write_text("".join(json.dumps(h.to_json()) + "\n" for h in history))
        tmp.replace(self.run_dir / "metrics.jsonl")

    def _writer(self):
        if self._tb is None:
            from tensorboardX import SummaryWriter

            self._tb = SummaryWriter(str(self.run_dir / "tensorboard"), flush_secs=5)
        return self._tb

    def log(self, info: RoundInfo) -> None:
        """Append one round: to metrics.jsonl before returning, to TensorBoard on a worker thread.

        Failed attempts go to metrics.jsonl only.

        Args:
          info: the round's record.
        """
        if not self.enabled:
            return
        with open(self.run_dir / "metrics.jsonl", "a") as f:
            f.write(json.dumps(info.to_json()) + "\n")
        if not info.ok:
            return
        if self._tb_worker is None:
            self._tb_worker = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="tensorboard")
        self._tb_writes = [f for f in self._tb_writes if not f.done() or f.exception() is not None]
        self._tb_writes.append(self._tb_worker.submit(self._tensorboard, info))

    def _tensorboard(self, info: RoundInfo) -> None:
        tb, step = self._writer(), info.round + 1
        scalars = {
            "accuracy/consensus": info.consensus_accuracy,
            "accuracy/fedavg": info.fedavg_accuracy,
            "accuracy/heldout_consensus": info.heldout_accuracy,
            "loss/consensus": info.consensus_loss,
            "privacy/epsilon": info.epsilon,
            "privacy/clip_norm": info.clip_norm,
            "vote/accepted": float(sum(info.accepted)),
            "stages/server_move": getattr(info, "server_move", math.nan),
            "time/round_s": float(sum(info.seconds.values())),
        }
        scalars.update({f"consensus/{k}": v for k, v in info.consensus_metrics.items()})
        for k, v in scalars.items():
            if v is not None and math.isfinite(v):
                tb.add_scalar(k, v, step)
        for i, (a, w) in enumerate(zip(info.node_accuracy, info.weights, strict=True)):
            if math.isfinite(a):
                tb.add_scalar(f"accuracy/node_{i}", a, step)
            tb.add_scalar(f"weights/node_{i}", w, step)
        for i, share in enumerate(getattr(info, "share", None) or []):
            if math.isfinite(share):
                tb.add_scalar(f"share/node_{i}", share, step)

    def close(self) -> None:
        """Wait for the TensorBoard writes and close the writer; the first failed write raises here."""
        if self._tb_worker is not None:
            self._tb_worker.shutdown(wait=True)
            self._tb_worker = None
        writes, self._tb_writes = self._tb_writes, []
        if self._tb is not None:
            self._tb.close()
            self._tb = None
        for f in writes:
            f.result()  # the first failed write, if any, raises here
