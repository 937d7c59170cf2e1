"""The Engine: a model served step by step — prefill, decode, greedy generate — on one backend.

``Engine.load(model)`` reads a checkpoint directory (or makes seeded random weights for a
built-in config name), binds the weights once (host: dequantized or upcast to f32 once),
allocates a KV cache of ``slots`` sequences × ``max_ctx`` positions and the RoPE tables, and
builds one :class:`~metrale.runtime.executor.Program` per ``(mode, rows)`` on first use. Programs
are captured as a graph once, when the backend can, and replayed: decode programs when built,
prefill programs at their first run into a cache slot, and again when a prompt goes to another
slot (the graph holds the slot's cache pointers).

Laws:

1. ``generate(p, n).ids[0] == argmax(prefill(p)[-1])``, and each later greedy token is the
   argmax of the decode step fed the one before (drawn on the device by the plan's ``sample``
   op at temperature 0).
2. A sticky ``DeviceFault`` latches: every later call raises a ``DeviceFault`` with its text.
3. ``close()`` frees in reverse order of acquisition; after it, ``backend.live_bytes()`` is
   what it was before ``load``.

>>> eng = Engine.load("tiny-qwen3", act="f32", max_ctx=32)
>>> logits = eng.prefill([1, 2, 3])
>>> logits.shape, logits.dtype
((3, 256), dtype('float32'))
>>> toks = eng.generate([1, 2, 3], 4).ids
>>> toks[0] == int(logits[-1].argmax()), len(toks)
(True, 4)
>>> eng.close()
>>> eng.backend.live_bytes()
0
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from metrale.lkb.errors import CheckpointError, ConfigError, DeviceFault, UnavailableError
from metrale.lkb.presentation import Presentation
from metrale.plan.circuit import circuit_for
from metrale.plan.config import ModelConfig
from metrale.plan.plan import Plan, plan_for
from metrale.plan.rope import rope_table
from metrale.runtime.backend import DevicePtr, GpuBackend
from metrale.runtime.executor import HostLoader, Loader, Program
from metrale.runtime.fault import FaultLatch, Teardown

__all__ = ["Engine", "LongContextWarning", "best_backend", "check_sizes", "checkpoint_dir",
           "checkpoint_quant", "checkpoint_weights", "pooled_weights", "random_weights",
           "seeded_weights"]

_EXPERT = re.compile(r"^(model\.layers\.\d+\.mlp\.experts)\.(\w+)\.weight$")


def checkpoint_quant(config: Mapping[str, Any] | None, *, file: object = None) -> str:
    """The plan's weight format named by a ``config.json``'s ``quantization_config``.

    >>> checkpoint_quant({"quantization_config": {"quant_method": "modelopt",
    ...                                           "quant_algo": "NVFP4"}})
    'nvfp4'
    >>> checkpoint_quant({})
    'bf16'
    """
    qc = (config or {}).get("quantization_config") or {}
    name = str(qc.get("metrale_format") or qc.get("quant_algo") or qc.get("quant_method") or "")
    name = name.lower()
    for quant in ("fp8", "mxfp4", "nvfp4"):
        if name.startswith(quant):
            return quant
    if name:
        raise ConfigError("unsupported quantization", file=file, key="quantization_config",
                          expected="fp8, mxfp4 or nvfp4", found=repr(name))
    return "bf16"


def _weight_shapes(config: ModelConfig, quant: str) -> dict[str, tuple[tuple[int, ...], str]]:
    """Every weight the circuit reads: its concrete shape and its stored format ("" plain)."""
    c = circuit_for(config, quant)
    sizes = c.sizes(1)
    out = {}
    for name in c.weight_names:
        t = c.input_type(name)
        out[name] = (tuple(int(d) for d in t.bind(sizes).shape), t.fmt)
    return out


def random_weights(model: str | ModelConfig, quant: str = "bf16", *, seed: int = 0
                   ) -> dict[str, np.ndarray]:
    """Seeded random weights of ``model`` in the circuit's layout, as f32 arrays.

    Matrices are ``N(0, 1) * hidden ** -0.5`` (unit-variance projections), norms
    ``1 + 0.1 * N(0, 1)``; every value is rounded to bf16 as a bf16 checkpoint stores it, and
    quantized weights (``quant`` other than bf16) are quantized and dequantized once.

    >>> w = random_weights("tiny-qwen3-moe")
    >>> w["model.layers.0.mlp.experts.gate_proj.weight"].shape
    (8, 32, 64)
    >>> all((w[k] == v).all() for k, v in random_weights("tiny-qwen3-moe").items())
    True
    """
    import ml_dtypes

    from metrale.lkb.quant import QuantFormat

    _check_seed(seed)
    config = ModelConfig.load(model) if not isinstance(model, ModelConfig) else model
    rng = np.random.default_rng(seed)
    std = np.float32(config.hidden_size ** -0.5)
    fmt = QuantFormat.parse(quant) if quant != "bf16" else None
    out: dict[str, np.ndarray] = {}
    for name, (shape, stored) in _weight_shapes(config, quant).items():
        w = rng.standard_normal(shape, dtype=np.float32)
        if name.endswith("norm.weight"):
            w = np.float32(1) + np.float32(0.1) * w
        else:
            w *= std
        w = w.astype(ml_dtypes.bfloat16).astype(np.float32)
        if stored and fmt is not None:
            flat = w.reshape(-1, shape[-1])
            w = fmt.quantize(flat, name=name).dequantize().astype(np.float32).reshape(shape)
        out[name] = w
    return out


RANDOM_WEIGHTS = ("normal", "pooled")
"""How a model without a checkpoint gets its seeded random weights: ``normal`` draws every value
(:func:`random_weights`: exact f32 arrays, what the oracle tests compare); ``pooled`` tiles each
tensor from small pools in its storage format (:func:`pooled_weights`: seconds for an 8B model,
for timing)."""


def pooled_weights(model: str | ModelConfig, quant: str = "bf16", *, seed: int = 0
                   ) -> dict[str, Any]:
    """Seeded random weights in their storage formats, every tensor tiled from small pools: what
    timing needs (the bytes a step moves) without drawing billions of values.

    bf16 matrices repeat a pool of ``N(0, 1) * hidden ** -0.5`` values, norms one of
    ``1 + 0.1 * N(0, 1)``; fp8 weights are e4m3 codes (never NaN) with a per-row scale that keeps
    their spread near the bf16 one; mxfp4 and nvfp4 random nibbles with block scales of 2^-7 to
    2^-3 (e8m0 codes 120-124) and of 2^-5 to 1.5 · 2^-5 (e4m3 codes 16-20).
    One array per (shape, format, role), shared by every layer that has it, so the host copy of a
    30B model stays small (a device still gets a buffer per tensor). Rows repeat: a test that
    must tell rows apart uses :func:`random_weights`.

    >>> w = pooled_weights("tiny-qwen3-moe", "mxfp4")
    >>> w["model.layers.0.mlp.experts.gate_proj.weight"].shape
    (8, 32, 64)
    >>> w["model.layers.0.mlp.experts.gate_proj.weight"] is w[
    ...     "model.layers.1.mlp.experts.gate_proj.weight"]
    True
    """
    import ml_dtypes

    _check_seed(seed)
    config = ModelConfig.load(model) if not isinstance(model, ModelConfig) else model
    rng = np.random.default_rng(seed)
    std = config.hidden_size ** -0.5
    pool = (rng.standard_normal(1 << 22) * std).astype(ml_dtypes.bfloat16)
    norm_pool = (1 + 0.1 * rng.standard_normal(1 << 16)).astype(ml_dtypes.bfloat16)
    byte_pool = rng.integers(0, 256, 1 << 22, dtype=np.uint8)
    fp8_pool = np.where((byte_pool & 0x7F) == 0x7F, byte_pool ^ 1, byte_pool).astype(np.uint8)
    scale_pool = rng.integers(0, 5, 4096, dtype=np.uint8)  # the block scale codes' offsets
    out: dict[str, Any] = {}
    made: dict[tuple, Any] = {}
    for name, (shape, fmt) in _weight_shapes(config, quant).items():
        key = (tuple(shape), fmt, name.endswith("norm.weight"))
        if key not in made:
            made[key] = _pooled(key, pool, norm_pool, byte_pool, fp8_pool, scale_pool, std)
        out[name] = made[key]
    return out


def _pooled(key: tuple, pool: np.ndarray, norm_pool: np.ndarray, byte_pool: np.ndarray,
            fp8_pool: np.ndarray, scale_pool: np.ndarray, std: float) -> Any:
    import ml_dtypes

    from metrale.lkb.quant import QuantFormat, QuantTensor

    shape, fmt, norm = key
    if not fmt:
        return np.resize(norm_pool if norm else pool, shape)
    f = QuantFormat.parse(fmt)
    specs = f.array_specs(shape)
    dshape, _ = specs["data"]
    if fmt == "fp8":
        data = np.resize(fp8_pool, dshape).view(ml_dtypes.float8_e4m3fn)
        scale = np.full(specs["scale"][0], std / 110, np.float32)  # dequantized spread ~ std
        return QuantTensor(f, shape, data, scale)
    sshape, sdt = specs["scale"]
    scale = np.resize(scale_pool, sshape) + np.uint8(120 if fmt == "mxfp4" else 16)
    scale = scale.view(sdt.numpy) if sdt.numpy.itemsize == 1 else scale
    glob = np.float32(1.0) if "global_scale" in specs else None
    return QuantTensor(f, shape, np.resize(byte_pool, dshape), scale, glob)


def seeded_weights(config: ModelConfig, quant: str, *, seed: int = 0, random: str = "normal"
                   ) -> dict[str, Any]:
    """The seeded random weights of a model without a checkpoint, drawn as ``random`` says
    (:data:`RANDOM_WEIGHTS`)."""
    if random == "normal":
        return random_weights(config, quant, seed=seed)
    if random == "pooled":
        return pooled_weights(config, quant, seed=seed)
    raise ConfigError("unknown random weights", key="random", expected=" or ".join(RANDOM_WEIGHTS),
                      found=repr(random))


def _check_seed(seed: Any) -> None:
    if not isinstance(seed, int) or isinstance(seed, bool) or seed < 0:
        raise ConfigError("bad seed", key="seed", expected="an int >= 0", found=repr(seed))


def _as_f32(value: Any) -> np.ndarray:
    from metrale.lkb.quant import QuantTensor

    if isinstance(value, QuantTensor):
        return np.asarray(value.dequantize(), np.float32)
    return np.asarray(value).astype(np.float32)


MAX_PREFILL_PROGRAMS = 32
"""Prefill programs an engine keeps (one per prompt length), least recently used dropped. A
server's prompts come in many lengths, and a cycle over more lengths than are kept would
rebuild every program it asks for (each a plan, a build and a graph capture)."""

PREFILL_ARENA_BYTES = 1 << 30
"""The activation arenas and workspaces the kept prefill programs may hold together (a quantized
prefill's workspace holds its largest weight made bf16: 235 MB for Llama-3.1-8B); past it the
least recently used are closed (the newest stays, whatever its size)."""

MAX_PLANS = 256
"""Plans an engine keeps (host objects; a program dropped keeps its plan for the next build)."""


class UnusedTensorWarning(UserWarning):
    """A checkpoint holds tensors that no plan node reads (reported, never an error)."""


def _needed_by(circuit: Any, name: str) -> str:
    """The circuit node that reads input ``name``: ``linear (q_proj) of layer 3``."""
    k = circuit.input_names.index(name)
    d = circuit.diagram
    for j, srcs in enumerate(d.wiring):
        if (-1, k) in srcs:
            box = d.boxes[j]
            role = box.param("role")
            where = f" of layer {name.split('.')[2]}" if name.startswith("model.layers.") else ""
            return f"{box.name}{f' ({role})' if role else ''}{where}"
    return "no node"


def checkpoint_weights(path: str | os.PathLike, config: ModelConfig, quant: str
                       ) -> dict[str, np.ndarray]:
    """The weights the circuit reads, from a checkpoint directory, each as f32 once.

    Quantized layouts are dequantized, bf16 is upcast (exact); a plain tensor the circuit
    lists as ``transposed`` is read with its last two axes swapped; per-expert tensors
    ``mlp.experts.{e}.X.weight`` are stacked into ``mlp.experts.X.weight`` [E, ...]; a tied
    ``lm_head`` is the embedding. A tensor the plan needs that is absent, or of the wrong
    shape or dtype, is a ``CheckpointError`` naming the tensor and the node that reads it;
    tensors nothing reads are listed in an :class:`UnusedTensorWarning`.
    """
    import warnings

    from metrale.lkb.dtype import DType
    from metrale.lkb.quant import QuantTensor
    from metrale.runtime.checkpoint import Checkpoint

    circuit = circuit_for(config, quant)
    shapes = _weight_shapes(config, quant)
    plain = {n: circuit.input_type(n).dtype for n in shapes}
    out: dict[str, np.ndarray] = {}
    used: set[str] = set()
    with Checkpoint.open(path) as ck:
        for name, (shape, stored) in shapes.items():
            node = _needed_by(circuit, name)
            m = _EXPERT.match(name)
            stacked = bool(m and name not in ck and
                           name[:-len(".weight")] + ".weight_blocks" not in ck)
            try:
                if stacked:
                    parts = [f"{m[1]}.{e}.{m[2]}.weight" for e in range(shape[0])]
                    raw = [ck.weight(p) for p in parts]
                    used.update(parts)
                elif name == "lm_head.weight" and name not in ck and config.tie_word_embeddings:
                    raw = [ck.weight("model.embed_tokens.weight")]
                else:
                    raw = [ck.weight(name)]
                    # a quantized X_blocks/X_scales pair is listed as the logical X.weight
                    used.update((name, name.removesuffix(".weight") + ".weight"))
            except CheckpointError as e:
                raise CheckpointError(f"{e.message} (needed by {node})", file=e.file or ck.path,
                                      key=e.key or name, expected=e.expected,
                                      found=e.found) from None
            names = parts if stacked else [name]
            for part, r in zip(names, raw):
                if isinstance(r, np.ndarray) and not _is_float(r, DType):
                    raise CheckpointError(f"weight has the wrong dtype (needed by {node})",
                                          file=ck.path, key=part,
                                          expected="bf16, f16 or f32, or a quantized layout",
                                          found=str(r.dtype))
                if stored:
                    _check_stored_format(r, stored, quant, _file_of(ck, part), part, node)
                if stacked and tuple(r.shape) != shape[1:]:
                    raise CheckpointError(f"expert weight has the wrong shape for the config "
                                          f"(needed by {node})", file=_file_of(ck, part),
                                          key=part, expected=shape[1:], found=tuple(r.shape))
            f32 = [_as_f32(r) for r in raw]
            for part, a in zip(names, f32):
                _check_finite(a, _file_of(ck, part), part, node)
            w = np.stack(f32) if stacked else f32[0]
            if name in circuit.transposed and isinstance(raw[0], np.ndarray):
                w = np.swapaxes(w, -1, -2)  # stored [..., k, n] as the model's x @ W takes it
            quantized = next((r for r in raw if isinstance(r, QuantTensor)), None)
            if not stored and quantized is not None:
                _check_plain_exact(w, plain[name], ck.path, name, node, quantized.fmt.name)
            if w.shape != shape:
                raise CheckpointError(f"weight has the wrong shape for the config (needed by "
                                      f"{node})", file=ck.path, key=name, expected=shape,
                                      found=w.shape)
            out[name] = np.ascontiguousarray(w)
        unused = sorted(set(ck.weight_names()) - used - {"model.embed_tokens.weight"})
        if unused:
            shown = ", ".join(unused[:8]) + (f" and {len(unused) - 8} more" if len(unused) > 8
                                             else "")
            warnings.warn(UnusedTensorWarning(f"{ck.path}: {len(unused)} tensor(s) no plan node "
                                              f"reads: {shown}"), stacklevel=2)
    return out


_EXACT_CHUNK = 1 << 22  # values per chunk of the exactness check (bounds its temporaries)


def _file_of(ck: Any, name: str) -> Any:
    return ck.file_of(name) if name in ck else ck.path


def _check_finite(w: np.ndarray, path: Any, name: str, node: str) -> None:
    """A weight with a NaN or an infinity is a ``CheckpointError`` naming the tensor, the first
    bad index and the node that reads it: it would turn every later activation into NaN."""
    flat = w.reshape(-1)
    for i in range(0, flat.size, _EXACT_CHUNK):
        ok = np.isfinite(flat[i:i + _EXACT_CHUNK])
        if not ok.all():
            j = i + int(np.argmin(ok))
            at = [int(x) for x in np.unravel_index(j, w.shape)]
            raise CheckpointError(f"NaN or inf in a weight (needed by {node})", file=path,
                                  key=name, expected="finite values", found=f"{flat[j]} at {at}")


def _check_stored_format(raw: Any, stored: str, quant: str, path: Any, name: str,
                         node: str) -> None:
    """The one format rule, for every backend: a weight the plan reads as ``quant`` (the plan's
    format, e.g. fp8) must be stored in that format. Plain floats under an fp8 plan are refused
    (the host would compute in bf16 and call it fp8; a device would re-quantize them)."""
    from metrale.lkb.quant import QuantTensor

    held = raw.fmt.kind if isinstance(raw, QuantTensor) else None
    if held == stored:
        return
    found = raw.fmt.name if held is not None else f"{_dtype_name(raw)} (not quantized)"
    raise CheckpointError(f"weight is stored {found}, and the plan reads it as {stored} "
                          f"(needed by {node}; quantize the checkpoint with met quantize SRC "
                          f"DST --to {stored}, or run with --quant "
                          f"{held or 'bf16'})", file=path, key=name,
                          expected=f"a {stored} layout", found=found)


def _dtype_name(a: Any) -> str:
    from metrale.lkb.dtype import DType

    try:
        return DType.of(np.asarray(a)).name
    except ConfigError:
        return str(np.asarray(a).dtype)


def _check_plain_exact(w: np.ndarray, dtype: Any, path: Any, name: str, node: str,
                       stored: str) -> None:
    """A tensor stored quantized (in format ``stored``) that the plan reads plain (``dtype``,
    e.g. bf16) is accepted only when every dequantized value is exact in that dtype; otherwise
    the device would read rounded weights the checkpoint does not hold, so it is a
    ``CheckpointError``."""
    if dtype.numpy == np.float32:
        return
    flat = w.reshape(-1)
    rounds = sum(int(np.count_nonzero(part != part.astype(dtype.numpy).astype(np.float32)))
                 for part in (flat[i:i + _EXACT_CHUNK]
                              for i in range(0, flat.size, _EXACT_CHUNK)))
    if rounds:
        raise CheckpointError(f"weight is stored {stored}, and the plan reads it as {dtype.name}: "
                              f"{rounds} of {w.size} values would round (needed by "
                              f"{node}; quantize_checkpoint keeps it {dtype.name})",
                              file=path, key=name, expected=f"{dtype.name} or values exact in it",
                              found=stored)


def _is_float(a: np.ndarray, DType: Any) -> bool:
    try:
        return DType.of(a).is_float
    except ConfigError:
        return False


def best_backend(hardware: str = "host", kernels_dir: Any = None) -> tuple[GpuBackend, Loader]:
    """The backend and loader that run ``hardware``'s plans here (their kernels compiled from
    ``kernels_dir``, default the shipped folder).

    The host class runs on :class:`HostBackend` everywhere; an NVIDIA class with an arch runs
    on :class:`CupyBackend` with compiled kernels (``CupyBackend`` says why when no device is
    there); other vendors are refused with the reason. The kernels are compiled to machine code
    (cubin) where the device runs the class's (:func:`binary_format_for`), so that no module
    waits for the driver to compile PTX inside the first steps; else to PTX.

    >>> be, loader = best_backend()
    >>> be.name
    'host'
    """
    from metrale.lkb.vendor import Vendor
    from metrale.realize.hardware import load_hardware
    from metrale.runtime.host_backend import HostBackend

    hw = load_hardware().get(hardware)
    if hw.vendor == Vendor.HOST:
        return HostBackend(), HostLoader()
    if hw.vendor == Vendor.NVIDIA and hw.arch not in (None, "none"):
        from metrale.runtime.cuda_loader import CudaPlanLoader
        from metrale.runtime.cupy_backend import CupyBackend

        backend = CupyBackend()
        return backend, CudaPlanLoader(
            hw.arch, kernels_dir=kernels_dir, output=binary_format_for(hw.arch, backend.limits),
            dependent_launch=bool(hw.capabilities and hw.capabilities.dependent_launch))
    raise UnavailableError("no backend runs this hardware class's kernels here",
                           key="--hardware", expected="host or an NVIDIA class with an arch",
                           found=repr(hardware))


def binary_format_for(arch: str, limits: Any) -> str:
    """``"cubin"`` where a device of ``limits`` runs machine code built for ``arch``, else
    ``"ptx"`` (which the driver compiles for the device when a module loads). Machine code is
    compiled with the build, on every core, and cached; PTX waits for the driver, one module
    after another, inside the first steps that load them (on a fresh machine, tiny-qwen3's
    first prefill took 10.2 s of a 21.0 s first token on an H100: ``bench_cold_start.py``).

    >>> from metrale.runtime.backend import DeviceLimits
    >>> binary_format_for("sm_90a", DeviceLimits(compute_capability=(9, 0)))
    'cubin'
    >>> binary_format_for("sm_80", DeviceLimits(compute_capability=(9, 0)))
    'ptx'
    >>> binary_format_for("sm_90a", DeviceLimits())
    'ptx'
    """
    from metrale.realize.preflight import preflight_arch

    cc = limits.compute_capability
    return "cubin" if cc is not None and preflight_arch(arch, cc, "cubin").ok else "ptx"


def checkpoint_dir(model: Any) -> Path | None:
    """The checkpoint directory ``model`` names, or ``None`` when it names a config to fill with
    random weights (a built-in name, a ``ModelConfig``, a lone ``config.json``).

    A directory is a checkpoint; so is the folder of a ``.safetensors`` file, of an index, or of
    a ``config.json`` that has weights beside it: a path into a checkpoint loads that checkpoint,
    never random weights for its config.

    >>> checkpoint_dir("tiny-qwen3") is None
    True
    """
    from metrale.runtime.checkpoint import INDEX, SINGLE

    if isinstance(model, ModelConfig):
        return None
    path = Path(model)
    if path.is_dir():
        return path
    if path.is_file():
        weights = any(os.path.lexists(path.parent / n) for n in (SINGLE, INDEX))
        if path.suffix == ".safetensors" or path.name == INDEX or weights:
            return path.parent
    return None


def available_memory() -> int | None:
    """Bytes of host memory available now (``MemAvailable``), or ``None`` where unknown."""
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


class LongContextWarning(UserWarning):
    """A context longer than the model's ``max_position_embeddings``: it runs, but the model
    was not trained on positions that far (its outputs there are not to be trusted)."""


MAX_POSITIONS = 2**31 - 1
"""No context is longer: positions are int32 on every backend."""


def _gib(n: float) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.2f} MiB"


def check_sizes(config: ModelConfig, quant: str, *, max_ctx: int, slots: int = 1,
                hardware: str = "host", memory: int | None = None) -> dict[str, int]:
    """Check the sizes a load asks for against what the model and the machine allow, before
    anything is allocated; returns the bytes asked (``weights``, ``kv_cache``, ``rope``).

    The host keeps weights as f32 (dequantized once, on every backend before they are bound),
    the KV cache as f32 too (on the host class; a device holds its own), and builds the RoPE
    tables in float64 first; those bytes are compared with ``memory`` (default: the host's
    available memory). Too much is an ``AllocationError`` saying what was asked and what fits;
    a context past ``max_position_embeddings`` is a :class:`LongContextWarning`.

    >>> from metrale.plan.config import ModelConfig
    >>> c = ModelConfig.load("tiny-qwen3")
    >>> check_sizes(c, "bf16", max_ctx=1 << 40, memory=1 << 30)
    Traceback (most recent call last):
    ...
    metrale.lkb.errors.ConfigError: max_ctx: context longer than positions can count (expected at most 2147483647, found 1099511627776)
    >>> check_sizes(c, "bf16", max_ctx=1 << 24, memory=1 << 30)
    Traceback (most recent call last):
    ...
    metrale.lkb.errors.AllocationError: tiny-qwen3: max_ctx: not enough memory: context 16777216 x 1 slot(s) asks for 12.00 GiB (weights 0.41 MiB, KV cache 8.00 GiB, RoPE tables 4.00 GiB), and 1.00 GiB is available here (expected a context of at most 1,397,544 positions)
    """  # noqa: E501
    import warnings

    from metrale.lkb.errors import AllocationError

    for key, value in (("max_ctx", max_ctx), ("slots", slots)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ConfigError(f"bad {'context length' if key == 'max_ctx' else 'slot count'}",
                              key=key, expected="an int >= 1", found=repr(value))
    if max_ctx > MAX_POSITIONS or max_ctx * slots > MAX_POSITIONS:
        raise ConfigError("context longer than positions can count", key="max_ctx",
                          expected=f"at most {MAX_POSITIONS // slots}", found=max_ctx)
    weights = sum(4 * int(np.prod(shape, dtype=object))
                  for shape, _ in _weight_shapes(config, quant).values())
    per_position = (config.num_hidden_layers * 2 * config.num_key_value_heads
                    * config.head_dim * 4 * slots)
    rope_per_position = config.head_dim * 16  # float64 angles and cos/sin, then f32 tables
    from metrale.lkb.vendor import Vendor
    from metrale.realize.hardware import load_hardware

    if load_hardware().get(hardware).vendor != Vendor.HOST:
        per_position = 0  # the KV cache lives on the device, whose allocator says when it is full
    kv = per_position * max_ctx
    rope = rope_per_position * max_ctx
    asked = weights + kv + rope
    memory = available_memory() if memory is None else memory
    if memory is not None and asked > memory:
        fits = (memory - weights) // (per_position + rope_per_position)
        room = (f"a context of at most {fits:,} positions" if fits >= 1 else
                f"a model whose weights fit in {_gib(memory)} (these need {_gib(weights)})")
        raise AllocationError(
            f"not enough memory: context {max_ctx} x {slots} slot(s) asks for {_gib(asked)} "
            f"(weights {_gib(weights)}, KV cache {_gib(kv)}, RoPE tables {_gib(rope)}), and "
            f"{_gib(memory)} is available here", file=config.name,
            key="max_ctx" if fits >= 1 else "weights", expected=room)
    if max_ctx > config.max_position_embeddings:
        warnings.warn(LongContextWarning(
            f"{config.name}: context {max_ctx} is longer than the model's "
            f"max_position_embeddings ({config.max_position_embeddings}): positions past it "
            f"were never trained"), stacklevel=3)
    return {"weights": weights, "kv_cache": kv, "rope": rope}


class Engine:
    """A loaded model with its KV cache; see the module docstring. Build with :meth:`load`."""

    def __init__(self, config: ModelConfig, quant: str, weights: Mapping[str, np.ndarray], *,
                 hardware: str, backend: GpuBackend | None, loader: Loader | None, act: str,
                 max_ctx: int, slots: int, blocking: bool, debug: bool, graphs: bool,
                 fuse: bool, policy: str, presentation: Presentation | None = None,
                 progress: bool = True, kernels_dir: Any = None) -> None:
        if not isinstance(max_ctx, int) or max_ctx < 1:
            raise ConfigError("bad context length", key="max_ctx", expected="an int >= 1",
                              found=repr(max_ctx))
        if not isinstance(slots, int) or slots < 1:
            raise ConfigError("bad slot count", key="slots", expected="an int >= 1",
                              found=repr(slots))
        self.config, self.quant, self.hardware, self.act = config, quant, hardware, act
        self.max_ctx, self.slots = max_ctx, slots
        self.blocking, self.debug, self.graphs = blocking, debug, graphs
        self.fuse, self.policy = fuse, policy
        self.presentation = presentation  # the LKB plans are made over (None: the shipped one)
        self.kernels_dir = kernels_dir  # the kernels folder plans realize (None: the shipped one)
        self.latch = FaultLatch()
        self._teardown = Teardown()
        if backend is None:
            backend, default_loader = best_backend(hardware, kernels_dir)
            self._teardown.callback(backend.close)
        else:
            default_loader = HostLoader()
        self.backend = backend
        self.loader = loader or default_loader
        self.lengths = [0] * slots
        self.text: Any = None  # the checkpoint's Text (tokenizer, template), when it has one
        self._programs: dict[tuple[str, int, str, bool], Program] = {}
        self._plans: dict[tuple[str, int, str, bool], Plan] = {}
        # the loader this engine chose compiles now, not inside the first step (a caller's own
        # loader is the caller's to prepare)
        self._prepares = loader is None and hasattr(self.loader, "prepare")
        self._progress = progress
        try:
            if self._prepares:
                from metrale.plan.points import prepared_steps

                # generation's plans, made as the loader asks for them (each plan's compiles
                # run while the next is made), then the weights copied while they all run
                plans = (self.plan(*step) for step in prepared_steps(slots, max_ctx))
                self.loader.prepare(plans, progress=progress,
                                    meanwhile=lambda: self._bind(weights))
            else:
                self._bind(weights)
            self._teardown.callback(self._close_programs)  # before the weights they read
        except BaseException as e:
            self._close_after(e)
            raise

    # -- construction -------------------------------------------------------------------------

    @classmethod
    def load(cls, model: str | os.PathLike | ModelConfig, *, hardware: str = "host",
             quant: str | None = None, backend: GpuBackend | None = None, act: str = "bf16",
             max_ctx: int | None = None, seed: int = 0, slots: int = 1, blocking: bool = False,
             debug: bool = False,
             graphs: bool = True, fuse: bool = True, policy: str = "exact",
             loader: Loader | None = None, progress: bool = True, random: str = "normal"
             ) -> Engine:
        """Load a checkpoint directory, or a built-in config name or a ``ModelConfig`` (a
        variant of one: ``attrs.evolve(config, num_hidden_layers=1)``) with seeded random
        weights, drawn as ``random`` says (:data:`RANDOM_WEIGHTS`).

        ``quant`` defaults to the checkpoint's ``quantization_config`` (else bf16); ``max_ctx``
        (the KV cache's positions) to 1024, or the model's ``max_position_embeddings`` if
        smaller; sizes are checked before anything is allocated (:func:`check_sizes`);
        ``backend`` to the best one for ``hardware``; ``slots`` is the number of sequences
        the KV cache holds; ``blocking`` synchronizes after every launch (faults name their
        kernel); ``debug`` poisons activations with NaN before each step; ``progress`` shows a
        bar (on a terminal) while a GPU class's kernels compile, which generation's do here,
        before any step (another plan's, as its program is first made).
        """
        path = checkpoint_dir(model)
        text = None
        if path is not None:
            config = ModelConfig.load(path)
            quant = quant or checkpoint_quant({"quantization_config":
                                               config.quantization_config},
                                              file=path / "config.json")
            if (path / "tokenizer.json").is_file():
                from metrale.runtime.text import Text

                text = Text.load(path)
        else:
            config = model if isinstance(model, ModelConfig) else ModelConfig.load(str(model))
            quant = quant or "bf16"
        if max_ctx is None:
            max_ctx = min(1024, config.max_position_embeddings)
        check_sizes(config, quant, max_ctx=max_ctx, slots=slots, hardware=hardware)
        if path is not None:
            weights = checkpoint_weights(path, config, quant)
        else:
            weights = seeded_weights(config, quant, seed=seed, random=random)
        eng = cls(config, quant, weights, hardware=hardware, backend=backend, loader=loader,
                  act=act, max_ctx=max_ctx, slots=slots, blocking=blocking, debug=debug,
                  graphs=graphs, fuse=fuse, policy=policy, progress=progress)
        eng.text = text
        return eng

    def _alloc(self, nbytes: int, label: str) -> DevicePtr:
        ptr = self.backend.alloc(nbytes, label)
        self._teardown.callback(self.backend.free, ptr)
        return ptr

    def _bind(self, weights: Mapping[str, np.ndarray]) -> None:
        reference = self.plan("decode", 1)
        self.externals: dict[str, DevicePtr] = {}
        self.weight_bytes = self.kv_bytes = 0
        cos, sin = rope_table(self.config, self.max_ctx)
        tables = {"rope.cos": cos, "rope.sin": sin}
        self._slot_bytes: dict[str, int] = {}
        for b in reference.buffers:
            if b.alias is not None or not (b.kind in ("weight", "cache") or b.name in tables):
                continue
            spec = self.loader.spec(b)
            if b.kind == "cache":
                self._slot_bytes[b.name] = spec.nbytes  # one slot: the decode rows=1 plan's
                ptr = self._alloc(spec.nbytes * self.slots, b.name)
                self.backend.memset(ptr, 0)
                self.kv_bytes += ptr.nbytes
            else:
                data = tables.get(b.name)
                if data is None:
                    data = weights.get(b.name)
                if data is None:
                    raise CheckpointError("the plan reads a weight the checkpoint lacks",
                                          file=self.config.name, key=b.name)
                if b.kind == "weight" and b.type.fmt and hasattr(self.loader, "prepare_parts"):
                    # stored as the device kernels read it: packed values, scales, global
                    for part, values in self.loader.prepare_parts(b.name, data,
                                                                  b.type.fmt).items():
                        part_ptr = self._alloc(max(values.nbytes, 1), part)
                        self.backend.copy_h2d(part_ptr, values.reshape(-1).view(np.uint8))
                        self.weight_bytes += values.nbytes
                        self.externals[part] = part_ptr
                    continue
                if hasattr(data, "dequantize"):  # a stored format the loader takes as values
                    data = _as_f32(data)
                arr = np.ascontiguousarray(data, spec.dtype)
                if arr.shape != spec.shape:
                    raise CheckpointError("weight has the wrong shape", file=self.config.name,
                                          key=b.name, expected=spec.shape, found=arr.shape)
                ptr = self._alloc(spec.nbytes, b.name)
                self.backend.copy_h2d(ptr, arr.reshape(-1).view(np.uint8))
                if b.kind == "weight":
                    self.weight_bytes += spec.nbytes
            self.externals[b.name] = ptr

    # -- plans and programs ---------------------------------------------------------------------

    def plan(self, mode: str, rows: int, logits: str = "all", sample: bool = False) -> Plan:
        """The plan of one step (cached per ``(mode, rows, logits, sample)``); ``sample`` ends
        it with the ``sample`` family, which draws each row's next id on the device."""
        key = (mode, rows, logits, sample)
        if key in self._plans:
            self._plans[key] = self._plans.pop(key)  # most recently used last
        else:
            while len(self._plans) >= MAX_PLANS:
                oldest = next(k for k in self._plans if k not in self._programs)
                del self._plans[oldest]
            self._plans[key] = plan_for(self.config, self.quant, self.hardware, mode=mode,
                                        rows=rows, act=self.act, context=self.max_ctx,
                                        fuse=self.fuse, policy=self.policy, logits=logits,
                                        presentation=self.presentation, sample=sample,
                                        cache_slots=self.slots if mode == "prefill" else None,
                                        kernels_dir=self.kernels_dir,
                                        device=self.backend.limits.name)
        return self._plans[key]

    def bucket_rows(self, rows: int) -> int:
        """The rows of the decode program a ``rows``-row step runs: its bucket's (the plans
        are chosen per bucket, HARDWARE.toml ``[cost] decode_buckets``), at most the slots.

        >>> with Engine.load("tiny-llama", max_ctx=8, slots=4) as eng:
        ...     [eng.bucket_rows(r) for r in (1, 2, 3, 4)]
        [1, 4, 4, 4]
        """
        from metrale.plan.search import bucket_of

        return min(bucket_of(self.plan("decode", 1).hw_target, "decode", rows), self.slots)

    def use_plan(self, plan: Plan) -> None:
        """Run ``plan`` for its step (mode, rows, logits) from now on, in place of the one the
        planner chose: a plan of this engine's model, quant and class (``met tune`` times the
        alternatives so). The step's program is rebuilt on next use. A plan that ends with the
        ``sample`` family is the sampling step's."""
        if (plan.target.model, plan.target.quant, plan.target.hw) != (
                self.config.name, self.quant, self.hardware):
            raise ConfigError("a plan of another target", key="plan",
                              expected=f"{self.config.name} {self.quant} on {self.hardware}",
                              found=str(plan.target))
        sample = any(k.family == "sample" for k in plan.kernels)
        key = (plan.mode, plan.rows, plan.logits, sample)  # the keys of plan() and program()
        old = self._programs.pop(key, None)
        if old is not None:
            old.close()
        self._plans[key] = plan

    @property
    def caches(self) -> dict[str, DevicePtr]:
        """Each cache buffer's memory, every slot of it."""
        return {name: self.externals[name] for name in self._slot_bytes}

    def _cache_ptr(self, name: str, first_slot: int, count: int) -> DevicePtr:
        step = self._slot_bytes[name]
        return (self.externals[name] + first_slot * step).take(count * step)

    def program(self, mode: str, rows: int, logits: str = "all", sample: bool = False
                ) -> Program:
        """The program of one step (built on first use, cached per ``(mode, rows, logits,
        sample)``).

        Prefill programs (one per prompt length and logits choice) are kept for the
        ``MAX_PREFILL_PROGRAMS`` used last, their arenas within ``PREFILL_ARENA_BYTES``; an
        older one is closed, freeing its activation arena and graphs (its plan stays).
        """
        key = (mode, rows, logits, sample)
        if key in self._programs:
            self._programs[key] = self._programs.pop(key)  # most recently used last
            return self._programs[key]
        if mode == "prefill":
            self._drop_prefills(MAX_PREFILL_PROGRAMS - 1)
        plan = self.plan(mode, rows, logits, sample)
        if self._prepares:  # a plan not prepared: its new kernels compile in parallel, now
            self.loader.prepare([plan], progress=self._progress)
        bindings = {n: p for n, p in self.externals.items() if n not in self._slot_bytes}
        for name in self._slot_bytes:
            bindings[name] = self._cache_ptr(name, 0, dict(plan.sizes)["slots"])
        prog = Program(plan, self.backend, bindings=bindings, loader=self.loader,
                       debug=self.debug)
        self._programs[key] = prog
        if mode == "decode" and self.graphs and not self.blocking:
            prog.capture()
        if mode == "prefill":
            self._drop_prefills(MAX_PREFILL_PROGRAMS, PREFILL_ARENA_BYTES)
        return prog

    def _drop_prefills(self, keep: int, arena_bytes: int | None = None) -> None:
        """Close the least recently used prefill programs until at most ``keep`` remain and,
        with ``arena_bytes``, their arenas and workspaces fit it (the newest always stays)."""
        while True:
            kept = [k for k in self._programs if k[0] == "prefill"]
            held = sum(self._programs[k].peak_bytes + self._programs[k].workspace_bytes
                       for k in kept)
            if len(kept) <= keep and (arena_bytes is None or held <= arena_bytes
                                      or len(kept) <= 1):
                return
            self._programs.pop(kept[0]).close()

    def _close_programs(self) -> None:
        programs, self._programs = list(self._programs.values()), {}
        first: BaseException | None = None
        for prog in reversed(programs):
            try:
                prog.close()
            except BaseException as e:  # every program is closed; the first error surfaces
                first = first or e
        if first is not None:
            raise first

    # -- steps ----------------------------------------------------------------------------------

    def _check_ids(self, token_ids: Sequence[int]) -> np.ndarray:
        try:
            ids = np.asarray(list(token_ids), np.int64)
        except (OverflowError, TypeError, ValueError):
            raise ConfigError("token ids must be ints in the vocabulary", key="token_ids",
                              expected=f"0 <= id < {self.config.vocab_size}",
                              found=repr(token_ids)[:80]) from None
        if ids.ndim != 1 or ids.size == 0:
            raise ConfigError("token ids must be a non-empty list of ints", key="token_ids",
                              found=repr(token_ids))
        bad = np.flatnonzero((ids < 0) | (ids >= self.config.vocab_size))
        if bad.size:
            raise ConfigError("token id out of range", key=f"token_ids[{int(bad[0])}]",
                              expected=f"0 <= id < {self.config.vocab_size}",
                              found=int(ids[bad[0]]))
        return ids.astype(np.int32)

    def _run(self, prog: Program, inputs: Mapping[str, np.ndarray], out: str = "logits"
             ) -> np.ndarray:
        self.latch.check()
        try:
            for name, values in inputs.items():
                prog.write(name, values)
            prog.run(blocking=self.blocking)
            if out == "ids":
                return np.array(prog.read("ids"), np.int32)
            return np.array(prog.read("logits"), np.float32)
        except DeviceFault as e:
            raise self.latch.latch(e) from None

    def prefill(self, token_ids: Sequence[int], *, slot: int = 0, last: bool = False
                ) -> np.ndarray:
        """Run the prompt through the model into cache ``slot`` (from position 0): f32[T, vocab],
        or with ``last`` only the last token's row, f32[1, vocab], all that generation needs: its
        plan runs the final norm and lm_head on that row alone (a 2048-token prompt's logits over
        a 152k vocabulary are 1.2 GB, and a quarter of Qwen3-0.6B's prefill arithmetic)."""
        self.latch.check()
        ids = self._check_ids(token_ids)
        if not 0 <= slot < self.slots:
            raise ConfigError("no such cache slot", key="slot",
                              expected=f"0 <= slot < {self.slots}", found=slot)
        if ids.size > self.max_ctx:
            raise ConfigError("prompt longer than the context", key="token_ids",
                              expected=f"at most {self.max_ctx} tokens", found=ids.size)
        prog = self.prefill_program(int(ids.size), "last" if last else "all")
        logits = self._run(prog, {"tokens": ids,
                                  "positions": np.arange(ids.size, dtype=np.int32),
                                  "slots": np.full(ids.size, slot, np.int32)})
        self.lengths[slot] = int(ids.size)
        return logits

    def prefill_program(self, rows: int, logits: str = "all", sample: bool = False) -> Program:
        """The prefill program of a ``rows``-token prompt, captured as a graph (unless
        ``graphs`` is off or runs are blocking): a prefill is hundreds of launches, each a few
        tens of microseconds from the host. It holds every cache slot: the slot is its
        ``slots`` input, so one graph serves a prompt of this length in any slot."""
        prog = self.program("prefill", rows, logits, sample)
        if self.graphs and not self.blocking and not prog.captured:
            prog.capture()
        return prog

    def _step_ids(self, token_ids: Sequence[int]) -> tuple[np.ndarray, int]:
        """A decode step's ids, checked, and its row count (at most the slots)."""
        ids = self._check_ids(token_ids)
        rows = int(ids.size)
        if rows > self.slots:
            raise ConfigError("more rows than cache slots", key="token_ids",
                              expected=f"at most {self.slots}", found=rows)
        return ids, rows

    def decode(self, token_ids: Sequence[int]) -> np.ndarray:
        """One token for each of the first ``len(token_ids)`` slots, at each slot's next
        position: f32[rows, vocab]."""
        self.latch.check()
        ids, rows = self._step_ids(token_ids)
        positions = np.array(self.lengths[:rows], np.int32)
        full = np.flatnonzero(positions >= self.max_ctx)
        if full.size:
            raise ConfigError("cache slot is full", key=f"slot {int(full[0])}",
                              expected=f"fewer than {self.max_ctx} tokens", found=self.max_ctx)
        # the step runs its rows bucket's program: a padding row takes the next slot at that
        # slot's next position (written there before any step reads it) and its logits drop;
        # where such a slot is full, the step runs its own rows
        run = self.bucket_rows(rows)
        if any(self.lengths[i] >= self.max_ctx for i in range(rows, run)):
            run = rows
        pad = np.arange(rows, run)
        logits = self._run(self.program("decode", run), {
            "tokens": np.concatenate([ids, np.full(pad.size, ids[-1])]),
            "positions": np.concatenate([positions,
                                         np.array([self.lengths[i] for i in pad], np.int32)]),
            "slots": np.arange(run, dtype=np.int32)})[:rows]
        for i in range(rows):
            self.lengths[i] += 1
        return logits

    def _check_slot(self, slot: int) -> None:
        if not isinstance(slot, int) or not 0 <= slot < self.slots:
            raise ConfigError("no such cache slot", key="slot",
                              expected=f"0 <= slot < {self.slots}", found=slot)

    def prefill_ids(self, token_ids: Sequence[int], *, slot: int = 0, params: np.ndarray,
                    keys: np.ndarray) -> int:
        """Prefill the prompt into ``slot`` and draw the next id on the device, through the
        prefill plan ending in ``sample`` (``params`` f32[1, 4], ``keys`` i32[1, 4]; see
        :mod:`metrale.runtime.sampling`)."""
        self.latch.check()
        ids = self._check_ids(token_ids)
        self._check_slot(slot)
        if ids.size > self.max_ctx:
            raise ConfigError("prompt longer than the context", key="token_ids",
                              expected=f"at most {self.max_ctx} tokens", found=ids.size)
        prog = self.prefill_program(int(ids.size), "last", sample=True)
        out = self._run(prog, {"tokens": ids, "positions": np.arange(ids.size, dtype=np.int32),
                               "slots": np.full(ids.size, slot, np.int32),
                               "sample.params": np.asarray(params, np.float32).reshape(1, 4),
                               "sample.keys": np.asarray(keys, np.int32).reshape(1, 4)}, "ids")
        self.lengths[slot] = int(ids.size)
        return int(out[0])

    def decode_ids(self, token_ids: Sequence[int], params: np.ndarray, keys: np.ndarray, *,
                   live: Sequence[bool] | None = None) -> np.ndarray:
        """One decode step for the first ``len(token_ids)`` slots, drawing each row's next id on
        the device: i32[rows]. Rows not ``live`` (free slots under a busy one) run at position 0
        and do not advance; under the exact policy they change no other row's bytes."""
        self.latch.check()
        ids, rows = self._step_ids(token_ids)
        alive = np.ones(rows, bool) if live is None else np.asarray(live, bool)
        positions = np.where(alive, np.array(self.lengths[:rows], np.int32), 0).astype(np.int32)
        full = np.flatnonzero(positions >= self.max_ctx)
        if full.size:
            raise ConfigError("cache slot is full", key=f"slot {int(full[0])}",
                              expected=f"fewer than {self.max_ctx} tokens", found=self.max_ctx)
        out = self._run(self.program("decode", rows, sample=True),
                        {"tokens": ids, "positions": positions,
                         "slots": np.arange(rows, dtype=np.int32),
                         "sample.params": np.asarray(params, np.float32).reshape(rows, 4),
                         "sample.keys": np.asarray(keys, np.int32).reshape(rows, 4)}, "ids")
        for i in np.flatnonzero(alive):
            self.lengths[int(i)] += 1
        return out

    def generate(self, prompt: str | Sequence[int], max_tokens: int = 16, *,
                 sampling: Any = None, stop: Sequence[str] = (), chat: bool = False) -> Any:
        """Generate after ``prompt`` (text, chat messages with ``chat``, or token ids) in a free
        slot: a :class:`~metrale.runtime.generate.Generation` with ``ids`` and ``text``.
        ``sampling`` is a :class:`~metrale.runtime.sampling.Sampling` (default greedy; the
        device's argmax, the same ids as ``argmax(prefill(p)[-1])`` then ``decode``)."""
        from metrale.runtime.generate import generate

        return generate(self, prompt, max_tokens, sampling=sampling, stop=stop, chat=chat)

    def stream(self, prompt: str | Sequence[int], max_tokens: int = 16, *,
               sampling: Any = None, stop: Sequence[str] = (), chat: bool = False) -> Any:
        """Like :meth:`generate`, as an iterator of :class:`~metrale.runtime.generate.Delta`
        (the new text and ids of each step)."""
        from metrale.runtime.generate import stream

        return stream(self, prompt, max_tokens, sampling=sampling, stop=stop, chat=chat)

    # -- figures and teardown ---------------------------------------------------------------

    def memory(self) -> dict[str, int]:
        """Bytes held: weights, KV cache, the largest activation arena, the programs'
        workspaces together, and all live bytes."""
        arena = max((p.peak_bytes for p in self._programs.values()), default=0)
        live = max((p.live_peak for p in self._programs.values()), default=0)
        work = sum(p.workspace_bytes for p in self._programs.values())
        return {"weights": self.weight_bytes, "kv_cache": self.kv_bytes,
                "activations_peak": arena, "activations_live_peak": live, "workspaces": work,
                "device_live": self.backend.live_bytes()}

    def _close_after(self, first: BaseException) -> None:
        for later in self._teardown._release_all():
            first.add_note(f"also during teardown: {type(later).__name__}: {later}")

    def close(self) -> None:
        """Free programs, caches, tables and weights, newest first (then the backend, if the
        engine made it); the first release error surfaces, never a second one over it."""
        self._teardown.close()

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, exc_type: Any, exc: BaseException | None, tb: Any) -> None:
        if exc is not None:
            self._close_after(exc)
        else:
            self.close()
