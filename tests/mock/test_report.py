"""benchmarks/report.py: the docs' performance tables and chart are what the committed JSON makes,
and a new run of any shape (peers, batch 8, more formats, a failed cell, a missing file) renders
without an edit."""

from __future__ import annotations

import json
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))
import report  # noqa: E402


def test_the_docs_agree_with_the_committed_results():
    """README.md, docs/performance.md and docs/decode.svg are exactly what the JSON makes:
    after a new benchmark run, `python benchmarks/report.py` and commit."""
    assert report.stale() == []


def test_every_committed_result_is_cited_by_a_doc():
    """benchmarks/results keeps a benchmark's current result only where a doc cites it."""
    docs = "".join(p.read_text() for p in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))])
    uncited = [p.name for p in sorted(report.RESULTS.glob("*.json")) if p.name not in docs]
    assert not uncited, uncited


def _row(model, batch, quant, policy, step, **kw):
    row = {"model": model, "batch": batch, "quant": quant, "step_s": step,
           "floor_s": 0.0003, "copy_floor_s": 0.00031, "bytes": 10**9, "launches": 199,
           "graph": True, "finite": True, **kw}
    if policy is not None:
        row["policy"] = policy
    return row


def test_a_new_decode_run_of_another_shape_renders(tmp_path):
    """Peers, batch 8, nvfp4, a third model, rows without a policy (older runs), a non-finite
    cell and a cell measured twice (the median counts)."""
    rows = [
        _row("qwen3-0.6b", 1, "bf16", None, 0.0009, eager_s=0.02, compiled_s=0.0035,
             peer_compiled_s=0.003),
        _row("qwen3-0.6b", 1, "bf16", "bounded", 0.0010),
        _row("qwen3-0.6b", 1, "nvfp4", "exact", 0.0008),
        _row("qwen3-0.6b", 1, "nvfp4", "exact", 0.0010),
        _row("qwen3-0.6b", 8, "bf16", "exact", 0.0030, compiled_s=0.004),
        _row("qwen3-0.6b", 8, "fp8", "bounded", 0.0020),
        _row("qwen3-30b-a3b", 1, "bf16", "exact", 0.0033, finite=False),
    ]
    (tmp_path / "gpu_decode.json").write_text(json.dumps(
        {"benchmark": "gpu_decode", "context": 1024, "device": "NVIDIA H200", "rows": rows}))
    blocks = report.blocks(tmp_path)
    summary = blocks["decode-summary"]
    assert "| qwen3-0.6b | 1 | 0.90 / 1.00 | — | 0.90 / — | 0.30 | 20.00 | 3.50 |" in summary
    assert "| qwen3-0.6b | 8 | 3.00 / — | — / 2.00 | — | 0.30 | — | 4.00 |" in summary
    assert "| qwen3-30b-a3b | 1 | not finite | — | — |" in summary
    assert "on one NVIDIA H200" in summary
    command = summary.split("reproduce with `")[1].split("`")[0]
    assert command == ("python benchmarks/bench_gpu_decode.py qwen3-0.6b qwen3-30b-a3b "
                       "--batches 1,8 --quants bf16,fp8,nvfp4 --policies exact,bounded "
                       "--quant-batches 1,8 --peer-models qwen3-0.6b")
    peers = blocks["decode-peers"]
    assert "| qwen3-0.6b | 1 | 0.900 | 20.000 (22.22×) | 3.500 (3.89×) | 3.000 (3.33×) |" in peers
    detail = blocks["decode-detail"]
    assert "| qwen3-0.6b | 1 | nvfp4 | 0.900 | — | 0.300 | 3.00× | 199 |" in detail
    svg = report.decode_chart(json.loads((tmp_path / "gpu_decode.json").read_text()))
    root = ET.fromstring(svg)
    labels = [t.text for t in root.iter("{http://www.w3.org/2000/svg}text")]
    assert "qwen3-0.6b" in labels and "nvfp4" in labels and "3.500" in labels
    assert "qwen3-30b-a3b" not in labels  # nothing finite to draw


def test_a_decode_run_of_its_own_renders_with_its_name_card_and_peers(tmp_path):
    """A run written with --name (gpt-oss-20b beside the committed run): its command says the
    name, the block names the card, and each step stands against its floor and the peers."""
    rows = [_row("gpt-oss-20b", 1, "mxfp4", p, s, floor_s=0.0012, launches=219, eager_s=0.04,
                 compiled_s=0.02) for p, s in (("exact", 0.0026), ("bounded", 0.0024))]
    (tmp_path / "gpu_decode_gpt_oss.json").write_text(json.dumps(
        {"benchmark": "gpu_decode_gpt_oss", "gpu": "NVIDIA H100 80GB HBM3",
         "copy_rate_bytes_per_s": 3.0e12, "rows": rows}))
    block = report.blocks(tmp_path)["decode-gpt-oss"]
    assert "(NVIDIA H100 80GB HBM3)" in block and "moved 3.00 TB/s" in block
    command = block.split("reproduce with `")[1].split("`")[0]
    assert command == ("python benchmarks/bench_gpu_decode.py gpt-oss-20b --batches 1 "
                       "--quants mxfp4 --policies exact,bounded --name gpu_decode_gpt_oss")
    assert ("| gpt-oss-20b | 1 | mxfp4 | bounded | 2.400 | 1.200 | 50% | 40.00 (16.7×) "
            "| 20.00 (8.3×) | 219 |") in block
    assert "No result is committed" in report.blocks(tmp_path / "none")["decode-gpt-oss"]


