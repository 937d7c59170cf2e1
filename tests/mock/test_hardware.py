"""Hw: the shipped hardware classes, the schema errors, the inheritance laws."""

import itertools
import json
import re
from pathlib import Path

import pytest

from metrale.lkb.errors import ConfigError, ManyErrors
from metrale.lkb.vendor import Vendor
from metrale.realize.hardware import (
    HARDWARE_FILE,
    Capabilities,
    DeviceInfo,
    HardwareClass,
    HardwareRegistry,
    default_kernels_dir,
    load_hardware,
    parse_arch,
)

HW = load_hardware()
NVIDIA_LEAVES = ["sm_80", "sm_89", "sm_90", "sm_100", "sm_120", "sm_121"]


# --- the shipped classes ---------------------------------------------------------------------

def test_shipped_classes_load() -> None:
    assert set(HW.names) == {"host", "cuda", *NVIDIA_LEAVES}
    for c in HW:
        assert c.file == default_kernels_dir() / c.name / HARDWARE_FILE
        assert c.vendor is (Vendor.HOST if c.name == "host" else Vendor.NVIDIA)


@pytest.mark.parametrize("name,chain", [
    ("host", ["host"]),
    ("cuda", ["cuda"]),
    ("sm_80", ["sm_80", "cuda"]),
    ("sm_89", ["sm_89", "sm_80", "cuda"]),
    ("sm_90", ["sm_90", "sm_80", "cuda"]),
    ("sm_100", ["sm_100", "sm_80", "cuda"]),
    ("sm_120", ["sm_120", "sm_80", "cuda"]),
    ("sm_121", ["sm_121", "sm_120", "sm_80", "cuda"]),
])
def test_chains_as_specified(name: str, chain: list[str]) -> None:
    assert [c.name for c in HW.chain(name)] == chain


def test_blackwell_does_not_inherit_hopper() -> None:
    # wgmma is sm_90a-only: no Blackwell class may reach sm_90.
    for name in ("sm_100", "sm_120", "sm_121"):
        assert not HW.leq(name, "sm_90")


@pytest.mark.parametrize("name,arch,cc,tc,fp8,fp4,smem,bw", [
    ("sm_80", "sm_80", (8, 0), "mma.sync", False, False, 163 * 1024, 2039),
    ("sm_89", "sm_89", (8, 9), "mma.sync", True, False, 99 * 1024, 864),
    ("sm_90", "sm_90a", (9, 0), "wgmma", True, False, 227 * 1024, 4300),
    ("sm_100", "sm_100a", (10, 0), "tcgen05", True, True, 227 * 1024, 8000),
    ("sm_120", "sm_120a", (12, 0), "mma.sync", True, True, 99 * 1024, 1792),
    ("sm_121", "sm_121a", (12, 1), "mma.sync", True, True, 99 * 1024, 273),
])
def test_nvidia_class_data(name, arch, cc, tc, fp8, fp4, smem, bw) -> None:
    c = HW.get(name)
    caps = c.capabilities
    assert (c.arch, caps.compute_capability, caps.tensor_core) == (arch, cc, tc)
    assert (caps.bf16, caps.fp8, caps.fp4) == (True, fp8, fp4)
    assert caps.max_shared_mem_per_block == smem
    assert (caps.max_threads_per_block, caps.warp_size) == (1024, 32)
    assert c.device.hbm_bandwidth_gbs == bw and not c.device.nominal
    assert parse_arch(arch)[:2] == cc


def test_abstract_classes_have_no_arch_and_nominal_bandwidth() -> None:
    for name in ("host", "cuda"):
        c = HW.get(name)
        assert c.arch is None and c.capabilities.compute_capability is None
        assert c.device.nominal
    assert HW.get("host").device.hbm_bandwidth_gbs == 50


