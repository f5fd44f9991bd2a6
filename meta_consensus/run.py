"""``MetaConsensus(config).train()``: the rounds of a run, with retries, logs, plots and checkpoints.

Example::

    from meta_consensus import MetaConsensus, config
    cfg = config.load(None, ["rounds=3", "dp.enabled=false"])    # the embedded default, changed
    result = MetaConsensus(cfg).train()
    result.consensus_params, result.history[-1].consensus_accuracy

Outputs (process 0 only) go to ``<output_dir>/<name>/``: ``config.toml`` (the
config used, its ``plugins`` included: ``meta-consensus run --config
runs/<name>/config.toml`` repeats the run), ``metrics.jsonl`` (one :class:`RoundInfo` per line),
``tensorboard/`` (event files), ``accuracy.png`` and ``weights.png``,
``table.txt``, ``privacy.json`` (the DP level, delta, epsilon and each node's)
and ``checkpoints/`` (orbax, every ``checkpoint_every`` rounds and at the end,
the last ``keep_checkpoints`` kept). ``train(resume=True)``
continues from the latest intact checkpoint; the rounds after it are run again
with the same keys, so the result equals an uninterrupted run's bit for bit.

The user's files are never lost: a fresh run into a directory that already
holds a run raises :class:`RunDirectoryError` before any file is touched, unless
``overwrite=True`` moves the earlier run aside to ``<name>.old-<k>`` (never
deleted); ``resume=True`` on a directory that holds no run is a :class:`RunDirectoryError`
naming it. A start that fails before its first checkpoint removes what it created (the run
directory, when it created it), so the name is free again; it never removes a directory it did
not create. A task given from Python (``MetaConsensus(cfg, task=...)``) is recorded in
``config.toml`` by its import path when a module holds it, otherwise as
``"<python object: NAME>"``, which a run from the config alone refuses.

SIGTERM (a preempted machine, a scheduler's stop) lets the current
round finish, saves its checkpoint and returns with ``RunResult.terminated``.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any

import jax
import numpy as np

from meta_consensus import report
from meta_consensus.checkpoint import RunCheckpoints
from meta_consensus.config import Config, ConfigError, dumps, to_dict
from meta_consensus.coordinator import Coordinator, CoordinatorState, PrivacyBudgetStop, RoundInfo
from strategies.tasks.base import Task

PyTree = Any

# The files whose presence marks a directory as holding a run.
RUN_FILES = ("config.toml", "metrics.jsonl", "checkpoints")
# The final consensus of a run, as safetensors beside the orbax checkpoints (``consensus.io``).
CONSENSUS_FILE = "consensus.safetensors"


def load_initial_params(path: str | Path, like: PyTree) -> PyTree:
    """The safetensors checkpoint at ``path`` as a first consensus: checked against ``like``, on its devices.

    ``like`` is the task's freshly initialized parameters: every key, shape and dtype must
    match (``consensus.io.CheckpointError`` / ``CheckpointKeyError``, both ValueErrors, name
    the first mismatch); the arrays go to the devices (and mesh sharding) of ``like``'s leaves.

    Args:
      path: a safetensors file.
      like: the task's freshly initialized parameters.

    Returns:
      The loaded tree, placed as ``like``.

    Raises:
      consensus.io.CheckpointError: for a file that is not a readable safetensors checkpoint.
      consensus.io.CheckpointKeyError: for a key, shape or dtype that does not match ``like``.
    """
    from consensus.io import load_safetensors

    loaded = load_safetensors(path, like=like)
    return jax.tree.map(lambda a, ref: jax.device_put(a, ref.sharding), loaded, like)


def _host_value(a: Any) -> np.ndarray:
    # A leaf of a multi-process run may span processes; a replicated one is whole on every process.
    if isinstance(a, jax.Array) and not a.is_fully_addressable:
        if a.is_fully_replicated:
            return np.asarray(a.addressable_data(0))
        from jax.experimental import multihost_utils

        return np.asarray(multihost_utils.process_allgather(a, tiled=True))
    return np.asarray(a)


def save_consensus(run_dir: str | Path, consensus: PyTree, metadata: dict[str, str] | None = None) -> Path:
    """Write ``run_dir/consensus.safetensors`` atomically (temporary name, then rename), bit for bit.

    Args:
      run_dir: the run folder.
      consensus: the consensus tree (leaves spanning processes are gathered first).
      metadata: string metadata stored in the file's header.

    Returns:
      The path written.
    """
    from consensus.io import save_safetensors

    host = jax.tree.map(_host_value, consensus)
    return save_safetensors(host, Path(run_dir) / CONSENSUS_FILE, metadata=metadata, overwrite=True)


#: What an export of the run needs to know of its task, for tasks that say it (``task.record()``:
#: the causal LM's model folder, domains and options), with a LoRA run's settings and targets.
TASK_FILE = "task.json"


def task_record(coordinator: Coordinator) -> dict[str, Any] | None:
    """The ``task.json`` of a run: the task's own ``record()`` and, in a LoRA run, ``"lora"``.

    Args:
      coordinator: the run's coordinator.

    Returns:
      A JSON-safe dict, or None for a task without ``record()``.
    """
    from meta_consensus import lora as lora_run

    record = getattr(coordinator.fleet.task, "record", None)
    if not callable(record):
        return None
    out = dict(record())
    out["lora"] = lora_run.describe(coordinator.lora) if coordinator.lora is not None else None
    return out


class RunDirectoryError(RuntimeError):
    """The run directory cannot be used as asked (a user error; nothing was written)."""


# How config.toml records a task given from Python that no module holds: a run from the config
# alone is refused (:func:`check_task_recorded`).
PYTHON_TASK_MARK = "<python object: {}>"


def is_python_task_mark(name: str) -> bool:
    """Whether a config's ``task.name`` is the record of a task object given from Python.

    Args:
      name: a ``task.name``.

    Returns:
      True for a :data:`PYTHON_TASK_MARK` record.
    """
    return name.startswith(PYTHON_TASK_MARK.split("{")[0])


def check_task_recorded(cfg: Config) -> None:
    """Refuse a config that names a task object given from Python that no module holds.

    Args:
      cfg: the run config.

    Raises:
      ConfigError: for such a ``task.name``.
    """
    if is_python_task_mark(cfg.task.name):
        raise ConfigError(
            f"task.name = {cfg.task.name!r}: this config was written by a run whose task was given from "
            "Python (MetaConsensus(cfg, task=...)) and no module holds it; pass the task again from "
            "Python, or name a factory with --set task.name=module:factory"
        )


def task_import_path(task: Any) -> str | None:
    """``"module:attribute"`` of an importable module (not ``__main__``) holding ``task`` itself.

    Args:
      task: a task object.

    Returns:
      The import path, or None when no loaded module holds it under a public name.
    """
    for name, module in list(sys.modules.items()):
        if module is None or name == "__main__" or name.startswith("_"):
            continue
        try:
            items = list(vars(module).items())
        except TypeError:
            continue
        for attr, value in items:
            if value is task and not attr.startswith("_"):
                return f"{name}:{attr}"
    return None


def recorded_config(cfg: Config, task: Any | None) -> str:
    """The TOML text of ``config.toml``.

    ``cfg``, with a task given from Python recorded by import path when it has one and marked
    otherwise, so the file never names another task.

    Args:
      cfg: the run config.
      task: the task given from Python, or None (the config names it).

    Returns:
      The TOML text.
    """
    if task is None:
        return dumps(cfg)
    import tomli_w

    data = to_dict(cfg)
    path = task_import_path(task)
    if path is None:
        data["task"]["name"] = PYTHON_TASK_MARK.format(getattr(task, "name", type(task).__name__))
    else:
        data["task"]["name"] = path
    data["task"]["options"] = {}
    return tomli_w.dumps(data)


def existing_run_files(run_dir: Path) -> list[str]:
    """Which of a run's files ``run_dir`` already holds.

    Args:
      run_dir: the run folder.

    Returns:
      The names among ``RUN_FILES`` that exist there.
    """
    return [f for f in RUN_FILES if (Path(run_dir) / f).exists()]


def move_aside(run_dir: Path) -> Path:
    """Rename ``run_dir`` to the first free sibling ``<name>.old-<k>`` and return the new path.

    Args:
      run_dir: the run folder.

    Returns:
      The new path.
    """
    run_dir = Path(run_dir)
    k = 1
    while (dest := run_dir.with_name(f"{run_dir.name}.old-{k}")).exists():
        k += 1
    run_dir.rename(dest)
    return dest


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
      terminated: the run stopped on SIGTERM after saving its last finished round.
      notes: what the run did to the files besides its outputs (an earlier run moved aside,
        damaged checkpoints skipped), one line each.
    """

    consensus_params: PyTree
    history: list[RoundInfo]
    state: CoordinatorState
    stopped: str
    seconds: float
    run_dir: Path | None
    terminated: bool = False
    notes: list[str] = dataclasses.field(default_factory=list)

    @property
    def succeeded(self) -> int:
        """How many rounds succeeded (0: the run produced nothing)."""
        return sum(h.ok for h in self.history)

    def table(self, cfg: Config) -> str:
        """The end-of-run table (:func:`meta_consensus.report.table`).

        Args:
          cfg: the run config.

        Returns:
          The table as text.
        """
        return report.table(cfg, self.history, self.seconds)


