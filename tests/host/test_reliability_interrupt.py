"""Interrupts leave nothing half-written (issue 10, case 19): ``met quantize``, evidence, cache.

A writer process is stopped mid-work, by SIGINT (Ctrl-C: Python unwinds, so temporary files
are removed too) or by SIGKILL (nothing runs: only the atomic rename protects the file). After
either, the destination is absent or whole, never a partial file in place of a good one, and
running the same work again succeeds.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest

from metrale.lkb.errors import EXIT_INTERRUPTED
from metrale.lkb.quant import FORMATS
from metrale.realize.cache import BuildCache
from metrale.realize.compute import Binary
from metrale.realize.evidence import EVIDENCE_FILE, load_evidence
from metrale.runtime.checkpoint import SINGLE, Checkpoint, write_checkpoint

ROOT = Path(__file__).resolve().parents[2]
ENV = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}


def _wait_for(condition, what: str, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.005)


def _stop(proc: subprocess.Popen, sig: int) -> tuple[int, str]:
    assert proc.poll() is None, "the writer finished before it could be interrupted"
    proc.send_signal(sig)
    _, err = proc.communicate(timeout=30)
    return proc.returncode, err.decode(errors="replace")


def _leftovers(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.rglob("*") if p.name.endswith((".tmp", ".old")))


# -- met quantize --------------------------------------------------------------------------------

LAYERS = 12
"""Weights of 1024 x 2048 bf16 in the source: enough that quantizing takes about a second."""


@pytest.fixture(scope="module")
def source(tmp_path_factory) -> Path:
    rng = np.random.default_rng(0)
    weights = {f"model.layers.{i}.mlp.down_proj.weight":
               rng.standard_normal((1024, 2048), np.float32).astype(ml_dtypes.bfloat16)
               for i in range(LAYERS)}
    weights["model.norm.weight"] = np.ones(1024, ml_dtypes.bfloat16)
    src = tmp_path_factory.mktemp("src") / "ckpt"
    write_checkpoint(src, weights, {"model_type": "llama"}, FORMATS["bf16"])
    return src


def _quantize(src: Path, dst: Path, *extra: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "metrale", "quantize", str(src), str(dst),
                             "--to", "mxfp4", "--no-progress", *extra],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=ENV, cwd=ROOT)


def _interrupt_quantize(src: Path, dst: Path, *extra: str) -> tuple[int, str]:
    proc = _quantize(src, dst, *extra)
    # the atomic writer's temporary sibling appears once writing has begun
    _wait_for(lambda: any(p.name.startswith(f".{dst.name}.") and p.name.endswith(".tmp")
                          for p in dst.parent.iterdir()), "the quantizer to start writing")
    time.sleep(0.2)
    return _stop(proc, signal.SIGINT)


def _assert_quantized(dst: Path) -> None:
    with Checkpoint.open(dst) as ck:
        assert len(ck.weight_names()) == LAYERS + 1
        assert ck.config["quantization_config"]["quant_method"] == "mxfp4"


def test_interrupted_quantize_leaves_no_destination_and_reruns(source, tmp_path):
    dst = tmp_path / "out"
    rc, err = _interrupt_quantize(source, dst)
    assert rc == EXIT_INTERRUPTED
    assert err.strip().splitlines()[-1] == "met: interrupted" and "Traceback" not in err
    assert not dst.exists()
    assert _leftovers(tmp_path) == []
    proc = _quantize(source, dst)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err.decode()
    _assert_quantized(dst)


def test_interrupted_overwrite_leaves_the_old_destination_intact(source, tmp_path):
    dst = tmp_path / "out"
    old = {"model.layers.0.mlp.down_proj.weight": np.full((4, 32), 2.0, ml_dtypes.bfloat16)}
    # a previous output of met quantize: the only kind of folder --overwrite replaces
    write_checkpoint(dst, old, {"model_type": "llama"}, FORMATS["bf16"], writer="met quantize")
    before = (dst / SINGLE).read_bytes()
    rc, _ = _interrupt_quantize(source, dst, "--overwrite")
    assert rc == EXIT_INTERRUPTED
    assert (dst / SINGLE).read_bytes() == before  # the good checkpoint is still there, whole
    assert _leftovers(tmp_path) == []
    proc = _quantize(source, dst, "--overwrite")
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err.decode()
    _assert_quantized(dst)


# -- evidence recording ------------------------------------------------------------------------

EVIDENCE_WRITER = textwrap.dedent("""
    import sys
    from metrale.realize.evidence import EvidenceRecord, append_records
    path, start = sys.argv[1], int(sys.argv[2])
    for i in range(start, start + 100_000):
        append_records(path, [EvidenceRecord(
            "sm_90", "NVIDIA H200", "rmsnorm", f"rmsnorm[n={i}]", "time", float(i), None,
            "us", "2025-06-01", "nvcc 13.0.88", "ab" * 32)])
