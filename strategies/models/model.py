""":class:`CausalLM`: a model family's nnx module as pure functions of a params dict.

The module is built once under ``nnx.eval_shape`` (no memory) for its graph, its parameter
shapes, their logical axes and init specs; :meth:`CausalLM.apply` merges the graph with a
params dict inside the traced function (as :mod:`strategies.tasks.text` does), so params stay
a plain nested dict that the trainer stacks, shards and merges like any other tree.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh

from consensus.mesh import DEFAULT_RULES, param_sharding
from strategies.models.config import LLAMA_LIKE, ModelConfig, ModelError, parse_config
from strategies.models.gpt2 import GPT2LMHeadModel
from strategies.models.layers import Array

PyTree = Any


def _build(config: ModelConfig, remat: bool, scan: bool) -> nnx.Module:
    if config.family in LLAMA_LIKE:
        from strategies.models.llama import LlamaForCausalLM

        return LlamaForCausalLM(config, remat=remat, scan=scan)
    return GPT2LMHeadModel(config, remat=remat, scan=scan)


def _is_spec(x: Any) -> bool:
    return isinstance(x, tuple) and len(x) == 3 and isinstance(x[0], tuple)


def _int_keys(tree: Any) -> Any:
    """Layer keys as ints: a tree rebuilt from dotted checkpoint keys spells them "0", "1", ..."""
    if isinstance(tree, Mapping):
        return {(int(k) if isinstance(k, str) and k.isdigit() else k): _int_keys(v) for k, v in tree.items()}
    return tree


def floating_dtype(params: PyTree) -> Any:
    """The dtype of the first floating leaf (the dtype :meth:`CausalLM.apply` computes in).

    Args:
      params: a parameter tree.

    Returns:
      That dtype, or float32 when no leaf is floating.
    """
    for x in jax.tree_util.tree_leaves(params):
        if jnp.issubdtype(x.dtype, jnp.floating):
            return x.dtype
    return jnp.float32


class CausalLM:
    """A Hugging Face causal LM (Llama, Mistral, Qwen2, GPT-2) as pure functions of a params dict.

    Args:
      config: the parsed config.
      remat: recompute each block's activations in the backward pass (``jax.checkpoint``).
      scan: run the blocks as one ``lax.scan`` over their stacked weights (one block to compile
        instead of every one; the params keep one subtree per block). Blocks that differ
        (per-layer sliding windows, GPT-2's per-layer attention scale) run in a loop.

    Attributes:
      config: the :class:`ModelConfig`.
      hf_config: the ``config.json`` dict it came from.
      remat: whether blocks are rematerialized.
      scan: whether alike blocks run as one scan.
      graphdef: the nnx graph merged with params in :meth:`apply`.
    """

    def __init__(self, config: ModelConfig, *, remat: bool = False, scan: bool = True):
        self.config = config
        self.remat = remat
        self.scan = scan
        module = nnx.eval_shape(lambda: _build(config, remat, scan))
        graphdef, state, rest = nnx.split(module, nnx.Param, ...)  # type: ignore[misc]  # flax's overloads
        if jax.tree_util.tree_leaves(rest):
            raise TypeError("CausalLM: the module holds non-Param state")
        self.graphdef = graphdef
        is_var = lambda v: isinstance(v, nnx.Variable)  # noqa: E731

        def spec(v: nnx.Variable) -> tuple[tuple[int, ...], float, float]:
            meta = v.get_metadata()
            return tuple(v.get_value().shape), float(meta["init_std"]), float(meta["init_fill"])

        def axes(v: nnx.Variable) -> tuple[str | None, ...]:
            names = tuple(v.get_metadata().get("out_sharding") or ())
            return names + (None,) * (len(v.get_value().shape) - len(names))

        self._specs = nnx.to_pure_dict(jax.tree.map(spec, state, is_leaf=is_var))
        self._axes = nnx.to_pure_dict(jax.tree.map(axes, state, is_leaf=is_var))

    @property
    def hf_config(self) -> dict[str, Any]:
        """The ``config.json`` dict the model was built from."""
        return dict(self.config.hf_config)

    def __repr__(self) -> str:
        c = self.config
        return (
            f"CausalLM({c.family}, layers={c.num_layers}, hidden={c.hidden_size}, heads={c.num_heads}/"
            f"{c.num_kv_heads}, vocab={c.vocab_size}, params={self.num_params():,})"
        )

    # ------------------------------------------------------------------ structure

    def shapes(self, dtype: Any = jnp.float32) -> PyTree:
        """The params' structure as ``jax.ShapeDtypeStruct`` leaves (nothing allocated).

        Args:
          dtype: the leaves' dtype.

        Returns:
          A nested dict like the params.
        """
        return jax.tree.map(lambda s: jax.ShapeDtypeStruct(s[0], dtype), self._specs, is_leaf=_is_spec)

    def logical_axes(self, params: PyTree | None = None) -> PyTree:
        """Logical axis names of every parameter dimension (:mod:`consensus.mesh` rules place them).

        Args:
          params: unused (the axes follow from the architecture).

        Returns:
          A tree like the params with a tuple of names per leaf, one per dimension.
        """
        return self._axes

    def shardings(self, mesh: Mesh, rules: Any = None) -> PyTree:
        """The NamedSharding of every parameter on ``mesh`` (replicated over its "node" axis).

        Args:
          mesh: a ("node", "data", "model") mesh.
          rules: logical axis rules (pairs, a dict or a MeshConfig); None: the default rules.

        Returns:
          A tree like the params.
        """
        return param_sharding(self.shapes(), self._axes, mesh, DEFAULT_RULES if rules is None else rules)

    def num_params(self, params: PyTree | None = None) -> int:
        """The number of parameters (of ``params``, or of the architecture).

        Args:
          params: a parameter tree, or None to count the architecture's.

        Returns:
          The count.
        """
        tree = self.shapes() if params is None else params
        return sum(math.prod(np.shape(x)) for x in jax.tree_util.tree_leaves(tree))

    # ------------------------------------------------------------------ params and forward

    def init(self, key: Array, *, mesh: Mesh | None = None, rules: Any = None) -> PyTree:
        """Fresh float32 params: normal(0, initializer_range) weights, unit norm scales, zero biases.

        Without a mesh, every leaf is a slice of one normal draw (one random-number call to
        compile instead of one per leaf: on CPU those calls dominate compile time). With a mesh,
        leaf i is drawn from ``fold_in(key, i)`` straight into its sharding, so a random-weight
        model of benchmark size is drawn shard by shard, never whole on one device; the two
        draws differ for the same key.

        Args:
          key: a JAX PRNG key.
          mesh: place every leaf on this mesh (None: the default device).
          rules: logical axis rules for ``mesh`` (None: the default rules).

        Returns:
          The params, a nested dict of float32 arrays.
        """
        leaves, treedef = jax.tree_util.tree_flatten(self._specs, is_leaf=_is_spec)

        sizes = [math.prod(shape) for shape, _, _ in leaves]

        def draw(key: Array) -> PyTree:
            drawn = sum(size for (_, std, _), size in zip(leaves, sizes, strict=True) if std > 0.0)
            flat = jax.random.normal(key, (drawn,), jnp.float32) if mesh is None else None
            out, start = [], 0
            for i, ((shape, std, fill), size) in enumerate(zip(leaves, sizes, strict=True)):
                if std <= 0.0:
                    out.append(jnp.full(shape, fill, jnp.float32))
                    continue
                if flat is None:
                    z = jax.random.normal(jax.random.fold_in(key, i), shape, jnp.float32)
                else:
                    z = flat[start : start + size].reshape(shape)
                    start += size
                out.append(jnp.float32(fill) + jnp.float32(std) * z)
            return jax.tree_util.tree_unflatten(treedef, out)

        shardings = self.shardings(mesh, rules) if mesh is not None else None
        return jax.jit(draw, out_shardings=shardings)(key)

    def apply(self, params: PyTree, tokens: Array) -> Array:
        """Next-token logits in the params' floating dtype.

        bfloat16 params compute in bfloat16, with float32 norm statistics and attention softmax.

        Args:
          params: the parameters (layer keys may be ints or decimal strings).
          tokens: (B, T) int tokens.

        Returns:
          (B, T, vocab) logits.

        Raises:
          ModelError: for tokens that are not a 2-D integer array, or longer than GPT-2's positions.
        """
        if not jnp.issubdtype(jnp.asarray(tokens).dtype, jnp.integer) or np.ndim(tokens) != 2:
            raise ModelError(
                f"tokens must be a (batch, length) integer array, got {jnp.asarray(tokens).dtype}"
            )
        if self.config.family == "gpt2" and tokens.shape[1] > self.config.max_position_embeddings:
            raise ModelError(
                f"{tokens.shape[1]} tokens exceed GPT-2's n_positions={self.config.max_position_embeddings}"
            )
        module = nnx.merge(self.graphdef, _int_keys(params))
        return module(tokens, floating_dtype(params))


def from_config(
    hf_config: Mapping[str, Any] | ModelConfig, *, remat: bool = False, scan: bool = True
) -> CausalLM:
    """A model (no weights) from a ``config.json`` dict or a :class:`ModelConfig`.

    Args:
      hf_config: the config.
      remat: recompute each block's activations in the backward pass.
      scan: run alike blocks as one ``lax.scan`` (see :class:`CausalLM`).

    Returns:
      The :class:`CausalLM`.

    Raises:
      ModelError: for an unsupported or inconsistent config.
    """
    config = hf_config if isinstance(hf_config, ModelConfig) else parse_config(hf_config)
    return CausalLM(config, remat=remat, scan=scan)
