"""One node of this package as a Flower client: receive the consensus, train with its strategy, reply.

:class:`FlowerNode` is the node side of :class:`meta_consensus.fleet.Fleet` for one node of
a config: it loads only its own shard (``task.splits(n, process_index=i, process_count=n)``,
the multi-host path of the tasks), trains with its configured strategy (local,
hierarchical, convexity, soup, or any registered one) in the same jitted trainer as the
in-process fleet, and submits what its strategy's submit hook makes of the round.
Everything that is a function of the whole config is computed from the whole config, so
node i's training is the one it does in the in-process run:

* its init key is ``split(k_nodes, n)[i]`` with ``k_params, k_nodes = split(key(seed))``
  (:meth:`strategies.trainer.NodeTrainer.init`), its training stream ``fold_in(that, 1)``;
* a hierarchical schedule is planned for all n nodes (its length is the longest node's)
  and row i is kept; the proximal step runs when any node of the config uses it (mu = 0
  and radius = inf leave the others' parameters unchanged, as in the fleet).

Between rounds the node keeps its optimizer state, key stream and step count in Flower's
``context.state`` (a RecordDict the SuperNode keeps for the run), under the key
``"meta-consensus.node"``: nothing else survives between two calls of a ClientApp.

LoRA runs (``[nodes.lora]``, :mod:`meta_consensus.lora`): the messages carry the adapter's
trainable arrays only, down and up, and, in the round after a merge method produced one, the
dense base delta (``"base_delta"``, with the config's ``base-version``). Each node builds the
shared base itself, once, from the config (the task's init from the seed or ``init_from``, then
``nodes.lora.pretrain_steps`` on the general pool), keeps it in its process, applies every base
delta once, and checks the server's SHA-256 of the base (``base-digest``) before it trains: a node
whose base differs is an error reply, never a silent drift. A SuperNode restarted mid-run rebuilds
the first base and cannot follow later deltas: its answers are then missing.

Not supported on this path (refused with a clear error): example-level DP-SGD, configured
Byzantine nodes (the package's model attacks are omniscient, they read every node's
candidate) and simulated faults (on Flower, faults are real: a node that dies is a
missing answer at the strategy). ``baseline_fedavg`` (a second, plain-FedAvg fleet trained
alongside for comparison) is ignored on Flower.
"""

from __future__ import annotations

import functools
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flwr.app import ArrayRecord, ConfigRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp

from consensus.mesh import to_host
from meta_consensus import config as config_lib
from meta_consensus import lora as lora_run
from meta_consensus.config import Config, ConfigError
from meta_consensus.fleet import _trainer, make_task
from meta_consensus.flower.arrays import from_array_record, to_array_record
from strategies.hierarchical import Level, plan
from strategies.lora import add_base_delta, matrix_shape
from strategies.node import LEVELS
from strategies.registry import check_task
from strategies.tasks.base import NodeData, Task
from strategies.trainer import Proximal, Schedule, TrainState

PyTree = Any

CONFIG_KEY = "meta-consensus.config"  # the run's config (TOML text) in the train message's ConfigRecord
ROUND_KEY = "server-round"  # Flower's own key for the round in the ConfigRecord
STATE_KEY = "meta-consensus.node"  # the node's TrainState (params aside) in context.state
PARTITION_KEY = "partition-id"  # node_config key (Flower's convention) and reply metric
BASE_VERSION_KEY = "base-version"  # LoRA: how many base deltas the server has applied
BASE_DIGEST_KEY = "base-digest"  # LoRA: SHA-256 of the server's frozen part (meta_consensus.lora.base_digest)
BASE_DELTA = "base_delta"  # LoRA: the RecordDict key of the last merge's dense base delta
EXAMPLES_KEY = "num-examples"  # Flower's weight key for metric aggregation


