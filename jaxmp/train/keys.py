"""Every run-config key: its default and a one-line meaning, in one table.

:func:`jaxmp.train.config.default_config` is built from :data:`KEYS`, ``python train.py
--help`` prints it (:func:`help_text`) and ``docs/CONFIG.md`` is generated from it
(:func:`markdown`; a test checks the file is current), so the three cannot disagree.
"""
from __future__ import annotations

from typing import Any, NamedTuple, Tuple

__all__ = ["Key", "KEYS", "help_text", "markdown"]


class Key(NamedTuple):
    """One config key: dotted ``name``, ``default`` and a one-line ``meaning``."""

    name: str
    default: Any
    meaning: str


KEYS: Tuple[Key, ...] = (
    Key("seed", 0, "seed of the initialisation, the data order and the sample, in [0, 2**31 - 1)"),
    # model: jaxmp.models.ModelConfig
    Key("model.vocab_size", 257, "embedding rows; at least the tokenizer's vocabulary (257 = bytes "
                                 "+ end-of-document), a multiple of 128 suits GPUs"),
    Key("model.num_layers", 2, "Transformer blocks"),
    Key("model.d_model", 64, "model width"),
    Key("model.num_heads", 4, "attention heads (divide d_model; head_dim even)"),
    Key("model.d_ff", 256, "hidden width of the dense SwiGLU layers (first_dense_layers)"),
    Key("model.max_len", 128, "longest sequence (RoPE positions); data.seq_len <= max_len"),
    Key("model.rope_theta", 10000.0, "RoPE base frequency"),
    Key("model.norm_eps", 1e-6, "RMSNorm epsilon"),
    Key("model.num_experts", 4, "routed experts per MoE layer (0 = a dense model)"),
    Key("model.num_shared_experts", 1, "always-on experts per MoE layer (DeepSeekMoE)"),
    Key("model.top_k", 2, "routed experts per token"),
    Key("model.d_expert", 64, "hidden width of each expert"),
    Key("model.first_dense_layers", 1, "leading blocks with a dense SwiGLU instead of MoE"),
    Key("model.score_fn", "softmax", "router scores: softmax or sigmoid (DeepSeek-V3)"),
    Key("model.aux_loss_weight", 0.01, "alpha of the load-balancing loss"),
    Key("model.bias_update_rate", 0.001, "gamma of auxiliary-loss-free balancing (DeepSeek-V3)"),
    Key("model.capacity_factor", 0.0, "0 = dropless dispatch; > 0 = GShard slots per expert "
                                      "(expert parallelism needs it)"),
    Key("model.moe_kernel", "auto", "auto | ragged_dot | pallas (the Mosaic GPU grouped GEMM; "
                                    "auto: on Hopper and newer GPUs)"),
    Key("model.attention", "auto", "reference | xla | cudnn | auto (cuDNN where it runs, else "
                                   "reference)"),
    Key("model.scan_layers", False, "stack the blocks and run them with jax.lax.scan"),
    Key("model.remat", "none", "none | attention | dots_saveable | full (per block)"),
    Key("model.num_kv_heads", 0, "key/value heads (grouped-query attention; 0 = num_heads)"),
    Key("model.head_dim", 0, "width of each head (0 = d_model / num_heads)"),
    Key("model.qk_norm", False, "per-head RMSNorm of q and k before RoPE (Qwen3)"),
    Key("model.qkv_bias", False, "biases on the q, k, v projections (Qwen2)"),
    Key("model.tie_embeddings", False, "the output head is the embedding table transposed"),
    Key("model.rope_dim", 0, "rotated dimensions per head (partial rotary; 0 = all)"),
    Key("model.rope_layout", "half", "half (pairs i, i+d/2: LLaMA) | interleaved (pairs 2i, "
                                     "2i+1: DeepSeek)"),
    Key("model.rope_scaling", "none", "none | llama3 | yarn (context extension of RoPE)"),
    Key("model.rope_factor", 1.0, "llama3/yarn: context extension factor"),
    Key("model.rope_original_max_len", 0, "llama3/yarn: the context before extension"),
    Key("model.rope_low_freq_factor", 1.0, "llama3: low-frequency band edge"),
    Key("model.rope_high_freq_factor", 4.0, "llama3: high-frequency band edge"),
    Key("model.rope_beta_fast", 32.0, "yarn: ramp edge in rotations (extrapolation)"),
    Key("model.rope_beta_slow", 1.0, "yarn: ramp edge in rotations (interpolation)"),
    Key("model.rope_mscale", 0.0, "yarn: mscale of the attention factor (0 = unset)"),
    Key("model.rope_mscale_all_dim", 0.0, "yarn: mscale_all_dim (0 = unset; MLA scales "
                                          "scores by its mscale squared)"),
    Key("model.norm_topk_prob", True, "normalize the chosen experts' gates to sum to 1"),
    Key("model.routed_scaling_factor", 1.0, "multiplies the routed experts' gates "
                                            "(DeepSeek-V3: 2.5)"),
    Key("model.n_group", 1, "expert groups of group-limited routing (DeepSeek-V3)"),
    Key("model.topk_group", 1, "groups a token may route to (= n_group: routing not limited)"),
    Key("model.group_score", "top2_sum", "a group's score: top2_sum (DeepSeek-V3) | max "
                                         "(DeepSeek-V2 group_limited_greedy)"),
    Key("model.mlp_only_layers", (), "layer indices with a dense FFN (Qwen-MoE), besides "
                                     "first_dense_layers"),
    Key("model.q_lora_rank", 0, "MLA: query latent width (0 = a plain q projection)"),
    Key("model.kv_lora_rank", 0, "MLA: key/value latent width (> 0 = Multi-head Latent "
                                 "Attention, DeepSeek-V2/V3)"),
    Key("model.qk_nope_head_dim", 0, "MLA: per-head q/k width without RoPE"),
    Key("model.qk_rope_head_dim", 0, "MLA: per-head q/k width with RoPE (one key shared)"),
    Key("model.v_head_dim", 0, "MLA: per-head value width"),
    Key("model.init_from", "", "a Hugging Face checkpoint directory: its config.json is the "
                               "architecture, its weights the start ('' = random init)"),
    # precision
    Key("precision.policy", "mixed_bf16; router: fp32; norm: fp32",
        "a policy, then 'pattern: policy' rules; the first matching module path wins"),
    Key("precision.loss_scale", "none",
        "none | static:S | dynamic[:init=..,growth_interval=..,hysteresis=..,min=..] "
        "(dynamic starts at 256)"),
    Key("precision.grad_reduce_dtype", "float32", "dtype of the cross-device gradient sum: "
                                                  "float32, bfloat16 or float16"),
    Key("precision.grad_compression", "none",
        "none | topk (top-k values + indices, error feedback)"),
    Key("precision.topk_ratio", 0.3, "fraction of each leaf sent per step under topk, in (0, 1]"),
    # optim
    Key("optim.learning_rate", 3e-3, "peak learning rate"),
    Key("optim.warmup_steps", 5, "linear warm-up steps"),
    Key("optim.schedule", "cosine", "learning-rate decay after warm-up (jaxmp.train.optimizer)"),
    Key("optim.final_lr_fraction", 0.1, "final learning rate / peak, in [0, 1]"),
    Key("optim.decay_steps", 0, "steps of the schedule (0 = train.steps; fix it to extend a run)"),
    Key("optim.b1", 0.9, "Adam beta1, in [0, 1)"),
    Key("optim.b2", 0.95, "Adam beta2, in [0, 1)"),
    Key("optim.eps", 1e-8, "Adam epsilon"),
    Key("optim.weight_decay", 0.01, "decoupled weight decay (AdamW)"),
    Key("optim.grad_clip", 1.0, "global-norm clip of the unscaled gradients (0 = off)"),
    Key("optim.mu_dtype", "", "Adam first moment dtype ('' = master dtype; bfloat16 "
                              "as DeepSeek-V3)"),
    Key("optim.nu_dtype", "", "Adam second moment dtype ('' = master dtype)"),
    Key("optim.update_rounding", "nearest", "nearest | stochastic | kahan: how updates reach "
                                            "bfloat16/float16 params (e.g. pure_bf16)"),
    # data
    Key("data.path", "", "'' = the Python standard library's .py files; a directory, a glob, "
                         ".jsonl files, or .bin/.npy token shards"),
    Key("data.text_field", "text", "the field holding the text in .jsonl files"),
    Key("data.tokenizer", "bytes", "bytes | PATH/tokenizer.json | PATH.model (SentencePiece) | "
                                   "bpe:VOCAB (trained on the train split, kept in the workdir)"),
    Key("data.token_dtype", "uint16", "dtype of .bin token shards: uint16 or uint32"),
    Key("data.eod_id", -1, "end-of-document token id (-1 = the tokenizer's own)"),
    Key("data.seq_len", 64, "tokens per training sequence"),
    Key("data.eval_fraction", 0.02, "share of documents (of shard tokens) held out for eval, "
                                    "in [0, 1)"),
    Key("data.num_eval_batches", 4, "batches per evaluation (0 = no evaluation)"),
    Key("data.max_tokens", 0, "cap on each split's tokens (0 = the whole corpus)"),
    # train
    Key("train.steps", 200, "optimizer steps in all"),
    Key("train.batch_size", 16, "global batch, in sequences"),
    Key("train.grad_accum_steps", 1, "micro-batches per step"),
    Key("train.num_devices", 0, "devices of the mesh (0 = all local devices)"),
    Key("train.log_every", 5, "steps between metric lines"),
    Key("train.eval_every", 50, "steps between evaluations, and at the last step (0 = never)"),
    Key("train.checkpoint_every", 100, "steps between checkpoints, and at the last step"),
    Key("train.keep_checkpoints", 2, "newest checkpoints kept (besides the last healthy one "
        "and the one of the lowest eval loss)"),
    Key("train.max_consecutive_skips", 100, "stop when this many steps in a row were skipped"),
    Key("train.loss_spike_factor", 3.0, "a loss above this x its running mean looks divergent "
                                        "(0 = off)"),
    Key("train.grad_norm_spike_factor", 100.0, "a gradient norm above this x its running mean "
                                               "looks divergent (0 = off)"),
    Key("train.max_divergent_steps", 10, "stop after this many divergent-looking steps in a row"),
    Key("train.sample_prompt", "", "prompt of the final sample ('' = the start of the first eval "
                                   "document)"),
    Key("train.sample_tokens", 80, "tokens of the final sample (0 = none)"),
    Key("train.sample_temperature", 0.8, "sampling temperature (0 = greedy)"),
    # parallel
    Key("parallel.strategy", "dp", "dp | zero1 | fsdp (how the state is split over 'data')"),
    Key("parallel.expert", 1, "devices along 'expert' (expert parallelism; needs "
                              "capacity_factor > 0)"),
    Key("parallel.dispatch_dtype", "compute",
        "compute | e4m3: dtype of the expert-parallel all-to-all"),
)


def help_text() -> str:
    """Every key as ``--config.KEY=DEFAULT  meaning``, one line each, by section."""
    width = max(len(f"--config.{k.name}={k.default!r}") for k in KEYS)
    lines, section = [], None
    for k in KEYS:
        top = k.name.split(".")[0] if "." in k.name else ""
        if top != section:
            section = top
            lines.append(f"{section or 'top level'}:")
        lines.append(f"  {f'--config.{k.name}={k.default!r}':<{width}}  {k.meaning}")
    return "\n".join(lines)


def markdown() -> str:
    """``docs/CONFIG.md``: the table as Markdown."""
    rows = ["# Run-config keys", "",
            "Generated from `jaxmp.train.keys.KEYS` (`python -m jaxmp.train.keys > "
            "docs/CONFIG.md`);",
            "`python train.py --help` prints the same table.", "",
            "| key | default | meaning |", "| --- | --- | --- |"]
    for k in KEYS:
        meaning = k.meaning.replace("|", "\\|")
        rows.append(f"| `{k.name}` | `{k.default!r}` | {meaning} |")
    return "\n".join(rows) + "\n"


if __name__ == "__main__":
    print(markdown(), end="")
