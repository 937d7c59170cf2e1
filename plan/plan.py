"""The plan: F_H ∘ L_H applied to a circuit — kernels, buffers, provenance, evidence, numerics.

``plan_for(model, quant, hardware, mode, rows)`` computes the composite
``(lower_H >> rewrite_H >> F_H)(circuit)`` and then only annotates its image (buffers,
bytes, evidence, numerics, launches), in named, pure steps, and returns a frozen
``Plan``: the kernels in launch order with their points, realization provenance, evidence
status and numerics; the relations applied and declined (with reasons); buffers with sizes
and lifetimes; bytes moved per step and the memory-bandwidth floor of the class's device.

>>> p = plan_for("tiny-qwen3", "bf16", "host")
>>> p.kernel_count <= 8 * 2 + 4, p.exact, p.row_invariant
(True, True, True)
>>> p == plan_for("tiny-qwen3", "bf16", "host")
True
"""

from __future__ import annotations

import math
import time
from collections.abc import Mapping
from typing import Any

import attrs

from metrale.lkb.diagram import Box, Diagram, Source
from metrale.lkb.family import Family, Point
from metrale.lkb.presentation import Presentation
from metrale.lkb.relation import eval_bound
from metrale.lkb.target import KernelTarget
from metrale.lkb.ty import TensorType

from .circuit import Circuit, circuit_for
from .config import ModelConfig
from .fuser import POLICIES, Applied, Declined, fuser, shared_excess

FORMAT_BITS = {"": None, "fp8": 8.0, "mxfp4": 4.25, "nvfp4": 4.5}
"""Bits a stored weight element costs, scales included (fp8's per-row scale is negligible)."""


@attrs.frozen
class Buffer:
    """A tensor of the step: its name, bound type, bytes, role and lifetime (kernel indices)."""

    name: str
    type: TensorType
    nbytes: int
    kind: str  # input | weight | cache | activation
    first: int  # producing kernel, -1 for step inputs
    last: int  # last reading kernel; len(kernels) when it is a step output
    alias: str | None = None  # the buffer whose memory it shares (views, in-place caches)


@attrs.frozen
class PlannedKernel:
    """One launch of the plan (views are listed but launch nothing)."""

    index: int
    family: str
    point: Point
    box: Box
    layer: int | None
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    kernel: Any  # realize.kernel.Kernel, None for views
    provenance: str
    shadow: bool
    residual: bool
    evidence: str
    relation: str | None
    numerics: str  # exact | bounded
    row_invariant: bool
    bytes_moved: int
    view: bool
    launched: tuple[str, ...] = ()
    """The entries launched at the plan's sizes, in order: the kernel's own, then its ``then``
    launches, less those whose grid is empty there (a GEMM's combine only where k is split;
    gemv.cu's linear makes its own launch or its split one, by n); empty for views and host
    callables."""
    cost: Any = attrs.field(default=None, eq=False)
    """The predicted :class:`~metrale.plan.cost.Cost` of the launch, with its source."""

    @property
    def label(self) -> str:
        return f"{self.family}" + (f" ⟵ {self.relation}" if self.relation else "")


