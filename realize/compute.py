"""Compute targets: one compiler per vendor, turning a kernel source into a ``Binary``.

``target_for(vendor)`` gives the target: NVIDIA compiles with ``nvcc`` when it is on PATH,
else with NVRTC from the PyPI wheels; the host's "binaries" are references to NumPy
callables; other vendors have no compiler yet and say so. A compile failure raises
``CompileError`` carrying the command line, the compiler log and the numbered source.

>>> t = target_for("cpu")
>>> t.available().ok
True
>>> b = t.compile("metrale.realize.compute", "host", {}, name="demo", entry="ptx_entries")
>>> b.data, b.entries, b.format
(b'metrale.realize.compute:ptx_entries', ('ptx_entries',), 'host')
>>> target_for("rocm").available()
Availability(ok=False, reason='no compiler for vendor amd: Metrale has no amd compute target (looked for hipcc from ROCm); install ROCm and register a ComputeTarget for amd')
"""  # noqa: E501

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import hashlib
import importlib
import importlib.metadata
import importlib.util
import re
import shlex
import shutil
import struct
import subprocess
import sys
from collections.abc import Callable, Mapping
from pathlib import Path, PurePosixPath
from typing import Any, Protocol, runtime_checkable

import attrs

from metrale.lkb.errors import CompileError, nearest
from metrale.lkb.vendor import Vendor

FORMATS = ("ptx", "cubin", "host")
NVCC_FLAGS = ("-std=c++17", "-O3")
"""Flags every nvcc compile gets besides -arch and the defines (part of the compiler identity)."""
_STDINT = ("#pragma once\n"
           "typedef signed char int8_t;\ntypedef short int16_t;\ntypedef int int32_t;\n"
           "typedef long long int64_t;\ntypedef unsigned char uint8_t;\n"
           "typedef unsigned short uint16_t;\ntypedef unsigned int uint32_t;\n"
           "typedef unsigned long long uint64_t;\ntypedef long long intptr_t;\n"
           "typedef unsigned long long uintptr_t;\n")
_HOST = ("#pragma once\n"
         "#define INFINITY __int_as_float(0x7f800000)\n"
         "__host__ __device__ constexpr int metrale_nvrtc_ctz(unsigned x, int n = 0) {\n"
         "    return (x & 1u) || n == 31 ? n : metrale_nvrtc_ctz(x >> 1, n + 1);\n}\n"
         "#define __builtin_ctz(x) metrale_nvrtc_ctz(x)\n")
NVRTC_SYSTEM_HEADERS = {"stdint.h": _STDINT, "cstdint": _STDINT, "metrale_nvrtc_host.h": _HOST}
"""What nvcc's host side gives the kernels and NVRTC, which reads no system header, does not,
as headers in memory: the fixed-width integers of the device's LP64 model; and, included before
every source (``NVRTC_FLAGS``), math.h's INFINITY and GCC's count of trailing zeros (a
constexpr, as the templates use it). A project header of the same name would take precedence."""
NVRTC_FLAGS = ("-std=c++17", "--pre-include=metrale_nvrtc_host.h")
"""Flags every NVRTC compile gets besides the arch and the defines (NVRTC optimizes by default)."""
COMPILE_TIMEOUT_S = 600


@attrs.frozen
class Availability:
    """Whether a target can compile here, and why (or why not).

    >>> bool(Availability(False, "no nvcc"))
    False
    """

    ok: bool
    reason: str

    def __bool__(self) -> bool:
        return self.ok


@attrs.frozen
class Binary:
    """A compiled kernel module: its bytes, the arch, the entry symbols it exports, its format
    (``ptx``, ``cubin`` or ``host``) and the identity of the compiler that made it.

    >>> b = Binary(b".entry k(", "sm_80", ["k"], "ptx", "nvcc 13.0.88")
    >>> b
    Binary(ptx for sm_80, 9 bytes, entries=('k',), compiler='nvcc 13.0.88')
    >>> b.sha256[:12]
    'c028ac75a0fd'
    """

    data: bytes = attrs.field(converter=bytes)
    arch: str
    entries: tuple[str, ...] = attrs.field(converter=tuple)
    format: str = attrs.field(validator=attrs.validators.in_(FORMATS))
    compiler: str

    @property
    def sha256(self) -> str:
        """Hex SHA-256 of ``data``."""
        return hashlib.sha256(self.data).hexdigest()

    @property
    def is_text(self) -> bool:
        """Whether ``data`` is text (PTX, a host reference) rather than an object file."""
        return self.format != "cubin"

    def __repr__(self) -> str:
        return (f"Binary({self.format} for {self.arch}, {len(self.data)} bytes, "
                f"entries={self.entries!r}, compiler={self.compiler!r})")