class MetaConsensus:
    """The meta-consensus system of one config.

    Args:
      config: the run :class:`~meta_consensus.config.Config`.
      task: a Task object to train on instead of the one ``config.task.name`` names (for
        example from :func:`strategies.tasks.task_from_arrays`).
      write: write the run directory (logs, plots, checkpoints); only process 0
        writes logs, every process takes part in checkpoints.
      progress: show a progress bar per round.
    """

    def __init__(
        self, config: Config, *, task: Task | None = None, write: bool = True, progress: bool = True
    ):
        if task is None:
            check_task_recorded(config)
        self.cfg = config
        self.task = task
        self.process_index = jax.process_index()
        self.process_count = jax.process_count()
        self.coordinator = Coordinator(
            config, task=task, process_index=self.process_index, process_count=self.process_count
        )
        self.write = write
        self.is_main = self.process_index == 0
        self.progress = progress and self.is_main
        self.run_dir = Path(config.run_dir)

    def train(
        self,
        *,
        resume: bool = False,
        overwrite: bool = False,
        max_rounds: int | None = None,
        initial_params: PyTree | None = None,
    ) -> RunResult:
        """Run the rounds (all of them, or up to ``max_rounds`` more).

        Args:
          resume: continue from the newest intact checkpoint of ``runs/<name>``
            (:class:`RunDirectoryError` when the directory holds no run; a fresh start when it
            holds one without checkpoints; :class:`~meta_consensus.checkpoint.CheckpointError`
            when there are checkpoints but none restores, or they are of another config).
          overwrite: when ``runs/<name>`` already holds a run and ``resume`` is False, move it
            aside to ``runs/<name>.old-<k>`` (without it: :class:`RunDirectoryError`).
          max_rounds: stop after this many rounds of this call (for tests and notebooks).
          initial_params: the first consensus (default: the task's init from the seed).

        Returns:
          The :class:`RunResult`.

        Raises:
          RunDirectoryError: when the run directory cannot be used as asked.
          meta_consensus.checkpoint.CheckpointError: when resuming finds no intact checkpoint
            or checkpoints of another config.
          consensus.io.CheckpointError: when ``init_from`` does not fit the task (also
            ``CheckpointKeyError``).
        """
        cfg = self.cfg
        co = self.coordinator
        if initial_params is None and cfg.init_from is not None:
            # Before the run directory is claimed: a checkpoint that does not fit changes no file.
            fresh = co.fleet.initial_params(jax.random.split(jax.random.key(cfg.seed))[0])
            initial_params = load_initial_params(cfg.init_from, fresh)
        state = co.init(cfg.seed, initial_params)
        notes: list[str] = []
        created = None
        if self.write:
            self._claim_run_dir(resume, overwrite, notes)
            created = _created_by_us(self.run_dir)
        try:
            return self._train(state, resume, max_rounds, notes)
        except BaseException:
            if created is not None and self.is_main and not _has_output(self.run_dir):
                created.undo()
            raise

    def _train(
        self, state: CoordinatorState, resume: bool, max_rounds: int | None, notes: list[str]
    ) -> RunResult:
        cfg = self.cfg
        history: list[RoundInfo] = []
        ckpt = RunCheckpoints(self.run_dir, cfg) if self.write and cfg.checkpoint_every > 0 else None
        log = report.RunLog(self.run_dir, enabled=self.write and self.is_main)
        saved = -1  # the round of the newest checkpoint on disk
        try:
            if resume and ckpt is not None and ckpt.steps():
                state, history, skipped = ckpt.restore_intact(state)
                saved = state.round
                for s in skipped:
                    notes.append(
                        f"warning: checkpoint of round {s.step} is damaged ({s.reason}); skipped and "
                        f"moved to {s.moved_to}; resuming from round {state.round}"
                    )
                log.restart(history)
            elif self.write and self.is_main:
                log.restart([])
        except BaseException:
            if ckpt is not None:
                ckpt.close()
            raise
        if self.write and self.is_main:
            for line in notes:
                print(f"meta-consensus: {line}", file=sys.stderr)
            (self.run_dir / "config.toml").write_text(recorded_config(cfg, self.task))
            record = task_record(self.coordinator)
            if record is not None:
                (self.run_dir / TASK_FILE).write_text(json.dumps(record, indent=2, default=str) + "\n")

        bar = self._bar(state.round)
        stopped = ""
        terminated = False
        t0 = time.perf_counter()
        done_now = 0
        sigterm = _SigtermFlag()
        try:
            while state.round < cfg.rounds and (max_rounds is None or done_now < max_rounds):
                if sigterm.agreed(self.process_count):
                    terminated = True
                    if ckpt is not None and saved != state.round:
                        ckpt.save(state, history)
                        saved = state.round
                    where = (
                        f"checkpoint of round {saved} saved; continue with --resume"
                        if ckpt is not None
                        else "no checkpoint (checkpoint_every = 0)"
                    )
                    stopped = f"SIGTERM after round {state.round} of {cfg.rounds}: {where}"
                    break
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
                    saved = state.round
                if bar is not None:
                    bar.update(1)
                    bar.set_postfix_str(self._postfix(infos[-1]))
        finally:
            sigterm.restore()
            if bar is not None:
                bar.close()
            log.close()
            if ckpt is not None:
                ckpt.close()  # waits for the last asynchronous save
        seconds = time.perf_counter() - t0
        result = RunResult(
            state.consensus,
            history,
            state,
            stopped,
            seconds,
            self.run_dir if self.write else None,
            terminated=terminated,
            notes=notes,
        )
        if self.write and self.is_main:
            text = report.table(cfg, history, sum(sum(h.seconds.values()) for h in history))
            (self.run_dir / "table.txt").write_text(text + "\n")
            report.plot(cfg, history, self.run_dir)
            # The run's guarantee: level, delta, epsilon and (example level) every node's.
            summary = self.coordinator.privacy_summary(state)
            (self.run_dir / "privacy.json").write_text(json.dumps(summary, indent=2, allow_nan=False) + "\n")
        if self.write:
            # Every process takes part (a sharded leaf is gathered); process 0 writes the file.
            host = jax.tree.map(_host_value, state.consensus)
            if self.is_main:
                meta = {"name": cfg.name, "round": str(state.round), "format": "meta-consensus"}
                save_consensus(self.run_dir, host, meta)
        return result

    def _claim_run_dir(self, resume: bool, overwrite: bool, notes: list[str]) -> None:
        """Refuse (or, with ``overwrite``, move aside) an earlier run before any file is written.

        Process 0 decides and every process learns the decision, so that all of them stop
        together instead of the others waiting for a process that left.
        """
        problem = ""
        if self.is_main:
            found = existing_run_files(self.run_dir)
            if resume and not found:
                problem = (
                    f"cannot resume {self.run_dir}: it holds no run (no config.toml, metrics.jsonl or "
                    "checkpoints); start it without --resume (resume=False), or give the name of an "
                    "earlier run (--set name=..., cfg.replace(name=...))"
                )
            elif found and not resume:
                if overwrite:
                    moved = move_aside(self.run_dir)
                    notes.append(f"moved the earlier run in {self.run_dir} to {moved}")
                else:
                    problem = (
                        f"{self.run_dir} already holds a run ({', '.join(found)}): continue it with "
                        "--resume (train(resume=True)), move it aside with --overwrite "
                        "(train(overwrite=True)), or choose another name (--set name=..., "
                        "cfg.replace(name=...))"
                    )
            elif found and resume and self.cfg.checkpoint_every == 0:
                problem = (
                    f"cannot resume {self.run_dir}: this config writes no checkpoints (checkpoint_every = 0)"
                )
        if self.process_count > 1:
            from jax.experimental import multihost_utils

            refused = multihost_utils.broadcast_one_to_all(np.int32(bool(problem)))
            if int(refused) and not problem:
                problem = f"process 0 refused the run directory {self.run_dir} (see its message)"
        if problem:
            raise RunDirectoryError(problem)

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


