"""Run a mergekit configuration tensor by tensor with mergekit's formulas (slices, gradients, every method).

What the plan-based merge (:mod:`meta_consensus.merge.mergekit`) cannot express runs here:
``slices:`` (layer ranges, passthrough layer stacking), gradients over layers, parameters that
differ per model (densities, gamma, epsilon), the methods only mergekit has (breadcrumbs,
DELLA, SCE, NuSLERP, Multi-SLERP, NearSwap, RAM, Arcee Fusion, passthrough), and
``--compute-dtype config`` (mergekit's arithmetic in the configuration's ``dtype``).

Each output tensor is read from its sources (one tensor per model at a time), merged by the
numpy formula of :mod:`consensus.merging.generalized`, :mod:`~consensus.merging.spherical` or
:mod:`~consensus.merging.sparsify`, cast to the output dtype and written; memory is a few
copies of the largest tensor, never a model. Float tensors are read in chunks: element-wise
methods chunk by chunk, the task-vector ones in two passes (masks, then the merge), and those
needing a tensor-wide statistic (SLERP, NuSLERP, Multi-SLERP, SCE, Arcee Fusion, RAM+) in a
pass per statistic (:mod:`consensus.merging.streamed`). Layers are found by name: the tensors
``PREFIX.N.REST`` under the prefix with the most numbered entries (``model.layers``,
``transformer.h``); tensors outside it come before the layers (embeddings) or after them
(final norm, head: names holding ``norm``, ``ln_f``, ``lm_head``), from the first slice's or
the last slice's sources as in mergekit.
"""

from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from meta_consensus.merge.errors import MergeError
from meta_consensus.merge.mergekit_config import NO_EFFECT, MergekitConfig, Slice, Source, fail

GTA_SHARED = {"int8_mask": False, "normalize": None, "rescale": None, "lambda": 1.0}
# name -> (shared parameters with defaults (None: required), per-model ones, base: "required" |
# "optional" | "none", (min, max) non-base models). mergekit 0.1.5's merge_methods/*.
METHODS: dict[str, tuple[dict[str, Any], dict[str, Any], str, tuple[int, int | None]]] = {
    "linear": ({"normalize": True}, {"weight": None}, "none", (1, None)),
    "slerp": ({"t": None}, {}, "required", (1, 1)),
    "nuslerp": ({"nuslerp_row_wise": False, "nuslerp_flatten": True}, {"weight": None}, "optional", (2, 2)),
    "multislerp": ({"normalize_weights": True, "eps": 1e-8}, {"weight": None}, "optional", (1, None)),
    "nearswap": ({"t": None}, {}, "required", (1, 1)),
    "arcee_fusion": ({}, {}, "required", (1, 1)),
    "sce": ({"int8_mask": False, "select_topk": 1.0}, {}, "required", (0, None)),
    "ram": ({"epsilon": 1e-5}, {}, "required", (0, None)),
    "ramplus_tl": ({"r": 0.1, "alpha": 0.2, "epsilon": 1e-5}, {}, "required", (0, None)),
    "passthrough": ({}, {"scale": "optional"}, "none", (1, 1)),
}
REFUSED_METHODS = {
    "model_stock": "model_stock runs with models: and one value per parameter (the plan-based merge); "
    "with slices or gradients it is not supported here",
    "karcher": "karcher runs with models: and one value per parameter (the plan-based merge); "
    "with slices or gradients it is not supported here",
}
POST = re.compile(
    r"(^|\.)(lm_head|embed_out|score|norm|ln_f|final_layer_norm|final_layernorm|final_norm)(\.|$)"
)
LAYER = re.compile(r"^(.*?)\.(\d+)\.(.+)$")


def method_table(name: str) -> tuple[dict[str, Any], dict[str, Any], str, tuple[int, int | None]]:
    """A method's parameters and base policy, mergekit 0.1.5's (task-vector methods included).

    Args:
      name: The ``merge_method``.

    Returns:
      (shared parameters with defaults, per-model ones, base policy, (min, max) non-base models).

    Raises:
      MergeError: If the method is not one mergekit 0.1.5 registers, or is refused here.
    """
    from consensus.merging.generalized import GTA_METHODS

    if name in GTA_METHODS:
        sparse, _, normalize, rescale = GTA_METHODS[name]
        per = {"weight": None, "density": 1.0}
        if sparse == "magnitude_outliers":
            per["gamma"] = 0.01
        if sparse == "della_magprune":
            per["epsilon"] = 0.15
        return {**GTA_SHARED, "normalize": normalize, "rescale": rescale}, per, "required", (0, None)
    if name in METHODS:
        return METHODS[name]
    if name in REFUSED_METHODS:
        raise MergeError(REFUSED_METHODS[name])
    known = sorted([*GTA_METHODS, *METHODS, *REFUSED_METHODS])
    raise MergeError(f"merge_method {name!r} is not one of mergekit 0.1.5's methods: {known}")