@attrs.frozen(eq=False)
class Plan:
    """A kernel plan for one target, mode and row count; see the module docstring."""

    target: KernelTarget
    mode: str
    rows: int
    policy: str
    act: str
    context: int
    kernels: tuple[PlannedKernel, ...]
    buffers: tuple[Buffer, ...]
    applied: tuple[Applied, ...]
    declined: tuple[Declined, ...]
    input_names: tuple[str, ...]
    output_names: tuple[str, ...]
    bandwidth: float  # bytes per second of the class's representative device
    device: str
    diagram: Diagram
    sizes: tuple[tuple[str, int], ...]
    bound: tuple[float, float] | None
    logits: str = "all"  # "last": a prefill's logits for its last row only
    steps: tuple[tuple[str, float], ...] = attrs.field(default=(), eq=False)
    choice: Any = attrs.field(default=None, eq=False)
    """The search's :class:`~metrale.plan.search.Choice` the plan was made by (its bucket, the
    matmul point, the matches not applied); None for a plan made without relations."""
    hw_target: Any = attrs.field(default=None, eq=False, repr=False)
    """The :class:`~metrale.realize.target.Target` the plan was made against (presentation,
    F_H, evidence, policy): what loaders read the plan's families and kernels from."""
    cost_device: str = attrs.field(default="", eq=False)
    """The device the kernels' costs are for (``plan.cost.CostModel``): an engine's, else the
    class's representative one (``device``)."""

    def _key(self) -> tuple:
        return (self.target, self.mode, self.rows, self.policy, self.act, self.context,
                self.logits, self.kernels, self.buffers, self.applied, self.declined)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Plan) and self._key() == other._key()

    def __hash__(self) -> int:
        return hash(self._key())

    @property
    def launches(self) -> tuple[PlannedKernel, ...]:
        """The kernels that launch (views excluded)."""
        return tuple(k for k in self.kernels if not k.view)

    @property
    def kernel_count(self) -> int:
        return len(self.launches)

    @property
    def bytes_moved(self) -> int:
        return sum(k.bytes_moved for k in self.kernels)

    @property
    def floor_s(self) -> float:
        """The memory-bandwidth floor: bytes moved over the device's bandwidth."""
        return self.bytes_moved / self.bandwidth

    @property
    def cost_floor_s(self) -> float:
        """The floor on the device the plan is costed for (:attr:`cost_device`: an engine's
        own, where the class knows it as its device or one of its ``[[peers]]``), else
        :attr:`floor_s`: what a step timed on that device is held to.

        >>> p = plan_for("tiny-llama", "bf16", "sm_90", device="NVIDIA H100 80GB HBM3")
        >>> round(p.cost_floor_s / p.floor_s, 3)  # the H200's 4300 GB/s over the H100's 3030
        1.419
        """
        dev = self.hw_target.hw.device_named(self.cost_device) if self.hw_target else None
        return self.bytes_moved / dev.hbm_bytes_per_s if dev is not None else self.floor_s

    @property
    def predicted_us(self) -> float:
        """The predicted step time: the sum of the kernels' predicted costs, microseconds."""
        return sum(k.cost.us for k in self.kernels if k.cost is not None)

    @property
    def bucket(self) -> int:
        """The rows the plan's alternatives were chosen at (a decode's bucket)."""
        return self.choice.bucket if self.choice is not None else self.rows

    @property
    def exact(self) -> bool:
        return all(k.numerics == "exact" for k in self.kernels)

    @property
    def row_invariant(self) -> bool:
        return all(k.row_invariant for k in self.kernels)

    def points(self) -> frozenset[Point]:
        """Every point the plan launches."""
        return frozenset(k.point for k in self.launches)

    def layer_kernels(self, layer: int) -> tuple[PlannedKernel, ...]:
        return tuple(k for k in self.launches if k.layer == layer)

    def peak_bytes(self) -> int:
        """Peak live bytes of activations when buffers are reused by liveness."""
        events: list[tuple[int, int]] = []
        for b in self.buffers:
            if b.kind == "activation" and b.alias is None:
                events.append((b.first, b.nbytes))
                events.append((b.last + 1, -b.nbytes))
        live = peak = 0
        for _, delta in sorted(events):
            live += delta
            peak = max(peak, live)
        return peak

    def __str__(self) -> str:
        from .printers import plan_text

        return plan_text(self)

    def to_json(self) -> dict[str, Any]:
        from .printers import plan_json

        return plan_json(self)

    def to_dot(self) -> str:
        from .printers import plan_dot

        return plan_dot(self)

    def _repr_html_(self) -> str:
        from .printers import plan_html

        return plan_html(self)

    def diff(self, other: Plan) -> PlanDiff:
        """Which kernels differ between two plans, and why (declined relations)."""
        return plan_diff(self, other)


