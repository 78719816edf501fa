"""Gated DeltaNet linear attention (Qwen3-Next's ``linear_attention`` layers).

The gated delta rule (Yang, Kautz and Hatamizadeh 2024, "Gated Delta Networks", eq. 10)
keeps a ``[d_k, d_v]`` state per head instead of the keys and values of every earlier
token: at token ``t``, with decay ``a_t = exp(g_t)`` and write strength ``beta_t``,

    S_t = a_t S_{t-1} + beta_t k_t (v_t - a_t S_{t-1}^T k_t)^T,    o_t = S_t^T q_t.

:func:`gated_delta_rule` computes it chunk by chunk (the WY / UT form of DeltaNet, Yang et
al. 2024, section 3; transformers' ``torch_chunk_gated_delta_rule``, FLA's
``chunk_gated_delta_rule``): within a chunk of ``chunk_size`` tokens the updates are one
triangular solve (:func:`unit_lower_solve`) and a few matmuls, and a ``jax.lax.scan``
carries the state across chunks. Everything runs in float32, as transformers' and FLA's reference forms do. There is
no Pallas kernel yet: on a GPU this is XLA's chunked form (see the README's feature table).

Documents packed in a row (``segment_ids``) do not see each other: a token reads the state
only of its own document, and the causal convolution of :class:`GatedDeltaNet` does not
reach across a boundary.
"""
from __future__ import annotations

from typing import Optional

import jax
import jax.numpy as jnp
from flax import nnx

from jaxmp import target as compile_target
from jaxmp.models.attention import query_valid
from jaxmp.models.layers import add_fp8_states, make_param, matmul
from jaxmp.precision.policy import Policy, PolicyRules

__all__ = ["gated_delta_rule", "unit_lower_solve", "causal_conv", "GatedDeltaNet",
           "LINEAR_PROJECTIONS"]

# How a Gated DeltaNet layer's input projections are laid out (GatedDeltaNet's
# ``projections``): Qwen3-Next's, grouped per key head, or Qwen3.5's, apart.
LINEAR_PROJECTIONS = ("grouped", "split")


def gated_delta_rule(q: jax.Array, k: jax.Array, v: jax.Array, g: jax.Array, beta: jax.Array,
                     segment_ids: Optional[jax.Array] = None,
                     chunk_size: int = 64) -> jax.Array:
    """The gated delta rule over a sequence, chunked; float32.

    Args:
      q, k: ``[B, T, H, d_k]`` queries (scaled as the caller wants) and keys (L2-normalized
        for a stable rule).
      v: ``[B, T, H, d_v]``.
      g: ``[B, T, H]``, the log decay of each token (``<= 0``).
      beta: ``[B, T, H]``, each token's write strength (in ``[0, 1]``).
      segment_ids: optional int ``[B, T]``: a token reads and writes the state of its own
        segment only (the state starts at 0 with each segment).
      chunk_size: tokens per chunk (transformers' and FLA's 64).

    Returns:
      ``o [B, T, H, d_v]`` float32.

    Raises:
      ValueError: shapes that do not fit.
    """
    b, t, h, dk = q.shape
    dv = v.shape[-1]
    if k.shape != q.shape or v.shape[:3] != (b, t, h) or g.shape != (b, t, h) or \
            beta.shape != (b, t, h):
        raise ValueError(f"q, k [B, T, H, d_k], v [B, T, H, d_v], g, beta [B, T, H] expected; "
                         f"got {q.shape}, {k.shape}, {v.shape}, {g.shape}, {beta.shape}")
    c = int(chunk_size)
    pad = (-t) % c
    n = (t + pad) // c
    seg = (jnp.zeros((b, t), jnp.int32) if segment_ids is None
           else jnp.asarray(segment_ids, jnp.int32))
    # padding positions get a segment of their own (-1): they touch no real token
    seg = jnp.pad(seg, ((0, 0), (0, pad)), constant_values=-1)

    def chunks(x):  # [B, T, H, ...] -> [B, H, N, C, ...] float32
        x = jnp.pad(x.astype(jnp.float32), ((0, 0), (0, pad)) + ((0, 0),) * (x.ndim - 2))
        x = x.reshape((b, n, c, h) + x.shape[3:])
        return jnp.moveaxis(x, 3, 1)

    q, k, v, g, beta = (chunks(x) for x in (q, k, v, g, beta))
    seg = seg.reshape(b, 1, n, c)
    prev = jnp.concatenate([jnp.full((b, 1, 1, 1), -2, jnp.int32), seg[:, :, :-1, -1:]], 2)
    same = seg[..., :, None] == seg[..., None, :]  # [B, 1, N, C, C]
    reads = (seg == prev).astype(jnp.float32)  # token reads the state carried in
    writes = (seg == seg[..., -1:]).astype(jnp.float32)  # its write reaches the chunk's end
    carry = (seg[..., -1] == prev[..., 0]).astype(jnp.float32)  # the chunk is one segment

    cum = jnp.cumsum(g, axis=-1)  # [B, H, N, C]: log decay from the chunk's start
    lower = jnp.tril(jnp.ones((c, c), bool))
    pair = jnp.where(lower & same, jnp.exp(jnp.where(lower, cum[..., :, None] - cum[..., None, :],
                                                     0.0)), 0.0)
    k_beta, v_beta = k * beta[..., None], v * beta[..., None]
    # I + L, L its strict lower part: the solve reads neither the diagonal nor above it
    system = jnp.einsum("...ik,...jk->...ij", k_beta, k) * pair
    substitution = compile_target.current().platform == "cpu"

    def solve(a, x):  # (I + L)^-1 x: the UT transform of the chunk's delta updates
        return unit_lower_solve(a, x, substitution)

    new_values = solve(system, v_beta)
    k_decayed = solve(system, k_beta * (jnp.exp(cum) * reads)[..., None])
    intra = jnp.einsum("...ik,...jk->...ij", q, k) * pair
    q_decayed = q * (jnp.exp(cum) * reads)[..., None]
    k_to_end = k * (jnp.exp(cum[..., -1:] - cum) * writes)[..., None]
    chunk_decay = jnp.exp(cum[..., -1]) * carry  # [B, H, N]

    def step(state, xs):
        nv, kd, qd, it, ke, cd = xs
        v_new = nv - kd @ state
        out = qd @ state + it @ v_new
        state = state * cd[..., None, None] + jnp.swapaxes(ke, -1, -2) @ v_new
        return state, out

    per_chunk = [jnp.moveaxis(x, 2, 0) for x in (new_values, k_decayed, q_decayed, intra,
                                                 k_to_end, chunk_decay)]
    # zeros like the inputs (inside shard_map they carry the inputs' varying mesh axes)
    state = jnp.zeros_like(new_values, shape=(b, h, dk, dv))
    _, out = jax.lax.scan(step, state, per_chunk)
    out = jnp.moveaxis(out, 0, 2).reshape(b, h, n * c, dv)[:, :, :t]
    return jnp.moveaxis(out, 1, 2)


