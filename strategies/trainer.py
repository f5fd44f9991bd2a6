"""Node trainer: n copies of a task's model trained by one jitted, vmapped step.

The n nodes' params, optimizer states, PRNG keys and step counters are stacked
on a leading node axis (:class:`TrainState`). One call to :meth:`NodeTrainer.fit`
runs ``steps`` steps of ``jit(scan(vmap(node_step)))``: every node samples its
own minibatch from its own data with its own key (the gather happens on
device), takes a gradient of the task's loss and an optax step with its own
hyperparameters. On a mesh the node axis lies on the mesh's "node" axis and
the model dimensions follow the task's logical axis names (tensor parallel
over "model", FSDP over "data"); XLA partitions the same program, so a
sharded run gives the unsharded run's params up to float32 rounding.

Per-node hyperparameters are plain (n,) arrays passed to an optimizer
*factory* (``optax.adam``, ``optax.sgd``, ...) inside the vmapped step, so one
compiled step serves every node and any learning rate; a (n, L) array gives
one value per hierarchical level. Options, all per node and all in the same
step (so honest, Byzantine, proximal and hierarchical nodes train together):

* ``schedule``: which data level each node draws from at each step, and
  whether it trains at all (:mod:`strategies.hierarchical` builds these);
* ``poisoned`` and ``data_attack``: Byzantine nodes that train on batches a data attack
  rewrote (``flip_labels``: the task's label flipping);
* ``proximal``: proximal pull towards an anchor, ``mu/2 ||theta - a||^2``,
  and projection onto the L2 ball of radius r around it after each update
  (the convexity strategy, :mod:`strategies.convexity`);
* ``dp``: example-level DP-SGD (:mod:`strategies.dpsgd`): Poisson-sampled padded
  batches, per-example gradients clipped to C, Gaussian noise of std z C, divided by
  the expected batch size, then the node's optimizer.

Mixed precision (``compute_dtype=jnp.bfloat16``) keeps float32 params and
optimizer state and computes the loss on bfloat16 copies; gradient
accumulation wraps the optimizer in ``optax.MultiSteps`` (one update every
``grad_accum`` micro-steps); ``remat`` recomputes the loss's activations in
the backward pass instead of storing them.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from consensus import mesh as mesh_lib
from strategies import dpsgd
from strategies.convexity import project_l2_ball, proximal_step
from strategies.tangent import TangentTask, check_linearizable
from strategies.tasks.base import Batch, NodeData, PyTree, Task, cast_floating, count_host

OptimizerFactory = Callable[..., optax.GradientTransformation]


class TrainState(NamedTuple):
    """Stacked state of n nodes.

    Attributes:
      params: stacked params, leaves (n, ...) float32.
      opt_state: stacked optimizer state.
      key: (n,) PRNG keys, one per node, fixed: the node's s-th step draws
        with ``fold_in(key, s)``.
      step: (n,) int32 number of steps each node has trained (micro-steps
        with gradient accumulation; steps where a node sat idle do not count).
    """

    params: PyTree
    opt_state: PyTree
    key: jax.Array
    step: jax.Array


class Proximal(NamedTuple):
    """Per-node convexity options, applied after every optimizer update.

    Attributes:
      anchor: single (unstacked) tree, usually the last consensus.
      mu: (n,) proximal strength; 0 disables the proximal step for a node.
      radius: (n,) radius of the L2 ball around the anchor; ``inf`` disables
        the projection for a node.
      tangent: (n,) bool, nodes that train the task's first-order expansion at the anchor
        (:mod:`strategies.tangent`) instead of the task's model; None: no node. The task must
        declare ``linearizable = True``. With every node tangent only the expansion is
        compiled; a fleet that mixes both computes both losses for every node and keeps one.
    """

    anchor: PyTree
    mu: jax.Array | np.ndarray
    radius: jax.Array | np.ndarray
    tangent: jax.Array | np.ndarray | None = None


# Which nodes of a fit train the tangent expansion (a static option: one compile per mode).
TANGENT_NONE, TANGENT_ALL, TANGENT_MIXED = 0, 1, 2


def _check_tangent(task: Task, anchor: PyTree, params: PyTree, dp: Any, frozen: PyTree | None) -> None:
    """Refuse tangent nodes the trainer cannot run.

    A task that cannot be linearised, an anchor unlike a node's params, DP-SGD, LoRA. Cheap
    (no trace of the task's init, unlike ``linearize``): every fit call of a round checks it.
    """
    if dp is not None:
        raise ValueError("proximal.tangent does not combine with example-level DP-SGD (dp)")
    if frozen is not None:
        raise ValueError(
            "proximal.tangent does not combine with a frozen base (LoRA): linearise the base task"
        )
    check_linearizable(task, "proximal.tangent")
    same = jax.tree.structure(anchor) == jax.tree.structure(params)  # type: ignore[operator]
    if not same or [np.shape(a) for a in jax.tree.leaves(anchor)] != [
        tuple(p.shape[1:]) for p in jax.tree.leaves(params)
    ]:
        raise ValueError(
            "proximal.anchor: the tangent nodes' expansion point must be one tree like a node's params"
        )


class Schedule(NamedTuple):
    """Which data level each node uses at each step, and whether it trains.

    Attributes:
      level: (n, steps) int32 index into the ``data`` sequence passed to fit.
      active: (n, steps) bool; an inactive node keeps its params, optimizer
        state and step count for that step.
    """

    level: Any
    active: Any


class FitLog(NamedTuple):
    """What one fit call reports, per step and node.

    Attributes:
      loss: (steps, n) float32 training loss of each node's minibatch (before
        its update).
      level: (steps, n) int32 data level used.
      rows: (steps, n, batch) int32 pool rows drawn, or None unless
        ``record=True``.
    """

    loss: jax.Array
    level: jax.Array
    rows: jax.Array | None


def _standard_promotion(tx: optax.GradientTransformation) -> optax.GradientTransformation:
    """Run an optax transform's init/update under standard dtype promotion.

    optax mixes Python floats and int32 step counts (``b1 ** count`` in Adam's
    bias correction), which ``jax_numpy_dtype_promotion="strict"`` rejects;
    the results are float32 either way, so the trainer's own code stays strict.
    """

    def init(params):
        with jax.numpy_dtype_promotion("standard"):
            return tx.init(params)

    def update(updates, state, params=None):
        with jax.numpy_dtype_promotion("standard"):
            return tx.update(updates, state, params)

    return optax.GradientTransformation(init, update)


def _take_tree(axes: Any, arg: Any) -> Any:
    # in_axes entries are 0, None, or tuples mirroring tuple arguments (the per-level pools).
    if axes is None:
        return arg
    if axes == 0:
        return jax.tree.map(lambda x: x[0], arg)
    return type(arg)(_take_tree(a, x) for a, x in zip(axes, arg, strict=True))


@functools.lru_cache(maxsize=32)
def _evaluator(task: Task, sequential: bool = False, frozen: bool = False) -> Callable:
    """Per-node metrics of a stack on one batch, compiled once per task and shared by trainers.

    ``sequential``: one node after the other (``lax.map``), for a single device. A vmapped
    evaluation batches every node's activations into one large working set, which for the
    text transformer on its 256 test windows falls out of cache and makes it slower than
    mapping on XLA:CPU (for digits the two are the same). On a node mesh the vmap spreads nodes over
    devices, so it stays.
    """
    if frozen:  # a LoRA task: the frozen base is one more (unstacked) argument
        metrics = task.metrics

        def run(stacked, batch, frozen):
            one = functools.partial(metrics, batch=batch, frozen=frozen)
            return jax.lax.map(one, stacked) if sequential else jax.vmap(one)(stacked)

        return jax.jit(run)
    if sequential:
        return jax.jit(lambda stacked, batch: jax.lax.map(lambda p: task.metrics(p, batch), stacked))
    return jax.jit(jax.vmap(task.metrics, in_axes=(0, None)))


def _as_level_table(name: str, value: Any, n: int, num_levels: int) -> np.ndarray:
    """A hyperparameter as an (n, L) float32 table: scalar, (n,) or (n, L)."""
    v = np.asarray(value, np.float32)
    if v.ndim == 0:
        return np.full((n, num_levels), v, np.float32)
    if v.shape == (n,):
        return np.repeat(v[:, None], num_levels, axis=1)
    if v.shape == (n, num_levels):
        return v
    raise ValueError(
        f"hyperparameter {name!r}: need a scalar, ({n},) or ({n}, {num_levels}) values, got {v.shape}"
    )


def _per_node(name: str, value: Any, n: int, dtype: Any) -> np.ndarray:
    v = np.asarray(value, dtype)
    if v.ndim == 0:
        v = np.full((n,), v, dtype)
    if v.shape != (n,):
        raise ValueError(f"{name}: need a scalar or ({n},) values, got shape {v.shape}")
    return v


def _attacked(attack: Callable[[Task, Batch], Batch], task: Task, batch: Batch) -> Batch:
    """The batch a data attack makes of ``batch``; a one-line error when it changes the batch's form."""
    out = attack(task, batch)

    def form(tree: Any) -> str:
        leaves, treedef = jax.tree.flatten_with_path(tree)
        kinds = ", ".join(
            f"{jax.tree_util.keystr(k)}: {jnp.result_type(x)}{list(jnp.shape(x))}" for k, x in leaves
        )
        return f"{type(tree).__name__} {{{kinds}}}"

    got, want = form(out), form(batch)
    if got != want or str(jax.tree.structure(out)) != str(jax.tree.structure(batch)):
        name = getattr(attack, "name", getattr(attack, "__name__", repr(attack)))
        raise ValueError(
            f"data attack {name!r} must return a batch of the same keys, shapes and dtypes: "
            f"got {got}, want {want}"
        )
    return out