# ----------------------------------------------------------------------------- layout


@dataclasses.dataclass
class Layout:
    """Where one model's layers are: the prefix of its numbered tensors and their count."""

    prefix: str | None
    layers: int
    keys: list[str]

    def layer_keys(self, index: int) -> list[str]:
        """The tensor names of layer ``index``, in the checkpoint's order."""
        head = f"{self.prefix}.{index}."
        return [k for k in self.keys if k.startswith(head)]

    def outside(self) -> tuple[list[str], list[str]]:
        """The tensors outside the layers: (those before them, those after them)."""
        rest = [k for k in self.keys if self.prefix is None or not k.startswith(f"{self.prefix}.")]
        return [k for k in rest if not POST.search(k)], [k for k in rest if POST.search(k)]


def layout_of(keys: Sequence[str], config: Mapping[str, Any] | None) -> Layout:
    """Find a model's layers: the prefix with the most numbered tensors, and how many layers.

    Args:
      keys: The model's tensor names.
      config: Its ``config.json``, or None (the count is then read off the names).

    Returns:
      The layout (prefix None when no tensor is numbered).
    """
    counts: dict[str, set[int]] = {}
    for k in keys:
        m = LAYER.match(k)
        if m:
            counts.setdefault(m.group(1), set()).add(int(m.group(2)))
    if not counts:
        return Layout(None, 0, list(keys))
    prefix = max(counts, key=lambda p: (len(counts[p]), -len(p)))
    n = max(counts[prefix]) + 1
    for name in ("num_hidden_layers", "n_layer", "num_layers"):
        if config and isinstance(config.get(name), int):
            n = int(config[name])
            break
    return Layout(prefix, n, list(keys))


def _model_config(model: str) -> dict[str, Any] | None:
    """A model folder's ``config.json``, or None."""
    p = Path(model)
    f = p / "config.json" if p.is_dir() else p.parent / "config.json"
    if p.is_dir() and f.is_file():
        try:
            return dict(json.loads(f.read_text()))
        except ValueError:
            return None
    return None


# ----------------------------------------------------------------------------- the job


@dataclasses.dataclass
class Tensor:
    """One output tensor: its name, the slice, t, and (source, input name) per source."""

    name: str
    slice: Slice
    t: float
    inputs: list[tuple[Source, str]]
    layer: int | None  # its output layer, or None outside the layers


@dataclasses.dataclass
class MergekitJob:
    """A mergekit configuration to run tensor by tensor (:func:`run_job`).

    Attributes:
      config: The configuration.
      out: The output folder.
      seed: The seed of the random methods (DARE, DELLA, Arcee Fusion's sampled quantiles).
      dtype: ``--dtype``: the output's float dtype, over the file's ``out_dtype`` / ``dtype``.
      compute: ``"float32"`` (compute in float32, cast once) or ``"config"`` (mergekit's: in the
        configuration's ``dtype``, every intermediate rounded).
      shard_size: Bytes above which the output is sharded.
    """

    config: MergekitConfig
    out: str
    seed: int = 0
    dtype: str | None = None
    compute: str = "float32"
    shard_size: int | None = None

    @property
    def inputs(self) -> list[str]:
        """Every model the configuration reads, in order of first mention."""
        return list(dict.fromkeys(s.model for sl in self.config.slices for s in sl.sources))


def _check_method(cfg: MergekitConfig) -> None:
    """Refuse a method, parameter or slice shape mergekit would refuse (one line each)."""
    shared, per, base_policy, (lo, hi) = method_table(cfg.method)
    for key in cfg.params:
        if key not in shared and key not in per:
            raise fail(
                cfg.path,
                f"parameters.{key}",
                f"{cfg.method} takes no such parameter; it takes {sorted({**shared, **per})}",
            )
    for s in cfg.slices:
        for key in s.params:
            if key not in shared and key not in per:
                raise fail(cfg.path, f"{s.where}.parameters.{key}", f"{cfg.method} takes no such parameter")
        base = cfg.base_of(s)
        for src in s.sources:
            for key in src.params:
                if key not in per:
                    raise fail(
                        cfg.path, f"{src.where}.parameters.{key}", f"{cfg.method} takes no per-model {key!r}"
                    )
        models = [src.model for src in s.sources]
        if base_policy == "required" and (base is None or base not in models):
            raise fail(cfg.path, "base_model", f"{cfg.method} needs a base_model among {s.where}'s sources")
        non_base = len([m for m in models if m != base]) if base_policy != "none" else len(models)
        if non_base < lo or (hi is not None and non_base > hi):
            want = f"exactly {lo}" if lo == hi else f"at least {lo}" if hi is None else f"{lo} to {hi}"
            raise fail(
                cfg.path, s.where, f"{cfg.method} merges {want} model(s) besides the base, got {non_base}"
            )


