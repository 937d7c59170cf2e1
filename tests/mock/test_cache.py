"""The build cache: hits and misses, damaged entries rebuilt, failed compiles, two writers."""

import json
import subprocess
import sys
import textwrap
import time
from collections.abc import Mapping
from pathlib import Path

import pytest

from metrale.lkb.errors import CacheError, CompileError
from metrale.lkb.vendor import Vendor
from metrale.realize.cache import BuildCache, cache_key, default_cache_root
from metrale.realize.compute import Availability, Binary, ComputeTarget, HostTarget


class FakeTarget:
    """A compiler whose output is a function of its inputs; counts its compiles."""

    vendor = Vendor.NVIDIA
    source_extension = ".cu"
    output_extension = ".ptx"
    output_is_text = True

    def __init__(self, version: str = "fake 1.0") -> None:
        self.compiles = 0
        self._version = version

    def available(self) -> Availability:
        return Availability(True, "fake")

    def version(self) -> str:
        return self._version

    def compile(self, source: str, arch: str, defines: Mapping[str, str | int], *, name: str,
                entry: str | None = None, headers: Mapping[str, str] | None = None) -> Binary:
        self.compiles += 1
        if "syntax error" in source:
            raise CompileError(f"fake compiler rejects {name}", file=name + ".cu", key=entry)
        text = f"// {arch} {sorted(defines.items())} {sorted((headers or {}).items())}\n"
        text += f".visible .entry {entry or 'k'}(\n{source}\n"
        return Binary(text.encode(), arch, (entry or "k",), "ptx", self._version)


def entry_files(cache: BuildCache) -> list[Path]:
    return sorted(p for p in cache.root.rglob("*") if p.is_file())


def build(cache: BuildCache, target: FakeTarget, source: str = "src", **kw) -> Binary:
    return cache.build(target, source, kw.pop("arch", "sm_90a"), kw.pop("defines", {"N": 4}),
                       "k", kw.pop("entry", "k"), **kw)


def test_fake_target_is_a_compute_target() -> None:
    assert isinstance(FakeTarget(), ComputeTarget)
    assert isinstance(HostTarget(), ComputeTarget)


def test_miss_then_hit(tmp_path: Path) -> None:
    cache, t = BuildCache(tmp_path), FakeTarget()
    b1 = build(cache, t)
    b2 = build(cache, t)
    assert b1 == b2 and b1.data.startswith(b"// sm_90a")
    assert t.compiles == 1 and (cache.hits, cache.misses) == (1, 1)
    assert [p.suffix for p in entry_files(cache)] == [".bin", ".json"]


def test_a_fresh_cache_object_hits_on_disk(tmp_path: Path) -> None:
    t = FakeTarget()
    b1 = build(BuildCache(tmp_path), t)
    again = BuildCache(tmp_path)
    assert build(again, t) == b1 and t.compiles == 1 and again.hits == 1


@pytest.mark.parametrize("change", [
    {"source": "src2"}, {"arch": "sm_80"}, {"defines": {"N": 5}}, {"entry": "k2"},
    {"headers": {"a.cuh": "x"}},
])
def test_every_input_is_in_the_key(tmp_path: Path, change: dict) -> None:
    cache, t = BuildCache(tmp_path), FakeTarget()
    build(cache, t)
    build(cache, t, **change)
    assert t.compiles == 2


def test_compiler_version_is_in_the_key(tmp_path: Path) -> None:
    cache = BuildCache(tmp_path)
    build(cache, FakeTarget("fake 1.0"))
    t2 = FakeTarget("fake 1.1")
    assert build(cache, t2).compiler == "fake 1.1" and t2.compiles == 1


def test_key_normalizes_defines() -> None:
    k = cache_key("s", {"A": 1, "B": "x"}, "sm_80", "v", None)
    assert k == cache_key("s", {"B": "x", "A": "1"}, "sm_80", "v", None)
    assert len(k) == 64 and k != cache_key("s", {"A": 1}, "sm_80", "v", None)


