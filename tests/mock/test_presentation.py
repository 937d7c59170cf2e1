"""The LKB presentation: loading, structure, round trip, and every malformed-TOML report."""

import math
import shutil
import time
from pathlib import Path

import pytest

from metrale.lkb.errors import ConfigError
from metrale.lkb.presentation import FAMILIES_FILE, FUSIONS_FILE, Presentation, default_kernels_dir

EXPECTED_FAMILIES = {
    "embedding", "rmsnorm", "add_rmsnorm", "linear", "qkv", "gate_up_swiglu", "qk_norm", "rope",
    "qk_norm_rope", "kv_append", "attention", "kv_append_attention", "softmax_topk",
    "moe_gate_up_swiglu", "moe_down", "moe_combine", "lm_head", "argmax", "dequant", "linear_add",
    "rope_kv_append_attention", "qk_norm_rope_kv_append_attention",
}
EXPECTED_RELATIONS = {
    "add_rmsnorm", "qkv_concat", "gate_up_swiglu", "qk_norm_rope", "kv_append_attention",
    "router_softmax_topk", "linear_residual", "dequant_linear", "rope_attention",
    "qk_norm_rope_attention",
}


@pytest.fixture(scope="module")
def P():
    return Presentation.load()


def test_shipped_presentation_is_sound(P):
    assert P.check() == []
    assert EXPECTED_FAMILIES <= set(P.family_names)
    assert EXPECTED_RELATIONS <= set(P.relation_names)
    assert any(not r.exact for r in P.relations)  # at least one bounded relation


def test_linear_has_every_weight_format_and_every_shape(P):
    points = P.family("linear").points
    assert {p.param("weight") for p in points} >= {"bf16", "fp8", "mxfp4", "nvfp4"}
    assert {p.param("shape") for p in points} == {"gemv", "gemm", "gemv_mma"}


def test_rope_has_both_styles(P):
    assert {p.param("style") for p in P.family("rope").points} == {"neox", "interleaved"}


def test_presentation_is_immutable_and_hashable(P):
    again = Presentation.load()
    assert again == P and hash(again) == hash(P)
    with pytest.raises(AttributeError):
        P.generators = ()
    assert P.family("rmsnorm").points[0].family == "rmsnorm"
    with pytest.raises(ConfigError, match="did you mean 'rmsnorm'"):
        P.family("rmsnrom")


def test_round_trip_keeps_comments_and_values(P, tmp_path):
    fam_text, fus_text = P.to_toml()
    assert fam_text == (default_kernels_dir() / FAMILIES_FILE).read_text()
    assert fus_text == (default_kernels_dir() / FUSIONS_FILE).read_text()
    P.write(tmp_path)
    assert Presentation.load(tmp_path) == P
    smaller = Presentation(P.generators, P.relations[:-1], P.sources)
    smaller.write(tmp_path)
    reloaded = Presentation.load(tmp_path)
    assert reloaded.relation_names == P.relation_names[:-1]
    assert "# The relations of the Latent Kernel Blueprint" in (tmp_path / FUSIONS_FILE).read_text()


def test_extend_checks_additions(P):
    rel = P.relation("add_rmsnorm")
    import attrs
    with pytest.raises(ConfigError, match="duplicate relation name"):
        P.extend(relations=[rel])
    assert len(P.extend(relations=[attrs.evolve(rel, name="copy")]).relations) == len(P.relations) + 1


def test_load_check_print_under_0_3_s():
    t0 = time.perf_counter()
    P = Presentation.load()
    P.check()
    str(P)
    P._repr_html_()
    assert time.perf_counter() - t0 < 0.3


def _tree(tmp_path: Path) -> Path:
    root = tmp_path / "kernels"
    root.mkdir()
    for name in (FAMILIES_FILE, FUSIONS_FILE):
        shutil.copy(default_kernels_dir() / name, root / name)
    return root


