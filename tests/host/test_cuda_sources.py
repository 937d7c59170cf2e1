"""The CUDA sources of the common NVIDIA layer and their metadata (kernels/cuda/common).

Every family has a kernel; every KERNELS.toml field is valid (launch formulas evaluate at each
family's example, arguments name ports, attrs and dims, reduction orders are the semantics'
words); with nvcc installed, every claimed point compiles to PTX exposing its entry.
"""

from __future__ import annotations

import ast
import hashlib
import itertools
import math
import re
import shutil
import subprocess
from pathlib import Path

import attrs
import pytest

from metrale.lkb import semantics  # noqa: F401  (registers every family, dequant included)
from metrale.lkb.dtype import DType
from metrale.lkb.files import read_toml
from metrale.lkb.semantics import WITHIN, describe, reduction_orders
from tests.host.conftest import nvidia_group

KERNELS = Path(__file__).resolve().parents[2] / "kernels"
COMMON = KERNELS / "cuda" / "common"
FAMILIES = read_toml(KERNELS / "KERNEL_FAMILIES.toml")["family"]
KERNELS_TOML = read_toml(COMMON / "KERNELS.toml")
TABLES = KERNELS_TOML["kernel"]
DEPENDENT = KERNELS_TOML.get("dependent_launch", False)
# the NVIDIA classes' own tables (kernels/<hw>/common, the residual): name -> (folder, doc)
OWN = {name: (toml.parent, doc) for toml in sorted(KERNELS.glob("sm_*/common/KERNELS.toml"))
       for doc in [read_toml(toml)] for name in doc.get("kernel", {})}
FIELDS = {"family", "when", "source", "entry", "defines", "fixed", "launch", "values", "args",
          "reduction", "row_invariant", "dependent_launch", "requires", "limits", "then",
          "transport", "traffic", "scratch"}


def table(name: str) -> tuple[dict, Path, bool]:
    """A table of the common layer or of a class's own folder: (table, its folder, the file's
    ``dependent_launch``)."""
    if name in TABLES:
        return TABLES[name], COMMON, DEPENDENT
    folder, doc = OWN[name]
    return doc["kernel"][name], folder, doc.get("dependent_launch", False)
# PTX that writes global memory: stores, atomics, reductions, and asynchronous copies whose
# destination is global (cp.async.cg.shared.global copies global into shared: a read)
WRITE_OP = re.compile(r"\b(?:st|atom|red)\.global\b"
                      r"|\bcp\.async(?:\.bulk)?(?:\.tensor\.\w+)?\.global\b")
ARG_TYPES = {"ptr", "i32", "i64", "f32", "scratch"}


def expand(assignment: dict) -> list[dict]:
    """``{a: [1, 2], b: 3}`` → one dict per combination, as KERNEL_FAMILIES.toml reads."""
    keys = list(assignment)
    values = [v if isinstance(v, list) else [v] for v in assignment.values()]
    return [dict(zip(keys, combo)) for combo in itertools.product(*values)]


def points(family: str) -> list[dict]:
    return [p for a in FAMILIES[family]["points"] for p in expand(a)]


def family_of(name: str) -> str:
    return table(name)[0].get("family", name)


def claims(name: str, point: dict) -> bool:
    when = table(name)[0].get("when", {})
    return all(point.get(k) in v for k, v in when.items())


def render(template: str, point: dict) -> str:
    """A define or reduction template at a point: {p} the value, {P} it upper-cased."""
    out = template
    for k, v in point.items():
        out = out.replace("{" + k + "}", str(v)).replace("{" + k.upper() + "}", str(v).upper())
    return out


def defines(name: str, point: dict) -> tuple[str, ...]:
    t = table(name)[0]
    out = list(t.get("fixed", []))
    for param, template in t["defines"].items():
        value = point[param]
        if isinstance(value, bool):
            if value:
                out.append(template)
        else:
            out.append(render(template, point))
    return tuple(sorted(out))


