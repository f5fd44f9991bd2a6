"""Tangent-space (linearised) fine-tuning: a task whose model is its first-order Taylor expansion.

Ortiz-Jimenez et al. (NeurIPS 2023, "Task arithmetic in the tangent space") fine-tune

    f_lin(x; theta) = f(x; theta0) + J_theta f(x; theta0) (theta - theta0)

instead of f(x; theta). The outputs are affine in theta, so a loss that is convex in the
outputs (cross entropy of logits, squared error) is convex in theta: two fine-tunes from the
same theta0 have no loss barrier between them (Jensen: the loss of their average is at most
their average loss), and task vectors add without interfering through the network's
curvature. The price is one forward-mode product per step on top of the forward pass; the
Jacobian is never formed (``jax.jvp`` pushes ``theta - theta0`` through the network).

:func:`linearize` wraps a task (:class:`TangentTask`): its ``apply`` is ``f_lin`` and its
loss, metrics and ``target_probs`` are the base task's, computed on ``f_lin``'s outputs, so
the trainer, the merges and the evaluation use it unchanged. In a one-shot merge theta0 is
the pretrained base every node starts from, and the merged parameters are evaluated as
``f_lin`` at the same theta0, as the paper does.
"""

from __future__ import annotations

import copy
import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

PyTree = Any
Array = jax.Array


class NotLinearizableError(TypeError):
    """The task's loss or metrics do not read its model through ``apply`` alone."""


def linearized_apply(apply_fn: Any, anchor: PyTree) -> Any:
    """``f_lin(params, inputs) = f(anchor, inputs) + J f(anchor, inputs) (params - anchor)``.

    Args:
      apply_fn: ``apply_fn(params, inputs, *, train=False, key=None)``, the model.
      anchor: theta0, the point of the expansion (a tree like the params).

    Returns:
      A function with ``apply_fn``'s signature whose outputs are affine in ``params`` and
      equal ``apply_fn``'s at ``params = anchor``, in the anchor's output dtype.
    """

    def apply(params: PyTree, inputs: Array, *, train: bool = False, key: Array | None = None) -> Array:
        # The tangent in the anchor's dtype: jvp requires primal and tangent dtypes to agree.
        delta = jax.tree.map(lambda p, a: (p - a).astype(a.dtype), params, anchor)
        out, tangent = jax.jvp(lambda p: apply_fn(p, inputs, train=train, key=key), (anchor,), (delta,))
        return out + tangent.astype(out.dtype)

    return apply


