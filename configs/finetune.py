"""Fine-tune a Hugging Face checkpoint: no architecture key, the model comes from its directory.

    python train.py --config configs/finetune.py --config.model.init_from=DIR --workdir runs/ft

DIR holds ``config.json`` and ``model.safetensors`` (or shards with their index) of a family
that ``jaxmp.models.hf`` maps (llama, mistral, qwen2, qwen3, qwen3_moe, mixtral, deepseek_v2,
deepseek_v3, glm4_moe); its ``tokenizer.json`` (end-of-document id: ``tokenizer_config.json``'s
``eos_token``) is the data tokenizer unless ``data.tokenizer`` says otherwise. Every
``model.*`` key left unset here takes DIR's value; one set on the command line that
contradicts DIR's config.json is a one-line error. Mixed bfloat16 with float32 routers and
norms, a small learning rate, sequences of 512 tokens (``model.max_len`` is DIR's).
"""
import ml_collections


def get_config() -> ml_collections.ConfigDict:
    config = ml_collections.ConfigDict()
    config.seed = 0
    config.model = ml_collections.ConfigDict(dict(
        init_from="",              # set on the command line: --config.model.init_from=DIR
        attention="auto",          # cuDNN's fused kernel on a GPU, else the reference path
        scan_layers=True,          # one compiled layer per stack of layers
        remat="full",              # keep only each block's input for the backward pass
    ))
    config.precision = ml_collections.ConfigDict(dict(
        policy="mixed_bf16; router: fp32; norm: fp32", loss_scale="none"))
    config.optim = ml_collections.ConfigDict(dict(
        learning_rate=2e-5, warmup_steps=20, schedule="cosine", final_lr_fraction=0.1,
        weight_decay=0.0, grad_clip=1.0))
    config.data = ml_collections.ConfigDict(dict(path="", seq_len=512))
    config.train = ml_collections.ConfigDict(dict(
        steps=200, batch_size=8, log_every=10, eval_every=50, checkpoint_every=100))
    return config
