"""jaxmp's copy of JAX's weight-gradient kernel differs from it in one line (issue 29).

``jaxmp.precision.grouped_gemm._transposed_ragged_dot`` is jax 0.10.2's
``transposed_ragged_dot_mgpu.transposed_ragged_dot`` with ``num_sms`` a keyword argument
instead of ``num_sms = jax.devices()[0].core_count``. The syntax trees (which ignore
formatting and comments) are compared, so a local edit, or a change in JAX's kernel in a
new jax, fails here.
"""
import ast
import inspect
import textwrap

import pytest


def _parts(fn):
    tree = ast.parse(textwrap.dedent(inspect.getsource(fn))).body[0]
    body = [s for s in tree.body
            if not isinstance(s, (ast.Import, ast.ImportFrom))  # jaxmp imports inside
            and not (isinstance(s, ast.Expr) and isinstance(s.value, ast.Constant))]
    return [a.arg for a in tree.args.kwonlyargs], [ast.dump(s) for s in body]


def test_the_copy_differs_from_jaxs_kernel_only_in_the_sm_count():
    shipped = pytest.importorskip("jax.experimental.pallas.ops.gpu.transposed_ragged_dot_mgpu")
    from jaxmp.precision import grouped_gemm
    jax_args, jax_body = _parts(shipped.transposed_ragged_dot)
    our_args, our_body = _parts(grouped_gemm._transposed_ragged_dot)
    core_count = ast.dump(ast.parse("num_sms = jax.devices()[0].core_count").body[0])
    assert jax_body.count(core_count) == 1
    assert our_args == jax_args + ["num_sms"]
    assert our_body == [s for s in jax_body if s != core_count]
