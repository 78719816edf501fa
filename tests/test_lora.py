"""Low-rank adapters over a frozen base (issue 42, points 2, 3 and 5): trained from
train.py's path on a released family's checkpoint, exported as a PEFT adapter that
``peft`` loads with the same logits, merged into an hf export that transformers loads, the
frozen base bitwise unchanged, checkpoints that refuse another base."""
from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from jaxmp.models import Lora, apply_lora, MoETransformer
from jaxmp.models.lora import FrozenParam, TRAINABLE, lora_product, merged_weight
from jaxmp.precision import ops
from jaxmp.train.config import load_config

from test_hf import _char_tokenizer, _hf_config, _hf_logits, _rel_err

TOKENS = np.random.RandomState(7).randint(0, 100, (2, 20))


@pytest.mark.parametrize("spec,w_shape,n_in", [
    (None, (6, 5), 1), ("btd,dhk->bthk", (6, 3, 4), 1), ("bthk,hkd->btd", (3, 4, 6), 2),
    ("btd,dr->btr", (6, 5), 1)])
def test_the_adapter_product_is_x_times_a_times_b_in_float64(spec, w_shape, n_in):
    """``scale (x A) B`` for each product spec a projection uses, against NumPy float64 of
    the same product with the weight's contracted dimensions flattened."""
    rng = np.random.RandomState(0)
    r, scale = 3, 0.75
    x_shape = (2, 4) + w_shape[:n_in]
    x = rng.randn(*x_shape).astype(np.float32)
    a = rng.randn(*w_shape[:n_in], r).astype(np.float32)
    b = rng.randn(r, *w_shape[n_in:]).astype(np.float32)
    got = np.asarray(lora_product(jnp.asarray(x), jnp.asarray(a), jnp.asarray(b), scale, spec,
                                  ops.cast_matmul))
    x2 = x.astype(np.float64).reshape(2, 4, -1)
    want = scale * (x2 @ a.reshape(-1, r)) @ b.reshape(r, -1)
    np.testing.assert_allclose(got.reshape(2, 4, -1), want, rtol=1e-5, atol=1e-5)
    # the merged weight gives the same product
    w = rng.randn(*w_shape).astype(np.float32)
    merged = merged_weight(w, a, b, scale).reshape(-1, int(np.prod(w_shape[n_in:])))
    np.testing.assert_allclose(x2 @ merged - x2 @ w.reshape(merged.shape).astype(np.float64),
                               want, rtol=1e-4, atol=1e-4)


def _tiny(scan=False, **over):
    from jaxmp.train.config import validate_config
    import dataclasses
    cfg = load_config("configs/tiny_moe.py", ["model.bias_update_rate=0.0", "lora.rank=4"])
    s = validate_config(cfg, 1)
    return dataclasses.replace(s.model, scan_layers=scan, **over), s.rules


@pytest.mark.parametrize("scan", [False, True])
def test_apply_lora_adapts_the_targets_freezes_the_rest_and_starts_as_the_base(scan):
    config, rules = _tiny(scan)
    model = MoETransformer(config, rules, rngs=nnx.Rngs(0))
    base = np.asarray(model(jnp.asarray(TOKENS))[0])
    paths = apply_lora(model, Lora(rank=4, alpha=8.0), seed=3)
    # attention and the dense / shared MLPs; no routed expert, router or head
    assert {p.split("/", 2)[2] for p in paths} == {
        "attn/wq", "attn/wk", "attn/wv", "attn/wo", "mlp/w_gate", "mlp/w_up", "mlp/w_down",
        "moe/shared_experts/w_gate", "moe/shared_experts/w_up", "moe/shared_experts/w_down"}
    trained = nnx.to_flat_state(nnx.state(model, TRAINABLE))
    assert trained and all(str(p[-1]).endswith(("_lora_a", "_lora_b")) for p, _ in trained)
    frozen = nnx.to_flat_state(nnx.state(model, FrozenParam))
    assert {str(p[-1]) for p, _ in frozen} >= {"table", "scale", "kernel", "w_gate", "wq"}
    np.testing.assert_array_equal(np.asarray(model(jnp.asarray(TOKENS))[0]), base)  # B = 0
    for p, v in trained:  # PEFT's init: A uniform in +-1/sqrt(fan_in), B zeros
        x = np.asarray(v.get_value())
        if str(p[-1]).endswith("_lora_b"):
            assert not x.any()
        else:
            fan_in = int(np.prod(x.shape[1 if scan else 0:-1]))
            assert 0.5 / np.sqrt(fan_in) < np.abs(x).max() <= 1 / np.sqrt(fan_in)


@pytest.mark.parametrize("targets,match", [
    ("attn/w; nothing_here", "matches no projection"),
    ("experts/w", "routed experts"),
    ("blocks/0/attn/wq", None),
])
def test_bad_targets_are_one_line_errors(targets, match):
    config, rules = _tiny(scan=True if match is None else False, num_layers=3,
                          first_dense_layers=0)
    model = nnx.eval_shape(lambda: MoETransformer(config, rules, rngs=nnx.Rngs(0)))
    lora = Lora(rank=2, targets=Lora.parse_targets(targets))
    with pytest.raises(ValueError, match=match or "scanned stack") as info:
        apply_lora(model, lora, seed=0)
    assert "\n" not in str(info.value)