def plan_tensors(
    cfg: MergekitConfig, layouts: Mapping[str, Layout]
) -> tuple[list[Tensor], list[tuple[Slice, int, int]]]:
    """The output tensors in write order (before the layers, the layers slice by slice, after them).

    Args:
      cfg: The configuration (``models:`` slices get their layer ranges here).
      layouts: Each model's layout.

    Returns:
      (the tensors, per output layer (slice, its source layer offset, output index)).

    Raises:
      MergeError: If a layer range exceeds a model's layers, or a source lacks a tensor.
    """
    for s in cfg.slices:
        for src in s.sources:
            n = layouts[src.model].layers
            if src.layer_range is None:
                src.layer_range = (0, n)
            elif src.layer_range[1] > n and layouts[src.model].prefix is not None:
                raise fail(
                    cfg.path,
                    f"{src.where}.layer_range",
                    f"{src.model} has {n} layers, range {list(src.layer_range)}",
                )
        counts = {src.layer_range[1] - src.layer_range[0] for src in s.sources if src.layer_range}
        if len(counts) > 1:
            raise fail(cfg.path, s.where, f"its models have different layer counts {sorted(counts)}")

    def entry(name: str, s: Slice, t: float, names: list[str], layer: int | None) -> Tensor:
        for src, k in zip(s.sources, names, strict=True):
            if k not in layouts[src.model].keys:
                raise MergeError(f"{src.model} has no tensor {k!r} (needed for {name!r})")
        return Tensor(name, s, t, list(zip(s.sources, names, strict=True)), layer)

    first, last = cfg.slices[0], cfg.slices[-1]
    ref = layouts[first.sources[0].model]
    pre, _ = ref.outside()
    _, post = layouts[last.sources[0].model].outside()
    out = [entry(k, first, 0.0, [k] * len(first.sources), None) for k in pre]
    layers: list[tuple[Slice, int, int]] = []
    index = 0
    for s in cfg.slices:
        assert s.sources[0].layer_range is not None
        count = s.sources[0].layer_range[1] - s.sources[0].layer_range[0]
        for offset in range(count):
            t = offset / (count - 1) if count > 1 else 1.0
            lay0 = layouts[s.sources[0].model]
            start0 = s.sources[0].layer_range[0] + offset
            for k in lay0.layer_keys(start0):
                rest = k[len(f"{lay0.prefix}.{start0}.") :]
                names = []
                for src in s.sources:
                    lay = layouts[src.model]
                    assert src.layer_range is not None
                    names.append(f"{lay.prefix}.{src.layer_range[0] + offset}.{rest}")
                out.append(entry(f"{ref.prefix}.{index}.{rest}", s, t, names, index))
            layers.append((s, offset, index))
            index += 1
    out += [entry(k, last, 0.0, [k] * len(last.sources), None) for k in post]
    return out, layers


def _resolve(cfg: MergekitConfig, tensor: Tensor) -> tuple[dict[str, Any], dict[str, list[Any]], str | None]:
    """One tensor's parameters: (shared ones, per-model ones over the non-base models, the base)."""
    shared, per, base_policy, _ = method_table(cfg.method)
    s = tensor.slice
    base = cfg.base_of(s) if base_policy != "none" else None
    p = {
        k: cfg.parameter(k, s, source=None, tensor=tensor.name, t=tensor.t, default=d, required=d is None)
        for k, d in shared.items()
    }

    def each(name: str) -> list[Any]:
        d = per[name]
        return [
            cfg.parameter(
                name,
                s,
                source=src,
                tensor=k,
                t=tensor.t,
                default=None if d == "optional" else d,
                required=d is None,
            )
            for (src, k) in tensor.inputs
            if src.model != base or base_policy == "none"
        ]

    return p, {k: each(k) for k in per}, base


CHUNK = 1 << 20  # entries per chunk of the task-vector merges' second pass