@attrs.frozen
class PlanDiff:
    """Kernels only in one plan or the other, counted by family and point."""

    left: str
    right: str
    only_left: tuple[tuple[str, int], ...]
    only_right: tuple[tuple[str, int], ...]
    reasons: tuple[str, ...]

    def __str__(self) -> str:
        lines = [f"{self.left}  vs  {self.right}"]
        lines += [f"  - {p} ×{n}" for p, n in self.only_left]
        lines += [f"  + {p} ×{n}" for p, n in self.only_right]
        if not self.only_left and not self.only_right:
            lines.append("  the same kernels")
        lines += [f"  why: {r}" for r in self.reasons]
        return "\n".join(lines)

    def _repr_html_(self) -> str:
        from .display import plan_diff_html

        return plan_diff_html(self)


def plan_diff(a: Plan, b: Plan) -> PlanDiff:
    from collections import Counter

    ca = Counter(str(k.point) for k in a.launches)
    cb = Counter(str(k.point) for k in b.launches)
    only_a = tuple(sorted((ca - cb).items()))
    only_b = tuple(sorted((cb - ca).items()))
    why = sorted({f"{d.relation} on {p.target.hw}: {d.reason}" for p in (a, b)
                  for d in p.declined if not d.reason.startswith("overlaps")})
    return PlanDiff(str(a.target), str(b.target), only_a, only_b, tuple(why))


# -- the pipeline --------------------------------------------------------------------------


def plan_for(model: str | ModelConfig, quant: str = "bf16", hardware: str = "host", *,
             mode: str = "decode", rows: int = 1, policy: str = "exact", act: str = "bf16",
             context: int = 1024, kernels_dir: Any = None,
             presentation: Presentation | None = None, fuse: bool = True,
             logits: str = "all", sample: bool = False, choice: Any = None,
             cache_slots: int | None = None, device: str | None = None) -> Plan:
    """Plan one forward step of ``model`` for ``hardware``; pure and deterministic.

    ``logits="last"`` (prefill) gives logits for the last row only (plan.circuit.LOGITS);
    ``sample`` ends the step with the ``sample`` family (the ids it draws are output ``ids``).
    ``cache_slots``: the KV cache's slots (``circuit_for``'s; an engine's prefill plans its
    whole cache, the slot an input).

    ``fuse=False`` skips rewrite_H (the plan of the lowered circuit, every relation unused):
    under the exact policy its results must equal the fused plan's byte for byte.

    The alternatives (matmul point, which matches apply) are the cheapest by cost at the rows'
    bucket (``plan.search.choose``); ``choice`` (a ``plan.search.Choice``) imposes others
    instead, as ``met tune`` does to time them. ``device``: the device the costs are for (an
    engine's; default the class's representative one): its evidence counts first.
    """
    from metrale.realize.target import target as target_of

    steps: list[tuple[str, float]] = []
    clock = time.perf_counter()

    def step(name: str) -> None:
        nonlocal clock
        now = time.perf_counter()
        steps.append((name, now - clock))
        clock = now

    if policy not in POLICIES:
        from metrale.lkb.errors import ConfigError

        raise ConfigError("unknown numerics policy", key="--policy",
                          expected=" or ".join(POLICIES), found=repr(policy))
    config = ModelConfig.load(model) if not isinstance(model, ModelConfig) else model
    T = target_of(hardware, kernels_dir=kernels_dir, presentation=presentation, policy=policy)
    P = T.presentation
    kernel_target = KernelTarget(hardware, config.name, quant)
    F = T.realization(kernel_target)
    step("config")
    circuit = circuit_for(config, quant, mode, rows, act=act, logits=logits, sample=sample,
                          cache_slots=cache_slots)
    sizes = dict(circuit.sizes(context))
    sizes["context"] = context
    step("circuit")
    # the alternatives are chosen by cost, on a two-layer cut at the rows' bucket (plan.search)
    from .search import choose

    if choice is None:
        choice = choose(config, quant, mode, rows, T=T, F=F, policy=policy, act=act,
                        context=context, logits=logits, presentation=P, device=device)
    step("search")
    # L_H = lower_H >> rewrite_H; the plan is (L_H >> F_H)(circuit), then annotated
    L_H = fuser(circuit, F, policy, context=context, presentation=P if fuse else _no_relations(P),
                shape=choice.shape, skip=choice.skip if fuse else frozenset())
    R = L_H.steps[-1]
    image = (L_H >> F.functor)(circuit.diagram)
    fused = R.run(R.last_input)  # the record of the rewrite the composite just made
    step("compose")
    kernels, buffers = _realize(circuit, fused.diagram, image, fused.origin, fused.applied, F, P,
                                sizes, T.evidence)
    kernels = _check_launches(kernels, P, sizes, F.hw)
    from .cost import CostModel

    model = CostModel.of(T, sizes, device)
    kernels = tuple(attrs.evolve(k, cost=model.kernel(k.box, P.family(k.family), k.kernel))
                    for k in kernels)
    step("annotate")
    bound = _compose_bound(fused.applied, P, sizes, act)
    hw = F.hw
    plan = Plan(kernel_target, mode, rows, policy, act, context, kernels,
                buffers, fused.applied, fused.declined, circuit.input_names,
                circuit.output_names, hw.device.hbm_bytes_per_s, hw.device.name, fused.diagram,
                tuple(sorted(sizes.items())), bound, logits, hw_target=T,
                choice=choice if fuse else None, cost_device=model.device)
    step("totals")
    return attrs.evolve(plan, steps=tuple(steps))