def test_every_field_is_commented() -> None:
    for c in HW:
        text = c.file.read_text()
        for key in re.findall(r"^(\w+) =", text, flags=re.M):
            assert re.search(rf"^#.*\b{key}\b", text, flags=re.M), f"{c.name}: {key} undocumented"


# --- poset laws over the shipped classes ----------------------------------------------------

def test_reflexive() -> None:
    assert all(HW.leq(a, a) for a in HW.names)


def test_transitive() -> None:
    for a, b, c in itertools.product(HW.names, repeat=3):
        if HW.leq(a, b) and HW.leq(b, c):
            assert HW.leq(a, c), (a, b, c)


def test_antisymmetric() -> None:
    for a, b in itertools.product(HW.names, repeat=2):
        if HW.leq(a, b) and HW.leq(b, a):
            assert a == b


def test_arrows_are_exactly_leq_and_poset_agrees() -> None:
    arrows = set(HW.arrows())
    poset = HW.poset()
    for a, b in itertools.product(HW.names, repeat=2):
        assert ((a, b) in arrows) == HW.leq(a, b) == poset.leq(a, b)
    assert set(HW.edges()) <= arrows


def test_parent_code_runs_on_every_descendant() -> None:
    for c in HW:
        for anc in HW.chain(c)[1:]:
            assert c.capabilities.runs(anc.capabilities) == [], (c.name, anc.name)
            assert anc.vendor is c.vendor


def test_get_unknown_suggests_nearest() -> None:
    with pytest.raises(ConfigError) as info:
        HW.get("sm_12")
    assert info.value.suggestion in ("sm_120", "sm_121")
    assert "sm_90" in info.value.expected
    assert "sm_90" in HW and "sm_9" not in HW and len(HW) == 8


def test_str_prints_every_chain() -> None:
    assert "sm_121 -> sm_120 -> sm_80 -> cuda" in str(HW).splitlines()


# --- a kernels tree in tmp_path --------------------------------------------------------------

def class_toml(name: str, inherits=(), *, vendor="nvidia", arch="none", tc="none", fp8=False,
               fp4=False, extra="", caps_extra="") -> str:
    return f"""name = "{name}"
vendor = "{vendor}"
arch = "{arch}"
inherits = {json.dumps(list(inherits))}
overlays = []
{extra}
[device]
name = "test device"
hbm_bandwidth_gbs = 100

[capabilities]
bf16 = true
fp8 = {str(fp8).lower()}
fp4 = {str(fp4).lower()}
tensor_core = "{tc}"
max_shared_mem_per_block = 1024
max_threads_per_block = 1024
warp_size = 32
{caps_extra}"""


def tree(tmp_path: Path, files: dict[str, str]) -> Path:
    root = tmp_path / "kernels"
    for name, text in files.items():
        (root / name).mkdir(parents=True)
        (root / name / HARDWARE_FILE).write_text(text)
    return root


def shipped_copy(tmp_path: Path) -> Path:
    return tree(tmp_path, {c.name: c.file.read_text() for c in HW})


def errors_of(root: Path) -> list[ConfigError]:
    with pytest.raises(ConfigError) as info:
        load_hardware(root)
    return list(info.value.errors) if isinstance(info.value, ManyErrors) else [info.value]


def test_shipped_copy_loads_equal(tmp_path: Path) -> None:
    assert load_hardware(shipped_copy(tmp_path)) == HW


def test_cycle_prints_the_chain_with_files(tmp_path: Path) -> None:
    root = tree(tmp_path, {"a": class_toml("a", ["b"]), "b": class_toml("b", ["c"]),
                           "c": class_toml("c", ["a"]), "d": class_toml("d")})
    errs = errors_of(root)
    assert len(errs) == 1
    msg = str(errs[0])
    assert ("inheritance cycle: a (kernels/a/HARDWARE.toml) -> b (kernels/b/HARDWARE.toml) -> "
            "c (kernels/c/HARDWARE.toml) -> a") in msg
    assert errs[0].file == str(root / "a" / HARDWARE_FILE) and errs[0].key == "inherits"


