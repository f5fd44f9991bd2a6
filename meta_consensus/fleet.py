"""The node side of a round: every node trains with its strategy, in one jitted program.

All n nodes live in one stacked :class:`~strategies.trainer.TrainState` and train
together in the node trainer's vmapped step, whatever their strategy:

* ``local``: Adam on the node's own shard;
* ``hierarchical``: a curriculum inside the round, the general pool (the task's
  public pool, apart from every node's shard), then the general rows of the
  node's own groups, then its own shard (:mod:`strategies.hierarchical`, one
  ``(n, T)`` schedule for all nodes);
* ``convexity``: proximal pull towards the last consensus (and an optional L2
  ball around it) after every step, which keeps the node mergeable
  (:mod:`strategies.convexity`);
* ``soup``: the round's training is cut into ``soup_snapshots`` segments; the
  node submits the greedy soup of its snapshots, from the latest, on a held-out
  split of its own shard that it never trains on (:func:`strategies.soup.greedy_soup`;
  ``Fleet.soup_log`` records each round's latest-snapshot and soup metrics);
* Byzantine nodes train like the others (on batches the configured data
  attack rewrote: label flipping, or a plug-in's) and submit the model attack
  of :mod:`strategies.byzantine`.

Failures are answers, not crashes: a fit call that raises or runs past the
timeout marks its nodes as not answering, and simulated faults (a drop rate,
crashing nodes) do the same per node. The round then goes on with the nodes
that did answer (see :mod:`meta_consensus.coordinator`).

Client sampling (``nodes.sampling``, :mod:`meta_consensus.sampling`): only the round's
sampled nodes train. The n nodes' states then live on the host (numpy, key data as uint32;
checkpointed by orbax like the on-device one); a round gathers the sampled rows, moves them
to the devices ``nodes.chunk`` at a time (with the mesh's sharding), trains each chunk in the
same vmapped program, and scatters the trained rows back into a new host state.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from consensus import mesh as mesh_lib
from meta_consensus.config import Config, ConfigError
from meta_consensus.sampling import ClientSample
from strategies import byzantine as byz_lib
from strategies.dpsgd import ExampleDP
from strategies.hierarchical import Level, plan
from strategies.node import LEVELS
from strategies.registry import check_task, resolve_task
from strategies.tasks import TaskData
from strategies.tasks.base import NodeData, Task, with_public_pool
from strategies.tasks.checks import check_task_data
from strategies.trainer import NodeTrainer, Proximal, Schedule, TrainState

PyTree = Any


def make_task(cfg: Config, task: Task | None = None) -> Task:
    """The task of a config, with the config's public pool settings.

    Args:
      cfg: the run config; ``task.name`` is a registered name or a ``package.module:factory``
        import path, and ``task.public_fraction`` and ``task.general_pool`` set the public pool.
      task: a Task object to use instead of the one ``task.name`` names.

    Returns:
      The task, wrapped to hold out its public pool when the config asks for one.

    Raises:
      ConfigError: public pool settings the task cannot meet.
      RegistryError: an unknown task name, or options its factory does not take.
      TaskError: the user's task module or factory fails.
    """
    task = resolve_task(cfg.task.name, cfg.task.options) if task is None else task
    try:
        return with_public_pool(task, cfg.task.public_fraction, cfg.task.general_pool)
    except ValueError as e:
        raise ConfigError(str(e)) from None


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
      ids: under client sampling, (slots,) the node of every row above (-1 on padding), and
        ``errors`` is keyed by slot; None under full participation (row i is node i).
    """

    state: TrainState
    submitted: PyTree
    answered: np.ndarray
    errors: dict[int, str]
    loss: np.ndarray
    seconds: float
    ids: np.ndarray | None = None


