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
from jaxmp.models.lora import FrozenParam, TRAINABLE, fp8_matrix, lora_product, merged_weight
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
    got = np.asarray(lora_product(jnp.asarray(x), jnp.asarray(a), jnp.asarray(b), scale, spec))
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
                        (["lora.rank=-1"], "lora.rank"),
                        (["lora.base=fp8"], "lora.base='fp8' is set with lora.rank=0"),
                        (["lora.targets=nothing"], "lora.targets='nothing' is set with lora.rank=0")]:
        with pytest.raises(ValueError, match=match):
            validate_config(load_config("configs/tiny_moe.py", over + [
                "model.bias_update_rate=0.001" if "model.bias_update_rate=0.0" not in over
                else "seed=0"]), 1)


def _train_lora(tmp, src, *extra):
    """Two LoRA steps of train.py's path (configs/finetune.py, ``model.init_from=src``) on
    a 2-device mesh under fsdp with scanned layers, at a learning rate that moves the
    adapters, into ``tmp/run``; returns the overrides."""
    from jaxmp.train.loop import train_and_evaluate

    corpus = tmp / "corpus.txt"
    corpus.write_text("def f(x):\n    return x + 1\n" * 300)
    overrides = [
        f"model.init_from={src}", "data.seq_len=32", "train.batch_size=4",
        "optim.learning_rate=3e-2", "optim.warmup_steps=0", "optim.weight_decay=0.0",
        f"data.path={corpus}", "data.num_eval_batches=0", "data.eval_fraction=0",
        "model.scan_layers=True", "train.steps=2", "train.sample_tokens=0",
        "train.eval_every=0", "lora.rank=4", "lora.alpha=8", "parallel.strategy=fsdp", *extra]
    summary = train_and_evaluate(load_config("configs/finetune.py", overrides),
                                 str(tmp / "run"), num_devices=2)
    assert summary["step"] == 2 and all(np.isfinite(summary["train_losses"]))
    return overrides


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory):
    """A tiny Llama checkpoint (its weights bfloat16 values, as released), and two LoRA
    steps of train.py's path on it over a bfloat16 base (2 devices, fsdp, scanned, float32
    compute), with a learning rate that moves the adapters."""
    tmp = tmp_path_factory.mktemp("lora")
    torch.manual_seed(0)
    original = transformers.AutoModelForCausalLM.from_config(
        _hf_config("llama", vocab_size=128)).float().eval()
    with torch.no_grad():
        for p in original.parameters():
            p.copy_(p.bfloat16().float())
    src = tmp / "src"
    original.save_pretrained(str(src))
    _char_tokenizer(src)
    overrides = _train_lora(tmp, src, "precision.policy=fp32", "lora.base=bfloat16")
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
    for p, v in frozen:  # the bfloat16 base holds the checkpoint's (bfloat16) values
        assert v.get_value().dtype == jnp.bfloat16
        np.testing.assert_array_equal(np.asarray(v.get_value(), np.float32),
                                      np.asarray(want[p]))
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
    # merged in bfloat16: every weight the float32 merge rounded to nearest even
    bf16 = tmp / "merged_bf16"
    assert export.main(["--workdir", str(tmp / "run"), "--out", str(bf16), "--format", "hf",
                        "--dtype", "bfloat16"]) == 0
    written = json.load(open(bf16 / "config.json"))
    assert written.get("torch_dtype", written.get("dtype")) == "bfloat16"
    a = transformers.AutoModelForCausalLM.from_pretrained(str(out)).state_dict()
    b = transformers.AutoModelForCausalLM.from_pretrained(str(bf16), dtype=torch.bfloat16).state_dict()
    for name, w in a.items():
        assert torch.equal(w.bfloat16(), b[name]), name


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


def _e4m3_tiles(x):
    """NumPy: ``x [M, K]`` quantized in 1x128 tiles (scale = tile amax / 448, E4M3 by
    ml_dtypes' rounding), dequantized in float64."""
    import ml_dtypes
    out = np.empty(x.shape, np.float64)
    for c in range(0, x.shape[1], 128):
        t = x[:, c:c + 128].astype(np.float32)
        s = (np.abs(t).max(1, keepdims=True) * np.float32(1 / 448)).astype(np.float32)
        s = np.where(s == 0, np.float32(1), s)
        q = (t * (np.float32(1) / s)).astype(ml_dtypes.float8_e4m3fn)
        out[:, c:c + 128] = q.astype(np.float64) * s
    return out


