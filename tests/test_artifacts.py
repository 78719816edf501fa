"""From your folder to a model you can use (issue 21, points 6 and 7): a BPE run's eval
units, jaxmp.train.load, python -m jaxmp.sample and python -m jaxmp.export."""
import json
import math
import os
import pathlib
import subprocess
import sys
import sysconfig

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxmp import export as export_cli
from jaxmp.models import ModelConfig, MoETransformer
from jaxmp.train import load, train_and_evaluate
from jaxmp.train.artifacts import load_export
from jaxmp.train.config import load_config

ROOT = pathlib.Path(__file__).resolve().parents[1]
STDLIB = pathlib.Path(sysconfig.get_paths()["stdlib"])


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """A 4-step run on a folder of ASCII text with a 384-token BPE."""
    tmp = tmp_path_factory.mktemp("own")
    folder = tmp / "corpus"
    folder.mkdir()
    for f in sorted((STDLIB / "json").glob("*.py")):
        text = f.read_text(encoding="utf-8", errors="replace")
        (folder / f"{f.stem}.txt").write_text("".join(c for c in text if ord(c) < 128))
    workdir = tmp / "run"
    config = load_config(ROOT / "configs" / "tiny_moe.py", [
        f"data.path={folder}", "data.tokenizer=bpe:384", "model.vocab_size=384",
        "data.seq_len=32", "model.max_len=32", "data.eval_fraction=0.3", "data.num_eval_batches=1",
        "train.steps=4", "train.batch_size=8", "train.log_every=2", "train.eval_every=4",
        "train.checkpoint_every=4", "train.sample_tokens=4", "model.d_model=32", "model.d_ff=64",
        "model.d_expert=32"])
    summary = train_and_evaluate(config, str(workdir), num_devices=1)
    return workdir, summary


def test_eval_in_nats_perplexity_and_bits_per_byte(run):
    workdir, summary = run
    records = [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]
    ev = [r for r in records if r["split"] == "eval"][-1]
    assert ev["loss_unit"] == "nats/token" and ev["step"] == 4
    assert ev["perplexity"] == pytest.approx(math.exp(ev["loss"]), rel=1e-12)
    # bits per byte by hand: the eval batch's 8 x 32 target tokens, each token's bytes from
    # its own decoded text (the corpus is ASCII), the loss summed over them in bits.
    model, tok, config = load(workdir)
    from jaxmp.train.data import create_pipeline
    pipe = create_pipeline(config.data, global_batch_size=8, seed=0, workdir=workdir)
    targets = pipe.eval_batches[0]["targets"]
    nbytes = sum(len(tok.decode([t]).encode()) for t in targets.reshape(-1) if t != tok.eos_id)
    assert ev["bits_per_byte"] == pytest.approx(ev["loss"] * targets.size / math.log(2) / nbytes,
                                                rel=1e-9)
    assert summary["eval"]["bits_per_byte"] == pytest.approx(ev["bits_per_byte"], rel=1e-9)
    tb = list((workdir / "tensorboard").glob("events*"))
    assert tb and b"eval/perplexity" in b"".join(p.read_bytes() for p in tb)
    assert b"eval/bits_per_byte" in b"".join(p.read_bytes() for p in tb)


def test_load_gives_the_trained_model_and_the_run_tokenizer(run):
    workdir, summary = run
    model, tok, config = load(workdir)
    assert config.data.tokenizer == "bpe:384" and tok.vocab_size == 384
    assert isinstance(model, MoETransformer) and model.config.vocab_size == 384
    text = "def loads(s):"
    assert tok.decode(tok.encode(text, add_eos=False)) == text
    # The sample the run printed came from this model: greedy decoding is reproducible.
    from jaxmp.models import generate
    ids = generate(model, tok.encode(text, add_eos=False), 3, temperature=0.0)
    assert tok.decode(ids).startswith(text)
    with pytest.raises(ValueError, match="step 99 has no checkpoint .* steps: 4"):
        load(workdir, step=99)
    with pytest.raises(ValueError, match="holds no checkpoints directory"):
        load(workdir / "corpus-nope")


def test_export_loads_back_to_the_same_logits(run, tmp_path):
    workdir, _ = run
    out = tmp_path / "export"
    assert export_cli.main(["--workdir", str(workdir), "--out", str(out)]) == 0
    meta = json.loads((out / "config.json").read_text())
    assert meta["tokenizer"] == {"kind": "huggingface", "file": "tokenizer.json",
                                 "vocab_size": 384, "eos_id": 0}
    assert (out / "model.safetensors").is_file() and meta["step"] == 4
    # as readable as config.json: safetensors alone writes its file 0600
    assert os.stat(out / "model.safetensors").st_mode == os.stat(out / "config.json").st_mode
    # A fresh model built here from the exported tensors alone (not via load_export).
    import safetensors.numpy
    tensors = safetensors.numpy.load_file(str(out / "model.safetensors"))
    fresh = nnx.eval_shape(lambda: MoETransformer(ModelConfig.from_config(meta["model"]),
                                                  meta["policy"], rngs=nnx.Rngs(7)))
    graphdef, state = nnx.split(fresh)
    flat = [(p, v.replace(jnp.asarray(tensors[".".join(map(str, p))])))
            for p, v in nnx.to_flat_state(state)]
    fresh = nnx.merge(graphdef, nnx.from_flat_state(flat))
    trained, _, _ = load(workdir)
    x = jnp.asarray(np.random.default_rng(0).integers(0, 384, (2, 32)), jnp.int32)
    logits = nnx.jit(lambda m, x: m(x)[0].astype(jnp.float32))
    want = np.asarray(logits(trained, x))
    np.testing.assert_array_equal(np.asarray(logits(fresh, x)), want)
    again, tok, _ = load_export(out)
    np.testing.assert_array_equal(np.asarray(logits(again, x)), want)
    assert tok.decode(tok.encode("x = 1", add_eos=False)) == "x = 1"


def test_sample_command(run):
    workdir, _ = run
    env = {**os.environ, "PYTHONPATH": str(ROOT), "JAX_PLATFORMS": "cpu"}
    env.pop("XLA_FLAGS", None)
    out = subprocess.run([sys.executable, "-m", "jaxmp.sample", "--workdir", str(workdir),
                          "--prompt", "def ", "--tokens", "5", "--temperature", "0"],
                         capture_output=True, text=True, env=env, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    model, tok, _ = load(workdir)
    from jaxmp.models import generate
    # the command samples only ids the tokenizer has (the model's vocabulary may be padded)
    expected = tok.decode(generate(model, tok.encode("def ", add_eos=False), 5, temperature=0.0,
                                   vocab_limit=tok.vocab_size))
    assert out.stdout == expected + "\n"
    bad = subprocess.run([sys.executable, "-m", "jaxmp.sample", "--workdir", str(workdir / "nope")],
                         capture_output=True, text=True, env=env, timeout=600)
    assert bad.returncode == 2 and "holds no checkpoints directory" in bad.stderr


def test_load_on_a_mesh_gives_the_same_weights_sharded(run):
    """load(num_devices=8): the trained weights on the 8-device mesh under the run's own
    layout (dp: every parameter on every device), equal to the host copy bit for bit."""
    import jax

    workdir, _ = run
    host, _, _ = load(workdir)
    meshed, _, config = load(workdir, num_devices=8)
    on_mesh = jax.tree.leaves(nnx.state(meshed, nnx.Param))
    assert on_mesh and all(len(x.sharding.device_set) == 8 for x in on_mesh)
    for a, b in zip(jax.tree.leaves(nnx.state(host, nnx.Param)), on_mesh):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(jax.device_get(b)))