class Fleet:
    """The n nodes of a run: task, data, trainer and each node's strategy.

    Args:
      cfg: the run config.
      task: a Task object instead of the one the config names.
      process_index: this process in a ``jax.distributed`` run (it hosts a block of the nodes).
      process_count: the processes of the run.

    Raises:
      ConfigError: client sampling over several processes, strategies that train on an empty
        public pool, or public pool settings the task cannot meet.
      ValueError: nodes whose strategies take different numbers of snapshots.
    """

    def __init__(
        self, cfg: Config, *, task: Task | None = None, process_index: int = 0, process_count: int = 1
    ):
        self.cfg = cfg
        n = cfg.nodes.count
        self.n = n
        if cfg.nodes.sampled and process_count > 1:
            # The n clients' state is one host's (gathered and scattered per round); a sample
            # spread over processes would need every process to hold the rows it trains.
            raise ConfigError("nodes.sampling: client sampling runs in one process (no jax.distributed)")
        self.task = make_task(cfg, None if task is None else check_task(task, "the task object"))
        self.strategies = cfg.nodes.build_strategies()
        self.settings = [s.settings(cfg.nodes.local_steps, cfg.nodes.learning_rate) for s in self.strategies]
        self.data: TaskData = self.task.splits(
            n,
            seed=cfg.task.data_seed,
            alpha=cfg.task.alpha,
            process_index=process_index,
            process_count=process_count,
        )
        own_heldout = np.asarray([st.own_heldout for st in self.settings], np.float64)
        # Each node's own held-out rows by global node id (those that keep any), on every process.
        self._own_batches: dict[int, dict[str, np.ndarray]] = {}
        if own_heldout.any():
            # Rows a node scores its snapshots on: kept out of every level of its training. The
            # draw is seeded by the node's global id, so the hosting process draws the rows one
            # process would; they are then shared, since every process runs every node's scoring.
            self.data = self.data.hold_out_own(own_heldout[self.data.node_ids], cfg.task.data_seed)
            self._own_batches = _own_heldout_batches(self.data, process_count)
        # Per round, each soup node's metrics on its held-out split: latest snapshot and soup.
        self.soup_log: list[dict[int, dict[str, Any]]] = []
        # Finite features, labels the model's logits can predict, a forward pass that fits the input.
        check_task_data(self.task, self.data, f"task {getattr(self.task, 'name', cfg.task.name)!r}")
        mesh = (
            (cfg.mesh.node, cfg.mesh.data, cfg.mesh.model) if cfg.mesh.enabled or process_count > 1 else None
        )
        auto = cfg.nodes.batch_size == "auto"
        self.trainer = _trainer(
            self.task,  # type: ignore[arg-type]  # tasks are hashable; the Task protocol does not say so
            cfg.nodes.learning_rate,
            1 if auto else int(cfg.nodes.batch_size),
            mesh,
            cfg.nodes.optimizer,
        )
        if auto:
            # The largest batch whose compiled step fits one device (compiled, not run).
            shapes = jax.eval_shape(self.task.init, jax.random.key(cfg.seed))
            self.trainer = self.trainer.with_auto_batch(shapes, self.data.own(), n)
            self.cfg = dataclasses.replace(
                cfg, nodes=dataclasses.replace(cfg.nodes, batch_size=self.trainer.batch_size)
            )
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
        tangent = np.asarray([st.tangent for st in self.settings], bool)
        needed = (mu > 0).any() or np.isfinite(radius).any() or tangent.any()
        self._proximal = (mu, radius, tangent) if needed else None
        self._segments = np.array_split(np.arange(cfg.nodes.local_steps), snaps.pop() if snaps else 1)
        self._metrics = _metrics(self.task)  # type: ignore[arg-type]  # as in _trainer
        self._broadcast_jit: Callable[..., Any] | None = None
        self._chunk_broadcast_jit: Callable[..., Any] | None = None
        self._own_data: NodeData | None = None  # TaskData.own(), built once for sampled rounds
        self._key_impl: Any = None  # the PRNG impl of the node keys (host state keeps raw key data)
        # Example-level DP-SGD settings (strategies.dpsgd.ExampleDP), set by the coordinator.
        self.example_dp: ExampleDP | None = None

    # ------------------------------------------------------------------ setup

    def _build_plan(self):
        """The per-node curriculum (steps and learning rate per level) of the strategies' settings."""
        level_steps = np.asarray([st.level_steps for st in self.settings], np.int64)
        if not level_steps[:, :2].any():
            return None  # every node trains on its own shard only: one data level
        if len(self.data.general_groups) == 0:
            pairs = zip(self.strategies, self.settings, strict=True)
            names = sorted({s.name for s, st in pairs if any(st.level_steps[:2])})
            raise ConfigError(
                f"nodes.strategies {names} train on the task's public pool, and it is empty: "
                "set task.public_fraction > 0"
            )
        level_lr = np.asarray([st.level_lr for st in self.settings], np.float32)
        levels = [Level(name, level_steps[:, j], level_lr[:, j]) for j, name in enumerate(LEVELS)]
        return plan(levels, self.data)

    def init(self, key: jax.Array, params: PyTree) -> TrainState:
        """Every node starts from ``params`` (the initial consensus); on the host under client sampling.

        Args:
          key: the nodes' key (split into one per node).
          params: the initial consensus.

        Returns:
          The nodes' stacked TrainState.
        """
        state = self.trainer.init(key, params, self.n)
        if not self.cfg.nodes.sampled:
            return state
        if jnp.issubdtype(state.key.dtype, jax.dtypes.prng_key):
            self._key_impl = jax.random.key_impl(state.key)
        return _to_host(state)

    def initial_params(self, key: jax.Array) -> PyTree:
        """The task's freshly initialized params.

        Args:
          key: the init key.

        Returns:
          The parameter tree.
        """
        return self.task.init(key)

    # ------------------------------------------------------------------ fit

    def fit(
        self, state: TrainState, anchor: PyTree, key: jax.Array, sample: ClientSample | None = None
    ) -> FleetOutput:
        """One round of node training from the broadcast consensus ``anchor``.

        Args:
          state: the nodes' state (optimizer state, keys and step counts carry over rounds).
          anchor: the consensus every node starts from (and the proximal anchor).
          key: this round's node key (model attacks, simulated faults).
          sample: the round's client sample (None: every node); see :meth:`fit_sample`.

        Returns:
          The nodes' new state, their candidates and which answered (simulated faults drop some).
        """
        if sample is not None:
            return self.fit_sample(state, anchor, key, sample)
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
            for j in np.flatnonzero(drop & answered):
                answered[j] = False
                errors[int(j)] = "no answer (simulated drop)"
        return FleetOutput(new_state, submitted, answered, errors, loss, seconds)

    def fit_sample(
        self, state: TrainState, anchor: PyTree, key: jax.Array, sample: ClientSample
    ) -> FleetOutput:
        """One round of the sampled nodes: gather from the host state, fit in chunks, scatter back.

        Rows of the output are the sample's slots; a padding slot trains a copy of a sampled
        node (fixed shapes) and is a missing answer. Attacks see the whole sample at once (an
        attack such as ALIE uses the sampled honest nodes' statistics); faults are drawn per
        node, as under full participation.

        Args:
          state: the nodes' state, all n rows (on the host under client sampling).
          anchor: the consensus every sampled node starts from.
          key: this round's node key.
          sample: the round's client sample.

        Returns:
          The output by slot (:attr:`FleetOutput.ids` names the node of each), with the whole
          host state updated in its sampled rows.
        """
        k_attack, k_fault = jax.random.split(key)
        real, rows = sample.real, sample.rows
        slots, chunk = len(rows), self.cfg.nodes.chunk_size()
        host = _to_host(state)
        t0 = time.perf_counter()
        try:
            trained, losses, candidates = [], [], []
            for start in range(0, slots, chunk):
                part = rows[start : start + chunk]
                new_part, loss, snapshots = self._train(self._device_rows(host, part), anchor, part)
                candidates.append(self._soups(new_part.params, snapshots, part))
                trained.append(_to_host(new_part))
                losses.append(loss)
            stacked = jax.tree.map(lambda *xs: jnp.concatenate(xs, 0), *candidates)
            byz = dataclasses.replace(self.byzantine, mask=self.byzantine.mask[rows] & real)
            submitted = byz_lib.submit(byz, k_attack, stacked, anchor)
            jax.block_until_ready(submitted)
            new_host = _scatter_rows(host, trained, sample.ids)
        except Exception as e:  # noqa: BLE001 - a failed fit is a missing answer, never a crash
            msg = f"fit raised {type(e).__name__}: {e}"
            return FleetOutput(
                state,
                self.trainer_broadcast(anchor, slots),
                np.zeros((slots,), bool),
                dict.fromkeys(np.flatnonzero(real).tolist(), msg),
                np.full((slots,), np.nan),
                time.perf_counter() - t0,
                ids=sample.ids,
            )
        seconds = time.perf_counter() - t0
        loss = np.where(real, np.concatenate(losses, 0), np.nan)
        answered = real.copy()
        errors: dict[int, str] = {}
        faults = self.cfg.faults
        if faults.timeout_s is not None and seconds > faults.timeout_s:
            answered[:] = False
            why = f"timed out ({seconds:.1f} s > {faults.timeout_s} s)"
            errors.update(dict.fromkeys(np.flatnonzero(real).tolist(), why))
        crash = np.isin(rows, np.asarray(faults.crash_nodes, np.int64)) & real
        for j in np.flatnonzero(crash):
            answered[j] = False
            errors[int(j)] = "fit raised RuntimeError: simulated crash"
        if faults.drop_rate > 0:
            drop = np.asarray(jax.random.uniform(k_fault, (self.n,)))[rows] < faults.drop_rate
            for j in np.flatnonzero(drop & answered):
                answered[j] = False
                errors[int(j)] = "no answer (simulated drop)"
        return FleetOutput(new_host, submitted, answered, errors, loss, seconds, ids=sample.ids)

    def _device_rows(self, host: TrainState, rows: np.ndarray) -> TrainState:
        """The host state's ``rows`` on the devices (params are reset to the anchor by ``_train``)."""
        part = jax.tree.map(lambda x: x[rows], host)
        key = jnp.asarray(part.key)
        if self._key_impl is not None:
            key = jax.random.wrap_key_data(key, impl=self._key_impl)
        part = part._replace(key=key)
        shardings = self.trainer.shardings(part.params)
        if shardings is None:
            return jax.tree.map(jnp.asarray, part)
        return TrainState(
            jax.device_put(part.params, shardings.params),
            jax.device_put(part.opt_state, shardings.opt_state),
            jax.device_put(part.key, shardings.key),
            jax.device_put(part.step, shardings.step),
        )

    def trainer_broadcast(self, params: PyTree, n: int | None = None) -> PyTree:
        """The n copies of ``params`` as a stacked tree (the placeholder of a failed fit).

        Args:
          params: the tree to copy.
          n: the number of copies (default: the fleet's n).

        Returns:
          The stacked tree, with a leading ``(n,)`` axis.
        """
        n = self.n if n is None else n
        return jax.tree.map(lambda p: jnp.broadcast_to(p, (n, *p.shape)), params)

    def _broadcast_placed(self, anchor: PyTree, like: PyTree) -> PyTree:
        """The n copies of ``anchor`` placed like the nodes' params (on the mesh's node axis)."""
        if self.trainer.mesh is None:
            return self.trainer_broadcast(anchor)
        if self._broadcast_jit is None:
            sh = _placed(self.trainer.shardings(like)).params
            self._broadcast_jit = jax.jit(self.trainer_broadcast, out_shardings=sh)
        return self._broadcast_jit(anchor)

    def _broadcast_rows(self, anchor: PyTree, like: PyTree) -> PyTree:
        """As many copies of ``anchor`` as ``like`` has rows, placed like it (a sampled chunk)."""
        rows = int(jax.tree.leaves(like)[0].shape[0])
        if self.trainer.mesh is None:
            return self.trainer_broadcast(anchor, rows)
        if self._chunk_broadcast_jit is None:
            sh = _placed(self.trainer.shardings(like)).params
            self._chunk_broadcast_jit = jax.jit(
                functools.partial(self.trainer_broadcast, n=rows), out_shardings=sh
            )
        return self._chunk_broadcast_jit(anchor)

    def _train(
        self, state: TrainState, anchor: PyTree, rows: np.ndarray | None = None
    ) -> tuple[TrainState, np.ndarray, list[PyTree]]:
        """Train ``state``'s nodes (all n, or, under sampling, the nodes ``rows`` of the chunk)."""
        # Every node restarts from the consensus; its optimizer state and key stream carry over.
        pick: slice | np.ndarray
        hp: Mapping[str, Any] | None
        level: np.ndarray | None
        active: np.ndarray | None
        if rows is None:
            state = state._replace(params=self._broadcast_placed(anchor, state.params))
            pick = slice(None)
        else:
            state = state._replace(params=self._broadcast_rows(anchor, state.params))
            pick = rows
        if self._plan is not None:
            data, hp = self._plan.data, self._plan.hyperparams
            level, active = np.asarray(self._plan.schedule.level), np.asarray(self._plan.schedule.active)
            if rows is not None:
                data = tuple(_data_rows(d, rows) for d in data)
                hp = {k: np.asarray(v)[rows] for k, v in hp.items()}
                level, active = level[rows], active[rows]
        else:
            if rows is None:
                data = self.data.own()
            else:
                if self._own_data is None:
                    self._own_data = self.data.own()
                data = _data_rows(self._own_data, rows)
            hp = None
            level = active = None
        prox = None
        if self._proximal is not None:
            mu, radius, tangent = self._proximal
            prox = Proximal(anchor, mu[pick], radius[pick], tangent[pick])
        poisoned = self.byzantine.poisoned[pick]
        snapshots, losses = [], []
        for seg in self._segments:
            schedule = None if level is None or active is None else Schedule(level[:, seg], active[:, seg])
            state, log = self.trainer.fit(
                state,
                data,
                len(seg),
                schedule=schedule,
                hyperparams=hp,
                poisoned=poisoned if poisoned.any() else None,
                data_attack=self.byzantine.data_attack,
                proximal=prox,
                dp=self.example_dp,
            )
            losses.append(mesh_lib.to_host(log.loss))
            if self.snapshot_nodes.size:
                snapshots.append(state.params)
        loss = np.concatenate(losses, 0).mean(0)
        return state, loss, snapshots

    def _soups(self, stacked: PyTree, snapshots: list[PyTree], rows: np.ndarray | None = None) -> PyTree:
        """Each node that took snapshots submits what its strategy's submit hook makes of them.

        A node scores trees on its own held-out split when its settings keep one (and it holds
        rows there), else on the coordinator's held-out split. ``rows``: the nodes of the
        stacked rows (a sampled chunk); None: row i is node i.
        """
        local = self.snapshot_nodes if rows is None else np.flatnonzero(np.isin(rows, self.snapshot_nodes))
        if not local.size:
            return stacked
        held = self.data.heldout
        shared_scores: np.ndarray | None = None
        out = stacked
        log: dict[int, dict[str, Any]] = {}
        for i in local:
            node = int(i) if rows is None else int(rows[i])
            ingredients = [jax.tree.map(functools.partial(_row, i=int(i)), s) for s in snapshots]
            final = jax.tree.map(functools.partial(_row, i=int(i)), stacked)
            own = self._own_batches.get(node)
            split = "own" if own is not None else "shared"
            batch: Mapping[str, Any] = held if own is None else own

            def evaluate(p: PyTree, batch: Any = batch) -> dict[str, float]:
                return {k: float(v) for k, v in mesh_lib.to_host(self._metrics(p, batch)).items()}

            if split == "shared":
                if shared_scores is None:
                    # One batched evaluation of every snapshot of every node on the shared split.
                    shared_scores = np.stack(
                        [
                            np.stack([self.trainer.evaluate(s, held)[m] for m in ("accuracy", "loss")], -1)
                            for s in snapshots
                        ],
                        0,
                    )
                scores = [{"accuracy": float(a), "loss": float(b)} for a, b in shared_scores[:, i]]
            else:
                scores = [evaluate(s) for s in ingredients]
            submitted = self.strategies[node].submit(final, ingredients, evaluate, scores=scores)
            log[node] = {"split": split, "latest": scores[-1], "soup": evaluate(submitted)}
            out = jax.tree.map(lambda x, s, i=int(i): x.at[i].set(s.astype(x.dtype)), out, submitted)
        self.soup_log.append(log)
        return out

    # ------------------------------------------------------------------ evaluation

    def evaluate_nodes(self, stacked: PyTree, split: str = "test") -> dict[str, np.ndarray]:
        """Per-node metrics on the shared test (or held-out) set: ``{name: (n,)}``.

        Args:
          stacked: the nodes' params, stacked on a leading axis.
          split: "test" or "heldout".

        Returns:
          Each metric as an array with one value per node.
        """
        return self.trainer.evaluate(stacked, getattr(self.data, split))

    def evaluate(self, params: PyTree, split: str = "test") -> dict[str, float]:
        """Metrics of one params tree on the test (or held-out) set.

        Args:
          params: the parameter tree.
          split: "test" or "heldout".

        Returns:
          The task's metrics by name.
        """
        out = mesh_lib.to_host(self._metrics(params, getattr(self.data, split)))
        return {k: float(v) for k, v in out.items()}


