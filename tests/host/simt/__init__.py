"""CUDA kernels of the common layer run on the host: their own source, an emulated machine.

``simt.hpp`` emulates the CUDA execution model (a fiber per CUDA thread, switched at barriers;
block barriers, warp collectives, shared memory, atomics; blocks one after another or, resident,
all at once) and the PTX the kernels write inline. This module prepares a kernel source for it
and runs its entries:

- the source and the headers it includes are rewritten in four ways, none specific to one
  kernel: a ``__shared__`` variable becomes a reference to the running block's own copy
  (``simt::block_shared``, found by a tag unique to the declaration), an ``extern __shared__``
  array becomes the block's dynamic shared memory (a pointer, or a macro at file scope), every
  ``asm`` statement becomes a call of ``simt::asm_stmt`` with its template, its output
  operands by reference and its inputs by value (the emulator dispatches on the template and
  refuses one it does not know), and ``__CUDA_ARCH__`` becomes ``METRALE_SIMT_ARCH``, which
  simt.hpp defines as 900: the kernels' own code for sm_90 runs (their dependent-launch waits
  among it), while the CUDA headers keep their host paths;
- a trampoline per entry, written from the KERNELS.toml argument types, unpacks the argument
  array as the driver would;
- the result is built with the host compiler against the CUDA headers nvcc uses, once per
  source and define set (cached by content).

>>> transform('__shared__ float buf[4][N], total;')  # doctest: +NORMALIZE_WHITESPACE
'auto& buf = simt::block_shared<float[4][N]>([] { static char tag; return &tag; }());
 auto& total = simt::block_shared<float>([] { static char tag; return &tag; }());'
>>> transform('    extern __shared__ __align__(16) char smem_base[];')
'    char* smem_base = (char*)simt::dynamic_smem();'
>>> transform('extern __shared__ float part[];')
'#define part ((float*)simt::dynamic_smem())'
>>> transform('asm volatile("prefetch.global.L2 [%0];" ::"l"(at));')
'simt::asm_stmt("prefetch.global.L2 [%0];", {}, {simt::in(at)});'
>>> transform('#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900')
'#if defined(METRALE_SIMT_ARCH) && METRALE_SIMT_ARCH >= 900'
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import hashlib
import re
import shutil
import subprocess
import threading
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from metrale.lkb.files import exclusive

HERE = Path(__file__).resolve().parent
KERNELS = Path(__file__).resolve().parents[3] / "kernels"
CXX = shutil.which("g++")
NVCC = shutil.which("nvcc")
ARG_C = {"ptr": "simt::AnyPtr", "i32": "int", "i64": "long long", "f32": "float",
         "scratch": "simt::AnyPtr", "tmap": "TensorMap"}

_EXTERN_SHARED = re.compile(
    r"extern\s+__shared__\s+(?:__align__\(\d+\)\s+)?([A-Za-z_][\w ]*?)\s+(\w+)\s*\[\s*\]\s*;")
_SHARED = re.compile(r"\b__shared__\s+(?:__align__\(\d+\)\s+)?([^;\n]*);")
_DECLARATOR = re.compile(r"\s*(\w+)\s*((?:\[[^\]]*\]\s*)*)")
_CUDA_ARCH = re.compile(r"\b__CUDA_ARCH__\b")


def available() -> tuple[bool, str]:
    """Whether the host compiler and the CUDA headers are here (and why not)."""
    if CXX is None:
        return False, "no g++"
    if not cuda_includes():
        return False, "no CUDA headers (neither nvcc's nor an NVRTC wheel's)"
    return True, ""


@functools.cache
def cuda_includes() -> list[Path]:
    """Where the CUDA headers are: nvcc's include path (its ``--dryrun`` names it), else the
    NVRTC distribution's; the first that holds cuda_bf16.h."""
    from metrale.realize.compute import find_nvrtc

    found: list[Path] = []
    if NVCC:
        r = subprocess.run([NVCC, "--dryrun", "-c", "-x", "cu", "/dev/null", "-o", "/dev/null"],
                           capture_output=True, text=True, timeout=60)
        lines = " ".join(x for x in (r.stdout + r.stderr).splitlines() if "INCLUDES=" in x)
        found += [Path(m) for m in re.findall(r'-I"?([^"\s]+)', lines)]
    nvrtc = find_nvrtc()
    found += list(nvrtc.include_dirs) if nvrtc else []
    return [d for d in found if (d / "cuda_bf16.h").is_file()][:1]