def _edit(root: Path, name: str, old: str, new: str) -> None:
    path = root / name
    text = path.read_text()
    assert old in text, old
    path.write_text(text.replace(old, new, 1))


FAM, FUS = FAMILIES_FILE, FUSIONS_FILE


def _line_of(text: str) -> int:
    lines = (default_kernels_dir() / FAMILIES_FILE).read_text().splitlines()
    return next(i for i, line in enumerate(lines, 1) if line.startswith(text))

MALFORMED = [
    # (file, old, new, parts the message must contain)
    (FAM, '[family.add]\n', '[family.add\n', [FAM, f":{_line_of('[family.add]')}:12", "TOML syntax error"]),
    (FAM, 'doc = "Elementwise', 'dco = "Elementwise', [FAM, "family.add.dco", "did you mean 'doc'"]),
    (FAM, 'params = { act = ["bf16", "f32"] }\npoints = [{ act = ["bf16", "f32"] }]\nexample = { rows = 3, h = 64 }',
     'params = { act = ["bf16", "f32"] }\npoints = [{ act = ["bf16", "fp9"] }]\nexample = { rows = 3, h = 64 }',
     [FAM, "family.add.points[0].act", "outside its parameter domain", "'fp9'"]),
    (FAM, 'inputs = ["a: {act}[rows, h]"', 'inputs = ["a {act}[rows, h]"', [FAM, "family.add.inputs[0]", "bad port"]),
    (FAM, 'outputs = ["s: {act}[rows, h]"]', 'outputs = ["s: fp9[rows, h]"]', [FAM, "family.add", "unknown dtype", "fp9"]),
    (FAM, 'row_invariant  row r', 'row_invariant  row r', []),  # placeholder replaced below
    (FAM, 'params = { act = ["bf16", "f32"], h_block = [256] }\npoints = [{ act = ["bf16", "f32"], h_block = 256 }]\nexample = { rows = 3, h = 640 }\n\n[family.add_rmsnorm]',
     'params = { act = ["bf16", "f32"], h_block = [256] }\npoints = [{ act = ["bf16", "f32"], h_block = 128 }]\nexample = { rows = 3, h = 640 }\n\n[family.add_rmsnorm]',
     [FAM, "family.rmsnorm.points[0].h_block", "one of 256", "128"]),
    (FUS, 'rhs = "s, y = add_rmsnorm(x, r, w)"', 'rhs = "s, y = add_rmsnrom(x, r, w)"',
     [FUS, "relation.add_rmsnorm.rhs", "undefined family 'add_rmsnrom'", "did you mean 'add_rmsnorm'"]),
    (FUS, 'lhs = "s = add(x, r); y = rmsnorm(s, w)"', 'lhs = "s = add(x, r); y = rmsnorm(s w)"',
     [FUS, "relation.add_rmsnorm.lhs", "col 30", "(found 'w')"]),
    (FUS, 'numerics = "bit_identical"\npriority = 20\n\n[relation.qkv_concat]',
     'numerics = "bit_identicle"\npriority = 20\n\n[relation.qkv_concat]',
     [FUS, "relation.add_rmsnorm.numerics", "bit_identical, bounded", "did you mean 'bit_identical'"]),
    (FUS, 'rhs = "h = gate_up_swiglu(x, wg, wu)"', 'rhs = "h = gate_up_swiglu(x, wg)"',
     [FUS, "relation.gate_up_swiglu", "takes 3 inputs"]),
    (FUS, 'rhs = "w, ids = softmax_topk(l)"', 'rhs = "w, ids = softmax(l)"',
     [FUS, "relation.router_softmax_topk"]),
    (FUS, 'lhs = "t = linear(x, w); y = add(r, t)"', 'lhs = "t = linear(x, w); y = add(x, t)"',
     [FUS, "relation.linear_residual", "same inputs"]),
    (FUS, 'rhs = "y = linear(x, wq)"', 'rhs = "y = linear[k_block=64](x, wq)"',
     [FUS, "relation.dequant_linear.rhs", "k_block outside its domain"]),
    (FUS, 'bound = { rel = "3 * eps_act", abs = "2 * (1 + eps_act) * gamma(k + 1, eps_f32)" }', '',
     [FUS, "relation.splitk_pairwise.bound", "states its bound"]),
    (FUS, 'lhs = "p = softmax(l); w, ids = topk(p)"', 'lhs = "p = softmax(l); w, ids = topk(q)"',
     [FUS, "relation.router_softmax_topk"]),
    (FUS, 'rhs = "qr, kr = qk_norm_rope(q, k, wq, wk, positions, cos, sin)"',
     'rhs = "qr, kr = qk_norm_rope(q, k, wq, wk, positions, sin, cos)"', []),
    (FUS, '[relation.splitk_pairwise]', '[relation.add_rmsnorm.extra]', [FUS, "relation.add_rmsnorm.extra", "unknown key"]),
]
MALFORMED = [m for m in MALFORMED if m[3]]
MALFORMED.append((FAM, "[family.rmsnorm]\n", "[family.rmsnorm]\nsemantics = \"rms_norm\"\n",
                  [FAM, "family.rmsnorm.semantics", "no reference semantics", "did you mean 'rmsnorm'"]))
