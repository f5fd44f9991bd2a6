"""Device meshes with axes ("node", "data", "model") and shardings of stacked trees.

A stacked tree (leading node axis) is laid out with its node axis on the mesh's
"node" axis and each model dimension placed by *logical axis rules* (MaxText
style): a model names its dimensions ("embed", "mlp", "heads", "vocab", ...)
and a small table maps each name to a mesh axis, or to nothing (replicated).

* tensor parallel: "mlp", "heads", "vocab" -> "model" (the default rules);
* FSDP style: "embed" -> "data" (``MeshConfig(..., fsdp=True)``), which splits
  the large input dimension of weight matrices over the data-parallel devices.

A rule is applied to a dimension only when the mesh axis has more than one
device, divides the dimension, and is not already used by another dimension of
the same leaf; otherwise that dimension is replicated. So one set of rules
serves every model size and mesh shape.

Multi-host: the mesh is built over ``jax.devices()`` (every process's devices,
process by process), so the "node" axis is split into contiguous blocks, one
block of nodes per process; :func:`global_from_local` assembles a global array
from each process's block without any process reading another's data.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

PyTree = Any
AXES = ("node", "data", "model")

# logical name -> mesh axis (None: replicated). First match wins.
DEFAULT_RULES: tuple[tuple[str, str | None], ...] = (
    ("batch", "data"),
    ("mlp", "model"),
    ("heads", "model"),
    ("kv_heads", "model"),
    ("vocab", "model"),
    ("embed", None),
    ("classes", None),
    ("length", None),
    ("kv", None),
)
FSDP_RULES: tuple[tuple[str, str | None], ...] = (("embed", "data"),) + tuple(
    r for r in DEFAULT_RULES if r[0] != "embed"
)


@dataclasses.dataclass(frozen=True)
class MeshConfig:
    """Shape of a ("node", "data", "model") mesh and the logical axis rules.

    Args:
      node: devices along the node axis (nodes are split over them).
      data: data-parallel devices inside one node (batch split; FSDP params).
      model: tensor-parallel devices inside one node.
      rules: logical axis rules; default :data:`DEFAULT_RULES`, or
        :data:`FSDP_RULES` when ``fsdp`` is True.
      fsdp: use :data:`FSDP_RULES` when ``rules`` is not given.

    Example:
      >>> mesh = make_mesh(MeshConfig(node=4, model=2))  # needs 8 devices
      >>> dict(mesh.shape)
      {'node': 4, 'data': 1, 'model': 2}
    """

    node: int = 1
    data: int = 1
    model: int = 1
    rules: tuple[tuple[str, str | None], ...] | None = None
    fsdp: bool = False

    def __post_init__(self):
        for name in AXES:
            v = getattr(self, name)
            if not isinstance(v, int | np.integer) or v < 1:
                raise ValueError(f"MeshConfig.{name} must be a positive int, got {v!r}")
        for rule in self.resolved_rules:
            if len(rule) != 2 or not isinstance(rule[0], str) or rule[1] not in (None, *AXES):
                raise ValueError(f"bad logical axis rule {rule!r}: need (name, one of {AXES} or None)")

    @property
    def size(self) -> int:
        """The number of devices the mesh needs: node * data * model."""
        return self.node * self.data * self.model

    @property
    def resolved_rules(self) -> tuple[tuple[str, str | None], ...]:
        """The logical axis rules in force: ``rules``, else FSDP's or the default ones."""
        if self.rules is not None:
            # TOML gives lists; __post_init__ checks that each is a (name, axis) pair.
            return tuple(tuple(r) for r in self.rules)  # type: ignore[misc]
        return FSDP_RULES if self.fsdp else DEFAULT_RULES


def make_mesh(config: MeshConfig, devices: Sequence[Any] | None = None) -> Mesh:
    """Build a Mesh with axes ("node", "data", "model") over ``devices`` (default ``jax.devices()``).

    With more devices than ``config.size`` in one process, the first
    ``config.size`` are used; across processes the mesh must cover every
    device (each process contributes its own block of nodes).

    Args:
      config: The mesh's shape.
      devices: The devices, or None for ``jax.devices()``.

    Returns:
      The ``jax.sharding.Mesh``.

    Raises:
      ValueError: If there are too few devices, or a multi-process mesh leaves some out.
    """
    devices = list(jax.devices() if devices is None else devices)
    if config.size > len(devices):
        raise ValueError(
            f"mesh node={config.node} x data={config.data} x model={config.model} needs "
            f"{config.size} devices, only {len(devices)} available"
        )
    if config.size < len(devices) and jax.process_count() > 1:
        raise ValueError(
            f"multi-process meshes must use all {len(devices)} devices, the config covers {config.size}"
        )
    grid = np.array(devices[: config.size], dtype=object).reshape(config.node, config.data, config.model)
    return Mesh(grid, AXES)