def _check_launches(kernels: tuple[PlannedKernel, ...], P: Presentation,
                    sizes: Mapping[str, int], hw: Any) -> tuple[PlannedKernel, ...]:
    """Every launch binds at the plan's sizes, inside its kernel's limits and the class's shared
    memory (as the runtime will bind it): a plan that could not run is refused here, with a
    LaunchError naming the kernel, rather than when it is loaded or launched. Returns the
    kernels with the entries they launch there (``launched``)."""
    from metrale.realize.kernel import box_numbers

    out = []
    launched: dict[tuple, tuple[str, ...]] = {}  # (kernel, numbers): every layer binds alike
    for k in kernels:
        if k.view or k.kernel is None or k.kernel.launch is None:
            out.append(k)
            continue
        numbers = box_numbers(k.box, P.family(k.family), sizes)
        key = (id(k.kernel), tuple(sorted(numbers.items())))
        if key not in launched:
            launched[key] = _launched(k, numbers, hw)
        out.append(attrs.evolve(k, launched=launched[key]))
    return tuple(out)


def _launched(k: PlannedKernel, numbers: Mapping[str, int | float], hw: Any) -> tuple[str, ...]:
    """The entries ``k``'s kernel launches at ``numbers``; a LaunchError names ``k`` where a
    launch does not bind, breaks its kernel's limits or needs more shared memory than ``hw``."""
    from metrale.lkb.errors import LaunchError

    where = f"kernel #{k.index} {k.point}"
    try:
        launches = k.kernel.launches_for(numbers)
    except LaunchError as e:
        raise LaunchError(e.message, key=where, expected=e.expected, found=e.found,
                          suggestion="a class whose kernels serve these sizes (--hardware "
                          "cuda: its generic kernels have wider limits)") from None
    over = shared_excess(launches, hw)
    if over:
        entry, shared, cap = over
        raise LaunchError(f"{entry} needs more shared memory than {hw.name} allows",
                          key=where, expected=f"at most {cap} bytes", found=f"{shared} bytes")
    return tuple(entry for entry, _, _ in launches)


def _no_relations(P: Presentation) -> Presentation:
    return Presentation(P.generators, ())


def _layer_of(names: tuple[str, ...]) -> int | None:
    for n in names:
        if n.startswith("model.layers."):
            return int(n.split(".")[2])
        if n.startswith("kv."):
            return int(n.split(".")[1])
    return None


def _nbytes(t: TensorType, elements: int) -> int:
    bits = FORMAT_BITS.get(t.fmt) or t.dtype.element_size_bits
    return int(elements * bits + 7) // 8


