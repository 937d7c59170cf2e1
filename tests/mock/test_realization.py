"""F_H: the chain walk (leaf > class common > ancestors), the host realization, strictness as a
functor, requirements, why-not messages, and KERNELS.toml validation."""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import attrs
import pytest

from metrale.lkb.diagram import Box, Diagram
from metrale.lkb.errors import AxiomError, ConfigError, LaunchError, ManyErrors
from metrale.lkb.family import Point
from metrale.lkb.functor import Functor
from metrale.lkb.presentation import Presentation
from metrale.lkb.target import KernelTarget
from metrale.realize.evidence import hash_source
from metrale.realize.formula import eval_formula, formula_names
from metrale.realize.functor import realization
from metrale.realize.hardware import default_kernels_dir
from metrale.realize.kernel import WORKSPACE_ALIGN, LaunchRule, WorkspaceSlice
from metrale.realize.relations import STATUSES, relation_on, relations_on
from metrale.runtime.cuda_loader import Arg
from metrale.testing import functor_laws
from tests.kernel_cases import matmul_point

SHIPPED = default_kernels_dir()
COMMON_TOML = (SHIPPED / "cuda" / "common" / "KERNELS.toml").read_text()
P = Presentation.load()
RMS_BF16 = P.family("rmsnorm").point(act="bf16", h_block=256)
RMS_F32 = P.family("rmsnorm").point(act="f32", h_block=256)
ARGMAX = P.family("argmax").point()


def table_text(name: str, **extra: str) -> str:
    """The shipped ``[kernel.NAME]`` table of cuda/common, with extra ``key = value`` lines."""
    m = re.search(rf"^\[kernel\.{name}\]\n(.*?)(?=^\[kernel\.|\Z)", COMMON_TOML, re.S | re.M)
    assert m, name
    body = m.group(1).rstrip() + "\n"
    return f"[kernel.{name}]\n{body}" + "".join(f"{k} = {v}\n" for k, v in extra.items())


@pytest.fixture
def tree(tmp_path: Path) -> Path:
    """A copy of the shipped kernels folder to add tables and sources to."""
    root = tmp_path / "kernels"
    shutil.copytree(SHIPPED, root, ignore=shutil.ignore_patterns("__pycache__", "*.py"))
    return root


def add_folder(root: Path, rel: str, tables: str, sources: dict[str, str]) -> None:
    folder = root / rel
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "KERNELS.toml").write_text(tables)
    for name, text in sources.items():
        (folder / name).write_text(text)


NORM = (SHIPPED / "cuda" / "common" / "norm.cu").read_text()


# ------------------------------------------------------------------------------- chain walk


def test_shipped_points_come_from_the_common_layer() -> None:
    F = realization("sm_90")
    k = F.realize(RMS_BF16)
    assert (k.provenance, k.source, k.entry) == ("cuda", "cuda/common/norm.cu", "metrale_rmsnorm")
    assert k.defines == ("-DACT_BF16", "-DH_BLOCK=256")
    assert not k.shadow and not k.residual and k.residual_reason == ""
    assert k.reduction == ("h (x²): f32, blocks of 256, partial sums combined sequentially",)
    assert "cuda/common/metrale.cuh" in k.headers
    assert all((SHIPPED / h).is_file() for h in k.headers)
    # the hash covers the headers: it is not the hash of the source alone
    assert k.source_hash != hash_source(NORM)
    assert len(F.kernels()) == sum(F.realizes(p) for p in P.points())


def test_chain_walk_leaf_then_own_common_then_ancestors(tree: Path) -> None:
    add_folder(tree, "sm_80/common", table_text("rmsnorm", reason='"Ampere rows"'),
               {"norm.cu": NORM})
    add_folder(tree, "sm_90/common", table_text("rmsnorm", reason='"Hopper rows"'),
               {"norm.cu": NORM + "\n// sm_90\n"})
    add_folder(tree, "sm_90/qwen3-0.6b/bf16",
               table_text("rmsnorm", when='{ act = ["bf16"] }'), {"norm.cu": NORM + "//q\n"})
    target = KernelTarget("sm_90", "qwen3-0.6b", "bf16")
    leaf = realization("sm_90", kernels_dir=tree, target=target)
    k = leaf.realize(RMS_BF16)
    assert (k.provenance, k.source) == ("sm_90", "sm_90/qwen3-0.6b/bf16/norm.cu")
    assert k.residual and k.residual_kind == "per-point copy" and k.shadow
    assert k.residual_reason == "no reason given"
    # the leaf claims only act=bf16: f32 falls through to the class's own common folder
    k32 = leaf.realize(RMS_F32)
    assert (k32.provenance, k32.source) == ("sm_90", "sm_90/common/norm.cu")
    assert k32.residual_kind == "shadow" and k32.residual_reason == "Hopper rows"
    # without a target there is no leaf
    assert realization("sm_90", kernels_dir=tree).realize(RMS_BF16).source == \
        "sm_90/common/norm.cu"
    # sm_89 inherits sm_80 only: sm_80's shadow of cuda
    k89 = realization("sm_89", kernels_dir=tree).realize(RMS_BF16)
    assert (k89.provenance, k89.source, k89.shadow) == ("sm_80", "sm_80/common/norm.cu", True)
    # sm_100 does not inherit sm_90 (wgmma is not Blackwell's): it never sees sm_90's folder
    assert realization("sm_100", kernels_dir=tree).realize(RMS_BF16).provenance == "sm_80"
    # the leaf's headers resolve through the chain (norm.cu includes cuda/common's headers)
    assert "cuda/common/metrale.cuh" in k.headers
    assert k.source_hash != k32.source_hash


def test_every_nvidia_class_resolves_every_point_it_can(tree: Path) -> None:
    for hw in ("sm_80", "sm_89", "sm_90", "sm_100", "sm_120", "sm_121", "cuda"):
        F = realization(hw)
        for k in F.kernels():  # the common layer's, or (sm_90's GEMMs and online prefill
            # attention) the class's own
            assert k.hw == hw and k.provenance in ("cuda", hw)
            assert (SHIPPED / k.source).is_file()
            assert (k.provenance != "cuda") == (k.source in (
                "sm_90/common/gemm_wgmma.cu", "sm_90/common/gemm_tma.cu",
                "sm_90/common/gemm_chain.cu", "sm_90/common/attention_wgmma.cu")), k


# --------------------------------------------------------------------------------- host


