"""LoRA on the node side: train low-rank adapters of chosen kernels on a frozen base.

A *target* is a kernel ``W`` of the model's params tree, named by its '/'-joined path
(``block_0/attn/query``) and selected by a regular expression over it or, as PEFT names
modules, by a bare module name that is one of its components (``q_proj`` selects
``model/layers/0/self_attn/q_proj/kernel``); an n-D kernel is viewed as ``(shape[0], prod(shape[1:]))``, the
layout agreed with :mod:`consensus.lora`. Its adapter is ``a (in, r)``, ``b (r, out)`` and the
model the node trains is the base with every target replaced by

    W + scale * (a @ b).reshape(W.shape),    scale = alpha / r.

An *adapter tree* is ``{path: {"a": a, "b": b}}``. ``a`` starts as PEFT's ``lora_A`` (Kaiming
uniform with ``a = sqrt(5)``: U(-1/sqrt(in), 1/sqrt(in))) and ``b`` at zero, so the first
update is exactly zero.

:class:`LoraTask` wraps any task whose params are a pure tree (every task of the package: Flax
NNX modules split to pure dicts) so that the *trainable* params the node trainer, the
strategies, the attacks, DP-SGD and the checkpoints see are the adapters only; the frozen part
(the base, and ``a`` under FFA-LoRA) is handed in as ``frozen=`` (see
:meth:`strategies.trainer.NodeTrainer.fit`): it is not stacked over the nodes, has no gradient
and no optimizer state, so memory and bytes on the wire scale with the adapters.

FFA-LoRA (``freeze_a``): ``a`` is drawn once from the run's key (the same for every node) and
frozen; the trainable tree is ``{path: {"b": b}}`` and the product ``a @ b`` is then linear in
the trained parameters, so the mean of the nodes' ``b`` gives exactly the mean of their updates.

Dropout (``dropout > 0``) acts on the adapter's input path: a keep mask over the ``in``
features of ``a`` (rows of ``a`` zeroed and the rest scaled by ``1 / (1 - p)``), drawn per
training step from the loss key. PEFT draws it per token; with the update merged into the
kernel the mask is shared by the step's rows (a feature-level dropout of the adapter input).

References:
  Hu et al., "LoRA: Low-Rank Adaptation of Large Language Models", ICLR 2022.
  Sun et al., "Improving LoRA in Privacy-preserving Federated Learning" (FFA-LoRA), ICLR 2024.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from strategies.tasks.base import Array, Batch, PyTree, Task, TaskData

#: The targets of the byte-level transformer (:mod:`strategies.tasks.text`): attention
#: projections and the MLP kernels (the output projection is left out: its 3-D kernel's
#: ``in`` axis is the heads axis).
DEFAULT_TARGETS: tuple[str, ...] = (r"attn/(query|key|value)$", r"mlp/(wi|wo)$")


class LoraError(ValueError):
    """A LoRA setting that does not fit the model (a target that matches nothing, a bad rank)."""


def path_name(path: Sequence[Any]) -> str:
    """The '/'-joined name of a ``jax.tree_util`` key path (``block_0/attn/query``).

    Args:
      path: a key path (dict keys, sequence indices, attribute names).

    Returns:
      The name.
    """
    parts = []
    for k in path:
        for attr in ("key", "idx", "name"):
            if hasattr(k, attr):
                parts.append(str(getattr(k, attr)))
                break
        else:
            parts.append(str(k))
    return "/".join(parts)


def kernel_paths(params: PyTree) -> dict[str, tuple[int, ...]]:
    """Every leaf of ``params`` with at least 2 dimensions: ``{path: shape}`` (the possible targets).

    Args:
      params: a parameter tree.

    Returns:
      The shapes by '/'-joined path.
    """
    return {
        path_name(p): tuple(int(d) for d in np.shape(x))
        for p, x in jax.tree_util.tree_leaves_with_path(params)
        if np.ndim(x) >= 2
    }


def matrix_shape(shape: Sequence[int]) -> tuple[int, int]:
    """``(in, out)`` of a kernel of ``shape`` viewed as a matrix: ``(shape[0], prod(shape[1:]))``.

    Args:
      shape: the kernel's shape (2 or more dimensions).

    Returns:
      ``(in, out)``.
    """
    return int(shape[0]), int(math.prod(shape[1:]))


#: A PEFT-style target: a module name (``q_proj``) or dotted module path (``self_attn.q_proj``).
_BARE_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z0-9_]+)*")


def target_matcher(pattern: str) -> Any:
    """``path -> bool`` of one target: a PEFT module name, or a regular expression.

    A bare name (``q_proj``, or dotted ``self_attn.q_proj``) matches the kernels with that run
    of path components (``model/layers/0/self_attn/q_proj/kernel``), as PEFT's
    ``target_modules`` match module names; anything else is a regular expression searched in
    the '/'-joined path (``attn/(query|key)$``).

    Args:
      pattern: the target.

    Returns:
      The predicate.

    Raises:
      LoraError: a pattern that is neither a name nor a regular expression.
    """
    if _BARE_NAME.fullmatch(pattern):
        run = "/" + pattern.replace(".", "/") + "/"
        return lambda path: run in "/" + path + "/"
    try:
        rx = re.compile(pattern)
    except re.error as e:
        raise LoraError(f"target {pattern!r} is not a regular expression: {e}") from None
    return lambda path: rx.search(path) is not None


def select_targets(params: PyTree, patterns: Sequence[str]) -> dict[str, tuple[int, ...]]:
    """The kernels one of ``patterns`` selects (:func:`target_matcher`): ``{path: shape}``.

    Args:
      params: the model's parameters.
      patterns: PEFT module names (``q_proj``) or regular expressions over '/'-joined paths.

    Returns:
      The matched kernels' shapes by path, sorted.

    Raises:
      LoraError: a pattern that is not a name or a regular expression, or matches no kernel
        (the message names it and lists some valid paths).
    """
    if isinstance(patterns, str) or not patterns:
        raise LoraError(
            f"targets must be a non-empty list of module names or regular expressions, got {patterns!r}"
        )
    kernels = kernel_paths(params)
    out: dict[str, tuple[int, ...]] = {}
    for pattern in patterns:
        matches = target_matcher(pattern)
        hit = {p: s for p, s in kernels.items() if matches(p)}
        if not hit:
            some = ", ".join(list(kernels)[:8])
            raise LoraError(
                f"target {pattern!r} matches no kernel (a parameter of 2 or more dimensions); "
                f"valid paths include: {some}"
            )
        out.update(hit)
    return dict(sorted(out.items()))


def check_rank(rank: Any, targets: Mapping[str, tuple[int, ...]]) -> None:
    """Check that ``rank`` is an integer >= 1 and below every target's ``min(in, out)``.

    Args:
      rank: the adapters' rank.
      targets: the target kernels' shapes by path.

    Raises:
      LoraError: otherwise, naming the smallest target.
    """
    if isinstance(rank, bool) or not isinstance(rank, int | np.integer) or rank < 1:
        raise LoraError(f"rank must be an integer >= 1, got {rank!r}")
    for path, shape in targets.items():
        m, k = matrix_shape(shape)
        if rank >= min(m, k):
            raise LoraError(
                f"rank {rank} is not below min(in, out) = {min(m, k)} of target {path!r} {list(shape)}: "
                "the adapter would not be low-rank"
            )


def init_adapter(
    key: Array, targets: Mapping[str, tuple[int, ...]], rank: int
) -> dict[str, dict[str, Array]]:
    """A fresh adapter tree: ``a ~ U(-1/sqrt(in), 1/sqrt(in))`` (PEFT's Kaiming init) and ``b = 0``.

    Target j draws its ``a`` from ``split(key, len(targets))[j]`` in sorted path order, so the
    same key gives every node the same ``a`` (FFA-LoRA's shared frozen factor).

    Args:
      key: a JAX PRNG key.
      targets: the target kernels' shapes by path.
      rank: r.

    Returns:
      ``{path: {"a": (in, r), "b": (r, out)}}``, float32.
    """
    keys = jax.random.split(key, max(len(targets), 1))
    out = {}
    for k, (path, shape) in zip(keys, sorted(targets.items()), strict=False):
        m, n = matrix_shape(shape)
        bound = 1.0 / math.sqrt(m)
        out[path] = {
            "a": jax.random.uniform(k, (m, rank), jnp.float32, -bound, bound),
            "b": jnp.zeros((rank, n), jnp.float32),
        }
    return out


def merge_adapter(base: PyTree, adapter: Mapping[str, Mapping[str, Array]], scale: float) -> PyTree:
    """``base`` with every target kernel ``W`` replaced by ``W + scale * (a @ b).reshape(W.shape)``.

    Computed in the base's dtype; ``base`` is not changed (a new tree is returned).

    Args:
      base: the base params.
      adapter: ``{path: {"a", "b"}}`` of the targets.
      scale: the LoRA scale ``alpha / rank``.

    Returns:
      The merged params.
    """

    def leaf(path: Any, w: Array) -> Array:
        ab = adapter.get(path_name(path))
        return w if ab is None else _merged(w, ab, scale)

    return jax.tree_util.tree_map_with_path(leaf, base)


def _merged(w: Array, ab: Mapping[str, Array], scale: float) -> Array:
    dt = w.dtype
    delta = jnp.asarray(scale, dt) * (ab["a"].astype(dt) @ ab["b"].astype(dt))
    return w + delta.reshape(w.shape)


def low_rank_params(base: PyTree, adapter: Mapping[str, Mapping[str, Array]], scale: float) -> PyTree:
    """``base`` with every 2-D target kernel wrapped with its adapter, unmerged (a LowRankKernel).

    A target whose kernel is not ``(in, out)`` with ``a: (in, r)`` and ``b: (r, out)`` is merged
    as :func:`merge_adapter` does.

    Args:
      base: the base params.
      adapter: ``{path: {"a", "b"}}`` of the targets.
      scale: the LoRA scale ``alpha / rank``.

    Returns:
      The params, each such kernel leaf a :class:`~strategies.models.layers.LowRankKernel`.
    """
    from strategies.models.layers import LowRankKernel

    def leaf(path: Any, w: Array) -> Any:
        ab = adapter.get(path_name(path))
        if ab is None:
            return w
        a, b = ab["a"], ab["b"]
        if w.ndim == 2 and a.shape == (w.shape[0], a.shape[-1]) and b.shape == (a.shape[-1], w.shape[1]):
            return LowRankKernel(w, a.astype(w.dtype), b.astype(w.dtype), float(scale))
        return _merged(w, ab, scale)

    return jax.tree_util.tree_map_with_path(leaf, base)


def add_base_delta(base: PyTree, delta: Mapping[str, Array] | None) -> PyTree:
    """``base`` plus a dense ``{path: (in, out)}`` update (a merge method's ``base_delta``).

    Args:
      base: the base params.
      delta: the update by target path, or None.

    Returns:
      The updated params (``base`` itself without an update).
    """
    if not delta:
        return base

    def leaf(path: Any, w: Array) -> Array:
        d = delta.get(path_name(path))
        return w if d is None else w + jnp.asarray(d, w.dtype).reshape(w.shape)

    return jax.tree_util.tree_map_with_path(leaf, base)


def tree_bytes(tree: PyTree) -> int:
    """Bytes of every array leaf of ``tree`` (what it costs on the wire, uncompressed).

    Args:
      tree: a tree of arrays.

    Returns:
      The byte count.
    """
    return int(sum(np.dtype(x.dtype).itemsize * math.prod(np.shape(x)) for x in jax.tree.leaves(tree)))


def tree_size(tree: PyTree) -> int:
    """Number of scalars in ``tree``.

    Args:
      tree: a tree of arrays.

    Returns:
      The count.
    """
    return int(sum(math.prod(np.shape(x)) for x in jax.tree.leaves(tree)))


@dataclasses.dataclass(frozen=True)
class LoraSettings:
    """The ``[nodes.lora]`` settings.

    Attributes:
      rank: r, the adapters' rank.
      alpha: the scale is ``alpha / rank``.
      targets: PEFT module names (``q_proj``: a run of path components) or regular expressions
        over '/'-joined parameter paths (``re.search``); see :func:`target_matcher`.
      dropout: dropout rate on the adapter's input path (0: off).
      freeze_a: FFA-LoRA: ``a`` is shared and frozen, the nodes train ``b`` only.
      pretrain_steps: a run's coordinator first trains the base for this many Adam steps on the
        task's general (public) pool, apart from every node's shard (0: the base is the task's
        init, or ``init_from``, as it is).
    """

    rank: int = 4
    alpha: float = 8.0
    targets: tuple[str, ...] = DEFAULT_TARGETS
    dropout: float = 0.0
    freeze_a: bool = False
    pretrain_steps: int = 0

    @property
    def scale(self) -> float:
        """``alpha / rank``."""
        return float(self.alpha) / float(self.rank)

    def check(self) -> None:
        """Check the values alone (the targets are checked against a model by :class:`LoraTask`).

        Raises:
          LoraError: for a rank, alpha, dropout, ``pretrain_steps`` or targets out of range.
        """
        if isinstance(self.rank, bool) or not isinstance(self.rank, int) or self.rank < 1:
            raise LoraError(f"rank must be an integer >= 1, got {self.rank!r}")
        if not isinstance(self.alpha, int | float) or not math.isfinite(self.alpha) or self.alpha <= 0:
            raise LoraError(f"alpha must be a finite number > 0, got {self.alpha!r}")
        if not 0.0 <= float(self.dropout) < 1.0:
            raise LoraError(f"dropout must be in [0, 1), got {self.dropout!r}")
        steps = self.pretrain_steps
        if isinstance(steps, bool) or not isinstance(steps, int) or steps < 0:
            raise LoraError(f"pretrain_steps must be an integer >= 0, got {steps!r}")
        if isinstance(self.targets, str) or not self.targets:
            raise LoraError(f"targets must be a non-empty list of regular expressions, got {self.targets!r}")


@dataclasses.dataclass(frozen=True, eq=False)
class LoraTask:
    """A task whose trainable params are the LoRA adapters of ``base_task``'s targets.

    Every method that runs the model takes the frozen part as ``frozen=`` (the dict
    ``{"base": base params, "a": {path: a}}``, ``"a"`` empty unless ``freeze_a``); without it the
    task's own ``frozen`` (the base the task was built with) is used, so ``LoraTask`` is a plain
    :class:`~strategies.tasks.base.Task` too. Compare by identity: one object per run, so
    compiled steps are shared by every round whatever the base becomes.

    Args:
      base_task: the task of the full model.
      settings: the LoRA settings.
      base: the base params (the pretrained model).
      key: the key of ``a`` (FFA-LoRA's shared ``a``, and the adapter of :meth:`init`).

    Raises:
      LoraError: for settings out of range, a target that matches no kernel, or a rank not
        below a target's ``min(in, out)``.
    """

    base_task: Task
    settings: LoraSettings
    base: PyTree
    key: Array
    targets: dict[str, tuple[int, ...]] = dataclasses.field(init=False, repr=False)
    name: str = dataclasses.field(init=False, default="lora")
    kind: str = dataclasses.field(init=False, default="classification")

    def __post_init__(self):
        self.settings.check()
        targets = select_targets(self.base, self.settings.targets)
        check_rank(self.settings.rank, targets)
        object.__setattr__(self, "targets", targets)
        object.__setattr__(self, "name", f"lora({getattr(self.base_task, 'name', 'task')})")
        object.__setattr__(self, "kind", getattr(self.base_task, "kind", "classification"))

    @property
    def scale(self) -> float:
        """``alpha / rank``."""
        return self.settings.scale

    # ------------------------------------------------------------------ trees

    def fresh_adapter(self, key: Array | None = None) -> dict[str, dict[str, Array]]:
        """A full adapter tree (``a`` and ``b``) from ``key`` (default the task's key).

        Args:
          key: a JAX PRNG key.

        Returns:
          ``{path: {"a", "b"}}`` (:func:`init_adapter`).
        """
        return init_adapter(self.key if key is None else key, self.targets, self.settings.rank)

    def initial_frozen(self, base: PyTree | None = None, key: Array | None = None) -> dict[str, Any]:
        """The frozen part of a run: ``{"base": base, "a": the shared a (FFA) or {}}``.

        Args:
          base: the base params (default the task's).
          key: the key of the shared ``a`` under ``freeze_a`` (default the task's).

        Returns:
          The frozen part.
        """
        base = self.base if base is None else base
        if not self.settings.freeze_a:
            return {"base": base, "a": {}}
        return {"base": base, "a": {p: {"a": v["a"]} for p, v in self.fresh_adapter(key).items()}}

    def trainable(self, adapter: Mapping[str, Mapping[str, Array]]) -> dict[str, dict[str, Array]]:
        """The part of a full adapter tree the nodes train (``b`` only under ``freeze_a``).

        Args:
          adapter: a full adapter tree.

        Returns:
          ``{path: {"a", "b"}}``, or ``{path: {"b"}}`` under ``freeze_a``.
        """
        if self.settings.freeze_a:
            return {p: {"b": v["b"]} for p, v in adapter.items()}
        return {p: {"a": v["a"], "b": v["b"]} for p, v in adapter.items()}

    def full_adapter(self, params: Mapping[str, Mapping[str, Array]], frozen: Mapping[str, Any]) -> dict:
        """Trainable params plus the frozen ``a`` (FFA): a full ``{path: {"a", "b"}}`` tree.

        Works on single and stacked trees (the frozen ``a`` is broadcast over a node axis).

        Args:
          params: the trainable params.
          frozen: the frozen part (its ``"a"`` under ``freeze_a``).

        Returns:
          The full adapter tree.
        """
        fixed = frozen.get("a") or {}
        out = {}
        for p, v in params.items():
            if "a" in v:
                out[p] = {"a": v["a"], "b": v["b"]}
            else:
                a = fixed[p]["a"]
                b = v["b"]
                if b.ndim == 3:  # stacked
                    a = jnp.broadcast_to(a, (b.shape[0], *a.shape))
                out[p] = {"a": a, "b": b}
        return out

    def init(self, key: Array) -> dict[str, dict[str, Array]]:
        """Trainable params of a fresh adapter from ``key`` (``b = 0``: the model is the base).

        Args:
          key: a JAX PRNG key.

        Returns:
          The trainable params.
        """
        return self.trainable(self.fresh_adapter(key))

    def model_params(self, params: PyTree, frozen: Mapping[str, Any] | None = None, key: Array | None = None):
        """The full model's params: the base with the adapters applied (dropout when ``key``).

        For a base task that declares ``low_rank_kernels = True`` (its model runs every target
        through :class:`strategies.models.layers.Linear`), each 2-D target kernel becomes a
        :class:`~strategies.models.layers.LowRankKernel` that applies the adapter beside the
        frozen kernel, so the step never computes the frozen kernels' gradients; otherwise
        ``W + scale a b`` is merged into the kernel (:func:`merge_adapter`). Both give the same
        model up to rounding.

        Args:
          params: the trainable params.
          frozen: the frozen part (default: the task's own).
          key: the key of the adapter dropout (None: no dropout).

        Returns:
          The merged params.
        """
        frozen = self.initial_frozen() if frozen is None else frozen
        adapter = self.full_adapter(params, frozen)
        rate = float(self.settings.dropout)
        if key is not None and rate > 0:
            keys = jax.random.split(key, len(adapter))
            adapter = {
                p: {"a": _drop_rows(v["a"], rate, k), "b": v["b"]}
                for k, (p, v) in zip(keys, sorted(adapter.items()), strict=True)
            }
        if getattr(self.base_task, "low_rank_kernels", False):
            return low_rank_params(frozen["base"], adapter, self.scale)
        return merge_adapter(frozen["base"], adapter, self.scale)

    # ------------------------------------------------------------------ Task protocol

    def apply(
        self,
        params: PyTree,
        inputs: Array,
        *,
        train: bool = False,
        key: Array | None = None,
        frozen: Mapping[str, Any] | None = None,
    ) -> Array:
        """The base task's ``apply`` on the merged model.

        Args:
          params: the trainable params.
          inputs: a batch of inputs.
          train: training mode (adapter and model dropout).
          key: the dropout key in training mode.
          frozen: the frozen part (default: the task's own).

        Returns:
          The base task's outputs.
        """
        k_lora, k_model = jax.random.split(key) if key is not None else (None, None)
        full = self.model_params(params, frozen, k_lora if train else None)
        return self.base_task.apply(full, inputs, train=train, key=k_model)

    def loss(
        self,
        params: PyTree,
        batch: Batch,
        key: Array | None = None,
        *,
        frozen: Mapping[str, Any] | None = None,
    ) -> Array:
        """The base task's loss of the merged model (adapter dropout from ``key``).

        Args:
          params: the trainable params.
          batch: a training batch.
          key: the dropout key (adapter and model).
          frozen: the frozen part (default: the task's own).

        Returns:
          A float32 scalar.
        """
        k_lora, k_model = jax.random.split(key) if key is not None else (None, None)
        return self.base_task.loss(self.model_params(params, frozen, k_lora), batch, k_model)

    def metrics(
        self, params: PyTree, batch: Batch, *, frozen: Mapping[str, Any] | None = None
    ) -> dict[str, Array]:
        """The base task's metrics of the merged model.

        Args:
          params: the trainable params.
          batch: an evaluation batch.
          frozen: the frozen part (default: the task's own).

        Returns:
          The metrics.
        """
        return self.base_task.metrics(self.model_params(params, frozen), batch)

    def logical_axes(self, params: PyTree | None = None) -> PyTree:
        """No logical axes: adapters are small and replicated.

        Args:
          params: the trainable params (default: a fresh adapter's).

        Returns:
          A tree of all-None tuples, one entry per leaf dimension.
        """
        example = self.init(self.key) if params is None else params
        return jax.tree.map(lambda x: (None,) * np.ndim(x), example)

    def flip_labels(self, batch: Batch) -> Batch:
        """The base task's label flipping.

        Args:
          batch: a training batch.

        Returns:
          The batch with corrupted targets.
        """
        return self.base_task.flip_labels(batch)

    def splits(
        self,
        num_nodes: int,
        *,
        seed: int = 0,
        alpha: float = 0.5,
        process_index: int = 0,
        process_count: int = 1,
    ) -> TaskData:
        """The base task's data.

        Args:
          num_nodes: the number of nodes over all processes.
          seed: the data seed.
          alpha: the Dirichlet concentration.
          process_index: this process's index.
          process_count: the number of processes.

        Returns:
          The base task's splits.
        """
        return self.base_task.splits(
            num_nodes, seed=seed, alpha=alpha, process_index=process_index, process_count=process_count
        )

    def __getattr__(self, name: str) -> Any:
        # Anything else a caller reads of a task (public pools, options) is the base task's.
        if name.startswith("_") or name in ("targets", "name"):
            raise AttributeError(name)
        return getattr(self.base_task, name)

    # ------------------------------------------------------------------ sizes

    def sizes(self) -> dict[str, int]:
        """Scalars and float32 bytes: the model, the full adapter, and what a node trains and sends.

        Returns:
          Counts by name (``model_params``, ``model_bytes``, ``adapter_params``, ...).
        """
        full = self.fresh_adapter()
        sent = self.trainable(full)
        return {
            "model_params": tree_size(self.base),
            "model_bytes": tree_bytes(self.base),
            "adapter_params": tree_size(full),
            "adapter_bytes": tree_bytes(full),
            "trainable_params": tree_size(sent),
            "trainable_bytes": tree_bytes(sent),
        }


def _drop_rows(a: Array, rate: float, key: Array) -> Array:
    keep = jax.random.bernoulli(key, 1.0 - rate, (a.shape[0], 1))
    return jnp.where(keep, a / jnp.asarray(1.0 - rate, a.dtype), jnp.zeros_like(a))


def lora_task(base_task: Task, settings: LoraSettings, base: PyTree, key: Array) -> LoraTask:
    """A :class:`LoraTask` (a one-line :class:`LoraError` when the targets or rank do not fit).

    Args:
      base_task: the task of the full model.
      settings: the LoRA settings.
      base: the base params.
      key: the key of ``a``.

    Returns:
      The task.

    Raises:
      LoraError: when the settings, targets or rank do not fit.
    """
    return LoraTask(base_task, settings, base, key)


# --------------------------------------------------------------------------- the round's merge


@dataclasses.dataclass(frozen=True)
class RoundMerge:
    """What one round's adapter consensus hands to the next round.

    Attributes:
      params: the trainable params every node starts the next round from (at the task's scale).
      frozen: the frozen part for the next round (the base plus the method's ``base_delta``).
      base_delta: the dense ``{path: (in, out)}`` update added to the base (None: none).
      info: the method's diagnostics (``consensus.lora.AdapterMerge.info``) plus ``bytes_up``
        and ``bytes_down`` (per node: what it sends, and what the coordinator broadcasts:
        the adapter's trainable part and any base delta), ``rank_out`` and, with ``measure``,
        ``deviation`` (see :func:`merge_round`).
    """

    params: dict[str, dict[str, Array]]
    frozen: dict[str, Any]
    base_delta: dict[str, Array] | None
    info: dict[str, Any]


def merge_round(
    task: LoraTask,
    frozen: Mapping[str, Any],
    stacked: Mapping[str, Mapping[str, Array]],
    *,
    method: str,
    rule: Any = None,
    space: str = "products",
    weights: Any = None,
    key: Array | None = None,
    measure: bool = False,
    start: Mapping[str, Mapping[str, Array]] | None = None,
) -> RoundMerge:
    """One round's adapter consensus: stacked node adapters -> the next round's adapter and base.

    Calls :func:`consensus.lora.merge_adapters` on the nodes' full adapters (the shared frozen
    ``a`` attached under FFA-LoRA). A merged adapter of another rank than the task's (FLoRA's
    stack, rank n r) is folded into the base and the nodes restart from a fresh adapter drawn
    from ``key`` (``b = 0``: the model is unchanged); otherwise the merged adapter is rescaled
    to the task's scale (its ``b`` times ``scale_out / scale``, the same update). A ``base_delta``
    is added to the base.

    Args:
      task: the run's :class:`LoraTask`.
      frozen: the round's frozen part (``{"base", "a"}``).
      stacked: the valid nodes' trainable params, stacked (node axis 0).
      method: an adapter method (``consensus.lora`` ``ADAPTER_METHODS``: fedit, ffa, stack, svd,
        exact_residual, ...).
      rule: a robust Aggregator (``consensus.registry.make(name, f)``) or None.
      space: where ``rule`` acts: "products" or "factors".
      weights: (n,) node weights (None: uniform).
      key: key of the fresh adapter / randomized rules.
      measure: also report ``deviation``, the relative L2 distance of the merged update from the
        weighted mean of the nodes' updates ``sum_i w_i s a_i b_i`` (0 for an exact method),
        over every target; dense (in, out) products, so for small models and benchmarks.
      start: the trainable params the nodes started the round from; with ``measure``, the
        deviation is then relative to the size of the round's update (mean product minus the
        starting product) rather than to the mean product.

    Returns:
      A :class:`RoundMerge`.
    """
    from consensus import lora as lora_lib

    full = task.full_adapter(stacked, frozen)
    k_merge, k_fresh = jax.random.split(jax.random.key(0) if key is None else key)
    takes_rank = "rank" in lora_lib.ADAPTER_METHODS[method].params
    merged = lora_lib.merge_adapters(
        method,
        full,
        scale=task.scale,
        weights=weights,
        rank=task.settings.rank if takes_rank else None,
        key=k_merge,
        rule=rule,
        space=space,
    )
    r = task.settings.rank
    rank_out = int(next(iter(merged.adapter.values()))["a"].shape[1])
    delta: dict[str, Array] | None = None
    if merged.base_delta is not None:
        delta = {p: jnp.asarray(d, jnp.float32) for p, d in merged.base_delta.items()}
    if rank_out != r:
        folded = {p: merged.delta(p) for p in merged.adapter}
        delta = folded  # merged.delta already includes the method's base_delta
        adapter = task.fresh_adapter(k_fresh)
    else:
        ratio = float(merged.scale) / task.scale
        adapter = {
            p: {"a": jnp.asarray(v["a"], jnp.float32), "b": jnp.asarray(v["b"], jnp.float32) * ratio}
            for p, v in merged.adapter.items()
        }
    if task.settings.freeze_a:
        fixed = frozen["a"]
        for p, v in adapter.items():
            if not bool(jnp.array_equal(v["a"], fixed[p]["a"])):
                raise LoraError(
                    f"method {method!r} changed the frozen a of target {p!r}; with freeze_a use a "
                    "method that keeps the shared a (ffa)"
                )
    params = task.trainable(adapter)
    new_frozen = {"base": add_base_delta(frozen["base"], delta), "a": frozen.get("a") or {}}
    one = jax.tree.map(lambda x: x[0], dict(stacked))
    info = dict(merged.info)
    info.update(
        bytes_up=tree_bytes(one),
        bytes_down=tree_bytes(params) + (tree_bytes(delta) if delta else 0),
        rank_out=rank_out,
    )
    if measure:
        origin = None if start is None else task.full_adapter(start, frozen)
        info["deviation"] = _deviation(task, full, merged, info.get("weights"), origin)
    return RoundMerge(params, new_frozen, delta, info)


def _deviation(
    task: LoraTask,
    full: Mapping[str, Mapping[str, Array]],
    merged: Any,
    weights: Any,
    origin: Mapping[str, Mapping[str, Array]] | None,
) -> float:
    """L2 distance of the merged update from ``sum_i w_i s a_i b_i`` over all targets, relative.

    Relative to the norm of that mean (minus the starting product ``s a_0 b_0`` when ``origin``
    is given).
    """
    n = int(next(iter(full.values()))["a"].shape[0])
    w = np.full((n,), 1.0 / n) if weights is None else np.asarray(weights, np.float64)
    num = den = 0.0
    for p, v in full.items():
        a = np.asarray(v["a"], np.float64)
        b = np.asarray(v["b"], np.float64)
        exact = task.scale * np.einsum("n,nir,nro->io", w, a, b)
        got = np.asarray(merged.delta(p), np.float64)
        num += float(np.sum((got - exact) ** 2))
        ref = exact
        if origin is not None:
            o = origin[p]
            ref = exact - task.scale * np.asarray(o["a"], np.float64) @ np.asarray(o["b"], np.float64)
        den += float(np.sum(ref**2))
    return math.sqrt(num / den) if den > 0 else math.sqrt(num)