def check_flower_config(cfg: Config) -> Config:
    """Refuse the settings the Flower path does not carry (see the module docstring).

    Args:
      cfg: the run config.

    Returns:
      ``cfg`` itself, when Flower can run it.

    Raises:
      ConfigError: example-level DP, Byzantine nodes, simulated faults, a mesh, client sampling,
        or a vote rule whose server step needs what only the in-process coordinator provides.
    """
    from meta_consensus import example_level_dp

    if example_level_dp.is_example_level(cfg):
        raise ConfigError("dp.level = 'example' (DP-SGD in the nodes) is not supported on Flower yet")
    if cfg.byzantine.nodes:
        raise ConfigError(
            "byzantine.nodes is not supported on Flower: the package's model attacks read every node's "
            "candidate; on Flower an attacker is a real client (see docs/flower.md)"
        )
    f = cfg.faults
    if f.drop_rate > 0 or f.crash_nodes or f.timeout_s is not None:
        raise ConfigError(
            "faults.* (simulated faults) are not used on Flower: faults are real there; "
            "set the strategy's round timeout instead"
        )
    if cfg.mesh.enabled:
        raise ConfigError("mesh.* is not supported on Flower: each node is one process")
    if cfg.nodes.sampled:
        raise ConfigError(
            "nodes.sampling is not supported on Flower yet: the in-process coordinator samples the "
            "clients (meta_consensus.sampling); on Flower use full participation"
        )
    from meta_consensus.server import vote_needs

    # The strategy computes the server step's update itself; what the vote's rules read from the
    # round (the coordinator's update, a key, the nodes' statistics) it does not provide yet.
    needs = sorted(vote_needs(cfg))
    if needs:  # the in-process coordinator provides them (meta_consensus.server)
        raise ConfigError(f"vote.rule = {cfg.vote.rule!r} needs {needs}, not provided on Flower yet")
    if cfg.vote.server_step > 0 and cfg.nodes.batch_size == "auto":
        raise ConfigError(
            "nodes.batch_size = 'auto' with vote.server_step on Flower: the server's root-set steps need "
            "an integer batch size (each node resolves 'auto' on its own device)"
        )
    if cfg.nodes.public_warm_start > 0 and cfg.nodes.batch_size == "auto":
        raise ConfigError(
            "nodes.batch_size = 'auto' with nodes.public_warm_start on Flower: the server's warm-start "
            "steps need an integer batch size (each node resolves 'auto' on its own device)"
        )
    return cfg