def _balanced(text: str, start: int) -> int:
    """The index just past the parenthesis that closes the one at ``start``."""
    depth, i, quote = 0, start, None
    while i < len(text):
        c = text[i]
        if quote:
            if c == "\\":
                i += 1
            elif c == quote:
                quote = None
        elif c in "\"'":
            quote = c
        elif c == "(":
            depth += 1
        elif c == ")":
            depth -= 1
            if depth == 0:
                return i + 1
        i += 1
    raise ValueError(f"unbalanced parentheses from {text[start:start + 60]!r}")


def _split_top(text: str, sep: str) -> list[str]:
    """``text`` split at ``sep`` outside strings and parentheses."""
    parts, depth, quote, cur, i = [], 0, None, [], 0
    while i < len(text):
        c = text[i]
        if quote:
            cur.append(c)
            if c == "\\":
                cur.append(text[i + 1])
                i += 1
            elif c == quote:
                quote = None
        elif c in "\"'":
            quote = c
            cur.append(c)
        elif c in "([{":
            depth += 1
            cur.append(c)
        elif c in ")]}":
            depth -= 1
            cur.append(c)
        elif c == sep and depth == 0:
            parts.append("".join(cur))
            cur = []
        else:
            cur.append(c)
        i += 1
    parts.append("".join(cur))
    return parts


def _operands(text: str) -> list[str]:
    """The C++ expressions of ``"constraint"(expr), ...``."""
    out = []
    for op in _split_top(text, ","):
        op = op.strip()
        if not op:
            continue
        m = re.fullmatch(r'"[^"]*"\s*\((.*)\)', op, re.S)
        if not m:
            raise ValueError(f"not an asm operand: {op!r}")
        out.append(m.group(1).strip())
    return out


def _asm(stmt: str) -> str:
    """``asm [volatile] ("...": outs: ins: clobbers)`` as a call of ``simt::asm_stmt``."""
    inner = stmt[stmt.index("(") + 1:-1]
    sections = _split_top(inner, ":")
    template = " ".join(re.findall(r'"(?:[^"\\]|\\.)*"', sections[0]))
    outs = _operands(sections[1]) if len(sections) > 1 else []
    ins = _operands(sections[2]) if len(sections) > 2 else []
    return (f"simt::asm_stmt({template}, {{{', '.join(f'simt::out({o})' for o in outs)}}}, "
            f"{{{', '.join(f'simt::in({i})' for i in ins)}}})")


def _dynamic_shared(m: re.Match) -> str:
    """``extern __shared__ T name[];`` as the running block's dynamic shared memory: a pointer
    taken where a function declares it, a macro where a file does (column 0), since a file-scope
    pointer would be taken once, at load, and blocks each have their own."""
    kind, name = m.group(1), m.group(2)
    if m.start() == 0 or m.string[m.start() - 1] == "\n":
        return f"#define {name} (({kind}*)simt::dynamic_smem())"
    return f"{kind}* {name} = ({kind}*)simt::dynamic_smem();"


def _block_shared(m: re.Match) -> str:
    """``__shared__ T a[N], b;`` as references to the running block's own ``a`` and ``b``."""
    first, *rest = _split_top(m.group(1), ",")
    d = re.fullmatch(r"(.*?)\s*\b(\w+)\s*((?:\[[^\]]*\]\s*)*)", first.strip(), re.S)
    if not d:
        raise ValueError(f"not a __shared__ declaration: {m.group(0)!r}")
    base, decls = d.group(1), [(d.group(2), d.group(3))]
    for r in rest:
        decl = _DECLARATOR.fullmatch(r)
        if not decl:
            raise ValueError(f"not a __shared__ declarator: {r!r} in {m.group(0)!r}")
        decls.append((decl.group(1), decl.group(2)))
    return " ".join(f"auto& {name} = simt::block_shared<{base}{dims.rstrip()}>"
                    "([] { static char tag; return &tag; }());" for name, dims in decls)