def _own_heldout_batches(data: TaskData, process_count: int) -> dict[int, dict[str, np.ndarray]]:
    """Every node's own held-out rows (its valid ones), keyed by global node id.

    In a ``jax.distributed`` run a process holds only its nodes' shards, but every process
    runs the same program for every soup node's scoring (a node's snapshots are rows of
    arrays sharded across processes), so each needs the same batch: the hosts' rows are
    gathered across processes (padded to common shapes first). One process: its own rows.
    """
    local = {
        int(g): batch for i, g in enumerate(data.node_ids) if (batch := data.own_heldout_batch(i)) is not None
    }
    if process_count == 1:
        return local
    from jax.experimental import multihost_utils

    ids = np.asarray(data.node_ids, np.int32)
    arrays = {k: np.asarray(v) for k, v in (data.own_heldout or {}).items()}
    counts = np.asarray(data.own_heldout_count, np.int32)
    rows = max((a.shape[1] for a in arrays.values()), default=0)
    # Process-local block sizes may differ: agree on the largest, pad to it, then gather.
    size = np.asarray(multihost_utils.process_allgather(np.asarray([len(ids), rows], np.int32)))
    n_max, rows_max = (int(x) for x in size.max(axis=0))

    def pad(a: np.ndarray, fill: Any) -> np.ndarray:
        widths = [(0, n_max - a.shape[0])] + ([(0, rows_max - a.shape[1])] if a.ndim > 1 else [])
        return np.pad(a, widths + [(0, 0)] * (a.ndim - len(widths)), constant_values=fill)

    gathered = multihost_utils.process_allgather(
        {"ids": pad(ids, -1), "counts": pad(counts, 0), "rows": {k: pad(v, 0) for k, v in arrays.items()}}
    )
    # (processes, n_max, ...) -> one row per hosted node of any process
    every = jax.tree.map(lambda v: np.asarray(v).reshape(-1, *np.shape(v)[2:]), gathered)
    out: dict[int, dict[str, np.ndarray]] = {}
    for j, g in enumerate(every["ids"]):
        c = int(every["counts"][j])
        if g >= 0 and c > 0:
            # The gathered arrays come back in jax's dtypes; the batch keeps the host's.
            out[int(g)] = {k: every["rows"][k][j, :c].astype(arrays[k].dtype) for k in arrays}
    return out


