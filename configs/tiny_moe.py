"""A tiny MoE Transformer that learns the embedded corpus on 2 CPU cores in minutes.

    python train.py --config configs/tiny_moe.py --workdir runs/tiny

Bytes of the Python standard library's source (the default corpus); mixed bfloat16
with the router and norms in float32. Try float16 with dynamic loss scaling:

    python train.py --config configs/tiny_moe.py --workdir runs/tiny_fp16 \
        --config.precision.policy="mixed_fp16; router: fp32; norm: fp32" \
        --config.precision.loss_scale=dynamic:init=2**15,growth_interval=200
"""
import ml_collections


def get_config() -> ml_collections.ConfigDict:
    config = ml_collections.ConfigDict()
    config.seed = 0

    config.model = ml_collections.ConfigDict(dict(
        vocab_size=257,            # bytes + end-of-document (jaxmp.train.tokenizer.ByteTokenizer)
        num_layers=2,
        d_model=64,
        num_heads=4,
        d_ff=256,                  # dense SwiGLU width (first_dense_layers)
        max_len=128,
        rope_theta=10000.0,
        norm_eps=1e-6,
        num_experts=4,             # routed experts
        num_shared_experts=1,      # always-on experts (DeepSeekMoE)
        top_k=2,
        d_expert=64,
        first_dense_layers=1,
        score_fn="sigmoid",        # DeepSeek-V3's router; the model maps to HF glm4_moe
        aux_loss_weight=0.01,      # alpha of the load-balancing loss
        bias_update_rate=0.001,    # gamma of auxiliary-loss-free balancing (DeepSeek-V3)
        capacity_factor=0.0,       # 0: dropless dispatch
        # reference | xla | cudnn | auto (cuDNN where it runs, else reference)
        attention="auto",
        scan_layers=False,         # True: stack the layers and run them with jax.lax.scan
        remat="none",              # none | attention | dots_saveable | full (per block)
    ))

    config.precision = ml_collections.ConfigDict(dict(
        # Per-module rules: first pattern that matches the module path wins.
        policy="mixed_bf16; router: fp32; norm: fp32",
        # bfloat16 has float32's range: no loss scale needed. Use dynamic[:...] for fp16.
        loss_scale="none",
        # Dtype of the cross-device gradient sum (jaxmp.comm, an explicit all-reduce):
        # float32 (exact), bfloat16 or float16 (half the bytes; the DeepSeek
        # mixed-precision article, section 2.3).
        grad_reduce_dtype="float32",
        # "none" or "topk": send each leaf's topk_ratio largest |g| (+ int32 indices) by
        # all-gather and keep the rest as a per-device residual (error feedback).
        grad_compression="none",
        topk_ratio=0.3,            # fraction of each leaf sent per step, in (0, 1]
    ))

    config.optim = ml_collections.ConfigDict(dict(
        learning_rate=3e-3, warmup_steps=5, schedule="cosine", final_lr_fraction=0.1,
        decay_steps=0,             # 0 = train.steps; fix it to extend a run later
        b1=0.9, b2=0.95, eps=1e-8, weight_decay=0.01, grad_clip=1.0,
        # "" keeps the moments in the master dtype; "bfloat16" as DeepSeek-V3
        mu_dtype="", nu_dtype="",
    ))

    config.data = ml_collections.ConfigDict(dict(
        path="",                   # "" = the Python standard library's .py files
        text_field="text",         # for .jsonl files
        tokenizer="bytes",         # bytes | PATH/tokenizer.json | PATH.model | bpe:VOCAB
        seq_len=64,
        eval_fraction=0.02,
        num_eval_batches=4,        # 0 = no evaluation
        max_tokens=0,              # 0 = the whole corpus
    ))

    config.train = ml_collections.ConfigDict(dict(
        steps=200,
        batch_size=16,             # global, in sequences
        grad_accum_steps=1,
        num_devices=0,             # 0 = all devices
        log_every=5,
        eval_every=50,             # and at the last step; 0 = never
        checkpoint_every=100,
        keep_checkpoints=2,
        max_consecutive_skips=100,  # stop with an error when this many steps in a row are skipped
        # An applied step "looks divergent" when its loss exceeds loss_spike_factor x the
        # running mean (or its gradient norm grad_norm_spike_factor x), is not finite, or its
        # gradient norm is 0; max_divergent_steps of them in a row stop the run (0 = a test off).
        loss_spike_factor=3.0,
        grad_norm_spike_factor=100.0,
        max_divergent_steps=10,
        sample_prompt="",          # "" = the start of the first eval document
        sample_tokens=80,
        sample_temperature=0.8,
    ))
    return config