def _realize(circuit: Circuit, d: Diagram, image: Diagram, origin: tuple[tuple[int, ...], ...],
             applied: tuple[Applied, ...], F: Any, P: Presentation, sizes: Mapping[str, int],
             records: Any) -> tuple[tuple[PlannedKernel, ...], tuple[Buffer, ...]]:
    """Annotate the composite's image: box ``j`` of ``image`` is F_H of box ``j`` of ``d`` (the
    rewritten diagram), and its kernel is read from it (``F.kernel_of``), not resolved again."""
    from metrale.realize.evidence import evidence_status
    # the lowered boxes each bounded rewrite consumed: a kernel made of them is bounded, even
    # when a bit-identical relation fused it further (qkv[gemv_mma], then its biases)
    bounded = [frozenset(a.boxes) for a in applied if a.numerics == "bounded"]
    relation_of: dict[tuple[int, ...], Applied] = {tuple(sorted(a.boxes)): a for a in applied}
    names: dict[Source, str] = {(-1, k): n for k, n in enumerate(circuit.input_names)}
    for k, src in enumerate(d.outputs):
        if src[0] >= 0:
            names.setdefault(src, circuit.output_names[k])
    kinds: dict[str, str] = {}
    aliases: dict[str, str] = {}
    checkpoint = set(circuit.weight_names)  # biases and sinks too, not only X.weight
    for n in circuit.input_names:
        kinds[n] = ("cache" if n.startswith("kv.") else
                    "weight" if n in checkpoint else "input")
    kernels: list[PlannedKernel] = []
    layer_of: dict[str, int | None] = {}
    cache: dict[Box, tuple[Point, Any, Family]] = {}
    counter = 0
    families = {f.name: f for f in P.generators}
    for j, (box, srcs, kbox) in enumerate(zip(d.boxes, d.wiring, image.boxes)):
        if box not in cache:
            fam = families[box.name]
            cache[box] = (fam.point_of(box), F.kernel_of(kbox), fam)
        point, kernel, fam = cache[box]
        ins = tuple(names[s] for s in srcs)
        outs = []
        inplace = dict(fam.inplace)
        for p, port in enumerate(fam.outputs):
            src = (j, p)
            if port.name in inplace:
                i = [q.name for q in fam.inputs].index(inplace[port.name])
                names[src] = ins[i]
            elif fam.view:
                names.setdefault(src, f"{ins[0]}~{p}" if ins[0] in kinds else f"t{counter}")
                aliases[names[src]] = ins[0]
                kinds[names[src]] = kinds.get(ins[0], "activation")
                counter += 1
            else:
                if src not in names:
                    names[src] = f"t{counter}"
                    counter += 1
                kinds.setdefault(names[src], "activation")
            outs.append(names[src])
        a = relation_of.get(tuple(sorted(origin[j])))
        numerics = "bounded" if any(b <= set(origin[j]) for b in bounded) else "exact"
        layer = _layer_of(ins)
        if layer is None and not any(n.endswith(".weight") for n in ins):
            # no weight of its own: the layer of what it reads
            layer = max((layer_of[n] for n in ins if layer_of.get(n) is not None), default=None)
        for n in outs:
            layer_of.setdefault(n, layer)
        if kernel is None:
            provenance, shadow, residual, evidence = "view (no kernel)", False, False, "n/a"
        else:
            provenance = kernel.provenance
            shadow, residual = bool(kernel.shadow), bool(kernel.residual)
            evidence = ("reference semantics" if kernel.source is None else
                        evidence_status(records, F.hw.name, fam.name, str(point),
                                        kernel.source_hash))
        moved = 0 if fam.view else _traffic(fam, box, sizes, kernel)
        kernels.append(PlannedKernel(
            j, fam.name, point, box, layer, ins, tuple(outs), kernel, provenance, shadow,
            residual, evidence, a.relation if a else None, numerics,
            bool(fam.row_invariant and (kernel is None or kernel.row_invariant)), moved,
            fam.view))
    buffers = _buffers(d, kernels, names, kinds, aliases, circuit, sizes)
    return tuple(kernels), buffers


