"""Vendor spellings: every usual spelling parses, anything else is a ConfigError that helps."""

import pytest
from hypothesis import given
from hypothesis import strategies as st

from metrale.lkb.errors import ConfigError
from metrale.lkb.vendor import Vendor

SPELLINGS = {
    "host": Vendor.HOST, "cpu": Vendor.HOST, "numpy": Vendor.HOST,
    "nvidia": Vendor.NVIDIA, "cuda": Vendor.NVIDIA,
    "amd": Vendor.AMD, "rocm": Vendor.AMD, "hip": Vendor.AMD,
    "apple": Vendor.APPLE, "metal": Vendor.APPLE,
    "intel": Vendor.INTEL, "oneapi": Vendor.INTEL, "sycl": Vendor.INTEL,
}


@pytest.mark.parametrize("text,vendor", sorted(SPELLINGS.items()))
def test_usual_spellings_case_insensitive(text: str, vendor: Vendor) -> None:
    assert Vendor.parse(text) is vendor
    assert Vendor.parse(text.upper()) is vendor
    assert Vendor.parse(f"  {text.title()}\t") is vendor


def test_canonical_value_round_trips() -> None:
    for v in Vendor:
        assert Vendor.parse(str(v)) is v
        assert Vendor.parse(v) is v
        assert v.spellings[0] == v.value


def test_unknown_spelling_lists_valid_ones_and_suggests() -> None:
    with pytest.raises(ConfigError) as info:
        Vendor.parse("nvidea", file="kernels/x/HARDWARE.toml", key="vendor")
    e = info.value
    assert e.suggestion == "nvidia"
    assert e.file == "kernels/x/HARDWARE.toml" and e.key == "vendor"
    for s in SPELLINGS:
        assert s in e.expected
    assert str(e).startswith("kernels/x/HARDWARE.toml: vendor: unknown vendor")
    assert "'nvidea'" in str(e)


def test_far_spelling_has_no_suggestion() -> None:
    with pytest.raises(ConfigError) as info:
        Vendor.parse("qualcomm")
    assert info.value.suggestion is None


@pytest.mark.parametrize("bad", [None, 3, ["cuda"], b"cuda"])
def test_non_string_is_config_error(bad: object) -> None:
    with pytest.raises(ConfigError, match="vendor must be a string"):
        Vendor.parse(bad)


@given(st.text(max_size=12))
def test_parse_accepts_exactly_the_spellings(text: str) -> None:
    normal = text.strip().lower()
    if normal in SPELLINGS:
        assert Vendor.parse(text) is SPELLINGS[normal]
    else:
        with pytest.raises(ConfigError):
            Vendor.parse(text)
