"""Tests of jaxmp.precision.policy: Policy, get_policy (jmp grammar + presets), PolicyRules."""
import dataclasses
import itertools

import jax
import jax.numpy as jnp
import jmp
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

import jaxmp
from jaxmp.precision.policy import canonical_dtype

F32, BF16, F16 = jnp.dtype("float32"), jnp.dtype("bfloat16"), jnp.dtype("float16")
DTYPES = (F32, BF16, F16)
HYP = settings(max_examples=30, deadline=None)


# --------------------------------------------------------------------------- Policy


def test_policy_is_frozen_and_hashable():
    p = jaxmp.Policy("f32", "bf16", jnp.float32)
    with pytest.raises(dataclasses.FrozenInstanceError):
        p.compute_dtype = F16
    # Spellings are canonicalised, so equal policies hash equal and work as dict keys.
    q = jaxmp.Policy(np.float32, jnp.bfloat16, "float32")
    assert p == q and hash(p) == hash(q)
    assert {p: 1}[q] == 1
    assert (p.param_dtype, p.compute_dtype, p.output_dtype) == (F32, BF16, F32)


def test_policy_is_static_under_jit():
    traces = []

    def f(x, policy):
        traces.append(policy)
        return policy.cast_to_output(policy.cast_to_compute(x) * 2)

    jf = jax.jit(f, static_argnums=1)
    x = jnp.ones((2,), jnp.float32)
    y = jf(x, jaxmp.get_policy("mixed_bf16"))
    assert y.dtype == F32
    # An equal policy built another way hits the cache: no second trace.
    jf(x, jaxmp.Policy("f32", "bf16", "f32"))
    assert len(traces) == 1
    y16 = jf(x, jaxmp.get_policy("bf16"))
    assert y16.dtype == BF16 and len(traces) == 2

    policy = jaxmp.get_policy("mixed_fp16")  # closed over: a Python constant of the trace
    out = jax.jit(lambda t: policy.cast_to_compute(t))({"w": x, "n": jnp.arange(3)})
    assert out["w"].dtype == F16 and out["n"].dtype == jnp.int32


@pytest.mark.parametrize("method,attr", [("cast_to_param", "param_dtype"),
                                         ("cast_to_compute", "compute_dtype"),
                                         ("cast_to_output", "output_dtype")])
def test_casts_touch_floating_leaves_only(method, attr):
    policy = jaxmp.Policy(F16, BF16, F32) if attr != "param_dtype" else jaxmp.Policy(BF16, F32, F16)
    target = getattr(policy, attr)
    tree = {
        "f32": jnp.array([1.5, -2.25], jnp.float32),
        "f16": jnp.array([3.0], jnp.float16),
        "bf16": jnp.array([0.5], jnp.bfloat16),
        "np": np.array([4.0], np.float64),
        "i32": jnp.array([1, 2], jnp.int32),
        "u8": np.array([7], np.uint8),
        "bool": jnp.array([True, False]),
        "py_int": 3,
        "py_float": 0.25,
        "none": None,
    }
    out = getattr(policy, method)(tree)
    for k in ("f32", "f16", "bf16", "np"):
        assert out[k].dtype == target, k
        np.testing.assert_array_equal(np.asarray(out[k], np.float64), np.asarray(tree[k], np.float64))
    assert out["i32"].dtype == jnp.int32 and out["u8"].dtype == np.uint8
    assert out["bool"].dtype == jnp.bool_
    np.testing.assert_array_equal(out["i32"], [1, 2])
    assert out["py_int"] == 3 and type(out["py_int"]) is int
    assert out["py_float"].dtype == target and float(out["py_float"]) == 0.25
    assert out["none"] is None


@pytest.mark.parametrize("p,c,o", list(itertools.product(DTYPES, repeat=3)))
def test_str_round_trip(p, c, o):
    policy = jaxmp.Policy(p, c, o)
    assert str(policy) == f"params={p.name},compute={c.name},output={o.name}"
    assert jaxmp.get_policy(str(policy)) == policy


def test_needs_loss_scale():
    assert jaxmp.get_policy("mixed_fp16").needs_loss_scale
    assert not jaxmp.get_policy("mixed_bf16").needs_loss_scale
    assert not jaxmp.get_policy("fp32").needs_loss_scale


def test_with_dtype_copies():
    p = jaxmp.get_policy("fp32")
    assert p.with_compute_dtype("bf16") == jaxmp.Policy(F32, BF16, F32)
    assert p.with_param_dtype("f16") == jaxmp.Policy(F16, F32, F32)
    assert p.with_output_dtype("bf16") == jaxmp.Policy(F32, F32, BF16)
    assert p == jaxmp.Policy(F32, F32, F32)  # unchanged


@pytest.mark.parametrize("bad", ["int32", "f8", None, jnp.int32, np.bool_, "complex64"])
def test_policy_rejects_non_float_dtypes(bad):
    with pytest.raises(ValueError, match="dtype"):
        jaxmp.Policy(bad, F32, F32)