def _placed(shardings: TrainState | None) -> TrainState:
    """The shardings of a trainer that has a mesh (its callers checked that it has one)."""
    assert shardings is not None
    return shardings


@functools.lru_cache(maxsize=16)
def _trainer(
    task: Task,
    learning_rate: float,
    batch_size: int,
    mesh: tuple[int, int, int] | None,
    optimizer: str = "adam",
) -> NodeTrainer:
    # Trainers are immutable and carry their compiled steps: runs of the same task and
    # optimizer settings (tests, benchmark sweeps, notebooks) share them instead of recompiling.
    mesh_cfg = None if mesh is None else mesh_lib.MeshConfig(node=mesh[0], data=mesh[1], model=mesh[2])
    make = {"adam": optax.adam, "sgd": optax.sgd}[optimizer]
    return NodeTrainer(task, make, {"learning_rate": learning_rate}, batch_size=batch_size, mesh=mesh_cfg)


@functools.lru_cache(maxsize=16)
def _metrics(task: Task):
    return jax.jit(task.metrics)


def _row(x: jax.Array, i: int) -> jax.Array:
    return x[i]


def _to_host(state: TrainState) -> TrainState:
    """A TrainState as numpy arrays on the host (typed keys as their raw uint32 data)."""
    key = state.key
    if isinstance(key, jax.Array) and jnp.issubdtype(key.dtype, jax.dtypes.prng_key):
        key = jax.random.key_data(key)
    return jax.tree.map(lambda x: np.asarray(mesh_lib.to_host(x)), state._replace(key=key))


def _scatter_rows(host: TrainState, parts: list[TrainState], ids: np.ndarray) -> TrainState:
    """A copy of ``host`` with the trained rows of the sample's real slots written back."""
    real = ids >= 0

    def write(old, *chunks):
        new = np.array(old, copy=True)
        new[ids[real]] = np.concatenate(chunks, 0)[real]
        return new

    return jax.tree.map(write, host, *parts)


def _data_rows(data: NodeData, rows: np.ndarray) -> NodeData:
    """The NodeData of the nodes ``rows`` (a shared pool stays whole; per-node pools are gathered)."""
    pool = data.pool if data.shared else {k: np.asarray(v)[rows] for k, v in data.pool.items()}
    return dataclasses.replace(
        data, pool=pool, index=np.asarray(data.index)[rows], count=np.asarray(data.count)[rows]
    )