class FlowerNode:
    """Node ``index`` of a config: its shard, its strategy, its training (see the module docstring).

    Args:
      cfg: the run config (the one the server sends with every train message).
      index: the node's partition id, in ``[0, nodes.count)``.
      task: a Task object instead of the one the config names (it must be the server's task).

    Raises:
      ConfigError: a setting the Flower path does not carry (:func:`check_flower_config`).
      ValueError: ``index`` out of range, or nodes whose strategies take different numbers of
        snapshots.
    """

    def __init__(self, cfg: Config, index: int, *, task: Task | None = None):
        self.cfg = check_flower_config(cfg)
        n = cfg.nodes.count
        if not (isinstance(index, int | np.integer) and 0 <= index < n):
            raise ValueError(f"partition-id must be an int in [0, {n}), got {index!r}")
        self.index = int(index)
        self.task = make_task(cfg) if task is None else check_task(task, "the task object")
        # LoRA runs: the node trains adapters; the frozen base is built once and kept here.
        self.lora: lora_run.LoraRound | None = None
        self.frozen: PyTree | None = None
        self.base_version = 0
        if cfg.nodes.lora is not None:
            self.base_task = self.task
            self.lora = lora_run.LoraRound(cfg, lora_run.wrap_task(cfg, self.task))
            self.task = self.lora.task  # type: ignore[assignment]  # a LoraTask is a Task
        self.data = self.task.splits(
            n, seed=cfg.task.data_seed, alpha=cfg.task.alpha, process_index=self.index, process_count=n
        )
        self.trainer: Any = _trainer(
            self.task,  # type: ignore[arg-type]  # tasks are hashable; the Task protocol does not say so
            cfg.nodes.learning_rate,
            cfg.nodes.batch_size,
            None,
        )
        if self.lora is not None:
            self.trainer = lora_run.FrozenTrainer(self.trainer, self)
        strategies = cfg.nodes.build_strategies()
        self.strategy = strategies[self.index]
        settings = [s.settings(cfg.nodes.local_steps, cfg.nodes.learning_rate) for s in strategies]
        self.settings = settings[self.index]
        if self.settings.own_heldout > 0:
            # The same rows the in-process fleet holds out for this node (drawn from its id).
            own_heldout = np.asarray([st.own_heldout for st in settings], np.float64)
            self.data = self.data.hold_out_own(own_heldout[self.data.node_ids], cfg.task.data_seed)
        row = slice(self.index, self.index + 1)
        level_steps = np.asarray([st.level_steps for st in settings], np.int64)
        self._levels: tuple[tuple[NodeData, ...], np.ndarray, np.ndarray] | None
        self._hp: dict[str, np.ndarray] | None
        if level_steps[:, :2].any():
            # The whole config's plan (its length is the longest node's), then this node's row.
            level_lr = np.asarray([st.level_lr for st in settings], np.float32)
            levels = [Level(name, level_steps[:, j], level_lr[:, j]) for j, name in enumerate(LEVELS)]
            p = plan(levels, self.data)
            self._levels = (p.data, np.asarray(p.schedule.level)[row], np.asarray(p.schedule.active)[row])
            self._hp = {k: np.asarray(v)[row] for k, v in p.hyperparams.items()}
        else:
            self._levels, self._hp = None, None
        mu = np.asarray([st.proximal_mu for st in settings], np.float32)
        radius = np.asarray([st.proximal_radius for st in settings], np.float32)
        tangent = np.asarray([st.tangent for st in settings], bool)
        needed = (mu > 0).any() or np.isfinite(radius).any() or tangent.any()
        self._proximal = (mu[row], radius[row], tangent[row]) if needed else None
        snaps = {st.snapshots for st in settings if st.snapshots}
        if len(snaps) > 1:
            raise ValueError(f"nodes take different numbers of snapshots {sorted(snaps)}; use one number")
        self._segments = np.array_split(np.arange(cfg.nodes.local_steps), snaps.pop() if snaps else 1)
        self._metrics: Any = jax.jit(self.task.metrics)
        if self.lora is not None:
            lora_metrics = lora_run.lora_metrics(self.lora.task)
            self._metrics = lambda p, batch: lora_metrics(p, batch, self.frozen)
        self.template = jax.eval_shape(self.task.init, jax.random.key(0))

    @property
    def num_examples(self) -> int:
        """The rows of this node's training shard (Flower's weight for its metrics)."""
        return int(self.data.train_count[0])

    # ------------------------------------------------------------------ LoRA base

    def sync_base(self, msg: Message) -> None:
        """LoRA runs: build the base once, apply the message's base delta, check the server's digest.

        Args:
          msg: the server's message (its config carries the base version and digest).

        Raises:
          ValueError: a base delta this node cannot place (a version it skipped) or a base whose
            digest differs from the server's (the reply is then an error: a missing answer).
        """
        if self.lora is None:
            return
        cfg_record: ConfigRecord = msg.content["config"]  # type: ignore[assignment]
        if self.frozen is None:
            k_params, _ = jax.random.split(jax.random.key(self.cfg.seed))
            base = self.base_task.init(k_params)
            if self.cfg.init_from is not None:
                from meta_consensus.run import load_initial_params

                base = load_initial_params(self.cfg.init_from, base)
            base = self.lora.pretrain(self.data, base, k_params)
            _, self.frozen = self.lora.start(base, k_params)
        version = int(cfg_record.get(BASE_VERSION_KEY, 0))  # type: ignore[arg-type]
        if version == self.base_version + 1 and BASE_DELTA in msg.content:
            got = msg.content[BASE_DELTA]
            like = {
                p: jax.ShapeDtypeStruct(matrix_shape(shape), np.float32)
                for p, shape in self.lora.task.targets.items()
                if p in set(got.keys())
            }
            delta = from_array_record(got, like, "the base delta")
            self.frozen = {"base": add_base_delta(self.frozen["base"], delta), "a": self.frozen["a"]}
            self.base_version = version
        if version != self.base_version:
            raise ValueError(
                f"base version {version} from the server, this node holds version {self.base_version}: "
                "it missed a base delta (a restarted SuperNode cannot follow a run whose base changed)"
            )
        digest = str(cfg_record.get(BASE_DIGEST_KEY, ""))
        if digest and digest != lora_run.base_digest(self.frozen):
            raise ValueError("this node's base differs from the server's (base-digest mismatch)")

    # ------------------------------------------------------------------ state

    def init_state(self, params: PyTree) -> TrainState:
        """This node's row of the fleet's initial state (see the module docstring).

        Args:
          params: the consensus the node starts from.

        Returns:
          The state with a leading node axis of one.
        """
        _, k_nodes = jax.random.split(jax.random.key(self.cfg.seed))
        state = self.trainer.init(k_nodes, params, 1)
        # NodeTrainer.init(k, ., 1) draws split(k, 1)[0]; node i of n draws split(k, n)[i].
        node_key = jax.random.split(k_nodes, self.cfg.nodes.count)[self.index]
        return state._replace(key=jax.random.fold_in(node_key, 1)[None])

    def state_to_record(self, state: TrainState) -> ArrayRecord:
        """The state less its params (they restart from the consensus) as an ArrayRecord.

        Args:
          state: the node's state after a round.

        Returns:
          The optimizer state, raw key data and step count as one ArrayRecord.
        """
        return to_array_record(
            {"opt_state": state.opt_state, "key": jax.random.key_data(state.key), "step": state.step}
        )

    def state_from_record(self, record: ArrayRecord, anchor: PyTree) -> TrainState:
        """The state saved by :meth:`state_to_record`, with ``anchor``'s structure for the params.

        Args:
          record: the ArrayRecord kept in Flower's ``context.state``.
          anchor: the round's consensus (the params restart from it).

        Returns:
          The state with a leading node axis of one, as :meth:`init_state` gives it.

        Raises:
          ArrayRecordMismatch: a record that does not match this node's optimizer state.
        """
        like = self.init_state(anchor)
        template = {"opt_state": like.opt_state, "key": jax.random.key_data(like.key), "step": like.step}
        got = from_array_record(record, template, "the node's saved state")
        impl = jax.random.key_impl(like.key)
        return TrainState(
            like.params,
            jax.tree.map(jnp.asarray, got["opt_state"]),
            jax.random.wrap_key_data(jnp.asarray(got["key"]), impl=impl),
            jnp.asarray(got["step"]),
        )

    # ------------------------------------------------------------------ the round

    def fit(self, state: TrainState, anchor: PyTree) -> tuple[TrainState, PyTree, float]:
        """One round from the consensus ``anchor``: (new state, the candidate, mean training loss).

        Args:
          state: the node's state from the last round (or :meth:`init_state`).
          anchor: the round's consensus; training starts from it.

        Returns:
          The new state, the candidate (what the strategy's submit hook makes of the round, in
          ``anchor``'s dtypes) and the mean training loss over the round's steps.
        """
        anchor = jax.tree.map(jnp.asarray, anchor)
        state = state._replace(params=jax.tree.map(lambda p: p[None], anchor))
        data: NodeData | tuple[NodeData, ...]
        level: np.ndarray | None
        active: np.ndarray | None
        if self._levels is not None:
            data, level, active = self._levels
        else:
            data, level, active = self.data.own(), None, None
        prox = None if self._proximal is None else Proximal(anchor, *self._proximal)
        snapshots, losses = [], []
        for seg in self._segments:
            # level and active are both set (the curriculum) or both None
            schedule = None if level is None or active is None else Schedule(level[:, seg], active[:, seg])
            state, log = self.trainer.fit(
                state, data, len(seg), schedule=schedule, hyperparams=self._hp, proximal=prox
            )
            losses.append(to_host(log.loss))
            if self.settings.snapshots:
                snapshots.append(state.params)
        loss = float(np.concatenate(losses, 0).mean(0)[0])
        final = jax.tree.map(lambda x: x[0], state.params)
        if self.settings.snapshots:
            own = self.data.own_heldout_batch(0)
            held = self.data.heldout if own is None else own

            def evaluate(p: PyTree) -> dict[str, float]:
                return {k: float(v) for k, v in to_host(self._metrics(p, held)).items()}

            ingredients = [jax.tree.map(lambda x: x[0], s) for s in snapshots]
            scores = [evaluate(s) for s in ingredients]
            final = self.strategy.submit(final, ingredients, evaluate, scores=scores)
        final = jax.tree.map(lambda c, a: jnp.asarray(c).astype(a.dtype), final, anchor)
        return state, jax.block_until_ready(final), loss

    def evaluate(self, params: PyTree) -> dict[str, float]:
        """The consensus's metrics on this node's own shard (its valid rows).

        Args:
          params: the consensus.

        Returns:
          The task's metrics by name.
        """
        k = self.num_examples
        batch = {name: np.asarray(v[0, :k]) for name, v in self.data.train.items()}
        return {m: float(v) for m, v in to_host(self._metrics(params, batch)).items()}


