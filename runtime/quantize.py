"""Quantizing a bf16 checkpoint into another format, with the error it costs per tensor.

:func:`quantize_checkpoint` rewrites every linear weight (every 2-D ``*.weight`` except
embeddings, norms, the output head and MoE routers, see :func:`should_quantize`) in a
:class:`~metrale.lkb.quant.QuantFormat` and copies everything else. A layer's MoE experts of one
projection are quantized as the one stacked tensor the plans read, so a format's tensor-wide
arrays (nvfp4's global scale) are shared by them, as the device stores them. The result is
written atomically and read back by :class:`~metrale.runtime.checkpoint.Checkpoint`. The report
gives each tensor's SQNR,
``10 log10(Σ w² / Σ (w - dequant(w))²)`` in dB, and its bytes before and after.

>>> should_quantize("model.layers.0.mlp.down_proj.weight", (1024, 3072))
True
>>> should_quantize("model.embed_tokens.weight", (151936, 1024))
False
"""

from __future__ import annotations

import io
import math
import os
import re
from collections.abc import Iterable, Iterator
from pathlib import Path

import attrs
import numpy as np
from rich.console import Console
from rich.progress import (
    BarColumn,
    DownloadColumn,
    Progress,
    TextColumn,
    TimeRemainingColumn,
)
from rich.table import Table

from metrale.lkb.errors import CheckpointError
from metrale.lkb.quant import QuantFormat, QuantTensor

from .checkpoint import Checkpoint, Weight, write_checkpoint
from .safetensors import path_kind

_SOURCE_FLOATS = ("BF16", "F16", "F32")
_CHUNK = 1 << 22  # elements per chunk for the f64 sums and finiteness checks (bounds memory)
SIDE_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json",
              "merges.txt", "special_tokens_map.json", "added_tokens.json",
              "generation_config.json", "chat_template.jinja", "chat_template.json")
"""The files besides weights and ``config.json`` that a checkpoint needs to run and is copied
with (tokenizer, chat template, generation defaults); nothing else of the source is copied."""
WRITER = "met quantize"
"""The writer :func:`quantize_checkpoint` records in its output's marker file."""


def should_quantize(name: str, shape: tuple[int, ...]) -> bool:
    """Whether ``quantize_checkpoint`` quantizes tensor ``name``: every 2-D ``*.weight`` except
    token embeddings (``embed_tokens``), norms (a module name containing ``norm``), the output
    head (``lm_head``) and MoE routers (``mlp.gate``).

    The plans read the head and the routers in bf16 (``plan.circuit``), as most published
    quantized checkpoints store them; a quantized copy would be read back rounded to bf16.

    >>> should_quantize("model.norm.weight", (1024, 1)), should_quantize("lm_head.weight", (8, 4))
    (False, False)
    >>> should_quantize("model.layers.0.mlp.gate.weight", (8, 4))
    False
    """
    if len(shape) != 2 or not name.endswith(".weight"):
        return False
    module = name[: -len(".weight")]
    last = module.rsplit(".", 1)[-1]
    return ("embed_tokens" not in module and "norm" not in last and module != "lm_head"
            and not module.endswith(("mlp.gate", "mlp.router")))


_TRANSPOSED_EXPERTS = re.compile(r"^.*\.mlp\.experts\.(gate_up_proj|down_proj)$")


def transposed_experts(name: str, shape: tuple[int, ...]) -> bool:
    """Whether ``name`` is a layer's experts stacked as one bare ``[E, k, n]`` parameter, the
    ``x @ W`` layout transformers' gpt-oss keeps (``mlp.experts.gate_up_proj``, ``down_proj``):
    quantized, it is written ``[E, n, k]``, as ``X_blocks``/``X_scales`` in mxfp4 (the
    published gpt-oss layout) and as ``X.weight`` with its scales in the other formats.

    >>> transposed_experts("model.layers.0.mlp.experts.gate_up_proj", (32, 2880, 5760))
    True
    >>> transposed_experts("model.layers.0.mlp.experts.gate_up_proj_bias", (32, 5760))
    False
    """
    return len(shape) == 3 and _TRANSPOSED_EXPERTS.match(name) is not None