def unit_lower_solve(a: jax.Array, x: jax.Array, substitution: bool) -> jax.Array:
    """``A^-1 x`` for unit lower-triangular ``a [..., C, C]`` (its diagonal and upper part
    not read), ``x [..., C, n]``.

    ``substitution=False``: ``jax.scipy.linalg.solve_triangular`` (cuBLAS's triangular
    solve on GPUs). ``True``: forward substitution row by row in a ``fori_loop``
    (transformers' own loop for its export path), for the CPU: XLA:CPU's LAPACK ``trsm``
    call waits on the host thread pool, which the other devices' programs hold when a
    mesh has as many devices as cores, and never returns (2 simulated devices on 2 cores).
    """
    if not substitution:
        return jax.scipy.linalg.solve_triangular(a, x, lower=True, unit_diagonal=True)
    c = a.shape[-1]
    lower = jnp.where(jnp.tril(jnp.ones((c, c), bool), -1), a, 0.0)

    def row(i, y):  # y_i = x_i - sum_{j < i} a_ij y_j (rows >= i of ``lower`` are 0 there)
        ai = jax.lax.dynamic_index_in_dim(lower, i, axis=-2, keepdims=False)
        xi = jax.lax.dynamic_index_in_dim(x, i, axis=-2, keepdims=False)
        yi = xi - jnp.einsum("...j,...jn->...n", ai, y)
        return jax.lax.dynamic_update_index_in_dim(y, yi, i, axis=-2)

    return jax.lax.fori_loop(1, c, row, x)


def causal_conv(x: jax.Array, w: jax.Array,
                segment_ids: Optional[jax.Array] = None) -> jax.Array:
    """Depthwise causal convolution: ``y[t, c] = sum_j w[c, j] x[t - K + 1 + j, c]``
    (``torch.nn.Conv1d(groups=C, padding=K - 1)`` cut to ``T``), in ``x``'s dtype.

    Args:
      x: ``[B, T, C]``. w: ``[C, K]``.
      segment_ids: optional int ``[B, T]``: no term crosses a segment boundary.
    """
    kernel = w.shape[-1]
    t = x.shape[1]
    y = jnp.zeros_like(x)
    for shift in range(kernel):  # x[t - shift] times w[:, K - 1 - shift]
        xs = jnp.pad(x, ((0, 0), (shift, 0), (0, 0)))[:, :t]
        if segment_ids is not None and shift:
            seg = jnp.asarray(segment_ids)
            same = jnp.pad(seg, ((0, 0), (shift, 0)), constant_values=-1)[:, :t] == seg
            xs = jnp.where(same[..., None], xs, jnp.zeros((), x.dtype))
        y = y + xs * w[:, kernel - 1 - shift].astype(x.dtype)
    return y