""")


def _evidence_writer(path: Path, start: int) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", EVIDENCE_WRITER, str(path), str(start)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=ENV)


def _points(path: Path) -> list[str]:
    load = load_evidence(path, hw="sm_90")
    assert load.ok, [str(e) for e in load.errors]
    return [r.point for r in load.records]


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGKILL], ids=["SIGINT", "SIGKILL"])
def test_killed_evidence_writer_leaves_a_whole_file(tmp_path, sig):
    path = tmp_path / "sm_90" / EVIDENCE_FILE
    proc = _evidence_writer(path, 0)
    _wait_for(lambda: path.is_file() and path.read_text().count("\n[[record]]") >= 5,
              "five records")
    rc, _ = _stop(proc, sig)
    assert rc != 0
    # each append is all or nothing: the file holds exactly the first n records, in order
    points = _points(path)
    assert points == [f"rmsnorm[n={i}]" for i in range(len(points))] and len(points) >= 5
    if sig == signal.SIGINT:
        assert _leftovers(path.parent) == []
    proc = _evidence_writer(path, 1000)
    _wait_for(lambda: len(_points(path)) > len(points), "the next writer to append")
    proc.kill()
    proc.communicate()
    again = _points(path)
    assert again[:len(points)] == points and again[len(points)] == "rmsnorm[n=1000]"


# -- the build cache -------------------------------------------------------------------------------

CACHE_WRITER = textwrap.dedent("""
    import hashlib, sys
    from metrale.realize.cache import BuildCache
    from metrale.realize.compute import Binary
    cache = BuildCache(sys.argv[1])
    for i in range(int(sys.argv[2])):
        key = hashlib.sha256(str(i).encode()).hexdigest()
        cache.put(key, Binary(bytes([i % 251]) * 200_000, "sm_90a", ("k",), "ptx", "fake 1.0"))
        print(i, flush=True)
""")


def _key(i: int) -> str:
    import hashlib

    return hashlib.sha256(str(i).encode()).hexdigest()


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGKILL], ids=["SIGINT", "SIGKILL"])
def test_killed_cache_writer_never_leaves_a_loadable_torn_entry(tmp_path, sig):
    n = 100_000
    proc = subprocess.Popen([sys.executable, "-c", CACHE_WRITER, str(tmp_path), str(n)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=ENV)
    assert proc.stdout is not None
    for _ in range(5):  # five entries committed
        assert proc.stdout.readline()
    rc, _ = _stop(proc, sig)
    assert rc != 0
    cache = BuildCache(tmp_path)
    got = {i: cache.get(_key(i)) for i in range(60)}
    done = [i for i, b in got.items() if b is not None]
    assert done[:5] == [0, 1, 2, 3, 4]
    for i in done:  # whatever loads is exactly what was put, never a torn payload
        assert got[i] == Binary(bytes([i % 251]) * 200_000, "sm_90a", ("k",), "ptx", "fake 1.0")
    assert done == list(range(len(done)))  # entries commit in order; the rest are misses
    if sig == signal.SIGINT:
        assert _leftovers(tmp_path) == []
    rerun = subprocess.run([sys.executable, "-c", CACHE_WRITER, str(tmp_path), "60"],
                           capture_output=True, env=ENV, timeout=60)
    assert rerun.returncode == 0, rerun.stderr.decode()
    fresh = BuildCache(tmp_path)
    assert all(fresh.get(_key(i)) is not None for i in range(60)) and fresh.discarded == 0