def evaluate(formula: str, env: dict) -> float:
    """A launch formula: arithmetic over names, ints, ceil/min/max; nothing else parses."""
    funcs = {"ceil": math.ceil, "min": min, "max": max}

    def ev(n: ast.AST):
        if isinstance(n, ast.Expression):
            return ev(n.body)
        if isinstance(n, ast.Constant) and type(n.value) is int:
            return n.value
        if isinstance(n, ast.Name):
            return env[n.id]
        if isinstance(n, ast.BinOp):
            ops = {ast.Add: lambda a, b: a + b, ast.Sub: lambda a, b: a - b,
                   ast.Mult: lambda a, b: a * b, ast.Div: lambda a, b: a / b,
                   ast.FloorDiv: lambda a, b: a // b}
            return ops[type(n.op)](ev(n.left), ev(n.right))
        if isinstance(n, ast.Call) and isinstance(n.func, ast.Name) and not n.keywords:
            return funcs[n.func.id](*(ev(a) for a in n.args))
        raise ValueError(f"not a launch formula: {ast.dump(n)}")

    return ev(ast.parse(formula, mode="eval"))


def port_names(family: str) -> set[str]:
    f = FAMILIES[family]
    return {p.split(":")[0].strip() for p in f["inputs"] + f["outputs"]}


def test_every_family_has_a_kernel_and_every_point_exactly_one():
    """... without requirements (what a class with none of the optional capabilities runs), and
    at most one more per set of requirements (a class that has them runs that one instead)."""
    for family in FAMILIES:
        if FAMILIES[family].get("view"):  # a reinterpretation aliases its buffer: no kernel
            assert not [n for n in TABLES if family_of(n) == family], family
            continue
        # a collective's kernel, and only its, names the rank group's transport
        assert all(bool(TABLES[n].get("transport")) == bool(FAMILIES[family].get("collective"))
                   for n in TABLES if family_of(n) == family), family
        for p in points(family):
            owners = [n for n in TABLES if family_of(n) == family and claims(n, p)]
            plain = [n for n in owners if "requires" not in TABLES[n]]
            assert len(plain) == 1, (family, p, owners)
            needs = [repr(sorted(TABLES[n]["requires"].items())) for n in owners if n not in plain]
            assert len(needs) == len(set(needs)), (family, p, owners)
            # the first claiming table whose requirements hold wins: the plain one comes last
            assert owners[-1] == plain[0], (family, p, owners)


@pytest.mark.parametrize("name", sorted(TABLES) + sorted(OWN))
def test_kernel_fields_are_valid(name):
    """... for the common layer's tables and each class's own; a class's own table says what
    it needs and why it exists (``requires``, ``reason``: it is residual)."""
    t, folder, _ = table(name)
    if name in TABLES:
        assert set(t) <= FIELDS, set(t) - FIELDS
    else:
        assert set(t) <= FIELDS | {"reason"} and {"requires", "reason"} <= set(t), set(t)
    family = family_of(name)
    assert family in FAMILIES
    fam = FAMILIES[family]
    assert (folder / t["source"]).is_file()
    text = (folder / t["source"]).read_text()
    for included in re.findall(r'^#include "(\w+\.cu)"', text, re.M):  # a source it includes
        text += (folder / included).read_text()
    for entry in entries(name):
        assert re.fullmatch(r"[A-Za-z_]\w*", entry)
        assert re.search(r'extern "C" __global__[^;{]*?\b' + entry + r"\(", text), entry
    assert set(t["defines"]) <= set(fam["params"]), set(t["defines"]) - set(fam["params"])
    assert set(t.get("when", {})) <= set(fam["params"])
    assert t["row_invariant"] is fam.get("row_invariant", True)
    mine = [p for p in points(family) if claims(name, p)]
    assert mine, "claims no point"
    # names an argument may take
    weights = set(fam.get("weights", []))
    names = port_names(family) | set(fam.get("attrs", {})) | set(fam["example"])
    names |= {f"{w}_{s}" for w in weights for s in ("scale", "global")}
    names |= set(t.get("values", {}))
    tensors = set(t.get("scratch", {}))  # tensors in the workspace: as bytes or a tensor map
    assert not tensors & names, tensors & names
    names |= tensors
    arg_names = []
    for a in t["args"]:
        arg, _, ty = a.partition(":")
        assert ty in ARG_TYPES or re.fullmatch(r"tmap\(\d+,\d+\)", ty), a
        assert arg in names, a
        if ty == "scratch":  # a workspace's bytes come from a formula, or a scratch tensor's
            assert arg in t.get("values", {}) or arg in tensors, a
        arg_names.append(arg)
    assert len(set(arg_names)) == len(arg_names)
    # every port is an argument of the kernel's launch or of a launch after it (a sink read
    # only by the merge), but a collective's input, which its transport reads
    transported = {"x"} if t.get("transport") else set()
    chained = {a.partition(":")[0] for then in t.get("then", []) for a in then["args"]}
    assert port_names(family) <= (set(arg_names) | chained | set(dict(fam.get("inplace", {})))
                                  | transported)
    for then in t.get("then", []):  # a launch after the kernel's own: its names are the table's
        assert set(then) == {"entry", "launch", "args"}, then
        then_args = [a.partition(":") for a in then["args"]]
        assert all((ty in ARG_TYPES or re.fullmatch(r"tmap\(\d+,\d+\)", ty)) and arg in names
                   for arg, _, ty in then_args), then["args"]
        assert len({arg for arg, _, _ in then_args}) == len(then_args)
    for p in mine:
        # `sms`, the running device's multiprocessors: H100's and H200's 132 (any count gives
        # a launch: persistent grids are min(sms, tiles))
        env = {"sms": 132, **fam["example"], **fam.get("attrs", {}), **p}
        env |= {f"{k}_bytes": dt.element_size_bits / 8 for k, v in p.items()
                if isinstance(v, str) and (dt := DType.named(v)) is not None}
        for v, f in t.get("values", {}).items():  # in order: a launch formula may read them
            env[v] = evaluate(f, env)
        made = 0  # a chain's launches may have empty grids (not made), but one is made
        for launch in (t["launch"], *(then["launch"] for then in t.get("then", []))):
            assert set(launch) == {"grid", "block", "shared"}
            dims = [evaluate(f, env) for f in launch["grid"] + launch["block"]]
            assert all(d == int(d) and d >= (0 if i < 3 and "then" in t else 1)
                       for i, d in enumerate(dims)), dims
            assert math.prod(dims[3:]) <= 1024
            assert evaluate(launch["shared"], env) >= 0
            made += min(dims[:3]) >= 1
        assert made >= 1, (name, p)
        for f in t.get("values", {}).values():  # sizes, or a switch between launches (0, 1)
            assert evaluate(f, env) >= 0
        for spec in t.get("scratch", {}).values():  # a scratch tensor: a dtype, rows, columns
            assert set(spec) == {"dtype", "shape"} and len(spec["shape"]) == 2, spec
            assert all(evaluate(f, env) >= 0 for f in spec["shape"]), spec
        # reduction orders: the semantics' own, in describe()'s words; the within-block order
        # may differ from the reference's (then it is named or left unstated)
        want = reduction_orders(fam.get("semantics", family), **p)
        got = [render(r, p) for r in t["reduction"]]
        assert len(got) == len(want), (got, want)
        for g, r in zip(got, want):
            assert g in {describe(attrs.evolve(r, within=w)) for w in WITHIN}, (g, describe(r))


def test_defines_render_as_documented():
    p = {"act": "bf16", "weight": "mxfp4", "k_block": 256, "across": "sequential",
         "shape": "gemv"}
    assert defines("linear", p) == ("ACROSS_SEQUENTIAL", "ACT_BF16", "K_BLOCK=256",
                                     "WEIGHT_MXFP4")
    assert defines("topk", {"renormalize": True}) == ("RENORMALIZE",)
    assert defines("topk_plain", {"renormalize": False}) == ()


NVCC = shutil.which("nvcc")


def compile_groups(hw: str) -> dict[tuple[str, tuple[str, ...]], set[str]]:
    """(source file name, defines) → the entries that class ``hw``'s PTX must expose: each
    source its realization runs, once per distinct define set (a table of the common layer that
    a class's own shadows is checked on the classes that run it)."""
    from tests.host.conftest import NvidiaBuilds
    from tests.host.simt import class_entries

    return {NvidiaBuilds.key(source, defs): set(entries)
            for (source, defs), entries in class_entries(hw).items()}


def entries(name: str) -> list[str]:
    """The entries a table launches: its own, then its ``then`` launches'."""
    t = table(name)[0]
    return [t["entry"], *(then["entry"] for then in t.get("then", []))]


def entry_body(ptx: str, entry: str) -> str:
    """The PTX of one entry: from its ``.entry`` line to the next entry."""
    start = ptx.index(f".entry {entry}(")
    end = ptx.find(".entry ", start + 1)
    return ptx[start:end if end >= 0 else len(ptx)]


def dependent(entry: str) -> bool:
    """Whether the tables of ``entry`` declare ``dependent_launch``."""
    return any(t.get("dependent_launch", default) for name in (*TABLES, *OWN)
               for t, _, default in [table(name)] if entry in entries(name))


@nvidia_group("sm_90")
@pytest.mark.skipif(NVCC is None, reason="nvcc is not installed")
def test_every_claimed_point_compiles_for_sm_90a(nvidia_builds):
    """... and an entry declared ``dependent_launch`` waits for the previous launch
    (``griddepcontrol.wait``) before its first write to global memory. Reads may come first
    where the kernel says why (weights, the KV rows of earlier steps: nothing a launch of the
    step writes)."""
    built = nvidia_builds.ptx("sm_90")  # the sm_90 class's arch is sm_90a
    for (source, defs), entries in sorted(compile_groups("sm_90").items()):
        ptx = built[(source, defs)]
        for e in entries:
            assert f".entry {e}(" in ptx, (source, defs, e)
            if dependent(e):
                body = entry_body(ptx, e)
                first = WRITE_OP.search(body)
                assert "griddepcontrol.wait" in body, (source, defs, e)
                assert first is None or body.index("griddepcontrol.wait") < first.start(), \
                    (source, defs, e, first and first.group())


@nvidia_group("sm_80")
@pytest.mark.skipif(NVCC is None, reason="nvcc is not installed")
def test_every_claimed_point_compiles_for_sm_80(nvidia_builds):
    """Below sm_90 the dependent-launch instructions compile out, and every entry is still
    there: in each unit the run builds for sm_80 (every source, in the full tier every define
    set: conftest.NvidiaBuilds)."""
    built, groups = nvidia_builds.ptx("sm_80"), compile_groups("sm_80")
    checked = groups.keys() if nvidia_builds.full else groups.keys() & built.keys()
    assert {source for source, _ in checked} == {source for source, _ in groups}, \
        sorted(groups.keys() - checked)
    for source, defs in sorted(checked):
        entries, ptx = groups[(source, defs)], built[(source, defs)]
        assert "griddepcontrol" not in ptx, (source, defs)  # an sm_90 instruction
        for e in entries:
            assert f".entry {e}(" in ptx, (source, defs, e)


@pytest.mark.skipif(NVCC is None, reason="nvcc is not installed")
@pytest.mark.parametrize("weight", ["BF16", "FP8", "MXFP4", "NVFP4"])
def test_gemv_machine_code_stays_small_and_in_registers(tmp_path, weight):
    """Each decode GEMV entry compiles to at most 48 KB of sm_90a machine code: a decode step
    fetches every kernel's code again in every layer, and a variant at 50–127 KB (rows unrolled
    over shared weight chunks) ran the quantized steps 0.8–1.4 ms past the sum of their kernels
    on the H200. And each fits the 64 registers that eight blocks of 128 threads per SM leave,
    without spilling (that occupancy measured fastest on the H200); bf16
    gate_up_swiglu runs seven blocks (72 registers), which measured faster for its two rows.
    The multi-row entries (`_rows8`, `_rows16`: several rows' FMAs over each weight chunk, launched
    past one row) are entries of their own so that those budgets hold; theirs: at most 96 KB,
    and no spill with bf16 and fp8 weights (fp4's 16-row entries spill a few words)."""
    from metrale.realize.compute import cubin_code_bytes

    cubin, log = _sm90a_cubin(tmp_path, "gemv.cu", "ACT_BF16", f"WEIGHT_{weight}", "K_BLOCK=256",
                              "ACROSS_SEQUENTIAL")
    sizes = cubin_code_bytes(cubin)
    entries = {"metrale_linear", "metrale_linear_add", "metrale_qkv", "metrale_gate_up_swiglu"}
    multi = {e for e in sizes if "_rows" in e}
    assert set(sizes) >= entries and {e + "_rows8" for e in entries} <= multi, sizes
    assert all(0 < n <= 48 * 1024 for e, n in sizes.items() if e not in multi), sizes
    assert all(0 < sizes[e] <= 96 * 1024 for e in multi), sizes
    usage = _resource_usage(log)
    assert set(usage) >= entries | multi, usage
    limit = {"metrale_gate_up_swiglu": 72} if weight == "BF16" else {}
    assert all(regs <= limit.get(e, 64) and spills == 0 for e, (regs, spills) in usage.items()
               if e not in multi), usage
    if weight in ("BF16", "FP8"):
        assert all(usage[e][1] == 0 for e in multi), usage


MMA_SYNC = "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32"
WGMMA = "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16"
WEIGHTS = ("BF16", "F32", "FP8", "MXFP4", "NVFP4")
# the tensor-core sources, each with its define sets, the entries each set exposes, the class
# whose build runs it and the MMA it issues (the GEMM: gemm.cu on sm_80, sm_90's own on wgmma)
TENSOR_CORE_BUILDS = [
    *(("gemm.cu", ("ACT_BF16", f"WEIGHT_{w}", "K_BLOCK=256"),
       {"metrale_linear_mma", "metrale_linear_add_mma", "metrale_qkv_mma",
        "metrale_gate_up_swiglu_mma"}, "sm_80", MMA_SYNC) for w in WEIGHTS if w != "F32"),
    # f32 weights: linear's alone (no other family takes them)
    ("gemm.cu", ("ACT_BF16", "WEIGHT_F32", "K_BLOCK=256"), {"metrale_linear_mma"}, "sm_80",
     MMA_SYNC),
    # f32 weights: gemm_wgmma.cu alone
    ("sm_90/common/gemm_wgmma.cu", ("ACT_BF16", "WEIGHT_F32", "K_BLOCK=256"),
     {"metrale_linear_wgmma"}, "sm_90", WGMMA),
    # the other formats: the Tensor Memory Accelerator's entries, and gemm_wgmma.cu's (their
    # `then`) with them
    *(("sm_90/common/gemm_tma.cu", ("ACT_BF16", f"WEIGHT_{w}", "K_BLOCK=256"),
       {"metrale_linear_tma", "metrale_linear_add_tma", "metrale_qkv_tma",
        "metrale_gate_up_swiglu_tma", "metrale_linear_wgmma", "metrale_linear_add_wgmma",
        "metrale_qkv_wgmma", "metrale_gate_up_swiglu_wgmma"}, "sm_90", WGMMA)
      for w in WEIGHTS if w != "F32"),
    # the prefill attention, two-pass and online: the classes' with mma.sync, and sm_90's own on
    # wgmma
    ("attention_prefill.cu", ("ACT_BF16", "KV_BLOCK=256"),
     {"metrale_attention_prefill", "metrale_kv_append_attention_prefill"}, "sm_80", MMA_SYNC),
    ("attention_online.cu", ("ACT_BF16", "KV_BLOCK=64"),
     {"metrale_kv_append_attention_online_prefill"}, "sm_80", MMA_SYNC),
    ("sm_90/common/attention_wgmma.cu", ("ACT_BF16", "KV_BLOCK=256"),
     {"metrale_wgmma_attention_prefill", "metrale_kv_append_wgmma_attention_prefill"}, "sm_90",
     "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16"),
    ("sm_90/common/attention_wgmma.cu", ("ACT_BF16", "KV_BLOCK=64"),
     {"metrale_kv_append_attention_wgmma_online_prefill"}, "sm_90",
     "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16"),
    # the bounded prefills' GEMMs, k one chain of 16-wide steps: 128 x 256 tiles
    ("sm_90/common/gemm_chain.cu", ("ACT_BF16", "WEIGHT_BF16", "K_BLOCK=16"),
     {"metrale_linear_chain", "metrale_linear_add_chain", "metrale_qkv_chain",
      "metrale_gate_up_swiglu_chain"}, "sm_90",
     "wgmma.mma_async.sync.aligned.m64n256k16.f32.bf16.bf16"),
]


@pytest.mark.skipif(NVCC is None, reason="nvcc is not installed")
@pytest.mark.parametrize("source,defs,entries,hw,mma", [
    pytest.param(*b, marks=nvidia_group(b[3]), id=f"{Path(b[0]).name}-{b[1][-2]}-{b[1][-1]}")
    for b in TENSOR_CORE_BUILDS])
def test_tensor_core_entries_issue_mmas_without_spilling(tmp_path, nvidia_builds, source, defs,
                                                        entries, hw, mma):
    """The prefill GEMM and attention entries issue bf16 MMAs and keep their accumulators in
    registers (no spill, no local arrays): a spill would sit in the main loop. ptxas does not
    serialize the wgmmas, for any of its reasons (C7518: a wgmma under a branch it cannot prove
    uniform, which held the GEMM 3-6 % slower at 2048 rows and an overlapped online attention at
    0.55x; C7513: a register a running wgmma reads written by another instruction)."""
    cubin, log = _sm90a_cubin(tmp_path, source, *defs)
    assert "wgmma.mma_async instructions are serialized" not in log, log
    usage = _resource_usage(log)
    assert set(usage) >= entries, usage
    assert all(spills == 0 for regs, spills in usage.values()), usage
    assert "bytes stack frame" in log and not re.search(r"[1-9]\d* bytes stack frame", log), log
    ptx = nvidia_builds.ptx_of(hw, source, defs)
    for e in entries:
        assert mma in entry_body(ptx, e), e


@pytest.mark.skipif(NVCC is None, reason="nvcc is not installed")
def test_decode_attention_machine_code_stays_small(tmp_path):
    """Each decode attention entry stays under 80 KB of machine code (the rope and qk_norm
    prologues the larger), and the merges launched after them (plain, and from a sink) under
    40 KB (32 KB); version 7's per-group instantiations made 440 KB entries."""
    from metrale.realize.compute import cubin_code_bytes

    cubin, _ = _sm90a_cubin(tmp_path, "attention_decode.cu", "ACT_BF16", "KV_BLOCK=256",
                            "CHUNK=64", "ROPE_NEOX", "H_BLOCK=256")
    sizes = cubin_code_bytes(cubin)
    merges = [sizes.pop(e) for e in ("metrale_attention_decode_merge",
                                     "metrale_attention_sink_decode_merge")]
    assert len(sizes) == 4, sizes  # attention, kv_append, rope and qk_norm_rope prologues
    assert all(0 < n <= 80 * 1024 for n in sizes.values()), sizes
    assert all(0 < n <= 40 * 1024 for n in merges), merges


def _sm90a_cubin(tmp_path: Path, source: str, *defines: str) -> tuple[bytes, str]:
    """``source`` compiled by nvcc to an sm_90a cubin (-O3, as the build), and ptxas's
    ``--resource-usage`` report; kept in the run's build cache (``conftest.run_build_cache``)
    under the hash of the compiler, the command and every source and header it can include,
    so a later run with the same inputs reads the same bytes and report instead of compiling."""
    from metrale.lkb.files import atomic_write
    from metrale.realize.compute import NvidiaTarget
    from tests.host.conftest import run_build_cache

    path = KERNELS / source if "/" in source else COMMON / source  # a class's own, by its path
    flags = ["-cubin", "-arch=sm_90a", "-std=c++17", "-O3", "--resource-usage",
             *(f"-D{d}" for d in defines)]
    inputs = sorted({*path.parent.glob("*.cu*"), *COMMON.glob("*.cu*")})
    key = hashlib.sha256(repr((NvidiaTarget("cubin", compiler="nvcc").version(), flags,
                               str(path.relative_to(KERNELS)))).encode()
                         + b"".join(p.name.encode() + b"\0" + p.read_bytes() for p in inputs)
                         ).hexdigest()
    kept = run_build_cache(tmp_path / "cache") / "resource-usage" / key[:2] / key
    if (kept / "done").is_file():
        return (kept / "out.cubin").read_bytes(), (kept / "ptxas.log").read_text()
    out = tmp_path / (Path(source).stem + ".cubin")
    cmd = [NVCC, *flags[:5], "-o", str(out), str(path), f"-I{COMMON}", *flags[5:]]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    cubin, log = out.read_bytes(), r.stdout + r.stderr
    atomic_write(kept / "out.cubin", cubin)
    atomic_write(kept / "ptxas.log", log)
    atomic_write(kept / "done", key)  # last: the entry is whole
    return cubin, log


def _resource_usage(ptxas: str) -> dict[str, tuple[int, int]]:
    """entry -> (registers, spill-store bytes) from ``nvcc --resource-usage`` output."""
    out: dict[str, tuple[int, int]] = {}
    entry = spills = None
    for line in ptxas.splitlines():
        if m := re.search(r"Function properties for (\w+)", line):
            entry, spills = m.group(1), None
        elif (m := re.search(r"(\d+) bytes spill stores", line)) and entry:
            spills = int(m.group(1))
        elif (m := re.search(r"Used (\d+) registers", line)) and entry and spills is not None:
            out[entry] = (int(m.group(1)), spills)
    return out