def test_host_realizes_every_point_by_the_reference_semantics() -> None:
    F = realization("host")
    assert F.by_semantics
    for fam in P.generators:
        for p in fam.points:
            k = F.realize(p)
            assert k is not None, F.why_not(p)
            assert (k.source, k.entry, k.provenance) == (None, fam.semantics, "host")
            assert k.reduction == fam.reductions(p)
            assert k.launch is None and k.defines == ()
    assert len(F.kernels()) == len(P.points())
    with pytest.raises(LaunchError, match="host callable"):
        F.realize(RMS_BF16).launch_for({"rows": 1, "h": 8})


# ------------------------------------------------------------------------------- functor


def generators() -> list:
    """Boxes of a few families' points, dims renamed so that they compose."""
    fams = [("add", {}), ("rmsnorm", {}), ("swiglu", {"n": "h"}), ("add_rmsnorm", {})]
    out = []
    for name, dims in fams:
        fam = P.family(name)
        for p in fam.points:
            if p.param("act") == "bf16":
                out.append(fam.box(p, {"eps": 1e-6} if fam.attrs else None, dims=dims))
    return out


@pytest.mark.parametrize("hw", ["sm_90", "host"])
def test_realization_is_a_strict_functor(hw: str) -> None:
    F = realization(hw)
    gens = generators()
    start = next(g.dom for g in gens if g.name == "add_rmsnorm")  # x, r, w: every box applies
    functor_laws(F.functor, gens, dom=start, max_examples=25)
    assert Functor.id("LKB") >> F.functor == F.functor
    assert F.functor.dom == "LKB" and F.functor.cod == f"Impl_{hw}"


def test_functor_image_carries_the_kernel_identity() -> None:
    F = realization("sm_90")
    add, rms = generators()[0], generators()[1]
    d = (add.diagram @ Diagram.id(rms.dom[1:])) >> rms.diagram
    image = F.functor(d)
    assert [b.name for b in image.boxes] == ["metrale_add", "metrale_rmsnorm"]
    assert image.dom == d.dom and image.cod == d.cod
    kb = image.boxes[1]
    assert kb.param("kernel") == F.realize(RMS_BF16).key
    assert kb.param("eps") == 1e-6 and kb.param("act") == "bf16"
    # a view's image is a zero-cost view box (F_H is total on what L_H produces)
    fam = P.family("split_heads")
    view = F.functor(fam.box(fam.points[0])).boxes[0]
    assert view.name == "split_heads" and view.param("kernel") == "view"
    assert F.kernel_of(view) is None
    # the image of a point not realized is an error naming why
    stray = Box("rmsnorm", rms.dom, rms.cod, {**dict(rms.params), "h_block": 7})
    with pytest.raises(AxiomError, match="not a compiled point of rmsnorm"):
        F.functor(stray)


# ---------------------------------------------------------------------------- requirements


def test_requirements_are_data(tree: Path) -> None:
    text = COMMON_TOML.replace('entry = "metrale_argmax"\n',
                               'entry = "metrale_argmax"\nrequires = ["fp4"]\n')
    (tree / "cuda" / "common" / "KERNELS.toml").write_text(text)
    assert realization("sm_100", kernels_dir=tree).realizes(ARGMAX)
    F80 = realization("sm_80", kernels_dir=tree)
    assert F80.realize(ARGMAX) is None
    assert F80.why_not(ARGMAX) == \
        "argmax[]: kernel argmax (cuda/common) requires fp4, which sm_80 lacks"


def test_first_table_whose_requirements_hold_wins(tree: Path) -> None:
    wg = table_text("rmsnorm", requires='{ tensor_core = "wgmma" }').replace(
        "[kernel.rmsnorm]", "[kernel.rmsnorm_wgmma]\nfamily = \"rmsnorm\"").replace(
        "metrale_rmsnorm", "metrale_rmsnorm_wgmma")
    (tree / "cuda" / "common" / "KERNELS.toml").write_text(wg + "\n" + COMMON_TOML)
    assert realization("sm_90", kernels_dir=tree).realize(RMS_BF16).entry == \
        "metrale_rmsnorm_wgmma"
    assert realization("sm_100", kernels_dir=tree).realize(RMS_BF16).entry == "metrale_rmsnorm"
    assert realization("sm_80", kernels_dir=tree).realize(RMS_BF16).entry == "metrale_rmsnorm"


def test_only_a_requirement_table_then_why_names_what_is_missing(tree: Path) -> None:
    text = COMMON_TOML.replace('entry = "metrale_argmax"\n',
                               'entry = "metrale_argmax"\nrequires = { tensor_core = "wgmma", '
                               'max_shared_mem_per_block = 200000 }\n')
    (tree / "cuda" / "common" / "KERNELS.toml").write_text(text)
    assert realization("sm_90", kernels_dir=tree).realizes(ARGMAX)
    why = realization("sm_100", kernels_dir=tree).why_not(ARGMAX)
    assert "requires tensor_core wgmma, which sm_100 lacks (it has tcgen05)" in why
    why = realization("sm_89", kernels_dir=tree).why_not(ARGMAX)
    assert "requires max_shared_mem_per_block >= 200000, which sm_89 lacks (it has 101376)" in why


def test_a_requirement_can_exclude_a_capability(tree: Path) -> None:
    text = COMMON_TOML.replace('entry = "metrale_argmax"\n',
                               'entry = "metrale_argmax"\nrequires = { fp8 = false, '
                               'compute_capability = [8, 0] }\n')
    (tree / "cuda" / "common" / "KERNELS.toml").write_text(text)
    assert realization("sm_80", kernels_dir=tree).realizes(ARGMAX)
    assert realization("sm_90", kernels_dir=tree).why_not(ARGMAX).endswith(
        "requires no fp8, which sm_90 has")
    assert "requires compute_capability >= [8, 0], which cuda lacks (it has None)" in \
        realization("cuda", kernels_dir=tree).why_not(ARGMAX)


def test_a_requirement_can_name_any_true_or_false_capability(tree: Path) -> None:
    """dependent_launch, like the number formats, is required as true or false."""
    text = COMMON_TOML.replace('entry = "metrale_argmax"\n',
                               'entry = "metrale_argmax"\nrequires = { dependent_launch = true }\n')
    (tree / "cuda" / "common" / "KERNELS.toml").write_text(text)
    assert realization("sm_90", kernels_dir=tree).realizes(ARGMAX)
    assert realization("sm_80", kernels_dir=tree).why_not(ARGMAX).endswith(
        "requires dependent_launch, which sm_80 lacks")
    (tree / "cuda" / "common" / "KERNELS.toml").write_text(
        text.replace("dependent_launch = true", "dependent_launch = 1"))
    with pytest.raises(ManyErrors, match="requires.dependent_launch: wrong type"):
        realization("sm_90", kernels_dir=tree)