def test_a_batched_run_shows_its_steps_past_one_row_under_its_file_name(tmp_path):
    """A run of several batches kept in a file of its own: the block lists its steps of more
    than one row, its command writes that file (--name, though the run named itself
    gpu_decode), and a run without peers has no peer columns."""
    rows = [_row("llama-3.1-8b", b, "bf16", p, s, floor_s=0.005, launches=300)
            for b, p, s in ((1, "exact", 0.0056), (8, "exact", 0.0084), (8, "bounded", 0.007))]
    (tmp_path / "gpu_decode_batched.json").write_text(json.dumps(
        {"benchmark": "gpu_decode", "gpu": "NVIDIA H100 80GB HBM3", "rows": rows}))
    block = report.blocks(tmp_path)["decode-batched"]
    command = block.split("reproduce with `")[1].split("`")[0]
    assert command == ("python benchmarks/bench_gpu_decode.py llama-3.1-8b --batches 1,8 "
                       "--quants bf16 --policies exact,bounded --no-hf --name gpu_decode_batched")
    assert "| llama-3.1-8b | 8 | bf16 | exact | 8.400 | 5.000 | 60% | 300 |" in block
    assert "| llama-3.1-8b | 8 | bf16 | bounded | 7.000 | 5.000 | 71% | 300 |" in block
    assert "| 1 |" not in block and "HF eager" not in block and "no peer" in block
    assert "the file holds its one-row steps too" in block


def test_missing_results_say_so(tmp_path):
    blocks = report.blocks(tmp_path)
    assert "No decode result is committed" in blocks["decode-summary"]
    assert "no whole step" in blocks["prefill-steps"]
    assert "No prefill attention result" in blocks["prefill-attention"]
    assert blocks["host"].count("| — | — |") == len(report.HOST)  # no figure, no goal
    ET.fromstring(report.decode_chart(None))


def test_prefill_steps_render_with_their_peer(tmp_path):
    steps = [{"model": "qwen3-0.6b", "quant": "bf16", "policy": p, "rows": n,
              "step_s": n * 1e-5 * (1 if p == "exact" else 0.8), "hf_eager_s": n * 2e-5}
             for p in ("exact", "bounded") for n in (512, 2048)]
    (tmp_path / "gpu_prefill.json").write_text(json.dumps({"steps": steps, "cases": []}))
    blocks = report.blocks(tmp_path)
    assert "| qwen3-0.6b | bf16 | bounded | 4.10 (HF 10.24) | 16.38 (HF 40.96) |" in \
        blocks["prefill-steps"]
    assert "--steps 512,2048 --step-quants bf16 --policies exact,bounded" in \
        blocks["prefill-steps"]


def test_a_variant_folder_s_prefill_steps_stay_out_of_the_table(tmp_path):
    # bench_gpu_prefill.py --kernels-dirs: an experiment's rows beside the shipped plans'
    steps = [{"model": "qwen3-0.6b", "quant": "bf16", "policy": "exact", "rows": 2048,
              "step_s": t, **({"kernels_dir": "/tmp/k"} if t > 0.02 else {})}
             for t in (0.0134, 0.0281)]
    (tmp_path / "gpu_prefill.json").write_text(json.dumps({"steps": steps, "cases": []}))
    block = report.blocks(tmp_path)["prefill-steps"]
    assert "| qwen3-0.6b | bf16 | exact | 13.40 |" in block and "28.10" not in block


def test_prefill_steps_show_the_last_row_s_step_where_it_was_timed(tmp_path):
    steps = [{"model": "qwen3-0.6b", "quant": "bf16", "policy": "bounded", "rows": 2048,
              "step_s": 0.0107, "last_logits_step_s": 0.0091, "hf_eager_s": 0.0277}]
    (tmp_path / "gpu_prefill.json").write_text(json.dumps({"steps": steps, "cases": []}))
    block = report.blocks(tmp_path)["prefill-steps"]
    assert "| model | weights | policy | 2048 tokens | 2048, last row's logits only |" in block
    assert "| qwen3-0.6b | bf16 | bounded | 10.70 (HF 27.70) | 9.10 |" in block


def test_the_chain_points_get_a_gemm_row_of_their_own(tmp_path):
    # bench_gpu_prefill.py --k-blocks 256,16: the chain_* relations' points beside the blocked
    cases = [{"model": "llama-3.1-8b", "launch": "qkv", "weight": "bf16", "rows": 2048,
              "k_block": kb, "finite": True, "tflops": t, "vs_peer": v}
             for kb, t, v in ((256, 500.0, 0.69), (16, 700.0, 0.91))]
    (tmp_path / "gpu_prefill.json").write_text(json.dumps({"steps": [], "cases": cases}))
    block = report.blocks(tmp_path)["prefill-gemm"]
    assert '--rows 2048 --k-blocks 256,16 --steps ""' in block and 'a "k chain" row' in block
    assert "| llama-3.1-8b | bf16 | 500–500 | 0.69× |" in block
    assert "| llama-3.1-8b | bf16, k chain | 700–700 | 0.91× |" in block
    only_blocked = [c for c in cases if c["k_block"] == 256]
    (tmp_path / "gpu_prefill.json").write_text(json.dumps({"steps": [], "cases": only_blocked}))
    block = report.blocks(tmp_path)["prefill-gemm"]
    assert "--k-blocks" not in block and "k chain" not in block


def test_a_marker_naming_no_block_is_an_error():
    with pytest.raises(KeyError, match="no-such"):
        report.render("<!-- report:no-such -->\n<!-- /report:no-such -->\n", {}, "x.md")
    assert report.render("<!-- report:a -->\nold\n<!-- /report:a -->", {"a": "new"}) == \
        "<!-- report:a -->\nnew\n<!-- /report:a -->"
