"""Causal multi-head self-attention with rotary position embeddings, on one of three paths.

The projections run in the module's compute dtype through :func:`jaxmp.ops.cast_matmul`,
or in FP8 under an FP8 policy (:func:`jaxmp.models.layers.matmul`); the attention core
(``softmax(q k^T / sqrt(h)) v``) never runs in FP8 (DeepSeek-V3 report, section 3.3.1)
and runs on the path that ``model.attention`` names (:data:`ATTENTION_IMPLEMENTATIONS`):

``"reference"``
    jaxmp's own float32 island: the scores ``q k^T`` are accumulated in float32 and
    normalized by :func:`jaxmp.ops.masked_softmax`, the probabilities go back to the
    compute dtype for the product with ``v``. It materializes ``[B, H, T, T]`` and keeps
    the compute-dtype probabilities for the backward pass (2 bytes per score in bf16).
``"xla"``
    ``jax.nn.dot_product_attention(implementation="xla")``: scores accumulated in float32
    (``preferred_element_type=float32``), softmax in float32, probabilities cast to the
    compute dtype for the product with ``v``: the same arithmetic as ``"reference"``
    written by JAX. It materializes the scores too and keeps more of them for the
    backward pass than ``"reference"`` (a boolean mask, the float32 masked scores and
    exponentials and the compute-dtype probabilities: 11 bytes per score in bf16,
    measured by :func:`jaxmp.analysis.residuals.saved_residuals`).
``"cudnn"``
    ``jax.nn.dot_product_attention(implementation="cudnn")``: cuDNN's fused
    (FlashAttention-style, Dao et al. 2022) kernel on NVIDIA GPUs. The scores never
    reach device memory; the softmax statistics are float32 inside the kernel, and the
    backward pass keeps only ``q``, ``k``, ``v``, the output and one float32 softmax
    statistic per query and head. It needs float16/bfloat16 ``q``/``k``/``v`` and a
    head dimension that is a multiple of 8, at most 128 (256 on Hopper and newer).
``"auto"`` (the default)
    ``"cudnn"`` where :func:`cudnn_support` says it runs (an NVIDIA GPU with cuDNN, a
    16-bit compute dtype, a supported head dimension), else ``"reference"``, which keeps
    2 bytes per score for the backward pass where ``"xla"`` keeps 11. Resolved once per
    attention module, when the model is built, from that module's compute dtype and the
    compile target the model is built for (``MoETransformer(target=)``, by default
    :func:`jaxmp.target.current`: a deviceless compile for an H200 gets ``"cudnn"``).

Every path takes attention sinks (GPT-OSS's learned per-head logit in the softmax
denominator; see :func:`attention_core` for how the fused paths compute them). Every path
is causal, takes an optional sliding window (``window``: a query sees its last
``window`` tokens, Mistral's and Qwen2's ``sliding_window``), and takes optional
per-sequence ``lengths`` (right padding) and
``segment_ids`` (documents packed in a row, 0 = padding): a query attends only to earlier
keys of its own document, a padded position neither attends nor is attended to, and
its output row is exactly 0 with gradient 0 (the fully-masked-row guarantee of
:func:`jaxmp.ops.masked_softmax`, enforced with a select after the core on the ``"xla"``
and ``"cudnn"`` paths, which would otherwise return a uniform average over the masked keys
or leave the row to the kernel). ``tests/test_attention.py`` checks values and gradients of every path that can
run against the reference, per dtype.

Parameters carry the logical axes ``embed``, ``heads``, ``head_dim``.
"""
from __future__ import annotations

import contextlib
import functools
import math
from typing import Optional, Tuple

import jax
import jax.extend
import jax.numpy as jnp
from flax import nnx

from jaxmp import target
from jaxmp.models.layers import (
    RMSNorm,
    Rope,
    add_fp8_states,
    apply_rope,
    make_param,
    matmul,
    yarn_mscale,
)
from jaxmp.precision import ops
from jaxmp.precision.policy import Policy, PolicyRules

__all__ = ["Attention", "MLAttention", "ATTENTION_IMPLEMENTATIONS", "cudnn_support", "xla_support",
           "resolve_attention",
           "attention_core", "trace_cudnn_without_gpu"]

ATTENTION_IMPLEMENTATIONS = ("reference", "xla", "cudnn", "auto")

# Set by trace_cudnn_without_gpu(): the cudnn path may be traced (never compiled) here.
_TRACE_ONLY_CUDNN = [False]


def _cudnn_version() -> Optional[int]:
    """cuDNN's version as JAX's fused attention reads it, or None when it finds none."""
    # Private but the check jax.nn.dot_product_attention(implementation="cudnn") itself
    # makes before tracing; there is no public query.
    from jax._src.cudnn import fused_attention_stablehlo as fused

    try:
        return int(fused.check_cudnn_version())
    except Exception:  # RuntimeError("cuDNN is not detected.") off CUDA
        return None