# ---------------------------------------------------------------------- the ClientApp


@functools.lru_cache(maxsize=16)
def parse_config(text: str) -> Config:
    """The config the server sent (TOML text), validated.

    Args:
      text: the config as TOML text.

    Returns:
      The config.

    Raises:
      ConfigError: an invalid config, or one Flower does not carry.
    """
    import tomllib

    return check_flower_config(config_lib.from_dict(tomllib.loads(text)))


def _node_view(cfg: Config) -> str:
    """What a node's training depends on (seed, task, nodes): configs that differ elsewhere share nodes."""
    import tomli_w

    d = config_lib.to_dict(cfg)
    return tomli_w.dumps({k: d[k] for k in ("seed", "task", "nodes")})


_NODES: dict[tuple[str, int, Any], FlowerNode] = {}


def node_for(cfg: Config, index: int, task: Task | None = None) -> FlowerNode:
    """Node ``index`` of ``cfg``, built once per process (the in-process grid, ``--isolation process``).

    Nodes are cached by what their training depends on (seed, task, nodes), at most 256.

    Args:
      cfg: the run config.
      index: the node's partition id.
      task: a Task object instead of the one the config names.

    Returns:
      The node.
    """
    key = (_node_view(cfg), int(index), task)
    if key not in _NODES:
        if len(_NODES) >= 256:
            _NODES.pop(next(iter(_NODES)))
        _NODES[key] = FlowerNode(cfg, index, task=task)
    return _NODES[key]