class GatedDeltaNet(nnx.Module):
    """Qwen3-Next's linear-attention layer: projections, a short causal convolution, the
    gated delta rule and a gated RMSNorm (transformers' ``Qwen3NextGatedDeltaNet``).

    ``[q, k, v, z] = x W_qkvz`` per key head, ``[b, a] = x W_ba``; ``q, k, v`` go through
    the depthwise causal convolution (kernel ``conv_kernel``) and SiLU; ``beta =
    sigmoid(b)``, ``g = -exp(A_log) softplus(a + dt_bias)``; q and k are L2-normalized
    (epsilon 1e-6, as FLA), q scaled by ``d_k ** -0.5``, and each key head serves
    ``num_value_heads / num_key_heads`` value heads; ``o = gated_delta_rule(...)``,
    then ``RMSNorm(o) * silu(z)`` per value head (float32, plain gain, epsilon
    ``norm_eps``) and the output projection.

    Args:
      d_model: model width.
      num_key_heads, num_value_heads: heads of q/k and of v (the second a multiple of the
        first).
      key_head_dim, value_head_dim: their widths.
      conv_kernel: the convolution's width in tokens.
      path, rules, rngs, init_std, out_std: as :class:`~jaxmp.models.attention.Attention`'s.
      norm_eps: the gated norm's epsilon.
      projections: one of :data:`LINEAR_PROJECTIONS`: ``"grouped"``, Qwen3-Next's
        ``in_proj_qkvz`` and ``in_proj_ba`` (q, k, v, z and b, a grouped per key head), or
        ``"split"``, Qwen3.5's ``in_proj_qkv`` (all q, then all k, then all v),
        ``in_proj_z``, ``in_proj_b`` and ``in_proj_a``: the same layer, its weights laid
        out otherwise.

    Parameters, ``grouped``: ``wqkvz`` [d_model, Hk, 2 d_k + 2 r d_v] and ``wba``
    [d_model, Hk, 2 r] (``r = Hv / Hk``; ``embed``, ``heads``, None); ``split``: ``wqkv``
    [d_model, 2 Hk d_k + Hv d_v] (``embed``, None), ``wz`` [d_model, Hv, d_v] (``embed``,
    ``heads``, ``head_dim``), ``wb``, ``wa`` [d_model, Hv] (``embed``, ``heads``); both:
    ``conv`` [2 Hk d_k + Hv d_v, 1, K]
    (depthwise, no axes), ``dt_bias``, ``A_log`` [Hv] (``heads``), ``norm_scale`` [d_v],
    ``wo`` [Hv, d_v, d_model] (``heads``, ``head_dim``, ``embed``).
    """

    def __init__(self, d_model: int, num_key_heads: int, num_value_heads: int,
                 key_head_dim: int, value_head_dim: int, conv_kernel: int, *, path: str,
                 rules: PolicyRules, rngs: nnx.Rngs, init_std: float = 0.02,
                 out_std: float = 0.02, norm_eps: float = 1e-6,
                 projections: str = "grouped"):
        if projections not in LINEAR_PROJECTIONS:
            raise ValueError(f"projections={projections!r}; allowed: "
                             f"{', '.join(LINEAR_PROJECTIONS)}")
        if num_value_heads % num_key_heads:
            raise ValueError(f"num_value_heads={num_value_heads} must be a multiple of "
                             f"num_key_heads={num_key_heads}")
        self.path = path
        self.policy: Policy = rules.resolve(path)
        self.hk, self.hv, self.dk, self.dv = num_key_heads, num_value_heads, key_head_dim, \
            value_head_dim
        self.norm_eps = float(norm_eps)
        r = num_value_heads // num_key_heads
        dt = self.policy.param_dtype
        normal = nnx.initializers.normal(init_std)
        self.projections = projections
        channels = 2 * num_key_heads * key_head_dim + num_value_heads * value_head_dim
        if projections == "grouped":
            self.wqkvz = make_param(rngs, normal, (d_model, num_key_heads,
                                                   2 * key_head_dim + 2 * r * value_head_dim),
                                    dt, ("embed", "heads", None))
            self.wba = make_param(rngs, normal, (d_model, num_key_heads, 2 * r), dt,
                                  ("embed", "heads", None))
            names = ("wqkvz", "wba", "wo")
        else:
            self.wqkv = make_param(rngs, normal, (d_model, channels), dt, ("embed", None))
            self.wz = make_param(rngs, normal, (d_model, num_value_heads, value_head_dim), dt,
                                 ("embed", "heads", "head_dim"))
            self.wb = make_param(rngs, normal, (d_model, num_value_heads), dt,
                                 ("embed", "heads"))
            self.wa = make_param(rngs, normal, (d_model, num_value_heads), dt,
                                 ("embed", "heads"))
            names = ("wqkv", "wz", "wb", "wa", "wo")
        self.conv = make_param(rngs, normal, (channels, 1, conv_kernel), dt, (None, None, None))
        self.dt_bias = make_param(rngs, nnx.initializers.ones, (num_value_heads,), dt,
                                  ("heads",))
        # A_log ~ U(0, log 16): A in (1, 16) (transformers draws A ~ U(0.01, 16))
        self.A_log = make_param(rngs, nnx.initializers.uniform(jnp.log(16.0)),
                                (num_value_heads,), dt, ("heads",))
        self.norm_scale = make_param(rngs, nnx.initializers.ones, (value_head_dim,), dt,
                                     (None,))
        self.wo = make_param(rngs, nnx.initializers.normal(out_std),
                             (num_value_heads, value_head_dim, d_model), dt,
                             ("heads", "head_dim", "embed"))
        add_fp8_states(self, names)

    def __call__(self, x: jax.Array, lengths: Optional[jax.Array] = None, *,
                 segment_ids: Optional[jax.Array] = None, positions: Optional[jax.Array] = None,
                 operands: Optional[dict] = None) -> jax.Array:
        """[B, T, d_model] -> [B, T, d_model] in ``policy.output_dtype``; the arguments as
        :meth:`~jaxmp.models.attention.Attention.__call__`'s (``positions`` unused: no
        RoPE here)."""
        del positions
        p = self.policy
        x = p.cast_to_compute(x)
        b, t, _ = x.shape
        hk, hv, dk, dv = self.hk, self.hv, self.dk, self.dv
        r = hv // hk
        if self.projections == "grouped":  # Qwen3-Next: per key head [q, k, v, z], [b, a]
            qkvz = matmul(self, x, "wqkvz", "btd,dhk->bthk", operands=operands)
            q, k, v, z = jnp.split(qkvz, [dk, 2 * dk, 2 * dk + r * dv], axis=-1)
            ba = matmul(self, x, "wba", "btd,dhk->bthk", operands=operands)
            b_logit, a = ba[..., :r].reshape(b, t, hv), ba[..., r:].reshape(b, t, hv)
            mixed = jnp.concatenate([q.reshape(b, t, -1), k.reshape(b, t, -1),
                                     v.reshape(b, t, -1)], -1)
        else:  # Qwen3.5: [all q, all k, all v], z, b, a apart
            mixed = matmul(self, x, "wqkv", "btd,dc->btc", operands=operands)
            z = matmul(self, x, "wz", "btd,dhk->bthk", operands=operands)
            b_logit = matmul(self, x, "wb", "btd,dh->bth", operands=operands)
            a = matmul(self, x, "wa", "btd,dh->bth", operands=operands)
        beta = jax.nn.sigmoid(b_logit.astype(jnp.float32))
        g = -jnp.exp(self.A_log[...].astype(jnp.float32)) * jax.nn.softplus(
            a.astype(jnp.float32) + self.dt_bias[...].astype(jnp.float32))
        mixed = jax.nn.silu(causal_conv(mixed, p.cast_to_compute(self.conv[...][:, 0]),
                                        segment_ids))
        q, k, v = jnp.split(mixed, [hk * dk, 2 * hk * dk], axis=-1)

        def l2(y):  # float32, FLA's epsilon
            y = y.astype(jnp.float32)
            return y * jax.lax.rsqrt(jnp.sum(y * y, -1, keepdims=True) + 1e-6)

        q = jnp.repeat(l2(q.reshape(b, t, hk, dk)), r, axis=2) * dk ** -0.5
        k = jnp.repeat(l2(k.reshape(b, t, hk, dk)), r, axis=2)
        o = gated_delta_rule(q, k, v.reshape(b, t, hv, dv), g, beta, segment_ids)
        valid = query_valid(t, lengths, segment_ids)
        if valid is not None:  # padding: an output row of 0, as attention's
            o = jnp.where(valid[:, :, None, None], o, 0.0)
        # gated RMSNorm per value head (transformers' Qwen3NextRMSNormGated), float32
        o = o * jax.lax.rsqrt(jnp.mean(o * o, -1, keepdims=True) + self.norm_eps)
        o = o * self.norm_scale[...].astype(jnp.float32) * jax.nn.silu(
            z.reshape(b, t, hv, dv).astype(jnp.float32))
        y = matmul(self, p.cast_to_compute(o), "wo", "bthk,hkd->btd", operands=operands)
        return p.cast_to_output(y)