def cudnn_support(dtype, head_dim: int,
                  where: Optional[target.Target] = None) -> Tuple[bool, str]:
    """Whether cuDNN's fused attention runs here for this compute dtype and head size.

    The conditions are those ``jax.nn.dot_product_attention(implementation="cudnn")``
    checks (jax/_src/cudnn/fused_attention_stablehlo.py: ``check_layout``,
    ``check_is_flash_attention``): an NVIDIA GPU as the compile target
    (:func:`jaxmp.target.current`: the host's GPU with cuDNN found, or a deviceless GPU
    target), float16 or bfloat16 operands, and a head dimension that is a multiple of 8
    and at most 128 (256 on compute capability >= 9.0).

    Args:
      dtype: the attention's compute dtype.
      head_dim: ``d_model / num_heads``.
      where: the compile target; None = :func:`jaxmp.target.current`.

    Returns:
      ``(supported, reason)``; the reason names the first condition that fails.
    """
    dtype = jnp.dtype(dtype)
    if _TRACE_ONLY_CUDNN[0]:
        ok = dtype in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)) and head_dim % 8 == 0 \
            and head_dim <= 256
        return ok, ("traced without a GPU (trace_cudnn_without_gpu)" if ok else
                    f"cuDNN needs float16/bfloat16 operands and a head dimension that is a "
                    f"multiple of 8 and <= 256; got {dtype.name}, {head_dim}")
    where = where or target.current()
    if where.platform != "gpu":
        return False, f"the compile target is {where.platform!r}, not an NVIDIA GPU"
    if where.deviceless:  # compiled for a GPU target description: its cuDNN, never run here
        if dtype not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)):
            return False, (f"cuDNN fused attention takes float16 or bfloat16 q/k/v; this "
                           f"module computes in {dtype.name}")
        limit = 256 if where.is_nvidia((9, 0)) else 128
        if head_dim % 8 or head_dim > limit:
            return False, (f"cuDNN fused attention needs a head dimension that is a multiple of "
                           f"8 and <= {limit} on {where.device_kind}; got {head_dim}")
        return True, f"cuDNN on {where.device_kind} (deviceless compile)"
    device = jax.devices()[0]
    # The backend's platform version ("cuda 12080", ...), as JAX's cuDNN check reads it.
    if "cuda" not in str(jax.extend.backend.get_backend().platform_version).lower():
        return False, f"the GPU {device.device_kind!r} is not driven by CUDA"
    if _cudnn_version() is None:
        return False, "JAX finds no cuDNN library"
    if dtype not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)):
        return False, (f"cuDNN fused attention takes float16 or bfloat16 q/k/v; this "
                       f"module computes in {dtype.name}")
    cc = tuple(int(x) for x in str(getattr(device, "compute_capability", "0.0")).split(".")[:2])
    limit = 256 if cc >= (9, 0) else 128
    if head_dim % 8 or head_dim > limit:
        return False, (f"cuDNN fused attention needs a head dimension that is a multiple of 8 "
                       f"and <= {limit} on compute capability {cc[0]}.{cc[1]}; got {head_dim}")
    return True, f"cuDNN {_cudnn_version()} on {device.device_kind}"


def resolve_attention(name: str, dtype, head_dim: int,
                      where: Optional[target.Target] = None) -> str:
    """The path an attention module runs: ``name`` itself, or for ``"auto"`` cudnn/reference.

    Args:
      name: one of :data:`ATTENTION_IMPLEMENTATIONS`.
      dtype: the module's compute dtype.
      head_dim: its head dimension.
      where: the compile target (:class:`jaxmp.target.Target`); None =
        :func:`jaxmp.target.current`.

    Returns:
      ``"reference"``, ``"xla"`` or ``"cudnn"``.

    Raises:
      ValueError: an unknown name, ``"cudnn"`` where :func:`cudnn_support` says it
        cannot run, or ``"xla"`` where :func:`xla_support` says it cannot (the message
        gives the reason and the alternatives).
    """
    if name not in ATTENTION_IMPLEMENTATIONS:
        raise ValueError(f"model.attention={name!r}; allowed: "
                         f"{', '.join(ATTENTION_IMPLEMENTATIONS)}")
    xla_ok, xla_reason = xla_support(dtype)
    if name == "auto":  # where cuDNN is absent, the reference keeps 2 bytes per score, xla 11
        return "cudnn" if cudnn_support(dtype, head_dim, where)[0] else "reference"
    if name == "cudnn":
        ok, reason = cudnn_support(dtype, head_dim, where)
        if not ok:
            raise ValueError(f"model.attention='cudnn' cannot run here: {reason}; use 'auto' "
                             f"(cudnn where it runs, else reference), 'xla' or 'reference'")
    if name == "xla" and not xla_ok:
        raise ValueError(f"model.attention='xla' cannot run here: {xla_reason}; use 'auto' or "
                         f"'reference'")
    return name


