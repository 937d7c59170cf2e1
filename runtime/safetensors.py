"""Safetensors files: the one place where the bytes of a checkpoint file become arrays.

A file is an 8-byte little-endian header length ``N``, ``N`` bytes of JSON header
(``{name: {"dtype", "shape", "data_offsets"}, "__metadata__": {str: str}}``), then the data,
with offsets relative to its start. :class:`SafetensorsFile` checks every header field before
it maps anything, then hands out read-only views of a memory map, so using one tensor of a
large file reads only that tensor's pages. :func:`write_safetensors` writes atomically.

Law: what is written is read back byte for byte, ml_dtypes types included.

>>> import tempfile, pathlib, ml_dtypes
>>> p = pathlib.Path(tempfile.mkdtemp()) / "t.safetensors"
>>> a = np.arange(6, dtype=np.float32).reshape(2, 3).astype(ml_dtypes.float8_e4m3fn)
>>> write_safetensors(p, {"a": a}, {"format": "np"})
>>> with SafetensorsFile.open(p) as f:
...     print(f.keys(), f.metadata, bool(np.array_equal(f.tensor("a"), a)))
...     print(f.info("a"))
('a',) {'format': 'np'} True
TensorInfo(name='a', dtype='F8_E4M3', shape=(2, 3), begin=0, end=6)
"""

from __future__ import annotations

import json
import math
import mmap
import os
import struct
from collections.abc import Iterator, Mapping
from pathlib import Path
from types import MappingProxyType
from typing import Any

import attrs
import ml_dtypes
import numpy as np

from metrale.lkb.errors import CheckpointError, nearest
from metrale.lkb.files import atomic_write
from metrale.lkb.quant import pack_e2m1, unpack_e2m1

MAX_HEADER_BYTES = 100_000_000
"""Headers longer than this are refused before they are read."""
MAX_ELEMENTS = 1 << 60
"""Shapes with more elements than this are refused (no real tensor comes near it)."""

DTYPES: Mapping[str, np.dtype] = MappingProxyType({
    "BOOL": np.dtype(np.bool_),
    "U8": np.dtype(np.uint8),
    "I8": np.dtype(np.int8),
    "U16": np.dtype("<u2"),
    "I16": np.dtype("<i2"),
    "U32": np.dtype("<u4"),
    "I32": np.dtype("<i4"),
    "U64": np.dtype("<u8"),
    "I64": np.dtype("<i8"),
    "F16": np.dtype("<f2"),
    "BF16": np.dtype(ml_dtypes.bfloat16),
    "F32": np.dtype("<f4"),
    "F64": np.dtype("<f8"),
    "F8_E4M3": np.dtype(ml_dtypes.float8_e4m3fn),
    "F8_E5M2": np.dtype(ml_dtypes.float8_e5m2),
    "F8_E8M0": np.dtype(ml_dtypes.float8_e8m0fnu),
    "F4": np.dtype(ml_dtypes.float4_e2m1fn),
})
"""Header dtype spelling → the NumPy dtype a tensor comes back as (``F4`` is unpacked)."""

_BITS = {name: (4 if name == "F4" else dt.itemsize * 8) for name, dt in DTYPES.items()}
_NAMES = {dt: name for name, dt in DTYPES.items()}
_ENTRY_KEYS = ("dtype", "shape", "data_offsets")


@attrs.frozen
class TensorInfo:
    """One header entry: dtype spelling, shape, and byte range within the data section.

    >>> TensorInfo("w", "F4", (2, 8), 0, 8).nbytes
    8
    """

    name: str
    dtype: str
    shape: tuple[int, ...]
    begin: int
    end: int

    @property
    def nbytes(self) -> int:
        """Bytes the tensor takes in the file."""
        return self.end - self.begin

    @property
    def numel(self) -> int:
        """Element count."""
        return math.prod(self.shape)

    @property
    def numpy(self) -> np.dtype:
        """The NumPy dtype :meth:`SafetensorsFile.tensor` returns."""
        return DTYPES[self.dtype]


class _Duplicate(Exception):
    pass


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    seen: dict[str, Any] = {}
    for k, v in pairs:
        if k in seen:
            raise _Duplicate(k)
        seen[k] = v
    return seen


