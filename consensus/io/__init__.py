"""Checkpoint input and output: safetensors files and sharded folders, and key mappings from other frameworks.

::

    from consensus import io
    io.save_safetensors(params, "consensus.safetensors")
    params = io.load_safetensors("consensus.safetensors", like=task.init(key))
    torch_mlp = io.load_safetensors("mlp.safetensors", like=template, mapping=io.KeyMapping.torch_linear())
"""

from consensus.io.keys import CheckpointKeyError, KeyMapping, check_against, flatten, unflatten
from consensus.io.safetensors import (
    CheckpointError,
    CheckpointReader,
    DirectFile,
    ShardedWriter,
    atomic_directory,
    checkpoint_files,
    load_safetensors,
    parse_size,
    save_safetensors,
)

__all__ = [
    "CheckpointError",
    "CheckpointKeyError",
    "CheckpointReader",
    "DirectFile",
    "KeyMapping",
    "ShardedWriter",
    "atomic_directory",
    "check_against",
    "checkpoint_files",
    "flatten",
    "load_safetensors",
    "parse_size",
    "save_safetensors",
    "unflatten",
]