# ----------------------------------------------------------------------------- why not


def test_why_not_messages(tree: Path) -> None:
    text = re.sub(r"\[kernel\.argmax\]\n.*?(?=^\[kernel\.|\Z)", "", COMMON_TOML, flags=re.S | re.M)
    (tree / "cuda" / "common" / "KERNELS.toml").write_text(text)
    F = realization("sm_80", kernels_dir=tree)
    assert F.why_not(ARGMAX) == "no kernel for argmax[] in sm_80's chain (sm_80, cuda)"
    assert realization("sm_121", kernels_dir=tree).why_not(ARGMAX).endswith(
        "sm_121's chain (sm_121, sm_120, sm_80, cuda)")
    assert F.why_not(Point("rmsnrom", ())) == \
        "no family 'rmsnrom' in the presentation (did you mean 'rmsnorm'?)"
    odd = Point("rmsnorm", (("act", "bf16"), ("h_block", 512)))
    assert F.why_not(odd) == "rmsnorm[act=bf16,h_block=512] is not a compiled point of rmsnorm"
    assert F.why_not(RMS_BF16).startswith("rmsnorm[act=bf16,h_block=256] is realized on sm_80")


def test_point_order_does_not_matter() -> None:
    """A point rebuilt from a box's sorted parameters resolves like the family's own."""
    F = realization("sm_90")
    lin = P.family("linear").points[0]
    shuffled = Point("linear", tuple(sorted(lin.params)))
    assert F.realize(shuffled) == F.realize(lin)


# ------------------------------------------------------------------------------ validation


def test_bad_tables_report_every_error_with_file_and_key(tree: Path) -> None:
    bad = (table_text("rmsnorm").replace("entry =", "entyr =")
           .replace('"rows", "1", "1"]', '"rowz", "1", "1"]')
           + table_text("add").replace("[kernel.add]", "[kernel.add2]\nfamily = \"add\"")
           .replace('"a:ptr"', '"a:pointer"').replace('source = "misc.cu"',
                                                     'source = "misc.cuu"'))
    add_folder(tree, "sm_90/common", bad, {"norm.cu": NORM})
    with pytest.raises(ManyErrors) as info:
        realization("sm_90", kernels_dir=tree)
    text = str(info.value)
    where = str(tree / "sm_90" / "common" / "KERNELS.toml")
    assert f"{where}: kernel.rmsnorm.entyr: unknown key; did you mean 'entry'?" in text
    assert f"{where}: kernel.rmsnorm.entry: missing key" in text
    assert "kernel.rmsnorm.launch.grid[0]: unknown size 'rowz' in formula" in text
    assert "did you mean 'rows'?" in text
    assert "kernel.add2.args[0]: unknown argument type" in text
    assert "kernel.add2.source: source not found in sm_90/common" in text


def test_a_dtype_parameter_gives_its_element_bytes_to_the_formulas(tree: Path) -> None:
    """``act_bytes``: the bytes of an element of the dtype the point's ``act`` names, so one
    table sizes a launch for bf16 and f32 rows alike; a parameter whose values are not all
    dtypes (``h_block``) gives none, and a formula reading it is refused by file and key."""
    shared = table_text("rmsnorm").replace('shared = "0"', 'shared = "h * act_bytes + 16"')
    add_folder(tree, "sm_90/common", shared, {"norm.cu": NORM})
    F = realization("sm_90", kernels_dir=tree)
    for point, size in ((RMS_BF16, 2), (RMS_F32, 4)):
        kernel = F.realize(point)
        assert kernel.launch_for({"rows": 3, "h": 1024, "eps": 1e-6})[2] == 1024 * size + 16
    add_folder(tree, "sm_90/common", shared.replace("act_bytes", "h_block_bytes"),
               {"norm.cu": NORM})
    with pytest.raises(ConfigError, match=r"kernel\.rmsnorm\.launch\.shared: unknown size "
                                          "'h_block_bytes'"):
        realization("sm_90", kernels_dir=tree)


def refusal(tree: Path, tables: str) -> tuple[str, str]:
    """The errors sm_90's realization raises with ``tables`` as its own KERNELS.toml (over
    norm.cu), and that file's path as they name it."""
    add_folder(tree, "sm_90/common", tables, {"norm.cu": NORM})
    with pytest.raises((ManyErrors, ConfigError)) as info:  # one error raises alone
        realization("sm_90", kernels_dir=tree)
    return str(info.value), str(tree / "sm_90" / "common" / "KERNELS.toml")


def test_a_scratch_argument_needs_a_formula_for_its_bytes(tree: Path) -> None:
    bad = table_text("rmsnorm").replace('"y:ptr",', '"y:ptr", "work:scratch",')
    assert "work:scratch" in bad
    text, where = refusal(tree, bad)
    assert (f"{where}: kernel.rmsnorm.args[3]: a scratch argument needs its bytes "
            "(expected a formula values.work or a tensor scratch.work") in text


def test_a_scratch_tensor_lies_after_the_byte_scratch_in_one_workspace(tree: Path) -> None:
    """``scratch = { NAME = { dtype, shape } }``: a tensor the kernel's launches share in the
    program's workspace, passed as its bytes (``NAME:scratch``) or its tensor map
    (``NAME:tmap(C,R)``). It lies past the byte scratches (``values``' bytes, from offset 0), at
    a multiple of WORKSPACE_ALIGN, each after the one before; its shape's formulas read the
    launch's sizes, and 0 rows take no bytes."""
    from metrale.runtime.cuda_loader import parse_args

    table = table_text("rmsnorm", values='{ ws = "3 * rows + 1" }',
                       scratch='{ t = { dtype = "bf16", shape = ["rows", "h"] }, '
                               'u = { dtype = "u8", shape = ["min(1, rows - 2)", "h"] } }')
    table = table.replace('"y:ptr",', '"y:ptr", "ws:scratch", "t:scratch", "u:tmap(64,8)",')
    add_folder(tree, "sm_90/common", table, {"norm.cu": NORM})
    kernel = realization("sm_90", kernels_dir=tree).realize(RMS_BF16)
    assert [a.kind for a in parse_args(kernel.args)][3:6] == ["scratch", "scratch", "tmap"]
    work = kernel.workspace({"rows": 3, "h": 100})
    assert work == {"ws": WorkspaceSlice(0, 10),
                    "t": WorkspaceSlice(WORKSPACE_ALIGN, 3 * 100 * 2, 3, 100, "bf16"),
                    "u": WorkspaceSlice(2 * WORKSPACE_ALIGN, 100, 1, 100, "u8")}
    assert kernel.workspace({"rows": 2, "h": 100})["u"].nbytes == 0


