"""The precision layer: everything mixed precision needs below the model.

* :mod:`~jaxmp.precision.policy`: parameter / compute / output dtypes, per-module rules.
* :mod:`~jaxmp.precision.loss_scale`: loss scales as pure pytrees, the finiteness verdict.
* :mod:`~jaxmp.precision.ops`: float32 islands (norms, softmax, cross-entropy, router).
* :mod:`~jaxmp.precision.optim`: optax integration (unscale first, skip bitwise, accumulate).
* :mod:`~jaxmp.precision.comm`: gradient collectives in a chosen dtype (inside ``shard_map``).
* :mod:`~jaxmp.precision.diagnostics`: underflow / overflow of gradients in a dtype, and
  what FP8 flushes to zero or saturates under each scaling recipe.
* :mod:`~jaxmp.precision.fp8`: FP8 scales, quantization, recipes (per tensor, delayed,
  per row, DeepSeek-V3 blocks) and FP8 matmuls with a custom VJP (``jaxmp.fp8``).

Depends on JAX, optax, Flax and NumPy only; the models, the trainer and the analysis build
on it. Docstrings cite field cases by label (``case LS-6``): docs/CASES.md lists them.
"""