def test_self_inheritance_is_a_cycle(tmp_path: Path) -> None:
    errs = errors_of(tree(tmp_path, {"a": class_toml("a", ["a"])}))
    assert "inheritance cycle: a (kernels/a/HARDWARE.toml) -> a" in str(errs[0])


def test_missing_parent_prints_chain_and_suggests(tmp_path: Path) -> None:
    root = shipped_copy(tmp_path)
    p = root / "sm_121" / HARDWARE_FILE
    p.write_text(p.read_text().replace('inherits = ["sm_120"]', 'inherits = ["sm_12O"]'))
    errs = errors_of(root)
    assert len(errs) == 1
    msg = str(errs[0])
    assert ("missing parent: sm_121 (kernels/sm_121/HARDWARE.toml) -> sm_12O "
            "(no kernels/sm_12O/HARDWARE.toml)") in msg
    assert errs[0].suggestion == "sm_120"


def test_sm_100_inheriting_sm_90_is_refused(tmp_path: Path) -> None:
    root = shipped_copy(tmp_path)
    p = root / "sm_100" / HARDWARE_FILE
    p.write_text(p.read_text().replace('inherits = ["sm_80"]', 'inherits = ["sm_90"]'))
    errs = errors_of(root)
    assert len(errs) == 1
    assert "sm_100 (kernels/sm_100/HARDWARE.toml) -> sm_90 (kernels/sm_90/HARDWARE.toml)" in \
        str(errs[0])
    assert "tensor_core wgmma" in str(errs[0])


def test_unknown_keys_suggest_nearest(tmp_path: Path) -> None:
    text = class_toml("a").replace("inherits =", "inherit =").replace("warp_size", "warpsize")
    errs = errors_of(tree(tmp_path, {"a": text}))
    by_key = {e.key: e for e in errs}
    assert by_key["inherit"].suggestion == "inherits"
    assert by_key["capabilities.warpsize"].suggestion == "warp_size"
    assert "missing key" in str(by_key["inherits"])
    assert all(e.file == str(tmp_path / "kernels" / "a" / HARDWARE_FILE) for e in errs)


def test_bad_enum_values_list_allowed_ones(tmp_path: Path) -> None:
    root = tree(tmp_path, {"a": class_toml("a", vendor="nvidea", tc="wgmm")})
    errs = {e.key: e for e in errors_of(root)}
    assert errs["vendor"].suggestion == "nvidia" and "cuda" in errs["vendor"].expected
    tc = errs["capabilities.tensor_core"]
    assert tc.suggestion == "wgmma"
    assert tc.expected == "one of none, mma.sync, wgmma, tcgen05"


def test_wrong_types_named(tmp_path: Path) -> None:
    text = class_toml("a").replace("bf16 = true", 'bf16 = "yes"').replace(
        "hbm_bandwidth_gbs = 100", "hbm_bandwidth_gbs = -1")
    errs = {e.key: e for e in errors_of(tree(tmp_path, {"a": text}))}
    assert errs["capabilities.bf16"].expected == "bool" and "'yes'" in errs["capabilities.bf16"].found
    assert "must be positive" in str(errs["device.hbm_bandwidth_gbs"])


def test_a_device_s_multiprocessors_are_optional_and_not_negative(tmp_path: Path) -> None:
    text = class_toml("a")
    assert load_hardware(tree(tmp_path / "ok", {"a": text})).get("a").device.multiprocessors == 0
    bad = text.replace("hbm_bandwidth_gbs = 100", "hbm_bandwidth_gbs = 100\nmultiprocessors = -4")
    errs = {e.key: e for e in errors_of(tree(tmp_path / "bad", {"a": bad}))}
    assert "must not be negative" in str(errs["device.multiprocessors"])
    assert HW.get("sm_90").device.multiprocessors == 132


