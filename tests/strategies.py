"""The project's Hypothesis strategies: the public ones from ``metrale.testing``, in one place,
and the tests' own (launch formulas and the sizes they read)."""

from hypothesis import strategies as st

from metrale.testing import (  # noqa: F401 - re-exported for the test modules
    boxes,
    composable_chains,
    diagrams,
    diagrams_over,
    tensor_products,
    tensor_types,
    tys,
)

FORMULA_NAMES = ("a", "b", "c")


def _formula_step(inner: st.SearchStrategy) -> st.SearchStrategy:
    return st.one_of(
        st.tuples(inner, st.sampled_from(["+", "-", "*", "/", "//", "%"]), inner)
        .map(lambda t: f"({t[0]} {t[1]} {t[2]})"),
        inner.map(lambda x: f"-{x}"),
        st.tuples(st.sampled_from(["ceil", "floor"]), inner).map(lambda t: f"{t[0]}({t[1]})"),
        st.tuples(st.sampled_from(["min", "max"]), st.lists(inner, min_size=1, max_size=3))
        .map(lambda t: f"{t[0]}({', '.join(t[1])})"))


launch_formulas = st.recursive(
    st.one_of(st.sampled_from(FORMULA_NAMES), st.integers(0, 5000).map(str),
              st.sampled_from(["0.5", "2.5", "-0.0", "1e400"])),
    _formula_step, max_leaves=12)
"""Launch formulas over the sizes ``a``, ``b``, ``c``: every operator and function the
language has, divisions by zero, infinities and -0 among them."""

formula_sizes = st.dictionaries(
    st.sampled_from(FORMULA_NAMES),
    st.one_of(st.integers(-3, 10**6), st.sampled_from([0, 1, 2, 64, 2048]),
              st.floats(allow_nan=True, allow_infinity=True), st.booleans(), st.just("8")))
"""Sizes for ``launch_formulas``: numbers (0, negatives, inf, NaN), and what is no size (a bool,
a string, a missing name)."""
