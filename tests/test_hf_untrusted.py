"""A Hugging Face checkpoint directory from outside is checked, not trusted
(jaxmp.models.hf): a config.json field missing, null, ill-typed, out of range or
non-finite, a tensor the config does not use, of a non-float dtype or holding a NaN, a
weight file named outside the directory, a damaged or non-regular file: each is one
ValueError line naming the field, tensor or file, raised before work is lost.

The checkpoints are written here with safetensors.numpy and a hand-written config.json
(a 2-layer llama of width 8): no torch. Nothing here compiles."""
import ast
import contextlib
import glob
import importlib.util
import json
import os
import signal
import stat
import struct
import types

import numpy as np
import pytest

pytest.importorskip("safetensors", reason="the train extra (safetensors) is not installed")
from safetensors.numpy import save_file  # noqa: E402

from _configs import ROOT  # noqa: E402
from jaxmp.models import ModelConfig, from_pretrained, hf  # noqa: E402
from jaxmp.models.hf import files as hf_files, spec as hf_spec  # noqa: E402

V, D, L, H, KV, HD, FF = 16, 8, 2, 2, 1, 4, 12
LLAMA = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "vocab_size": V,
         "hidden_size": D, "num_hidden_layers": L, "num_attention_heads": H,
         "num_key_value_heads": KV, "intermediate_size": FF, "max_position_embeddings": 32,
         "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "tie_word_embeddings": False}
YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16}
LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
          "high_freq_factor": 4.0, "original_max_position_embeddings": 16}
QWEN3_MOE = {"model_type": "qwen3_moe", "vocab_size": V, "hidden_size": D,
             "num_hidden_layers": L, "num_attention_heads": H, "num_key_value_heads": KV,
             "head_dim": HD, "intermediate_size": FF, "num_experts": 4,
             "num_experts_per_tok": 2, "moe_intermediate_size": 4}
MIXTRAL = {"model_type": "mixtral", "vocab_size": V, "hidden_size": D, "num_hidden_layers": L,
           "num_attention_heads": H, "intermediate_size": FF, "num_local_experts": 4,
           "num_experts_per_tok": 2}
DEEPSEEK_V3 = {"model_type": "deepseek_v3", "vocab_size": V, "hidden_size": D,
               "num_hidden_layers": L, "num_attention_heads": H, "intermediate_size": FF,
               "n_routed_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 4,
               "kv_lora_rank": 4, "q_lora_rank": None, "qk_nope_head_dim": 4,
               "qk_rope_head_dim": 4, "v_head_dim": 4, "n_group": 4, "topk_group": 2}
DEEPSEEK_V2 = {**DEEPSEEK_V3, "model_type": "deepseek_v2", "n_group": None, "topk_group": None}
GLM4_MOE = {"model_type": "glm4_moe", "vocab_size": V, "hidden_size": D, "num_hidden_layers": L,
            "num_attention_heads": H, "head_dim": HD, "intermediate_size": FF,
            "n_routed_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 4}
GEMMA3 = {"model_type": "gemma3_text", "vocab_size": V, "hidden_size": D,
          "num_hidden_layers": L, "num_attention_heads": H, "num_key_value_heads": KV,
          "head_dim": HD, "intermediate_size": FF}
GPT_OSS = {"model_type": "gpt_oss", "vocab_size": V, "hidden_size": D,
           "num_hidden_layers": L, "num_attention_heads": H, "intermediate_size": FF,
           "num_local_experts": 4, "num_experts_per_tok": 2}
FAMILY = {"llama": LLAMA, "qwen3_moe": QWEN3_MOE, "mixtral": MIXTRAL,
          "deepseek_v3": DEEPSEEK_V3, "deepseek_v2": DEEPSEEK_V2, "glm4_moe": GLM4_MOE,
          "gemma3_text": GEMMA3, "gpt_oss": GPT_OSS}


def _one_line(info):
    assert "\n" not in str(info.value), str(info.value)


def _tensors(layers=L, seed=0):
    """A llama checkpoint's tensors (float32, random), ``layers`` layers."""
    rng = np.random.RandomState(seed)
    t = {"model.embed_tokens.weight": (V, D), "model.norm.weight": (D,),
         "lm_head.weight": (V, D)}
    for i in range(layers):
        p = f"model.layers.{i}"
        t.update({f"{p}.input_layernorm.weight": (D,), f"{p}.post_attention_layernorm.weight":
                  (D,), f"{p}.self_attn.q_proj.weight": (H * HD, D),
                  f"{p}.self_attn.k_proj.weight": (KV * HD, D),
                  f"{p}.self_attn.v_proj.weight": (KV * HD, D),
                  f"{p}.self_attn.o_proj.weight": (D, H * HD), f"{p}.mlp.gate_proj.weight":
                  (FF, D), f"{p}.mlp.up_proj.weight": (FF, D),
                  f"{p}.mlp.down_proj.weight": (D, FF)})
    return {k: rng.randn(*s).astype(np.float32) for k, s in t.items()}


def _checkpoint(path, tensors=None, config=None, **fields):
    """A llama checkpoint directory: config.json (LLAMA with ``fields``) and
    model.safetensors (``tensors``, default :func:`_tensors`)."""
    os.makedirs(path, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config or {**LLAMA, **fields}))
    save_file(_tensors() if tensors is None else tensors, str(path / "model.safetensors"))
    return str(path)


def _raw_safetensors(file, tensors):
    """A safetensors file written by hand: ``{name: (dtype name, shape, bytes)}``."""
    header, data = {}, b""
    for name, (dtype, shape, raw) in tensors.items():
        header[name] = {"dtype": dtype, "shape": list(shape),
                        "data_offsets": [len(data), len(data) + len(raw)]}
        data += raw
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    file.write_bytes(struct.pack("<Q", len(text)) + text + data)


_FIFOS = {}  # {path: a read-write descriptor of it} of the FIFOs the running test made


def _mkfifo(file):
    """A FIFO at ``file``, held open read-write by the test: a reader that opens it does
    not block (there is a writer), so a regression fails instead of hanging; _deadline
    also refuses any open of it by jaxmp.models.hf."""
    os.mkfifo(file)
    _FIFOS[os.path.abspath(file)] = os.open(file, os.O_RDWR | os.O_NONBLOCK)


@contextlib.contextmanager
def _deadline(seconds):
    """Fails (instead of hanging) when the block runs past ``seconds`` (SIGALRM), and
    when jaxmp.models.hf opens anything but a regular file (``open`` or ``safe_open``;
    a FIFO blocks, /dev/zero never ends): a non-regular file must be refused from
    ``os.stat`` alone."""
    def expire(signum, frame):
        raise TimeoutError(f"still running after {seconds} s")

    def refuse(file):
        if os.path.exists(file) and not stat.S_ISREG(os.stat(file).st_mode):
            raise AssertionError(f"jaxmp.models.hf opened {file}, not a regular file")

    real_safetensors = hf_files.safetensors_module()

    def guarded_open(file, *args, **kwargs):
        refuse(file)
        return open(file, *args, **kwargs)

    def guarded_safe_open(file, *args, **kwargs):
        refuse(file)
        return real_safetensors.safe_open(file, *args, **kwargs)

    saved = hf_files.safetensors_module
    hf_files.open = guarded_open  # the module's global open, ahead of the builtin
    hf_files.safetensors_module = lambda: types.SimpleNamespace(safe_open=guarded_safe_open,
                                                                numpy=real_safetensors.numpy)
    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
        hf_files.safetensors_module = saved
        del hf_files.open
        for fd in _FIFOS.values():
            os.close(fd)
        _FIFOS.clear()


# ---- 1. config.json fields: required, typed, range-checked ---------------------------------

