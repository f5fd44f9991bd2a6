"""The node side of a round: every node trains with its strategy, in one jitted program.

All n nodes live in one stacked :class:`~strategies.trainer.TrainState` and train
together in the node trainer's vmapped step, whatever their strategy:

* ``local``: Adam on the node's own shard;
* ``hierarchical``: a curriculum inside the round, the general pool, then the
  general rows of the node's own groups, then its own shard
  (:mod:`strategies.hierarchical`, one ``(n, T)`` schedule for all nodes);
* ``convexity``: proximal pull towards the last consensus (and an optional L2
  ball around it) after every step, which keeps the node mergeable
  (:mod:`strategies.convexity`);
* ``soup``: the round's training is cut into ``soup_snapshots`` segments; the
  node submits the greedy soup of its snapshots on held-out accuracy
  (:func:`strategies.soup.greedy_soup`);
* Byzantine nodes train like the others (on flipped labels for label
  flipping) and submit the model attack of :mod:`strategies.byzantine`.

Failures are answers, not crashes: a fit call that raises or runs past the
timeout marks its nodes as not answering, and simulated faults (a drop rate,
crashing nodes) do the same per node. The round then goes on with the nodes
that did answer (see :mod:`meta_consensus.coordinator`).
"""

from __future__ import annotations

import dataclasses
import functools
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from consensus import mesh as mesh_lib
from meta_consensus.config import Config
from strategies import byzantine as byz_lib
from strategies.hierarchical import Level, plan
from strategies.node import LEVELS
from strategies.registry import check_task, resolve_task
from strategies.tasks import TaskData
from strategies.tasks.base import Task
from strategies.trainer import NodeTrainer, Proximal, Schedule, TrainState

PyTree = Any


def make_task(cfg: Config) -> Task:
    """The task of a config: a registered name or a ``package.module:factory`` import path."""
    return resolve_task(cfg.task.name, cfg.task.options)


@dataclasses.dataclass(frozen=True)
class FleetOutput:
    """What the nodes hand back in one round.

    Attributes:
      state: the nodes' TrainState after training (unchanged if the fit failed).
      submitted: (n, ...) stacked candidates as the coordinator receives them.
      answered: (n,) bool, nodes whose answer arrived.
      errors: node index -> why it did not answer.
      loss: (n,) mean training loss of the round (NaN for a failed fit).
      seconds: wall time of the fit.
    """

    state: TrainState
    submitted: PyTree
    answered: np.ndarray
    errors: dict[int, str]
    loss: np.ndarray
    seconds: float