@pytest.mark.parametrize("scratch,args,message", [
    ('{ t = { dtype = "f16", shape = ["rows", "h"] } }', '"t:scratch"',
     "kernel.rmsnorm.scratch.t.dtype: unknown scratch dtype (expected one of bf16, f32, u8"),
    ('{ t = { dtype = "bf16", shape = ["rows"] } }', '"t:scratch"',
     "kernel.rmsnorm.scratch.t.shape: two formulas (rows, columns)"),
    ('{ t = { dtype = "bf16", shape = ["rowz", "h"] } }', '"t:scratch"',
     "kernel.rmsnorm.scratch.t.shape[0]: unknown size 'rowz' in formula"),
    ('{ t = { dtype = "bf16", shape = ["rows", "h"] } }', '"t:ptr"',
     "kernel.rmsnorm.args[3]: a scratch tensor is passed as its bytes or its tensor map"),
    ('{ t = { dtype = "bf16", shape = ["rows", "h"] } }', "",
     "kernel.rmsnorm.scratch.t: a scratch tensor no launch takes"),
    ('{ x = { dtype = "bf16", shape = ["rows", "h"] } }', "",
     "kernel.rmsnorm.scratch.x: a scratch tensor's name is a new identifier"),
    ('{ t = { dtype = "bf16", shape = ["rows", "h"], align = 16 } }', '"t:scratch"',
     "kernel.rmsnorm.scratch.t.align: unknown key"),
], ids=["dtype", "shape", "size", "ptr", "unused", "port", "key"])
def test_a_scratch_tensor_is_refused_by_file_and_key(tree: Path, scratch: str, args: str,
                                                     message: str) -> None:
    table = table_text("rmsnorm", scratch=scratch).replace('"y:ptr",', f'"y:ptr", {args},'
                                                           if args else '"y:ptr",')
    text, where = refusal(tree, table)
    assert f"{where}: {message}" in text, text


def test_a_tensor_map_argument_describes_an_input_in_a_box_it_can_copy(tree: Path) -> None:
    """``tmap(C,R)``: a tensor map of an input port, parsed with its box; on an output port, or
    with a box past the copy engine's 256 x 256, the table is refused by file and key."""
    from metrale.runtime.cuda_loader import parse_args

    good = table_text("rmsnorm").replace('"x:ptr"', '"x:tmap(64,128)"')
    add_folder(tree, "sm_90/common", good, {"norm.cu": NORM})
    kernel = realization("sm_90", kernels_dir=tree).realize(RMS_BF16)
    assert parse_args(kernel.args)[0] == Arg("x", "tmap", (64, 128))
    text, where = refusal(tree, table_text("rmsnorm").replace('"y:ptr"', '"y:tmap(64,128)"')
                          + table_text("add").replace('"a:ptr"', '"a:tmap(64,512)"'))
    assert (f"{where}: kernel.rmsnorm.args[2]: a tensor map describes an input port or a "
            "scratch tensor (expected an input of rmsnorm or a name in `scratch`") in text
    assert "kernel.add.args[0]: a tensor map's box is 1..256 by 1..256" in text


def test_reduction_orders_must_be_the_semantics(tree: Path) -> None:
    bad = table_text("rmsnorm").replace("combined sequentially", "combined pairwise")
    add_folder(tree, "sm_90/common", bad, {"norm.cu": NORM})
    with pytest.raises(ConfigError, match="kernel.rmsnorm.reduction: order differs"):
        realization("sm_90", kernels_dir=tree)


def test_overlapping_tables_in_one_folder_are_an_error(tree: Path) -> None:
    two = table_text("rmsnorm") + table_text("rmsnorm").replace(
        "[kernel.rmsnorm]", "[kernel.rmsnorm_again]\nfamily = \"rmsnorm\"")
    add_folder(tree, "sm_90/common", two, {"norm.cu": NORM})
    with pytest.raises(ConfigError, match="both claim rmsnorm"):
        realization("sm_90", kernels_dir=tree)


def test_bad_requirements_name_the_nearest_capability(tree: Path) -> None:
    add_folder(tree, "sm_90/common", table_text("rmsnorm", requires='["fp9"]'), {"norm.cu": NORM})
    with pytest.raises(ConfigError, match=r"requires.fp9: unknown capability .*'fp8'"):
        realization("sm_90", kernels_dir=tree)


def test_target_of_another_class_is_refused() -> None:
    with pytest.raises(ConfigError, match="target of another class"):
        realization("sm_90", target=KernelTarget("sm_80", "m", "q"))


# -------------------------------------------------------------------------------- launch


def test_launch_rules_bind_and_refuse(tree: Path) -> None:
    own = table_text("add").replace(
        re.search(r"^launch = .*$", table_text("add"), re.M).group(0),
        'launch = { grid = ["ceil(count / 256)", "1", "1"], block = ["256", "1", "1"], '
        'shared = "4 * h" }').replace(re.search(r"^values = .*$", table_text("add"),
                                                re.M).group(0), 'values = { count = "rows * h" }')
    add_folder(tree, "sm_90/common", own, {"misc.cu": (SHIPPED / "cuda/common/misc.cu")
                                           .read_text()})
    k = realization("sm_90", kernels_dir=tree).realize(P.family("add").point(act="bf16"))
    assert k.launch_for({"rows": 3, "h": 1000}) == ((12, 1, 1), (256, 1, 1), 4000)
    assert k.sizes({"rows": 3, "h": 1000})["count"] == 3000
    with pytest.raises(LaunchError, match="size 'h' is not bound"):
        k.launch_for({"rows": 3})
    rule = LaunchRule(("n / 3", "1", "1"), ("1", "1", "1"), "0")
    with pytest.raises(LaunchError, match="not a whole number"):
        rule.bind({"n": 4})
    with pytest.raises(LaunchError, match="out of range"):
        LaunchRule(("n - 5", "1", "1"), ("1", "1", "1"), "0").bind({"n": 4})
    # point parameters are sizes too (a block count over k_block)
    lin = realization("sm_90").realize(P.family("linear").points[0])
    assert lin.sizes({"k": 1024})["k_block"] == 256


@pytest.mark.parametrize("text", ["x.y", "f(1)", "__import__('os')", "[1]", "1 if 2 else 3",
                                  "True", "2 ** 3", "'a'", "lambda: 1", "\x00", "(" * 500])
