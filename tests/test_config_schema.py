"""One declaration per config key (issue 29, point 1): every key is declared once, by
jaxmp.train.keys (the model.* keys by ModelConfig's fields), and the defaults, the checks,
ModelConfig's own validation, --help and docs/CONFIG.md are read from that declaration."""
import dataclasses
import pathlib
import re

import ml_collections
import pytest

from jaxmp.models import ModelConfig
from jaxmp.train import keys
from jaxmp.train.config import ALLOWED, default_config, is_complete, load_config, validate_config

ROOT = pathlib.Path(__file__).resolve().parents[1]
FIELDS = dataclasses.fields(ModelConfig)
MODEL_KEYS = [k for k in keys.KEYS if k.name.startswith("model.") and k.name != "model.init_from"]


def test_the_model_keys_are_modelconfigs_fields():
    """(That every key is in KEYS once, and that docs/CONFIG.md is current, is
    tests/test_config_help.py's check.)"""
    # the model section is ModelConfig's fields, in their order, plus where weights come from
    assert [k.name for k in MODEL_KEYS] == [f"model.{f.name}" for f in FIELDS]
    # keys.py declares no model key of its own besides model.init_from
    source = (ROOT / "jaxmp" / "train" / "keys.py").read_text()
    assert re.findall(r'Key\("model\.(\w+)"', source) == ["init_from"]


def test_modelconfig_defaults_are_the_run_defaults():
    default = ModelConfig()  # every field has a default: the run's default model
    config = default_config()
    for f in FIELDS:
        assert f.default is not dataclasses.MISSING, f.name
        assert config.model[f.name] == f.default, f.name
    assert ModelConfig.from_config(config.model) == default


# A value each spec refuses, found by trying candidates (no value is hard-coded per key).
_BAD_CANDIDATES = (-1, 0, "nope", None, 2.5, float("nan"), 1, True, (-1,), "", 10 ** 12)


def _with(key: str, value):
    """The default config, as a dict (which holds any type, as a config file's may), with
    ``key`` set to ``value``."""
    config = default_config().to_dict()
    *sections, name = key.split(".")
    node = config
    for part in sections:
        node = node[part]
    node[name] = value
    return ml_collections.ConfigDict(config)


@pytest.mark.parametrize("key", [k for k in keys.KEYS if k.allowed is not None],
                         ids=lambda k: k.name)
def test_validate_config_refuses_what_each_declared_spec_refuses(key):
    """Behaviour, not the table restated: the declared default passes validate_config, and
    a value the declared spec refuses is refused by validate_config with the spec's own
    text, naming the key."""
    assert key.allowed.ok(key.default) and key.meaning.strip()
    refused = [v for v in _BAD_CANDIDATES if not key.allowed.ok(v)]
    assert refused, key.name
    value = refused[0]
    with pytest.raises(ValueError, match=re.escape(f"{key.name}=") + r".* is not allowed; it "
                                         r"must be " + re.escape(key.allowed.allowed)):
        validate_config(_with(key.name, value), 1)


@pytest.mark.parametrize("key", [k for k in keys.KEYS if k.allowed is None],
                         ids=lambda k: k.name)
def test_a_key_without_a_spec_is_checked_all_the_same(key):
    """Every key is checked, not only those that carry a spec: a value of another type
    (a list where the default is not one) is refused, naming the key."""
    value = ["a list"] if not isinstance(key.default, (list, tuple)) else 3.5
    with pytest.raises((ValueError, TypeError), match=re.escape(key.name.rpartition(".")[2])):
        validate_config(_with(key.name, value), 1)


@pytest.mark.parametrize("field", [f for f in FIELDS if f.metadata["allowed"] is not None],
                         ids=lambda f: f.name)
def test_modelconfig_and_the_run_config_refuse_the_same_values(field):
    spec = field.metadata["allowed"]
    refused = [v for v in _BAD_CANDIDATES if not spec.ok(v)]
    assert refused, field.name
    for value in refused:
        with pytest.raises(ValueError, match=re.escape(f"{field.name}={value!r} must be")):
            ModelConfig(**{field.name: value})
        config = default_config().to_dict()  # a dict holds any type, as a config file's may
        config["model"][field.name] = value
        # (an int given for a float key is completed as a float: -1 reads -1.0)
        with pytest.raises(ValueError, match=re.escape(f"model.{field.name}=") + r"\S+"
                           + re.escape(f" is not allowed; it must be {spec.allowed}")):
            validate_config(ml_collections.ConfigDict(config), 1)


def test_docs_list_each_keys_allowed_values():
    doc = (ROOT / "docs" / "CONFIG.md").read_text()
    for k in keys.KEYS:
        if k.allowed is not None:
            line = next(l for l in doc.splitlines() if l.startswith(f"| `{k.name}` |"))
            assert k.allowed.allowed.replace("|", "\\|") in line, k.name


@pytest.mark.parametrize("path", sorted(str(p.relative_to(ROOT))
                                        for p in (ROOT / "configs").glob("*.py")))
def test_config_files_state_only_what_differs_from_the_defaults(path):
    """A shipped config sets no key to its default value, except where it starts from
    another config (tiny_moe) and sets the key back to the default."""
    import ast
    tree = ast.parse((ROOT / path).read_text())
    defaults = {k.name.rpartition(".")[2]: k.default for k in keys.KEYS}
    base = load_config("configs/tiny_moe.py")
    derived = "tiny_moe.py" in (ROOT / path).read_text() and not path.endswith("tiny_moe.py")
    for node in ast.walk(tree):
        if isinstance(node, ast.keyword) and node.arg in defaults:
            value = ast.literal_eval(node.value)
            section = next(k.name.partition(".")[0] for k in keys.KEYS
                           if k.name.rpartition(".")[2] == node.arg)
            if derived and base[section][node.arg] != defaults[node.arg]:
                continue  # set back to the default from tiny_moe's value
            assert value != defaults[node.arg], f"{path}: {node.arg}={value!r} is the default"


def test_a_loaded_config_is_complete_and_completed_once(monkeypatch):
    config = load_config("configs/tiny_moe.py")
    assert is_complete(config) and config.is_locked
    with pytest.raises(AttributeError, match="num_expert"):
        config.model.num_expert = 3  # a typo is refused at once (a locked ConfigDict)
    from jaxmp.train import config as config_module
    calls = []
    monkeypatch.setattr(config_module, "default_config",
                        lambda: calls.append(1) or default_config())
    settings = validate_config(config, 1)
    assert calls == [] and settings.config.to_dict() == config.to_dict()
    assert settings.config is not config  # a copy: the caller's config is its own
