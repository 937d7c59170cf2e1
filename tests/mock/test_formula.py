"""Launch formulas: the compiled fast path computes what the tree walk computes, value for value
and error for error, on any formula and any sizes."""

from __future__ import annotations

import math

import pytest
from hypothesis import given

from metrale.lkb.errors import LaunchError
from metrale.realize import formula
from tests.strategies import formula_sizes, launch_formulas


def _outcome(fn, text: str, env: dict) -> tuple[str, object]:
    try:
        value = fn(text, env)
    except LaunchError as e:
        return "error", str(e)
    return type(value).__name__, "nan" if isinstance(value, float) and math.isnan(value) \
        else repr(value)


@given(launch_formulas, formula_sizes)
def test_the_compiled_formula_is_the_walk(text: str, env: dict) -> None:
    """Same type and bits (-0.0 and NaN told apart by repr), or the same typed error."""
    walked = _outcome(lambda t, e: formula._walk(t, e, None, ""), text, env)
    assert _outcome(formula.eval_formula, text, env) == walked, text


def test_the_fast_path_serves_numbers_and_leaves_the_rest_to_the_walk() -> None:
    """A formula compiles once; sizes that are not numbers, and a division by zero, get the
    walk's typed errors."""
    assert formula._compiled("ceil(n / 4) * 2") is formula._compiled("ceil(n / 4) * 2")
    assert formula.eval_formula("ceil(n / 4) * 2", {"n": 1030}) == 516
    assert _outcome(formula.eval_formula, "n // m", {"n": 1, "m": 0}) == (
        "error", "division by zero in a launch formula (expected a non-zero divisor, "
                 "found 'n // m')")
    assert "size 'n' is not a number" in _outcome(formula.eval_formula, "n + 1", {"n": True})[1]
    assert "size 'm' is not bound" in _outcome(formula.eval_formula, "n + m", {"n": 1})[1]


def test_a_formula_past_500_characters_is_refused_as_the_walk_refuses_it() -> None:
    """The compiled path takes only what parse_formula takes: a long formula, arithmetic all
    the same, is a ConfigError naming the file and key, not a number."""
    from metrale.lkb.errors import ConfigError

    long = " + ".join(["n"] * 200)
    with pytest.raises(ConfigError, match="not a launch formula"):
        formula.eval_formula(long, {"n": 1}, file="KERNELS.toml", key="launch.shared")