@runtime_checkable
class ComputeTarget(Protocol):
    """A vendor's compiler: what it reads and writes, whether it is here, and ``compile``.

    ``version()`` identifies the compiler and its fixed flags, so that a build cache keyed on
    it never serves a binary from another compiler. ``headers`` maps include names to their
    text, so a source's includes take part in its identity too.
    """

    vendor: Vendor
    source_extension: str
    output_extension: str
    output_is_text: bool

    def available(self) -> Availability: ...

    def version(self) -> str: ...

    def compile(self, source: str, arch: str, defines: Mapping[str, str | int], *, name: str,
                entry: str | None = None,
                headers: Mapping[str, str] | None = None) -> Binary: ...


# ---------------------------------------------------------------------------------------------
# Entry symbols

_PTX_ENTRY = re.compile(r"^\s*(?:\.(?:visible|weak|extern)\s+)*\.entry\s+([A-Za-z_$%][\w$%]*)",
                        re.MULTILINE)


def ptx_entries(ptx: str) -> tuple[str, ...]:
    """The kernel entry symbols a PTX module declares, in order.

    >>> ptx_entries('.visible .entry add_one(\\n.param .u64 p)\\n{\\n}\\n.entry _Z1kv()')
    ('add_one', '_Z1kv')
    """
    return tuple(dict.fromkeys(_PTX_ENTRY.findall(ptx)))


def _elf_sections(cubin: bytes) -> list[tuple[int, ...]]:
    """The section headers of an ELF64 little-endian file (``CompileError`` if it is not one)."""
    if len(cubin) < 64 or cubin[:4] != b"\x7fELF" or cubin[4] != 2 or cubin[5] != 1:
        raise CompileError("not a cubin", expected="an ELF64 little-endian file",
                           found=f"{bytes(cubin[:4])!r}...")
    try:
        shoff, = struct.unpack_from("<Q", cubin, 0x28)
        shentsize, shnum = struct.unpack_from("<HH", cubin, 0x3A)
        return [struct.unpack_from("<IIQQQQIIQQ", cubin, shoff + i * shentsize)
                for i in range(shnum)]
    except struct.error as e:
        raise CompileError("cubin section table unreadable", found=str(e)) from None


def cubin_code_bytes(cubin: bytes) -> dict[str, int]:
    """Bytes of machine code per function of a cubin (its ``.text.NAME`` sections).

    A decode step runs each layer's kernels in turn, so every kernel fetches its code again in
    every layer: code size is a cost the step pays and a kernel timed alone does not
    (``docs/gpu-notes.md``, version 7).

    >>> cubin_code_bytes(b"MZ")
    Traceback (most recent call last):
    ...
    metrale.lkb.errors.CompileError: not a cubin (expected an ELF64 little-endian file, found b'MZ'...)
    """  # noqa: E501
    sections = _elf_sections(cubin)
    try:
        _, _, _, _, names_at, *_ = sections[struct.unpack_from("<H", cubin, 0x3E)[0]]
        out = {}
        for sec in sections:
            name = cubin[names_at + sec[0]:cubin.index(b"\0", names_at + sec[0])].decode()
            if sec[1] == 1 and name.startswith(".text."):  # SHT_PROGBITS
                out[name[len(".text."):]] = sec[5]
    except (struct.error, IndexError, ValueError, UnicodeDecodeError) as e:
        raise CompileError("cubin section names unreadable", found=str(e)) from None
    return out


