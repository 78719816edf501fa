"""Memory per device of the released models' training step, from XLA's GPU compiler.

Usage::

    python benchmarks/released_memory.py --out benchmarks/released_memory   # deviceless GPU
    python benchmarks/released_memory.py --toy --out /tmp/released_memory  # CPU, toy sizes

For each ``configs/hf/*.json`` (the config.json of a released checkpoint, copied into a
temporary folder as ``config.json``), each strategy (``parallel.strategy`` dp, zero1,
fsdp, and for a model with routed experts fsdp with ``parallel.expert`` = the devices,
i.e. every device holds 1/8 of each MoE layer's experts) and each policy (mixed_bf16 and
fp8_blockwise, router and norms float32 as ``configs/finetune.py`` has them; with
``--policies lora_bf16,lora_fp8`` also rank-16 LoRA over a frozen bfloat16 or E4M3 base,
:data:`LORA_POLICIES`), it builds
the trainer's config as ``train.py --config configs/finetune.py
--config.model.init_from=DIR`` does (scanned layers, ``model.remat=full``,
``model.attention=auto``: cuDNN's fused attention on the GPU), compiles the trainer's own
``Experiment.train_step`` for 8 x H100 and 8 x H200 without a GPU
(:func:`jaxmp.analysis.gpu.compile_step`) and reads the bytes per device from XLA's
``memory_analysis()`` (:func:`jaxmp.analysis.gpu.step_memory`: arguments + outputs -
aliased + temporaries; it fits within :data:`jaxmp.analysis.gpu.FIT_MARGIN` of the
device). Each target is compiled on its own: XLA's GPU compiler reads the target's memory
size and bandwidth (its rematerialization limit and fusion cost model), and the two
programs' temporaries differ (by 16 MB for Llama-3.1-8B fsdp mixed_bf16).

The batch is ``--per_device_batch`` (default 1) sequences of ``--seq_len`` (default 4096)
tokens per device; expert parallelism exchanges fixed-size slots, at
``--capacity_factor`` (default 1.25). No weights are read: the step is compiled from
the config.json alone. A case the trainer refuses or XLA cannot compile is written with
the reason in one phrase. These are compiles, not timings: no autotuning, no cuDNN
workspace, no allocator or NCCL buffers (:data:`jaxmp.analysis.gpu.CAVEATS`).

It writes ``OUT.json`` (one record per case, rewritten after each case, so a long run
that is stopped keeps what it compiled; ``--resume`` skips the cases already there and
keeps those this run does not ask for, so that a long run can be done in steps) and
``OUT.md`` (one row per model and strategy, one column per policy and target; the LoRA
policies in a table of their own).

``--toy`` shrinks every config.json (2 layers, width 64, 8 experts, vocabulary 256,
sequences of 64 tokens) and compiles the same trainer step for 8 host CPU devices, so
that the script runs on any machine in seconds (``tests/test_released_memory.py``).
Toy bytes are the CPU program's and say nothing about a GPU; ``fits`` is still judged
against the targets' capacities.
"""
from __future__ import annotations

import argparse
import json
import os
import pathlib
import resource
import sys
import tempfile
import time
from typing import Dict, List, Optional, Sequence

if __package__ in (None, ""):  # run as `python benchmarks/released_memory.py`
    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

ROOT = pathlib.Path(__file__).resolve().parents[1]
HF_CONFIGS = ROOT / "configs" / "hf"
DEVICES = 8
POLICIES = {"mixed_bf16": "mixed_bf16; router: fp32; norm: fp32",
            "fp8_blockwise": "fp8_blockwise; router: fp32; norm: fp32"}
# LoRA (--policies lora_bf16,lora_fp8; not run by default): mixed_bf16 with rank-16
# adapters on attention, dense MLPs and shared experts (jaxmp.models.lora's default
# targets, the routed experts left out) over a frozen base in bfloat16 or E4M3 with
# 128 x 128 block scales (lora.base), the router biases frozen with it.
LORA_POLICIES = {"lora_bf16": "bfloat16", "lora_fp8": "fp8"}
ALL_POLICIES = {**POLICIES, **{name: POLICIES["mixed_bf16"] for name in LORA_POLICIES}}
STRATEGIES = ("dp", "zero1", "fsdp", "expert")  # "expert": fsdp with parallel.expert = DEVICES
TARGETS = ("H100", "H200")

