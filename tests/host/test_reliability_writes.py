"""Issue 53, what a command writes and reads from disk: ``met quantize --overwrite`` never
destroys what it did not write, copies only the files a checkpoint needs (streamed, no link
leaving the source), names the path a full disk refused; and anything but a regular file in
place of ``model.safetensors`` is named for what it is."""

from __future__ import annotations

import errno
import os
import pathlib

import pytest

from metrale.cli import main
from metrale.lkb.errors import EXIT_OS_ERROR, CheckpointError
from metrale.runtime import checkpoint as checkpoint_module
from metrale.runtime.checkpoint import OUTPUT_MARKER, SINGLE, Checkpoint, write_checkpoint
from metrale.runtime.engine import Engine
from metrale.runtime.quantize import quantize_checkpoint
from tests.host.test_reliability_weights import tiny_checkpoint


@pytest.fixture
def models(tmp_path):
    """``models/qwen3`` (a checkpoint with a tokenizer), ``models/llama`` (a sibling) and
    ``models/notes.txt`` (an unrelated file)."""
    root = tmp_path / "models"
    src = tiny_checkpoint(root / "qwen3")
    (src / "tokenizer.json").write_text('{"version": "1.0"}')
    tiny_checkpoint(root / "llama", "tiny-llama")
    (root / "notes.txt").write_text("mine")
    return root


def _snapshot(folder: pathlib.Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes()
            for p in sorted(folder.rglob("*")) if p.is_file()}


def _met(capsys, *argv):
    status = main(list(argv))
    out, err = capsys.readouterr()
    assert "Traceback" not in err
    return status, out, err


# -- 3. --overwrite destroys nothing it did not write ------------------------------------------


def test_overwrite_never_replaces_the_folder_holding_the_source(models, capsys):
    before = _snapshot(models)
    status, out, err = _met(capsys, "quantize", str(models / "qwen3"), str(models), "--to", "fp8",
                            "--overwrite", "--no-progress")
    assert status == CheckpointError.exit_status and out == ""
    assert "destination is the source or a folder holding it" in err
    assert _snapshot(models) == before  # the source, the sibling and notes.txt are all there
    with pytest.raises(CheckpointError, match="folder holding it"):
        quantize_checkpoint(models / "qwen3", models.parent, "fp8", overwrite=True,
                            progress=False)
    assert _snapshot(models) == before


def test_overwrite_never_replaces_the_source_itself(models, capsys):
    src = models / "qwen3"
    before = _snapshot(src)
    status, _, err = _met(capsys, "quantize", str(src), str(src), "--to", "fp8", "--overwrite",
                          "--no-progress")
    assert status == 4 and "the source" in err
    link = models / "alias"
    link.symlink_to(src)
    status, _, err = _met(capsys, "quantize", str(src), str(link), "--to", "fp8", "--overwrite",
                          "--no-progress")
    assert status == 4 and "the source" in err
    assert _snapshot(src) == before


@pytest.mark.parametrize("kind", ["folder", "file", "checkpoint of another writer"])
def test_overwrite_refuses_what_met_quantize_did_not_write(models, capsys, kind):
    dst = models / "llama"
    if kind == "file":
        dst = models / "notes.txt"
    elif kind == "folder":
        dst = models / "plain"
        dst.mkdir()
        (dst / "mine.txt").write_text("keep")
    before = _snapshot(models)
    status, _, err = _met(capsys, "quantize", str(models / "qwen3"), str(dst), "--to", "fp8",
                          "--overwrite", "--no-progress")
    assert status == 4
    assert "destination exists and was not written by met quantize" in err
    assert OUTPUT_MARKER in err
    assert _snapshot(models) == before


def test_overwrite_replaces_a_previous_output_of_met_quantize(models, capsys):
    src, dst = models / "qwen3", models / "qwen3-q"
    assert _met(capsys, "quantize", str(src), str(dst), "--to", "fp8", "--no-progress")[0] == 0
    assert (dst / OUTPUT_MARKER).is_file()
    status, _, err = _met(capsys, "quantize", str(src), str(dst), "--to", "mxfp4",
                          "--no-progress")
    assert status == 4
    assert err.rstrip().endswith("--overwrite replaces a previous output of met quantize)")
    assert "overwrite=True" not in err
    status, _, _ = _met(capsys, "quantize", str(src), str(dst), "--to", "mxfp4", "--overwrite",
                        "--no-progress")
    assert status == 0
    with Checkpoint.open(dst) as ck:
        assert ck.config["quantization_config"]["quant_method"] == "mxfp4"


def test_the_api_error_names_its_own_switch(models):
    dst = models / "out"
    quantize_checkpoint(models / "qwen3", dst, "fp8", progress=False)
    with pytest.raises(CheckpointError, match=r"overwrite=True replaces a previous output"):
        quantize_checkpoint(models / "qwen3", dst, "fp8", progress=False)


