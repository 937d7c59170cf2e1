"""The Engine: a model served step by step — prefill, decode, greedy generate — on one backend.

``Engine.load(model)`` reads a checkpoint directory (or makes seeded random weights for a
built-in config name), binds the weights once (host: dequantized or upcast to f32 once),
allocates a KV cache of ``slots`` sequences × ``max_ctx`` positions and the RoPE tables, and
builds one :class:`~metrale.runtime.executor.Program` per ``(mode, rows)`` on first use. Programs
are captured as a graph once, when the backend can, and replayed: decode programs when built,
prefill programs at their first run into a cache slot, and again when a prompt goes to another
slot (the graph holds the slot's cache pointers).

Laws:

1. ``generate(p, n)[0] == argmax(prefill(p)[-1])``, and each later token is the argmax of the
   decode step fed the one before.
2. A sticky ``DeviceFault`` latches: every later call raises a ``DeviceFault`` with its text.
3. ``close()`` frees in reverse order of acquisition; after it, ``backend.live_bytes()`` is
   what it was before ``load``.

>>> eng = Engine.load("tiny-qwen3", act="f32", max_ctx=32)
>>> logits = eng.prefill([1, 2, 3])
>>> logits.shape, logits.dtype
((3, 256), dtype('float32'))
>>> toks = eng.generate([1, 2, 3], 4)
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

__all__ = ["Engine", "best_backend", "checkpoint_quant", "checkpoint_weights", "random_weights"]

_EXPERT = re.compile(r"^(model\.layers\.\d+\.mlp\.experts)\.(\w+)\.weight$")


def checkpoint_quant(config: Mapping[str, Any] | None) -> str:
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
        raise ConfigError("unsupported quantization", key="quantization_config",
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


def _as_f32(value: Any) -> np.ndarray:
    from metrale.lkb.quant import QuantTensor

    if isinstance(value, QuantTensor):
        return np.asarray(value.dequantize(), np.float32)
    return np.asarray(value).astype(np.float32)


MAX_PREFILL_PROGRAMS = 8
"""Prefill programs an engine keeps (one per prompt length), least recently used dropped."""


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

    Quantized layouts are dequantized, bf16 is upcast (exact); per-expert tensors
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
                    used.add(name)
            except CheckpointError as e:
                raise CheckpointError(f"{e.message} (needed by {node})", file=e.file or ck.path,
                                      key=e.key or name, expected=e.expected,
                                      found=e.found) from None
            for r in raw:
                if isinstance(r, np.ndarray) and not _is_float(r, DType):
                    raise CheckpointError(f"weight has the wrong dtype (needed by {node})",
                                          file=ck.path, key=name,
                                          expected="bf16, f16 or f32, or a quantized layout",
                                          found=str(r.dtype))
            w = np.stack([_as_f32(r) for r in raw]) if stacked else _as_f32(raw[0])
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


def best_backend(hardware: str = "host") -> tuple[GpuBackend, Loader]:
    """The backend and loader that run ``hardware``'s plans here.

    The host class runs on :class:`HostBackend` everywhere; an NVIDIA class with an arch runs
    on :class:`CupyBackend` with compiled kernels (``CupyBackend`` says why when no device is
    there); other vendors are refused with the reason.

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

        return CupyBackend(), CudaPlanLoader(
            hw.arch, dependent_launch=bool(hw.capabilities and hw.capabilities.dependent_launch))
    raise UnavailableError("no backend runs this hardware class's kernels here",
                           key="--hardware", expected="host or an NVIDIA class with an arch",
                           found=repr(hardware))


PREPARE_PREFILL_ROWS = 64
"""Rows of the prefill plan whose kernels an Engine on a GPU compiles before its first step,
with the decode plans of rows 1 and of all its slots: together, the kernels its steps launch
(``plan.points``, what ``met build`` compiles, takes decode rows 1 and 8 and prefill 64)."""