def test_lora_config_refusals():
    from jaxmp.train.config import validate_config
    for over, match in [(["lora.rank=4"], "bias_update_rate"),
                        (["lora.rank=4", "model.bias_update_rate=0.0", "lora.targets=(("],
                         "not a regular expression"),
                        (["lora.rank=4", "model.bias_update_rate=0.0", "lora.base=int8"],
                         "lora.base"),
                        (["lora.rank=-1"], "lora.rank")]:
        with pytest.raises(ValueError, match=match):
            validate_config(load_config("configs/tiny_moe.py", over + [
                "model.bias_update_rate=0.001" if "model.bias_update_rate=0.0" not in over
                else "seed=0"]), 1)


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory):
    """A tiny Llama checkpoint, and two LoRA steps of train.py's path on it (2 devices,
    fsdp, scanned), with a learning rate that moves the adapters."""
    from jaxmp.train.loop import train_and_evaluate

    tmp = tmp_path_factory.mktemp("lora")
    torch.manual_seed(0)
    original = transformers.AutoModelForCausalLM.from_config(
        _hf_config("llama", vocab_size=128)).float().eval()
    src = tmp / "src"
    original.save_pretrained(str(src))
    _char_tokenizer(src)
    corpus = tmp / "corpus.txt"
    corpus.write_text("def f(x):\n    return x + 1\n" * 300)
    overrides = [
        f"model.init_from={src}", "precision.policy=fp32", "data.seq_len=32",
        "train.batch_size=4", "optim.learning_rate=3e-2", "optim.warmup_steps=0",
        f"data.path={corpus}", "data.num_eval_batches=0", "data.eval_fraction=0",
        "model.scan_layers=True", "train.steps=2", "train.sample_tokens=0",
        "train.eval_every=0", "lora.rank=4", "lora.alpha=8", "parallel.strategy=fsdp",
        "optim.weight_decay=0.0"]
    summary = train_and_evaluate(load_config("configs/finetune.py", overrides),
                                 str(tmp / "run"), num_devices=2)
    assert summary["step"] == 2
    return tmp, src, original, overrides


def test_the_frozen_base_is_bitwise_the_checkpoint_and_the_adapters_moved(lora_run):
    from jaxmp.train.artifacts import load
    from jaxmp.models import from_pretrained

    tmp, src, _, _ = lora_run
    model, _, config = load(str(tmp / "run"))
    base = from_pretrained(str(src), "fp32", scan_layers=True)
    want = {p: v.get_value() for p, v in nnx.to_flat_state(nnx.state(base, nnx.Param))}
    frozen = nnx.to_flat_state(nnx.state(model, FrozenParam))
    assert len(frozen) == len(want)
    for p, v in frozen:
        np.testing.assert_array_equal(np.asarray(v.get_value()), np.asarray(want[p]))
    b = [np.asarray(v.get_value()) for p, v in nnx.to_flat_state(nnx.state(model, TRAINABLE))
         if str(p[-1]).endswith("_lora_b")]
    assert b and all(np.abs(x).max() > 1e-3 for x in b)


def test_a_peft_export_loads_in_peft_with_the_runs_logits(lora_run):
    peft = pytest.importorskip("peft")
    from jaxmp import export
    from jaxmp.train.artifacts import load

    tmp, src, _, _ = lora_run
    out = tmp / "peft"
    assert export.main(["--workdir", str(tmp / "run"), "--out", str(out), "--format", "peft"]) == 0
    cfg = json.load(open(out / "adapter_config.json"))
    assert (cfg["r"], cfg["lora_alpha"], cfg["peft_type"]) == (4, 8.0, "LORA")
    base = transformers.AutoModelForCausalLM.from_pretrained(str(src)).float().eval()
    adapted = peft.PeftModel.from_pretrained(base, str(out)).eval()
    # every adapter tensor was loaded (none left at PEFT's B = 0 init)
    loaded = {n for n, _ in adapted.named_parameters() if "lora_" in n}
    assert len(loaded) == 2 * len(cfg["target_modules"]) == 2 * 2 * 7
    theirs = _hf_logits(adapted, TOKENS)
    model, _, _ = load(str(tmp / "run"))
    ours = np.asarray(jax.jit(lambda t: model(t)[0])(jnp.asarray(TOKENS)))
    assert _rel_err(ours, theirs) < 1e-4
    base_logits = _hf_logits(transformers.AutoModelForCausalLM.from_pretrained(str(src)).float(),
                             TOKENS)
    assert _rel_err(theirs, base_logits) > 1e-3  # the adapters changed the model


def test_the_merged_exports_are_the_adapted_model(lora_run):
    from jaxmp import export
    from jaxmp.train.artifacts import load

    tmp, _, _, _ = lora_run
    model, _, _ = load(str(tmp / "run"))
    ours = np.asarray(jax.jit(lambda t: model(t)[0])(jnp.asarray(TOKENS)))
    out = tmp / "merged"
    assert export.main(["--workdir", str(tmp / "run"), "--out", str(out), "--format", "hf"]) == 0
    merged = transformers.AutoModelForCausalLM.from_pretrained(str(out)).float().eval()
    assert _rel_err(_hf_logits(merged, TOKENS), ours) < 1e-4


def test_a_peft_export_of_a_run_without_adapters_is_refused(tmp_path):
    from jaxmp import export
    from jaxmp.train.loop import train_and_evaluate

    cfg = load_config("configs/tiny_moe.py", [
        "train.steps=1", "train.batch_size=2", "data.max_tokens=4000", "train.eval_every=0",
        "data.num_eval_batches=0", "train.sample_tokens=0"])
    train_and_evaluate(cfg, str(tmp_path / "run"), num_devices=1)
    with pytest.raises(SystemExit) as info:
        export.main(["--workdir", str(tmp_path / "run"), "--out", str(tmp_path / "p"),
                     "--format", "peft"])
    assert info.value.code == 2 and not (tmp_path / "p").exists()