def transform(text: str) -> str:
    """A CUDA source made ready for the host emulation (the module docstring says how)."""
    text = _CUDA_ARCH.sub("METRALE_SIMT_ARCH", text)
    text = _EXTERN_SHARED.sub(_dynamic_shared, text)
    text = _SHARED.sub(_block_shared, text)
    out, pos = [], 0
    for m in re.finditer(r"\basm\s*(?:volatile\s*)?\(", text):
        if m.start() < pos:
            continue
        end = _balanced(text, m.end() - 1)
        out.append(text[pos:m.start()])
        out.append(_asm(text[m.start():end]))
        pos = end
    out.append(text[pos:])
    return "".join(out)


def _trampolines(entries: Mapping[str, tuple[str, ...]]) -> str:
    """``simt_call_<entry>(void** args)`` for each entry, from its KERNELS.toml argument types."""
    out = []
    for entry, types in sorted(entries.items()):
        args = ", ".join(f"simt::arg<{ARG_C[t]}>(a, {i})" for i, t in enumerate(types))
        out.append(f'extern "C" void simt_call_{entry}(void** a) {{ {entry}({args}); }}')
    return "\n".join(out)


_GUARD: list[tuple[int, int]] = []  # (address, bytes): what the launches now running guard


@contextlib.contextmanager
def dependent_launch_guard(ranges: Sequence[tuple[int, int]]) -> Iterator[None]:
    """Launches inside the block run with the host bytes ``ranges`` ((address, bytes) pairs)
    guarded as the bytes of a step (simt.hpp, ``Guarded``): poisoned in each block until its
    threads' ``griddepcontrol.wait``, a write before that wait a trap. The ranges must not
    overlap: a block sets each range aside and poisons it in turn, so an overlap would set poison
    aside as the step's bytes."""
    spans = sorted((int(a), int(n)) for a, n in ranges if n > 0)
    for (a, n), (b, _) in zip(spans, spans[1:]):
        assert a + n <= b, f"guarded ranges overlap at {b:#x}"
    _GUARD[:] = spans
    try:
        yield
    finally:
        _GUARD.clear()


class Library:
    """One kernel source built for the emulation with one define set: launch(entry, ...) runs an
    entry over a grid, its arguments given as Python values in KERNELS.toml order."""

    def __init__(self, path: Path, types: Mapping[str, tuple[str, ...]]) -> None:
        self.dll = ctypes.CDLL(str(path))
        self.types = dict(types)
        self.dll.simt_run.restype = ctypes.c_int
        self.dll.simt_run.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int,
                                      ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int,
                                      ctypes.c_int, ctypes.c_int, ctypes.c_int]
        self.dll.simt_guard.restype = None
        self.dll.simt_guard.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int]

    def launch(self, entry: str, grid: tuple[int, int, int], block: tuple[int, int, int],
               shared: int, args: list[Any], *, resident: bool = False) -> None:
        rc = self.run(entry, grid, block, shared, args, resident=resident)
        assert rc == 0, f"{entry}: the emulation refused the launch ({rc}; stderr says why)"

    def run(self, entry: str, grid: tuple[int, int, int], block: tuple[int, int, int],
            shared: int, args: list[Any], *, resident: bool = False) -> int:
        """Launch ``entry``: 0 done, 1 a launch shape the GPU would refuse, 2 a thread trapped or
        faulted (a misaligned or out-of-range shared access, an unknown PTX template). Blocks run
        one after another; ``resident`` runs them all at once, as a persistent kernel's blocks
        must be for a grid-wide barrier (at most 16384 threads, no dependent-launch guard)."""
        types = self.types[entry]
        assert len(args) == len(types), (entry, len(args), len(types))
        values = []
        for v, t in zip(args, types):
            if t in ("ptr", "scratch"):
                ptr = None if v is None or (isinstance(v, int) and v == 0) else (
                    v.ctypes.data if isinstance(v, np.ndarray) else v)
                values.append(ctypes.c_void_p(ptr))
            elif t == "tmap":  # a tensor map's 128 bytes (runtime.host_backend.host_tensor_map)
                values.append((ctypes.c_ubyte * 128).from_buffer_copy(bytes(v)))
            elif t == "i32":
                values.append(ctypes.c_int(int(v)))
            elif t == "i64":
                values.append(ctypes.c_longlong(int(v)))
            else:
                values.append(ctypes.c_float(float(v)))
        argv = (ctypes.c_void_p * max(len(values), 1))(*[ctypes.addressof(v) for v in values])
        fn = getattr(self.dll, f"simt_call_{entry}")
        n = len(_GUARD)
        starts = (ctypes.c_void_p * max(n, 1))(*[a for a, _ in _GUARD])
        lengths = (ctypes.c_size_t * max(n, 1))(*[b for _, b in _GUARD])
        with _ONE_LAUNCH:  # the emulator's state is global: one launch at a time
            self.dll.simt_guard(starts, lengths, n)
            return self.dll.simt_run(ctypes.cast(fn, ctypes.c_void_p), argv, *grid, *block,
                                     shared, int(resident))