def xla_support(dtype) -> Tuple[bool, str]:
    """Whether ``jax.nn.dot_product_attention(implementation="xla")`` compiles here.

    For float16 operands it asks XLA for the ``F16_F16_F32`` dot algorithm (float16
    inputs, float32 accumulation), which XLA:CPU rejects when compiling ("not supported
    by dot_general on CPU"); every other case runs.

    Returns:
      ``(supported, reason)``.
    """
    if jnp.dtype(dtype) == jnp.dtype(jnp.float16) and jax.default_backend() == "cpu" \
            and not _TRACE_ONLY_CUDNN[0]:
        return False, ("for float16 q/k/v it requests the F16_F16_F32 dot algorithm, which "
                       "XLA:CPU does not support")
    return True, "supported"


@contextlib.contextmanager
def trace_cudnn_without_gpu():
    """Lets the ``"cudnn"`` path be *traced* where there is no cuDNN, to count its memory.

    Inside the context, ``model.attention="cudnn"`` builds on any backend and JAX's cuDNN
    version check reports 9.8, so ``jax.make_jaxpr``, ``jax.eval_shape`` and
    :func:`jaxmp.analysis.residuals.saved_residuals` see the fused kernel's real
    forward/backward rule (its residuals are what a GPU run keeps). A program traced
    here cannot be compiled or run off a GPU: use it for abstract evaluation only.
    """
    from jax._src.cudnn import fused_attention_stablehlo as fused

    original = fused.check_cudnn_version
    if _cudnn_version() is None:
        fused.check_cudnn_version = lambda: 90800
    _TRACE_ONLY_CUDNN[0] = True
    try:
        yield
    finally:
        fused.check_cudnn_version = original
        _TRACE_ONLY_CUDNN[0] = False


def query_valid(t: int, lengths: Optional[jax.Array],
                segment_ids: Optional[jax.Array] = None) -> Optional[jax.Array]:
    """bool ``[B, T]``: the real tokens, those within the first ``lengths[b]`` and not in
    segment 0 (padding); None when neither is given (every token is real)."""
    valid = None
    if lengths is not None:
        valid = jnp.arange(t)[None, :] < jnp.asarray(lengths, jnp.int32)[:, None]  # [B, T]
    if segment_ids is not None:
        real = jnp.asarray(segment_ids, jnp.int32) != 0
        valid = real if valid is None else valid & real
    return valid


def _padding_masks(t: int, lengths: Optional[jax.Array],
                   segment_ids: Optional[jax.Array] = None, window: int = 0):
    """``(attend [B|1, 1, T, T] bool, query_valid [B, T] bool or None)``: causal, within
    the last ``window`` tokens (0 = all), within the first ``lengths[b]`` tokens, and
    within one segment of ``segment_ids`` (0 is padding: it neither attends nor is
    attended to)."""
    attend = ops.causal_mask(t)[None, None]
    if window:  # key j is seen by query i when i - window < j (transformers' sliding window)
        attend = attend & (jnp.arange(t)[:, None] - jnp.arange(t)[None, :] < window)[None, None]
    if segment_ids is not None:
        seg = jnp.asarray(segment_ids, jnp.int32)
        attend = attend & (seg[:, None, :, None] == seg[:, None, None, :])
    valid = query_valid(t, lengths, segment_ids)
    if valid is None:
        return attend, None
    return attend & valid[:, None, None, :] & valid[:, None, :, None], valid


def _scores(q, k, scale):
    """float32 ``[B, H, T, T]`` scores ``q k^T`` times ``scale`` (None: ``h ** -0.5``),
    each query head with its key head (grouped-query attention: ``k`` repeated)."""
    groups = q.shape[2] // k.shape[2]
    if groups > 1:  # query head n reads key/value head n // groups (GQA, Ainslie et al.)
        k = jnp.repeat(k, groups, axis=2)
    scores = jnp.einsum("bqhk,bshk->bhqs", q, k, preferred_element_type=jnp.float32)
    return scores / math.sqrt(q.shape[-1]) if scale is None else scores * scale