DROP = object()


@pytest.mark.parametrize("family, change, message", [
    ("llama", dict(num_hidden_layers=DROP), r"num_hidden_layers is missing; it is required"),
    ("llama", dict(num_attention_heads=None), r"num_attention_heads=None is not allowed"),
    ("llama", dict(vocab_size=DROP), r"vocab_size is missing"),
    ("llama", dict(hidden_size=64.0), r"hidden_size=64\.0 is not allowed; allowed: an integer"),
    ("llama", dict(intermediate_size=DROP), r"intermediate_size is missing"),
    ("llama", dict(vocab_size=True), r"vocab_size=True is not allowed"),
    ("llama", dict(num_hidden_layers=0), r"num_hidden_layers=0 is not allowed; allowed: an "
                                         r"integer in \[1, 2147483647\]"),
    ("llama", dict(num_key_value_heads=-1), r"num_key_value_heads=-1 is not allowed"),
    ("llama", dict(max_position_embeddings="32"), r"max_position_embeddings='32' is not"),
    ("llama", dict(rope_theta="1e4"), r"rope_theta='1e4' is not allowed; allowed: a finite "
                                      r"number > 0"),
    ("llama", dict(rms_norm_eps=0), r"rms_norm_eps=0 is not allowed; allowed: a finite number"
                                    r" > 0"),
    ("llama", dict(tie_word_embeddings=1), r"tie_word_embeddings=1 is not allowed; allowed: "
                                           r"True or False"),
    ("llama", dict(mlp_bias=0), r"mlp_bias=0 cannot be represented exactly"),
    ("llama", dict(partial_rotary_factor=0.0), r"partial_rotary_factor=0\.0 is not allowed; "
                                               r"allowed: a finite number in \(0, 1\]"),
    ("llama", dict(partial_rotary_factor=1.5), r"partial_rotary_factor=1\.5 is not allowed"),
    ("llama", dict(rope_scaling={k: v for k, v in LLAMA3.items() if k != "low_freq_factor"}),
     r"rope_scaling\.low_freq_factor is missing \(rope_type llama3 needs it\)"),
    ("llama", dict(rope_scaling={**LLAMA3, "high_freq_factor": 1.0}),
     r"rope_scaling\.high_freq_factor=1\.0 is not allowed"),
    ("llama", dict(rope_scaling={k: v for k, v in YARN.items() if k != "factor"}),
     r"rope_scaling\.factor is missing"),
    ("llama", dict(rope_parameters={"rope_type": "yarn", "factor": "4",
                                    "original_max_position_embeddings": 16}),
     r"rope_parameters\.factor='4' is not allowed"),
    ("qwen3_moe", dict(norm_topk_prob="yes"), r"norm_topk_prob='yes' is not allowed"),
    ("qwen3_moe", dict(moe_intermediate_size=DROP), r"moe_intermediate_size is missing"),
    ("qwen3_moe", dict(num_experts=DROP), r"num_experts is missing"),
    ("qwen3_moe", dict(mlp_only_layers=[0, "1"]), r"mlp_only_layers=\[0, '1'\] is not"),
    ("mixtral", dict(num_experts_per_tok=DROP), r"num_experts_per_tok is missing"),
    ("deepseek_v3", dict(kv_lora_rank=DROP), r"kv_lora_rank is missing"),
    ("deepseek_v3", dict(q_lora_rank=DROP), r"q_lora_rank is missing"),
    ("deepseek_v3", dict(n_routed_experts=DROP), r"n_routed_experts is missing"),
    ("deepseek_v3", dict(first_k_dense_replace="1"), r"first_k_dense_replace='1' is not"),
    ("deepseek_v3", dict(routed_scaling_factor=0.0), r"routed_scaling_factor=0\.0 is not"),
    ("deepseek_v3", dict(rope_interleave="true"), r"rope_interleave='true' is not allowed"),
    ("deepseek_v3", dict(moe_layer_freq=True), r"moe_layer_freq=True cannot be represented"),
    ("deepseek_v3", dict(num_local_experts=4), r"num_local_experts=4 is not allowed; "
                                               r"allowed: n_routed_experts's value 8"),
    ("deepseek_v2", dict(topk_method="group_limited_greedy"),
     r"n_group=None is not allowed; allowed: an integer >= 1 with topk_method "
     r"group_limited_greedy"),
    ("gemma3_text", dict(final_logit_softcapping=30.0),
     r"final_logit_softcapping=30\.0 cannot be represented exactly; allowed: null"),
    ("gemma3_text", dict(use_bidirectional_attention=True),
     r"use_bidirectional_attention=True cannot be represented"),
    ("gemma3_text", dict(hidden_activation="gelu"), r"hidden_activation='gelu' cannot be"),
    ("gemma3_text", dict(query_pre_attn_scalar=0), r"query_pre_attn_scalar=0 is not allowed"),
    ("gemma3_text", dict(tie_word_embeddings=False), r"tie_word_embeddings=False cannot be"),
    ("gemma3_text", dict(sliding_window_pattern=0), r"sliding_window_pattern=0 is not allowed"),
    ("gemma3_text", dict(rope_parameters={"sliding_attention": {"rope_type": "linear",
                                                                "factor": 2.0}}),
     r"rope_parameters\.sliding_attention=.* cannot be represented exactly; allowed: "
     r"\{rope_type: default, rope_theta\}"),
    ("gemma3_text", dict(rope_parameters={"sliding_attention": {"rope_theta": -1.0}}),
     r"rope_parameters\.sliding_attention\.rope_theta=-1\.0 is not allowed"),
    ("gemma3_text", dict(rope_parameters={"full_attention": {"rope_theta": 1e6},
                                          "chunked_attention": {}}),
     r"rope_parameters\.chunked_attention=\{\} cannot be represented"),
    # keys transformers' Gemma 3 ignores, which would have scaled the global layers' RoPE
    ("gemma3_text", dict(rope_scaling={"type": "linear", "factor": 4.0}),
     r"rope_scaling\.type='linear' cannot be represented exactly; allowed: absent"),
    ("gemma3_text", dict(rope_parameters={"rope_type": "linear", "factor": 2.0}),
     r"rope_parameters=.* allowed: keyed by full_attention and sliding_attention"),
    ("gemma3_text", dict(hidden_size=31), r"hidden_size=31 is not allowed; allowed: a multiple "
                                          r"of num_attention_heads"),
    ("gemma3_text", dict(num_hidden_layers=2 ** 31 - 1),
     r"num_hidden_layers=2147483647 is not allowed; allowed: at most 1,048,576 layers"),
    ("qwen3_moe", dict(layer_types=[]), r"layer_types=\[\] is not allowed; allowed: one entry "
                                        r"per layer"),
    ("gpt_oss", dict(num_local_experts=DROP), r"num_local_experts is missing"),
    ("gpt_oss", dict(sliding_window=None), r"sliding_window=None is not allowed"),
    ("llama", dict(rope_scaling={"rope_type": "linear", "factor": 4.0},
                   rope_parameters={"rope_theta": 1000.0}),
     r"rope_parameters\.rope_theta=1000\.0 cannot be represented exactly; allowed: absent, or "
     r"rope_scaling's value \(transformers reads rope_scaling and ignores rope_parameters"),
    ("gpt_oss", dict(swiglu_limit=-1.0), r"swiglu_limit=-1\.0 is not allowed"),
    ("gpt_oss", dict(swiglu_alpha="1.7"), r"swiglu_alpha='1\.7' is not allowed"),
    ("gpt_oss", dict(use_sliding_window=True), r"use_sliding_window=True cannot be "
                                               r"represented exactly; allowed: absent"),
    ("gpt_oss", dict(quantization_config={"quant_method": "fp8"}),
     r"quantization_config=.* cannot be represented exactly; allowed: absent \(jaxmp reads "
     r"unquantized float16, bfloat16 or float32 weights, and mxfp4 ones\)"),
    ("gpt_oss", dict(quantization_config={"quant_method": "mxfp4", "dequantize": False}),
     r"quantization_config\.dequantize=False cannot be represented exactly; allowed: the mxfp4 "
     r"keys quant_method, modules_to_not_convert"),
    ("gpt_oss", dict(quantization_config={"quant_method": "mxfp4",
                                          "modules_to_not_convert": "lm_head"}),
     r"quantization_config\.modules_to_not_convert='lm_head' is not allowed"),
    ("llama", dict(quantization_config={"quant_method": "mxfp4"}),
     r"quantization_config=.* allowed: absent \(jaxmp reads unquantized float16, bfloat16 "
     r"or float32 weights, and fp8 ones\)"),
    ("gpt_oss", dict(rope_parameters={**YARN, "truncate": "no"}),
     r"rope_parameters\.truncate='no' is not allowed"),
    ("gpt_oss", dict(num_hidden_layers=2 ** 31 - 1),
     r"num_hidden_layers=2147483647 is not allowed; allowed: at most 1,048,576 layers"),
    ("glm4_moe", dict(use_qk_norm="no"), r"use_qk_norm='no' is not allowed"),
    ("glm4_moe", dict(n_group=0), r"n_group=0 is not allowed"),
])
def test_config_field_missing_null_or_ill_typed_is_named(family, change, message):
    """Nothing is filled in with jaxmp's defaults: a required field is required, and every
    field has its type and range (ints are not bools, reals are finite)."""
    config = {**FAMILY[family], **change}
    config = {k: v for k, v in config.items() if v is not DROP}
    with pytest.raises(ValueError, match=rf"^config\.json \({family}\): {message}") as info:
        hf.config_from_hf(config)
    _one_line(info)


