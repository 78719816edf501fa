"""jaxmp installs without its trainer, and ``import jaxmp`` stays light (issue 29, point 5).

The core (``pip install jaxmp``) depends on jax, flax, optax, jmp and numpy; the ``train``
extra adds the trainer's dependencies (orbax, grain, ml_collections, tqdm, tensorboardX,
tokenizers, sentencepiece, safetensors, jinja2, pyarrow). flax itself depends on orbax-checkpoint, so orbax
arrives with the core all the same; the others must not.
"""
import json
import os
import pathlib
import re
import shutil
import subprocess
import sys
import textwrap

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
# The train extra's distributions and the module each installs; orbax comes with flax.
TRAIN_ONLY = {"grain": "grain", "ml_collections": "ml_collections", "tqdm": "tqdm",
              "tensorboardX": "tensorboardX", "tokenizers": "tokenizers",
              "sentencepiece": "sentencepiece", "safetensors": "safetensors", "jinja2": "jinja2",
              "pyarrow": "pyarrow"}
TRAIN_MODULES = sorted(set(TRAIN_ONLY.values()) | {"orbax", "torch", "transformers"})
# A pip that cannot reach an index says one of these: the test is then skipped, not failed.
OFFLINE = re.compile(r"Could not find a version|No matching distribution|Failed to establish|"
                     r"NewConnectionError|Temporary failure in name resolution|"
                     r"Network is unreachable")