def _has_checkpoint(run_dir: Path) -> bool:
    ckpts = Path(run_dir) / "checkpoints"
    return ckpts.is_dir() and any(p.name.isdigit() for p in ckpts.iterdir())


def _has_output(run_dir: Path) -> bool:
    """Whether the run directory holds a checkpoint or a logged round.

    A run without checkpoints (``checkpoint_every = 0``) that fails after some rounds keeps what
    it logged, and only a start that produced nothing is undone.
    """
    metrics = Path(run_dir) / "metrics.jsonl"
    return _has_checkpoint(run_dir) or (metrics.is_file() and metrics.stat().st_size > 0)


@dataclasses.dataclass
class _Created:
    """What a start is about to create.

    The highest missing directory on the way to the run directory, or the entries a run
    directory that already existed did not hold.
    """

    root: Path | None
    run_dir: Path
    before: frozenset[str]

    def undo(self) -> None:
        if self.root is not None:
            shutil.rmtree(self.root, ignore_errors=True)
            return
        for entry in set(os.listdir(self.run_dir)) - self.before if self.run_dir.is_dir() else ():
            p = self.run_dir / entry
            if p.is_dir() and not p.is_symlink():
                shutil.rmtree(p, ignore_errors=True)
            else:
                p.unlink(missing_ok=True)


