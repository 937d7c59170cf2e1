"""The prepared TMA experiments (docs/experiments/tma) still write the bytes of the launches they
would replace, on the host emulation: the persistent attention and MLP halves against the plan's
five and three launches and decode attention with its merge in one launch against its two
(resident grids), and the staged-weight tensor-core GEMV against gemv_mma.cu (rings of slots,
warps in step and skewed). Their kernels reuse the plans' own
device code (norm.cu, gemv.cuh, attention_decode.cu, gemv_mma.cu), so a change there that breaks
them shows here, before a device session spends its minutes on them."""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

import pytest

from tests.host import simt

ok, why = simt.available()
pytestmark = [pytest.mark.skipif(not ok, reason=f"no host emulation: {why}"),
              pytest.mark.xdist_group("emulation")]  # one worker: conftest.build_dir

FOLDER = Path(__file__).resolve().parents[2] / "docs" / "experiments" / "tma"


@pytest.mark.parametrize("script", ["check_mlp_emulated", "check_attn_emulated",
                                    "check_merged_emulated", "check_gemv_tma_emulated"])
def test_a_prepared_experiment_writes_the_bytes_it_replaces(script, build_dir):
    sys.path.insert(0, str(FOLDER))
    try:
        checks = importlib.import_module(script).checks(build_dir)
    finally:
        sys.path.remove(str(FOLDER))
    failed = [what for what, good in checks.items() if not good]
    assert len(checks) >= 17 and not failed, failed