def test_all_violations_reported_together(tmp_path: Path) -> None:
    root = tree(tmp_path, {
        "a": class_toml("a").replace("warp_size", "warpsize"),
        "b": 'name = "b"\nvendor = = 3\n',  # syntax error
        "c": class_toml("not_c"),
        "d": class_toml("d", ["zz"]),
    })
    errs = errors_of(root)
    text = "\n".join(map(str, errs))
    assert "warpsize" in text
    assert re.search(r"kernels/b/HARDWARE.toml:2:\d+: TOML syntax error", text)
    assert "must equal the folder name" in text
    assert "missing parent: d" in text


def test_arch_specific_instructions_need_arch_specific_target(tmp_path: Path) -> None:
    root = tree(tmp_path, {"h": class_toml("h", arch="sm_90", tc="wgmma", fp8=True)})
    (e,) = errors_of(root)
    assert e.key == "arch" and "tensor_core wgmma need an arch-specific target" in str(e)
    assert e.expected == "sm_90a (or sm_90f)"


def test_compute_capability_must_agree_with_arch(tmp_path: Path) -> None:
    text = class_toml("x", arch="sm_89", caps_extra="compute_capability = [8, 6]")
    (e,) = errors_of(tree(tmp_path, {"x": text}))
    assert e.key == "capabilities.compute_capability" and "disagrees with arch 'sm_89'" in str(e)


def test_compute_capability_derived_from_arch(tmp_path: Path) -> None:
    hw = load_hardware(tree(tmp_path, {"x": class_toml("x", arch="sm_86")}))
    assert hw.get("x").capabilities.compute_capability == (8, 6)


def test_bad_arch_spelling(tmp_path: Path) -> None:
    (e,) = errors_of(tree(tmp_path, {"x": class_toml("x", arch="hopper")}))
    assert e.key == "arch" and "sm_<major><minor>" in e.expected


def test_cross_vendor_inheritance_refused(tmp_path: Path) -> None:
    root = tree(tmp_path, {"h": class_toml("h", vendor="cpu"), "n": class_toml("n", ["h"])})
    (e,) = errors_of(root)
    assert "inherits across vendors" in str(e)


def test_newer_parent_refused(tmp_path: Path) -> None:
    root = tree(tmp_path, {"old": class_toml("old", ["new"], arch="sm_80"),
                           "new": class_toml("new", arch="sm_89")})
    (e,) = errors_of(root)
    assert "cannot inherit a newer arch" in str(e)


def test_c3_linearization_of_a_diamond(tmp_path: Path) -> None:
    root = tree(tmp_path, {"a": class_toml("a"), "b": class_toml("b", ["a"]),
                           "c": class_toml("c", ["a"]), "d": class_toml("d", ["b", "c"])})
    hw = load_hardware(root)
    assert [c.name for c in hw.chain("d")] == ["d", "b", "c", "a"]
    assert hw.leq("d", "a") and not hw.leq("b", "c")


def test_inconsistent_order_refused(tmp_path: Path) -> None:
    root = tree(tmp_path, {"x": class_toml("x"), "y": class_toml("y"),
                           "a": class_toml("a", ["x", "y"]), "b": class_toml("b", ["y", "x"]),
                           "c": class_toml("c", ["a", "b"])})
    (e,) = errors_of(root)
    assert "no consistent inheritance order for c" in str(e)


def test_registry_from_values_checks_the_graph() -> None:
    caps = Capabilities(True, False, False)
    dev = DeviceInfo("d", 1)
    a = HardwareClass("a", Vendor.NVIDIA, None, ["b"], caps, dev)
    with pytest.raises(ConfigError, match="missing parent: a -> b"):
        HardwareRegistry([a])
    b = HardwareClass("b", Vendor.NVIDIA, None, [], caps, dev)
    assert [c.name for c in HardwareRegistry([a, b]).chain("a")] == ["a", "b"]