def logical_to_spec(
    shape: Sequence[int],
    logical: Sequence[str | None] | None,
    mesh: Mesh,
    rules: Any = DEFAULT_RULES,
) -> tuple[str | None, ...]:
    """Return the mesh-axis entries for one (unstacked) leaf, following the logical rules.

    A dimension gets its mesh axis only when that axis has > 1 device, divides
    the dimension, and is not taken by an earlier dimension of the leaf; names
    without a rule are replicated. The "node" axis is never used here.

    Args:
      shape: The leaf's shape.
      logical: One logical name (or None) per dimension, or None to replicate.
      mesh: The mesh.
      rules: Logical axis rules (pairs, a dict or a MeshConfig).

    Returns:
      One mesh axis or None per dimension (a PartitionSpec's entries).

    Raises:
      ValueError: If ``logical`` has more entries than the shape, or a name maps to "node".
    """
    rules = rules_dict(rules)
    logical = tuple(logical) if logical is not None else ()
    if len(logical) > len(shape):
        raise ValueError(f"logical axes {logical} have more entries than the shape {tuple(shape)}")
    logical = logical + (None,) * (len(shape) - len(logical))
    used: set[str | None] = set()
    spec: list[str | None] = []
    for dim, name in zip(shape, logical, strict=True):
        axis = rules.get(name) if name is not None else None
        if axis == "node":
            raise ValueError(f"logical axis {name!r} maps to 'node', reserved for the stacked node axis")
        size = mesh.shape.get(axis, 1) if axis is not None else 1
        ok = axis is not None and axis not in used and size > 1 and dim % size == 0
        spec.append(axis if ok else None)
        if ok:
            used.add(axis)
    return tuple(spec)


def rules_dict(rules: Any) -> dict[str, str | None]:
    """Return logical axis rules (pairs, a dict or a MeshConfig) as a dict; the first rule for a name wins.

    Args:
      rules: Pairs ``(name, axis)``, a dict or a :class:`MeshConfig`.

    Returns:
      Logical name -> mesh axis (or None).
    """
    if isinstance(rules, MeshConfig):
        rules = rules.resolved_rules
    if isinstance(rules, Mapping):
        return dict(rules)
    out: dict[str, str | None] = {}
    for name, axis in rules:
        out.setdefault(name, axis)
    return out


def param_sharding(
    params: PyTree, logical_axes: PyTree | None, mesh: Mesh, rules: Any = DEFAULT_RULES
) -> PyTree:
    """Return the NamedSharding of every leaf of a single (unstacked) tree, replicated over "node".

    Args:
      params: The tree (arrays or ``jax.ShapeDtypeStruct``).
      logical_axes: A tree of its structure with a tuple of logical names per leaf, or None.
      mesh: The mesh.
      rules: Logical axis rules (pairs, a dict or a MeshConfig).

    Returns:
      A tree of NamedSharding with the structure of ``params``.

    Raises:
      ValueError: If ``logical_axes`` does not have the params' structure or a leaf's names
        do not fit it.
    """
    rules = rules_dict(rules)
    axes = _axes_like(params, logical_axes)
    return jax.tree.map(
        lambda p, a: NamedSharding(mesh, PartitionSpec(*logical_to_spec(np.shape(p), a, mesh, rules))),
        params,
        axes,
        is_leaf=_is_axes_leaf,
    )


def stacked_sharding(
    stacked: PyTree, logical_axes: PyTree | None, mesh: Mesh, rules: Any = DEFAULT_RULES
) -> PyTree:
    """NamedSharding ``P("node", *spec)`` for every leaf of a stacked tree.

    Args:
      stacked: stacked tree (arrays or ``jax.ShapeDtypeStruct``), leaves (n, ...).
      logical_axes: tree of the *unstacked* params' structure with a tuple of
        logical names per leaf (None: replicate every model dim).
      mesh: a ("node", "data", "model") mesh; n must be a multiple of its
        "node" size.
      rules: logical axis rules, a MeshConfig, or a dict.

    Returns:
      A tree of NamedSharding with the structure of ``stacked``.

    Raises:
      ValueError: If a leaf has no node axis, n does not split over the "node" axis, or
        ``logical_axes`` does not fit the params.
    """
    rules = rules_dict(rules)
    axes = _axes_like(stacked, logical_axes)
    n_node = mesh.shape["node"]

    def leaf(x, a):
        shape = np.shape(x)
        if not shape:
            raise ValueError("stacked_sharding: a stacked leaf must have a leading node axis, got a scalar")
        if shape[0] % n_node:
            raise ValueError(f"stacked_sharding: {shape[0]} nodes do not split over a node axis of {n_node}")
        return NamedSharding(mesh, PartitionSpec("node", *logical_to_spec(shape[1:], a, mesh, rules)))

    return jax.tree.map(leaf, stacked, axes, is_leaf=_is_axes_leaf)


def node_sharding(mesh: Mesh) -> NamedSharding:
    """Return ``P("node")`` on dim 0 (per-node data, keys, hyperparameters); the rest replicated.

    Args:
      mesh: The mesh.

    Returns:
      The NamedSharding.
    """
    return NamedSharding(mesh, PartitionSpec("node"))