@dataclasses.dataclass(frozen=True, eq=False)
class TangentTask:
    """A task fine-tuned in the tangent space of its base at ``anchor`` (see the module docstring).

    ``apply`` is :func:`linearized_apply`; ``loss``, ``metrics`` and ``target_probs`` are the
    base task's, computed on the linearised outputs; the data, the label flipping and the
    axes are the base task's. Like a LoRA task's frozen base, the anchor can be passed to
    ``apply``, ``loss`` and ``metrics`` as ``frozen=`` (the trainer's ``fit(..., frozen=)`` and
    ``evaluate(..., frozen=)``), so a large anchor is an argument of the compiled step rather
    than a constant inside it; without it, the task's own ``anchor`` is used.

    Build it with :func:`linearize`, which checks the base task and the anchor.

    Attributes:
      base_task: the task whose model is linearised (it declares ``linearizable = True``).
      anchor: theta0, the point of the expansion.
    """

    base_task: Any
    anchor: PyTree

    @property
    def name(self) -> str:
        """``tangent(<base task's name>)``."""
        return f"tangent({self.base_task.name})"

    @property
    def kind(self) -> str:
        """The base task's kind ("classification" when it has none)."""
        return getattr(self.base_task, "kind", "classification")

    def __getattr__(self, attr: str) -> Any:
        # Everything this class does not define is the base task's (splits, flip_labels,
        # logical_axes, record, ...). Guarded: copy and pickle probe attributes before __init__.
        if attr in ("base_task", "anchor") or attr.startswith("__"):
            raise AttributeError(attr)
        return getattr(self.base_task, attr)

    def initial_frozen(self) -> PyTree:
        """The anchor, as the trainer's ``frozen`` argument.

        Returns:
          ``anchor``.
        """
        return self.anchor

    def _on(self, frozen: PyTree | None) -> Any:
        # A shallow copy of the base task whose own apply (an instance attribute shadows the
        # class's) is the linearised model: every base method that calls self.apply reads it.
        proxy = copy.copy(self.base_task)
        anchor = self.anchor if frozen is None else frozen
        object.__setattr__(proxy, "apply", linearized_apply(self.base_task.apply, anchor))
        return proxy

    def init(self, key: Array) -> PyTree:
        """The anchor: tangent fine-tuning starts at theta0, where ``f_lin = f``.

        Args:
          key: unused (the anchor is the start).

        Returns:
          A copy of the anchor.
        """
        del key
        return jax.tree.map(jnp.array, self.anchor)

    def apply(
        self,
        params: PyTree,
        inputs: Array,
        *,
        train: bool = False,
        key: Array | None = None,
        frozen: PyTree | None = None,
    ) -> Array:
        """The linearised model's outputs.

        Args:
          params: the parameters theta.
          inputs: a batch of inputs.
          train: training mode of the base model (dropout at the anchor).
          key: the dropout key in training mode.
          frozen: the anchor (default: the task's own).

        Returns:
          ``f(anchor) + J f(anchor) (params - anchor)``.
        """
        return self._on(frozen).apply(params, inputs, train=train, key=key)

    def loss(
        self, params: PyTree, batch: Any, key: Array | None = None, *, frozen: PyTree | None = None
    ) -> Array:
        """The base task's loss of the linearised model.

        Args:
          params: the parameters theta.
          batch: a training batch.
          key: the dropout key (training mode when given).
          frozen: the anchor (default: the task's own).

        Returns:
          A float32 scalar.
        """
        return self._on(frozen).loss(params, batch, key)

    def metrics(self, params: PyTree, batch: Any, *, frozen: PyTree | None = None) -> dict[str, Array]:
        """The base task's metrics of the linearised model.

        Args:
          params: the parameters theta.
          batch: an evaluation batch.
          frozen: the anchor (default: the task's own).

        Returns:
          The metrics.
        """
        return self._on(frozen).metrics(params, batch)

    def target_probs(self, params: PyTree, batch: Any, *, frozen: PyTree | None = None) -> Array:
        """The base task's target probabilities under the linearised model.

        Args:
          params: the parameters theta.
          batch: a held-out batch.
          frozen: the anchor (default: the task's own).

        Returns:
          The base task's ``target_probs`` (AttributeError when it has none).
        """
        return self._on(frozen).target_probs(params, batch)


def check_linearizable(task: Any, caller: str) -> None:
    """Refuse a task whose loss may read the model other than through ``self.apply``.

    Args:
      task: the task.
      caller: the function named in the error.

    Raises:
      NotLinearizableError: for a task that does not declare ``linearizable = True``.
    """
    if not getattr(task, "linearizable", False):
        raise NotLinearizableError(
            f"{caller}: task {getattr(task, 'name', type(task).__name__)!r} does not declare "
            "linearizable = True (its loss must read the model only through self.apply)"
        )


def linearize(task: Any, anchor: PyTree) -> TangentTask:
    """The task fine-tuned in the tangent space at ``anchor`` (see the module docstring).

    Only tasks that declare ``linearizable = True`` are accepted: their loss, metrics and
    ``target_probs`` read the model through ``self.apply`` and nothing else, so they become
    the linearised model's.

    Args:
      task: a task (digits, Fashion-MNIST, text, causal LM, an array task).
      anchor: theta0, usually the pretrained parameters every node starts from.

    Returns:
      The :class:`TangentTask`.

    Raises:
      NotLinearizableError: for a task that does not declare ``linearizable = True`` (a LoRA
        task, whose loss merges adapters into a frozen base: linearise the base task instead).
      ValueError: for an anchor whose tree structure or leaf shapes differ from the task's
        parameters, or a leaf that is not floating-point.
    """
    check_linearizable(task, "linearize")
    expected = jax.eval_shape(task.init, jax.random.key(0))
    if jax.tree.structure(expected) != jax.tree.structure(anchor):  # type: ignore[operator]
        raise ValueError(
            f"linearize: the anchor's tree structure differs from task {task.name!r}'s parameters"
        )
    for want, got in zip(jax.tree.leaves(expected), jax.tree.leaves(anchor), strict=True):
        if tuple(want.shape) != tuple(jnp.shape(got)):
            raise ValueError(f"linearize: an anchor leaf has shape {jnp.shape(got)}, the task's {want.shape}")
        if not jnp.issubdtype(jnp.result_type(got), jnp.floating):
            raise ValueError(
                f"linearize: an anchor leaf has dtype {jnp.result_type(got)}, not floating-point"
            )
    return TangentTask(task, anchor)
