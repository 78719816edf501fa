"""The manual mesh axes a value varies over inside ``jax.shard_map``, and how to restore them.

A Pallas kernel's result (and a custom VJP's cotangent built from one) carries no
varying-manual-axes type, so under ``jax.shard_map`` it would not match its primal's
type; :func:`match_varying` restores it with ``lax.pcast(..., to="varying")`` (the values
are unchanged).
"""
from __future__ import annotations

import jax

__all__ = ["varying_axes", "match_varying", "as_axes"]


def as_axes(entry) -> tuple:
    """Mesh axis names as a tuple: None -> ``()``, ``"data"`` -> ``("data",)``, a sequence
    -> its tuple. Takes a ``PartitionSpec`` entry, a sharding rule's target or a
    collective's ``axis_name``."""
    if entry is None:
        return ()
    return (entry,) if isinstance(entry, str) else tuple(entry)


def varying_axes(x) -> frozenset:
    """The manual mesh axes ``x`` may differ over (jax 0.10.2: ``aval.manual_axis_type``,
    older: ``aval.vma``); empty outside ``shard_map``."""
    aval = jax.typeof(x)
    mat = getattr(aval, "manual_axis_type", None)
    return frozenset(getattr(mat, "varying", None) or getattr(aval, "vma", None) or ())


def match_varying(out, *like):
    """``out`` made varying over every manual mesh axis any array of ``like`` varies over."""
    want = frozenset().union(*(varying_axes(a) for a in like))
    missing = tuple(sorted(want - varying_axes(out)))
    return jax.lax.pcast(out, missing, to="varying") if missing else out