def _is_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _parse_header(path: Path, raw: bytes) -> tuple[dict[str, str], list[TensorInfo]]:
    def fail(message: str, key: str = "header", expected: Any = None, found: Any = None,
             suggestion: str | None = None) -> CheckpointError:
        return CheckpointError(message, file=path, key=key, expected=expected, found=found,
                               suggestion=suggestion)

    try:
        text = raw.decode("utf-8")
        header = json.loads(text, object_pairs_hook=_no_duplicates)
    except UnicodeDecodeError as e:
        raise fail("header is not UTF-8", found=str(e)) from None
    except _Duplicate as e:
        raise fail("duplicate key in header", key=str(e.args[0]), expected="each key once",
                   found="twice") from None
    except json.JSONDecodeError as e:
        raise fail(f"header is not JSON: {e.msg}", found=f"at byte {e.pos}") from None
    except RecursionError:
        raise fail("header nested too deeply") from None
    except ValueError as e:  # an integer past Python's 4300-digit conversion limit
        raise fail("header value unreadable", found=str(e)[:80]) from None
    if not isinstance(header, dict):
        raise fail("header is not a JSON object", expected="object",
                   found=type(header).__name__)

    metadata = header.pop("__metadata__", {})
    if not isinstance(metadata, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in metadata.items()
    ):
        raise fail("metadata must map strings to strings", key="__metadata__",
                   expected="{str: str}", found=repr(metadata)[:80])

    infos = []
    for name, entry in header.items():
        if not isinstance(entry, dict):
            raise fail("tensor entry is not an object", key=name, expected="object",
                       found=type(entry).__name__)
        for k in entry:
            if k not in _ENTRY_KEYS:
                raise fail("unknown field", key=f"{name}.{k}",
                           suggestion=nearest(k, _ENTRY_KEYS))
        for k in _ENTRY_KEYS:
            if k not in entry:
                raise fail("missing field", key=f"{name}.{k}")
        dtype, shape, offsets = entry["dtype"], entry["shape"], entry["data_offsets"]
        if not isinstance(dtype, str) or dtype not in DTYPES:
            raise fail("unknown dtype", key=f"{name}.dtype",
                       expected="one of " + ", ".join(DTYPES), found=repr(dtype),
                       suggestion=nearest(str(dtype), DTYPES))
        if not isinstance(shape, list) or not all(_is_int(d) and d >= 0 for d in shape):
            raise fail("shape must be a list of non-negative integers", key=f"{name}.shape",
                       expected="[int >= 0, ...]", found=repr(shape)[:80])
        numel = 1
        for d in shape:
            numel *= d
            if numel > MAX_ELEMENTS or d > MAX_ELEMENTS:  # one huge dim beside a 0 one too
                raise fail("shape too large", key=f"{name}.shape",
                           expected=f"at most {MAX_ELEMENTS} elements", found=shape)
        if not (isinstance(offsets, list) and len(offsets) == 2
                and all(_is_int(o) and o >= 0 for o in offsets)):
            raise fail("data_offsets must be [begin, end], non-negative integers",
                       key=f"{name}.data_offsets", expected="[begin, end]",
                       found=repr(offsets)[:80])
        begin, end = offsets
        if begin > end:
            raise fail("data_offsets out of order", key=f"{name}.data_offsets",
                       expected="begin <= end", found=offsets)
        if dtype == "F4" and numel % 2:
            raise fail("packed e2m1 needs an even element count", key=f"{name}.shape",
                       expected="even element count", found=f"{numel} elements {shape}")
        want = numel * _BITS[dtype] // 8
        if end - begin != want:
            raise fail("byte length does not match shape and dtype",
                       key=f"{name}.data_offsets",
                       expected=f"{want} bytes ({shape} x {dtype})", found=f"{end - begin} bytes")
        infos.append(TensorInfo(name, dtype, tuple(shape), begin, end))
    return metadata, infos


def _check_layout(path: Path, infos: list[TensorInfo], data_len: int) -> None:
    """The byte ranges tile the data section exactly: from 0, no gap, no overlap, no tail."""
    at, prev = 0, None
    for info in sorted(infos, key=lambda i: (i.begin, i.end)):
        key = f"{info.name}.data_offsets"
        if info.begin < at:
            raise CheckpointError("tensor overlaps the one before it", file=path, key=key,
                                  expected=f"begin >= {at} (end of {prev})", found=info.begin)
        if info.begin > at:
            raise CheckpointError("gap before tensor", file=path, key=key,
                                  expected=f"begin == {at}", found=info.begin)
        if info.end > data_len:
            raise CheckpointError("tensor runs past the end of the file", file=path, key=key,
                                  expected=f"end <= {data_len}", found=info.end)
        at, prev = info.end, info.name
    if at != data_len:
        raise CheckpointError("bytes after the last tensor", file=path, key="header",
                              expected=f"data section of {at} bytes",
                              found=f"{data_len} bytes")


