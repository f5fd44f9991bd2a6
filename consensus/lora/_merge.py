"""``merge_adapters``: the one entry point over the declared adapter methods (and robust rules)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jax

from consensus.lora._core import AdapterError, AdapterMerge, check_stacked, node_scales, node_weights
from consensus.specs import ADAPTER_METHODS

SPACES = ("products", "factors")


def merge_adapters(
    method: str,
    stacked: Mapping[str, Mapping[str, Any]],
    *,
    scale: Any,
    weights: Any = None,
    rank: int | None = None,
    key: jax.Array | None = None,
    rule: Any = None,
    space: str = "products",
    **options: Any,
) -> AdapterMerge:
    """Merge n nodes' LoRA adapters into one with a declared adapter method, optionally robustly.

    Args:
      method: A name of :data:`consensus.specs.ADAPTER_METHODS`: ``fedit``, ``ffa``, ``stack``,
        ``svd``, ``exact_residual`` and PEFT's ``linear``, ``cat``, ``ties``, ``dare_linear``,
        ``dare_ties`` (see each method's docstring for its exactness and conventions).
      stacked: ``{target: {"a": (n, in, r), "b": (n, r, out)}}``, the nodes' adapters stacked on
        axis 0 (:func:`consensus.lora.stack_adapters` builds it from a list of trees).
      scale: The adapters' scale (``alpha / r``), one float or one per node.
      weights: Node weights, default uniform. The package's own methods (``fedit``, ``ffa``,
        ``stack``, ``exact_residual``) normalise them to sum 1; PEFT's names (``linear``, ``cat``,
        ``svd``, ``ties``, ``dare_*``) use them as given, as PEFT's ``add_weighted_adapter`` does
        (a weighted sum; the default is then 1/n each).
      rank: The output rank of the methods that take one (``svd``: default the input rank).
      key: A ``jax.random`` key for randomised methods (``dare_*``).
      rule: An :class:`~consensus.base.Aggregator` (``consensus.krum(1)``, ``consensus.median()``)
        applied robustly in ``space`` before ``method`` combines (see :mod:`consensus.lora.robust`).
      space: Where ``rule`` works: ``"products"`` (exact, on the updates ``s_i a_i b_i``; a vector
        rule reads their Gram matrix, formed from the factors; a coordinate-wise rule is streamed
        target by target) or ``"factors"`` (cheap, on the flattened factors; the factorisation is
        not unique, so two nodes with one update can look far apart).
      **options: The method's own options (``density`` for TIES and DARE, ...).

    Returns:
      An :class:`~consensus.lora.AdapterMerge`.

    Raises:
      AdapterError: malformed or non-finite adapters, a rank mismatch, bad weights, an option the
        method does not take, or a rule the method cannot follow.
      consensus.specs.RegistryError: an unknown method (the message lists the valid ones).
      consensus.base.ByzantineToleranceError: too few valid nodes for ``rule``'s precondition.
    """
    spec = ADAPTER_METHODS[method]
    if space not in SPACES:
        raise AdapterError(f"space must be one of {list(SPACES)}, got {space!r}")
    params = dict(options)
    if rank is not None:
        if "rank" not in spec.params:
            raise AdapterError(f"{method} takes no rank (its output rank is fixed by the method)")
        params["rank"] = rank
    missing = [k for k in spec.required if k not in params]
    if missing:
        raise AdapterError(f"{method} needs {', '.join(missing)} (pass {missing[0]}=...)")
    try:
        built = spec.build(**params)
    except TypeError as e:
        raise AdapterError(f"{method}: {e}") from None
    n, _ = check_stacked(stacked, finite=rule is None)
    s = node_scales(scale, n)
    if spec.randomized and key is None:
        raise AdapterError(f"{method} is randomised: pass key=jax.random.key(seed)")
    if rule is not None:
        from consensus.lora.robust import merge_robust

        return merge_robust(spec, built, stacked, s, weights, rule, space, key)
    w = node_weights(weights, n, normalize=bool(spec.traits.get("normalize", True)))
    return built.combine(stacked, s, w, key)
