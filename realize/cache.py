"""The build cache: compiled binaries stored under the SHA-256 of everything that made them.

An entry is two files, the payload and a small JSON meta holding the payload's SHA-256 and
its own; both are written with ``atomic_write``, payload first and meta last, so the meta's
rename is the commit. A reader checks both hashes: a corrupt, truncated or hand-edited entry
is deleted and counts as a miss, never loaded. Two processes writing one key at once both
succeed and leave a whole entry.

Laws: ``build`` is ``compile`` memoized on the key, and a failed compile stores nothing.

>>> import tempfile
>>> from metrale.realize.compute import HostTarget
>>> cache = BuildCache(tempfile.mkdtemp())
>>> b1 = cache.build(HostTarget(), "numpy", "host", {}, name="add", entry="add")
>>> b2 = cache.build(HostTarget(), "numpy", "host", {}, name="add", entry="add")
>>> b1 == b2, cache.hits, cache.misses
(True, 1, 1)
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from metrale.lkb.errors import CacheError, ConfigError
from metrale.lkb.files import atomic_write, read_json
from metrale.realize.compute import FORMATS, Binary, ComputeTarget

LAYOUT = "v1"
"""Folder of the current entry layout; a new layout gets a new folder, never a migration."""

_log = logging.getLogger("metrale.cache")
_KEY = re.compile(r"[0-9a-f]{64}")
_META_FIELDS = {"layout", "key", "sha256", "size", "arch", "entries", "format", "compiler",
                "meta_sha256"}


def default_cache_root() -> Path:
    """``$METRALE_CACHE``, else ``$XDG_CACHE_HOME/metrale``, else ``~/.cache/metrale``."""
    if os.environ.get("METRALE_CACHE"):
        return Path(os.environ["METRALE_CACHE"]).expanduser()
    if os.environ.get("XDG_CACHE_HOME"):
        return Path(os.environ["XDG_CACHE_HOME"]).expanduser() / "metrale"
    return Path("~/.cache/metrale").expanduser()


def _canonical(obj: Any) -> bytes:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=True).encode()


def cache_key(source: str, defines: Mapping[str, str | int], arch: str, compiler_version: str,
              entry: str | None, headers: Mapping[str, str] | None = None) -> str:
    """SHA-256 hex of everything a binary depends on. Defines are compared as ``-D`` text (so
    ``1`` and ``"1"`` are one key) and in name order; headers by name and text.

    >>> k = cache_key("src", {"B": 1, "A": "x"}, "sm_90a", "nvcc 13.0.88", "k")
    >>> k == cache_key("src", {"A": "x", "B": "1"}, "sm_90a", "nvcc 13.0.88", "k")
    True
    >>> k == cache_key("src", {"A": "x", "B": 1}, "sm_80", "nvcc 13.0.88", "k")
    False
    """
    return hashlib.sha256(_canonical({
        "layout": LAYOUT,
        "source": source,
        "defines": sorted([str(k), str(v)] for k, v in defines.items()),
        "arch": arch,
        "compiler": compiler_version,
        "entry": entry,
        "headers": sorted([str(k), str(v)] for k, v in (headers or {}).items()),
    })).hexdigest()


class BuildCache:
    """A folder of binaries keyed by :func:`cache_key`; counts its hits, misses and discards.

    >>> import tempfile
    >>> BuildCache(tempfile.mkdtemp()).get("0" * 64) is None
    True
    """

    def __init__(self, root: os.PathLike | str | None = None) -> None:
        self.root = Path(root) if root is not None else default_cache_root()
        self.hits = 0
        self.misses = 0
        self.discarded = 0

    def __repr__(self) -> str:
        return f"BuildCache({str(self.root)!r})"

    key = staticmethod(cache_key)

    def paths(self, key: str) -> tuple[Path, Path]:
        """The payload and meta files of ``key``."""
        if not isinstance(key, str) or not _KEY.fullmatch(key):
            raise CacheError("not a cache key", key="key", expected="64 lowercase hex digits",
                             found=repr(key))
        folder = self.root / LAYOUT / key[:2]
        return folder / f"{key}.bin", folder / f"{key}.json"

    def get(self, key: str) -> Binary | None:
        """The binary stored under ``key``, or ``None``; a damaged entry is deleted (a miss)."""
        payload, meta_path = self.paths(key)
        if not meta_path.is_file():
            self.misses += 1
            return None
        try:
            binary = self._read(key, payload, meta_path)
        except _Damaged as e:
            _log.warning("build cache: discarding %s: %s", meta_path, e)
            self.discard(key)
            self.discarded += 1
            self.misses += 1
            return None
        self.hits += 1
        return binary

    def _read(self, key: str, payload: Path, meta_path: Path) -> Binary:
        try:
            meta = read_json(meta_path)
        except ConfigError as e:
            raise _Damaged(f"meta unreadable: {e}") from None
        if not isinstance(meta, dict) or set(meta) != _META_FIELDS:
            raise _Damaged("meta has the wrong fields")
        claimed = meta.pop("meta_sha256")
        if claimed != hashlib.sha256(_canonical(meta)).hexdigest():
            raise _Damaged("meta does not match its own hash")
        if meta["layout"] != LAYOUT or meta["key"] != key or meta["format"] not in FORMATS:
            raise _Damaged("meta is for another key or layout")
        try:
            data = payload.read_bytes()
        except OSError as e:
            raise _Damaged(f"payload unreadable: {e}") from None
        if len(data) != meta["size"] or hashlib.sha256(data).hexdigest() != meta["sha256"]:
            raise _Damaged(f"payload hash mismatch ({len(data)} bytes, meta says {meta['size']})")
        return Binary(data, meta["arch"], meta["entries"], meta["format"], meta["compiler"])

    def put(self, key: str, binary: Binary) -> None:
        """Store ``binary`` under ``key``: payload then meta, each atomically."""
        payload, meta_path = self.paths(key)
        meta = {"layout": LAYOUT, "key": key, "sha256": binary.sha256, "size": len(binary.data),
                "arch": binary.arch, "entries": list(binary.entries), "format": binary.format,
                "compiler": binary.compiler}
        meta["meta_sha256"] = hashlib.sha256(_canonical(meta)).hexdigest()
        try:
            atomic_write(payload, binary.data)
            atomic_write(meta_path, json.dumps(meta, indent=1, sort_keys=True) + "\n")
        except OSError as e:
            raise CacheError(f"could not write the build cache entry: {e}", file=meta_path,
                             key=key) from None

    def discard(self, key: str) -> None:
        """Delete ``key``'s entry (meta first, so no reader sees a meta without its payload)."""
        payload, meta_path = self.paths(key)
        for p in (meta_path, payload):
            try:
                p.unlink()
            except FileNotFoundError:
                pass
            except OSError as e:
                raise CacheError(f"could not delete a damaged cache entry: {e}", file=p,
                                 key=key) from None

    def build(self, target: ComputeTarget, source: str, arch: str,
              defines: Mapping[str, str | int], name: str, entry: str | None = None,
              headers: Mapping[str, str] | None = None) -> Binary:
        """The cached binary of this compile, compiling and storing it on a miss.

        A compile that raises stores nothing, so the next build tries again.
        """
        key = cache_key(source, defines, arch, target.version(), entry, headers)
        hit = self.get(key)
        if hit is not None:
            return hit
        extra = {"headers": headers} if headers else {}
        binary = target.compile(source, arch, defines, name=name, entry=entry, **extra)
        self.put(key, binary)
        return binary


class _Damaged(Exception):
    """An entry that must not be loaded (internal: ``get`` turns it into a miss)."""