def test_formulas_are_arithmetic_only(text: str) -> None:
    with pytest.raises(ConfigError, match="not a launch formula"):
        formula_names(text)


def test_formula_values() -> None:
    assert eval_formula("ceil(n / 4) + min(a, 2) * max(b, 1) - floor(c / 2) + d % 3",
                        {"n": 9, "a": 5, "b": 0, "c": 5, "d": 7}) == 3 + 2 - 2 + 1
    assert formula_names("ceil(nq / 4) + max(1, k)") == {"nq", "k"}


# --------------------------------------------------------------------------- relations on H


def test_relations_on_the_host_follow_the_declared_numerics() -> None:
    found = {r.relation.name: r for r in relations_on(realization("host"))}
    assert found["splitk_pairwise"].status == "bounded"
    assert found["splitk_pairwise"].bound == P.relation("splitk_pairwise").bound
    exact = [r for r in P.relations if r.exact]
    assert all(found[r.name].status == "bit_identical" for r in exact)
    # dequant_linear has rhs points whose lhs (dequant[weight=f32] …) is not compiled
    assert "without a compiled lhs" in found["dequant_linear"].reason
    rhs = P.family("add_rmsnorm").point(act="bf16", h_block=256)
    (v,) = found["add_rmsnorm"].at(rhs)
    assert [str(p) for p in v.lhs] == ["add[act=bf16]", "rmsnorm[act=bf16,h_block=256]"]
    assert found["add_rmsnorm"].holds_exactly(rhs)


def test_a_shadow_with_another_order_makes_a_relation_differ(tree: Path) -> None:
    """sm_90 shadows add_rmsnorm at act=bf16 with a stated within-block order; rmsnorm (from
    cuda) leaves it unstated: bit-identical at f32, differs at bf16, on sm_90 only."""
    text = table_text("add_rmsnorm", when='{ act = ["bf16"] }').replace(
        'sequentially"]', 'sequentially; within a block: left to right"]')
    add_folder(tree, "sm_90/common", text, {"norm.cu": NORM})
    r = relation_on(P.relation("add_rmsnorm"), realization("sm_90", kernels_dir=tree))
    assert r.status == "mixed"
    assert r.reason == "bit_identical at 1 point, differs at 1 point"
    bf16 = P.family("add_rmsnorm").point(act="bf16", h_block=256)
    f32 = P.family("add_rmsnorm").point(act="f32", h_block=256)
    (v,) = r.at(bf16)
    assert v.status == "differs" and "declares no bound" in v.reason
    assert not r.holds_exactly(bf16) and r.holds_exactly(f32)
    same = relation_on(P.relation("add_rmsnorm"), realization("sm_80", kernels_dir=tree))
    assert same.status == "bit_identical"


def test_a_relation_whose_rhs_is_not_realized(tree: Path) -> None:
    text = COMMON_TOML.replace('entry = "metrale_add_rmsnorm"\n',
                               'entry = "metrale_add_rmsnorm"\nrequires = ["fp4"]\n')
    (tree / "cuda" / "common" / "KERNELS.toml").write_text(text)
    r = relation_on(P.relation("add_rmsnorm"), realization("sm_90", kernels_dir=tree))
    assert r.status == "not realized"
    assert "requires fp4, which sm_90 lacks" in r.reason
    assert relation_on(P.relation("add_rmsnorm"),
                       realization("sm_100", kernels_dir=tree)).status == "bit_identical"


def test_relations_on_table_for_the_cli() -> None:
    from metrale.commands import relations_on_table

    table, rows = relations_on_table("sm_90")
    assert table.row_count == len(rows) == len(P.relations)
    assert {r["relation"] for r in rows} == set(P.relation_names)
    split = next(r for r in rows if r["relation"] == "splitk_pairwise")
    assert split["status"] == "bounded" and split["bound"]["rel"] == "3 * eps_act"
    assert all(p["status"] in STATUSES for r in rows for p in r["points"])


def test_a_launch_without_its_workspace_is_refused_naming_it() -> None:
    from metrale.runtime.cuda_loader import BoundKernel, parse_args

    fam = P.family("attention")
    point = next(p for p in fam.points if dict(p.params)["mode"] == "decode")
    kernel = realization("sm_90").realize(point)
    bound = BoundKernel(kernel, None, parse_args(kernel.args))
    numbers = {"rows": 2, "hq": 8, "hkv": 2, "d": 64, "slots": 2, "max_ctx": 600,
               "scale": 0.125, "window": 0}
    # a record of (m, l, 2 unused, 64 partials) floats for each of 2 rows x 8 q heads x 10 chunks
    # of 64 positions
    assert bound.workspace(numbers) == {"work": WorkspaceSlice(0, 2 * 8 * 10 * 68 * 4)}
    ptrs = {n: 1 for n in ("q", "k_cache", "v_cache", "positions", "slots", "o")}
    with pytest.raises(LaunchError, match="no workspace for scratch argument work"):
        bound.pack(ptrs, numbers)
    assert len(bound.pack({**ptrs, "work": 7}, numbers)) == len(bound.args)


def test_decode_attention_launches_its_merge_after_it_on_the_same_workspace() -> None:
    """Each decode attention kernel is two launches: the chunks' records, then their merge with
    a block per (q head, row), both handed the one workspace and the output."""
    F = realization("sm_90")
    numbers = {"rows": 3, "hq": 32, "hkv": 8, "d": 128, "max_ctx": 1025, "max_pos": 4096,
               "slots": 3, "scale": 0.09, "window": 0, "eps": 1e-6}
    for family in ("attention", "kv_append_attention", "rope_kv_append_attention",
                   "qk_norm_rope_kv_append_attention"):
        point = next(p for p in P.family(family).points if dict(p.params)["mode"] == "decode")
        k = F.realize(point)
        (e0, a0, (g0, _, _)), (e1, a1, (g1, b1, s1)) = k.launches_for(numbers)
        assert (e0, e1) == (k.entry, "metrale_attention_decode_merge") == k.entries
        assert g0 == (8, 3, 17) and g1 == (32, 3, 1) and b1 == (128, 1, 1)
        assert s1 == (32 * 132 + 96 + 132) * 4  # 32 records' window, factors, outputs, max, sum
        assert {"work:scratch", "o:ptr"} <= set(a0) & set(a1)


@pytest.mark.parametrize("weight,threshold", [("fp8", 384), ("nvfp4", 384), ("mxfp4", 256)])
@pytest.mark.parametrize("rows,made", [(16, "split"), (64, "split"), (65, "wgmma"),
                                       ("at", "wgmma"), ("past", "tma"), (2048, "tma")])