@pytest.mark.parametrize("k,n,grouped", [(200, 136, False), (64, 300, False), (160, 96, True)])
def test_a_frozen_fp8_weight_is_read_as_stored_forward_and_backward(k, n, grouped):
    """``jaxmp.fp8.matmul(..., scales=)`` (a ``lora.base=fp8`` projection) against NumPy
    float64: the activation in 1x128 E4M3 tiles times the stored E4M3 weight times its
    128 x 128 block scales; ``dx`` the gradient's 1x128 tiles times the same blocks
    transposed; no weight gradient."""
    import ml_dtypes
    from jaxmp.precision import fp8

    rng = np.random.RandomState(1)
    g_count = 3 if grouped else 1
    w = rng.randn(g_count, k, n).astype(np.float32) * rng.uniform(0.1, 3, (g_count, 1, n))
    qs, ss = zip(*(fp8.quantize_blocks(jnp.asarray(m), (128, 128)) for m in w))
    q, s = jnp.stack(qs), jnp.stack(ss)
    wd = np.stack([np.asarray(qi).astype(np.float64) * np.repeat(np.repeat(np.asarray(si), 128, 0),
                                                                 128, 1)[:k, :n]
                   for qi, si in zip(qs, ss)])
    sizes = np.array([5, 0, 11]) if grouped else np.array([16])
    x = rng.randn(int(sizes.sum()), k).astype(np.float32)
    g = rng.randn(int(sizes.sum()), n).astype(np.float32)
    recipe = fp8.Recipe.blockwise(kernel="xla")
    if grouped:
        f = lambda x: fp8.matmul(x, q, recipe, group_sizes=jnp.asarray(sizes, jnp.int32), scales=s)
    else:
        f = lambda x: fp8.matmul(x, q[0], recipe, scales=s[0])
    y, vjp = jax.vjp(f, jnp.asarray(x))
    (dx,) = vjp(jnp.asarray(g))
    group = np.repeat(np.arange(g_count), sizes)
    xq, gq = _e4m3_tiles(x), _e4m3_tiles(g)
    want_y = np.einsum("mk,mkn->mn", xq, wd[group])
    want_dx = np.einsum("mn,mkn->mk", gq, wd[group])
    np.testing.assert_allclose(np.asarray(y), want_y, rtol=2e-5, atol=2e-5 * np.abs(want_y).max())
    np.testing.assert_allclose(np.asarray(dx), want_dx, rtol=2e-5,
                               atol=2e-5 * np.abs(want_dx).max())
    assert q.dtype == ml_dtypes.float8_e4m3fn


@pytest.fixture(scope="module", params=["deepseek_v3", "qwen3_moe"])
def fp8_lora_run(request, tmp_path_factory):
    """A tiny blockwise-FP8 checkpoint of ``family`` (128 x 128 blocks, one partial block
    per projection), and two LoRA steps over it with ``lora.base=fp8`` (train.py's path,
    2 devices, fsdp with expert parallelism off)."""
    from test_hf import _fp8_checkpoint

    family = request.param
    tmp = tmp_path_factory.mktemp(f"fp8lora_{family}")
    torch.manual_seed(2)
    model = transformers.AutoModelForCausalLM.from_config(
        _hf_config(family, vocab_size=128)).float().eval()
    with torch.no_grad():  # as released: what is not FP8 is bfloat16 (the frozen base's dtype)
        for p in model.parameters():
            p.copy_(p.bfloat16().float())
    src = tmp / "src"
    quantized = _fp8_checkpoint(  # as the releases: every nn.Linear but the router and head
        model, str(src), (128, 128), np.random.RandomState(3),
        quantize=lambda n: n.endswith(("proj.weight", "proj_with_mqa.weight")))
    _char_tokenizer(src)
    _train_lora(tmp, src, "precision.policy=mixed_bf16", "lora.base=fp8",
                "lora.targets=attn/w")  # what peft loads onto these families (PEFT_MOE_REMAPPED)
    return family, tmp, src, quantized