def _fused_with_lse(q, k, v, implementation, scale, padding, attend, valid):
    """``(out [B, T, H, h], lse float32 [B, T, H])`` of the fused path: the output with its
    own gradient, and the log-sum-exp of each query's scaled, masked scores (no gradient,
    0 on padded queries).

    cuDNN's kernel computes the statistic in float32 beside its output (the
    FlashAttention-2 log-sum-exp, Dao 2023, section 3.1.1); ``jax.nn.dot_product_attention
    (return_residual=True)`` rounds it to the compute dtype (to 0.125 at 16 in bfloat16),
    so it is read from the private call that returns it as cuDNN wrote it. On the
    ``"xla"`` path, which materializes the scores anyway, it is computed from them here
    in float32.
    """
    if implementation == "cudnn":
        # Private, as jaxmp's cuDNN version check above: the public function's arguments
        # translated as it translates them (jax/_src/nn/functions.py, case 'cudnn').
        from jax._src.cudnn import fused_attention_stablehlo as fused

        kinds = fused.MaskType
        lengths = padding.get("query_seq_lengths")
        window = padding.get("local_window_size")
        out, stat = fused.dot_product_attention(
            q, k, v, None, padding.get("mask"), lengths, lengths, scale=scale,
            mask_type=kinds.PADDING_CAUSAL if lengths is not None else kinds.CAUSAL,
            sliding_window_length=None if window is None else window[0] + 1,
            return_residual=True)
        lse = jnp.transpose(stat.astype(jnp.float32), (0, 2, 1))  # cuDNN's [B, H, T]
    else:
        out = jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation=implementation,
                                           scale=scale, **padding)
        lse = jax.nn.logsumexp(jnp.where(attend, _scores(q, k, scale), -jnp.inf), axis=-1)
        lse = jnp.transpose(lse, (0, 2, 1))
    lse = jax.lax.stop_gradient(lse)
    if valid is not None:  # a padded query's statistic is the kernel's to fill
        lse = jnp.where(valid[:, :, None], lse, 0.0)
    return out, lse


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _lse_gradient(core, scale, q, k, lse, masks):
    """``lse`` (the log-sum-exp of ``core``'s scores scaled by ``scale``), with its
    gradient in ``q`` and ``k``, which the fused kernels do not give: ``d lse_i / d q_i =
    scale sum_j P_ij k_j`` (attention with ``k`` as the values) and ``d lse_i / d k_j =
    scale P_ij q_i`` (the values' gradient of attention at cotangent ``scale g q``), both
    from the fused path itself (one more forward and backward pass of it)."""
    del core, scale, q, k, masks
    return lse


def _lse_gradient_fwd(core, scale, q, k, lse, masks):
    return lse, (q, k, masks)


def _lse_gradient_bwd(core, scale, res, g):
    q, k, masks = res
    g = jnp.float32(scale) * g[..., None]  # [B, T, H, 1]
    values_k, pullback = jax.vjp(lambda v: core(q, k, v, lengths=masks[0],
                                                  segment_ids=masks[1]), k)
    (dk,) = pullback((g * q.astype(jnp.float32)).astype(q.dtype))
    dq = g * values_k.astype(jnp.float32)
    return dq.astype(q.dtype), dk.astype(k.dtype), None, None


_lse_gradient.defvjp(_lse_gradient_fwd, _lse_gradient_bwd)


