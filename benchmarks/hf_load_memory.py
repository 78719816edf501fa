"""Peak host memory of ``jaxmp.models.from_pretrained`` against the checkpoint's size.

Usage::

    python benchmarks/hf_load_memory.py --json hf_load_memory.json
    python benchmarks/hf_load_memory.py --layers 2,8 --d-model 128 --vocab 1024   # toy

For each layer count it writes a Llama checkpoint (float32 random tensors, one shard per
layer with ``model.safetensors.index.json``, as transformers shards) of fixed width, so
the model grows with the layer count while its largest tensor stays the same. A fresh
Python process per checkpoint loads it with ``from_pretrained(dir, "fp32")`` after a
warm-up load of a one-layer checkpoint (JAX's backend and the tracing machinery are then
in memory), and reports its peak resident set (on Linux ``VmHWM`` of ``/proc/self/status``, elsewhere
``resource.getrusage(...).ru_maxrss``: the kernel's high-water mark, file-backed pages of memory-mapped files included) against
its resident set just before the load (``/proc/self/statm``). ``ru_maxrss`` is not
used on Linux: it keeps the parent's high-water mark across fork and exec (a test
worker's gigabytes). On Linux the high-water
mark is first reset to the current resident set (``/proc/self/clear_refs``), so that the
warm-up's own peak cannot hide the load's; elsewhere ``stale_peak`` says by how much an
earlier peak exceeded the resident set before the load.

On a CPU the loaded parameters themselves live in host memory, so the peak growth is at
least the model's bytes. What a streaming load adds on top (``overhead = growth - model
bytes``) should stay near the largest tensor (one slice read, transposed and cast at a
time), not grow with the model: a loader that read whole files or kept their memory-mapped
pages resident would add about the model's bytes again.
"""
from __future__ import annotations

import argparse
import json
import os
import pathlib
import platform
import subprocess
import sys
import tempfile
from typing import Dict, List

import numpy as np

ROOT = pathlib.Path(__file__).resolve().parents[1]

_MEASURE = r"""
import json, os, resource, sys
import jax
from jaxmp.models import from_pretrained

def rss_now():
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:
        return peak()

def peak():
    try:  # Linux: this process's own high-water mark (VmHWM, reset by clear_refs)
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return kb if sys.platform == "darwin" else kb * 1024

jax.block_until_ready(jax.tree.leaves(from_pretrained(sys.argv[1], "fp32")))  # warm-up
try:  # Linux: reset the high-water mark to the current resident set
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    reset = True
except OSError:
    reset = False
before = rss_now()
stale = max(0, peak() - before)  # an earlier peak the load must exceed to be seen
model = from_pretrained(sys.argv[2], "fp32")
jax.block_until_ready(jax.tree.leaves(model))
print(json.dumps({"rss_before": before, "peak": peak(), "hwm_reset": reset,
                  "stale_peak": stale}))
"""


def write_llama(path: pathlib.Path, num_layers: int, d_model: int, d_ff: int, vocab: int,
                seed: int = 0) -> Dict[str, int]:
    """A float32 Llama checkpoint (``config.json``, one shard per layer and one for the
    embeddings, norm and head, ``model.safetensors.index.json``) of random tensors.

    Returns:
      ``{"model_bytes", "largest_tensor_bytes", "tensors"}``.
    """
    from safetensors.numpy import save_file

    path.mkdir(parents=True, exist_ok=True)
    heads = max(1, d_model // 64)
    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama",
              "vocab_size": vocab, "hidden_size": d_model, "intermediate_size": d_ff,
              "num_hidden_layers": num_layers, "num_attention_heads": heads,
              "num_key_value_heads": heads, "max_position_embeddings": 256,
              "rms_norm_eps": 1e-6, "tie_word_embeddings": False, "torch_dtype": "float32"}
    (path / "config.json").write_text(json.dumps(config))
    rng = np.random.default_rng(seed)
    shards: List[Dict[str, np.ndarray]] = [{
        "model.embed_tokens.weight": (vocab, d_model), "model.norm.weight": (d_model,),
        "lm_head.weight": (vocab, d_model)}]
    for i in range(num_layers):
        p = f"model.layers.{i}"
        shards.append({f"{p}.input_layernorm.weight": (d_model,),
                       f"{p}.post_attention_layernorm.weight": (d_model,),
                       **{f"{p}.self_attn.{x}_proj.weight": (d_model, d_model) for x in "qkvo"},
                       f"{p}.mlp.gate_proj.weight": (d_ff, d_model),
                       f"{p}.mlp.up_proj.weight": (d_ff, d_model),
                       f"{p}.mlp.down_proj.weight": (d_model, d_ff)})
    weight_map, total, largest = {}, 0, 0
    for j, shapes in enumerate(shards):
        name = f"model-{j + 1:05d}-of-{len(shards):05d}.safetensors"
        tensors = {k: (0.02 * rng.standard_normal(s)).astype(np.float32)
                   for k, s in shapes.items()}
        save_file(tensors, str(path / name), metadata={"format": "pt"})
        for k, t in tensors.items():
            weight_map[k] = name
            total += t.nbytes
            largest = max(largest, t.nbytes)
    (path / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {"total_size": total}, "weight_map": weight_map}))
    return {"model_bytes": total, "largest_tensor_bytes": largest, "tensors": len(weight_map)}