def test_an_fp8_base_is_the_checkpoints_own_bytes_and_scales(fp8_lora_run):
    """The frozen E4M3 weights of a resumed (loaded) LoRA run are bitwise the checkpoint's
    ``weight`` (transposed to jaxmp's ``[in, out]``) and their scales its
    ``weight_scale_inv`` transposed: nothing dequantized or quantized again."""
    from safetensors.torch import load_file
    from jaxmp.train.artifacts import load

    family, tmp, src, quantized = fp8_lora_run
    stored = load_file(str(src / "model.safetensors"))
    model, _, _ = load(str(tmp / "run"))
    stack = model.stacks[0]
    layer = stack.layers.index(0)
    wo, so = stack.attn.wo[...][layer], stack.attn.wo_scale_inv[...][layer]
    name = "model.layers.0.self_attn.o_proj.weight"
    assert name in quantized and wo.dtype == jnp.float8_e4m3fn
    want = stored[name].view(torch.uint8).numpy()
    np.testing.assert_array_equal(np.asarray(wo).reshape(-1, wo.shape[-1]).T.view(np.uint8), want)
    np.testing.assert_array_equal(np.asarray(so), stored[f"{name}_scale_inv"].numpy().T)


def _dequantized_copy(src, dst, quantized):
    """transformers' float32 model of ``src`` with each FP8 weight dequantized by NumPy
    (DeepSeek's ``weight_dequant``), saved in ``dst`` without a quantization_config."""
    from safetensors.torch import load_file, save_file
    from test_hf import _dequantized

    dst.mkdir(exist_ok=True)
    stored = load_file(str(src / "model.safetensors"))
    plain = {n: t for n, t in stored.items() if not n.endswith("_scale_inv")}
    plain.update({n: torch.tensor(_dequantized(stored, n, (128, 128))) for n in quantized})
    save_file(plain, str(dst / "model.safetensors"), metadata={"format": "pt"})
    config = json.load(open(src / "config.json"))
    del config["quantization_config"]
    (dst / "config.json").write_text(json.dumps(config))
    return transformers.AutoModelForCausalLM.from_pretrained(str(dst)).float().eval()


def test_an_fp8_base_run_exports_peft_merged_and_fp8(fp8_lora_run):
    """The run's adapters through peft on transformers' load of the FP8 base equal its
    merged export through transformers (both float32: ``W`` dequantized plus
    ``(alpha / r) A B``); the merged ``--quantize fp8`` export is that within E4M3's
    rounding of the weights; and the run's own logits (activations in E4M3 tiles, bfloat16
    compute) are that within the error its FP8 base alone has against transformers."""
    peft = pytest.importorskip("peft")
    pytest.importorskip("accelerate", reason="transformers' FP8 load needs accelerate")
    from jaxmp import export
    from jaxmp.train.artifacts import load
    from test_hf import _hf_fp8_model

    family, tmp, src, quantized = fp8_lora_run
    run = ["--workdir", str(tmp / "run")]
    for fmt in (["--format", "peft"], ["--format", "hf"], ["--format", "hf", "--quantize", "fp8"]):
        out = tmp / "_".join(fmt).replace("-", "")
        assert export.main(run + ["--out", str(out)] + fmt) == 0
    merged = _hf_logits(transformers.AutoModelForCausalLM.from_pretrained(
        str(tmp / "format_hf")).float().eval(), TOKENS)
    # peft on the base dequantized in float32 (NumPy), exactly the merged export's math
    plain = _dequantized_copy(src, tmp / "plain", quantized)
    exact = peft.PeftModel.from_pretrained(plain, str(tmp / "format_peft")).eval()
    assert _rel_err(_hf_logits(exact, TOKENS), merged) < 1e-4
    # and on transformers' own load of the FP8 base (dequantized to bfloat16 on a CPU)
    adapted = peft.PeftModel.from_pretrained(_hf_fp8_model(src), str(tmp / "format_peft")).eval()
    theirs = _hf_logits(adapted, TOKENS)
    assert _rel_err(theirs, merged) < 1e-2
    assert _rel_err(_hf_logits(_hf_fp8_model(tmp / "format_hf_quantize_fp8"), TOKENS),
                    merged) < 0.1
    base = _hf_logits(_hf_fp8_model(src), TOKENS)
    assert _rel_err(theirs, base) > 1e-2  # the adapters moved it

    def logits(model):
        return np.asarray(jax.jit(lambda t: model(t)[0])(jnp.asarray(TOKENS)), np.float64)

    model, _, _ = load(str(tmp / "run"))
    ours = logits(model)
    for path, var in nnx.to_flat_state(nnx.state(model, TRAINABLE)):  # B = 0: the base
        if str(path[-1]).endswith("_lora_b"):
            var.set_value(jnp.zeros_like(var.get_value()))
    rounding = _rel_err(logits(model), base)
    assert _rel_err(ours, merged) < 2 * rounding + 0.01, rounding


