"""Fine-tune a Hugging Face checkpoint: no architecture key, the model comes from its directory.

    python train.py --config configs/finetune.py --config.model.init_from=DIR --workdir runs/ft

DIR holds ``config.json`` and ``model.safetensors`` (or shards with their index) of a family
that ``jaxmp.models.hf`` maps (``jaxmp.models.hf.FAMILIES``, the README's family table); its ``tokenizer.json`` (end-of-document id: ``tokenizer_config.json``'s
``eos_token``) is the data tokenizer unless ``data.tokenizer`` says otherwise. Every
``model.*`` key left unset here takes DIR's value; one set on the command line that
contradicts DIR's config.json is a one-line error. Mixed bfloat16 with float32 routers and
norms (the default policy), attention "auto" (cuDNN's fused kernel on a GPU), a small
learning rate, sequences of 512 tokens (``model.max_len`` is DIR's).
"""
import ml_collections
from ml_collections import config_dict

from jaxmp.train.config import default_config


def get_config() -> ml_collections.ConfigDict:
    config = default_config()
    # A placeholder (None): --config.model.init_from=DIR must fill it, else a one-line error.
    config.model.init_from = config_dict.placeholder(str)
    config.model.update(dict(
        scan_layers=True,          # one compiled layer per stack of layers
        remat="full",              # keep only each block's input for the backward pass
    ))
    config.optim.update(dict(learning_rate=2e-5, warmup_steps=20, weight_decay=0.0))
    config.data.seq_len = 512
    # A metric line every step: a fine-tuning step takes seconds, and the progress bar only
    # moves with the steps whose results have come back (at each logged step).
    config.train.update(dict(batch_size=8, log_every=1))
    return config