def test_import_jaxmp_loads_none_of_the_trainers_dependencies():
    code = ("import json, sys, jaxmp, jaxmp.models, jaxmp.sharding, jaxmp.analysis\n"
            "print(json.dumps(sorted({m.split('.')[0] for m in sys.modules})))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=300, cwd=ROOT,
                          env=dict(os.environ, PYTHONPATH=str(ROOT), JAX_PLATFORMS="cpu"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    loaded = set(json.loads(proc.stdout.splitlines()[-1]))
    assert "jax" in loaded and "flax" in loaded  # the probe saw the imports
    assert not loaded & set(TRAIN_MODULES), sorted(loaded & set(TRAIN_MODULES))


def test_the_core_lists_no_trainer_dependency_and_the_train_extra_lists_them_all():
    try:
        import tomllib
    except ImportError:  # Python 3.10
        tomllib = pytest.importorskip("tomli")
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    name = lambda spec: re.match(r"[A-Za-z0-9_.\-]+", spec).group(0)  # noqa: E731
    # jmp is the test extra's: jaxmp recognises jmp objects without importing jmp
    assert sorted(name(s) for s in project["dependencies"]) == ["flax", "jax", "numpy", "optax"]
    assert "jmp" in {name(s) for s in project["optional-dependencies"]["test"]}
    extra = {name(s) for s in project["optional-dependencies"]["train"]}
    # orbax-checkpoint and absl-py (train.py's flags) are listed too; flax brings both
    # into a core install anyway, so the core venv is not checked for them
    assert extra == set(TRAIN_ONLY) | {"orbax-checkpoint", "absl-py"}


# Run in the fresh venv: policies, loss scales, optim and fp8 against hand arithmetic.
_CORE_USE = textwrap.dedent("""
    import importlib.util, json, sys
    import numpy as np
    import jax, jax.numpy as jnp, optax
    import jaxmp
    from jaxmp import fp8, optim

    policy = jaxmp.get_policy("mixed_fp16")
    assert (policy.param_dtype, policy.compute_dtype, policy.output_dtype) == (
        jnp.float32, jnp.float16, jnp.float32)
    assert policy.cast_to_compute(jnp.ones(3, jnp.float32)).dtype == jnp.float16

    # loss = sum(w * x); grads of the scaled loss are 1024 x; SGD(0.5) on the unscaled grads.
    scale = jaxmp.DynamicLossScale(loss_scale=2.0 ** 10, growth_interval=2000)
    params = {"w": jnp.array([1.0, 2.0, 3.0], jnp.float32)}
    x = np.array([0.5, -1.0, 2.0], np.float32)
    tx = optax.sgd(0.5)
    grads = jax.grad(lambda p: scale.scale(jnp.sum(p["w"] * x)))(params)
    assert np.array_equal(np.asarray(grads["w"]), 1024.0 * x)
    good = optim.apply_gradients(tx, grads, tx.init(params), params, scale)
    assert np.array_equal(np.asarray(good.params["w"]), np.array([0.75, 2.5, 2.0], np.float32))
    bad = optim.apply_gradients(tx, {"w": jnp.array([np.inf, 0.0, 0.0], jnp.float32)},
                                tx.init(params), params, scale)
    assert np.array_equal(np.asarray(bad.params["w"]), np.array([1.0, 2.0, 3.0], np.float32))
    assert float(bad.loss_scale.loss_scale) == 512.0  # backed off by the default 0.5

    # FP8 (DeepSeek-V3 blocks): 1 and 0.01 are each their block's amax, quantized to 448;
    # y = 256 * 1 * 0.01 = 2.56, returned in bfloat16.
    xa = jnp.ones((4, 256), jnp.bfloat16)
    w = jnp.full((256, 64), 0.01, jnp.float32)
    y = fp8.dot(xa, w, fp8.Recipe.blockwise())
    assert y.dtype == jnp.bfloat16 and y.shape == (4, 64)
    assert np.allclose(np.asarray(y, np.float64), 2.56, rtol=2.0 ** -7)
    q, s = fp8.quantize_blocks(w, (128, 128))
    assert q.dtype == jnp.float8_e4m3fn and s.shape == (2, 1)
    assert np.array_equal(np.asarray(q, np.float32), np.full((256, 64), 448.0, np.float32))
    assert np.allclose(np.asarray(s, np.float64), 0.01 / 448, rtol=1e-6)

    print(json.dumps({"jaxmp": jaxmp.__file__,
                      "loaded": sorted({m.split(".")[0] for m in sys.modules}),
                      "installed": {m: importlib.util.find_spec(m) is not None
                                    for m in %r}}))
""" % sorted(set(TRAIN_ONLY.values())))


def test_the_wheel_installs_only_the_core_and_its_precision_tools_work(tmp_path):
    pytest.importorskip("setuptools", reason="building the wheel without isolation needs it")
    src = tmp_path / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)
    shutil.copytree(ROOT / "jaxmp", src / "jaxmp",
                    ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    wheels = tmp_path / "wheels"
    build = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps",
                            "--no-build-isolation", "-q", "-w", str(wheels), str(src)],
                           capture_output=True, text=True, timeout=300)
    assert build.returncode == 0, build.stderr[-3000:]
    (wheel,) = wheels.glob("jaxmp-*.whl")
    venv = tmp_path / "venv"
    # A venv without pip of its own, filled by this interpreter's pip (``--python``), and no
    # byte-compiling of what it installs (Python compiles what is imported): 10 instead of
    # 28 seconds on 2 cores, and the same resolution of the wheel's dependencies.
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True,
                   timeout=300)
    python = venv / "bin" / "python"
    # No PYTHONPATH: a jaxmp on it (the tests') would count as installed for pip and Python.
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    try:
        install = subprocess.run([sys.executable, "-m", "pip", "--python", str(python),
                                  "install", "-q", "--no-compile", str(wheel)],
                                 capture_output=True, text=True, timeout=900, cwd=tmp_path,
                                 env=env)
    except subprocess.TimeoutExpired:
        pytest.skip("pip install of the core took over 15 minutes (a slow or absent index)")
    if install.returncode != 0 and OFFLINE.search(install.stdout + install.stderr):
        pytest.skip("no package index reachable: "
                    + OFFLINE.search(install.stdout + install.stderr).group(0))
    assert install.returncode == 0, install.stderr[-3000:]
    run = subprocess.run([str(python), "-c", _CORE_USE], capture_output=True, text=True,
                         timeout=300, cwd=tmp_path, env=dict(env, JAX_PLATFORMS="cpu"))
    assert run.returncode == 0, run.stderr[-3000:]
    report = json.loads(run.stdout.splitlines()[-1])
    assert report["jaxmp"].startswith(str(venv))  # the wheel's copy, not the tests'
    assert not any(report["installed"].values()), report["installed"]
    assert not set(report["loaded"]) & set(TRAIN_MODULES)