def test_a_peft_export_refuses_mlp_adapters_peft_would_move_to_the_experts(fp8_lora_run,
                                                                           tmp_path):
    """peft moves a qwen2_moe-pattern family's gate/up/down_proj targets to the routed
    experts when it loads onto transformers 5; such adapters are refused in one line, the
    attention's written (the run above)."""
    from jaxmp.models import from_pretrained
    from jaxmp.models.hf.peft import save_adapters

    family, _, src, _ = fp8_lora_run
    model = from_pretrained(str(src), "fp32")
    apply_lora(model, Lora(rank=2), seed=0)  # the default targets: attention and MLPs
    with pytest.raises(ValueError, match="re-targets") as info:
        save_adapters(model, str(tmp_path / "p"), rank=2, alpha=16.0)
    assert "\n" not in str(info.value) and not (tmp_path / "p").exists()


LORA_TINY = ["lora.rank=4", "model.bias_update_rate=0.0", "lora.base=bfloat16"]


@pytest.mark.slow
def test_a_sigkilled_lora_run_resumes_bitwise_like_an_uninterrupted_one(tmp_path):
    """train.py with adapters over a bfloat16 base (tests/test_faults.py's launcher),
    checkpointing every 4 steps, killed by SIGKILL at step 6 or later: the rerun resumes
    from the last complete checkpoint (adapters and optimizer state; the base rebuilt and
    checked against its digest) and logs the uninterrupted run's losses, bit for bit."""
    from test_faults import assert_sigkilled_run_resumes_bitwise

    assert_sigkilled_run_resumes_bitwise(tmp_path, *LORA_TINY)


def test_a_lora_checkpoint_holds_no_base_and_refuses_another_base(lora_run, tmp_path):
    """The checkpoint holds the adapters and their optimizer state, not the base (its
    arrays are the trained parameters' size), and a digest of the base; a resume over a
    base whose weights changed under the same path is refused in one line before a step."""
    import shutil
    from safetensors.torch import load_file, save_file
    from jaxmp.train.loop import train_and_evaluate
    from jaxmp.train.artifacts import load

    tmp, src, _, overrides = lora_run
    base = tmp_path / "base"
    shutil.copytree(src, base)
    run = tmp_path / "run"
    over = [o for o in overrides if not o.startswith(("model.init_from", "train.steps"))]
    cfg = load_config("configs/finetune.py", over + [f"model.init_from={base}", "train.steps=1"])
    train_and_evaluate(cfg, str(run), num_devices=2)
    meta = json.load(open(run / "checkpoints" / "1" / "verify" / "metadata"))
    assert len(meta["lora_base_digest"]) == 64
    from jaxmp.train import CheckpointError
    for key, value in (("lora.base", "master"), ("lora.rank", "8")):  # the run's adapters
        other = load_config("configs/finetune.py", over + [f"model.init_from={base}",
                                                           "train.steps=2", f"{key}={value}"])
        with pytest.raises(CheckpointError, match=rf"different settings \({key}: saved"):
            train_and_evaluate(other, str(run), num_devices=2)
    tree = (run / "checkpoints" / "1" / "state" / "_METADATA").read_text()
    assert "wq_lora_a" in tree and "table" not in tree and "attn_norm" not in tree  # no base
    from jaxmp import export
    moved = tmp_path / "moved"
    base.rename(moved)  # the base moved after training: named, and given back with --base
    with pytest.raises(ValueError, match="holds no config.json .moved or deleted"):
        load(str(run))
    assert export.main(["--workdir", str(run), "--out", str(tmp_path / "p"), "--format", "peft",
                        "--base", str(moved)]) == 0
    moved.rename(base)
    tensors = load_file(str(base / "model.safetensors"))
    name = "model.layers.1.self_attn.o_proj.weight"
    tensors[name] = tensors[name] * 1.5  # (a change the bfloat16 base holds)
    save_file(tensors, str(base / "model.safetensors"), metadata={"format": "pt"})
    cfg2 = load_config("configs/finetune.py", over + [f"model.init_from={base}", "train.steps=2"])
    with pytest.raises(ValueError, match="another base") as info:
        train_and_evaluate(cfg2, str(run), num_devices=2)
    assert "\n" not in str(info.value)
    with pytest.raises(ValueError, match="another base"):
        load(str(run))  # the export's reader too