# ---- 2. what was a traceback is one line ---------------------------------------------------

@pytest.mark.parametrize("family, change, message", [
    ("llama", dict(rope_scaling=[1, 2]), r"rope_scaling=\[1, 2\] is not allowed; allowed: a "
                                         r"JSON object"),
    ("llama", dict(rope_scaling="yarn"), r"rope_scaling='yarn' is not allowed"),
    ("llama", dict(rope_theta=None), r"rope_theta=None is not allowed"),
    ("llama", dict(rope_scaling={**YARN, "original_max_position_embeddings": 0}),
     r"rope_scaling\.original_max_position_embeddings=0 is not allowed"),
    ("llama", dict(rope_scaling={**YARN, "beta_fast": 0}), r"rope_scaling\.beta_fast=0 is not"),
    ("llama", dict(rope_scaling={**YARN, "rope_type": 3}), r"rope_scaling\.rope_type=3 is not"),
    ("llama", dict(layer_types=5), r"layer_types=5 is not allowed"),
    ("llama", dict(rope_theta=float("nan")), r"rope_theta=nan is not a finite number"),
    ("llama", dict(rope_scaling={**YARN, "factor": float("inf")}),
     r"rope_scaling\.factor=inf is not a finite number"),
    ("llama", dict(initializer_range=float("nan")), r"initializer_range=nan is not a finite"),
    ("llama", dict(model_type=["llama"]), r"model_type=\['llama'\] is not supported"),
    ("qwen3_moe", dict(decoder_sparse_step=0), r"decoder_sparse_step=0 is not allowed"),
])
def test_config_faults_that_were_tracebacks_are_one_line(family, change, message):
    with pytest.raises(ValueError, match=message) as info:
        hf.config_from_hf({**FAMILY[family], **change})
    _one_line(info)


@pytest.mark.parametrize("text, message", [
    ("[1, 2]", r"config\.json is a JSON array; allowed: a JSON object"),
    ("null", r"config\.json is null"),
    ("NaN", r"config\.json is the number nan"),
    ('{"model_type": "llama", "rope_theta": NaN}', r"rope_theta=nan is not a finite number"),
    ('{"model_type": "llama", "rope_scaling": {"factor": -Infinity}}',
     r"rope_scaling\.factor=-inf is not a finite number"),
    ('{"model_type": "llama", "mlp_only_layers": [1e999]}',
     r"mlp_only_layers\[0\]=inf is not a finite number"),
    ('{"model_type": "llama",', r"cannot read the checkpoint's config\.json \(Expecting"),
    ("\xff\xfe\x00", r"cannot read the checkpoint's config\.json"),
    ("[" * 100000, r"cannot read the checkpoint's config\.json"),
])
def test_config_json_that_is_not_an_object_of_finite_numbers_is_named(tmp_path, text, message):
    (tmp_path / "config.json").write_bytes(text.encode("latin-1"))
    with pytest.raises(ValueError, match=rf"^{tmp_path}/config\.json: .*{message}") as info:
        from_pretrained(str(tmp_path))
    _one_line(info)


def _transformers_defaults(family):
    """``{field: default}`` of transformers' config class for ``family``, read from the
    source of its configuration_<family>.py (the class's annotated fields, or its
    ``__init__``'s keyword defaults in older versions), without importing it (that imports
    torch: seconds)."""
    spec = importlib.util.find_spec("transformers")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("transformers is not installed")
    # A text model of a multimodal family is declared beside it (gemma3_text in gemma3/).
    folder = family if os.path.isdir(os.path.join(spec.submodule_search_locations[0], "models",
                                                  family)) else family.removesuffix("_text")
    file = os.path.join(spec.submodule_search_locations[0], "models", folder,
                        f"configuration_{folder}.py")
    assert os.path.isfile(file), (f"transformers has no model_type {family!r} ({file}): a "
                                  f"family's module is named after transformers' model_type")
    tree = ast.parse(open(file).read())

    def declares(node):  # the class whose model_type = "<family>"
        return any(isinstance(b, ast.Assign) and isinstance(b.targets[0], ast.Name)
                   and b.targets[0].id == "model_type" and isinstance(b.value, ast.Constant)
                   and b.value.value == family for b in node.body)

    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef)
               and n.name.endswith("Config") and declares(n))
    pairs = []
    for node in cls.body:
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and node.value:
            pairs.append((node.target.id, node.value))
        elif isinstance(node, ast.Assign) and isinstance(node.targets[0], ast.Name):
            pairs.append((node.targets[0].id, node.value))
        elif isinstance(node, ast.FunctionDef) and node.name == "__init__":
            args = node.args.args[len(node.args.args) - len(node.args.defaults):]
            pairs += [(a.arg, d) for a, d in zip(args, node.args.defaults)]
    out = {}
    for name, value in pairs:
        try:  # literals and constant arithmetic (4096 * 32)
            out[name] = eval(compile(ast.Expression(value), file, "eval"), {"__builtins__": {}})
        except Exception:  # noqa: BLE001  a name or a call: no default to compare
            pass
    out.setdefault("default_theta", 10000.0)  # RotaryEmbeddingConfigMixin's
    if isinstance(out["default_theta"], dict):  # Gemma 3: the global and the local layers'
        out["rope_local_base_freq"] = out["default_theta"]["local"]
        out["default_theta"] = out["default_theta"]["global"]
    return out