# --toy: config.json fields replaced where the file has them (width 64, 2 layers of which
# the first dense where the family has dense layers, 8 experts of which 2 per token, one
# linear-attention layer where the family has them).
TOY_FIELDS = {"hidden_size": 64, "intermediate_size": 128, "moe_intermediate_size": 32,
              "num_hidden_layers": 2, "num_attention_heads": 4, "head_dim": 16,
              "vocab_size": 256, "n_routed_experts": 8, "num_experts": 8,
              "num_local_experts": 8, "num_experts_per_tok": 2, "first_k_dense_replace": 1,
              "kv_lora_rank": 16, "qk_nope_head_dim": 16, "qk_rope_head_dim": 8,
              "v_head_dim": 16, "linear_num_key_heads": 2,
              "linear_num_value_heads": 4, "linear_key_head_dim": 16,
              "linear_value_head_dim": 16}


def toy_config_json(hf: dict) -> dict:
    """``hf`` (a config.json) at toy size (:data:`TOY_FIELDS`), the architecture kept: GQA
    stays GQA (2 key/value heads) and MHA stays MHA, MLA keeps its low-rank query where
    it has one, group-limited routing keeps 4 groups of which 2 are picked. A multimodal
    wrapper's ``text_config`` is made toy-sized whole (every shape field set, the ones it
    leaves to transformers' defaults included). Layer kinds are kept: ``layer_types``
    gives the toy its first two kinds (GPT-OSS's sliding then full layer), a
    ``full_attention_interval`` of 2 one linear and one full layer (Qwen3-Next), a
    ``sliding_window_pattern`` of 2 one local and one global layer (Gemma 3)."""
    if isinstance(hf.get("text_config"), dict):
        from jaxmp.models import hf as hf_module

        f = hf_module.config_from_hf(hf)  # the shape as read, defaults filled in
        shapes = {"hidden_size": f["d_model"], "intermediate_size": f["d_ff"],
                  "num_hidden_layers": f["num_layers"], "num_attention_heads": f["num_heads"],
                  "num_key_value_heads": f["num_kv_heads"], "head_dim": f["head_dim"],
                  "vocab_size": f["vocab_size"]}
        return {**hf, "text_config": toy_config_json({**hf["text_config"], **shapes})}
    out = dict(hf)
    for key, value in TOY_FIELDS.items():
        if key in out:
            out[key] = value
    if "num_key_value_heads" in hf:
        mha = hf["num_key_value_heads"] == hf["num_attention_heads"]
        out["num_key_value_heads"] = out["num_attention_heads"] if mha else 2
    if hf.get("q_lora_rank"):
        out["q_lora_rank"] = 32
    if hf.get("n_group", 1) > 1:
        out["n_group"], out["topk_group"] = 4, 2
    if hf.get("layer_types"):  # one layer of each of the first two kinds the file names
        kinds = list(dict.fromkeys(hf["layer_types"]))
        out["layer_types"] = (kinds * 2)[:out["num_hidden_layers"]]
    else:  # or a pattern of period 2, where the family reads one (defaults included)
        from jaxmp.models.hf.families import FAMILIES

        specs = FAMILIES[hf["model_type"]].specs if hf.get("model_type") in FAMILIES else {}
        for key in ("sliding_window_pattern", "full_attention_interval"):
            if key in specs:
                out[key] = 2
    return out


def released_models(names: Optional[Sequence[str]] = None) -> Dict[str, dict]:
    """``{name: config.json}`` of ``configs/hf/*.json`` (``names``: those only), smallest
    first (by width x layers), so that the short compiles come first.

    Raises:
      ValueError: a name with no file, naming the files there are.
    """
    found = {p.stem: json.loads(p.read_text()) for p in sorted(HF_CONFIGS.glob("*.json"))}
    for name in names or ():
        if name not in found:
            raise ValueError(f"--models {name!r}: no configs/hf/{name}.json; allowed: "
                             f"{', '.join(found)}")
    chosen = {n: c for n, c in found.items() if not names or n in names}

    from jaxmp.models import hf

    def size(config):  # read as jaxmp reads it (a wrapper's text_config, defaults filled)
        fields = hf.config_from_hf(config)
        return fields["d_model"] * fields["num_layers"]

    return dict(sorted(chosen.items(), key=lambda nc: size(nc[1])))