def _traffic(fam: Family, box: Box, sizes: Mapping[str, int], kernel: Any = None) -> int:
    """Bytes one launch moves: every port's elements (or its declared traffic, the kernel's
    before the family's: ``plan.cost.declared_traffic``) at its dtype."""
    from metrale.realize.kernel import box_numbers

    from .cost import declared_traffic

    total = 0
    # the family's dims take the circuit's sizes through the box's types
    env = box_numbers(box, fam, dict(sizes))
    for port, t in zip((*fam.inputs, *fam.outputs), (*box.dom.types, *box.cod.types)):
        elements = declared_traffic(fam, kernel, port.name, env)
        total += _nbytes(t, t.numel(sizes) if elements is None else int(elements))
    return total


def _buffers(d: Diagram, kernels: list[PlannedKernel], names: Mapping[Source, str],
             kinds: Mapping[str, str], aliases: Mapping[str, str], circuit: Circuit,
             sizes: Mapping[str, int]) -> tuple[Buffer, ...]:
    first: dict[str, int] = {}
    last: dict[str, int] = {}
    types: dict[str, TensorType] = {}
    for k, n in enumerate(circuit.input_names):
        first[n] = -1
        types[n] = d.dom.types[k]
    for pk in kernels:
        for n, t in zip(pk.inputs, pk.box.dom.types):
            last[n] = max(last.get(n, -1), pk.index)
            types.setdefault(n, t)
        for n, t in zip(pk.outputs, pk.box.cod.types):
            first.setdefault(n, pk.index)
            types.setdefault(n, t)
    end = len(kernels)
    for src in d.outputs:
        last[names[src]] = end
    out = []
    for n, t in types.items():
        bound = t.bind(sizes)
        root = n
        while root in aliases:
            root = aliases[root]
            last[root] = max(last.get(root, -1), last.get(n, -1))
        out.append(Buffer(n, bound, _nbytes(t, t.numel(sizes)), kinds.get(n, "activation"),
                          first.get(n, -1), last.get(n, first.get(n, -1)), aliases.get(n)))
    return tuple(attrs.evolve(b, last=max(b.last, last.get(b.name, b.last))) for b in out)


def _compose_bound(applied: tuple[Applied, ...], P: Presentation, sizes: Mapping[str, int],
                   act: str) -> tuple[float, float] | None:
    """The largest bound among the bounded relations applied, or ``None`` when all are exact.

    Per kernel, not composed: each fused kernel's outputs are within ``rel * |unfused| + abs *
    magnitude`` of the unfused kernels' on the same inputs (the magnitude as the relation
    states it: for a reordered sum, the sum of its terms' magnitudes), wherever the magnitude
    is finite; how those per-kernel differences grow through the model is not a formula of
    this plan, so the plan reports the per-kernel worst case of each coefficient. A relation declared bit-identical
    that holds here only up to a bound (its two sides' realizations declare different orders)
    states no bound: then the plan's is infinite, printed as not stated.
    """
    from metrale.lkb.relation import UNIT_ROUNDOFF

    rel_total = abs_total = 0.0
    any_bounded = False
    for a in applied:
        if a.numerics != "bounded":
            continue
        any_bounded = True
        rel = P.relation(a.relation)
        env = {f"eps_{k}": v for k, v in UNIT_ROUNDOFF.items()}
        env["eps_act"] = UNIT_ROUNDOFF[act]
        env.update({k: float(v) for k, v in sizes.items()})
        for port, t in zip(P.family(a.fused.name).inputs, a.fused.dom.types):
            for fd, cd in zip(port.dims, t.shape):
                if isinstance(fd, str):
                    env[fd] = float(cd if isinstance(cd, int) else sizes.get(cd, 0))
        if rel.bound is None:
            return (math.inf, math.inf)
        else:
            rel_total = max(rel_total, eval_bound(rel.bound.rel, env, rel.file))
            abs_total = max(abs_total, eval_bound(rel.bound.abs, env, rel.file))
    return (rel_total, abs_total) if any_bounded else None