def test_canonical_dtype_message_lists_allowed():
    with pytest.raises(ValueError) as e:
        canonical_dtype("fp8")
    assert "'fp8'" in str(e.value) and "bfloat16" in str(e.value) and "float16" in str(e.value)


# --------------------------------------------------------------------------- get_policy


@pytest.mark.parametrize("name,expected", [
    ("fp32", (F32, F32, F32)),
    ("mixed_bf16", (F32, BF16, F32)),
    ("mixed_fp16", (F32, F16, F32)),
    ("bf16", (BF16, BF16, BF16)),
    ("  Mixed_BF16 ", (F32, BF16, F32)),
])
def test_presets(name, expected):
    assert jaxmp.get_policy(name) == jaxmp.Policy(*expected)


@pytest.mark.parametrize("spec,expected", [
    ("params=float32,compute=bfloat16,output=float32", (F32, BF16, F32)),
    ("p=f32,c=bf16,o=f32", (F32, BF16, F32)),
    ("p=f32, c=f16, o=f32", (F32, F16, F32)),
    ("o=f32,c=bf16,p=f32", (F32, BF16, F32)),
    ("bf16", (BF16, BF16, BF16)),
    ("half", (F16, F16, F16)),
    ("full", (F32, F32, F32)),
    # jmp's defaults: params float32, compute follows params, output follows compute.
    ("c=f16", (F32, F16, F16)),
    ("p=bf16", (BF16, BF16, BF16)),
    ("p=f32,c=bf16", (F32, BF16, BF16)),
    ("c=bf16,o=f32", (F32, BF16, F32)),
    ("p=f16,o=f32", (F16, F16, F32)),
])
def test_jmp_grammar(spec, expected):
    assert jaxmp.get_policy(spec) == jaxmp.Policy(*expected)


_JMP_KEYS = {"param": ("p", "params"), "compute": ("c", "compute"), "output": ("o", "output")}
_JMP_NAMES = ("f32", "float32", "full", "bf16", "bfloat16", "f16", "float16")


@st.composite
def jmp_specs(draw):
    roles = draw(st.lists(st.sampled_from(sorted(_JMP_KEYS)), min_size=1, max_size=3, unique=True))
    parts = [f"{draw(st.sampled_from(_JMP_KEYS[r]))}={draw(st.sampled_from(_JMP_NAMES))}"
             for r in roles]
    return ",".join(parts)


@HYP
@given(jmp_specs())
def test_string_grammar_matches_jmp(spec):
    # Each policy built independently: jmp's own parser vs ours.
    ref = jmp.get_policy(spec)
    ours = jaxmp.get_policy(spec)
    assert (ours.param_dtype, ours.compute_dtype, ours.output_dtype) == tuple(
        jnp.dtype(d) for d in (ref.param_dtype, ref.compute_dtype, ref.output_dtype))
    assert jaxmp.get_policy(ref) == ours  # a jmp.Policy object is accepted too


def test_accepts_policy_objects():
    p = jaxmp.get_policy(jmp.get_policy("p=f32,c=bf16,o=f32"))
    assert isinstance(p, jaxmp.Policy) and p == jaxmp.Policy(F32, BF16, F32)
    q = jaxmp.Policy(F32, F16, F32)
    assert jaxmp.get_policy(q) is q


@pytest.mark.parametrize("spec,tokens", [
    ("p=f32,c=fp8,o=f32", ["'fp8'", "bfloat16", "float32"]),
    ("p=f32,compute=int8", ["'int8'", "bfloat16"]),
    ("q=f32", ["'q'", "params", "compute", "output"]),
    ("p=f32,weights=bf16", ["'weights'", "params"]),
    ("mixed_fp8", ["'mixed_fp8'", "mixed_bf16", "mixed_fp16", "fp32"]),
    ("", ["''", "mixed_bf16"]),
    ("p=f32,c", ["'c'", "key=dtype"]),
    ("p=f32,", ["''", "key=dtype"]),
    ("p=f32=bf16", ["'p=f32=bf16'", "key=dtype"]),
    ("p=f32,params=bf16", ["'params'", "twice"]),
])
def test_get_policy_errors_name_the_token(spec, tokens):
    with pytest.raises(ValueError) as e:
        jaxmp.get_policy(spec)
    for t in tokens:
        assert t in str(e.value), (t, str(e.value))


def test_get_policy_wrong_type():
    with pytest.raises(TypeError, match="int"):
        jaxmp.get_policy(3)


# --------------------------------------------------------------------------- PolicyRules