@dataclasses.dataclass(frozen=True, eq=False)
class NodeTrainer:
    """Trains n nodes of one task in one jitted, vmapped step.

    Args:
      task: the :class:`~strategies.tasks.base.Task`.
      optimizer: optax factory called as ``optimizer(**hyperparams)`` inside
        the vmapped step with each node's scalars (default ``optax.adam``);
        the optimizer state's structure must not depend on their values.
      hyperparams: defaults, each a scalar, an (n,) or an (n, L) array (one
        value per node and data level), e.g. ``{"learning_rate": 1e-3}``.
        ``learning_rate`` is also the step size of the proximal step.
      batch_size: rows each node draws per micro-step.
      mesh: optional ("node", "data", "model") mesh (:func:`consensus.mesh.make_mesh`), or a
        :class:`~consensus.mesh.MeshConfig` (its mesh is built and its rules used).
      rules: logical axis rules or a MeshConfig (see :mod:`consensus.mesh`).
      compute_dtype: float32, or bfloat16 for mixed precision (params and
        optimizer state stay float32; gradients arrive in float32).
      grad_accum: micro-steps per optimizer update (``optax.MultiSteps``).
      remat: recompute activations in the backward pass (``jax.checkpoint`` of
        the loss keeping only matmul outputs).
      unroll: ``lax.scan`` unroll factor over the steps of one fit call.
      donate: hand the state's buffers to :meth:`fit`'s result (XLA updates params and optimizer
        state in place instead of holding the old and the new copies at once, which halves
        their share of the peak memory); the state passed to ``fit`` is then consumed.

    Raises:
      ValueError: for ``batch_size`` or ``grad_accum`` below 1, a ``compute_dtype`` other than
        float32 or bfloat16, hyperparams without ``learning_rate``, or a mesh with other axes.

    Example (trains four models, so not run as a doctest)::

        task = DigitsTask()
        data = task.splits(4, seed=0)
        trainer = NodeTrainer(task, optax.adam, {"learning_rate": 3e-3}, batch_size=32)
        state = trainer.init(jax.random.key(0), task.init(jax.random.key(1)), 4)
        state, log = trainer.fit(state, data.own(), 200)
        trainer.evaluate(state.params, data.test)["accuracy"]  # (4,) numpy accuracies
    """

    task: Task
    optimizer: OptimizerFactory = optax.adam
    hyperparams: Mapping[str, Any] = dataclasses.field(default_factory=lambda: {"learning_rate": 1e-3})
    batch_size: int = 32
    mesh: jax.sharding.Mesh | mesh_lib.MeshConfig | None = None
    rules: Any = mesh_lib.DEFAULT_RULES
    compute_dtype: Any = jnp.float32
    grad_accum: int = 1
    remat: bool = False
    unroll: int = 1
    donate: bool = False
    if TYPE_CHECKING:  # set by __post_init__, not dataclass fields at run time
        _fit_jit: Any = dataclasses.field(init=False)  # a jitted function (its .lower too)
        _eval_jit: Callable[..., Any] = dataclasses.field(init=False)
        _init_cache: dict[tuple[Any, ...], Callable[..., Any]] = dataclasses.field(init=False)

    def __post_init__(self):
        if self.batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {self.batch_size}")
        if self.grad_accum < 1:
            raise ValueError(f"grad_accum must be >= 1, got {self.grad_accum}")
        if jnp.dtype(self.compute_dtype) not in (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16)):
            raise ValueError(f"compute_dtype must be float32 or bfloat16, got {self.compute_dtype}")
        if not self.hyperparams:
            raise ValueError("hyperparams must hold at least the optimizer's learning_rate")
        if isinstance(self.mesh, mesh_lib.MeshConfig):
            # A config builds its mesh and brings its logical axis rules.
            object.__setattr__(self, "rules", self.mesh)
            object.__setattr__(self, "mesh", mesh_lib.make_mesh(self.mesh))
        if self.mesh is not None and tuple(self.mesh.axis_names) != mesh_lib.AXES:
            raise ValueError(f"mesh axes must be {mesh_lib.AXES}, got {tuple(self.mesh.axis_names)}")
        # Compiled functions, built once per trainer (jit caches per static args and shapes).
        donate = ("state",) if self.donate else ()
        fit_jit = jax.jit(self._fit_impl, static_argnames=("static",), donate_argnames=donate)
        object.__setattr__(self, "_fit_jit", fit_jit)
        one_device = self.mesh is None or self.mesh.devices.size == 1
        object.__setattr__(self, "_eval_jit", _evaluator(self.task, sequential=one_device))
        object.__setattr__(self, "_init_cache", {})

    # ------------------------------------------------------------------ optimizer

    def _tx(self, hp: Mapping[str, Any]) -> optax.GradientTransformation:
        tx = self.optimizer(**hp)
        if self.grad_accum > 1:
            tx = optax.MultiSteps(tx, every_k_schedule=self.grad_accum)
        return _standard_promotion(tx)

    def _init_hp(self) -> dict[str, jax.Array]:
        # Any values do for init: the state's structure does not depend on them.
        return {k: jnp.asarray(np.asarray(v, np.float32).reshape(-1)[0]) for k, v in self.hyperparams.items()}

    # ------------------------------------------------------------------ placement

    def _put(self, x: Any, sharding: Any, *, per_node: bool) -> jax.Array:
        if self.mesh is None:
            return jnp.asarray(x)
        if isinstance(x, jax.Array) and x.sharding == sharding:
            return x
        if per_node and jax.process_count() > 1:
            # x holds this process's block of nodes only.
            x = np.asarray(x)
            return mesh_lib.global_from_local(x, sharding, (x.shape[0] * jax.process_count(), *x.shape[1:]))
        return mesh_lib.global_from_local(np.asarray(x) if not isinstance(x, jax.Array) else x, sharding)

    @property
    def _mesh(self) -> jax.sharding.Mesh | None:
        """``mesh`` as __post_init__ left it: a MeshConfig has become its mesh."""
        assert not isinstance(self.mesh, mesh_lib.MeshConfig)
        return self.mesh

    def _node_sh(self) -> Any:
        return None if self._mesh is None else mesh_lib.node_sharding(self._mesh)

    def _rep_sh(self) -> Any:
        return None if self._mesh is None else mesh_lib.replicated(self._mesh)

    def place(self, data: NodeData) -> NodeData:
        """Put a NodeData on the device(s): per-node arrays on the "node" axis, shared pools replicated.

        In a multi-process run, ``data`` holds the hosted nodes only (as
        returned by ``TaskData`` of ``splits(process_index=...)``). Placing once
        and reusing the result avoids a host-to-device copy per fit call.

        Args:
          data: the NodeData (host arrays).

        Returns:
          The same NodeData with its arrays on the devices.
        """
        pool_sh = self._rep_sh() if data.shared else self._node_sh()
        pool = {k: self._put(v, pool_sh, per_node=not data.shared) for k, v in data.pool.items()}
        index = self._put(
            np.asarray(data.index, np.int32) if not isinstance(data.index, jax.Array) else data.index,
            self._node_sh(),
            per_node=True,
        )
        count = self._put(
            np.asarray(data.count, np.int32) if not isinstance(data.count, jax.Array) else data.count,
            self._node_sh(),
            per_node=True,
        )
        return NodeData(pool, index, count, data.shared, data.name, data.identity)

    def shardings(self, stacked_params: PyTree) -> TrainState | None:
        """NamedShardings of a TrainState for stacked params (arrays or ShapeDtypeStructs), or None.

        Args:
          stacked_params: the stacked params (or their shapes).

        Returns:
          A TrainState of shardings, or None without a mesh.
        """
        mesh = self._mesh
        if mesh is None:
            return None
        single = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape[1:], x.dtype), stacked_params)
        axes = self.task.logical_axes(single)
        p_sh = mesh_lib.stacked_sharding(stacked_params, axes, mesh, self.rules)
        opt_abs = jax.eval_shape(jax.vmap(self._tx(self._init_hp()).init), stacked_params)
        o_sh = mesh_lib.opt_state_sharding(opt_abs, stacked_params, p_sh, mesh)
        node = mesh_lib.node_sharding(mesh)
        return TrainState(p_sh, o_sh, node, node)  # type: ignore[arg-type]  # a TrainState of shardings

    # ------------------------------------------------------------------ init

    def init(self, key: jax.Array, params: PyTree | None, num_nodes: int) -> TrainState:
        """A stacked TrainState: n copies of ``params`` (or n fresh inits when None).

        Args:
          key: PRNG key (the same on every process); node i's init key is
            ``split(key, n)[i]`` and its training stream is derived from it.
          params: one params tree, copied to every node, or None.
          num_nodes: n over all processes (a multiple of the mesh's "node" size).

        Returns:
          TrainState with float32 params and ``step == 0``, sharded on the mesh.

        Raises:
          ValueError: for a ``num_nodes`` that is not a positive int (or not a multiple of the
            mesh's "node" size).
          TypeError: for a params leaf that is not floating-point.
        """
        if not isinstance(num_nodes, int | np.integer) or num_nodes < 1:
            raise ValueError(f"num_nodes must be a positive int, got {num_nodes!r}")
        mesh = self._mesh
        if mesh is not None and num_nodes % mesh.shape["node"]:
            raise ValueError(
                f"num_nodes={num_nodes} is not a multiple of the mesh's node axis ({mesh.shape['node']})"
            )
        if params is not None:
            for path, leaf in jax.tree_util.tree_leaves_with_path(params):
                if not jnp.issubdtype(jnp.result_type(leaf), jnp.floating):
                    raise TypeError(f"params leaf {jax.tree_util.keystr(path)} is not floating point")
        typed = jnp.issubdtype(key.dtype, jax.dtypes.prng_key)
        # Raw key data travels as a plain uint32 array (placeable on any mesh, across processes).
        key_data = jax.random.key_data(key) if typed else key
        impl = jax.random.key_impl(key) if typed else None
        signature = (
            None if params is None else [(jnp.shape(x), jnp.result_type(x)) for x in jax.tree.leaves(params)]
        )
        cache_key = (num_nodes, str(impl), str(jax.tree.structure(params)), str(signature))
        if cache_key not in self._init_cache:
            # One compiled init per node count and params signature (tests and rounds call it often).
            build = self._build_init(num_nodes, params is None, impl)
            abstract = jax.eval_shape(build, key_data, params)
            self._init_cache[cache_key] = jax.jit(build, out_shardings=self.shardings(abstract.params))
        key_data = self._put(key_data, self._rep_sh(), per_node=False)
        if params is not None:
            params = jax.tree.map(lambda p: self._put(p, self._rep_sh(), per_node=False), params)
        return self._init_cache[cache_key](key_data, params)

    def abstract_state(self, key: jax.Array, params: PyTree | None, num_nodes: int) -> TrainState:
        """The TrainState :meth:`init` would return, as ``jax.ShapeDtypeStruct`` leaves (nothing allocated).

        With a mesh the leaves carry their shardings, so :meth:`lower` compiles the sharded step.

        Args:
          key: as for :meth:`init`.
          params: as for :meth:`init` (arrays or ``jax.ShapeDtypeStruct`` leaves).
          num_nodes: as for :meth:`init`.

        Returns:
          A TrainState of ``jax.ShapeDtypeStruct``.
        """
        typed = jnp.issubdtype(key.dtype, jax.dtypes.prng_key)
        key_data = jax.random.key_data(key) if typed else key
        impl = jax.random.key_impl(key) if typed else None
        abstract = jax.eval_shape(self._build_init(num_nodes, params is None, impl), key_data, params)
        sh = self.shardings(abstract.params)
        if sh is None:
            return abstract
        return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), abstract, sh)

    def with_auto_batch(
        self, params: PyTree, data: NodeData | Sequence[NodeData], num_nodes: int, **options: Any
    ) -> NodeTrainer:
        """This trainer with the batch size :func:`auto_batch_size` chooses (nothing is allocated).

        Args:
          params: one node's params (arrays or ``jax.ShapeDtypeStruct`` leaves).
          data: the data the fits will draw from.
          num_nodes: n, as for :meth:`init`.
          **options: ``memory_bytes``, ``fraction``, ``max_batch`` and fit options, as
            :func:`auto_batch_size` takes them.

        Returns:
          A new NodeTrainer.

        Raises:
          ValueError: as :func:`auto_batch_size`.
        """
        state = self.abstract_state(jax.random.key(0), params, num_nodes)
        return dataclasses.replace(self, batch_size=auto_batch_size(self, state, data, **options))

    def _build_init(self, num_nodes: int, fresh: bool, impl: Any) -> Callable:
        def build(key_data, params):
            k = jax.random.wrap_key_data(key_data, impl=impl) if impl is not None else key_data
            keys = jax.random.split(k, num_nodes)
            if fresh:
                stacked = jax.vmap(self.task.init)(keys)
            else:
                stacked = jax.tree.map(lambda p: jnp.broadcast_to(p, (num_nodes, *p.shape)), params)
            stacked = cast_floating(stacked, jnp.float32)
            opt = jax.vmap(self._tx(self._init_hp()).init)(stacked)
            stream = jax.vmap(lambda k: jax.random.fold_in(k, 1))(keys)
            return TrainState(stacked, opt, stream, jnp.zeros((num_nodes,), jnp.int32))

        return build

    # ------------------------------------------------------------------ fit

    def fit_args(
        self,
        state: TrainState,
        data: NodeData | Sequence[NodeData],
        steps: int,
        *,
        schedule: Schedule | None = None,
        hyperparams: Mapping[str, Any] | None = None,
        flip_labels: Any = None,
        poisoned: Any = None,
        data_attack: Callable[[Task, Batch], Batch] | None = None,
        proximal: Proximal | None = None,
        record: bool = False,
        dp: dpsgd.ExampleDP | None = None,
        frozen: PyTree | None = None,
    ) -> tuple[tuple[Any, ...], tuple[Any, ...]]:
        """Check and place the arguments of one fit call: what :meth:`fit` runs and :meth:`lower` lowers.

        Args:
          state: the stacked TrainState (from :meth:`init` or a previous fit).
          data: one NodeData, or a sequence of them (data levels) indexed by
            ``schedule.level``. Per-node pools must have the state's node count
            (this process's block in a multi-process run).
          steps: number of (micro-)steps, static (one compile per value).
          schedule: per node and step, the data level and whether to train
            (default: level 0, every node active).
          hyperparams: overrides of the trainer's defaults (scalar, (n,) or
            (n, L) each, over all n nodes).
          flip_labels: optional (n,) bool, nodes that train on the task's
            flipped labels (label-flipping Byzantine nodes): ``poisoned`` with the task's
            ``flip_labels`` as the data attack.
          poisoned: optional (n,) bool, nodes whose every batch ``data_attack`` rewrites
            (not together with ``flip_labels``).
          data_attack: ``attack(task, batch) -> batch`` (a
            :class:`strategies.attacks.DataAttack`), jittable, returning a batch of the
            same structure, shapes and dtypes; None: the task's ``flip_labels``. A static
            argument of the jitted step: pass one hashable object per configuration
            (equal across calls), or every call compiles again.
          proximal: optional :class:`Proximal` options (anchor, mu, radius).
          record: also return the pool rows every node drew at every step.
          dp: example-level DP-SGD settings (:class:`strategies.dpsgd.ExampleDP`): every
            step samples each level's rows by Poisson sampling at ``q = min(1, batch_size /
            count)`` into ``dp.pad`` slots (``rows`` then logs the slots, -1 where empty).
            The clipped sum takes the fast path (ghost clipping) when the task supplies
            ``dp_dense_taps()`` and ``dp.ghost`` is True, else the generic per-example path.
          frozen: the frozen part of the model (a LoRA task's base, :mod:`strategies.lora`), one
            unstacked tree every node's loss reads as ``task.loss(params, batch, key,
            frozen=frozen)``: no gradient, no optimizer state, not copied per node. None: the
            task's loss of ``params`` alone.

        Returns:
          ``(args, static)``: the jitted step's arguments (state first) and its static options.

        Raises:
          TypeError: for ``data`` that is not a NodeData or a non-empty sequence of them, both
            ``flip_labels`` and ``poisoned``, a ``data_attack`` that is not callable, or ``dp``
            that is not an :class:`~strategies.dpsgd.ExampleDP`.
          ValueError: for ``steps`` that is not a positive int, data whose node count is not
            the state's, a schedule of the wrong shape or with unknown levels, negative proximal
            options, or invalid DP settings (several processes, a clip norm or noise
            multiplier out of range, a bad pad).
        """
        levels = (data,) if isinstance(data, NodeData) else tuple(data)
        if not levels or not all(isinstance(d, NodeData) for d in levels):
            raise TypeError("data must be a NodeData or a non-empty sequence of NodeData")
        if not isinstance(steps, int | np.integer) or steps < 1:
            raise ValueError(f"steps must be a positive int, got {steps!r}")
        n = int(state.step.shape[0])
        n_local = n // jax.process_count() if self.mesh is not None else n
        for d in levels:
            if d.num_nodes != n_local:
                raise ValueError(f"data {d.name!r} has {d.num_nodes} nodes, the state has {n_local} (hosted)")
        num_levels = len(levels)
        if schedule is None:
            level = np.zeros((n, steps), np.int32)
            active = np.ones((n, steps), bool)
        else:
            level = np.asarray(schedule.level, np.int32)
            active = np.broadcast_to(np.asarray(schedule.active, bool), level.shape)
            if level.shape != (n, steps):
                raise ValueError(f"schedule.level must be (n={n}, steps={steps}), got {level.shape}")
            if level.min() < 0 or level.max() >= num_levels:
                raise ValueError(f"schedule.level refers to levels outside 0..{num_levels - 1}")
        hp_all = {**self.hyperparams, **(hyperparams or {})}
        hp = {k: _as_level_table(k, v, n, num_levels) for k, v in hp_all.items()}
        use_prox = proximal is not None
        if proximal is not None:
            if "learning_rate" not in hp:
                raise ValueError(
                    "proximal training needs a 'learning_rate' hyperparameter (the prox step size)"
                )
            mu = _per_node("proximal.mu", proximal.mu, n, np.float32)
            radius = _per_node("proximal.radius", proximal.radius, n, np.float32)
            if np.any(mu < 0) or np.any(radius < 0) or np.any(np.isnan(radius)):
                raise ValueError("proximal.mu and proximal.radius must be >= 0")
            on = False if proximal.tangent is None else proximal.tangent
            tangent = _per_node("proximal.tangent", on, n, bool)
            tangent_mode = TANGENT_ALL if tangent.all() else TANGENT_MIXED if tangent.any() else TANGENT_NONE
            if tangent_mode != TANGENT_NONE:
                _check_tangent(self.task, proximal.anchor, state.params, dp, frozen)
            prox: tuple[Any, ...] | None = (proximal.anchor, mu, radius, tangent)
        else:
            prox, tangent_mode = None, TANGENT_NONE
        if flip_labels is not None and poisoned is not None:
            raise TypeError("pass either flip_labels or poisoned (with data_attack), not both")
        if data_attack is not None and not callable(data_attack):
            raise TypeError(f"data_attack must be callable as attack(task, batch), got {data_attack!r}")
        mask_name, mask = ("poisoned", poisoned) if poisoned is not None else ("flip_labels", flip_labels)
        use_flip = mask is not None and bool(np.any(np.asarray(mask)))
        flip = _per_node(mask_name, mask if use_flip else False, n, bool)
        attack = data_attack if use_flip and poisoned is not None else None
        gate = not bool(np.all(active))
        dp_args, dp_static = self._dp_args(dp, levels, n)
        static = (
            steps,
            bool(record),
            tuple((d.shared, d.identity) for d in levels),
            use_flip,
            attack,
            use_prox,
            gate,
            dp_static,
            frozen is not None,
            tangent_mode,
        )

        rep = self._rep_sh()
        put_small = functools.partial(self._put, sharding=rep, per_node=False)
        levels = tuple(self.place(d) for d in levels)
        args = (
            put_small(level.T.copy()),
            put_small(active.T.copy()),
            {k: put_small(v) for k, v in hp.items()},
            put_small(flip),
            None if prox is None else (jax.tree.map(put_small, prox[0]), *(put_small(a) for a in prox[1:])),
            None if dp_args is None else tuple(put_small(a) for a in dp_args),
            None if frozen is None else jax.tree.map(put_small, frozen),
        )
        pools = tuple((dict(d.pool), d.index, d.count) for d in levels)
        return (state, pools, *args), static

    def fit(
        self,
        state: TrainState,
        data: NodeData | Sequence[NodeData],
        steps: int,
        **options: Any,
    ) -> tuple[TrainState, FitLog]:
        """Run ``steps`` training steps of every node in one jitted call.

        Args:
          state: the stacked TrainState (from :meth:`init` or a previous fit). With
            ``donate=True`` its buffers are reused for the result and it must not be read again.
          data: one NodeData, or a sequence of them (data levels) indexed by
            ``schedule.level``. Per-node pools must have the state's node count
            (this process's block in a multi-process run).
          steps: number of (micro-)steps, static (one compile per value).
          **options: ``schedule``, ``hyperparams``, ``flip_labels``, ``poisoned``,
            ``data_attack``, ``proximal``, ``record``, ``dp`` and ``frozen``, as
            :meth:`fit_args` describes them.

        Returns:
          ``(state, log)`` with a :class:`FitLog`.

        Raises:
          TypeError: as :meth:`fit_args`.
          ValueError: as :meth:`fit_args`.
        """
        args, static = self.fit_args(state, data, steps, **options)
        return self._fit_jit(*args, static=static)

    def lower(
        self,
        state: TrainState,
        data: NodeData | Sequence[NodeData],
        steps: int = 1,
        **options: Any,
    ) -> jax.stages.Lowered:
        """The fit step lowered for these arguments, not run (``.compile().memory_analysis()``).

        The compiled executable's memory analysis says what one fit call needs per device
        (arguments, outputs and XLA's temporaries) without allocating it; :func:`auto_batch_size`
        sizes the batch with it.

        Args:
          state: the stacked TrainState (or its ``jax.ShapeDtypeStruct`` tree).
          data: as for :meth:`fit`.
          steps: number of steps of the lowered call.
          **options: as for :meth:`fit`.

        Returns:
          The ``jax.stages.Lowered`` fit call.

        Raises:
          TypeError: as :meth:`fit_args`.
          ValueError: as :meth:`fit_args`.
        """
        args, static = self.fit_args(state, data, steps, **options)
        return self._fit_jit.lower(*args, static=static)

    def _dp_args(self, dp: dpsgd.ExampleDP | None, levels: Sequence[NodeData], n: int) -> tuple:
        """Host-side DP-SGD arrays: (clip (n,), z (n,), rate (n, L), expected batch (n, L)), static."""
        if dp is None:
            return None, None
        if not isinstance(dp, dpsgd.ExampleDP):
            raise TypeError(f"dp must be a strategies.dpsgd.ExampleDP, got {type(dp).__name__}")
        if self.mesh is not None and jax.process_count() > 1:
            raise ValueError("example-level DP-SGD runs in one process (other hosts' node counts unknown)")
        clip = _per_node("dp.clip_norm", dp.clip_norm, n, np.float32)
        z = _per_node("dp.noise_multiplier", dp.noise_multiplier, n, np.float32)
        if not (np.all(clip > 0) and np.all(np.isfinite(clip))):
            raise ValueError(f"dp.clip_norm must be finite and > 0, got {clip.tolist()}")
        if not (np.all(z >= 0) and np.all(np.isfinite(z))):
            raise ValueError(f"dp.noise_multiplier must be finite and >= 0, got {z.tolist()}")
        micro = int(dp.microbatch)
        if int(dp.pad) < 1 or micro < 0 or (micro and int(dp.pad) % micro):
            raise ValueError(f"dp.pad must be >= 1 and a multiple of dp.microbatch, got {dp.pad}, {micro}")
        counts = np.stack([np.asarray(count_host(d.count), np.int64) for d in levels], 1)  # (n, L)
        rate = dpsgd.sampling_rates(counts, self.batch_size)
        expected = (rate.astype(np.float64) * counts).astype(np.float32)
        ghost = bool(dp.ghost) and self._dense_taps() is not None
        return (clip, z, rate, expected), (int(dp.pad), micro, ghost)

    def _dense_taps(self) -> dpsgd.DenseTaps | None:
        """The task's dense-layer taps for DP-SGD's fast path (ghost clipping), None for the generic path.

        Present when the task defines ``dp_dense_taps()`` and it returns taps (the MLP tasks
        without dropout); the params are cast to the compute dtype as :meth:`_loss_fn` does.
        """
        make = getattr(self.task, "dp_dense_taps", None)
        taps = make() if make is not None else None
        if taps is None:
            return None

        def loss(params, batch, offsets):
            if jnp.dtype(self.compute_dtype) != jnp.dtype(jnp.float32):
                params = cast_floating(params, self.compute_dtype)
            losses, inputs = taps.loss(params, batch, offsets)
            return losses.astype(jnp.float32), inputs

        return dpsgd.DenseTaps(taps.widths, loss)

    def _loss_fn(self, frozen: PyTree | None = None, tangent_at: PyTree | None = None) -> Callable:
        """The step's loss of ``params``: the task's, or its expansion at ``tangent_at``."""
        task: Any = self.task if tangent_at is None else TangentTask(self.task, tangent_at)

        def loss(params, batch, key):
            if jnp.dtype(self.compute_dtype) != jnp.dtype(jnp.float32):
                params = cast_floating(params, self.compute_dtype)
            if tangent_at is not None:  # the anchor as an argument of the step, not a constant
                at = tangent_at
                if jnp.dtype(self.compute_dtype) != jnp.dtype(jnp.float32):
                    at = cast_floating(at, self.compute_dtype)
                return task.loss(params, batch, key, frozen=at).astype(jnp.float32)
            if frozen is not None:
                out = task.loss(params, batch, key, frozen=frozen)
                return out.astype(jnp.float32)
            return task.loss(params, batch, key).astype(jnp.float32)

        if self.remat:
            loss = jax.checkpoint(loss, policy=jax.checkpoint_policies.dots_saveable)
        return loss

    def _fit_impl(self, state, pools, level_t, active_t, hp, flip, prox, dp_args, frozen, *, static):
        steps, record, shared, use_flip, attack, use_prox, gate, dp_static, _, tangent_mode = static
        loss_fn = self._loss_fn(frozen)
        dense_taps = self._dense_taps() if dp_static is not None and dp_static[2] else None
        accum = self.grad_accum > 1
        batch_sh = None
        if (
            self.mesh is not None
            and self.mesh.shape["data"] > 1
            and self.batch_size % self.mesh.shape["data"] == 0
        ):
            batch_sh = jax.sharding.NamedSharding(self.mesh, jax.sharding.PartitionSpec("data"))

        def value_and_grad(params, batch, key, tan_i, anchor):
            if tangent_mode == TANGENT_NONE:
                return jax.value_and_grad(loss_fn)(params, batch, key)
            tangent = jax.value_and_grad(self._loss_fn(tangent_at=anchor))(params, batch, key)
            if tangent_mode == TANGENT_ALL:
                return tangent
            # Under vmap both branches run for every node: the select keeps each node's own.
            plain = jax.value_and_grad(loss_fn)(params, batch, key)
            return jax.tree.map(lambda t, p: jnp.where(tan_i, t, p), tangent, plain)

        def node_step(
            params, opt, step, lvl, act, k_sample, k_loss, hp_i, flip_i, mu_i, r_i, tan_i, anchor, dp_i, pools
        ):
            batches, rows_l = [], []
            if dp_static is not None:
                # Example-level DP-SGD: a Poisson draw per level into fixed padded slots.
                k_sample, k_noise = jax.random.split(k_sample)
                for j, ((pool, index, count), (_, identity)) in enumerate(zip(pools, shared, strict=True)):
                    idx = None if identity else index
                    rows, mask, _ = dpsgd.poisson_rows(
                        k_sample, idx, count, dp_i[2][j], dp_static[0], index.shape[-1]
                    )
                    batches.append({**{k: v[rows] for k, v in pool.items()}, "mask": mask})
                    rows_l.append(jnp.where(mask, rows, -1))
            else:
                for (pool, index, count), (_, identity) in zip(pools, shared, strict=True):
                    u = jax.random.randint(k_sample, (self.batch_size,), 0, count)
                    rows = u if identity else index[u]
                    batches.append({k: v[rows] for k, v in pool.items()})
                    rows_l.append(rows)
            if len(batches) == 1:
                batch, rows = batches[0], rows_l[0]
            else:
                batch = jax.tree.map(lambda *bs: jnp.stack(bs)[lvl], *batches)
                rows = jnp.stack(rows_l)[lvl]
            if use_flip:
                flipped = (
                    self.task.flip_labels(batch) if attack is None else _attacked(attack, self.task, batch)
                )
                batch = jax.tree.map(lambda a, b: jnp.where(flip_i, a, b), flipped, batch)
            if batch_sh is not None and dp_static is None:
                batch = jax.lax.with_sharding_constraint(batch, batch_sh)
            hp_l = {k: v[lvl] for k, v in hp_i.items()}
            if dp_static is not None:
                clip_i, z_i, _, expected_i = dp_i
                mask = batch.pop("mask")
                loss, grads = dpsgd.private_gradient(
                    loss_fn,
                    params,
                    batch,
                    mask,
                    k_loss,
                    k_noise,
                    clip_i,
                    z_i,
                    expected_i[lvl],
                    dp_static[1],
                    taps=dense_taps,
                )
            else:
                loss, grads = value_and_grad(params, batch, k_loss, tan_i, anchor)
            updates, new_opt = self._tx(hp_l).update(grads, opt, params)
            new_params = optax.apply_updates(params, updates)
            if use_prox:
                moved = proximal_step(new_params, anchor, mu_i, hp_l["learning_rate"])
                moved = project_l2_ball(moved, anchor, r_i)
                if accum:
                    # Only after real updates: MultiSteps emits zeros on accumulation micro-steps.
                    moved = jax.tree.map(
                        lambda a, b: jnp.where(optax.MultiSteps.has_updated(new_opt), a, b), moved, new_params
                    )
                new_params = moved
            new_step = step + 1
            if gate:
                keep = functools.partial(jax.tree.map, lambda a, b: jnp.where(act, a, b))
                new_params, new_opt = keep(new_params, params), keep(new_opt, opt)
                new_step = jnp.where(act, new_step, step)
            # Unused scan outputs are not always pruned by XLA: emit the drawn rows only on request.
            return (new_params, new_opt, new_step), ((loss, rows) if record else loss)

        pool_axes = tuple((None if sh else 0, 0, 0) for sh, _ in shared)
        if use_prox:
            anchor, mu, radius, tangent = prox
        else:
            anchor, mu, radius = None, jnp.zeros_like(flip, jnp.float32), jnp.zeros_like(flip, jnp.float32)
            tangent = jnp.zeros_like(flip, bool)
        prox_axes = (0, 0, 0, None)
        spmd = "node" if self.mesh is not None else None
        dp_axes = None if dp_args is None else (0, 0, 0, 0)
        in_axes = (0, 0, 0, 0, 0, 0, 0, 0, 0, *prox_axes, dp_axes, pool_axes)
        # One node: run the unbatched step. vmap of size 1 turns every matmul into a batched
        # dot_general, which XLA:CPU runs measurably slower than a plain GEMM; the node axis is
        # taken off the carry and the loop-invariant arguments once, outside the scan, not per step.
        single = self.mesh is None and flip.shape[0] == 1
        step_fn = node_step if single else jax.vmap(node_step, in_axes=in_axes, spmd_axis_name=spmd)

        # Node i's s-th training step uses fold_in(key_i, s) (s = its step count), split into a
        # sampling and a loss key. Derived for all steps at once, outside the loop (one vectorized
        # hash instead of a split per step); idle steps do not consume keys, and a fit split into
        # several calls draws exactly what one call draws.
        act_int = active_t.astype(jnp.int32)
        counts = state.step[None, :] + jnp.cumsum(act_int, axis=0) - act_int
        step_keys = jax.vmap(jax.vmap(jax.random.fold_in), in_axes=(None, 0))(state.key, counts)
        pairs = jax.vmap(jax.vmap(jax.random.split))(step_keys)

        carry0 = (state.params, state.opt_state, state.step)
        xs = (level_t, active_t, pairs[:, :, 0], pairs[:, :, 1])
        invariant = (hp, flip, mu, radius, tangent, anchor, dp_args, pools)
        if single:
            invariant = _take_tree(in_axes[7:], invariant)
            carry0 = jax.tree.map(lambda x: x[0], carry0)
            xs = jax.tree.map(lambda x: x[:, 0], xs)

        def body(carry, xs):
            return step_fn(*carry, *xs, *invariant)

        carry, outs = jax.lax.scan(body, carry0, xs, length=steps, unroll=self.unroll)
        if single:
            carry = jax.tree.map(lambda x: jnp.expand_dims(x, 0), carry)
            outs = jax.tree.map(lambda x: jnp.expand_dims(x, 1), outs)
        loss, rows = outs if record else (outs, None)
        new_state = TrainState(carry[0], carry[1], state.key, carry[2])
        sh = self.shardings(new_state.params)
        if sh is not None:
            new_state = jax.lax.with_sharding_constraint(new_state, sh)
        return new_state, FitLog(loss=loss, level=level_t, rows=rows)

    # ------------------------------------------------------------------ evaluate

    def evaluate(
        self, stacked_params: PyTree, batch: Mapping[str, Any], frozen: PyTree | None = None
    ) -> dict[str, np.ndarray]:
        """Per-node metrics of every node on one shared batch, in one vmapped call.

        Args:
          stacked_params: the nodes' stacked params.
          batch: one batch, evaluated by every node.
          frozen: the frozen part of the model (see :meth:`fit`), shared by every node.

        Returns:
          ``{metric: (n,) float64 numpy}`` gathered on the host (every process).
        """
        batch = {
            k: self._put(np.asarray(v) if not isinstance(v, jax.Array) else v, self._rep_sh(), per_node=False)
            for k, v in batch.items()
        }
        if frozen is None:
            out = self._eval_jit(stacked_params, batch)
        else:
            one_device = self._mesh is None or self._mesh.devices.size == 1
            evaluator = _evaluator(self.task, one_device, True)  # type: ignore[arg-type]  # hashable tasks
            out = evaluator(stacked_params, batch, frozen)
        return {k: np.asarray(v, np.float64) for k, v in mesh_lib.to_host(out).items()}