@attrs.frozen
class TensorReport:
    """What happened to one tensor: kept or quantized, bytes before and after, SQNR in dB."""

    name: str
    shape: tuple[int, ...]
    dtype: str
    fmt: str
    """The format it was written in, or ``copy`` when written as it was."""
    bytes_before: int
    bytes_after: int
    sqnr_db: float | None
    """``None`` for copied tensors; ``inf`` when the round trip is exact."""


@attrs.frozen
class QuantizeReport:
    """The result of :func:`quantize_checkpoint`: where, which format, and every tensor's report.

    >>> r = QuantizeReport("a", "b", "mxfp4", (TensorReport("w", (2, 32), "BF16", "mxfp4",
    ...                                                     128, 34, 18.5),))
    >>> r.bytes_before, r.bytes_after, r.min_sqnr_db
    (128, 34, 18.5)
    """

    src: str
    dst: str
    fmt: str
    tensors: tuple[TensorReport, ...]

    @property
    def bytes_before(self) -> int:
        """Bytes of all source tensors."""
        return sum(t.bytes_before for t in self.tensors)

    @property
    def bytes_after(self) -> int:
        """Bytes of all written tensors."""
        return sum(t.bytes_after for t in self.tensors)

    @property
    def quantized(self) -> tuple[TensorReport, ...]:
        """The reports of the tensors that were quantized."""
        return tuple(t for t in self.tensors if t.sqnr_db is not None)

    @property
    def min_sqnr_db(self) -> float | None:
        """The worst SQNR over quantized tensors (``None`` if none was quantized)."""
        q = [t.sqnr_db for t in self.quantized]
        return min(q) if q else None

    def table(self) -> Table:
        """A rich table: one row per tensor, then the totals."""
        t = Table(title=f"quantize {self.src} -> {self.dst} ({self.fmt})")
        for col in ("tensor", "shape", "format", "bytes before", "bytes after", "SQNR dB"):
            t.add_column(col, justify="left" if col in ("tensor", "format") else "right",
                         overflow="fold")  # a tensor name folds, never cut to ambiguity
        for r in self.tensors:
            sq = "" if r.sqnr_db is None else f"{r.sqnr_db:.2f}"
            t.add_row(r.name, "x".join(map(str, r.shape)), r.fmt, f"{r.bytes_before:,}",
                      f"{r.bytes_after:,}", sq)
        worst = self.min_sqnr_db
        t.add_row("total", "", "", f"{self.bytes_before:,}", f"{self.bytes_after:,}",
                  "" if worst is None else f"min {worst:.2f}")
        return t

    def __str__(self) -> str:
        console = Console(width=120, file=io.StringIO())
        console.print(self.table())
        return console.file.getvalue()


def sqnr_db(w: np.ndarray, deq: np.ndarray) -> float:
    """``10 log10(Σ w² / Σ (w - deq)²)`` summed in f64; ``inf`` when ``deq == w`` exactly.

    >>> round(sqnr_db(np.array([3.0, 4.0]), np.array([3.0, 4.5])), 3)
    20.0
    """
    a = np.asarray(w).reshape(-1)
    b = np.asarray(deq).reshape(-1)
    signal = noise = 0.0
    for i in range(0, a.size, _CHUNK):
        x = a[i : i + _CHUNK].astype(np.float64)
        e = x - b[i : i + _CHUNK].astype(np.float64)
        signal += float(x @ x)
        noise += float(e @ e)
    if noise == 0:
        return math.inf
    if signal == 0:
        return -math.inf
    return 10 * math.log10(signal / noise)


def _check_finite(arr: np.ndarray, name: str, file: Path) -> None:
    flat = arr.reshape(-1)
    for i in range(0, flat.size, _CHUNK):
        ok = np.isfinite(flat[i : i + _CHUNK].astype(np.float32))
        if not ok.all():
            at = np.unravel_index(i + int(np.argmin(ok)), arr.shape)
            raise CheckpointError("NaN or inf in a tensor", file=file, key=name,
                                  expected="finite values",
                                  found=f"{flat[i + int(np.argmin(ok))]} at {list(map(int, at))}")