def attention_core(q: jax.Array, k: jax.Array, v: jax.Array, implementation: str,
                   lengths: Optional[jax.Array] = None,
                   scale: Optional[float] = None,
                   segment_ids: Optional[jax.Array] = None, window: int = 0,
                   sinks: Optional[jax.Array] = None) -> jax.Array:
    """Causal ``softmax(q k^T / sqrt(h)) v`` on one path, softmax statistics in float32.

    Args:
      q: ``[B, T, H, h]``; k: ``[B, T, K, h]``; v: ``[B, T, K, h_v]``, in the compute
        dtype (one dtype for all three). ``K < H`` is grouped-query attention (Ainslie et
        al. 2023): query head ``n`` attends with key/value head ``n // (H / K)``, as
        transformers' ``repeat_kv``. ``h_v`` may be smaller than ``h`` (MLA).
      implementation: ``"reference"``, ``"xla"`` or ``"cudnn"`` (resolved: see
        :func:`resolve_attention`).
      lengths: optional int ``[B]``, the non-padding tokens of each sequence (right
        padding); positions ``>= lengths[b]`` neither attend nor are attended to and
        their output rows are exactly 0, gradient included.
      scale: the score scale; None = ``1 / sqrt(h)``.
      segment_ids: optional int ``[B, T]``, the document each token belongs to (packed
        rows): a query attends only to earlier keys of its own segment; segment 0 is
        padding, whose output rows are exactly 0, gradient included. On the ``"xla"`` and
        ``"cudnn"`` paths the segments go in as a boolean ``mask [B, 1, T, T]`` beside
        ``is_causal`` (cuDNN folds it into its fused kernel as a bias).
      window: a sliding window (a Python int, 0 = none): query ``i`` attends only to keys
        ``j > i - window`` (transformers' ``sliding_window``). On the ``"xla"`` and
        ``"cudnn"`` paths it is ``local_window_size=(window - 1, 0)`` (cuDNN's own
        sliding-window kernel, no ``[T, T]`` mask), or part of the segment mask where
        there is one.
      sinks: optional float32 ``[H]``, attention sinks (GPT-OSS): a learned logit per
        head in every query's softmax denominator and no value,
        ``softmax([s_i1 .. s_iT, sink])[:T] v``; a padded query stays 0. On the
        ``"reference"`` path it is a score column; on the fused paths the output is
        rescaled by ``sigmoid(lse - sink)`` (``lse``: the query's log-sum-exp, the
        statistic the fused kernel keeps, :func:`_fused_with_lse`), whose gradient in
        ``q`` and ``k`` the kernel does not give: :func:`_lse_gradient` computes it with
        one more forward and backward pass of the same kernel.

    Returns:
      ``[B, T, H, h_v]`` in ``q``'s dtype.

    Raises:
      ValueError: an unknown implementation, or q/k/v of shapes or dtypes that do not fit.
    """
    if implementation not in ("reference", "xla", "cudnn"):
        raise ValueError(f"attention implementation {implementation!r}; allowed: reference, xla, "
                         f"cudnn (resolve 'auto' with resolve_attention first)")
    if (q.ndim != 4 or k.shape != v.shape[:-1] + k.shape[-1:] or q.shape[:2] != k.shape[:2]
            or q.shape[-1] != k.shape[-1] or k.shape[2] < 1 or q.shape[2] % k.shape[2]
            or not q.dtype == k.dtype == v.dtype):
        raise ValueError(f"q [B, T, H, h], k [B, T, K, h], v [B, T, K, h_v] with K dividing H "
                         f"and one dtype expected, got {q.shape} {q.dtype}, {k.shape} {k.dtype}, "
                         f"{v.shape} {v.dtype}")
    t = q.shape[1]
    if segment_ids is not None and jnp.shape(segment_ids) != q.shape[:2]:
        raise ValueError(f"segment_ids of shape {jnp.shape(segment_ids)}; expected [B, T] = "
                         f"{list(q.shape[:2])}")
    if sinks is not None and jnp.shape(sinks) != (q.shape[2],):
        raise ValueError(f"sinks of shape {jnp.shape(sinks)}; expected [H] = [{q.shape[2]}]")
    if isinstance(window, bool) or not isinstance(window, int) or window < 0:
        raise ValueError(f"window={window!r} must be a Python int >= 0 (0 = no sliding window)")
    attend, query_valid = _padding_masks(t, lengths, segment_ids, window)
    groups = q.shape[2] // k.shape[2]
    if implementation == "reference":
        scores = _scores(q, k, scale)
        if groups > 1:  # query head n reads key/value head n // groups
            v = jnp.repeat(v, groups, axis=2)
        if sinks is None:
            probs = ops.masked_softmax(scores, attend, axis=-1, dtype=q.dtype)
            return jnp.einsum("bhqs,bshk->bqhk", probs, v)
        b, h = scores.shape[:2]
        sink = jnp.broadcast_to(jnp.asarray(sinks, jnp.float32)[None, :, None, None],
                                (b, h, t, 1))
        # the sink column counts for every query that attends at all (not for padding)
        seen = jnp.broadcast_to(jnp.any(attend, axis=-1, keepdims=True), (b, h, t, 1))
        probs = ops.masked_softmax(jnp.concatenate([scores, sink], -1),
                                   jnp.concatenate([jnp.broadcast_to(attend, scores.shape),
                                                    seen], -1), axis=-1, dtype=q.dtype)
        return jnp.einsum("bhqs,bshk->bqhk", probs[..., :t], v)
    padding = {} if lengths is None else dict(
        query_seq_lengths=jnp.asarray(lengths, jnp.int32),
        key_value_seq_lengths=jnp.asarray(lengths, jnp.int32))
    hv = v.shape[-1]
    if hv > q.shape[-1]:
        raise ValueError(f"a value head of {hv} > query head {q.shape[-1]} runs only on the "
                         f"reference path")
    if hv < q.shape[-1]:  # the fused paths take one head size: pad v with zeros, then cut
        v = jnp.pad(v, ((0, 0),) * 3 + ((0, q.shape[-1] - hv),))
    if segment_ids is not None:  # documents of a packed row: the causal mask within each
        padding["mask"] = attend  # the window too
    elif window and window < t:
        padding["local_window_size"] = (window - 1, 0)
    if sinks is None:
        out = jax.nn.dot_product_attention(q, k, v, is_causal=True,
                                           implementation=implementation, scale=scale,
                                           **padding)
    else:  # out * Z / (Z + e^sink), Z = e^lse: the sink's share taken from every query
        scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
        out, lse = _fused_with_lse(q, k, v, implementation, scale, padding, attend,
                                   query_valid)
        core = functools.partial(attention_core, implementation=implementation, scale=scale,
                                 window=window)
        lse = _lse_gradient(core, scale, q, k, lse, (lengths, segment_ids))
        share = jax.nn.sigmoid(lse - jnp.asarray(sinks, jnp.float32)[None, None, :])
        out = (out.astype(jnp.float32) * share[..., None]).astype(q.dtype)
    if hv < q.shape[-1]:
        out = out[..., :hv]
    if query_valid is not None:  # a select, not a product: 0 * inf would be NaN
        out = jnp.where(query_valid[:, :, None, None], out, jnp.zeros((), out.dtype))
    return out


