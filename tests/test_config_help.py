"""One table of config keys for default_config(), train.py --help and docs/CONFIG.md, and
the shipped configs from any directory (issue 21, point 8)."""
import os
import pathlib
import subprocess
import sys

from jaxmp.train import keys
from jaxmp.train.config import default_config, flat_keys, load_config

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_one_table_for_defaults_and_docs():
    names = [k.name for k in keys.KEYS]
    assert sorted(names) == sorted(flat_keys(default_config())) and len(set(names)) == len(names)
    flat = default_config()
    for k in keys.KEYS:
        node = flat
        for part in k.name.split("."):
            node = node[part]
        assert node == k.default and k.meaning.strip()
    assert (ROOT / "docs" / "CONFIG.md").read_text() == keys.markdown()  # regenerate if not


def test_train_help_lists_every_key_from_another_directory(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(ROOT), "JAX_PLATFORMS": "cpu"}
    out = subprocess.run([sys.executable, str(ROOT / "train.py"), "--help"], cwd=tmp_path,
                         capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    lines = out.stdout.splitlines()
    for k in keys.KEYS:
        line = next(l for l in lines if l.strip().startswith(f"--config.{k.name}="))
        assert f"--config.{k.name}={k.default!r}" in line and k.meaning in line


def test_shipped_configs_load_from_any_directory(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    config = load_config("configs/tiny_moe.py", ["train.steps=3"])
    assert config.train.steps == 3 and config.model.vocab_size == 257
