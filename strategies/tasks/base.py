"""The task interface: a model, its loss and metrics, and the data of every node.

A *task* is a small frozen object that the node trainer, the strategies and the
coordinator all talk to. Parameters are plain pytrees (nested dicts of jax
arrays) obtained from a Flax NNX module with ``nnx.split`` and
``nnx.to_pure_dict``; ``apply`` turns them back into a module with
``nnx.merge`` inside the traced function, so the consensus code can stack,
average and shard them like any other tree.

Data layout (:class:`TaskData`), chosen so every node's batch has the same
shape and one jitted step serves all nodes:

* ``train``: each hosted node's own shard, ``(n_local, m, ...)``, valid rows
  first and zero padding after ``train_count[i]`` rows;
* ``general``: a pool shared by every node (no node axis) used by the
  "general" and "groups" levels of hierarchical training. For the built-in
  tasks it is **public data** apart from the nodes' shards (a stratified
  ``public_fraction`` of the training rows, disjoint from every shard); the
  union of the shards is only an explicit choice (``general_pool = "union"``,
  centralised data, see :data:`GENERAL_POOLS`);
* ``own_heldout``: optionally, rows of each node's own shard kept out of its
  training for its submit hook (a soup's selection, :meth:`TaskData.hold_out_own`);
* ``heldout`` / ``test``: shared evaluation sets;
* ``groups``: every example belongs to one group (a class for digits, a module
  family for text) and every node specializes in a few groups
  (``node_groups``), which drives the "specialized" hierarchical level.

A fit phase samples from a :class:`NodeData`: a pool (shared or per node), a
``(n, k)`` table of the pool rows each node may draw and the number ``count``
of valid entries per node. Node i draws ``index[i, randint(0, count[i])]``
with its own key, so the gather happens on device.

Multi-host: ``splits(..., process_index=p, process_count=P)`` returns the
shards of the nodes process p hosts only (a contiguous block, see
:func:`hosted_nodes`), never the other nodes' examples.

Row provenance: ``meta["example_ids"]`` (each own row's global id) and
``meta["general_ids"]`` (each general row's) let :meth:`TaskData.drawn_ids`
say which rows of the data set a fit phase can draw for every node, so a test
can check by row index that no node trains on another node's rows.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any, Protocol, runtime_checkable

import jax
import jax.numpy as jnp
import numpy as np

from consensus.specs import Registry, Spec

PyTree = Any
Array = jax.Array
Batch = Mapping[str, Array]


@runtime_checkable
class Task(Protocol):
    """What the node trainer needs from a model + data family.

    Conventions every task follows:

    * ``apply`` computes in the floating dtype of ``params`` (the trainer casts
      float32 params to bfloat16 for mixed precision) and casts floating inputs
      to it; ``loss`` and ``metrics`` return float32 scalars.
    * ``loss`` is the mean over the rows of ``batch`` whose ``batch["mask"]``
      is True when a mask is present (padding rows weigh nothing).
    * ``metrics`` returns at least ``"loss"``; classification tasks add
      ``"accuracy"``, language models ``"accuracy"`` and ``"perplexity"``.
    * ``logical_axes(params)`` has the structure of ``params`` with, at each
      leaf, a tuple of logical axis names (or None entries for dims that are
      never split), one entry per dimension of the leaf.
    * ``flip_labels(batch)`` returns the batch with corrupted targets (label
      flipping attack). It must be a pure jittable function.
    * ``kind`` (optional, default "classification"): "classification" when
      ``apply`` returns (rows, classes) logits for integer labels ``y``; any other
      value (e.g. "language") turns off the objectives that need per-class logits.

    The methods (:meth:`init`, :meth:`apply`, :meth:`loss`, :meth:`metrics`,
    :meth:`logical_axes`, :meth:`flip_labels`, :meth:`splits`) are what the trainer, the
    attacks and the run call; each documents its own arguments.

    Attributes:
      name: the task's name in logs, reports and error messages (for a built-in task, the
        name a config gives as ``task.name``).
      kind: optional class attribute, "classification" when absent (see above).
    """

    name: str

    def init(self, key: Array) -> PyTree:
        """Fresh parameters.

        Args:
          key: a JAX PRNG key.

        Returns:
          The parameter tree.
        """
        ...

    def apply(self, params: PyTree, inputs: Array, *, train: bool = False, key: Array | None = None) -> Array:
        """The model's output on a batch of inputs, in the floating dtype of ``params``.

        Args:
          params: the parameters.
          inputs: a batch of inputs.
          train: training mode (dropout on, when the model has it).
          key: the dropout key in training mode.

        Returns:
          The outputs (logits (rows, classes) for a classification task).
        """
        ...

    def loss(self, params: PyTree, batch: Batch, key: Array | None = None) -> Array:
        """The mean training loss over the batch's rows (masked rows excluded).

        Args:
          params: the parameters.
          batch: a batch (``"mask"`` optional).
          key: the dropout key, for models that use one.

        Returns:
          A float32 scalar.
        """
        ...

    def metrics(self, params: PyTree, batch: Batch) -> dict[str, Array]:
        """Evaluation metrics on a batch.

        Args:
          params: the parameters.
          batch: a batch (``"mask"`` optional).

        Returns:
          float32 scalars by name, ``"loss"`` at least.
        """
        ...

    def logical_axes(self, params: PyTree) -> PyTree:
        """Logical axis names of every parameter (for sharding).

        Args:
          params: the parameters (or their shapes).

        Returns:
          A tree like ``params`` with a tuple of names (or None) per leaf dimension.
        """
        ...

    def flip_labels(self, batch: Batch) -> Batch:
        """The batch with corrupted targets (the label-flipping attack); pure and jittable.

        Args:
          batch: a training batch.

        Returns:
          A batch of the same structure, shapes and dtypes.
        """
        ...

    def splits(
        self,
        num_nodes: int,
        *,
        seed: int = 0,
        alpha: float = 0.5,
        process_index: int = 0,
        process_count: int = 1,
    ) -> TaskData:
        """Every split of the task, partitioned over the nodes.

        Args:
          num_nodes: the number of nodes over all processes.
          seed: the data seed (partition and draws).
          alpha: the Dirichlet concentration of the non-IID partition.
          process_index: this process's index.
          process_count: the number of processes (each hosts a contiguous block of nodes).

        Returns:
          The splits for the nodes this process hosts.
        """
        ...


#: What a task's general pool is: ``"public"``, public rows apart from every node's shard (the
#: default), or ``"union"``, the public rows and every node's shard (centralised data: an upper
#: bound for comparisons, refused with example-level DP).
GENERAL_POOLS = ("public", "union")
#: The share of the training rows the built-in classification tasks reserve as the public pool.
DEFAULT_PUBLIC_FRACTION = 0.1

#: Tasks a config names by ``task.name``: each factory is declared beside its task with
#: ``@TASKS.declare("name")`` and called with ``task.options`` (its parameters).
TASKS: Registry[Spec] = Registry("task")


# --------------------------------------------------------------------------- data


@dataclasses.dataclass(frozen=True)
class NodeData:
    """What one fit phase samples from: a pool, and the rows of it each node may draw.

    Attributes:
      pool: dict of arrays. Shared by all nodes (``(N, ...)``) when ``shared``,
        else one pool per node (``(n, N, ...)``).
      index: (n, k) int32. Row ``index[i, j]`` of the pool is node i's j-th
        candidate; only the first ``count[i]`` entries are valid.
      count: (n,) int32, at least 1 for every node.
      shared: whether ``pool`` has no node axis.
      name: label for logs ("general", "groups", "own", ...).
      identity: promise that ``index[i, j] == j`` for every node (as for
        :meth:`TaskData.own`), so samplers may draw pool rows directly and skip
        one gather. Checked when ``index`` is a host array.

    Raises:
      ValueError: for ``index``/``count`` of the wrong shapes, an empty pool, pool arrays that
        disagree on their leading dims, a node without a row, or an ``identity`` that does
        not hold.
    """

    # Host arrays as built here; a fit phase may put them on the devices.
    pool: Mapping[str, Array | np.ndarray]
    index: Array | np.ndarray
    count: Array | np.ndarray
    shared: bool
    name: str = "data"
    identity: bool = False

    def __post_init__(self):
        index, count = np.shape(self.index), np.shape(self.count)
        what = f"NodeData {self.name!r}"
        if len(index) != 2 or count != index[:1]:
            raise ValueError(f"{what}: index must be (n, k) and count (n,); got {index} and {count}")
        if not self.pool:
            raise ValueError(f"{what}: empty pool")
        lead = {np.shape(v)[: 1 if self.shared else 2] for v in self.pool.values()}
        if len(lead) != 1:
            raise ValueError(f"{what}: pool arrays disagree on their leading dims: {lead}")
        if not self.shared and lead.pop()[0] != index[0]:
            raise ValueError(f"{what}: per-node pool has a node axis different from index {index}")
        c = np.asarray(count_host(self.count))
        if c.size and c.min() < 1:
            raise ValueError(f"{what}: nodes {np.flatnonzero(c < 1).tolist()} have no data to draw")
        host_index = isinstance(self.index, np.ndarray)
        if self.identity and host_index and not (self.index == np.arange(index[1])[None]).all():
            raise ValueError(f"{what}: identity=True but index is not arange(k) for every node")

    @property
    def num_nodes(self) -> int:
        """n, the number of nodes (rows of ``index``)."""
        return int(np.shape(self.index)[0])

    def select_nodes(self, rows: np.ndarray) -> NodeData:
        """The NodeData of a subset of the nodes (host-side, e.g. for one process).

        Args:
          rows: the nodes' indices.

        Returns:
          A NodeData over those nodes.
        """
        rows = np.asarray(rows)
        pool = self.pool if self.shared else {k: v[rows] for k, v in self.pool.items()}
        return dataclasses.replace(self, pool=pool, index=self.index[rows], count=self.count[rows])


def count_host(count: Any) -> np.ndarray:
    """``count`` as a host numpy array when it is concrete (for validation only).

    Args:
      count: row counts (host, device or traced).

    Returns:
      The counts, or an empty array when they cannot be read on the host.
    """
    try:
        return np.asarray(count)
    except Exception:  # a tracer or a global array spanning processes: skip the check
        return np.ones((0,), np.int32)


def pad_index_table(rows_per_node: list[np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    """Pack per-node row lists into an ``(n, k)`` int32 table (padded with 0) and counts.

    Args:
      rows_per_node: one array of row indices per node.

    Returns:
      ``(table, counts)``: (n, k) int32 with k the longest list (at least 1), (n,) int32.
    """
    counts = np.array([len(r) for r in rows_per_node], np.int32)
    k = max(int(counts.max(initial=0)), 1)
    table = np.zeros((len(rows_per_node), k), np.int32)
    for i, r in enumerate(rows_per_node):
        table[i, : len(r)] = r
    return table, counts


def pad_stack(arrays: list[np.ndarray], size: int | None = None) -> np.ndarray:
    """Stack arrays of shape (m_i, ...) into (n, max m_i, ...) with zero padding after each.

    Args:
      arrays: n arrays of one trailing shape and dtype.
      size: the padded length (default: the longest).

    Returns:
      (n, size, ...) array.
    """
    size = max(a.shape[0] for a in arrays) if size is None else size
    out = np.zeros((len(arrays), size, *arrays[0].shape[1:]), arrays[0].dtype)
    for i, a in enumerate(arrays):
        out[i, : a.shape[0]] = a
    return out


@dataclasses.dataclass(frozen=True)
class TaskData:
    """Every split a task provides, for the nodes this process hosts.

    Attributes:
      num_nodes: total number of nodes over all processes.
      node_ids: (n_local,) global ids of the hosted nodes (a contiguous block).
      train: dict of (n_local, m, ...) arrays, each node's own shard, valid rows
        first, zero padded.
      train_count: (n_local,) int32 valid rows per node.
      train_groups: (n_local, m) int32 group of each own row (-1 on padding).
      general: dict of (N_g, ...) arrays shared by every node.
      general_groups: (N_g,) int32 group of each general row.
      heldout: dict of (N_h, ...) arrays (model selection, soups, barriers).
      test: dict of (N_t, ...) arrays (final numbers only).
      node_groups: (n_local, G) bool, the groups each node specializes in.
      group_names: the G group names (class names, module families).
      process_index, process_count: which share of the nodes this is.
      meta: anything else. By convention ``meta["example_ids"]`` is an
        (n_local, m) int64 array of global example ids of each own row (-1 on
        padding), so callers can check that processes hold disjoint shards;
        ``meta["general_ids"]`` the (N_g,) ids of the general rows and
        ``meta["general_pool"]`` one of :data:`GENERAL_POOLS`.
      own_heldout: None, or dict of (n_local, h, ...) arrays: rows of each node's
        own shard kept out of its training (:meth:`hold_out_own`), valid rows first.
      own_heldout_count: (n_local,) int32 valid rows of ``own_heldout`` (None with it).

    Raises:
      ValueError: when ``train``, ``train_count`` or ``node_groups`` disagree with ``node_ids``
        on the number of nodes, or ``node_groups`` with ``group_names``.
    """

    num_nodes: int
    node_ids: np.ndarray
    train: Mapping[str, np.ndarray]
    train_count: np.ndarray
    train_groups: np.ndarray
    general: Mapping[str, np.ndarray]
    general_groups: np.ndarray
    heldout: Mapping[str, np.ndarray]
    test: Mapping[str, np.ndarray]
    node_groups: np.ndarray
    group_names: tuple[str, ...]
    process_index: int = 0
    process_count: int = 1
    meta: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    own_heldout: Mapping[str, np.ndarray] | None = None
    own_heldout_count: np.ndarray | None = None

    def __post_init__(self):
        n = len(self.node_ids)
        for k, v in self.train.items():
            if np.shape(v)[0] != n:
                raise ValueError(f"TaskData: train[{k!r}] has {np.shape(v)[0]} nodes, node_ids has {n}")
        if np.shape(self.train_count) != (n,) or np.shape(self.node_groups)[0] != n:
            raise ValueError("TaskData: train_count must be (n_local,) and node_groups (n_local, G)")
        if np.shape(self.node_groups)[1] != len(self.group_names):
            raise ValueError("TaskData: node_groups has a column per group name")

    @property
    def num_local(self) -> int:
        """The number of nodes this process hosts."""
        return len(self.node_ids)

    @property
    def general_pool(self) -> str | None:
        """What the general pool is (one of :data:`GENERAL_POOLS`), None when the task does not say."""
        return self.meta.get("general_pool")

    def hold_out_own(self, fractions: Any, seed: int) -> TaskData:
        """Keep a share of each node's own shard out of its training: the node's own held-out split.

        Node i (global id g) holds out ``max(1, round(fractions[i] * count_i))`` of its rows, at
        most ``count_i - 1`` (none when the fraction is 0 or the shard has one row), drawn with
        ``np.random.default_rng([seed, g])``, so the draw does not depend on how many processes
        there are. The held-out rows leave ``train`` (no level of any strategy draws them) and
        go to ``own_heldout``.

        Args:
          fractions: one share in [0, 1) for every node, or (n_local,) shares.
          seed: the seed of the draw (the run's data seed).

        Returns:
          A new TaskData; ``meta["example_ids"]`` follows the train rows and
          ``meta["own_heldout_ids"]`` holds the held-out rows' ids (-1 on padding).

        Raises:
          ValueError: a share outside [0, 1).
        """
        n = self.num_local
        fr = np.broadcast_to(np.asarray(fractions, np.float64), (n,))
        if np.any(~np.isfinite(fr)) or np.any(fr < 0) or np.any(fr >= 1):
            raise ValueError(f"hold_out_own: fractions must be in [0, 1), got {fr.tolist()}")
        counts = np.asarray(self.train_count, np.int64)
        keep_rows, held_rows = [], []
        for i in range(n):
            c = int(counts[i])
            h = 0 if fr[i] == 0 or c < 2 else min(c - 1, max(1, int(round(fr[i] * c))))
            perm = np.random.default_rng([int(seed), int(self.node_ids[i])]).permutation(c)
            held_rows.append(np.sort(perm[:h]))
            keep_rows.append(np.sort(perm[h:]))
        m = int(np.shape(self.train_groups)[1])
        size = max(1, max(len(r) for r in held_rows))
        ids = self.meta.get("example_ids")

        def regroup(arr: np.ndarray, rows: list[np.ndarray], width: int, fill: Any) -> np.ndarray:
            out = np.full((n, width, *arr.shape[2:]), fill, arr.dtype)
            for i, r in enumerate(rows):
                out[i, : len(r)] = arr[i, r]
            return out

        meta = dict(self.meta)
        if ids is not None:
            meta["example_ids"] = regroup(np.asarray(ids), keep_rows, m, -1)
            meta["own_heldout_ids"] = regroup(np.asarray(ids), held_rows, size, -1)
        return dataclasses.replace(
            self,
            train={k: regroup(np.asarray(v), keep_rows, m, 0) for k, v in self.train.items()},
            train_count=np.asarray([len(r) for r in keep_rows], np.int32),
            train_groups=regroup(np.asarray(self.train_groups), keep_rows, m, -1),
            own_heldout={k: regroup(np.asarray(v), held_rows, size, 0) for k, v in self.train.items()},
            own_heldout_count=np.asarray([len(r) for r in held_rows], np.int32),
            meta=meta,
        )

    def own_heldout_batch(self, i: int) -> dict[str, np.ndarray] | None:
        """The valid own held-out rows of hosted node ``i`` (its local index), None without any.

        Args:
          i: the node's local index.

        Returns:
          Its held-out rows by name, or None.
        """
        if self.own_heldout is None or self.own_heldout_count is None:
            return None
        k = int(self.own_heldout_count[i])
        return None if k == 0 else {name: v[i, :k] for name, v in self.own_heldout.items()}

    def drawn_ids(self, data: NodeData) -> list[np.ndarray]:
        """The global ids of the rows each hosted node may draw in the fit phase ``data``.

        A shared pool is the general pool (its ids are ``meta["general_ids"]``); a per-node pool
        is the nodes' own shards (``meta["example_ids"]``).

        Args:
          data: a fit phase of this TaskData (:meth:`own`, :meth:`everything`, ...).

        Returns:
          One array of global ids per hosted node.

        Raises:
          ValueError: the ids this needs are not in ``meta``.
        """
        index, count = np.asarray(data.index), np.asarray(count_host(data.count))
        key = "general_ids" if data.shared else "example_ids"
        ids = self.meta.get(key)
        if ids is None:
            raise ValueError(f"TaskData.drawn_ids: the task gives no meta[{key!r}]")
        ids = np.asarray(ids)
        if data.shared:
            return [ids[index[i, : count[i]]] for i in range(data.num_nodes)]
        return [ids[i, index[i, : count[i]]] for i in range(data.num_nodes)]

    def own(self) -> NodeData:
        """Each node draws from its own shard only.

        Returns:
          A per-node NodeData over ``train`` (``identity`` holds).
        """
        m = int(next(iter(self.train.values())).shape[1])
        index = np.broadcast_to(np.arange(m, dtype=np.int32), (self.num_local, m)).copy()
        count = self.train_count.astype(np.int32)
        return NodeData(dict(self.train), index, count, shared=False, name="own", identity=True)

    def everything(self) -> NodeData:
        """Every node draws from the whole shared general pool.

        Returns:
          A shared NodeData over ``general``.
        """
        n_g = len(self.general_groups)
        index = np.broadcast_to(np.arange(n_g, dtype=np.int32), (self.num_local, n_g)).copy()
        count = np.full((self.num_local,), n_g, np.int32)
        return NodeData(dict(self.general), index, count, shared=True, name="general")

    def in_groups(self, node_groups: np.ndarray | None = None) -> NodeData:
        """Every node draws from the general rows of its own groups (default ``self.node_groups``).

        Args:
          node_groups: (n_local, G) bool groups per node (default: ``self.node_groups``).

        Returns:
          A shared NodeData over ``general``, each node's candidates its groups' rows.

        Raises:
          ValueError: when a node has no general row in its groups.
        """
        node_groups = self.node_groups if node_groups is None else np.asarray(node_groups, bool)
        rows = [np.flatnonzero(node_groups[i][self.general_groups]) for i in range(self.num_local)]
        empty = [int(self.node_ids[i]) for i, r in enumerate(rows) if len(r) == 0]
        if empty:
            raise ValueError(f"TaskData.in_groups: nodes {empty} have no general rows in their groups")
        index, count = pad_index_table(rows)
        return NodeData(dict(self.general), index, count, shared=True, name="groups")

    def own_in_groups(self, node_groups: np.ndarray | None = None) -> NodeData:
        """Each node draws from the rows of its own shard that belong to its groups.

        Args:
          node_groups: (n_local, G) bool groups per node (default: ``self.node_groups``).

        Returns:
          A per-node NodeData over ``train``.
        """
        node_groups = self.node_groups if node_groups is None else np.asarray(node_groups, bool)
        rows = []
        for i in range(self.num_local):
            g = self.train_groups[i, : self.train_count[i]]
            rows.append(np.flatnonzero(node_groups[i][g]))
        index, count = pad_index_table(rows)
        if count.min(initial=1) < 1:
            raise ValueError("TaskData.own_in_groups: some nodes hold no row of their own groups")
        return NodeData(dict(self.train), index, count, shared=False, name="own_groups")


def public_split(
    groups: np.ndarray, rows: np.ndarray, fraction: float, seed: int
) -> tuple[np.ndarray, np.ndarray]:
    """Stratified public / private split of ``rows``: ``round(fraction * size)`` of every group is public.

    Args:
      groups: (N,) int group (class) of every example of the data set.
      rows: the candidate rows (the training split).
      fraction: the public share in [0, 1).
      seed: seed of the draw (``np.random.default_rng(seed)``).

    Returns:
      ``(public, private)``: sorted, disjoint, together ``rows``.

    Raises:
      ValueError: a fraction outside [0, 1).
    """
    if not 0.0 <= fraction < 1.0:
        raise ValueError(f"public_fraction must be in [0, 1), got {fraction}")
    rows = np.sort(np.asarray(rows, np.int64))
    if fraction == 0.0:
        return rows[:0], rows
    rng = np.random.default_rng(seed)
    g = np.asarray(groups)[rows]
    public = [rng.permutation(rows[g == c])[: int(round(fraction * np.sum(g == c)))] for c in np.unique(g)]
    pub = np.sort(np.concatenate(public)) if public else rows[:0]
    return pub, np.setdiff1d(rows, pub)


def with_public_pool(task: Any, public_fraction: float | None = None, general_pool: str | None = None) -> Any:
    """``task`` with a config's public pool settings (None keeps the task's own).

    A task takes them when it has the fields ``public_fraction`` / ``general_pool``
    (a frozen dataclass: digits, Fashion-MNIST, :func:`~strategies.tasks.task_from_arrays`).

    Args:
      task: the task.
      public_fraction: the share of the training rows reserved as the public pool, in [0, 1).
      general_pool: one of :data:`GENERAL_POOLS`.

    Returns:
      The task with the settings (the task itself when none is given).

    Raises:
      ValueError: a value the task does not take, or a bad one.
    """
    changes: dict[str, Any] = {}
    name = getattr(task, "name", type(task).__name__)
    fields = {f.name for f in dataclasses.fields(task)} if dataclasses.is_dataclass(task) else set()
    if public_fraction is not None:
        if "public_fraction" not in fields:
            raise ValueError(f"task {name!r} sets its public pool itself: it takes no task.public_fraction")
        if not 0.0 <= float(public_fraction) < 1.0:
            raise ValueError(f"task.public_fraction must be in [0, 1), got {public_fraction}")
        changes["public_fraction"] = float(public_fraction)
    if general_pool is not None:
        if general_pool not in GENERAL_POOLS:
            raise ValueError(f"task.general_pool must be one of {list(GENERAL_POOLS)}, got {general_pool!r}")
        if "general_pool" not in fields:
            if getattr(task, "general_pool", None) == general_pool:
                return dataclasses.replace(task, **changes) if changes else task
            raise ValueError(f"task {name!r} sets its general pool itself: it takes no task.general_pool")
        changes["general_pool"] = general_pool
    return dataclasses.replace(task, **changes) if changes else task


def hosted_nodes(num_nodes: int, process_index: int = 0, process_count: int = 1) -> np.ndarray:
    """The contiguous block of global node ids that process ``process_index`` hosts.

    Contiguous blocks match how a mesh built over ``jax.devices()`` lays the
    "node" axis over processes (each process owns a contiguous run of devices).

    Args:
      num_nodes: the number of nodes over all processes.
      process_index: this process's index.
      process_count: the number of processes.

    Returns:
      The hosted global ids.

    Raises:
      ValueError: for a process index outside [0, process_count), or a node count that is not
        a multiple of the process count.
    """
    if process_count < 1 or not 0 <= process_index < process_count:
        raise ValueError(f"need 0 <= process_index < process_count, got {process_index}, {process_count}")
    if num_nodes % process_count:
        raise ValueError(f"num_nodes={num_nodes} must be a multiple of process_count={process_count}")
    per = num_nodes // process_count
    return np.arange(process_index * per, (process_index + 1) * per)


def dirichlet_partition(
    groups: np.ndarray,
    num_nodes: int,
    alpha: float,
    rng: np.random.Generator,
    *,
    min_size: int = 1,
    max_tries: int = 100,
) -> list[np.ndarray]:
    """Non-IID split of examples over nodes, per-group proportions ~ Dirichlet(alpha).

    For every group g, a vector p_g ~ Dir(alpha * 1_n) splits the examples of g
    over the n nodes (the usual label-skew partition of Hsu et al. 2019). Small
    alpha gives each node a few dominant groups; large alpha tends to IID.
    Redraws (up to ``max_tries``) until every node holds ``min_size`` examples.

    Args:
      groups: (N,) int group (class) of each example.
      num_nodes: n.
      alpha: concentration, > 0.
      rng: numpy Generator (seeded by the caller).
      min_size: smallest acceptable shard.
      max_tries: the most draws before giving up.

    Returns:
      n sorted int arrays of example indices, disjoint, covering all N examples.

    Raises:
      ValueError: for ``alpha <= 0``, ``num_nodes < 1``, too few examples, or no draw within
        ``max_tries`` that gives every node ``min_size`` examples.

    References:
      Hsu, Qi, Brown, "Measuring the effects of non-identical data distribution
      for federated visual classification", 2019.
    """
    if alpha <= 0:
        raise ValueError(f"alpha must be > 0, got {alpha}")
    if num_nodes < 1:
        raise ValueError(f"num_nodes must be >= 1, got {num_nodes}")
    groups = np.asarray(groups)
    if len(groups) < num_nodes * min_size:
        raise ValueError(f"{len(groups)} examples cannot give {num_nodes} nodes {min_size} each")
    for _ in range(max_tries):
        parts: list[list[np.ndarray]] = [[] for _ in range(num_nodes)]
        for g in np.unique(groups):
            idx = rng.permutation(np.flatnonzero(groups == g))
            p = rng.dirichlet(np.full(num_nodes, alpha))
            cuts = (np.cumsum(p)[:-1] * len(idx)).astype(int)
            for i, chunk in enumerate(np.split(idx, cuts)):
                parts[i].append(chunk)
        shards = [np.sort(np.concatenate(p)) for p in parts]
        if min(len(s) for s in shards) >= min_size:
            return shards
    raise ValueError(
        f"could not give every one of {num_nodes} nodes {min_size} examples in {max_tries} Dirichlet draws "
        f"with alpha={alpha}; raise alpha or lower num_nodes"
    )


def dominant_groups(shard_groups: np.ndarray, num_groups: int, *, mass: float = 0.8) -> np.ndarray:
    """The fewest groups that cover ``mass`` of a node's examples (its specialization).

    Args:
      shard_groups: the group of each of the node's examples.
      num_groups: G.
      mass: the share of the examples to cover.

    Returns:
      (G,) bool.
    """
    counts = np.bincount(np.asarray(shard_groups), minlength=num_groups).astype(np.float64)
    order = np.argsort(-counts, kind="stable")
    cum = np.cumsum(counts[order]) / max(counts.sum(), 1.0)
    k = int(np.searchsorted(cum, mass) + 1)
    out = np.zeros(num_groups, bool)
    out[order[:k]] = True
    return out


# --------------------------------------------------------------------------- models


def logical_axes_of_state(state: Any) -> PyTree:
    """Logical axes of an ``nnx.State`` of Params as a pure tree of tuples.

    Reads the ``out_sharding`` metadata set by ``nnx.with_partitioning`` (use
    ``eager_sharding=False`` so modules can be built without a mesh); dims
    without a name get None, so every leaf gets a tuple of length ``ndim``.

    Args:
      state: an ``nnx.State`` (or a pure tree) of Params.

    Returns:
      A pure tree of tuples of axis names.

    Raises:
      ValueError: when a leaf's names outnumber its dimensions.
    """
    from flax import nnx

    def leaf(v):
        names = v.get_metadata().get("out_sharding") if isinstance(v, nnx.Variable) else None
        ndim = len(np.shape(v.get_value() if isinstance(v, nnx.Variable) else v))
        names = tuple(names) if names else ()
        if len(names) > ndim:
            raise ValueError(f"logical axes {names} have more entries than the leaf's {ndim} dims")
        return names + (None,) * (ndim - len(names))

    axes = jax.tree.map(leaf, state, is_leaf=lambda v: isinstance(v, nnx.Variable))
    return nnx.to_pure_dict(axes) if isinstance(axes, nnx.State) else axes


def split_module(module: Any) -> tuple[Any, PyTree, PyTree]:
    """``(graphdef, params, logical_axes)`` of an NNX module; params is a pure dict of arrays.

    Only ``nnx.Param`` variables are trainable params; a module with other
    state (batch statistics, caches) is rejected so nothing is silently lost.

    Args:
      module: an NNX module.

    Returns:
      ``(graphdef, params, logical_axes)``.

    Raises:
      TypeError: when the module holds state other than ``nnx.Param``.
    """
    from flax import nnx

    graphdef, params, rest = nnx.split(module, nnx.Param, ...)  # type: ignore[misc]  # flax's overloads
    if jax.tree_util.tree_leaves(rest):
        raise TypeError("split_module: the module holds non-Param state; a task's only state is its params")
    return graphdef, nnx.to_pure_dict(params), logical_axes_of_state(params)


def cast_floating(tree: PyTree, dtype: Any) -> PyTree:
    """Cast every floating leaf of ``tree`` to ``dtype`` (integers are left alone).

    Args:
      tree: a tree of arrays.
      dtype: the floating dtype.

    Returns:
      The cast tree.
    """
    return jax.tree.map(lambda x: x.astype(dtype) if jnp.issubdtype(x.dtype, jnp.floating) else x, tree)


def param_dtype(params: PyTree) -> Any:
    """The dtype of the first floating leaf (the dtype ``apply`` computes in).

    Args:
      params: a parameter tree.

    Returns:
      That dtype, or float32 when no leaf is floating.
    """
    for x in jax.tree_util.tree_leaves(params):
        if jnp.issubdtype(x.dtype, jnp.floating):
            return x.dtype
    return jnp.float32


def masked_mean(values: Array, mask: Array | None) -> Array:
    """Float32 mean of ``values`` over the entries where ``mask`` is True (all when None).

    Args:
      values: the values.
      mask: a bool mask of their shape, or None.

    Returns:
      A float32 scalar (0 when nothing is masked in).
    """
    values = values.astype(jnp.float32)
    if mask is None:
        return jnp.mean(values)
    m = mask.astype(jnp.float32)
    return jnp.sum(values * m) / jnp.maximum(jnp.sum(m), jnp.float32(1.0))


def cross_entropy(logits: Array, labels: Array) -> Array:
    """Per-example softmax cross entropy in float32 (logits (..., C), int labels (...)).

    Args:
      logits: (..., C) logits.
      labels: (...) integer labels.

    Returns:
      (...) float32 losses.
    """
    logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    return -jnp.take_along_axis(logp, labels[..., None].astype(jnp.int32), axis=-1)[..., 0]


def batch_rows(batch: Batch) -> int:
    """Number of rows of a batch (leading dim of its arrays, checked to agree).

    Args:
      batch: a dict of arrays.

    Returns:
      The row count.

    Raises:
      ValueError: when the arrays disagree on it.
    """
    sizes = {int(np.shape(v)[0]) for v in batch.values()}
    if len(sizes) != 1:
        raise ValueError(f"batch arrays disagree on the number of rows: {sizes}")
    return sizes.pop()