def test_a_quantized_gemm_makes_the_launches_its_rows_call_for(weight: str, threshold: int,
                                                               rows: int | str, made: str) -> None:
    """A quantized GEMM's chain: the weight made bf16, the Tensor Memory Accelerator's matmul on
    it, gemm_wgmma.cu's matmul, its combine of k splits. Past the table's threshold the first
    two are made and the others have empty grids; up to it gemm_wgmma.cu's, which up to 64 rows
    splits k over its grid and sums the splits in the combine launch (above, k is not split and
    the combine is not made at all). Every launch of the chain is its own entry."""
    from metrale.runtime.cuda_loader import BoundKernel, parse_args

    rows = {"at": threshold, "past": threshold + 1}.get(rows, rows)  # type: ignore[arg-type]
    F = realization("sm_90")
    for family in ("linear", "linear_add", "qkv", "gate_up_swiglu", "lm_head"):
        point = next(p for p in P.family(family).points if dict(p.params)["shape"] == "gemm"
                     and dict(p.params)["act"] == "bf16" and dict(p.params)["weight"] == weight)
        k = F.realize(point)
        numbers = {"rows": rows, "k": 4096, "n": 4096, "nq": 4096, "nk": 1024, "nv": 1024,
                   "sms": 132}
        dequant, tma, wgmma, combine = k.entries
        assert dequant.startswith("metrale_weight") and tma.endswith("_tma"), k.entries
        assert wgmma.endswith("_wgmma") and combine == wgmma + "_combine", k.entries
        want = {"split": [wgmma, combine], "wgmma": [wgmma], "tma": [dequant, tma]}[made]
        assert [e for e, _, _ in k.launches_for(numbers)] == want, (family, rows)
        assert (k.sizes(numbers)["splits"] > 1) == (made == "split")
        bound = BoundKernel(k, "own", parse_args(k.args),
                            tuple(("then", parse_args(t.args)) for t in k.then))
        assert bound.call(combine)[0] == "then" and bound.call(dequant)[0] == "own"
        with pytest.raises(LaunchError, match="makes no launch of metrale_rmsnorm"):
            bound.call("metrale_rmsnorm")
        scratch = [w for w in k.workspace(numbers).values() if w.dtype]
        assert len(scratch) == {"qkv": 3, "gate_up_swiglu": 2}.get(family, 1)
        assert all(w.nbytes == (w.rows * 4096 * 2 if made == "tma" else 0) for w in scratch)
    # rows of a k that is not whole 16-byte rows of bf16 cannot be copied by tensor map (fp8
    # alone takes such a k: the fp4 formats' k is a multiple of their 32- or 16-column blocks)
    if weight == "fp8":
        odd = F.realize(matmul_point(P.family("linear"), "gemm", weight))
        sizes = {"rows": 2048, "k": 1036, "n": 256, "sms": 132}
        assert [e for e, _, _ in odd.launches_for(sizes)] == ["metrale_linear_wgmma"]