class Engine:
    """A loaded model with its KV cache; see the module docstring. Build with :meth:`load`."""

    def __init__(self, config: ModelConfig, quant: str, weights: Mapping[str, np.ndarray], *,
                 hardware: str, backend: GpuBackend | None, loader: Loader | None, act: str,
                 max_ctx: int, slots: int, blocking: bool, debug: bool, graphs: bool,
                 fuse: bool, policy: str, presentation: Presentation | None = None,
                 progress: bool = True) -> None:
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
        self.latch = FaultLatch()
        self._teardown = Teardown()
        if backend is None:
            backend, default_loader = best_backend(hardware)
            self._teardown.callback(backend.close)
        else:
            default_loader = HostLoader()
        self.backend = backend
        self.loader = loader or default_loader
        self.lengths = [0] * slots
        self._programs: dict[tuple[str, int], Program] = {}
        self._plans: dict[tuple[str, int], Plan] = {}
        try:
            self._bind(weights)
            # the loader this engine chose compiles now, not inside the first step (a caller's
            # own loader is the caller's to prepare)
            if loader is None and hasattr(self.loader, "prepare"):
                plans = [self.plan("decode", rows) for rows in sorted({1, slots})]
                plans.append(self.plan("prefill", min(PREPARE_PREFILL_ROWS, max_ctx)))
                self.loader.prepare(plans, progress=progress)
        except BaseException as e:
            self._close_after(e)
            raise

    # -- construction -------------------------------------------------------------------------

    @classmethod
    def load(cls, model: str | os.PathLike | ModelConfig, *, hardware: str = "host",
             quant: str | None = None, backend: GpuBackend | None = None, act: str = "bf16",
             max_ctx: int = 1024, seed: int = 0, slots: int = 1, blocking: bool = False,
             debug: bool = False,
             graphs: bool = True, fuse: bool = True, policy: str = "exact",
             loader: Loader | None = None, progress: bool = True) -> Engine:
        """Load a checkpoint directory, or a built-in config name or a ``ModelConfig`` (a
        variant of one: ``attrs.evolve(config, num_hidden_layers=1)``) with seeded random
        weights.

        ``quant`` defaults to the checkpoint's ``quantization_config`` (else bf16);
        ``backend`` to the best one for ``hardware``; ``slots`` is the number of sequences
        the KV cache holds; ``blocking`` synchronizes after every launch (faults name their
        kernel); ``debug`` poisons activations with NaN before each step; ``progress`` shows a
        bar (on a terminal) while a GPU class's kernels compile, which they do here, before any
        step.
        """
        path = None if isinstance(model, ModelConfig) else Path(model)
        if path is not None and path.is_dir():
            config = ModelConfig.load(path)
            quant = quant or checkpoint_quant({"quantization_config":
                                               config.quantization_config})
            weights = checkpoint_weights(path, config, quant)
        else:
            config = model if isinstance(model, ModelConfig) else ModelConfig.load(str(model))
            quant = quant or "bf16"
            weights = random_weights(config, quant, seed=seed)
        return cls(config, quant, weights, hardware=hardware, backend=backend, loader=loader,
                   act=act, max_ctx=max_ctx, slots=slots, blocking=blocking, debug=debug,
                   graphs=graphs, fuse=fuse, policy=policy, progress=progress)

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

    def plan(self, mode: str, rows: int, logits: str = "all") -> Plan:
        """The plan of one step (cached per ``(mode, rows, logits)``)."""
        key = (mode, rows, logits)
        if key not in self._plans:
            self._plans[key] = plan_for(self.config, self.quant, self.hardware, mode=mode,
                                        rows=rows, act=self.act, context=self.max_ctx,
                                        fuse=self.fuse, policy=self.policy, logits=logits,
                                        presentation=self.presentation)
        return self._plans[key]

    @property
    def caches(self) -> dict[str, DevicePtr]:
        """Each cache buffer's memory, every slot of it."""
        return {name: self.externals[name] for name in self._slot_bytes}

    def _cache_ptr(self, name: str, first_slot: int, count: int) -> DevicePtr:
        step = self._slot_bytes[name]
        return (self.externals[name] + first_slot * step).take(count * step)

    def program(self, mode: str, rows: int, logits: str = "all") -> Program:
        """The program of one step (built on first use, cached per ``(mode, rows, logits)``).

        Prefill programs (one per prompt length and logits choice) are kept for the
        ``MAX_PREFILL_PROGRAMS`` used last; an older one is closed, freeing its activation arena.
        """
        key = (mode, rows, logits)
        if key in self._programs:
            self._programs[key] = self._programs.pop(key)  # most recently used last
        else:
            if mode == "prefill":
                prefills = [k for k in self._programs if k[0] == "prefill"]
                for old in prefills[:max(0, len(prefills) - MAX_PREFILL_PROGRAMS + 1)]:
                    self._programs.pop(old).close()
                    self._plans.pop(old, None)
            plan = self.plan(mode, rows, logits)
            bindings = {n: p for n, p in self.externals.items() if n not in self._slot_bytes}
            for name in self._slot_bytes:
                bindings[name] = self._cache_ptr(name, 0, rows if mode == "decode" else 1)
            prog = Program(plan, self.backend, bindings=bindings, loader=self.loader,
                           debug=self.debug)
            self._teardown.callback(prog.close)
            if mode == "decode" and self.graphs and not self.blocking:
                prog.capture()
            self._programs[key] = prog
        return self._programs[key]

    # -- steps ----------------------------------------------------------------------------------

    def _check_ids(self, token_ids: Sequence[int]) -> np.ndarray:
        ids = np.asarray(list(token_ids), np.int64)
        if ids.ndim != 1 or ids.size == 0:
            raise ConfigError("token ids must be a non-empty list of ints", key="token_ids",
                              found=repr(token_ids))
        bad = np.flatnonzero((ids < 0) | (ids >= self.config.vocab_size))
        if bad.size:
            raise ConfigError("token id out of range", key=f"token_ids[{int(bad[0])}]",
                              expected=f"0 <= id < {self.config.vocab_size}",
                              found=int(ids[bad[0]]))
        return ids.astype(np.int32)

    def _run(self, prog: Program, inputs: Mapping[str, np.ndarray]) -> np.ndarray:
        self.latch.check()
        try:
            for name, values in inputs.items():
                prog.write(name, values)
            prog.run(blocking=self.blocking)
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
        prog = self.prefill_program(int(ids.size), slot, "last" if last else "all")
        logits = self._run(prog, {"tokens": ids,
                                  "positions": np.arange(ids.size, dtype=np.int32),
                                  "slots": np.zeros(ids.size, np.int32)})
        self.lengths[slot] = int(ids.size)
        return logits

    def prefill_program(self, rows: int, slot: int = 0, logits: str = "all") -> Program:
        """The prefill program of a ``rows``-token prompt, its cache bound to ``slot``'s, and
        captured as a graph for that slot (unless ``graphs`` is off or runs are blocking): a
        prefill is hundreds of launches, each a few tens of microseconds from the host."""
        prog = self.program("prefill", rows, logits)
        for name in self._slot_bytes:
            prog.bind(name, self._cache_ptr(name, slot, 1))  # drops the graph of another slot
        if self.graphs and not self.blocking and not prog.captured:
            prog.capture()
        return prog

    def decode(self, token_ids: Sequence[int]) -> np.ndarray:
        """One token for each of the first ``len(token_ids)`` slots, at each slot's next
        position: f32[rows, vocab]."""
        self.latch.check()
        ids = self._check_ids(token_ids)
        rows = int(ids.size)
        if rows > self.slots:
            raise ConfigError("more rows than cache slots", key="token_ids",
                              expected=f"at most {self.slots}", found=rows)
        positions = np.array(self.lengths[:rows], np.int32)
        full = np.flatnonzero(positions >= self.max_ctx)
        if full.size:
            raise ConfigError("cache slot is full", key=f"slot {int(full[0])}",
                              expected=f"fewer than {self.max_ctx} tokens", found=self.max_ctx)
        logits = self._run(self.program("decode", rows),
                           {"tokens": ids, "positions": positions,
                            "slots": np.arange(rows, dtype=np.int32)})
        for i in range(rows):
            self.lengths[i] += 1
        return logits

    def generate(self, prompt_ids: Sequence[int], steps: int) -> list[int]:
        """Greedy decoding in slot 0: ``steps`` new tokens after the prompt."""
        if not isinstance(steps, int) or steps < 0:
            raise ConfigError("bad step count", key="steps", expected="an int >= 0",
                              found=repr(steps))
        if steps == 0:
            return []
        token = int(self.prefill(prompt_ids, last=True)[-1].argmax())
        out = [token]
        for _ in range(steps - 1):
            token = int(self.decode([token])[0].argmax())
            out.append(token)
        return out

    # -- figures and teardown ---------------------------------------------------------------

    def memory(self) -> dict[str, int]:
        """Bytes held: weights, KV cache, the largest activation arena, and all live bytes."""
        arena = max((p.peak_bytes for p in self._programs.values()), default=0)
        live = max((p.live_peak for p in self._programs.values()), default=0)
        return {"weights": self.weight_bytes, "kv_cache": self.kv_bytes,
                "activations_peak": arena, "activations_live_peak": live,
                "device_live": self.backend.live_bytes()}

    def _close_after(self, first: BaseException) -> None:
        for later in self._teardown._release_all():
            first.add_note(f"also during teardown: {type(later).__name__}: {later}")

    def close(self) -> None:
        """Free programs, caches, tables and weights, newest first (then the backend, if the
        engine made it); the first release error surfaces, never a second one over it."""
        self._programs.clear()
        self._teardown.close()

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, exc_type: Any, exc: BaseException | None, tb: Any) -> None:
        if exc is not None:
            self._close_after(exc)
            self._programs.clear()
        else:
            self.close()