# ---------------------------------------------------------------------- batch size by memory


def device_memory_bytes(device: Any = None) -> int:
    """The memory one device offers a program: the runtime's limit, or the host's available memory.

    Accelerators report ``bytes_limit`` in ``device.memory_stats()``; a CPU device reports
    nothing, and its programs live in the host's memory, so ``MemAvailable`` of
    ``/proc/meminfo`` (else the physical memory) stands in for it.

    Args:
      device: a jax device (default the first).

    Returns:
      Bytes.
    """
    device = jax.devices()[0] if device is None else device
    stats = device.memory_stats() if hasattr(device, "memory_stats") else None
    if stats and stats.get("bytes_limit"):
        return int(stats["bytes_limit"])
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    import os

    return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))


def compiled_bytes(compiled: Any) -> int:
    """Peak bytes per device of a compiled executable, from XLA's memory analysis.

    Arguments, outputs and temporaries, less the outputs aliased onto donated arguments.

    Args:
      compiled: a ``jax.stages.Compiled``.

    Returns:
      Bytes (0 when the backend gives no analysis).
    """
    m = compiled.memory_analysis()
    if m is None:
        return 0
    return int(
        m.argument_size_in_bytes + m.output_size_in_bytes + m.temp_size_in_bytes - m.alias_size_in_bytes
    )


