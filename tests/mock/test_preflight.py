"""Arch preflight: NVIDIA's binary compatibility rules, and the reasons they give."""

import pytest
from hypothesis import given
from hypothesis import strategies as st

from metrale.lkb.errors import ConfigError
from metrale.realize.hardware import load_hardware
from metrale.realize.preflight import best_class, preflight, preflight_arch

HW = load_hardware()


@pytest.mark.parametrize("arch,cc,fmt,ok", [
    ("sm_80", (8, 0), "cubin", True),
    ("sm_80", (8, 6), "cubin", True),      # same major, newer minor
    ("sm_80", (8, 9), "cubin", True),
    ("sm_80", (9, 0), "cubin", False),     # cubins do not cross majors
    ("sm_80", (9, 0), "ptx", True),        # PTX does, through the JIT
    ("sm_80", (12, 1), "ptx", True),
    ("sm_80", (7, 5), "ptx", False),       # never onto an older device
    ("sm_89", (8, 6), "cubin", False),
    ("sm_89", (8, 6), "ptx", False),
    ("sm_90a", (9, 0), "ptx", True),
    ("sm_90a", (9, 0), "cubin", True),
    ("sm_90a", (10, 0), "ptx", False),     # arch-specific: exactly 9.0
    ("sm_90a", (8, 9), "cubin", False),
    ("sm_100a", (10, 0), "cubin", True),
    ("sm_100a", (10, 3), "ptx", False),
    ("sm_120a", (12, 1), "cubin", False),  # GB10 needs its own sm_121a build
    ("sm_121a", (12, 1), "cubin", True),
    ("sm_100f", (10, 3), "cubin", True),   # family-specific: 10.x >= 10.0
    ("sm_100f", (12, 0), "ptx", False),
    ("sm_120f", (12, 1), "ptx", True),
])
def test_compatibility_table(arch: str, cc: tuple[int, int], fmt: str, ok: bool) -> None:
    assert preflight_arch(arch, cc, fmt).ok is ok


def test_reason_says_what_was_built_and_what_is_present() -> None:
    v = preflight(HW.get("sm_90"), (12, 0), device_name="NVIDIA GeForce RTX 5090")
    assert not v
    assert v.reason == ("class sm_90: built sm_90a (ptx); device NVIDIA GeForce RTX 5090 is cc "
                        "12.0: sm_90a is arch-specific and runs only on cc 9.0")
    ok = preflight(HW.get("sm_80"), (9, 0), binary_format="ptx")
    assert ok and "JIT-compiled" in ok.reason and "built sm_80 (ptx)" in ok.reason
    no = preflight(HW.get("sm_80"), (9, 0), binary_format="cubin")
    assert not no and "a cubin for sm_80 runs only on cc 8.x >= 8.0" in no.reason


def test_every_nvidia_class_runs_on_its_own_capability() -> None:
    for c in HW:
        if c.arch is not None:
            for fmt in ("ptx", "cubin"):
                assert preflight(c, c.capabilities.compute_capability, binary_format=fmt), c.name


def test_host_and_cuda_classes() -> None:
    assert preflight(HW.get("host"), (9, 0)).ok
    v = preflight(HW.get("cuda"), (9, 0))
    assert not v.ok and "no arch of its own" in v.reason


@pytest.mark.parametrize("bad", [(9,), (9, -1), ("9", "0"), "90", (9.0, 0), (True, 0)])
def test_bad_capability_is_config_error(bad) -> None:
    with pytest.raises(ConfigError, match=r"\(major, minor\)"):
        preflight(HW.get("sm_80"), bad)


def test_bad_format_and_arch() -> None:
    with pytest.raises(ConfigError, match="ptx or cubin"):
        preflight_arch("sm_80", (8, 0), "sass")
    with pytest.raises(ConfigError, match="not an NVIDIA arch"):
        preflight_arch("gfx942", (9, 0))


@pytest.mark.parametrize("cc,name", [((8, 0), "sm_80"), ((8, 6), "sm_80"), ((8, 9), "sm_89"),
                                     ((9, 0), "sm_90"), ((10, 0), "sm_100"),
                                     ((12, 0), "sm_120"), ((12, 1), "sm_121"),
                                     ((10, 3), "sm_89")])
def test_best_class(cc: tuple[int, int], name: str) -> None:
    assert best_class(HW, cc).name == name


def test_best_class_cubin_stays_within_major() -> None:
    assert best_class(HW, (10, 3), binary_format="cubin") is None
    assert best_class(HW, (7, 5)) is None


ARCHS = st.tuples(st.integers(7, 13), st.integers(0, 9), st.sampled_from(["", "a", "f"]))
CCS = st.tuples(st.integers(7, 13), st.integers(0, 9))


@given(ARCHS, CCS)
def test_rules_as_properties(arch, cc) -> None:
    major, minor, suffix = arch
    name = f"sm_{major}{minor}{suffix}"
    ptx, cubin = preflight_arch(name, cc, "ptx").ok, preflight_arch(name, cc, "cubin").ok
    assert not cubin or ptx                       # whatever a cubin runs on, PTX runs on
    if ptx or cubin:
        assert cc >= (major, minor)               # never onto an older device
    if suffix == "a":
        assert ptx == cubin == (cc == (major, minor))
    if suffix == "":
        assert ptx == (cc >= (major, minor))
        assert cubin == (cc[0] == major and cc[1] >= minor)