_ONE_LAUNCH = threading.Lock()
"""Held across a launch: ctypes lets other threads run meanwhile (tensor-parallel ranks
stepping in threads), and the emulator keeps its guard and thread state in globals."""


def _compile(cmd: list[str], out: Path) -> None:
    """Run the host compiler ``cmd`` (which writes ``out.partial``), then rename its output into
    place whole."""
    partial = out.with_name(out.name + ".partial")
    r = subprocess.run([*cmd, "-o", str(partial)], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-4000:]
    partial.replace(out)


def _runtime(build_dir: Path, defines: tuple[str, ...]) -> Path:
    """simt.cpp compiled once per build folder and ``METRALE_SIMT_*`` define set (the only
    defines it reads), linked into every library."""
    defines = tuple(sorted(d for d in defines if d.startswith("METRALE_SIMT_")))
    key = hashlib.sha256(b"".join(p.read_bytes() for p in (HERE / "simt.hpp", HERE / "simt.cpp"))
                         + repr(defines).encode()).hexdigest()[:20]
    out = build_dir / f"simt_{key}.o"
    if not out.is_file():
        with exclusive(build_dir / f".simt_{key}.lock"):
            if not out.is_file():
                _compile([CXX, "-std=c++20", "-O1", "-c", "-fPIC", "-w",
                          f"-I{cuda_includes()[0]}", f"-I{HERE}",
                          *(f"-D{d}" for d in defines), str(HERE / "simt.cpp")], out)
    return out


def _inputs(source: str, defines: tuple[str, ...], entries: Mapping[str, tuple[str, ...]],
            kernels: Path = KERNELS) -> tuple[dict[str, str], str]:
    """The texts a build of ``source`` compiles (the source and the headers it includes, by
    spelling, found as the production build finds them) and its key: their content, the
    emulator's, this module's, the defines and the entries."""
    from metrale.realize.kernel import source_identity

    text, _, headers, digest = source_identity(kernels, source, ("cuda/common",))
    own = b"".join(p.read_bytes() for p in (HERE / "simt.hpp", HERE / "simt.cpp", Path(__file__)))
    key = hashlib.sha256(digest.encode() + own
                         + repr((source, defines, sorted(entries.items()))).encode())
    return {Path(source).name: text, **headers}, key.hexdigest()[:20]


