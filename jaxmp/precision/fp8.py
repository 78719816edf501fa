"""FP8 matmuls with per-tensor, delayed, per-row and DeepSeek-V3 block scaling, in pure JAX.

``jaxmp.fp8`` (this module) quantizes the operands of a matmul to an 8-bit float format,
multiplies the 8-bit values with float32 accumulation, and applies the scales to the
float32 result. A scale is ``amax / finfo(dtype).max`` (:func:`scale_from_amax`), so the
largest magnitude of the group of elements it covers lands on the format's maximum
(448 for E4M3, 57344 for E5M2) and ``q = saturate(x / scale)`` (:func:`quantize`).

The formats (OCP 8-bit floating point specification; ``jnp.float8_e4m3fn`` and
``jnp.float8_e5m2``):

* :data:`E4M3`: 4 exponent, 3 mantissa bits, max 448, smallest normal ``2**-6``,
  smallest subnormal ``2**-9``, no inf (NaN only).
* :data:`E5M2`: 5 exponent, 2 mantissa bits, max 57344, smallest normal ``2**-14``,
  smallest subnormal ``2**-16``, with inf.

The recipes (:class:`Recipe`), by how many elements share one scale:

======================== ============================ ========== ========== ===================
recipe                   scales                       forward    backward   source
======================== ============================ ========== ========== ===================
``Recipe.tensorwise()``  one per tensor, from the     E4M3       E5M2       Transformer Engine's
                         tensor's own amax (current                         current scaling,
                         scaling)                                           HYBRID format
``Recipe.delayed()``     one per tensor, from the     E4M3       E5M2       Transformer Engine's
                         max of an amax history of                          ``DelayedScaling``;
                         earlier steps                                      Flax ``fp8_ops``
``Recipe.rowwise()``     one per row of the           E4M3       E4M3       torchao's float8
                         activation / gradient, one                         ``ROWWISE`` recipe
                         per output column of the                           (without its power
                         weight                                             of two rounding)
``Recipe.blockwise()``   one per 1x128 tile of the    E4M3       E4M3       DeepSeek-V3 report,
                         activation and gradient,                           section 3.3.2
                         one per 128x128 block of
                         the weight
======================== ============================ ========== ========== ===================

"Backward" is the format of the output gradient in the two backward matmuls
(``dx = g @ w.T``, ``dw = x.T @ g``); the weight and the activation keep the forward format
there. Every product accumulates in float32. Per-tensor and per-row scales lie outside
the contraction and multiply the float32 product once. 1x128 tiles and 128x128 blocks
lie *along* the contraction, so the blockwise product is a sum over 128-wide slices of
the contraction, each an FP8 product with float32 output that is scaled and added in
float32: the "promotion to CUDA cores every 128 elements" of DeepSeek-V3 (report, section
3.3.2), which on Hopper also avoids the tensor cores' limited (about 14-bit) accumulation
in long contractions.

The backward pass of :func:`dot` (a ``jax.custom_vjp``):

* saves the activation in FP8 with its scales (DeepSeek-V3, section 3.3.3, caches the
  activations of its linear layers in FP8), never a bfloat16 copy; the weight's FP8 copy
  is not saved but quantized again from the master weight, which the backward pass has
  anyway (as :func:`jaxmp.ops.cast_matmul` recasts it);
* quantizes each operand of the two backward products with scales outside *their*
  contraction where the recipe allows: per-row recipes scale the gradient by rows for
  ``dx`` and by columns for ``dw``, and the weight by rows for ``dx``; blockwise uses the
  transposed 128x128 weight blocks for ``dx`` and 128x1 tiles of the activation and the
  gradient for ``dw``. Where a saved FP8 activation is needed with another layout (per
  column for rowwise, 128x1 tiles for blockwise) it is dequantized and quantized again,
  as DeepSeek-V3 converts its cached 1x128 tiles to 128x1 tiles (section 3.3.3).

Delayed scaling and its state. ``Recipe.delayed`` scales each tensor by the largest amax
in a history of the previous steps (Transformer Engine, Flax). The history of one
:func:`dot` is a float32 ``[3, history_length]`` array (:func:`init_state`; rows: the
activation, the weight, the output gradient; newest entry first), a pure pytree leaf
that the caller keeps (the trainer: in ``TrainState.rest``, checkpointed with it). The
gradient's amax is only known in the backward pass, so the updated history comes back
the way Flax's Linen ``fp8_ops`` return it: as the *cotangent* of the state ("overwrite
with gradient"): ``jax.grad`` with respect to the state gives its new value, which
replaces the state instead of being applied by an optimizer. Three rules follow:

* each state belongs to exactly one :func:`dot` call per forward pass: JAX adds the
  cotangents of a value used twice, and a sum of histories is meaningless;
* micro-batches of one step each return the history rolled once with their own amax;
  combine them with :func:`merge_states` (elementwise max: the newest entry becomes the
  largest micro-batch amax, case FP8-1), and devices with ``jax.lax.pmax``;
* a skipped step keeps the old state (select it, as the parameters).

Flax's Linen version makes JAX combine cotangents by max through a custom extended dtype
(``fp8_meta_dtype``, a private JAX API); jaxmp keeps plain float32 arrays and lets the
train step combine them explicitly (:mod:`jaxmp.train.step`). Under ``jax.lax.scan`` over
layers a stacked ``[layers, 3, history_length]`` state gives each layer its own slice,
and the cotangent comes back stacked: each layer keeps its own history.

:func:`matmul` takes ``jnp.einsum``-style specs and grouped (ragged) matmuls, so a model
can swap :func:`jaxmp.ops.cast_matmul` for it module by module
(:mod:`jaxmp.models.layers`).

The blockwise GEMM (``Recipe.blockwise(kernel=...)``): ``"xla"`` is the sum over 128-wide
slices above, one FP8 ``dot_general`` each (the reference and the oracle); ``"pallas"``
is one Pallas Mosaic GPU kernel per product that promotes inside it
(:mod:`jaxmp.precision._fp8.kernel`, interpreted on a host without a GPU); ``"auto"`` (the
default) takes ``pallas`` when compiling for a Hopper GPU (compute capability 9.x) and
``xla`` elsewhere. Only the dense :func:`dot` (and :func:`matmul` without a group axis)
uses the kernel; :func:`grouped_dot` is the XLA form under every setting.

This module re-exports the public names of its parts (:mod:`jaxmp.precision._fp8`):
quantization (``quant``), recipes and state (``recipe``), the products (``gemm``), the
kernel (``kernel``), the einsum adapter (``einsum``); :func:`all_to_all` is
:func:`jaxmp.precision.comm.fp8_all_to_all`.
"""
from __future__ import annotations

from jaxmp.precision._fp8.einsum import matmul
from jaxmp.precision._fp8.gemm import dot, grouped_dot
from jaxmp.precision._fp8.quant import (
    BLOCK, E4M3, E5M2, dequantize, dequantize_blocks, quantize, quantize_blocks, scale_from_amax)
from jaxmp.precision._fp8.recipe import (
    KERNELS, RECIPES, Recipe, init_state, merge_states, roll_history)
from jaxmp.precision.comm import fp8_all_to_all as all_to_all

__all__ = [
    "E4M3",
    "E5M2",
    "BLOCK",
    "RECIPES",
    "KERNELS",
    "scale_from_amax",
    "quantize",
    "dequantize",
    "quantize_blocks",
    "dequantize_blocks",
    "Recipe",
    "init_state",
    "roll_history",
    "merge_states",
    "dot",
    "grouped_dot",
    "matmul",
    "all_to_all",
]