def _instructions(hlo_text):
    """``{instruction name: (element type, dims)}`` and the ``(result, operand)`` names of
    every ``convert`` of an optimized HLO module."""
    import re
    shapes, converts = {}, []
    for m in re.finditer(r"^\s*(?:ROOT )?%([\w.\-]+) = (\w+)\[([\d,]*)\]\S* (\w[\w\-]*)\((%[\w.\-]+)?",
                         hlo_text, re.M):
        name, dtype, dims, op, first = m.groups()
        shapes[name] = (dtype, tuple(int(d) for d in dims.split(",") if d))
        if op == "convert":
            converts.append((name, first[1:]))
    return shapes, converts


def test_an_fp8_base_is_never_quantized_or_dequantized_in_the_compiled_step():
    """Issue 42, point 2: the trainer's step with ``lora.base=fp8``, compiled deviceless for
    one H100: the frozen E4M3 weights reach the blockwise Mosaic GPU GEMMs as stored. No
    ``convert`` makes an E4M3 array of a weight's size (in any layout: no re-quantization;
    a bfloat16 base under fp8_blockwise makes its ``[Kb, 128, Nb, 128]`` blocks), none
    reads an E4M3 array of a weight's size (no bfloat16 or float32 copy held); each projection is one forward GEMM and one ``dx`` GEMM (no
    weight gradient; layer 0's q/k/v ``dx`` feeds the frozen embedding only and is dropped)."""
    from jaxmp.analysis import gpu, hlo
    problem = gpu.plugin_problem()
    if problem is not None:
        pytest.skip(f"deviceless GPU compile: {problem}")
    from jaxmp.train.state import split_frozen

    over = ["model.d_model=256", "model.num_heads=2", "model.head_dim=128", "model.d_ff=512",
            "model.num_experts=0", "model.num_layers=2", "model.first_dense_layers=2",
            "model.max_len=192", "data.seq_len=192", "train.batch_size=2", "lora.rank=16",
            "lora.base=fp8", "model.bias_update_rate=0.0"]
    step = gpu.compile_step(load_config("configs/tiny_moe.py", over), gpu.get_target("H100"), 1)
    frozen = split_frozen(step.experiment.abstract_state.rest)[0]
    weights = set()
    for path, v in nnx.to_flat_state(frozen):
        value = v.get_value()
        if value.dtype == jnp.float8_e4m3fn:
            axes = tuple(v.get_metadata()["out_sharding"])
            lead, k, n = fp8_matrix(str(path[-1]), value.shape, axes)
            weights.add(k * n)
    tokens = 2 * 192
    assert len(weights) == 2 and not weights & {tokens * 256, tokens * 512}  # told apart
    shapes, converts = _instructions(step.hlo_text)

    def weight_sized(name):  # a weight in any layout (its [Kb, 128, Nb, 128] blocks too)
        return int(np.prod(shapes[name][1])) in weights

    quantized = [r for r, o in converts if shapes[r][0] == "f8e4m3fn" and weight_sized(r)]
    dequantized = [r for r, o in converts if o in shapes and shapes[o][0] == "f8e4m3fn"
                   and weight_sized(o)]
    assert quantized == [] and dequantized == []
    assert any(shapes[r][0] == "f8e4m3fn" for r, _ in converts)  # the activations' tiles
    kernels = hlo.hlo_kernels(hlo.parse_module(step.hlo_text))
    mosaic = [k for k in kernels if k.kind == "mosaic_gpu" and "scaled_mm" in k.op_name]
    forward = [k for k in mosaic if "transpose(" not in k.op_name]
    assert (len(forward), len(mosaic) - len(forward)) == (2 * 7, 2 * 7 - 3)