def build(build_dir: Path, source: str, defines: tuple[str, ...],
          entries: Mapping[str, tuple[str, ...]]) -> Library:
    """``kernels/<source>`` and the headers it includes (looked up in its folder, then in the
    common NVIDIA layer, as the build looks them up) transformed, with the trampolines of
    ``entries`` (entry -> argument types), compiled for the host with ``defines``: once per
    content (the source and its headers, the emulator, this module, the defines and entries) in
    ``build_dir``, which the run's workers, and later runs, share; an edit to a header rebuilds
    only the sources that include it."""
    files, key = _inputs(source, defines, entries)
    out = build_dir / f"{Path(source).stem}_{key}.so"
    if out.is_file():
        return Library(out, entries)
    build_dir.mkdir(parents=True, exist_ok=True)
    with exclusive(build_dir / f".{key}.lock"):
        if not out.is_file():
            work = build_dir / f"src_{key}"
            work.mkdir(exist_ok=True)
            for name, body in files.items():
                (work / name).write_text(transform(body))
            main = work / "simt_main.cpp"
            main.write_text(f'#include "simt.hpp"\n#include "{Path(source).name}"\n'
                            + _trampolines(entries) + "\n")
            _compile([CXX, "-std=c++20", "-O1", "-shared", "-fPIC", "-w",
                      f"-I{cuda_includes()[0]}", f"-I{HERE}", f"-I{work}",
                      *(f"-D{d}" for d in defines), str(main),
                      str(_runtime(build_dir, defines))], out)
            shutil.rmtree(work, ignore_errors=True)
    return Library(out, entries)


@functools.cache
def class_entries(hw: str) -> dict[tuple[str, tuple[str, ...]], dict[str, tuple[str, ...]]]:
    """(source, defines) -> {entry: argument types} over every point class ``hw`` realizes, so
    that one build serves every entry compiled with those defines, whichever asks first (the
    build is keyed on the entries too, so a caller that asked for fewer would build again)."""
    from metrale.lkb.presentation import Presentation
    from metrale.realize.functor import realization
    from metrale.runtime.cuda_loader import parse_args

    P = Presentation.load()
    F = realization(hw, presentation=P)
    out: dict = {}
    for fam in P.generators:
        for point in fam.points:
            k = None if fam.view else F.realize(point)
            if k is not None and k.source is not None:
                entries = out.setdefault((k.source, k.defines), {})
                for entry, args in k.calls:
                    entries[entry] = tuple(a.kind for a in parse_args(args))
    return out


def plan_loader(build_dir: Path, *, dependent_launch: bool = False, comm: Any = None) -> Any:
    """The executor's loader for an NVIDIA class's plans on a ``HostBackend``: every launch runs
    its kernel's own source on the emulation, with the launch shape the plan gives it (the CUDA
    loader's buffers, weights in their storage format, arguments bound the same way).

    Usage: ``Engine.load(model, hardware="sm_90", backend=HostBackend(),
    loader=plan_loader(build_dir))``. With ``dependent_launch`` the launches are marked as the
    device's loader marks them on a class that has dependent launches (``Launch.dependent``);
    the emulation runs them in order either way. ``comm`` is the rank group's transport of a
    sharded plan (``runtime.parallel.HostComm``: the ranks' collectives meet on the host).
    """
    from metrale.runtime.backend import HostKernel
    from metrale.runtime.cuda_loader import CudaPlanLoader, parse_args

    class PlanLoader(CudaPlanLoader):
        def __init__(self) -> None:
            super().__init__("emulated", dependent_launch=dependent_launch, comm=comm)

        def bind(self, backend: Any, k: Any, grid: tuple[int, int, int],
                 block: tuple[int, int, int], shared: int, entry: str | None = None
                 ) -> tuple[Any, tuple[Any, ...]]:
            kernel = k.kernel
            lib = build(build_dir, kernel.source,
                        tuple(d.removeprefix("-D") for d in kernel.defines),
                        class_entries(kernel.hw)[(kernel.source, kernel.defines)])
            entry = entry or kernel.entry
            args = dict(kernel.calls)[entry]

            def run(*values: Any) -> None:
                lib.launch(entry, grid, block, shared, list(values))

            label = f"#{k.index} {entry}"
            module = backend.module({label: HostKernel(run, len(args))}, label)
            return backend.kernel(module, label), parse_args(args)

    return PlanLoader()
