"""A task's data and model checked at the door, before any training: one line naming what is wrong.

Every classification task goes through :func:`check_task_data` when the system builds
it (and :func:`~strategies.tasks.custom.task_from_arrays` checks its arrays when it is
called): features are finite, labels are integers in ``[0, classes)`` where ``classes``
is the model's logit count, and one forward pass of the model on a batch of the real
input (shapes only, :func:`jax.eval_shape`) checks the input width and that the model
returns ``(rows, classes)`` logits. A failure is a :class:`TaskError`, one line naming
the array, the row and the value, or the user's file and line where their code failed,
so a wrong label range or a NaN feature can never train into a reported accuracy.
"""

from __future__ import annotations

import os
import re
import sysconfig
import traceback
from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

#: Rows of the real input the forward-pass check runs on.
CHECK_ROWS = 8


class TaskError(ValueError):
    """A mistake in a task's model, data or factory (the user's): its message is one line."""


class TaskTypeError(TaskError, TypeError):
    """An object of the wrong kind given as a task or a model."""


class NotATaskError(TaskTypeError):
    """An object given as a task lacks members of the Task protocol."""


def _library_dirs() -> tuple[str, ...]:
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    ours = [os.path.join(root, d) for d in ("kernels", "consensus", "strategies", "meta_consensus")]
    paths = sysconfig.get_paths()
    others = {paths.get(k, "") for k in ("stdlib", "platstdlib", "purelib", "platlib")}
    return tuple(os.path.abspath(p) + os.sep for p in [*ours, *others] if p)


def _is_users(filename: str) -> bool:
    if filename.startswith("<") or "site-packages" in filename or "dist-packages" in filename:
        return False
    path = os.path.abspath(filename)
    return not path.startswith(_library_dirs())


def user_location(error: BaseException) -> str:
    """`` at file:line`` of the innermost traceback frame in the user's own code, or ''.

    The user's code is any file outside this package's directories, the standard
    library and site-packages (a script, ``my_tasks.py``, a notebook cell).

    Args:
      error: a raised exception (its traceback is read).

    Returns:
      ``" at <file>:<line>"``, or '' when no frame is the user's.
    """
    frames = [f for f in traceback.extract_tb(error.__traceback__) if _is_users(f.filename)]
    if not frames:
        return ""
    return f" at {frames[-1].filename}:{frames[-1].lineno}"


def one_line(error: BaseException) -> str:
    """``Type: first line of the message`` of an exception, with the user's file and line.

    Args:
      error: a raised exception.

    Returns:
      One line (the message's whitespace collapsed, cut at 300 characters).
    """
    text = " ".join(str(error).split())
    if len(text) > 300:
        text = text[:297] + "..."
    return f"{type(error).__name__}: {text}{user_location(error)}"


def _index(idx: tuple[int, ...] | np.ndarray) -> str:
    return ", ".join(str(int(i)) for i in idx)


def check_features(x: Any, what: str = "x") -> None:
    """Check that a floating array ``x`` is finite (other dtypes pass).

    Args:
      x: the features.
      what: how the error names the array.

    Raises:
      TaskError: naming the first non-finite entry and how many rows hold one.
    """
    x = np.asarray(x)
    if not np.issubdtype(x.dtype, np.floating):
        return
    bad = ~np.isfinite(x)
    if not bad.any():
        return
    first = np.argwhere(bad)[0]
    rows = int(bad.reshape(len(x), -1).any(axis=1).sum()) if x.ndim else 1
    raise TaskError(
        f"{what}[{_index(first)}] is {x[tuple(first)]}: features must be finite "
        f"({rows} of {len(x) if x.ndim else 1} rows hold NaN or Inf)"
    )


def check_labels(y: Any, num_classes: int | None, what: str = "y", why: str = "") -> None:
    """Check that every label is an integer in ``[0, num_classes)``.

    Args:
      y: the labels.
      num_classes: the class count (None: only non-negativity is checked).
      what: how the error names the array.
      why: a clause added after the bad label (e.g. where ``num_classes`` comes from).

    Raises:
      TaskError: naming the first label that is not an integer in ``[0, num_classes)``.
    """
    y = np.asarray(y)
    if not np.issubdtype(y.dtype, np.integer):
        raise TaskError(f"{what} must hold non-negative integer classes, got dtype {y.dtype}")
    if y.size == 0:
        return
    low = np.flatnonzero(y.reshape(-1) < 0)
    if low.size:
        i = np.unravel_index(low[0], y.shape)
        raise TaskError(f"{what}[{_index(i)}] = {int(y[i])}: labels must be non-negative integer classes")
    if num_classes is None:
        return
    high = np.flatnonzero(y.reshape(-1) >= num_classes)
    if high.size:
        i = np.unravel_index(high[0], y.shape)
        raise TaskError(
            f"{what}[{_index(i)}] = {int(y[i])}{why}: labels must be integers in [0, {num_classes}) "
            f"({high.size} of {y.size} labels are not)"
        )


_DOT = re.compile(r"contracting dimensions to have the same shape, got \((\d+),?\) and \((\d+),?\)")