def cubin_entries(cubin: bytes) -> tuple[str, ...]:
    """The kernel entry symbols of a cubin (ELF64): global functions marked as CUDA entries.

    Read by hand from the ELF symbol table (about thirty lines; no ELF reader is a dependency).

    >>> cubin_entries(b"not an ELF")
    Traceback (most recent call last):
    ...
    metrale.lkb.errors.CompileError: not a cubin (expected an ELF64 little-endian file, found b'not '...)
    """  # noqa: E501
    sections = _elf_sections(cubin)
    try:
        names = []
        for sec in sections:
            if sec[1] != 2:  # SHT_SYMTAB
                continue
            strtab = sections[sec[6]]
            for off in range(sec[4], sec[4] + sec[5], 24):
                st_name, st_info, st_other = struct.unpack_from("<IBB", cubin, off)
                # STT_FUNC, STB_GLOBAL, and NVIDIA's STO_CUDA_ENTRY flag in st_other.
                if st_info & 0xF == 2 and st_info >> 4 == 1 and st_other & 0x10:
                    start = strtab[4] + st_name
                    names.append(cubin[start:cubin.index(b"\0", start)].decode())
    except (struct.error, IndexError, ValueError, UnicodeDecodeError) as e:
        raise CompileError("cubin symbol table unreadable", found=str(e)) from None
    return tuple(dict.fromkeys(names))


# ---------------------------------------------------------------------------------------------
# Compile errors


def numbered(source: str, lines: frozenset[int] = frozenset(), context: int = 4,
             whole_below: int = 200) -> str:
    """``source`` with line numbers; long sources show only ``context`` lines around ``lines``.

    >>> print(numbered("int a;\\nint b\\nint c;"))
       1 | int a;
       2 | int b
       3 | int c;
    """
    src = source.splitlines()
    keep = range(1, len(src) + 1)
    if len(src) > whole_below and lines:
        keep = sorted({n for k in lines for n in range(k - context, k + context + 1)
                       if 1 <= n <= len(src)})
    out, last = [], 0
    for n in keep:
        if n != last + 1:
            out.append("     ...")
        out.append(f"{n:4d} | {src[n - 1]}")
        last = n
    if last != len(src) and keep:
        out.append("     ...")
    return "\n".join(out)


def compile_error(what: str, *, file: str, entry: str | None, command: str, log: str,
                  source: str) -> CompileError:
    """A ``CompileError`` with the command, the log and the numbered source in its message;
    the three are also kept as attributes ``command``, ``log`` and ``source``."""
    refs = frozenset(int(m) for m in re.findall(rf"{re.escape(file)}\((\d+)\)", log))
    hint = ""
    if re.search(r'could not open source file "cuda_\w+\.h', log):
        hint = ("\n  hint: NVRTC needs the CUDA headers; install the wheel matching NVRTC "
                "(`pip install nvidia-cuda-runtime-cu12`, or `nvidia-cuda-runtime` for CUDA 13)")
    text = (f"{what}\n  command: {command}\n  log:\n"
            + "\n".join("    " + s for s in (log.strip() or "(empty)").splitlines())
            + hint + "\n  source:\n" + numbered(source, refs))
    err = CompileError(text, file=file, key=entry)
    err.command, err.log, err.source = command, log, source
    return err


def _check_defines(defines: Mapping[str, str | int], file: str) -> list[str]:
    out = []
    for k, v in sorted(defines.items()):
        if not (isinstance(k, str) and re.fullmatch(r"[A-Za-z_]\w*", k)):
            raise CompileError("define name is not an identifier", file=file, key=str(k),
                               expected="[A-Za-z_][A-Za-z0-9_]*", found=repr(k))
        if isinstance(v, bool) or not isinstance(v, str | int):
            raise CompileError("define value must be a string or an integer", file=file, key=k,
                               expected="str or int", found=f"{type(v).__name__} {v!r}")
        out.append(f"-D{k}={v}")
    return out


def _check_header_names(headers: Mapping[str, str], file: str) -> None:
    for h in headers:
        p = PurePosixPath(h)
        if p.is_absolute() or ".." in p.parts or not p.parts:
            raise CompileError("header name must be a relative path inside the source tree",
                               file=file, key=h, expected="e.g. 'common/tile.cuh'", found=h)


def _check_entry(binary: Binary, entry: str | None, file: str) -> Binary:
    if entry is not None and entry not in binary.entries:
        raise CompileError(
            f"entry {entry!r} is not exported (declare the kernel extern \"C\" so its symbol is "
            "not mangled)", file=file, key=entry,
            expected="one of " + (", ".join(binary.entries) or "(no entries)"), found=entry,
            suggestion=nearest(entry, binary.entries))
    return binary


# ---------------------------------------------------------------------------------------------
# NVIDIA: nvcc, else NVRTC


@attrs.frozen
class _Nvrtc:
    library: Path
    origin: str
    include_dirs: tuple[Path, ...]