def test_empty_or_missing_tree(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="no hardware classes"):
        load_hardware(tmp_path)
    with pytest.raises(ConfigError, match="kernels folder not found"):
        load_hardware(tmp_path / "nope")


def test_broken_parent_is_not_also_missing(tmp_path: Path) -> None:
    root = shipped_copy(tmp_path)
    p = root / "sm_80" / HARDWARE_FILE
    p.write_text(p.read_text().replace("warp_size", "warp_sise"))
    errs = errors_of(root)
    assert [e.key for e in errs] == ["capabilities.warp_size", "capabilities.warp_sise"]
    assert errs[1].suggestion == "warp_size"


def test_the_repository_root_on_sys_path_leaves_the_name_kernels_to_its_distribution(tmp_path):
    """pytest runs from the repository root and the notebooks add it to ``sys.path``, so this
    project's ``kernels/`` folder is found there as a top-level ``kernels``: the name of Hugging
    Face's distribution, which transformers imports. Imported under that name, the folder hands
    it to the installed distribution (here a stand-in placed after the root on the path), and
    ``metrale.kernels`` is still the folder."""
    import subprocess
    import sys

    root = Path(__file__).resolve().parents[2]
    (tmp_path / "kernels").mkdir()
    (tmp_path / "kernels" / "__init__.py").write_text('WHO = "the distribution"\n')
    code = ("import sys; sys.path[:0] = [sys.argv[1], sys.argv[2]]; import kernels; "
            "print(kernels.WHO); from metrale.realize.hardware import default_kernels_dir; "
            "print((default_kernels_dir() / 'sm_90' / 'HARDWARE.toml').is_file())")
    out = subprocess.run([sys.executable, "-c", code, str(root), str(tmp_path)],
                         capture_output=True, text=True, check=True).stdout.split("\n")
    assert out[:2] == ["the distribution", "True"], out


def test_the_interconnect_table_is_read_and_checked(tmp_path: Path) -> None:
    """sm_90 states its links (an estimate, marked nominal); a bad figure is refused by key."""
    link = load_hardware().get("sm_90").interconnect
    assert link is not None and link.latency_us > 0 and link.bandwidth_gbs > 0 and link.nominal
    assert load_hardware().get("host").interconnect is None
    text = class_toml("a") + "\n[interconnect]\nlatency_us = -1\nbandwidth_gbs = 0\nspeed = 3\n"
    errs = {e.key: e for e in errors_of(tree(tmp_path, {"a": text}))}
    assert "must not be negative" in str(errs["interconnect.latency_us"])
    assert "must be positive" in str(errs["interconnect.bandwidth_gbs"])
    assert "interconnect.speed" in errs


def test_the_peers_are_read_and_checked(tmp_path: Path) -> None:
    """sm_90 names the H100 beside its representative H200; a peer is written as [device] is,
    and a bad one, or two of one name, is refused by key."""
    sm90 = load_hardware().get("sm_90")
    h100 = sm90.device_named("NVIDIA H100 80GB HBM3")
    assert h100 in sm90.peers and h100.hbm_bandwidth_gbs < sm90.device.hbm_bandwidth_gbs
    assert sm90.device_named("NVIDIA H200") is sm90.device
    assert sm90.device_named("test CPU") is None
    peer = '\n[[peers]]\nname = "{}"\nhbm_bandwidth_gbs = {}\n'
    text = class_toml("a") + peer.format("x", -5) + peer.format("y", 10)
    errs = {e.key: e for e in errors_of(tree(tmp_path / "1", {"a": text}))}
    assert "must be positive" in str(errs["peers.hbm_bandwidth_gbs"])
    for i, text in enumerate([peer.format("y", 10) + peer.format("y", 20),
                              peer.format("test device", 10)]):  # the representative's name
        errs = {e.key: e for e in errors_of(tree(tmp_path / f"d{i}", {"a": class_toml("a") + text}))}
        assert "duplicate device name" in str(errs["peers"])