def quantize_checkpoint(src: os.PathLike | str, dst: os.PathLike | str,
                        fmt: QuantFormat | str, *, progress: bool = True,
                        overwrite: bool = False, flag: str = "overwrite=True") -> QuantizeReport:
    """Write ``dst``: the checkpoint ``src`` with its linear weights in ``fmt``.

    ``src`` holds plain float tensors (bf16, or f16/f32); a tensor with NaN or inf is refused
    by name, as is a weight whose K the format's block does not divide. The files a checkpoint
    needs besides its weights (:data:`SIDE_FILES`: tokenizer, generation config) are copied,
    streamed, and a link among them that leaves ``src`` is refused; ``config.json`` gets
    ``quantization_config``. The write is atomic: on any error or interrupt ``dst`` does not
    appear. An existing ``dst`` is replaced only with ``overwrite`` and only when it is a
    previous output of this function; ``dst`` is never ``src`` nor a folder holding it.
    """
    from .checkpoint import check_destination

    fmt = QuantFormat.parse(fmt, key="--to" if flag.startswith("--") else "fmt")
    check_destination(dst, overwrite=overwrite, writer=WRITER, protect=(src,), flag=flag)
    reports: list[TensorReport] = []
    with Checkpoint.open(src) as ck:
        names = ck.names()
        for name in names:
            info = ck.info(name)
            if info.dtype not in _SOURCE_FLOATS and name.endswith(".weight"):
                raise CheckpointError("source is not a plain float checkpoint",
                                      file=ck.file_of(name), key=name,
                                      expected="/".join(_SOURCE_FLOATS), found=info.dtype)
        extra = _extra_files(ck.path)
        total = sum(ck.info(n).nbytes for n in names)
        bar = Progress(TextColumn("[bold]quantize[/] {task.description}"), BarColumn(),
                       DownloadColumn(), TimeRemainingColumn(),
                       console=Console(stderr=True), disable=not progress, transient=True)

        # a layer's experts of one projection, quantized together where the format has arrays
        # shared by a whole tensor (nvfp4's global scale): the plans stack them into one tensor
        experts = _expert_groups(names) if _has_tensor_wide_arrays(fmt) else {}
        stacked = _StackedExperts(ck, fmt)

        def produce() -> Iterator[tuple[str, Weight]]:
            task = bar.add_task(fmt.name, total=total)
            for name in names:
                info = ck.info(name)
                arr = ck.raw(name)
                bar.update(task, description=name)
                if info.dtype in _SOURCE_FLOATS and name not in experts:  # groups: in take
                    _check_finite(arr, name, ck.file_of(name))
                if fmt.kind != "bf16" and transposed_experts(name, info.shape):
                    w32 = np.ascontiguousarray(np.swapaxes(arr.astype(np.float32), -1, -2))
                    qt = fmt.quantize(w32, name=name)
                    sq = sqnr_db(w32, qt.dequantize())
                    reports.append(TensorReport(name, info.shape, info.dtype, fmt.name,
                                                info.nbytes, qt.nbytes, sq))
                    yield (name if fmt.kind == "mxfp4" else name + ".weight"), qt
                elif should_quantize(name, info.shape):
                    w32 = arr.astype(np.float32)
                    group = experts.get(name)
                    qt: QuantTensor = (fmt.quantize(w32, name=name) if group is None
                                       else stacked.take(group, name))
                    sq = sqnr_db(w32, qt.dequantize())
                    reports.append(TensorReport(name, info.shape, info.dtype, fmt.name,
                                                info.nbytes, qt.nbytes, sq))
                    yield name, qt
                else:
                    reports.append(TensorReport(name, info.shape, info.dtype, "copy",
                                                info.nbytes, info.nbytes, None))
                    yield name, arr
                bar.advance(task, info.nbytes)

        with bar:
            try:
                write_checkpoint(dst, produce(), ck.config, fmt, extra_files=extra,
                                 overwrite=overwrite, writer=WRITER, protect=(src,), flag=flag)
            except CheckpointError as e:
                if e.file is None and e.key is not None and e.key in ck:
                    raise CheckpointError(e.message, file=ck.file_of(e.key), key=e.key,
                                          expected=e.expected, found=e.found) from None
                raise
    return QuantizeReport(str(src), str(dst), fmt.name, tuple(reports))


