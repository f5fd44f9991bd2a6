"""Tasks: a model, its loss and metrics, and the data of every node (one file per task)."""

from strategies.tasks.base import (
    Batch,
    NodeData,
    Task,
    TaskData,
    cast_floating,
    cross_entropy,
    dirichlet_partition,
    dominant_groups,
    hosted_nodes,
    logical_axes_of_state,
    masked_mean,
    pad_index_table,
    pad_stack,
    param_dtype,
    split_module,
)
from strategies.tasks.custom import ArrayTask, task_from_arrays
from strategies.tasks.digits import DigitsTask
from strategies.tasks.text import TextTask

__all__ = [
    "ArrayTask",
    "Batch",
    "DigitsTask",
    "NodeData",
    "Task",
    "TaskData",
    "TextTask",
    "cast_floating",
    "cross_entropy",
    "dirichlet_partition",
    "dominant_groups",
    "hosted_nodes",
    "logical_axes_of_state",
    "masked_mean",
    "pad_index_table",
    "pad_stack",
    "param_dtype",
    "split_module",
    "task_from_arrays",
]
