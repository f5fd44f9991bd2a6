"""The merge's streaming machinery: reused read buffers, read-ahead and write-behind threads.

Two aligned byte buffers take turns holding the (n, leaf) stacks, a worker thread reads leaf
k + 1 while leaf k merges and another writes leaf k - 1. A buffer reused too early would put a
later leaf's bytes into an earlier leaf's output; this checks every leaf of a checkpoint with
leaves of alternating sizes (large after small and small after large), an integer leaf (copied,
a view of the stack otherwise) and more leaves than buffers against numpy's float64 median.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from consensus import io
from meta_consensus.merge import MergePlan, RuleChoice, _aligned_empty, merge_checkpoints

N = 5


def _models() -> list[dict[str, np.ndarray]]:
    rng = np.random.default_rng(3)
    shapes = [(64, 48), (3,), (64, 48), (3,), (64, 48)]  # two compilations, five leaves
    models = []
    for _ in range(N):
        m = {f"layer_{j}": rng.normal(size=s).astype(np.float32) for j, s in enumerate(shapes)}
        m["step"] = np.array([7, 11], np.int32)  # equal in every input: copied
        models.append(m)
    return models


@pytest.mark.slow  # two XLA compilations: 4.5 s on 2 shared cores
def test_streamed_median_equals_numpy_leaf_by_leaf(tmp_path):
    models = _models()
    paths = [str(io.save_safetensors(m, tmp_path / f"in{i}.safetensors")) for i, m in enumerate(models)]
    out = tmp_path / "out"
    report = merge_checkpoints(
        MergePlan(inputs=tuple(paths), out=str(out), rule=RuleChoice("median")), progress=False
    )
    merged = io.load_safetensors(out)
    flat = io.flatten(merged)
    assert sorted(flat) == sorted(models[0])
    for key in models[0]:
        stack = np.stack([m[key] for m in models])
        if key == "step":
            assert flat[key].dtype == np.int32 and np.array_equal(flat[key], models[0][key])
            continue
        want = np.median(stack.astype(np.float64), axis=0)  # odd n: the middle value, exact
        np.testing.assert_array_equal(flat[key], want.astype(np.float32), err_msg=key)
    assert report["leaves"]["step"]["method"].startswith("copy")
    assert json.loads((out / "merge_report.json").read_text())["method"] == "median"


def test_aligned_buffers_start_on_64_bytes():
    for shape, dtype in [((3,), np.float32), ((5, 7), np.float64), ((1,), np.uint8)]:
        a = _aligned_empty(shape, dtype)
        assert a.shape == shape and a.dtype == dtype and a.flags.c_contiguous
        assert a.ctypes.data % 64 == 0
