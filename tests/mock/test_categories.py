"""Small categories: posets, products (projections), coproducts (injections), targets."""

import pytest

from metrale.lkb import AxiomError, Coproduct, Discrete, KernelTarget, Poset, ProductCategory
from metrale.lkb.target import target_category
from metrale.testing import coproduct_laws, product_laws, small_category_laws

HW = Poset("Hw", ["cuda", "sm_80", "sm_90", "sm_89"],
           [("sm_80", "cuda"), ("sm_90", "sm_80"), ("sm_89", "sm_80")])


def test_poset_laws():
    small_category_laws(HW)
    assert HW.leq("sm_90", "cuda") and not HW.leq("cuda", "sm_90")
    assert not HW.leq("sm_89", "sm_90")


def test_product_laws_and_projections():
    T = target_category(HW, ["qwen3-0.6b", "llama-3.1-8b"], ["bf16", "fp8"])
    small_category_laws(T)
    product_laws(T)
    t = KernelTarget("sm_90", "qwen3-0.6b", "fp8")
    assert [T.projection(i)(t.as_tuple()) for i in range(3)] == ["sm_90", "qwen3-0.6b", "fp8"]
    arrow = T.arrow(("sm_90", "qwen3-0.6b", "fp8"), ("cuda", "qwen3-0.6b", "fp8"))
    assert T.projection(0)(arrow) == HW.arrow("sm_90", "cuda")
    assert not T.hom(("sm_90", "qwen3-0.6b", "fp8"), ("sm_90", "qwen3-0.6b", "bf16"))


def test_coproduct_injections_disjoint():
    C = Coproduct((Discrete("A", [1, 2]), Discrete("B", [1, 2]), HW))
    coproduct_laws(C)
    small_category_laws(C)
    assert C.inject(0, 1) != C.inject(1, 1)
    assert not C.hom(C.inject(0, 1), C.inject(1, 1))


def test_poset_refuses_cycles_and_strangers():
    with pytest.raises(AxiomError, match="cycle"):
        Poset("P", ["a", "b", "c"], [("a", "b"), ("b", "c"), ("c", "a")])
    with pytest.raises(AxiomError, match="not an element"):
        Poset("P", ["a"], [("a", "z")])


def test_product_composition_is_componentwise():
    P = ProductCategory((HW, HW))
    f = P.arrow(("sm_90", "sm_89"), ("sm_80", "sm_80"))
    g = P.arrow(("sm_80", "sm_80"), ("cuda", "cuda"))
    assert P.compose(f, g) == P.arrow(("sm_90", "sm_89"), ("cuda", "cuda"))
    with pytest.raises(AxiomError, match="cannot compose"):
        P.compose(g, f)