def auto_batch_size(
    trainer: NodeTrainer,
    state: TrainState,
    data: NodeData | Sequence[NodeData],
    *,
    memory_bytes: int | None = None,
    fraction: float = 0.9,
    max_batch: int = 1024,
    **options: Any,
) -> int:
    """The largest power-of-two batch whose fit step fits the device, by compiled memory analysis.

    Each candidate's one-step fit is lowered and compiled, never run: its memory analysis
    (:func:`compiled_bytes`) is compared with ``fraction`` of the device's memory. Candidates
    double from 1 until one does not fit (the step's memory grows with the batch), so the
    search compiles about ``log2(batch)`` programs.

    Args:
      trainer: the trainer whose ``batch_size`` is chosen (its other settings are kept).
      state: the state the fit will start from.
      data: the data it will draw from.
      memory_bytes: the device's memory (default :func:`device_memory_bytes`).
      fraction: the share of it the step may use (the rest is headroom for the runtime).
      max_batch: the largest batch considered.
      **options: further fit options (``frozen``, ``dp``, ...), as the run will pass them.

    Returns:
      The batch size (at least 1).

    Raises:
      ValueError: when even a batch of one does not fit, or ``fraction`` is not in (0, 1].
    """
    if not 0.0 < fraction <= 1.0:
        raise ValueError(f"fraction must be in (0, 1], got {fraction}")
    budget = int(fraction * (device_memory_bytes() if memory_bytes is None else memory_bytes))

    def need(batch: int) -> int:
        candidate = dataclasses.replace(trainer, batch_size=batch)
        return compiled_bytes(candidate.lower(state, data, 1, **options).compile())

    first = need(1)
    if first > budget:
        raise ValueError(
            f"a batch of 1 needs {first / 2**30:.2f} GiB per device, more than the {budget / 2**30:.2f} GiB "
            "available: use a smaller model, bfloat16, remat or more devices"
        )
    batch = 1
    while batch * 2 <= max_batch and need(batch * 2) <= budget:
        batch *= 2
    return batch