def case_overrides(folder: str, policy: str, strategy: str, batch: int, seq_len: int,
                   capacity_factor: float) -> List[str]:
    """The ``--config.KEY=VALUE`` overrides of one case, on top of configs/finetune.py."""
    from jaxmp.analysis.accounting import LORA_RANK

    out = [f"--config.model.init_from={folder}",
           f"--config.precision.policy={ALL_POLICIES[policy]}",
           f"--config.train.batch_size={batch}", f"--config.data.seq_len={seq_len}"]
    if policy in LORA_POLICIES:
        out += [f"--config.lora.rank={LORA_RANK}", f"--config.lora.base={LORA_POLICIES[policy]}",
                "--config.model.bias_update_rate=0.0"]
    if strategy == "expert":
        out += ["--config.parallel.strategy=fsdp", f"--config.parallel.expert={DEVICES}",
                f"--config.model.capacity_factor={capacity_factor}"]
    else:
        out.append(f"--config.parallel.strategy={strategy}")
    return out


def _reason(e: BaseException) -> str:
    """One phrase of an exception's message (its first line, at most 160 characters)."""
    text = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    return text if len(text) <= 160 else text[:157] + "..."


def _compile_cpu(config):
    """The trainer's step compiled for 8 host CPU devices (--toy)."""
    import jax

    from jaxmp import sharding
    from jaxmp.train.experiment import Experiment

    mesh = sharding.make_mesh(DEVICES, expert=int(config.parallel.expert),
                              devices=jax.devices("cpu"))
    exp = Experiment.create(config, mesh=mesh)
    return exp, exp.train_step.lower(exp.abstract_state, exp.abstract_batch()).compile()


def run_case(folder: str, policy: str, strategy: str, targets: Sequence[str], *, toy: bool,
             batch: int, seq_len: int, capacity_factor: float) -> List[dict]:
    """One case compiled and measured for each of ``targets`` (module docstring): one
    compile per GPU target (one for all with ``toy``, the CPU program). Never raises for a
    case the trainer refuses or XLA cannot compile: the record's ``error`` says why.

    Returns:
      One record per target: ``policy``, ``strategy``, ``target``, then ``memory``
      (:func:`jaxmp.analysis.gpu.step_memory`), ``params``, ``active_params``,
      ``attention`` (the path ``model.attention=auto`` took), or ``error``; and
      ``compile_s``, ``max_rss_gb`` (this process's peak resident memory so far).
    """
    from jaxmp.analysis import gpu
    from jaxmp.train.config import load_config

    recs, compiled_once = [], None
    for target in targets:
        rec: dict = {"policy": policy, "strategy": strategy, "target": target}
        gpu_target = gpu.get_target(target)
        start = time.perf_counter()
        try:
            config = load_config("configs/finetune.py",
                                 case_overrides(folder, policy, strategy, batch, seq_len,
                                                capacity_factor))
            if toy:
                compiled_once = compiled_once or _compile_cpu(config)
                (exp, compiled), path = compiled_once, "reference (CPU)"
            else:
                step = gpu.compile_step(config, gpu_target, DEVICES)
                exp, compiled = step.experiment, step.compiled
                path = gpu._attention_path(exp)
            rec["memory"] = gpu.step_memory(compiled, gpu_target.memory_bytes)
            rec["params"], rec["active_params"] = (int(n) for n in exp.param_counts)
            rec["attention"] = path
        except Exception as e:  # noqa: BLE001 - a case that cannot compile is a row
            rec["error"] = _reason(e)
        rec["compile_s"] = round(time.perf_counter() - start, 1)
        rec["max_rss_gb"] = round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6, 2)
        recs.append(rec)
    return recs


def _key(model: str, rec: dict) -> tuple:
    return model, rec["policy"], rec["strategy"], rec["target"]


def _size(nbytes: float) -> str:
    return f"{nbytes / 1e9:.2f} GB" if nbytes >= 1e8 else f"{nbytes / 1e6:.3f} MB"


def _count(n: int) -> str:
    return f"{n / 1e9:.1f}B" if n >= 1e8 else f"{n / 1e3:.0f}k"


def _cell(rec: Optional[dict]) -> str:
    if rec is None:
        return "not compiled"
    if "error" in rec:
        return f"does not compile: {rec['error']}"
    mem = rec["memory"]
    gb = f"**{_size(mem['total_bytes'])}**"
    return f"{gb} fits" if mem["fits"] else f"{gb}: does not fit"


