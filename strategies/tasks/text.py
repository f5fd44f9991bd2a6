"""Text: a byte-level decoder-only transformer on the Python standard library's own source.

The corpus is the ``.py`` files of a fixed list of packages of the running
interpreter's standard library (found with ``sysconfig``), so it ships with
every install and nothing is downloaded. Tokens are raw bytes (vocabulary 256);
an example is a window of ``context + 1`` consecutive bytes of one file, with
inputs ``x = w[:-1]`` and next-byte targets ``y = w[1:]``.

Non-IID by module. Packages are grouped into module *families* (networking /
formats, concurrency, runtime and tooling, see :data:`FAMILIES`). Every file
gets one role, drawn per family with a fixed seed: private (owned by one node),
general (a public pool shared by every node), held-out or test. Node i belongs
to family ``i % F`` and owns a contiguous, byte-balanced run of that family's
private files (so mostly one or two packages): the shards of different nodes
are disjoint files. The three hierarchical levels are then
``TaskData.everything()`` (general windows of all modules) ->
``TaskData.in_groups()`` (general windows of the node's family) ->
``TaskData.own()`` (the node's own modules).

Multi-host: the node -> file assignment is computed from file sizes only, and a
process reads the private files of the nodes it hosts and no other; the shared
general, held-out and test pools are read by every process.

The model names every parameter dimension with a logical axis ("vocab",
"embed", "heads", "kv", "mlp", "length", "norm"), so the stacked params split
over a "model" mesh axis (tensor parallel: "mlp", "heads", "vocab") and a
"data" axis (FSDP: "embed") with the rules of :mod:`consensus.mesh`.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os
import sysconfig
from collections.abc import Sequence
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from strategies.tasks.base import (
    TASKS,
    Array,
    Batch,
    PyTree,
    TaskData,
    hosted_nodes,
    masked_mean,
    param_dtype,
    split_module,
)

VOCAB_SIZE = 256
METRICS_ROWS = 32  # rows per chunk of an evaluation batch in ``metrics`` (see _chunked_metrics)

# Module families -> stdlib packages. The order of families fixes node i's family (i % F).
# fmt: off
FAMILIES: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("net", ("email", "http", "urllib", "html", "xml", "xmlrpc", "wsgiref", "json")),
    ("concurrency", ("asyncio", "concurrent", "multiprocessing")),
    ("runtime", ("importlib", "unittest", "logging", "collections", "ctypes", "re", "tomllib",
                 "sqlite3", "dbm", "curses", "venv", "zoneinfo")),
)
# fmt: on

# Shares of each family's files by role; the rest is private (node-owned) data.
_ROLE_FRACTIONS = (("general", 0.2), ("heldout", 0.1), ("test", 0.1))


# --------------------------------------------------------------------------- corpus


@dataclasses.dataclass(frozen=True)
class CorpusFile:
    """One source file of the corpus (its bytes are read lazily).

    Attributes:
      path: path relative to the stdlib root, e.g. "json/decoder.py".
      package: top-level stdlib package ("json").
      family: index into :data:`FAMILIES`.
      size: bytes used (the file's size capped at ``max_bytes_per_file``).
      role: "private", "general", "heldout" or "test".
    """

    path: str
    package: str
    family: int
    size: int
    role: str


def stdlib_root() -> str:
    """The directory of the running interpreter's standard library.

    Returns:
      The path.
    """
    return sysconfig.get_paths()["stdlib"]


def list_corpus(
    *,
    root: str | None = None,
    families: tuple[tuple[str, tuple[str, ...]], ...] = FAMILIES,
    max_bytes_per_file: int = 32_768,
    min_bytes: int = 256,
    split_seed: int = 0,
) -> tuple[CorpusFile, ...]:
    """Deterministic list of corpus files with their family and role (reads sizes, not bytes).

    Files are sorted by path; ``test``/``tests``/``__pycache__`` folders and
    files shorter than ``min_bytes`` are skipped. Roles are drawn per family
    with ``np.random.default_rng(split_seed)``: 20% general, 10% held-out,
    10% test (at least one file each), the rest private.

    Args:
      root: stdlib directory (default :func:`stdlib_root`).
      families: (family name, packages) pairs.
      max_bytes_per_file: only the first this many bytes of a file are used,
        which bounds the corpus (a few MB at most).
      min_bytes: shorter files are left out.
      split_seed: seed of the role draw.

    Returns:
      Tuple of :class:`CorpusFile`, sorted by (family, path).

    Raises:
      ValueError: for ``max_bytes_per_file < min_bytes``, or a family with fewer than 8
        usable files.
    """
    root = stdlib_root() if root is None else root
    if max_bytes_per_file < min_bytes:
        raise ValueError(f"max_bytes_per_file={max_bytes_per_file} is below min_bytes={min_bytes}")
    rng = np.random.default_rng(split_seed)
    out: list[CorpusFile] = []
    for fam, (fam_name, packages) in enumerate(families):
        entries: list[tuple[str, str, int]] = []
        for package in packages:
            base = os.path.join(root, package)
            if not os.path.isdir(base):
                continue  # a trimmed interpreter may lack a package; the rest still form the family
            for dirpath, dirnames, filenames in os.walk(base):
                dirnames[:] = sorted(d for d in dirnames if d not in ("test", "tests", "__pycache__"))
                for f in sorted(filenames):
                    if not f.endswith(".py"):
                        continue
                    full = os.path.join(dirpath, f)
                    size = min(os.path.getsize(full), max_bytes_per_file)
                    if size >= min_bytes:
                        entries.append((os.path.relpath(full, root), package, size))
        entries.sort()
        if len(entries) < 8:
            raise ValueError(
                f"family {fam_name!r}: only {len(entries)} usable files under {root}; "
                "need 8 (is the standard library installed in full?)"
            )
        roles = np.array(["private"] * len(entries), dtype=object)
        order = rng.permutation(len(entries))
        start = 0
        for role, frac in _ROLE_FRACTIONS:
            k = max(1, int(round(frac * len(entries))))
            roles[order[start : start + k]] = role
            start += k
        out.extend(
            CorpusFile(path, package, fam, size, str(role))
            for (path, package, size), role in zip(entries, roles, strict=True)
        )
    return tuple(out)


def assign_files(files: Sequence[CorpusFile], num_nodes: int, num_families: int) -> list[np.ndarray]:
    """Private files of each node: node i gets a contiguous, byte-balanced run of family ``i % F``.

    Args:
      files: the corpus list.
      num_nodes: n.
      num_families: F.

    Returns:
      ``num_nodes`` int arrays of indices into ``files``, disjoint, each non-empty.

    Raises:
      ValueError: for ``num_nodes < 1``, or a family with fewer private files than nodes.
    """
    if num_nodes < 1:
        raise ValueError(f"num_nodes must be >= 1, got {num_nodes}")
    out: list[np.ndarray] = [np.zeros(0, np.int64)] * num_nodes
    for fam in range(num_families):
        nodes = list(range(fam, num_nodes, num_families))
        if not nodes:
            continue
        idx = np.array([j for j, f in enumerate(files) if f.family == fam and f.role == "private"], np.int64)
        if len(idx) < len(nodes):
            raise ValueError(
                f"family {fam} has {len(idx)} private files for its {len(nodes)} nodes "
                f"(num_nodes={num_nodes}); every node needs at least one file: use fewer nodes"
            )
        sizes = np.array([files[j].size for j in idx], np.float64)
        # Cut the byte-cumulative sequence at equal shares, keeping >= 1 file per node.
        cum = np.cumsum(sizes) / sizes.sum()
        m, cuts, prev = len(nodes), [], 0
        for k in range(1, m):
            c = int(np.searchsorted(cum, k / m)) + 1
            prev = min(max(c, prev + 1), len(idx) - (m - k))
            cuts.append(prev)
        for node, part in zip(nodes, np.split(idx, cuts), strict=True):
            out[node] = part
    return out


def read_file_bytes(path: str, max_bytes: int, root: str | None = None) -> np.ndarray:
    """The first ``max_bytes`` bytes of ``root/path`` as a uint8 array.

    Args:
      path: the file's path relative to ``root``.
      max_bytes: the most bytes read.
      root: the stdlib directory (default :func:`stdlib_root`).

    Returns:
      (k,) uint8, k <= ``max_bytes``.
    """
    root = stdlib_root() if root is None else root
    with open(os.path.join(root, path), "rb") as fh:
        return np.frombuffer(fh.read(max_bytes), np.uint8)


def sample_windows(
    files: Sequence[CorpusFile],
    file_ids: np.ndarray,
    count: int,
    length: int,
    rng: np.random.Generator,
    read: Any,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``count`` windows of ``length`` bytes from the given files, files weighted by their size.

    Args:
      files: the corpus list.
      file_ids: indices into ``files`` to draw from.
      count: number of windows.
      length: bytes per window (context + 1).
      rng: numpy Generator.
      read: ``read(file_id) -> uint8 array`` (cached by the caller).

    Returns:
      ``(windows (count, length) int32, file_of_window (count,) int64, offset (count,) int64)``.

    Raises:
      ValueError: when no given file is at least ``length`` bytes long.
    """
    usable = np.array([j for j in file_ids if files[j].size >= length], np.int64)
    if len(usable) == 0:
        raise ValueError(f"no file among {len(file_ids)} is at least {length} bytes long")
    weight = np.array([files[j].size - length + 1 for j in usable], np.float64)
    pick = usable[rng.choice(len(usable), size=count, p=weight / weight.sum())]
    out = np.zeros((count, length), np.int32)
    offsets = np.zeros(count, np.int64)
    for r, j in enumerate(pick):
        data = read(int(j))
        o = int(rng.integers(0, len(data) - length + 1))
        offsets[r] = o
        out[r] = data[o : o + length]
    return out, pick, offsets


# --------------------------------------------------------------------------- model


def _param(
    rngs: nnx.Rngs,
    shape: tuple[int, ...],
    axes: tuple[str | None, ...],
    *,
    std: float = 0.0,
    fill: float = 0.0,
) -> nnx.Param:
    """A float32 Param ``fill + std * N(0, 1)`` with logical axes and its init spec as metadata.

    ``eager_sharding=False``: the module is built without a mesh; the trainer places params with
    the logical axes read back from the ``out_sharding`` metadata (:mod:`consensus.mesh` rules).
    ``init_std`` / ``init_fill`` let :meth:`TextTask.init` draw every parameter from one normal
    vector (one threefry call instead of one per parameter, which dominates compile time on CPU).
    """
    if std > 0.0:
        value = jnp.float32(fill) + jnp.float32(std) * jax.random.normal(rngs.params(), shape, jnp.float32)
    else:
        value = jnp.full(shape, fill, jnp.float32)
    return nnx.Param(value, out_sharding=axes, eager_sharding=False, init_std=std, init_fill=fill)


def _layer_norm(x: Array, scale: Array, bias: Array, eps: float = 1e-5) -> Array:
    # Statistics in float32 even under bfloat16 compute: the variance of small activations underflows.
    x32 = x.astype(jnp.float32)
    mean = jnp.mean(x32, axis=-1, keepdims=True)
    var = jnp.mean(jnp.square(x32 - mean), axis=-1, keepdims=True)
    y = (x32 - mean) * jax.lax.rsqrt(var + jnp.float32(eps))
    return (y * scale.astype(jnp.float32) + bias.astype(jnp.float32)).astype(x.dtype)


def _dropout(x: Array, rate: float, key: Array | None) -> Array:
    if rate <= 0.0 or key is None:
        return x
    keep = jax.random.bernoulli(key, 1.0 - rate, x.shape)
    return jnp.where(keep, x / jnp.asarray(1.0 - rate, x.dtype), jnp.zeros_like(x))


class LayerNorm(nnx.Module):
    """Layer normalization over the last axis; scale and bias are replicated ("norm")."""

    def __init__(self, dim: int, *, rngs: nnx.Rngs):
        self.scale = _param(rngs, (dim,), ("norm",), fill=1.0)
        self.bias = _param(rngs, (dim,), ("norm",))

    def __call__(self, x: Array) -> Array:
        """Normalize ``x`` over its last axis, then scale and shift.

        Args:
          x: (..., dim) activations.

        Returns:
          The normalized activations, x's shape.
        """
        return _layer_norm(x, self.scale[...], self.bias[...])


class CausalSelfAttention(nnx.Module):
    """Multi-head causal self-attention; heads split over the "model" mesh axis."""

    def __init__(self, d_model: int, num_heads: int, num_layers: int, *, rngs: nnx.Rngs):
        head_dim = d_model // num_heads
        w = 1.0 / math.sqrt(d_model)
        # GPT-2 style: the residual-branch output projection is scaled down with depth.
        w_out = 1.0 / math.sqrt(d_model * 2 * num_layers)
        self.query = _param(rngs, (d_model, num_heads, head_dim), ("embed", "heads", "kv"), std=w)
        self.key = _param(rngs, (d_model, num_heads, head_dim), ("embed", "heads", "kv"), std=w)
        self.value = _param(rngs, (d_model, num_heads, head_dim), ("embed", "heads", "kv"), std=w)
        self.out = _param(rngs, (num_heads, head_dim, d_model), ("heads", "kv", "embed"), std=w_out)

    def __call__(self, x: Array) -> Array:
        """Causal attention of every position over itself and the earlier ones (softmax in float32).

        Args:
          x: (B, T, d_model) activations.

        Returns:
          (B, T, d_model), x's dtype.
        """
        dt = x.dtype
        q = jnp.einsum("btd,dnh->btnh", x, self.query[...].astype(dt))
        k = jnp.einsum("btd,dnh->btnh", x, self.key[...].astype(dt))
        v = jnp.einsum("btd,dnh->btnh", x, self.value[...].astype(dt))
        scale = jnp.asarray(1.0 / math.sqrt(q.shape[-1]), dt)
        logits = jnp.einsum("btnh,bsnh->bnts", q * scale, k).astype(jnp.float32)
        t = x.shape[1]
        causal = jnp.tril(jnp.ones((t, t), jnp.bool_))
        logits = jnp.where(causal, logits, jnp.float32(-1e30))
        probs = jax.nn.softmax(logits, axis=-1).astype(dt)
        ctx = jnp.einsum("bnts,bsnh->btnh", probs, v)
        return jnp.einsum("btnh,nhd->btd", ctx, self.out[...].astype(dt))


class MLPBlock(nnx.Module):
    """Position-wise GELU MLP; its hidden dimension splits over the "model" mesh axis."""

    def __init__(self, d_model: int, d_mlp: int, num_layers: int, *, rngs: nnx.Rngs):
        self.wi = _param(rngs, (d_model, d_mlp), ("embed", "mlp"), std=1.0 / math.sqrt(d_model))
        self.bi = _param(rngs, (d_mlp,), ("mlp",))
        w_out = 1.0 / math.sqrt(d_mlp * 2 * num_layers)
        self.wo = _param(rngs, (d_mlp, d_model), ("mlp", "embed"), std=w_out)
        self.bo = _param(rngs, (d_model,), ("norm",))

    def __call__(self, x: Array) -> Array:
        """``gelu(x W_i + b_i) W_o + b_o`` at every position.

        Args:
          x: (..., d_model) activations.

        Returns:
          (..., d_model), x's dtype.
        """
        dt = x.dtype
        h = jax.nn.gelu(x @ self.wi[...].astype(dt) + self.bi[...].astype(dt))
        return h @ self.wo[...].astype(dt) + self.bo[...].astype(dt)


class Block(nnx.Module):
    """Pre-norm transformer block: x + attn(ln(x)), then x + mlp(ln(x))."""

    def __init__(self, d_model: int, num_heads: int, d_mlp: int, num_layers: int, *, rngs: nnx.Rngs):
        self.ln_attn = LayerNorm(d_model, rngs=rngs)
        self.attn = CausalSelfAttention(d_model, num_heads, num_layers, rngs=rngs)
        self.ln_mlp = LayerNorm(d_model, rngs=rngs)
        self.mlp = MLPBlock(d_model, d_mlp, num_layers, rngs=rngs)

    def __call__(self, x: Array, *, dropout: float = 0.0, key: Array | None = None) -> Array:
        """The block's output, dropout on both residual branches when given a key.

        Args:
          x: (B, T, d_model) activations.
          dropout: the dropout rate.
          key: the dropout key (None: no dropout).

        Returns:
          (B, T, d_model).
        """
        k1, k2 = jax.random.split(key) if key is not None else (None, None)
        x = x + _dropout(self.attn(self.ln_attn(x)), dropout, k1)
        return x + _dropout(self.mlp(self.ln_mlp(x)), dropout, k2)


class ByteTransformer(nnx.Module):
    """Decoder-only byte-level transformer with learned positions and an untied output layer.

    Every parameter carries logical axis names (``out_sharding`` metadata):
    token embedding ("vocab", "embed"), positions ("length", "embed"),
    attention ("embed", "heads", "kv") / ("heads", "kv", "embed"), MLP
    ("embed", "mlp") / ("mlp", "embed"), norms and residual biases ("norm",),
    output ("embed", "vocab").
    """

    def __init__(
        self,
        *,
        vocab: int,
        context: int,
        d_model: int,
        num_heads: int,
        num_layers: int,
        d_mlp: int,
        rngs: nnx.Rngs,
    ):
        self.num_layers = num_layers
        self.embed = _param(rngs, (vocab, d_model), ("vocab", "embed"), std=0.02)
        self.pos = _param(rngs, (context, d_model), ("length", "embed"), std=0.02)
        # Named attributes (block_0, block_1, ...) keep params-dict keys and checkpoint paths readable.
        for i in range(num_layers):
            setattr(self, f"block_{i}", Block(d_model, num_heads, d_mlp, num_layers, rngs=rngs))
        self.ln_f = LayerNorm(d_model, rngs=rngs)
        # Small output weights: the untrained model predicts nearly uniform bytes (loss ~ ln 256).
        self.unembed = _param(rngs, (d_model, vocab), ("embed", "vocab"), std=0.02)
        self.unembed_bias = _param(rngs, (vocab,), ("vocab",))

    def __call__(self, tokens: Array, *, dtype: Any, dropout: float = 0.0, key: Array | None = None) -> Array:
        """Next-byte logits of a batch of token sequences.

        Args:
          tokens: (B, T) int byte tokens, T <= context.
          dtype: the compute dtype.
          dropout: the dropout rate.
          key: the dropout key (None: no dropout).

        Returns:
          (B, T, vocab) logits in ``dtype``.
        """
        t = tokens.shape[-1]
        x = jnp.take(self.embed[...].astype(dtype), tokens, axis=0) + self.pos[...][:t].astype(dtype)
        keys = jax.random.split(key, self.num_layers) if key is not None else [None] * self.num_layers
        for i in range(self.num_layers):
            x = getattr(self, f"block_{i}")(x, dropout=dropout, key=keys[i])
        x = self.ln_f(x)
        return x @ self.unembed[...].astype(dtype) + self.unembed_bias[...].astype(dtype)


# --------------------------------------------------------------------------- task


def _is_spec(x: Any) -> bool:
    return isinstance(x, tuple) and len(x) == 3 and isinstance(x[0], tuple)


@dataclasses.dataclass(frozen=True)
class TextTask:
    """Next-byte prediction on standard-library Python source, non-IID by module family.

    Args:
      context: tokens per example (the model's maximum length).
      d_model: the embedding width.
      num_heads: attention heads (``d_model`` must be a multiple).
      num_layers: transformer blocks.
      d_mlp: the MLP's hidden width.
      dropout: dropout rate in training (0 disables it).
      windows_per_node: training windows sampled from each node's own files.
      general_windows: windows in the shared general pool.
      heldout_windows: windows in the held-out pool.
      test_windows: windows in the test pool.
      max_bytes_per_file: only the first this many bytes of each file are used.
      split_seed: seed of the file roles and of the shared pools (fixed, so
        test numbers compare across node seeds).
      families: (family name, stdlib packages) pairs; node i's family is i % F.
      root: stdlib directory (default: the running interpreter's).

    Raises:
      ValueError: for ``d_model`` not a multiple of ``num_heads``, a size below 1, a dropout
        outside [0, 1), or ``max_bytes_per_file`` below two windows.

    Example (reads and tokenizes the corpus, so not run as a doctest)::

        task = TextTask()
        data = task.splits(4, seed=0)
        params = task.init(jax.random.key(0))
        task.metrics(params, data.test)["perplexity"]  # about 256 before training
    """

    context: int = 64
    d_model: int = 64
    num_heads: int = 4
    num_layers: int = 2
    d_mlp: int = 256
    dropout: float = 0.0
    windows_per_node: int = 512
    general_windows: int = 2048
    heldout_windows: int = 256
    test_windows: int = 256
    max_bytes_per_file: int = 32_768
    split_seed: int = 0
    families: tuple[tuple[str, tuple[str, ...]], ...] = FAMILIES
    root: str | None = None
    name: str = "text"
    kind: ClassVar[str] = "language"  # what the weight objectives may assume (see Task)
    # The general pool is windows of the files whose role is "general": public data, never a node's
    # file (see list_corpus), so it is fixed by the file roles and takes no task.public_fraction.
    general_pool: ClassVar[str] = "public"
    # loss and metrics read the model through self.apply only (strategies.tangent.linearize)
    linearizable: ClassVar[bool] = True

    def __post_init__(self):
        if self.d_model % self.num_heads:
            raise ValueError(f"d_model={self.d_model} must be a multiple of num_heads={self.num_heads}")
        for field in (
            "context",
            "d_model",
            "num_heads",
            "num_layers",
            "d_mlp",
            "windows_per_node",
            "general_windows",
            "heldout_windows",
            "test_windows",
        ):
            if getattr(self, field) < 1:
                raise ValueError(f"{field} must be >= 1, got {getattr(self, field)}")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"dropout must be in [0, 1), got {self.dropout}")
        if self.max_bytes_per_file < 2 * (self.context + 1):
            raise ValueError(
                f"max_bytes_per_file={self.max_bytes_per_file} is too small for context={self.context}"
            )

    # ------------------------------------------------------------------ model

    def _module(self, rngs: nnx.Rngs) -> ByteTransformer:
        return ByteTransformer(
            vocab=VOCAB_SIZE,
            context=self.context,
            d_model=self.d_model,
            num_heads=self.num_heads,
            num_layers=self.num_layers,
            d_mlp=self.d_mlp,
            rngs=rngs,
        )

    @functools.cached_property
    def _abstract(self) -> tuple[Any, PyTree, PyTree]:
        """(graphdef, logical axes, per-leaf (shape, std, fill)) from an abstract module."""
        module = nnx.eval_shape(lambda: self._module(nnx.Rngs(0)))
        graphdef, _, axes = split_module(module)
        state = nnx.state(module, nnx.Param)

        def spec(v: nnx.Variable) -> tuple[tuple[int, ...], float, float]:
            meta = v.get_metadata()
            return tuple(v.get_value().shape), float(meta["init_std"]), float(meta["init_fill"])

        specs = jax.tree.map(spec, state, is_leaf=lambda v: isinstance(v, nnx.Variable))
        return graphdef, axes, nnx.to_pure_dict(specs)

    def init(self, key: Array) -> PyTree:
        """Fresh float32 params (a nested dict of arrays).

        Every parameter is ``fill + std * z`` with its module-declared ``(std, fill)`` and ``z``
        a slice of one standard normal draw from ``key``: the same distribution as building the
        module with ``nnx.Rngs``, but one random-number call to compile instead of one per leaf.

        Args:
          key: a JAX PRNG key.

        Returns:
          The parameters.
        """
        specs = self._abstract[2]
        leaves, treedef = jax.tree_util.tree_flatten(specs, is_leaf=_is_spec)
        sizes = [math.prod(shape) for shape, _, _ in leaves]
        z = jax.random.normal(key, (sum(sizes),), jnp.float32)
        out, start = [], 0
        for (shape, std, fill), size in zip(leaves, sizes, strict=True):
            if std > 0.0:
                out.append(jnp.float32(fill) + jnp.float32(std) * z[start : start + size].reshape(shape))
            else:
                out.append(jnp.full(shape, fill, jnp.float32))
            start += size
        return jax.tree_util.tree_unflatten(treedef, out)

    def logical_axes(self, params: PyTree | None = None) -> PyTree:
        """Logical axis names of every parameter dimension (the structure of ``params``).

        Args:
          params: unused (the axes follow from the architecture).

        Returns:
          A tree like the parameters with a tuple of names per leaf.
        """
        return self._abstract[1]

    def apply(self, params: PyTree, inputs: Array, *, train: bool = False, key: Array | None = None) -> Array:
        """Next-byte logits (B, T, 256) in the params' dtype for int tokens (B, T), T <= context.

        Args:
          params: the parameters.
          inputs: (B, T) int tokens.
          train: training mode (dropout on, when configured).
          key: the dropout key in training mode.

        Returns:
          (B, T, 256) logits.

        Raises:
          ValueError: for more than ``context`` tokens.
          TypeError: for inputs that are not integers.
        """
        if inputs.shape[-1] > self.context:
            raise ValueError(f"inputs have {inputs.shape[-1]} tokens, more than context={self.context}")
        if not jnp.issubdtype(inputs.dtype, jnp.integer):
            raise TypeError(f"inputs must be integer byte tokens, got {inputs.dtype}")
        model = nnx.merge(self._abstract[0], params)
        rate = self.dropout if train else 0.0
        return model(inputs, dtype=param_dtype(params), dropout=rate, key=key)

    def _token_losses(self, params: PyTree, batch: Batch, key: Array | None) -> tuple[Array, Array]:
        logits = self.apply(params, batch["x"], train=key is not None, key=key)
        logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
        nll = -jnp.take_along_axis(logp, batch["y"][..., None].astype(jnp.int32), axis=-1)[..., 0]
        return nll, logits

    @staticmethod
    def _token_mask(batch: Batch, shape: tuple[int, ...]) -> Array | None:
        mask = batch.get("mask")
        # Row mask (B,) over padding rows; every token of a valid row counts.
        return None if mask is None else jnp.broadcast_to(mask[:, None], shape)

    def loss(self, params: PyTree, batch: Batch, key: Array | None = None) -> Array:
        """Mean next-byte cross entropy in nats (float32) over the tokens of the valid rows.

        Args:
          params: the parameters.
          batch: ``{"x", "y"}`` token arrays (a row ``"mask"`` optional).
          key: the dropout key (training mode when given).

        Returns:
          A float32 scalar.
        """
        nll, _ = self._token_losses(params, batch, key)
        return masked_mean(nll, self._token_mask(batch, nll.shape))

    def metrics(self, params: PyTree, batch: Batch) -> dict[str, Array]:
        """``loss`` (nats per byte), ``accuracy`` (top-1 next byte), ``perplexity`` and ``bits_per_byte``.

        Math:
          loss = mean over tokens of -log p(y_t | x_<=t); perplexity = exp(loss);
          bits per byte = loss / ln 2.

        Args:
          params: the parameters.
          batch: ``{"x", "y"}`` token arrays (a row ``"mask"`` optional).

        Returns:
          The metrics, float32 scalars.
        """
        rows = batch["x"].shape[0]
        if rows > METRICS_ROWS:
            loss, accuracy = self._chunked_metrics(params, batch)
        else:
            nll, logits = self._token_losses(params, batch, None)
            mask = self._token_mask(batch, nll.shape)
            loss = masked_mean(nll, mask)
            accuracy = masked_mean((jnp.argmax(logits, axis=-1) == batch["y"]).astype(jnp.float32), mask)
        return {
            "loss": loss,
            "accuracy": accuracy,
            "perplexity": jnp.exp(loss),
            "bits_per_byte": loss / jnp.float32(math.log(2.0)),
        }

    def _chunked_metrics(self, params: PyTree, batch: Batch) -> tuple[Array, Array]:
        """(loss, accuracy) over the valid rows, METRICS_ROWS rows at a time in a ``lax.map``.

        One forward pass over a whole evaluation set (256 windows) keeps activations and
        attention scores far out of cache: on XLA:CPU chunks of 32 rows take about half the
        time. The sums of the token losses, of the correct tokens and of the token
        count are accumulated over the chunks (rows padded to a whole chunk count as masked),
        so the result is the masked mean of the whole batch, as in one pass.
        """
        rows = batch["x"].shape[0]
        pad = -rows % METRICS_ROWS
        mask = batch.get("mask")
        mask = jnp.ones((rows,), jnp.float32) if mask is None else mask.astype(jnp.float32)

        def chunks(v: Array) -> Array:
            v = jnp.pad(v, [(0, pad)] + [(0, 0)] * (v.ndim - 1))
            return v.reshape((-1, METRICS_ROWS) + v.shape[1:])

        def one(chunk: tuple[Array, Array, Array]) -> Array:
            x, y, m = chunk
            nll, logits = self._token_losses(params, {"x": x, "y": y}, None)
            tokens = jnp.broadcast_to(m[:, None], nll.shape)
            correct = (jnp.argmax(logits, axis=-1) == y).astype(jnp.float32)
            return jnp.stack([jnp.sum(nll * tokens), jnp.sum(correct * tokens), jnp.sum(tokens)])

        total = jnp.sum(jax.lax.map(one, (chunks(batch["x"]), chunks(batch["y"]), chunks(mask))), axis=0)
        count = jnp.maximum(total[2], jnp.float32(1.0))
        return total[0] / count, total[1] / count

    def flip_labels(self, batch: Batch) -> Batch:
        """Label flipping attack on bytes: y -> 255 - y.

        Args:
          batch: a batch with targets ``"y"``.

        Returns:
          The batch with flipped targets (same dtype).
        """
        out = dict(batch)
        out["y"] = (VOCAB_SIZE - 1 - batch["y"]).astype(batch["y"].dtype)
        return out

    # ------------------------------------------------------------------ data

    def corpus(self) -> tuple[CorpusFile, ...]:
        """The corpus file list (sizes and roles; no bytes read).

        Returns:
          The files (:func:`list_corpus` with this task's settings, cached).
        """
        return _cached_corpus(self.root, self.families, self.max_bytes_per_file, self.split_seed)

    def splits(
        self,
        num_nodes: int,
        *,
        seed: int = 0,
        alpha: float = 0.5,
        process_index: int = 0,
        process_count: int = 1,
    ) -> TaskData:
        """Per-node windows of the node's own modules, and the shared general / held-out / test pools.

        Args:
          num_nodes: n over all processes; node i's family is ``i % F``.
          seed: seed of the node windows (node i draws from
            ``default_rng([seed, i])``, so a node's data does not depend on
            how many processes there are).
          alpha: unused: text is non-IID by construction (by module), not by
            a Dirichlet draw; accepted for the common Task signature.
          process_index: this process's index; it reads the private files of its hosted
            nodes (:func:`hosted_nodes`) only.
          process_count: the number of processes.

        Returns:
          TaskData with batches ``{"x": (.., context) int32, "y": (.., context) int32}``;
          groups are module families. ``meta`` holds ``example_ids``
          (file index << 32 | byte offset of each own window), ``node_files``
          (corpus indices of each hosted node's files), ``files`` (corpus
          paths) and ``node_packages``.
        """
        del alpha
        files = self.corpus()
        num_families = len(self.families)
        hosted = hosted_nodes(num_nodes, process_index, process_count)
        node_files = assign_files(files, num_nodes, num_families)
        length = self.context + 1
        cache: dict[int, np.ndarray] = {}

        def read(j: int) -> np.ndarray:
            if j not in cache:
                cache[j] = read_file_bytes(files[j].path, self.max_bytes_per_file, self.root)
            return cache[j]

        def by_role(role: str) -> np.ndarray:
            return np.array([j for j, f in enumerate(files) if f.role == role], np.int64)

        family_of = np.array([f.family for f in files], np.int32)
        shared = {}
        shared_ids = {}
        for offset, (role, count) in enumerate(
            (
                ("general", self.general_windows),
                ("heldout", self.heldout_windows),
                ("test", self.test_windows),
            )
        ):
            rng = np.random.default_rng([self.split_seed, 1 + offset])
            w, fid, off = sample_windows(files, by_role(role), count, length, rng, read)
            shared[role] = ({"x": w[:, :-1], "y": w[:, 1:]}, family_of[fid])
            shared_ids[role] = ((fid.astype(np.int64) << 32) | off).astype(np.int64)

        xs, ys, ids, groups = [], [], [], []
        for node in hosted:
            rng = np.random.default_rng([seed, int(node)])
            w, fid, off = sample_windows(files, node_files[node], self.windows_per_node, length, rng, read)
            xs.append(w[:, :-1])
            ys.append(w[:, 1:])
            ids.append((fid << 32) | off)
            groups.append(family_of[fid])
        n_local = len(hosted)
        node_groups = np.zeros((n_local, num_families), bool)
        node_groups[np.arange(n_local), hosted % num_families] = True
        return TaskData(
            num_nodes=num_nodes,
            node_ids=hosted,
            train={"x": np.stack(xs), "y": np.stack(ys)},
            train_count=np.full((n_local,), self.windows_per_node, np.int32),
            train_groups=np.stack(groups).astype(np.int32),
            general=shared["general"][0],
            general_groups=shared["general"][1],
            heldout=shared["heldout"][0],
            test=shared["test"][0],
            node_groups=node_groups,
            group_names=tuple(name for name, _ in self.families),
            process_index=process_index,
            process_count=process_count,
            meta={
                "example_ids": np.stack(ids).astype(np.int64),
                "general_ids": shared_ids["general"],
                "general_pool": "public",
                "node_files": [node_files[i] for i in hosted],
                "node_packages": [sorted({files[j].package for j in node_files[i]}) for i in hosted],
                "files": tuple(f.path for f in files),
                "seed": seed,
                "files_read": tuple(sorted(cache)),
            },
        )


@functools.cache
def _cached_corpus(
    root: str | None, families: tuple[tuple[str, tuple[str, ...]], ...], max_bytes: int, split_seed: int
) -> tuple[CorpusFile, ...]:
    return list_corpus(root=root, families=families, max_bytes_per_file=max_bytes, split_seed=split_seed)


@TASKS.declare("text")
def text(**options: Any) -> TextTask:
    """A byte-level transformer on a small embedded text corpus."""
    return TextTask(**options)