@pytest.mark.parametrize("rows", [1, 9])
@pytest.mark.parametrize("n,split", [(128, True), (1024, True), (1025, False), (4096, False)])
def test_a_short_linear_makes_its_split_launch_in_place_of_its_own(n: int, split: bool,
                                                                    rows: int) -> None:
    """gemv.cu's linear and linear_add: up to n = 1024 the kernel's own launch (a warp a column)
    has an empty grid and is not made; its split launch (a block a column, its shared memory
    the k-block partials of 8 rows) is, and above 1024 the reverse. Past one row the multi-row
    entries take their place (9 rows: `_rows16`, a warp two columns or a block two columns, the
    partials of 2 columns of 16 rows). Exactly one is made. fp4 weights have no split launch:
    one warp a column (two past one row) at every n."""
    F = realization("sm_90")
    for family in ("linear", "linear_add"):
        point = P.family(family).point(act="bf16", weight="bf16", shape="gemv", k_block=256,
                                       across="sequential")
        k = F.realize(point)
        (entry, _, (grid, block, shared)), = k.launches_for({"rows": rows, "k": 2304, "n": n})
        assert block == (128, 1, 1)
        multi = "" if rows == 1 else "_rows16"
        if split and rows == 1:
            assert (entry, grid, shared) == (k.entry + "_split", (n, 1, 1), 9 * 8 * 4)
        elif split:
            assert (entry, grid, shared) == (k.entry + "_split_rows16", (-(-n // 2), 1, 1),
                                             9 * 2 * 16 * 4)
        else:
            assert (entry, grid, shared) == (k.entry + multi, (-(-n // (4 * (1 + (rows > 1)))),
                                                               1, 1), 0)
        fp4 = F.realize(P.family(family).point(**{**point.as_dict(), "weight": "mxfp4"}))
        assert [e for e, _, _ in fp4.launches_for(
            {"rows": rows, "k": 2304, "n": n})] == [k.entry + multi], fp4


def test_a_kernel_whose_every_launch_is_empty_is_refused(tree: Path) -> None:
    """A chain may leave out any of its launches where its grid is 0, but not all of them: at
    sizes where no launch would be made the kernel refuses them, naming the point and each
    entry's grid, rather than leave its outputs unwritten."""
    then = ('entry = "metrale_rmsnorm_again"\nargs = ["x:ptr"]\nlaunch = { grid = ["rows - 3", '
            '"1", "1"], block = ["1", "1", "1"] }')
    text = table_text("rmsnorm").replace('grid = ["rows", "1", "1"]', 'grid = ["rows - 3", "1", "1"]')
    assert 'grid = ["rows - 3", "1", "1"]' in text
    add_folder(tree, "sm_90/common", text + "\n[[kernel.rmsnorm.then]]\n" + then + "\n",
               {"norm.cu": NORM})
    k = realization("sm_90", kernels_dir=tree).realize(RMS_BF16)
    assert [e for e, _, _ in k.launches_for({"rows": 4, "h": 1024})] == [
        "metrale_rmsnorm", "metrale_rmsnorm_again"]
    with pytest.raises(LaunchError, match=r"makes no launch at these sizes") as e:
        k.launches_for({"rows": 3, "h": 1024})
    assert "metrale_rmsnorm(0, 1, 1)" in str(e.value) and str(RMS_BF16) in str(e.value)


def test_a_then_launch_of_an_entry_launched_already_is_refused(tree: Path) -> None:
    """A kernel's launches are told apart by their entries: a ``then`` launch may not repeat
    the kernel's own entry (nor an earlier ``then``'s)."""
    then = ('entry = "metrale_rmsnorm"\nargs = ["x:ptr"]\nlaunch = { grid = ["1", "1", "1"], '
            'block = ["1", "1", "1"] }')
    add_folder(tree, "sm_90/common",
               table_text("rmsnorm") + "\n[[kernel.rmsnorm.then]]\n" + then + "\n",
               {"norm.cu": NORM})
    with pytest.raises(ConfigError, match=r"kernel.rmsnorm.then\[0\].entry: launched twice"):
        realization("sm_90", kernels_dir=tree)


@pytest.mark.parametrize("then,words", [
    ('args = ["x:ptr"]\nlaunch = { grid = ["1", "1", "1"], block = ["1", "1", "1"] }',
     r"then\[0\].entry: missing key"),
    ('entry = "m"\nargs = ["heads:i32"]\nlaunch = { grid = ["1", "1", "1"], block = ["1", "1", '
     '"1"] }', r"then\[0\].args\[0\]: argument is not a port"),
    ('entry = "m"\nargs = ["x:ptr"]\nlaunch = { grid = ["rows", "heads", "1"], block = ["1", '
     '"1", "1"] }', r"then\[0\].launch.grid\[1\]: unknown size 'heads'"),
    ('entry = "m"\nargs = ["x:ptr"]\nlaunch = { grid = ["1", "1", "1"], block = ["1", "1", '
     '"1"] }\nshared = "0"', r"then\[0\].shared: unknown key"),
])
def test_bad_then_launches_are_named(tree: Path, then: str, words: str) -> None:
    add_folder(tree, "sm_90/common",
               table_text("rmsnorm") + "\n[[kernel.rmsnorm.then]]\n" + then + "\n",
               {"norm.cu": NORM})
    with pytest.raises(ConfigError, match=rf"kernel.rmsnorm.{words}"):
        realization("sm_90", kernels_dir=tree)


def test_the_prefill_attention_refuses_shapes_it_cannot_serve_before_launching() -> None:
    """The two-pass prefill attention traps on a head_dim that is not a multiple of 16 up to 256
    (and sm_80's mma.sync kernels on a group of more than 8 q heads); the tables' limits turn that
    into a typed error when the launch is bound, naming the point and the limit."""
    P = Presentation.load()
    for hw, threads, limits in (
            ("sm_90", 384, ()),  # two computing warpgroups and the producer
            ("sm_80", 128, (({"hq": 64, "hkv": 4}, "hq // hkv <= 8"),))):
        F = realization(hw)
        for family in ("attention", "kv_append_attention"):
            k = F.realize(P.family(family).point(act="bf16", mode="prefill", kv_block=256))
            base = {"rows": 40, "hq": 32, "hkv": 8, "d": 128, "max_ctx": 64, "slots": 1}
            assert k.launch_for(base)[1] == (threads, 1, 1)
            for bad, limit in (*limits, ({"d": 72}, "d % 16 == 0"), ({"d": 512}, "d <= 256"),
                               ({"hq": 12, "hkv": 8}, "hq % hkv == 0")):
                with pytest.raises(LaunchError, match="cannot serve these sizes") as e:
                    k.launch_for({**base, **bad})
                assert e.value.key == str(k.point) and e.value.expected == limit


@pytest.mark.parametrize("limit,words", [
    ('["h <= "]', "not a limit"),
    ('["h + 1"]', "not a limit"),
    ('["rows < h < 8"]', "not a limit"),
    ('["h.real <= 8"]', "not a launch formula"),
    ('["heads <= 8"]', "unknown size 'heads' in limit"),
])
def test_bad_limits_are_named(tree: Path, limit: str, words: str) -> None:
    add_folder(tree, "sm_90/common", table_text("rmsnorm", limits=limit), {"norm.cu": NORM})
    with pytest.raises(ConfigError, match=rf"kernel.rmsnorm.limits\[0\]: {words}"):
        realization("sm_90", kernels_dir=tree)


@pytest.mark.parametrize("traffic,words", [
    ('{ weights = "h" }', "rmsnorm has no such port"),
    ('{ w = "h * heads" }', "unknown size 'heads' in formula"),
    ('{ w = "h.real" }', "not a launch formula"),
])
def test_bad_traffic_is_named(tree: Path, traffic: str, words: str) -> None:
    add_folder(tree, "sm_90/common", table_text("rmsnorm", traffic=traffic), {"norm.cu": NORM})
    with pytest.raises(ConfigError, match=rf"kernel.rmsnorm.traffic.\w+: {words}"):
        realization("sm_90", kernels_dir=tree)


def test_a_limit_on_a_table_reaches_its_kernels(tree: Path) -> None:
    add_folder(tree, "sm_90/common", table_text("rmsnorm", limits='["h <= 4096"]'),
               {"norm.cu": NORM})
    k = realization("sm_90", kernels_dir=tree).realize(
        Point("rmsnorm", (("act", "bf16"), ("h_block", 256))))
    assert k.limits == ("h <= 4096",) and k.launch_for({"rows": 2, "h": 4096})[0] == (2, 1, 1)
    with pytest.raises(LaunchError, match="expected h <= 4096, found h=8192"):
        k.launch_for({"rows": 2, "h": 8192})


def test_every_kernel_that_traps_on_a_shape_states_the_limit_and_the_models_fit() -> None:
    """The entries that trap on shapes they cannot serve (the attention kernels' head_dim and
    group, the top-k kernels' top_k) have tables with limits, and every built-in model plans
    inside them on every NVIDIA class."""
    from metrale.plan.plan import plan_for

    F = realization("sm_90")
    P = Presentation.load()
    trapping = [k for fam in P.generators for p in fam.points
                for k in [F.realize(p)] if k is not None and k.source
                and ("attention" in k.entry or "topk" in k.entry)]
    assert len(trapping) > 10
    assert all(k.limits for k in trapping), [k.entry for k in trapping if not k.limits]
    for model in ("qwen3-0.6b", "llama-3.1-8b", "qwen3-30b-a3b"):
        for hw in ("cuda", "sm_80", "sm_89", "sm_90", "sm_120"):
            for mode in ("decode", "prefill"):
                assert plan_for(model, "bf16", hw, mode=mode, rows=64).kernel_count > 0


@pytest.mark.parametrize("hw", ["sm_80", "sm_90", "sm_100", "sm_120"])
def test_a_kernel_key_names_one_launch_recipe(hw: str) -> None:
    """The key is a kernel's identity (the loaders cache bound launches by it, the functor's
    image names it): two points that share it must launch the same entries with the same rules
    and arguments. gpt-oss's decode attention runs attention_decode.cu's entry with the sink's
    merge after it, so the key names the `then` chain; keyed by its first entry alone, a loader
    that had bound the plain decode attention gave the sink points the plain merge, which drops
    the sink (found on an H100: every sink decode point 5 % off its reference)."""
    F = realization(hw)
    P = Presentation.load()
    recipes: dict[str, set] = {}
    for fam in P.generators:
        for p in fam.points:
            k = F.realize(p)
            if k is None or k.source is None:
                continue
            recipes.setdefault(k.key, set()).add(
                (k.launch, k.args, tuple((t.entry, t.launch, t.args) for t in k.then)))
    assert recipes
    shared = {key: len(v) for key, v in recipes.items() if len(v) > 1}
    assert not shared, shared
    sink = F.realize(P.family("attention_sink").point(act="bf16", mode="decode", kv_block=256))
    plain = F.realize(P.family("attention").point(act="bf16", mode="decode", kv_block=256))
    assert sink.entry == plain.entry and sink.key != plain.key


def test_a_kernel_s_workspace_counts_its_then_launches_scratch_too() -> None:
    # linear_tma launches gemm_wgmma.cu's one-warpgroup entry up to 64 rows (its `then`), whose
    # workspace a caller must allocate though the TMA entry itself takes none
    from metrale.runtime.cuda_loader import BoundKernel, parse_args

    point = matmul_point(P.family("linear"), "gemm", "bf16")
    kernel = realization("sm_90").realize(point)
    assert kernel.entry == "metrale_linear_tma", kernel.entry
    then = tuple(("handle", parse_args(t.args)) for t in kernel.then)
    bound = BoundKernel(kernel, None, parse_args(kernel.args), then)
    assert not any(a.kind == "scratch" for a in bound.args)
    numbers = {"rows": 8, "k": 1280, "n": 40}
    ws = bound.workspace(numbers)
    assert set(ws) == {"ws"} and ws["ws"].nbytes == kernel.sizes(numbers)["ws"] > 16


def test_a_persistent_grid_reads_the_multiprocessors_of_the_device_that_runs_it() -> None:
    # sm_90's bf16 GEMM past 64 rows with k < 2048 launches one block an SM, or one a tile where
    # they are fewer: the class's device's multiprocessors while plans are made, the running
    # device's (its backend's limits) when a loader binds the launch; from k = 2048 a block a tile
    from metrale.runtime.backend import DeviceLimits, HostKernel, TensorMap
    from metrale.runtime.cuda_loader import BoundKernel, parse_args
    from metrale.runtime.mock_backend import MockBackend

    point = matmul_point(P.family("linear"), "gemm", "bf16")
    kernel = realization("sm_90").realize(point)
    assert kernel.multiprocessors == 132
    big, small = {"rows": 2048, "k": 1024, "n": 4096}, {"rows": 130, "k": 64, "n": 256}
    assert kernel.launch_for(big)[0] == (132, 1, 1)
    assert kernel.launch_for({**big, "sms": 114})[0] == (114, 1, 1)
    assert kernel.launch_for(small)[0] == (4, 1, 1)  # 2 row tiles x 2 column tiles
    assert kernel.launch_for({**big, "k": 2048})[0] == (16 * 32, 1, 1)  # a block a tile
    be = MockBackend(DeviceLimits(multiprocessors=7))
    handle = be.kernel(be.module({kernel.entry: HostKernel(None, len(kernel.args))}, "k.bin"),
                       kernel.entry)
    bound = BoundKernel(kernel, handle, parse_args(kernel.args))
    run = {"rows": 1024, "k": 64, "n": 1024}  # 64 tiles
    x, w, y = be.alloc(1024 * 64 * 2, "x"), be.alloc(1024 * 64 * 2, "w"), be.alloc(2 << 20, "y")
    maps = {"x": TensorMap(x, 1024, 64, "bf16", (64, 128)),
            "w": TensorMap(w, 1024, 64, "bf16", (64, 128))}
    bound.launch(be, {**maps, "y": y}, run)
    (launch,) = [c for c in be.calls if c.op == "launch"]
    assert launch.args[1] == (7, 1, 1)


def test_a_launch_that_reads_the_multiprocessors_names_where_they_come_from() -> None:
    # a class whose [device] gives no multiprocessors plans no launch that reads them: the
    # error says where the count comes from, not only that a size is unbound
    point = matmul_point(P.family("linear"), "gemm", "bf16")
    kernel = attrs.evolve(realization("sm_90").realize(point), multiprocessors=0)
    sizes = {"rows": 2048, "k": 1024, "n": 4096}
    with pytest.raises(LaunchError, match=r"multiprocessors \(sms\)") as e:
        kernel.launch_for(sizes)
    assert "HARDWARE.toml" in str(e.value) and e.value.key == str(point)
    assert kernel.launch_for({**sizes, "sms": 8})[0] == (8, 1, 1)


def test_the_tma_gemm_refuses_a_launch_without_k() -> None:
    # its blocks loop over a tile's k-blocks until the last closes: with no k there is none, so
    # such a launch must never reach the device (its `splits` formula refuses it, typed)
    point = matmul_point(P.family("linear"), "gemm", "bf16")
    kernel = realization("sm_90").realize(point)
    with pytest.raises(LaunchError, match="division by zero"):
        kernel.launches_for({"rows": 256, "k": 0, "n": 128})
    assert kernel.launches_for({"rows": 256, "k": 8, "n": 128})[0][0] == "metrale_linear_tma"


@pytest.mark.parametrize("family", ["attention_sink", "kv_append_attention_sink",
                                    "rope_kv_append_attention_sink"])
def test_sink_decode_takes_a_block_a_kv_head_on_full_layers(family):
    """sm_90's sink decode tables put all of a kv head's query heads in one block on a full layer
    (window 0), so gpt-oss-20b's full layers at 1,025 cached positions launch 136 blocks, within
    the 264 two an SM of an H100 or H200 holds; a sliding layer (window 128), whose few chunks of
    work need the blocks, splits its 8 query heads a kv head four a block."""
    F = realization("sm_90")
    point = next(p for p in P.family(family).points
                 if p.as_dict()["mode"] == "decode" and p.as_dict()["act"] == "bf16")
    kernel = F.realize(point)
    shape = {"rows": 1, "hq": 64, "hkv": 8, "d": 64, "half": 32, "slots": 1, "max_ctx": 1025,
             "max_pos": 1025, "context": 1025, "scale": 0.125}
    grids = {window: kernel.launches_for({**shape, "window": window})[0][2][0]
             for window in (0, 128)}
    assert grids == {0: (8, 1, 17), 128: (16, 1, 17)}, grids