def test_defaults_are_transformers_own():
    """Each field jaxmp defaults has transformers' default for the family (its config
    class), not jaxmp's: Mixtral's rope_theta is 1e6 and its eps 1e-5, DeepSeek-V3 routes
    8 groups, 4 picked, with 3 dense layers, and so on."""
    names = {"rope_theta": "default_theta", "num_nextn_predict_layers": "num_mtp_layers"}
    checked = 0
    for family, fam in hf.FAMILIES.items():
        theirs = _transformers_defaults(family)
        for key, spec in fam.specs.items():
            if spec.default in (hf_spec.NEEDED, hf_spec.ABSENT) or key == "partial_rotary_factor":
                continue
            if names.get(key, key) not in theirs:
                continue  # transformers does not declare it (topk_method of V3, ...)
            default = theirs[names.get(key, key)]
            assert spec.default == default and (isinstance(default, float) or
                                                type(spec.default) is type(default)), \
                (family, key, spec.default, default)
            checked += 1
    assert checked > 100, checked
    # Glm4MoeConfig's __post_init__ sets 0.5, Qwen3NextConfig's and Qwen3_5MoeTextConfig's
    # 0.25; the others read 1.0
    # (all dimensions).
    text = {f: fam for f, fam in hf.FAMILIES.items() if not fam.text_of}  # wrappers have none
    partial = {"glm4_moe": 0.5, "qwen3_next": 0.25, "qwen3_5_moe_text": 0.25}
    assert {f: fam.specs["partial_rotary_factor"].default for f, fam in text.items()} == {
        f: partial.get(f, 1.0) for f in text}


def test_defaults_filled_in_are_transformers_not_jaxmps():
    out = hf.config_from_hf(MIXTRAL)
    assert (out["rope_theta"], out["norm_eps"], out["max_len"]) == (1e6, 1e-5, 131072)
    out = hf.config_from_hf({k: v for k, v in DEEPSEEK_V3.items()
                             if k not in ("n_group", "topk_group")})
    assert (out["n_group"], out["topk_group"], out["first_dense_layers"],
            out["num_shared_experts"], out["routed_scaling_factor"],
            out["norm_topk_prob"]) == (8, 4, 3, 1, 2.5, True)
    out = hf.config_from_hf({**DEEPSEEK_V2, "n_routed_experts": 4})  # greedy: no groups
    assert (out["norm_topk_prob"], out["n_group"], out["num_shared_experts"]) == (False, 1, 2)
    # Mistral without a sliding_window field has transformers' 4096 window; null has none.
    config = {**LLAMA, "model_type": "mistral"}
    assert hf.config_from_hf(config)["sliding_window"] == 4096
    assert "sliding_window" not in hf.config_from_hf({**config, "sliding_window": None})
    # Qwen2 slides only with use_sliding_window, from max_window_layers (28) on.
    qwen2 = {**LLAMA, "model_type": "qwen2", "num_hidden_layers": 30, "sliding_window": 64}
    assert "sliding_window" not in hf.config_from_hf(qwen2)
    out = hf.config_from_hf({**qwen2, "use_sliding_window": True})
    assert out["sliding_window"] == 64
    assert out["layer_types"] == ("full_attention",) * 28 + ("sliding_attention",) * 2