def forward_shape(
    init: Callable[[jax.Array], Any],
    apply: Callable[[Any, Any], Any],
    x: Any,
    *,
    what: str = "x",
    key: jax.Array | None = None,
) -> tuple[int, ...]:
    """The output shape of one forward pass on ``x[:CHECK_ROWS]`` (shapes only: nothing is computed).

    A failure is a TaskError: the model's input width against the data's when the
    message says so, else the exception's message and the user's file and line.

    Args:
      init: ``init(key) -> params``.
      apply: ``apply(params, x) -> logits``.
      x: the inputs (the first ``CHECK_ROWS`` rows are used).
      what: how the error names the inputs.
      key: the init key (default: ``jax.random.key(0)``).

    Returns:
      The output shape ``(rows, C)``.

    Raises:
      TaskError: when init or the forward pass fails, or the output is not ``(rows, C)``.
    """
    key = jax.random.key(0) if key is None else key
    try:
        params = jax.eval_shape(init, key)
    except Exception as e:  # the user's constructor or init
        raise TaskError(f"the model's init fails: {one_line(e)}") from e
    batch = jnp.asarray(np.asarray(x)[:CHECK_ROWS])
    try:
        out = jax.eval_shape(apply, params, batch)
    except Exception as e:
        m = _DOT.search(str(e))
        if m and batch.ndim == 2 and int(m.group(1)) == batch.shape[1]:
            raise TaskError(
                f"the model expects input width {m.group(2)}, the data has {batch.shape[1]} features "
                f"({what}.shape = {tuple(np.shape(x))})"
            ) from e
        raise TaskError(
            f"the model's forward pass fails on a batch of {what} (shape {tuple(batch.shape)}): {one_line(e)}"
        ) from e
    shape = tuple(getattr(out, "shape", ()))
    if len(shape) != 2 or shape[0] != batch.shape[0]:
        raise TaskError(
            f"the model returns shape {shape} for a batch of {batch.shape[0]} rows of {what}; "
            f"a classification model returns logits (rows, classes) = ({batch.shape[0]}, C)"
        )
    return shape


def logit_count(
    init: Callable[[jax.Array], Any],
    apply: Callable[[Any, Any], Any],
    x: Any,
    num_classes: int | None,
    what: str,
) -> int:
    """The model's logit count, checked against ``num_classes`` when given.

    Args:
      init: ``init(key) -> params``.
      apply: ``apply(params, x) -> logits``.
      x: the inputs.
      num_classes: the task's class count, or None.
      what: how the error names the inputs.

    Returns:
      C, the number of logits.

    Raises:
      TaskError: as :func:`forward_shape`, or when C differs from ``num_classes``.
    """
    classes = forward_shape(init, apply, x, what=what)[1]
    if num_classes is not None and classes != num_classes:
        raise TaskError(
            f"the model gives {classes} logits, but the task has num_classes = {num_classes}: "
            "the model's last layer needs one output per class"
        )
    return classes


def _splits(data: Any) -> list[tuple[str, Mapping[str, np.ndarray]]]:
    """(name, {"x", "y"}) of the valid rows of every split of a TaskData."""
    out: list[tuple[str, Mapping[str, np.ndarray]]] = []
    train, count = getattr(data, "train", None), getattr(data, "train_count", None)
    if train is not None and count is not None and "x" in train:
        ids = getattr(data, "node_ids", range(len(count)))
        for i, c in enumerate(np.asarray(count)):
            out.append(
                (f"node {int(ids[i])}'s train", {k: np.asarray(v[i])[: int(c)] for k, v in train.items()})
            )
    for name in ("general", "heldout", "test"):
        split = getattr(data, name, None)
        if split is not None and "x" in split:
            out.append((name, split))
    return out


def check_task_data(task: Any, data: Any, origin: str = "the task") -> None:
    """Check a task's splits and model before training; raise a one-line TaskError.

    Every floating ``x`` is finite; for a classification task (``kind`` missing or
    ``"classification"``) one forward pass gives ``(rows, C)`` logits, ``C`` equals the
    task's ``num_classes`` when it has one, and every label of every split is in ``[0, C)``.

    Args:
      task: the task (``init``, ``apply``; ``kind`` and ``num_classes`` when it has them).
      data: its TaskData.
      origin: how the error names the task.

    Raises:
      TaskError: ``"<origin>: <what is wrong>"``.
    """
    splits = _splits(data)
    try:
        for name, split in splits:
            check_features(split["x"], f"{name} x")
        if getattr(task, "kind", "classification") != "classification" or not splits:
            return
        name, sample = next(((n, s) for n, s in reversed(splits) if len(s["x"])), splits[-1])
        classes = logit_count(
            task.init, task.apply, sample["x"], getattr(task, "num_classes", None), f"{name} x"
        )
        for name, split in splits:
            if "y" in split:
                check_labels(split["y"], classes, f"{name} y", f", but the model gives {classes} logits")
    except TaskError as e:
        raise TaskError(f"{origin}: {e}") from e.__cause__


__all__ = [
    "CHECK_ROWS",
    "NotATaskError",
    "TaskError",
    "TaskTypeError",
    "check_features",
    "check_labels",
    "check_task_data",
    "forward_shape",
    "logit_count",
    "one_line",
    "user_location",
]
