"""``MetaConsensus(config).train()``: the rounds of a run, with retries, logs, plots and checkpoints.

Example::

    from meta_consensus import MetaConsensus, config
    cfg = config.load(None, ["rounds=3", "dp.enabled=false"])    # the embedded default, changed
    result = MetaConsensus(cfg).train()
    result.consensus_params, result.history[-1].consensus_accuracy

Outputs (process 0 only) go to ``<output_dir>/<name>/``: ``config.toml`` (the
config used: ``meta-consensus run --config runs/<name>/config.toml`` repeats
the run), ``metrics.jsonl`` (one :class:`RoundInfo` per line),
``tensorboard/`` (event files), ``accuracy.png`` and ``weights.png``,
``table.txt`` and ``checkpoints/`` (orbax, every ``checkpoint_every`` rounds
and at the end, the last ``keep_checkpoints`` kept). ``train(resume=True)``
continues from the latest checkpoint; the rounds after it are run again with
the same keys, so the result equals an uninterrupted run's bit for bit.
"""

from __future__ import annotations

import dataclasses
import sys
import time
from pathlib import Path
from typing import Any

import jax

from meta_consensus import report
from meta_consensus.checkpoint import RunCheckpoints
from meta_consensus.config import Config, dumps
from meta_consensus.coordinator import Coordinator, CoordinatorState, PrivacyBudgetStop, RoundInfo

PyTree = Any


@dataclasses.dataclass
class RunResult:
    """What :meth:`MetaConsensus.train` returns.

    Attributes:
      consensus_params: the final consensus tree.
      history: every round attempt, in order (failed attempts included).
      state: the final :class:`CoordinatorState` (nodes, aggregator, ledger).
      stopped: why the run stopped early ("" when it ran every round).
      seconds: wall time of the rounds.
      run_dir: where the outputs are (None when nothing was written).
    """

    consensus_params: PyTree
    history: list[RoundInfo]
    state: CoordinatorState
    stopped: str
    seconds: float
    run_dir: Path | None

    def table(self, cfg: Config) -> str:
        return report.table(cfg, self.history, self.seconds)


class MetaConsensus:
    """The meta-consensus system of one config.

    Args:
      config: the run :class:`~meta_consensus.config.Config`.
      write: write the run directory (logs, plots, checkpoints); only process 0
        writes logs, every process takes part in checkpoints.
      progress: show a progress bar per round.
    """

    def __init__(self, config: Config, *, write: bool = True, progress: bool = True):
        self.cfg = config
        self.process_index = jax.process_index()
        self.process_count = jax.process_count()
        self.coordinator = Coordinator(
            config, process_index=self.process_index, process_count=self.process_count
        )
        self.write = write
        self.is_main = self.process_index == 0
        self.progress = progress and self.is_main
        self.run_dir = Path(config.run_dir)

    def train(
        self, *, resume: bool = False, max_rounds: int | None = None, initial_params: PyTree | None = None
    ) -> RunResult:
        """Run the rounds (all of them, or up to ``max_rounds`` more).

        Args:
          resume: continue from the latest checkpoint of ``runs/<name>`` (a fresh start when
            there is none).
          max_rounds: stop after this many rounds of this call (for tests and notebooks).
          initial_params: the first consensus (default: the task's init from the seed).
        """
        cfg = self.cfg
        co = self.coordinator
        state = co.init(cfg.seed, initial_params)
        history: list[RoundInfo] = []
        ckpt = RunCheckpoints(self.run_dir, cfg) if self.write and cfg.checkpoint_every > 0 else None
        log = report.RunLog(self.run_dir, enabled=self.write and self.is_main)
        if resume and ckpt is not None and ckpt.latest() is not None:
            state, history = ckpt.restore(state)
            log.restart(history)
        elif self.write and self.is_main:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            log.restart([])
        if self.write and self.is_main:
            (self.run_dir / "config.toml").write_text(dumps(cfg))

        bar = self._bar(state.round)
        stopped = ""
        t0 = time.perf_counter()
        done_now = 0
        try:
            while state.round < cfg.rounds and (max_rounds is None or done_now < max_rounds):
                try:
                    state, infos = self._round_with_retries(state)
                except PrivacyBudgetStop as e:
                    stopped = f"privacy budget: {e}"
                    break
                for info in infos:
                    history.append(info)
                    log.log(info)
                done_now += 1
                if not infos[-1].ok and cfg.on_failure == "stop":
                    last = infos[-1]
                    stopped = f"round {last.round + 1} failed after {cfg.max_retries} retries: {last.reason}"
                    break
                if ckpt is not None and (
                    state.round % cfg.checkpoint_every == 0 or state.round == cfg.rounds
                ):
                    ckpt.save(state, history)
                if bar is not None:
                    bar.update(1)
                    bar.set_postfix_str(self._postfix(infos[-1]))
        finally:
            if bar is not None:
                bar.close()
            log.close()
            if ckpt is not None:
                ckpt.close()
        seconds = time.perf_counter() - t0
        result = RunResult(
            state.consensus, history, state, stopped, seconds, self.run_dir if self.write else None
        )
        if self.write and self.is_main:
            text = report.table(cfg, history, sum(sum(h.seconds.values()) for h in history))
            (self.run_dir / "table.txt").write_text(text + "\n")
            report.plot(cfg, history, self.run_dir)
        return result

    def _round_with_retries(self, state: CoordinatorState) -> tuple[CoordinatorState, list[RoundInfo]]:
        infos = []
        for attempt in range(self.cfg.max_retries + 1):
            new_state, info = self.coordinator.round(state, attempt=attempt)
            infos.append(info)
            if info.ok:
                return new_state, infos
            state = new_state  # the same consensus; the ledger may have been charged
        return self.coordinator.skip(state), infos

    def _bar(self, start: int):
        if not self.progress:
            return None
        from tqdm.auto import tqdm

        return tqdm(
            total=self.cfg.rounds,
            initial=start,
            desc=f"meta-consensus {self.cfg.name}",
            unit="round",
            file=sys.stderr,
            dynamic_ncols=True,
        )

    @staticmethod
    def _postfix(info: RoundInfo) -> str:
        if not info.ok:
            return f"failed: {info.reason[:40]}"
        s = f"acc {info.consensus_accuracy:.3f} fedavg {info.fedavg_accuracy:.3f}"
        s += f" accepted {sum(info.accepted)}"
        if info.epsilon:
            s += f" eps {info.epsilon:.3g}"
        return s
