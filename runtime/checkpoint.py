"""Hugging Face checkpoint directories: safetensors shards, their index, and quantized layouts.

:class:`Checkpoint` opens a directory (one ``model.safetensors`` or shards listed by
``model.safetensors.index.json``) and returns weights as arrays or, for quantized layouts, as
:class:`~metrale.lkb.quant.QuantTensor`. :func:`write_checkpoint` writes one atomically.

Layouts recognized by :meth:`Checkpoint.weight` for a module ``X``:

====================  ==========================================================================
plain                 ``X.weight`` (BF16, F16, F32)
fp8 (compressed-      ``X.weight`` F8_E4M3/F8_E5M2 + ``X.weight_scale`` F32 scalar or ``[n, 1]``
tensors)
fp8 block             ``X.weight`` F8 + ``X.weight_scale_inv`` F32 ``[ceil(n/128), ceil(k/128)]``
mxfp4 (gpt-oss)       ``X.weight_blocks`` | ``X.blocks`` | ``X_blocks`` U8 ``[..., n, k/32, 16]``
                      + the matching ``*scales`` U8 (e8m0) ``[..., n, k/32]``
nvfp4 (ModelOpt)      ``X.weight`` U8 ``[n, k/2]`` + ``X.weight_scale`` F8_E4M3 ``[n, k/16]``
                      + ``X.weight_scale_2`` F32 scalar
====================  ==========================================================================

Law: what :func:`write_checkpoint` writes, :meth:`Checkpoint.weight` reads back byte for byte.

>>> import tempfile, pathlib
>>> from metrale.lkb.quant import FORMATS
>>> d = pathlib.Path(tempfile.mkdtemp()) / "ckpt"
>>> qt = FORMATS["mxfp4"].quantize(np.ones((4, 64), np.float32))
>>> write_checkpoint(d, {"m.proj.weight": qt, "m.norm.weight": np.ones(4, np.float32)},
...                  {"model_type": "toy"}, FORMATS["mxfp4"])
>>> with Checkpoint.open(d) as ck:
...     print(ck.names())
...     print(ck.weight("m.proj") == qt, ck.config["quantization_config"]["quant_method"])
('m.norm.weight', 'm.proj.weight_blocks', 'm.proj.weight_scales')
True mxfp4
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any, NoReturn

import ml_dtypes
import numpy as np

from metrale.lkb.errors import CheckpointError, nearest
from metrale.lkb.files import atomic_write, read_json
from metrale.lkb.quant import (
    BF16Format,
    FP8Format,
    MXFP4Format,
    NVFP4Format,
    QuantFormat,
    QuantTensor,
)

from .safetensors import SafetensorsFile, TensorInfo, encode_safetensors, path_kind

SINGLE = "model.safetensors"
INDEX = "model.safetensors.index.json"
CONFIG = "config.json"
DEFAULT_SHARD_BYTES = 2 << 30
"""Shards written by :func:`write_checkpoint` hold at most this many bytes (unless one tensor
is larger); each shard is assembled in memory once before its atomic write."""

Weight = QuantTensor | np.ndarray
"""What a checkpoint holds per weight: a quantized tensor or a plain array."""

_FP8_DTYPES = {"F8_E4M3": "e4m3", "F8_E5M2": "e5m2"}
_SCALE_DTYPES = ("F32", "BF16", "F16")
_MX_SUFFIXES = ((".weight_blocks", ".weight_scales"), (".blocks", ".scales"),
                ("_blocks", "_scales"))


def _module(prefix: str) -> str:
    return prefix[: -len(".weight")] if prefix.endswith(".weight") else prefix


class Checkpoint:
    """An open checkpoint directory: its shards, its ``config.json`` and its tensors by name.

    Opening validates every shard header and the index; on any error every shard already
    mapped is closed again. Tensors are views of the maps (see :class:`SafetensorsFile`).
    """

    def __init__(self, path: Path, shards: Mapping[str, SafetensorsFile],
                 where: Mapping[str, str], config: dict[str, Any] | None) -> None:
        self.path = path
        self._shards = dict(shards)
        self._where = dict(sorted(where.items()))
        self.config = config
        """The parsed ``config.json``, or ``None`` when the directory has none."""

    @classmethod
    def open(cls, path: os.PathLike | str) -> Checkpoint:
        """Open a checkpoint directory (or one ``.safetensors`` file).

        >>> Checkpoint.open("/nonexistent")
        Traceback (most recent call last):
        ...
        metrale.lkb.errors.CheckpointError: /nonexistent: checkpoint not found
        """
        path = Path(path)
        if _is_file(path):
            folder, files, listed = path.parent, [path.name], None
        elif _is_dir(path):
            folder = path
            if (path / INDEX).is_file():
                listed = _read_index(path / INDEX)
                files = sorted(set(listed.values()))
            elif (path / SINGLE).is_file():
                files, listed = [SINGLE], None
            elif (bad := next((n for n in (INDEX, SINGLE)
                               if path_kind(path / n) != "nothing"), None)) is not None:
                raise CheckpointError("not a regular file", file=path / bad,
                                      expected="a safetensors file" if bad == SINGLE
                                      else "a JSON file", found=path_kind(path / bad))
            else:
                found = sorted(p.name for p in path.glob("*.safetensors"))
                raise CheckpointError("no checkpoint in directory", file=path,
                                      expected=f"{SINGLE} or {INDEX}",
                                      found=", ".join(found) or "neither")
        elif path_kind(path) != "nothing":
            raise CheckpointError("not a checkpoint", file=path,
                                  expected="a checkpoint directory or a .safetensors file",
                                  found=path_kind(path))
        else:
            raise CheckpointError("checkpoint not found", file=path)

        shards: dict[str, SafetensorsFile] = {}
        try:
            for name in files:
                if not _is_file(folder / name):
                    tensor = next(t for t, f in (listed or {}).items() if f == name)
                    raise CheckpointError("index names a missing shard", file=folder / INDEX,
                                          key=f"weight_map.{tensor}", expected="an existing file",
                                          found=name)
                shards[name] = SafetensorsFile.open(folder / name)
            where: dict[str, str] = {}
            for name, shard in shards.items():
                for tensor in shard.keys():
                    if tensor in where:
                        raise CheckpointError("tensor stored in two shards",
                                              file=folder / name, key=tensor,
                                              expected="one shard", found=f"{where[tensor]} too")
                    where[tensor] = name
            for tensor, name in (listed or {}).items():
                if where.get(tensor) != name:
                    raise CheckpointError("index lists a tensor its shard does not hold",
                                          file=folder / INDEX, key=f"weight_map.{tensor}",
                                          expected=f"{tensor} in {name}",
                                          found=f"in {where[tensor]}" if tensor in where
                                          else "absent")
            config = read_json(folder / CONFIG) if (folder / CONFIG).is_file() else None
        except BaseException:
            for shard in shards.values():
                shard.close()
            raise
        return cls(folder if path.is_dir() else path, shards, where, config)

    @property
    def files(self) -> tuple[Path, ...]:
        """The shard files, sorted by name."""
        return tuple(s.path for _, s in sorted(self._shards.items()))

    def names(self) -> tuple[str, ...]:
        """Every stored tensor name, sorted."""
        return tuple(self._where)

    def __contains__(self, name: object) -> bool:
        return name in self._where

    def file_of(self, name: str) -> Path:
        """The shard holding tensor ``name``."""
        return self._shard(name).path

    def _shard(self, name: str) -> SafetensorsFile:
        try:
            return self._shards[self._where[name]]
        except KeyError:
            raise CheckpointError("no such tensor", file=self.path, key=name,
                                  suggestion=nearest(name, self._where)) from None

    def info(self, name: str) -> TensorInfo:
        """The header entry of stored tensor ``name``."""
        return self._shard(name).info(name)

    def raw(self, name: str) -> np.ndarray:
        """The stored tensor ``name`` as it is in the file (read-only)."""
        return self._shard(name).tensor(name)

    @property
    def nbytes(self) -> int:
        """Bytes of every stored tensor together."""
        return sum(self.info(n).nbytes for n in self._where)

    def weight(self, prefix: str) -> QuantTensor | np.ndarray:
        """The weight of module ``prefix`` (``X`` or ``X.weight``), in whichever layout it is.

        Plain float weights come back as arrays, quantized layouts as ``QuantTensor``; a name
        that is no module but a stored tensor (``X.bias``) comes back raw.
        """
        x = _module(prefix)
        for blocks, scales in _MX_SUFFIXES:
            if x + blocks in self._where:
                return self._mxfp4(x + blocks, x + scales)
        w = x + ".weight"
        if w not in self._where:
            if prefix in self._where:
                return self.raw(prefix)
            raise CheckpointError("no such weight", file=self.path, key=w,
                                  suggestion=nearest(w, self._where))
        info = self.info(w)
        if info.dtype in _FP8_DTYPES:
            return self._fp8(x, info)
        if info.dtype == "U8" and (x + ".weight_scale" in self._where
                                   or x + ".weight_scale_2" in self._where):
            return self._nvfp4(x, info)
        return self.raw(w)

    def weight_names(self) -> tuple[str, ...]:
        """One name per logical weight: ``X.weight`` for a quantized module, else the stored name.

        Each is accepted by :meth:`weight`; scales and packed blocks are folded into theirs.
        """
        out: list[str] = []
        consumed: set[str] = set()
        for name in self._where:
            for blocks, scales in _MX_SUFFIXES:
                if name.endswith(blocks) and name[: -len(blocks)] + scales in self._where:
                    consumed.add(name[: -len(blocks)] + scales)
                    out.append(name[: -len(blocks)] + ".weight")
                    break
            else:
                if name.endswith(".weight"):
                    consumed.update(name + s for s in ("_scale", "_scale_inv", "_scale_2"))
                out.append(name)
        return tuple(n for n in out if n not in consumed)

    def _fail(self, name: str, message: str, expected: Any = None,
              found: Any = None) -> NoReturn:
        raise CheckpointError(message, file=self.file_of(name), key=name, expected=expected,
                              found=found)

    def _need(self, name: str, dtypes: Iterable[str], shape: tuple[int, ...] | None = None,
              *, layout: str) -> TensorInfo:
        if name not in self._where:
            raise CheckpointError(f"{layout} layout is missing a tensor", file=self.path,
                                  key=name, expected="present", found="absent")
        info = self.info(name)
        dtypes = tuple(dtypes)
        if info.dtype not in dtypes:
            self._fail(name, f"{layout} tensor has the wrong dtype", " or ".join(dtypes),
                       info.dtype)
        if shape is not None and info.shape != tuple(shape):
            self._fail(name, f"{layout} tensor shape is inconsistent with its weight",
                       list(shape), list(info.shape))
        return info

    def _finite_scale(self, name: str, layout: str, positive: bool = False) -> np.ndarray:
        s = self.raw(name).astype(np.float32)
        bad = ~np.isfinite(s) | ((s <= 0) if positive else False)
        if bad.any():
            at = np.argwhere(bad)[0].tolist() if s.ndim else []
            self._fail(name, f"{layout} scale is not usable",
                       "finite and > 0" if positive else "finite",
                       f"{s[tuple(at)]} at {at}")
        return s

    def _fp8(self, x: str, info: TensorInfo) -> QuantTensor:
        w = x + ".weight"
        if len(info.shape) < 2:
            self._fail(w, "fp8 weight must be a matrix", "[..., n, k]", list(info.shape))
        *lead, n, k = info.shape
        element = _FP8_DTYPES[info.dtype]
        if x + ".weight_scale_inv" in self._where:
            fmt = FP8Format("block", element)
            name = x + ".weight_scale_inv"
            self._need(name, _SCALE_DTYPES, fmt.scale_shape(info.shape), layout="fp8 block")
        else:
            name = x + ".weight_scale"
            s = self._need(name, _SCALE_DTYPES, layout="fp8")
            if s.numel == 1 and len(s.shape) <= 1:
                fmt = FP8Format("tensor", element)
            elif s.shape == (*lead, n, 1):
                fmt = FP8Format("channel", element)
            else:
                self._fail(name, "fp8 scale shape is inconsistent with its weight",
                           f"[] or [1] (tensor) or {[*lead, n, 1]} (channel)", list(s.shape))
        scale = self._finite_scale(name, "fp8").reshape(fmt.scale_shape(info.shape))
        return QuantTensor(fmt, info.shape, self.raw(w), scale)

    def _mxfp4(self, blocks_name: str, scales_name: str) -> QuantTensor:
        b = self._need(blocks_name, ("U8",), layout="mxfp4")
        if len(b.shape) < 3 or b.shape[-1] != MXFP4Format.BLOCK // 2:
            self._fail(blocks_name, "mxfp4 blocks must be [..., n, k/32, 16] packed bytes",
                       "[..., n, k/32, 16]", list(b.shape))
        self._need(scales_name, ("U8", "F8_E8M0"), b.shape[:-1], layout="mxfp4")
        scales = self.raw(scales_name).view(np.uint8)
        if (scales == 0xFF).any():
            at = np.argwhere(scales == 0xFF)[0].tolist()
            self._fail(scales_name, "e8m0 scale is NaN (byte 0xFF)", "bytes 0..254",
                       f"0xFF at {at}")
        *lead, n, kb, half = b.shape
        data = self.raw(blocks_name).reshape(*lead, n, kb * half)
        return QuantTensor(MXFP4Format(), (*lead, n, kb * MXFP4Format.BLOCK), data,
                           scales.view(ml_dtypes.float8_e8m0fnu))

    def _nvfp4(self, x: str, info: TensorInfo) -> QuantTensor:
        w, block = x + ".weight", NVFP4Format.BLOCK
        if len(info.shape) < 2:
            self._fail(w, "nvfp4 weight must be packed [..., n, k/2]", "[..., n, k/2]",
                       list(info.shape))
        *lead, n, half = info.shape
        k = 2 * half
        if k % block:
            self._fail(w, "nvfp4 needs K divisible by its block", f"K a multiple of {block}",
                       f"K = {k}")
        self._need(x + ".weight_scale", ("F8_E4M3",), (*lead, n, k // block), layout="nvfp4")
        scale = self.raw(x + ".weight_scale")
        if np.isnan(scale.astype(np.float32)).any():
            self._fail(x + ".weight_scale", "nvfp4 block scale is NaN", "finite", "NaN")
        g = self._need(x + ".weight_scale_2", ("F32",), layout="nvfp4")
        if g.numel != 1 or len(g.shape) > 1:
            self._fail(x + ".weight_scale_2", "nvfp4 global scale must be a scalar", "[] or [1]",
                       list(g.shape))
        gs = self._finite_scale(x + ".weight_scale_2", "nvfp4 global", positive=True)
        return QuantTensor(NVFP4Format(), (*lead, n, k), self.raw(w), scale, gs.reshape(()))

    def close(self) -> None:
        """Close every shard."""
        for shard in self._shards.values():
            shard.close()

    def __enter__(self) -> Checkpoint:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return (f"Checkpoint({str(self.path)!r}, {len(self._shards)} files, "
                f"{len(self._where)} tensors)")


def _is_file(path: Path) -> bool:
    """``path.is_file()``, but a name the OS refuses (too long …) is no file, not an OSError."""
    try:
        return path.is_file()
    except OSError:
        return False


def _is_dir(path: Path) -> bool:
    """``path.is_dir()``, but a name the OS refuses is no folder, not an OSError."""
    try:
        return path.is_dir()
    except OSError:
        return False


class _DuplicateKey(Exception):
    pass


def _pairs(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in pairs:
        if k in out:
            raise _DuplicateKey(k)
        out[k] = v
    return out


def _read_index(path: Path) -> dict[str, str]:
    read_json(path)  # size and nesting caps, syntax errors at file:line:col
    try:
        index = json.loads(path.read_text(encoding="utf-8"), object_pairs_hook=_pairs)
    except _DuplicateKey as e:
        raise CheckpointError("tensor listed twice in the index", file=path,
                              key=f"weight_map.{e.args[0]}", expected="one shard per tensor",
                              found="two entries") from None
    wm = index.get("weight_map") if isinstance(index, dict) else None
    if not isinstance(wm, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in wm.items()
    ):
        raise CheckpointError("index needs a weight_map of tensor → shard file", file=path,
                              key="weight_map", expected="{str: str}", found=repr(wm)[:80])
    for tensor, shard in wm.items():
        if Path(shard).name != shard or shard in (".", ".."):
            raise CheckpointError("shard must be a file name in the checkpoint directory",
                                  file=path, key=f"weight_map.{tensor}",
                                  expected="a plain file name", found=shard)
    return wm


# ---------------------------------------------------------------- writing


def quantization_config(fmt: QuantFormat) -> dict[str, Any] | None:
    """The ``quantization_config`` entry of ``config.json`` describing ``fmt``.

    Modelled on the configs of the tools whose layouts are written (FineGrainedFP8,
    compressed-tensors, gpt-oss, ModelOpt); ``metrale_format`` names the format exactly.

    >>> quantization_config(NVFP4Format())["quant_algo"]
    'NVFP4'
    """
    if isinstance(fmt, BF16Format):
        return None
    base: dict[str, Any] = {"metrale_format": fmt.name}
    if isinstance(fmt, FP8Format):
        base.update(quant_method="fp8", fmt=fmt.element, activation_scheme="dynamic",
                    weight_granularity=fmt.granularity)
        if fmt.granularity == "block":
            base["weight_block_size"] = [fmt.block_size, fmt.block_size]
    elif isinstance(fmt, MXFP4Format):
        base.update(quant_method="mxfp4", group_size=fmt.block_size)
    elif isinstance(fmt, NVFP4Format):
        base.update(quant_method="modelopt", quant_algo="NVFP4", group_size=fmt.block_size)
    return base


def stored_tensors(name: str, value: QuantTensor | np.ndarray) -> dict[str, np.ndarray]:
    """The stored tensors of one weight in its format's checkpoint layout.

    >>> from metrale.lkb.quant import FORMATS
    >>> qt = FORMATS["fp8_e4m3_block"].quantize(np.ones((2, 4), np.float32))
    >>> sorted(stored_tensors("m.proj.weight", qt))
    ['m.proj.weight', 'm.proj.weight_scale_inv']
    """
    if not isinstance(value, QuantTensor):
        return {name: np.asarray(value)}
    fmt = value.fmt
    stacked_bare = len(value.shape) == 3 and not name.endswith(".weight")
    if not isinstance(fmt, BF16Format) and not name.endswith(".weight") and not (
            isinstance(fmt, MXFP4Format) and stacked_bare):
        raise CheckpointError("a quantized weight must be named X.weight", key=name,
                              expected="X.weight", found=name)
    if isinstance(fmt, MXFP4Format) and stacked_bare:
        # a bare stacked parameter [E, n, k] (gpt-oss's experts): transformers' X_blocks /
        # X_scales; a module's weight is still X.weight
        *lead, n, k = value.shape
        return {name + "_blocks": value.data.reshape(*lead, n, k // fmt.BLOCK, fmt.BLOCK // 2),
                name + "_scales": value.scale.view(np.uint8)}
    x = _module(name)
    if isinstance(fmt, BF16Format):
        return {name: value.data}
    if isinstance(fmt, FP8Format):
        suffix = ".weight_scale_inv" if fmt.granularity == "block" else ".weight_scale"
        return {name: value.data, x + suffix: value.scale}
    if isinstance(fmt, MXFP4Format):
        *lead, n, k = value.shape
        blocks = value.data.reshape(*lead, n, k // fmt.BLOCK, fmt.BLOCK // 2)
        return {x + ".weight_blocks": blocks, x + ".weight_scales": value.scale.view(np.uint8)}
    if isinstance(fmt, NVFP4Format):
        return {name: value.data, x + ".weight_scale": value.scale,
                x + ".weight_scale_2": value.global_scale}
    raise CheckpointError("format has no checkpoint layout", key=name, found=fmt.name)


def _shards(items: Iterable[tuple[str, QuantTensor | np.ndarray]],
            max_bytes: int) -> Iterator[dict[str, np.ndarray]]:
    shard: dict[str, np.ndarray] = {}
    size, yielded = 0, False
    for name, value in items:
        group = stored_tensors(name, value)
        group_bytes = sum(a.nbytes for a in group.values())
        if shard and size + group_bytes > max_bytes:
            yield shard
            shard, size, yielded = {}, 0, True
        clash = next((n for n in group if n in shard), None)
        if clash is not None:
            raise CheckpointError("tensor written twice", key=clash, expected="once",
                                  found="twice")
        shard.update(group)
        size += group_bytes
    if shard or not yielded:
        yield shard


OUTPUT_MARKER = ".metrale-output.json"
"""The file :func:`write_checkpoint` leaves in every folder it writes: it names the writer, and
only a folder holding it (from the same writer) may be replaced with ``overwrite``."""


def _marker_writer(folder: Path) -> str | None:
    """The writer named by ``folder``'s output marker, or ``None`` when it has none."""
    marker = folder / OUTPUT_MARKER
    try:
        if marker.is_symlink() or not marker.is_file() or marker.stat().st_size > 4096:
            return None
        data = json.loads(marker.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    writer = data.get("writer") if isinstance(data, dict) else None
    return writer if isinstance(writer, str) else None


def _same_or_inside(inner: Path, outer: Path) -> bool:
    """Whether ``inner`` is ``outer`` or lies inside it (both resolved)."""
    return inner == outer or outer in inner.parents


def check_destination(dst: os.PathLike | str, *, overwrite: bool, writer: str,
                      protect: Iterable[os.PathLike | str] = (), flag: str = "overwrite=True"
                      ) -> None:
    """Refuse a destination whose replacement could destroy data its writer did not create.

    A path that does not exist is fine. One that exists is refused unless ``overwrite`` is
    given and it is a real folder (not a link) holding :data:`OUTPUT_MARKER` from the same
    ``writer``; and it is never one of ``protect`` (the sources being read) nor a folder above
    one. ``flag`` is how the caller spells the overwrite switch (``--overwrite`` on the CLI).

    >>> import tempfile
    >>> d = Path(tempfile.mkdtemp())
    >>> check_destination(d, overwrite=True, writer="met quantize")
    Traceback (most recent call last):
    ...
    metrale.lkb.errors.CheckpointError: ...: destination exists and was not written by met quantize (expected a new folder, or a previous output of met quantize (it holds .metrale-output.json), found a folder without that marker)
    """  # noqa: E501
    dst = Path(dst)
    real = dst.resolve()
    for src in protect:
        source = Path(src).resolve()
        if _same_or_inside(source, real):
            raise CheckpointError("destination is the source or a folder holding it",
                                  file=dst, expected="a folder apart from the source",
                                  found=f"it holds {src}" if source != real else "the source")
    if not (dst.exists() or dst.is_symlink()):
        return
    if not overwrite:
        raise CheckpointError("destination exists", file=dst, expected="a new folder",
                              found=f"an existing path; {flag} replaces a previous output "
                                    f"of {writer}")
    found = _marker_writer(dst) if dst.is_dir() and not dst.is_symlink() else None
    if found == writer:
        return
    kind = ("a link" if dst.is_symlink() else "a file" if not dst.is_dir()
            else "a folder without that marker" if found is None else f"the output of {found}")
    raise CheckpointError(f"destination exists and was not written by {writer}", file=dst,
                          expected=f"a new folder, or a previous output of {writer} (it holds "
                                   f"{OUTPUT_MARKER})", found=kind)


def _copy_into(folder: Path, name: str, source: Path) -> None:
    """Copy ``source`` to ``folder / name`` in 1 MiB chunks (never whole in memory)."""
    tmp = folder / f".{name}.{secrets.token_hex(8)}.tmp"
    try:
        with open(source, "rb") as fin, open(tmp, "xb") as fout:
            shutil.copyfileobj(fin, fout, 1 << 20)
            fout.flush()
            os.fsync(fout.fileno())
        os.replace(tmp, folder / name)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def write_checkpoint(
    dst: os.PathLike | str,
    tensors: Mapping[str, Weight] | Iterable[tuple[str, Weight]],
    config: Mapping[str, Any] | None,
    fmt: QuantFormat | str,
    *,
    max_shard_bytes: int = DEFAULT_SHARD_BYTES,
    extra_files: Mapping[str, bytes | os.PathLike] | None = None,
    overwrite: bool = False,
    writer: str = "write_checkpoint",
    protect: Iterable[os.PathLike | str] = (),
    flag: str = "overwrite=True",
) -> None:
    """Write a checkpoint directory atomically: all of it appears at ``dst``, or none of it.

    ``tensors`` maps names to arrays (stored as they are) or ``QuantTensor`` s (stored in
    their format's layout, see :func:`stored_tensors`); it may be an iterable of pairs, consumed
    once, so a caller can produce tensors while earlier shards are written. ``config.json``
    gets ``quantization_config`` for ``fmt``. ``extra_files`` maps plain file names to bytes
    or to a file to copy (streamed). Everything is written into a temporary sibling directory
    (each file with ``atomic_write``) that is renamed to ``dst`` at the end; an interrupt
    removes it. The folder gets :data:`OUTPUT_MARKER` naming ``writer``; an existing ``dst``
    is refused unless ``overwrite`` and it is a previous output of the same ``writer``, and it
    is never one of ``protect`` nor a folder holding one (see :func:`check_destination`).
    """
    fmt = QuantFormat.parse(fmt) if isinstance(fmt, str) else fmt
    dst = Path(dst)
    check_destination(dst, overwrite=overwrite, writer=writer, protect=protect, flag=flag)
    try:
        _write_checkpoint(dst, tensors, config, fmt, max_shard_bytes, extra_files or {}, writer)
    except OSError as e:
        if e.filename is not None:
            raise
        # a full disk reports no file: name the folder being written (docs/errors.md, 12)
        raise OSError(e.errno, e.strerror or str(e), str(dst)) from e


def _write_checkpoint(dst: Path, tensors: Any, config: Mapping[str, Any] | None,
                      fmt: QuantFormat, max_shard_bytes: int,
                      extra_files: Mapping[str, bytes | os.PathLike], writer: str) -> None:
    dst.parent.mkdir(parents=True, exist_ok=True)
    # Names drawn before the folders exist (64 random bits) and folders made inside the
    # ``try``: an interrupt landing anywhere finds them to remove (``mkdtemp`` leaves a gap).
    tmp = dst.parent / f".{dst.name}.{secrets.token_hex(8)}.tmp"
    trash = tmp.with_suffix(".old")
    try:
        os.mkdir(tmp)  # mode 0o777 less the umask: a plain folder once renamed
        items = tensors.items() if isinstance(tensors, Mapping) else tensors
        written: list[tuple[str, tuple[str, ...]]] = []
        total = 0
        for i, shard in enumerate(_shards(items, max_shard_bytes)):
            part = f"part-{i:05d}.safetensors"
            atomic_write(tmp / part, encode_safetensors(shard, {"format": "pt"}))
            written.append((part, tuple(shard)))
            total += sum(a.nbytes for a in shard.values())
        if len(written) == 1:
            os.replace(tmp / written[0][0], tmp / SINGLE)
        else:
            count = len(written)
            weight_map: dict[str, str] = {}
            for i, (part, names) in enumerate(written):
                final = f"model-{i + 1:05d}-of-{count:05d}.safetensors"
                os.replace(tmp / part, tmp / final)
                weight_map.update(dict.fromkeys(names, final))
            index = {"metadata": {"total_size": total},
                     "weight_map": dict(sorted(weight_map.items()))}
            atomic_write(tmp / INDEX, json.dumps(index, indent=2) + "\n")
        cfg = dict(config or {})
        cfg.pop("quantization_config", None)
        qc = quantization_config(fmt)
        if qc is not None:
            cfg["quantization_config"] = qc
        atomic_write(tmp / CONFIG, json.dumps(cfg, indent=2) + "\n")
        for name, data in extra_files.items():
            if Path(name).name != name or name in (SINGLE, INDEX, CONFIG, OUTPUT_MARKER):
                raise CheckpointError("extra file name not allowed", file=dst, key=name,
                                      expected="a plain file name other than the checkpoint's")
            if isinstance(data, (bytes, bytearray, memoryview)):
                atomic_write(tmp / name, bytes(data))
            else:
                _copy_into(tmp, name, Path(data))
        atomic_write(tmp / OUTPUT_MARKER, json.dumps({"writer": writer, "format": fmt.name})
                     + "\n")
        if dst.exists() or dst.is_symlink():
            os.mkdir(trash)
            os.replace(dst, trash / dst.name)
            os.replace(tmp, dst)
            shutil.rmtree(trash, ignore_errors=True)
        else:
            os.replace(tmp, dst)
    except BaseException:
        if not dst.exists() and (trash / dst.name).exists():
            os.replace(trash / dst.name, dst)  # stopped between the two renames: old one back
        shutil.rmtree(tmp, ignore_errors=True)
        shutil.rmtree(trash, ignore_errors=True)
        raise
