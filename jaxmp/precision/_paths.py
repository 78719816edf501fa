"""Names of pytree leaves: ``jax.tree_util.keystr`` with ``/`` separators.

One helper for every place that names a leaf (diagnostics reports, the top-k residual's
match with the gradients, router-bias lookup): an ``nnx.State`` and its
``nnx.to_pure_dict`` give the same names, because the ``.value`` attribute an
``nnx.Variable`` keeps its array under is dropped.
"""
from __future__ import annotations

from typing import Any, List, Sequence

import jax

__all__ = ["path_name", "leaf_names"]


def path_name(path: Sequence[Any]) -> str:
    """``blocks/0/attn/wq`` for the key path of a leaf (``<root>`` for the empty path).

    ``jax.tree_util.keystr(path, simple=True, separator="/")`` after dropping the
    trailing ``GetAttrKey('value')`` steps of ``nnx.Variable`` leaves.
    """
    path = list(path)
    while path and isinstance(path[-1], jax.tree_util.GetAttrKey) and path[-1].name in (
            "value", "raw_value"):
        path.pop()
    return jax.tree_util.keystr(tuple(path), simple=True, separator="/") or "<root>"


def leaf_names(tree: Any) -> List[str]:
    """:func:`path_name` of every leaf of ``tree``, in ``jax.tree.leaves`` order."""
    return [path_name(p) for p, _ in jax.tree_util.tree_flatten_with_path(tree)[0]]