def _expected(c):
    """The ModelConfig of released config.json ``c``, from its numbers (not jaxmp.models.hf's)."""
    e = dict(vocab_size=c["vocab_size"], d_model=c["hidden_size"],
             num_layers=c["num_hidden_layers"], num_heads=c["num_attention_heads"],
             max_len=c["max_position_embeddings"], norm_eps=c["rms_norm_eps"],
             rope_theta=float(c["rope_theta"]), tie_embeddings=c["tie_word_embeddings"])
    kind = c["model_type"]
    scaling = c.get("rope_scaling") or {}
    if scaling:
        e.update(rope_scaling=scaling.get("rope_type", scaling.get("type")),
                 rope_factor=float(scaling["factor"]),
                 rope_original_max_len=scaling["original_max_position_embeddings"])
    if scaling.get("rope_type") == "llama3":
        e.update(rope_low_freq_factor=scaling["low_freq_factor"],
                 rope_high_freq_factor=scaling["high_freq_factor"])
    if scaling.get("type") == "yarn":
        e.update(rope_beta_fast=scaling["beta_fast"], rope_beta_slow=scaling["beta_slow"],
                 rope_mscale=scaling["mscale"], rope_mscale_all_dim=scaling["mscale_all_dim"])
    if scaling.get("rope_type") == "yarn" and "truncate" in scaling:
        e.update(rope_beta_fast=scaling["beta_fast"], rope_beta_slow=scaling["beta_slow"],
                 rope_truncate=scaling["truncate"])
    if kind in ("llama", "mixtral", "qwen3_moe", "gpt_oss"):
        e.update(num_kv_heads=c["num_key_value_heads"],
                 head_dim=c.get("head_dim", c["hidden_size"] // c["num_attention_heads"]))
    if kind == "llama":
        e.update(d_ff=c["intermediate_size"])
    else:
        e.update(num_experts=c.get("num_local_experts", c.get("num_experts",
                                                              c.get("n_routed_experts"))),
                 top_k=c["num_experts_per_tok"], capacity_factor=None, aux_loss_weight=0.0,
                 bias_update_rate=0.0)
    if kind == "mixtral":
        e.update(d_expert=c["intermediate_size"], d_ff=0)
    if kind == "qwen3_next":
        every = c["full_attention_interval"]
        e.update(num_kv_heads=c["num_key_value_heads"], head_dim=c["head_dim"],
                 num_experts=c["num_experts"], top_k=c["num_experts_per_tok"],
                 d_expert=c["moe_intermediate_size"], d_ff=c["intermediate_size"],
                 num_shared_experts=c["shared_expert_intermediate_size"]
                 // c["moe_intermediate_size"], qk_norm=True, norm_plus_one=True,
                 attention_output_gate=True, shared_expert_gate=True,
                 rope_dim=int(c["head_dim"] * c["partial_rotary_factor"]),
                 linear_num_key_heads=c["linear_num_key_heads"],
                 linear_num_value_heads=c["linear_num_value_heads"],
                 linear_key_head_dim=c["linear_key_head_dim"],
                 linear_value_head_dim=c["linear_value_head_dim"],
                 linear_conv_kernel=c["linear_conv_kernel_dim"],
                 layer_types=tuple("linear_attention" if (i + 1) % every else "full_attention"
                                   for i in range(c["num_hidden_layers"])),
                 capacity_factor=None, aux_loss_weight=0.0, bias_update_rate=0.0)
    if kind == "gpt_oss":
        e.update(d_expert=c["intermediate_size"], d_ff=0, qkv_bias=c["attention_bias"],
                 o_bias=c["attention_bias"], attention_sinks=True, moe_bias=True,
                 expert_activation="clamped_swiglu", swiglu_limit=c["swiglu_limit"],
                 sliding_window=c["sliding_window"], layer_types=tuple(c["layer_types"]))
    if kind == "qwen3_moe":
        e.update(d_expert=c["moe_intermediate_size"], d_ff=c["intermediate_size"],
                 qk_norm=True, norm_topk_prob=c["norm_topk_prob"])
    if kind.startswith("deepseek"):
        e.update(d_expert=c["moe_intermediate_size"], d_ff=c["intermediate_size"],
                 num_shared_experts=c["n_shared_experts"],
                 first_dense_layers=c["first_k_dense_replace"],
                 norm_topk_prob=c["norm_topk_prob"],
                 routed_scaling_factor=c["routed_scaling_factor"],
                 q_lora_rank=c["q_lora_rank"] or 0, kv_lora_rank=c["kv_lora_rank"],
                 qk_nope_head_dim=c["qk_nope_head_dim"], qk_rope_head_dim=c["qk_rope_head_dim"],
                 v_head_dim=c["v_head_dim"], rope_layout="interleaved",
                 score_fn=c["scoring_func"])
    if kind == "deepseek_v3":
        e.update(n_group=c["n_group"], topk_group=c["topk_group"])
    if kind == "deepseek_v2":  # greedy: transformers ignores the groups
        e.update(group_score="max", n_group=1, topk_group=1)
    return ModelConfig(**e)


# Gemma-3-4B's multimodal config leaves its text model's shape to transformers' defaults:
# tests/test_hf.py::test_released_configs_map compares it with transformers' own reading.
@pytest.mark.parametrize("file", sorted(f for f in glob.glob(str(ROOT / "configs" / "hf" /
                                                                 "*.json"))
                                        if "text_config" not in json.load(open(f))),
                         ids=os.path.basename)
def test_released_configs_give_the_same_model_config(file):
    """configs/hf/*.json (released config.json files) still pass, each giving the
    ModelConfig its numbers say."""
    c = json.loads(open(file).read())
    assert ModelConfig(**hf.config_from_hf(c)) == _expected(c)


# ---- 3. tensors: every one used, floating, finite -------------------------------------------

def _raises(path, message, **kw):
    with pytest.raises(ValueError, match=message) as info:
        from_pretrained(path, "fp32", **kw)
    _one_line(info)
    return str(info.value)


@pytest.mark.parametrize("change, message", [
    (dict(extra={f"model.layers.7.mlp.{p}_proj.weight": np.ones((FF, D), np.float32)
                 for p in ("gate", "up")}),
     r"^/.*: 2 tensor\(s\) of the checkpoint are not used by the llama model "
     r"its config\.json describes \(2 layers\): model\.layers\.7\.mlp\.gate_proj\.weight, "
     r"model\.layers\.7\.mlp\.up_proj\.weight$"),
    (dict(extra={"model.layers.0.self_attn.o_proj.bias": np.ones(D, np.float32)}),
     r": 1 tensor\(s\) .* not used .*: model\.layers\.0\.self_attn\.o_proj\.bias$"),
    (dict(extra={f"model.layers.2.{n}": np.ones(D, np.float32) for n in ("a", "b", "c", "d",
                                                                       "e")}),
     r": 5 tensor\(s\) .*model\.layers\.2\.a, .*model\.layers\.2\.d, \.\.\.$"),
    (dict(replace={"model.norm.weight": np.ones(D, np.int32)}),
     r"model\.safetensors: tensor model\.norm\.weight has dtype I32; allowed: F16, BF16, "
     r"F32, F64$"),
    (dict(replace={"model.layers.1.mlp.up_proj.weight": np.ones((FF, D), np.uint8)}),
     r"tensor model\.layers\.1\.mlp\.up_proj\.weight has dtype U8"),
    (dict(replace={"model.layers.0.self_attn.q_proj.weight": np.ones((H * HD, D), np.bool_)}),
     r"tensor model\.layers\.0\.self_attn\.q_proj\.weight has dtype BOOL"),
    (dict(drop="model.layers.1.self_attn.k_proj.weight"),
     r"has no tensor 'model\.layers\.1\.self_attn\.k_proj\.weight': layer 1 is missing"),
    (dict(replace={"model.layers.1.mlp.down_proj.weight": np.ones((FF, D), np.float32)}),
     r"tensor model\.layers\.1\.mlp\.down_proj\.weight has shape \[12, 8\]"),
])
def test_tensor_faults_are_named_before_loading(tmp_path, change, message):
    tensors = {**_tensors(), **change.get("replace", {}), **change.get("extra", {})}
    tensors.pop(change.get("drop"), None)
    _raises(_checkpoint(tmp_path, tensors), message)


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_a_non_finite_weight_is_named_as_it_is_read(tmp_path, bad):
    tensors = _tensors()
    tensors["model.layers.1.mlp.down_proj.weight"][3, 5] = bad
    _raises(_checkpoint(tmp_path, tensors), r"model\.safetensors: tensor "
                                            r"model\.layers\.1\.mlp\.down_proj\.weight holds "
                                            r"non-finite values \(NaN or infinity\)")


def test_fp8_weights_without_quantization_config_are_named(tmp_path):
    tensors = {k: ("F32", v.shape, v.tobytes()) for k, v in _tensors().items()}
    tensors["model.layers.0.mlp.up_proj.weight"] = ("F8_E4M3", (FF, D), bytes(FF * D))
    _checkpoint(tmp_path, {})
    _raw_safetensors(tmp_path / "model.safetensors", tensors)
    _raises(str(tmp_path), r"tensor model\.layers\.0\.mlp\.up_proj\.weight has dtype F8_E4M3; "
                           r"allowed: F16, BF16, F32, F64 \(an FP8 weight needs its "
                           r"model\.layers\.0\.mlp\.up_proj\.weight_scale_inv and config\.json's "
                           r"quantization_config \{quant_method: fp8\}\)")


def test_tensors_skipped_on_purpose_load_bit_for_bit(tmp_path):
    """MTP layers num_nextn_predict_layers announces (after the config's layers), RoPE's
    inv_freq buffers and a tied lm_head are skipped; the weights load unchanged. Without
    the announcement the MTP layer is refused as unused."""
    tensors = _tensors(layers=L + 1)  # layer 2: an MTP layer
    tensors["model.layers.2.eh_proj.weight"] = np.ones((D, 2 * D), np.float32)
    tensors["model.layers.0.self_attn.rotary_emb.inv_freq"] = np.ones(HD // 2, np.float32)
    path = _checkpoint(tmp_path, tensors, num_nextn_predict_layers=1)
    model = from_pretrained(path, "fp32")
    np.testing.assert_array_equal(np.asarray(model.embed.table[...]),
                                  tensors["model.embed_tokens.weight"])
    np.testing.assert_array_equal(np.asarray(model.blocks[1].mlp.w_down[...]),
                                  tensors["model.layers.1.mlp.down_proj.weight"].T)
    (tmp_path / "config.json").write_text(json.dumps(LLAMA))  # llama: no MTP by default
    _raises(path, r": 10 tensor\(s\) .*: model\.layers\.2\.eh_proj\.weight, model\.layers\.2\."
                  r"input_layernorm\.weight")
    tied = tmp_path / "tied"  # lm_head.weight saved anyway, equal to the embedding
    tensors = _tensors()
    tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"].copy()
    _checkpoint(tied, tensors, tie_word_embeddings=True)
    assert from_pretrained(str(tied), "fp32").config.tie_embeddings
    # (one that differs is refused: transformers 5 then does not tie, "both are present in
    # the checkpoints with different values, so we will NOT tie them";
    # test_a_tied_head_stored_beside_its_embedding_must_equal_it)


# ---- 4. weight files outside the directory --------------------------------------------------

@pytest.mark.parametrize("file", ["../outside/evil.safetensors", "/tmp/evil.safetensors",
                                  "sub/model.safetensors", "..", ".", "", "a\\b", None, 3])
def test_index_naming_a_file_outside_the_directory_is_refused_unread(tmp_path, file):
    outside = tmp_path / "outside"
    outside.mkdir()
    save_file(_tensors(), str(outside / "evil.safetensors"))
    path = tmp_path / "ckpt"
    path.mkdir()
    (path / "config.json").write_text(json.dumps(LLAMA))
    weight_map = {name: "model-00001-of-00001.safetensors" for name in _tensors()}
    weight_map["model.norm.weight"] = file
    (path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    with pytest.raises(ValueError, match=r"model\.safetensors\.index\.json: "
                                         r"weight_map\['model\.norm\.weight'\]=.* is not a file "
                                         r"inside the checkpoint directory; allowed: a plain "
                                         r"file name") as info:
        hf_files.Files(str(path))  # only the index is read
    _one_line(info)


# ---- 5. damaged and non-regular files -------------------------------------------------------

def _damage(file, how):
    raw = file.read_bytes()
    n = struct.unpack("<Q", raw[:8])[0] if len(raw) >= 8 else 0
    if how == "truncated":
        file.write_bytes(raw[:-5])
    elif how == "empty":
        file.write_bytes(b"")
    elif how == "7 bytes":
        file.write_bytes(raw[:7])
    elif how == "flipped header":
        file.write_bytes(raw[:8] + b"X" + raw[9:])
    elif how == "oversized header":
        file.write_bytes(struct.pack("<Q", 1 << 40) + raw[8:])
    elif how == "offsets past the end":
        header = json.loads(raw[8:8 + n])
        header["model.norm.weight"]["data_offsets"][1] += 1 << 20
        text = json.dumps(header).encode()
        text += b" " * (-len(text) % 8)
        file.write_bytes(struct.pack("<Q", len(text)) + text + raw[8 + n:])
    elif how == "symlink to /dev/zero":
        file.unlink()
        file.symlink_to("/dev/zero")
    elif how == "directory":
        file.unlink()
        file.mkdir()
    elif how == "fifo":
        file.unlink()
        _mkfifo(file)
    elif how == "broken symlink":
        file.unlink()
        file.symlink_to(file.parent / "nowhere")


DAMAGE = {
    "truncated": r"not a readable safetensors file \(.*incomplete metadata",
    "empty": r"not a readable safetensors file \(.*header too small",
    "7 bytes": r"not a readable safetensors file \(.*header too small",
    "flipped header": r"not a readable safetensors file \(.*invalid JSON",
    "oversized header": r"not a readable safetensors file \(.*header too large",
    "offsets past the end": r"not a readable safetensors file",
    "symlink to /dev/zero": r"a character device, not a regular file; the checkpoint's "
                            r"model\.safetensors must be a regular file \(refused unread\)",
    "directory": r"a directory, not a regular file",
    "fifo": r"a FIFO, not a regular file",
    "broken symlink": r"a broken symbolic link",
}


@pytest.mark.parametrize("how", sorted(DAMAGE))
def test_damaged_model_safetensors_is_one_line(tmp_path, how):
    path = _checkpoint(tmp_path)
    _damage(tmp_path / "model.safetensors", how)
    with _deadline(20):
        message = _raises(path, rf"^{tmp_path}/model\.safetensors: {DAMAGE[how]}")
    assert "Traceback" not in message


@pytest.mark.parametrize("how", ["fifo", "directory", "symlink to /dev/zero"])
def test_a_non_regular_config_json_is_refused_unopened(tmp_path, how):
    _checkpoint(tmp_path)
    _damage(tmp_path / "config.json", how)
    with _deadline(20):
        _raises(str(tmp_path), rf"^{tmp_path}/config\.json: {DAMAGE[how].split(';')[0]}; the "
                               rf"checkpoint's config\.json must be a regular file")


def _sharded(path):
    """A checkpoint in two shards with its index; returns the index's path."""
    tensors = _tensors()
    names = sorted(tensors)
    shards = {"model-00001-of-00002.safetensors": names[:10],
              "model-00002-of-00002.safetensors": names[10:]}
    path.mkdir(exist_ok=True)
    (path / "config.json").write_text(json.dumps(LLAMA))
    for file, part in shards.items():
        save_file({n: tensors[n] for n in part}, str(path / file))
    index = path / "model.safetensors.index.json"
    index.write_text(json.dumps({"metadata": {}, "weight_map": {
        n: f for f, part in shards.items() for n in part}}))
    return index, tensors


@pytest.mark.parametrize("text, message", [
    ("{", r"cannot read the checkpoint's model\.safetensors\.index\.json \(Expecting"),
    ("[1]", r"the checkpoint's model\.safetensors\.index\.json is a JSON array; allowed: "
            r"a JSON object"),
    ("{}", r"weight_map=None is not allowed; allowed: a JSON object \{tensor name: file name"),
    ('{"weight_map": null}', r"weight_map=None is not allowed"),
    ('{"weight_map": ["a"]}', r"weight_map=\['a'\] is not allowed"),
    ('{"weight_map": {"x": "y"}, "metadata": {"total_size": NaN}}',
     r"metadata\.total_size=nan is not a finite number"),
    ("fifo", r"a FIFO, not a regular file"),
    ("directory", r"a directory, not a regular file"),
])
def test_bad_index_json_is_one_line(tmp_path, text, message):
    index, _ = _sharded(tmp_path)
    if text in ("fifo", "directory"):
        _damage(index, text)
    else:
        index.write_text(text)
    with _deadline(20):
        _raises(str(tmp_path), rf"^{index}: {message}")


@pytest.mark.parametrize("fault, message", [
    ("shard holds more", r"model-00002-of-00002\.safetensors: holds 1 tensor\(s\) that "
                         r"model\.safetensors\.index\.json does not map to it: extra\.weight$"),
    ("shard missing", r"model-00002-of-00002\.safetensors: no such file; the checkpoint's "
                      r"weight file must be a regular file$"),
    ("shard is a fifo", r"model-00002-of-00002\.safetensors: a FIFO, not a regular file"),
    ("index lies", r": model-00002-of-00002\.safetensors has no tensor 'model\.norm\.weight' "
                   r"\(the index says it has\)$"),
])
def test_sharded_checkpoint_faults_are_one_line(tmp_path, fault, message):
    index, tensors = _sharded(tmp_path)
    shard = tmp_path / "model-00002-of-00002.safetensors"
    names = sorted(tensors)[10:]
    if fault == "shard holds more":
        save_file({**{n: tensors[n] for n in names}, "extra.weight": np.ones(2, np.float32)},
                  str(shard))
    elif fault == "shard missing":
        shard.unlink()
    elif fault == "shard is a fifo":
        _damage(shard, "fifo")
    else:
        save_file({n: tensors[n] for n in names if n != "model.norm.weight"}, str(shard))
    with _deadline(20):
        _raises(str(tmp_path), message)


def test_a_valid_sharded_checkpoint_loads(tmp_path):
    _, tensors = _sharded(tmp_path)
    model = from_pretrained(str(tmp_path), "fp32")
    np.testing.assert_array_equal(np.asarray(model.final_norm.scale[...]),
                                  tensors["model.norm.weight"])


@pytest.mark.parametrize("fault", ["fifo", "list"])
def test_tokenizer_files_are_checked(tmp_path, fault):
    (tmp_path / "tokenizer.json").write_text("{}")
    config = tmp_path / "tokenizer_config.json"
    if fault == "fifo":
        _mkfifo(config)
    else:
        config.write_text("[]")
    with _deadline(20), pytest.raises(ValueError, match=rf"^{config}: ") as info:
        hf.tokenizer_eos(str(tmp_path))
    _one_line(info)


# ---- 6. a config.json far larger than its checkpoint answers at once -------------------------

def test_a_million_layers_over_two_fail_at_layer_two_at_once(tmp_path):
    """The checkpoint's names are checked against the config's layer by layer before the
    model is built (even abstractly): the answer names layer 2 within seconds."""
    path = _checkpoint(tmp_path, num_hidden_layers=1_000_000)
    with _deadline(60):  # a bound on a regression that hangs, not a timing
        _raises(path, r"has no tensor 'model\.layers\.2\.input_layernorm\.weight': layer 2 is "
                      r"missing or incomplete, and config\.json says 1000000 layers")


# ---- 7. the trainer checks the base's tensors before it reads its corpus ------------------------

def _finetune(path, tmp_path, monkeypatch, workdir=None):
    """train_and_evaluate of configs/finetune.py from ``path`` on one device, with the data
    pipeline replaced by one that fails the test: what is checked here is checked before
    any document is read. Returns the workdir."""
    from jaxmp.train import experiment, loop
    from jaxmp.train.config import load_config

    def read_corpus(*args, **kwargs):
        raise AssertionError("the corpus was read before the base's tensors were checked")

    monkeypatch.setattr(experiment, "create_pipeline", read_corpus)
    config = load_config("configs/finetune.py", [f"model.init_from={path}", "data.seq_len=16",
                                                 "train.batch_size=2"])
    workdir = workdir or tmp_path / "run"
    loop.train_and_evaluate(config, str(workdir), num_devices=1)
    return workdir


def _byte_vocab(tensors):
    """``tensors`` with a 257-token embedding and head: the byte tokenizer's vocabulary,
    which finetune.py trains with when the base has no tokenizer.json."""
    return {**tensors, "model.embed_tokens.weight": np.ones((257, D), np.float32),
            "lm_head.weight": np.ones((257, D), np.float32)}


@pytest.mark.parametrize("change, message", [
    (dict(drop="model.layers.1.self_attn.k_proj.weight"),
     r"has no tensor 'model\.layers\.1\.self_attn\.k_proj\.weight': layer 1 is missing"),
    (dict(replace={"model.layers.1.mlp.down_proj.weight": np.ones((FF, D), np.float32)}),
     r"tensor model\.layers\.1\.mlp\.down_proj\.weight has shape \[12, 8\]"),
    (dict(replace={"model.norm.weight": np.ones(D, np.int32)}),
     r"tensor model\.norm\.weight has dtype I32"),
])
def test_the_trainer_names_a_bad_base_tensor_before_it_reads_the_corpus(tmp_path, monkeypatch,
                                                                         change, message):
    """Before, a missing or misshapen tensor of ``model.init_from`` was found when the
    state was initialised, after the corpus was read and tokenized (6-13 s on the
    default corpus): here the pipeline fails the test if it is built first. Nothing is
    left in the workdir."""
    tensors = {**_byte_vocab(_tensors()), **change.get("replace", {})}
    tensors.pop(change.get("drop"), None)
    path = _checkpoint(tmp_path / "base", tensors, vocab_size=257)
    with pytest.raises(ValueError, match=message) as info:
        _finetune(path, tmp_path, monkeypatch)
    _one_line(info)
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("where", ["file", "dir"])
def test_a_config_json_file_plans_a_run_and_only_a_directory_starts_one(tmp_path, monkeypatch,
                                                                        where):
    """``model.init_from`` may name a config.json file (configs/hf/*.json): load_config
    and validate_config give the architecture the directory holding it gives, with no
    tokenizer taken; the trainer refuses the file in one line before anything is made,
    and from_pretrained too."""
    from jaxmp.train.config import load_config, validate_config

    base = tmp_path / "base"
    _checkpoint(base, _byte_vocab(_tensors()), vocab_size=257)
    file = tmp_path / "Llama-tiny.json"
    file.write_text((base / "config.json").read_text())
    given = [f"model.init_from={file if where == 'file' else base}", "data.seq_len=16"]
    cfg = load_config("configs/finetune.py", given)
    want = load_config("configs/finetune.py", [f"model.init_from={base}", "data.seq_len=16"])
    assert validate_config(cfg, 1).model == validate_config(want, 1).model
    assert cfg.model.init_from == str(file if where == "file" else base)
    if where == "dir":
        return
    assert cfg.data.tokenizer == "bytes"  # no tokenizer beside a file: finetune.py's default
    with pytest.raises(ValueError, match=rf"^{file}: not a checkpoint directory; a config\.json "
                                         r"alone plans a run \(python -m jaxmp\.report\)") as info:
        _finetune(file, tmp_path, monkeypatch)
    _one_line(info)
    assert not (tmp_path / "run").exists()
    with pytest.raises(ValueError, match=rf"^{file}: not a checkpoint directory"):
        from_pretrained(str(file))
    # The README's example: refused as a file before any other check (before, an 8B
    # model's parameter memory, or seq_len above its max_len, was refused first).
    released = ROOT / "configs" / "hf" / "Llama-3.1-8B.json"
    with pytest.raises(ValueError, match=rf"^{released}: not a checkpoint directory"):
        _finetune(released, tmp_path, monkeypatch)


def test_under_init_from_a_vocabulary_too_small_names_the_tokenizer_not_the_model(tmp_path,
                                                                                  monkeypatch):
    """The base's vocabulary is fixed: the refusal names data.tokenizer, not a
    model.vocab_size that init_from would refuse in turn."""
    path = _checkpoint(tmp_path / "base")  # 16 tokens, no tokenizer.json: bytes (257)
    with pytest.raises(ValueError, match=r"^model\.vocab_size=16 is smaller than the vocabulary "
                                         r"of data\.tokenizer='bytes' \(257 tokens\); the "
                                         r"vocabulary is model\.init_from's .*: give "
                                         r"data\.tokenizer of at most 16 tokens") as info:
        _finetune(path, tmp_path, monkeypatch)
    _one_line(info)
    assert "model.vocab_size=384" not in str(info.value)


# ---- 8. what an attack on the fine-tuner's path found next ----------------------------------

ROPE_P = {"rope_type": "default", "rope_theta": 10000.0}


@pytest.mark.parametrize("family, change, message", [
    # transformers reads rope_parameters' theta, jaxmp read the top-level one
    ("llama", dict(rope_theta=500000.0, rope_parameters=ROPE_P),
     r"rope_theta=500000\.0 is not allowed; allowed: rope_parameters\.rope_theta's 10000\.0 "
     r"\(both are given"),
    # transformers reads rope_scaling, jaxmp read rope_parameters
    ("llama", dict(rope_scaling=YARN, rope_parameters={**YARN, "factor": 2.0}),
     r"rope_parameters\.factor=2\.0 cannot be represented exactly; allowed: absent, or "
     r"rope_scaling's value"),
    ("llama", dict(rope_scaling={**YARN, "type": "yarn"},
                   rope_parameters={**YARN, "rope_type": "llama3"}),
     r"rope_parameters\.rope_type='llama3' cannot be represented exactly; allowed: absent, or "
     r"rope_scaling's value"),
    ("llama", dict(layer_types=["full_attention"]),
     r"layer_types=\['full_attention'\] is not allowed; allowed: one entry per layer \(2, "),
    ("llama", dict(layer_types=["full_attention"] * 5), r"layer_types=.* one entry per layer"),
    ("deepseek_v3", dict(num_key_value_heads=1),
     r"num_key_value_heads=1 is not allowed; allowed: num_attention_heads \(2\) or null: MLA"),
])
def test_config_fields_that_disagree_with_each_other_are_named(family, change, message):
    with pytest.raises(ValueError, match=rf"^config\.json \({family}\): {message}") as info:
        hf.config_from_hf({**FAMILY[family], **change})
    _one_line(info)


@pytest.mark.parametrize("change", [
    dict(rope_theta=10000.0, rope_parameters=ROPE_P),  # the same value twice
    dict(rope_scaling=YARN, rope_parameters=YARN),
    dict(layer_types=["full_attention"] * L),
])
def test_config_fields_given_twice_alike_are_taken(change):
    assert hf.config_from_hf({**LLAMA, **change})["num_layers"] == L
    assert hf.config_from_hf({**DEEPSEEK_V3, "num_key_value_heads": H})["num_heads"] == H


def test_a_qwen3_moe_of_a_billion_layers_maps_at_once():
    """Every layer sparse (decoder_sparse_step 1): nothing is enumerated, so the trainer's
    memory check can refuse it in a second instead of building a billion-entry set."""
    with _deadline(30):
        out = hf.config_from_hf({**QWEN3_MOE, "num_hidden_layers": 10 ** 9})
    assert out["num_layers"] == 10 ** 9 and out["mlp_only_layers"] == ()


def test_a_tied_head_stored_beside_its_embedding_must_equal_it(tmp_path):
    """transformers keeps a stored lm_head.weight even with tie_word_embeddings: true, while
    jaxmp ties the head to the embedding: a head that differs is refused (it loaded
    silently as another model); an equal one loads, tied."""
    tensors = _tensors()
    path = _checkpoint(tmp_path / "differs", tensors, tie_word_embeddings=True)
    with _deadline(20):
        _raises(path, r"config\.json says tie_word_embeddings: true, but the checkpoint's "
                      r"lm_head\.weight differs from model\.embed_tokens\.weight")
    tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"].copy()
    path = _checkpoint(tmp_path / "equal", tensors, tie_word_embeddings=True)
    model = from_pretrained(path, "fp32")
    np.testing.assert_array_equal(np.asarray(model.embed.table[...]),
                                  tensors["model.embed_tokens.weight"])


@pytest.mark.parametrize("dtype, value, policy, what", [
    (np.float64, 1e300, "fp32", "float32"),
    (np.float32, 1e5, "params=float16,compute=float16,output=float32", "float16"),
])
def test_a_finite_weight_beyond_the_parameter_dtype_is_named(tmp_path, dtype, value, policy,
                                                             what):
    """A weight finite in the file but infinite in the parameter dtype loaded as inf and
    the run skipped every step: refused as it is read, naming the tensor."""
    tensors = _tensors()
    name = "model.layers.0.self_attn.q_proj.weight"
    tensors[name] = np.full(tensors[name].shape, value, dtype)
    path = _checkpoint(tmp_path, tensors)
    with pytest.raises(ValueError, match=rf"tensor {name} holds values beyond {what}'s range "
                                         r"\(the parameter dtype; largest \|value\| ") as info:
        from_pretrained(path, policy)
    _one_line(info)


@pytest.mark.parametrize("eos", ["", False, 0, {"text": "</s>"}, {"content": ""}])
def test_an_ill_typed_or_empty_eos_token_is_named(tmp_path, eos):
    """Treated as absent before (the tokenizer's own guess was used, exit 0)."""
    from tokenizers import Tokenizer, models

    Tokenizer(models.BPE(vocab={"a": 0, "</s>": 1}, merges=[])).save(
        str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": eos}))
    with pytest.raises(ValueError, match=r"tokenizer_config\.json: eos_token=.* is not allowed; "
                                         r"allowed: a non-empty string") as info:
        hf.tokenizer_eos(str(tmp_path))
    _one_line(info)
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": None}))
    assert hf.tokenizer_eos(str(tmp_path)) == (str(tmp_path / "tokenizer.json"), None)


@pytest.mark.parametrize("text", ['{"version": "1.0", "mod', "hello", "[]"])
def test_a_damaged_tokenizer_json_beside_an_eos_token_is_one_line(tmp_path, text):
    """tokenizers raises a bare Exception: it was a traceback."""
    (tmp_path / "tokenizer.json").write_text(text)
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "</s>"}))
    with pytest.raises(ValueError, match=rf"^{tmp_path}/tokenizer\.json: not a Hugging Face "
                                         r"tokenizer\.json \(") as info:
        hf.tokenizer_eos(str(tmp_path))
    _one_line(info)


def test_window_configs_transformers_cannot_run_are_refused_and_huge_ones_are_counted():
    """qwen2: sliding layer_types while use_sliding_window is false (transformers fails on
    it with a TypeError); a billion layers of which the first slide none: counted, not
    listed."""
    qwen2 = {**LLAMA, "model_type": "qwen2", "sliding_window": 4}
    with pytest.raises(ValueError, match=r"layer_types=.* allowed: full_attention only while "
                                         r"use_sliding_window is false"):
        hf.config_from_hf({**qwen2, "layer_types": ["sliding_attention", "full_attention"]})
    with _deadline(10):
        out = hf.config_from_hf({**qwen2, "num_hidden_layers": 10 ** 9,
                                 "use_sliding_window": True, "max_window_layers": 0})
    assert out["sliding_window"] == 4 and "layer_types" not in out
    with pytest.raises(ValueError, match=r"num_hidden_layers=1000000000 is not allowed; allowed: "
                                         r"at most 1,048,576 layers"):
        hf.config_from_hf({**qwen2, "num_hidden_layers": 10 ** 9, "use_sliding_window": True,
                           "max_window_layers": 1})


def test_gemma3_without_a_sliding_layer_loads_as_global_layers_only():
    """sliding_window_pattern 1 (every layer global), as transformers runs it: no window,
    and no local RoPE base to keep."""
    out = hf.config_from_hf({**GEMMA3, "sliding_window_pattern": 1})
    assert "sliding_window" not in out and "rope_local_theta" not in out
    ModelConfig(**out)


def test_gemma3_reads_both_rope_layouts_and_its_layer_pattern():
    """transformers' Gemma 3 config in its old fields (rope_theta, rope_local_base_freq,
    rope_scaling) and its rope_parameters per layer type give one model; without
    layer_types every sliding_window_pattern-th layer is global (transformers' rule:
    sliding where (i + 1) % pattern), and with its defaults (pattern 6, window 4096,
    theta 1e6 and 10000) the numbers are transformers' defaults."""
    old = hf.config_from_hf({**GEMMA3, "num_hidden_layers": 4, "sliding_window_pattern": 2,
                             "rope_theta": 5e5, "rope_local_base_freq": 50.0,
                             "rope_scaling": {"rope_type": "linear", "factor": 8.0}})
    new = hf.config_from_hf({**GEMMA3, "num_hidden_layers": 4, "layer_types": [
        "sliding_attention", "full_attention"] * 2, "rope_parameters": {
        "sliding_attention": {"rope_type": "default", "rope_theta": 50.0},
        "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 5e5}}})
    assert old == new
    assert (old["layer_types"], old["rope_local_theta"], old["rope_theta"], old["rope_scaling"],
            old["rope_factor"]) == (("sliding_attention", "full_attention") * 2, 50.0, 5e5,
                                    "linear", 8.0)
    assert old["embed_scale"] == D ** 0.5 and old["norm_plus_one"] and old["post_norms"]
    defaults = hf.config_from_hf({**GEMMA3, "num_hidden_layers": 7})
    assert defaults["layer_types"] == ("sliding_attention",) * 5 + ("full_attention",) + (
        "sliding_attention",)
    assert (defaults["sliding_window"], defaults["rope_theta"], defaults["rope_local_theta"],
            defaults["query_pre_attn_scalar"]) == (4096, 1e6, 10000.0, 256)


def test_a_wrappers_quantization_config_is_its_text_models():
    """transformers writes a multimodal checkpoint's quantization_config on the wrapper:
    it is the text model's (and FineGrainedFP8Config's block, 128 x 128, where it is not
    said)."""
    wrapper = {"model_type": "gemma3", "text_config": {**GEMMA3},
               "quantization_config": {"quant_method": "fp8", "fmt": "e4m3",
                                       "activation_scheme": "dynamic"}}
    text, kind = hf.text_config(wrapper)
    assert kind == "gemma3" and text["quantization_config"] == wrapper["quantization_config"]
    method, values = hf.quantization("gemma3_text", text)
    assert method == "fp8" and values["weight_block_size"] == [128, 128]
    assert hf.config_from_hf(wrapper)["d_model"] == D
    with pytest.raises(ValueError, match=r"quantization_config=.* is not allowed; allowed: "
                                         r"text_config\.quantization_config's value"):
        hf.text_config({**wrapper, "text_config": {**GEMMA3, "quantization_config": {
            "quant_method": "fp8", "weight_block_size": [64, 64]}}})
