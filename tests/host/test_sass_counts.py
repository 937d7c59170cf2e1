"""benchmarks/sass_counts.py reads cuobjdump's listings right: opcodes without their modifiers
or predicates, per function; registers and stack; tensor-core instructions and the gaps
between them; spills as local loads and stores. Then one real build of gemv_mma.cu."""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
from sass_counts import count, entries_of, resources_of, summary  # noqa: E402

SASS = """
	code for sm_90a
		Function : metrale_b
	.headerflags	@"EF_CUDA_TEXMODE_UNIFIED EF_CUDA_64BIT_ADDRESS EF_CUDA_SM90"
  /*0000*/  LDC R1, c[0x0][0x28] ;  /* 0x00000a00ff017b82 */
  /* 0x000fe20000000800 */
  /*0010*/  @P0 LDG.E.128.CONSTANT R4, desc[UR6][R2.64] ;  /* 0x0000000602040981 */
  /* 0x000ea8000c1e9d00 */
  /*0020*/  HMMA.16816.F32.BF16 R8, R4, R12, RZ ;  /* 0x0000000c0408723c */
  /* 0x004fe200000418ff */
  /*0030*/  LOP3.LUT R4, R4, 0x81c081c0, RZ, 0xc0, !PT ;  /* 0x81c081c004047812 */
  /* 0x000fe200078ec0ff */
  /*0040*/  @!P1 IMAD R5, R5, 0x1040, RZ ;  /* 0x0000104005059824 */
  /* 0x000fe200078e02ff */
  /*0050*/  STL [R1], R5 ;  /* 0x0000000501007387 */
  /* 0x000fe20000100800 */
  /*0060*/  HMMA.16816.F32.BF16 R8, R4, R14, R8 ;  /* 0x0000000e0408723c */
  /* 0x000fe20000041808 */
  /*0070*/  LDL R5, [R1] ;  /* 0x0000000001057983 */
  /* 0x000fe20000100800 */
  /*0080*/  EXIT ;  /* 0x000000000000794d */
  /* 0x000fea0003800000 */
		..........

		Function : metrale_a
	.headerflags	@"EF_CUDA_TEXMODE_UNIFIED EF_CUDA_64BIT_ADDRESS EF_CUDA_SM90"
  /*0000*/  EXIT ;  /* 0x000000000000794d */
  /* 0x000fea0003800000 */
"""

RESOURCES = """
Resource usage:
 Common:
  GLOBAL:0
 Function metrale_b:
  REG:86 STACK:8 SHARED:0 LOCAL:0 CONSTANT[0]:584 TEXTURE:0 SURFACE:0 SAMPLER:0
 Function metrale_a:
  REG:16 STACK:0 SHARED:0 LOCAL:0 CONSTANT[0]:528 TEXTURE:0 SURFACE:0 SAMPLER:0
"""


def test_a_listing_becomes_each_functions_opcodes():
    ops = entries_of(SASS)
    assert ops == {"metrale_b": ["LDC", "LDG", "HMMA", "LOP3", "IMAD", "STL", "HMMA", "LDL",
                                 "EXIT"],
                   "metrale_a": ["EXIT"]}
    assert resources_of(RESOURCES) == {"metrale_b": (86, 8), "metrale_a": (16, 0)}


def test_the_summary_counts_tensor_instructions_gaps_and_spills():
    s = summary(entries_of(SASS)["metrale_b"], 86, 8)
    assert (s["registers"], s["stack_bytes"], s["instructions"], s["tensor"]) == (86, 8, 9, 2)
    assert s["gaps"] == [3]  # LOP3, IMAD, STL between the two HMMAs
    assert (s["spill_loads"], s["spill_stores"]) == (1, 1)
    assert s["top"][0] == ("HMMA", 2)
    assert summary(["EXIT"], 16, 0)["gaps"] == []


@pytest.mark.skipif(shutil.which("nvcc") is None or shutil.which("cuobjdump") is None,
                    reason="nvcc and cuobjdump are not on PATH")
def test_a_real_build_of_the_tensor_core_gemv(tmp_path):
    """gemv_mma.cu in mxfp4 for sm_90a: its four entries, each with tensor-core instructions
    and registers, and as many gaps as tensor-core instructions less one."""
    got = count("gemv_mma.cu", "ACT_BF16 WEIGHT_MXFP4 K_BLOCK=256", tmp_path)
    assert sorted(got) == sorted(f"metrale_{e}_gemv_mma" for e in
                                 ("linear", "linear_add", "qkv", "gate_up_swiglu"))
    for name, s in got.items():
        assert s["tensor"] > 0 and s["registers"] > 0, name
        assert len(s["gaps"]) == s["tensor"] - 1, name
        assert s["instructions"] > s["tensor"] + sum(s["gaps"]), name