# tiny_moe (d_model 64, 4 heads of 16, a dense layer of d_ff 256, a MoE layer of 4 routed
# and 1 shared expert of 64) with rank-16 adapters on attention, the dense MLP and the
# shared expert: in x 16 + 16 x out per projection.
R = 16
TINY_ADAPTERS = (2 * 4 * (64 * R + R * 64)          # q, k, v, o of both layers
                 + 2 * (64 * R + R * 256) + (256 * R + R * 64)  # the dense SwiGLU
                 + 3 * (64 * R + R * 64))           # the shared expert
TINY_PARAMS = 176_832  # tests/test_accounting.py's count by formula
# What lora.base=fp8 holds in E4M3: attention, the dense SwiGLU, routed and shared experts;
# one float32 scale per 128 x 128 block of each (every matrix here is 1 or 2 blocks).
TINY_FP8 = 2 * 4 * 64 * 64 + 3 * 64 * 256 + 3 * 4 * 64 * 64 + 3 * 64 * 64
TINY_SCALES = 8 * 1 + 3 * 2 + 12 * 1 + 3 * 1


@pytest.mark.parametrize("mode,base_bytes", [
    ("lora_master", 4 * TINY_PARAMS), ("lora_bf16", 2 * TINY_PARAMS),
    ("lora_fp8", TINY_FP8 + 4 * TINY_SCALES + 2 * (TINY_PARAMS - TINY_FP8))])
def test_the_report_lora_modes_count_base_and_adapters_by_hand(mode, base_bytes):
    """Issue 42, point 4: a LoRA mode's persistent state per device (dp, one device), from
    the abstract train state of the report's own experiment: float32 adapters, their
    float32 gradient and Adam moments (plus two int32 counts), and the frozen base in
    float32, bfloat16, or E4M3 with its block scales and bfloat16 for the rest."""
    from jaxmp.analysis import accounting
    from jaxmp.train.experiment import Experiment

    assert accounting.default_modes(load_config("configs/tiny_moe.py")) == list(accounting.MODES)
    config = accounting.mode_config(load_config("configs/tiny_moe.py"), mode)
    assert (config.lora.rank, config.model.bias_update_rate) == (R, 0.0)
    got = accounting.state_bytes(Experiment.create(config, num_devices=1))
    assert got["params_bytes"] == got["grads_bytes"] == 4 * TINY_ADAPTERS == 151_552
    assert got["opt_state_bytes"] == 2 * 4 * TINY_ADAPTERS + 8
    assert got["frozen_base_bytes"] == base_bytes


def test_an_fp8_base_refuses_a_checkpoint_without_its_fp8_form_before_the_corpus(lora_run,
                                                                               tmp_path):
    """``lora.base=fp8`` over a bfloat16/float32 checkpoint, or over FP8 blocks the
    blockwise kernels cannot take (64 x 64), is one line from the header checks the trainer
    runs before it reads its corpus; so is the loader, for a block it cannot read."""
    from test_hf import _fp8_checkpoint
    from jaxmp.train.experiment import Experiment

    tmp, src, _, overrides = lora_run
    over = [o for o in overrides if not o.startswith("model.init_from")] + ["lora.base=fp8",
                                                                           "precision.policy=mixed_bf16"]
    exp = Experiment.create(load_config("configs/finetune.py", over + [f"model.init_from={src}"]),
                            num_devices=2)
    with pytest.raises(ValueError, match="no quantization_config") as info:
        exp.check_init_from()
    assert "\n" not in str(info.value)
    torch.manual_seed(1)
    model = transformers.AutoModelForCausalLM.from_config(
        _hf_config("qwen3_moe", vocab_size=128)).float().eval()
    fp8_dir = tmp_path / "fp8_64"
    _fp8_checkpoint(model, str(fp8_dir), (64, 64), np.random.RandomState(0))
    _char_tokenizer(fp8_dir)
    exp = Experiment.create(load_config("configs/finetune.py", over + [
        f"model.init_from={fp8_dir}"]), num_devices=2)
    with pytest.raises(ValueError, match=r"weight_block_size \[64, 64\]; allowed: \[128, 128\]"):
        exp.check_init_from()
    with pytest.raises(ValueError, match=r"weight_block_size \[64, 64\]"):
        exp.init_state()  # the loader's own check