def measure(warm: pathlib.Path, path: pathlib.Path, timeout: float = 900) -> Dict[str, int]:
    """Loads ``path`` in a fresh process (after a warm-up load of ``warm``); returns
    ``{"rss_before", "peak", "stale_peak"}`` in bytes and ``hwm_reset``.

    Raises:
      RuntimeError: the process failed (its last line of stderr named).
    """
    env = {**os.environ, "JAX_PLATFORMS": "cpu",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT),
                                                       os.environ.get("PYTHONPATH")]))}
    proc = subprocess.run([sys.executable, "-c", _MEASURE, str(warm), str(path)], env=env,
                          capture_output=True, text=True, timeout=timeout)
    if proc.returncode:
        tail = (proc.stderr.strip().splitlines() or ["(no output)"])[-1]
        raise RuntimeError(f"loading {path} failed: {tail}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def run(layers: List[int], d_model: int, d_ff: int, vocab: int, workdir: pathlib.Path) -> dict:
    """One row per layer count: sizes, peak growth and overhead (bytes and MB)."""
    warm = workdir / "warm"
    write_llama(warm, 1, 64, 128, 256)
    rows = []
    for n in layers:
        path = workdir / f"llama_{n}"
        sizes = write_llama(path, n, d_model, d_ff, vocab)
        got = measure(warm, path)
        growth = got["peak"] - got["rss_before"]
        rows.append({"layers": n, **sizes, **got, "growth": growth,
                     "overhead": growth - sizes["model_bytes"]})
    return {"setup": {"d_model": d_model, "d_ff": d_ff, "vocab": vocab, "layers": layers,
                      "machine": f"{platform.machine()}, {os.cpu_count()} CPUs",
                      "python": platform.python_version()},
            "rows": rows}


def format_table(result: dict) -> str:
    """:func:`run`'s rows as the Markdown table of benchmarks/README.md (MB = 10**6 bytes)."""
    mb = 1e6
    lines = ["| layers | model MB | largest tensor MB | peak growth MB | overhead MB "
             "(growth - model) | overhead / largest tensor |",
             "| --- | --- | --- | --- | --- | --- |"]
    for r in result["rows"]:
        lines.append(f"| {r['layers']} | {r['model_bytes'] / mb:.1f} | "
                     f"{r['largest_tensor_bytes'] / mb:.1f} | {r['growth'] / mb:.1f} | "
                     f"{r['overhead'] / mb:.1f} | "
                     f"{r['overhead'] / r['largest_tensor_bytes']:.2f} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--layers", default="2,4,8,16", help="comma-separated layer counts")
    p.add_argument("--d-model", type=int, default=512)
    p.add_argument("--d-ff", type=int, default=1408)
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--json", default="", help="write the result here")
    p.add_argument("--workdir", default="", help="where the checkpoints go (default: a "
                                                 "temporary directory, removed)")
    args = p.parse_args(argv)
    try:
        layers = [int(x) for x in args.layers.split(",")]
        if not layers or min(layers) < 1:
            raise ValueError
    except ValueError:
        p.error(f"--layers {args.layers!r}: comma-separated integers >= 1")
    with tempfile.TemporaryDirectory() as tmp:
        result = run(layers, args.d_model, args.d_ff, args.vocab,
                     pathlib.Path(args.workdir or tmp))
    result["setup"]["command"] = " ".join(["python", "benchmarks/hf_load_memory.py"]
                                          + list(argv if argv is not None else sys.argv[1:]))
    print(format_table(result))
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