# -- 7. side files: only what a checkpoint needs, links inside, streamed ------------------------


def test_only_the_files_a_checkpoint_needs_are_copied(models, capsys):
    src = models / "qwen3"
    (src / "generation_config.json").write_text("{}")
    (src / "training_log.txt").write_text("not a checkpoint's")
    (src / "optimizer.pt").write_bytes(b"\0" * 1024)
    dst = models / "q"
    assert _met(capsys, "quantize", str(src), str(dst), "--to", "fp8", "--no-progress")[0] == 0
    assert sorted(p.name for p in dst.iterdir()) == sorted(
        [OUTPUT_MARKER, "config.json", SINGLE, "generation_config.json", "tokenizer.json"])
    assert (dst / "tokenizer.json").read_text() == '{"version": "1.0"}'


def test_a_side_file_linking_outside_the_source_is_refused(models, tmp_path, capsys):
    src = models / "qwen3"
    secret = tmp_path / "secret.json"
    secret.write_text('{"key": "private"}')
    (src / "tokenizer.json").unlink()
    (src / "tokenizer.json").symlink_to(secret)
    status, _, err = _met(capsys, "quantize", str(src), str(models / "q"), "--to", "fp8",
                          "--no-progress")
    assert status == 4 and not (models / "q").exists()
    assert f"{src / 'tokenizer.json'}: side file links outside the source checkpoint" in err


def test_a_side_file_linking_inside_the_source_is_copied_as_a_file(models, capsys):
    src = models / "qwen3"
    (src / "real_tokenizer.json").write_text('{"inside": true}')
    (src / "tokenizer.json").unlink()
    (src / "tokenizer.json").symlink_to("real_tokenizer.json")
    assert _met(capsys, "quantize", str(src), str(models / "q"), "--to", "fp8",
                "--no-progress")[0] == 0
    copied = models / "q" / "tokenizer.json"
    assert not copied.is_symlink() and copied.read_text() == '{"inside": true}'


def test_side_files_are_streamed_never_read_whole(models, monkeypatch):
    src = models / "qwen3"
    with open(src / "tokenizer.json", "wb") as f:  # 64 MiB, sparse: costs no disk
        f.truncate(64 << 20)

    def refuse(self, *a, **k):
        raise AssertionError(f"read whole: {self}")

    monkeypatch.setattr(pathlib.Path, "read_bytes", refuse)
    quantize_checkpoint(src, models / "q", "fp8", progress=False)
    assert (models / "q" / "tokenizer.json").stat().st_size == 64 << 20


# -- 8. a full disk, and anything but a file in place of model.safetensors ----------------------


def test_a_full_disk_names_the_folder_being_written(models, monkeypatch, capsys):
    def full(path, data):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(checkpoint_module, "atomic_write", full)
    dst = models / "q"
    status, out, err = _met(capsys, "quantize", str(models / "qwen3"), str(dst), "--to", "fp8",
                            "--no-progress")
    assert status == EXIT_OS_ERROR == 12 and out == ""
    assert err == f"met: {dst}: No space left on device\n"
    assert not dst.exists() and not [p for p in models.iterdir() if p.name.startswith(".q.")]


def _replace_single(folder: pathlib.Path, kind: str) -> str:
    target = folder / SINGLE
    target.unlink()
    if kind == "a FIFO":
        os.mkfifo(target)
    elif kind == "a directory":
        target.mkdir()
    elif kind == "a character device":
        target.symlink_to("/dev/zero")
    elif kind == "a link loop":
        target.symlink_to(target)
    return kind


@pytest.mark.parametrize("kind", ["a FIFO", "a directory", "a character device", "a link loop"])
def test_anything_but_a_file_in_place_of_the_weights_is_named(tmp_path, capsys, kind):
    d = tiny_checkpoint(tmp_path / "c")
    _replace_single(d, kind)
    with pytest.raises(CheckpointError) as e:
        Checkpoint.open(d)
    assert e.value.file == str(d / SINGLE) and e.value.message == "not a regular file"
    assert e.value.found == kind
    with pytest.raises(CheckpointError, match=kind):
        Engine.load(d)
    status, _, err = _met(capsys, "run", "--checkpoint", str(d))
    assert status == 4
    assert err == (f"met: {d / SINGLE}: not a regular file (expected a safetensors file, found "
                   f"{kind})\n")


def test_write_checkpoint_refuses_what_it_did_not_write(tmp_path):
    dst = tmp_path / "mine"
    dst.mkdir()
    (dst / "keep.txt").write_text("keep")
    with pytest.raises(CheckpointError, match="not written by write_checkpoint"):
        write_checkpoint(dst, {"w": __import__("numpy").ones(2, "float32")}, None, "bf16",
                         overwrite=True)
    assert (dst / "keep.txt").read_text() == "keep"