MALFORMED.append((FUS, 'rhs = "s, y = add_rmsnorm(x, r, w)"', 'rhs = "s, y = add_rmsnorm(x, w, r)"',
                  [FUS, "relation.add_rmsnorm", "ill-typed side"]))
MALFORMED.append((FUS, 'at = { limit = inf }', 'at = { limit = "inf" }',
                  [FUS, "relation.mma_gemv_moe_gate_up_clamp.bound.at.limit",
                   "a magnitude attribute is a number", "'inf'"]))


def test_a_bound_names_the_attributes_its_magnitude_is_taken_at():
    """The clamped SwiGLU's bound scales with the sums before the clamp: its magnitude is the
    lhs at limit = inf, which the table round-trips."""
    P = Presentation.load()
    rel = P.relation("mma_gemv_moe_gate_up_clamp")
    assert rel.bound.at == (("limit", math.inf),)
    assert rel.to_table()["bound"]["at"] == {"limit": math.inf}
    assert P.relation("mma_gemv_moe_down_bias").bound.at == ()


@pytest.mark.parametrize("case", MALFORMED, ids=[f"{m[0]}:{m[2][:30]}" for m in MALFORMED])
def test_malformed_toml_is_reported_with_file_and_key(tmp_path, case):
    file, old, new, parts = case
    root = _tree(tmp_path)
    _edit(root, file, old, new)
    with pytest.raises(ConfigError) as e:
        Presentation.load(root)
    message = str(e.value)
    for part in parts:
        assert part in message, f"{part!r} not in {message!r}"


def test_at_least_twelve_distinct_malformed_files():
    assert len({(m[0], m[2]) for m in MALFORMED}) >= 12


def test_every_violation_is_reported_at_once(tmp_path):
    root = _tree(tmp_path)
    _edit(root, FAM, 'doc = "Elementwise', 'dco = "Elementwise')
    _edit(root, FUS, 'rhs = "s, y = add_rmsnorm(x, r, w)"', 'rhs = "s, y = add_rmsnrom(x, r, w)"')
    with pytest.raises(ConfigError) as e:
        Presentation.load(root)
    assert "2 problems" in str(e.value)
    assert len(e.value.errors) == 2


def test_huge_registry_refused_before_parsing(tmp_path):
    root = _tree(tmp_path)
    with open(root / FUSIONS_FILE, "a") as f:
        f.write("# " + "x" * (17 * 1024 * 1024) + "\n")
    with pytest.raises(ConfigError, match="too large"):
        Presentation.load(root)