def _strategy_name(strategy: str) -> str:
    return f"fsdp + expert {DEVICES}" if strategy == "expert" else strategy


def markdown(report: dict) -> str:
    """The table of :func:`main`'s report: one row per model and strategy."""
    s = report["setup"]
    by = {_key(r["model"], r): r for r in report["cases"]}
    policies, targets = s["policies"], s["targets"]
    head = (f"Bytes per device of the trainer's step, {DEVICES} devices, "
            f"{s['per_device_batch']} x {s['seq_len']} tokens per device, "
            + ("toy sizes compiled for the CPU" if s["toy"] else
               "compiled deviceless by XLA's GPU compiler")
            + f"; fits = at most {s['fit_margin']:.0%} of the device "
              f"({', '.join(f'{t} {b / 1e9:.1f} GB' for t, b in s['device_bytes'].items())})")
    lines = [head]
    # One table of full training, one of LoRA (only the models with a case in it).
    for group in ([p for p in policies if p not in LORA_POLICIES],
                  [p for p in policies if p in LORA_POLICIES]):
        if not group:
            continue
        cols = [f"{p} {DEVICES} x {t}" for p in group for t in targets]
        lines += ["", "| model | parameters (active) | strategy | " + " | ".join(cols) + " |",
                  "| --- | --- | --- | " + " | ".join("---" for _ in cols) + " |"]
        for model in s["models"]:
            recs = [r for r in report["cases"] if r["model"] == model and "params" in r
                    and r["policy"] in group]  # a LoRA model counts its adapters
            if not any(r["policy"] in group for r in report["cases"] if r["model"] == model):
                continue
            size = (f"{_count(recs[0]['params'])} ({_count(recs[0]['active_params'])})"
                    if recs else "")
            for strategy in s["strategies"]:
                row = [by.get((model, p, strategy, t)) for p in group for t in targets]
                if strategy == "expert" and not any(row) and report["moe"].get(model) is False:
                    continue  # a dense model has no expert parallelism
                lines.append(f"| {model} | {size} | {_strategy_name(strategy)} | "
                             + " | ".join(_cell(r) for r in row) + " |")
    return "\n".join(lines) + "\n"


def _write(out: str, report: dict) -> None:
    path = pathlib.Path(out)
    path.parent.mkdir(parents=True, exist_ok=True)
    pathlib.Path(f"{out}.json").write_text(json.dumps(report, indent=2) + "\n")
    pathlib.Path(f"{out}.md").write_text(markdown(report))


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", required=True, help="writes OUT.json and OUT.md")
    p.add_argument("--toy", action="store_true", help="toy sizes, compiled for 8 CPU devices")
    p.add_argument("--models", default="", help="comma-separated configs/hf names (default all)")
    p.add_argument("--policies", default=",".join(POLICIES),
                   help=f"comma-separated, of {', '.join(ALL_POLICIES)} (default: "
                        f"{','.join(POLICIES)})")
    p.add_argument("--strategies", default=",".join(STRATEGIES))
    p.add_argument("--targets", default=",".join(TARGETS))
    p.add_argument("--per_device_batch", type=int, default=1)
    p.add_argument("--seq_len", type=int, default=None, help="default 4096 (--toy: 64)")
    p.add_argument("--capacity_factor", type=float, default=1.25)
    p.add_argument("--resume", action="store_true", help="skip the cases OUT.json already has")
    return p


