"""The shared argument checks (jaxmp._checks) and the config table built on them."""
import math

import numpy as np
import pytest

from _configs import small_config
from jaxmp import _checks
from jaxmp._checks import Choice, Int, Real
from jaxmp.train.config import ALLOWED, validate_config
from jaxmp.train.data import create_pipeline


@pytest.mark.parametrize("spec, good, bad", [
    (Int(1), [1, 7, np.int32(3), 2**40], [0, -1, True, 1.0, "1", None]),
    (Int(0, 3), [0, 3, np.int64(2)], [-1, 4, False, 2.5]),
    (Int(0, none_ok=True), [None, 0, 5], [-1, "x"]),
    (Real(0, 1, hi_open=True), [0, 0.5, np.float32(0.25), 0.999], [1, 1.0, -0.1, math.nan, True]),
    (Real(0, lo_open=True), [1e-30, 5], [0, 0.0, math.inf, -1]),
    (Real(), [-1e30, 0, 3], [math.inf, -math.inf, math.nan, None]),
    (Real(0, finite=False), [0, math.inf], [-1, math.nan]),
    (Choice(("a", "b")), ["a", "b"], ["c", None, ["a"], 1]),
])
def test_specs_accept_exactly_their_values(spec, good, bad):
    assert all(spec.ok(v) for v in good)
    assert not any(spec.ok(v) for v in bad)


@pytest.mark.parametrize("call, message", [
    (lambda: _checks.check_int("n", 0, 1), "n=0 must be an integer >= 1"),
    (lambda: _checks.check_int("n", True, 0, 3), "n=True must be an integer in [0, 3]"),
    (lambda: _checks.check_real("r", 1.5, 0, 1, lo_open=True),
     "r=1.5 must be a finite number in (0, 1]"),
    (lambda: _checks.check_real("r", -1, 0), "r=-1 must be a finite number >= 0"),
    (lambda: _checks.check_choice("c", "z", ("x", "y")), "c='z' is not allowed; allowed: x, y"),
])
def test_one_line_errors_name_the_value_and_what_is_allowed(call, message):
    with pytest.raises(ValueError) as e:
        call()
    assert str(e.value) == message


def test_the_checks_return_plain_python_numbers():
    assert type(_checks.check_int("n", np.int64(4), 1)) is int
    assert type(_checks.check_real("r", np.float32(0.5), 0, 1)) is float


@pytest.mark.parametrize("seed, ok", [(0, True), (2**31 - 2, True), (2**31 - 1, False),
                                      (2**32, False), (-1, False)])
def test_the_run_config_and_the_data_pipeline_agree_on_the_seed(seed, ok):
    config = small_config()
    config.seed = seed
    if ok:
        validate_config(config, 8)
        return
    with pytest.raises(ValueError, match=rf"^seed={seed} is not allowed; it must be an integer in "
                                         r"\[0, 2\*\*31 - 1\)$"):
        validate_config(config, 8)
    # The pipeline checks its seed before it reads any corpus.
    match = rf"^seed={seed} must be an integer in \[0, 2\*\*31 - 1\)$"
    with pytest.raises(ValueError, match=match):
        create_pipeline(config.data, global_batch_size=16, seed=seed)


def test_every_table_key_is_a_config_key_and_its_default_passes():
    config = small_config()
    for key, spec in ALLOWED.items():
        node = config
        for part in key.split("."):
            node = node[part]
        assert spec.ok(node), key