_EXPERT = re.compile(r"^(.*\.mlp\.experts)\.(\d+)\.(\w+)\.weight$")


def _expert_groups(names: Iterable[str]) -> dict[str, tuple[str, ...]]:
    """Each per-expert weight name -> the names of its group (one layer's experts of one
    projection), in expert order.

    >>> g = _expert_groups(["m.mlp.experts.1.up_proj.weight", "m.mlp.experts.0.up_proj.weight"])
    >>> g["m.mlp.experts.1.up_proj.weight"]
    ('m.mlp.experts.0.up_proj.weight', 'm.mlp.experts.1.up_proj.weight')
    """
    groups: dict[tuple[str, str], list[tuple[int, str]]] = {}
    for name in names:
        m = _EXPERT.match(name)
        if m:
            groups.setdefault((m[1], m[3]), []).append((int(m[2]), name))
    out = {}
    for members in groups.values():
        ordered = tuple(n for _, n in sorted(members))
        out.update(dict.fromkeys(ordered, ordered))
    return out


def _has_tensor_wide_arrays(fmt: QuantFormat) -> bool:
    """Whether ``fmt`` keeps an array for a whole tensor (not one per leading index), so that
    quantizing experts one by one differs from quantizing their stack.

    >>> _has_tensor_wide_arrays(QuantFormat.parse("nvfp4")), _has_tensor_wide_arrays(
    ...     QuantFormat.parse("mxfp4"))
    (True, False)
    """
    one, two = fmt.array_specs((256, 256)), fmt.array_specs((2, 256, 256))
    return any(two[f][0] != (2, *one[f][0]) for f in one)


class _StackedExperts:
    """Expert groups quantized as one stacked tensor, handed out one expert at a time (each
    group is read and quantized when its first member is asked for, and dropped with its last)."""

    def __init__(self, ck: Checkpoint, fmt: QuantFormat) -> None:
        self.ck, self.fmt = ck, fmt
        self._ready: dict[str, QuantTensor] = {}

    def take(self, group: tuple[str, ...], name: str) -> QuantTensor:
        if name not in self._ready:
            members = [self.ck.raw(n) for n in group]
            for n, arr in zip(group, members, strict=True):  # each refused by name, first
                _check_finite(arr, n, self.ck.file_of(n))
                if arr.shape != members[0].shape:
                    raise CheckpointError("an expert's weight differs in shape from its layer's "
                                          "other experts", file=self.ck.file_of(n), key=n,
                                          expected=tuple(members[0].shape),
                                          found=tuple(arr.shape))
            stack = np.stack([np.asarray(a, np.float32) for a in members])
            qt = self.fmt.quantize(stack, name=name)
            one = self.fmt.array_specs(qt.shape[1:])
            arrays = {f: getattr(qt, f) for f in one}  # the format's arrays, stacked or shared
            for i, n in enumerate(group):
                parts = {f: a if a.shape == one[f][0] else a[i] for f, a in arrays.items()}
                self._ready[n] = QuantTensor(self.fmt, qt.shape[1:], **parts)
        return self._ready.pop(name)


def _extra_files(folder: Path) -> dict[str, Path]:
    """The :data:`SIDE_FILES` of checkpoint ``folder`` that exist, to copy: each a regular file
    inside ``folder`` (a link is followed only while it stays inside)."""
    if not folder.is_dir():
        return {}
    root = folder.resolve()
    out = {}
    for name in SIDE_FILES:
        p = folder / name
        if not (p.exists() or p.is_symlink()):
            continue
        try:
            real = p.resolve(strict=True)
        except (OSError, RuntimeError):
            raise CheckpointError("side file is a broken link or a link loop", file=p,
                                  expected="a regular file") from None
        if root not in real.parents:
            raise CheckpointError("side file links outside the source checkpoint", file=p,
                                  expected=f"a file inside {folder}", found=str(real))
        if not real.is_file():
            raise CheckpointError("side file is not a regular file", file=p,
                                  expected="a regular file", found=path_kind(real))
        out[name] = real
    return out
