"""Robust rules on adapters, on the products or on the factors."""

from __future__ import annotations

from typing import Any


def merge_robust(
    spec: Any, built: Any, stacked: Any, s: Any, weights: Any, rule: Any, space: str, key: Any
) -> Any:
    """Robust merge of adapters (being written: products via the Gram from the factors, or factors)."""
    raise NotImplementedError("robust adapter merging is not available yet")
