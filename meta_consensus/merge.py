"""``meta-consensus merge``: merge checkpoints made anywhere with any registered rule, streaming leaf by leaf.

::

    meta-consensus merge --method trimmed_mean --num-byzantine 1 --out merged/ a.safetensors b/ c/ d/
    meta-consensus merge --method krum --num-byzantine 1 --override '^head\\.=median' --out merged/ IN...
    meta-consensus merge --config merge.toml

Any rule of :data:`consensus.registry.RULES` that maps n inputs to one
(kinds "coordinatewise", "vector", "merge"; pre-aggregators are n -> n and are
refused) merges the inputs, with ``--set method.PARAM=VALUE`` for its
parameters, ``--num-byzantine F`` for the rules that take f, ``--base BASE``
for the rules that need ``params`` (merge methods over task vectors) and
``--override PATTERN=METHOD`` for a different rule on the keys a regular
expression matches (as mergekit's slices do; the first matching override wins).

Inputs (and ``--base``) are safetensors checkpoints (a ``.safetensors`` file, a
sharded folder with its ``model.safetensors.index.json``, an ``*.index.json``) or
orbax checkpoints of this package (:class:`~meta_consensus.checkpoint.RunCheckpoints`):
a step folder ``<run>/checkpoints/<round>``, a ``checkpoints`` folder or a run
folder without a ``consensus.safetensors`` (their latest round), whose consensus
is read with the dotted keys that :func:`consensus.io.save_safetensors` writes for
the same tree (``Dense_0.kernel``, ``layers.0.w``), so safetensors and orbax inputs
mix (see :func:`open_input`).

Streaming (memory about 2n + 7 times the largest leaf merged whole: a stack and a base
leaf per worker, up to four merged leaves in flight and one being written; chunked
leaves take a chunk per worker and the merged leaves; never n models): every
safetensors input is a :class:`~consensus.io.CheckpointReader` that reads one
tensor straight into the merge's buffer, every orbax input a
:class:`~meta_consensus.checkpoint.TreeReader` that restores a few leaves at a
time (orbax restores whole trees or parts of one, not arrays into a given buffer,
and each restore walks the checkpoint's whole metadata: the leaves come in groups
of at most max(largest leaf, 8 MB), held until they are read, then copied into the
merge's buffer: one such group more per orbax input), and the output a
:class:`~consensus.io.ShardedWriter` that appends one tensor at a time, with
``O_DIRECT`` where the file system allows it (:class:`~consensus.io.DirectFile`:
the page cache stays with the inputs). :mod:`meta_consensus.merge_stream` holds
the buffers, the read-ahead and write-behind threads and the column chunks.

* Element-wise rules (``RuleSpec.elementwise``: mean, median, trimmed mean,
  MeaMed, task arithmetic) are streamed in column chunks of the flattened
  leaves, 32 MB of stacked rows at a time, so the rule reads rows that are still
  in cache and a model's leaves share a few compiled shapes; a leaf whose chunks
  find different valid nodes (a node non-finite in part of it) is merged again
  whole, so the result is always the whole-leaf merge.
* Other coordinate-wise rules and merge methods run leaf by leaf: the n copies of
  one leaf are stacked (host buffer, then device copy), merged, cast and
  written. A merge method's statistics (TIES' trimming, DARE's drop) are then
  per tensor, as in mergekit; a rule that needs a key gets ``fold_in(key(seed),
  leaf index)``.
* Vector rules (Krum, Multi-Krum, geometric median, centered clipping) need
  whole-model distances. A first pass over the leaves (in column chunks, as the
  element-wise rules) sums the Gram matrix ``G = sum_chunks (X - c)(X - c)^T``
  (float64 on the host), centred on ``c`` = the base when given, else the
  coordinate-wise median of the inputs (the library's own centre for
  ``params=None``); a node with a non-finite value anywhere is left out. The rule then runs on an n x n
  embedding ``E = U sqrt(Lambda)`` of ``G = U Lambda U^T``, which has the same
  inner products and distances as the inputs, so it selects and weighs the
  same inputs as on the full models; its weights ``w`` (``info.weights``) give
  each output leaf in the second pass (chunk by chunk) as ``c + sum_i w_i (x_i - c)``. Only rules
  whose output is that linear combination (``info.linear``) can stream this way
  (Bulyan's coordinate-wise second stage cannot, and is refused).

Non-float tensors (integer step counters, boolean masks) are copied when every
input holds the same value and are an error otherwise. Convex merge weights
need held-out data, which checkpoints alone do not carry: they are not offered
here (use :mod:`consensus.convex` from Python).

Every user error (inputs with different keys, shapes or dtypes, an unknown
method or parameter, too few inputs for the rule, an existing output folder,
a folder that is no checkpoint, an orbax checkpoint whose metadata cannot be
read) is found before anything is written and raises :class:`MergeError` (or
:class:`consensus.io.CheckpointError`); the CLI prints it on one line and exits
2. A tensor that cannot be read only when its turn comes (a data file cut short)
is the same one-line error, and the output, written to a temporary folder until
the end, is removed.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import re
import tomllib
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from meta_consensus import merge_stream as stream

# jax and the library are imported in the functions that use them: building the CLI parser
# (``meta-consensus --help``, ``run``, ``report``) must not pay for importing jax.

REPORT_NAME = "merge_report.json"
MERGE_KINDS = ("coordinatewise", "vector", "merge")


class MergeError(ValueError):
    """A user error of the merge command (found before any output is written)."""


@dataclasses.dataclass(frozen=True)
class RuleChoice:
    """One rule with its parameters (the default one, or an override's)."""

    method: str
    params: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    num_byzantine: int | None = None
    pattern: str | None = None  # None for the default rule

    @property
    def spec(self) -> Any:
        from consensus.registry import RULES

        return RULES[self.method]

    def label(self) -> str:
        return self.method if self.pattern is None else f"{self.method} (override {self.pattern!r})"


@dataclasses.dataclass(frozen=True)
class MergePlan:
    """What to merge, how, and where (built by :func:`plan_from_args` or :func:`plan_from_toml`)."""

    inputs: tuple[str, ...]
    out: str
    rule: RuleChoice
    overrides: tuple[RuleChoice, ...] = ()
    base: str | None = None
    dtype: str | None = None
    shard_size: int | None = None
    seed: int = 0


# ----------------------------------------------------------------------------- parsing


def parse_value(text: str) -> Any:
    """A TOML value (``3``, ``0.5``, ``true``, ``[1, 2]``, ``"s"``) or, failing that, the bare string."""
    try:
        return tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        return text


def parse_sets(items: Sequence[str]) -> dict[str, Any]:
    """``["method.beta=0.1", ...]`` -> ``{"beta": 0.1}``; the prefix must be ``method.``."""
    out: dict[str, Any] = {}
    for item in items:
        key, eq, value = item.partition("=")
        if not eq or not key.startswith("method.") or key == "method.":
            raise MergeError(f"--set {item!r}: expected method.PARAM=VALUE (e.g. --set method.max_iter=50)")
        out[key.removeprefix("method.")] = parse_value(value)
    return out


def parse_override(text: str) -> RuleChoice:
    """``PATTERN=METHOD[,PARAM=VALUE...][,num_byzantine=F]`` -> a RuleChoice for the matching keys."""
    pattern, eq, rest = text.partition("=")  # so a pattern holds no '='
    if not eq or not pattern or not rest:
        raise MergeError(f"--override {text!r}: expected PATTERN=METHOD[,PARAM=VALUE...]")
    method, *pairs = rest.split(",")
    params: dict[str, Any] = {}
    for pair in pairs:
        k, eq2, v = pair.partition("=")
        if not eq2:
            raise MergeError(f"--override {text!r}: {pair!r} is not PARAM=VALUE")
        params[k.strip()] = parse_value(v)
    f = params.pop("num_byzantine", None)
    return RuleChoice(method.strip(), params, f, pattern)


def plan_from_toml(path: str | Path, **overrides: Any) -> MergePlan:
    """A plan from a TOML file; keyword arguments (from the command line) win over its values.

    Keys: ``method``, ``num_byzantine``, ``inputs`` (list), ``out``, ``base``,
    ``dtype``, ``shard_size``, ``seed``, ``[params]`` (the method's parameters)
    and ``[[overrides]]`` tables with ``pattern``, ``method``, ``num_byzantine``
    and ``params``.
    """
    path = Path(path)
    try:
        doc = tomllib.loads(path.read_text())
    except (OSError, tomllib.TOMLDecodeError) as e:
        raise MergeError(f"cannot read merge config {path}: {e}") from e
    known = {
        "method",
        "num_byzantine",
        "inputs",
        "out",
        "base",
        "dtype",
        "shard_size",
        "seed",
        "params",
        "overrides",
    }
    unknown = sorted(set(doc) - known)
    if unknown:
        raise MergeError(f"{path}: unknown keys {unknown}; valid keys: {sorted(known)}")
    values = {k: v for k, v in overrides.items() if v not in (None, [], (), {})}
    method = values.get("method", doc.get("method"))
    if not method:
        raise MergeError(f'{path}: no method (set method = "..." or pass --method)')
    params = {**dict(doc.get("params", {})), **values.get("params", {})}
    f = values.get("num_byzantine", doc.get("num_byzantine"))
    over = []
    for o in doc.get("overrides", []):
        if "pattern" not in o or "method" not in o:
            raise MergeError(f"{path}: every [[overrides]] needs a pattern and a method, got {o}")
        over.append(RuleChoice(o["method"], dict(o.get("params", {})), o.get("num_byzantine"), o["pattern"]))
    over += list(values.get("overrides", []))
    return MergePlan(
        inputs=tuple(values.get("inputs", doc.get("inputs", ()))),
        out=values.get("out", doc.get("out")) or "",
        rule=RuleChoice(method, params, f),
        overrides=tuple(over),
        base=values.get("base", doc.get("base")),
        dtype=values.get("dtype", doc.get("dtype")),
        shard_size=_size(values.get("shard_size", doc.get("shard_size"))),
        seed=int(values.get("seed", doc.get("seed", 0))),
    )


def _size(text: Any) -> int | None:
    from consensus.io import parse_size

    try:
        return parse_size(text)
    except ValueError as e:
        raise MergeError(f"shard size: {e}") from e


# ----------------------------------------------------------------------------- checks


def open_input(path: str | Path) -> Any:
    """A reader of one input: :class:`~consensus.io.CheckpointReader` for safetensors, else
    :class:`~meta_consensus.checkpoint.TreeReader` for an orbax checkpoint of this package.

    A folder holding ``.safetensors`` files is read as safetensors (a run folder's final
    ``consensus.safetensors`` included); a folder without any is read as an orbax step folder,
    ``checkpoints`` folder or run folder (the latest round). Anything else is a
    :class:`MergeError` naming both kinds.
    """
    from consensus import io

    p = Path(path)
    if p.is_dir() and not any(p.glob("*.safetensors")) and not any(p.glob("*.index.json")):
        # Imported here: the orbax side pulls in the run's modules (flax, optax, the node side),
        # about 0.7 s that a merge of safetensors files does not need.
        from meta_consensus.checkpoint import TreeReader, find_step_directory

        if find_step_directory(p) is None:
            raise MergeError(
                f"{p}: not a checkpoint: no .safetensors files and no orbax checkpoint of this package "
                "(<run>/checkpoints/<round>/arrays)"
            )
        return TreeReader(p)
    return io.CheckpointReader(p)


def _check_rule(choice: RuleChoice, n: int, has_base: bool) -> None:
    from consensus.registry import RULES

    spec = choice.spec  # RegistryError lists the valid names
    if spec.kind not in MERGE_KINDS:
        valid = RULES.names(lambda s: s.kind in MERGE_KINDS)
        raise MergeError(
            f"{choice.method} is a {spec.kind!r} rule (n -> n), not a merge; valid methods: {valid}"
        )
    spec.check_params(choice.params)
    missing = [p for p in spec.required if p not in choice.params and p not in spec.defaults]
    if missing:
        raise MergeError(f"{choice.label()} needs parameter(s) {missing} (--set method.NAME=VALUE)")
    if spec.takes_f and choice.num_byzantine is None:
        raise MergeError(
            f"{choice.label()} needs --num-byzantine F (how many of the {n} inputs may be Byzantine)"
        )
    f = choice.num_byzantine or 0
    if f < 0:
        raise MergeError(f"num_byzantine must be >= 0, got {f}")
    spec.check(n, f)  # ByzantineToleranceError naming the rule, n, f and the requirement
    if "params" in spec.needs and not has_base:
        raise MergeError(
            f"{choice.label()} merges task vectors: it needs --base BASE (the common pre-trained model)"
        )
    unsupported = sorted(set(spec.needs) - {"params", "key"})
    if unsupported:
        raise MergeError(f"{choice.label()} needs {unsupported}, which the merge command cannot provide")
    try:
        spec.build(choice.num_byzantine if spec.takes_f else None, **choice.params)
    except (TypeError, ValueError) as e:
        raise MergeError(f"{choice.label()}: {e}") from e


def _check_inputs(readers: Sequence[Any], base: Any | None) -> None:
    ref = readers[0]
    for r in [*readers[1:], *([base] if base is not None else [])]:
        missing = [k for k in ref.specs if k not in r.specs]
        extra = [k for k in r.specs if k not in ref.specs]
        if missing or extra:
            parts = ([f"lacks {missing[:5]}"] if missing else []) + (
                [f"has extra {extra[:5]}"] if extra else []
            )
            raise MergeError(f"{r.path} does not have the keys of {ref.path}: {'; '.join(parts)}")
        for k, (shape, dtype) in ref.specs.items():
            s, d = r.specs[k]
            if s != shape or d != dtype:
                raise MergeError(f"{k!r} is {d}{list(s)} in {r.path} but {dtype}{list(shape)} in {ref.path}")


def assign_rules(keys: Sequence[str], plan: MergePlan) -> dict[str, RuleChoice]:
    """key -> its rule (the first matching override, else the default); an unused override is an error."""
    compiled = []
    for o in plan.overrides:
        try:
            compiled.append((re.compile(o.pattern or ""), o))
        except re.error as e:
            raise MergeError(f"override pattern {o.pattern!r} is not a regular expression: {e}") from e
    out, used = {}, set()
    for k in keys:
        choice = plan.rule
        for i, (rx, o) in enumerate(compiled):
            if rx.search(k):
                choice, _ = o, used.add(i)
                break
        out[k] = choice
    unused = [o.pattern for i, (_, o) in enumerate(compiled) if i not in used]
    if unused:
        raise MergeError(
            f"override pattern(s) {unused} match no key of the inputs (keys look like {keys[:3]})"
        )
    return out


# ----------------------------------------------------------------------------- merging


def _as_compute(x: np.ndarray) -> Any:
    """Floating leaves are merged in float32 (bfloat16 / float16 inputs too) and cast back on output.

    A float32 / float64 host array is handed to jax as it is: on the CPU backend an aligned
    buffer (:func:`~meta_consensus.merge_stream.aligned_empty`) is aliased, not copied: a
    worker of :class:`~meta_consensus.merge_stream.Pipeline` reuses its buffers for its next
    piece only once this one's output is on the host (and copied where it is a view of them).
    """
    import jax
    import jax.numpy as jnp

    if np.dtype(x.dtype) in (np.dtype(np.float32), np.dtype(np.float64)):
        return jax.device_put(x)
    return jnp.asarray(x, _compute_dtype(x.dtype))


def _centre(x: Any, base: Any | None) -> Any:
    """The vector rules' centre of an (n, s) stack: the base, else the library's own
    (``robust_centre``: the coordinate-wise median, non-finite entries read as 0, by its sorting
    network or exact selection; ``jnp.median`` here made a Krum merge of 8 x 1 GB take 184 s)."""
    from consensus.aggregators._common import robust_centre

    return base if base is not None else robust_centre({"x": x})["x"]


@functools.cache
def _vector_programs() -> tuple[Any, Any]:
    """The vector rules' two per-leaf programs, jitted once (jax is imported only when a merge runs).

    * stats(x, base): (which rows are finite, the (n, n) Gram matrix of the rows around the
      centre) of an (n, s) stack. A row holding NaN or Inf (or values whose squares overflow
      float32, as the library's ``gram_stats`` counts them) has a non-finite diagonal entry and
      only spoils its own row and column of G, which the caller masks out; reading finiteness
      off the diagonal saves a reduction over the stack (2.6 ms of 6.1 per 32 MB chunk).
    * combine(x, base, w): ``c + sum_i w_i (x_i - c)`` as ``sum_i w_i x_i + (1 - sum_i w_i) c``
      in the library's one-pass weighted sum (``tensordot`` over the node axis took 15 ms per
      32 MB chunk, this 1-2 ms); 0-weight rows (NaN ones included) contribute nothing.
    """
    import jax
    import jax.numpy as jnp

    from kernels import gram as gram_kernels
    from kernels import rows as row_kernels

    def stats(x: Any, base: Any | None) -> tuple[Any, Any]:
        g = gram_kernels.gram(x, _centre(x, base))
        return jnp.isfinite(jnp.diagonal(g)), g

    def combine(x: Any, base: Any | None, w: Any) -> Any:
        return row_kernels.weighted_sum(x, w, _centre(x, base), 1.0 - jnp.sum(w))

    return jax.jit(stats), jax.jit(combine)


def _vector_weights(choice: RuleChoice, gram: np.ndarray, valid: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Weights and selection of a vector rule run on an n x n embedding with Gram matrix ``gram``."""
    import jax.numpy as jnp

    from consensus.base import get_info

    n = len(gram)
    g = np.where(valid[:, None] & valid[None, :], gram, 0.0)
    lam, u = np.linalg.eigh(g)
    embedding = (u * np.sqrt(np.clip(lam, 0.0, None))).astype(np.float32)
    rule = choice.spec.build(choice.num_byzantine if choice.spec.takes_f else None, **choice.params)
    stacked, centre = {"e": jnp.asarray(embedding)}, {"e": jnp.zeros((n,), jnp.float32)}
    _, state = rule.update(stacked, rule.init(centre), centre, mask=jnp.asarray(valid))
    info = get_info(state)
    if not info.linear:
        raise MergeError(
            f"{choice.label()}: its output is not a weighted combination of the inputs, so it cannot be "
            "merged leaf by leaf from whole-model weights; use a coordinate-wise rule or a linear vector rule"
        )
    return np.asarray(info.weights, np.float64), np.asarray(info.selected)


def _rule_key(choice: RuleChoice) -> str:
    return json.dumps([choice.method, choice.pattern], default=str)


def merge_checkpoints(
    plan: MergePlan, *, progress: bool = True, overwrite: bool = False, chunk_bytes: int = stream.CHUNK_BYTES
) -> dict[str, Any]:
    """Run a merge plan: check everything, then stream the inputs into ``plan.out``; returns the report.

    ``chunk_bytes``: the size of the column chunks that element-wise rules are streamed in
    (see :mod:`meta_consensus.merge_stream`; 0 merges every leaf whole, as other rules are).
    """
    from tqdm.auto import tqdm

    from consensus import io as ckpt
    from consensus.base import ByzantineToleranceError

    if len(plan.inputs) < 1:
        raise MergeError("no inputs: give the checkpoints to merge (files or folders)")
    if not plan.out:
        raise MergeError("no output folder: give --out DIR")
    out = Path(plan.out)
    if out.exists() and not overwrite:
        raise MergeError(f"output {out} exists; choose a new folder (nothing is ever overwritten)")
    out_dtype = None
    if plan.dtype is not None:
        try:
            names = {d.name: d for d in ckpt.safetensors.DTYPE_CODES.values()}
            out_dtype = names.get(plan.dtype) or ckpt.safetensors.DTYPE_CODES.get(plan.dtype.upper())
            if out_dtype is None:
                raise MergeError(f"--dtype {plan.dtype!r} is not a safetensors dtype; valid: {sorted(names)}")
            ckpt.safetensors.dtype_code(out_dtype)
        except ckpt.CheckpointError as e:
            raise MergeError(f"--dtype {plan.dtype!r}: {e}") from e
    n = len(plan.inputs)
    try:
        for choice in (plan.rule, *plan.overrides):
            _check_rule(choice, n, plan.base is not None)
    except ByzantineToleranceError as e:
        raise MergeError(f"{e} ({n} inputs given)") from e

    readers: list[Any] = []
    base = None
    compiled: _Compiled | None = None
    try:
        for p in plan.inputs:
            readers.append(open_input(p))
        base = open_input(plan.base) if plan.base else None
        _check_inputs(readers, base)
        keys = list(readers[0].specs)
        rules = assign_rules(keys, plan)
        specs = {}
        for k, (shape, dtype) in readers[0].specs.items():
            specs[k] = (shape, out_dtype if (out_dtype is not None and _is_float(dtype)) else dtype)
        report: dict[str, Any] = {
            "method": plan.rule.method,
            "params": dict(plan.rule.params),
            "num_byzantine": plan.rule.num_byzantine,
            "overrides": [
                {
                    "pattern": o.pattern,
                    "method": o.method,
                    "params": dict(o.params),
                    "num_byzantine": o.num_byzantine,
                }
                for o in plan.overrides
            ],
            "inputs": [str(p) for p in plan.inputs],
            "base": plan.base,
            # the round each orbax input was read from (a checkpoints or run folder: its latest)
            "orbax_steps": {
                str(p): str(r.step_directory)
                for p, r in zip([*plan.inputs, plan.base], [*readers, base], strict=True)
                if hasattr(r, "step_directory")
            },
            "dtype": plan.dtype,
            "seed": plan.seed,
            "vector_rules": {},
            "leaves": {},
        }
        total = len(keys)
        vector_groups: dict[str, list[str]] = {}
        for k in keys:
            if rules[k].spec.kind == "vector" and _is_float(readers[0].specs[k][1]):
                vector_groups.setdefault(_rule_key(rules[k]), []).append(k)
        weights: dict[str, tuple[np.ndarray, np.ndarray]] = {}
        bar = tqdm(
            total=total + sum(len(v) for v in vector_groups.values()), disable=not progress, unit="leaf"
        )
        # The leaves of an element-wise rule, and of a vector rule (its Gram matrix sums over
        # columns, its output is c + sum_i w_i (x_i - c) column by column), are read in column
        # chunks; the others whole.
        chunked = {
            k
            for k in keys
            if chunk_bytes > 0
            and (rules[k].spec.elementwise or rules[k].spec.kind == "vector")
            and "key" not in rules[k].spec.needs
            and _is_float(readers[0].specs[k][1])
            and stream.can_chunk([*readers, base], k)
        }
        pieces = stream.plan_pieces(keys, readers[0].specs, chunked, n, chunk_bytes)
        # its updates, compiled in the background while pass 1 or the first reads run
        compiled = _Compiled(
            [
                (rules[p.key], shape, _compute_dtype(dtype), base is not None)
                for p in pieces
                for dtype in [readers[0].specs[p.key][1]]
                for shape in [(n, *readers[0].specs[p.key][0]) if p.whole else (n, p.padded)]
                if _is_float(dtype) and rules[p.key].spec.kind != "vector"
            ]
        )
        for group, group_keys in vector_groups.items():
            gram, finite = np.zeros((n, n)), np.ones(n, bool)

            # pass 1: the Gram matrix of the whole slice, a leaf or a chunk at a time (a chunk's
            # zero padding adds nothing: its rows, base and centre are all 0 there)
            def gram_of(piece: stream.Piece, buffers: dict) -> tuple[np.ndarray, np.ndarray]:
                stacked, base_leaf = stream.read_piece(readers, base, piece, buffers)
                x = _as_compute(stacked).reshape(n, -1)
                b = None if base_leaf is None else _as_compute(base_leaf).reshape(-1)
                leaf_finite, leaf_gram = _vector_programs()[0](x, b)
                return np.asarray(leaf_finite), np.asarray(leaf_gram, np.float64)

            in_group = set(group_keys)
            group_pieces = [p for p in pieces if p.key in in_group]
            for piece, (leaf_finite, leaf_gram) in zip(
                group_pieces, stream.Pipeline(gram_of, group_pieces), strict=True
            ):
                finite &= leaf_finite
                gram += leaf_gram
                if piece.last:
                    bar.update(1)
            choice = rules[group_keys[0]]
            w, selected = _vector_weights(choice, gram, finite)
            weights[group] = (w, selected)
            report["vector_rules"][choice.label()] = {
                "leaves": len(group_keys),
                "weights": [round(float(v), 8) for v in w],
                "selected": [plan.inputs[i] for i in np.flatnonzero(selected)],
                "excluded_nonfinite": [plan.inputs[i] for i in np.flatnonzero(~finite)],
            }
        with ckpt.atomic_directory(out, overwrite=overwrite) as tmp:
            writer = ckpt.ShardedWriter(
                tmp,
                specs,
                shard_size=plan.shard_size,
                metadata={"merged_by": "meta-consensus merge"},
                direct=True,  # the page cache stays with the inputs (see consensus.io.DirectFile)
            )
            # pass 2: two workers read and merge pieces (leaves or chunks) while earlier leaves are written
            background = stream.Writer(writer)
            index_of = {k: i for i, k in enumerate(keys)}

            def merge_piece(piece: stream.Piece, buffers: dict) -> tuple[Any, dict[str, Any]]:
                """A worker's piece: a whole leaf merged (host array, report), or a chunk (values, info)."""
                k = piece.key
                shape, dtype = specs[k]
                stacked, base_piece = stream.read_piece(readers, base, piece, buffers)
                where = (plan.seed, index_of[k], compiled)  # the rule's key, and its compiled updates
                if piece.whole or rules[k].spec.kind == "vector":
                    vector = weights.get(_rule_key(rules[k]))
                    merged, leaf_report = _merge_leaf(stacked, base_piece, k, rules[k], vector, *where)
                    host = np.asarray(merged)
                    host = host.reshape(shape) if piece.whole else host[: piece.width]
                    host = host.astype(dtype, copy=False)
                else:
                    merged, info = _apply_update(stacked, base_piece, rules[k], *where)
                    host = np.asarray(merged)[: piece.width].astype(dtype, copy=False)
                    leaf_report = _leaf_report(rules[k], info)
                if np.may_share_memory(host, stacked):  # a rule that passed an input through
                    host = host.copy()  # the worker's buffer is reused for its next piece
                return host, leaf_report

            leaf: _ChunkedLeaf | None = None
            try:
                for piece, (host, leaf_report) in zip(
                    pieces, stream.Pipeline(merge_piece, pieces), strict=True
                ):
                    k = piece.key
                    if not piece.whole:
                        if piece.start == 0:
                            leaf = _ChunkedLeaf()
                        leaf.add(host, leaf_report)
                        if not piece.last:
                            continue
                        host = leaf.parts if leaf.consistent else None
                        if host is None:  # the chunks found different valid nodes: merge the leaf whole
                            host, leaf_report = merge_piece(stream.Piece(k), {})
                    background.write(k, host)
                    report["leaves"][k] = leaf_report
                    bar.update(1)
                background.close()  # the last write's error, if any, raises here
            finally:
                background.pool.shutdown(wait=True, cancel_futures=True)
                writer.abort()
            writer.close()
            (tmp / REPORT_NAME).write_text(json.dumps(report, indent=2) + "\n")
        bar.close()
    finally:
        if compiled is not None:
            compiled.close()
        for r in [*readers, *([base] if base else [])]:
            r.close()
    return report


def _compute_dtype(dtype: np.dtype) -> np.dtype:
    """The dtype :func:`_as_compute` merges a floating leaf of ``dtype`` in."""
    import jax

    # float32 / float64 are kept (float64 becomes float32 without jax's x64 mode); the
    # narrower floats (bfloat16, float16) are merged in float32.
    keep = np.dtype(dtype) in (np.dtype(np.float32), np.dtype(np.float64))
    return np.dtype(jax.dtypes.canonicalize_dtype(dtype if keep else np.float32))


def _is_float(dtype: np.dtype) -> bool:
    import ml_dtypes

    return bool(np.issubdtype(dtype, np.floating)) or np.dtype(dtype) == np.dtype(ml_dtypes.bfloat16)


def _jitted_update(choice: RuleChoice, has_base: bool) -> Any:
    """The rule's update on one stacked leaf ``{"x": x}``, jitted: XLA fuses the rule's passes over
    the leaf, where eager dispatch would run them one by one."""
    import jax

    spec = choice.spec
    keyed = "key" in spec.needs
    rule = spec.build(choice.num_byzantine if spec.takes_f else None, **choice.params)

    def update(x: Any, params: Any, key: Any) -> Any:
        extra = {"key": key} if keyed else {}
        init = params if has_base else {"x": x[0]}
        return rule.update({"x": x}, rule.init(init), params if has_base else None, **extra)

    return jax.jit(update)


class _Compiled:
    """The plan's leaf updates, compiled ahead of time in a background thread, one per distinct
    (rule, leaf shape, compute dtype, base given).

    Compiling costs ~0.1 s per shape on a CPU, a fixed cost that was on the merge's critical
    path at the first leaf of every shape (four shapes: ~0.45 s, against ~1 s for reading
    8 GB of inputs); compiled here in the order the leaves come, each one is ready by the
    time its first leaf is read, and XLA's compiler releases the GIL.
    """

    def __init__(self, jobs: Sequence[tuple[RuleChoice, tuple[int, ...], Any, bool]]):
        from concurrent.futures import ThreadPoolExecutor

        import jax

        self.pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="merge-compile")
        self.futures: dict[tuple[str, tuple[int, ...], str, bool], Any] = {}
        fns: dict[tuple[str, bool], Any] = {}
        key_spec = jax.eval_shape(lambda: jax.random.key(0))
        for choice, shape, dtype, has_base in jobs:
            slot = (_rule_key(choice), tuple(shape), np.dtype(dtype).name, has_base)
            if slot in self.futures:
                continue
            if (slot[0], has_base) not in fns:
                fns[slot[0], has_base] = _jitted_update(choice, has_base)
            fn = fns[slot[0], has_base]
            x = jax.ShapeDtypeStruct(shape, dtype)
            params = {"x": jax.ShapeDtypeStruct(shape[1:], dtype)} if has_base else None
            key = key_spec if "key" in choice.spec.needs else None
            self.futures[slot] = self.pool.submit(lambda f=fn, a=(x, params, key): f.lower(*a).compile())

    def get(self, shape: tuple[int, ...], dtype: Any, has_base: bool, choice: RuleChoice) -> Any:
        future = self.futures.get((_rule_key(choice), tuple(shape), np.dtype(dtype).name, has_base))
        return None if future is None else future.result()

    def close(self) -> None:
        self.pool.shutdown(wait=True, cancel_futures=True)


def _merge_leaf(
    stacked: np.ndarray,
    base_leaf: np.ndarray | None,
    key: str,
    choice: RuleChoice,
    vector: tuple[np.ndarray, np.ndarray] | None,
    seed: int,
    index: int,
    compiled: _Compiled | None = None,
) -> tuple[Any, dict[str, Any]]:
    import jax.numpy as jnp

    n = len(stacked)
    if not _is_float(stacked.dtype):
        if not all(np.array_equal(stacked[0], stacked[i]) for i in range(1, n)):
            raise MergeError(
                f"{key!r} is a {stacked.dtype} tensor that differs between inputs; "
                "only float tensors are merged"
            )
        # A copy: the stack's buffer is reused for a later leaf while this one is being written.
        return stacked[0].copy(), {"method": "copy (non-float, equal in every input)"}
    if vector is not None:
        w, _ = vector
        flat = _as_compute(stacked).reshape(n, -1)
        b = None if base_leaf is None else _as_compute(base_leaf).reshape(-1)
        merged = _vector_programs()[1](flat, b, jnp.asarray(w, jnp.float32))
        return merged, {"method": choice.method, "weights": "whole-model (see vector_rules)"}
    merged, info = _apply_update(stacked, base_leaf, choice, seed, index, compiled)
    return merged, _leaf_report(choice, info)


def _apply_update(
    stacked: Any, base: Any | None, choice: RuleChoice, seed: int, index: int, compiled: _Compiled | None
) -> tuple[Any, Any]:
    """The rule's (merged leaf or chunk, info) on a float stack; the key is ``fold_in(key(seed), index)``."""
    import jax

    from consensus.base import get_info

    x = _as_compute(stacked)
    params = None if base is None else {"x": _as_compute(base)}
    key = jax.random.fold_in(jax.random.key(seed), index) if "key" in choice.spec.needs else None
    fn = compiled.get(x.shape, x.dtype, params is not None, choice) if compiled is not None else None
    if fn is None:
        fn = _jitted_update(choice, params is not None)
    merged, state = fn(x, params, key)
    return merged["x"], get_info(state)


def _leaf_report(choice: RuleChoice, info: Any) -> dict[str, Any]:
    leaf_report: dict[str, Any] = {
        "method": choice.method,
        "selected": [int(i) for i in np.flatnonzero(np.asarray(info.selected))],
    }
    if info.linear:
        leaf_report["weights"] = [round(float(v), 8) for v in np.asarray(info.weights)]
    return leaf_report


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


# ----------------------------------------------------------------------------- command line


def add_parser(sub: Any) -> None:
    """Register the ``merge`` subcommand on the CLI's subparsers."""
    p = sub.add_parser(
        "merge",
        help="merge checkpoints (safetensors files or folders, or this package's orbax checkpoints) "
        "with a registered rule",
    )
    p.add_argument(
        "inputs",
        nargs="*",
        metavar="INPUT",
        help="checkpoints: .safetensors files, sharded safetensors folders, or orbax checkpoints of "
        "this package (a <run>/checkpoints/<round> folder, or a checkpoints or run folder: its latest "
        "round; the consensus is merged); kinds may be mixed",
    )
    p.add_argument("--method", help="a rule of consensus.registry.RULES (median, trimmed_mean, krum, ...)")
    p.add_argument("--num-byzantine", "-f", type=int, default=None, help="f, for the rules that take one")
    p.add_argument(
        "--set", action="append", default=[], metavar="method.PARAM=VALUE", help="a rule parameter"
    )
    p.add_argument(
        "--override",
        action="append",
        default=[],
        metavar="PATTERN=METHOD[,PARAM=VALUE...]",
        help="another rule for the keys a regex matches, e.g. '^head\\.=median' (first match wins)",
    )
    p.add_argument(
        "--base", help="the common base model, any input kind (needed by merge methods over task vectors)"
    )
    p.add_argument("--out", help="output folder (must not exist)")
    p.add_argument("--dtype", help="output dtype of float tensors (default: the inputs')")
    p.add_argument("--shard-size", help="shard the output above this size, e.g. 2GB")
    p.add_argument("--seed", type=int, default=None, help="seed of randomized rules (default 0)")
    p.add_argument("--config", help="merge TOML file (command-line options win)")
    p.add_argument("--quiet", action="store_true", help="no progress bar")


def plan_from_args(args: Any) -> MergePlan:
    overrides = [parse_override(o) for o in args.override]
    values = {
        "method": args.method,
        "params": parse_sets(args.set),
        "num_byzantine": args.num_byzantine,
        "inputs": list(args.inputs),
        "out": args.out,
        "base": args.base,
        "dtype": args.dtype,
        "shard_size": args.shard_size,
        "seed": args.seed,
        "overrides": overrides,
    }
    if args.config:
        return plan_from_toml(args.config, **values)
    if not args.method:
        raise MergeError("give --method NAME (or --config merge.toml)")
    return MergePlan(
        inputs=tuple(args.inputs),
        out=args.out or "",
        rule=RuleChoice(args.method, values["params"], args.num_byzantine),
        overrides=tuple(overrides),
        base=args.base,
        dtype=args.dtype,
        shard_size=_size(args.shard_size),
        seed=args.seed or 0,
    )


def user_errors() -> tuple[type[Exception], ...]:
    """The exception types that are the user's mistake (one line, exit 2 in the CLI)."""
    from consensus.base import ByzantineToleranceError
    from consensus.io import CheckpointError, CheckpointKeyError
    from consensus.registry import RegistryError

    return (MergeError, RegistryError, CheckpointError, CheckpointKeyError, ByzantineToleranceError)


def merge_cmd(args: Any) -> int:
    """The ``merge`` subcommand: 0 on success; user errors raise (the CLI prints one line, exit 2)."""
    plan = plan_from_args(args)
    report = merge_checkpoints(plan, progress=not args.quiet)
    print(
        f"meta-consensus merge: {len(plan.inputs)} inputs, {len(report['leaves'])} tensors, "
        f"method {plan.rule.method} -> {plan.out}/ ({REPORT_NAME})"
    )
    return 0