def _gta_streamed(
    cfg: MergekitConfig,
    tensor: Tensor,
    readers: Mapping[str, Any],
    compute: Any,
    rng: np.random.Generator,
    out_dtype: Any,
    chunk: int | None = None,
) -> tuple[np.ndarray, dict[str, Any]]:
    """A task-vector merge (TIES, DARE, breadcrumbs, DELLA, ...) of one tensor in two passes.

    Pass 1 reads one model at a time and keeps only its sparsification (a bool mask and the L1
    rescale factor, :func:`~consensus.merging.sparsify.sparsify_mask`); pass 2 reads the models
    and the base in flat chunks and merges each (:func:`~consensus.merging.generalized.mix`,
    element-wise over the models). The result equals
    :func:`~consensus.merging.generalized.generalized_task_arithmetic` of the whole tensors, with
    a few copies of the tensor in memory instead of 2n.
    """
    from consensus.merging import generalized
    from consensus.merging.sparsify import sparsify_mask

    chunk = chunk or CHUNK
    p, per, base = _resolve(cfg, tensor)
    sparse, consensus, _, _ = generalized.GTA_METHODS[cfg.method]
    record = {**p, **{k: v for k, v in per.items()}}
    assert base is not None  # the task-vector methods require one (_check_method)
    base_in = next(k for src, k in tensor.inputs if src.model == base)
    base_reader = readers[base]
    models = [(readers[src.model], k) for src, k in tensor.inputs if src.model != base]
    shape = tuple(base_reader.specs[base_in][0])
    size = int(np.prod(shape, dtype=np.int64))
    plans: list[tuple[Any, Any, Any]] = []
    for i, (reader, key) in enumerate(models):
        if sparse is None:
            plans.append((None, None, np.dtype(compute)))
            continue
        d = _read(reader, key).astype(compute, copy=False)
        b = _read(base_reader, base_in).astype(compute, copy=False)
        d = np.subtract(d, b, out=d) if d.flags.writeable else d - b
        del b
        mask, factor, work = sparsify_mask(
            d,
            sparse,
            float(per["density"][i]),
            rescale=bool(p["rescale"]),
            gamma=float(per["gamma"][i]) if "gamma" in per else 0.01,
            epsilon=float(per["epsilon"][i]) if "epsilon" in per else 0.15,
            rng=rng,
        )
        # packed 8 entries a byte: the masks of n models cost n/8 bytes per entry until pass 2
        plans.append((None if mask is None else np.packbits(mask), factor, work))
        del d, mask
    out = np.empty(size, out_dtype)
    weights = [float(w) for w in per["weight"]]
    for start in range(0, size, chunk):
        stop = min(size, start + chunk)
        b = _read_range(base_reader, base_in, start, stop).astype(compute, copy=False)
        deltas = np.empty((len(models), stop - start), np.dtype(compute))
        for i, ((reader, key), (mask, factor, work)) in enumerate(zip(models, plans, strict=True)):
            x = _read_range(reader, key, start, stop)
            bits = None if mask is None else _unpack(mask, start, stop)
            deltas[i] = generalized.masked_delta(x, b, bits, factor, work)
        merged = generalized.mix(
            b, deltas, weights, consensus=consensus, normalize=bool(p["normalize"]), scale=float(p["lambda"])
        )
        out[start:stop] = merged.astype(out_dtype, copy=False)
    return out.reshape(shape), record


# The methods whose output entry depends only on the inputs' same entry: merged chunk by chunk.
ELEMENTWISE = ("linear", "nearswap", "ram", "passthrough")


def _elementwise_streamed(
    cfg: MergekitConfig,
    tensor: Tensor,
    readers: Mapping[str, Any],
    job: MergekitJob,
    cfg_dtype: Any,
    index: int,
    out_dtype: Any,
    chunk: int | None = None,
) -> tuple[np.ndarray, dict[str, Any]]:
    """An element-wise method (:data:`ELEMENTWISE`) on one tensor, in flat chunks of every input."""
    chunk = chunk or CHUNK
    reader0, key0 = readers[tensor.inputs[0][0].model], tensor.inputs[0][1]
    shape, first = reader0.specs[key0]
    size = int(np.prod(shape, dtype=np.int64))
    if job.compute == "config":
        compute = cfg_dtype if cfg_dtype is not None else first
    else:
        compute = np.float64 if np.dtype(first) == np.float64 else np.float32
    out = np.empty(size, out_dtype)
    params: dict[str, Any] = {}
    for start in range(0, size, chunk):
        stop = min(size, start + chunk)
        arrays = [
            _read_range(readers[src.model], k, start, stop).astype(compute, copy=False)
            for src, k in tensor.inputs
        ]
        merged, params = _merge_one(cfg, tensor, arrays, np.random.default_rng([job.seed, index]), False)
        out[start:stop] = np.asarray(merged).astype(out_dtype, copy=False)
    return out.reshape(shape), params