def _partition(context: Context) -> int:
    """The node config's ``partition-id`` (a ConfigError names the flag when it is missing)."""
    value = context.node_config.get(PARTITION_KEY)
    if value is None:
        raise ConfigError(
            f"this SuperNode has no {PARTITION_KEY!r} in its node config: start it with "
            f'--node-config "{PARTITION_KEY}=<i> num-partitions=<n>"'
        )
    return int(value)


def _node_of(msg: Message, context: Context, task: Task | None) -> tuple[FlowerNode, int]:
    # flwr types a RecordDict value as any record and a ConfigRecord value as any config value;
    # the strategy sends "config" as a ConfigRecord whose ROUND_KEY is an int.
    cfg_record: ConfigRecord = msg.content["config"]  # type: ignore[assignment]
    cfg = parse_config(str(cfg_record[CONFIG_KEY]))
    return node_for(cfg, _partition(context), task), int(cfg_record[ROUND_KEY])  # type: ignore[arg-type]


def train_reply(msg: Message, context: Context, task: Task | None = None) -> Message:
    """Train this node for one round from the consensus in ``msg``; reply with its candidate.

    Args:
      msg: the strategy's train message (the consensus, the round, the config text).
      context: the SuperNode's context: ``partition-id`` in its node config, the node's state
        across rounds in ``context.state``.
      task: a Task object instead of the one the config names.

    Returns:
      The reply: the candidate as an ArrayRecord, and the partition, round, example count and
      training loss as metrics.

    Raises:
      ConfigError: a node config without ``partition-id``, or a config Flower does not carry.
      ValueError: a LoRA base that differs from the server's.
      ArrayRecordMismatch: a consensus that does not match the task's parameters.
    """
    node, server_round = _node_of(msg, context, task)
    node.sync_base(msg)
    anchor = from_array_record(msg.content["arrays"], node.template, "the broadcast consensus")
    saved = context.state.array_records.get(STATE_KEY) if STATE_KEY in context.state else None
    state = node.init_state(anchor) if saved is None else node.state_from_record(saved, anchor)
    state, candidate, loss = node.fit(state, anchor)
    context.state[STATE_KEY] = node.state_to_record(state)
    metrics = MetricRecord(
        {
            PARTITION_KEY: node.index,
            ROUND_KEY: server_round,
            EXAMPLES_KEY: node.num_examples,
            "train_loss": loss if math.isfinite(loss) else float("nan"),
        }
    )
    return Message(RecordDict({"arrays": to_array_record(candidate), "metrics": metrics}), reply_to=msg)