@pytest.mark.parametrize("base", ["bfloat16", "fp8"])
def test_adapters_train_alike_under_every_strategy_and_expert_parallelism(base):
    """Two LoRA steps of tiny_moe on 4 devices under dp, zero1, fsdp and fsdp with expert
    parallelism 2: the same losses and adapters as dp (float32 policy; the routed experts'
    frozen base split along ``expert``; an FP8 base's adapters after the first step), the
    frozen base laid out as the forward pass reads
    parameters (split over ``data`` under fsdp only)."""
    from jaxmp.train.experiment import Experiment
    from jaxmp.train.state import split_frozen

    results = {}
    for strategy, expert in (("dp", 1), ("zero1", 1), ("fsdp", 1), ("fsdp", 2)):
        cfg = load_config("configs/tiny_moe.py", [
            f"parallel.strategy={strategy}", f"parallel.expert={expert}", "lora.rank=4",
            f"lora.base={base}", "model.bias_update_rate=0.0", "train.batch_size=8",
            "optim.warmup_steps=0", "model.capacity_factor=4.0", "data.max_tokens=20000",
            "data.num_eval_batches=1",
            "precision.policy=fp32"])
        exp = Experiment.create(cfg, num_devices=4)
        state = exp.init_state()
        frozen = split_frozen(state.rest)[0]
        wq = frozen["blocks"][0]["attn"]["wq"].get_value()
        split = "data" in str(wq.sharding.spec)
        assert split == (strategy == "fsdp"), (strategy, wq.sharding.spec)
        batch = exp.batch_to_device(next(exp.data.train_iter))
        losses, params = [], []
        for _ in range(2):
            state, m = exp.train_step(state, batch)
            losses.append(float(m["loss"]))
            params.append(jax.device_get(state.params))
        losses.append(exp.evaluate(state))  # the eval step reads the base as the train step
        results[(strategy, expert)] = (losses, params)
    ref_losses, ref_params = results[("dp", 1)]
    # An FP8 base: the activations' E4M3 tiles of the second step may round an element the
    # other way after a last-bit difference of the first step's reductions, so its
    # adapters are compared after the first step.
    compared = 1 if base == "fp8" else 2
    for key, (losses, params) in results.items():
        np.testing.assert_allclose(losses, ref_losses, rtol=2e-5, err_msg=str(key))
        for a, b in zip(jax.tree.leaves(params[compared - 1]),
                        jax.tree.leaves(ref_params[compared - 1])):
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-6,
                                       err_msg=str(key))


def test_a_gradient_norm_past_float32_is_a_divergent_step_and_no_state_holds_it():
    """``lora.alpha=1e30``: finite gradients whose norm overflows float32. The step looks
    divergent and the running means stay finite (a checkpoint holding an infinite mean
    could not be restored)."""
    from jaxmp.train.experiment import Experiment

    exp = Experiment.create(load_config("configs/tiny_moe.py", [
        "lora.rank=4", "lora.alpha=1e30", "model.bias_update_rate=0.0", "train.batch_size=2",
        "data.max_tokens=4000", "optim.warmup_steps=0"]), num_devices=1)
    state = exp.init_state()
    batch = exp.batch_to_device(next(exp.data.train_iter))
    for _ in range(2):
        state, m = exp.train_step(state, batch)
    assert not np.isfinite(float(m["grad_norm"])) and bool(m["divergent"])
    assert all(np.isfinite(float(x)) for x in (state.grad_norm_ema, state.loss_ema))


def test_an_fp8_scale_past_float32_times_448_is_refused(tmp_path):
    from safetensors.torch import load_file, save_file
    from test_hf import _fp8_checkpoint
    from jaxmp.models import from_pretrained

    torch.manual_seed(3)
    model = transformers.AutoModelForCausalLM.from_config(_hf_config("llama")).float()
    _fp8_checkpoint(model, str(tmp_path), (128, 128), np.random.RandomState(0))
    tensors = load_file(str(tmp_path / "model.safetensors"))
    tensors["model.layers.0.mlp.up_proj.weight_scale_inv"][:] = 3e38
    save_file(tensors, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ValueError, match="up_proj.weight_scale_inv holds a scale of 3e.38, past "
                                         "float32's range") as info:
        from_pretrained(str(tmp_path), "fp32")
    assert "\n" not in str(info.value)