def _package_dir(module: str) -> Path | None:
    try:
        spec = importlib.util.find_spec(module)
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(next(iter(spec.submodule_search_locations)))


def _dist_version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def _lib_in(folder: Path) -> Path | None:
    for sub in ("lib", "bin"):
        for pattern in ("libnvrtc.so*", "nvrtc64_*.dll", "libnvrtc*.dylib"):
            for p in sorted((folder / sub).glob(pattern)):
                if "builtins" not in p.name and ".alt." not in p.name:
                    return p
    return None


def find_nvrtc() -> _Nvrtc | None:
    """Where NVRTC is: the ``nvidia-cuda-nvrtc`` wheel (CUDA 13, then the ``-cu12`` one), then
    ``cuda-python``'s path finder, then the system's library path; ``None`` when nowhere.

    The CUDA headers NVRTC compiles against come from the same distribution as the library.
    """
    for module, dist, include_module in (("nvidia.cu13", "nvidia-cuda-nvrtc", "nvidia.cu13"),
                                         ("nvidia.cuda_nvrtc", "nvidia-cuda-nvrtc-cu12",
                                          "nvidia.cuda_runtime")):
        folder = _package_dir(module)
        lib = _lib_in(folder) if folder else None
        if lib is not None:
            inc = _package_dir(include_module)
            includes = (inc / "include",) if inc and (inc / "include" / "cuda_bf16.h").is_file() \
                else ()
            return _Nvrtc(lib, f"{dist} {_dist_version(dist)} wheel", includes)
    try:
        from cuda.pathfinder import load_nvidia_dynamic_lib  # type: ignore[import-not-found]

        path = Path(load_nvidia_dynamic_lib("nvrtc").abs_path)
        return _Nvrtc(path, "cuda-python", _toolkit_includes(path))
    except Exception:  # noqa: BLE001 - any failure of an optional finder means "not found here"
        pass
    name = ctypes.util.find_library("nvrtc")
    if name:
        path = Path(name)
        return _Nvrtc(path, "system library", _toolkit_includes(path))
    return None


def _toolkit_includes(lib: Path) -> tuple[Path, ...]:
    real = Path(lib).resolve() if Path(lib).is_absolute() else Path(lib)
    for inc in (real.parent.parent / "include", real.parent.parent.parent / "include"):
        if (inc / "cuda_bf16.h").is_file():
            return (inc,)
    return ()