class Attention(nnx.Module):
    """Causal multi-head self-attention with RoPE on a chosen core path.

    Args:
      d_model: model width.
      num_heads: query heads H.
      rope_theta: the RoPE base (used when ``rope`` is None).
      path: attribute path, e.g. ``blocks/0/attn``.
      rules: per-module precision rules.
      rngs: NNX rngs.
      init_std: normal init std of ``wq``, ``wk``, ``wv``.
      out_std: normal init std of ``wo`` (scaled down for a residual branch, GPT-2).
      implementation: one of :data:`ATTENTION_IMPLEMENTATIONS`, resolved here with
        this module's compute dtype for ``target`` (:func:`resolve_attention`); the
        result is ``self.implementation``.
      target: the compile target (:class:`jaxmp.target.Target`) the choice is made for;
        None = :func:`jaxmp.target.current`.
      recompute_core: run the attention core under ``jax.checkpoint`` with nothing
        saveable (``model.remat="attention"``: selective activation recomputation,
        Korthikanti et al. 2022, section 4.2): the backward pass keeps q, k, v and
        recomputes the scores, softmax and context instead of keeping them.
      num_kv_heads: key/value heads K dividing H (grouped-query attention); 0 = H.
      head_dim: per-head width, even; 0 = ``d_model / H``.
      qk_norm: per-head RMSNorm of q and k before RoPE (Qwen3), modules
        ``{path}/q_norm`` and ``{path}/k_norm`` (float32 islands by the ``norm`` pattern).
      qkv_bias: biases on the q, k, v projections (Qwen2).
      o_bias: a bias on the output projection (Llama's ``attention_bias``).
      norm_eps: epsilon of the q/k norms.
      rope: a :class:`~jaxmp.models.layers.Rope`; None = plain RoPE of base ``rope_theta``.
      window: a sliding window in tokens (:func:`attention_core`); 0 = full attention.
      scale: the scores' scale; None = ``head_dim ** -0.5`` (Gemma:
        ``query_pre_attn_scalar ** -0.5``).
      norm_plus_one: the q/k norms' gain is ``1 + scale``
        (:class:`~jaxmp.models.layers.RMSNorm`; Gemma).
      sinks: a learned sink logit per query head in the softmax denominator (GPT-OSS;
        :func:`attention_core`), used in float32.
      output_gate: the q projection also gives a gate per head and dimension, and the
        core's output is multiplied by its sigmoid before the output projection
        (Qwen3-Next's gated attention: ``q_proj`` ``[H * 2 h, d]``, query and gate
        halves per head).

    Parameters: ``wq`` [d_model, H, head_dim] (``[d_model, H, 2 head_dim]`` with
    ``output_gate``: query then gate per head), ``wk``, ``wv`` [d_model, K, head_dim]
    (``embed``, ``heads``, ``head_dim``), ``wo`` [H, head_dim, d_model] (``heads``,
    ``head_dim``, ``embed``); with ``qkv_bias`` ``bq`` [H, head_dim], ``bk``, ``bv``
    [K, head_dim] (``heads``, ``head_dim``); with ``o_bias`` ``bo`` [d_model] (``embed``);
    with ``sinks`` ``sinks`` [H] (``heads``, normal init of ``init_std`` as transformers').

    Raises:
      ValueError: from :func:`resolve_attention` (e.g. ``"cudnn"`` off a GPU).
    """

    def __init__(self, d_model: int, num_heads: int, rope_theta: float = 10000.0, *, path: str,
                 rules: PolicyRules, rngs: nnx.Rngs, init_std: float = 0.02, out_std: float = 0.02,
                 implementation: str = "reference", recompute_core: bool = False,
                 num_kv_heads: int = 0, head_dim: int = 0, qk_norm: bool = False,
                 qkv_bias: bool = False, o_bias: bool = False, norm_eps: float = 1e-6,
                 rope: Optional[Rope] = None,
                 target: Optional[target.Target] = None, window: int = 0,
                 scale: Optional[float] = None, norm_plus_one: bool = False,
                 sinks: bool = False, output_gate: bool = False):
        self.path = path
        self.window = int(window)
        self.scale = scale
        self.policy: Policy = rules.resolve(path)
        self.rope_theta = rope_theta
        self.rope = rope
        d, h = d_model, num_heads
        k = head_dim or d // h
        kv = num_kv_heads or h
        self.implementation = resolve_attention(implementation, self.policy.compute_dtype, k,
                                                target)
        self.recompute_core = bool(recompute_core)
        dt = self.policy.param_dtype
        self.output_gate = bool(output_gate)
        for name, heads in (("wq", h), ("wk", kv), ("wv", kv)):
            width = 2 * k if name == "wq" and output_gate else k
            setattr(self, name, make_param(rngs, nnx.initializers.normal(init_std),
                                           (d, heads, width), dt, ("embed", "heads", "head_dim")))
        self.wo = make_param(rngs, nnx.initializers.normal(out_std), (h, k, d), dt,
                             ("heads", "head_dim", "embed"))
        add_fp8_states(self, ("wq", "wk", "wv", "wo"))
        if qkv_bias:
            for name, heads in (("bq", h), ("bk", kv), ("bv", kv)):
                width = 2 * k if name == "bq" and output_gate else k
                setattr(self, name, make_param(rngs, nnx.initializers.zeros, (heads, width), dt,
                                               ("heads", "head_dim")))
        if o_bias:
            self.bo = make_param(rngs, nnx.initializers.zeros, (d,), dt, ("embed",))
        if sinks:
            self.sinks = make_param(rngs, nnx.initializers.normal(init_std), (h,), dt,
                                    ("heads",))
        if qk_norm:
            self.q_norm = RMSNorm(k, norm_eps, path=f"{path}/q_norm", rules=rules, rngs=rngs,
                                  axis="head_dim", plus_one=norm_plus_one)
            self.k_norm = RMSNorm(k, norm_eps, path=f"{path}/k_norm", rules=rules, rngs=rngs,
                                  axis="head_dim", plus_one=norm_plus_one)

    def _project(self, x, name, operands):
        """The ``name`` projection, biased and normed; for ``q`` with ``output_gate``
        ``(q, gate)``."""
        p = self.policy
        y = matmul(self, x, f"w{name}", "btd,dhk->bthk", operands=operands)
        if hasattr(self, f"b{name}"):
            y = y + p.cast_to_compute(getattr(self, f"b{name}")[...])
        if name == "q" and self.output_gate:
            y, gate = jnp.split(y, 2, axis=-1)
            return self._norm(y, name), gate
        return self._norm(y, name)

    def _norm(self, y, name):
        p = self.policy
        if hasattr(self, f"{name}_norm"):  # Qwen3: per-head RMSNorm before RoPE
            y = p.cast_to_compute(getattr(self, f"{name}_norm")(y))
        return y

    def __call__(self, x: jax.Array, lengths: Optional[jax.Array] = None, *,
                 segment_ids: Optional[jax.Array] = None, positions: Optional[jax.Array] = None,
                 operands: Optional[dict] = None) -> jax.Array:
        """[B, T, d_model] -> [B, T, d_model] in ``policy.output_dtype``.

        ``lengths``: optional int [B] non-padding tokens per sequence, ``segment_ids``:
        optional int [B, T] documents of packed rows (see :func:`attention_core`).
        ``positions``: int [T] or [B, T], the RoPE positions (default ``0 .. T-1``).
        ``operands``: a dict the weight matmuls record their operands in
        (:func:`~jaxmp.models.layers.matmul`), or None.
        """
        p = self.policy
        x = p.cast_to_compute(x)
        positions = jnp.arange(x.shape[1]) if positions is None else positions
        # Weights go to the compute dtype inside ops.cast_matmul (recast, not saved, for
        # backward), or to FP8 by the policy's recipe (layers.matmul).
        q = self._project(x, "q", operands)
        q, gate = q if self.output_gate else (q, None)
        q = apply_rope(q, positions, self.rope_theta, self.rope)
        k = apply_rope(self._project(x, "k", operands), positions, self.rope_theta, self.rope)
        v = self._project(x, "v", operands)
        core = functools.partial(attention_core, implementation=self.implementation,
                                 window=self.window, scale=self.scale)
        if self.recompute_core:
            core = jax.checkpoint(core, policy=jax.checkpoint_policies.nothing_saveable)
        sinks = self.sinks[...].astype(jnp.float32) if hasattr(self, "sinks") else None
        out = core(q, k, v, lengths=lengths, segment_ids=segment_ids, sinks=sinks)
        if gate is not None:  # Qwen3-Next: the output gated per head and dimension
            out = out * jax.nn.sigmoid(gate)
        y = matmul(self, out, "wo", "bthk,hkd->btd", operands=operands)
        if hasattr(self, "bo"):
            y = y + p.cast_to_compute(self.bo[...])
        return p.cast_to_output(y)