def _choices(flag: str, value: str, allowed: Sequence[str]) -> List[str]:
    items = [v for v in value.split(",") if v]
    for v in items:
        if v not in allowed:
            raise ValueError(f"--{flag} {v!r}: allowed: {', '.join(allowed)}")
    return items


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    from jaxmp.analysis.report import output_problem

    try:
        policies = _choices("policies", args.policies, tuple(ALL_POLICIES))
        strategies = _choices("strategies", args.strategies, STRATEGIES)
        targets = _choices("targets", args.targets, TARGETS)
        models = released_models([m for m in args.models.split(",") if m])
        if args.per_device_batch < 1:
            raise ValueError(f"--per_device_batch must be >= 1, got {args.per_device_batch}")
        problem = output_problem(f"{args.out}.json")
        if problem:
            raise ValueError(problem)
    except ValueError as e:
        parser.error(str(e))
    seq_len = args.seq_len or (64 if args.toy else 4096)
    if args.toy:  # 8 host CPU devices, set before JAX starts its CPU backend
        flags = os.environ.get("XLA_FLAGS", "")
        if "xla_force_host_platform_device_count" not in flags:
            os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={DEVICES}"
    import jax

    if not args.toy and "JAX_PLATFORMS" not in os.environ:  # the CUDA plugin: CPU platform
        jax.config.update("jax_platforms", "cpu")
    from jaxmp.analysis import gpu

    if not args.toy:
        problem = gpu.plugin_problem()
        if problem:
            parser.error(f"deviceless GPU compiles need XLA's GPU compiler: {problem} "
                         f"(or run with --toy)")
    elif jax.device_count("cpu") < DEVICES:
        parser.error(f"--toy needs {DEVICES} CPU devices; JAX started with "
                     f"{jax.device_count('cpu')} (XLA_FLAGS sets fewer)")
    report = {"setup": {"devices": DEVICES, "toy": args.toy, "models": list(models),
                        "policies": policies,
                        "policy_strings": {p: ALL_POLICIES[p] for p in policies},
                        "strategies": strategies, "targets": targets,
                        "per_device_batch": args.per_device_batch, "seq_len": seq_len,
                        "capacity_factor": args.capacity_factor, "config": "configs/finetune.py",
                        "fit_margin": gpu.FIT_MARGIN, "jax": jax.__version__,
                        "device_bytes": {t: gpu.get_target(t).memory_bytes for t in targets}},
              "moe": {}, "cases": []}
    done = {}
    if args.resume and os.path.isfile(f"{args.out}.json"):
        old = json.loads(pathlib.Path(f"{args.out}.json").read_text())
        for field in ("devices", "toy", "per_device_batch", "seq_len", "capacity_factor"):
            if old["setup"][field] != report["setup"][field]:
                parser.error(f"--resume: {args.out}.json has {field}={old['setup'][field]!r}, "
                             f"this run {report['setup'][field]!r}")
        done = {_key(r["model"], r): r for r in old["cases"]}
        report["moe"].update(old.get("moe", {}))
        setup = report["setup"]  # the table shows the old cases too, in the canonical order
        sizes = {n: i for i, n in enumerate(released_models())}
        for field, order in (("models", sizes), ("policies", tuple(ALL_POLICIES)),
                             ("strategies", STRATEGIES), ("targets", TARGETS)):
            union = set(setup[field]) | set(old["setup"][field])
            setup[field] = sorted(union, key=list(order).index)
        setup["device_bytes"] = {**old["setup"]["device_bytes"], **setup["device_bytes"]}
        setup["policy_strings"] = {**old["setup"].get("policy_strings", {}),
                                   **setup["policy_strings"]}
    # done: the earlier cases not yet visited (each written, so that a stopped run loses none)
    with tempfile.TemporaryDirectory() as tmp:
        folders = {}
        for name, hf in models.items():
            folders[name] = os.path.join(tmp, name)
            os.makedirs(folders[name])
            with open(os.path.join(folders[name], "config.json"), "w") as f:
                json.dump(toy_config_json(hf) if args.toy else hf, f)
            report["moe"][name] = any(k in hf for k in ("n_routed_experts", "num_experts",
                                                          "num_local_experts"))
        # Policy first, then model (smallest first), strategy, target: a stopped run has
        # every model's mixed_bf16 rows before any fp8_blockwise one.
        for policy in policies:
            for name in models:
                for strategy in strategies:
                    if strategy == "expert" and not report["moe"][name]:
                        continue
                    todo = [t for t in targets if (name, policy, strategy, t) not in done]
                    recs = run_case(folders[name], policy, strategy, todo, toy=args.toy,
                                    batch=DEVICES * args.per_device_batch, seq_len=seq_len,
                                    capacity_factor=args.capacity_factor) if todo else []
                    new = {r["target"]: {"model": name, **r} for r in recs}
                    for target in targets:
                        rec = new.get(target) or done.pop((name, policy, strategy, target))
                        if target in new:
                            print(json.dumps(rec), flush=True)
                        report["cases"].append(rec)
                    # the done cases this loop has not reached yet are written too
                    _write(args.out, {**report, "cases": report["cases"] + list(done.values())})
    report["cases"] += list(done.values())  # the earlier cases this run did not ask for
    _write(args.out, report)
    print(markdown(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
