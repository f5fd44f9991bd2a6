"""The merge itself: :func:`merge_checkpoints` checks a plan, then streams the inputs into the output.

The inputs are read leaf by leaf or in column chunks, in one merge pass, after a Gram pass for
the vector rules and two counting passes for TIES in chunks.

The design (memory bound, which leaves are chunked, how a vector rule gets whole-model weights
from a Gram pass) is in docs/merging.md.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from meta_consensus.merge import streaming as stream
from meta_consensus.merge.compute import (
    Compiled,
    apply_update,
    compute_dtype,
    gram_of,
    is_float,
    merge_leaf,
    trim_density,
    vector_weights,
)
from meta_consensus.merge.errors import MergeError
from meta_consensus.merge.inputs import copy_model_files, model_folder, open_input, prepare_inputs
from meta_consensus.merge.plan import MergePlan, RuleChoice, assign_rules, check_plan
from meta_consensus.merge.report import leaf_report, new_report, vector_rule_report, write_report
from meta_consensus.merge.trim import LeafTrim, high_counts, low_counts


def merge_checkpoints(
    plan: MergePlan,
    *,
    progress: bool = True,
    overwrite: bool = False,
    chunk_bytes: int = stream.CHUNK_BYTES,
    strict: bool = False,
    config_from: str | None = None,
) -> dict[str, Any]:
    """Run a merge plan: check everything, then stream the inputs into ``plan.out``.

    Every check that needs no tensor data runs before anything is written, and the output is
    written to a temporary folder renamed at the end: on any error ``plan.out`` is left as it was.
    PEFT adapter folders are merged by :func:`~meta_consensus.merge.adapters.merge_adapter_folders`.

    Args:
      plan: The plan.
      progress: Show a progress bar (one step per leaf, and per leaf of a vector rule's pass).
      overwrite: Replace an existing output folder.
      chunk_bytes: The size of the column chunks that element-wise and vector rules (and TIES,
        given the base) are streamed in (see :mod:`meta_consensus.merge.streaming`); 0 merges
        every leaf whole, as other rules are.
      strict: An input with a non-finite value is an error; by default the rules leave it out of
        that tensor, and the report's ``nonfinite`` names it.
      config_from: The Hugging Face model folder whose ``config.json``, generation config and
        tokenizer files the output gets (default: the first input, when it is such a folder).

    Returns:
      The report, as written to ``merge_report.json`` in the output.

    Raises:
      MergeError: If there is one input, the plan cannot run
        (:func:`~meta_consensus.merge.plan.check_plan`), the inputs disagree
        (:func:`~meta_consensus.merge.inputs.prepare_inputs`), an override matches no key, a
        non-float tensor differs between inputs, a vector rule's output is no weighted
        combination of the inputs, or, with ``strict``, an input holds NaN or Inf.
      RegistryError: If a rule is given a parameter it does not take.
      CheckpointError: If an input is missing or not a readable checkpoint.
    """
    from tqdm.auto import tqdm

    from consensus import io as ckpt
    from meta_consensus.merge.adapters import is_adapter_folder, merge_adapter_folders

    if any(is_adapter_folder(p) for p in plan.inputs):  # PEFT LoRA adapters: their own merge
        return merge_adapter_folders(plan, overwrite=overwrite, config_from=config_from)
    if len(plan.inputs) == 1:
        raise MergeError(f"one input ({plan.inputs[0]}): a merge needs at least 2")
    out_dtype = check_plan(plan, overwrite=overwrite)
    model_files = model_folder(plan.inputs, config_from) if plan.inputs else None
    readers: list[Any] = []
    base = None
    compiled: Compiled | None = None
    try:
        for p in plan.inputs:
            readers.append(open_input(p))
        base = open_input(plan.base) if plan.base else None
        float_dtypes = [d for _, d in readers[0].specs.values() if is_float(d)]
        readers, base = prepare_inputs(readers, base, out_dtype)
        keys = list(readers[0].specs)
        rules = assign_rules(keys, plan)
        n = len(readers)
        in_specs = readers[0].specs
        specs = {
            k: (shape, out_dtype if (out_dtype is not None and is_float(dtype)) else dtype)
            for k, (shape, dtype) in in_specs.items()
        }
        report = new_report(plan, readers, base)
        report["strict"] = strict
        vector_groups: dict[str, list[str]] = {}
        for k in keys:
            if rules[k].spec.kind == "vector" and is_float(in_specs[k][1]):
                vector_groups.setdefault(rules[k].key, []).append(k)
        bar = tqdm(
            total=len(keys) + sum(len(v) for v in vector_groups.values()), disable=not progress, unit="leaf"
        )
        # The leaves of an element-wise rule, of a vector rule (its Gram matrix sums over
        # columns, its output is c + sum_i w_i (x_i - c) column by column), and of a trimming rule
        # given the base (TIES: per-node thresholds from two counting passes over the chunks, then
        # element-wise) are read in column chunks; the others whole.
        trimmed = {k for k in keys if base is not None and trim_density(rules[k]) is not None}
        chunked = {
            k
            for k in keys
            if chunk_bytes > 0
            and (rules[k].spec.elementwise or rules[k].spec.kind == "vector" or k in trimmed)
            and not rules[k].spec.randomized
            and is_float(in_specs[k][1])
            and stream.can_chunk([*readers, base], k)
        }
        trimmed &= chunked
        pieces = stream.plan_pieces(keys, in_specs, chunked, n, chunk_bytes)
        # its updates, compiled in the background while pass 1 or the first reads run
        compiled = Compiled(
            [
                (
                    rules[p.key],
                    shape,
                    compute_dtype(dtype),
                    base is not None,
                    p.key in trimmed and not p.whole,
                )
                for p in pieces
                for dtype in [in_specs[p.key][1]]
                for shape in [(n, *in_specs[p.key][0]) if p.whole else (n, p.padded)]
                if is_float(dtype) and rules[p.key].spec.kind != "vector"
            ]
        )
        run = _Run(plan, readers, base, rules, specs, {k: i for i, k in enumerate(keys)}, compiled, strict)
        for group_keys in vector_groups.values():
            run.vector_pass(group_keys, pieces, report, bar)
        if trimmed:
            run.trim_pass(trimmed, pieces)
        with ckpt.atomic_directory(Path(plan.out), overwrite=overwrite) as tmp:
            writer = ckpt.ShardedWriter(
                tmp,
                specs,
                shard_size=plan.shard_size,
                metadata={"merged_by": "meta-consensus merge"},
                direct=True,  # the page cache stays with the inputs (see consensus.io.DirectFile)
            )
            try:
                run.merge_pass(pieces, writer, report, bar)
            finally:
                writer.abort()
            writer.close()
            report["nonfinite"] = run.nonfinite_report()
            if model_files is not None:
                float_dtype = out_dtype if out_dtype is not None else (float_dtypes or [None])[0]
                report["model_files"] = {
                    "from": str(model_files),
                    "files": copy_model_files(model_files, tmp, float_dtype),
                }
            write_report(tmp, report)
        bar.close()
    finally:
        if compiled is not None:
            compiled.close()
        for r in [*readers, *([base] if base else [])]:
            r.close()
    return report


@dataclasses.dataclass
class _Run:
    """One merge's opened inputs and decisions, for its passes over the pieces."""

    plan: MergePlan
    readers: Sequence[Any]
    base: Any | None
    rules: dict[str, RuleChoice]  # key -> its rule
    specs: dict[str, tuple[tuple[int, ...], Any]]  # key -> (shape, output dtype)
    index_of: dict[str, int]  # key -> its position (a randomized rule's key is folded in with it)
    compiled: Compiled
    strict: bool = False
    weights: dict[str, tuple[np.ndarray, np.ndarray]] = dataclasses.field(default_factory=dict)
    # key -> a trimming rule's (n,) per-node thresholds over the whole leaf (chunked TIES)
    thresholds: dict[str, np.ndarray] = dataclasses.field(default_factory=dict)
    # key -> the inputs (indices) with a non-finite value in it
    nonfinite: dict[str, set[int]] = dataclasses.field(default_factory=dict)

    def check_finite(self, key: str, stacked: np.ndarray) -> None:
        """Note the inputs whose rows of ``stacked`` hold NaN or Inf (an error when ``strict``)."""
        rows = np.flatnonzero(~np.isfinite(stacked.reshape(len(self.readers), -1)).all(axis=1))
        if rows.size == 0:
            return
        if self.strict:
            names = ", ".join(str(self.plan.inputs[int(i)]) for i in rows)
            raise MergeError(f"--strict: {key!r} holds NaN or Inf in {names}")
        self.nonfinite.setdefault(key, set()).update(int(i) for i in rows)

    def nonfinite_report(self) -> dict[str, list[str]]:
        """Map each input to the tensors in which it held NaN or Inf (the rules left it out there)."""
        out: dict[str, list[str]] = {}
        for key in self.index_of:  # in the checkpoint's order
            for i in sorted(self.nonfinite.get(key, ())):
                out.setdefault(str(self.plan.inputs[i]), []).append(key)
        return out

    def vector_pass(
        self, group_keys: list[str], pieces: Sequence[stream.Piece], report: dict[str, Any], bar: Any
    ) -> None:
        """Pass 1 of a vector rule: the Gram matrix of its leaves, then its whole-model weights.

        The Gram matrix is summed a leaf or a chunk at a time (a chunk's zero padding adds
        nothing: its rows, base and centre are all 0 there).
        """
        n = len(self.readers)
        gram, finite = np.zeros((n, n)), np.ones(n, bool)

        def work(piece: stream.Piece, buffers: dict) -> tuple[np.ndarray, np.ndarray]:
            return gram_of(*stream.read_piece(self.readers, self.base, piece, buffers))

        in_group = set(group_keys)
        group_pieces = [p for p in pieces if p.key in in_group]
        for piece, (piece_finite, piece_gram) in zip(
            group_pieces, stream.Pipeline(work, group_pieces), strict=True
        ):
            finite &= piece_finite
            gram += piece_gram
            if piece.last:
                bar.update(1)
        choice = self.rules[group_keys[0]]
        w, selected = vector_weights(choice, gram, finite, self.plan.seed)
        self.weights[choice.key] = (w, selected)
        report["vector_rules"][choice.label()] = vector_rule_report(
            self.plan.inputs, len(group_keys), w, selected, finite
        )

    def trim_pass(self, keys: set[str], pieces: Sequence[stream.Piece]) -> None:
        """Find each chunked TIES leaf's exact per-node thresholds, before the merge pass.

        Two counting passes over the leaf's chunks (:mod:`meta_consensus.merge.trim`).
        """
        from consensus.merging.ties import trim_count

        n = len(self.readers)
        searches: dict[str, LeafTrim] = {}
        for k in keys:
            size = int(np.prod(self.specs[k][0], dtype=np.int64))
            count = trim_count(trim_density(self.rules[k]), size)  # type: ignore[arg-type]
            if count is None:  # every entry kept: threshold 0
                self.thresholds[k] = np.zeros(n, np.float32)
            else:
                searches[k] = LeafTrim(n, count)
        todo = [p for p in pieces if p.key in searches]

        def high(piece: stream.Piece, buffers: dict) -> np.ndarray:
            stacked, base = stream.read_piece(self.readers, self.base, piece, buffers)
            return high_counts(stacked, base, piece.width)

        def low(piece: stream.Piece, buffers: dict) -> np.ndarray:
            stacked, base = stream.read_piece(self.readers, self.base, piece, buffers)
            return low_counts(stacked, base, piece.width, bins[piece.key])

        bins: dict[str, np.ndarray] = {}
        for piece, counts in zip(todo, stream.Pipeline(high, todo), strict=True):
            searches[piece.key].add_high(counts)
            if piece.last:
                bins[piece.key] = searches[piece.key].split()
        for piece, counts in zip(todo, stream.Pipeline(low, todo), strict=True):
            searches[piece.key].add_low(counts)
            if piece.last:
                self.thresholds[piece.key] = searches.pop(piece.key).thresholds()

    def merge_piece(self, piece: stream.Piece, buffers: dict) -> tuple[Any, dict[str, Any]]:
        """A worker's piece: a whole leaf merged (host array, report), or a chunk (values, report)."""
        k = piece.key
        shape, dtype = self.specs[k]
        choice = self.rules[k]
        stacked, base_piece = stream.read_piece(self.readers, self.base, piece, buffers)
        if is_float(stacked.dtype):
            self.check_finite(k, stacked)
        where = (self.plan.seed, self.index_of[k], self.compiled)  # the rule's key, its compiled updates
        if piece.whole or choice.spec.kind == "vector":
            vector = self.weights.get(choice.key)
            merged, piece_report = merge_leaf(stacked, base_piece, k, choice, vector, *where)
            host = np.asarray(merged)
            host = host.reshape(shape) if piece.whole else host[: piece.width]
            host = host.astype(dtype, copy=False)
        else:
            merged, info = apply_update(stacked, base_piece, choice, *where, self.thresholds.get(k))
            host = np.asarray(merged)[: piece.width].astype(dtype, copy=False)
            piece_report = leaf_report(choice, info)
        if np.may_share_memory(host, stacked):  # a rule that passed an input through
            host = host.copy()  # the worker's buffer is reused for its next piece
        return host, piece_report

    def merge_pass(
        self, pieces: Sequence[stream.Piece], writer: Any, report: dict[str, Any], bar: Any
    ) -> None:
        """Pass 2: two workers read and merge pieces (leaves or chunks) while earlier leaves are written."""
        background = stream.Writer(writer)
        leaf: _ChunkedLeaf | None = None
        try:
            for piece, (host, leaf_entry) in zip(
                pieces, stream.Pipeline(self.merge_piece, pieces), strict=True
            ):
                k = piece.key
                if not piece.whole:
                    if piece.start == 0:
                        leaf = _ChunkedLeaf()
                    assert leaf is not None
                    leaf.add(host, leaf_entry)
                    if not piece.last:
                        continue
                    host = leaf.parts if leaf.consistent else None
                    if host is None:  # the chunks found different valid nodes: merge the leaf whole
                        host, leaf_entry = self.merge_piece(stream.Piece(k), {})
                background.write(k, host)
                report["leaves"][k] = leaf_entry
                bar.update(1)
            background.close()  # the last write's error, if any, raises here
        finally:
            background.pool.shutdown(wait=True, cancel_futures=True)


class _ChunkedLeaf:
    """Collects the chunks of a leaf merged chunk by chunk (an element-wise rule).

    An element-wise rule gives on a chunk the values it gives there on the whole leaf, as
    long as it finds the same valid nodes (finite ones) in the chunk as in the leaf. When
    every chunk reports the same selection, each node is finite in every chunk or in none,
    which is the leaf's own selection: the result is the whole-leaf merge. Otherwise
    (a node non-finite in part of the leaf) ``consistent`` is False and the caller merges
    the leaf whole. The chunks' outputs are kept as they come (XLA's own buffers) and go
    to the writer as pieces, so the leaf is never assembled in memory.
    """

    def __init__(self) -> None:
        self.parts: list[np.ndarray] = []
        self.report: dict[str, Any] | None = None
        self.consistent = True

    def add(self, values: np.ndarray, report: dict[str, Any]) -> None:
        self.parts.append(values)
        if self.report is None:
            self.report = report
        self.consistent &= report == self.report