class MLAttention(nnx.Module):
    """Multi-head Latent Attention (DeepSeek-V2 report, arXiv:2405.04434, section 2.1).

    ``q = W_qb RMSNorm(W_qa x)`` (or ``W_q x`` without ``q_lora_rank``), split per head
    into ``qk_nope_head_dim`` plain and ``qk_rope_head_dim`` rotated dimensions;
    ``[c_kv, k_rope] = W_kva x``, ``[k_nope, v] = W_kvb RMSNorm(c_kv)`` per head, and the
    one rotated key ``k_rope`` is shared by all heads. Scores are scaled by
    ``(qk_nope + qk_rope)^-1/2``, times ``yarn_mscale(factor, mscale_all_dim)^2`` under
    yarn scaling (as transformers' ``DeepseekV3Attention``). The latent norms' epsilon is
    1e-6 (transformers' ``DeepseekV3RMSNorm`` default, whatever ``rms_norm_eps`` says).

    Module paths: the module's own (projections), ``{path}/q_a_norm`` and
    ``{path}/kv_a_norm`` (RMSNorms; float32 islands by the ``norm`` pattern).

    Parameters: ``wq`` [d, H, nope + rope] or ``wq_a`` [d, q_lora] and ``wq_b``
    [q_lora, H, nope + rope]; ``wkv_a`` [d, kv_lora + rope]; ``wkv_b`` [kv_lora, H,
    nope + v]; ``wo`` [H, v, d]. Logical axes ``embed``, ``heads``, ``head_dim``; the
    latent widths are not split (None).
    """

    def __init__(self, d_model: int, num_heads: int, *, q_lora_rank: int, kv_lora_rank: int,
                 qk_nope_head_dim: int, qk_rope_head_dim: int, v_head_dim: int, rope: Rope,
                 path: str, rules: PolicyRules, rngs: nnx.Rngs, init_std: float = 0.02,
                 out_std: float = 0.02, implementation: str = "reference",
                 recompute_core: bool = False, target: Optional[target.Target] = None):
        self.path = path
        self.policy: Policy = rules.resolve(path)
        self.rope = rope
        d, h = d_model, num_heads
        self.nope, self.rope_dim, self.v_dim = qk_nope_head_dim, qk_rope_head_dim, v_head_dim
        self.kv_lora_rank = kv_lora_rank
        qk = qk_nope_head_dim + qk_rope_head_dim
        self.implementation = resolve_attention(implementation, self.policy.compute_dtype, qk,
                                                target)
        self.recompute_core = bool(recompute_core)
        self.scale = qk ** -0.5
        if rope.scaling == "yarn" and rope.mscale_all_dim:
            self.scale *= yarn_mscale(rope.factor, rope.mscale_all_dim) ** 2
        dt = self.policy.param_dtype
        normal = nnx.initializers.normal(init_std)
        names = []
        if q_lora_rank:
            self.wq_a = make_param(rngs, normal, (d, q_lora_rank), dt, ("embed", None))
            self.q_a_norm = RMSNorm(q_lora_rank, 1e-6, path=f"{path}/q_a_norm", rules=rules,
                                    rngs=rngs, axis=None)
            self.wq_b = make_param(rngs, normal, (q_lora_rank, h, qk), dt,
                                   (None, "heads", "head_dim"))
            names += ["wq_a", "wq_b"]
        else:
            self.wq = make_param(rngs, normal, (d, h, qk), dt, ("embed", "heads", "head_dim"))
            names.append("wq")
        self.wkv_a = make_param(rngs, normal, (d, kv_lora_rank + qk_rope_head_dim), dt,
                                ("embed", None))
        self.kv_a_norm = RMSNorm(kv_lora_rank, 1e-6, path=f"{path}/kv_a_norm", rules=rules,
                                 rngs=rngs, axis=None)
        self.wkv_b = make_param(rngs, normal, (kv_lora_rank, h, qk_nope_head_dim + v_head_dim),
                                dt, (None, "heads", "head_dim"))
        self.wo = make_param(rngs, nnx.initializers.normal(out_std), (h, v_head_dim, d), dt,
                             ("heads", "head_dim", "embed"))
        add_fp8_states(self, tuple(names) + ("wkv_a", "wkv_b", "wo"))

    def __call__(self, x: jax.Array, lengths: Optional[jax.Array] = None, *,
                 segment_ids: Optional[jax.Array] = None, positions: Optional[jax.Array] = None,
                 operands: Optional[dict] = None) -> jax.Array:
        """[B, T, d_model] -> [B, T, d_model] in ``policy.output_dtype``; the arguments
        as :meth:`Attention.__call__`'s."""
        p = self.policy
        x = p.cast_to_compute(x)
        positions = jnp.arange(x.shape[1]) if positions is None else positions
        if hasattr(self, "wq"):
            q = matmul(self, x, "wq", "btd,dhk->bthk", operands=operands)
        else:
            c = p.cast_to_compute(self.q_a_norm(matmul(self, x, "wq_a", "btd,dr->btr",
                                                       operands=operands)))
            q = matmul(self, c, "wq_b", "btr,rhk->bthk", operands=operands)
        q_rot = apply_rope(q[..., self.nope:], positions, rope=self.rope)
        q = jnp.concatenate([q[..., :self.nope], q_rot], axis=-1)
        kv_a = matmul(self, x, "wkv_a", "btd,dr->btr", operands=operands)
        c_kv = p.cast_to_compute(self.kv_a_norm(kv_a[..., :self.kv_lora_rank]))
        k_rot = apply_rope(kv_a[..., None, self.kv_lora_rank:], positions, rope=self.rope)
        kv = matmul(self, c_kv, "wkv_b", "btr,rhk->bthk", operands=operands)
        k_nope, v = kv[..., :self.nope], kv[..., self.nope:]
        k = jnp.concatenate([k_nope, jnp.broadcast_to(k_rot, k_nope.shape[:3] + k_rot.shape[3:])],
                            axis=-1)
        core = functools.partial(attention_core, implementation=self.implementation,
                                 scale=self.scale)
        if self.recompute_core:
            core = jax.checkpoint(core, policy=jax.checkpoint_policies.nothing_saveable)
        out = core(q, k, v, lengths=lengths, segment_ids=segment_ids)
        return p.cast_to_output(matmul(self, out, "wo", "bthk,hkd->btd", operands=operands))