@functools.lru_cache(maxsize=8)
def _nvcc_identity(nvcc: str) -> str:
    try:
        out = subprocess.run([nvcc, "--version"], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise CompileError(f"could not run {nvcc} --version", found=str(e)) from None
    m = re.search(r"V(\d+\.\d+\.\d+)", out.stdout)
    if out.returncode != 0 or m is None:
        raise CompileError(f"{nvcc} --version did not print a version", found=out.stdout[-200:])
    return f"nvcc {m.group(1)}"


@functools.lru_cache(maxsize=8)
def _load_nvrtc(path: str) -> tuple[Any, str]:
    lib = ctypes.CDLL(path)
    major, minor = ctypes.c_int(), ctypes.c_int()
    lib.nvrtcVersion(ctypes.byref(major), ctypes.byref(minor))
    lib.nvrtcGetErrorString.restype = ctypes.c_char_p
    return lib, f"{major.value}.{minor.value}"


class NvidiaTarget:
    """NVIDIA's compiler: ``nvcc`` when on PATH, else NVRTC from a PyPI wheel.

    ``output`` is ``"ptx"`` (text, JIT-compiled by the driver, forward-compatible) or
    ``"cubin"`` (machine code for one arch). ``compiler`` forces ``"nvcc"`` or ``"nvrtc"``.

    >>> t = NvidiaTarget("cubin")
    >>> t.source_extension, t.output_extension, t.output_is_text
    ('.cu', '.cubin', False)
    """

    vendor = Vendor.NVIDIA
    source_extension = ".cu"

    def __init__(self, output: str = "ptx", *, compiler: str = "auto", nvcc: str | None = None,
                 timeout_s: float = COMPILE_TIMEOUT_S) -> None:
        if output not in ("ptx", "cubin"):
            raise CompileError("unknown NVIDIA output", key="output",
                               expected="ptx or cubin", found=repr(output))
        if compiler not in ("auto", "nvcc", "nvrtc"):
            raise CompileError("unknown NVIDIA compiler", key="compiler",
                               expected="auto, nvcc or nvrtc", found=repr(compiler))
        self.output = output
        self.compiler = compiler
        self._nvcc = nvcc
        self.timeout_s = timeout_s

    @property
    def output_extension(self) -> str:
        return "." + self.output

    @property
    def output_is_text(self) -> bool:
        return self.output == "ptx"

    def __repr__(self) -> str:
        return f"NvidiaTarget({self.output!r}, compiler={self.compiler!r})"

    @functools.cached_property
    def _backend(self) -> tuple[str, Any]:
        nvcc = self._nvcc or shutil.which("nvcc")
        if self.compiler in ("auto", "nvcc") and nvcc:
            return "nvcc", nvcc
        if self.compiler == "nvcc":
            return "none", "no nvcc on PATH; install the CUDA toolkit"
        found = find_nvrtc()
        if found is not None:
            return "nvrtc", found
        return "none", ("no nvcc on PATH and no NVRTC wheel; install the CUDA toolkit or "
                        "`pip install nvidia-cuda-nvrtc-cu12`")

    def available(self) -> Availability:
        """Which compiler will be used, or why none can be."""
        kind, what = self._backend
        if kind == "nvcc":
            return Availability(True, f"nvcc at {what}")
        if kind == "nvrtc":
            return Availability(True, f"NVRTC {what.library} (from {what.origin})")
        return Availability(False, what)

    def version(self) -> str:
        """Compiler identity for cache keys: compiler and version, output format, fixed flags."""
        kind, what = self._backend
        if kind == "nvcc":
            return f"{_nvcc_identity(what)} {self.output} {' '.join(NVCC_FLAGS)}"
        if kind == "nvrtc":
            _, ver = self._nvrtc_lib(what)
            real = Path(what.library).resolve().name if Path(what.library).is_absolute() \
                else what.library
            shim = hashlib.sha256(repr(sorted(NVRTC_SYSTEM_HEADERS.items())).encode())
            return (f"nvrtc {ver} ({real}, {what.origin}) {self.output} {' '.join(NVRTC_FLAGS)}"
                    f" shim {shim.hexdigest()[:12]}")
        raise CompileError(f"no NVIDIA compiler: {what}")

    def _nvrtc_lib(self, found: _Nvrtc) -> tuple[Any, str]:
        try:
            return _load_nvrtc(str(found.library))
        except OSError as e:
            raise CompileError(f"could not load NVRTC from {found.library} ({found.origin})",
                               found=str(e)) from None

    def compile(self, source: str, arch: str, defines: Mapping[str, str | int], *, name: str,
                entry: str | None = None,
                headers: Mapping[str, str] | None = None) -> Binary:
        """Compile ``source`` for ``arch`` (``sm_90a`` …); ``entry``, when given, must be exported.

        A failure raises ``CompileError`` with the command line, the log and the numbered source.
        """
        file = _safe_name(name) + self.source_extension
        headers = dict(headers or {})
        _check_header_names(headers, file)
        flags = _check_defines(defines, file)
        if not re.fullmatch(r"sm_\d+[af]?", arch):
            raise CompileError("not an NVIDIA arch", file=file, key="arch",
                               expected="sm_<major><minor>[a|f], e.g. sm_90a", found=repr(arch))
        kind, what = self._backend
        if kind == "nvcc":
            binary = self._nvcc_compile(what, source, arch, flags, file, entry, headers)
        elif kind == "nvrtc":
            binary = self._nvrtc_compile(what, source, arch, flags, file, entry, headers)
        else:
            raise CompileError(f"cannot compile for NVIDIA: {what}", file=file, key=entry)
        return _check_entry(binary, entry, file)

    def _nvcc_compile(self, nvcc: str, source: str, arch: str, flags: list[str], file: str,
                      entry: str | None, headers: dict[str, str]) -> Binary:
        from metrale.realize import jobs

        with jobs.scratch("nvcc-") as tmp:
            root = Path(tmp)
            for h, text in headers.items():
                (root / h).parent.mkdir(parents=True, exist_ok=True)
                (root / h).write_text(text)
            (root / file).write_text(source)
            out = root / ("out" + self.output_extension)
            cmd = [nvcc, f"-{self.output}", f"-arch={arch}", *NVCC_FLAGS, *flags, "-I", tmp,
                   "-o", str(out), str(root / file)]
            shown = shlex.join(cmd).replace(tmp + "/", "").replace(tmp, ".")
            try:
                proc = jobs.run(cmd, cwd=tmp, timeout=self.timeout_s)
            except subprocess.TimeoutExpired:
                raise compile_error(f"nvcc timed out after {self.timeout_s} s compiling {file} "
                                    f"for {arch}", file=file, entry=entry, command=shown, log="",
                                    source=source) from None
            except OSError as e:
                raise CompileError(f"could not run nvcc: {e}", file=file, key=entry) from None
            log = (proc.stdout + proc.stderr).replace(str(root / file), file)
            if proc.returncode != 0 or not out.is_file():
                raise compile_error(f"nvcc failed compiling {file} for {arch} "
                                    f"(exit status {proc.returncode})", file=file, entry=entry,
                                    command=shown, log=log, source=source)
            data = out.read_bytes()
        return self._binary(data, arch)

    def _nvrtc_compile(self, found: _Nvrtc, source: str, arch: str, flags: list[str], file: str,
                       entry: str | None, headers: dict[str, str]) -> Binary:
        lib, _ = self._nvrtc_lib(found)
        headers = {**NVRTC_SYSTEM_HEADERS, **headers}
        target = arch if self.output == "cubin" else "compute_" + arch[len("sm_"):]
        opts = [f"--gpu-architecture={target}", *NVRTC_FLAGS, *flags,
                *(f"-I{d}" for d in found.include_dirs)]
        shown = "nvrtc " + shlex.join([*opts, file])
        names = list(headers)
        c_headers = (ctypes.c_char_p * len(names))(*(headers[h].encode() for h in names))
        c_names = (ctypes.c_char_p * len(names))(*(h.encode() for h in names))
        prog = ctypes.c_void_p()

        def check(rc: int, what: str, log: str = "") -> None:
            if rc != 0:
                msg = lib.nvrtcGetErrorString(rc).decode()
                raise compile_error(f"NVRTC{what} failed compiling {file} for {arch} ({msg})",
                                    file=file, entry=entry, command=shown, log=log,
                                    source=source)

        check(lib.nvrtcCreateProgram(ctypes.byref(prog), source.encode(), file.encode(),
                                     len(names), c_headers, c_names), " nvrtcCreateProgram")
        try:
            c_opts = (ctypes.c_char_p * len(opts))(*(o.encode() for o in opts))
            rc = lib.nvrtcCompileProgram(prog, len(opts), c_opts)
            size = ctypes.c_size_t()
            lib.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
            buf = ctypes.create_string_buffer(size.value)
            lib.nvrtcGetProgramLog(prog, buf)
            check(rc, "", buf.value.decode(errors="replace"))
            get_size, get = ((lib.nvrtcGetCUBINSize, lib.nvrtcGetCUBIN) if self.output == "cubin"
                             else (lib.nvrtcGetPTXSize, lib.nvrtcGetPTX))
            check(get_size(prog, ctypes.byref(size)), " output size")
            out = ctypes.create_string_buffer(size.value)
            check(get(prog, out), " output")
            data = out.raw[:size.value]
        finally:
            lib.nvrtcDestroyProgram(ctypes.byref(prog))
        if self.output == "ptx":
            data = data.rstrip(b"\0")
        return self._binary(data, arch)

    def _binary(self, data: bytes, arch: str) -> Binary:
        entries = (ptx_entries(data.decode(errors="replace")) if self.output == "ptx"
                   else cubin_entries(data))
        return Binary(data, arch, entries, self.output, self.version())


def _safe_name(name: str) -> str:
    return re.sub(r"[^\w.-]", "_", name) or "kernel"


# ---------------------------------------------------------------------------------------------
# Host: references to NumPy callables


class HostTarget:
    """The host "compiler": a source is a Python reference ``module`` or ``module:attr``, and
    its binary is the UTF-8 ``module:attr`` once the attribute is found to exist.

    >>> import numpy as np
    >>> b = HostTarget().compile("numpy:add", "host", {}, name="add")
    >>> b.data, HostTarget.load(b) is np.add
    (b'numpy:add', True)
    """

    vendor = Vendor.HOST
    source_extension = ".py"
    output_extension = ".ref"
    output_is_text = True

    def __repr__(self) -> str:
        return "HostTarget()"

    def available(self) -> Availability:
        return Availability(True, "host: NumPy reference callables run everywhere")

    def version(self) -> str:
        import numpy

        py = ".".join(map(str, sys.version_info[:3]))
        return f"host python {py} numpy {numpy.__version__}"

    def compile(self, source: str, arch: str, defines: Mapping[str, str | int], *, name: str,
                entry: str | None = None,
                headers: Mapping[str, str] | None = None) -> Binary:
        """Check that the referenced callable exists; the binary is its ``module:attr``."""
        file = _safe_name(name) + self.source_extension
        module, _, attr = source.strip().partition(":")
        if entry is not None and attr and attr != entry:
            raise CompileError("host reference names another attribute than the entry",
                               file=file, key=entry, expected=entry, found=attr)
        attr = attr or entry
        if not re.fullmatch(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)*", module) or not attr:
            raise CompileError("host source must be a reference 'module' or 'module:attr' with "
                               "an entry", file=file, key=entry,
                               expected="e.g. 'metrale.lkb.reference:rmsnorm'",
                               found=repr(source.strip()[:80]))
        obj = _resolve(module, attr, file)
        if not callable(obj):
            raise CompileError("host entry is not callable", file=file, key=attr,
                               found=type(obj).__name__)
        return Binary(f"{module}:{attr}".encode(), arch or "host", (attr,), "host",
                      self.version())

    @staticmethod
    def load(binary: Binary) -> Callable[..., Any]:
        """The callable a host binary refers to."""
        module, _, attr = binary.data.decode().partition(":")
        return _resolve(module, attr, module)


def _resolve(module: str, attr: str, file: str) -> Any:
    try:
        mod = importlib.import_module(module)
    except ImportError as e:
        raise CompileError(f"host module {module!r} cannot be imported", file=file, key=attr,
                           found=str(e)) from None
    try:
        return getattr(mod, attr)
    except AttributeError:
        names = [n for n in dir(mod) if not n.startswith("_")]
        raise CompileError(f"host module {module!r} has no attribute {attr!r}", file=file,
                           key=attr, suggestion=nearest(attr, names)) from None


# ---------------------------------------------------------------------------------------------
# Vendors without a compiler


_MISSING = {
    Vendor.AMD: (".hip", ".hsaco", False, "hipcc from ROCm", "ROCm"),
    Vendor.APPLE: (".metal", ".metallib", False, "xcrun metal", "the Xcode command line tools"),
    Vendor.INTEL: (".cpp", ".spv", False, "icpx from oneAPI", "the Intel oneAPI Base Toolkit"),
}


class UnsupportedTarget:
    """A vendor Metrale has no compiler for: never available; ``compile`` says what to do.

    >>> UnsupportedTarget(Vendor.APPLE).compile("", "m3", {}, name="k")
    Traceback (most recent call last):
    ...
    metrale.lkb.errors.CompileError: k.metal: no compiler for vendor apple: Metrale has no apple compute target (looked for xcrun metal); install the Xcode command line tools and register a ComputeTarget for apple
    """  # noqa: E501

    def __init__(self, vendor: Vendor) -> None:
        self.vendor = vendor
        ext, out, text, self._looked, self._install = _MISSING[vendor]
        self.source_extension, self.output_extension, self.output_is_text = ext, out, text

    def __repr__(self) -> str:
        return f"UnsupportedTarget({self.vendor})"

    @property
    def _reason(self) -> str:
        v = self.vendor
        return (f"no compiler for vendor {v}: Metrale has no {v} compute target (looked for "
                f"{self._looked}); install {self._install} and register a ComputeTarget for {v}")

    def available(self) -> Availability:
        return Availability(False, self._reason)

    def version(self) -> str:
        raise CompileError(self._reason)

    def compile(self, source: str, arch: str, defines: Mapping[str, str | int], *, name: str,
                entry: str | None = None,
                headers: Mapping[str, str] | None = None) -> Binary:
        raise CompileError(self._reason, file=_safe_name(name) + self.source_extension,
                           key=entry)


def target_for(vendor: Vendor | str, **options: Any) -> ComputeTarget:
    """The compute target of ``vendor`` (any spelling); ``options`` go to ``NvidiaTarget``.

    >>> target_for("cuda", output="cubin")
    NvidiaTarget('cubin', compiler='auto')
    """
    v = Vendor.parse(vendor)
    if v is Vendor.NVIDIA:
        return NvidiaTarget(**options)
    if v is Vendor.HOST:
        return HostTarget()
    return UnsupportedTarget(v)
