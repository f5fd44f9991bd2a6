"""The merge's streaming machinery: reused buffers, two workers, column chunks, write-behind.

Two workers read and merge pieces (whole leaves, one at a time in shared buffers, or column
chunks in each worker's own buffers) while a third thread writes earlier leaves. A buffer
reused too early would put a later leaf's bytes into an earlier leaf's output; this checks
every leaf of a checkpoint with leaves of alternating sizes (large after small and small after
large), an integer leaf (copied, a view of the stack otherwise) and more leaves than buffers
against numpy's float64 median, whole and in chunks, and the chunks against the whole-leaf
merge bit for bit.
"""

from __future__ import annotations

import json

import ml_dtypes
import numpy as np
import pytest

from consensus import io
from meta_consensus.merge import MergePlan, RuleChoice, merge_checkpoints
from meta_consensus.merge import streaming as merge_stream
from meta_consensus.merge.streaming import aligned_empty

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
@pytest.mark.parametrize("chunk_bytes", [0, 1024], ids=["whole leaves", "chunks"])
def test_streamed_median_equals_numpy_leaf_by_leaf(tmp_path, chunk_bytes):
    models = _models()
    paths = [str(io.save_safetensors(m, tmp_path / f"in{i}.safetensors")) for i, m in enumerate(models)]
    out = tmp_path / "out"
    report = merge_checkpoints(
        MergePlan(inputs=tuple(paths), out=str(out), rule=RuleChoice("median")),
        progress=False,
        chunk_bytes=chunk_bytes,
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
        a = aligned_empty(shape, dtype)
        assert a.shape == shape and a.dtype == dtype and a.flags.c_contiguous
        assert a.ctypes.data % 64 == 0


def _merge(tmp_path, name, paths, method, base=None, chunk_bytes=None):
    kw = {} if chunk_bytes is None else {"chunk_bytes": chunk_bytes}
    plan = MergePlan(inputs=tuple(paths), out=str(tmp_path / name), rule=RuleChoice(method), base=base)
    report = merge_checkpoints(plan, progress=False, **kw)
    return io.flatten(io.load_safetensors(tmp_path / name)), report


@pytest.mark.slow  # six compilations
@pytest.mark.parametrize("method", ["median", "task_arithmetic", "ties"])
def test_column_chunks_give_the_whole_leaf_merge_bit_for_bit(tmp_path, method, monkeypatch):
    # 2560-byte chunks of 5 rows: 128 columns, so the (64, 48) leaves come in 24 chunks, the
    # (1000,) leaf in 8 (the last one 104 wide, padded) and (3,) in one padded chunk; bfloat16
    # inputs are merged in float32 and cast back, chunk by chunk. TIES reads every chunk three
    # times (two counting passes for its per-leaf thresholds, then the merge); the bfloat16
    # task vectors hold many equal magnitudes, so its thresholds meet ties.
    rng = np.random.default_rng(4)
    shapes = {"a": (64, 48), "b": (1000,), "c": (3,)}
    models = [
        {
            k: rng.normal(size=s).astype(ml_dtypes.bfloat16 if k == "b" else np.float32)
            for k, s in shapes.items()
        }
        for _ in range(N + 1)
    ]
    models[1]["a"][40, 7] = np.nan  # input 1 is non-finite in one chunk of "a" only
    paths = [str(io.save_safetensors(m, tmp_path / f"in{i}.safetensors")) for i, m in enumerate(models)]
    base = paths.pop() if method in ("task_arithmetic", "ties") else None
    paths = paths[:N] if base else paths[1 : N + 1] + paths[:1]
    chunks = []
    read_chunk = merge_stream.read_chunk
    monkeypatch.setattr(
        merge_stream, "read_chunk", lambda r, p, into=None: chunks.append(p) or read_chunk(r, p, into)
    )
    chunked, report = _merge(tmp_path, "chunked", paths, method, base, chunk_bytes=2560)
    reads = 3 if method == "ties" else 1
    assert len(chunks) == (24 + 8 + 1) * (2 if base else 1) * reads  # the inputs' chunks, and the base's
    whole, want = _merge(tmp_path, "whole", paths, method, base, chunk_bytes=0)
    for k in shapes:
        assert chunked[k].dtype == whole[k].dtype and chunked[k].tobytes() == whole[k].tobytes(), k
        assert np.all(np.isfinite(np.asarray(chunked[k], np.float32))), k
    assert report["leaves"] == want["leaves"]
    # The node with a NaN in one chunk is dropped from that whole leaf (the leaf is merged
    # whole when its chunks disagree), and kept in the others.
    nan_input = paths.index(str(tmp_path / "in1.safetensors"))
    assert nan_input not in report["leaves"]["a"]["selected"]
    assert nan_input in report["leaves"]["b"]["selected"]
    stack = np.stack([np.asarray(io.load_safetensors(p)["c"], np.float64) for p in paths])
    if method == "median":
        np.testing.assert_allclose(chunked["c"], np.median(stack, axis=0), rtol=1e-6)


@pytest.mark.slow  # four compilations
@pytest.mark.parametrize("base", [False, True], ids=["median centre", "base centre"])
def test_vector_rule_in_column_chunks_equals_whole_leaves(tmp_path, base, monkeypatch):
    # Krum's whole-model weights come from a Gram matrix summed over chunks instead of leaves,
    # and its output c + sum_i w_i (x_i - c) is built chunk by chunk: the same selection and
    # the same values (to float32 rounding of the Gram sums). Input 5 holds a NaN: excluded.
    rng = np.random.default_rng(9)
    shapes = {"a": (64, 48), "b": (1000,), "c": (3,)}
    centre = {k: rng.normal(size=s) for k, s in shapes.items()}
    models = [
        {
            k: (v + (3.0 if i == N - 1 else 0.1) * rng.normal(size=v.shape)).astype(np.float32)
            for k, v in centre.items()
        }
        for i in range(N + 1)
    ]
    models[N]["b"][500] = np.nan
    paths = [str(io.save_safetensors(m, tmp_path / f"in{i}.safetensors")) for i, m in enumerate(models)]
    base_path = None
    if base:
        base_path = str(
            io.save_safetensors(
                {k: v.astype(np.float32) for k, v in centre.items()}, tmp_path / "base.safetensors"
            )
        )
    chunks = []
    read_chunk = merge_stream.read_chunk
    monkeypatch.setattr(
        merge_stream, "read_chunk", lambda r, p, into=None: chunks.append(p) or read_chunk(r, p, into)
    )

    def run(name, chunk_bytes):
        plan = MergePlan(
            inputs=tuple(paths), out=str(tmp_path / name), rule=RuleChoice("krum", {}, 1), base=base_path
        )
        report = merge_checkpoints(plan, progress=False, chunk_bytes=chunk_bytes)
        return io.flatten(io.load_safetensors(tmp_path / name)), report

    chunked, report = run("chunked", 2560)
    assert len(chunks) == 2 * (24 + 8 + 1) * (2 if base else 1)  # both passes; the base's chunks too
    whole, want = run("whole", 0)
    (entry,) = report["vector_rules"].values()
    (want_entry,) = want["vector_rules"].values()
    assert entry["selected"] == want_entry["selected"] and len(entry["selected"]) == 1
    assert entry["excluded_nonfinite"] == want_entry["excluded_nonfinite"] == [paths[N]]
    np.testing.assert_allclose(entry["weights"], want_entry["weights"], atol=1e-7)
    for k in shapes:
        np.testing.assert_allclose(chunked[k], whole[k], rtol=1e-6, atol=1e-6, err_msg=k)
        assert np.all(np.isfinite(chunked[k]))


@pytest.mark.parametrize("density", [0.01, 0.2, 0.9])
def test_chunked_trim_thresholds_keep_the_library_entries(density):
    # TIES' thresholds found over column chunks (two counting passes) keep exactly the entries
    # the library's whole-leaf thresholds keep: continuous deltas, heavy ties (a few distinct
    # magnitudes, zeros), a row with NaN and Inf.
    from consensus.merging.ties import trim_count, trim_thresholds
    from meta_consensus.merge.trim import LeafTrim, high_counts, low_counts

    rng = np.random.default_rng(5)
    size, width = 3000, 700
    base = rng.normal(size=size).astype(np.float32)
    rows = [base + rng.normal(scale=1e-3, size=size).astype(np.float32) for _ in range(2)]
    rows.append(base + rng.integers(-2, 3, size=size).astype(np.float32))  # ties and zeros
    rows.append(base.copy())  # all zeros
    rows.append(rows[0].copy())
    rows[-1][[10, 20]] = [np.nan, np.inf]
    x = np.stack(rows)
    n = len(x)
    k = trim_count(density, size)
    search = LeafTrim(n, k)
    starts = range(0, size, width)
    for s in starts:
        search.add_high(high_counts(x[:, s : s + width], base[s : s + width], min(width, size - s)))
    high = search.split()
    for s in starts:
        search.add_low(low_counts(x[:, s : s + width], base[s : s + width], min(width, size - s), high))
    got = search.thresholds()
    want = np.asarray(trim_thresholds(x, base, density, np.ones(n, bool)))
    d = np.abs(x - base)
    for i in range(n - 1):  # the last row is non-finite: the rule excludes it
        assert np.array_equal(~(d[i] < got[i]), ~(d[i] < want[i])), i