class Fleet:
    """The n nodes of a run: task, data, trainer and each node's strategy."""

    def __init__(
        self, cfg: Config, *, task: Task | None = None, process_index: int = 0, process_count: int = 1
    ):
        self.cfg = cfg
        n = cfg.nodes.count
        self.n = n
        self.task = make_task(cfg) if task is None else check_task(task, "the task object")
        self.data: TaskData = self.task.splits(
            n,
            seed=cfg.task.data_seed,
            alpha=cfg.task.alpha,
            process_index=process_index,
            process_count=process_count,
        )
        mesh = (
            (cfg.mesh.node, cfg.mesh.data, cfg.mesh.model) if cfg.mesh.enabled or process_count > 1 else None
        )
        self.trainer = _trainer(self.task, cfg.nodes.learning_rate, cfg.nodes.batch_size, mesh)
        self.strategies = cfg.nodes.build_strategies()
        self.settings = [s.settings(cfg.nodes.local_steps, cfg.nodes.learning_rate) for s in self.strategies]
        self.byzantine = byz_lib.Byzantine(
            mask=np.isin(np.arange(n), np.asarray(cfg.byzantine.nodes, np.int64)),
            attack=cfg.byzantine.attack,
            label_flip=cfg.byzantine.label_flip,
            kwargs=dict(cfg.byzantine.options),
        )
        self._plan = self._build_plan()
        # Submit hooks that need snapshots (soups): the round's steps are cut into that many segments.
        snaps = {st.snapshots for st in self.settings if st.snapshots}
        if len(snaps) > 1:
            raise ValueError(f"nodes take different numbers of snapshots {sorted(snaps)}; use one number")
        self.snapshot_nodes = np.flatnonzero([st.snapshots > 0 for st in self.settings])
        mu = np.asarray([st.proximal_mu for st in self.settings], np.float32)
        radius = np.asarray([st.proximal_radius for st in self.settings], np.float32)
        self._proximal = (mu, radius) if (mu > 0).any() or np.isfinite(radius).any() else None
        self._segments = np.array_split(np.arange(cfg.nodes.local_steps), snaps.pop() if snaps else 1)
        self._metrics = _metrics(self.task)
        self._broadcast_jit = None
        # Example-level DP-SGD settings (strategies.dpsgd.ExampleDP), set by the coordinator.
        self.example_dp = None

    # ------------------------------------------------------------------ setup

    def _build_plan(self):
        """The per-node curriculum (steps and learning rate per level) of the strategies' settings."""
        level_steps = np.asarray([st.level_steps for st in self.settings], np.int64)
        if not level_steps[:, :2].any():
            return None  # every node trains on its own shard only: one data level
        level_lr = np.asarray([st.level_lr for st in self.settings], np.float32)
        levels = [Level(name, level_steps[:, j], level_lr[:, j]) for j, name in enumerate(LEVELS)]
        return plan(levels, self.data)

    def init(self, key: jax.Array, params: PyTree) -> TrainState:
        """Every node starts from ``params`` (the initial consensus)."""
        return self.trainer.init(key, params, self.n)

    def initial_params(self, key: jax.Array) -> PyTree:
        return self.task.init(key)

    # ------------------------------------------------------------------ fit

    def fit(self, state: TrainState, anchor: PyTree, key: jax.Array) -> FleetOutput:
        """One round of node training from the broadcast consensus ``anchor``.

        Args:
          state: the nodes' state (optimizer state, keys and step counts carry over rounds).
          anchor: the consensus every node starts from (and the proximal anchor).
          key: this round's node key (model attacks, simulated faults).
        """
        k_attack, k_fault = jax.random.split(key)
        answered = np.ones((self.n,), bool)
        errors: dict[int, str] = {}
        t0 = time.perf_counter()
        try:
            new_state, loss, snapshots = self._train(state, anchor)
            if self.example_dp is not None:
                # Under example-level DP the training loss (private rows, no noise) stays on the node.
                loss = np.full_like(loss, np.nan)
            candidates = self._soups(new_state.params, snapshots)
            submitted = byz_lib.submit(self.byzantine, k_attack, candidates, anchor)
            jax.block_until_ready(submitted)
        except Exception as e:  # noqa: BLE001 - a failed fit is a missing answer, never a crash
            msg = f"fit raised {type(e).__name__}: {e}"
            return FleetOutput(
                state,
                self.trainer_broadcast(anchor),
                np.zeros((self.n,), bool),
                dict.fromkeys(range(self.n), msg),
                np.full((self.n,), np.nan),
                time.perf_counter() - t0,
            )
        seconds = time.perf_counter() - t0
        faults = self.cfg.faults
        if faults.timeout_s is not None and seconds > faults.timeout_s:
            answered[:] = False
            errors.update(dict.fromkeys(range(self.n), f"timed out ({seconds:.1f} s > {faults.timeout_s} s)"))
        for i in faults.crash_nodes:
            answered[i] = False
            errors[i] = "fit raised RuntimeError: simulated crash"
        if faults.drop_rate > 0:
            drop = np.asarray(jax.random.uniform(k_fault, (self.n,))) < faults.drop_rate
            for i in np.flatnonzero(drop & answered):
                answered[i] = False
                errors[int(i)] = "no answer (simulated drop)"
        return FleetOutput(new_state, submitted, answered, errors, loss, seconds)

    def trainer_broadcast(self, params: PyTree) -> PyTree:
        """n copies of ``params`` as a stacked tree (the placeholder of a failed fit)."""
        return jax.tree.map(lambda p: jnp.broadcast_to(p, (self.n, *p.shape)), params)

    def _broadcast_placed(self, anchor: PyTree, like: PyTree) -> PyTree:
        """n copies of ``anchor`` placed like the nodes' params (on the mesh's node axis)."""
        if self.trainer.mesh is None:
            return self.trainer_broadcast(anchor)
        if self._broadcast_jit is None:
            sh = self.trainer.shardings(like).params
            self._broadcast_jit = jax.jit(self.trainer_broadcast, out_shardings=sh)
        return self._broadcast_jit(anchor)

    def _train(self, state: TrainState, anchor: PyTree) -> tuple[TrainState, np.ndarray, list[PyTree]]:
        # Every node restarts from the consensus; its optimizer state and key stream carry over.
        state = state._replace(params=self._broadcast_placed(anchor, state.params))
        if self._plan is not None:
            data, hp = self._plan.data, self._plan.hyperparams
            level, active = np.asarray(self._plan.schedule.level), np.asarray(self._plan.schedule.active)
        else:
            data, hp = self.data.own(), None
            level = active = None
        prox = None
        if self._proximal is not None:
            prox = Proximal(anchor, *self._proximal)
        flip = self.byzantine.flip_mask
        snapshots, losses = [], []
        for seg in self._segments:
            schedule = None if level is None else Schedule(level[:, seg], active[:, seg])
            state, log = self.trainer.fit(
                state,
                data,
                len(seg),
                schedule=schedule,
                hyperparams=hp,
                flip_labels=flip if flip.any() else None,
                proximal=prox,
                dp=self.example_dp,
            )
            losses.append(mesh_lib.to_host(log.loss))
            if self.snapshot_nodes.size:
                snapshots.append(state.params)
        loss = np.concatenate(losses, 0).mean(0)
        return state, loss, snapshots

    def _soups(self, stacked: PyTree, snapshots: list[PyTree]) -> PyTree:
        """Each node that took snapshots submits what its strategy's submit hook makes of them."""
        if not self.snapshot_nodes.size:
            return stacked
        held = self.data.heldout
        # One batched evaluation of every snapshot of every node, then each hook picks its own.
        scores = np.stack([self.trainer.evaluate(s, held)["accuracy"] for s in snapshots], 0)
        out = stacked
        for i in self.snapshot_nodes:
            ingredients = [jax.tree.map(functools.partial(_row, i=int(i)), s) for s in snapshots]
            final = jax.tree.map(functools.partial(_row, i=int(i)), stacked)
            submitted = self.strategies[i].submit(
                final,
                ingredients,
                lambda p: float(self._metrics(p, held)["accuracy"]),
                scores=scores[:, i].tolist(),
            )
            out = jax.tree.map(lambda x, s, i=int(i): x.at[i].set(s.astype(x.dtype)), out, submitted)
        return out

    # ------------------------------------------------------------------ evaluation

    def evaluate_nodes(self, stacked: PyTree, split: str = "test") -> dict[str, np.ndarray]:
        """Per-node metrics on the shared test (or held-out) set: ``{name: (n,)}``."""
        return self.trainer.evaluate(stacked, getattr(self.data, split))

    def evaluate(self, params: PyTree, split: str = "test") -> dict[str, float]:
        """Metrics of one params tree on the test (or held-out) set."""
        out = mesh_lib.to_host(self._metrics(params, getattr(self.data, split)))
        return {k: float(v) for k, v in out.items()}


@functools.lru_cache(maxsize=16)
def _trainer(
    task: Task, learning_rate: float, batch_size: int, mesh: tuple[int, int, int] | None
) -> NodeTrainer:
    # Trainers are immutable and carry their compiled steps: runs of the same task and
    # optimizer settings (tests, benchmark sweeps, notebooks) share them instead of recompiling.
    mesh_cfg = None if mesh is None else mesh_lib.MeshConfig(node=mesh[0], data=mesh[1], model=mesh[2])
    return NodeTrainer(
        task, optax.adam, {"learning_rate": learning_rate}, batch_size=batch_size, mesh=mesh_cfg
    )


@functools.lru_cache(maxsize=16)
def _metrics(task: Task):
    return jax.jit(task.metrics)


def _row(x: jax.Array, i: int) -> jax.Array:
    return x[i]
