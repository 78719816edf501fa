"""The concepts behind :mod:`jaxmp.precision.fp8`, one module each.

* :mod:`.quant`: formats, scales, quantization by tensor, slice and block.
* :mod:`.recipe`: :class:`~.recipe.Recipe` and the delayed recipe's amax-history state.
* :mod:`.gemm`: the FP8 products and their custom VJPs, one scheme per recipe.
* :mod:`.kernel`: the blockwise GEMM as a Pallas Mosaic GPU kernel (Hopper and newer).
* :mod:`.grouped_kernel`: the grouped (MoE) blockwise GEMMs as Pallas Mosaic GPU kernels.
* :mod:`.einsum`: :func:`~.einsum.matmul`, einsum specs onto the products.

The modules of this private package are one unit behind :mod:`jaxmp.precision.fp8`: they
share their underscore helpers (``_quantize``, ``_check_recipe``, ...) among themselves,
and nothing outside the package imports them.

The FP8 all-to-all is with the other collectives, :func:`jaxmp.precision.comm.fp8_all_to_all`.
"""