def test_rules_first_match_wins_and_default():
    fp32, fp16, bf16 = (jaxmp.get_policy(s) for s in ("fp32", "mixed_fp16", "bf16"))
    rules = jaxmp.PolicyRules(default=fp16, rules=(("moe/router", fp32), ("moe", bf16), ("router", bf16)))
    assert rules.resolve("blocks/3/moe/router") == fp32          # first rule, though all match
    assert rules.resolve("blocks/3/moe/experts/0") == bf16       # only the second matches
    assert rules.resolve("blocks/3/attn/router_like") == bf16    # re.search: anywhere in the path
    assert rules.resolve("blocks/3/attn/q") == fp16              # no match: default
    assert rules.resolve(("blocks", 3, "moe", "router")) == fp32  # a key sequence is joined by '/'
    # Reversed order: the broader pattern now shadows the specific one.
    rev = jaxmp.PolicyRules(default=fp16, rules=(("moe", bf16), ("moe/router", fp32)))
    assert rev.resolve("blocks/3/moe/router") == bf16


def test_rules_regex_anchors():
    rules = jaxmp.get_policy_rules(r"mixed_bf16; ^head$: fp32; norm\d*$: fp32")
    fp32 = jaxmp.get_policy("fp32")
    assert rules.resolve("head") == fp32
    assert rules.resolve("lm/head") == jaxmp.get_policy("mixed_bf16")
    assert rules.resolve("blocks/0/norm2") == fp32
    assert rules.resolve("blocks/0/norm2/scale") == jaxmp.get_policy("mixed_bf16")


def test_rules_from_string():
    rules = jaxmp.get_policy_rules("mixed_fp16; router: fp32; experts: p=f32,c=bf16,o=f32")
    assert rules.default == jaxmp.Policy(F32, F16, F32)
    assert rules.rules == (("router", jaxmp.Policy(F32, F32, F32)),
                           ("experts", jaxmp.Policy(F32, BF16, F32)))
    # No default item: float32.
    assert jaxmp.get_policy_rules("router: bf16").default == jaxmp.Policy(F32, F32, F32)
    # A single policy or a PolicyRules object.
    assert jaxmp.get_policy_rules("mixed_bf16") == jaxmp.PolicyRules(jaxmp.get_policy("mixed_bf16"))
    assert jaxmp.get_policy_rules(rules) is rules
    assert jaxmp.get_policy_rules(jmp.get_policy("c=bf16")).default == jaxmp.Policy(F32, BF16, BF16)


def test_rules_accept_an_ordered_mapping():
    rules = jaxmp.PolicyRules("mixed_bf16", {"moe/router": "fp32", "moe": "bf16"})
    assert rules.rules == (("moe/router", jaxmp.get_policy("fp32")), ("moe", jaxmp.get_policy("bf16")))
    assert rules.resolve("x/moe/router") == jaxmp.get_policy("fp32")


@pytest.mark.parametrize("spec", [
    "mixed_fp16; router: fp32; norm: fp32; experts: p=f32,c=f16,o=f32",
    "bf16",
    r"mixed_bf16; (?:attn|mlp)/out: fp32; ^blocks/\d+/norm$: fp32",  # ':' inside a pattern
    "p=f32,c=bf16; a|b: c=f16",
])
def test_rules_str_round_trip(spec):
    rules = jaxmp.get_policy_rules(spec)
    again = jaxmp.get_policy_rules(str(rules))
    assert again == rules and hash(again) == hash(rules)


@HYP
@given(st.lists(st.tuples(st.sampled_from(["router", "norm", r"blocks/\d+/moe", "(?:q|k)_proj", "^head$"]),
                          st.tuples(*[st.sampled_from(DTYPES)] * 3)), max_size=4),
       st.tuples(*[st.sampled_from(DTYPES)] * 3))
def test_rules_str_round_trip_property(items, default):
    rules = jaxmp.PolicyRules(jaxmp.Policy(*default), tuple((pat, jaxmp.Policy(*d)) for pat, d in items))
    assert jaxmp.get_policy_rules(str(rules)) == rules


def test_rules_hashable_static_under_jit():
    rules = jaxmp.get_policy_rules("mixed_bf16; router: fp32")
    f = jax.jit(lambda x, r: r.resolve("moe/router").cast_to_compute(x), static_argnums=1)
    assert f(jnp.ones(2, jnp.float16), rules).dtype == F32
    assert f(jnp.ones(2, jnp.float16), jaxmp.get_policy_rules(str(rules))).dtype == F32


@pytest.mark.parametrize("spec,tokens", [
    ("fp32; bf16", ["two default", "'bf16'"]),
    ("fp32; : bf16", ["empty module pattern"]),
    ("fp32; (router: bf16", ["'(router'"]),
    ("fp32; router: fp9", ["'fp9'"]),
])
def test_rules_errors(spec, tokens):
    with pytest.raises(ValueError) as e:
        jaxmp.get_policy_rules(spec)
    for t in tokens:
        assert t in str(e.value), (t, str(e.value))


def test_rules_reject_malformed_pairs():
    with pytest.raises(ValueError, match="pattern, policy"):
        jaxmp.PolicyRules("fp32", rules=("router",))


def test_float64_policy_without_x64_is_an_error_not_a_silent_float32():
    with pytest.raises(ValueError, match="jax_enable_x64"):
        jaxmp.get_policy("f64")