# The methods that need statistics of the whole tensor (norms, dot products, a variance rank, a
# quantile, counts) before any entry: their passes read chunks (consensus.merging.streamed).
STREAMED = ("slerp", "nuslerp", "multislerp", "sce", "arcee_fusion", "ramplus_tl")


def _can_stream(tensor: Tensor, readers: Mapping[str, Any]) -> bool:
    """Whether every input of a tensor is read by range and it has entries (and an axis: Arcee Fusion)."""
    shape = readers[tensor.inputs[0][0].model].specs[tensor.inputs[0][1]][0]
    return (
        len(shape) > 0
        and int(np.prod(shape, dtype=np.int64)) > 0
        and all(hasattr(readers[src.model], "read_range_into") for src, _ in tensor.inputs)
    )


def _stats_streamed(
    cfg: MergekitConfig,
    tensor: Tensor,
    readers: Mapping[str, Any],
    job: MergekitJob,
    cfg_dtype: Any,
    index: int,
    out_dtype: Any,
    chunk: int | None = None,
) -> tuple[np.ndarray, dict[str, Any]]:
    """A method of :data:`STREAMED` on one tensor: its statistics pass by pass, then the merge, in chunks.

    The same operations as :func:`_merge_one` on whole tensors (whole-tensor sums accumulated
    chunk by chunk, see :mod:`consensus.merging.streamed`), with one chunk per input alive
    instead of every input's whole tensor.
    """
    from consensus.merging import generalized, streamed

    chunk = chunk or CHUNK
    reader0, key0 = readers[tensor.inputs[0][0].model], tensor.inputs[0][1]
    shape, first = reader0.specs[key0]
    size = int(np.prod(shape, dtype=np.int64))
    if job.compute == "config":
        compute = cfg_dtype if cfg_dtype is not None else first
    else:
        compute = np.float64 if np.dtype(first) == np.float64 else np.float32
    m = cfg.method
    # as _merge_one: mergekit's slerp computes in float32 whatever the configuration's dtype
    then = np.float32 if (m == "slerp" and job.compute == "config") else None

    def read(model: str, key: str) -> streamed.Read:
        reader = readers[model]

        def entries(start: int, stop: int) -> np.ndarray:
            a = _read_range(reader, key, start, stop).astype(compute, copy=False)
            return a if then is None else a.astype(then, copy=False)

        return entries

    p, per, base = _resolve(cfg, tensor)
    record = {k: v for k, v in {**p, **per}.items() if v is not None}
    xs = [read(src.model, k) for src, k in tensor.inputs if src.model != base]
    b = next((read(src.model, k) for src, k in tensor.inputs if src.model == base), None)
    out = np.empty(size, out_dtype)
    if m == "slerp":
        assert b is not None
        streamed.slerp(float(p["t"]), b, xs[0], size, out, chunk=chunk)
    elif m == "nuslerp":
        w = [float(v) for v in per["weight"]]
        t = 0.5 if abs(sum(w)) < 1e-6 else w[1] / sum(w)
        row_wise, flatten = bool(p["nuslerp_row_wise"]), bool(p["nuslerp_flatten"])
        streamed.nuslerp(t, xs[0], xs[1], shape, out, base=b, row_wise=row_wise, flatten=flatten, chunk=chunk)
    elif m == "multislerp":
        weights = [float(v) for v in per["weight"]]
        normalize, eps = bool(p["normalize_weights"]), float(p["eps"])
        streamed.multislerp(xs, weights, size, out, base=b, normalize_weights=normalize, eps=eps, chunk=chunk)
    elif m == "sce":
        assert b is not None
        streamed.sce(b, xs, size, out, select_topk=float(p["select_topk"]), chunk=chunk)
    elif m == "arcee_fusion":
        assert b is not None
        rng = np.random.default_rng([job.seed, index])
        streamed.arcee_fusion(b, xs[0], shape, out, rng, chunk=chunk)
    elif m == "ramplus_tl":
        assert b is not None
        eps, r, alpha = float(p["epsilon"]), float(p["r"]), float(p["alpha"])
        boost = streamed.ramplus_boost(b, xs, size, eps, r, alpha, chunk=chunk)
        for start in range(0, size, chunk):
            stop = min(size, start + chunk)
            bb = b(start, stop)
            merged = generalized.ram(bb, [x(start, stop) for x in xs], eps, True, r, alpha, boost=boost)
            out[start:stop] = merged.astype(out_dtype, copy=False)
    else:  # pragma: no cover - STREAMED lists the methods above
        raise MergeError(f"merge_method {m!r} is not streamed")
    return out.reshape(shape), record