def evaluate_reply(msg: Message, context: Context, task: Task | None = None) -> Message:
    """Evaluate the consensus in ``msg`` on this node's own shard.

    Args:
      msg: the strategy's evaluate message.
      context: the SuperNode's context (``partition-id`` in its node config).
      task: a Task object instead of the one the config names.

    Returns:
      The reply: the task's metrics as ``eval_<name>``, with the partition, round and example count.

    Raises:
      ConfigError: a node config without ``partition-id``, or a config Flower does not carry.
      ArrayRecordMismatch: a consensus that does not match the task's parameters.
    """
    node, server_round = _node_of(msg, context, task)
    node.sync_base(msg)
    params = from_array_record(msg.content["arrays"], node.template, "the broadcast consensus")
    out = node.evaluate(params)
    metrics = MetricRecord(
        {
            PARTITION_KEY: node.index,
            ROUND_KEY: server_round,
            EXAMPLES_KEY: node.num_examples,
            **{f"eval_{k}": v for k, v in out.items()},
        }
    )
    return Message(RecordDict({"metrics": metrics}), reply_to=msg)


def query_reply(msg: Message, context: Context) -> Message:
    """Reply with the partition this SuperNode serves (its node config's ``partition-id``).

    The strategy asks once per Flower node id, so that a node that never answers is still filed
    under its partition.

    Args:
      msg: the strategy's query message.
      context: the SuperNode's context.

    Returns:
      The reply, with ``partition-id`` as its only metric.

    Raises:
      ConfigError: a node config without ``partition-id``.
    """
    return Message(RecordDict({"metrics": MetricRecord({PARTITION_KEY: _partition(context)})}), reply_to=msg)


def make_client_app(task: Task | None = None) -> ClientApp:
    """A Flower ClientApp running node ``partition-id`` (its SuperNode's node config) of the server's config.

    Args:
      task: a Task object instead of the one the config names (it must be the server's task).

    Returns:
      The ClientApp, answering train, evaluate and query messages.
    """
    app = ClientApp()

    @app.train()
    def train(msg: Message, context: Context) -> Message:
        return train_reply(msg, context, task)

    @app.evaluate()
    def evaluate(msg: Message, context: Context) -> Message:
        return evaluate_reply(msg, context, task)

    @app.query()
    def query(msg: Message, context: Context) -> Message:
        return query_reply(msg, context)

    return app