def _created_by_us(run_dir: Path) -> _Created:
    run_dir = Path(run_dir).absolute()
    missing = None
    for p in (run_dir, *run_dir.parents):
        if p.exists():
            break
        missing = p
    before = frozenset(os.listdir(run_dir)) if missing is None and run_dir.is_dir() else frozenset()
    return _Created(missing, run_dir, before)


class _SigtermFlag:
    """Set by SIGTERM; checked between rounds so the run stops after a finished, saved round.

    Installed only on the main thread (Python's rule for signal handlers); elsewhere it stays
    unset and SIGTERM keeps its default action. In a multi-process run the flag is agreed on
    (any process's SIGTERM stops all of them at the same round), since saving is collective.
    """

    def __init__(self):
        self.set = False
        self._previous = None
        if threading.current_thread() is threading.main_thread():
            self._previous = signal.signal(signal.SIGTERM, self._handle)

    def _handle(self, signum, frame) -> None:
        self.set = True

    def agreed(self, process_count: int) -> bool:
        if process_count == 1:
            return self.set
        from jax.experimental import multihost_utils

        flags = multihost_utils.process_allgather(np.int32(self.set))
        return bool(np.any(flags))

    def restore(self) -> None:
        if self._previous is not None:
            signal.signal(signal.SIGTERM, self._previous)
            self._previous = None