def _damage_payload(cache: BuildCache, key: str, how: str) -> None:
    payload, meta = cache.paths(key)
    data = payload.read_bytes()
    if how == "flip":
        payload.write_bytes(data[:5] + bytes([data[5] ^ 1]) + data[6:])
    elif how == "truncate":
        payload.write_bytes(data[: len(data) // 2])
    elif how == "delete":
        payload.unlink()
    elif how == "edit_meta_arch":
        m = json.loads(meta.read_text())
        m["arch"] = "sm_80"
        meta.write_text(json.dumps(m))
    elif how == "edit_payload_and_its_hash":
        import hashlib

        new = data.replace(b"src", b"evil")
        payload.write_bytes(new)
        m = json.loads(meta.read_text())
        m["sha256"], m["size"] = hashlib.sha256(new).hexdigest(), len(new)
        meta.write_text(json.dumps(m))
    elif how == "garbage_meta":
        meta.write_text("{not json")
    elif how == "empty_meta":
        meta.write_text("")
    else:
        raise AssertionError(how)


@pytest.mark.parametrize("how", ["flip", "truncate", "delete", "edit_meta_arch",
                                 "edit_payload_and_its_hash", "garbage_meta", "empty_meta"])
def test_damaged_entry_is_deleted_and_rebuilt(tmp_path: Path, how: str) -> None:
    cache, t = BuildCache(tmp_path), FakeTarget()
    good = build(cache, t)
    key = cache_key("src", {"N": 4}, "sm_90a", t.version(), "k")
    _damage_payload(cache, key, how)
    assert cache.get(key) is None
    assert cache.discarded == 1
    assert not any(p.exists() for p in cache.paths(key))  # deleted, never loaded
    rebuilt = build(cache, t)
    assert rebuilt == good and t.compiles == 2
    assert cache.get(key) == good


def test_payload_without_meta_is_a_miss(tmp_path: Path) -> None:
    cache, t = BuildCache(tmp_path), FakeTarget()
    build(cache, t)
    key = cache_key("src", {"N": 4}, "sm_90a", t.version(), "k")
    cache.paths(key)[1].unlink()  # as if a writer died between payload and meta
    assert cache.get(key) is None and cache.discarded == 0
    build(cache, t)
    assert t.compiles == 2 and cache.get(key) is not None


def test_failed_compile_leaves_no_entry(tmp_path: Path) -> None:
    cache, t = BuildCache(tmp_path), FakeTarget()
    with pytest.raises(CompileError, match="fake compiler rejects k"):
        build(cache, t, source="a syntax error")
    assert entry_files(cache) == []
    with pytest.raises(CompileError):
        build(cache, t, source="a syntax error")
    assert t.compiles == 2  # tried again, nothing was cached


def test_bad_keys_refused(tmp_path: Path) -> None:
    cache = BuildCache(tmp_path)
    for bad in ["", "../../etc/passwd", "A" * 64, "0" * 63]:
        with pytest.raises(CacheError, match="not a cache key"):
            cache.get(bad)


def test_unwritable_root_is_cache_error(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("x")
    cache = BuildCache(blocker)  # a file where the folder should be
    with pytest.raises(CacheError, match="could not write"):
        build(cache, FakeTarget())


def test_default_root_from_environment(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("METRALE_CACHE", str(tmp_path / "c"))
    assert default_cache_root() == tmp_path / "c"
    assert BuildCache().root == tmp_path / "c"
    monkeypatch.delenv("METRALE_CACHE")
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    assert default_cache_root() == Path.home() / ".cache" / "metrale"


def test_host_target_through_the_cache(tmp_path: Path) -> None:
    cache = BuildCache(tmp_path)
    b = cache.build(HostTarget(), "numpy", "host", {}, "add", "add")
    assert HostTarget.load(b) is __import__("numpy").add
    assert cache.build(HostTarget(), "numpy", "host", {}, "add", "add") == b
    assert cache.hits == 1


WRITER = textwrap.dedent("""
    import sys
    from metrale.realize.cache import BuildCache
    from metrale.realize.compute import Binary
    root, key, which, n = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
    payload = (which * 50_000).encode()
    b = Binary(payload, "sm_90a", ("k",), "ptx", "fake 1.0")
    cache = BuildCache(root)
    for _ in range(n):
        cache.put(key, b)
""")


def _run_writers(tmp_path: Path, contents: list[str], n: int = 150) -> tuple[set, int]:
    key = "ab" * 32
    procs = [subprocess.Popen([sys.executable, "-c", WRITER, str(tmp_path), key, c, str(n)],
                              stderr=subprocess.PIPE) for c in contents]
    reader = BuildCache(tmp_path)
    seen, reads = set(), 0
    while any(p.poll() is None for p in procs):
        got = reader.get(key)
        reads += 1
        if got is not None:
            # whatever a reader gets is one writer's whole, self-consistent binary
            assert got.data in {(c * 50_000).encode() for c in contents}
            seen.add(got.data[:1])
        time.sleep(0.001)
    for p in procs:
        _, err = p.communicate()
        assert p.returncode == 0, err.decode()
    return seen, reads


def test_two_processes_writing_one_key(tmp_path: Path) -> None:
    seen, reads = _run_writers(tmp_path, ["x", "x"])
    assert reads > 0
    final = BuildCache(tmp_path).get("ab" * 32)
    assert final is not None and final.data == b"x" * 50_000
    leftovers = [p.name for p in tmp_path.rglob("*") if p.is_file() and p.suffix == ".tmp"]
    assert leftovers == []


def test_two_processes_writing_different_bytes_never_tear(tmp_path: Path) -> None:
    # A nondeterministic compiler: the key is the same, the bytes differ. A reader may miss
    # (a mismatch is discarded) but never loads a mixture.
    _run_writers(tmp_path, ["x", "y"])
    final = BuildCache(tmp_path).get("ab" * 32)
    assert final is None or final.data in (b"x" * 50_000, b"y" * 50_000)
    assert not [p for p in tmp_path.rglob("*.tmp")]


def test_reads_do_not_write(tmp_path: Path) -> None:
    cache, t = BuildCache(tmp_path), FakeTarget()
    build(cache, t)
    stamps = {p: p.stat().st_mtime_ns for p in entry_files(cache)}
    build(cache, t)
    assert {p: p.stat().st_mtime_ns for p in entry_files(cache)} == stamps