def _unpack(packed: np.ndarray, start: int, stop: int) -> np.ndarray:
    """Entries ``[start, stop)`` of a ``np.packbits`` mask, as bools."""
    b0 = start // 8
    bits = np.unpackbits(packed[b0 : (stop + 7) // 8])
    return bits[start - 8 * b0 : stop - 8 * b0].astype(bool)


def _read_range(reader: Any, key: str, start: int, stop: int) -> np.ndarray:
    """Entries ``[start, stop)`` of a tensor, flat (a reader without range reads: the whole, sliced)."""
    dtype = reader.specs[key][1]
    if hasattr(reader, "read_range_into"):
        out = np.empty(stop - start, dtype)
        reader.read_range_into(key, start, out)
        return out
    return _read(reader, key).reshape(-1)[start:stop]


def _merge_one(
    cfg: MergekitConfig,
    tensor: Tensor,
    arrays: list[np.ndarray],
    rng: np.random.Generator,
    float32_spherical: bool,
) -> tuple[np.ndarray, dict[str, Any]]:
    """Merge one tensor's inputs (already in the compute dtype) by the configuration's method."""
    from consensus.merging import generalized, spherical

    shared, per, base_policy, _ = method_table(cfg.method)
    p, per_values, base = _resolve(cfg, tensor)
    models = [(src, a) for (src, _), a in zip(tensor.inputs, arrays, strict=True) if src.model != base]
    base_arr = next((a for (src, _), a in zip(tensor.inputs, arrays, strict=True) if src.model == base), None)
    record = {**p, **per_values}
    xs = [a for _, a in models]
    m = cfg.method
    if m in generalized.GTA_METHODS:
        sparse, consensus, _, _ = generalized.GTA_METHODS[m]
        assert base_arr is not None
        out = generalized.generalized_task_arithmetic(
            base_arr,
            xs,
            [float(w) for w in per_values["weight"]],
            sparsification=sparse,
            consensus=consensus,
            densities=[float(d) for d in per_values["density"]],
            normalize=bool(p["normalize"]),
            scale=float(p["lambda"]),
            rescale=bool(p["rescale"]),
            gammas=per_values.get("gamma"),
            epsilons=per_values.get("epsilon"),
            rng=rng,
        )
    elif m == "linear":
        out = generalized.linear(xs, [float(w) for w in per_values["weight"]], bool(p["normalize"]))
    elif m == "slerp":
        assert base_arr is not None
        v0, v1 = (
            (base_arr, xs[0])
            if not float32_spherical
            else (base_arr.astype(np.float32), xs[0].astype(np.float32))
        )
        out = spherical.slerp(float(p["t"]), v0, v1)
    elif m == "nuslerp":
        w = [float(v) for v in per_values["weight"]]
        t = 0.5 if abs(sum(w)) < 1e-6 else w[1] / sum(w)
        if base_arr is not None:
            d = spherical.nuslerp(
                t,
                xs[0] - base_arr,
                xs[1] - base_arr,
                row_wise=bool(p["nuslerp_row_wise"]),
                flatten=bool(p["nuslerp_flatten"]),
            )
            out = base_arr + d
        else:
            out = spherical.nuslerp(
                t, xs[0], xs[1], row_wise=bool(p["nuslerp_row_wise"]), flatten=bool(p["nuslerp_flatten"])
            )
    elif m == "multislerp":
        out = spherical.multislerp(
            xs,
            [float(v) for v in per_values["weight"]],
            base_arr,
            bool(p["normalize_weights"]),
            float(p["eps"]),
        )
    elif m == "nearswap":
        assert base_arr is not None
        out = spherical.nearswap(base_arr, xs[0], float(p["t"]))
    elif m == "arcee_fusion":
        assert base_arr is not None
        out = spherical.arcee_fusion(base_arr, xs[0], rng)
    elif m == "sce":
        assert base_arr is not None
        out = generalized.sce(base_arr, xs, float(p["select_topk"]))
    elif m in ("ram", "ramplus_tl"):
        assert base_arr is not None
        out = generalized.ram(
            base_arr,
            xs,
            float(p["epsilon"]),
            m == "ramplus_tl",
            float(p.get("r", 0.1)),
            float(p.get("alpha", 0.2)),
        )
    elif m == "passthrough":
        scale = per_values["scale"][0]
        out = xs[0] if scale is None else xs[0] * xs[0].dtype.type(float(scale))
    else:  # pragma: no cover - method_table refused it
        raise MergeError(f"merge_method {m!r} is not run here")
    return out, {k: v for k, v in record.items() if v is not None}


def _leaf_entry(t: Tensor, params: Mapping[str, Any]) -> dict[str, Any]:
    """A tensor's report entry: its sources, its layer position and the parameters it got."""
    return {
        "sources": [f"{src.model}:{k}" for src, k in t.inputs],
        **({"t": round(t.t, 8)} if t.layer is not None else {}),
        "params": {k: v for k, v in params.items() if v is not None},
    }


def _float(dtype: Any) -> bool:
    """Whether a dtype is a float one (bfloat16 included)."""
    return np.dtype(dtype).kind == "f" or np.dtype(dtype).name == "bfloat16"


def run_job(
    job: MergekitJob, *, progress: bool = True, overwrite: bool = False, config_from: str | None = None
) -> dict[str, Any]:
    """Run a :class:`MergekitJob`: check it, then merge tensor by tensor into ``job.out``.

    Args:
      job: The job.
      progress: Show a progress bar.
      overwrite: Replace an existing output folder.
      config_from: The Hugging Face model folder whose ``config.json`` and tokenizer files the
        output gets (default: the first slice's first model, when it is such a folder).

    Returns:
      The report, as written to ``merge_report.json``.

    Raises:
      MergeError: If the method, a parameter or a slice is refused, a model lacks a tensor, a
        non-float tensor differs between models, or the dtype is unknown.
    """
    from tqdm.auto import tqdm

    from consensus import io as ckpt
    from consensus.merging.generalized import GTA_METHODS
    from meta_consensus.merge.inputs import copy_model_files, open_input
    from meta_consensus.merge.plan import output_dtype
    from meta_consensus.merge.report import write_report

    cfg = job.config
    _check_method(cfg)
    out = Path(job.out)
    if not job.out:
        raise MergeError("no output folder: give --out DIR")
    if out.exists() and not overwrite:
        raise MergeError(f"output {out} exists; choose a new folder (nothing is ever overwritten)")
    if job.compute not in ("float32", "config"):
        raise MergeError(f"--compute-dtype {job.compute!r}: expected float32 or config")
    out_name = job.dtype or cfg.out_dtype or cfg.dtype
    out_dtype = None if out_name is None else output_dtype(out_name)
    cfg_dtype = None if cfg.dtype is None else output_dtype(cfg.dtype)
    readers: dict[str, Any] = {}
    try:
        for model in job.inputs:
            readers[model] = open_input(model)
        layouts = {m: layout_of(list(r.specs), _model_config(m)) for m, r in readers.items()}
        tensors, layers = plan_tensors(cfg, layouts)
        specs: dict[str, tuple[tuple[int, ...], Any]] = {}
        for t in tensors:
            src, k = t.inputs[0]
            shape, dtype = readers[src.model].specs[k]
            for s2, k2 in t.inputs[1:]:
                if readers[s2.model].specs[k2][0] != shape:
                    raise MergeError(
                        f"{k2!r} is {list(readers[s2.model].specs[k2][0])} in {s2.model} "
                        f"but {list(shape)} in {src.model}"
                    )
            specs[t.name] = (tuple(shape), out_dtype if (out_dtype is not None and _float(dtype)) else dtype)
        report: dict[str, Any] = {
            "mergekit_config": str(cfg.path),
            "method": cfg.method,
            "executor": "per tensor, mergekit's formulas (meta_consensus.merge.mergekit_exec)",
            "inputs": job.inputs,
            "base": cfg.base_model,
            "dtype": out_name,
            "compute_dtype": "float32" if job.compute == "float32" else (cfg.dtype or "the inputs'"),
            "seed": job.seed,
            "layers": len(layers),
            "keys_read": [],
            "no_effect": {},
            "leaves": {},
            "nonfinite": {},
        }
        bar = tqdm(total=len(tensors), disable=not progress, unit="tensor")
        with ckpt.atomic_directory(out, overwrite=overwrite) as tmp:
            writer = ckpt.ShardedWriter(
                tmp,
                specs,
                shard_size=job.shard_size,
                metadata={"merged_by": "meta-consensus merge (mergekit config)"},
            )
            try:
                for index, t in enumerate(tensors):
                    shape, dtype = specs[t.name]
                    first = readers[t.inputs[0][0].model].specs[t.inputs[0][1]][1]
                    if _float(first) and cfg.method in GTA_METHODS:  # two passes, a few copies in memory
                        compute = (
                            (cfg_dtype if cfg_dtype is not None else first)
                            if job.compute == "config"
                            else (np.float64 if np.dtype(first) == np.float64 else np.float32)
                        )
                        rng = np.random.default_rng([job.seed, index])
                        try:
                            merged, params = _gta_streamed(cfg, t, readers, compute, rng, dtype)
                        except ValueError as e:
                            raise MergeError(f"{cfg.path}: {t.name}: {e}") from None
                        writer.write(t.name, merged)
                        report["leaves"][t.name] = _leaf_entry(t, params)
                        bar.update(1)
                        continue
                    if _float(first) and cfg.method in ELEMENTWISE:  # entry by entry: in flat chunks
                        merged, params = _elementwise_streamed(cfg, t, readers, job, cfg_dtype, index, dtype)
                        writer.write(t.name, merged)
                        report["leaves"][t.name] = _leaf_entry(t, params)
                        bar.update(1)
                        continue
                    if _float(first) and cfg.method in STREAMED and _can_stream(t, readers):
                        try:  # statistics of the whole tensor first, then the merge: passes over chunks
                            merged, params = _stats_streamed(cfg, t, readers, job, cfg_dtype, index, dtype)
                        except ValueError as e:  # Multi-SLERP's antipodes
                            raise MergeError(f"{cfg.path}: {t.name}: {e}") from None
                        writer.write(t.name, merged)
                        report["leaves"][t.name] = _leaf_entry(t, params)
                        bar.update(1)
                        continue
                    arrays = [np.asarray(_read(readers[src.model], k)) for src, k in t.inputs]
                    if not _float(arrays[0].dtype):
                        if not all(np.array_equal(arrays[0], a) for a in arrays[1:]):
                            raise MergeError(
                                f"{t.name!r} is a {arrays[0].dtype} tensor that differs between models; "
                                "only float tensors are merged"
                            )
                        writer.write(t.name, arrays[0])
                        report["leaves"][t.name] = {"method": "copy (non-float)"}
                        bar.update(1)
                        continue
                    if job.compute == "config":
                        compute = cfg_dtype if cfg_dtype is not None else arrays[0].dtype
                    else:
                        compute = np.float64 if arrays[0].dtype == np.float64 else np.float32
                    arrays = [a.astype(compute, copy=False) for a in arrays]
                    rng = np.random.default_rng([job.seed, index])
                    try:
                        merged, params = _merge_one(cfg, t, arrays, rng, job.compute == "config")
                    except ValueError as e:  # a formula's refusal (DELLA's epsilon, Multi-SLERP's antipodes)
                        raise MergeError(f"{cfg.path}: {t.name}: {e}") from None
                    writer.write(t.name, np.ascontiguousarray(np.asarray(merged).astype(dtype, copy=False)))
                    report["leaves"][t.name] = _leaf_entry(t, params)
                    bar.update(1)
            finally:
                writer.abort()
            writer.close()
            report["keys_read"] = list(cfg.keys_read)
            report["no_effect"] = {
                k: NO_EFFECT[k.rsplit(".", 1)[-1]] for k in cfg.keys_read if k.rsplit(".", 1)[-1] in NO_EFFECT
            }
            folder = Path(config_from) if config_from else Path(cfg.slices[0].sources[0].model)
            if folder.is_dir() and (folder / "config.json").is_file():
                float_dtype = (
                    out_dtype
                    if out_dtype is not None
                    else next((d for _, d in specs.values() if _float(d)), None)
                )
                copied = copy_model_files(folder, tmp, float_dtype)
                _fix_layer_count(tmp / "config.json", layers, layouts, cfg)
                report["model_files"] = {"from": str(folder), "files": copied}
            write_report(tmp, report)
        bar.close()
    finally:
        for r in readers.values():
            r.close()
    return report


def _read(reader: Any, key: str) -> np.ndarray:
    """One tensor of a reader, whole."""
    shape, dtype = reader.specs[key]
    out = np.empty(shape, dtype)
    reader.read_into(key, out)
    return out


def _fix_layer_count(
    path: Path, layers: list[tuple[Slice, int, int]], layouts: Mapping[str, Layout], cfg: MergekitConfig
) -> None:
    """Set the output config's layer count (and per-layer lists) to the layers written."""
    config = json.loads(path.read_text())
    total = len(layers)
    for name in ("num_hidden_layers", "n_layer", "num_layers"):
        if isinstance(config.get(name), int):
            old = config[name]
            config[name] = total
            for key, value in list(config.items()):
                if isinstance(value, list) and len(value) == old and old != total:
                    per_layer = []
                    for s, offset, _ in layers:
                        src = s.sources[0]
                        assert src.layer_range is not None
                        theirs = (_model_config(src.model) or {}).get(key, value)
                        per_layer.append(theirs[src.layer_range[0] + offset])
                    config[key] = per_layer
            break
    path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
