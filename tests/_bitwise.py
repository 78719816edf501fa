"""Bitwise comparison of arrays and pytrees for the skipped-step tests (NaN-safe; -0 and
+0 differ)."""
import jax
import numpy as np


def bits(x):
    """The raw bits of an array as unsigned integers of its item size."""
    x = np.asarray(x)
    return x.view(np.dtype(f"u{x.dtype.itemsize}"))


def assert_bitwise_equal(tree_a, tree_b):
    """Both trees have the same number of leaves (at least one) with identical bits."""
    a, b = jax.tree.leaves(tree_a), jax.tree.leaves(tree_b)
    assert len(a) == len(b) > 0
    for x, y in zip(a, b):
        np.testing.assert_array_equal(bits(x), bits(y))