def replicated(mesh: Mesh) -> NamedSharding:
    """Return the sharding replicated over the whole mesh (shared data, anchors).

    Args:
      mesh: The mesh.

    Returns:
      The NamedSharding.
    """
    return NamedSharding(mesh, PartitionSpec())


def _is_axes_leaf(x: Any) -> bool:
    return x is None or (isinstance(x, tuple) and all(isinstance(a, str | None) for a in x))


def _axes_like(tree: PyTree, logical_axes: PyTree | None) -> PyTree:
    if logical_axes is None:
        return jax.tree.map(lambda _: None, tree)
    try:
        jax.tree.map(lambda a, x: None, logical_axes, tree, is_leaf=_is_axes_leaf)
    except ValueError as e:
        raise ValueError(f"logical_axes does not have the structure of the params tree: {e}") from None
    return logical_axes


def opt_state_sharding(
    opt_state: PyTree, stacked_params: PyTree, param_shardings: PyTree, mesh: Mesh
) -> PyTree:
    """Return the shardings of a stacked optimizer state: leaves that mirror a param take its sharding.

    An optimizer-state leaf whose path ends with a param's path and whose shape
    equals that param's (Adam's mu and nu, momentum traces, MultiSteps'
    accumulators) is placed like the param; everything else (step counts,
    injected hyperparameters) is ``P("node")``.

    Args:
      opt_state: The stacked optimizer state.
      stacked_params: The stacked params it optimizes.
      param_shardings: Their shardings (as :func:`stacked_sharding` gives).
      mesh: The mesh.

    Returns:
      A tree of NamedSharding with the structure of ``opt_state``.
    """
    p_flat, _ = jax.tree_util.tree_flatten_with_path(stacked_params)
    s_flat = jax.tree_util.tree_leaves(param_shardings)
    by_path = {
        jax.tree_util.keystr(path): (np.shape(x), s) for (path, x), s in zip(p_flat, s_flat, strict=True)
    }
    default = NamedSharding(mesh, PartitionSpec("node"))

    def leaf(path, x):
        key = jax.tree_util.keystr(path)
        shape = np.shape(x)
        for p_key, (p_shape, s) in by_path.items():
            if key.endswith(p_key) and p_shape == shape:
                return s
        if not shape:
            return replicated(mesh)
        return default

    return jax.tree_util.tree_map_with_path(leaf, opt_state)


def global_from_local(
    local: Any, sharding: NamedSharding, global_shape: Sequence[int] | None = None
) -> jax.Array:
    """Build a global array from this process's block (multi-host), or a plain ``device_put``.

    Per-node arrays: ``local`` holds this process's nodes (rows of dim 0) and
    ``global_shape`` the shape over all nodes. Replicated arrays: every process
    passes the same full value.

    Args:
      local: This process's block (or the full value).
      sharding: The target sharding.
      global_shape: The shape over all processes, or None when ``local`` is the whole array.

    Returns:
      The (global) jax array.
    """
    if jax.process_count() == 1:
        return jax.device_put(local, sharding)
    local = np.asarray(local)
    shape = None if global_shape is None else tuple(global_shape)
    return jax.make_array_from_process_local_data(sharding, local, shape)


def to_host(tree: PyTree) -> PyTree:
    """Return numpy copies of (possibly sharded, multi-process) arrays, gathered in full on every process.

    Args:
      tree: A tree of arrays.

    Returns:
      The same tree of numpy arrays.
    """
    if jax.process_count() == 1:
        return jax.tree.map(lambda x: np.asarray(jax.device_get(x)), tree)
    from jax.experimental import multihost_utils

    def one(x: Any) -> np.ndarray:
        # Only arrays spread over other processes' devices need a collective gather: process-local
        # values (numpy, single-device arrays) are already whole here, and a replicated global array
        # has a full copy on this process. Every process must call this on the same tree.
        if not isinstance(x, jax.Array) or x.is_fully_addressable:
            return np.asarray(x)
        if x.is_fully_replicated:
            return np.asarray(x.addressable_data(0))
        return np.asarray(multihost_utils.process_allgather(x, tiled=True))

    return jax.tree.map(one, tree)


def shard_stacked(stacked: PyTree, shardings: PyTree) -> PyTree:
    """Place a stacked tree (all nodes present on this host) with the given shardings.

    Args:
      stacked: The stacked tree.
      shardings: A tree of shardings like it.

    Returns:
      The placed tree.
    """
    return jax.tree.map(lambda x, s: jax.device_put(x, s), stacked, shardings)


def unshard(tree: PyTree) -> PyTree:
    """Gather a placed tree back into host numpy arrays (the inverse of :func:`shard_stacked`).

    Args:
      tree: A tree of (sharded) arrays.

    Returns:
      The same tree of numpy arrays.
    """
    return to_host(tree)