def path_kind(path: os.PathLike | str) -> str:
    """What ``path`` is, in words, following links: ``a regular file``, ``a directory``,
    ``a FIFO``, ``a character device``, ``a link loop``, ``nothing`` …

    >>> path_kind("/dev/null"), path_kind("/"), path_kind("/nonexistent")
    ('a character device', 'a directory', 'nothing')
    """
    import errno
    import stat

    try:
        mode = os.stat(path).st_mode
    except OSError as e:
        if e.errno == errno.ELOOP:
            return "a link loop"
        if e.errno in (errno.ENOENT, errno.ENOTDIR, errno.ENAMETOOLONG):
            return "a broken link" if _is_link(path) else "nothing"
        return e.strerror or "unreadable"
    for test, word in ((stat.S_ISREG, "a regular file"), (stat.S_ISDIR, "a directory"),
                       (stat.S_ISFIFO, "a FIFO"), (stat.S_ISCHR, "a character device"),
                       (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket")):
        if test(mode):
            return word
    return "not a regular file"


def _is_link(path: os.PathLike | str) -> bool:
    try:
        return os.path.islink(path)
    except (OSError, ValueError):
        return False


class SafetensorsFile:
    """An open, validated safetensors file; tensors are read-only views of its memory map.

    ``close()`` drops the map; views already handed out keep their pages alive until they
    are garbage (unmapping under a live view would crash). F4 tensors come back unpacked
    (one e2m1 per byte), which is a copy rather than a view.
    """

    def __init__(self, path: Path, metadata: dict[str, str], infos: list[TensorInfo],
                 data_start: int, mapped: mmap.mmap | None) -> None:
        self.path = path
        self._metadata = metadata
        self._infos = {i.name: i for i in sorted(infos, key=lambda i: i.begin)}
        self._data_start = data_start
        self._mm = mapped
        self._closed = False

    @classmethod
    def open(cls, path: os.PathLike | str) -> SafetensorsFile:
        """Validate the header of ``path`` and map the file.

        >>> SafetensorsFile.open("/nonexistent.safetensors")
        Traceback (most recent call last):
        ...
        metrale.lkb.errors.CheckpointError: /nonexistent.safetensors: file not found
        """
        path = Path(path)
        kind = path_kind(path)
        if kind == "nothing":
            raise CheckpointError("file not found", file=path)
        if kind != "a regular file":  # opening a FIFO would block; /dev/zero never ends
            raise CheckpointError("not a regular file", file=path, expected="a safetensors file",
                                  found=kind)
        try:
            fh = open(path, "rb")
        except FileNotFoundError:
            raise CheckpointError("file not found", file=path) from None
        except OSError as e:
            raise CheckpointError("cannot open file", file=path, found=e.strerror) from None
        with fh:
            size = os.fstat(fh.fileno()).st_size
            if size < 8:
                raise CheckpointError("file too short for a safetensors header", file=path,
                                      key="header", expected="at least 8 bytes",
                                      found=f"{size} bytes")
            (n,) = struct.unpack("<Q", fh.read(8))
            if n > MAX_HEADER_BYTES or n > size - 8:
                raise CheckpointError("header length prefix too large", file=path,
                                      key="header",
                                      expected=f"at most {min(MAX_HEADER_BYTES, size - 8)} bytes",
                                      found=f"{n} bytes")
            metadata, infos = _parse_header(path, fh.read(n))
            _check_layout(path, infos, size - 8 - n)
            mapped = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ) if infos else None
        return cls(path, metadata, infos, 8 + n, mapped)

    @property
    def metadata(self) -> dict[str, str]:
        """The ``__metadata__`` table (empty when absent)."""
        return dict(self._metadata)

    def keys(self) -> tuple[str, ...]:
        """Tensor names, in file order."""
        return tuple(self._infos)

    def __contains__(self, name: object) -> bool:
        return name in self._infos

    def __iter__(self) -> Iterator[str]:
        return iter(self._infos)

    def __len__(self) -> int:
        return len(self._infos)

    def info(self, name: str) -> TensorInfo:
        """The header entry of ``name``."""
        try:
            return self._infos[name]
        except KeyError:
            raise CheckpointError("no such tensor", file=self.path, key=name,
                                  suggestion=nearest(name, self._infos)) from None

    def tensor(self, name: str) -> np.ndarray:
        """The tensor ``name`` as a read-only array (a view of the map; F4 unpacked)."""
        info = self.info(name)
        if self._closed:
            raise CheckpointError("file is closed", file=self.path, key=name)
        dtype = DTYPES[info.dtype]
        if info.numel == 0:
            out = np.empty(info.shape, dtype)
            out.flags.writeable = False
            return out
        if info.dtype == "F4":
            packed = np.frombuffer(self._mm, np.uint8, info.nbytes, self._data_start + info.begin)
            out = unpack_e2m1(packed).reshape(info.shape)
            out.flags.writeable = False
            return out
        return np.frombuffer(self._mm, dtype, info.numel,
                             self._data_start + info.begin).reshape(info.shape)

    def close(self) -> None:
        """Stop handing out tensors and release the map if no view holds it."""
        self._closed = True
        if self._mm is not None:
            try:
                self._mm.close()
            except BufferError:
                pass  # live views hold the map; it is unmapped when the last one goes
            self._mm = None

    def __enter__(self) -> SafetensorsFile:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"SafetensorsFile({str(self.path)!r}, {len(self._infos)} tensors)"


def _byte_view(a: np.ndarray) -> memoryview:
    return memoryview(np.ascontiguousarray(a).reshape(-1).view(np.uint8))


def encode_safetensors(tensors: Mapping[str, np.ndarray],
                       metadata: Mapping[str, str] | None = None) -> bytes:
    """The bytes of a safetensors file holding ``tensors`` (see :func:`write_safetensors`).

    >>> raw = encode_safetensors({"x": np.array([7, 9], np.uint8)})
    >>> n = int.from_bytes(raw[:8], "little")
    >>> n % 8, raw[8:8 + n].decode().rstrip(), raw[8 + n:]
    (0, '{"x":{"dtype":"U8","shape":[2],"data_offsets":[0,2]}}', b'\\x07\\t')
    """
    meta = dict(metadata or {})
    if not all(isinstance(k, str) and isinstance(v, str) for k, v in meta.items()):
        raise CheckpointError("metadata must map strings to strings", key="__metadata__",
                              expected="{str: str}", found=repr(meta)[:80])
    entries = []
    for name, arr in tensors.items():
        if not isinstance(name, str) or name == "__metadata__":
            raise CheckpointError("bad tensor name", key=str(name),
                                  expected="a string other than __metadata__", found=repr(name))
        arr = np.asarray(arr)
        if arr.dtype.byteorder == ">":
            arr = arr.astype(arr.dtype.newbyteorder("<"))
        dtype = _NAMES.get(arr.dtype)
        if dtype is None:
            raise CheckpointError("dtype has no safetensors spelling", key=name,
                                  expected="one of " + ", ".join(map(str, _NAMES)),
                                  found=str(arr.dtype))
        if dtype == "F4":
            if arr.size % 2:
                raise CheckpointError("packed e2m1 needs an even element count", key=name,
                                      expected="even element count", found=arr.size)
            payload = _byte_view(pack_e2m1(arr.reshape(-1)))
        else:
            payload = _byte_view(arr)
        entries.append((name, dtype, list(arr.shape), payload))
    # widest elements first keeps every tensor aligned to its element size
    entries.sort(key=lambda e: (-_BITS[e[1]], e[0]))
    header: dict[str, Any] = {"__metadata__": meta} if meta else {}
    at = 0
    for name, dtype, shape, payload in entries:
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [at, at + len(payload)]}
        at += len(payload)
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    return b"".join([struct.pack("<Q", len(text)), text, *(e[3] for e in entries)])


def write_safetensors(path: os.PathLike | str, tensors: Mapping[str, np.ndarray],
                      metadata: Mapping[str, str] | None = None) -> None:
    """Write ``tensors`` to ``path`` atomically; ml_dtypes types keep their own header spelling.

    Written here rather than with ``safetensors.numpy.save``: that one knows no bfloat16,
    fp8, e8m0 or fp4 NumPy types. The header is padded to 8 bytes and tensors are ordered
    widest element first, as the ``safetensors`` package does; ``float4_e2m1fn`` arrays are
    stored packed as ``F4`` (low nibble first).
    """
    try:
        raw = encode_safetensors(tensors, metadata)
    except CheckpointError as e:
        raise CheckpointError(e.message, file=path, key=e.key, expected=e.expected,
                              found=e.found) from None
    atomic_write(path, raw)
